//! Generated code for the Sleuth gRPC contracts (`proto/sleuth/<area>/v1`).
//!
//! Modules mirror the proto packages: `sleuth_proto::tools::v1` is
//! `sleuth.tools.v1`. Every service and client uses these types; no crate
//! defines its own copy of a wire type.

include!(concat!(env!("OUT_DIR"), "/sleuth.rs"));

pub use sleuth::{agent, common, inference, learner, policy, rollout, tools};

/// Encoded `FileDescriptorSet` of every Sleuth proto (imports included), served
/// by gRPC reflection so `grpcurl` can list and call the APIs.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/sleuth_descriptor.bin"));
