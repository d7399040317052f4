//! moeforge: Mixture-of-Experts CUDA kernels generated from one Rust description.
//!
//! One dependency gives the whole stack:
//!
//! - [`moe_kernel`]: the attribute that declares a layer, checks its spec and renders its kernels
//!   at compile time;
//! - [`codegen`] (moe-codegen): the spec types ([`MoeSpec`], [`WeightFormat`], [`Arch`], ...) and
//!   [`render()`], which turns a spec into CUDA C; re-exported here at the top level;
//! - [`runtime`] (moe-runtime): NVRTC JIT, the kernel cache, weight upload and launch;
//! - [`checkpoint`] (moe-checkpoint): one MoE layer of a Hugging Face safetensors checkpoint,
//!   mapped into moeforge's layout.
//!
//! # Example
//!
//! ```
//! use moeforge::{moe_kernel, Arch, KernelFamily};
//!
//! /// Qwen3-30B-A3B's MoE layer.
//! #[moe_kernel(hidden = 2048, intermediate = 768, experts = 128, top_k = 8, format = bf16, activation = silu)]
//! pub struct Qwen3Moe;
//!
//! /// OLMoE's, with fp8 weights, for Hopper only.
//! #[moe_kernel(hidden = 2048, intermediate = 1024, experts = 64, top_k = 8, format = fp8_e4m3, archs = [sm_90a])]
//! pub struct Olmoe;
//!
//! assert_eq!(Qwen3Moe::SPEC.id(), "h2048_i768_e128_k8_bf16_bf16_silu");
//! assert_eq!(Olmoe::SPEC.id(), "h2048_i1024_e64_k8_fp8_e4m3_bf16_silu");
//!
//! // The same spec, built at run time, is the same value.
//! let spec = moeforge::MoeSpec::builder(2048, 768, 128, 8).build().unwrap();
//! assert_eq!(spec, Qwen3Moe::SPEC);
//!
//! // `families` left out: every family the spec supports (warp decode, the grouped GEMMs and
//! // the fused kernel, for every format the geometry fits).
//! assert_eq!(Qwen3Moe::FAMILIES, &KernelFamily::ALL);
//! assert_eq!(Olmoe::FAMILIES, &KernelFamily::ALL);
//!
//! // Every (family, arch) was rendered when the macro expanded.
//! for &(family, arch, name, source) in Qwen3Moe::SOURCES {
//!     println!("{family} {arch}: {name}, {} bytes", source.len());
//! }
//! assert_eq!(Qwen3Moe::SOURCES.len(), 3 * 3);
//! let k = Qwen3Moe::kernel_source(KernelFamily::WarpDecode, Arch::Sm100a).unwrap();
//! assert_eq!(k, moeforge::render(&spec, KernelFamily::WarpDecode, Arch::Sm100a).unwrap());
//! assert!(Olmoe::kernel_source(KernelFamily::WarpDecode, Arch::Sm100a).is_none());
//! ```
//!
//! On a GPU, `load` uploads the weights and JITs the sources embedded for the device's arch, every
//! declared family's (`MoeLayer::with_sources`): nothing is rendered at run time, and an arch
//! missing from `archs` is `Err(RuntimeError::MissingSource)`:
//!
//! ```no_run
//! # use moeforge::moe_kernel;
//! # #[moe_kernel(hidden = 2048, intermediate = 768, experts = 128, top_k = 8)]
//! # pub struct Qwen3Moe;
//! use moeforge::runtime::{Device, HostWeights, MoeLayer, RuntimeError};
//!
//! fn build(weights: &HostWeights) -> Result<MoeLayer, RuntimeError> {
//!     let device = Device::new(0)?;
//!     let layer = Qwen3Moe::load(&device, weights)?;
//!     // bf16: large steps take the grouped GEMMs, embedded like warp decode.
//!     assert!(layer.grouped_available().is_ok());
//!     Ok(layer)
//! }
//! ```
//!
//! A spec the kernels cannot serve does not compile; the error points at the argument:
//!
//! ```compile_fail
//! // error: `top_k` = 9 exceeds experts = 8
//! #[moeforge::moe_kernel(hidden = 4096, intermediate = 14336, experts = 8, top_k = 9)]
//! pub struct Mixtral;
//! ```

#![warn(missing_docs)]

// Lets `#[moe_kernel]`'s `::moeforge::...` paths resolve inside this crate too.
extern crate self as moeforge;

pub use moe_checkpoint as checkpoint;
pub use moe_codegen as codegen;
pub use moe_dsl::moe_kernel;
pub use moe_runtime as runtime;

pub use moe_codegen::{
    render, ActDtype, Activation, Arch, CodegenError, DequantVariant, KernelFamily, KernelSource, MoeSpec,
    MoeSpecBuilder, SpecError, WeightFormat,
};
