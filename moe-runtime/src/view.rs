//! Device memory the caller owns, seen by `forward`: a pointer, an element count and the element
//! type, borrowed for as long as the call that takes it.

use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::marker::PhantomData;

/// A read-only device tensor of `len` elements of `T` (an engine's buffer, or a `CudaSlice`).
#[derive(Debug, Clone, Copy)]
pub struct DeviceTensor<'a, T> {
    ptr: sys::CUdeviceptr,
    len: usize,
    _borrow: PhantomData<&'a [T]>,
}

/// A writable device tensor of `len` elements of `T`.
#[derive(Debug)]
pub struct DeviceTensorMut<'a, T> {
    ptr: sys::CUdeviceptr,
    len: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

impl<'a, T> DeviceTensor<'a, T> {
    /// A view of a cudarc slice (e.g. one from candle's CUDA storage), borrowed for `'a`.
    pub fn new(slice: &'a CudaSlice<T>, stream: &CudaStream) -> Self {
        let (ptr, _guard) = slice.device_ptr(stream);
        DeviceTensor { ptr, len: slice.len(), _borrow: PhantomData }
    }

    /// A view of raw device memory.
    ///
    /// # Safety
    /// `ptr` must address `len` initialised elements of `T` in device memory of the layer's
    /// context, valid and not written by others until the work enqueued with it has finished.
    pub unsafe fn from_raw(ptr: sys::CUdeviceptr, len: usize) -> DeviceTensor<'static, T> {
        DeviceTensor { ptr, len, _borrow: PhantomData }
    }
}

impl<'a, T> DeviceTensorMut<'a, T> {
    /// A writable view of a cudarc slice, borrowed for `'a`.
    pub fn new(slice: &'a mut CudaSlice<T>, stream: &CudaStream) -> Self {
        let len = slice.len();
        let (ptr, _guard) = slice.device_ptr_mut(stream);
        DeviceTensorMut { ptr, len, _borrow: PhantomData }
    }

    /// A writable view of raw device memory.
    ///
    /// # Safety
    /// As [`DeviceTensor::from_raw`], and nothing else may read or write the memory until the
    /// work enqueued with it has finished.
    pub unsafe fn from_raw(ptr: sys::CUdeviceptr, len: usize) -> DeviceTensorMut<'static, T> {
        DeviceTensorMut { ptr, len, _borrow: PhantomData }
    }
}

macro_rules! accessors {
    ($t:ident) => {
        impl<T> $t<'_, T> {
            /// The device address of the first element.
            pub fn ptr(&self) -> sys::CUdeviceptr {
                self.ptr
            }
            /// Elements in the view.
            pub fn len(&self) -> usize {
                self.len
            }
            /// Whether the view holds no element.
            pub fn is_empty(&self) -> bool {
                self.len == 0
            }
        }
    };
}
accessors!(DeviceTensor);
accessors!(DeviceTensorMut);

/// Routing ids `[M, k]` as int32 or int64 (PyTorch's index type; narrowed on the device, each
/// id outside int32 counted as out of range).
#[derive(Debug, Clone, Copy)]
pub enum TopkIds<'a> {
    /// int32 ids, which the kernels read as they are.
    I32(DeviceTensor<'a, i32>),
    /// int64 ids, narrowed to int32 on the device before the step.
    I64(DeviceTensor<'a, i64>),
}

impl TopkIds<'_> {
    /// Ids in the view.
    pub fn len(&self) -> usize {
        match self {
            TopkIds::I32(t) => t.len(),
            TopkIds::I64(t) => t.len(),
        }
    }
    /// Whether the view holds no id.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<'a> From<DeviceTensor<'a, i32>> for TopkIds<'a> {
    fn from(t: DeviceTensor<'a, i32>) -> Self {
        TopkIds::I32(t)
    }
}

impl<'a> From<DeviceTensor<'a, i64>> for TopkIds<'a> {
    fn from(t: DeviceTensor<'a, i64>) -> Self {
        TopkIds::I64(t)
    }
}
