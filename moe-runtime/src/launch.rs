//! The one place kernels are launched: `cuLaunchKernelEx` with programmatic dependent launch
//! (PDL), thread-block clusters or cooperative grids, used by every kernel family.

use crate::error::Result;
use cudarc::driver::{sys, CudaFunction, CudaSlice, CudaStream, DevicePtr};
use moe_codegen::params::KernelParams;
use std::ffi::c_void;
use std::marker::PhantomData;

/// A loaded kernel and the one parameter struct its C signature takes
/// (`moe_codegen::params`): a launch can pass nothing else.
pub(crate) struct Kernel<P> {
    f: CudaFunction,
    params: PhantomData<fn(P)>,
}

impl<P: KernelParams> Kernel<P> {
    /// `f` must be an entry point declared with `const __grid_constant__ P`.
    pub fn new(f: CudaFunction) -> Kernel<P> {
        Kernel { f, params: PhantomData }
    }

    /// Launch `(grid, block, dynamic shared memory)` on `stream`, as a programmatic dependent of
    /// the kernel before it if `pdl` (it may start before that one finishes and waits in
    /// `griddepcontrol.wait`).
    ///
    /// # Safety
    /// Every address in `p` must be valid for what the kernel does with it, until it completes.
    pub unsafe fn launch(&self, stream: &CudaStream, dims: (u32, u32, u32), pdl: bool, p: P) -> Result<()> {
        self.launch_with(stream, dims, launch_attrs(pdl, 1), p)
    }

    /// [`Kernel::launch`] with these attributes (with clusters: the grid a multiple of the
    /// cluster's size).
    ///
    /// # Safety
    /// As [`Kernel::launch`].
    pub unsafe fn launch_with(
        &self,
        stream: &CudaStream,
        (grid, block, smem): (u32, u32, u32),
        mut attrs: LaunchAttrs,
        mut p: P,
    ) -> Result<()> {
        let cfg = launch_config(stream, grid, block, smem, &mut attrs);
        // The driver copies the struct's bytes at launch; the kernel's module asserts its layout.
        let mut args = [&mut p as *mut P as *mut c_void];
        sys::cuLaunchKernelEx(&cfg, self.f.cu_function(), args.as_mut_ptr(), std::ptr::null_mut()).result()?;
        Ok(())
    }
}

impl<P> std::ops::Deref for Kernel<P> {
    type Target = CudaFunction;
    fn deref(&self) -> &CudaFunction {
        &self.f
    }
}

/// Clusters of `cluster` blocks of `f` that fit on the device at once.
pub(crate) fn max_active_clusters(
    f: &CudaFunction,
    stream: &CudaStream,
    block: u32,
    smem: u32,
    cluster: u32,
) -> Result<u32> {
    let mut attrs = launch_attrs(false, cluster);
    let cfg = launch_config(stream, cluster, block, smem, &mut attrs);
    let mut n = 0i32;
    unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f.cu_function(), &cfg).result()? };
    Ok(n.max(0) as u32)
}

/// The launch attributes in use: programmatic serialisation if `pdl`, cluster dimensions if
/// `cluster > 1` (an unused attribute stays past `numAttrs`).
pub(crate) fn launch_attrs(pdl: bool, cluster: u32) -> LaunchAttrs {
    let mut attrs = LaunchAttrs { a: unsafe { std::mem::zeroed() }, n: 0 };
    if pdl {
        let a = &mut attrs.a[attrs.n];
        a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        a.value.programmaticStreamSerializationAllowed = 1;
        attrs.n += 1;
    }
    if cluster > 1 {
        let a = &mut attrs.a[attrs.n];
        a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        a.value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: cluster, y: 1, z: 1 };
        attrs.n += 1;
    }
    attrs
}

/// A cooperative launch: every block resident at once (grid barriers), or the launch fails.
pub(crate) fn cooperative_attrs() -> LaunchAttrs {
    let mut attrs = launch_attrs(false, 1);
    let a = &mut attrs.a[attrs.n];
    a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    a.value.cooperative = 1;
    attrs.n += 1;
    attrs
}

pub(crate) struct LaunchAttrs {
    a: [sys::CUlaunchAttribute; 2],
    n: usize,
}

fn launch_config(
    stream: &CudaStream,
    grid: u32,
    block: u32,
    smem: u32,
    attrs: &mut LaunchAttrs,
) -> sys::CUlaunchConfig {
    sys::CUlaunchConfig {
        gridDimX: grid,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem,
        hStream: stream.cu_stream(),
        attrs: attrs.a.as_mut_ptr(),
        numAttrs: attrs.n as u32,
    }
}

pub(crate) fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    // Event tracking is off on moeforge contexts, so the guard records nothing.
    s.device_ptr(stream).0
}
