//! Which family runs a step: the one function every step goes through, so that the cost-model
//! dispatcher replaces it and nothing else.

use moe_codegen::KernelFamily;

pub mod wave;

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
}
