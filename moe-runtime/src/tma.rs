//! TMA tensor maps (`CUtensorMap`) for the warp-specialised grouped GEMMs: encoded on the host
//! (no device call), passed to the kernel by value as a `__grid_constant__` parameter.

use crate::error::Result;
use cudarc::driver::sys;
use std::ffi::c_void;

/// A 2-D, K-major matrix `[rows, k_bytes]` read in boxes of `box_rows` rows x 128 bytes, landing
/// in shared memory in the 128-byte swizzle the GEMM stages use.
#[repr(transparent)]
pub(crate) struct TensorMap(sys::CUtensorMap);

impl TensorMap {
    /// The all-zero map, for kernels built without TMA (the parameter is unused there).
    pub fn unused() -> TensorMap {
        // SAFETY: CUtensorMap is plain bytes.
        TensorMap(unsafe { std::mem::zeroed() })
    }

    /// `ptr`: device address of row 0 (16-byte aligned); rows of `k_bytes` (a multiple of 128).
    pub fn k_major(ptr: u64, rows: u64, k_bytes: u64, elem_bytes: u64, box_rows: u32) -> Result<TensorMap> {
        use sys::CUtensorMapDataType as D;
        let dtype = if elem_bytes == 2 { D::CU_TENSOR_MAP_DATA_TYPE_UINT16 } else { D::CU_TENSOR_MAP_DATA_TYPE_UINT8 };
        let dims = [k_bytes / elem_bytes, rows];
        let strides = [k_bytes];
        let boxes = [(128 / elem_bytes) as u32, box_rows];
        let elem_strides = [1u32, 1];
        let mut map = TensorMap::unused();
        // SAFETY: every array has the rank (2) entries the call reads (strides: rank - 1).
        unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map.0,
                dtype,
                2,
                ptr as *mut c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                elem_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
            .result()?;
        }
        Ok(map)
    }
}
