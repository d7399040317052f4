//! The `#[moe_kernel]` attribute macro of moeforge. Use it through the facade, `moeforge::moe_kernel`:
//! the code it generates names `::moeforge::codegen` and `::moeforge::runtime`.

#![warn(missing_docs)]

use proc_macro::TokenStream;

mod args;
mod expand;

/// Declare an MoE layer: the spec is checked and its CUDA kernels are rendered when the macro
/// expands, so a bad geometry is a compile error and the binary carries exactly the source it JITs
/// (`load` builds the layer from those sources and renders nothing at run time).
///
/// ```
/// use moeforge::{moe_kernel, Arch, KernelFamily, WeightFormat};
///
/// /// Qwen3-30B-A3B's MoE layer.
/// #[moe_kernel(
///     hidden = 2048,
///     intermediate = 768,
///     experts = 128,
///     top_k = 8,
///     format = bf16,
///     activation = silu,
///     archs = [sm_90a, sm_100a, sm_120a],
/// )]
/// pub struct Qwen3Moe;
///
/// // The spec, as a constant.
/// assert_eq!(Qwen3Moe::SPEC.hidden(), 2048);
/// assert_eq!(Qwen3Moe::SPEC.weight_format(), WeightFormat::Bf16);
/// assert_eq!(Qwen3Moe::ARCHS, &[Arch::Sm90a, Arch::Sm100a, Arch::Sm120a]);
///
/// // `families` left out: every family the spec supports, all three for bf16.
/// assert_eq!(Qwen3Moe::FAMILIES, &KernelFamily::ALL);
///
/// // The sources rendered at compile time are exactly what `render` produces at run time.
/// for &family in Qwen3Moe::FAMILIES {
///     for &arch in Qwen3Moe::ARCHS {
///         let k = Qwen3Moe::kernel_source(family, arch).unwrap();
///         assert_eq!(k, moeforge::render(&Qwen3Moe::SPEC, family, arch).unwrap());
///     }
/// }
/// let k = Qwen3Moe::kernel_source(KernelFamily::WarpDecode, Arch::Sm90a).unwrap();
/// assert_eq!(k.name, "warp_decode_h2048_i768_e128_k8_bf16_bf16_silu");
///
/// /// Quantized weights: every family (the grouped loader and the fused kernel decode them for
/// /// the tensor cores); with the `lut` dequant variant no grouped GEMMs.
/// #[moe_kernel(hidden = 2048, intermediate = 768, experts = 128, top_k = 8, format = int4_g128)]
/// pub struct Qwen3Int4;
/// assert_eq!(Qwen3Int4::FAMILIES, &KernelFamily::ALL);
/// ```
///
/// # Arguments
///
/// | key | value | default |
/// |-----|-------|---------|
/// | `hidden` | integer | required |
/// | `intermediate` | integer (per expert) | required |
/// | `experts` | integer | required |
/// | `top_k` | integer | required |
/// | `format` | `bf16`, `fp16`, `fp8_e4m3`, `fp8_e4m3_b128`, `mxfp8`, `int8`, `int8_g{32,64,128}`, `int4`, `int4_g{32,64,128}`, `int4_asym`, `int4_asym_g{32,64,128}`, `nvfp4`, `mxfp4` | `bf16` |
/// | `dequant` | `lut`, `bits`, `hardware` | the format's default on each arch |
/// | `activation` | `silu`, `gelu_tanh`, `swiglu_oai` (gpt-oss) | `silu` |
/// | `act_dtype` | `bf16`, `fp16` | the format's (`fp16` for fp16 weights, else `bf16`) |
/// | `bias` | `true`, `false`: per-expert biases on w13 and w2 (`HostWeights::w13_bias` / `w2_bias`) | `false` |
/// | `shared_experts` | integer: shared experts every token uses, after the routed ones in w13 / w2 (DeepSeek-V3, Qwen2-MoE) | `0` |
/// | `shared_gate` | `true`, `false`: the shared experts weighted by `sigmoid(x . shared_gate)` (Qwen2-MoE) | `false` |
/// | `router` | `softmax` (renormalised top-k: Qwen3, Mixtral, gpt-oss), `softmax_raw` (OLMoE), `group_limited` (DeepSeek-V3, Kimi-K2) | `softmax` |
/// | `router_groups`, `router_topk_groups` | integers: `group_limited`'s expert groups and the groups kept | required with `group_limited` |
/// | `router_renormalize`, `router_scaling` | `true` / `false`; a number: renormalise the chosen weights, then scale them | `true`; `1.0` |
/// | `archs` | list of `sm_90a`, `sm_100a`, `sm_120a` | all three |
/// | `families` | list of `warp_decode`, `grouped_gemm` | every family the spec supports (`moe_codegen::family_supports`) |
///
/// Names are parsed by moe-codegen's `FromStr` impls and the spec is built by the same
/// `MoeSpec::new` the runtime uses, so the macro accepts exactly what the runtime accepts. Every
/// error points at the argument it concerns: an unknown, duplicate or missing key, a zero size,
/// `top_k > experts`, a size the format's 16-byte vector or scale group does not divide
/// (`hidden = 2056` with `fp8_e4m3`), an unknown format, dequant variant, activation, dtype, arch
/// or family, a dequant variant the format lacks (at `dequant`) or a declared arch lacks (at the
/// arch; every target arch has every variant of its formats today), a declared family the spec
/// has no kernels for (at that `families` entry, with `moe_codegen::grouped_support`'s reason:
/// `grouped_gemm` with the `lut` dequant variant, or with bf16 weights and fp16 activations).
///
/// ```compile_fail
/// # use moeforge::moe_kernel;
/// // error: `hidden` = 2056 is not a multiple of 16 (the weight format's 16-byte vector width) ...
/// #[moe_kernel(hidden = 2056, intermediate = 1024, experts = 64, top_k = 8, format = fp8_e4m3)]
/// pub struct Olmoe;
/// ```
///
/// ```compile_fail
/// # use moeforge::moe_kernel;
/// // error: grouped_gemm is not available for this spec: int4 weights with the lut dequant
/// // variant (bits and hardware are supported)
/// #[moe_kernel(hidden = 2048, intermediate = 768, experts = 128, top_k = 8, format = int4,
///              dequant = lut, families = [warp_decode, grouped_gemm])]
/// pub struct Qwen3Int4;
/// ```
///
/// # Generated items
///
/// The struct is kept (its docs gain a line stating the geometry) and gets:
///
/// - `pub const SPEC: moeforge::MoeSpec`;
/// - `pub const ARCHS: &[Arch]` and `pub const FAMILIES: &[KernelFamily]`, as declared (or defaulted);
/// - `pub const SOURCES: &[(KernelFamily, Arch, &str, &str)]`: family, arch, module name and CUDA C
///   source of every declared pair, rendered by `moe_codegen::render` during expansion (each
///   distinct text embedded once: warp decode's is the same on every arch, the grouped family's
///   differs between `sm_90a` and the `mma.sync` archs);
/// - `pub fn kernel_source(family, arch) -> Option<KernelSource>`, equal to `render(&SPEC, family, arch)`;
/// - `pub fn load(&Device, &HostWeights) -> Result<MoeLayer, RuntimeError>` (where `warp_decode` is
///   among the families): the runtime layer built by `MoeLayer::with_sources` from the embedded
///   sources of every declared family for the device's arch, rendering nothing at run time;
///   `Err(RuntimeError::MissingSource)` if that arch was not declared.
///
/// ```no_run
/// # use moeforge::moe_kernel;
/// # #[moe_kernel(hidden = 2048, intermediate = 768, experts = 128, top_k = 8)]
/// # pub struct Qwen3Moe;
/// use moeforge::runtime::{Device, HostWeights, MoeLayer, RuntimeError};
///
/// fn build(weights: &HostWeights) -> Result<MoeLayer, RuntimeError> {
///     let device = Device::new(0)?;
///     Qwen3Moe::load(&device, weights)
/// }
/// ```
#[proc_macro_attribute]
pub fn moe_kernel(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::expand(attr.into(), item.into()).into()
}
