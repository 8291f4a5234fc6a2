//! torch.distributed's engine for Rust: c10d's `TCPStore` rendezvous and its
//! process groups, Gloo for CPU tensors and NCCL for CUDA tensors, on
//! [`tch::Tensor`]s, through a small C++ shim compiled against the libtorch
//! tch links (build.rs).
//!
//! - [`Rendezvous`]: torchrun's environment (`MASTER_ADDR`, `MASTER_PORT`,
//!   `WORLD_SIZE`, `RANK`), rank 0's name looked up until it resolves.
//! - [`ProcessGroup`]: the ranks' tensors travel through the process group;
//!   small messages (commands, digests) through the store, so a rank can wait
//!   for rank 0's next command without a collective timing out, and bytes
//!   never need a device.
//! - [`Collective`]: what sharded training asks of either, with [`Single`]
//!   for one rank (every collective the identity, nothing bound).
//!
//! c10d's store has no authentication: only learner pods may reach its port
//! and the Gloo/NCCL ports (the chart's NetworkPolicy; docs/security.md).

mod ffi;
mod group;
mod rendezvous;

pub use group::{Backend, Bind, ProcessGroup};
pub use rendezvous::{Rendezvous, resolve_master};

use tch::Tensor;

/// Why a collective or the rendezvous failed; a failed collective ends the
/// step on every rank.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    /// A collective failed; `gone` names the ranks that did not answer the
    /// roll call taken after the failure (rank 0 when its store is gone).
    #[error("{op} failed on rank {rank}{}: {message}", gone_ranks(.gone))]
    Failed { op: &'static str, rank: usize, gone: Vec<usize>, message: String },
    /// The caller asked what the group cannot do: tensors the collective
    /// cannot take, or a collective after an earlier one failed.
    #[error("{op}: {message}")]
    Usage { op: &'static str, message: String },
}

fn gone_ranks(gone: &[usize]) -> String {
    match gone {
        [] => String::new(),
        [one] => format!(" (rank {one} is gone)"),
        many => format!(" (ranks {many:?} are gone)"),
    }
}

/// How [`Collective::all_reduce`] combines the ranks' elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    Max,
}

/// The operations sharded training needs. Tensors must be contiguous and on
/// the group's device (CPU for Gloo, CUDA for NCCL).
pub trait Collective: Send {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Every rank's `payload`, in rank order, on every rank.
    fn all_gather_bytes(&mut self, payload: Vec<u8>) -> Result<Vec<Vec<u8>>, CollectiveError>;
    /// Rank 0's `payload` on every rank (the others pass anything, e.g.
    /// empty). The others wait for it without a time limit (rank 0's next
    /// command comes when the run has groups); a gone rank 0 ends the wait.
    fn broadcast_bytes(&mut self, payload: Vec<u8>) -> Result<Vec<u8>, CollectiveError>;
    /// `output` (world x `input`'s elements) receives every rank's `input`, in rank order.
    fn all_gather(&mut self, output: &Tensor, input: &Tensor) -> Result<(), CollectiveError>;
    /// `output` receives this rank's chunk of the element-wise sum over ranks
    /// of `input` (world x `output`'s elements); `input` is only read. Each
    /// rank sends (world - 1) / world of `input` once: NCCL's own, and for
    /// Gloo (whose own is an all-reduce, half as many bytes again) a ring of
    /// sends and receives.
    fn reduce_scatter_sum(&mut self, output: &Tensor, input: &Tensor) -> Result<(), CollectiveError>;
    /// `tensor` becomes the element-wise `op` over ranks.
    fn all_reduce(&mut self, tensor: &Tensor, op: Reduce) -> Result<(), CollectiveError>;
    /// `tensor` becomes rank `root`'s.
    fn broadcast(&mut self, tensor: &Tensor, root: usize) -> Result<(), CollectiveError>;
    /// Waits until every rank has arrived.
    fn barrier(&mut self) -> Result<(), CollectiveError>;
}

/// A single rank: every collective is the identity.
pub struct Single;

impl Collective for Single {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_gather_bytes(&mut self, payload: Vec<u8>) -> Result<Vec<Vec<u8>>, CollectiveError> {
        Ok(vec![payload])
    }
    fn broadcast_bytes(&mut self, payload: Vec<u8>) -> Result<Vec<u8>, CollectiveError> {
        Ok(payload)
    }
    fn all_gather(&mut self, output: &Tensor, input: &Tensor) -> Result<(), CollectiveError> {
        copy("all_gather", output, input)
    }
    fn reduce_scatter_sum(&mut self, output: &Tensor, input: &Tensor) -> Result<(), CollectiveError> {
        copy("reduce_scatter", output, input)
    }
    fn all_reduce(&mut self, _tensor: &Tensor, _op: Reduce) -> Result<(), CollectiveError> {
        Ok(())
    }
    fn broadcast(&mut self, _tensor: &Tensor, _root: usize) -> Result<(), CollectiveError> {
        Ok(())
    }
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        Ok(())
    }
}

fn copy(op: &'static str, output: &Tensor, input: &Tensor) -> Result<(), CollectiveError> {
    if output.numel() != input.numel() {
        return Err(CollectiveError::Usage {
            op,
            message: format!("one rank: output has {} elements, input {}", output.numel(), input.numel()),
        });
    }
    tch::no_grad(|| output.shallow_clone().copy_(input));
    Ok(())
}
