//! The expert-parallel layer: this rank's experts as a [`MoeLayer`], the exchange kernels and
//! their buffers, and the step's halves.

use super::comm::{Comm, Window};
use super::map::ExpertMap;
use super::EpError;
use crate::device::Device;
use crate::launch::{ptr, Kernel};
use crate::layer::{ActElem, MoeLayer};
use crate::view::{DeviceTensor, DeviceTensorMut};
use crate::weights::Weights;
use cudarc::driver::{sys, CudaEvent, CudaSlice, CudaStream};
use moe_codegen::ep::{ep_entry, EP_PLAN_THREADS};
use moe_codegen::params::{EpCombineParams, EpCountParams, EpPackParams, EpPlaceParams, EpUnpackParams, RouteParams};
use moe_codegen::{render_ep, MoeSpec};
use std::sync::Arc;

mod halves;

/// Bounds an expert-parallel layer's buffers are sized from, the same on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EpConfig {
    /// The most tokens a rank passes in one step.
    pub max_tokens: usize,
    /// Rows of each peer slab (tokens one rank may send one peer in a step); `None`: the
    /// worst case, `max_tokens`. Smaller saves memory and transfer time at large rank counts,
    /// where a token reaches only some ranks; a step that overflows a slab drops those token
    /// transfers and reports them through [`EpLayer::take_errors`].
    pub capacity: Option<usize>,
    /// Tokens travel to their peers in e4m3, one f32 scale per 128 columns (amax / 448), and are
    /// turned back into the activation dtype on arrival: half the dispatch's bytes, at the cost
    /// of quantizing the activations the peers' experts see (a token's own rank reads it
    /// unquantized). The hidden size must be a multiple of 128. The combine stays in the
    /// activation dtype.
    pub fp8_dispatch: bool,
    /// Transfers of at least [`COPY_ENGINE_MIN_BYTES`] per peer run as NCCL all-to-alls between
    /// symmetric windows, which NCCL moves with the GPU's copy engines within a node: no SM is
    /// taken from the kernels they overlap (the experts', or a caller's between the halves). Each
    /// such all-to-all also copies this rank's own chunk locally (NCCL's all-to-all has no empty
    /// chunk), and its synchronisation costs more than a kernel's, so smaller transfers stay
    /// on NCCL's kernels, one send and one receive per peer. Off: every transfer on the kernels,
    /// and the buffers in ordinary device memory. Across nodes NCCL runs the all-to-all on its
    /// kernels either way.
    pub copy_engines: bool,
    /// With shared experts: steps of at least this many tokens per rank run them apart, in a
    /// launch of their own after the peers' slabs, under the combine's transfer (which otherwise
    /// has nothing to run under), and the rank's routed experts on its own tokens alone under
    /// the dispatch. Their output is then rounded to the activation dtype apart from the routed
    /// experts' (one more rounding). `None`: always in one launch with the routed experts.
    pub shared_apart_tokens: Option<usize>,
    /// Steps of at least this many tokens per rank that the rank's layer runs on the grouped
    /// GEMMs, and whose combine travels on the copy engines ([`EpConfig::copy_engines`],
    /// [`COPY_ENGINE_MIN_BYTES`]), split their own tokens' launch: the alignment and GEMM1 under
    /// the dispatch's transfer, GEMM2 after the peers' slabs, under the combine's transfer (which
    /// otherwise has nothing to run under), and last the own combine, which adds the peers'
    /// partials itself (no final sum of its own; the same bits). The peers' slabs then run
    /// on a second set of the local layer's scratch, reserved at construction. Where it applies,
    /// the shared experts stay in the own tokens' launch (`shared_apart_tokens` gives way).
    /// `None`: never.
    pub split_own_tokens: Option<usize>,
}

