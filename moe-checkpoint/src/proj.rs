//! One linear projection of one expert (`[N, K]`: N outputs, K inputs) read from its checkpoint
//! tensors into moeforge's bytes for one matrix of the spec's [`WeightFormat`]. Every format
//! used here stacks by concatenation (codes row-major, scales per row or per 128-row block),
//! so a layer's `w13` is each expert's gate bytes then up bytes, expert after expert.
//!
//! bf16 / fp16 and DeepSeek's block FP8 are stored exactly as moeforge stores them and are
//! copied; GPTQ and AWQ are repacked in [`crate::int4`].
//!
//! A shared expert wider than the routed ones is cut along its intermediate dimension into
//! experts of the routed size ([`Proj::rows`] for gate / up, [`Proj::cols`] for down), in the
//! format's bytes: whole 128x128 blocks, whole int4 groups ([`split_refusal`] says when not).

use crate::config::Quantization;
use crate::error::{CheckpointError, Result};
use crate::store::{dtype_error, Store};
use moe_codegen::{ScaleLayout, WeightFormat};
use safetensors::Dtype;

/// One matrix in moeforge's layout: its code bytes and scale bytes.
#[derive(Debug, Default)]
pub(crate) struct Proj {
    pub data: Vec<u8>,
    pub scales: Vec<u8>,
}

impl Proj {
    /// Rows `r0 .. r0 + rows` of this `[n, k]` matrix (a shared expert's gate or up rows for one
    /// chunk of its intermediate dimension). `format` must cut there ([`split_refusal`] with
    /// `rows`; `r0` a multiple of `rows`).
    pub fn rows(&self, format: WeightFormat, k: usize, r0: usize, rows: usize) -> Proj {
        let rb = format.data_bytes(1, k);
        let data = self.data[r0 * rb..(r0 + rows) * rb].to_vec();
        let scales = match format.scale_layout() {
            ScaleLayout::None => Vec::new(),
            // One f32 per 128x128 block, block rows after block rows.
            ScaleLayout::Block128F32 => {
                let b = k.div_ceil(128) * 4;
                self.scales[r0 / 128 * b..(r0 + rows) / 128 * b].to_vec()
            }
            // Every other layout here keeps each row's scales together.
            _ => {
                let sb = format.scale_bytes(1, 1, k);
                self.scales[r0 * sb..(r0 + rows) * sb].to_vec()
            }
        };
        Proj { data, scales }
    }

    /// Columns `c0 .. c0 + cols` (along K) of this `[n, k]` matrix (a shared expert's down
    /// projection for one chunk of its intermediate dimension): each row's codes and the scales
    /// of the blocks / groups they hold; a scale per whole row (`int4`, `int4_asym`) is the same
    /// for every chunk. `format` must cut there ([`split_refusal`] with `cols`; `c0` a multiple).
    pub fn cols(&self, format: WeightFormat, n: usize, k: usize, c0: usize, cols: usize) -> Proj {
        let (rb, off, len) = (format.data_bytes(1, k), format.data_bytes(1, c0), format.data_bytes(1, cols));
        let mut data = Vec::with_capacity(n * len);
        for r in 0..n {
            data.extend_from_slice(&self.data[r * rb + off..r * rb + off + len]);
        }
        let layout = format.scale_layout();
        let scales = match layout {
            ScaleLayout::None => Vec::new(),
            ScaleLayout::RowF32 | ScaleLayout::GroupF16Zero { group: 0 } => self.scales.clone(),
            ScaleLayout::Block128F32 => {
                let kb = k.div_ceil(128);
                let mut s = Vec::with_capacity(n.div_ceil(128) * cols / 128 * 4);
                for br in 0..n.div_ceil(128) {
                    s.extend_from_slice(&self.scales[4 * (br * kb + c0 / 128)..4 * (br * kb + (c0 + cols) / 128)]);
                }
                s
            }
            _ => {
                // One record of `rec` bytes per `g` columns of a row, rows after rows.
                let g = layout.group() as usize;
                let (rec, per_row) = (format.scale_bytes(1, 1, g), k / g);
                let mut s = Vec::with_capacity(n * cols / g * rec);
                for r in 0..n {
                    s.extend_from_slice(
                        &self.scales[(r * per_row + c0 / g) * rec..(r * per_row + (c0 + cols) / g) * rec],
                    );
                }
                s
            }
        };
        Proj { data, scales }
    }
}

