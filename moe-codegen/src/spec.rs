//! The MoE layer's description, validated once at construction.

use crate::dequant::DequantVariant;
use crate::format::WeightFormat;
use crate::router::Router;
use std::fmt;
use std::str::FromStr;

/// Largest expert count the decode kernels' shared-memory routing tables hold.
pub const MAX_EXPERTS: u32 = 1024;
/// Largest top-k the kernels accept (routing is staged in shared memory).
pub const MAX_TOP_K: u32 = 32;

/// Why a spec was refused. Every message names the field, what came and what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// A size that must be positive is zero.
    #[error("`{field}` must be greater than zero")]
    Zero {
        /// The spec field (`hidden`, `intermediate`, `experts`, `top_k`).
        field: &'static str,
    },
    /// More experts per token than the layer has.
    #[error("top_k = {top_k} exceeds experts = {experts}")]
    TopKExceedsExperts {
        /// The requested experts per token.
        top_k: u32,
        /// The layer's expert count.
        experts: u32,
    },
    /// A size above what the kernels support ([`MAX_EXPERTS`], [`MAX_TOP_K`]).
    #[error("`{field}` = {value} exceeds the supported maximum {max}")]
    TooLarge {
        /// The spec field.
        field: &'static str,
        /// The value given.
        value: u32,
        /// The largest value supported.
        max: u32,
    },
    /// A size that must be a multiple of a vector width, scale group or block is not.
    #[error("`{field}` = {value} is not a multiple of {divisor} ({why})")]
    NotDivisible {
        /// The spec field.
        field: &'static str,
        /// The value given.
        value: u32,
        /// What it must be a multiple of.
        divisor: u32,
        /// Where the divisor comes from.
        why: &'static str,
    },
    /// A name (arch, format, activation, ...) that parses to nothing known.
    #[error("unknown {what} `{got}`; expected one of: {expected}")]
    Unknown {
        /// What was being parsed, e.g. `arch`.
        what: &'static str,
        /// The text given.
        got: String,
        /// The accepted names, comma-separated.
        expected: &'static str,
    },
    /// An activation dtype the weight format cannot be combined with.
    #[error("activation dtype {act} does not go with weight format {format}: {why}")]
    ActDtypeMismatch {
        /// The activation dtype given.
        act: ActDtype,
        /// The weight format given.
        format: WeightFormat,
        /// Why the pair is refused.
        why: &'static str,
    },
    /// A router the layer's experts and top-k cannot serve.
    #[error("router: {why}")]
    Router {
        /// What is wrong with the router.
        why: String,
    },
    /// A dequant variant the weight format does not have.
    #[error("weight format {format} has no dequant variant `{variant}`: {why}")]
    DequantUnsupported {
        /// The weight format.
        format: WeightFormat,
        /// The variant named.
        variant: DequantVariant,
        /// Why the format lacks it.
        why: &'static str,
    },
}

/// The gated activation applied between the up and down projections, `glu(gate, up)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum Activation {
    /// SwiGLU: `silu(gate) * up` (Qwen, Mixtral, OLMoE, DeepSeek).
    Silu,
    /// GeGLU with the tanh approximation: `gelu_tanh(gate) * up`.
    GeluTanh,
    /// gpt-oss's clamped SwiGLU: `gate` clamped above at 7, `up` to [-7, 7], then
    /// `gate * sigmoid(1.702 * gate) * (up + 1)` (Hugging Face `GptOssExperts`).
    SwigluOai,
}

/// [`Activation::SwigluOai`]'s constants (gpt-oss's `alpha` and `limit`).
pub const SWIGLU_OAI_ALPHA: f64 = 1.702;
/// See [`SWIGLU_OAI_ALPHA`].
pub const SWIGLU_OAI_LIMIT: f64 = 7.0;