impl EpConfig {
    /// Steps of up to `max_tokens` tokens per rank, slabs of the worst case, activations sent
    /// as they are.
    pub fn new(max_tokens: usize) -> EpConfig {
        EpConfig {
            max_tokens,
            capacity: None,
            fp8_dispatch: false,
            copy_engines: true,
            shared_apart_tokens: Some(SHARED_APART_TOKENS),
            split_own_tokens: Some(SPLIT_OWN_TOKENS),
        }
    }
    fn slab_rows(&self) -> usize {
        self.capacity.unwrap_or(self.max_tokens).min(self.max_tokens)
    }
}

/// The smallest transfer per peer that runs on the copy engines ([`EpConfig::copy_engines`]). On
/// 2 H200s (NCCL 2.28.3, graph replays) an all-to-all of 4 MiB per peer took 10-18 us longer than
/// NCCL's kernels; at 16 MiB the two were even in isolation, and the whole layer (Qwen3-30B-A3B,
/// 4096 tokens per rank, median of three runs each) was 0.7% faster on the copy engines with bf16
/// dispatch and 2.8% with e4m3.
pub const COPY_ENGINE_MIN_BYTES: usize = 8 << 20;

/// [`EpConfig::shared_apart_tokens`]'s default.
pub const SHARED_APART_TOKENS: usize = 1024;

/// [`EpConfig::split_own_tokens`]'s default. On 2 H100s, split against unsplit: Qwen3-30B-A3B
/// at 2048 and 4096 tokens per rank 7% faster, DeepSeek-V3 with its shared expert at 4096 1%.
pub const SPLIT_OWN_TOKENS: usize = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Idle,
    Sent,
    Received,
    Returning,
}

/// How a step runs this rank's experts on its own tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OwnPlan {
    /// One launch, the routed and shared experts together.
    One,
    /// The routed experts, then the shared ones in a launch of their own
    /// ([`EpConfig::shared_apart_tokens`]).
    SharedApart,
    /// One launch in parts ([`EpConfig::split_own_tokens`]): its front (alignment, GEMM1), its
    /// GEMM2, and in `combine_recv` its combine, which adds the peers' partials to the own sums
    /// (`moe_ep_combine` folded in).
    Split,
}

