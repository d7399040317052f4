//! `config.json`: which model family, the MoE geometry, the router and the quantization. Read
//! field by field from a JSON value (not a derive) so every error names the field.

use crate::error::{CheckpointError, Result};
use moe_codegen::{GroupLimited, Router};
use serde_json::Value;
use std::path::Path;

/// The model families the loader knows, by `config.json`'s `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ModelKind {
    /// `qwen3_moe`: Qwen3-30B-A3B, Qwen3-235B-A22B.
    Qwen3Moe,
    /// `qwen2_moe`: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B (one gated shared expert).
    Qwen2Moe,
    /// `olmoe`: OLMoE-1B-7B.
    Olmoe,
    /// `mixtral`: Mixtral-8x7B, 8x22B.
    Mixtral,
    /// `deepseek_v3`: DeepSeek-V3 / R1.
    DeepseekV3,
    /// `kimi_k2`: Kimi-K2 (DeepSeek-V3's architecture).
    KimiK2,
    /// `gpt_oss`: gpt-oss-20b / 120b.
    GptOss,
}

impl ModelKind {
    /// `config.json`'s `model_type` for this family.
    pub const fn model_type(self) -> &'static str {
        match self {
            ModelKind::Qwen3Moe => "qwen3_moe",
            ModelKind::Qwen2Moe => "qwen2_moe",
            ModelKind::Olmoe => "olmoe",
            ModelKind::Mixtral => "mixtral",
            ModelKind::DeepseekV3 => "deepseek_v3",
            ModelKind::KimiK2 => "kimi_k2",
            ModelKind::GptOss => "gpt_oss",
        }
    }
    fn from_model_type(t: &str) -> Option<ModelKind> {
        [
            ModelKind::Qwen3Moe,
            ModelKind::Qwen2Moe,
            ModelKind::Olmoe,
            ModelKind::Mixtral,
            ModelKind::DeepseekV3,
            ModelKind::KimiK2,
            ModelKind::GptOss,
        ]
        .into_iter()
        .find(|k| k.model_type() == t)
    }
    /// DeepSeek-V3's architecture (Kimi-K2 shares it).
    pub const fn is_deepseek(self) -> bool {
        matches!(self, ModelKind::DeepseekV3 | ModelKind::KimiK2)
    }
}

impl std::fmt::Display for ModelKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.model_type())
    }
}

/// How the expert weights are stored (`quantization_config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Quantization {
    /// No `quantization_config`: bf16 or fp16 weights (whichever the tensors are).
    None,
    /// `quant_method: fp8` with `weight_block_size: [128, 128]`: e4m3 weights and f32
    /// `weight_scale_inv` per 128x128 block (DeepSeek-V3, Kimi-K2, Qwen3 FP8).
    Fp8Block,
    /// `quant_method: gptq`, 4 bits.
    Gptq {
        /// `group_size`; `None` for -1 (one group per row).
        group: Option<u32>,
        /// `sym`: every zero point is 8.
        sym: bool,
        /// `checkpoint_format: gptq_v2`: zero points stored as they are (v1 stores them minus 1).
        v2: bool,
    },
    /// `quant_method: awq`, 4 bits, `version: gemm`, with zero points.
    Awq {
        /// `group_size`; `None` for -1.
        group: Option<u32>,
    },
    /// `quant_method: mxfp4` (gpt-oss).
    Mxfp4,
}

/// A shared expert every token goes through beside the routed ones. The loaded layer holds it
/// as `intermediate / ModelConfig::intermediate` shared experts of the routed size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedConfig {
    /// Its intermediate size (DeepSeek: `moe_intermediate_size * n_shared_experts`; Qwen2-MoE:
    /// `shared_expert_intermediate_size`).
    pub intermediate: u32,
    /// Qwen2-MoE: its output is scaled per token by `sigmoid(shared_expert_gate . x)`.
    pub gated: bool,
}

/// What `config.json` says about the model's MoE layers.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The family.
    pub model: ModelKind,
    /// `num_hidden_layers`.
    pub layers: usize,
    /// `hidden_size`.
    pub hidden: u32,
    /// The routed experts' intermediate size (`moe_intermediate_size` or `intermediate_size`).
    pub intermediate: u32,
    /// Routed experts per layer.
    pub experts: u32,
    /// `num_experts_per_tok`.
    pub top_k: u32,
    /// How router logits become routing, in the model's own formula.
    pub router: Router,
    /// How the experts are stored.
    pub quant: Quantization,
    /// The shared expert, where the family has one.
    pub shared: Option<SharedConfig>,
    /// gpt-oss: `swiglu_limit`.
    pub swiglu_limit: Option<f32>,
    /// Which layers are dense MLPs rather than MoE layers.
    dense: DenseLayers,
}

