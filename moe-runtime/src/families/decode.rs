//! The warp-decode family: output-centric kernels for steps of a few tokens. `gate_up` gives a
//! warp one intermediate neuron of one routed expert (SiLU fused), `down` one (hidden output,
//! token) with the routing weights folded in; routing is grouped by expert in shared memory
//! inside `gate_up`. Steps larger than one launch's routing tables run as several launches.

use crate::device::Device;
use crate::error::{Result, RuntimeError};
use crate::families::StepPtrs;
use crate::launch::{cooperative_attrs, ptr, Kernel};
use cudarc::driver::{sys, CudaFunction, CudaSlice, CudaStream};
use moe_codegen::params::{
    DownParams, ExpandParams, GateUpBulkParams, GateUpParams, IdsFromI64Params, ResidentParams, RouteParams,
};
use moe_codegen::{
    bulk_smem_bytes, decode_down_smem_bytes, decode_mid_floats, decode_smem_bytes, resident_renders, resident_rows,
    resident_smem_bytes, routing_smem_bytes, DecodeTiles, KernelSource, MoeSpec, RESIDENT_WARPS, TOKEN_TILES,
};
use std::sync::{Arc, Mutex};

/// Token-tile cap used unless `set_max_token_tile` says otherwise: the largest tile rendered
/// (`TOKEN_TILES`; why no larger one: `moe_codegen::heuristics`).
pub const DEFAULT_MAX_TOKEN_TILE: u32 = TOKEN_TILES[TOKEN_TILES.len() - 1];

struct TileFns {
    tile: u32,
    gate_up: Kernel<GateUpParams>,
    /// Resident blocks per SM at the largest routing table we size for.
    gate_up_blocks_per_sm: u32,
}

/// A one-token kernel that streams weights through shared memory (`decode_bulk.cuh`).
struct BulkFn<P> {
    f: Kernel<P>,
    smem: u32,
    threads: u32,
}

/// `moe_decode_resident`: a one-token step in one cooperative launch of one block per SM, each
/// block's rows of the step's w2 in its shared memory.
struct ResidentFn {
    f: Kernel<ResidentParams>,
    rows: u32,
    smem: u32,
    grid: u32,
    /// The grid barrier's arrivals and the blocks out; zero between launches.
    sync: CudaSlice<u32>,
}

/// The down kernel (one for every token tile).
struct DownFn {
    f: Kernel<DownParams>,
    blocks_per_sm: u32,
}

/// The family's compiled functions, its launch geometry and its scratch.
pub(crate) struct DecodeFamily {
    sms: u32,
    /// Shared memory the kernels declare statically (the dequant table of `lut`).
    static_smem: u32,
    warps: u32,
    /// Hidden outputs per down item (the module's tiles).
    down_rows: usize,
    /// Items a warp of the multi-token gate_up kernels serves at once (the module's tiles).
    gate_up_items: u64,
    tiles: Vec<TileFns>,
    down: DownFn,
    /// down with its first items stashed in shared memory, for steps of one token.
    down_stash: DownFn,
    /// The bulk one-token kernels, where the tiles ask for them and their shared memory fits.
    bulk_gate_up: Option<BulkFn<GateUpBulkParams>>,
    bulk_down: Option<BulkFn<DownParams>>,
    /// The resident one-token kernel, where the spec's weights are 16-bit and a block's share of
    /// the step's w2 fits this device; `use_resident`: one-token steps take it.
    resident: Option<ResidentFn>,
    use_resident: bool,
    /// gate_up -> down intermediate, `[M * top_k, I]` f32, grown on demand.
    mid: Mutex<CudaSlice<f32>>,
    max_token_tile: u32,
    /// Narrows int64 routing ids to int32 (`moe_ids_from_i64`).
    ids_from_i64: Kernel<IdsFromI64Params>,
    /// The spec's router, for steps from logits (`moe_route`).
    route: Kernel<RouteParams>,
    /// Appends the shared experts' slots to a step's routing (`moe_expand_routing`).
    expand: Kernel<ExpandParams>,
    /// The most tokens one launch routes (its shared memory, its 32-bit indices, the
    /// intermediate's cap); larger steps run as consecutive launches of at most this many.
    chunk: usize,
}

