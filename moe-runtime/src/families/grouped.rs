//! The grouped-GEMM (prefill) path of a layer: its kernels, its scratch and its launches.
//!
//! prepare (route if given logits, align, [quantize x]; one cooperative launch) -> GEMM1 + SwiGLU
//! -> [quantize mid] -> GEMM2 + routing weight -> combine, each kernel after prepare a programmatic
//! dependent of the one before (it launches while that one drains and waits in griddepcontrol.wait).
//! Every buffer is sized on the host from upper bounds known before launch
//! (`GemmTiles::max_tiles`), so the step needs no host synchronisation and can be captured.

use crate::device::Device;
use crate::dispatch::DeviceMenu;
use crate::error::{Result, RuntimeError};
use crate::families::{Part, ScratchSlot, StepPtrs};
use crate::launch::{cooperative_attrs, launch_attrs, max_active_clusters, ptr, Kernel};
use crate::tma::TensorMap;
use cudarc::driver::{sys, CudaFunction, CudaSlice, CudaStream};
use moe_codegen::grouped::{
    prepare_smem_bytes, x_per_token, ALIGN_THREADS, CHOOSE_THREADS, ELEMWISE_THREADS, ROUTE_THREADS,
};
use moe_codegen::params::{
    ChooseParams, CombineRowsParams, ConvertParams, DispatchPlanes, Gemm1Params, Gemm2Params, KernelParams,
    PrepareParams, QuantMidParams, RouteParams, TmaDesc,
};
use moe_codegen::{GemmTiles, KernelSource, MoeSpec};
use std::sync::{Arc, Mutex};

/// A step's alignment as the device left it (buffers at their reserved sizes).
#[derive(Debug, Clone)]
pub struct Alignment {
    /// Pair in each row of each tile, -1 for padding.
    pub sorted_rows: Vec<i32>,
    /// Row of each pair (the combine's inverse map).
    pub pair_pos: Vec<i32>,
    /// Expert of each tile.
    pub tile_expert: Vec<i32>,
    /// (first tile, tiles, expert, pairs) of each tile's expert, flattened.
    pub tile_span: Vec<i32>,
    /// Tiles in use.
    pub num_tiles: i32,
    /// The hot experts' tiles, which lead the layout (`moe_codegen::grouped::HOT_TILES`).
    pub hot_tiles: i32,
    /// With extended items (`GemmTiles::extended_rows`), GEMM1's own tiles (an expert's short
    /// last tile joins the ones before it): (first, tiles, expert + (layout tile - GEMM1 tile) *
    /// 65536, pairs) of each, flattened; empty without them.
    pub tile_span1: Vec<i32>,
    /// GEMM1's tiles (equal to `num_tiles` without extended items).
    pub num_tiles1: i32,
    /// The hot experts' tiles among GEMM1's (equal to `hot_tiles` without extended items).
    pub hot_tiles1: i32,
}

struct Fns {
    route: Kernel<RouteParams>,
    prepare: Kernel<PrepareParams>,
    /// `moe_prepare` without the router and the multi-block path: a one-block step whose ids are
    /// given. The code a step launches costs its GEMMs time (docs/dispatch.md).
    prepare_solo: Kernel<PrepareParams>,
    quant_mid: Kernel<QuantMidParams>,
    gemm1: Kernel<Gemm1Params>,
    gemm2_atomic: Kernel<Gemm2Params>,
    gemm2_rows: Kernel<Gemm2Params>,
    combine_rows: Kernel<CombineRowsParams>,
    convert: Kernel<ConvertParams>,
    choose: Kernel<ChooseParams>,
}

