//! Weight formats: how a `[rows, cols]` matrix (rows = output channels N, cols = the reduction
//! axis K) is stored, quantized and dequantized. The CUDA side of a format is one element codec
//! include (`templates/dequant_<codec>.cuh`, one section per
//! [`DequantVariant`](crate::DequantVariant)) plus one scale include
//! (`templates/scales_<layout>.cuh`), picked by `templates/dequant.cuh`; kernel families never
//! special-case a format beyond that.
//!
//! # Packed layouts
//!
//! A weight tensor is a stack of `T` matrices (the experts) of `N` rows and `K` columns, `R = T * N`
//! rows in all, row-major. Every format packs along K: one row's codes are contiguous.
//!
//! | format | codes (per element) | scales (bytes, little-endian) | value |
//! |---|---|---|---|
//! | `bf16`, `fp16` | 2 bytes | none | the 16-bit float |
//! | `fp8_e4m3` | e4m3fn byte | `[R]` f32, one per row | `e4m3 * s[r]` |
//! | `fp8_e4m3_b128` | e4m3fn byte | `[R/128, K/128]` f32, one per 128x128 block (DeepSeek-V3) | `e4m3 * s[r/128][c/128]` |
//! | `mxfp8` | e4m3fn byte | `[R, K/32]` E8M0 bytes | `e4m3 * 2^(e-127)` |
//! | `int8` | i8 (two's complement) | `[R]` f32 | `q * s[r]` |
//! | `int8_g{32,64,128}` | i8 | `[R, K/G]` f16 | `q * s[r][c/G]` |
//! | `int4` | nibble `u = q + 8` | `[R]` f32 | `(u - 8) * s[r]` |
//! | `int4_g{32,64,128}` | nibble `u = q + 8` | `[R, K/G]` f16 | `(u - 8) * s[r][c/G]` |
//! | `int4_asym`, `int4_asym_g{32,64,128}` | nibble `u` | `[R, K/G]` u32 records (`G = K` for `int4_asym`): bits 0-15 the f16 scale, bits 16-23 the zero point `z` (0..=15) | `(u - z) * s` |
//! | `nvfp4` | e2m1 nibble | `[T]` f32 global scales, then `[R, K/16]` e4m3 bytes | `e2m1 * e4m3 * g[r/N]` |
//! | `mxfp4` | e2m1 nibble | `[R, K/32]` E8M0 bytes | `e2m1 * 2^(e-127)` |
//!
//! 4-bit codes: element `2j` of a row in the low nibble of byte `j`, element `2j + 1` in the high
//! nibble (the order gpt-oss's MXFP4 and GPTQ's int32 words use). No interleaving is needed: the
//! kernels produce f32 values straight into registers, so any pairing of nibbles is free.
//!
//! Group scales of the integer formats are f16: half the bytes of f32, and the quantizers round
//! the scale to f16 *before* rounding the codes, so no accuracy is lost to it beyond f16's range
//! (a group whose scale would exceed 65504 is refused with [`QuantError::OutOfRange`]). Per-row
//! scales stay f32 (they cost nothing next to a row). E8M0 code 0xff (NaN) and the e4m3 NaN codes
//! are never produced; what the kernels make of them is unspecified.
//!
//! Dequantization is defined, bit for bit, as `((code - zero) * group_scale) * row_scale` in f32,
//! in that order, where `group_scale` is the per-group (or per-block) scale, 1 when the format has
//! none, and `row_scale` the per-row f32 scale or NVFP4's per-tensor global, 1 when none.

use crate::numerics::{e2m1_from_f32, e2m1_to_f32, e8m0_for_amax, e8m0_to_f32, rne, E2M1_EMAX, E2M1_MAX, E4M3_EMAX};
pub use crate::numerics::{e4m3_from_f32, e4m3_to_f32, E4M3_MAX};
use crate::spec::{ActDtype, SpecError};
use half::f16;
use std::fmt;
use std::str::FromStr;