impl OwnPlan {
    fn parts(self) -> usize {
        if self == OwnPlan::One {
            1
        } else {
            2
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Step {
    stage: Stage,
    m: usize,
    rows: usize,
    plan: OwnPlan,
    /// Parts of the plan enqueued so far.
    own_done: usize,
    /// The own tokens' activations, as the last of those parts read them.
    x_own: u64,
    /// The received slabs run on their own stream (`forward`'s split steps, which join it).
    recv_side: bool,
}

struct Kernels {
    count: Kernel<EpCountParams>,
    place: Kernel<EpPlaceParams>,
    pack: Kernel<EpPackParams>,
    unpack: Kernel<EpUnpackParams>,
    combine: Kernel<EpCombineParams>,
    route: Kernel<RouteParams>,
}

/// A buffer the transfers read or write: a symmetric window ([`EpConfig::copy_engines`]) or
/// ordinary device memory.
enum Xfer {
    Window(Window),
    Plain(CudaSlice<u8>),
}

impl Xfer {
    fn new(comm: &Comm, windows: bool, bytes: usize, s: &Arc<CudaStream>) -> Result<Xfer, EpError> {
        Ok(if windows { Xfer::Window(comm.window(bytes, s)?) } else { Xfer::Plain(s.alloc_zeros(bytes)?) })
    }
    fn ptr(&self, s: &CudaStream) -> u64 {
        match self {
            Xfer::Window(w) => w.ptr(),
            Xfer::Plain(b) => ptr(b, s),
        }
    }
}

/// Device buffers, sized once from [`EpConfig`]. The transfer buffers hold one chunk per rank,
/// chunk d for (or from) rank d: an all-to-all's layout (this rank's own chunk unused).
struct Buffers {
    owner: CudaSlice<i32>,
    local: CudaSlice<i32>,
    slots: CudaSlice<i32>,
    /// Per block of tokens, how many go to each slab.
    counts: CudaSlice<i32>,
    pos: CudaSlice<i32>,
    self_ids: CudaSlice<i32>,
    self_weights: CudaSlice<f32>,
    /// The shared experts run apart: routing rows naming no routed expert (-1, weight 0), and
    /// their output.
    no_ids: CudaSlice<i32>,
    no_weights: CudaSlice<f32>,
    y_shared: CudaSlice<u8>,
    /// The peers' slabs (one NCCL transfer each: rows, ids, weights), and ours from them,
    /// `slab_stride` apart.
    send: Xfer,
    recv: Xfer,
    /// fp8 dispatch: the received rows back in the activation dtype (else unused).
    x_recv: CudaSlice<u8>,
    y_self: CudaSlice<u8>,
    /// Outputs of the slab from rank d at chunk d, returned to d; theirs for us at chunk d.
    y_recv: Xfer,
    y_back: Xfer,
    err: CudaSlice<i32>,
    /// Steps from logits: the whole layer's routing `[max_tokens, k]`, and the router's
    /// per-expert correction bias (zeros until set).
    routed_ids: CudaSlice<i32>,
    routed_weights: CudaSlice<f32>,
    router_bias: CudaSlice<f32>,
}

/// Events ordering the compute stream and the NCCL stream.
struct Events {
    planned: CudaEvent,
    packed: CudaEvent,
    arrived: CudaEvent,
    computed: CudaEvent,
    returned: CudaEvent,
}

/// One rank of a MoE layer whose experts are spread over the ranks of a [`Comm`].
pub struct EpLayer {
    spec: MoeSpec,
    map: ExpertMap,
    cfg: EpConfig,
    // Dropped (aborted) before `bufs`, whose windows it has registered.
    comm: Comm,
    local: MoeLayer,
    /// Slots per row of each rank's layer: min(top-k, the experts it holds).
    slots: Vec<usize>,
    stream: Arc<CudaStream>,
    comm_stream: Arc<CudaStream>,
    /// The pack's, beside the own tokens' front ([`EpLayer::dispatch_send`]).
    pack_stream: Arc<CudaStream>,
    /// The received slabs', beside the own tokens' front, in `forward`'s split steps.
    recv_stream: Arc<CudaStream>,
    kernels: Kernels,
    bufs: Buffers,
    events: Events,
    step: Step,
    /// Benches only: run no expert on the own tokens / on the received slabs.
    skip_own: bool,
    skip_received: bool,
    no_transfers: bool,
}

impl EpLayer {
    /// This rank's part of the layer `spec` (every expert counted), experts placed by `map`:
    /// `weights` holds this rank's experts only, in the map's local order, then the spec's shared
    /// experts, which every rank holds and runs on its own tokens
    /// ([`crate::HostWeights::select_experts`] cuts them from a whole layer's). Checks with every
    /// other rank that they built the same layer (spec, map, bounds): [`EpError::Mismatch`] if
    /// not, [`EpError::Timeout`] if a rank never comes.
    pub fn new<'w>(
        device: &Device,
        comm: Comm,
        spec: MoeSpec,
        map: ExpertMap,
        weights: impl Into<Weights<'w>>,
        cfg: EpConfig,
    ) -> Result<EpLayer, EpError> {
        let (rank, ranks) = (comm.rank(), comm.ranks());
        if map.experts() != spec.experts() || map.ranks() != ranks {
            return Err(EpError::Config(format!(
                "the expert map covers {} experts over {} ranks; the spec has {} experts and the communicator {ranks} ranks",
                map.experts(),
                map.ranks(),
                spec.experts()
            )));
        }
        if cfg.max_tokens == 0 || cfg.capacity == Some(0) {
            return Err(EpError::Config(format!("bounds {cfg:?}: at least one token per step and per slab")));
        }
        if !Arc::ptr_eq(comm.context(), device.context()) {
            return Err(EpError::Config("the communicator was made on another device".into()));
        }
        let stream = device.stream().clone();
        // Every rank must have built the same layer: a 32-byte digest of it, gathered.
        let digest = blake3::hash(format!("{spec:?}|{map:?}|{cfg:?}|{ranks}").as_bytes());
        let all = comm.all_gather(digest.as_bytes(), &stream)?;
        if let Some(other) = all.chunks(32).position(|d| d != digest.as_bytes()) {
            return Err(EpError::Mismatch { me: rank, other });
        }

        let k = spec.top_k() as usize;
        let slots: Vec<usize> = (0..ranks).map(|r| k.min(map.count(r) as usize)).collect();
        let mut b = MoeSpec::builder(spec.hidden(), spec.intermediate(), map.count(rank), slots[rank] as u32)
            .weight_format(spec.weight_format())
            .activation(spec.activation())
            .act_dtype(spec.act_dtype())
            .bias(spec.has_bias());
        if let Some(d) = spec.dequant() {
            b = b.dequant(d);
        }
        let mut local_spec = b.build().map_err(crate::error::RuntimeError::from)?;
        if spec.shared_experts() > 0 {
            // The shared experts after this rank's routed ones: its own tokens' launch appends
            // their slots, a peer's slab leaves them empty (`MoeLayer::step` with `shared` off).
            local_spec = local_spec
                .with_shared_experts(spec.shared_experts(), spec.shared_gated())
                .map_err(crate::error::RuntimeError::from)?;
        }
        let mut local = MoeLayer::load(device, local_spec, weights)?;
        // Padding rows and experts held elsewhere are ids of -1, which the kernels skip.
        local.set_validate_routing(false);
        let rows = cfg.slab_rows();
        let peers = ranks - 1;
        local.reserve(cfg.max_tokens.max(peers * rows))?;
        if may_split(&cfg, ranks) {
            local.reserve_second(rows)?;
        }

        if cfg.fp8_dispatch && spec.hidden() % 128 != 0 {
            return Err(EpError::Config(format!(
                "fp8 dispatch with hidden = {}: one scale per 128 columns needs a multiple of 128",
                spec.hidden()
            )));
        }
        let src = render_ep(&spec, device.arch(), cfg.fp8_dispatch).map_err(crate::error::RuntimeError::from)?;
        let names =
            [ep_entry::COUNT, ep_entry::PLACE, ep_entry::PACK, ep_entry::UNPACK, ep_entry::COMBINE, ep_entry::ROUTE];
        let mut f = device.functions(&src, &names)?.into_iter();
        let kernels = Kernels {
            count: Kernel::new(f.next().unwrap()),
            place: Kernel::new(f.next().unwrap()),
            pack: Kernel::new(f.next().unwrap()),
            unpack: Kernel::new(f.next().unwrap()),
            combine: Kernel::new(f.next().unwrap()),
            route: Kernel::new(f.next().unwrap()),
        };

        let row_bytes = spec.hidden() as usize * spec.act_dtype().bytes();
        let wire = wire_row_bytes(&spec, cfg.fp8_dispatch);
        let ctx = device.context();
        let ev = || ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING));
        let events = Events { planned: ev()?, packed: ev()?, arrived: ev()?, computed: ev()?, returned: ev()? };
        // NCCL's kernels on the highest priority: the block scheduler then starts them beside a
        // persistent GEMM of this rank's own tokens instead of after it.
        let (mut least, mut greatest) = (0i32, 0i32);
        unsafe { sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest).result()? };
        let comm_stream = ctx.new_stream_with_priority(greatest)?;
        // The windows last: once one is registered, nothing below fails but a window (which then
        // aborts the communicator, so that none is freed while NCCL still uses it).
        let chunks = ranks * slab_stride(rows, k, wire);
        let n = |v: usize| v.max(1);
        let s = &stream;
        let (x_recv, y_self, err) = (
            s.alloc_zeros(n(if cfg.fp8_dispatch { peers * rows * row_bytes } else { 0 }))?,
            s.alloc_zeros(n(cfg.max_tokens * row_bytes))?,
            s.alloc_zeros(2)?,
        );
        let (owner, local_ids, slot_counts) = (
            s.clone_htod(&map.owners_i32())?,
            s.clone_htod(&map.locals_i32())?,
            s.clone_htod(&slots.iter().map(|&v| v as i32).collect::<Vec<_>>())?,
        );
        // The shared experts' own launch's buffers only where a step may take it.
        let apart = if may_run_shared_apart(&spec, &cfg, ranks) { cfg.max_tokens } else { 0 };
        let no_ids = s.clone_htod(&vec![-1i32; n(apart * slots[rank])])?;
        let (no_weights, y_shared) = (s.alloc_zeros(n(apart * slots[rank]))?, s.alloc_zeros(n(apart * row_bytes))?);
        let (routed_ids, routed_weights, router_bias) = (
            s.alloc_zeros(n(cfg.max_tokens * k))?,
            s.alloc_zeros(n(cfg.max_tokens * k))?,
            s.alloc_zeros(n(spec.experts() as usize))?,
        );
        let (counts, pos, self_ids, self_weights) = (
            s.alloc_zeros(n(token_blocks(cfg.max_tokens) * ranks))?,
            s.alloc_zeros(n(cfg.max_tokens * ranks))?,
            s.alloc_zeros(n(cfg.max_tokens * slots[rank]))?,
            s.alloc_zeros(n(cfg.max_tokens * slots[rank]))?,
        );
        stream.synchronize()?;
        // Collective: every rank makes the same windows in the same order (the digest above).
        let ce = cfg.copy_engines;
        let bufs = Buffers {
            owner,
            local: local_ids,
            slots: slot_counts,
            counts,
            pos,
            self_ids,
            self_weights,
            no_ids,
            no_weights,
            y_shared,
            send: Xfer::new(&comm, ce, n(chunks), s)?,
            recv: Xfer::new(&comm, ce, n(chunks), s)?,
            x_recv,
            y_self,
            y_recv: Xfer::new(&comm, ce, n(ranks * rows * row_bytes), s)?,
            y_back: Xfer::new(&comm, ce, n(ranks * rows * row_bytes), s)?,
            err,
            routed_ids,
            routed_weights,
            router_bias,
        };
        let layer = EpLayer {
            spec,
            map,
            cfg,
            comm,
            local,
            slots,
            stream,
            comm_stream,
            pack_stream: ctx.new_stream()?,
            recv_stream: ctx.new_stream_with_priority(greatest)?,
            kernels,
            bufs,
            events,
            step: Step {
                stage: Stage::Idle,
                m: 0,
                rows: 0,
                plan: OwnPlan::One,
                own_done: 0,
                x_own: 0,
                recv_side: false,
            },
            skip_own: false,
            skip_received: false,
            no_transfers: false,
        };
        if ce && !layer.copy_engines() {
            tracing::info!(rank, "NCCL registered no symmetric windows: the transfers run on NCCL's kernels");
        }
        Ok(layer)
    }

    /// The whole layer's spec.
    pub fn spec(&self) -> &MoeSpec {
        &self.spec
    }
    /// Where the experts live.
    pub fn map(&self) -> &ExpertMap {
        &self.map
    }
    /// This rank's experts, as a single-GPU layer.
    pub fn local_layer(&self) -> &MoeLayer {
        &self.local
    }
    /// The stream every kernel of the step runs on (the device's); NCCL runs on its own,
    /// joined by events.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
    /// Whether the transfers can run on the copy engines: [`EpConfig::copy_engines`] asked, and
    /// NCCL registered every transfer buffer as a symmetric window (it does not without direct
    /// peer access, or with `NCCL_WIN_ENABLE=0`). Within a node NCCL then moves them with the copy
    /// engines; across nodes, with its kernels.
    pub fn copy_engines(&self) -> bool {
        let b = &self.bufs;
        [&b.send, &b.recv, &b.y_recv, &b.y_back].iter().all(|x| matches!(x, Xfer::Window(w) if w.registered()))
    }

    /// Run the kernels of a step on `stream` (a stream of the layer's device) from now on.
    pub fn set_stream(&mut self, stream: Arc<CudaStream>) -> Result<(), EpError> {
        if !Arc::ptr_eq(stream.context(), self.stream.context()) || self.step.stage != Stage::Idle {
            return Err(EpError::Config("a stream of the layer's device, between steps".into()));
        }
        self.stream = stream;
        Ok(())
    }

    /// Benches only: the steps move tokens but run no expert (dispatch and combine timed alone).
    #[doc(hidden)]
    pub fn set_exchange_only(&mut self, on: bool) {
        self.set_skip_experts(on, on);
    }
    /// Benches only: the steps run no expert on the own tokens (`own`) or on the received slabs
    /// (`received`), to time each launch in its place.
    #[doc(hidden)]
    pub fn set_skip_experts(&mut self, own: bool, received: bool) {
        (self.skip_own, self.skip_received) = (own, received);
    }
    /// The stream the received slabs run on.
    fn received_stream(&self) -> &Arc<CudaStream> {
        if self.step.recv_side {
            &self.recv_stream
        } else {
            &self.stream
        }
    }
    /// Benches only: the steps run every kernel but start no transfer (the experts' time alone;
    /// received slabs hold whatever the last transfer left).
    #[doc(hidden)]
    pub fn set_no_transfers(&mut self, on: bool) {
        self.no_transfers = on;
    }

    fn row_bytes(&self) -> usize {
        self.spec.hidden() as usize * self.spec.act_dtype().bytes()
    }
    /// Bytes of a token's row in a peer slab (as it travels).
    fn wire_bytes(&self) -> usize {
        wire_row_bytes(&self.spec, self.cfg.fp8_dispatch)
    }

    fn expect(&self, call: &'static str, stage: Stage, expected: &'static str) -> Result<(), EpError> {
        if self.step.stage == stage {
            Ok(())
        } else {
            Err(EpError::OutOfOrder { call, expected })
        }
    }

    /// The whole step: `x [m, H]`, `topk_ids` / `topk_weights [m, k]` (ids of the whole layer,
    /// -1 for a padding slot), `y [m, H]`. Every rank calls it with the same `m`.
    pub fn forward<T: ActElem + 'static>(
        &mut self,
        x: &CudaSlice<T>,
        topk_ids: &CudaSlice<i32>,
        topk_weights: &CudaSlice<f32>,
        y: &mut CudaSlice<T>,
    ) -> Result<(), EpError> {
        let s = self.stream.clone();
        self.whole_step(x, DeviceTensor::new(topk_ids, &s), DeviceTensor::new(topk_weights, &s), y)
    }

    fn whole_step<T: ActElem + 'static>(
        &mut self,
        x: &CudaSlice<T>,
        topk_ids: DeviceTensor<'_, i32>,
        topk_weights: DeviceTensor<'_, f32>,
        y: &mut CudaSlice<T>,
    ) -> Result<(), EpError> {
        let s = self.stream.clone();
        let xp = DeviceTensor::new(x, &s).ptr();
        self.dispatch_send(DeviceTensor::new(x, &s), topk_ids, topk_weights)?;
        // Split steps: the received slabs on a stream of their own, so that they start as the
        // own tokens' front drains (the halves keep them on the caller's stream, whose capture
        // may end before anything would join that stream).
        self.step.recv_side = self.step.plan == OwnPlan::Split;
        // Own tokens need no transfer: their experts are launched while the transfers fly (the
        // shared experts, where they run apart, under the combine's).
        self.run_own_part(xp)?;
        self.dispatch_recv()?;
        self.combine_send()?;
        if self.step.recv_side {
            // The own GEMM2 after the received slabs: beside them, it delayed their combine's
            // transfer, which then had nothing to run under.
            self.stream.wait(&self.events.computed)?;
        }
        while self.step.own_done < self.step.plan.parts() {
            self.run_own_part(xp)?;
        }
        self.combine_recv(DeviceTensorMut::new(y, &s))
    }

    /// The whole step from router logits `[m, E]` f32 (every expert of the layer), routed on the
    /// device by the spec's router (`MoeSpec::with_router`; the group-limited one adds the bias
    /// of [`EpLayer::set_router_bias`]), then [`EpLayer::forward`]. No host synchronisation.
    pub fn forward_logits<T: ActElem + 'static>(
        &mut self,
        x: &CudaSlice<T>,
        logits: &CudaSlice<f32>,
        y: &mut CudaSlice<T>,
    ) -> Result<(), EpError> {
        // Everything checked before the router writes the routing buffers.
        let m = self.start_step::<T>("forward_logits", x.len())?;
        let e = self.spec.experts() as usize;
        if logits.len() != m * e {
            return Err(shape("router logits", format!("[{m}, {e}]"), format!("{} elements", logits.len())));
        }
        let (s, b) = (self.stream.clone(), &self.bufs);
        let p = RouteParams {
            logits: ptr(logits, &s),
            bias: ptr(&b.router_bias, &s),
            m: m as i32,
            topk_ids: ptr(&b.routed_ids, &s),
            topk_weights: ptr(&b.routed_weights, &s),
        };
        let threads = moe_codegen::grouped::ROUTE_THREADS;
        let grid = m.div_ceil((threads / 32) as usize) as u32;
        // SAFETY: logits hold m rows of E (checked); the routing buffers max_tokens >= m rows of k.
        unsafe { self.kernels.route.launch(&s, (grid, threads, 0), false, p)? };
        let n = m * self.spec.top_k() as usize;
        // SAFETY: the layer's own routing buffers, n elements each (above).
        let (ids, weights) = unsafe {
            (
                DeviceTensor::<i32>::from_raw(ptr(&self.bufs.routed_ids, &s), n),
                DeviceTensor::<f32>::from_raw(ptr(&self.bufs.routed_weights, &s), n),
            )
        };
        self.whole_step(x, ids, weights, y)
    }

    /// The group-limited router's per-expert correction bias `[E]` (DeepSeek-V3's
    /// `e_score_correction_bias`), for [`EpLayer::forward_logits`]; zeros until set.
    pub fn set_router_bias(&mut self, bias: &[f32]) -> Result<(), EpError> {
        let e = self.spec.experts() as usize;
        if bias.len() != e {
            return Err(shape("router bias", format!("[{e}]"), format!("{} elements", bias.len())));
        }
        self.stream.memcpy_htod(bias, &mut self.bufs.router_bias)?;
        Ok(())
    }

    /// The routing the last [`EpLayer::forward_logits`] of `m` tokens chose, copied back (waits
    /// on the host): `(topk_ids, topk_weights)`, each `[m, k]`, ids of the whole layer.
    pub fn last_routing(&self, m: usize) -> Result<(Vec<i32>, Vec<f32>), EpError> {
        self.synchronize()?;
        let n = m * self.spec.top_k() as usize;
        if m > self.cfg.max_tokens {
            return Err(EpError::TooManyTokens { m, max: self.cfg.max_tokens });
        }
        let ids = self.stream.clone_dtoh(&self.bufs.routed_ids)?;
        let w = self.stream.clone_dtoh(&self.bufs.routed_weights)?;
        Ok((ids[..n].to_vec(), w[..n].to_vec()))
    }

    /// Wait on the host for everything enqueued so far, within the communicator's timeout;
    /// past it the communicator is aborted ([`EpError::Timeout`]).
    pub fn synchronize(&self) -> Result<(), EpError> {
        self.comm.synchronize(&self.comm_stream)?;
        self.comm.synchronize(&self.stream)
    }

    /// Token transfers dropped (slabs full) and ids skipped since the last call: an error if
    /// any. Waits on the host.
    pub fn take_errors(&mut self) -> Result<(), EpError> {
        self.synchronize()?;
        let e = self.stream.clone_dtoh(&self.bufs.err)?;
        self.stream.memset_zeros(&mut self.bufs.err)?;
        if e[0] != 0 || e[1] != 0 {
            return Err(EpError::Routing { dropped: e[1], invalid: e[0], capacity: self.cfg.slab_rows() });
        }
        Ok(())
    }

    /// A new step's token count from `x`'s length, checked (the previous step done, whole rows,
    /// the bound).
    fn start_step<T: ActElem>(&self, call: &'static str, x_len: usize) -> Result<usize, EpError> {
        self.expect(call, Stage::Idle, "the previous step's combine_recv")?;
        let m = self.check_x::<T>("x", x_len)?;
        if m > self.cfg.max_tokens {
            return Err(EpError::TooManyTokens { m, max: self.cfg.max_tokens });
        }
        Ok(m)
    }

    fn check_x<T: ActElem>(&self, what: &'static str, len: usize) -> Result<usize, EpError> {
        let h = self.spec.hidden() as usize;
        if T::DTYPE != self.spec.act_dtype() {
            return Err(shape("activation dtype", self.spec.act_dtype().to_string(), T::DTYPE.to_string()));
        }
        if len == 0 || len % h != 0 {
            return Err(shape(what, format!("[m, {h}] with m >= 1"), format!("{len} elements")));
        }
        Ok(len / h)
    }
}

