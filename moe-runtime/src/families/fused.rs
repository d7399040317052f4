//! The fused three-phase family: a step's up-projection, activation and down-projection in one
//! cooperative launch (`moe_fused`, `templates/fused.cu`), for steps of a few to a few dozen
//! tokens. Steps past the module's `max_tokens` run as consecutive launches.

use crate::device::Device;
use crate::error::{Result, RuntimeError};
use crate::families::StepPtrs;
use crate::launch::{cooperative_attrs, ptr, Kernel};
use cudarc::driver::{sys, CudaSlice, CudaStream};
use moe_codegen::params::FusedParams;
use moe_codegen::{fused_smem_bytes, FusedTiles, KernelSource, MoeSpec};
use std::sync::Arc;

/// The family's compiled kernel, its launch shape and its scratch (sized once, at load).
pub(crate) struct FusedFamily {
    kernel: Kernel<FusedParams>,
    tiles: FusedTiles,
    smem: u32,
    /// Blocks of the cooperative grid: every one resident at once.
    grid: u32,
    /// The intermediate `[max_tokens * k, I]` in the activation dtype.
    mid: CudaSlice<u16>,
    /// Per-expert count of finished up items, and blocks finished; zero between steps (the last
    /// block of a launch resets them).
    done: CudaSlice<i32>,
    finished: CudaSlice<i32>,
    /// With the down items split (`FusedTiles::down_split`): each half's sums `[rows / 16][split]
    /// [max_tokens][16]`, and per 16 rows the halves in; zero between launches (the block that
    /// finishes a row resets its count).
    dn_part: CudaSlice<f32>,
    dn_count: CudaSlice<i32>,
    stream: Arc<CudaStream>,
}

impl FusedFamily {
    /// Build the family from its rendered module (`src.fused_tiles` sizes the launch).
    pub fn load(device: &Device, spec: &MoeSpec, src: &KernelSource) -> Result<FusedFamily> {
        let tiles = src.fused_tiles.ok_or_else(|| RuntimeError::Shape {
            what: "KernelSource::fused_tiles",
            expected: "the fused tiles the source was rendered with".into(),
            got: "none".into(),
        })?;
        let smem = fused_smem_bytes(spec, &tiles);
        if smem > device.max_smem_optin() {
            return Err(RuntimeError::Shape {
                what: "fused shared memory",
                expected: format!("at most {} bytes per block", device.max_smem_optin()),
                got: format!("{smem} bytes ({tiles:?})"),
            });
        }
        let f = device.function(src, moe_codegen::fused::ENTRY)?;
        f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)?;
        let per_sm = f.occupancy_max_active_blocks_per_multiprocessor(tiles.warps * 32, smem as usize, None)?;
        if per_sm < 1 {
            return Err(RuntimeError::Shape {
                what: "fused occupancy",
                expected: "at least one resident block per SM".into(),
                got: format!("none at {smem} bytes of shared memory"),
            });
        }
        let stream = device.stream().clone();
        let pairs = (tiles.max_tokens * spec.top_k()) as usize;
        let fam = FusedFamily {
            kernel: Kernel::new(f),
            tiles,
            smem,
            grid: device.sm_count() * per_sm as u32,
            mid: stream.alloc_zeros::<u16>(pairs * spec.intermediate() as usize)?,
            done: stream.alloc_zeros::<i32>(spec.experts() as usize)?,
            finished: stream.alloc_zeros::<i32>(1)?,
            dn_part: stream.alloc_zeros::<f32>(if tiles.down_split > 1 {
                (tiles.down_split * tiles.max_tokens * spec.hidden()) as usize
            } else {
                1
            })?,
            dn_count: stream.alloc_zeros::<i32>((spec.hidden() / 16) as usize)?,
            stream,
        };
        tracing::debug!(grid = fam.grid, smem, ?tiles, "fused family loaded");
        Ok(fam)
    }

    /// The tiles the family was rendered with.
    pub fn tiles(&self) -> FusedTiles {
        self.tiles
    }

    /// Tokens one launch takes.
    pub fn max_tokens(&self) -> usize {
        self.tiles.max_tokens as usize
    }

    /// Enqueue the step of `m` tokens on `stream` (launches of at most `max_tokens` each).
    pub fn forward(&self, stream: &CudaStream, spec: &MoeSpec, m: usize, p: &StepPtrs) -> Result<()> {
        let (h, k) = (spec.hidden() as u64, spec.top_k() as u64);
        let act = 2u64; // bytes of a bf16 / fp16 activation
        let chunk = self.max_tokens();
        for start in (0..m).step_by(chunk) {
            let n = chunk.min(m - start);
            let s = start as u64;
            let params = FusedParams {
                x: p.x + s * h * act,
                topk_ids: p.ids + s * k * 4,
                topk_weights: p.weights + s * k * 4,
                w13: p.w13,
                w13_scales: p.w13_scales,
                w13_bias: p.w13_bias,
                w2: p.w2,
                w2_scales: p.w2_scales,
                w2_bias: p.w2_bias,
                mid: ptr(&self.mid, &self.stream),
                y: p.y + s * h * act,
                done: ptr(&self.done, &self.stream),
                finished: ptr(&self.finished, &self.stream),
                dn_part: ptr(&self.dn_part, &self.stream),
                dn_count: ptr(&self.dn_count, &self.stream),
                err: p.errors,
                choice: p.choice,
                m: n as i32,
            };
            // SAFETY: the step's pointers were checked against the spec by the layer; the scratch
            // holds `max_tokens` tokens and the launch takes at most that many.
            unsafe {
                self.kernel.launch_with(
                    stream,
                    (self.grid, self.tiles.warps * 32, self.smem),
                    cooperative_attrs(),
                    params,
                )?
            };
        }
        Ok(())
    }
}
