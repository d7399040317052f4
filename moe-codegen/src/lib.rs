//! moeforge codegen: the MoE layer's description ([`MoeSpec`]) and its rendering into CUDA C.
//!
//! Pure Rust with no CUDA dependency: everything here runs in unit tests in milliseconds.
//! Data flows one way: `MoeSpec` -> [`render()`] -> [`KernelSource`] -> (moe-runtime) NVRTC.

#![warn(missing_docs)]

pub mod dequant;
pub mod ep;
pub mod format;
pub mod fused;
pub mod grouped;
pub mod heuristics;
pub mod numerics;
pub mod params;
pub mod render;
pub mod router;
pub mod spec;

pub use dequant::DequantVariant;
pub use ep::{render_ep, EP_MAX_RANKS};
pub use format::{Codec, Packed, QuantError, ScaleLayout, WeightFormat};
pub use fused::{fused_smem_bytes, fused_support, render_fused, FusedTiles};
pub use grouped::{grouped_support, render_grouped, GemmTiles, Mma};
pub use render::{
    bulk_smem_bytes, decode_down_smem_bytes, decode_mid_floats, decode_smem_bytes, dequant_variants, family_supports,
    render, render_count, render_dequant_probe, render_warp_decode, resident_renders, resident_rows,
    resident_smem_bytes, routing_smem_bytes, static_smem_bytes, variants, CodegenError, DecodeTiles, KernelSource,
    BULK_SMEM_BUDGET, BULK_SMEM_MAX, RESIDENT_WARPS, TOKEN_TILES, X_STAGE_MAX_BYTES,
};
pub use router::{GroupLimited, Router};
pub use spec::{ActDtype, Activation, Arch, KernelFamily, MoeSpec, MoeSpecBuilder, SpecError, REFERENCE_GEOMETRIES};
