//! Which family runs a step: the one function every step goes through, so that the cost-model
//! dispatcher replaces it and nothing else.

use moe_codegen::KernelFamily;

pub mod model;
pub mod profile;
pub mod wave;

pub use model::{
    DeviceMenu, DispatchModel, LinearCost, ModelFitError, ModelSource, Sample, DEFAULT_OVERHEAD_US, DEVICE_MARGIN,
};
pub use profile::{profile, DispatchProfile, ProfileError};

/// What the dispatcher chose for a step, as [`crate::MoeLayer::last_choice`] reads it back.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    /// The family that ran.
    pub family: KernelFamily,
    /// Whether the device chose it from the live routing (`false`: the host, from the token count
    /// alone, because no routing could change the answer or dispatch is off).
    pub on_device: bool,
    /// Tokens in the step.
    pub m: usize,
    /// Distinct experts the device counted (0 where the host chose).
    pub distinct: u32,
    /// Valid (token, expert) pairs the device counted (0 where the host chose).
    pub pairs: u32,
    /// The model's prediction for warp decode, us (0 where the host chose).
    pub predicted_decode_us: f32,
    /// The model's prediction for the grouped GEMMs, us (0 where the host chose).
    pub predicted_grouped_us: f32,
    /// The model's prediction for the fused family, us (0 where the host chose or the layer has
    /// no fused family).
    pub predicted_fused_us: f32,
}

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
