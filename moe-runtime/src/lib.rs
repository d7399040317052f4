//! moeforge runtime: NVRTC JIT with a two-level kernel cache, weights on the device, and the
//! layer's `forward`.
//!
//! ```text
//! KernelSource --jit--> CUBIN (disk cache, blake3-keyed) --Device::load--> CudaModule (memory)
//!              MoeLayer::load(device, spec, weights) -> forward(x, topk_ids, topk_weights, y)
//! ```
//!
//! The feature `testing` adds the helpers tests and benches use: `reference` (the f64 CPU
//! layer), `testing` (random weights and steps) and `timing` (CUDA-event timing).

#![warn(missing_docs)]

pub mod cache;
pub mod device;
pub mod dispatch;
pub mod ep;
pub mod error;
pub mod families;
pub mod jit;
mod launch;
pub mod layer;
// Helpers for tests, benches and examples, not for the library: the CPU reference, random
// weights and steps (feature `testing`, which brings in rand).
#[cfg(feature = "testing")]
pub mod reference;
#[cfg(feature = "testing")]
pub mod testing;
// CUDA-graph timing on the device: the dispatch profile needs it too.
pub mod timing;
mod tma;
pub mod toolkit;
pub mod view;
pub mod weights;

pub use cache::DiskCache;
pub use cudarc;
pub use device::Device;
pub use error::{Result, RuntimeError};
pub use families::decode::DEFAULT_MAX_TOKEN_TILE;
pub use families::grouped::Alignment;
pub use jit::{cache_key, compile, CompileOptions, Compiled};
pub use layer::{validate_ids, ActElem, MoeLayer, DEFAULT_PREFILL_THRESHOLD};
pub use view::{DeviceTensor, DeviceTensorMut, TopkIds};
pub use weights::{DeviceWeights, HostWeights, Weights};