/// Why matrices of `format` cannot be cut into chunks of `i` along the intermediate dimension
/// (w13's rows, w2's K) keeping whole blocks and groups; `None`: they can, exactly.
pub(crate) fn split_refusal(format: WeightFormat, i: usize) -> Option<String> {
    let layout = format.scale_layout();
    let g = layout.group() as usize;
    match layout {
        ScaleLayout::Block128F32 if i % 128 != 0 => {
            Some(format!("{format}'s 128x128 blocks would be cut: {i} is not a multiple of 128"))
        }
        ScaleLayout::Nvfp4 => Some(format!("{format}'s per-tensor global scale cannot be split")),
        _ if g > 0 && i % g != 0 => {
            Some(format!("{format}'s groups of {g} along K would be cut: {i} is not a multiple"))
        }
        _ if format.elem_bits() == 4 && i % 2 != 0 => Some(format!("{format} packs two codes per byte: {i} is odd")),
        _ => None,
    }
}

/// How a projection's tensors are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Storage {
    /// `{prefix}.weight`, bf16 or fp16.
    Dense(WeightFormat),
    /// `{prefix}.weight` e4m3 and `{prefix}.weight_scale_inv` per 128x128 block.
    Fp8Block,
    /// GPTQ `qweight` / `qzeros` / `scales` (/ `g_idx`).
    Gptq { group: Option<u32>, sym: bool, v2: bool },
    /// AWQ GEMM `qweight` / `qzeros` / `scales`.
    Awq { group: Option<u32> },
}

impl Storage {
    /// The storage of a layer's experts: from the quantization config, and for unquantized
    /// checkpoints from the dtype of `probe` (a projection prefix of the layer).
    pub fn detect(quant: Quantization, store: &Store, probe: &str, model: &str) -> Result<Storage> {
        Ok(match quant {
            Quantization::None => {
                // The shape is checked when each projection is read; here only the dtype matters.
                let name = format!("{probe}.weight");
                match store.dtype(&name)? {
                    Dtype::BF16 => Storage::Dense(WeightFormat::Bf16),
                    Dtype::F16 => Storage::Dense(WeightFormat::Fp16),
                    d => return Err(dtype_error(&name, &[Dtype::BF16, Dtype::F16], d)),
                }
            }
            Quantization::Fp8Block => Storage::Fp8Block,
            Quantization::Gptq { group, sym, v2 } => Storage::Gptq { group, sym, v2 },
            Quantization::Awq { group } => Storage::Awq { group },
            Quantization::Mxfp4 => {
                return Err(CheckpointError::Unsupported {
                    model: model.to_string(),
                    feature: "mxfp4 experts outside gpt-oss".into(),
                })
            }
        })
    }

    /// The moeforge format the projections are mapped into (exactly, no requantization).
    pub fn format(self) -> WeightFormat {
        use WeightFormat::*;
        match self {
            Storage::Dense(f) => f,
            Storage::Fp8Block => Fp8E4m3B128,
            Storage::Gptq { group, sym: true, .. } => match group {
                None => Int4,
                Some(32) => Int4G32,
                Some(64) => Int4G64,
                _ => Int4G128,
            },
            Storage::Gptq { group, sym: false, .. } | Storage::Awq { group } => match group {
                None => Int4Asym,
                Some(32) => Int4AsymG32,
                Some(64) => Int4AsymG64,
                _ => Int4AsymG128,
            },
        }
    }