/// How expert weights are stored on the device. See the module docs for each layout.
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
    /// FP8 e4m3 with one f32 scale per 128x128 block (DeepSeek-V3's `weight_scale_inv`).
    Fp8E4m3B128,
    /// OCP MXFP8: e4m3 with one E8M0 scale per 32 elements along K.
    Mxfp8,
    /// INT8 weight-only, symmetric, one f32 scale per output channel.
    Int8,
    /// INT8 symmetric, one f16 scale per 32 elements along K.
    Int8G32,
    /// INT8 symmetric, one f16 scale per 64 elements along K.
    Int8G64,
    /// INT8 symmetric, one f16 scale per 128 elements along K.
    Int8G128,
    /// INT4 symmetric (offset-binary nibbles, zero 8), one f32 scale per output channel.
    Int4,
    /// INT4 symmetric, one f16 scale per 32 along K.
    Int4G32,
    /// INT4 symmetric, one f16 scale per 64 along K.
    Int4G64,
    /// INT4 symmetric, one f16 scale per 128 along K.
    Int4G128,
    /// INT4 asymmetric (GPTQ / AWQ style): one f16 scale and one integer zero point per row.
    Int4Asym,
    /// INT4 asymmetric, scale and zero point per 32 along K.
    Int4AsymG32,
    /// INT4 asymmetric, scale and zero point per 64 along K.
    Int4AsymG64,
    /// INT4 asymmetric, scale and zero point per 128 along K.
    Int4AsymG128,
    /// NVFP4: e2m1 with one e4m3 scale per 16 along K and one f32 global scale per tensor (expert).
    Nvfp4,
    /// OCP MXFP4 (as gpt-oss ships): e2m1 with one E8M0 scale per 32 along K.
    Mxfp4,
}

/// How one element is coded: what the kernels' `dequant_vec` decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codec {
    /// bfloat16.
    Bf16,
    /// IEEE half.
    Fp16,
    /// FP8 e4m3fn byte.
    E4m3,
    /// Two's complement i8.
    Int8,
    /// Unsigned nibble minus a zero point (8 for the symmetric formats).
    Uint4,
    /// FP4 e2m1 nibble.
    E2m1,
}

impl Codec {
    /// The codec's include suffix: `dequant_<name>.cuh`.
    pub const fn name(self) -> &'static str {
        match self {
            Codec::Bf16 => "bf16",
            Codec::Fp16 => "fp16",
            Codec::E4m3 => "e4m3",
            Codec::Int8 => "int8",
            Codec::Uint4 => "uint4",
            Codec::E2m1 => "e2m1",
        }
    }
}

/// Where a format's scales live and what one covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScaleLayout {
    /// No scales.
    None,
    /// One f32 per row.
    RowF32,
    /// One f32 per 128x128 block.
    Block128F32,
    /// One E8M0 byte per `group` elements along K.
    E8m0 {
        /// Elements along K per scale.
        group: u32,
    },
    /// One f16 per `group` elements along K.
    GroupF16 {
        /// Elements along K per scale.
        group: u32,
    },
    /// One u32 record (f16 scale, u8 zero point) per `group` elements along K; `group == 0`: one per row.
    GroupF16Zero {
        /// Elements along K per record; 0: one record per row.
        group: u32,
    },
    /// One e4m3 byte per 16 along K, after one f32 global per tensor.
    Nvfp4,
}

impl ScaleLayout {
    /// The layout's include suffix: `scales_<name>.cuh`.
    pub const fn name(self) -> &'static str {
        match self {
            ScaleLayout::None => "none",
            ScaleLayout::RowF32 => "row",
            ScaleLayout::Block128F32 => "block128",
            ScaleLayout::E8m0 { .. } => "e8m0",
            ScaleLayout::GroupF16 { .. } => "f16",
            ScaleLayout::GroupF16Zero { .. } => "f16_zero",
            ScaleLayout::Nvfp4 => "nvfp4",
        }
    }
    /// Elements along K one scale covers; 0 where a scale covers a whole row (or there is none).
    pub const fn group(self) -> u32 {
        match self {
            ScaleLayout::None | ScaleLayout::RowF32 => 0,
            ScaleLayout::Block128F32 => 128,
            ScaleLayout::Nvfp4 => 16,
            ScaleLayout::E8m0 { group } | ScaleLayout::GroupF16 { group } | ScaleLayout::GroupF16Zero { group } => {
                group
            }
        }
    }
}

