//! The macro's generated items: values, defaults, and sources identical to a run-time `render`.

use moeforge::codegen::render::entry_points;
use moeforge::{moe_kernel, render, ActDtype, Activation, Arch, DequantVariant, KernelFamily, MoeSpec, WeightFormat};

/// Qwen3-30B-A3B.
#[moe_kernel(
    hidden = 2048,
    intermediate = 768,
    experts = 128,
    top_k = 8,
    format = bf16,
    activation = silu,
    archs = [sm_90a, sm_100a, sm_120a]
)]
pub struct Qwen3Moe;

#[moe_kernel(hidden = 2048, intermediate = 1024, experts = 64, top_k = 8, format = fp8_e4m3, archs = [sm_120a, sm_90a])]
struct Olmoe;

#[moe_kernel(hidden = 512, intermediate = 256, experts = 8, top_k = 2, format = fp16, activation = gelu_tanh,
             families = [warp_decode])]
struct SmallFp16;

#[moe_kernel(top_k = 4, experts = 32, intermediate = 2880, hidden = 2880, act_dtype = fp16, format = fp8_e4m3,)]
pub(crate) struct GptOss;

/// gpt-oss-20b as it ships: MXFP4 (the variant left to the arch's default), per-expert biases and
/// the clamped SwiGLU.
#[moe_kernel(hidden = 2880, intermediate = 2880, experts = 32, top_k = 4, format = mxfp4, activation = swiglu_oai, bias = true)]
struct GptOssMxfp4;

/// A named dequant variant (the hardware FP4 decode; on sm_90a through e4m3).
#[moe_kernel(
    hidden = 2048,
    intermediate = 768,
    experts = 128,
    top_k = 8,
    format = nvfp4,
    dequant = hardware,
    archs = [sm_100a, sm_120a]
)]
struct Qwen3Nvfp4Hw;

#[moe_kernel(hidden = 2048, intermediate = 768, experts = 128, top_k = 8, format = int4_asym_g128, dequant = lut)]
struct Qwen3Awq;

/// DeepSeek-V3-shaped (scaled down): one shared expert computed in the step, its router.
#[moe_kernel(
    hidden = 1024,
    intermediate = 256,
    experts = 64,
    top_k = 6,
    format = fp8_e4m3_b128,
    shared_experts = 1,
    router = group_limited,
    router_groups = 8,
    router_topk_groups = 4,
    router_scaling = 2.5
)]
struct DeepSeekLike;

/// OLMoE's router: no renormalisation of the chosen weights.
#[moe_kernel(hidden = 2048, intermediate = 1024, experts = 64, top_k = 8, router = softmax_raw)]
struct OlmoeRaw;

/// Qwen2-MoE's shared expert, gated, as four of the routed experts' size.
#[moe_kernel(hidden = 2048, intermediate = 1408, experts = 60, top_k = 4, shared_experts = 4, shared_gate = true)]
struct Qwen2Moe;

