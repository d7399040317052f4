//! One linear projection of one expert (`[N, K]`: N outputs, K inputs) read from its checkpoint
//! tensors into moeforge's bytes for one matrix of the spec's [`WeightFormat`]. Every format
//! used here stacks by concatenation (codes row-major, scales per row or per 128-row block),
//! so a layer's `w13` is each expert's gate bytes then up bytes, expert after expert.
//!
//! bf16 / fp16 and DeepSeek's block FP8 are stored exactly as moeforge stores them and are
//! copied; GPTQ and AWQ are repacked in [`crate::int4`].

use crate::config::Quantization;
use crate::error::{CheckpointError, Result};
use crate::store::{dtype_error, Store};
use moe_codegen::WeightFormat;
use safetensors::Dtype;

/// One matrix in moeforge's layout: its code bytes and scale bytes.
#[derive(Debug, Default)]
pub(crate) struct Proj {
    pub data: Vec<u8>,
    pub scales: Vec<u8>,
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
