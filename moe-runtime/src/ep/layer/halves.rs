//! The step's halves on an expert-parallel layer: the dispatch (plan, pack, exchange, unpack),
//! the experts of this rank and of the rows received, and the combine back to each token's rank.

use super::{
    may_run_shared_apart, may_split, meta_bytes, shape, slab_stride, token_blocks, EpLayer, OwnPlan, Stage, Step, Xfer,
    COPY_ENGINE_MIN_BYTES,
};
use crate::ep::comm::P2p;
use crate::ep::EpError;
use crate::families::{Part, Partials, ScratchSlot, StepAt};
use crate::launch::ptr;
use crate::layer::ActElem;
use crate::view::{DeviceTensor, DeviceTensorMut, TopkIds};
use moe_codegen::ep::{EP_PLAN_THREADS, EP_ROW_THREADS};
use moe_codegen::params::{EpCombineParams, EpCountParams, EpPackParams, EpPlaceParams, EpUnpackParams};
use moe_codegen::{ActDtype, KernelFamily};

impl EpLayer {
    /// First half of the dispatch: plan the step, pack each token's row for the peers that own
    /// its experts and start the transfers (no host wait).
    pub fn dispatch_send<T: ActElem>(
        &mut self,
        x: DeviceTensor<'_, T>,
        topk_ids: DeviceTensor<'_, i32>,
        topk_weights: DeviceTensor<'_, f32>,
    ) -> Result<(), EpError> {
        let m = self.start_step::<T>("dispatch_send", x.len())?;
        let k = self.spec.top_k() as usize;
        for (what, got) in [("topk_ids", topk_ids.len()), ("topk_weights", topk_weights.len())] {
            if got != m * k {
                return Err(shape(what, format!("[{m}, {k}]"), format!("{got} elements")));
            }
        }
        let (rank, ranks) = (self.comm.rank(), self.comm.ranks());
        let rows = m.min(self.cfg.slab_rows());
        // Only where the combine's transfer takes no SM: NCCL's kernels would wait for the
        // back part's persistent GEMM (2 H100s, Qwen3-30B-A3B at 1024 tokens: 2% slower split).
        let split = may_split(&self.cfg, ranks)
            && m >= self.cfg.split_own_tokens.unwrap_or(usize::MAX)
            && self.copy_engines()
            && rows * self.row_bytes() >= COPY_ENGINE_MIN_BYTES
            && self.local.family_for(m) == Some(KernelFamily::GroupedGemm);
        let apart = may_run_shared_apart(&self.spec, &self.cfg, ranks)
            && m >= self.cfg.shared_apart_tokens.unwrap_or(usize::MAX);
        let plan = match (split, apart) {
            (true, _) => OwnPlan::Split,
            (false, true) => OwnPlan::SharedApart,
            (false, false) => OwnPlan::One,
        };
        let s = &self.stream;
        let b = &self.bufs;
        let blocks = token_blocks(m) as u32;
        let stride = slab_stride(rows, self.spec.top_k() as usize, self.wire_bytes());
        // Where the kernels write slab j: chunk (rank + j) % ranks of `send`; for an in-place
        // all-gather, the peer's slab in this rank's own chunk of `recv` (`send` then passed so
        // that its chunk `peer` is that chunk; nothing is written to any other).
        let send = if self.gathers(stride) {
            let peer = 1 - rank;
            b.recv.ptr(s) + (rank * stride) as u64 - (peer * stride) as u64
        } else {
            b.send.ptr(s)
        };
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
            send,
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
        // The pack on a stream of its own: the own tokens' front runs beside it. The NCCL stream
        // waits for it, and the received slabs for that.
        let ps = if ranks > 1 {
            self.events.planned.record(s)?;
            self.pack_stream.wait(&self.events.planned)?;
            &self.pack_stream
        } else {
            s
        };
        if ranks > 1 {
            let pack = EpPackParams {
                x: x.ptr(),
                pos: ptr(&b.pos, s),
                send,
                m: m as i32,
                rows: rows as i32,
                rank: rank as i32,
                ranks: ranks as i32,
            };
            // SAFETY: as above; `send` holds a chunk per rank of the slab rows.
            unsafe { self.kernels.pack.launch(ps, (m as u32, EP_ROW_THREADS, 0), false, pack)? };
        }
        self.events.packed.record(ps)?;
        self.comm_stream.wait(&self.events.packed)?;
        self.exchange(&self.bufs.send, &self.bufs.recv, stride)?;
        self.events.arrived.record(&self.comm_stream)?;
        self.step = Step { stage: Stage::Sent, m, rows, plan, own_done: 0, x_own: 0, recv_side: false };
        Ok(())
    }

