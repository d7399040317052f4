//! A MoE layer on one GPU: its weights, its kernels, and `forward`.

use crate::device::Device;
use crate::dispatch::{choose_family, Choice, DispatchModel, ModelSource};
use crate::error::{Result, RuntimeError};
use crate::families::decode::DecodeFamily;
use crate::families::fused::FusedFamily;
use crate::families::grouped::{Alignment, GroupedPath};
use crate::families::ScratchSlot;
use crate::weights::Weights;
use cudarc::driver::{CudaSlice, CudaStream};
use moe_codegen::heuristics::{large_step_tiles, large_step_tokens};
use moe_codegen::{render, ActDtype, KernelFamily, KernelSource, MoeSpec, TOKEN_TILES};
use std::sync::{Arc, Mutex};

mod step;

/// Element types the activations `x` / `y` may have. With the `f16` feature (the facade's
/// default) they are cudarc `DeviceRepr`s, so generic code can allocate and copy them.
#[cfg(feature = "f16")]
pub trait ActElem: cudarc::driver::DeviceRepr + Copy + Default {
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