impl DecodeFamily {
    /// Build the family from its rendered module (`src.decode_tiles` sizes the grids).
    pub fn load(device: &Device, spec: &MoeSpec, src: &KernelSource) -> Result<DecodeFamily> {
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
        let stream = device.stream();
        let warps = src.block_threads / 32;
        let sizing_smem = routing_smem_bytes(spec, 64);
        let occ = |f: &CudaFunction| -> Result<u32> {
            Ok(f.occupancy_max_active_blocks_per_multiprocessor(warps * 32, sizing_smem as usize, None)?.max(1) as u32)
        };
        let (gu_smem, dn_smem) = bulk_smem_bytes(spec, &dt);
        let bulk_gu = dt.bulk_gu && gu_smem <= device.max_smem_optin();
        let bulk_dn = dt.bulk_dn && dn_smem <= device.max_smem_optin();
        let names = DecodeFamily::eager_entries(spec, src, device.max_smem_optin());
        let mut fns = device.functions(src, &names.iter().map(String::as_str).collect::<Vec<_>>())?.into_iter();
        let mut next = || fns.next().expect("one function per name");
        // In eager_entries' order, each with the parameter struct its signature declares.
        let ids_from_i64 = Kernel::new(next());
        let route = Kernel::new(next());
        let expand = Kernel::new(next());
        let down_f = Kernel::new(next());
        let stash_f = Kernel::new(next());
        let mut tiles = Vec::new();
        for t in TOKEN_TILES {
            let gate_up = Kernel::new(next());
            tiles.push(TileFns { tile: t, gate_up_blocks_per_sm: occ(&gate_up)?, gate_up });
        }
        let down = DownFn { blocks_per_sm: occ(&down_f)?, f: down_f };
        let down_stash = DownFn { blocks_per_sm: occ(&stash_f)?, f: stash_f };
        let mut bulk_fn = |on: bool, smem: u32, warps: u32| -> Result<Option<(CudaFunction, u32, u32)>> {
            if !on {
                return Ok(None);
            }
            let f = next();
            f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)?;
            Ok(Some((f, smem, (warps + 1) * 32)))
        };
        let bulk_gate_up = bulk_fn(bulk_gu, gu_smem, dt.bulk_gu_warps)?.map(|(f, smem, threads)| BulkFn {
            f: Kernel::new(f),
            smem,
            threads,
        });
        let bulk_down = bulk_fn(bulk_dn, dn_smem, dt.bulk_dn_warps)?.map(|(f, smem, threads)| BulkFn {
            f: Kernel::new(f),
            smem,
            threads,
        });
        let on_device = (src.arch, device.sm_count(), device.max_smem_optin());
        let resident =
            match (resident_renders(spec, src.arch), resident_rows(spec, on_device.0, on_device.1, on_device.2)) {
                (false, _) => None,
                (true, None) => {
                    next(); // compiled, not launched here: a block's w2 rows do not fit
                    None
                }
                (true, Some(rows)) => {
                    let f = next();
                    let smem = resident_smem_bytes(spec, rows);
                    f.set_attribute(
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        smem as i32,
                    )?;
                    let per_sm =
                        f.occupancy_max_active_blocks_per_multiprocessor(RESIDENT_WARPS * 32, smem as usize, None)?;
                    (per_sm >= 1)
                        .then(|| -> Result<ResidentFn> {
                            Ok(ResidentFn {
                                f: Kernel::new(f),
                                rows,
                                smem,
                                grid: device.sm_count(),
                                sync: stream.alloc_zeros::<u32>(2)?,
                            })
                        })
                        .transpose()?
                }
            };
        // The intermediate scratch holds the resident kernel's [top_k, I] f32.
        let kspec = spec.kernel_spec();
        debug_assert!(decode_mid_floats(spec, 1) >= (kspec.top_k() * kspec.intermediate()) as usize);
        // Static shared memory (LUT tables, down's stash) as the compiled kernels declare it.
        let mut static_smem = 0;
        for f in tiles.iter().map(|t| &*t.gate_up).chain([&*down.f, &*down_stash.f]) {
            static_smem =
                static_smem.max(f.get_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?);
        }
        let chunk = max_chunk(spec, static_smem as u32, device.max_smem_optin());
        if chunk == 0 {
            let need = decode_smem_bytes(spec, 1) + static_smem as u32;
            return Err(RuntimeError::StepTooLarge { m: 1, need, max: device.max_smem_optin() });
        }
        Ok(DecodeFamily {
            sms: device.sm_count(),
            static_smem: static_smem as u32,
            warps,
            down_rows: dt.dn_rows as usize,
            gate_up_items: (32 / dt.gu_lanes) as u64,
            tiles,
            down,
            down_stash,
            bulk_gate_up,
            bulk_down,
            resident,
            use_resident: true,
            mid: Mutex::new(stream.alloc_zeros::<f32>(decode_mid_floats(spec, 1))?),
            max_token_tile: DEFAULT_MAX_TOKEN_TILE,
            ids_from_i64,
            route,
            expand,
            chunk,
        })
    }

    /// The kernels [`DecodeFamily::load`] loads (each its own module): routing-id narrowing,
    /// down, down with the stash, gate_up for every token tile and the bulk pair where it fits.
    pub fn eager_entries(spec: &MoeSpec, src: &KernelSource, max_smem: u32) -> Vec<String> {
        use moe_codegen::render::decode_entry::*;
        let mut names: Vec<String> = [IDS_FROM_I64, ROUTE, EXPAND_ROUTING, DOWN, DOWN_STASH].map(String::from).into();
        names.extend(TOKEN_TILES.iter().map(|&t| gate_up(t)));
        if let Some(dt) = src.decode_tiles {
            let (gu_smem, dn_smem) = bulk_smem_bytes(spec, &dt);
            names.extend((dt.bulk_gu && gu_smem <= max_smem).then(|| GATE_UP_BULK.to_string()));
            names.extend((dt.bulk_dn && dn_smem <= max_smem).then(|| DOWN_BULK.to_string()));
        }
        names.extend(resident_renders(spec, src.arch).then(|| RESIDENT.to_string()));
        names
    }

    /// Whether one-token steps take the resident kernel (`moe_decode_resident`): the spec and the
    /// device have it and [`DecodeFamily::set_resident_one_token`] has not turned it off.
    pub fn resident_one_token(&self) -> bool {
        self.use_resident && self.resident.is_some()
    }

    /// Whether one-token steps may take the resident kernel (on by default); off, they run the
    /// split kernels (gate_up, then down).
    pub fn set_resident_one_token(&mut self, on: bool) {
        self.use_resident = on;
    }

    /// The largest token tile a step may pick.
    pub fn set_max_token_tile(&mut self, tile: u32) {
        self.max_token_tile = tile;
    }

    /// Whether one-token steps take the bulk gate_up and the bulk down.
    pub fn bulk_one_token(&self) -> (bool, bool) {
        (self.bulk_gate_up.is_some(), self.bulk_down.is_some())
    }

    /// `out[i] = in[i]` for `n` int64 ids narrowed to int32 (-1 where out of range), on `stream`
    /// after the work before it (a plain launch: the kernels that follow read `out` after their
    /// programmatic wait on it).
    pub fn narrow_ids(&self, stream: &CudaStream, input: u64, out: u64, n: usize) -> Result<()> {
        let block = self.warps * 32;
        let grid = n.div_ceil(block as usize).clamp(1, 4 * self.sms as usize) as u32;
        let p = IdsFromI64Params { src: input, dst: out, n: n as i32 };
        unsafe { self.ids_from_i64.launch(stream, (grid, block, 0), false, p) }
    }

    /// Route `logits [m, E]` (f32, plus the per-expert `bias`) into `ids` / `weights` `[m, k]`, on
    /// `stream` after the work before it.
    pub fn route(&self, stream: &CudaStream, m: usize, logits: u64, bias: u64, ids: u64, weights: u64) -> Result<()> {
        let threads = moe_codegen::grouped::ROUTE_THREADS;
        let grid = m.div_ceil((threads / 32) as usize) as u32;
        let p = RouteParams { logits, bias, m: m as i32, topk_ids: ids, topk_weights: weights };
        unsafe { self.route.launch(stream, (grid, threads, 0), false, p) }
    }

    /// `[m, k]` routing (`ids`, `weights`) widened into `[m, k + S]` at `dst_ids` / `dst_weights`
    /// with the shared experts' slots (weights from `x` and `gate` where gated; with `shared`
    /// off, empty slots: -1), on `stream` after the work before it (a plain launch, as
    /// `narrow_ids`).
    #[allow(clippy::too_many_arguments)]
    pub fn expand(
        &self,
        stream: &CudaStream,
        m: usize,
        (ids, weights): (u64, u64),
        x: u64,
        gate: u64,
        (dst_ids, dst_weights): (u64, u64),
        shared: bool,
    ) -> Result<()> {
        let threads = moe_codegen::grouped::ROUTE_THREADS;
        let grid = m.div_ceil((threads / 32) as usize) as u32;
        let p = ExpandParams {
            ids_in: ids,
            weights_in: weights,
            x,
            gate,
            dst_ids,
            dst_weights,
            m: m as i32,
            shared_on: shared as i32,
        };
        unsafe { self.expand.launch(stream, (grid, threads, 0), false, p) }
    }

    /// The most tokens one launch takes.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Size the intermediate for launches of up to `tokens` tokens (capped at the chunk).
    pub fn reserve(&self, stream: &Arc<CudaStream>, spec: &MoeSpec, tokens: usize) -> Result<()> {
        let tokens = tokens.min(self.chunk);
        let need = decode_mid_floats(spec, tokens as u32);
        let mut mid = self.mid.lock().unwrap_or_else(|p| p.into_inner());
        if mid.len() < need {
            // Growing means a sync and an allocation, which would invalidate a graph capture.
            let capturing = stream.capture_status()? != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
            if capturing {
                return Err(RuntimeError::NotReserved { m: tokens });
            }
            stream.synchronize()?;
            *mid = stream.alloc_zeros::<f32>(need)?;
            stream.synchronize()?;
        }
        Ok(())
    }

    /// Warp decode over a step of any size: launches of at most `decode_chunk` tokens, each on
    /// its own rows of x, the routing and y (the chunks share the intermediate scratch, which
    /// each gate_up writes only after its `griddepcontrol.wait` on the down before it).
    pub fn forward(&self, stream: &Arc<CudaStream>, spec: &MoeSpec, m: usize, p: &StepPtrs) -> Result<()> {
        let (h, k) = (spec.hidden() as u64, spec.top_k() as u64);
        let act = spec.act_dtype().bytes() as u64;
        let chunk = self.chunk;
        self.reserve(stream, spec, m.min(chunk))?;
        for start in (0..m).step_by(chunk) {
            let t = start as u64;
            let part = StepPtrs {
                x: p.x + t * h * act,
                ids: p.ids + t * k * 4,
                weights: p.weights + t * k * 4,
                y: p.y + t * h * act,
                ..*p
            };
            self.launch(stream, spec, chunk.min(m - start), &part)?;
        }
        Ok(())
    }

    fn launch(&self, s: &CudaStream, spec: &MoeSpec, m: usize, p: &StepPtrs) -> Result<()> {
        let (h, k) = (spec.hidden() as usize, spec.top_k() as usize);
        let smem = decode_smem_bytes(spec, m as u32);
        let mid_buf = self.mid.lock().unwrap_or_else(|p| p.into_inner());
        let tile = DecodeTiles::token_tile(m as u32).min(self.max_token_tile);
        let fns = self.tiles.iter().find(|t| t.tile == tile).expect("every token tile has a slot");
        let gate_up = &fns.gate_up;
        for f in [&**gate_up, &*self.down.f, &*self.down_stash.f] {
            if smem + self.static_smem > 48 * 1024 {
                f.set_attribute(
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )?;
            }
        }
        let mid = ptr(&mid_buf, s);
        let m_i32 = m as i32;
        let block = self.warps * 32;
        let pairs = (m * k) as u64;
        let gu_items = pairs.min(spec.experts() as u64) * spec.intermediate() as u64;
        // At M = 1 every down warp holds one item (one row): the stash kernel, which takes the
        // whole item to shared memory before the wait.
        let (down, dn_rows) = if m == 1 { (&self.down_stash, 1) } else { (&self.down, self.down_rows) };
        let dn_items = (h / dn_rows) as u64 * m as u64;
        let gu_warp_items = if tile == 1 { gu_items } else { gu_items.div_ceil(self.gate_up_items) };
        let grid = |items: u64, per_sm: u32| items.div_ceil(self.warps as u64).min((self.sms * per_sm) as u64) as u32;
        let gu = GateUpParams {
            x: p.x,
            topk_ids: p.ids,
            w13: p.w13,
            w13_scales: p.w13_scales,
            w13_bias: p.w13_bias,
            mid,
            m: m_i32,
            err: p.errors,
            choice: p.choice,
        };
        let dn = DownParams {
            mid,
            topk_ids: p.ids,
            topk_weights: p.weights,
            w2: p.w2,
            w2_scales: p.w2_scales,
            w2_bias: p.w2_bias,
            y: p.y,
            m: m_i32,
            choice: p.choice,
        };
        // Both launch as programmatic dependents: each waits (griddepcontrol.wait) before it
        // touches memory its predecessor may use, so only launch latency overlaps.
        // The bulk kernels: one block per SM (a producer warp and the consumers).
        let bulk_grid = |tiles: u64| tiles.min(self.sms as u64) as u32;
        if let (1, Some(r), true) = (m, &self.resident, self.use_resident) {
            let rp = ResidentParams {
                x: p.x,
                topk_ids: p.ids,
                topk_weights: p.weights,
                w13: p.w13,
                w13_scales: p.w13_scales,
                w13_bias: p.w13_bias,
                w2: p.w2,
                w2_scales: p.w2_scales,
                w2_bias: p.w2_bias,
                mid,
                y: p.y,
                sync: ptr(&r.sync, s),
                err: p.errors,
                choice: p.choice,
                rows: r.rows as i32,
            };
            // SAFETY: as below; the grid is one block per SM, every one resident (cooperative).
            return unsafe { r.f.launch_with(s, (r.grid, RESIDENT_WARPS * 32, r.smem), cooperative_attrs(), rp) };
        }
        // SAFETY: the step's pointers were checked against the spec by the layer, the
        // intermediate is sized for this launch (reserve above).
        unsafe {
            match (m, &self.bulk_gate_up) {
                (1, Some(b)) => {
                    // The bulk gate_up also takes w2, which it prefetches into L2 for down.
                    let tiles = pairs * spec.intermediate() as u64 / (b.threads / 32 - 1) as u64;
                    let bp = GateUpBulkParams {
                        x: gu.x,
                        topk_ids: gu.topk_ids,
                        w13: gu.w13,
                        w13_scales: gu.w13_scales,
                        w13_bias: gu.w13_bias,
                        w2: p.w2,
                        mid,
                        m: m_i32,
                        err: gu.err,
                    };
                    b.f.launch(s, (bulk_grid(tiles), b.threads, b.smem), true, bp)?;
                }
                _ => {
                    // Staged activations can take more shared memory than the load-time sizing
                    // assumed.
                    let per_sm = gate_up.occupancy_max_active_blocks_per_multiprocessor(block, smem as usize, None)?;
                    let per_sm = (per_sm as u32).clamp(1, fns.gate_up_blocks_per_sm);
                    gate_up.launch(s, (grid(gu_warp_items, per_sm), block, smem), true, gu)?;
                }
            }
            // down needs only the step's ids and weights in dynamic shared memory: the less it
            // asks for, the sooner its blocks fit beside gate_up's last ones.
            match (m, &self.bulk_down) {
                (1, Some(b)) => {
                    let tiles = h as u64 / (b.threads / 32 - 1) as u64;
                    b.f.launch(s, (bulk_grid(tiles), b.threads, b.smem), true, dn)?;
                }
                _ => {
                    let dn_smem = decode_down_smem_bytes(spec, m as u32);
                    down.f.launch(s, (grid(dn_items, down.blocks_per_sm), block, dn_smem), true, dn)?;
                }
            }
        }
        Ok(())
    }
}

/// The largest token count `c` such that a warp-decode launch of every size up to `c` fits the
/// device's shared memory and the kernels' 32-bit work indices (0: not even one token fits).
/// Scanned rather than solved: the activation staging switches off past a size, so the bytes a
/// step needs are not monotonic in its tokens.
fn max_chunk(spec: &MoeSpec, static_smem: u32, max_smem: u32) -> usize {
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
