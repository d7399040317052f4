//! A MoE layer on one GPU: its weights, its kernels, and `forward`.

use crate::device::Device;
use crate::dispatch::{choose_family, Choice, DispatchModel, ModelSource};
use crate::error::{Result, RuntimeError};
use crate::families::decode::DecodeFamily;
use crate::families::fused::FusedFamily;
use crate::families::grouped::{Alignment, GroupedPath};
use crate::families::{Part, ScratchSlot, StepAt, StepPtrs};
use crate::launch::ptr;
use crate::view::{DeviceTensor, DeviceTensorMut, TopkIds};
use crate::weights::Weights;
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use moe_codegen::heuristics::{large_step_tiles, large_step_tokens};
use moe_codegen::{render, ActDtype, KernelFamily, KernelSource, MoeSpec, TOKEN_TILES};
use std::sync::{Arc, Mutex};

/// Element types the activations `x` / `y` may have. With the `f16` feature (the facade's
/// default) they are cudarc `DeviceRepr`s, so generic code can allocate and copy them.
#[cfg(feature = "f16")]
pub trait ActElem: DeviceRepr + Copy + Default {
    /// The activation dtype the kernels are rendered for.
    const DTYPE: ActDtype;
    /// Convert from `f32`, rounding to nearest.
    fn from_f32(v: f32) -> Self;
    /// Convert to `f32` (exact).
    fn to_f32(self) -> f32;
}
/// Element types the activations `x` / `y` may have.
#[cfg(not(feature = "f16"))]
pub trait ActElem: Copy + Default {
    /// The activation dtype the kernels are rendered for.
    const DTYPE: ActDtype;
    /// Convert from `f32`, rounding to nearest.
    fn from_f32(v: f32) -> Self;
    /// Convert to `f32` (exact).
    fn to_f32(self) -> f32;
}
impl ActElem for half::bf16 {
    const DTYPE: ActDtype = ActDtype::Bf16;
    fn from_f32(v: f32) -> Self {
        half::bf16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
}
impl ActElem for half::f16 {
    const DTYPE: ActDtype = ActDtype::Fp16;
    fn from_f32(v: f32) -> Self {
        half::f16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
}

/// A MoE layer loaded on one GPU: its weights on the device, its compiled kernels (warp decode,
/// and the grouped GEMMs where the spec allows them) and their scratch; `forward` runs a step.
pub struct MoeLayer {
    spec: MoeSpec,
    /// What the kernels compute: `spec` with its shared experts as experts past the routed ones
    /// (`MoeSpec::kernel_spec`); the families are built for it.
    kspec: MoeSpec,
    stream: Arc<CudaStream>,
    w13: CudaSlice<u8>,
    w13_scales: CudaSlice<u8>,
    w2: CudaSlice<u8>,
    w2_scales: CudaSlice<u8>,
    /// `(w13_bias, w2_bias)` of a spec with biases.
    bias: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    /// The gated shared experts' gate `[H]`.
    shared_gate: Option<CudaSlice<f32>>,
    /// A step's routing with the shared experts' slots appended (`[M, k + S]`), grown as `ids32`;
    /// one per [`ScratchSlot`].
    ids_ext: [Mutex<CudaSlice<i32>>; 2],
    weights_ext: [Mutex<CudaSlice<f32>>; 2],
    /// Count of out-of-range expert ids the kernels met.
    errors: CudaSlice<i32>,
    /// int64 routing ids narrowed to int32 (`forward_on` with [`TopkIds::I64`]), or the ids a
    /// decode-only layer routes from logits into.
    ids32: Mutex<CudaSlice<i32>>,
    /// The routing weights a decode-only layer routes from logits into.
    weights32: Mutex<CudaSlice<f32>>,
    validate_routing: bool,
    decode: DecodeFamily,
    /// The prefill family, where the spec's format and geometry allow it (else why not).
    grouped: std::result::Result<GroupedPath, String>,
    /// The grouped family with the large-step tiles (`heuristics::large_step_tiles`) and the step
    /// size from which it runs, where they differ from `grouped`'s.
    grouped_large: Option<(usize, GroupedPath)>,
    /// The fused three-phase family, where the spec's geometry allows it (else why not).
    fused: std::result::Result<FusedFamily, String>,
    /// Steps of at least this many tokens take the grouped GEMMs.
    prefill_threshold: usize,
    /// The dispatcher's models (None: below the threshold, warp decode).
    dispatch: Option<DispatchModel>,
    /// `moe_choose`'s output: the family, the counts and the predictions (`Choice`).
    choice: CudaSlice<i32>,
    /// The last step's token count and its family where the host chose it.
    last_plan: Mutex<Option<(usize, Option<KernelFamily>)>>,
    deterministic: bool,
    /// The group-limited router's per-expert correction bias (zeros until set).
    router_bias: CudaSlice<f32>,
}

/// Token count from which `forward` takes the grouped GEMMs, unless `set_prefill_threshold` says
/// otherwise. Qwen3-30B-A3B bf16 (benches/results/h100-prefill.json, H100): at M = 16 the grouped
/// path took 355 us against 414 us for warp decode with uniform routing (152 against 244 skewed);
/// at M = 8 warp decode still won with uniform routing (230 against 251 us). The formats whose
/// weights the grouped GEMMs decode in registers cross over at the same count (H100, same run,
/// grouped / warp decode at M = 16, uniform and skewed routing, us): mxfp4 149 / 215 and 90 /
/// 188, int4_g128 148 / 181 and 54 / 160, mxfp8 206 / 234 and 112 / 203; int8 200 / 181 and 98 /
/// 152 (M = 24: 237 / 250); at M = 8 warp decode wins with uniform routing for all of them.
pub const DEFAULT_PREFILL_THRESHOLD: usize = 16;

impl MoeLayer {
    /// Render the spec's kernels for this device (warp decode, and the grouped family where the
    /// spec allows it), build them and upload the weights.
    pub fn load<'w>(device: &Device, spec: MoeSpec, weights: impl Into<Weights<'w>>) -> Result<MoeLayer> {
        let src = render(&spec, KernelFamily::WarpDecode, device.arch())?;
        MoeLayer::with_source(device, spec, src, weights)
    }