/// The config fields that make some layers dense.
#[derive(Debug, Clone, PartialEq)]
enum DenseLayers {
    None,
    /// Qwen: `mlp_only_layers` and `decoder_sparse_step`.
    Qwen {
        mlp_only: Vec<usize>,
        sparse_step: usize,
    },
    /// DeepSeek: `first_k_dense_replace` and `moe_layer_freq`.
    Deepseek {
        first_k_dense: usize,
        freq: usize,
    },
}

impl ModelConfig {
    /// Read `dir/config.json`.
    pub fn read(dir: &Path) -> Result<ModelConfig> {
        let path = dir.join("config.json");
        let text = std::fs::read(&path).map_err(|source| CheckpointError::Io { path: path.clone(), source })?;
        let v: Value = serde_json::from_slice(&text).map_err(|source| CheckpointError::Json { path, source })?;
        ModelConfig::from_json(&v)
    }

    /// Parse a `config.json` value.
    pub fn from_json(v: &Value) -> Result<ModelConfig> {
        let c = Fields(v);
        let model_type = c.str("model_type")?;
        let model = ModelKind::from_model_type(model_type).ok_or_else(|| CheckpointError::Unsupported {
            model: model_type.to_string(),
            feature: "this model type (known: qwen3_moe, qwen2_moe, olmoe, mixtral, deepseek_v3, kimi_k2, gpt_oss)"
                .into(),
        })?;
        let layers = c.uint("num_hidden_layers")? as usize;
        let hidden = c.u32("hidden_size")?;
        let top_k = c.u32("num_experts_per_tok")?;
        let (intermediate, experts) = match model {
            ModelKind::Qwen3Moe | ModelKind::Qwen2Moe => (c.u32("moe_intermediate_size")?, c.u32("num_experts")?),
            ModelKind::Olmoe => (c.u32("intermediate_size")?, c.u32("num_experts")?),
            ModelKind::Mixtral | ModelKind::GptOss => (c.u32("intermediate_size")?, c.u32("num_local_experts")?),
            ModelKind::DeepseekV3 | ModelKind::KimiK2 => (c.u32("moe_intermediate_size")?, c.u32("n_routed_experts")?),
        };
        // transformers' defaults where the field is absent: Qwen2/3-MoE and OLMoE default to no
        // renormalisation; Mixtral and gpt-oss always renormalise (gpt-oss: softmax over the top-k
        // logits, the same weights).
        let router = match model {
            ModelKind::Qwen3Moe | ModelKind::Qwen2Moe | ModelKind::Olmoe => {
                Router::Softmax { renormalize: c.opt_bool("norm_topk_prob")?.unwrap_or(false) }
            }
            ModelKind::Mixtral | ModelKind::GptOss => Router::Softmax { renormalize: true },
            ModelKind::DeepseekV3 | ModelKind::KimiK2 => {
                if let Some(s) = c.opt_str("scoring_func")? {
                    if s != "sigmoid" {
                        return Err(
                            c.bad("scoring_func", format!("`{s}`: only DeepSeek-V3's sigmoid scoring is supported"))
                        );
                    }
                }
                if let Some(m) = c.opt_str("topk_method")? {
                    if m != "noaux_tc" {
                        return Err(c.bad("topk_method", format!("`{m}`: only `noaux_tc` is supported")));
                    }
                }
                let g = GroupLimited::new(
                    c.u32("n_group")?,
                    c.u32("topk_group")?,
                    c.opt_bool("norm_topk_prob")?.unwrap_or(true),
                    c.f64("routed_scaling_factor")? as f32,
                );
                Router::GroupLimited(g)
            }
        };
        let shared = match model {
            ModelKind::Qwen2Moe => match c.opt_uint("shared_expert_intermediate_size")? {
                Some(0) | None => None,
                Some(n) => {
                    Some(SharedConfig { intermediate: to_u32(&c, "shared_expert_intermediate_size", n)?, gated: true })
                }
            },
            ModelKind::DeepseekV3 | ModelKind::KimiK2 => match c.opt_uint("n_shared_experts")? {
                Some(0) | None => None,
                Some(n) => {
                    let i = (intermediate as u64).checked_mul(n).filter(|&v| v <= u32::MAX as u64);
                    let i = i.ok_or_else(|| c.bad("n_shared_experts", "too large".into()))?;
                    Some(SharedConfig { intermediate: i as u32, gated: false })
                }
            },
            _ => None,
        };
        let dense = match model {
            ModelKind::Qwen3Moe | ModelKind::Qwen2Moe => DenseLayers::Qwen {
                mlp_only: c.opt_uint_list("mlp_only_layers")?.unwrap_or_default(),
                sparse_step: c.opt_uint("decoder_sparse_step")?.unwrap_or(1).max(1) as usize,
            },
            ModelKind::DeepseekV3 | ModelKind::KimiK2 => DenseLayers::Deepseek {
                first_k_dense: c.opt_uint("first_k_dense_replace")?.unwrap_or(0) as usize,
                freq: c.opt_uint("moe_layer_freq")?.unwrap_or(1).max(1) as usize,
            },
            _ => DenseLayers::None,
        };
        let quant = quantization(&c, model)?;
        let swiglu_limit = match model {
            ModelKind::GptOss => Some(c.opt_f64("swiglu_limit")?.unwrap_or(7.0) as f32),
            _ => None,
        };
        Ok(ModelConfig {
            model,
            layers,
            hidden,
            intermediate,
            experts,
            top_k,
            router,
            quant,
            shared,
            swiglu_limit,
            dense,
        })
    }

