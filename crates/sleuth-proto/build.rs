//! Generates Rust code and the reflection descriptor set from `proto/`.
//!
//! protoc comes from the `protoc-bin-vendored` crate so that a fresh machine
//! needs no system protobuf compiler.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read at run time: a build-script binary reused from another checkout
    // (the build cache is shared) must still compile this checkout's protos.
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let protos: Vec<PathBuf> = [
        "sleuth/common/v1/common.proto",
        "sleuth/tools/v1/tool_gateway.proto",
        "sleuth/policy/v1/policy_server.proto",
        "sleuth/inference/v1/inference_gateway.proto",
        "sleuth/agent/v1/agent.proto",
        "sleuth/rollout/v1/orchestrator.proto",
        "sleuth/learner/v1/learner.proto",
    ]
    .iter()
    .map(|p| root.join(p))
    .collect();
    let includes = [root.clone(), protoc_bin_vendored::include_path()?];
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);

    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out_dir.join("sleuth_descriptor.bin"))
        .include_file("sleuth.rs")
        // Services serve `Unimplemented` for RPCs they do not override yet.
        .generate_default_stubs(true)
        .compile_with_config(config, &protos, &includes)?;
    println!("cargo:rerun-if-changed={}", root.display());
    Ok(())
}