    /// The grouped family's status for this layer: `Err(why)` if the spec cannot use it.
    pub fn grouped_available(&self) -> std::result::Result<(), &str> {
        self.grouped.as_ref().map(|_| ()).map_err(|w| w.as_str())
    }

    /// As [`MoeLayer::load`], with the warp-decode source rendered ahead of time; the grouped
    /// family, where the spec allows it, is rendered here.
    pub fn with_source<'w>(
        device: &Device,
        spec: MoeSpec,
        src: KernelSource,
        weights: impl Into<Weights<'w>>,
    ) -> Result<MoeLayer> {
        let fused = match moe_codegen::fused_support(&spec) {
            Ok(()) => Ok(render(&spec, KernelFamily::Fused, device.arch())?),
            Err(why) => Err(why),
        };
        let grouped_src = match moe_codegen::grouped_support(&spec) {
            Ok(()) => {
                let tiles = moe_codegen::GemmTiles::for_spec(&spec, device.arch());
                Ok((tiles, moe_codegen::render_grouped(&spec, device.arch(), tiles)?))
            }
            Err(why) => Err(why),
        };
        let large_src = match (&grouped_src, large_step_tiles(&spec, device.arch())) {
            (Ok(_), Some(tiles)) => Some((tiles, moe_codegen::render_grouped(&spec, device.arch(), tiles)?)),
            _ => None,
        };
        // Every family's kernels in one parallel batch of compiles.
        let mut batch = vec![&src];
        batch.extend(grouped_src.as_ref().ok().map(|(_, g)| g));
        batch.extend(large_src.as_ref().map(|(_, g)| g));
        batch.extend(fused.as_ref().ok());
        compile_all(device, &spec.kernel_spec(), &batch)?;
        let grouped = match grouped_src {
            Ok((tiles, gsrc)) => Ok(GroupedPath::with_source(device, &spec.kernel_spec(), tiles, &gsrc)?),
            Err(why) => Err(why),
        };
        let large = match large_src {
            Some((tiles, gsrc)) => Some(GroupedPath::with_source(device, &spec.kernel_spec(), tiles, &gsrc)?),
            None => None,
        };
        MoeLayer::build(device, spec, src, grouped, large, fused, weights)
    }

