//! moeforge codegen: the MoE layer's description ([`MoeSpec`]) and its rendering into CUDA C.
//!
//! Pure Rust with no CUDA dependency: everything here runs in unit tests in milliseconds.
//! Data flows one way: `MoeSpec` -> [`render`] -> [`KernelSource`] -> (moe-runtime) NVRTC.

pub mod format;
pub mod render;
pub mod spec;

pub use format::{Packed, QuantError, WeightFormat};
pub use render::{
    render, render_warp_decode, routing_smem_bytes, variants, CodegenError, DecodeTiles, KernelSource, TOKEN_TILES,
};
pub use spec::{ActDtype, Activation, Arch, KernelFamily, MoeSpec, MoeSpecBuilder, SpecError, REFERENCE_GEOMETRIES};