impl Activation {
    /// Every activation.
    pub const ALL: [Activation; 3] = [Activation::Silu, Activation::GeluTanh, Activation::SwigluOai];
    /// The name `#[moe_kernel]`, `FromStr` and `Display` use (`silu`, `gelu_tanh`, `swiglu_oai`).
    pub const fn name(self) -> &'static str {
        match self {
            Activation::Silu => "silu",
            Activation::GeluTanh => "gelu_tanh",
            Activation::SwigluOai => "swiglu_oai",
        }
    }
    /// f64 reference: the intermediate value of one neuron from its gate and up projections.
    pub fn glu(self, g: f64, u: f64) -> f64 {
        match self {
            Activation::Silu => g / (1.0 + (-g).exp()) * u,
            Activation::GeluTanh => {
                let c = (2.0 / std::f64::consts::PI).sqrt();
                0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh()) * u
            }
            Activation::SwigluOai => {
                let g = g.min(SWIGLU_OAI_LIMIT);
                let u = u.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT);
                g / (1.0 + (-SWIGLU_OAI_ALPHA * g).exp()) * (u + 1.0)
            }
        }
    }
}

/// Element type of the activations `x` and the output `y`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum ActDtype {
    /// bfloat16 (`__nv_bfloat16`).
    Bf16,
    /// IEEE half precision (`__half`).
    Fp16,
}

impl ActDtype {
    /// Every activation dtype.
    pub const ALL: [ActDtype; 2] = [ActDtype::Bf16, ActDtype::Fp16];
    /// The name `#[moe_kernel]`, `FromStr` and `Display` use (`bf16`, `fp16`).
    pub const fn name(self) -> &'static str {
        match self {
            ActDtype::Bf16 => "bf16",
            ActDtype::Fp16 => "fp16",
        }
    }
    /// Bytes of one element.
    pub const fn bytes(self) -> usize {
        2
    }
    /// The CUDA C type name.
    pub const fn cuda_type(self) -> &'static str {
        match self {
            ActDtype::Bf16 => "__nv_bfloat16",
            ActDtype::Fp16 => "__half",
        }
    }
    /// Round an f32 to this dtype and back, as the device stores it.
    pub fn round(self, v: f32) -> f32 {
        match self {
            ActDtype::Bf16 => half::bf16::from_f32(v).to_f32(),
            ActDtype::Fp16 => half::f16::from_f32(v).to_f32(),
        }
    }
}

/// A GPU target. The `a` suffix is the arch-specific feature set (wgmma, setmaxnreg, tcgen05...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum Arch {
    /// Hopper: H100, H200.
    Sm90a,
    /// Datacenter Blackwell: B200, GB200.
    Sm100a,
    /// Consumer / workstation Blackwell: RTX PRO 6000, RTX 50xx.
    Sm120a,
}

impl Arch {
    /// Every arch moeforge renders for.
    pub const ALL: [Arch; 3] = [Arch::Sm90a, Arch::Sm100a, Arch::Sm120a];
    /// The NVRTC `--gpu-architecture` value.
    pub const fn name(self) -> &'static str {
        match self {
            Arch::Sm90a => "sm_90a",
            Arch::Sm100a => "sm_100a",
            Arch::Sm120a => "sm_120a",
        }
    }
    /// The arch to build for on a device of this compute capability, if moeforge targets it.
    pub fn from_compute_capability(major: i32, minor: i32) -> Option<Arch> {
        match (major, minor) {
            (9, 0) => Some(Arch::Sm90a),
            (10, 0) => Some(Arch::Sm100a),
            (12, 0) => Some(Arch::Sm120a),
            _ => None,
        }
    }
}

/// The kernel families one spec can be rendered into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum KernelFamily {
    /// Output-centric decode: one warp per output element, two kernels (gate_up, down).
    WarpDecode,
    /// Prefill: route, align tokens into expert-contiguous tiles, grouped tensor-core GEMMs
    /// (SwiGLU fused into the first, routing weights and the combine into the second).
    GroupedGemm,
    /// Mid-size steps: up-projection, activation and down-projection in one cooperative launch
    /// on tensor cores, the intermediate kept in L2.
    Fused,
}

