//! Expert parallelism: one layer's experts spread over ranks (one GPU each), tokens exchanged
//! through NCCL.
//!
//! A step on rank r, with the same token count `m` on every rank:
//!
//! ```text
//! dispatch_send   plan (routing -> each token's destinations, tokens in order), pack each
//!                 token once per peer that owns one of its experts, one NCCL group: to every
//!                 peer its slab (activations, local expert ids, routing weights), from every
//!                 peer ours
//! run_local_experts  this rank's experts on its own tokens (read in place: nothing to send),
//!                 with the layer's shared experts, which every rank holds
//! dispatch_recv   wait for the slabs, run this rank's experts on what arrived
//! combine_send    one NCCL group: each slab's outputs back to the rank they came from
//! combine_recv    per token, the partial outputs summed in rank order in fp32
//! ```
//!
//! No call waits on the host; NCCL runs on a stream of its own, joined by events, so a caller
//! may put other work (attention, say) between the halves, and the whole step
//! captures into a CUDA graph. Transfers are sized from the step's `m` (each peer's slab holds
//! `min(m, capacity)` rows), which is why every rank must pass the same `m`: an engine pads its
//! ranks' batches to a common size, marking padding tokens with ids of -1 (they go nowhere and
//! get zeros, or the shared experts' output where the layer has them, as on one GPU).

mod comm;
mod layer;
mod map;

pub use comm::{Comm, UniqueId};
pub use layer::{EpConfig, EpLayer, COPY_ENGINE_MIN_BYTES, SHARED_APART_TOKENS};
pub use map::ExpertMap;

use crate::error::RuntimeError;

use std::time::Duration;

/// Why an expert-parallel layer could not be built or run a step.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EpError {
    /// The single-GPU runtime's error (shapes, dtypes, kernels, the driver).
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// `libnccl.so.2` could not be loaded.
    #[error("NCCL (libnccl.so.2) was not found on the library path: expert parallelism loads it at run time")]
    NcclMissing,
    /// An NCCL call failed.
    #[error("NCCL: {call} failed with {code}")]
    Nccl {
        /// The call.
        call: &'static str,
        /// NCCL's result code.
        code: String,
    },
    /// An NCCL call or a step did not complete in time; the communicator was aborted.
    #[error(
        "{what} did not complete within {timeout:?}: a rank that never joined or never called, or ranks whose \
         steps differ; the communicator was aborted"
    )]
    Timeout {
        /// What was waited on.
        what: &'static str,
        /// The communicator's deadline.
        timeout: Duration,
    },
    /// The communicator was aborted by an earlier failure; build a new one.
    #[error("the NCCL communicator was aborted by an earlier failure")]
    Aborted,
    /// An expert map that is not one owner per expert.
    #[error("expert map: {0}")]
    ExpertMap(String),
    /// A configuration the layer cannot run (rank counts, bounds, spec features).
    #[error("expert parallelism: {0}")]
    Config(String),
    /// Another rank built its layer from a different spec, expert map or bounds.
    #[error("rank {other} built its layer from a different spec, expert map or token bounds than rank {me}")]
    Mismatch {
        /// This rank.
        me: usize,
        /// The first rank that differs.
        other: usize,
    },
    /// A step larger than the bound the layer's buffers were sized for.
    #[error("a step of {m} tokens exceeds the {max} tokens per rank the layer was built for")]
    TooManyTokens {
        /// The step's tokens.
        m: usize,
        /// `EpConfig::max_tokens`.
        max: usize,
    },
    /// Tokens that did not fit a peer's slab, or ids outside the experts, since the last check.
    #[error(
        "{dropped} token transfer(s) exceeded a peer slab of {capacity} rows and were dropped; {invalid} expert \
         id(s) outside [0, E) (other than -1) were skipped"
    )]
    Routing {
        /// Token transfers dropped for want of room.
        dropped: i32,
        /// Ids skipped.
        invalid: i32,
        /// Rows per peer slab (`EpConfig::capacity`).
        capacity: usize,
    },
    /// The halves of a step called out of order.
    #[error("`{call}` called out of order: {expected}")]
    OutOfOrder {
        /// The call.
        call: &'static str,
        /// What had to come first.
        expected: &'static str,
    },
}

impl From<cudarc::driver::DriverError> for EpError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        EpError::Runtime(e.into())
    }
}