/// Why quantization refused its input.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QuantError {
    /// A weight is NaN or infinite.
    #[error("weight at row {row}, column {col} is {value}: NaN and infinities cannot be quantized")]
    NonFinite {
        /// Row of the weight (across all tensors).
        row: usize,
        /// Column of the weight.
        col: usize,
        /// The value found.
        value: f32,
    },
    /// The value count does not match `rows * cols`.
    #[error("expected {expected} values for a {rows}x{cols} matrix, got {got}")]
    Shape {
        /// Rows asked for.
        rows: usize,
        /// Columns asked for.
        cols: usize,
        /// `rows * cols`.
        expected: usize,
        /// Values given.
        got: usize,
    },
    /// The format cannot lay out a matrix of this shape (e.g. K not a multiple of its group).
    #[error("{format} cannot store a {rows}x{cols} matrix: {why}")]
    Layout {
        /// The weight format.
        format: WeightFormat,
        /// Rows asked for.
        rows: usize,
        /// Columns asked for.
        cols: usize,
        /// What the shape violates.
        why: &'static str,
    },
    /// A weight beyond what the format's f16 group scale can reach.
    #[error(
        "weight at row {row}, column {col} is {value}: {format} holds magnitudes up to {max} (its f16 scale saturates)"
    )]
    OutOfRange {
        /// The weight format.
        format: WeightFormat,
        /// Row of the weight (across all tensors).
        row: usize,
        /// Column of the weight.
        col: usize,
        /// The value found.
        value: f32,
        /// The largest magnitude the format holds.
        max: f32,
    },
}

/// A quantized `[rows, cols]` matrix: `tensors` stacked matrices of `rows / tensors` rows each
/// (experts), as raw code bytes plus the format's scale bytes (empty if none), both laid out as
/// the module docs say.
#[derive(Debug, Clone, PartialEq)]
pub struct Packed {
    /// Rows of all tensors together (`R = T * N`).
    pub rows: usize,
    /// Columns (K, the reduction axis).
    pub cols: usize,
    /// Stacked matrices (`T`, the experts).
    pub tensors: usize,
    /// The codes, row-major, packed along K.
    pub data: Vec<u8>,
    /// The scale bytes (empty for formats without scales).
    pub scales: Vec<u8>,
}

/// Largest integer code magnitude of the symmetric formats.
const INT8_QMAX: f32 = 127.0;
const INT4_QMAX: f32 = 7.0;
/// NVFP4's global scale maps the tensor maximum to the largest block scale times the largest element.
const NVFP4_RANGE: f32 = E4M3_MAX * E2M1_MAX;

impl WeightFormat {
    /// Every weight format.
    pub const ALL: [WeightFormat; 19] = [
        WeightFormat::Bf16,
        WeightFormat::Fp16,
        WeightFormat::Fp8E4m3,
        WeightFormat::Fp8E4m3B128,
        WeightFormat::Mxfp8,
        WeightFormat::Int8,
        WeightFormat::Int8G32,
        WeightFormat::Int8G64,
        WeightFormat::Int8G128,
        WeightFormat::Int4,
        WeightFormat::Int4G32,
        WeightFormat::Int4G64,
        WeightFormat::Int4G128,
        WeightFormat::Int4Asym,
        WeightFormat::Int4AsymG32,
        WeightFormat::Int4AsymG64,
        WeightFormat::Int4AsymG128,
        WeightFormat::Nvfp4,
        WeightFormat::Mxfp4,
    ];
    /// Every name, comma-separated (for error messages).
    pub const NAMES: &'static str = "bf16, fp16, fp8_e4m3, fp8_e4m3_b128, mxfp8, int8, int8_g32, int8_g64, int8_g128, \
                                     int4, int4_g32, int4_g64, int4_g128, int4_asym, int4_asym_g32, int4_asym_g64, \
                                     int4_asym_g128, nvfp4, mxfp4";

