//! The kernel families, one module each: compiled functions, launch geometry and scratch.
//! A family never imports its sibling; what they share (the step's pointers) lives here.

pub mod decode;
pub mod fused;
pub mod grouped;

/// Which part of a grouped step a launch enqueues. A step split in parts leaves its layout and
/// intermediate in its scratch between `Front` (alignment, GEMM1), `Gemm2` and `Combine`, so that
/// another step may run between them on the other scratch ([`ScratchSlot`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    Whole,
    Front,
    Gemm2,
    /// The combine, adding other ranks' partial outputs of the step's tokens to its own sums.
    Combine(Partials),
}

impl Part {
    pub fn runs_front(self) -> bool {
        matches!(self, Part::Whole | Part::Front)
    }
    pub fn runs_gemm2(self) -> bool {
        matches!(self, Part::Whole | Part::Gemm2)
    }
    pub fn runs_combine(self) -> bool {
        matches!(self, Part::Whole | Part::Combine(_))
    }
}

/// Other ranks' partial outputs of a step's tokens (an expert-parallel rank's), which the combine
/// adds to the step's own sums, each rounded to the activation dtype first, in rank order in f32:
/// the expert-parallel combine folded into the step's last kernel, with the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Partials {
    /// Rows in the activation dtype, `rows` per rank: rank p's at row `p * rows`.
    pub y: u64,
    /// `[m, ranks]`: token t's row at `t * ranks + j` in the chunk of rank (rank + j) % ranks
    /// (j >= 1), -1 where it has none.
    pub pos: u64,
    pub rows: i32,
    pub rank: i32,
    pub ranks: i32,
}

/// One of a layer's two sets of step scratch: a step split into parts keeps the first while
/// another step runs on the second.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ScratchSlot {
    First = 0,
    Second = 1,
}

/// Where a step runs: on which scratch slot, whole or which part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StepAt {
    pub slot: ScratchSlot,
    pub part: Part,
}

impl StepAt {
    /// The whole step on the first slot: every step but an expert-parallel rank's split ones.
    pub const WHOLE: StepAt = StepAt { slot: ScratchSlot::First, part: Part::Whole };
}

/// Device pointers a family reads for one step.
#[derive(Clone, Copy)]
pub(crate) struct StepPtrs {
    pub x: u64,
    /// Router logits `[M, E]` and bias (0: `ids` / `weights` are given); moe_prepare then routes
    /// into `ids` / `weights`, which must be the scratch's (`GroupedPath::routing_ptrs`).
    pub logits: u64,
    pub bias: u64,
    pub ids: u64,
    pub weights: u64,
    pub y: u64,
    pub w13: u64,
    pub w13_scales: u64,
    pub w2: u64,
    pub w2_scales: u64,
    /// Per-expert biases (0 without: the kernels are rendered not to read them).
    pub w13_bias: u64,
    pub w2_bias: u64,
    pub errors: u64,
    /// `moe_choose`'s output where the device picks the family (each family's kernels return at
    /// once unless chosen), 0 where the host did.
    pub choice: u64,
}
