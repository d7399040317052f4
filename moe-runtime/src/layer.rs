//! A MoE layer on one GPU: its weights, its kernels, and `forward`.

use crate::device::Device;
use crate::error::{Result, RuntimeError};
use crate::launch::{launch, ptr};
use crate::prefill::{GroupedPath, StepPtrs};
use crate::weights::HostWeights;
use cudarc::driver::{sys, CudaFunction, CudaSlice, CudaStream, DeviceRepr};
use moe_codegen::{
    bulk_smem_bytes, decode_down_smem_bytes, decode_mid_floats, decode_smem_bytes, render, routing_smem_bytes,
    ActDtype, DecodeTiles, KernelFamily, KernelSource, MoeSpec, TOKEN_TILES,
};
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// Element types the activations `x` / `y` may have.
pub trait ActElem: DeviceRepr + Copy + Default {
    const DTYPE: ActDtype;
    fn from_f32(v: f32) -> Self;
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

struct TileFns {
    tile: u32,
    gate_up: CudaFunction,
    fused: CudaFunction,
    /// Resident blocks per SM at the largest routing table we size for.
    gate_up_blocks_per_sm: u32,
}

/// A one-token kernel that streams weights through shared memory (`decode_bulk.cuh`).
struct BulkFn {
    f: CudaFunction,
    smem: u32,
    threads: u32,
}

/// The down kernel (one for every token tile).
struct DownFn {
    f: CudaFunction,
    blocks_per_sm: u32,
}

pub struct MoeLayer {
    spec: MoeSpec,
    stream: Arc<CudaStream>,
    sms: u32,
    max_smem: u32,
    /// Shared memory the kernels declare statically (the dequant table of `lut`).
    static_smem: u32,
    warps: u32,
    /// Hidden outputs per down item (the module's tiles).
    down_rows: usize,
    /// Items a warp of the multi-token gate_up kernels serves at once (the module's tiles).
    gate_up_items: u64,
    w13: CudaSlice<u8>,
    w13_scales: CudaSlice<u8>,
    w2: CudaSlice<u8>,
    w2_scales: CudaSlice<u8>,
    tiles: Vec<TileFns>,
    down: DownFn,
    /// down with its first items stashed in shared memory, for steps of one token.
    down_stash: DownFn,
    /// The bulk one-token kernels, where the tiles ask for them and their shared memory fits.
    bulk_gate_up: Option<BulkFn>,
    bulk_down: Option<BulkFn>,
    /// gate_up -> down intermediate, `[M * top_k, I]` f32, grown on demand.
    mid: Mutex<CudaSlice<f32>>,
    /// Count of out-of-range expert ids the kernels met.
    errors: CudaSlice<i32>,
    /// The fused kernel's per-expert ready counters and finished-block count (cleared by it).
    ready: CudaSlice<i32>,
    validate_routing: bool,
    fused: bool,
    max_token_tile: u32,
    /// The prefill family, where the spec's format and geometry allow it (else why not).
    grouped: std::result::Result<GroupedPath, String>,
    /// Steps of at least this many tokens take the grouped GEMMs.
    prefill_threshold: usize,
    /// The most tokens one warp-decode launch routes (its shared memory and 32-bit indices);
    /// larger decode steps run as consecutive launches of at most this many tokens.
    decode_chunk: usize,
    deterministic: bool,
    /// The group-limited router's per-expert correction bias (zeros until set).
    router_bias: CudaSlice<f32>,
}

/// Token count from which `forward` takes the grouped GEMMs, unless `set_prefill_threshold`
/// says otherwise. Qwen3-30B-A3B bf16 (benches/results/h100-prefill.json, H100): at M = 16 the
/// grouped path took 355 us against 414 us for warp decode with uniform routing (152 against 244
/// skewed); at M = 8 warp decode still won with uniform routing (230 against 251 us).
pub const DEFAULT_PREFILL_THRESHOLD: usize = 16;

/// Token-tile cap used unless `set_max_token_tile` says otherwise. On the H100 (Qwen3-30B-A3B,
/// benches/results/h100-decode.json) a cap of 4 ran M = 8 in 218 us against 371 us with 8: the
/// 8-token kernels need about 150 registers and halve the resident warps; with 128 experts and
/// top-8 an expert rarely serves more than 4 tokens of a decode step anyway.
pub const DEFAULT_MAX_TOKEN_TILE: u32 = 4;

impl MoeLayer {
    /// Render the spec's kernels for this device (warp decode, and the grouped family where the
    /// spec allows it), build them and upload the weights.
    pub fn load(device: &Device, spec: MoeSpec, weights: &HostWeights) -> Result<MoeLayer> {
        let src = render(&spec, KernelFamily::WarpDecode, device.arch())?;
        MoeLayer::with_source(device, spec, src, weights)
    }

