//! The shim's C functions (src/shim.cpp). Each returns null on success or a
//! message to free with [`sleuth_c10d_free_error`].

use std::os::raw::{c_char, c_int};

use torch_sys::C_tensor;

/// The shim's store and process group.
#[repr(C)]
pub struct Group {
    _private: [u8; 0],
}

unsafe extern "C" {
    pub fn sleuth_c10d_free_error(message: *mut c_char);
    pub fn sleuth_c10d_free_bytes(bytes: *mut u8);
    pub fn sleuth_c10d_store(
        host: *const c_char,
        port: u16,
        rank: c_int,
        world: c_int,
        timeout_ms: i64,
        out: *mut *mut Group,
    ) -> *mut c_char;
    pub fn sleuth_c10d_start(
        group: *mut Group,
        rank: c_int,
        world: c_int,
        timeout_ms: i64,
        nccl: c_int,
        interface: *const c_char,
        bind_host: *const c_char,
    ) -> *mut c_char;
    pub fn sleuth_c10d_free_group(group: *mut Group);
    pub fn sleuth_c10d_abort(group: *mut Group) -> *mut c_char;
    pub fn sleuth_c10d_all_gather(group: *mut Group, output: *mut C_tensor, input: *mut C_tensor) -> *mut c_char;
    pub fn sleuth_c10d_reduce_scatter(group: *mut Group, output: *mut C_tensor, input: *mut C_tensor) -> *mut c_char;
    pub fn sleuth_c10d_all_reduce(group: *mut Group, tensor: *mut C_tensor, op: c_int) -> *mut c_char;
    pub fn sleuth_c10d_broadcast(group: *mut Group, tensor: *mut C_tensor, root: c_int) -> *mut c_char;
    pub fn sleuth_c10d_barrier(group: *mut Group) -> *mut c_char;
    pub fn sleuth_c10d_store_set(group: *mut Group, key: *const c_char, data: *const u8, len: usize) -> *mut c_char;
    pub fn sleuth_c10d_store_check(group: *mut Group, key: *const c_char, present: *mut c_int) -> *mut c_char;
    pub fn sleuth_c10d_store_get(
        group: *mut Group,
        key: *const c_char,
        data: *mut *mut u8,
        len: *mut usize,
    ) -> *mut c_char;
    pub fn sleuth_c10d_store_add(group: *mut Group, key: *const c_char, delta: i64, value: *mut i64) -> *mut c_char;
    pub fn sleuth_c10d_store_delete(group: *mut Group, key: *const c_char) -> *mut c_char;
}

/// The shim's message, taken (and freed); `None` on success.
pub fn taken(message: *mut c_char) -> Option<String> {
    if message.is_null() {
        return None;
    }
    // SAFETY: a non-null return is a NUL-terminated string from strdup, freed once here.
    let text = unsafe { std::ffi::CStr::from_ptr(message) }.to_string_lossy().into_owned();
    unsafe { sleuth_c10d_free_error(message) };
    Some(text)
}