impl KernelFamily {
    /// Every kernel family.
    pub const ALL: [KernelFamily; 3] = [KernelFamily::WarpDecode, KernelFamily::GroupedGemm, KernelFamily::Fused];
    /// The name `#[moe_kernel]`, `FromStr` and `Display` use (`warp_decode`, `grouped_gemm`, `fused`).
    pub const fn name(self) -> &'static str {
        match self {
            KernelFamily::WarpDecode => "warp_decode",
            KernelFamily::GroupedGemm => "grouped_gemm",
            KernelFamily::Fused => "fused",
        }
    }
}

macro_rules! named_enum_parse {
    ($ty:ty, $what:literal, $expected:literal) => {
        impl FromStr for $ty {
            type Err = SpecError;
            fn from_str(s: &str) -> Result<Self, SpecError> {
                <$ty>::ALL.into_iter().find(|v| v.name() == s).ok_or_else(|| SpecError::Unknown {
                    what: $what,
                    got: s.to_string(),
                    expected: $expected,
                })
            }
        }
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}
named_enum_parse!(Activation, "activation", "silu, gelu_tanh, swiglu_oai");
named_enum_parse!(ActDtype, "activation dtype", "bf16, fp16");
named_enum_parse!(Arch, "arch", "sm_90a, sm_100a, sm_120a");
named_enum_parse!(KernelFamily, "kernel family", "warp_decode, grouped_gemm, fused");

/// The geometry and number formats of one MoE layer. Construct with [`MoeSpec::new`] or
/// [`MoeSpec::builder`]; a value of this type is always valid.
///
/// Weight layout (the vLLM / Hugging Face convention, row-major, contiguous):
/// - `w13`: `[experts, 2 * intermediate, hidden]`, the gate rows `0..I` first, then the up rows `I..2I`;
/// - `w2`: `[experts, hidden, intermediate]`.
///
/// For each token `t` routed to experts `e_s` with weights `r_s`:
/// `y[t] = sum_s r_s * w2[e_s] @ (act(w13[e_s][..I] @ x[t]) * (w13[e_s][I..] @ x[t]))`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct MoeSpec {
    hidden: u32,
    intermediate: u32,
    experts: u32,
    top_k: u32,
    activation: Activation,
    weight_format: WeightFormat,
    act_dtype: ActDtype,
    /// `None`: the format's default on the arch rendered for ([`WeightFormat::default_dequant`]).
    dequant: Option<DequantVariant>,
    /// How router logits become routing (only the prefill family routes on the device).
    #[serde(default)]
    router: Router,
    /// Per-expert biases: `w13_bias [E, 2I]` added to the gate / up projections before the
    /// activation, `w2_bias [E, H]` to each expert's output before its routing weight (gpt-oss).
    #[serde(default)]
    bias: bool,
    /// Shared experts every token uses besides its routed ones (DeepSeek-V3, Qwen2-MoE), stored
    /// after the routed experts and computed in the same step.
    #[serde(default)]
    shared: u32,
    /// Whether the shared experts' output is scaled by `sigmoid(x . shared_gate)` per token
    /// (Qwen2-MoE) rather than 1 (DeepSeek-V3).
    #[serde(default)]
    shared_gated: bool,
}

/// Why a reduction axis must be a multiple of the format's vector width.
pub const VECTOR_WIDTH_WHY: &str = "the weight format's 16-byte vector width";

impl MoeSpec {
    /// A spec with SiLU and the format's default activation dtype.
    pub const fn builder(hidden: u32, intermediate: u32, experts: u32, top_k: u32) -> MoeSpecBuilder {
        MoeSpecBuilder {
            hidden,
            intermediate,
            experts,
            top_k,
            activation: Activation::Silu,
            weight_format: WeightFormat::Bf16,
            act_dtype: None,
            dequant: None,
            bias: false,
        }
    }

    /// Validate and build, with the format's default dequant variant. `const` so that
    /// `#[moe_kernel]` runs the very same checks at compile time.
    pub const fn new(
        hidden: u32,
        intermediate: u32,
        experts: u32,
        top_k: u32,
        activation: Activation,
        weight_format: WeightFormat,
        act_dtype: ActDtype,
    ) -> Result<MoeSpec, SpecError> {
        MoeSpec::new_with_dequant(hidden, intermediate, experts, top_k, activation, weight_format, act_dtype, None)
    }

