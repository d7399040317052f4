//! Property tests of the spec builder against the renderer: every spec the builder accepts
//! renders for every arch and every family it claims (or is refused there with a typed reason that
//! names the arch), and every refusal is a typed `SpecError` with a message.

use moe_codegen::{
    grouped_support, render, ActDtype, Activation, Arch, CodegenError, DequantVariant, KernelFamily, MoeSpec,
    WeightFormat,
};
use proptest::prelude::*;

fn format() -> impl Strategy<Value = WeightFormat> {
    (0..WeightFormat::ALL.len()).prop_map(|i| WeightFormat::ALL[i])
}

/// Sizes around the divisors the formats care about (vectors of 8 to 32 elements, groups of 32
/// to 128, 128 x 128 blocks, 64-wide column tiles), zero and odd values included.
fn size() -> impl Strategy<Value = u32> {
    prop_oneof![
        3 => (1u32..=48).prop_map(|n| n * 64),
        1 => (1u32..=90).prop_map(|n| n * 32),
        1 => 0u32..=300,
        1 => Just(2880u32),
    ]
}

static ACCEPTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn accepted_specs_render_and_refusals_are_typed(
        hidden in size(),
        intermediate in size(),
        experts in prop_oneof![4 => 1u32..=160, 1 => 0u32..=1100],
        top_k in prop_oneof![4 => 1u32..=8, 1 => 0u32..=40],
        format in format(),
        variant in proptest::option::of(0..DequantVariant::ALL.len()),
        fp16 in any::<bool>(),
        gelu in any::<bool>(),
    ) {
        let mut b = MoeSpec::builder(hidden, intermediate, experts, top_k)
            .weight_format(format)
            .act_dtype(if fp16 { ActDtype::Fp16 } else { ActDtype::Bf16 })
            .activation(if gelu { Activation::GeluTanh } else { Activation::Silu });
        if let Some(v) = variant {
            b = b.dequant(DequantVariant::ALL[v]);
        }
        let spec = match b.build() {
            Ok(spec) => {
                ACCEPTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                spec
            }
            Err(e) => {
                // A typed refusal with a message that names what was wrong.
                prop_assert!(!e.to_string().is_empty());
                return Ok(());
            }
        };
        for arch in Arch::ALL {
            match render(&spec, KernelFamily::WarpDecode, arch) {
                Ok(src) => prop_assert!(!src.source.is_empty()),
                // Only a named variant some archs lack may be refused, and only on those archs.
                Err(CodegenError::DequantUnavailable { arch: a, .. }) => {
                    prop_assert!(spec.dequant().is_some() && a == arch)
                }
                Err(e) => prop_assert!(false, "{} on {arch}: accepted spec failed to render: {e}", spec.id()),
            }
            let grouped = render(&spec, KernelFamily::GroupedGemm, arch);
            match (grouped_support(&spec), grouped) {
                (Ok(()), Ok(src)) => prop_assert!(src.grouped_tiles.is_some()),
                (Ok(()), Err(e)) => prop_assert!(false, "{} on {arch}: grouped family claimed, not rendered: {e}", spec.id()),
                (Err(_), Ok(_)) => prop_assert!(false, "{}: grouped family refused, yet rendered", spec.id()),
                (Err(why), Err(CodegenError::Unsupported { .. })) => prop_assert!(!why.is_empty()),
                (Err(_), Err(e)) => prop_assert!(false, "{}: untyped grouped refusal: {e}", spec.id()),
            }
        }
    }
}

/// The strategies above must reach the renderer, not only the builder's refusals.
#[test]
fn most_drawn_specs_are_accepted() {
    accepted_specs_render_and_refusals_are_typed();
    let n = ACCEPTED.load(std::sync::atomic::Ordering::Relaxed);
    assert!(n >= 24, "only {n} of the drawn specs were accepted");
}

/// bf16 weights with fp16 activations: a valid spec for warp decode, but the grouped GEMMs
/// multiply in one 16-bit type, so that family refuses it rather than reading fp16 as bf16.
#[test]
fn bf16_weights_with_fp16_activations_have_no_grouped_family() {
    let spec = MoeSpec::builder(2048, 768, 128, 8).act_dtype(ActDtype::Fp16).build().unwrap();
    let why = grouped_support(&spec).unwrap_err();
    assert!(why.contains("fp16"), "{why}");
    for arch in Arch::ALL {
        assert!(matches!(render(&spec, KernelFamily::GroupedGemm, arch), Err(CodegenError::Unsupported { .. })));
        assert!(render(&spec, KernelFamily::WarpDecode, arch).is_ok());
    }
    let bf16 = MoeSpec::builder(2048, 768, 128, 8).build().unwrap();
    assert!(grouped_support(&bf16).is_ok());
    let fp8 = MoeSpec::builder(2048, 768, 128, 8).weight_format(WeightFormat::Fp8E4m3).act_dtype(ActDtype::Fp16);
    assert!(grouped_support(&fp8.build().unwrap()).is_ok(), "fp8 quantizes x from either dtype");
}

/// Hidden sizes that hold whole 16-byte vectors but not 16 bulk warps' rows (found by the
/// property test above): the bulk rings take fewer consumer warps, and warp decode renders.
#[test]
fn odd_hidden_sizes_render() {
    for h in [72u32, 104, 136, 2888] {
        let spec = MoeSpec::builder(h, 64, 8, 2).build().unwrap();
        for arch in Arch::ALL {
            render(&spec, KernelFamily::WarpDecode, arch).unwrap_or_else(|e| panic!("hidden {h} on {arch}: {e}"));
        }
    }
}
