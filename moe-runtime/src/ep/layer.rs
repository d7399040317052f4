//! The expert-parallel layer: this rank's experts as a [`MoeLayer`], the exchange kernels and
//! their buffers, and the step's halves.

use super::comm::{Comm, P2p};
use super::map::ExpertMap;
use super::EpError;
use crate::device::Device;
use crate::launch::{ptr, Kernel};
use crate::layer::{ActElem, MoeLayer};
use crate::view::{DeviceTensor, DeviceTensorMut, TopkIds};
use crate::weights::Weights;
use cudarc::driver::{sys, CudaEvent, CudaSlice, CudaStream};
use moe_codegen::ep::{ep_entry, EP_PLAN_THREADS, EP_ROW_THREADS};
use moe_codegen::params::{EpCombineParams, EpCountParams, EpPackParams, EpPlaceParams, EpUnpackParams};
use moe_codegen::{render_ep, ActDtype, MoeSpec};
use std::sync::Arc;

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
}

impl EpConfig {
    /// Steps of up to `max_tokens` tokens per rank, slabs of the worst case, activations sent
    /// as they are.
    pub fn new(max_tokens: usize) -> EpConfig {
        EpConfig { max_tokens, capacity: None, fp8_dispatch: false }
    }
    fn slab_rows(&self) -> usize {
        self.capacity.unwrap_or(self.max_tokens).min(self.max_tokens)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Idle,
    Sent,
    Received,
    Returning,
}

#[derive(Clone, Copy, Debug)]
struct Step {
    stage: Stage,
    m: usize,
    rows: usize,
    /// This rank's own tokens its experts have run on: `[0, local_next)`.
    local_next: usize,
}

struct Kernels {
    count: Kernel<EpCountParams>,
    place: Kernel<EpPlaceParams>,
    pack: Kernel<EpPackParams>,
    unpack: Kernel<EpUnpackParams>,
    combine: Kernel<EpCombineParams>,
}

/// Device buffers, sized once from [`EpConfig`].
struct Buffers {
    owner: CudaSlice<i32>,
    local: CudaSlice<i32>,
    slots: CudaSlice<i32>,
    /// Per block of tokens, how many go to each slab.
    counts: CudaSlice<i32>,
    pos: CudaSlice<i32>,
    self_ids: CudaSlice<i32>,
    self_weights: CudaSlice<f32>,
    /// The peers' slabs (one NCCL transfer each: rows, ids, weights; `slab_bytes`), and ours
    /// from them.
    send: CudaSlice<u8>,
    recv: CudaSlice<u8>,
    /// fp8 dispatch: the received rows back in the activation dtype (else unused).
    x_recv: CudaSlice<u8>,
    y_self: CudaSlice<u8>,
    y_recv: CudaSlice<u8>,
    y_back: CudaSlice<u8>,
    err: CudaSlice<i32>,
}

/// Events ordering the compute stream and the NCCL stream.
struct Events {
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
    comm: Comm,
    local: MoeLayer,
    /// Slots per row of each rank's layer: min(top-k, the experts it holds).
    slots: Vec<usize>,
    stream: Arc<CudaStream>,
    comm_stream: Arc<CudaStream>,
    kernels: Kernels,
    bufs: Buffers,
    events: Events,
    step: Step,
    exchange_only: bool,
}

impl EpLayer {
    /// This rank's part of the layer `spec` (every expert counted), experts placed by `map`:
    /// `weights` holds this rank's experts only, in the map's local order
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
        if spec.shared_experts() > 0 {
            return Err(EpError::Config(
                "shared experts: run them on the token's own rank (e.g. between the halves) with a dense layer".into(),
            ));
        }
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
        let local_spec = b.build().map_err(crate::error::RuntimeError::from)?;
        let mut local = MoeLayer::load(device, local_spec, weights)?;
        // Padding rows and experts held elsewhere are ids of -1, which the kernels skip.
        local.set_validate_routing(false);
        let rows = cfg.slab_rows();
        let peers = ranks - 1;
        local.reserve(cfg.max_tokens.max(peers * rows))?;