    /// [`MoeSpec::new`] naming the dequant variant (`None`: the format's default per arch). A variant
    /// the format lacks altogether is refused here; one that only some archs lack, when rendering.
    #[allow(clippy::too_many_arguments)]
    pub const fn new_with_dequant(
        hidden: u32,
        intermediate: u32,
        experts: u32,
        top_k: u32,
        activation: Activation,
        weight_format: WeightFormat,
        act_dtype: ActDtype,
        dequant: Option<DequantVariant>,
    ) -> Result<MoeSpec, SpecError> {
        MoeSpec::new_full(hidden, intermediate, experts, top_k, activation, weight_format, act_dtype, dequant, false)
    }

    #[allow(clippy::too_many_arguments)]
    const fn new_full(
        hidden: u32,
        intermediate: u32,
        experts: u32,
        top_k: u32,
        activation: Activation,
        weight_format: WeightFormat,
        act_dtype: ActDtype,
        dequant: Option<DequantVariant>,
        bias: bool,
    ) -> Result<MoeSpec, SpecError> {
        if hidden == 0 {
            return Err(SpecError::Zero { field: "hidden" });
        }
        if intermediate == 0 {
            return Err(SpecError::Zero { field: "intermediate" });
        }
        if experts == 0 {
            return Err(SpecError::Zero { field: "experts" });
        }
        if top_k == 0 {
            return Err(SpecError::Zero { field: "top_k" });
        }
        if experts > MAX_EXPERTS {
            return Err(SpecError::TooLarge { field: "experts", value: experts, max: MAX_EXPERTS });
        }
        if top_k > experts {
            return Err(SpecError::TopKExceedsExperts { top_k, experts });
        }
        if top_k > MAX_TOP_K {
            return Err(SpecError::TooLarge { field: "top_k", value: top_k, max: MAX_TOP_K });
        }
        // Every kernel streams weight rows in 16-byte vectors and reads activations in matching
        // runs, so both reduction axes must hold whole vectors.
        let vec = weight_format.elems_per_16b();
        if hidden % vec != 0 {
            return Err(SpecError::NotDivisible {
                field: "hidden",
                value: hidden,
                divisor: vec,
                why: VECTOR_WIDTH_WHY,
            });
        }
        if intermediate % vec != 0 {
            return Err(SpecError::NotDivisible {
                field: "intermediate",
                value: intermediate,
                divisor: vec,
                why: VECTOR_WIDTH_WHY,
            });
        }
        // Scales cover whole groups (blocks) along K: hidden is w13's K, intermediate w2's.
        let group = weight_format.k_group();
        if let WeightFormat::Fp8E4m3B128 = weight_format {
            // The block grid also runs down the rows: w2 has `hidden` rows per expert, w13 two
            // halves of `intermediate`, and a block must not straddle the gate and up halves.
            if hidden % 128 != 0 {
                return Err(SpecError::NotDivisible {
                    field: "hidden",
                    value: hidden,
                    divisor: 128,
                    why: "fp8_e4m3_b128 scales 128x128 blocks: w13's K and w2's rows must hold whole blocks",
                });
            }
            if intermediate % 128 != 0 {
                return Err(SpecError::NotDivisible {
                    field: "intermediate",
                    value: intermediate,
                    divisor: 128,
                    why: "fp8_e4m3_b128 scales 128x128 blocks: w2's K must hold whole blocks and w13's gate and \
                          up halves must not share one",
                });
            }
        } else if group > 0 {
            if hidden % group != 0 {
                return Err(SpecError::NotDivisible {
                    field: "hidden",
                    value: hidden,
                    divisor: group,
                    why: "the weight format's scale group along K",
                });
            }
            if intermediate % group != 0 {
                return Err(SpecError::NotDivisible {
                    field: "intermediate",
                    value: intermediate,
                    divisor: group,
                    why: "the weight format's scale group along K",
                });
            }
        }
        if let Some(v) = dequant {
            if !weight_format.has_dequant(v) {
                return Err(SpecError::DequantUnsupported {
                    format: weight_format,
                    variant: v,
                    why: match weight_format.dequant_on(v, Arch::Sm90a) {
                        Err(why) => why,
                        Ok(()) => "unavailable",
                    },
                });
            }
        }
        if let WeightFormat::Fp16 = weight_format {
            if let ActDtype::Bf16 = act_dtype {
                return Err(SpecError::ActDtypeMismatch {
                    act: act_dtype,
                    format: weight_format,
                    why: "fp16 weights take fp16 activations",
                });
            }
        }
        Ok(MoeSpec {
            hidden,
            intermediate,
            experts,
            top_k,
            activation,
            weight_format,
            act_dtype,
            dequant,
            router: Router::Softmax { renormalize: true },
            bias,
            shared: 0,
            shared_gated: false,
        })
    }

