//! The runtime's one error type. Messages say what was expected and what came.

use moe_codegen::{Arch, CodegenError, SpecError};

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Codegen(#[from] CodegenError),
    #[error(
        "NVRTC / CUDA headers not found (looked in: {searched}). Run `scripts/setup-cuda.sh` to install the pinned \
         NVRTC wheels into .cuda/, or set CUDA_HOME to a CUDA 13 toolkit"
    )]
    ToolkitNotFound { searched: String },
    #[error("no usable NVIDIA GPU: {0}")]
    NoGpu(String),
    #[error("device of compute capability {major}.{minor} is not a moeforge target (sm_90a, sm_100a, sm_120a)")]
    UnsupportedDevice { major: i32, minor: i32 },
    #[error("NVRTC failed to compile `{name}` for {arch}:\n{log}\n--- offending source lines ---\n{excerpt}")]
    Compile { name: String, arch: Arch, log: String, excerpt: String },
    #[error("NVRTC call failed: {0}")]
    Nvrtc(String),
    #[error("CUDA driver error: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("kernel cache I/O at {path}: {source}")]
    CacheIo { path: String, source: std::io::Error },
    #[error("`{what}`: expected {expected}, got {got}")]
    Shape { what: &'static str, expected: String, got: String },
    #[error("routing holds {count} expert id(s) outside [0, {experts}); first bad at pair {first_pair}: {first_id}")]
    ExpertIdOutOfRange { count: usize, experts: u32, first_pair: usize, first_id: i32 },
    #[error("a step of {m} tokens needs more scratch than reserved: call `reserve({m})` before capturing a graph")]
    NotReserved { m: usize },
    #[error("no grouped step has run on this layer yet")]
    NoStepYet,
    #[error("the {family} family is not available for this layer: {why}")]
    FamilyUnavailable { family: moe_codegen::KernelFamily, why: String },
    #[error("no {family} source for {arch} among the sources given (render it for the device's arch)")]
    MissingSource { family: moe_codegen::KernelFamily, arch: Arch },
    #[error("step of {m} tokens needs {need} bytes of shared memory for routing; the device allows {max}")]
    StepTooLarge { m: usize, need: u32, max: u32 },
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