    /// `Ok` where `layer` is a MoE layer; the typed error where it is out of range or dense.
    pub fn check_layer(&self, layer: usize) -> Result<()> {
        if layer >= self.layers {
            return Err(CheckpointError::LayerOutOfRange { layer, layers: self.layers });
        }
        let why = match &self.dense {
            DenseLayers::None => None,
            DenseLayers::Qwen { mlp_only, sparse_step } => {
                if mlp_only.contains(&layer) {
                    Some(format!("mlp_only_layers contains {layer}"))
                } else if (layer + 1) % sparse_step != 0 {
                    Some(format!("decoder_sparse_step = {sparse_step} and ({layer} + 1) % {sparse_step} != 0"))
                } else {
                    None
                }
            }
            DenseLayers::Deepseek { first_k_dense, freq } => {
                if layer < *first_k_dense {
                    Some(format!("first_k_dense_replace = {first_k_dense}"))
                } else if layer % freq != 0 {
                    Some(format!("moe_layer_freq = {freq}"))
                } else {
                    None
                }
            }
        };
        match why {
            Some(why) => Err(CheckpointError::DenseLayer { layer, why }),
            None => Ok(()),
        }
    }
}

/// `quantization_config`, checked against what moeforge can hold exactly.
fn quantization(c: &Fields, model: ModelKind) -> Result<Quantization> {
    let Some(q) = c.0.get("quantization_config").filter(|q| !q.is_null()) else {
        return Ok(Quantization::None);
    };
    let q = Fields(q);
    let field = |f: &str| format!("quantization_config.{f}");
    let bad = |f: &str, why: String| CheckpointError::Config { field: field(f), why };
    let unsupported = |feature: String| CheckpointError::Unsupported { model: model.to_string(), feature };
    let method = q.str("quant_method").map_err(|_| bad("quant_method", "missing or not a string".into()))?;
    let four_bits = |q: &Fields| -> Result<()> {
        match q.opt_uint("bits").map_err(|_| bad("bits", "not an integer".into()))? {
            Some(4) => Ok(()),
            Some(b) => Err(unsupported(format!("{method} with {b} bits (moeforge's integer formats here are 4-bit)"))),
            None => Err(bad("bits", "missing".into())),
        }
    };
    let group = |q: &Fields| -> Result<Option<u32>> {
        let g =
            q.0.get("group_size")
                .and_then(Value::as_i64)
                .ok_or_else(|| bad("group_size", "missing or not an integer".into()))?;
        match g {
            -1 => Ok(None),
            32 | 64 | 128 => Ok(Some(g as u32)),
            _ => Err(unsupported(format!(
                "{method} group_size {g} (moeforge's int4 formats have groups of 32, 64, 128 or one per row)"
            ))),
        }
    };
    match method {
        "fp8" => {
            let block: Option<Vec<u64>> = q
                .opt_uint_list("weight_block_size")
                .map_err(|_| bad("weight_block_size", "not a list of integers".into()))?
                .map(|v| v.into_iter().map(|x| x as u64).collect());
            match block.as_deref() {
                Some([128, 128]) => {}
                None => return Err(unsupported("fp8 without weight_block_size (per-tensor fp8 scales)".into())),
                Some(b) => {
                    return Err(unsupported(format!("fp8 weight_block_size {b:?} (moeforge's blocks are 128x128)")))
                }
            }
            if let Some(f) = q.opt_str("fmt").map_err(|_| bad("fmt", "not a string".into()))? {
                if f != "e4m3" {
                    return Err(unsupported(format!("fp8 fmt `{f}` (moeforge's fp8 is e4m3)")));
                }
            }
            Ok(Quantization::Fp8Block)
        }
        "gptq" => {
            four_bits(&q)?;
            let desc_act = q.opt_bool("desc_act").map_err(|_| bad("desc_act", "not a bool".into()))?.unwrap_or(false);
            let _ = desc_act; // act-order is judged from each g_idx tensor: a trivial g_idx loads.
            let sym = q.opt_bool("sym").map_err(|_| bad("sym", "not a bool".into()))?.unwrap_or(true);
            let format = q.opt_str("checkpoint_format").map_err(|_| bad("checkpoint_format", "not a string".into()))?;
            let v2 = match format {
                None | Some("gptq") => false,
                Some("gptq_v2") => true,
                Some(f) => return Err(unsupported(format!("GPTQ checkpoint_format `{f}`"))),
            };
            Ok(Quantization::Gptq { group: group(&q)?, sym, v2 })
        }
        "awq" => {
            four_bits(&q)?;
            let version = q.opt_str("version").map_err(|_| bad("version", "not a string".into()))?.unwrap_or("gemm");
            if !version.eq_ignore_ascii_case("gemm") {
                return Err(unsupported(format!("AWQ version `{version}` (only the GEMM packing)")));
            }
            if q.opt_bool("zero_point").map_err(|_| bad("zero_point", "not a bool".into()))? == Some(false) {
                return Err(unsupported("AWQ without zero points".into()));
            }
            Ok(Quantization::Awq { group: group(&q)? })
        }
        "mxfp4" if model == ModelKind::GptOss => Ok(Quantization::Mxfp4),
        other => Err(unsupported(format!("quant_method `{other}`"))),
    }
}