    /// The model dimension: `x` and `y` rows, `w13`'s K, `w2`'s rows.
    pub const fn hidden(&self) -> u32 {
        self.hidden
    }
    /// One expert's intermediate size: `w13` holds `2 * intermediate` rows, `w2`'s K.
    pub const fn intermediate(&self) -> u32 {
        self.intermediate
    }
    /// The number of experts in the layer.
    pub const fn experts(&self) -> u32 {
        self.experts
    }
    /// Experts each token is routed to.
    pub const fn top_k(&self) -> u32 {
        self.top_k
    }
    /// The gated activation between the projections.
    pub const fn activation(&self) -> Activation {
        self.activation
    }
    /// How `w13` and `w2` are stored.
    pub const fn weight_format(&self) -> WeightFormat {
        self.weight_format
    }
    /// Element type of the activations `x` and the output `y`.
    pub const fn act_dtype(&self) -> ActDtype {
        self.act_dtype
    }
    /// How router logits become routing (default: softmax over every expert, top-k renormalised).
    pub const fn router(&self) -> Router {
        self.router
    }

    /// This spec with another router, checked against its experts and top-k.
    pub fn with_router(mut self, router: Router) -> Result<MoeSpec, SpecError> {
        router.validate(self.experts, self.top_k)?;
        self.router = router;
        Ok(self)
    }

    /// [`MoeSpec::with_router`] for `#[moe_kernel]`'s constants, whose router the macro checked
    /// with `with_router` when it expanded (this one, `const`, checks nothing).
    #[doc(hidden)]
    pub const fn with_router_checked_by_macro(mut self, router: Router) -> MoeSpec {
        self.router = router;
        self
    }

    /// This spec with (or without) per-expert biases.
    pub const fn with_bias(mut self, bias: bool) -> MoeSpec {
        self.bias = bias;
        self
    }
    /// Whether the experts have biases (`w13_bias [E, 2I]`, `w2_bias [E, H]`, f32).
    pub const fn has_bias(&self) -> bool {
        self.bias
    }

    /// This spec with `count` shared experts (each of the spec's intermediate size; a larger
    /// shared expert is split into several along its intermediate dimension, which computes the
    /// same sum), weighted 1 or, if `gated`, by `sigmoid(x . shared_gate)` per token. Their
    /// weights follow the routed experts' in w13 / w2 (experts `E .. E + count`).
    pub const fn with_shared_experts(mut self, count: u32, gated: bool) -> Result<MoeSpec, SpecError> {
        if self.experts + count > MAX_EXPERTS {
            return Err(SpecError::TooLarge {
                field: "experts + shared experts",
                value: self.experts + count,
                max: MAX_EXPERTS,
            });
        }
        if self.top_k + count > MAX_TOP_K {
            return Err(SpecError::TooLarge {
                field: "top_k + shared experts",
                value: self.top_k + count,
                max: MAX_TOP_K,
            });
        }
        if gated && count == 0 {
            return Err(SpecError::Zero { field: "shared experts (a shared gate needs at least one)" });
        }
        self.shared = count;
        self.shared_gated = gated;
        Ok(self)
    }
    /// Shared experts every token uses (0: none).
    pub const fn shared_experts(&self) -> u32 {
        self.shared
    }
    /// Whether the shared experts are scaled by `sigmoid(x . shared_gate)` per token.
    pub const fn shared_gated(&self) -> bool {
        self.shared_gated
    }
    /// The layer the kernels compute: the shared experts as experts `E .. E + S` that every
    /// token's routing names in slots `k .. k + S` (the layer appends them on the device). The
    /// spec itself where there are none.
    pub const fn kernel_spec(&self) -> MoeSpec {
        let mut k = *self;
        k.experts += self.shared;
        k.top_k += self.shared;
        k.shared = 0;
        k.shared_gated = false;
        k
    }