    /// The grouped family's status for this layer: `Err(why)` if the spec cannot use it.
    pub fn grouped_available(&self) -> std::result::Result<(), &str> {
        self.grouped.as_ref().map(|_| ()).map_err(|w| w.as_str())
    }

    /// As [`MoeLayer::load`], with the warp-decode source rendered ahead of time; the grouped
    /// family, where the spec allows it, is rendered here.
    pub fn with_source(device: &Device, spec: MoeSpec, src: KernelSource, weights: &HostWeights) -> Result<MoeLayer> {
        let grouped = match moe_codegen::grouped_support(&spec) {
            Ok(()) => Ok(GroupedPath::load(device, &spec)?),
            Err(why) => Err(why),
        };
        MoeLayer::build(device, spec, src, grouped, weights)
    }

    /// A layer from sources rendered ahead of time (e.g. by `#[moe_kernel]`): renders nothing.
    /// `sources` must hold the warp-decode module for the device's arch; a grouped module for
    /// that arch gives the layer the grouped family, and without one every step takes warp decode.
    pub fn with_sources(
        device: &Device,
        spec: MoeSpec,
        sources: &[KernelSource],
        weights: &HostWeights,
    ) -> Result<MoeLayer> {
        let arch = device.arch();
        let find = |family| sources.iter().find(|s| s.family == family && s.arch == arch);
        let decode = find(KernelFamily::WarpDecode)
            .ok_or(RuntimeError::MissingSource { family: KernelFamily::WarpDecode, arch })?
            .clone();
        let grouped = match find(KernelFamily::GroupedGemm) {
            Some(src) => {
                let tiles = src.grouped_tiles.ok_or_else(|| RuntimeError::Shape {
                    what: "KernelSource::grouped_tiles",
                    expected: "the tiles the grouped source was rendered with".into(),
                    got: "none".into(),
                })?;
                Ok(GroupedPath::with_source(device, &spec, tiles, src)?)
            }
            None => Err(format!("no grouped source for {arch} among the layer's sources")),
        };
        MoeLayer::build(device, spec, decode, grouped, weights)
    }