    /// Whether a transfer of `bytes` per peer runs as an in-place all-gather of the receiving
    /// window: two ranks on the copy engines. Each rank's chunk for its peer then sits in its
    /// own chunk of that window. NCCL's all-to-all copies the own chunk locally first, on the
    /// same stream, as many bytes again: 16.8 MB took 103-105 us that way on 2 H100s, where
    /// one peer copy of them takes about 53 us.
    fn gathers(&self, bytes: usize) -> bool {
        self.comm.ranks() == 2 && matches!(self.bufs.recv, Xfer::Window(_)) && bytes >= COPY_ENGINE_MIN_BYTES
    }

    /// Chunk d of `send` (`bytes` long) to rank d, and rank d's for us into chunk d of `recv`,
    /// on the NCCL stream: one all-to-all (copy engines, [`EpConfig::copy_engines`]) or a send
    /// and a receive per peer (NCCL's kernels); with two ranks on the copy engines
    /// ([`EpLayer::gathers`]), this rank's chunk of `recv` to the peer's (`send` unread). Every
    /// rank takes the same path: `bytes` is the same on each.
    fn exchange(&self, send: &Xfer, recv: &Xfer, bytes: usize) -> Result<(), EpError> {
        if self.no_transfers {
            return Ok(());
        }
        if let (true, Xfer::Window(rw)) = (self.gathers(bytes), recv) {
            return self.comm.all_gather_in_place(rw, bytes, &self.comm_stream);
        }
        if let (Xfer::Window(sw), Xfer::Window(rw)) = (send, recv) {
            if bytes >= COPY_ENGINE_MIN_BYTES {
                return self.comm.all_to_all(sw, rw, bytes, &self.comm_stream);
            }
        }
        let (rank, ranks, s) = (self.comm.rank(), self.comm.ranks(), &self.stream);
        let (sp, rp) = (send.ptr(s), recv.ptr(s));
        let ops: Vec<P2p> = (0..ranks)
            .filter(|&d| d != rank)
            .flat_map(|d| {
                let off = (d * bytes) as u64;
                [P2p::Send { ptr: sp + off, bytes, peer: d }, P2p::Recv { ptr: rp + off, bytes, peer: d }]
            })
            .collect();
        self.comm.group(&ops, &self.comm_stream)
    }

    /// This rank's experts on its own tokens, reading `x` (the step's, again) in place: nothing
    /// travels for them, so this may run while the transfers are in flight, anywhere between
    /// `dispatch_send` and `combine_recv`. Where the shared experts run apart
    /// ([`EpConfig::shared_apart_tokens`](super::EpConfig::shared_apart_tokens)), both launches back to back (`forward` puts the second
    /// under the combine's transfer).
    pub fn run_local_experts<T: ActElem>(&mut self, x: DeviceTensor<'_, T>) -> Result<(), EpError> {
        if !matches!(self.step.stage, Stage::Sent | Stage::Received | Stage::Returning) {
            return Err(EpError::OutOfOrder { call: "run_local_experts", expected: "dispatch_send" });
        }
        let m = self.check_x::<T>("x", x.len())?;
        if m != self.step.m {
            return Err(shape("x", format!("the step's {} tokens", self.step.m), format!("{m} tokens")));
        }
        while self.step.own_done < self.step.plan.parts() {
            self.run_own_part(x.ptr())?;
        }
        Ok(())
    }

    /// The next launch of this rank's experts on its own tokens (x checked by the caller): the
    /// routed and shared experts together, or the routed ones, then the shared ones, or the
    /// front, then the back of the one launch.
    pub(super) fn run_own_part(&mut self, x: u64) -> Result<(), EpError> {
        if self.step.own_done >= self.step.plan.parts() {
            return Ok(());
        }
        if !self.skip_own {
            match self.spec.act_dtype() {
                ActDtype::Bf16 => self.run_own_rows::<half::bf16>(x)?,
                ActDtype::Fp16 => self.run_own_rows::<half::f16>(x)?,
            }
        }
        self.step.own_done += 1;
        self.step.x_own = x;
        Ok(())
    }