    /// A layer from sources rendered ahead of time (e.g. by `#[moe_kernel]`): renders nothing.
    /// `sources` must hold the warp-decode module for the device's arch; a grouped module for
    /// that arch gives the layer the grouped family, and without one every step takes warp decode.
    /// A second grouped module, rendered with `moe_codegen::heuristics::large_step_tiles`, takes
    /// the steps of `large_step_tokens` and more (`#[moe_kernel]`'s `LARGE_STEP_SOURCES`).
    pub fn with_sources<'w>(
        device: &Device,
        spec: MoeSpec,
        sources: &[KernelSource],
        weights: impl Into<Weights<'w>>,
    ) -> Result<MoeLayer> {
        let arch = device.arch();
        let find = |family| sources.iter().find(|s| s.family == family && s.arch == arch);
        compile_all(device, &spec.kernel_spec(), &sources.iter().filter(|s| s.arch == arch).collect::<Vec<_>>())?;
        let decode = find(KernelFamily::WarpDecode)
            .ok_or(RuntimeError::MissingSource { family: KernelFamily::WarpDecode, arch })?
            .clone();
        // A second grouped source with the large-step tiles gives the layer that path too.
        let large_tiles = large_step_tiles(&spec, arch);
        let is_large = |s: &&KernelSource| large_tiles.is_some() && s.grouped_tiles == large_tiles;
        let grouped_sources = || sources.iter().filter(|s| s.family == KernelFamily::GroupedGemm && s.arch == arch);
        let grouped_tiles = |src: &KernelSource| {
            src.grouped_tiles.ok_or_else(|| RuntimeError::Shape {
                what: "KernelSource::grouped_tiles",
                expected: "the tiles the grouped source was rendered with".into(),
                got: "none".into(),
            })
        };
        let grouped = match grouped_sources().find(|s| !is_large(s)) {
            Some(src) => Ok(GroupedPath::with_source(device, &spec.kernel_spec(), grouped_tiles(src)?, src)?),
            None => Err(format!("no grouped source for {arch} among the layer's sources")),
        };
        let large = match grouped_sources().find(is_large) {
            Some(src) if grouped.is_ok() => {
                Some(GroupedPath::with_source(device, &spec.kernel_spec(), grouped_tiles(src)?, src)?)
            }
            _ => None,
        };
        let fused = find(KernelFamily::Fused)
            .cloned()
            .ok_or_else(|| format!("no fused source for {arch} among the layer's sources"));
        MoeLayer::build(device, spec, decode, grouped, large, fused, weights)
    }

    fn build<'w>(
        device: &Device,
        spec: MoeSpec,
        src: KernelSource,
        grouped: std::result::Result<GroupedPath, String>,
        large: Option<GroupedPath>,
        fused: std::result::Result<KernelSource, String>,
        weights: impl Into<Weights<'w>>,
    ) -> Result<MoeLayer> {
        let weights = weights.into();
        if let Err(why) = &grouped {
            tracing::info!(%why, "no grouped GEMM path; every step uses warp decode");
        }
        weights.validate(&spec)?;
        let kspec = spec.kernel_spec();
        let grouped_ok = grouped.is_ok();
        let decode = DecodeFamily::load(device, &kspec, &src)?;
        let fused = match fused {
            Ok(fsrc) => Ok(FusedFamily::load(device, &kspec, &fsrc)?),
            Err(why) => {
                tracing::info!(%why, "no fused family");
                Err(why)
            }
        };
        let stream = device.stream().clone();
        let on_device = weights.into_device(&stream)?;
        let [w13, w13_scales, w2, w2_scales] = on_device.mats;
        let fused_ok = fused.is_ok();
        let profile = profiled(device, &spec, &kspec);
        let layer = MoeLayer {
            spec,
            kspec,
            shared_gate: on_device.shared_gate,
            ids_ext: [Mutex::new(stream.alloc_zeros::<i32>(1)?), Mutex::new(stream.alloc_zeros::<i32>(1)?)],
            weights_ext: [Mutex::new(stream.alloc_zeros::<f32>(1)?), Mutex::new(stream.alloc_zeros::<f32>(1)?)],
            w13,
            w13_scales,
            w2,
            w2_scales,
            bias: on_device.bias,
            errors: stream.alloc_zeros::<i32>(1)?,
            ids32: Mutex::new(stream.alloc_zeros::<i32>(1)?),
            weights32: Mutex::new(stream.alloc_zeros::<f32>(1)?),
            validate_routing: cfg!(debug_assertions),
            decode,
            grouped,
            grouped_large: large.map(|g| (profile.large_step_tokens.unwrap_or_else(|| large_step_tokens(&kspec)), g)),
            fused,
            prefill_threshold: DEFAULT_PREFILL_THRESHOLD,
            dispatch: grouped_ok.then_some(profile.model).map(|m| m.restricted(fused_ok)),
            choice: stream.alloc_zeros::<i32>(8)?,
            last_plan: Mutex::new(None),
            deterministic: true,
            router_bias: stream.alloc_zeros::<f32>(spec.experts() as usize)?,
            stream,
        };
        layer.stream.synchronize()?;
        tracing::info!(module = %src.name, arch = %device.arch(), "layer loaded");
        Ok(layer)
    }

    /// Whether one-token steps take the bulk gate_up and the bulk down (the tiles ask for them
    /// and their shared memory fits this device).
    pub fn bulk_one_token(&self) -> (bool, bool) {
        self.decode.bulk_one_token()
    }

    /// Whether one-token steps on warp decode run as one cooperative launch whose blocks hold
    /// their rows of the step's w2 in shared memory (`moe_decode_resident`: 16-bit weights where
    /// a block's share fits this device), rather than as gate_up then down.
    pub fn resident_one_token(&self) -> bool {
        self.decode.resident_one_token()
    }

    /// Turn the resident one-token kernel off (or back on, where the spec and device have it):
    /// one-token steps on warp decode then run the split kernels.
    pub fn set_resident_one_token(&mut self, on: bool) {
        self.decode.set_resident_one_token(on);
    }

    /// The spec the layer was loaded with.
    pub fn spec(&self) -> &MoeSpec {
        &self.spec
    }
    /// The layer's own stream (its device's), which [`MoeLayer::forward`] enqueues on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Check expert ids on the host before each forward (a device-to-host copy and a sync, so
    /// not inside graph capture). On by default in debug builds.
    pub fn set_validate_routing(&mut self, on: bool) {
        self.validate_routing = on;
    }

    /// The largest token tile (tokens served per pass over a weight row) forward may pick, one of
    /// `TOKEN_TILES`. Larger tiles re-read fewer rows from L2 but need more registers per warp.
    pub fn set_max_token_tile(&mut self, tile: u32) -> Result<()> {
        if !TOKEN_TILES.contains(&tile) {
            return Err(RuntimeError::Shape {
                what: "max token tile",
                expected: format!("one of {TOKEN_TILES:?}"),
                got: tile.to_string(),
            });
        }
        self.decode.set_max_token_tile(tile);
        Ok(())
    }

    /// Size the scratch for steps of up to `max_tokens`, so that later forwards (and graph
    /// captures) allocate nothing. With the grouped family, warp decode's scratch covers the
    /// steps below the prefill threshold only: a larger step forced onto warp decode
    /// (`forward_family`) grows it outside capture, and inside one is `NotReserved`.
    pub fn reserve(&self, max_tokens: usize) -> Result<()> {
        // The grouped module also routes from logits, for either family.
        self.reserve_grouped(ScratchSlot::First, max_tokens)?;
        // Warp decode takes the steps below the threshold, or every step without the grouped
        // family; a decode launch never takes more than the family's chunk.
        let decode_max = if self.grouped.is_ok() { max_tokens.min(self.prefill_threshold) } else { max_tokens };
        self.decode.reserve(&self.stream, &self.kspec, decode_max)?;
        // int64 routing ids are narrowed into this, and a decode-only layer routes logits into it.
        let pairs = max_tokens * self.spec.top_k() as usize;
        self.ids_scratch(&self.stream, pairs)?;
        if self.grouped.is_err() {
            self.weights_scratch(&self.stream, pairs)?;
        }
        if self.spec.shared_experts() > 0 {
            let ext = max_tokens * self.kspec.top_k() as usize;
            self.grow(&self.ids_ext[0], &self.stream, ext)?;
            self.grow(&self.weights_ext[0], &self.stream, ext)?;
        }
        Ok(())
    }

    /// The most tokens one warp-decode launch takes; larger steps are split into launches of at
    /// most this many, on the stream, with no host synchronisation.
    pub fn decode_chunk(&self) -> usize {
        self.decode.chunk()
    }

    /// Out-of-range expert ids the kernels have skipped since the last call (syncs the stream).
    pub fn take_routing_errors(&mut self) -> Result<i32> {
        let n = self.stream.clone_dtoh(&self.errors)?[0];
        self.stream.memset_zeros(&mut self.errors)?;
        Ok(n)
    }

    /// Steps of at least `tokens` tokens take the grouped GEMMs (when the spec allows them);
    /// smaller ones warp decode. A fixed threshold: this turns the dispatcher off
    /// ([`MoeLayer::set_dispatch_model`] turns it back on, below the new threshold).
    pub fn set_prefill_threshold(&mut self, tokens: usize) {
        self.prefill_threshold = tokens.max(1);
        self.dispatch = None;
    }

    /// The token count from which steps take the grouped GEMMs.
    pub fn prefill_threshold(&self) -> usize {
        self.prefill_threshold
    }

    /// The routing-aware dispatcher's models, or `None` for the fixed threshold. Below the
    /// prefill threshold each step's family is the one the models predict faster for its live
    /// routing (distinct experts and pairs, counted on the device), unless its
    /// token count alone settles it ([`DispatchModel::fixed_choice`]); from the threshold on,
    /// the grouped GEMMs. On by default where the layer has the grouped family, with
    /// [`DispatchModel::analytic`]; a profile fitted on the device ([`DispatchModel::fit`]) does
    /// better. Without the grouped family this is a no-op.
    pub fn set_dispatch_model(&mut self, model: Option<DispatchModel>) {
        // A model of the fused family counts only where the layer has it.
        let fused = self.fused.is_ok();
        self.dispatch = model.filter(|_| self.grouped.is_ok()).map(|m| m.restricted(fused));
    }

    /// The dispatcher's models, if it is on.
    pub fn dispatch_model(&self) -> Option<DispatchModel> {
        self.dispatch
    }

    /// What ran the last step: the family, who chose it and, where the device did, what it
    /// counted and predicted. Reads the device's choice back (synchronizes the context: the step
    /// may have run on a caller's stream), and emits it as a `tracing` event.
    pub fn last_choice(&self) -> Result<Choice> {
        let (m, fixed) = (*self.last_plan.lock().unwrap_or_else(|p| p.into_inner())).ok_or(RuntimeError::NoStepYet)?;
        let choice = match fixed {
            Some(family) => Choice {
                family,
                on_device: false,
                m,
                distinct: 0,
                pairs: 0,
                predicted_decode_us: 0.0,
                predicted_grouped_us: 0.0,
                predicted_fused_us: 0.0,
            },
            None => {
                self.stream.context().synchronize()?;
                let c = self.stream.clone_dtoh(&self.choice)?;
                Choice {
                    family: match c[0] {
                        1 => KernelFamily::GroupedGemm,
                        2 => KernelFamily::Fused,
                        _ => KernelFamily::WarpDecode,
                    },
                    on_device: true,
                    m,
                    distinct: c[1] as u32,
                    pairs: c[2] as u32,
                    predicted_decode_us: f32::from_bits(c[4] as u32),
                    predicted_grouped_us: f32::from_bits(c[5] as u32),
                    predicted_fused_us: f32::from_bits(c[6] as u32),
                }
            }
        };
        tracing::info!(?choice, "dispatch");
        Ok(choice)
    }

    /// How the grouped path combines expert outputs into token rows. `true` (the default): GEMM2
    /// stores each (token, slot) row in the activation dtype and `moe_combine_rows` sums a
    /// token's rows, times their routing weights, in slot order in f32, bit-reproducible run to run. `false`: GEMM2 adds into
    /// f32 token rows with `red.global.add.v4.f32`, then converts. The gather-reduce measured
    /// faster on the H100 (Qwen3-30B-A3B bf16 M = 4096: 788 against 918 us; Mixtral-8x7B even),
    /// top-8 routing being 8 atomics per output.
    pub fn set_deterministic(&mut self, on: bool) {
        self.deterministic = on;
    }

    /// The group-limited router's correction bias, one f32 per expert.
    pub fn set_router_bias(&mut self, bias: &[f32]) -> Result<()> {
        let e = self.spec.experts() as usize;
        if bias.len() != e {
            return Err(RuntimeError::Shape {
                what: "router bias",
                expected: format!("[{e}]"),
                got: bias.len().to_string(),
            });
        }
        self.stream.memcpy_htod(bias, &mut self.router_bias)?;
        Ok(())
    }

    /// Rebuild the grouped family with other tiles (benchmarks sweep them this way).
    pub fn set_grouped_tiles(&mut self, device: &Device, tiles: moe_codegen::GemmTiles) -> Result<()> {
        let src = moe_codegen::render_grouped(&self.spec, device.arch(), tiles)?;
        self.grouped = Ok(GroupedPath::with_source(device, &self.kspec, tiles, &src)?);
        self.grouped_large = None; // these tiles take every grouped step
        Ok(())
    }

    /// Rebuild the fused family with other tiles (benchmarks and profiles sweep them this way).
    pub fn set_fused_tiles(&mut self, device: &Device, tiles: moe_codegen::FusedTiles) -> Result<()> {
        let src = moe_codegen::render_fused(&self.spec, device.arch(), tiles)?;
        self.fused = Ok(FusedFamily::load(device, &self.kspec, &src)?);
        Ok(())
    }

    /// The fused family's tiles, if the layer has that family.
    pub fn fused_tiles(&self) -> Option<moe_codegen::FusedTiles> {
        self.fused.as_ref().ok().map(|f| f.tiles())
    }

    /// The grouped family's tiles, if the layer has that family.
    pub fn grouped_tiles(&self) -> Option<moe_codegen::GemmTiles> {
        self.grouped.as_ref().ok().map(|g| g.tiles)
    }

    /// The step size from which grouped steps take the large-step tiles
    /// (`moe_codegen::heuristics::large_step_tokens`, or what a dispatch profile measured), or
    /// `None` where the layer has no such tiles.
    pub fn large_step_tokens(&self) -> Option<usize> {
        self.grouped_large.as_ref().map(|(from, _)| *from)
    }

    /// Take the large-step tiles from steps of `tokens` (at least 1) on; nothing where the layer
    /// has no such tiles. Steps captured in a graph before keep the tiles they were captured with,
    /// and a step size newly on the other tiles needs [`MoeLayer::reserve`] again before capture.
    pub fn set_large_step_tokens(&mut self, tokens: usize) {
        if let Some((from, _)) = &mut self.grouped_large {
            *from = tokens.max(1);
        }
    }

    /// The tiles a grouped step of `m` tokens runs with: the large-step tiles from their step
    /// size on (`moe_codegen::heuristics::large_step_tiles`, where the layer has them), else
    /// [`MoeLayer::grouped_tiles`].
    pub fn grouped_tiles_for(&self, m: usize) -> Option<moe_codegen::GemmTiles> {
        self.grouped_for(m).ok().map(|g| g.tiles)
    }

    /// The family `forward` uses for a step of `m` tokens, or `None` where the dispatcher
    /// chooses it on the device from each step's routing.
    pub fn family_for(&self, m: usize) -> Option<KernelFamily> {
        match self.dispatch {
            // Without a profile, a one-token step takes the resident kernel where the layer has
            // it: measured ahead of the others' split and fused kernels (docs/decode-notes.md),
            // which the analytic planes do not model.
            Some(model)
                if m == 1
                    && m < self.prefill_threshold
                    && model.source == ModelSource::Analytic
                    && self.resident_one_token() =>
            {
                Some(KernelFamily::WarpDecode)
            }
            Some(model) if m < self.prefill_threshold => {
                model.fixed_choice(m, self.kspec.top_k(), self.kspec.experts())
            }
            _ => Some(choose_family(m, self.prefill_threshold, self.grouped.is_ok())),
        }
    }

    /// `y[M, H] = MoE(x[M, H])` for routing `topk_ids[M, k]` (i32) and `topk_weights[M, k]` (f32),
    /// enqueued on the layer's stream with no host synchronisation (unless routing validation is
    /// on), so it can be captured in a CUDA graph. The family follows [`MoeLayer::family_for`].
    pub fn forward<T: ActElem>(
        &self,
        x: &CudaSlice<T>,
        topk_ids: &CudaSlice<i32>,
        topk_weights: &CudaSlice<f32>,
        y: &mut CudaSlice<T>,
    ) -> Result<()> {
        let s = &self.stream;
        let (x, ids, w) = (DeviceTensor::new(x, s), DeviceTensor::new(topk_ids, s), DeviceTensor::new(topk_weights, s));
        self.step(s, None, x, ids.into(), w, DeviceTensorMut::new(y, s), true, StepAt::WHOLE)
    }

    /// [`MoeLayer::forward`] with the family named.
    pub fn forward_family<T: ActElem>(
        &self,
        family: KernelFamily,
        x: &CudaSlice<T>,
        topk_ids: &CudaSlice<i32>,
        topk_weights: &CudaSlice<f32>,
        y: &mut CudaSlice<T>,
    ) -> Result<()> {
        let s = &self.stream;
        let (x, ids, w) = (DeviceTensor::new(x, s), DeviceTensor::new(topk_ids, s), DeviceTensor::new(topk_weights, s));
        self.step(s, Some(family), x, ids.into(), w, DeviceTensorMut::new(y, s), true, StepAt::WHOLE)
    }

    /// [`MoeLayer::forward`] on memory and a stream the caller owns: `x [M, H]` and `y [M, H]` in
    /// the spec's activation dtype, `topk_ids [M, k]` as i32 or i64, `topk_weights [M, k]` f32,
    /// enqueued on `stream` (a stream of the layer's context; wrap an engine's raw `CUstream` with
    /// cudarc's `CudaContext::wrap_borrowed_stream`) with no host synchronisation, so it can be
    /// captured in the caller's graph once [`MoeLayer::reserve`] covers M. Steps on different
    /// streams share the layer's scratch: order them (one stream, or events between them).
    pub fn forward_on<T: ActElem>(
        &self,
        stream: &Arc<CudaStream>,
        x: DeviceTensor<'_, T>,
        topk_ids: TopkIds<'_>,
        topk_weights: DeviceTensor<'_, f32>,
        y: DeviceTensorMut<'_, T>,
    ) -> Result<()> {
        self.step(stream, None, x, topk_ids, topk_weights, y, true, StepAt::WHOLE)
    }

    /// [`MoeLayer::forward_on`] with the family named.
    pub fn forward_family_on<T: ActElem>(
        &self,
        stream: &Arc<CudaStream>,
        family: KernelFamily,
        x: DeviceTensor<'_, T>,
        topk_ids: TopkIds<'_>,
        topk_weights: DeviceTensor<'_, f32>,
        y: DeviceTensorMut<'_, T>,
    ) -> Result<()> {
        self.step(stream, Some(family), x, topk_ids, topk_weights, y, true, StepAt::WHOLE)
    }

    /// One step (the family `None`: the layer's choice). `shared` off: the shared experts' slots
    /// stay empty (an expert-parallel rank's experts on a peer's tokens, whose shared experts run
    /// on their own rank). `at`: [`StepAt::WHOLE`], or one scratch slot and one part of a grouped
    /// step (its `Front`, `Gemm2` and `Combine` in order with the same arguments, only steps on
    /// the other slot between them; see [`MoeLayer::reserve_second`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn step<T: ActElem>(
        &self,
        stream: &Arc<CudaStream>,
        family: Option<KernelFamily>,
        x: DeviceTensor<'_, T>,
        topk_ids: TopkIds<'_>,
        topk_weights: DeviceTensor<'_, f32>,
        y: DeviceTensorMut<'_, T>,
        shared: bool,
        at: StepAt,
    ) -> Result<()> {
        let StepAt { slot, part } = at;
        if stream.context().cu_ctx() != self.stream.context().cu_ctx() {
            return Err(RuntimeError::Shape {
                what: "stream",
                expected: "a stream of the context the layer was loaded on".into(),
                got: "a stream of another context".into(),
            });
        }
        let m = self.check_step::<T>(x.len(), y.len())?;
        let k = self.spec.top_k() as usize;
        let expect = |what, got: usize| {
            if got == m * k {
                Ok(())
            } else {
                Err(RuntimeError::Shape { what, expected: format!("[{m}, {k}]"), got: format!("{got} elements") })
            }
        };
        expect("topk_ids", topk_ids.len())?;
        expect("topk_weights", topk_weights.len())?;
        let ids = match topk_ids {
            TopkIds::I32(t) => t.ptr(),
            TopkIds::I64(t) => {
                let scratch = self.ids_scratch(stream, m * k)?;
                self.decode.narrow_ids(stream, t.ptr(), scratch, m * k)?;
                scratch
            }
        };
        if self.validate_routing && part.runs_front() {
            let mut host = vec![0i32; m * k];
            stream.synchronize()?;
            unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut host, ids)? };
            validate_ids(&host, self.spec.experts())?;
        }
        let family = family.or_else(|| self.family_for(m));
        if part != Part::Whole && family != Some(KernelFamily::GroupedGemm) {
            return Err(RuntimeError::FamilyUnavailable {
                family: KernelFamily::GroupedGemm,
                why: format!("a step split in parts runs on the grouped GEMMs; {m} tokens take {family:?}"),
            });
        }
        let routing = (ids, topk_weights.ptr());
        // A step's later parts read the routing its front widened.
        let (ids, weights) = if !part.runs_front() {
            self.widened(stream, slot, m, routing)?
        } else {
            self.widen(stream, slot, m, routing, x.ptr(), shared)?
        };
        let p = self.step_ptrs(x.ptr(), ids, weights, y.ptr());
        self.launch_family(stream, family, m, &p, slot, part)
    }

    /// The grouped paths' scratch on `slot` for steps of up to `max_tokens`: the large-step path
    /// takes the steps from its size on, the other those below (and the device's dispatch, below
    /// the prefill threshold).
    fn reserve_grouped(&self, slot: ScratchSlot, max_tokens: usize) -> Result<()> {
        if let Ok(g) = &self.grouped {
            let below = self
                .grouped_large
                .as_ref()
                .map_or(max_tokens, |(from, _)| max_tokens.min((from - 1).max(self.prefill_threshold)));
            g.reserve_in(slot, &self.stream, &self.kspec, below.max(1), self.deterministic)?;
        }
        if let Some((from, g)) = &self.grouped_large {
            if max_tokens >= *from {
                g.reserve_in(slot, &self.stream, &self.kspec, max_tokens, self.deterministic)?;
            }
        }
        Ok(())
    }

    /// Reserve the second scratch slot for steps of up to `max_tokens` (the families' own
    /// scratch is [`MoeLayer::reserve`]'s): a caller that splits a step keeps the first slot's
    /// while others run on this one.
    pub(crate) fn reserve_second(&self, max_tokens: usize) -> Result<()> {
        let slot = ScratchSlot::Second;
        self.reserve_grouped(slot, max_tokens)?;
        if self.spec.shared_experts() > 0 {
            let ext = max_tokens * self.kspec.top_k() as usize;
            self.grow(&self.ids_ext[slot as usize], &self.stream, ext)?;
            self.grow(&self.weights_ext[slot as usize], &self.stream, ext)?;
        }
        Ok(())
    }

    /// The routing the kernels read: `(ids, weights)` `[m, k]` themselves, or with shared
    /// experts widened on `stream` into the layer's `[m, k + S]` scratch (their slots empty
    /// where `shared` is off).
    fn with_shared(&self, stream: &CudaStream, m: usize, routing: (u64, u64), x: u64) -> Result<(u64, u64)> {
        self.widen(stream, ScratchSlot::First, m, routing, x, true)
    }
    fn widen(
        &self,
        stream: &CudaStream,
        slot: ScratchSlot,
        m: usize,
        routing: (u64, u64),
        x: u64,
        shared: bool,
    ) -> Result<(u64, u64)> {
        if self.spec.shared_experts() == 0 {
            return Ok(routing);
        }
        let dst = self.widened(stream, slot, m, routing)?;
        let gate = self.shared_gate.as_ref().map_or(0, |g| ptr(g, &self.stream));
        self.decode.expand(stream, m, routing, x, gate, dst, shared)?;
        Ok(dst)
    }
    /// Where [`MoeLayer::widen`] puts a step's routing on `slot` (the routing itself without
    /// shared experts).
    fn widened(&self, stream: &CudaStream, slot: ScratchSlot, m: usize, routing: (u64, u64)) -> Result<(u64, u64)> {
        if self.spec.shared_experts() == 0 {
            return Ok(routing);
        }
        let n = m * self.kspec.top_k() as usize;
        let i = slot as usize;
        Ok((self.grow(&self.ids_ext[i], stream, n)?, self.grow(&self.weights_ext[i], stream, n)?))
    }

    /// The int32 routing ids (narrowed from int64, or routed here from logits): `n` ids, grown
    /// outside graph capture.
    fn ids_scratch(&self, stream: &CudaStream, n: usize) -> Result<u64> {
        self.grow(&self.ids32, stream, n)
    }

    /// The routing weights a decode-only layer routes from logits into: `n`, as `ids_scratch`.
    fn weights_scratch(&self, stream: &CudaStream, n: usize) -> Result<u64> {
        self.grow(&self.weights32, stream, n)
    }

    fn grow<E: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        slot: &Mutex<CudaSlice<E>>,
        stream: &CudaStream,
        n: usize,
    ) -> Result<u64> {
        let mut buf = slot.lock().unwrap_or_else(|p| p.into_inner());
        if buf.len() < n {
            if stream.capture_status()? != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
                return Err(RuntimeError::NotReserved { m: n / self.spec.top_k() as usize });
            }
            self.stream.synchronize()?;
            *buf = self.stream.alloc_zeros::<E>(n)?;
            self.stream.synchronize()?;
        }
        Ok(ptr(&buf, &self.stream))
    }

    /// Route on the device, then [`MoeLayer::forward`]: `logits [M, E]` f32 through the spec's
    /// router (both families' modules hold it; a layer without the grouped family routes into
    /// scratch that [`MoeLayer::reserve`] sizes).
    pub fn forward_logits<T: ActElem>(
        &self,
        x: &CudaSlice<T>,
        logits: &CudaSlice<f32>,
        y: &mut CudaSlice<T>,
    ) -> Result<()> {
        let m = self.check_step::<T>(x.len(), y.len())?;
        let e = self.spec.experts() as usize;
        if logits.len() != m * e {
            return Err(RuntimeError::Shape {
                what: "router logits",
                expected: format!("[{m}, {e}]"),
                got: format!("{} elements", logits.len()),
            });
        }
        let s = &self.stream;
        let family = self.family_for(m);
        let (logits, bias) = (ptr(logits, s), ptr(&self.router_bias, s));
        let Ok(g) = self.grouped_for(m) else {
            let pairs = m * self.spec.top_k() as usize;
            let (ids, weights) = (self.ids_scratch(s, pairs)?, self.weights_scratch(s, pairs)?);
            self.decode.route(s, m, logits, bias, ids, weights)?;
            let (ids, weights) = self.with_shared(s, m, (ids, weights), ptr(x, s))?;
            let p = self.step_ptrs(ptr(x, s), ids, weights, ptr(y, s));
            return self.launch_family(s, family, m, &p, ScratchSlot::First, Part::Whole);
        };
        g.reserve(&self.stream, &self.kspec, m, self.deterministic)?;
        // moe_prepare routes in the grouped step's first kernel, except where the shared experts'
        // slots must be appended first.
        if family == Some(KernelFamily::GroupedGemm) && self.spec.shared_experts() == 0 {
            // The grouped step routes in its first kernel (moe_prepare).
            let (ids, weights) = g.routing_ptrs(s, m)?;
            let p = StepPtrs { logits, bias, ..self.step_ptrs(ptr(x, s), ids, weights, ptr(y, s)) };
            return self.launch_family(s, family, m, &p, ScratchSlot::First, Part::Whole);
        }
        let routing = g.route(s, m, logits, bias)?;
        let (ids, weights) = self.with_shared(s, m, routing, ptr(x, s))?;
        let p = self.step_ptrs(ptr(x, s), ids, weights, ptr(y, s));
        self.launch_family(s, family, m, &p, ScratchSlot::First, Part::Whole)
    }

    /// The routing the last [`MoeLayer::forward_logits`] produced, copied back (syncs):
    /// `(topk_ids, topk_weights)`, each `[M, k]`.
    pub fn last_routing(&self, m: usize) -> Result<(Vec<i32>, Vec<f32>)> {
        let n = m * self.spec.top_k() as usize;
        let (ids, w) = match self.last_grouped() {
            Ok(g) => g.last_routing(&self.stream)?,
            Err(_) => {
                let ids = self.stream.clone_dtoh(&*self.ids32.lock().unwrap_or_else(|p| p.into_inner()))?;
                (ids, self.stream.clone_dtoh(&*self.weights32.lock().unwrap_or_else(|p| p.into_inner()))?)
            }
        };
        if ids.len() < n || w.len() < n {
            return Err(RuntimeError::NoStepYet);
        }
        Ok((ids[..n].to_vec(), w[..n].to_vec()))
    }

    /// The grouped path's last alignment (syncs).
    pub fn last_alignment(&self) -> Result<Alignment> {
        self.last_grouped()?.last_alignment(&self.stream)
    }

    /// The fused family's status for this layer: `Err(why)` if the spec cannot use it.
    pub fn fused_available(&self) -> std::result::Result<(), &str> {
        self.fused.as_ref().map(|_| ()).map_err(|w| w.as_str())
    }

    fn fused_family(&self) -> Result<&FusedFamily> {
        self.fused
            .as_ref()
            .map_err(|why| RuntimeError::FamilyUnavailable { family: KernelFamily::Fused, why: why.clone() })
    }

    fn grouped_path(&self) -> Result<&GroupedPath> {
        self.grouped
            .as_ref()
            .map_err(|why| RuntimeError::FamilyUnavailable { family: KernelFamily::GroupedGemm, why: why.clone() })
    }

    /// The grouped path a step of `m` tokens runs on.
    fn grouped_for(&self, m: usize) -> Result<&GroupedPath> {
        match &self.grouped_large {
            Some((from, g)) if m >= *from => Ok(g),
            _ => self.grouped_path(),
        }
    }

    /// The grouped path the last step ran on (its token count in `last_plan`).
    fn last_grouped(&self) -> Result<&GroupedPath> {
        let m = self.last_plan.lock().unwrap_or_else(|p| p.into_inner()).map_or(0, |(m, _)| m);
        self.grouped_for(m)
    }

    /// x `[M, H]` with M > 0 in the spec's dtype and y of the same shape; returns M.
    fn check_step<T: ActElem>(&self, x_len: usize, y_len: usize) -> Result<usize> {
        let h = self.spec.hidden() as usize;
        if T::DTYPE != self.spec.act_dtype() {
            return Err(RuntimeError::Shape {
                what: "activation dtype",
                expected: self.spec.act_dtype().to_string(),
                got: T::DTYPE.to_string(),
            });
        }
        if x_len == 0 || x_len % h != 0 {
            return Err(RuntimeError::Shape {
                what: "x",
                expected: format!("[M, {h}] with M > 0"),
                got: format!("{x_len} elements"),
            });
        }
        let m = x_len / h;
        if y_len != m * h {
            return Err(RuntimeError::Shape {
                what: "y",
                expected: format!("[{m}, {h}]"),
                got: format!("{y_len} elements"),
            });
        }
        Ok(m)
    }

    fn step_ptrs(&self, x: u64, ids: u64, weights: u64, y: u64) -> StepPtrs {
        let s = &self.stream;
        StepPtrs {
            x,
            logits: 0,
            bias: 0,
            ids,
            weights,
            y,
            w13: ptr(&self.w13, s),
            w13_scales: ptr(&self.w13_scales, s),
            w2: ptr(&self.w2, s),
            w2_scales: ptr(&self.w2_scales, s),
            w13_bias: self.bias.as_ref().map_or(0, |(b, _)| ptr(b, s)),
            w2_bias: self.bias.as_ref().map_or(0, |(_, b)| ptr(b, s)),
            errors: ptr(&self.errors, s),
            choice: 0,
        }
    }

    /// Run the step on `family`, or (`None`) on the family the device picks: the grouped family's
    /// first kernel chooses (`moe_prepare` for a step of up to 32 tokens, else `moe_choose`
    /// ahead of it), then every candidate family runs, whose kernels return at once unless chosen.
    fn launch_family(
        &self,
        stream: &Arc<CudaStream>,
        family: Option<KernelFamily>,
        m: usize,
        p: &StepPtrs,
        slot: ScratchSlot,
        part: Part,
    ) -> Result<()> {
        *self.last_plan.lock().unwrap_or_else(|p| p.into_inner()) = Some((m, family));
        match family {
            Some(KernelFamily::GroupedGemm) => {
                let g = self.grouped_for(m)?;
                tracing::debug!(m, tiles = ?g.tiles, "forward: grouped GEMMs");
                g.reserve_in(slot, stream, &self.kspec, m, self.deterministic)?;
                g.forward_part(stream, &self.kspec, m, p, self.deterministic, slot, part, None)
            }
            Some(KernelFamily::Fused) => {
                tracing::debug!(m, "forward: fused");
                self.fused_family()?.forward(stream, &self.kspec, m, p)
            }
            Some(_) => {
                tracing::debug!(m, "forward: warp decode");
                self.decode.forward(stream, &self.kspec, m, p)
            }
            None => {
                tracing::debug!(m, "forward: the device chooses the family");
                let model = self.dispatch.expect("a step the device dispatches has models");
                let menu = model.device_menu(m, self.kspec.top_k(), self.kspec.experts());
                let g = self.grouped_path()?;
                g.reserve_in(slot, stream, &self.kspec, m, self.deterministic)?;
                let p = StepPtrs { choice: ptr(&self.choice, &self.stream), ..*p };
                // One stream: the grouped kernels first (choosing), then warp decode's. Run on two
                // streams (forked and joined) or in the other order, the dispatched steps measured
                // the same within noise (H100, docs/dispatch.md).
                g.forward_dispatched(stream, &self.kspec, m, &p, &menu, self.deterministic, slot)?;
                // Warp decode and the fused family where they are on the menu (`device_menu`:
                // only where they can win; `set_dispatch_model` keeps the fused model only where
                // the layer has the family).
                if menu.decode {
                    self.decode.forward(stream, &self.kspec, m, &p)?;
                }
                if menu.model.fused.is_some() {
                    self.fused_family()?.forward(stream, &self.kspec, m, &p)?;
                }
                Ok(())
            }
        }
    }
}