fn to_u32(c: &Fields, f: &str, n: u64) -> Result<u32> {
    u32::try_from(n).map_err(|_| c.bad(f, format!("{n} does not fit in 32 bits")))
}

/// Typed access to a JSON object's fields, each error naming the field.
struct Fields<'a>(&'a Value);

impl Fields<'_> {
    fn bad(&self, field: &str, why: String) -> CheckpointError {
        CheckpointError::Config { field: field.to_string(), why }
    }
    fn get(&self, f: &str) -> Option<&Value> {
        self.0.get(f).filter(|v| !v.is_null())
    }
    fn str(&self, f: &str) -> Result<&str> {
        match self.get(f) {
            None => Err(self.bad(f, "missing".into())),
            Some(v) => v.as_str().ok_or_else(|| self.bad(f, format!("expected a string, got {v}"))),
        }
    }
    fn opt_str(&self, f: &str) -> Result<Option<&str>> {
        self.get(f).map(|_| self.str(f)).transpose()
    }
    fn uint(&self, f: &str) -> Result<u64> {
        match self.get(f) {
            None => Err(self.bad(f, "missing".into())),
            Some(v) => v.as_u64().ok_or_else(|| self.bad(f, format!("expected a non-negative integer, got {v}"))),
        }
    }
    fn opt_uint(&self, f: &str) -> Result<Option<u64>> {
        self.get(f).map(|_| self.uint(f)).transpose()
    }
    fn u32(&self, f: &str) -> Result<u32> {
        let n = self.uint(f)?;
        if n == 0 {
            return Err(self.bad(f, "must be greater than zero".into()));
        }
        to_u32(self, f, n)
    }
    fn f64(&self, f: &str) -> Result<f64> {
        match self.get(f) {
            None => Err(self.bad(f, "missing".into())),
            Some(v) => v.as_f64().ok_or_else(|| self.bad(f, format!("expected a number, got {v}"))),
        }
    }
    fn opt_f64(&self, f: &str) -> Result<Option<f64>> {
        self.get(f).map(|_| self.f64(f)).transpose()
    }
    fn opt_bool(&self, f: &str) -> Result<Option<bool>> {
        self.get(f).map(|v| v.as_bool().ok_or_else(|| self.bad(f, format!("expected a bool, got {v}")))).transpose()
    }
    fn opt_uint_list(&self, f: &str) -> Result<Option<Vec<usize>>> {
        let Some(v) = self.get(f) else { return Ok(None) };
        let list = v.as_array().ok_or_else(|| self.bad(f, format!("expected a list, got {v}")))?;
        list.iter()
            .map(|x| x.as_u64().map(|n| n as usize).ok_or_else(|| self.bad(f, format!("expected integers, got {x}"))))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
}
