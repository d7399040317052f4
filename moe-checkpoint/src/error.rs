//! The one error type of the loader: every variant names the file, the tensor or the config
//! field it is about, so a corrupt or mismatched checkpoint is diagnosed without a debugger.

use std::path::PathBuf;

/// Why a checkpoint (or one of its layers) could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// A file could not be opened or mapped.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// `config.json` or `model.safetensors.index.json` is not valid JSON.
    #[error("{path}: not valid JSON: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        source: serde_json::Error,
    },
    /// A `config.json` field is missing, of the wrong type or out of range.
    #[error("config.json: `{field}`: {why}")]
    Config {
        /// The field, e.g. `hidden_size` or `quantization_config.group_size`.
        field: String,
        /// What is wrong with it.
        why: String,
    },
    /// The layer index is past the model's last layer.
    #[error("layer {layer} is out of range: the model has {layers} layers (0..{layers})")]
    LayerOutOfRange {
        /// The layer asked for.
        layer: usize,
        /// `num_hidden_layers`.
        layers: usize,
    },
    /// The layer exists but is a dense MLP, not a Mixture-of-Experts layer.
    #[error("layer {layer} is a dense MLP layer, not a MoE layer ({why})")]
    DenseLayer {
        /// The layer asked for.
        layer: usize,
        /// Which config fields say so.
        why: String,
    },
    /// A tensor the layer needs is in no shard (or not in the shard the index names).
    #[error("tensor `{tensor}` is missing from {file}")]
    MissingTensor {
        /// The tensor name.
        tensor: String,
        /// Where it was looked for (a shard, or the index).
        file: PathBuf,
    },
    /// A tensor has another shape than the config implies.
    #[error("tensor `{tensor}` has shape {got:?}, expected {expected:?}")]
    Shape {
        /// The tensor name.
        tensor: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape in the file.
        got: Vec<usize>,
    },
    /// A tensor has a dtype the format does not use.
    #[error("tensor `{tensor}` has dtype {got}, expected {expected}")]
    Dtype {
        /// The tensor name.
        tensor: String,
        /// The dtype(s) accepted.
        expected: String,
        /// The dtype in the file.
        got: String,
    },
    /// A safetensors file is truncated or corrupt (the safetensors crate's own diagnosis).
    #[error("{file}: corrupt or truncated safetensors file: {source}")]
    Corrupt {
        /// The shard.
        file: PathBuf,
        /// What the safetensors parser found.
        source: safetensors::SafeTensorError,
    },
    /// A tensor's values cannot be represented exactly in moeforge's format.
    #[error("tensor `{tensor}`: {why}")]
    Value {
        /// The tensor name.
        tensor: String,
        /// What value and why.
        why: String,
    },
    /// GPTQ act-order: `g_idx` is not `k / group_size`, so groups are not contiguous along K.
    #[error(
        "tensor `{tensor}`: GPTQ act-order (desc_act) is not supported: g_idx[{k}] = {got}, expected {expected} (k / \
         group_size)"
    )]
    ActOrder {
        /// The `g_idx` tensor.
        tensor: String,
        /// The first input channel out of order.
        k: usize,
        /// Its group in the file.
        got: i64,
        /// Its group without act-order.
        expected: usize,
    },
    /// The model, its quantization or one of its features is not supported (yet).
    #[error("{model}: {feature} is not supported")]
    Unsupported {
        /// The model type (`config.json`'s `model_type`).
        model: String,
        /// What is missing, and why.
        feature: String,
    },
    /// An expert asked of [`crate::load_layer_experts`] that the layer does not have.
    #[error("expert {expert} is out of range: the layer has {experts} routed experts (0..{experts})")]
    ExpertOutOfRange {
        /// The expert asked for.
        expert: u32,
        /// The layer's routed experts.
        experts: u32,
    },
    /// The geometry read from the config makes no valid [`moe_codegen::MoeSpec`].
    #[error("the layer's spec: {0}")]
    Spec(#[from] moe_codegen::SpecError),
}

/// The loader's result type.
pub type Result<T, E = CheckpointError> = std::result::Result<T, E>;