#[test]
fn spec_holds_the_declared_values() {
    let g = GptOssMxfp4::SPEC;
    assert!(g.has_bias() && g.activation() == Activation::SwigluOai);
    let built = MoeSpec::builder(2880, 2880, 32, 4).weight_format(WeightFormat::Mxfp4);
    assert_eq!(g, built.activation(Activation::SwigluOai).bias(true).build().unwrap());
    assert!(!Qwen3Moe::SPEC.has_bias());
    assert_eq!((DeepSeekLike::SPEC.shared_experts(), DeepSeekLike::SPEC.shared_gated()), (1, false));
    assert_eq!((Qwen2Moe::SPEC.shared_experts(), Qwen2Moe::SPEC.shared_gated()), (4, true));
    assert_eq!(Qwen2Moe::SPEC.kernel_spec().experts(), 64);
    use moeforge::codegen::{GroupLimited, Router};
    assert_eq!(DeepSeekLike::SPEC.router(), Router::GroupLimited(GroupLimited::new(8, 4, true, 2.5)));
    assert_eq!(OlmoeRaw::SPEC.router(), Router::Softmax { renormalize: false });
    assert_eq!(Qwen3Moe::SPEC.router(), Router::default());
    assert_eq!(
        DeepSeekLike::kernel_source(KernelFamily::GroupedGemm, Arch::Sm90a).unwrap().source,
        render(&DeepSeekLike::SPEC, KernelFamily::GroupedGemm, Arch::Sm90a).unwrap().source
    );
    let s = Qwen3Moe::SPEC;
    assert_eq!((s.hidden(), s.intermediate(), s.experts(), s.top_k()), (2048, 768, 128, 8));
    assert_eq!(s.weight_format(), WeightFormat::Bf16);
    assert_eq!(s.act_dtype(), ActDtype::Bf16);
    assert_eq!(s.activation(), Activation::Silu);
    assert_eq!(s, MoeSpec::builder(2048, 768, 128, 8).build().unwrap());
    assert_eq!(Qwen3Moe::ARCHS, &[Arch::Sm90a, Arch::Sm100a, Arch::Sm120a]);
    // Families default to every one the spec supports: all three for bf16.
    assert_eq!(Qwen3Moe::FAMILIES, &KernelFamily::ALL);
    assert_eq!(Qwen3Moe::SOURCES.len(), 9);

    let o = Olmoe::SPEC;
    assert_eq!(o.id(), "h2048_i1024_e64_k8_fp8_e4m3_bf16_silu");
    assert_eq!(Olmoe::ARCHS, &[Arch::Sm120a, Arch::Sm90a], "declared order is kept");
    assert_eq!(Olmoe::SOURCES.len(), 6);

    // fp16 weights default to fp16 activations.
    assert_eq!(SmallFp16::SPEC.act_dtype(), ActDtype::Fp16);
    assert_eq!(SmallFp16::SPEC.activation(), Activation::GeluTanh);
    assert_eq!(SmallFp16::ARCHS, &Arch::ALL, "archs default to all three");

    assert_eq!(GptOss::SPEC.id(), "h2880_i2880_e32_k4_fp8_e4m3_fp16_silu");

    assert_eq!(GptOssMxfp4::SPEC.weight_format(), WeightFormat::Mxfp4);
    assert_eq!(GptOssMxfp4::SPEC.dequant(), None);
    assert_eq!(GptOssMxfp4::SPEC.dequant_for(Arch::Sm90a), Ok(DequantVariant::Hardware));
    assert_eq!(GptOssMxfp4::SPEC.dequant_for(Arch::Sm120a), Ok(DequantVariant::Bits));
    assert_eq!(Qwen3Nvfp4Hw::SPEC.dequant(), Some(DequantVariant::Hardware));
    assert_eq!(Qwen3Nvfp4Hw::SPEC.id(), "h2048_i768_e128_k8_nvfp4_bf16_silu_hardware");
    assert_eq!(
        Qwen3Awq::SPEC,
        MoeSpec::builder(2048, 768, 128, 8)
            .weight_format(WeightFormat::Int4AsymG128)
            .dequant(DequantVariant::Lut)
            .build()
            .unwrap()
    );
}

/// bf16 weights with fp16 activations: warp decode only (the grouped GEMMs take one 16-bit type).
#[moe_kernel(hidden = 2048, intermediate = 768, experts = 128, top_k = 8, act_dtype = fp16, archs = [sm_90a])]
struct Bf16WeightsFp16Acts;

/// fp8 weights with fp16 activations: both families (GEMM1 quantizes x from either dtype).
#[moe_kernel(hidden = 2048, intermediate = 768, experts = 128, top_k = 8, format = fp8_e4m3, act_dtype = fp16,
             archs = [sm_100a])]
struct Fp8WeightsFp16Acts;

/// Plain int4: both families (the grouped loader decodes the weights).
#[moe_kernel(hidden = 2048, intermediate = 768, experts = 128, top_k = 8, format = int4)]
struct Qwen3Int4;

