//! Weight formats: how a `[rows, cols]` matrix (rows = output channels, cols = the reduction axis K)
//! is stored, quantized and dequantized. The CUDA side of each format is one include,
//! `templates/dequant_<format>.cuh`; kernel families never special-case a format beyond that.

use crate::spec::{ActDtype, SpecError};
use std::fmt;
use std::str::FromStr;

/// How expert weights are stored on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum WeightFormat {
    /// bfloat16, no scales.
    Bf16,
    /// IEEE half, no scales.
    Fp16,
    /// FP8 e4m3 (`e4m3fn`: max 448, no infinities) with one fp32 scale per output channel (row):
    /// `w[r][c] = scale[r] * fp8[r][c]`. Scales are a separate `[experts, rows]` f32 tensor.
    Fp8E4m3,
}

/// Why quantization refused its input.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QuantError {
    #[error("weight at row {row}, column {col} is {value}: NaN and infinities cannot be quantized")]
    NonFinite { row: usize, col: usize, value: f32 },
    #[error("expected {expected} values for a {rows}x{cols} matrix, got {got}")]
    Shape { rows: usize, cols: usize, expected: usize, got: usize },
}

/// A quantized `[rows, cols]` matrix: raw element bytes plus per-row scales (empty if none).
#[derive(Debug, Clone, PartialEq)]
pub struct Packed {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<u8>,
    pub scales: Vec<f32>,
}

impl WeightFormat {
    pub const ALL: [WeightFormat; 3] = [WeightFormat::Bf16, WeightFormat::Fp16, WeightFormat::Fp8E4m3];

    pub const fn name(self) -> &'static str {
        match self {
            WeightFormat::Bf16 => "bf16",
            WeightFormat::Fp16 => "fp16",
            WeightFormat::Fp8E4m3 => "fp8_e4m3",
        }
    }
    /// Bytes per stored element.
    pub const fn elem_bytes(self) -> u32 {
        match self {
            WeightFormat::Bf16 | WeightFormat::Fp16 => 2,
            WeightFormat::Fp8E4m3 => 1,
        }
    }
    /// Elements in one 16-byte vector load: the unit every kernel streams weights in.
    pub const fn elems_per_16b(self) -> u32 {
        16 / self.elem_bytes()
    }
    /// Whether the format carries one fp32 scale per output row.
    pub const fn has_row_scales(self) -> bool {
        matches!(self, WeightFormat::Fp8E4m3)
    }
    /// The activation dtype used when the spec names none.
    pub const fn default_act_dtype(self) -> ActDtype {
        match self {
            WeightFormat::Fp16 => ActDtype::Fp16,
            _ => ActDtype::Bf16,
        }
    }
    /// Bytes of a `[rows, cols]` matrix in this format, scales included.
    pub const fn bytes_for(self, rows: usize, cols: usize) -> usize {
        let scales = if self.has_row_scales() { rows * 4 } else { 0 };
        rows * cols * self.elem_bytes() as usize + scales
    }

    /// Quantize a row-major `[rows, cols]` f32 matrix.
    pub fn quantize(self, rows: usize, cols: usize, w: &[f32]) -> Result<Packed, QuantError> {
        if w.len() != rows * cols {
            return Err(QuantError::Shape { rows, cols, expected: rows * cols, got: w.len() });
        }
        if let Some(i) = w.iter().position(|v| !v.is_finite()) {
            return Err(QuantError::NonFinite { row: i / cols.max(1), col: i % cols.max(1), value: w[i] });
        }
        let (data, scales) = match self {
            WeightFormat::Bf16 => (w.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect(), vec![]),
            WeightFormat::Fp16 => (w.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect(), vec![]),
            WeightFormat::Fp8E4m3 => {
                let mut data = Vec::with_capacity(w.len());
                let mut scales = Vec::with_capacity(rows);
                for row in w.chunks(cols.max(1)).take(rows) {
                    let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let scale = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
                    data.extend(row.iter().map(|&v| e4m3_from_f32(v / scale)));
                    scales.push(scale);
                }
                (data, scales)
            }
        };
        Ok(Packed { rows, cols, data, scales })
    }

    /// Dequantize to f32 exactly as the kernels do (element value times row scale, in f32).
    pub fn dequantize(self, p: &Packed) -> Vec<f32> {
        let cols = p.cols.max(1);
        match self {
            WeightFormat::Bf16 => {
                p.data.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
            }
            WeightFormat::Fp16 => {
                p.data.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
            }
            WeightFormat::Fp8E4m3 => {
                p.data.iter().enumerate().map(|(i, &b)| e4m3_to_f32(b) * p.scales[i / cols]).collect()
            }
        }
    }
}