/// What a layer takes from its dispatch profile: the dispatcher's models and where the large-step
/// tiles start.
struct Profiled {
    model: DispatchModel,
    large_step_tokens: Option<usize>,
}

/// The profile saved for this GPU, spec and version under the kernel cache (`moe-jit profile`),
/// else the analytic models and the heuristic start of the large-step tiles. A profile that
/// cannot be read is reported and passed over, as a corrupt kernel cache entry is.
fn profiled(device: &Device, spec: &MoeSpec, kspec: &MoeSpec) -> Profiled {
    let analytic = || Profiled { model: DispatchModel::analytic(kspec, device.dram_gbps()), large_step_tokens: None };
    match crate::dispatch::DispatchProfile::load(device.cache_dir(), &device.name(), spec) {
        Ok(Some(p)) => {
            tracing::info!(model = ?p.model, large_step_tokens = ?p.large_step_tokens, "dispatch profile loaded");
            Profiled { model: p.model, large_step_tokens: p.large_step_tokens }
        }
        Ok(None) => analytic(),
        Err(e) => {
            tracing::warn!(%e, "dispatch profile passed over; the analytic models dispatch");
            eprintln!("moeforge: {e}; dispatching with the analytic models");
            analytic()
        }
    }
}

/// Compile the kernels the families load at once (each its own module) in one parallel batch.
fn compile_all(device: &Device, spec: &MoeSpec, sources: &[&KernelSource]) -> Result<()> {
    let names: Vec<(&KernelSource, Vec<String>)> = sources
        .iter()
        .map(|&s| match s.family {
            KernelFamily::WarpDecode => (s, DecodeFamily::eager_entries(spec, s, device.max_smem_optin())),
            _ => (s, s.entry_points.clone()),
        })
        .collect();
    let items: Vec<(&KernelSource, &str)> =
        names.iter().flat_map(|(s, n)| n.iter().map(move |e| (*s, e.as_str()))).collect();
    device.compile_entries(&items)
}

/// Every id in `[0, experts)`, else a typed error naming the first offender.
pub fn validate_ids(ids: &[i32], experts: u32) -> Result<()> {
    let bad = |&(_, &e): &(usize, &i32)| e < 0 || e as u32 >= experts;
    let count = ids.iter().enumerate().filter(bad).count();
    match ids.iter().enumerate().find(bad) {
        None => Ok(()),
        Some((first_pair, &first_id)) => Err(RuntimeError::ExpertIdOutOfRange { count, experts, first_pair, first_id }),
    }
}
