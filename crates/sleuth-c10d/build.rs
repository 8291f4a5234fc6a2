//! Compiles the C++ shim against the libtorch that torch-sys links (the
//! venv's torch wheel), the way torch-sys builds its own wrapper.
//!
//! - c10d's Gloo header includes gloo's own headers, which the wheel does
//!   not ship: they come from Debian's `libgloo-dev` (or `GLOO_INCLUDE_DIR`).
//!   The shim holds gloo objects only behind c10d's smart pointers and calls
//!   only libtorch's own functions, so the wheel's bundled gloo does the work.
//! - ProcessGroupNCCL is compiled in when torch is a CUDA build and the
//!   venv's nvidia packages hold CUDA's and NCCL's headers; otherwise the
//!   NCCL backend reports at run time why it is missing.

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=src/shim.cpp");
    println!("cargo:rerun-if-changed=src/nccl.cpp");
    println!("cargo:rerun-if-env-changed=GLOO_INCLUDE_DIR");
    let lib = PathBuf::from(
        std::env::var("DEP_TCH_LIBTORCH_LIB").expect("torch-sys reports where libtorch is (DEP_TCH_LIBTORCH_LIB)"),
    );
    let torch = lib.parent().expect("libtorch's lib/ has a parent").to_owned();
    let includes = [torch.join("include"), torch.join("include/torch/csrc/api/include")];
    let gloo = std::env::var_os("GLOO_INCLUDE_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/usr/include"));
    if !gloo.join("gloo/context.h").exists() {
        panic!(
            "c10d's Gloo header needs gloo's headers, not found under {}: apt-get install libgloo-dev \
             (deploy/local/setup.sh does), or set GLOO_INCLUDE_DIR",
            gloo.display()
        );
    }
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .warnings(false)
        .flag("-std=c++17")
        .define("USE_C10D_GLOO", None)
        .includes(&includes)
        .include(&gloo)
        .file("src/shim.cpp");
    match nccl_headers(&lib) {
        Ok(cuda_includes) => {
            build.define("SLEUTH_C10D_NCCL", None).define("USE_C10D_NCCL", None).define("USE_CUDA", None);
            build.includes(&cuda_includes).file("src/nccl.cpp");
            println!("cargo:rustc-env=SLEUTH_C10D_NCCL_MISSING=");
        }
        Err(why) => println!("cargo:rustc-env=SLEUTH_C10D_NCCL_MISSING={why}"),
    }
    build.compile("sleuth_c10d");
}

/// CUDA's and NCCL's include folders from the venv's nvidia packages, or why
/// the NCCL backend is left out.
fn nccl_headers(lib: &Path) -> Result<Vec<PathBuf>, String> {
    if !lib.join("libtorch_cuda.so").exists() {
        return Err(format!("{} is a CPU-only libtorch", lib.display()));
    }
    let site = lib.ancestors().nth(2).ok_or("no site-packages above libtorch")?;
    let cuda = site.join("nvidia/cu13/include");
    let nccl = site.join("nvidia/nccl/include");
    // The headers' folder changes when the header packages are installed.
    println!("cargo:rerun-if-changed={}", if cuda.exists() { &cuda } else { site }.display());
    for needed in
        [cuda.join("cuda_runtime_api.h"), cuda.join("crt/host_config.h"), cuda.join("nv/target"), nccl.join("nccl.h")]
    {
        if !needed.exists() {
            return Err(format!(
                "{} is missing (the nvidia-cuda-runtime, -crt, -cccl and nvidia-nccl packages of deploy/local/requirements.txt)",
                needed.display()
            ));
        }
    }
    Ok(vec![cuda, nccl])
}
