//! Expert weights on the host, in the layout of [`MoeSpec`]: `w13 [E, 2I, H]` (gate rows, then
//! up rows), `w2 [E, H, I]`, each as the format's code bytes plus its scale bytes, laid out as
//! `moe_codegen::format` documents (each expert one stacked tensor: NVFP4 keeps one global scale
//! per expert and matrix, so gate and up of one expert share theirs).

use crate::error::{Result, RuntimeError};
use crate::view::DeviceTensor;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut};
use moe_codegen::{MoeSpec, QuantError};
use std::sync::Arc;

/// A layer's expert weights in host memory, quantized into the spec's format, ready to upload.
#[derive(Debug, Clone, Default)]
pub struct HostWeights {
    /// The format's code bytes for the `E` stacked `[2I, H]` matrices (gate rows, then up rows).
    pub w13: Vec<u8>,
    /// The format's scale bytes for the `E` stacked `[2I, H]` matrices of `w13` (empty if none).
    pub w13_scales: Vec<u8>,
    /// The format's code bytes for the `E` stacked `[H, I]` matrices.
    pub w2: Vec<u8>,
    /// The format's scale bytes for the `E` stacked `[H, I]` matrices of `w2` (empty if none).
    pub w2_scales: Vec<u8>,
    /// With [`MoeSpec::has_bias`]: `[E, 2I]` f32 added to the gate / up projections (empty
    /// without biases).
    pub w13_bias: Vec<f32>,
    /// With [`MoeSpec::has_bias`]: `[E, H]` f32 added to each expert's output (empty without).
    pub w2_bias: Vec<f32>,
    /// With [`MoeSpec::shared_gated`]: `[H]` f32, the shared experts' weight per token being
    /// `sigmoid(x . shared_gate)` (empty without).
    pub shared_gate: Vec<f32>,
}

impl HostWeights {
    /// Quantize f32 weights (`w13 [E, 2I, H]`, `w2 [E, H, I]`; E counting the shared experts
    /// after the routed ones) into the spec's format, one tensor per expert, experts in parallel.
    pub fn quantize(spec: &MoeSpec, w13: &[f32], w2: &[f32]) -> std::result::Result<HostWeights, QuantError> {
        let spec = &spec.kernel_spec();
        let (e, h, i) = (spec.experts() as usize, spec.hidden() as usize, spec.intermediate() as usize);
        let f = spec.weight_format();
        let a = f.quantize_stacked(e, 2 * i, h, w13)?;
        let b = f.quantize_stacked(e, h, i, w2)?;
        Ok(HostWeights { w13: a.data, w13_scales: a.scales, w2: b.data, w2_scales: b.scales, ..Default::default() })
    }

    /// These weights with per-expert biases (`w13_bias [E, 2I]`, `w2_bias [E, H]`, f32), for a
    /// spec with [`MoeSpec::has_bias`].
    pub fn with_bias(mut self, w13_bias: Vec<f32>, w2_bias: Vec<f32>) -> HostWeights {
        self.w13_bias = w13_bias;
        self.w2_bias = w2_bias;
        self
    }

    /// Check sizes against the spec (its shared experts counted after the routed ones).
    pub fn validate(&self, spec: &MoeSpec) -> Result<()> {
        check_gate(spec, self.shared_gate.len())?;
        let spec = &spec.kernel_spec();
        check_sizes(spec, [self.w13.len(), self.w13_scales.len(), self.w2.len(), self.w2_scales.len()])?;
        check_bias(spec, self.w13_bias.len(), self.w2_bias.len())
    }

    /// Row `r` of expert `e`'s `w13` (`r < 2I`; `e` past the routed experts: a shared one),
    /// dequantized exactly as the kernels read it.
    pub fn w13_row(&self, spec: &MoeSpec, e: usize, r: usize) -> Vec<f32> {
        let spec = &spec.kernel_spec();
        let (n, h, i) = (spec.experts() as usize, spec.hidden() as usize, spec.intermediate() as usize);
        spec.weight_format().dequantize_row(&self.w13, &self.w13_scales, n, n * 2 * i, h, e * 2 * i + r)
    }
    /// Row `r` of expert `e`'s `w2` (`r < H`), dequantized.
    pub fn w2_row(&self, spec: &MoeSpec, e: usize, r: usize) -> Vec<f32> {
        let spec = &spec.kernel_spec();
        let (n, h, i) = (spec.experts() as usize, spec.hidden() as usize, spec.intermediate() as usize);
        spec.weight_format().dequantize_row(&self.w2, &self.w2_scales, n, n * h, i, e * h + r)
    }
}