/// Scratch for steps of up to `tokens` tokens, grown (outside graph capture) on demand.
struct Scratch {
    tokens: usize,
    deterministic: bool,
    sorted_rows: CudaSlice<i32>,
    pair_pos: CudaSlice<i32>,
    tile_expert: CudaSlice<i32>,
    /// int4 per tile: (first tile, tiles, expert, pairs) of its expert.
    tile_span: CudaSlice<i32>,
    /// The same over GEMM1's tiles with extended items (one int4 without).
    tile_span1: CudaSlice<i32>,
    /// Tiles in use and the hot experts' tiles among them (which come first), then the same
    /// counts of GEMM1's tiles.
    num_tiles: CudaSlice<i32>,
    /// Zeroed before each step by one memset: the warp-specialised GEMMs' work counters (GEMM1,
    /// GEMM2), moe_prepare's barrier counter, one unused, then moe_prepare's per-expert pair
    /// counts (`COUNTS_AT`).
    work_counters: CudaSlice<i32>,
    /// GEMM1 output `[max_rows, I]` in the activation dtype.
    mid: CudaSlice<u8>,
    /// FP8 operands: x and mid in e4m3 with one f32 per 128 along K; x: or one per token, copied
    /// to each sorted row (`xs_row`), see `x_per_token`.
    xq: CudaSlice<u8>,
    xs_token: CudaSlice<f32>,
    xs_row: CudaSlice<f32>,
    midq: CudaSlice<u8>,
    mids: CudaSlice<f32>,
    /// The atomic combine's f32 token rows `[M, H]`, or the gather-reduce combine's pair rows
    /// `[max_rows, H]` in the activation dtype (bytes).
    out32: CudaSlice<u8>,
    /// Routing produced on the device from logits.
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
}

pub(crate) struct GroupedPath {
    pub tiles: GemmTiles,
    fns: Fns,
    fp8: bool,
    /// x takes one scale per token, stored per sorted row (`moe_codegen::grouped::x_per_token`).
    x_per_token: bool,
    /// Weights decoded in registers: GEMM1 reads x as moe_prepare copies it into `xq`, paired
    /// (the template's `x_pair_col`).
    x_paired: bool,
    /// GEMM1 writes the intermediate in e4m3 itself (`GemmTiles::quantizes_mid`).
    mid_in_gemm1: bool,
    /// GEMM1's extended rows (`GemmTiles::extended_rows`) and its dynamic shared memory.
    ext_rows: u32,
    /// GEMM2's (`GemmTiles::gemm2_extended_rows`: its deterministic kernel takes GEMM1's tiles).
    ext_rows2: u32,
    gemm1_smem: u32,
    /// moe_prepare's resident blocks on the device, and its dynamic shared memory.
    prepare_blocks: u32,
    prepare_smem: u32,
    gemm1_blocks: u32,
    gemm2_blocks: u32,
    sms: u32,
    /// One per [`ScratchSlot`]; the second is reserved only where a caller splits steps.
    scratch: [Mutex<Option<Scratch>>; 2],
}