impl FromStr for WeightFormat {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        WeightFormat::ALL.into_iter().find(|v| v.name() == s).ok_or_else(|| SpecError::Unknown {
            what: "weight format",
            got: s.to_string(),
            expected: "bf16, fp16, fp8_e4m3",
        })
    }
}

impl fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Largest finite e4m3fn value.
pub const E4M3_MAX: f32 = 448.0;

/// Decode one e4m3fn byte (bias 7, no infinities, 0x7f/0xff are NaN).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0xf) as i32;
    let m = (b & 7) as f32;
    if e == 15 && b & 7 == 7 {
        return f32::NAN;
    }
    let mag = if e == 0 { m / 8.0 * 2f32.powi(-6) } else { (1.0 + m / 8.0) * 2f32.powi(e - 7) };
    sign * mag
}

/// Encode to e4m3fn: round to nearest, ties to even, saturating at ±448.
pub fn e4m3_from_f32(v: f32) -> u8 {
    if v.is_nan() {
        return 0x7f;
    }
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = v.abs();
    if a >= E4M3_MAX {
        return sign | 0x7e;
    }
    // Codes 0..=0x7e are the non-negative finite values in increasing order.
    let (mut lo, mut hi) = (0u8, 0x7eu8);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if e4m3_to_f32(mid) <= a {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let (dl, dh) = (a - e4m3_to_f32(lo), e4m3_to_f32(hi) - a);
    let code = if dl < dh || (dl == dh && lo & 1 == 0) { lo } else { hi };
    sign | code
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_roundtrips_every_finite_code() {
        for b in 0u8..=255 {
            let v = e4m3_to_f32(b);
            if v.is_nan() {
                assert!(b & 0x7f == 0x7f);
                continue;
            }
            let back = e4m3_from_f32(v);
            // +0 and -0 both round-trip to themselves.
            assert_eq!(back, b, "code {b:#x} value {v}");
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    }

    #[test]
    fn e4m3_rounds_to_nearest_even_and_saturates() {
        // 1.0 = 0x38, next is 1.125 = 0x39; 1.0625 is a tie -> even (0x38).
        assert_eq!(e4m3_from_f32(1.0625), 0x38);
        assert_eq!(e4m3_from_f32(1.07), 0x39);
        assert_eq!(e4m3_from_f32(1e6), 0x7e);
        assert_eq!(e4m3_from_f32(-1e6), 0xfe);
    }

    #[test]
    fn fp8_quantize_is_close_and_per_row() {
        let (rows, cols) = (3, 64);
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) * (1 + i / cols) as f32).collect();
        let p = WeightFormat::Fp8E4m3.quantize(rows, cols, &w).unwrap();
        assert_eq!(p.scales.len(), rows);
        let d = WeightFormat::Fp8E4m3.dequantize(&p);
        for (a, b) in w.iter().zip(&d) {
            assert!((a - b).abs() <= a.abs() * 0.0625 + 1e-3, "{a} vs {b}");
        }
        // The row maximum maps to exactly 448 * scale.
        let amax = w[..cols].iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!((d[..cols].iter().fold(0f32, |m, v| m.max(v.abs())) - amax).abs() < 1e-4 * amax);
    }

    #[test]
    fn zero_rows_get_unit_scale() {
        let p = WeightFormat::Fp8E4m3.quantize(2, 16, &[0.0; 32]).unwrap();
        assert_eq!(p.scales, vec![1.0, 1.0]);
        assert!(WeightFormat::Fp8E4m3.dequantize(&p).iter().all(|&v| v == 0.0));
    }

    #[test]
    fn non_finite_and_bad_shapes_are_refused() {
        let mut w = vec![1.0f32; 32];
        w[17] = f32::NAN;
        assert!(matches!(WeightFormat::Bf16.quantize(2, 16, &w), Err(QuantError::NonFinite { row: 1, col: 1, .. })));
        assert!(matches!(WeightFormat::Fp8E4m3.quantize(2, 16, &w), Err(QuantError::NonFinite { row: 1, col: 1, .. })));
        w[17] = f32::INFINITY;
        assert!(matches!(WeightFormat::Fp16.quantize(2, 16, &w), Err(QuantError::NonFinite { .. })));
        assert!(matches!(WeightFormat::Bf16.quantize(3, 16, &w), Err(QuantError::Shape { expected: 48, got: 32, .. })));
    }

    #[test]
    fn half_formats_roundtrip_representable_values() {
        let w: Vec<f32> = (0..64).map(|i| (i as f32 - 32.0) * 0.25).collect();
        for f in [WeightFormat::Bf16, WeightFormat::Fp16] {
            assert_eq!(f.dequantize(&f.quantize(4, 16, &w).unwrap()), w);
        }
    }
}
