//! How the kernels turn a weight code into a float: the [`DequantVariant`] of a spec.
//!
//! | variant | what it does | where |
//! |---|---|---|
//! | `lut` | a table of every code's value in **shared** memory, filled from a `__constant__` copy at kernel start (constant memory serializes when a warp's lanes read different entries; shared memory serves a 16-entry table without bank conflicts and a 256-entry one with few) | every codec but bf16 / fp16 |
//! | `bits` | LUT-free: the float built from the code with integer ops. INT8 / INT4: the exact `0x6400 \| code` fp16 magic number, minus `1024 + zero` (FasterTransformer's trick); e4m3 / e2m1: sign, exponent and mantissa moved into an fp16 with masks and shifts, then one multiply by the exponent-bias power of two (subnormals come out exact) | every codec but fp16 |
//! | `hardware` | the arch's conversion instructions: `cvt.rn.f16x2.e4m3x2` (sm_89+), `cvt.rn.f16x2.e2m1x2` (sm_100a / sm_120a), `I2F` for integers, `cvt.f32.f16`. sm_90 has no e2m1 conversion: there each e2m1 code becomes an e4m3 byte with shifts and masks (its value times 2^-6, exact, undone in fp32 per dot product) and goes through `cvt.rn.f16x2.e4m3x2`, 7 logic ops and 4 `cvt` per 8 codes | every codec but bf16 |
//!
//! Scales are decoded the same way in every variant (f16 -> f32 conversion, E8M0 by an exponent
//! shift, NVFP4's e4m3 block scales by `cvt`): one decode per group, not per element.
//!
//! # Defaults per (format, arch)
//!
//! Chosen when a spec names no variant, by [`WeightFormat::default_dequant`]:
//! - bf16: `bits` (a 16-bit shift; its only variant); fp16: `hardware` (its only variant);
//! - FP8 e4m3 formats: `hardware` on every arch: one `cvt` per two codes, fewer instructions than
//!   `bits` (three logic ops and a multiply per pair), and the path fp8 had before variants existed;
//! - INT8 / INT4: `bits` on every arch: the magic number costs one `LOP3` and one `HSUB2` per pair,
//!   against a quarter-rate `I2F` per element, and no table;
//! - FP4 on sm_90: `hardware` (through e4m3): on the H100 (Qwen3, M = 1, two same-run sweeps) it
//!   ran nvfp4 in 13.3 us against 14.5 for `bits` (five ops per pair: two shifts, two logic ops
//!   and the bias multiply) and mxfp4 in 12.0 against 12.8 us;
//! - FP4 on sm_100a / sm_120a: `bits`, even where `cvt.rn.f16x2.e2m1x2` exists: the warp-decode
//!   write-up this crate follows (RTX PRO 6000, sm_120) measured the hardware FP4 decode slower
//!   than the bit-built float, and measured a constant-memory table 41 us slower on a 6 us kernel.
//!
//! The benchmark (`cargo bench --bench decode -- --report`) times every variant on the device at hand.

use crate::format::{Codec, WeightFormat};
use crate::spec::{Arch, SpecError};
use std::fmt;
use std::str::FromStr;

/// How the kernels decode weight codes. Part of the rendered source, hence of the JIT cache key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum DequantVariant {
    /// A table of every code's value, in shared memory.
    Lut,
    /// LUT-free: the float built from the code's bits with integer ops.
    Bits,
    /// The arch's conversion instructions.
    Hardware,
}

impl DequantVariant {
    /// Every variant (not every format has each; see [`crate::WeightFormat::dequant_variants`]).
    pub const ALL: [DequantVariant; 3] = [DequantVariant::Lut, DequantVariant::Bits, DequantVariant::Hardware];
    /// The name `#[moe_kernel]`, `FromStr` and `Display` use (`lut`, `bits`, `hardware`).
    pub const fn name(self) -> &'static str {
        match self {
            DequantVariant::Lut => "lut",
            DequantVariant::Bits => "bits",
            DequantVariant::Hardware => "hardware",
        }
    }
}

impl FromStr for DequantVariant {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        DequantVariant::ALL.into_iter().find(|v| v.name() == s).ok_or_else(|| SpecError::Unknown {
            what: "dequant variant",
            got: s.to_string(),
            expected: "lut, bits, hardware",
        })
    }
}

impl fmt::Display for DequantVariant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl WeightFormat {
    /// The variants the format has on at least one arch.
    pub const fn dequant_variants(self) -> &'static [DequantVariant] {
        match self.codec() {
            Codec::Bf16 => &[DequantVariant::Bits],
            Codec::Fp16 => &[DequantVariant::Hardware],
            _ => &DequantVariant::ALL,
        }
    }

    /// Whether the format has variant `v` at all (spec-time check).
    pub const fn has_dequant(self, v: DequantVariant) -> bool {
        let all = self.dequant_variants();
        let mut i = 0;
        while i < all.len() {
            if all[i] as u8 == v as u8 {
                return true;
            }
            i += 1;
        }
        false
    }

    /// Whether `arch` has variant `v` of this format; `Err` says why not.
    pub const fn dequant_on(self, v: DequantVariant, arch: Arch) -> Result<(), &'static str> {
        if !self.has_dequant(v) {
            return Err(match self.codec() {
                Codec::Bf16 => "bf16 weights have one variant, `bits` (the widening is a 16-bit shift)",
                _ => "fp16 weights have one variant, `hardware` (cvt.f32.f16)",
            });
        }
        // Every arch moeforge targets has every variant of a format today (sm_90's `hardware`
        // FP4 decode goes through e4m3); an arch that lacks one gets its `Err` arm here.
        let _ = arch;
        Ok(())
    }

    /// The variant used when the spec names none (see the module docs for why).
    pub const fn default_dequant(self, arch: Arch) -> DequantVariant {
        match (self.codec(), arch) {
            (Codec::Fp16 | Codec::E4m3, _) | (Codec::E2m1, Arch::Sm90a) => DequantVariant::Hardware,
            _ => DequantVariant::Bits,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_exist_on_every_arch() {
        for f in WeightFormat::ALL {
            for a in Arch::ALL {
                let d = f.default_dequant(a);
                assert_eq!(f.dequant_on(d, a), Ok(()), "{f} {a} {d}");
            }
        }
    }

    #[test]
    fn availability() {
        use DequantVariant::*;
        assert!(WeightFormat::Nvfp4.dequant_on(Hardware, Arch::Sm90a).is_ok());
        assert!(WeightFormat::Mxfp4.dequant_on(Hardware, Arch::Sm100a).is_ok());
        assert!(WeightFormat::Mxfp4.dequant_on(Hardware, Arch::Sm120a).is_ok());
        assert!(WeightFormat::Int4G128.dequant_on(Lut, Arch::Sm90a).is_ok());
        assert!(!WeightFormat::Bf16.has_dequant(Lut));
        assert!(WeightFormat::Fp16.dequant_on(Bits, Arch::Sm90a).is_err());
        assert_eq!("hardware".parse::<DequantVariant>(), Ok(Hardware));
        assert!("table".parse::<DequantVariant>().is_err());
    }
}
