//! [`ProcessGroup`]: c10d's TCPStore and a Gloo or NCCL process group.

use std::ffi::CString;
use std::os::raw::c_int;
use std::time::{Duration, Instant};

use tch::{Device, Tensor};
use torch_sys::C_tensor;

use crate::ffi::{self, taken};
use crate::{Collective, CollectiveError, Reduce, Rendezvous, resolve_master};

/// Which c10d process group carries the tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// CPU tensors.
    Gloo,
    /// CUDA tensors.
    Nccl,
}

impl Backend {
    /// Gloo for CPU tensors, NCCL for CUDA tensors.
    pub fn for_device(device: Device) -> Self {
        if device.is_cuda() { Self::Nccl } else { Self::Gloo }
    }

    /// Why this build cannot start the backend (NCCL needs libtorch_cuda and
    /// CUDA's headers when it is built), if it cannot.
    pub fn missing(self) -> Option<&'static str> {
        match (self, env!("SLEUTH_C10D_NCCL_MISSING")) {
            (Self::Nccl, why) if !why.is_empty() => Some(why),
            _ => None,
        }
    }
}

/// Where a rank's Gloo connections listen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bind {
    /// Where this host's name resolves (c10d's default; a pod's IP).
    Default,
    /// An address or name of this host.
    Host(String),
    /// A network interface (Gloo's `GLOO_SOCKET_IFNAME`).
    Interface(String),
}

/// One rank of a c10d process group: tensors through Gloo or NCCL, small
/// messages through rank 0's TCPStore (see the crate docs).
pub struct ProcessGroup {
    group: *mut ffi::Group,
    rank: usize,
    world: usize,
    backend: Backend,
    peer_timeout: Duration,
    /// Messages sent so far: every rank numbers the store's keys alike.
    messages: u64,
    /// Failed collectives so far: the roll call after each is numbered alike.
    failures: u64,
}

// SAFETY: c10d's store and process groups may be used from any thread; the
// group is used by one thread at a time (`&mut self`).
unsafe impl Send for ProcessGroup {}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // SAFETY: made by sleuth_c10d_store, freed once.
        unsafe { ffi::sleuth_c10d_free_group(self.group) }
    }
}

/// A wait in the store that did not end in every key.
enum Unanswered {
    /// These ranks' keys were missing at the deadline.
    Ranks(Vec<usize>),
    /// The store (rank 0) is gone.
    Store(String),
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn key(text: &str) -> CString {
    CString::new(text).expect("store keys are made here, without NUL")
}

fn tensor_ptr(tensor: &Tensor) -> *mut C_tensor {
    // The shim takes `at::Tensor&` and writes into the storage, never the handle.
    tensor.as_ptr() as *mut C_tensor
}

impl ProcessGroup {
    /// Joins the group for tensors on `device`: rank 0 hosts the store at
    /// MASTER_ADDR:MASTER_PORT; every rank signs in there, and the ranks
    /// missing at the rendezvous timeout are named; then c10d starts the
    /// process group (its own connections, through the store).
    pub fn connect(rendezvous: &Rendezvous, device: Device) -> Result<Self, CollectiveError> {
        let Rendezvous { ref master_addr, master_port, world_size: world, rank, timeout, peer_timeout, ref bind } =
            *rendezvous;
        let failed = CollectiveError::Rendezvous;
        let backend = Backend::for_device(device);
        if let Some(why) = backend.missing() {
            return Err(failed(format!("rank {rank}: no {backend:?} backend: {why}")));
        }
        let deadline = Instant::now() + timeout;
        let address = resolve_master(master_addr, master_port, rank, deadline)?;
        let host = key(&address.ip().to_string());
        let mut group = std::ptr::null_mut();
        // SAFETY: host is NUL-terminated; on success `group` is set.
        let made = unsafe {
            ffi::sleuth_c10d_store(
                host.as_ptr(),
                master_port,
                rank as c_int,
                world as c_int,
                millis(timeout),
                &mut group,
            )
        };
        if let Some(why) = taken(made) {
            return Err(failed(format!(
                "rank {rank}: rank 0's store at MASTER_ADDR {master_addr}:{master_port} ({address}): {why}"
            )));
        }
        let mut this = Self { group, rank, world, backend, peer_timeout, messages: 0, failures: 0 };
        this.set(&format!("sleuth/joined/{rank}"), &[]).map_err(|why| failed(format!("rank {rank}: {why}")))?;
        match this.wait_for(&this.rank_keys("sleuth/joined"), Some(deadline)) {
            Ok(()) => {}
            Err(Unanswered::Ranks(missing)) => {
                return Err(failed(format!("rank {rank}: ranks {missing:?} did not join within {timeout:?}")));
            }
            Err(Unanswered::Store(why)) => return Err(failed(format!("rank {rank}: rank 0's store: {why}"))),
        }
        let (interface, bind_host) = match bind {
            Bind::Default => (String::new(), String::new()),
            Bind::Host(host) => (String::new(), host.clone()),
            Bind::Interface(interface) => (interface.clone(), String::new()),
        };
        let (interface, bind_host) = (key(&interface), key(&bind_host));
        // SAFETY: the group was made above; strings are NUL-terminated.
        let started = unsafe {
            ffi::sleuth_c10d_start(
                this.group,
                rank as c_int,
                world as c_int,
                millis(peer_timeout),
                c_int::from(backend == Backend::Nccl),
                interface.as_ptr(),
                bind_host.as_ptr(),
            )
        };
        if let Some(why) = taken(started) {
            return Err(failed(format!("rank {rank}: starting the {backend:?} process group: {why}")));
        }
        tracing::info!(rank, world, ?backend, %address, "joined the process group");
        Ok(this)
    }