impl GroupedPath {
    pub fn with_source(device: &Device, spec: &MoeSpec, tiles: GemmTiles, src: &KernelSource) -> Result<GroupedPath> {
        // Every kernel its own module, compiled in parallel; in the order ENTRY_POINTS lists them.
        let [route, prepare, prepare_solo, quant_mid, gemm1, gemm2_atomic, gemm2_rows, combine_rows, convert, choose]: [CudaFunction;
            10] = device.functions(src, &moe_codegen::grouped::ENTRY_POINTS)?.try_into().expect("one function per name");
        let fns = Fns {
            route: Kernel::new(route),
            prepare: Kernel::new(prepare),
            prepare_solo: Kernel::new(prepare_solo),
            quant_mid: Kernel::new(quant_mid),
            gemm1: Kernel::new(gemm1),
            gemm2_atomic: Kernel::new(gemm2_atomic),
            gemm2_rows: Kernel::new(gemm2_rows),
            combine_rows: Kernel::new(combine_rows),
            convert: Kernel::new(convert),
            choose: Kernel::new(choose),
        };
        let blocks = |g: &CudaFunction, smem: u32| -> Result<u32> {
            if smem > device.max_smem_optin() {
                return Err(RuntimeError::FamilyUnavailable {
                    family: moe_codegen::KernelFamily::GroupedGemm,
                    why: format!(
                        "tiles {tiles:?} need {smem} B of shared memory; the device allows {}",
                        device.max_smem_optin()
                    ),
                });
            }
            g.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)?;
            if tiles.cluster > 1 {
                // Clusters must fit within a GPC, which may leave an SM idle.
                let n = max_active_clusters(g, device.stream(), tiles.gemm_threads(), smem, tiles.cluster)?;
                if n == 0 {
                    return Err(RuntimeError::FamilyUnavailable {
                        family: moe_codegen::KernelFamily::GroupedGemm,
                        why: format!("no cluster of {} blocks with tiles {tiles:?} fits the device", tiles.cluster),
                    });
                }
                return Ok(n * tiles.cluster);
            }
            let per_sm = g.occupancy_max_active_blocks_per_multiprocessor(tiles.gemm_threads(), smem as usize, None)?;
            Ok(per_sm.max(1) * device.sm_count())
        };
        // moe_prepare's grid: as many blocks as can be resident at once (its grid barriers).
        let prepare_smem = prepare_smem_bytes(spec);
        fns.prepare.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            prepare_smem as i32,
        )?;
        let prepare_blocks =
            fns.prepare.occupancy_max_active_blocks_per_multiprocessor(ALIGN_THREADS, prepare_smem as usize, None)?
                * device.sm_count();
        if prepare_blocks == 0 {
            return Err(RuntimeError::FamilyUnavailable {
                family: moe_codegen::KernelFamily::GroupedGemm,
                why: format!("moe_prepare with {prepare_smem} B of shared memory fits no SM"),
            });
        }
        let gemm1_smem = tiles.gemm1_smem_bytes(spec);
        let gemm1_blocks = blocks(&fns.gemm1, gemm1_smem)?;
        let gemm2_blocks = blocks(&fns.gemm2_atomic, tiles.gemm2_smem_bytes(spec))?;
        blocks(&fns.gemm2_rows, tiles.gemm2_smem_bytes(spec))?;
        let fp8 = moe_codegen::grouped::quantizes_activations(spec);
        tracing::info!(module = %src.name, ?tiles, gemm1_blocks, gemm2_blocks, "grouped path loaded");
        Ok(GroupedPath {
            tiles,
            fns,
            fp8,
            x_per_token: x_per_token(spec),
            x_paired: moe_codegen::grouped::decodes_weights(spec),
            mid_in_gemm1: tiles.quantizes_mid(spec),
            ext_rows: tiles.extended_rows(spec),
            ext_rows2: tiles.gemm2_extended_rows(spec),
            gemm1_smem,
            prepare_blocks,
            prepare_smem,
            gemm1_blocks,
            gemm2_blocks,
            sms: device.sm_count(),
            scratch: [Mutex::new(None), Mutex::new(None)],
        })
    }

    /// Size the scratch for steps of up to `tokens` tokens in the given combine mode.
    pub fn reserve(&self, stream: &Arc<CudaStream>, spec: &MoeSpec, tokens: usize, deterministic: bool) -> Result<()> {
        self.reserve_in(ScratchSlot::First, stream, spec, tokens, deterministic)
    }

    /// [`GroupedPath::reserve`] for one scratch slot.
    pub fn reserve_in(
        &self,
        slot: ScratchSlot,
        stream: &Arc<CudaStream>,
        spec: &MoeSpec,
        tokens: usize,
        deterministic: bool,
    ) -> Result<()> {
        let mut s = self.scratch[slot as usize].lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = s.as_ref() {
            if s.tokens >= tokens && (s.deterministic || !deterministic) {
                return Ok(());
            }
        }
        let capturing = stream.capture_status()? != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        if capturing {
            return Err(RuntimeError::NotReserved { m: tokens });
        }
        stream.synchronize()?;
        *s = None; // free before allocating the larger set
        let (h, i, k) = (spec.hidden() as usize, spec.intermediate() as usize, spec.top_k() as usize);
        let pairs = tokens * k;
        let max_tiles = self.tiles.max_tiles(pairs, spec.experts());
        let rows = max_tiles * self.tiles.bm as usize;
        let q = |n: usize| if self.fp8 { n } else { 1 };
        *s = Some(Scratch {
            tokens,
            deterministic,
            sorted_rows: stream.alloc_zeros(rows)?,
            pair_pos: stream.alloc_zeros(pairs)?,
            tile_expert: stream.alloc_zeros(max_tiles)?,
            tile_span: stream.alloc_zeros(4 * max_tiles)?,
            tile_span1: stream.alloc_zeros(if self.ext_rows > 0 { 4 * max_tiles } else { 4 })?,
            num_tiles: stream.alloc_zeros(4)?,
            work_counters: stream.alloc_zeros(COUNTS_AT + spec.experts() as usize)?,
            mid: stream.alloc_zeros(if self.mid_in_gemm1 { 1 } else { rows * i * 2 })?,
            // e4m3 x, or (weights decoded in registers) x paired for GEMM1, two bytes a value.
            xq: stream.alloc_zeros(if self.x_paired { tokens * h * 2 } else { q(tokens * h) })?,
            xs_token: stream.alloc_zeros(q(if self.x_per_token { tokens } else { tokens * h / 128 }))?,
            xs_row: stream.alloc_zeros(if self.x_per_token { rows } else { 1 })?,
            midq: stream.alloc_zeros(q(rows * i))?,
            mids: stream.alloc_zeros(q(rows * i / 128))?,
            // Either combine may run on scratch reserved for the gather-reduce one.
            out32: stream.alloc_zeros(if deterministic {
                (rows * h * 2).max(tokens * h * 4)
            } else {
                tokens * h * 4
            })?,
            ids: stream.alloc_zeros(pairs)?,
            weights: stream.alloc_zeros(pairs)?,
        });
        Ok(())
    }

    /// The scratch's routing buffers `(ids, weights)`, where a step from logits routes.
    pub fn routing_ptrs(&self, stream: &Arc<CudaStream>, m: usize) -> Result<(u64, u64)> {
        let s = self.scratch[0].lock().unwrap_or_else(|p| p.into_inner());
        let s = s.as_ref().ok_or(RuntimeError::NotReserved { m })?;
        Ok((ptr(&s.ids, stream), ptr(&s.weights, stream)))
    }

    /// Route `logits [m, E]` (f32) on the device into the scratch's ids / weights and return
    /// their pointers (steps of another family; the grouped one routes in moe_prepare).
    pub fn route(&self, stream: &Arc<CudaStream>, m: usize, logits: u64, bias: u64) -> Result<(u64, u64)> {
        let (ids, w) = self.routing_ptrs(stream, m)?;
        let grid = m.div_ceil((ROUTE_THREADS / 32) as usize) as u32;
        let p = RouteParams { logits, bias, m: m as i32, topk_ids: ids, topk_weights: w };
        unsafe { self.fns.route.launch(stream, (grid, ROUTE_THREADS, 0), false, p)? };
        Ok((ids, w))
    }

    /// A step the device dispatches: the family is chosen from `model` on the device, written to
    /// `p.choice` (8 i32: `moe_choose`'s layout), and this family's kernels follow it (the other
    /// candidates' kernels, launched after these by the caller, read it too). Where the step's
    /// front is one `moe_prepare` block, that block chooses (one launch fewer); otherwise
    /// `moe_choose` runs first.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_dispatched(
        &self,
        stream: &Arc<CudaStream>,
        spec: &MoeSpec,
        m: usize,
        p: &StepPtrs,
        menu: &DeviceMenu,
        deterministic: bool,
        slot: ScratchSlot,
    ) -> Result<()> {
        let planes = menu.planes();
        if self.solo(m) && p.logits == 0 {
            return self.forward_part(stream, spec, m, p, deterministic, slot, Part::Whole, Some(planes));
        }
        let c = ChooseParams { topk_ids: p.ids, m: m as i32, planes, out: p.choice };
        // SAFETY: `ids` holds the step's m * k routing ids (checked by the layer), `choice` 8 i32.
        unsafe { self.fns.choose.launch(stream, (1, CHOOSE_THREADS, 0), true, c)? };
        self.forward_part(stream, spec, m, p, deterministic, slot, Part::Whole, None)
    }

    /// The blocks `moe_prepare` runs for a step of `m` tokens: at most those that fit at once, no
    /// more than the tokens' warps need.
    fn prepare_grid(&self, m: usize) -> u32 {
        let need = m.div_ceil((ALIGN_THREADS / 32) as usize);
        need.clamp(1, self.prepare_blocks as usize) as u32
    }

    /// Whether a step of `m` tokens takes `moe_prepare`'s one-block form: a token a warp.
    fn solo(&self, m: usize) -> bool {
        m <= (ALIGN_THREADS / 32) as usize && self.prepare_grid(m) == 1
    }

    /// One step, `y[m, H] = MoE(x)` for the routing at `p.ids` / `p.weights`, or one part of it,
    /// on one scratch slot. A step's parts follow each other in order on the same slot with the
    /// same `m` and pointers, and nothing on that slot between them.
    ///
    /// With `choose` (a step of one `moe_prepare` block that the device dispatches), that block
    /// makes the dispatcher's choice into `p.choice` from these planes and the step follows it.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_part(
        &self,
        stream: &Arc<CudaStream>,
        spec: &MoeSpec,
        m: usize,
        p: &StepPtrs,
        deterministic: bool,
        slot: ScratchSlot,
        part: Part,
        choose: Option<DispatchPlanes>,
    ) -> Result<()> {
        let mut guard = self.scratch[slot as usize].lock().unwrap_or_else(|p| p.into_inner());
        let s = guard.as_mut().ok_or(RuntimeError::NotReserved { m })?;
        let (h, k) = (spec.hidden() as usize, spec.top_k() as usize);
        let pairs = m * k;
        let max_tiles = self.tiles.max_tiles(pairs, spec.experts());
        let m32 = m as i32;
        let (sorted, pos, tile_e, span, span1, ntiles) = (
            ptr(&s.sorted_rows, stream),
            ptr(&s.pair_pos, stream),
            ptr(&s.tile_expert, stream),
            ptr(&s.tile_span, stream),
            ptr(&s.tile_span1, stream),
            ptr(&s.num_tiles, stream),
        );
        // Routing (from logits), alignment and x's e4m3 copy in one cooperative launch.
        let prepare_grid = self.prepare_grid(m);
        // A step one block's warps cover (a token each): moe_prepare zeroes the GEMMs' work
        // counters itself and needs no other (no memset node ahead of it).
        let solo = self.solo(m);
        debug_assert!(choose.is_none() || (solo && p.logits == 0 && part.runs_front()));
        let (front, gemm2, combine) = (part.runs_front(), part.runs_gemm2(), part.runs_combine());
        let partials = match part {
            Part::Combine(partials) => Some(partials),
            _ => None,
        };
        if partials.is_some() && !deterministic {
            return Err(RuntimeError::FamilyUnavailable {
                family: moe_codegen::KernelFamily::GroupedGemm,
                why: "other ranks' partials are added by the deterministic combine".into(),
            });
        }
        if front && !solo {
            stream.memset_zeros(&mut s.work_counters)?;
        }
        if front && !deterministic {
            let mut y32_view = s.out32.slice_mut(0..m * h * 4);
            stream.memset_zeros(&mut y32_view)?;
        }
        let counters = ptr(&s.work_counters, stream);
        let (xq, xs_token, xs_row) = (ptr(&s.xq, stream), ptr(&s.xs_token, stream), ptr(&s.xs_row, stream));
        let prepare = PrepareParams {
            logits: p.logits,
            bias: p.bias,
            m: m32,
            topk_ids: p.ids,
            topk_weights: p.weights,
            x: p.x,
            xq,
            xs_token,
            xs_row,
            counts: counters + 4 * COUNTS_AT as u64,
            errors: p.errors,
            sync: counters + 8,
            sorted_rows: sorted,
            pair_pos: pos,
            tile_expert: tile_e,
            tile_span: span,
            tile_span1: span1,
            num_tiles: ntiles,
            // The choice to follow, unless this launch makes it.
            choice: if choose.is_some() { 0 } else { p.choice },
            gemm_counters: if solo { counters } else { 0 },
            planes: choose.unwrap_or_default(),
            choose_into: if choose.is_some() { p.choice } else { 0 },
        };
        // SAFETY (every launch below): the step's pointers were checked against the spec by the
        // layer; the scratch is reserved for this step (its tile bounds, `max_tiles`).
        if front && solo && p.logits == 0 {
            // One block, no router: no dynamic shared memory (it holds the router's scores).
            unsafe { self.fns.prepare_solo.launch_with(stream, (1, ALIGN_THREADS, 0), cooperative_attrs(), prepare)? };
        } else if front {
            let dims = (prepare_grid, ALIGN_THREADS, self.prepare_smem);
            unsafe { self.fns.prepare.launch_with(stream, dims, cooperative_attrs(), prepare)? };
        }
        let elementwise = |n: usize| (n.div_ceil(ELEMWISE_THREADS as usize) as u32).clamp(1, self.sms * 16);
        // GEMM1's A operand: x itself, its paired copy (weights decoded in registers), or its e4m3
        // copy with its scales (by sorted row with per-token scales).
        let (a1, a1s) = match (self.fp8, self.x_per_token) {
            (false, _) if self.x_paired => (xq, 0u64),
            (false, _) => (p.x, 0u64),
            (true, false) => (xq, xs_token),
            (true, true) => (xq, xs_row),
        };
        // GEMM1's output: mid in the activation dtype, or already in e4m3 with its scales.
        let (mid, mid_scales) =
            if self.mid_in_gemm1 { (ptr(&s.midq, stream), ptr(&s.mids, stream)) } else { (ptr(&s.mid, stream), 0u64) };
        let nt1 = (spec.intermediate() / (self.tiles.bn1 / 2)) as usize;
        let nt2 = self.tiles.gemm2_col_blocks(spec.hidden()) as usize;
        // Persistent grids: no more clusters than items (cluster tiles x column blocks).
        let cl = self.tiles.cluster as usize;
        let grid = |nt: usize, most: u32| ((max_tiles.div_ceil(cl) * nt).min(most as usize / cl).max(1) * cl) as u32;
        let (grid1, grid2) = (grid(nt1, self.gemm1_blocks), grid(nt2, self.gemm2_blocks));
        // The weights' tensor maps (warp-specialised kernels): w13 in boxes of BN1 / 2 rows (gate,
        // then up), w2 in boxes of BN2 rows.
        let packed_bits = moe_codegen::grouped::decodes_weights(spec).then(|| spec.weight_format().elem_bits());
        let (w13_map, w2_map) = if let (true, Some(bits)) = (self.tiles.warp_specialized, packed_bits) {
            // Packed rows, a k-tile (64 codes) per box, decoded by the producer.
            let (e, hs, is, b) = (spec.experts() as u64, spec.hidden() as u64, spec.intermediate() as u64, bits as u64);
            (
                TensorMap::packed(p.w13, e * 2 * is, hs * b / 8, 8 * bits, self.tiles.bn1 / 2)?,
                TensorMap::packed(p.w2, e * hs, is * b / 8, 8 * bits, self.tiles.bn2)?,
            )
        } else if self.tiles.warp_specialized {
            let (e, hs, is) = (spec.experts() as u64, spec.hidden() as u64, spec.intermediate() as u64);
            let eb = if self.fp8 { 1 } else { 2 };
            (
                TensorMap::k_major(p.w13, e * 2 * is, hs * eb, eb, self.tiles.bn1 / 2)?,
                TensorMap::k_major(p.w2, e * hs, is * eb, eb, self.tiles.bn2 / self.tiles.cluster)?,
            )
        } else {
            (TmaDesc::UNUSED, TmaDesc::UNUSED)
        };
        let gemm1 = Gemm1Params {
            a: a1,
            a_scales: a1s,
            sorted_rows: sorted,
            tile_expert: tile_e,
            // GEMM1 takes its own tiles' spans with extended items.
            tile_span: if self.ext_rows > 0 { span1 } else { span },
            num_tiles: ntiles,
            w13: p.w13,
            w13_scales: p.w13_scales,
            w13_bias: p.w13_bias,
            mid,
            mid_scales,
            work_counter: counters,
            b_map: w13_map,
        };
        if front {
            unsafe { self.launch_gemm(&self.fns.gemm1, stream, grid1, self.gemm1_smem, gemm1)? };
        }
        let (mut a2, mut a2s) = (mid, mid_scales);
        if self.fp8 && !self.mid_in_gemm1 {
            let (q, qs) = (ptr(&s.midq, stream), ptr(&s.mids, stream));
            (a2, a2s) = (q, qs);
            let rows = max_tiles * self.tiles.bm as usize;
            let quant = QuantMidParams { mid, num_tiles: ntiles, sorted_rows: sorted, q, s: qs };
            // Half a warp per 128-element block.
            let grid = elementwise(rows * spec.intermediate() as usize / 128 * 16);
            if front {
                unsafe { self.fns.quant_mid.launch(stream, (grid, ELEMWISE_THREADS, 0), true, quant)? };
            }
        }
        if !gemm2 && !combine {
            return Ok(());
        }
        let out32 = ptr(&s.out32, stream);
        let gemm2_params = Gemm2Params {
            a: a2,
            a_scales: a2s,
            sorted_rows: sorted,
            tile_expert: tile_e,
            // The deterministic GEMM2 takes GEMM1's tiles where it extends them too.
            tile_span: if self.ext_rows2 > 0 && deterministic { span1 } else { span },
            num_tiles: ntiles,
            w2: p.w2,
            w2_scales: p.w2_scales,
            topk_weights: p.weights,
            out: out32,
            work_counter: counters + 4,
            b_map: w2_map,
            a_map: if let (true, Some(_)) = (self.tiles.warp_specialized, packed_bits) {
                // The intermediate in the activation dtype, its rows in tile order.
                let rows = (max_tiles * self.tiles.bm as usize) as u64;
                TensorMap::k_major(a2, rows, spec.intermediate() as u64 * 2, 2, self.tiles.bm)?
            } else {
                TmaDesc::UNUSED
            },
        };
        if gemm2 {
            let f = if deterministic { &self.fns.gemm2_rows } else { &self.fns.gemm2_atomic };
            unsafe { self.launch_gemm(f, stream, grid2, self.tiles.gemm2_smem_bytes(spec), gemm2_params)? };
        }
        if !combine {
            return Ok(());
        }
        // A combine launched alone follows whatever its caller enqueued after GEMM2 (an event
        // wait): no programmatic dependency.
        let pdl = gemm2;
        unsafe {
            if deterministic {
                let combine = CombineRowsParams {
                    rows: out32,
                    pair_pos: pos,
                    topk_ids: p.ids,
                    topk_weights: p.weights,
                    w2_bias: p.w2_bias,
                    m: m32,
                    y: p.y,
                    choice: p.choice,
                    peers: partials.map_or(0, |q| q.y),
                    peer_pos: partials.map_or(0, |q| q.pos),
                    peer_rows: partials.map_or(0, |q| q.rows),
                    rank: partials.map_or(0, |q| q.rank),
                    ranks: partials.map_or(0, |q| q.ranks),
                };
                let dims = (elementwise(m * h / 8), ELEMWISE_THREADS, 0);
                self.fns.combine_rows.launch(stream, dims, pdl, combine)?;
            } else {
                let convert = ConvertParams {
                    y32: out32,
                    topk_ids: p.ids,
                    topk_weights: p.weights,
                    w2_bias: p.w2_bias,
                    m: m32,
                    y: p.y,
                    choice: p.choice,
                };
                self.fns.convert.launch(stream, (elementwise(m * h), ELEMWISE_THREADS, 0), pdl, convert)?;
            }
        }
        Ok(())
    }

    /// A GEMM kernel with `smem` bytes of dynamic shared memory, in clusters if the tiles ask
    /// for them.
    ///
    /// # Safety
    /// As [`Kernel::launch`].
    unsafe fn launch_gemm<P: KernelParams>(
        &self,
        f: &Kernel<P>,
        stream: &CudaStream,
        grid: u32,
        smem: u32,
        p: P,
    ) -> Result<()> {
        let dims = (grid, self.tiles.gemm_threads(), smem);
        f.launch_with(stream, dims, launch_attrs(true, self.tiles.cluster), p)
    }

    /// The routing the last `route` produced (syncs): `(ids, weights)` over the reserved pairs.
    pub fn last_routing(&self, stream: &Arc<CudaStream>) -> Result<(Vec<i32>, Vec<f32>)> {
        let s = self.scratch[0].lock().unwrap_or_else(|p| p.into_inner());
        let s = s.as_ref().ok_or(RuntimeError::NoStepYet)?;
        Ok((stream.clone_dtoh(&s.ids)?, stream.clone_dtoh(&s.weights)?))
    }

    /// The alignment of the last step, copied back (syncs): `(sorted_rows, pair_pos, tile_expert,
    /// num_tiles)`, for tests.
    pub fn last_alignment(&self, stream: &Arc<CudaStream>) -> Result<Alignment> {
        let s = self.scratch[0].lock().unwrap_or_else(|p| p.into_inner());
        let s = s.as_ref().ok_or(RuntimeError::NoStepYet)?;
        let n = stream.clone_dtoh(&s.num_tiles)?;
        Ok(Alignment {
            sorted_rows: stream.clone_dtoh(&s.sorted_rows)?,
            pair_pos: stream.clone_dtoh(&s.pair_pos)?,
            tile_expert: stream.clone_dtoh(&s.tile_expert)?,
            tile_span: stream.clone_dtoh(&s.tile_span)?,
            num_tiles: n[0],
            hot_tiles: n[1],
            tile_span1: if self.ext_rows > 0 { stream.clone_dtoh(&s.tile_span1)? } else { Vec::new() },
            num_tiles1: n[2],
            hot_tiles1: n[3],
        })
    }
}

/// Where moe_prepare's per-expert counts start in `Scratch::work_counters` (i32 elements).
const COUNTS_AT: usize = 4;