impl HostWeights {
    /// The weights of `experts` only (routed experts of `spec`, in the order given), as a layer of
    /// `experts.len()` experts holds them: what one rank of an expert-parallel layer loads. The
    /// spec's shared experts (every rank holds them) follow the selected ones, with their gate.
    pub fn select_experts(&self, spec: &MoeSpec, experts: &[u32]) -> Result<HostWeights> {
        self.validate(spec)?;
        let routed = spec.experts() as usize;
        if let Some(&e) = experts.iter().find(|&&e| e as usize >= routed) {
            return Err(RuntimeError::ExpertIdOutOfRange {
                count: 1,
                experts: routed as u32,
                first_pair: 0,
                first_id: e as i32,
            });
        }
        let shared = spec.shared_experts();
        let experts: Vec<u32> = experts.iter().copied().chain(routed as u32..routed as u32 + shared).collect();
        let spec = &spec.kernel_spec();
        let n = spec.experts() as usize;
        let (h, i, f) = (spec.hidden() as usize, spec.intermediate() as usize, spec.weight_format());
        let pick = |v: &[u8], per: usize| -> Vec<u8> {
            experts.iter().flat_map(|&e| &v[e as usize * per..(e as usize + 1) * per]).copied().collect()
        };
        let pick_f32 = |v: &[f32], per: usize| -> Vec<f32> {
            if v.is_empty() {
                return Vec::new();
            }
            experts.iter().flat_map(|&e| &v[e as usize * per..(e as usize + 1) * per]).copied().collect()
        };
        let per_expert =
            [(2 * i, h), (h, i)].into_iter().all(|(r, c)| f.scale_bytes(n, r, c) == n * f.scale_bytes(1, r, c));
        if !per_expert && !matches!(f.scale_layout(), moe_codegen::ScaleLayout::Nvfp4) {
            return Err(RuntimeError::Shape {
                what: "weight scales",
                expected: "whole scale blocks per expert".into(),
                got: format!("{f} scales shared across experts at this geometry"),
            });
        }
        // Scales: per-expert blocks, but NVFP4 keeps every tensor's global scale first.
        let scales = |v: &[u8], rows: usize, cols: usize| -> Vec<u8> {
            if v.is_empty() {
                return Vec::new();
            }
            if matches!(f.scale_layout(), moe_codegen::ScaleLayout::Nvfp4) {
                let per = rows * cols.div_ceil(16);
                let (globals, blocks) = v.split_at(n * 4);
                let mut out = pick(globals, 4);
                out.extend(pick(blocks, per));
                out
            } else {
                pick(v, f.scale_bytes(1, rows, cols))
            }
        };
        Ok(HostWeights {
            w13: pick(&self.w13, f.data_bytes(2 * i, h)),
            w13_scales: scales(&self.w13_scales, 2 * i, h),
            w2: pick(&self.w2, f.data_bytes(h, i)),
            w2_scales: scales(&self.w2_scales, h, i),
            w13_bias: pick_f32(&self.w13_bias, 2 * i),
            w2_bias: pick_f32(&self.w2_bias, h),
            shared_gate: self.shared_gate.clone(),
        })
    }
}

/// `[w13, w13_scales, w2, w2_scales]` byte counts against the spec's layout.
fn check_sizes(spec: &MoeSpec, [w13, w13_scales, w2, w2_scales]: [usize; 4]) -> Result<()> {
    let f = spec.weight_format();

    let (e, h, i) = (spec.experts() as usize, spec.hidden() as usize, spec.intermediate() as usize);
    let check = |what, got: usize, expected: usize| {
        if got == expected {
            Ok(())
        } else {
            Err(RuntimeError::Shape { what, expected: format!("{expected} bytes"), got: format!("{got}") })
        }
    };
    check("w13 bytes", w13, f.data_bytes(e * 2 * i, h))?;
    check("w2 bytes", w2, f.data_bytes(e * h, i))?;
    check("w13_scales", w13_scales, f.scale_bytes(e, 2 * i, h))?;
    check("w2_scales", w2_scales, f.scale_bytes(e, h, i))?;
    Ok(())
}