    /// The name `#[moe_kernel]`, `FromStr` and `Display` use, e.g. `int4_g128`.
    pub const fn name(self) -> &'static str {
        match self {
            WeightFormat::Bf16 => "bf16",
            WeightFormat::Fp16 => "fp16",
            WeightFormat::Fp8E4m3 => "fp8_e4m3",
            WeightFormat::Fp8E4m3B128 => "fp8_e4m3_b128",
            WeightFormat::Mxfp8 => "mxfp8",
            WeightFormat::Int8 => "int8",
            WeightFormat::Int8G32 => "int8_g32",
            WeightFormat::Int8G64 => "int8_g64",
            WeightFormat::Int8G128 => "int8_g128",
            WeightFormat::Int4 => "int4",
            WeightFormat::Int4G32 => "int4_g32",
            WeightFormat::Int4G64 => "int4_g64",
            WeightFormat::Int4G128 => "int4_g128",
            WeightFormat::Int4Asym => "int4_asym",
            WeightFormat::Int4AsymG32 => "int4_asym_g32",
            WeightFormat::Int4AsymG64 => "int4_asym_g64",
            WeightFormat::Int4AsymG128 => "int4_asym_g128",
            WeightFormat::Nvfp4 => "nvfp4",
            WeightFormat::Mxfp4 => "mxfp4",
        }
    }

    /// How one element is coded.
    pub const fn codec(self) -> Codec {
        use WeightFormat::*;
        match self {
            Bf16 => Codec::Bf16,
            Fp16 => Codec::Fp16,
            Fp8E4m3 | Fp8E4m3B128 | Mxfp8 => Codec::E4m3,
            Int8 | Int8G32 | Int8G64 | Int8G128 => Codec::Int8,
            Int4 | Int4G32 | Int4G64 | Int4G128 | Int4Asym | Int4AsymG32 | Int4AsymG64 | Int4AsymG128 => Codec::Uint4,
            Nvfp4 | Mxfp4 => Codec::E2m1,
        }
    }

    /// Where the format's scales live and what one covers.
    pub const fn scale_layout(self) -> ScaleLayout {
        use WeightFormat::*;
        match self {
            Bf16 | Fp16 => ScaleLayout::None,
            Fp8E4m3 | Int8 | Int4 => ScaleLayout::RowF32,
            Fp8E4m3B128 => ScaleLayout::Block128F32,
            Mxfp8 | Mxfp4 => ScaleLayout::E8m0 { group: 32 },
            Int8G32 | Int4G32 => ScaleLayout::GroupF16 { group: 32 },
            Int8G64 | Int4G64 => ScaleLayout::GroupF16 { group: 64 },
            Int8G128 | Int4G128 => ScaleLayout::GroupF16 { group: 128 },
            Int4Asym => ScaleLayout::GroupF16Zero { group: 0 },
            Int4AsymG32 => ScaleLayout::GroupF16Zero { group: 32 },
            Int4AsymG64 => ScaleLayout::GroupF16Zero { group: 64 },
            Int4AsymG128 => ScaleLayout::GroupF16Zero { group: 128 },
            Nvfp4 => ScaleLayout::Nvfp4,
        }
    }

    /// Whether codes carry zero points (asymmetric INT4).
    pub const fn has_zero_points(self) -> bool {
        matches!(self.scale_layout(), ScaleLayout::GroupF16Zero { .. })
    }

    /// Bits per stored element.
    pub const fn elem_bits(self) -> u32 {
        match self.codec() {
            Codec::Bf16 | Codec::Fp16 => 16,
            Codec::E4m3 | Codec::Int8 => 8,
            Codec::Uint4 | Codec::E2m1 => 4,
        }
    }
    /// Elements in one 16-byte vector load: the unit every kernel streams weights in.
    pub const fn elems_per_16b(self) -> u32 {
        128 / self.elem_bits()
    }
    /// Elements along K one scale covers (0: a whole row, or no scales). The reduction axes of a
    /// spec must be multiples of it.
    pub const fn k_group(self) -> u32 {
        self.scale_layout().group()
    }
    /// Whether the format carries one fp32 scale per output row.
    pub const fn has_row_scales(self) -> bool {
        matches!(self.scale_layout(), ScaleLayout::RowF32)
    }
    /// The activation dtype used when the spec names none.
    pub const fn default_act_dtype(self) -> ActDtype {
        match self {
            WeightFormat::Fp16 => ActDtype::Fp16,
            _ => ActDtype::Bf16,
        }
    }

    /// Bytes of the codes of a `[rows, cols]` matrix.
    pub const fn data_bytes(self, rows: usize, cols: usize) -> usize {
        rows * cols * self.elem_bits() as usize / 8
    }
    /// Scale bytes of `tensors` stacked `[rows, cols]` matrices.
    pub const fn scale_bytes(self, tensors: usize, rows: usize, cols: usize) -> usize {
        let r = tensors * rows;
        match self.scale_layout() {
            ScaleLayout::None => 0,
            ScaleLayout::RowF32 => r * 4,
            ScaleLayout::Block128F32 => r.div_ceil(128) * cols.div_ceil(128) * 4,
            ScaleLayout::E8m0 { group } => r * cols.div_ceil(group as usize),
            ScaleLayout::GroupF16 { group } => r * cols.div_ceil(group as usize) * 2,
            ScaleLayout::GroupF16Zero { group } => {
                let g = if group == 0 { 1 } else { cols.div_ceil(group as usize) };
                r * g * 4
            }
            ScaleLayout::Nvfp4 => tensors * 4 + r * cols.div_ceil(16),
        }
    }
    /// Bytes of one `[rows, cols]` matrix (one expert's) in this format: codes plus every scale
    /// the kernels read for it (NVFP4's global included).
    pub const fn bytes_for(self, rows: usize, cols: usize) -> usize {
        self.data_bytes(rows, cols) + self.scale_bytes(1, rows, cols)
    }

    /// Whether `[rows, cols]` matrices (`rows` per stacked tensor) fit the layout.
    pub fn check_matrix(self, rows: usize, cols: usize) -> Result<(), QuantError> {
        let err = |why| Err(QuantError::Layout { format: self, rows, cols, why });
        if self.elem_bits() == 4 && cols % 2 != 0 {
            return err("4-bit codes pack two per byte along K: cols must be even");
        }
        let g = self.k_group() as usize;
        if g > 0 && cols % g != 0 {
            return err("cols must be a multiple of the scale group along K");
        }
        if self == WeightFormat::Fp8E4m3B128 && rows % 128 != 0 {
            return err("128x128 block scales: each tensor's rows must be a multiple of 128");
        }
        Ok(())
    }

    /// Quantize a row-major `[rows, cols]` f32 matrix (one tensor).
    pub fn quantize(self, rows: usize, cols: usize, w: &[f32]) -> Result<Packed, QuantError> {
        self.quantize_stacked(1, rows, cols, w)
    }

    /// Quantize `tensors` stacked `[rows, cols]` matrices (`w` is `[tensors * rows, cols]`); per-tensor
    /// quantities (NVFP4's global scale) are per stacked matrix. Tensors are quantized in parallel.
    pub fn quantize_stacked(self, tensors: usize, rows: usize, cols: usize, w: &[f32]) -> Result<Packed, QuantError> {
        let total = tensors * rows;
        if w.len() != total * cols {
            return Err(QuantError::Shape { rows: total, cols, expected: total * cols, got: w.len() });
        }
        if let Some(i) = w.iter().position(|v| !v.is_finite()) {
            return Err(QuantError::NonFinite { row: i / cols.max(1), col: i % cols.max(1), value: w[i] });
        }
        self.check_matrix(rows, cols)?;
        let per = rows * cols;
        let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(tensors.max(1));
        let chunk = tensors.div_ceil(threads.max(1)).max(1);
        let parts: Vec<Result<Vec<Tensor>, QuantError>> = std::thread::scope(|sc| {
            let handles: Vec<_> = (0..tensors)
                .step_by(chunk)
                .map(|t0| {
                    let t1 = (t0 + chunk).min(tensors);
                    sc.spawn(move || {
                        (t0..t1)
                            .map(|t| self.quantize_tensor(rows, cols, &w[t * per..(t + 1) * per], t * rows))
                            .collect()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("quantizer thread panicked")).collect()
        });
        let mut data = Vec::with_capacity(self.data_bytes(total, cols));
        let mut globals = Vec::new();
        let mut body = Vec::new();
        for part in parts {
            for t in part? {
                data.extend_from_slice(&t.data);
                body.extend_from_slice(&t.scales);
                globals.extend(t.global.map(f32::to_le_bytes).into_iter().flatten());
            }
        }
        globals.extend_from_slice(&body);
        Ok(Packed { rows: total, cols, tensors, data, scales: globals })
    }

    /// One tensor: codes, its scale body, its global (NVFP4). `row0` numbers rows in errors.
    fn quantize_tensor(self, rows: usize, cols: usize, w: &[f32], row0: usize) -> Result<Tensor, QuantError> {
        let mut data = Vec::with_capacity(self.data_bytes(rows, cols));
        let mut scales = Vec::new();
        let mut global = None;
        let amax = |v: &[f32]| v.iter().fold(0f32, |m, x| m.max(x.abs()));
        let range_err = |r: usize, g0: usize, v: &[f32], max: f32| {
            let (c, &value) = v.iter().enumerate().max_by(|a, b| a.1.abs().total_cmp(&b.1.abs())).expect("non-empty");
            QuantError::OutOfRange { format: self, row: row0 + r, col: g0 + c, value, max }
        };
        match self.scale_layout() {
            ScaleLayout::Block128F32 => {
                // Codes row-major, scales [rows/128, cols/128].
                let (br, bc) = (rows / 128, cols.div_ceil(128));
                let mut s = vec![1f32; br * bc];
                for (b, sb) in s.iter_mut().enumerate() {
                    let (i, j) = (b / bc, b % bc);
                    let c1 = ((j + 1) * 128).min(cols);
                    let m = (i * 128..(i + 1) * 128)
                        .map(|r| amax(&w[r * cols + j * 128..r * cols + c1]))
                        .fold(0f32, f32::max);
                    *sb = f32_scale(m, E4M3_MAX);
                }
                for r in 0..rows {
                    data.extend(
                        w[r * cols..(r + 1) * cols]
                            .iter()
                            .enumerate()
                            .map(|(c, &v)| e4m3_from_f32(v / s[(r / 128) * bc + c / 128])),
                    );
                }
                scales.extend(s.iter().flat_map(|v| v.to_le_bytes()));
            }
            ScaleLayout::Nvfp4 => {
                let g = f32_scale(amax(w), NVFP4_RANGE);
                global = Some(g);
                for row in w.chunks_exact(cols) {
                    let mut codes = Vec::with_capacity(cols);
                    for grp in row.chunks_exact(16) {
                        let sc = crate::numerics::e4m3_from_f32(amax(grp) / E2M1_MAX / g);
                        scales.push(sc);
                        let denom = e4m3_to_f32(sc) * g;
                        codes.extend(grp.iter().map(|&v| if denom > 0.0 { e2m1_from_f32(v / denom) } else { 0 }));
                    }
                    pack_nibbles(&codes, &mut data);
                }
            }
            layout => {
                for (r, row) in w.chunks_exact(cols).enumerate() {
                    match layout {
                        ScaleLayout::None => {
                            // Past the 16-bit format's largest value the conversion gives infinity.
                            let (bytes, max): (Vec<[u8; 2]>, f32) = match self {
                                WeightFormat::Bf16 => (
                                    row.iter().map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect(),
                                    half::bf16::MAX.to_f32(),
                                ),
                                _ => (row.iter().map(|&v| f16::from_f32(v).to_le_bytes()).collect(), f16::MAX.to_f32()),
                            };
                            let inf = |b: &[u8; 2]| match self {
                                WeightFormat::Bf16 => half::bf16::from_le_bytes(*b).is_infinite(),
                                _ => f16::from_le_bytes(*b).is_infinite(),
                            };
                            if let Some(c) = bytes.iter().position(inf) {
                                return Err(QuantError::OutOfRange {
                                    format: self,
                                    row: row0 + r,
                                    col: c,
                                    value: row[c],
                                    max,
                                });
                            }
                            data.extend(bytes.into_iter().flatten());
                        }
                        ScaleLayout::RowF32 => {
                            let m = amax(row);
                            let qmax = match self.codec() {
                                Codec::E4m3 => E4M3_MAX,
                                Codec::Int8 => INT8_QMAX,
                                _ => INT4_QMAX,
                            };
                            let s = f32_scale(m, qmax);
                            scales.extend_from_slice(&s.to_le_bytes());
                            self.encode_sym(row, s, &mut data);
                        }
                        ScaleLayout::E8m0 { group } => {
                            let (emax, mut codes) = match self.codec() {
                                Codec::E4m3 => (E4M3_EMAX, Vec::new()),
                                _ => (E2M1_EMAX, Vec::with_capacity(cols)),
                            };
                            for grp in row.chunks_exact(group as usize) {
                                let e = e8m0_for_amax(amax(grp), emax);
                                scales.push(e);
                                let x = e8m0_to_f32(e);
                                match self.codec() {
                                    Codec::E4m3 => data.extend(grp.iter().map(|&v| e4m3_from_f32(v / x))),
                                    _ => codes.extend(grp.iter().map(|&v| e2m1_from_f32(v / x))),
                                }
                            }
                            if self.codec() == Codec::E2m1 {
                                pack_nibbles(&codes, &mut data);
                            }
                        }
                        ScaleLayout::GroupF16 { group } => {
                            let qmax = if self.codec() == Codec::Int8 { INT8_QMAX } else { INT4_QMAX };
                            let mut codes = Vec::with_capacity(cols);
                            for (gi, grp) in row.chunks_exact(group as usize).enumerate() {
                                let s = f16_scale(amax(grp) / qmax)
                                    .ok_or_else(|| range_err(r, gi * group as usize, grp, f16::MAX.to_f32() * qmax))?;
                                scales.extend_from_slice(&s.to_le_bytes());
                                let sf = s.to_f32();
                                match self.codec() {
                                    Codec::Int8 => {
                                        data.extend(grp.iter().map(|&v| int_code(v, sf, -127.0, 127.0) as i8 as u8))
                                    }
                                    _ => codes.extend(grp.iter().map(|&v| (int_code(v, sf, -8.0, 7.0) + 8) as u8)),
                                }
                            }
                            if self.codec() == Codec::Uint4 {
                                pack_nibbles(&codes, &mut data);
                            }
                        }
                        ScaleLayout::GroupF16Zero { group } => {
                            let g = if group == 0 { cols } else { group as usize };
                            let mut codes = Vec::with_capacity(cols);
                            for (gi, grp) in row.chunks_exact(g).enumerate() {
                                let lo = grp.iter().fold(0f32, |m, &v| m.min(v));
                                let hi = grp.iter().fold(0f32, |m, &v| m.max(v));
                                let span = (hi as f64 - lo as f64) / 15.0;
                                let s = f16_scale(span as f32)
                                    .filter(|_| span <= f16::MAX.to_f64())
                                    .ok_or_else(|| range_err(r, gi * g, grp, f16::MAX.to_f32() * 7.5))?;
                                let sf = s.to_f32();
                                let z = rne(-lo / sf).clamp(0.0, 15.0);
                                let rec = s.to_bits() as u32 | (z as u32) << 16;
                                scales.extend_from_slice(&rec.to_le_bytes());
                                codes.extend(grp.iter().map(|&v| (rne(v / sf) + z).clamp(0.0, 15.0) as u8));
                            }
                            pack_nibbles(&codes, &mut data);
                        }
                        ScaleLayout::Block128F32 | ScaleLayout::Nvfp4 => unreachable!("handled above"),
                    }
                }
            }
        }
        Ok(Tensor { data, scales, global })
    }

    /// Codes of a row under one f32 scale (the per-row symmetric formats).
    fn encode_sym(self, row: &[f32], s: f32, data: &mut Vec<u8>) {
        match self.codec() {
            Codec::E4m3 => data.extend(row.iter().map(|&v| e4m3_from_f32(v / s))),
            Codec::Int8 => data.extend(row.iter().map(|&v| int_code(v, s, -127.0, 127.0) as i8 as u8)),
            _ => {
                let codes: Vec<u8> = row.iter().map(|&v| (int_code(v, s, -8.0, 7.0) + 8) as u8).collect();
                pack_nibbles(&codes, data);
            }
        }
    }

    /// Dequantize every row (see the module docs for the exact arithmetic).
    pub fn dequantize(self, p: &Packed) -> Vec<f32> {
        let mut out = Vec::with_capacity(p.rows * p.cols);
        for r in 0..p.rows {
            out.extend(self.dequantize_row(&p.data, &p.scales, p.tensors, p.rows, p.cols, r));
        }
        out
    }

    /// Row `r` of `tensors` stacked matrices with `rows` rows in all, dequantized exactly as the
    /// kernels' dequant primitives compute it: `((code - zero) * group_scale) * row_scale` in f32.
    pub fn dequantize_row(
        self,
        data: &[u8],
        scales: &[u8],
        tensors: usize,
        rows: usize,
        cols: usize,
        r: usize,
    ) -> Vec<f32> {
        let rb = self.data_bytes(1, cols);
        let d = &data[r * rb..(r + 1) * rb];
        let f32_at = |i: usize| f32::from_le_bytes(scales[4 * i..4 * i + 4].try_into().expect("4 bytes"));
        // Codes (minus the symmetric INT4 zero point) first, one codec match per row.
        static E4M3: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
        let mut v: Vec<f32> = match self.codec() {
            Codec::Bf16 => d.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            Codec::Fp16 => d.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            Codec::E4m3 => {
                let t = E4M3.get_or_init(|| std::array::from_fn(|b| e4m3_to_f32(b as u8)));
                d.iter().map(|&b| t[b as usize]).collect()
            }
            Codec::Int8 => d.iter().map(|&b| b as i8 as f32).collect(),
            Codec::Uint4 => {
                let zero = if self.has_zero_points() { 0.0 } else { 8.0 };
                d.iter().flat_map(|&b| [(b & 15) as f32 - zero, (b >> 4) as f32 - zero]).collect()
            }
            Codec::E2m1 => d.iter().flat_map(|&b| [e2m1_to_f32(b & 15), e2m1_to_f32(b >> 4)]).collect(),
        };
        // Then ((code - zero) * group_scale) * row_scale, in that order.
        let grouped = |v: &mut [f32], g: usize, scale: &dyn Fn(usize) -> (f32, f32), rs: f32| {
            for (gi, chunk) in v.chunks_mut(g).enumerate() {
                let (gs, zero) = scale(gi);
                chunk.iter_mut().for_each(|x| *x = (*x - zero) * gs * rs);
            }
        };
        match self.scale_layout() {
            ScaleLayout::None => {}
            ScaleLayout::RowF32 => {
                let rs = f32_at(r);
                v.iter_mut().for_each(|x| *x = *x * 1.0 * rs);
            }
            ScaleLayout::Block128F32 => {
                let base = (r / 128) * cols.div_ceil(128);
                grouped(&mut v, 128, &|gi| (f32_at(base + gi), 0.0), 1.0);
            }
            ScaleLayout::E8m0 { group } => {
                let (g, base) = (group as usize, r * (cols / group as usize));
                grouped(&mut v, g, &|gi| (e8m0_to_f32(scales[base + gi]), 0.0), 1.0);
            }
            ScaleLayout::GroupF16 { group } => {
                let (g, base) = (group as usize, r * (cols / group as usize));
                grouped(
                    &mut v,
                    g,
                    &|gi| (f16::from_le_bytes([scales[2 * (base + gi)], scales[2 * (base + gi) + 1]]).to_f32(), 0.0),
                    1.0,
                );
            }
            ScaleLayout::GroupF16Zero { group } => {
                let g = if group == 0 { cols } else { group as usize };
                let base = r * (cols / g);
                let rec = |gi: usize| {
                    let i = 4 * (base + gi);
                    let rec = u32::from_le_bytes(scales[i..i + 4].try_into().expect("4 bytes"));
                    (f16::from_bits(rec as u16).to_f32(), ((rec >> 16) & 0xff) as f32)
                };
                grouped(&mut v, g, &rec, 1.0);
            }
            ScaleLayout::Nvfp4 => {
                let body = 4 * tensors + r * (cols / 16);
                let rs = f32_at(r / (rows / tensors.max(1)));
                grouped(&mut v, 16, &|gi| (e4m3_to_f32(scales[body + gi]), 0.0), rs);
            }
        }
        v
    }
}

/// One quantized tensor before stacking.
struct Tensor {
    data: Vec<u8>,
    scales: Vec<u8>,
    global: Option<f32>,
}

/// The f32 scale mapping `amax` to `qmax`: 1 for an all-zero block, never 0 (a subnormal `amax`
/// underflows the division), and small enough that `qmax * scale` stays finite.
fn f32_scale(amax: f32, qmax: f32) -> f32 {
    if amax == 0.0 {
        return 1.0;
    }
    let mut s = (amax / qmax).max(f32::from_bits(1));
    while !(qmax * s).is_finite() {
        s = f32::from_bits(s.to_bits() - 1);
    }
    s
}

/// `rne(v / s)` clamped to `[lo, hi]`.
fn int_code(v: f32, s: f32, lo: f32, hi: f32) -> i32 {
    rne(v / s).clamp(lo, hi) as i32
}

/// A positive f16 scale for `s >= 0`: 1 for 0, at least the smallest f16 subnormal, `None` past f16's range.
fn f16_scale(s: f32) -> Option<f16> {
    if s == 0.0 {
        return Some(f16::ONE);
    }
    let h = f16::from_f32(s);
    if !h.is_finite() {
        return None;
    }
    Some(if h.to_f32() == 0.0 { f16::from_bits(1) } else { h })
}

/// Two nibbles per byte, element `2j` in the low nibble.
fn pack_nibbles(codes: &[u8], out: &mut Vec<u8>) {
    out.extend(codes.chunks(2).map(|p| (p[0] & 15) | (p.get(1).copied().unwrap_or(0) & 15) << 4));
}

impl FromStr for WeightFormat {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        WeightFormat::ALL.into_iter().find(|v| v.name() == s).ok_or_else(|| SpecError::Unknown {
            what: "weight format",
            got: s.to_string(),
            expected: WeightFormat::NAMES,
        })
    }
}

impl fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests;
