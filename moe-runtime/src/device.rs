//! One GPU: its context and stream, its arch, and the modules loaded on it (kept in memory,
//! keyed by (device, cache key); built through the disk cache).

use crate::cache::{DiskCache, Outcome};
use crate::error::{Result, RuntimeError};
use crate::jit::{cache_key, CompileOptions};
use crate::toolkit::toolkit;
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;
use dashmap::DashMap;
use moe_codegen::{Arch, KernelSource};
use std::sync::{Arc, LazyLock};

static MODULES: LazyLock<DashMap<(usize, String), Arc<CudaModule>>> = LazyLock::new(DashMap::new);

/// One GPU opened for moeforge: its context, a stream of its own, its arch and limits, and the
/// kernel cache its modules are built through. Clones share the context and stream.
#[derive(Clone)]
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: Arch,
    sms: u32,
    max_smem_optin: u32,
    /// Peak DRAM bandwidth from the memory clock and bus width, GB/s (0 if the driver does not say).
    dram_gbps: f64,
    cache: DiskCache,
}

impl Device {
    /// Open GPU `ordinal`. `NoGpu` when the driver library or the device is missing.
    pub fn new(ordinal: usize) -> Result<Device> {
        if !unsafe { sys::is_culib_present() } {
            return Err(RuntimeError::NoGpu("libcuda (the NVIDIA driver) is not installed".into()));
        }
        let count = CudaContext::device_count().map_err(|e| RuntimeError::NoGpu(format!("{e:?}")))?;
        if ordinal as i32 >= count {
            return Err(RuntimeError::NoGpu(format!("device {ordinal} requested, {count} present")));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| RuntimeError::NoGpu(format!("{e:?}")))?;
        Device::from_context(ctx)
    }