    /// The dequant variant the spec names; `None`: the format's default on each arch.
    pub const fn dequant(&self) -> Option<DequantVariant> {
        self.dequant
    }
    /// The variant the kernels for `arch` use (named or default), or why `arch` lacks the named one.
    pub const fn dequant_for(&self, arch: Arch) -> Result<DequantVariant, &'static str> {
        let v = match self.dequant {
            Some(v) => v,
            None => self.weight_format.default_dequant(arch),
        };
        match self.weight_format.dequant_on(v, arch) {
            Ok(()) => Ok(v),
            Err(why) => Err(why),
        }
    }

    /// Elements of `w13` (all experts).
    pub const fn w13_elems(&self) -> usize {
        self.experts as usize * 2 * self.intermediate as usize * self.hidden as usize
    }
    /// Elements of `w2` (all experts).
    pub const fn w2_elems(&self) -> usize {
        self.experts as usize * self.hidden as usize * self.intermediate as usize
    }
    /// Bytes one expert's weights (w13 + w2, every scale the kernels read included) occupy.
    pub fn expert_bytes(&self) -> usize {
        let f = self.weight_format;
        let (h, i) = (self.hidden as usize, self.intermediate as usize);
        f.bytes_for(2 * i, h) + f.bytes_for(h, i)
    }

    /// A short, file-name-safe id of the spec, e.g. `h2048_i768_e128_k8_bf16_bf16_silu`; a named
    /// dequant variant is appended (`..._silu_lut`).
    pub fn id(&self) -> String {
        let dq = self.dequant.map_or(String::new(), |d| format!("_{d}"));
        // The default router is left out so ids (and module names) of decode specs stay short.
        let router = if self.router == Router::default() { String::new() } else { format!("_{}", self.router) };
        let bias = if self.bias { "_bias" } else { "" };
        let shared = match (self.shared, self.shared_gated) {
            (0, _) => String::new(),
            (s, false) => format!("_sh{s}"),
            (s, true) => format!("_sh{s}g"),
        };
        format!(
            "h{}_i{}_e{}_k{}_{}_{}_{}{bias}{shared}{router}{dq}",
            self.hidden,
            self.intermediate,
            self.experts,
            self.top_k,
            self.weight_format,
            self.act_dtype,
            self.activation
        )
    }
}

/// Builder for [`MoeSpec`] with defaults: SiLU, bf16 weights, the format's activation dtype.
#[derive(Debug, Clone, Copy)]
pub struct MoeSpecBuilder {
    hidden: u32,
    intermediate: u32,
    experts: u32,
    top_k: u32,
    activation: Activation,
    weight_format: WeightFormat,
    act_dtype: Option<ActDtype>,
    dequant: Option<DequantVariant>,
    bias: bool,
}