    fn run_own_rows<T: ActElem + 'static>(&self, x: u64) -> Result<(), EpError> {
        let (s, b) = (&self.stream, &self.bufs);
        let (h, slots, m) = (self.spec.hidden() as usize, self.slots[self.comm.rank()], self.step.m);
        let (plan, second) = (self.step.plan, self.step.own_done == 1);
        let shared_part = plan == OwnPlan::SharedApart && second;
        // The shared experts' own launch: routing rows naming no routed expert.
        let (ids, w, y) = if shared_part {
            (ptr(&b.no_ids, s), ptr(&b.no_weights, s), ptr(&b.y_shared, s))
        } else {
            (ptr(&b.self_ids, s), ptr(&b.self_weights, s), ptr(&b.y_self, s))
        };
        // SAFETY: x holds the step's m tokens (checked); the rest are the layer's buffers, sized
        // for max_tokens >= m (the shared experts' own launch's where a step may take it).
        let (x, ids, w, y) = unsafe {
            (
                DeviceTensor::<T>::from_raw(x, m * h),
                DeviceTensor::<i32>::from_raw(ids, m * slots),
                DeviceTensor::<f32>::from_raw(w, m * slots),
                DeviceTensorMut::<T>::from_raw(y, m * h),
            )
        };
        // The routed experts' launch leaves the shared experts out where they run apart.
        let shared = plan != OwnPlan::SharedApart || shared_part;
        let part = match (plan, second) {
            (OwnPlan::Split, false) => Part::Front,
            (OwnPlan::Split, true) => Part::Gemm2,
            _ => Part::Whole,
        };
        self.local.step(s, None, x, TopkIds::I32(ids), w, y, shared, StepAt { slot: ScratchSlot::First, part })?;
        Ok(())
    }

    /// Second half of the dispatch: wait (on the stream) for the peers' slabs and run this
    /// rank's experts on them.
    pub fn dispatch_recv(&mut self) -> Result<(), EpError> {
        self.expect("dispatch_recv", Stage::Sent, "dispatch_send")?;
        self.received_stream().wait(&self.events.arrived)?;
        let peers = self.comm.ranks() - 1;
        if self.cfg.fp8_dispatch && peers > 0 {
            let (s, b) = (self.received_stream(), &self.bufs);
            let p = EpUnpackParams {
                recv: b.recv.ptr(s),
                x_recv: ptr(&b.x_recv, s),
                rows: self.step.rows as i32,
                rank: self.comm.rank() as i32,
                ranks: self.comm.ranks() as i32,
            };
            // SAFETY: recv holds a chunk per rank of the step's rows, x_recv `peers` slabs of
            // act_t rows.
            let blocks = (self.step.rows * peers) as u32;
            unsafe { self.kernels.unpack.launch(s, (blocks, EP_ROW_THREADS, 0), false, p)? };
        }
        if !self.skip_received {
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
        let (s, b, rb, wire) = (self.received_stream(), &self.bufs, self.row_bytes(), self.wire_bytes());
        let (rows, slots) = (self.step.rows, self.slots[self.comm.rank()]);
        let (h, n) = (self.spec.hidden() as usize, rows * slots);
        // From rank `from`: chunk `from` of recv; its outputs go back from chunk `from` of y_recv
        // (with an in-place all-gather, from this rank's own chunk of y_back).
        let from = (self.comm.rank() + self.comm.ranks() - j) % self.comm.ranks();
        let y_out = if self.gathers(rows * rb) {
            b.y_back.ptr(s) + (self.comm.rank() * rows * rb) as u64
        } else {
            b.y_recv.ptr(s) + (from * rows * rb) as u64
        };
        let slab = b.recv.ptr(s) + (from * slab_stride(rows, self.spec.top_k() as usize, wire)) as u64;
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
                DeviceTensorMut::<T>::from_raw(y_out, rows * h),
            )
        };
        // A peer's tokens: their shared experts run on their own rank. Between a split own
        // launch's parts, on the other scratch.
        let slot = if self.step.plan == OwnPlan::Split { ScratchSlot::Second } else { ScratchSlot::First };
        self.local.step(s, None, x, TopkIds::I32(ids), w, y, false, StepAt { slot, part: Part::Whole })?;
        Ok(())
    }

    /// First half of the combine: each slab's outputs back to the rank it came from (no host
    /// wait).
    pub fn combine_send(&mut self) -> Result<(), EpError> {
        self.expect("combine_send", Stage::Received, "dispatch_recv")?;
        self.events.computed.record(self.received_stream())?;
        self.comm_stream.wait(&self.events.computed)?;
        self.exchange(&self.bufs.y_recv, &self.bufs.y_back, self.step.rows * self.row_bytes())?;
        self.events.returned.record(&self.comm_stream)?;
        self.step.stage = Stage::Returning;
        Ok(())
    }

    /// Second half of the combine: wait (on the stream) for the outputs and sum each token's
    /// partials into `y [m, H]`, rank by rank. This rank's experts must have run on all its own
    /// tokens ([`EpLayer::run_local_experts`]).
    pub fn combine_recv<T: ActElem + 'static>(&mut self, y: DeviceTensorMut<'_, T>) -> Result<(), EpError> {
        self.expect("combine_recv", Stage::Returning, "combine_send")?;
        if self.step.own_done != self.step.plan.parts() {
            return Err(EpError::OutOfOrder { call: "combine_recv", expected: "run_local_experts" });
        }
        let m = self.check_x::<T>("y", y.len())?;
        if m != self.step.m {
            return Err(shape("y", format!("the step's {} tokens", self.step.m), format!("{m} tokens")));
        }
        let (s, b) = (&self.stream, &self.bufs);
        s.wait(&self.events.returned)?;
        if self.step.plan == OwnPlan::Split && !self.skip_own {
            // The own tokens' combine adds the peers' partials itself.
            self.run_own_combine(y)?;
            self.step.stage = Stage::Idle;
            return Ok(());
        }
        let p = EpCombineParams {
            y_self: ptr(&b.y_self, s),
            y_self_b: ptr(&b.y_shared, s),
            y_peers: b.y_back.ptr(s),
            pos: ptr(&b.pos, s),
            y: y.ptr(),
            m: m as i32,
            rows: self.step.rows as i32,
            rank: self.comm.rank() as i32,
            ranks: self.comm.ranks() as i32,
            split: (self.step.plan == OwnPlan::SharedApart) as i32,
        };
        // SAFETY: y holds m rows (checked); the rest are the layer's buffers.
        unsafe { self.kernels.combine.launch(s, (m as u32, EP_ROW_THREADS, 0), false, p)? };
        self.step.stage = Stage::Idle;
        Ok(())
    }

    /// A split own launch's last part: its combine, the peers' partials (in `y_back`) added in
    /// rank order, into `y` (m rows, checked by the caller).
    fn run_own_combine<T: ActElem + 'static>(&self, y: DeviceTensorMut<'_, T>) -> Result<(), EpError> {
        let (s, b) = (&self.stream, &self.bufs);
        let (h, slots, m) = (self.spec.hidden() as usize, self.slots[self.comm.rank()], self.step.m);
        let partials = Partials {
            y: b.y_back.ptr(s),
            pos: ptr(&b.pos, s),
            rows: self.step.rows as i32,
            rank: self.comm.rank() as i32,
            ranks: self.comm.ranks() as i32,
        };
        // SAFETY: x_own is the step's x (checked when its front ran), m rows; the routing is the
        // layer's, sized for max_tokens >= m.
        let (x, ids, w) = unsafe {
            (
                DeviceTensor::<T>::from_raw(self.step.x_own, m * h),
                DeviceTensor::<i32>::from_raw(ptr(&b.self_ids, s), m * slots),
                DeviceTensor::<f32>::from_raw(ptr(&b.self_weights, s), m * slots),
            )
        };
        let at = StepAt { slot: ScratchSlot::First, part: Part::Combine(partials) };
        self.local.step(s, None, x, TopkIds::I32(ids), w, y, true, at)?;
        Ok(())
    }
}
