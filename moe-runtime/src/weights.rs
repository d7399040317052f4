//! Expert weights on the host, in the layout of [`MoeSpec`]: `w13 [E, 2I, H]` (gate rows, then
//! up rows), `w2 [E, H, I]`, each as the format's raw bytes plus per-row scales where it has them.

use crate::error::{Result, RuntimeError};
use moe_codegen::{MoeSpec, Packed, QuantError, WeightFormat};

#[derive(Debug, Clone)]
pub struct HostWeights {
    pub w13: Vec<u8>,
    /// `[E, 2I]` when the format has row scales, else empty.
    pub w13_scales: Vec<f32>,
    pub w2: Vec<u8>,
    /// `[E, H]` when the format has row scales, else empty.
    pub w2_scales: Vec<f32>,
}

impl HostWeights {
    /// Quantize f32 weights (`w13 [E, 2I, H]`, `w2 [E, H, I]`) into the spec's format.
    pub fn quantize(spec: &MoeSpec, w13: &[f32], w2: &[f32]) -> std::result::Result<HostWeights, QuantError> {
        let (e, h, i) = (spec.experts() as usize, spec.hidden() as usize, spec.intermediate() as usize);
        let f = spec.weight_format();
        let a = f.quantize(e * 2 * i, h, w13)?;
        let b = f.quantize(e * h, i, w2)?;
        Ok(HostWeights { w13: a.data, w13_scales: a.scales, w2: b.data, w2_scales: b.scales })
    }

    /// Check sizes against the spec.
    pub fn validate(&self, spec: &MoeSpec) -> Result<()> {
        let f = spec.weight_format();
        let eb = f.elem_bytes() as usize;
        let (e, h, i) = (spec.experts() as usize, spec.hidden() as usize, spec.intermediate() as usize);
        let check = |what, got: usize, expected: usize| {
            if got == expected {
                Ok(())
            } else {
                Err(RuntimeError::Shape { what, expected: format!("{expected} elements"), got: format!("{got}") })
            }
        };
        check("w13 bytes", self.w13.len(), spec.w13_elems() * eb)?;
        check("w2 bytes", self.w2.len(), spec.w2_elems() * eb)?;
        let rs = f.has_row_scales();
        check("w13_scales", self.w13_scales.len(), if rs { e * 2 * i } else { 0 })?;
        check("w2_scales", self.w2_scales.len(), if rs { e * h } else { 0 })?;
        Ok(())
    }

    /// Row `r` of expert `e`'s `w13` (`r < 2I`), dequantized exactly as the kernels read it.
    pub fn w13_row(&self, spec: &MoeSpec, e: usize, r: usize) -> Vec<f32> {
        let (h, i) = (spec.hidden() as usize, spec.intermediate() as usize);
        row(spec.weight_format(), &self.w13, &self.w13_scales, e * 2 * i + r, h)
    }
    /// Row `r` of expert `e`'s `w2` (`r < H`), dequantized.
    pub fn w2_row(&self, spec: &MoeSpec, e: usize, r: usize) -> Vec<f32> {
        let (h, i) = (spec.hidden() as usize, spec.intermediate() as usize);
        row(spec.weight_format(), &self.w2, &self.w2_scales, e * h + r, i)
    }
}

fn row(f: WeightFormat, data: &[u8], scales: &[f32], r: usize, cols: usize) -> Vec<f32> {
    let eb = f.elem_bytes() as usize;
    let p = Packed {
        rows: 1,
        cols,
        data: data[r * cols * eb..(r + 1) * cols * eb].to_vec(),
        scales: if f.has_row_scales() { vec![scales[r]] } else { vec![] },
    };
    f.dequantize(&p)
}