/// Without `families`, every family `family_supports` allows for the spec, in `KernelFamily::ALL`'s order.
#[test]
fn families_default_to_those_the_spec_supports() {
    use moeforge::codegen::family_supports;
    let defaults = |spec: &MoeSpec| -> Vec<KernelFamily> {
        KernelFamily::ALL.into_iter().filter(|&f| family_supports(f, spec)).collect()
    };
    let all = KernelFamily::ALL;
    let both = [KernelFamily::WarpDecode, KernelFamily::GroupedGemm];
    let no_grouped = [KernelFamily::WarpDecode, KernelFamily::Fused];
    assert_eq!(Qwen3Moe::FAMILIES, &all);
    assert_eq!(Olmoe::FAMILIES, &all, "per-channel fp8 has the grouped family");
    assert_eq!(Fp8WeightsFp16Acts::FAMILIES, &all);
    // 2880 one-byte elements are not whole 128-byte k-tiles: the grouped GEMMs decode them in registers.
    assert_eq!(GptOss::FAMILIES, &all, "per-channel fp8 at 2880 has the grouped family");
    assert_eq!(Qwen3Int4::FAMILIES, &all, "the grouped loader decodes int4");
    assert_eq!(Qwen3Awq::FAMILIES, &no_grouped, "the lut variant's table: no grouped GEMMs");
    // The fused kernel takes 4-bit codes 128 at a time along K: 2880 does not divide.
    assert_eq!(GptOssMxfp4::FAMILIES, &both);
    assert_eq!(Bf16WeightsFp16Acts::FAMILIES, &no_grouped, "the grouped GEMMs take one 16-bit type");
    assert_eq!(SmallFp16::FAMILIES, &[KernelFamily::WarpDecode], "a declared list is kept");
    for (spec, families) in [
        (Qwen3Moe::SPEC, Qwen3Moe::FAMILIES),
        (Olmoe::SPEC, Olmoe::FAMILIES),
        (GptOss::SPEC, GptOss::FAMILIES),
        (Qwen3Int4::SPEC, Qwen3Int4::FAMILIES),
        (Qwen3Awq::SPEC, Qwen3Awq::FAMILIES),
        (GptOssMxfp4::SPEC, GptOssMxfp4::FAMILIES),
        (Qwen3Nvfp4Hw::SPEC, Qwen3Nvfp4Hw::FAMILIES),
        (Bf16WeightsFp16Acts::SPEC, Bf16WeightsFp16Acts::FAMILIES),
        (Fp8WeightsFp16Acts::SPEC, Fp8WeightsFp16Acts::FAMILIES),
    ] {
        assert_eq!(families, defaults(&spec), "{}", spec.id());
    }
    // Every default family is embedded for every declared arch: what `load` hands `with_sources`.
    for &family in Qwen3Moe::FAMILIES {
        for &arch in Qwen3Moe::ARCHS {
            let k = Qwen3Moe::kernel_source(family, arch).unwrap();
            assert_eq!(k.grouped_tiles.is_some(), family == KernelFamily::GroupedGemm);
            assert_eq!(k.decode_tiles.is_some(), family == KernelFamily::WarpDecode);
            assert_eq!(k.fused_tiles.is_some(), family == KernelFamily::Fused);
        }
    }
    assert!(Qwen3Awq::kernel_source(KernelFamily::GroupedGemm, Arch::Sm90a).is_none());
    assert!(Qwen3Awq::SOURCES.iter().all(|s| s.0 != KernelFamily::GroupedGemm));
    // The decoded-weight GEMMs take the mma.sync pipeline, sm_90a included.
    let g = Qwen3Int4::kernel_source(KernelFamily::GroupedGemm, Arch::Sm90a).unwrap();
    assert!(g.name.ends_with("_mma"), "{}", g.name);
}

/// The grouped family renders per arch (wgmma on sm_90a, mma.sync on sm_100a and sm_120a): each
/// arch's row holds its own text, not a neighbour's.
#[test]
fn grouped_sources_differ_per_arch() {
    let text = |arch| Qwen3Moe::SOURCES.iter().find(|s| s.0 == KernelFamily::GroupedGemm && s.1 == arch).unwrap().3;
    assert_ne!(text(Arch::Sm90a), text(Arch::Sm100a));
    assert_ne!(text(Arch::Sm90a), text(Arch::Sm120a));
    for arch in Arch::ALL {
        assert!(text(arch) == render(&Qwen3Moe::SPEC, KernelFamily::GroupedGemm, arch).unwrap().source, "{arch}");
    }
    // Warp decode renders one text for every arch.
    let decode: Vec<&str> = Qwen3Moe::SOURCES.iter().filter(|s| s.0 == KernelFamily::WarpDecode).map(|s| s.3).collect();
    assert_eq!(decode.len(), 3);
    assert!(decode.iter().all(|t| *t == decode[0]));
}

#[test]
fn spec_is_usable_in_const_context() {
    const H: u32 = Qwen3Moe::SPEC.hidden();
    const BYTES: usize = Olmoe::SPEC.w13_elems();
    let _array = [0u8; H as usize];
    assert_eq!(BYTES, 64 * 2 * 1024 * 2048);
}

