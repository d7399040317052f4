//! Expert weights on the host, in the layout of [`MoeSpec`]: `w13 [E, 2I, H]` (gate rows, then
//! up rows), `w2 [E, H, I]`, each as the format's code bytes plus its scale bytes, laid out as
//! `moe_codegen::format` documents (each expert one stacked tensor: NVFP4 keeps one global scale
//! per expert and matrix, so gate and up of one expert share theirs).

use crate::error::{Result, RuntimeError};
use moe_codegen::{MoeSpec, QuantError};

#[derive(Debug, Clone)]
pub struct HostWeights {
    pub w13: Vec<u8>,
    /// The format's scale bytes for the `E` stacked `[2I, H]` matrices of `w13` (empty if none).
    pub w13_scales: Vec<u8>,
    pub w2: Vec<u8>,
    /// The format's scale bytes for the `E` stacked `[H, I]` matrices of `w2` (empty if none).
    pub w2_scales: Vec<u8>,
}

impl HostWeights {
    /// Quantize f32 weights (`w13 [E, 2I, H]`, `w2 [E, H, I]`) into the spec's format, one tensor
    /// per expert, experts in parallel.
    pub fn quantize(spec: &MoeSpec, w13: &[f32], w2: &[f32]) -> std::result::Result<HostWeights, QuantError> {
        let (e, h, i) = (spec.experts() as usize, spec.hidden() as usize, spec.intermediate() as usize);
        let f = spec.weight_format();
        let a = f.quantize_stacked(e, 2 * i, h, w13)?;
        let b = f.quantize_stacked(e, h, i, w2)?;
        Ok(HostWeights { w13: a.data, w13_scales: a.scales, w2: b.data, w2_scales: b.scales })
    }

    /// Check sizes against the spec.
    pub fn validate(&self, spec: &MoeSpec) -> Result<()> {
        let f = spec.weight_format();
        let (e, h, i) = (spec.experts() as usize, spec.hidden() as usize, spec.intermediate() as usize);
        let check = |what, got: usize, expected: usize| {
            if got == expected {
                Ok(())
            } else {
                Err(RuntimeError::Shape { what, expected: format!("{expected} bytes"), got: format!("{got}") })
            }
        };
        check("w13 bytes", self.w13.len(), f.data_bytes(e * 2 * i, h))?;
        check("w2 bytes", self.w2.len(), f.data_bytes(e * h, i))?;
        check("w13_scales", self.w13_scales.len(), f.scale_bytes(e, 2 * i, h))?;
        check("w2_scales", self.w2_scales.len(), f.scale_bytes(e, h, i))?;
        Ok(())
    }

    /// Row `r` of expert `e`'s `w13` (`r < 2I`), dequantized exactly as the kernels read it.
    pub fn w13_row(&self, spec: &MoeSpec, e: usize, r: usize) -> Vec<f32> {
        let (n, h, i) = (spec.experts() as usize, spec.hidden() as usize, spec.intermediate() as usize);
        spec.weight_format().dequantize_row(&self.w13, &self.w13_scales, n, n * 2 * i, h, e * 2 * i + r)
    }
    /// Row `r` of expert `e`'s `w2` (`r < H`), dequantized.
    pub fn w2_row(&self, spec: &MoeSpec, e: usize, r: usize) -> Vec<f32> {
        let (n, h, i) = (spec.experts() as usize, spec.hidden() as usize, spec.intermediate() as usize);
        spec.weight_format().dequantize_row(&self.w2, &self.w2_scales, n, n * h, i, e * h + r)
    }
}
