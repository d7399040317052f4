//! A layer's step: `forward` and its variants, the step's scratch, and the launch of the family
//! that runs it (or of every family on the device's menu).

use super::{validate_ids, ActElem, MoeLayer};
use crate::error::{Result, RuntimeError};
use crate::families::{Part, ScratchSlot, StepAt, StepPtrs};
use crate::launch::ptr;
use crate::view::{DeviceTensor, DeviceTensorMut, TopkIds};
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use moe_codegen::KernelFamily;
use std::sync::{Arc, Mutex};

impl MoeLayer {
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
        self.forward_slices(None, x, topk_ids, topk_weights, y)
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
        self.forward_slices(Some(family), x, topk_ids, topk_weights, y)
    }

    /// A whole step on the layer's stream from its own slices, on `family` or as dispatched.
    fn forward_slices<T: ActElem>(
        &self,
        family: Option<KernelFamily>,
        x: &CudaSlice<T>,
        topk_ids: &CudaSlice<i32>,
        topk_weights: &CudaSlice<f32>,
        y: &mut CudaSlice<T>,
    ) -> Result<()> {
        let s = &self.stream;
        let (x, ids, w) = (DeviceTensor::new(x, s), DeviceTensor::new(topk_ids, s), DeviceTensor::new(topk_weights, s));
        self.step(s, family, x, ids.into(), w, DeviceTensorMut::new(y, s), true, StepAt::WHOLE)
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
    pub(super) fn reserve_grouped(&self, slot: ScratchSlot, max_tokens: usize) -> Result<()> {
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
    pub(super) fn ids_scratch(&self, stream: &CudaStream, n: usize) -> Result<u64> {
        self.grow(&self.ids32, stream, n)
    }

    /// The routing weights a decode-only layer routes from logits into: `n`, as `ids_scratch`.
    pub(super) fn weights_scratch(&self, stream: &CudaStream, n: usize) -> Result<u64> {
        self.grow(&self.weights32, stream, n)
    }

    pub(super) fn grow<E: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
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