    /// Read projection `prefix` (`n` outputs, `k` inputs).
    pub fn load(self, store: &Store, prefix: &str, n: usize, k: usize) -> Result<Proj> {
        match self {
            Storage::Dense(f) => {
                let dtype = if f == WeightFormat::Bf16 { Dtype::BF16 } else { Dtype::F16 };
                let name = format!("{prefix}.weight");
                let (t, _) = store.get(&name, &[dtype], &[n, k])?;
                Ok(Proj { data: t.data.to_vec(), scales: Vec::new() })
            }
            Storage::Fp8Block => {
                let name = format!("{prefix}.weight");
                let (t, _) = store.get(&name, &[Dtype::F8_E4M3], &[n, k])?;
                // `weight_scale_inv` despite its name multiplies: w = e4m3 * s (DeepSeek's
                // weight_dequant), one f32 per 128x128 block, row-major: moeforge's layout.
                let s = store.floats(&format!("{prefix}.weight_scale_inv"), &[n.div_ceil(128), k.div_ceil(128)])?;
                Ok(Proj { data: t.data.to_vec(), scales: s.iter().flat_map(|v| v.to_le_bytes()).collect() })
            }
            Storage::Gptq { group, sym, v2 } => crate::int4::gptq(store, prefix, n, k, group, sym, v2),
            Storage::Awq { group } => crate::int4::awq(store, prefix, n, k, group),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `[n, k]` matrix quantized by moeforge in `f`, as a [`Proj`], with its rows dequantized.
    fn matrix(f: WeightFormat, n: usize, k: usize) -> (Proj, Vec<Vec<f32>>) {
        let w: Vec<f32> =
            (0..n * k).map(|x| ((x * 7919 % 1009) as f32 / 1009.0 - 0.5) * (1.0 + (x / k) as f32)).collect();
        let p = f.quantize(n, k, &w).unwrap();
        let rows = (0..n).map(|r| f.dequantize_row(&p.data, &p.scales, 1, n, k, r)).collect();
        (Proj { data: p.data, scales: p.scales }, rows)
    }

    #[test]
    fn shared_expert_chunks_dequantize_to_the_slices_of_the_whole() {
        use WeightFormat::*;
        let (si, i, h) = (512, 128, 256);
        for f in [Bf16, Fp16, Fp8E4m3B128, Int4, Int4G32, Int4G128, Int4Asym, Int4AsymG32, Int4AsymG128] {
            assert_eq!(split_refusal(f, i), None, "{f}");
            // Gate / up: [si, h] cut into [i, h] by rows.
            let (p, want) = matrix(f, si, h);
            for j in 0..si / i {
                let c = p.rows(f, h, j * i, i);
                assert_eq!((c.data.len(), c.scales.len()), (f.data_bytes(i, h), f.scale_bytes(1, i, h)), "{f}");
                for r in 0..i {
                    assert_eq!(f.dequantize_row(&c.data, &c.scales, 1, i, h, r), want[j * i + r], "{f} rows {j} {r}");
                }
            }
            // Down: [h, si] cut into [h, i] along K.
            let (p, want) = matrix(f, h, si);
            for j in 0..si / i {
                let c = p.cols(f, h, si, j * i, i);
                assert_eq!((c.data.len(), c.scales.len()), (f.data_bytes(h, i), f.scale_bytes(1, h, i)), "{f}");
                for (r, row) in want.iter().enumerate() {
                    // int4 / int4_asym (a scale per whole row): each chunk keeps the row's scale.
                    let got = f.dequantize_row(&c.data, &c.scales, 1, h, i, r);
                    assert_eq!(got, row[j * i..(j + 1) * i], "{f} cols {j} {r}");
                }
            }
        }
    }

    #[test]
    fn cuts_through_blocks_or_groups_are_refused() {
        use WeightFormat::*;
        assert!(split_refusal(Fp8E4m3B128, 192).unwrap().contains("128x128"));
        assert!(split_refusal(Int4G128, 64).unwrap().contains("groups of 128"));
        assert!(split_refusal(Int4AsymG32, 48).unwrap().contains("groups of 32"));
        assert_eq!(split_refusal(Int4AsymG32, 64), None);
        assert_eq!(split_refusal(Bf16, 48), None);
        assert!(split_refusal(Int4, 7).is_some());
    }
}
