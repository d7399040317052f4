//! The runtime's one error type. Messages say what was expected and what came.

use moe_codegen::{Arch, CodegenError, SpecError};

/// Everything the runtime can fail with: spec and codegen errors passed through, toolkit and
/// device discovery, NVRTC compilation, the driver, the kernel cache and the checks on a step's
/// inputs.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The layer's spec is invalid.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// Rendering a kernel's source failed.
    #[error(transparent)]
    Codegen(#[from] CodegenError),
    /// NVRTC or the CUDA headers could not be found, so nothing can be compiled.
    #[error(
        "NVRTC / CUDA headers not found (looked in: {searched}). Run `scripts/setup-cuda.sh` to install the pinned \
         NVRTC wheels into .cuda/, or set CUDA_HOME to a CUDA 13 toolkit"
    )]
    ToolkitNotFound {
        /// The folders looked in, and what was missing.
        searched: String,
    },
    /// No GPU could be opened: no driver, no device at that ordinal, or the context failed.
    #[error("no usable NVIDIA GPU: {0}")]
    NoGpu(String),
    /// The GPU's compute capability is not one moeforge compiles for.
    #[error("device of compute capability {major}.{minor} is not a moeforge target (sm_90a, sm_100a, sm_120a)")]
    UnsupportedDevice {
        /// Compute capability, major part.
        major: i32,
        /// Compute capability, minor part.
        minor: i32,
    },
    /// NVRTC rejected a kernel's source; the log and the source lines it points at say why.
    #[error("NVRTC failed to compile `{name}` for {arch}:\n{log}\n--- offending source lines ---\n{excerpt}")]
    Compile {
        /// The kernel source's name.
        name: String,
        /// The arch it was compiled for.
        arch: Arch,
        /// NVRTC's program log.
        log: String,
        /// The source lines the log refers to, for reading the error without the source.
        excerpt: String,
    },
    /// An NVRTC API call other than the compilation itself failed.
    #[error("NVRTC call failed: {0}")]
    Nvrtc(String),
    /// A CUDA driver call failed.
    #[error("CUDA driver error: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// Reading or writing the kernel cache failed.
    #[error("kernel cache I/O at {path}: {source}")]
    CacheIo {
        /// The file or folder involved.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// An input's size or shape does not match the layer's spec.
    #[error("`{what}`: expected {expected}, got {got}")]
    Shape {
        /// Which input.
        what: &'static str,
        /// The size or shape the spec calls for.
        expected: String,
        /// The size or shape given.
        got: String,
    },
    /// The routing names experts the layer does not have.
    #[error("routing holds {count} expert id(s) outside [0, {experts}); first bad at pair {first_pair}: {first_id}")]
    ExpertIdOutOfRange {
        /// How many (token, slot) pairs hold a bad id.
        count: usize,
        /// The layer's number of experts.
        experts: u32,
        /// The index of the first bad pair.
        first_pair: usize,
        /// The id found there.
        first_id: i32,
    },
    /// A step needs more scratch than reserved, and growing it is not allowed (as while
    /// capturing a CUDA graph).
    #[error("a step of {m} tokens needs more scratch than reserved: call `reserve({m})` before capturing a graph")]
    NotReserved {
        /// The step's number of tokens.
        m: usize,
    },
    /// The dispatch profile could not be fitted (its timed steps do not determine the models).
    #[error("dispatch profile: {0}")]
    Profile(String),
    /// A grouped step's results were asked for before any grouped step ran.
    #[error("no grouped step has run on this layer yet")]
    NoStepYet,
    /// A kernel family cannot serve this layer (its spec, weight format or sources).
    #[error("the {family} family is not available for this layer: {why}")]
    FamilyUnavailable {
        /// The family asked for.
        family: moe_codegen::KernelFamily,
        /// Why it cannot.
        why: String,
    },
    /// The sources given hold none of a family for the device's arch.
    #[error("no {family} source for {arch} among the sources given (render it for the device's arch)")]
    MissingSource {
        /// The family missing.
        family: moe_codegen::KernelFamily,
        /// The device's arch.
        arch: Arch,
    },
    /// A step's routing needs more shared memory than the device allows per block.
    #[error("step of {m} tokens needs {need} bytes of shared memory for routing; the device allows {max}")]
    StepTooLarge {
        /// The step's number of tokens.
        m: usize,
        /// The bytes of shared memory it needs.
        need: u32,
        /// The bytes the device allows.
        max: u32,
    },
}

/// The runtime's result type, [`RuntimeError`] by default.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