    fn build(
        device: &Device,
        spec: MoeSpec,
        src: KernelSource,
        grouped: std::result::Result<GroupedPath, String>,
        weights: &HostWeights,
    ) -> Result<MoeLayer> {
        if let Err(why) = &grouped {
            tracing::info!(%why, "no grouped GEMM path; every step uses warp decode");
        }
        weights.validate(&spec)?;
        let dt = src.decode_tiles.ok_or_else(|| RuntimeError::Shape {
            what: "KernelSource::decode_tiles",
            expected: "the warp-decode tiles the source was rendered with".into(),
            got: "none".into(),
        })?;
        if dt.dn_rows == 0 || spec.hidden() % dt.dn_rows != 0 || !matches!(dt.gu_lanes, 16 | 32) {
            return Err(RuntimeError::Shape {
                what: "KernelSource::decode_tiles",
                expected: format!("rows per down item dividing {} and 16 or 32 gate_up lanes", spec.hidden()),
                got: format!("{dt:?}"),
            });
        }
        let module = device.load(&src)?;
        let stream = device.stream().clone();
        let warps = src.block_threads / 32;
        let sizing_smem = routing_smem_bytes(&spec, 64);
        let occ = |f: &CudaFunction| -> Result<u32> {
            Ok(f.occupancy_max_active_blocks_per_multiprocessor(warps * 32, sizing_smem as usize, None)?.max(1) as u32)
        };
        let mut tiles = Vec::new();
        for t in TOKEN_TILES {
            let gate_up = module.load_function(&format!("moe_gate_up_t{t}"))?;
            let fused = module.load_function(&format!("moe_fused_t{t}"))?;
            tiles.push(TileFns { tile: t, gate_up_blocks_per_sm: occ(&gate_up)?, gate_up, fused });
        }
        let down_f = module.load_function("moe_down")?;
        let down = DownFn { blocks_per_sm: occ(&down_f)?, f: down_f };
        let stash_f = module.load_function("moe_down_stash")?;
        let down_stash = DownFn { blocks_per_sm: occ(&stash_f)?, f: stash_f };
        let (gu_smem, dn_smem) = bulk_smem_bytes(&spec, &dt);
        let bulk_fn = |on: bool, name: &str, smem: u32, warps: u32| -> Result<Option<BulkFn>> {
            if !on || smem > device.max_smem_optin() {
                return Ok(None);
            }
            let f = module.load_function(name)?;
            f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)?;
            Ok(Some(BulkFn { f, smem, threads: (warps + 1) * 32 }))
        };
        let bulk_gate_up = bulk_fn(dt.bulk_gu, "moe_gate_up_bulk", gu_smem, dt.bulk_gu_warps)?;
        let bulk_down = bulk_fn(dt.bulk_dn, "moe_down_bulk", dn_smem, dt.bulk_dn_warps)?;
        // Static shared memory (LUT tables, down's stash) as the compiled kernels declare it.
        let mut static_smem = 0;
        for f in tiles.iter().flat_map(|t| [&t.gate_up, &t.fused]).chain([&down.f, &down_stash.f]) {
            static_smem =
                static_smem.max(f.get_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?);
        }
        let decode_chunk = decode_chunk(&spec, static_smem as u32, device.max_smem_optin());
        if decode_chunk == 0 {
            let need = decode_smem_bytes(&spec, 1) + static_smem as u32;
            return Err(RuntimeError::StepTooLarge { m: 1, need, max: device.max_smem_optin() });
        }
        // Formats without scales still get a small buffer so every pointer is valid.
        let nonempty = |v: &[u8]| if v.is_empty() { vec![0u8; 16] } else { v.to_vec() };
        let layer = MoeLayer {
            spec,
            sms: device.sm_count(),
            max_smem: device.max_smem_optin(),
            static_smem: static_smem as u32,
            warps,
            down_rows: dt.dn_rows as usize,
            gate_up_items: (32 / dt.gu_lanes) as u64,
            w13: stream.clone_htod(&weights.w13)?,
            w13_scales: stream.clone_htod(&nonempty(&weights.w13_scales))?,
            w2: stream.clone_htod(&weights.w2)?,
            w2_scales: stream.clone_htod(&nonempty(&weights.w2_scales))?,
            tiles,
            down,
            down_stash,
            bulk_gate_up,
            bulk_down,
            mid: Mutex::new(stream.alloc_zeros::<f32>(decode_mid_floats(&spec, 1))?),
            errors: stream.alloc_zeros::<i32>(1)?,
            ready: stream.alloc_zeros::<i32>(spec.experts() as usize + 1)?,
            validate_routing: cfg!(debug_assertions),
            // Measured on the H100 (benches/results/h100-decode.json): the split pair is faster.
            fused: false,
            max_token_tile: DEFAULT_MAX_TOKEN_TILE,
            grouped,
            decode_chunk,
            prefill_threshold: DEFAULT_PREFILL_THRESHOLD,
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
        (self.bulk_gate_up.is_some(), self.bulk_down.is_some())
    }