/// The JIT cache key hashes the rendered source (plus compile options): equal sources, one cache entry.
#[test]
fn macro_sources_equal_runtime_render() {
    fn check(
        spec: &MoeSpec,
        sources: &[(KernelFamily, Arch, &str, &str)],
        get: fn(KernelFamily, Arch) -> Option<moeforge::KernelSource>,
    ) {
        for &(family, arch, name, source) in sources {
            let want = render(spec, family, arch).unwrap();
            assert_eq!(name, want.name);
            assert!(source == want.source, "{name} on {arch}: macro and render differ");
            assert_eq!(get(family, arch).unwrap(), want);
            assert_eq!(want.entry_points, entry_points(family));
        }
    }
    check(&Qwen3Moe::SPEC, Qwen3Moe::SOURCES, Qwen3Moe::kernel_source);
    check(&Olmoe::SPEC, Olmoe::SOURCES, Olmoe::kernel_source);
    check(&SmallFp16::SPEC, SmallFp16::SOURCES, SmallFp16::kernel_source);
    check(&GptOss::SPEC, GptOss::SOURCES, GptOss::kernel_source);
    check(&GptOssMxfp4::SPEC, GptOssMxfp4::SOURCES, GptOssMxfp4::kernel_source);
    check(&Qwen3Nvfp4Hw::SPEC, Qwen3Nvfp4Hw::SOURCES, Qwen3Nvfp4Hw::kernel_source);
    check(&Qwen3Awq::SPEC, Qwen3Awq::SOURCES, Qwen3Awq::kernel_source);
    check(&Qwen3Int4::SPEC, Qwen3Int4::SOURCES, Qwen3Int4::kernel_source);
    check(&Bf16WeightsFp16Acts::SPEC, Bf16WeightsFp16Acts::SOURCES, Bf16WeightsFp16Acts::kernel_source);
    check(&Fp8WeightsFp16Acts::SPEC, Fp8WeightsFp16Acts::SOURCES, Fp8WeightsFp16Acts::kernel_source);
    assert!(Qwen3Nvfp4Hw::SOURCES.iter().all(|s| s.3.contains("cvt.rn.f16x2.e2m1x2")));
    assert!(Qwen3Awq::SOURCES.iter().all(|s| s.3.contains("w_lut") && s.2.ends_with("_lut")));
}

#[test]
fn undeclared_pairs_have_no_source() {
    assert!(Olmoe::kernel_source(KernelFamily::WarpDecode, Arch::Sm100a).is_none());
    assert!(Olmoe::kernel_source(KernelFamily::WarpDecode, Arch::Sm90a).is_some());
    // The fp8 source is not the bf16 one.
    let (q, o) = (Qwen3Moe::SOURCES[0].3, Olmoe::SOURCES[0].3);
    assert_ne!(q, o);
    assert!(o.contains("__NV_E4M3"));
}

#[test]
fn load_has_the_runtime_signature() {
    let _: fn(
        &moeforge::runtime::Device,
        &moeforge::runtime::HostWeights,
    ) -> Result<moeforge::runtime::MoeLayer, moeforge::runtime::RuntimeError> = Qwen3Moe::load;
}

/// Both families from one description: the prefill module is rendered at expansion too.
#[moe_kernel(hidden = 2048, intermediate = 768, experts = 128, top_k = 8, families = [warp_decode, grouped_gemm],
             archs = [sm_90a, sm_120a])]
struct Qwen3Both;

#[test]
fn grouped_family_sources_equal_the_runtime_render() {
    assert_eq!(Qwen3Both::FAMILIES, &[KernelFamily::WarpDecode, KernelFamily::GroupedGemm]);
    for arch in [Arch::Sm90a, Arch::Sm120a] {
        let k = Qwen3Both::kernel_source(KernelFamily::GroupedGemm, arch).expect("declared");
        assert_eq!(k, render(&Qwen3Both::SPEC, KernelFamily::GroupedGemm, arch).unwrap());
        assert!(k.entry_points.contains(&"moe_gemm1".to_string()));
    }
    assert!(Qwen3Both::kernel_source(KernelFamily::GroupedGemm, Arch::Sm100a).is_none());
}

/// The grouped family's large-step module: embedded for decoded weights on sm_90a (the layer's
/// `load` adds it), equal to the runtime render with `large_step_tiles`; none for bf16 or the
/// mma.sync archs.
#[test]
fn large_step_sources_equal_the_runtime_render() {
    use moeforge::codegen::heuristics::large_step_tiles;
    let tiles = large_step_tiles(&Qwen3Int4::SPEC, Arch::Sm90a).expect("int4 decodes on sm_90a");
    let k = Qwen3Int4::large_step_source(Arch::Sm90a).expect("embedded");
    assert_eq!(k, moeforge::codegen::render_grouped(&Qwen3Int4::SPEC, Arch::Sm90a, tiles).unwrap());
    assert_eq!((k.grouped_tiles, k.block_threads), (Some(tiles), 384));
    assert_eq!(Qwen3Int4::LARGE_STEP_SOURCES.len(), 1);
    for arch in [Arch::Sm100a, Arch::Sm120a] {
        assert!(Qwen3Int4::large_step_source(arch).is_none());
    }
    assert!(Qwen3Both::LARGE_STEP_SOURCES.is_empty() && Qwen3Both::large_step_source(Arch::Sm90a).is_none());
}
