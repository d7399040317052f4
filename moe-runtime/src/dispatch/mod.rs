//! Which family runs a step: the one function every step goes through, so that the cost-model
//! dispatcher replaces it and nothing else.

use moe_codegen::{KernelFamily, MoeSpec};

pub mod wave;

/// The token count from which a layer takes the grouped GEMMs unless told otherwise
/// (`MoeLayer::set_prefill_threshold`): [`crate::DEFAULT_PREFILL_THRESHOLD`] where the tensor
/// cores read the weights as stored, [`DECODED_PREFILL_THRESHOLD`] where the grouped loader
/// decodes them (`moe_codegen::grouped::dequantizes_weights`).
pub fn default_prefill_threshold(spec: &MoeSpec) -> usize {
    if moe_codegen::grouped::dequantizes_weights(spec.weight_format()) {
        DECODED_PREFILL_THRESHOLD
    } else {
        crate::DEFAULT_PREFILL_THRESHOLD
    }
}

/// The grouped threshold for weights the loader decodes. Qwen3-30B-A3B on the H100, uniform
/// routing, grouped against warp decode (us): mxfp4 at M = 16, 64, 256: 568 / 213, 835 / 721,
/// 847 / 2826; int8: 793 / 183, 1168 / 634, 1185 / 2635 (benches/results/h100-prefill.json).
pub const DECODED_PREFILL_THRESHOLD: usize = 128;

/// The family for a step of `m` tokens: the grouped GEMMs from `prefill_threshold` tokens on,
/// where the layer has them; warp decode otherwise.
pub fn choose_family(m: usize, prefill_threshold: usize, grouped_available: bool) -> KernelFamily {
    if m >= prefill_threshold && grouped_available {
        KernelFamily::GroupedGemm
    } else {
        KernelFamily::WarpDecode
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threshold_and_availability() {
        assert_eq!(choose_family(15, 16, true), KernelFamily::WarpDecode);
        assert_eq!(choose_family(16, 16, true), KernelFamily::GroupedGemm);
        assert_eq!(choose_family(1 << 20, 16, false), KernelFamily::WarpDecode);
        assert_eq!(choose_family(1, 1, true), KernelFamily::GroupedGemm);
    }

    #[test]
    fn decoded_weights_cross_over_later() {
        let spec = |f| MoeSpec::builder(2048, 768, 128, 8).weight_format(f).build().unwrap();
        assert_eq!(default_prefill_threshold(&spec(moe_codegen::WeightFormat::Bf16)), crate::DEFAULT_PREFILL_THRESHOLD);
        assert_eq!(
            default_prefill_threshold(&spec(moe_codegen::WeightFormat::Fp8E4m3)),
            crate::DEFAULT_PREFILL_THRESHOLD
        );
        assert_eq!(default_prefill_threshold(&spec(moe_codegen::WeightFormat::Mxfp4)), DECODED_PREFILL_THRESHOLD);
    }
}
