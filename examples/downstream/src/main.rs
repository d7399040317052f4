//! Two MoE layers declared with `#[moe_kernel]`: their specs were checked and their CUDA sources
//! rendered when this crate compiled. On a GPU, each is loaded and one decode step is checked
//! against the CPU reference: the program fails (exits non-zero) when the error is outside
//! [`MAX_REL_L2`] / [`MIN_COSINE`]. Without a GPU it only lists the rendered kernels.

use moeforge::runtime::reference::{compare, moe_forward};
use moeforge::runtime::testing::{random_step, random_weights};
use moeforge::runtime::{ActElem, Device, HostWeights, MoeLayer, RuntimeError};
use moeforge::{moe_kernel, ActDtype, Arch, KernelFamily, MoeSpec};
use std::process::ExitCode;

/// The error a layer's output may have against the f64 reference on the same (quantized) weights:
/// the bound moeforge's GPU tests hold every format to (moe-runtime/tests/gpu_decode.rs,
/// gpu_formats.rs).
const MAX_REL_L2: f64 = 5e-3;
const MIN_COSINE: f64 = 0.99999;

/// Qwen3-30B-A3B's MoE layer.
#[moe_kernel(
    hidden = 2048,
    intermediate = 768,
    experts = 128,
    top_k = 8,
    format = bf16,
    activation = silu,
    archs = [sm_90a, sm_100a, sm_120a]
)]
pub struct Qwen3Moe;

/// OLMoE's MoE layer, with fp8 weights (one fp32 scale per output row).
#[moe_kernel(hidden = 2048, intermediate = 1024, experts = 64, top_k = 8, format = fp8_e4m3)]
pub struct OlmoeFp8;

type Load = fn(&Device, &HostWeights) -> Result<MoeLayer, RuntimeError>;

/// What main needs of a declared layer.
struct Model {
    name: &'static str,
    spec: MoeSpec,
    archs: &'static [Arch],
    source: fn(KernelFamily, Arch) -> Option<moeforge::KernelSource>,
    load: Load,
}

const MODELS: [Model; 2] = [
    Model {
        name: "Qwen3Moe",
        spec: Qwen3Moe::SPEC,
        archs: Qwen3Moe::ARCHS,
        source: Qwen3Moe::kernel_source,
        load: Qwen3Moe::load,
    },
    Model {
        name: "OlmoeFp8",
        spec: OlmoeFp8::SPEC,
        archs: OlmoeFp8::ARCHS,
        source: OlmoeFp8::kernel_source,
        load: OlmoeFp8::load,
    },
];

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut rendered = 0;
    for m in &MODELS {
        println!("{}: {:?}", m.name, m.spec);
        for &arch in m.archs {
            let k = (m.source)(KernelFamily::WarpDecode, arch).expect("declared arch has a source");
            println!("  {arch}: {} ({} bytes, {} entry points)", k.name, k.source.len(), k.entry_points.len());
            rendered += 1;
        }
    }

    let device = match Device::new(0) {
        Ok(d) => d,
        Err(e) => {
            println!("no GPU found: rendered {rendered} kernels ({e})");
            return Ok(());
        }
    };
    println!("GPU 0: {} ({})", device.name(), device.arch());
    for m in &MODELS {
        decode_step(m, &device)?;
    }
    Ok(())
}

/// Load the layer with random weights, run one 4-token step, compare with the CPU reference; an
/// error when the output is outside the tolerance.
fn decode_step(m: &Model, device: &Device) -> Result<(), Box<dyn std::error::Error>> {
    let spec = m.spec;
    let weights = random_weights(&spec, 1);
    let layer = (m.load)(device, &weights)?;
    let (x, ids, rw) = random_step(&spec, 4, 0.0, 2);
    let y = match spec.act_dtype() {
        ActDtype::Bf16 => forward::<half::bf16>(&layer, &x, &ids, &rw)?,
        ActDtype::Fp16 => forward::<half::f16>(&layer, &x, &ids, &rw)?,
    };
    let (rel, cos) = compare(&y, &moe_forward(&spec, &weights, &x, &ids, &rw));
    println!("  {}: 4-token step, relative L2 error {rel:.2e}, cosine {cos:.8}", m.name);
    check_tolerance(m.name, rel, cos)?;
    Ok(())
}

/// One forward with activations of type `T` (the spec's dtype); `y` starts as NaN, so that an
/// output the kernels do not write fails the check.
fn forward<T: ActElem>(layer: &MoeLayer, x: &[f32], ids: &[i32], rw: &[f32]) -> Result<Vec<f32>, RuntimeError> {
    let s = layer.stream();
    let xs: Vec<T> = x.iter().map(|&v| T::from_f32(v)).collect();
    let (xd, idd, wd) = (s.clone_htod(&xs)?, s.clone_htod(ids)?, s.clone_htod(rw)?);
    let mut yd = s.clone_htod(&vec![T::from_f32(f32::NAN); xs.len()])?;
    layer.forward(&xd, &idd, &wd, &mut yd)?;
    Ok(s.clone_dtoh(&yd)?.into_iter().map(T::to_f32).collect())
}

/// `Err` unless `rel <= MAX_REL_L2` and `cos >= MIN_COSINE` (NaN fails both).
fn check_tolerance(name: &str, rel: f64, cos: f64) -> Result<(), String> {
    if rel <= MAX_REL_L2 && cos >= MIN_COSINE {
        Ok(())
    } else {
        Err(format!(
            "{name}: output does not match the CPU reference: relative L2 {rel:.2e} (at most {MAX_REL_L2:.0e}), \
             cosine {cos:.8} (at least {MIN_COSINE})"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tolerance_rejects_what_is_outside_it() {
        assert!(check_tolerance("t", 1.9e-3, 0.999_999).is_ok());
        assert!(check_tolerance("t", MAX_REL_L2, MIN_COSINE).is_ok());
        assert!(check_tolerance("t", 6e-3, 0.999_999).is_err());
        assert!(check_tolerance("t", 1e-3, 0.9999).is_err());
        assert!(check_tolerance("t", f64::NAN, f64::NAN).is_err());
    }
}