/// The shared gate's length: `[H]` for gated shared experts, none otherwise.
fn check_gate(spec: &MoeSpec, got: usize) -> Result<()> {
    let expected = if spec.shared_gated() { spec.hidden() as usize } else { 0 };
    if got != expected {
        return Err(RuntimeError::Shape {
            what: "shared_gate",
            expected: format!("{expected} f32 (gated shared experts: {})", spec.shared_gated()),
            got: format!("{got}"),
        });
    }
    Ok(())
}

/// `w13_bias` / `w2_bias` element counts: `[E, 2I]` and `[E, H]` with biases, none without.
fn check_bias(spec: &MoeSpec, w13: usize, w2: usize) -> Result<()> {
    let (e, h, i) = (spec.experts() as usize, spec.hidden() as usize, spec.intermediate() as usize);
    let want = if spec.has_bias() { [e * 2 * i, e * h] } else { [0, 0] };
    for (what, got, expected) in [("w13_bias", w13, want[0]), ("w2_bias", w2, want[1])] {
        if got != expected {
            let has = if spec.has_bias() { "has" } else { "has no" };
            return Err(RuntimeError::Shape {
                what,
                expected: format!("{expected} f32 (the spec {has} biases)"),
                got: format!("{got}"),
            });
        }
    }
    Ok(())
}

/// Expert weights already on the device, in [`HostWeights`]' layout, moved into the layer that
/// is built from them (no copy). `None` scales: the format has none.
#[derive(Debug)]
pub struct DeviceWeights {
    /// The code bytes of `w13`, as in [`HostWeights::w13`].
    pub w13: CudaSlice<u8>,
    /// The scale bytes of `w13`, as in [`HostWeights::w13_scales`].
    pub w13_scales: Option<CudaSlice<u8>>,
    /// The code bytes of `w2`, as in [`HostWeights::w2`].
    pub w2: CudaSlice<u8>,
    /// The scale bytes of `w2`, as in [`HostWeights::w2_scales`].
    pub w2_scales: Option<CudaSlice<u8>>,
    /// `w13_bias` and `w2_bias` (f32) as in [`HostWeights`], for a spec with biases.
    pub bias: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    /// [`HostWeights::shared_gate`], for gated shared experts.
    pub shared_gate: Option<CudaSlice<f32>>,
}

impl DeviceWeights {
    /// Copies of device memory the caller filled (device to device, on `stream`, which is
    /// synchronised before returning so the caller may reuse its buffers).
    pub fn copy_from(
        stream: &Arc<CudaStream>,
        w13: DeviceTensor<'_, u8>,
        w13_scales: Option<DeviceTensor<'_, u8>>,
        w2: DeviceTensor<'_, u8>,
        w2_scales: Option<DeviceTensor<'_, u8>>,
    ) -> Result<DeviceWeights> {
        let copy = |t: DeviceTensor<'_, u8>| -> Result<CudaSlice<u8>> {
            let mut dst = stream.alloc_zeros::<u8>(t.len().max(1))?;
            if !t.is_empty() {
                let (d, _g) = dst.device_ptr_mut(stream);
                unsafe { cudarc::driver::result::memcpy_dtod_async(d, t.ptr(), t.len(), stream.cu_stream())? };
            }
            Ok(dst)
        };
        let w = DeviceWeights {
            w13: copy(w13)?,
            w13_scales: w13_scales.map(copy).transpose()?,
            w2: copy(w2)?,
            w2_scales: w2_scales.map(copy).transpose()?,
            bias: None,
            shared_gate: None,
        };
        stream.synchronize()?;
        Ok(w)
    }

    /// Check sizes against the spec.
    pub fn validate(&self, spec: &MoeSpec) -> Result<()> {
        check_gate(spec, self.shared_gate.as_ref().map_or(0, |g| g.len()))?;
        let spec = &spec.kernel_spec();
        let len = |s: &Option<CudaSlice<u8>>| s.as_ref().map_or(0, |s| s.len());
        check_sizes(spec, [self.w13.len(), len(&self.w13_scales), self.w2.len(), len(&self.w2_scales)])?;
        let (b13, b2) = self.bias.as_ref().map_or((0, 0), |(a, b)| (a.len(), b.len()));
        check_bias(spec, b13, b2)
    }
}