    /// The backend carrying this group's tensors.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    fn rank_keys(&self, prefix: &str) -> Vec<(usize, String)> {
        (0..self.world).map(|r| (r, format!("{prefix}/{r}"))).collect()
    }

    fn set(&mut self, name: &str, value: &[u8]) -> Result<(), String> {
        let k = key(name);
        // SAFETY: the pointer and length describe `value`.
        taken(unsafe { ffi::sleuth_c10d_store_set(self.group, k.as_ptr(), value.as_ptr(), value.len()) })
            .map_or(Ok(()), Err)
    }

    fn get(&mut self, name: &str) -> Result<Vec<u8>, String> {
        let k = key(name);
        let (mut data, mut len) = (std::ptr::null_mut(), 0usize);
        // SAFETY: on success `data` holds `len` bytes from malloc, freed below.
        if let Some(why) = taken(unsafe { ffi::sleuth_c10d_store_get(self.group, k.as_ptr(), &mut data, &mut len) }) {
            return Err(why);
        }
        let value = unsafe { std::slice::from_raw_parts(data, len) }.to_vec();
        unsafe { ffi::sleuth_c10d_free_bytes(data) };
        Ok(value)
    }

    fn present(&mut self, name: &str) -> Result<bool, String> {
        let k = key(name);
        let mut present = 0;
        // SAFETY: `present` outlives the call.
        taken(unsafe { ffi::sleuth_c10d_store_check(self.group, k.as_ptr(), &mut present) })
            .map_or(Ok(present != 0), Err)
    }

    fn add(&mut self, name: &str, delta: i64) -> Result<i64, String> {
        let k = key(name);
        let mut value = 0;
        // SAFETY: `value` outlives the call.
        taken(unsafe { ffi::sleuth_c10d_store_add(self.group, k.as_ptr(), delta, &mut value) }).map_or(Ok(value), Err)
    }

    fn delete(&mut self, names: &[String]) {
        for name in names {
            let k = key(name);
            // Best effort: a key left behind costs the store a few bytes.
            if let Some(why) = taken(unsafe { ffi::sleuth_c10d_store_delete(self.group, k.as_ptr()) }) {
                tracing::debug!(key = name, %why, "a store key was not deleted");
            }
        }
    }

