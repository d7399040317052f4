//! TMA tensor maps (`CUtensorMap`) for the warp-specialised grouped GEMMs: encoded on the host
//! (no device call), passed to the kernel inside its `__grid_constant__` parameter struct.

use crate::error::Result;
use cudarc::driver::sys;
use moe_codegen::params::TmaDesc;
use std::ffi::c_void;

/// A 2-D, K-major matrix `[rows, k_bytes]` read in boxes of `box_rows` rows x 128 bytes, landing
/// in shared memory in the 128-byte swizzle the GEMM stages use.
pub(crate) struct TensorMap;

impl TensorMap {
    /// `ptr`: device address of row 0 (16-byte aligned); rows of `k_bytes` (a multiple of 128).
    pub fn k_major(ptr: u64, rows: u64, k_bytes: u64, elem_bytes: u64, box_rows: u32) -> Result<TmaDesc> {
        use sys::CUtensorMapDataType as D;
        let dtype = if elem_bytes == 2 { D::CU_TENSOR_MAP_DATA_TYPE_UINT16 } else { D::CU_TENSOR_MAP_DATA_TYPE_UINT8 };
        let (dims, box_inner) = ([k_bytes / elem_bytes, rows], (128 / elem_bytes) as u32);
        Self::encode(
            ptr,
            dtype,
            dims,
            k_bytes,
            [box_inner, box_rows],
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        )
    }

    /// Packed weight rows of `row_bytes` (a multiple of 16) read as stored, in boxes of
    /// `box_rows` rows x `box_bytes` (one k-tile of codes), landing densely (no swizzle): the
    /// producer decodes them into the stages (`gemm_wsq.cuh`).
    pub fn packed(ptr: u64, rows: u64, row_bytes: u64, box_bytes: u32, box_rows: u32) -> Result<TmaDesc> {
        let dtype = sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8;
        let swizzle = sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE;
        Self::encode(ptr, dtype, [row_bytes, rows], row_bytes, [box_bytes, box_rows], swizzle)
    }

    fn encode(
        ptr: u64,
        dtype: sys::CUtensorMapDataType,
        dims: [u64; 2],
        row_bytes: u64,
        boxes: [u32; 2],
        swizzle: sys::CUtensorMapSwizzle,
    ) -> Result<TmaDesc> {
        let strides = [row_bytes];
        let elem_strides = [1u32, 1];
        let mut map = sys::CUtensorMap { opaque: [0; 16] };
        // SAFETY: every array has the rank (2) entries the call reads (strides: rank - 1).
        unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map,
                dtype,
                2,
                ptr as *mut c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                elem_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
            .result()?;
        }
        Ok(TmaDesc(map.opaque))
    }
}