/// Where a layer's weights come from: the host (uploaded) or the device (moved in).
#[derive(Debug)]
pub enum Weights<'a> {
    /// Weights in host memory, copied to the device on load.
    Host(&'a HostWeights),
    /// Weights already on the device, moved into the layer without a copy.
    Device(Box<DeviceWeights>),
}

impl<'a> From<&'a HostWeights> for Weights<'a> {
    fn from(w: &'a HostWeights) -> Self {
        Weights::Host(w)
    }
}

impl From<DeviceWeights> for Weights<'_> {
    fn from(w: DeviceWeights) -> Self {
        Weights::Device(Box::new(w))
    }
}

impl Weights<'_> {
    /// Check sizes against the spec.
    pub fn validate(&self, spec: &MoeSpec) -> Result<()> {
        match self {
            Weights::Host(w) => w.validate(spec),
            Weights::Device(w) => w.validate(spec),
        }
    }

    /// `[w13, w13_scales, w2, w2_scales]` on the device (a 16-byte zero buffer for absent scales,
    /// so every kernel pointer is valid), and the biases where the spec has them.
    pub(crate) fn into_device(self, stream: &Arc<CudaStream>) -> Result<OnDevice> {
        let empty = || stream.alloc_zeros::<u8>(16);
        Ok(match self {
            Weights::Host(w) => {
                let up = |v: &[u8]| if v.is_empty() { Ok(empty()?) } else { upload(stream, v) };
                let bias = if w.w13_bias.is_empty() {
                    None
                } else {
                    Some((stream.clone_htod(&w.w13_bias)?, stream.clone_htod(&w.w2_bias)?))
                };
                let shared_gate =
                    if w.shared_gate.is_empty() { None } else { Some(stream.clone_htod(&w.shared_gate)?) };
                OnDevice { mats: [up(&w.w13)?, up(&w.w13_scales)?, up(&w.w2)?, up(&w.w2_scales)?], bias, shared_gate }
            }
            Weights::Device(w) => {
                let w = *w;
                let mats = [w.w13, w.w13_scales.map_or_else(empty, Ok)?, w.w2, w.w2_scales.map_or_else(empty, Ok)?];
                OnDevice { mats, bias: w.bias, shared_gate: w.shared_gate }
            }
        })
    }
}

/// A layer's weights on the device: `[w13, w13_scales, w2, w2_scales]` and the biases.
pub(crate) struct OnDevice {
    pub mats: [CudaSlice<u8>; 4],
    pub bias: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    pub shared_gate: Option<CudaSlice<f32>>,
}

/// Buffers from this size on are page-locked for their upload.
const PIN_MIN_BYTES: usize = 64 << 20;

/// A host-to-device copy of `v`. A large buffer is page-locked in place for the copy, so the
/// DMA reads it directly instead of through the driver's pageable staging (where registration
/// is refused, the plain copy runs).
fn upload(stream: &Arc<CudaStream>, v: &[u8]) -> Result<CudaSlice<u8>> {
    use cudarc::driver::sys;
    if v.len() < PIN_MIN_BYTES {
        return Ok(stream.clone_htod(v)?);
    }
    let p = v.as_ptr() as *mut std::ffi::c_void;
    // Read-only: the device only reads it, and the caller's buffer stays immutable.
    let pinned = unsafe { sys::cuMemHostRegister_v2(p, v.len(), sys::CU_MEMHOSTREGISTER_READ_ONLY) }
        == sys::CUresult::CUDA_SUCCESS;
    let out = stream.clone_htod(v);
    if pinned {
        // The copy must finish before the pages are released.
        let synced = stream.synchronize();
        unsafe { sys::cuMemHostUnregister(p) };
        synced?;
    }
    Ok(out?)
}