    pub fn spec(&self) -> &MoeSpec {
        &self.spec
    }
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Check expert ids on the host before each forward (a device-to-host copy and a sync, so
    /// not inside graph capture). On by default in debug builds.
    pub fn set_validate_routing(&mut self, on: bool) {
        self.validate_routing = on;
    }

    /// Two kernels per step (default: gate_up, then down as a programmatic dependent) or one
    /// persistent kernel whose down phase waits on per-expert counters. Both compute the same
    /// function; on the H100 the split pair measured faster (see benches/results).
    pub fn set_fused(&mut self, on: bool) {
        self.fused = on;
    }

    /// The largest token tile (tokens served per pass over a weight row) forward may pick, one of
    /// 1, 2, 4, 8. Larger tiles re-read fewer rows from L2 but need more registers per warp.
    pub fn set_max_token_tile(&mut self, tile: u32) -> Result<()> {
        if !TOKEN_TILES.contains(&tile) {
            return Err(RuntimeError::Shape {
                what: "max token tile",
                expected: format!("one of {TOKEN_TILES:?}"),
                got: tile.to_string(),
            });
        }
        self.max_token_tile = tile;
        Ok(())
    }

    /// Size the scratch for steps of up to `max_tokens`, so that later forwards (and graph
    /// captures) allocate nothing.
    pub fn reserve(&self, max_tokens: usize) -> Result<()> {
        // The grouped module also routes from logits, for either family.
        if let Ok(g) = &self.grouped {
            g.reserve(&self.stream, &self.spec, max_tokens, self.deterministic)?;
        }
        // Warp decode takes the steps below the threshold, or every step without the grouped
        // family; a decode step is never launched on more than `decode_chunk` tokens at once.
        let decode_max = if self.grouped.is_ok() { max_tokens.min(self.prefill_threshold) } else { max_tokens };
        self.reserve_decode(decode_max.min(self.decode_chunk))
    }

    /// The most tokens one warp-decode launch takes; larger steps are split into launches of at
    /// most this many, on the stream, with no host synchronisation.
    pub fn decode_chunk(&self) -> usize {
        self.decode_chunk
    }

    fn reserve_decode(&self, max_tokens: usize) -> Result<()> {
        let need = decode_mid_floats(&self.spec, max_tokens as u32);
        let mut mid = self.mid.lock().unwrap_or_else(|p| p.into_inner());
        if mid.len() < need {
            // Growing means a sync and an allocation, which would invalidate a graph capture.
            let capturing = self.stream.capture_status()?
                != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
            if capturing {
                return Err(RuntimeError::NotReserved { m: max_tokens });
            }
            self.stream.synchronize()?;
            *mid = self.stream.alloc_zeros::<f32>(need)?;
        }
        Ok(())
    }

    /// Out-of-range expert ids the kernels have skipped since the last call (syncs the stream).
    pub fn take_routing_errors(&mut self) -> Result<i32> {
        let n = self.stream.clone_dtoh(&self.errors)?[0];
        self.stream.memset_zeros(&mut self.errors)?;
        Ok(n)
    }

    /// Steps of at least `tokens` tokens take the grouped GEMMs (when the spec allows them);
    /// smaller ones warp decode.
    pub fn set_prefill_threshold(&mut self, tokens: usize) {
        self.prefill_threshold = tokens.max(1);
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
        self.grouped = Ok(GroupedPath::with_source(device, &self.spec, tiles, &src)?);
        Ok(())
    }

    /// The grouped family's tiles, if the layer has that family.
    pub fn grouped_tiles(&self) -> Option<moe_codegen::GemmTiles> {
        self.grouped.as_ref().ok().map(|g| g.tiles)
    }

    /// The family `forward` uses for a step of `m` tokens.
    pub fn family_for(&self, m: usize) -> KernelFamily {
        if m >= self.prefill_threshold && self.grouped.is_ok() {
            KernelFamily::GroupedGemm
        } else {
            KernelFamily::WarpDecode
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
        let m = self.check_step(x, y)?;
        self.forward_family(self.family_for(m), x, topk_ids, topk_weights, y)
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
        let m = self.check_step(x, y)?;
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
        if self.validate_routing {
            self.check_ids(topk_ids)?;
        }
        let s = &self.stream;
        let p = self.step_ptrs(ptr(x, s), ptr(topk_ids, s), ptr(topk_weights, s), ptr(y, s));
        self.launch_family(family, m, &p)
    }

    /// Route on the device, then [`MoeLayer::forward`]: `logits [M, E]` f32 through the spec's
    /// router (in the grouped module, so the spec must allow that family).
    pub fn forward_logits<T: ActElem>(
        &self,
        x: &CudaSlice<T>,
        logits: &CudaSlice<f32>,
        y: &mut CudaSlice<T>,
    ) -> Result<()> {
        let m = self.check_step(x, y)?;
        let e = self.spec.experts() as usize;
        if logits.len() != m * e {
            return Err(RuntimeError::Shape {
                what: "router logits",
                expected: format!("[{m}, {e}]"),
                got: format!("{} elements", logits.len()),
            });
        }
        let g = self.grouped_path()?;
        g.reserve(&self.stream, &self.spec, m, self.deterministic)?;
        let s = &self.stream;
        let family = self.family_for(m);
        let (logits, bias) = (ptr(logits, s), ptr(&self.router_bias, s));
        if family == KernelFamily::GroupedGemm {
            // The grouped step routes in its first kernel (moe_prepare).
            let (ids, weights) = g.routing_ptrs(s, m)?;
            let p = StepPtrs { logits, bias, ..self.step_ptrs(ptr(x, s), ids, weights, ptr(y, s)) };
            return self.launch_family(family, m, &p);
        }
        let (ids, weights) = g.route(s, m, logits, bias)?;
        let p = self.step_ptrs(ptr(x, s), ids, weights, ptr(y, s));
        self.launch_family(family, m, &p)
    }

    /// The routing the last [`MoeLayer::forward_logits`] produced, copied back (syncs):
    /// `(topk_ids, topk_weights)`, each `[M, k]`.
    pub fn last_routing(&self, m: usize) -> Result<(Vec<i32>, Vec<f32>)> {
        let (ids, w) = self.grouped_path()?.last_routing(&self.stream)?;
        let n = m * self.spec.top_k() as usize;
        Ok((ids[..n].to_vec(), w[..n].to_vec()))
    }

    /// The grouped path's last alignment (syncs).
    pub fn last_alignment(&self) -> Result<crate::prefill::Alignment> {
        self.grouped_path()?.last_alignment(&self.stream)
    }

    fn grouped_path(&self) -> Result<&GroupedPath> {
        self.grouped
            .as_ref()
            .map_err(|why| RuntimeError::FamilyUnavailable { family: KernelFamily::GroupedGemm, why: why.clone() })
    }

    /// x `[M, H]` with M > 0 in the spec's dtype and y of the same shape; returns M.
    fn check_step<T: ActElem>(&self, x: &CudaSlice<T>, y: &CudaSlice<T>) -> Result<usize> {
        let h = self.spec.hidden() as usize;
        if T::DTYPE != self.spec.act_dtype() {
            return Err(RuntimeError::Shape {
                what: "activation dtype",
                expected: self.spec.act_dtype().to_string(),
                got: T::DTYPE.to_string(),
            });
        }
        if x.is_empty() || x.len() % h != 0 {
            return Err(RuntimeError::Shape {
                what: "x",
                expected: format!("[M, {h}] with M > 0"),
                got: format!("{} elements", x.len()),
            });
        }
        let m = x.len() / h;
        if y.len() != m * h {
            return Err(RuntimeError::Shape {
                what: "y",
                expected: format!("[{m}, {h}]"),
                got: format!("{} elements", y.len()),
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
            errors: ptr(&self.errors, s),
        }
    }

    fn launch_family(&self, family: KernelFamily, m: usize, p: &StepPtrs) -> Result<()> {
        tracing::debug!(%family, m, "forward");
        match family {
            KernelFamily::GroupedGemm => {
                let g = self.grouped_path()?;
                g.reserve(&self.stream, &self.spec, m, self.deterministic)?;
                g.forward(&self.stream, &self.spec, m, p, self.deterministic)
            }
            _ => self.forward_decode(m, p),
        }
    }

    /// Warp decode over a step of any size: launches of at most `decode_chunk` tokens, each on
    /// its own rows of x, the routing and y (the chunks share the intermediate scratch, which
    /// each gate_up writes only after its `griddepcontrol.wait` on the down before it).
    fn forward_decode(&self, m: usize, p: &StepPtrs) -> Result<()> {
        let (h, k) = (self.spec.hidden() as u64, self.spec.top_k() as u64);
        let act = self.spec.act_dtype().bytes() as u64;
        let chunk = self.decode_chunk;
        self.reserve_decode(m.min(chunk))?;
        for start in (0..m).step_by(chunk) {
            let t = start as u64;
            let part = StepPtrs {
                x: p.x + t * h * act,
                ids: p.ids + t * k * 4,
                weights: p.weights + t * k * 4,
                y: p.y + t * h * act,
                ..*p
            };
            self.launch_decode(chunk.min(m - start), &part)?;
        }
        Ok(())
    }

    fn launch_decode(&self, m: usize, p: &StepPtrs) -> Result<()> {
        let (h, k) = (self.spec.hidden() as usize, self.spec.top_k() as usize);
        let smem = decode_smem_bytes(&self.spec, m as u32);
        let mid = self.mid.lock().unwrap_or_else(|p| p.into_inner());
        let tile = DecodeTiles::token_tile(m as u32).min(self.max_token_tile);
        let fns = self.tiles.iter().find(|t| t.tile == tile).expect("every token tile is loaded");
        for f in [&fns.gate_up, &self.down.f, &self.down_stash.f, &fns.fused] {
            if smem + self.static_smem > 48 * 1024 {
                f.set_attribute(
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )?;
            }
        }
        let s = &self.stream;
        let (mut xp, mut idp, mut wp) = (p.x, p.ids, p.weights);
        let (mut w13, mut w13s, mut w2, mut w2s) =
            (ptr(&self.w13, s), ptr(&self.w13_scales, s), ptr(&self.w2, s), ptr(&self.w2_scales, s));
        let (mut midp, mut yp, mut errp, mut readyp) = (ptr(&mid, s), p.y, p.errors, ptr(&self.ready, s));
        let mut m_i32 = m as i32;
        let block = self.warps * 32;
        let pairs = (m * k) as u64;
        let gu_items = pairs.min(self.spec.experts() as u64) * self.spec.intermediate() as u64;
        // At M = 1 every down warp holds one item (one row): the stash kernel, which takes the
        // whole item to shared memory before the wait.
        let (down, dn_rows) = if m == 1 { (&self.down_stash, 1) } else { (&self.down, self.down_rows) };
        let dn_items = (h / dn_rows) as u64 * m as u64;
        let gu_warp_items = if tile == 1 { gu_items } else { gu_items.div_ceil(self.gate_up_items) };
        let grid = |items: u64, per_sm: u32| items.div_ceil(self.warps as u64).min((self.sms * per_sm) as u64) as u32;
        let as_arg = |p: &mut u64| p as *mut u64 as *mut c_void;
        if self.fused {
            // Its blocks wait on each other, so the grid must be co-resident: size it from the
            // occupancy at this step's shared memory.
            let per_sm = fns.fused.occupancy_max_active_blocks_per_multiprocessor(block, smem as usize, None)?;
            if per_sm == 0 {
                return Err(RuntimeError::StepTooLarge { m, need: smem, max: self.max_smem });
            }
            let blocks = grid(gu_warp_items.max((h / self.down_rows) as u64 * m as u64), per_sm);
            let mut args = [
                as_arg(&mut xp),
                as_arg(&mut idp),
                as_arg(&mut wp),
                as_arg(&mut w13),
                as_arg(&mut w13s),
                as_arg(&mut w2),
                as_arg(&mut w2s),
                as_arg(&mut midp),
                as_arg(&mut yp),
                &mut m_i32 as *mut i32 as *mut c_void,
                as_arg(&mut errp),
                as_arg(&mut readyp),
            ];
            unsafe { launch(&fns.fused, s, blocks, block, smem, true, &mut args)? };
            return Ok(());
        }
        unsafe {
            let mut gu = [
                as_arg(&mut xp),
                as_arg(&mut idp),
                as_arg(&mut w13),
                as_arg(&mut w13s),
                as_arg(&mut midp),
                &mut m_i32 as *mut i32 as *mut c_void,
                as_arg(&mut errp),
            ];
            // Both launch as programmatic dependents: each waits (griddepcontrol.wait) before it
            // touches memory its predecessor may use, so only launch latency overlaps.
            // Staged activations can take more shared memory than the load-time sizing assumed.
            // The bulk kernels: one block per SM (a producer warp and the consumers). The bulk
            // gate_up also takes w2, which it prefetches into L2 for down.
            let bulk_grid = |tiles: u64| tiles.min(self.sms as u64) as u32;
            match (m, &self.bulk_gate_up) {
                (1, Some(b)) => {
                    let tiles = pairs * self.spec.intermediate() as u64 / (b.threads / 32 - 1) as u64;
                    let mut w2p = w2;
                    let mut args = [gu[0], gu[1], gu[2], gu[3], as_arg(&mut w2p), gu[4], gu[5], gu[6]];
                    launch(&b.f, s, bulk_grid(tiles), b.threads, b.smem, true, &mut args)?;
                }
                _ => {
                    let per_sm =
                        fns.gate_up.occupancy_max_active_blocks_per_multiprocessor(block, smem as usize, None)?;
                    let per_sm = (per_sm as u32).clamp(1, fns.gate_up_blocks_per_sm);
                    launch(&fns.gate_up, s, grid(gu_warp_items, per_sm), block, smem, true, &mut gu)?;
                }
            }
            let mut dn = [
                as_arg(&mut midp),
                as_arg(&mut idp),
                as_arg(&mut wp),
                as_arg(&mut w2),
                as_arg(&mut w2s),
                as_arg(&mut yp),
                &mut m_i32 as *mut i32 as *mut c_void,
            ];
            // down needs only the step's ids and weights in dynamic shared memory: the less it
            // asks for, the sooner its blocks fit beside gate_up's last ones.
            match (m, &self.bulk_down) {
                (1, Some(b)) => {
                    let tiles = h as u64 / (b.threads / 32 - 1) as u64;
                    launch(&b.f, s, bulk_grid(tiles), b.threads, b.smem, true, &mut dn)?;
                }
                _ => {
                    let dn_smem = decode_down_smem_bytes(&self.spec, m as u32);
                    launch(&down.f, s, grid(dn_items, down.blocks_per_sm), block, dn_smem, true, &mut dn)?;
                }
            }
        }
        Ok(())
    }

    fn check_ids(&self, topk_ids: &CudaSlice<i32>) -> Result<()> {
        let ids = self.stream.clone_dtoh(topk_ids)?;
        validate_ids(&ids, self.spec.experts())
    }
}

/// The largest token count `c` such that a warp-decode launch of every size up to `c` fits the
/// device's shared memory and the kernels' 32-bit work indices (0: not even one token fits).
/// Scanned rather than solved: the activation staging switches off past a size, so the bytes a
/// step needs are not monotonic in its tokens.
fn decode_chunk(spec: &MoeSpec, static_smem: u32, max_smem: u32) -> usize {
    let max = i32::MAX as usize / spec.hidden() as usize;
    // The intermediate scratch is sized for one launch: cap it, but never below one token.
    let mid_cap = (MAX_DECODE_MID_BYTES / (4 * decode_mid_floats(spec, 1))).max(1);
    (1..=max.min(mid_cap))
        .take_while(|&m| decode_smem_bytes(spec, m as u32) + static_smem <= max_smem)
        .last()
        .unwrap_or(0)
}

/// Cap on the intermediate scratch of one warp-decode launch: steps that large are far past the
/// sizes warp decode serves well, so more launches cost little and the memory stays bounded.
const MAX_DECODE_MID_BYTES: usize = 64 << 20;

/// Every id in `[0, experts)`, else a typed error naming the first offender.
pub fn validate_ids(ids: &[i32], experts: u32) -> Result<()> {
    let bad = |&(_, &e): &(usize, &i32)| e < 0 || e as u32 >= experts;
    let count = ids.iter().enumerate().filter(bad).count();
    match ids.iter().enumerate().find(bad) {
        None => Ok(()),
        Some((first_pair, &first_id)) => Err(RuntimeError::ExpertIdOutOfRange { count, experts, first_pair, first_id }),
    }
}