    /// A device on a context the caller already has (an engine's, candle's): moeforge's
    /// buffers and modules live in it, and [`MoeLayer::forward_on`](crate::MoeLayer::forward_on)
    /// takes the caller's streams of it. Turns off cudarc's per-buffer event tracking on the
    /// context: moeforge orders its work by streams, and tracked buffers would add event waits
    /// inside graph captures.
    pub fn from_context(ctx: Arc<CudaContext>) -> Result<Device> {
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability()?;
        let arch =
            Arch::from_compute_capability(major, minor).ok_or(RuntimeError::UnsupportedDevice { major, minor })?;
        let sms = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let max_smem_optin =
            ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as u32;
        // kHz, bits: two transfers a clock.
        let clock_khz = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE).unwrap_or(0);
        let bus_bits = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH).unwrap_or(0);
        let dram_gbps = 2.0 * clock_khz.max(0) as f64 * 1e3 * (bus_bits.max(0) as f64 / 8.0) / 1e9;
        let stream = ctx.new_stream()?;
        Ok(Device { ctx, stream, arch, sms, max_smem_optin, dram_gbps, cache: DiskCache::open_default() })
    }

    /// The kernel cache's folder (dispatch profiles live under it too).
    pub fn cache_dir(&self) -> &std::path::Path {
        self.cache.dir()
    }
    /// Use another kernel cache directory (tests, the CLI).
    pub fn with_cache(mut self, cache: DiskCache) -> Device {
        self.cache = cache;
        self
    }
    /// The arch kernels are compiled for on this device.
    pub fn arch(&self) -> Arch {
        self.arch
    }
    /// The number of streaming multiprocessors, which the kernels size their grids by.
    pub fn sm_count(&self) -> u32 {
        self.sms
    }
    /// The most shared memory, in bytes, a block may opt in to; it bounds the kernels' tiles.
    pub fn max_smem_optin(&self) -> u32 {
        self.max_smem_optin
    }
    /// Peak DRAM bandwidth in GB/s from the memory clock and bus width the driver reports (0 where
    /// it reports neither); the dispatcher's analytic fallback scales by it.
    pub fn dram_gbps(&self) -> f64 {
        self.dram_gbps
    }
    /// The CUDA context moeforge's buffers and modules live in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// The device's own stream: layers loaded on the device upload their weights and run
    /// [`MoeLayer::forward`](crate::MoeLayer::forward) on it.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    /// The GPU's name as the driver reports it (`unknown` if it cannot).
    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "unknown".into())
    }

    /// Build into the disk cache every entry point of every source it lacks (each its own
    /// module, as [`Device::functions`] loads them), one NVRTC compile per core at a time, so
    /// that the loads that follow only read the cache.
    pub fn prepare(&self, sources: &[KernelSource]) -> Result<()> {
        let items: Vec<(&KernelSource, &str)> =
            sources.iter().flat_map(|s| s.entry_points.iter().map(move |e| (s, e.as_str()))).collect();
        self.compile_entries(&items)
    }

    /// Compile into the disk cache (not into memory) each `(source, entry point)` module that
    /// neither holds, in parallel.
    pub fn compile_entries(&self, items: &[(&KernelSource, &str)]) -> Result<()> {
        let opts = CompileOptions::for_arch(toolkit()?, self.arch);
        let todo: Vec<(&KernelSource, CompileOptions)> = items
            .iter()
            .map(|&(src, e)| (src, opts.for_entry(e)))
            .filter(|(src, o)| !MODULES.contains_key(&(self.ctx.ordinal(), cache_key(src, o))))
            .collect();
        let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(todo.len()).max(1);
        let next = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|sc| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    sc.spawn(|| -> Result<()> {
                        loop {
                            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            let Some((src, o)) = todo.get(i) else { return Ok(()) };
                            self.cache.get_or_compile(src, o)?;
                        }
                    })
                })
                .collect();
            workers.into_iter().try_for_each(|w| w.join().expect("compile thread panicked"))
        })
    }

    /// The functions `entries` of `src`, each from its own module (compiled in parallel where
    /// neither memory nor the disk cache holds it).
    pub fn functions(&self, src: &KernelSource, entries: &[&str]) -> Result<Vec<CudaFunction>> {
        self.check_arch(src)?;
        self.compile_entries(&entries.iter().map(|&e| (src, e)).collect::<Vec<_>>())?;
        let opts = CompileOptions::for_arch(toolkit()?, self.arch);
        entries.iter().map(|&e| self.load_with(src, &opts.for_entry(e))?.load_function(e).map_err(Into::into)).collect()
    }

    /// The function `entry` of `src` (see [`Device::functions`]).
    pub fn function(&self, src: &KernelSource, entry: &str) -> Result<CudaFunction> {
        Ok(self.functions(src, &[entry])?.remove(0))
    }

    fn check_arch(&self, src: &KernelSource) -> Result<()> {
        if src.arch != self.arch {
            return Err(RuntimeError::Shape {
                what: "kernel arch",
                expected: self.arch.to_string(),
                got: src.arch.to_string(),
            });
        }
        Ok(())
    }

    /// The loaded module for `src`: from memory, else from the disk cache, else compiled.
    pub fn load(&self, src: &KernelSource) -> Result<Arc<CudaModule>> {
        self.check_arch(src)?;
        self.load_with(src, &CompileOptions::for_arch(toolkit()?, self.arch))
    }

    fn load_with(&self, src: &KernelSource, opts: &CompileOptions) -> Result<Arc<CudaModule>> {
        let key = (self.ctx.ordinal(), cache_key(src, opts));
        if let Some(m) = MODULES.get(&key) {
            return Ok(m.clone());
        }
        let (cubin, outcome) = self.cache.get_or_compile(src, opts)?;
        if outcome != Outcome::Hit {
            tracing::info!(module = %src.name, ?outcome, "kernel built");
        }
        let module = self.ctx.load_module(Ptx::from_binary(cubin))?;
        Ok(MODULES.entry(key).or_insert(module).clone())
    }
}