        if cfg.fp8_dispatch && spec.hidden() % 128 != 0 {
            return Err(EpError::Config(format!(
                "fp8 dispatch with hidden = {}: one scale per 128 columns needs a multiple of 128",
                spec.hidden()
            )));
        }
        let src = render_ep(&spec, device.arch(), cfg.fp8_dispatch).map_err(crate::error::RuntimeError::from)?;
        let names = [ep_entry::COUNT, ep_entry::PLACE, ep_entry::PACK, ep_entry::UNPACK, ep_entry::COMBINE];
        let mut f = device.functions(&src, &names)?.into_iter();
        let kernels = Kernels {
            count: Kernel::new(f.next().unwrap()),
            place: Kernel::new(f.next().unwrap()),
            pack: Kernel::new(f.next().unwrap()),
            unpack: Kernel::new(f.next().unwrap()),
            combine: Kernel::new(f.next().unwrap()),
        };

        let row_bytes = spec.hidden() as usize * spec.act_dtype().bytes();
        let wire = wire_row_bytes(&spec, cfg.fp8_dispatch);
        let send_bytes: usize = (1..ranks).map(|j| slab_bytes(rows, slots[(rank + j) % ranks], wire)).sum();
        let n = |v: usize| v.max(1);
        let s = &stream;
        let bufs = Buffers {
            owner: s.clone_htod(&map.owners_i32())?,
            local: s.clone_htod(&map.locals_i32())?,
            slots: s.clone_htod(&slots.iter().map(|&v| v as i32).collect::<Vec<_>>())?,
            counts: s.alloc_zeros(n(token_blocks(cfg.max_tokens) * ranks))?,
            pos: s.alloc_zeros(n(cfg.max_tokens * ranks))?,
            self_ids: s.alloc_zeros(n(cfg.max_tokens * slots[rank]))?,
            self_weights: s.alloc_zeros(n(cfg.max_tokens * slots[rank]))?,
            send: s.alloc_zeros(n(send_bytes))?,
            recv: s.alloc_zeros(n(peers * slab_bytes(rows, slots[rank], wire)))?,
            x_recv: s.alloc_zeros(n(if cfg.fp8_dispatch { peers * rows * row_bytes } else { 0 }))?,
            y_self: s.alloc_zeros(n(cfg.max_tokens * row_bytes))?,
            y_recv: s.alloc_zeros(n(peers * rows * row_bytes))?,
            y_back: s.alloc_zeros(n(peers * rows * row_bytes))?,
            err: s.alloc_zeros(2)?,
        };
        let ctx = device.context();
        let ev = || ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING));
        let events = Events { packed: ev()?, arrived: ev()?, computed: ev()?, returned: ev()? };
        // NCCL's kernels on the highest priority: the block scheduler then starts them beside a
        // persistent GEMM of this rank's own tokens instead of after it.
        let (mut least, mut greatest) = (0i32, 0i32);
        unsafe { sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest).result()? };
        let comm_stream = ctx.new_stream_with_priority(greatest)?;
        stream.synchronize()?;
        Ok(EpLayer {
            spec,
            map,
            cfg,
            comm,
            local,
            slots,
            stream,
            comm_stream,
            kernels,
            bufs,
            events,
            step: Step { stage: Stage::Idle, m: 0, rows: 0, local_next: 0 },
            exchange_only: false,
        })
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
        self.exchange_only = on;
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
        let xp = DeviceTensor::new(x, &s).ptr();
        self.dispatch_send(
            DeviceTensor::new(x, &s),
            DeviceTensor::new(topk_ids, &s),
            DeviceTensor::new(topk_weights, &s),
        )?;
        // Own tokens need no transfer: their experts are launched while the transfers fly.
        self.run_local(xp, self.step.m)?;
        self.dispatch_recv()?;
        self.combine_send()?;
        self.combine_recv(DeviceTensorMut::new(y, &s))
    }

    /// First half of the dispatch: plan the step, pack each token's row for the peers that own
    /// its experts and start the transfers (no host wait).
    pub fn dispatch_send<T: ActElem>(
        &mut self,
        x: DeviceTensor<'_, T>,
        topk_ids: DeviceTensor<'_, i32>,
        topk_weights: DeviceTensor<'_, f32>,
    ) -> Result<(), EpError> {
        self.expect("dispatch_send", Stage::Idle, "the previous step's combine_recv")?;
        let m = self.check_x::<T>("x", x.len())?;
        if m > self.cfg.max_tokens {
            return Err(EpError::TooManyTokens { m, max: self.cfg.max_tokens });
        }
        let k = self.spec.top_k() as usize;
        for (what, got) in [("topk_ids", topk_ids.len()), ("topk_weights", topk_weights.len())] {
            if got != m * k {
                return Err(shape(what, format!("[{m}, {k}]"), format!("{got} elements")));
            }
        }
        let (rank, ranks) = (self.comm.rank(), self.comm.ranks());
        let rows = m.min(self.cfg.slab_rows());
        let s = &self.stream;
        let b = &self.bufs;
        let blocks = token_blocks(m) as u32;
        let count = EpCountParams {
            topk_ids: topk_ids.ptr(),
            owner: ptr(&b.owner, s),
            counts: ptr(&b.counts, s),
            m: m as i32,
            rank: rank as i32,
            ranks: ranks as i32,
        };
        let place = EpPlaceParams {
            topk_ids: topk_ids.ptr(),
            topk_weights: topk_weights.ptr(),
            owner: ptr(&b.owner, s),
            local: ptr(&b.local, s),
            slots: ptr(&b.slots, s),
            counts: ptr(&b.counts, s),
            pos: ptr(&b.pos, s),
            self_ids: ptr(&b.self_ids, s),
            self_weights: ptr(&b.self_weights, s),
            send: ptr(&b.send, s),
            err: ptr(&b.err, s),
            m: m as i32,
            rows: rows as i32,
            rank: rank as i32,
            ranks: ranks as i32,
        };
        // SAFETY: every buffer was sized for max_tokens / the slab rows at construction; x, the
        // ids and the weights hold m tokens (checked).
        unsafe {
            // One block starts every slab at row 0: no counts to make.
            if blocks > 1 {
                self.kernels.count.launch(s, (blocks, EP_PLAN_THREADS, 0), false, count)?;
            }
            // Programmatic dependents: each kernel's launch overlaps its predecessor's drain.
            self.kernels.place.launch(s, (blocks, EP_PLAN_THREADS, 0), blocks > 1, place)?;
        }
        if ranks > 1 {
            let pack = EpPackParams {
                x: x.ptr(),
                pos: ptr(&b.pos, s),
                slots: ptr(&b.slots, s),
                send: ptr(&b.send, s),
                m: m as i32,
                rows: rows as i32,
                rank: rank as i32,
                ranks: ranks as i32,
            };
            // SAFETY: as above; `send` holds ranks - 1 slabs of the slab rows.
            unsafe { self.kernels.pack.launch(s, (m as u32, EP_ROW_THREADS, 0), true, pack)? };
        }
        self.events.packed.record(s)?;
        self.comm_stream.wait(&self.events.packed)?;
        let ops = self.dispatch_ops(rows);
        self.comm.group(&ops, &self.comm_stream)?;
        self.events.arrived.record(&self.comm_stream)?;
        self.step = Step { stage: Stage::Sent, m, rows, local_next: 0 };
        Ok(())
    }

    /// To each peer (r + j) its slab j, from each peer (r - j) our region j: one transfer each.
    fn dispatch_ops(&self, rows: usize) -> Vec<P2p> {
        let (rank, ranks) = (self.comm.rank(), self.comm.ranks());
        let (s, b, rb) = (&self.stream, &self.bufs, self.wire_bytes());
        let mine = slab_bytes(rows, self.slots[rank], rb);
        let mut ops = Vec::with_capacity(2 * ranks);
        let mut off = 0;
        for j in 1..ranks {
            let (to, from) = ((rank + j) % ranks, (rank + ranks - j) % ranks);
            let theirs = slab_bytes(rows, self.slots[to], rb);
            ops.push(P2p::Send { ptr: ptr(&b.send, s) + off as u64, bytes: theirs, peer: to });
            ops.push(P2p::Recv { ptr: ptr(&b.recv, s) + ((j - 1) * mine) as u64, bytes: mine, peer: from });
            off += theirs;
        }
        ops
    }

    /// This rank's experts on its own tokens, reading `x` (the step's, again) in place: nothing
    /// travels for them, so this may run while the transfers are in flight, anywhere between
    /// `dispatch_send` and `combine_recv`.
    pub fn run_local_experts<T: ActElem>(&mut self, x: DeviceTensor<'_, T>) -> Result<(), EpError> {
        if !matches!(self.step.stage, Stage::Sent | Stage::Received | Stage::Returning) {
            return Err(EpError::OutOfOrder { call: "run_local_experts", expected: "dispatch_send" });
        }
        let m = self.check_x::<T>("x", x.len())?;
        if m != self.step.m {
            return Err(shape("x", format!("the step's {} tokens", self.step.m), format!("{m} tokens")));
        }
        self.run_local(x.ptr(), m)
    }

    /// Own tokens `[local_next, upto)` through this rank's experts (x checked by the caller).
    fn run_local(&mut self, x: u64, upto: usize) -> Result<(), EpError> {
        let lo = self.step.local_next;
        if upto <= lo {
            return Ok(());
        }
        if !self.exchange_only {
            match self.spec.act_dtype() {
                ActDtype::Bf16 => self.run_local_rows::<half::bf16>(x, lo, upto)?,
                ActDtype::Fp16 => self.run_local_rows::<half::f16>(x, lo, upto)?,
            }
        }
        self.step.local_next = upto;
        Ok(())
    }

    fn run_local_rows<T: ActElem + 'static>(&self, x: u64, lo: usize, hi: usize) -> Result<(), EpError> {
        let (s, b) = (&self.stream, &self.bufs);
        let (h, slots) = (self.spec.hidden() as usize, self.slots[self.comm.rank()]);
        let (rb, n) = (self.row_bytes() as u64, (hi - lo) * slots);
        let ix = (lo * slots * 4) as u64;
        // SAFETY: x holds the step's m >= hi tokens (checked); the rest are the layer's buffers.
        let (x, ids, w, y) = unsafe {
            (
                DeviceTensor::<T>::from_raw(x + lo as u64 * rb, (hi - lo) * h),
                DeviceTensor::<i32>::from_raw(ptr(&b.self_ids, s) + ix, n),
                DeviceTensor::<f32>::from_raw(ptr(&b.self_weights, s) + ix, n),
                DeviceTensorMut::<T>::from_raw(ptr(&b.y_self, s) + lo as u64 * rb, (hi - lo) * h),
            )
        };
        self.local.forward_on(s, x, TopkIds::I32(ids), w, y)?;
        Ok(())
    }

    /// Second half of the dispatch: wait (on the stream) for the peers' slabs and run this
    /// rank's experts on them.
    pub fn dispatch_recv(&mut self) -> Result<(), EpError> {
        self.expect("dispatch_recv", Stage::Sent, "dispatch_send")?;
        self.stream.wait(&self.events.arrived)?;
        let peers = self.comm.ranks() - 1;
        if self.cfg.fp8_dispatch && peers > 0 {
            let (s, b) = (&self.stream, &self.bufs);
            let p = EpUnpackParams {
                recv: ptr(&b.recv, s),
                x_recv: ptr(&b.x_recv, s),
                rows: self.step.rows as i32,
                slots: self.slots[self.comm.rank()] as i32,
            };
            // SAFETY: recv holds `peers` slabs of the step's rows, x_recv as many act_t rows.
            let blocks = (self.step.rows * peers) as u32;
            unsafe { self.kernels.unpack.launch(s, (blocks, EP_ROW_THREADS, 0), false, p)? };
        }
        if !self.exchange_only {
            // One run per peer's slab (each self-contained: rows, ids, weights).
            for j in 1..self.comm.ranks() {
                match self.spec.act_dtype() {
                    ActDtype::Bf16 => self.run_received::<half::bf16>(j)?,
                    ActDtype::Fp16 => self.run_received::<half::f16>(j)?,
                }
            }
        }
        self.step.stage = Stage::Received;
        Ok(())
    }

    /// This rank's experts on the slab that came from rank - j.
    fn run_received<T: ActElem + 'static>(&self, j: usize) -> Result<(), EpError> {
        let (s, b, rb, wire) = (&self.stream, &self.bufs, self.row_bytes(), self.wire_bytes());
        let (rows, slots) = (self.step.rows, self.slots[self.comm.rank()]);
        let (h, n) = (self.spec.hidden() as usize, rows * slots);
        let slab = ptr(&b.recv, s) + ((j - 1) * slab_bytes(rows, slots, wire)) as u64;
        let ids = slab + (rows * wire) as u64;
        let weights = ids + meta_bytes(rows, slots) as u64;
        // fp8 dispatch: the rows moe_ep_unpack turned back into act_t.
        let x = if self.cfg.fp8_dispatch { ptr(&b.x_recv, s) + ((j - 1) * rows * rb) as u64 } else { slab };
        // SAFETY: the layer's own buffers, sized for (ranks - 1) slabs of the slab rows.
        let (x, ids, w, y) = unsafe {
            (
                DeviceTensor::<T>::from_raw(x, rows * h),
                DeviceTensor::<i32>::from_raw(ids, n),
                DeviceTensor::<f32>::from_raw(weights, n),
                DeviceTensorMut::<T>::from_raw(ptr(&b.y_recv, s) + ((j - 1) * rows * rb) as u64, rows * h),
            )
        };
        self.local.forward_on(s, x, TopkIds::I32(ids), w, y)?;
        Ok(())
    }

    /// First half of the combine: each slab's outputs back to the rank it came from (no host
    /// wait).
    pub fn combine_send(&mut self) -> Result<(), EpError> {
        self.expect("combine_send", Stage::Received, "dispatch_recv")?;
        let (rank, ranks, rows) = (self.comm.rank(), self.comm.ranks(), self.step.rows);
        let (s, b, rb) = (&self.stream, &self.bufs, self.row_bytes());
        self.events.computed.record(s)?;
        self.comm_stream.wait(&self.events.computed)?;
        let mut ops = Vec::with_capacity(2 * ranks);
        for j in 1..ranks {
            let (to, from) = ((rank + j) % ranks, (rank + ranks - j) % ranks);
            let off = ((j - 1) * rows * rb) as u64;
            ops.push(P2p::Send { ptr: ptr(&b.y_recv, s) + off, bytes: rows * rb, peer: from });
            ops.push(P2p::Recv { ptr: ptr(&b.y_back, s) + off, bytes: rows * rb, peer: to });
        }
        self.comm.group(&ops, &self.comm_stream)?;
        self.events.returned.record(&self.comm_stream)?;
        self.step.stage = Stage::Returning;
        Ok(())
    }

    /// Second half of the combine: wait (on the stream) for the outputs and sum each token's
    /// partials into `y [m, H]`, rank by rank. This rank's experts must have run on all its own
    /// tokens ([`EpLayer::run_local_experts`]).
    pub fn combine_recv<T: ActElem>(&mut self, y: DeviceTensorMut<'_, T>) -> Result<(), EpError> {
        self.expect("combine_recv", Stage::Returning, "combine_send")?;
        if self.step.local_next != self.step.m {
            return Err(EpError::OutOfOrder { call: "combine_recv", expected: "run_local_experts" });
        }
        let m = self.check_x::<T>("y", y.len())?;
        if m != self.step.m {
            return Err(shape("y", format!("the step's {} tokens", self.step.m), format!("{m} tokens")));
        }
        let (s, b) = (&self.stream, &self.bufs);
        s.wait(&self.events.returned)?;
        let p = EpCombineParams {
            y_self: ptr(&b.y_self, s),
            y_peers: ptr(&b.y_back, s),
            pos: ptr(&b.pos, s),
            y: y.ptr(),
            m: m as i32,
            rows: self.step.rows as i32,
            rank: self.comm.rank() as i32,
            ranks: self.comm.ranks() as i32,
        };
        // SAFETY: y holds m rows (checked); the rest are the layer's buffers.
        unsafe { self.kernels.combine.launch(s, (m as u32, EP_ROW_THREADS, 0), false, p)? };
        self.step.stage = Stage::Idle;
        Ok(())
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

/// Bytes of a peer slab, as `templates/ep.cu` lays it out: `rows` activation rows of
/// `row_bytes` (as they travel), their ids, their weights.
fn slab_bytes(rows: usize, slots: usize, row_bytes: usize) -> usize {
    rows * row_bytes + 2 * meta_bytes(rows, slots)
}

/// Blocks of the count and place kernels for `m` tokens.
fn token_blocks(m: usize) -> usize {
    m.div_ceil(EP_PLAN_THREADS as usize)
}

fn shape(what: &'static str, expected: String, got: String) -> EpError {
    EpError::Runtime(crate::error::RuntimeError::Shape { what, expected, got })
}