impl MoeSpecBuilder {
    /// Per-expert biases on w13 and w2 (default: none).
    pub const fn bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }
    /// Set the activation (default: SiLU).
    pub const fn activation(mut self, a: Activation) -> Self {
        self.activation = a;
        self
    }
    /// Set the weight format (default: bf16).
    pub const fn weight_format(mut self, f: WeightFormat) -> Self {
        self.weight_format = f;
        self
    }
    /// Set the activation dtype (default: the format's, [`WeightFormat::default_act_dtype`]).
    pub const fn act_dtype(mut self, d: ActDtype) -> Self {
        self.act_dtype = Some(d);
        self
    }
    /// Name the dequant variant (default: the format's, per arch).
    pub const fn dequant(mut self, d: DequantVariant) -> Self {
        self.dequant = Some(d);
        self
    }
    /// Validate and build, with the same checks as [`MoeSpec::new_with_dequant`].
    pub const fn build(self) -> Result<MoeSpec, SpecError> {
        let act = match self.act_dtype {
            Some(d) => d,
            None => self.weight_format.default_act_dtype(),
        };
        MoeSpec::new_full(
            self.hidden,
            self.intermediate,
            self.experts,
            self.top_k,
            self.activation,
            self.weight_format,
            act,
            self.dequant,
            self.bias,
        )
    }
}

/// The reference geometries every variant is checked against (`moe-jit check`, tests).
pub const REFERENCE_GEOMETRIES: [(&str, u32, u32, u32, u32); 4] = [
    ("qwen3-30b-a3b", 2048, 768, 128, 8),
    ("mixtral-8x7b", 4096, 14336, 8, 2),
    ("olmoe", 2048, 1024, 64, 8),
    ("gpt-oss-20b", 2880, 2880, 32, 4),
];

#[cfg(test)]
mod tests {
    use super::*;

    fn b(h: u32, i: u32, e: u32, k: u32) -> MoeSpecBuilder {
        MoeSpec::builder(h, i, e, k)
    }

    #[test]
    fn reference_geometries_are_valid_in_every_format() {
        for (_, h, i, e, k) in REFERENCE_GEOMETRIES {
            for f in WeightFormat::ALL {
                // Scale groups (blocks) along K must divide both reduction axes: gpt-oss-20b's 2880
                // takes groups of 32 and 64, not 128.
                let g = f.k_group().max(1);
                if h % g != 0 || i % g != 0 {
                    let e = b(h, i, e, k).weight_format(f).build().unwrap_err();
                    assert!(matches!(e, SpecError::NotDivisible { divisor, .. } if divisor == g), "{f}: {e}");
                    continue;
                }
                let s = b(h, i, e, k).weight_format(f).build().unwrap();
                assert_eq!((s.hidden(), s.intermediate(), s.experts(), s.top_k()), (h, i, e, k));
                assert_eq!(s.act_dtype(), f.default_act_dtype());
            }
        }
    }

    #[test]
    fn zero_sizes_are_refused_by_name() {
        assert_eq!(b(0, 8, 8, 2).build(), Err(SpecError::Zero { field: "hidden" }));
        assert_eq!(b(8, 0, 8, 2).build(), Err(SpecError::Zero { field: "intermediate" }));
        assert_eq!(b(8, 8, 0, 2).build(), Err(SpecError::Zero { field: "experts" }));
        assert_eq!(b(8, 8, 8, 0).build(), Err(SpecError::Zero { field: "top_k" }));
    }

    #[test]
    fn top_k_and_limits() {
        assert_eq!(b(8, 8, 4, 5).build(), Err(SpecError::TopKExceedsExperts { top_k: 5, experts: 4 }));
        assert_eq!(
            b(8, 8, 2048, 2).build(),
            Err(SpecError::TooLarge { field: "experts", value: 2048, max: MAX_EXPERTS })
        );
        assert_eq!(b(8, 8, 64, 33).build(), Err(SpecError::TooLarge { field: "top_k", value: 33, max: MAX_TOP_K }));
    }

    #[test]
    fn vector_width_must_divide_both_reduction_axes() {
        // bf16 vectors hold 8, fp8 vectors 16.
        assert!(b(2056, 768, 8, 2).build().is_ok());
        let e = b(2056, 768, 8, 2).weight_format(WeightFormat::Fp8E4m3).build().unwrap_err();
        assert!(matches!(e, SpecError::NotDivisible { field: "hidden", value: 2056, divisor: 16, .. }), "{e}");
        let e = b(2048, 772, 8, 2).build().unwrap_err();
        assert!(matches!(e, SpecError::NotDivisible { field: "intermediate", value: 772, divisor: 8, .. }));
        assert!(e.to_string().contains("16-byte vector"), "{e}");
    }