/// Whether a step of this layer may split its own tokens' launch: it is asked for, and there is
/// a peer whose slab can run between the parts.
fn may_split(cfg: &EpConfig, ranks: usize) -> bool {
    ranks > 1 && cfg.split_own_tokens.is_some_and(|t| t <= cfg.max_tokens)
}

/// Whether a step of this layer may run its shared experts apart: it has some, it is asked for,
/// and there is a peer whose combine they can run under.
fn may_run_shared_apart(spec: &MoeSpec, cfg: &EpConfig, ranks: usize) -> bool {
    spec.shared_experts() > 0 && ranks > 1 && cfg.shared_apart_tokens.is_some_and(|t| t <= cfg.max_tokens)
}

/// Bytes of a slab's ids (and of its weights): `rows * slots` 4-byte values, 16-byte aligned.
fn meta_bytes(rows: usize, slots: usize) -> usize {
    (rows * slots * 4).div_ceil(16) * 16
}

/// Bytes of a token's row in a peer slab (`WIRE_ROW_BYTES` in `templates/ep.cu`): the activation
/// row, or with fp8 dispatch its e4m3 codes and one f32 scale per 128 columns, padded to 16.
fn wire_row_bytes(spec: &MoeSpec, fp8: bool) -> usize {
    let h = spec.hidden() as usize;
    if fp8 {
        (h + h / 32).div_ceil(16) * 16
    } else {
        h * spec.act_dtype().bytes()
    }
}

/// Bytes from one slab to the next in the transfer buffers (`slab_stride` in `templates/ep.cu`):
/// `rows` activation rows of `row_bytes` (as they travel), their ids, their weights, room for
/// `top_k` slots a row (a rank's slots are min(top-k, its experts)).
fn slab_stride(rows: usize, top_k: usize, row_bytes: usize) -> usize {
    rows * row_bytes + 2 * meta_bytes(rows, top_k)
}

/// Blocks of the count and place kernels for `m` tokens.
fn token_blocks(m: usize) -> usize {
    m.div_ceil(EP_PLAN_THREADS as usize)
}

fn shape(what: &'static str, expected: String, got: String) -> EpError {
    EpError::Runtime(crate::error::RuntimeError::Shape { what, expected, got })
}