    /// Polls the store until every key is present, or `deadline`.
    fn wait_for(&mut self, keys: &[(usize, String)], deadline: Option<Instant>) -> Result<(), Unanswered> {
        let mut pending: Vec<&(usize, String)> = keys.iter().collect();
        let mut pause = Duration::from_millis(1);
        loop {
            let mut still = Vec::new();
            for entry in pending {
                if !self.present(&entry.1).map_err(Unanswered::Store)? {
                    still.push(entry);
                }
            }
            if still.is_empty() {
                return Ok(());
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(Unanswered::Ranks(still.iter().map(|(r, _)| *r).collect()));
            }
            pending = still;
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    /// The error for a failed `op`, after a roll call in the store names the
    /// ranks that are gone (every surviving rank of a failed collective
    /// takes part; a rank that does not answer within the grace is gone).
    ///
    /// The rank first aborts its process group: a peer blocked on it (a ring
    /// step waiting for what this rank will never send) fails at once and
    /// answers the roll call, instead of at the peer timeout, after the
    /// grace, when it would be named gone though alive. The group takes no
    /// collective after that.
    fn failed(&mut self, op: &'static str, message: String) -> CollectiveError {
        // SAFETY: the group is live until drop.
        if let Some(why) = taken(unsafe { ffi::sleuth_c10d_abort(self.group) }) {
            tracing::warn!(%why, "the process group did not abort cleanly");
        }
        self.failures += 1;
        let roll = format!("sleuth/roll/{}", self.failures);
        let grace = self.peer_timeout.min(Duration::from_secs(10));
        let gone = match self.set(&format!("{roll}/{}", self.rank), &[]) {
            Err(_) => return CollectiveError::Failed { op, rank: self.rank, gone: vec![0], message },
            Ok(()) => match self.wait_for(&self.rank_keys(&roll), Some(Instant::now() + grace)) {
                Ok(()) => Vec::new(),
                Err(Unanswered::Ranks(missing)) => missing,
                Err(Unanswered::Store(_)) => {
                    return CollectiveError::Failed { op, rank: self.rank, gone: vec![0], message };
                }
            },
        };
        // The store lives in rank 0's process, which may end right after this
        // error: rank 0 waits until every rank that answered has finished its
        // own roll call, or a slower one would find the store gone and name
        // rank 0 instead of the rank that is.
        let done = format!("{roll}/done");
        if self.set(&format!("{done}/{}", self.rank), &[]).is_ok() && self.rank == 0 {
            let answered: Vec<(usize, String)> =
                self.rank_keys(&done).into_iter().filter(|(r, _)| !gone.contains(r)).collect();
            // Best effort: a rank that never finishes is not waited for past the grace twice over.
            let _ = self.wait_for(&answered, Some(Instant::now() + 2 * grace));
        }
        CollectiveError::Failed { op, rank: self.rank, gone, message }
    }

    fn store_failed(&self, op: &'static str, why: String) -> CollectiveError {
        CollectiveError::Failed { op, rank: self.rank, gone: vec![0], message: format!("rank 0's store: {why}") }
    }

    fn check(&self, op: &'static str, tensors: &[&Tensor]) -> Result<(), CollectiveError> {
        for tensor in tensors {
            let usage = |message: String| CollectiveError::Usage { op, message };
            if !tensor.is_contiguous() {
                return Err(usage("tensors must be contiguous".into()));
            }
            if Backend::for_device(tensor.device()) != self.backend {
                return Err(usage(format!("a {:?} tensor cannot go through {:?}", tensor.device(), self.backend)));
            }
        }
        Ok(())
    }

    /// Runs a tensor collective; a failure takes the roll call.
    fn collective(
        &mut self,
        op: &'static str,
        tensors: &[&Tensor],
        call: impl FnOnce(*mut ffi::Group) -> *mut std::os::raw::c_char,
    ) -> Result<(), CollectiveError> {
        self.check(op, tensors)?;
        if self.failures > 0 {
            let message = "the process group was aborted when an earlier collective failed; join a new one".into();
            return Err(CollectiveError::Usage { op, message });
        }
        match taken(call(self.group)) {
            None => Ok(()),
            Some(message) => Err(self.failed(op, message)),
        }
    }
}

impl Collective for ProcessGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather_bytes(&mut self, payload: Vec<u8>) -> Result<Vec<Vec<u8>>, CollectiveError> {
        const OP: &str = "all_gather_bytes";
        self.messages += 1;
        let prefix = format!("sleuth/message/{}", self.messages);
        self.set(&format!("{prefix}/{}", self.rank), &payload).map_err(|why| self.store_failed(OP, why))?;
        let keys = self.rank_keys(&prefix);
        match self.wait_for(&keys, Some(Instant::now() + self.peer_timeout)) {
            Ok(()) => {}
            Err(Unanswered::Ranks(gone)) => {
                let message = format!("no message within {:?}", self.peer_timeout);
                return Err(CollectiveError::Failed { op: OP, rank: self.rank, gone, message });
            }
            Err(Unanswered::Store(why)) => return Err(self.store_failed(OP, why)),
        }
        let mut all = Vec::with_capacity(self.world);
        for (_, k) in &keys {
            all.push(self.get(k).map_err(|why| self.store_failed(OP, why))?);
        }
        // The last rank to read deletes the round's keys.
        let read = format!("{prefix}/read");
        if self.add(&read, 1).map_err(|why| self.store_failed(OP, why))? == self.world as i64 {
            let mut names: Vec<String> = keys.into_iter().map(|(_, k)| k).collect();
            names.push(read);
            self.delete(&names);
        }
        Ok(all)
    }

    fn broadcast_bytes(&mut self, payload: Vec<u8>) -> Result<Vec<u8>, CollectiveError> {
        const OP: &str = "broadcast_bytes";
        self.messages += 1;
        let name = format!("sleuth/message/{}", self.messages);
        if self.rank == 0 {
            self.set(&name, &payload).map_err(|why| self.store_failed(OP, why))?;
            return Ok(payload);
        }
        match self.wait_for(&[(0, name.clone())], None) {
            Ok(()) => {}
            Err(Unanswered::Store(why)) => return Err(self.store_failed(OP, why)),
            Err(Unanswered::Ranks(_)) => unreachable!("a wait without a deadline ends only in the key or an error"),
        }
        let value = self.get(&name).map_err(|why| self.store_failed(OP, why))?;
        // The last of the other ranks to read deletes the message.
        let read = format!("{name}/read");
        if self.add(&read, 1).map_err(|why| self.store_failed(OP, why))? == self.world as i64 - 1 {
            self.delete(&[name, read]);
        }
        Ok(value)
    }

    fn all_gather(&mut self, output: &Tensor, input: &Tensor) -> Result<(), CollectiveError> {
        if output.numel() != input.numel() * self.world {
            return Err(CollectiveError::Usage {
                op: "all_gather",
                message: format!("output has {} elements, not {} x {}", output.numel(), self.world, input.numel()),
            });
        }
        let (o, i) = (tensor_ptr(output), tensor_ptr(input));
        // SAFETY: both tensors outlive the call.
        self.collective("all_gather", &[output, input], |g| unsafe { ffi::sleuth_c10d_all_gather(g, o, i) })
    }

    fn reduce_scatter_sum(&mut self, output: &Tensor, input: &Tensor) -> Result<(), CollectiveError> {
        if input.numel() != output.numel() * self.world {
            return Err(CollectiveError::Usage {
                op: "reduce_scatter",
                message: format!("input has {} elements, not {} x {}", input.numel(), self.world, output.numel()),
            });
        }
        let (o, i) = (tensor_ptr(output), tensor_ptr(input));
        // SAFETY: both tensors outlive the call.
        self.collective("reduce_scatter", &[output, input], |g| unsafe { ffi::sleuth_c10d_reduce_scatter(g, o, i) })
    }

    fn all_reduce(&mut self, tensor: &Tensor, op: Reduce) -> Result<(), CollectiveError> {
        let (t, op) = (tensor_ptr(tensor), c_int::from(op == Reduce::Max));
        // SAFETY: the tensor outlives the call.
        self.collective("all_reduce", &[tensor], |g| unsafe { ffi::sleuth_c10d_all_reduce(g, t, op) })
    }

    fn broadcast(&mut self, tensor: &Tensor, root: usize) -> Result<(), CollectiveError> {
        let t = tensor_ptr(tensor);
        // SAFETY: the tensor outlives the call.
        self.collective("broadcast", &[tensor], |g| unsafe { ffi::sleuth_c10d_broadcast(g, t, root as c_int) })
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        // SAFETY: the group outlives the call.
        self.collective("barrier", &[], |g| unsafe { ffi::sleuth_c10d_barrier(g) })
    }
}