    #[test]
    fn act_dtype_must_match_fp16_weights() {
        let e = b(64, 64, 4, 2).weight_format(WeightFormat::Fp16).act_dtype(ActDtype::Bf16).build().unwrap_err();
        assert!(matches!(e, SpecError::ActDtypeMismatch { .. }));
        assert!(b(64, 64, 4, 2).weight_format(WeightFormat::Bf16).act_dtype(ActDtype::Fp16).build().is_ok());
    }

    #[test]
    fn names_round_trip_and_unknown_names_list_the_choices() {
        for a in Arch::ALL {
            assert_eq!(a.name().parse::<Arch>().unwrap(), a);
        }
        for f in WeightFormat::ALL {
            assert_eq!(f.to_string().parse::<WeightFormat>().unwrap(), f);
        }
        let e = "sm_80".parse::<Arch>().unwrap_err();
        assert!(e.to_string().contains("sm_90a, sm_100a, sm_120a"), "{e}");
        assert!("relu".parse::<Activation>().is_err());
        assert_eq!(Arch::from_compute_capability(9, 0), Some(Arch::Sm90a));
        assert_eq!(Arch::from_compute_capability(12, 0), Some(Arch::Sm120a));
        assert_eq!(Arch::from_compute_capability(8, 0), None);
    }

    #[test]
    fn sizes_and_id() {
        let s = b(2048, 768, 128, 8).build().unwrap();
        assert_eq!(s.w13_elems(), 128 * 2 * 768 * 2048);
        assert_eq!(s.expert_bytes(), 3 * 768 * 2048 * 2);
        let f = b(2048, 768, 128, 8).weight_format(WeightFormat::Fp8E4m3).build().unwrap();
        assert_eq!(f.expert_bytes(), 3 * 768 * 2048 + 4 * (2 * 768 + 2048));
        assert_eq!(s.id(), "h2048_i768_e128_k8_bf16_bf16_silu");
        let g = b(2880, 2880, 32, 4).activation(Activation::SwigluOai).bias(true).build().unwrap();
        assert!(g.has_bias());
        assert_eq!(g.id(), "h2880_i2880_e32_k4_bf16_bf16_swiglu_oai_bias");
    }

    #[test]
    fn shared_experts_widen_the_kernel_spec() {
        let s = b(2048, 768, 256, 8).build().unwrap().with_shared_experts(1, false).unwrap();
        let k = s.kernel_spec();
        assert_eq!((k.experts(), k.top_k(), k.shared_experts()), (257, 9, 0));
        assert_eq!(s.id(), "h2048_i768_e256_k8_bf16_bf16_silu_sh1");
        let q = b(2048, 1408, 60, 4).build().unwrap().with_shared_experts(4, true).unwrap();
        assert!(q.shared_gated() && q.id().ends_with("_sh4g"));
        assert!(b(64, 64, 1024, 8).build().unwrap().with_shared_experts(1, false).is_err());
        assert!(b(64, 64, 64, 30).build().unwrap().with_shared_experts(3, false).is_err());
        assert!(b(64, 64, 64, 8).build().unwrap().with_shared_experts(0, true).is_err());
    }

    #[test]
    fn swiglu_oai_clamps_as_gpt_oss() {
        let a = Activation::SwigluOai;
        // Below the limits: gate * sigmoid(1.702 gate) * (up + 1).
        let want = 0.5 / (1.0 + (-1.702f64 * 0.5).exp()) * (2.0 + 1.0);
        assert!((a.glu(0.5, 2.0) - want).abs() < 1e-15);
        // gate clamps above only, up on both sides.
        assert_eq!(a.glu(9.0, 9.0), a.glu(7.0, 7.0));
        assert_eq!(a.glu(-9.0, -9.0), a.glu(-9.0, -7.0));
        assert!(a.glu(-9.0, 0.0) < 0.0 && a.glu(-9.0, 0.0) > -1e-5);
    }
}
