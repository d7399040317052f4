//! Two MoE layers declared with `#[moe_kernel]`: their specs were checked and their CUDA sources
//! rendered when this crate compiled. On a GPU, each is loaded and one decode step is checked
//! against the CPU reference.

use half::bf16;
use moeforge::runtime::reference::{compare, moe_forward};
use moeforge::runtime::testing::{random_step, random_weights};
use moeforge::runtime::{Device, HostWeights, MoeLayer, RuntimeError};
use moeforge::{moe_kernel, Arch, KernelFamily, MoeSpec};

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

fn main() -> Result<(), Box<dyn std::error::Error>> {
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

/// Load the layer with random weights, run one 4-token step, compare with the CPU reference.
fn decode_step(m: &Model, device: &Device) -> Result<(), Box<dyn std::error::Error>> {
    let spec = m.spec;
    let weights = random_weights(&spec, 1);
    let layer = (m.load)(device, &weights)?;
    let (x, ids, rw) = random_step(&spec, 4, 0.0, 2);
    let s = layer.stream();
    let xs: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let (xd, idd, wd) = (s.clone_htod(&xs)?, s.clone_htod(&ids)?, s.clone_htod(&rw)?);
    let mut yd = s.alloc_zeros::<bf16>(xs.len())?;
    layer.forward(&xd, &idd, &wd, &mut yd)?;
    let y: Vec<f32> = s.clone_dtoh(&yd)?.into_iter().map(f32::from).collect();
    let (rel, cos) = compare(&y, &moe_forward(&spec, &weights, &x, &ids, &rw));
    println!("  {}: 4-token step, relative L2 error {rel:.2e}, cosine {cos:.6}", m.name);
    Ok(())
}
