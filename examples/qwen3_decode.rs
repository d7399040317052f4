//! The main job: one Qwen3-30B-A3B-shaped MoE layer (hidden 2048, intermediate 768, 128 experts,
//! top-8) through warp decode.
//!
//! With a GPU: random weights, a random decode step, the output checked against the f64 CPU
//! reference, then the latency of the whole layer (CUDA-graph replay over weight copies that
//! exceed L2) and its share of the device-to-device copy bandwidth measured in the same run.
//! Without a GPU: the kernels are rendered and compiled for sm_90a, sm_100a and sm_120a, and the
//! CPU reference runs on one step.
//!
//! `cargo run --release --example qwen3_decode -- [--format bf16|fp16|fp8_e4m3] [--m 1]`

use clap::Parser;
use moeforge::codegen::{render, Arch, KernelFamily, MoeSpec, WeightFormat};
use moeforge::runtime::reference::{compare, moe_forward};
use moeforge::runtime::testing::{fresh_seed, random_step, random_weights};
use moeforge::runtime::timing::{capture, copy_gbps, time_graph};
use moeforge::runtime::{compile, toolkit::toolkit, CompileOptions, Device, MoeLayer};

#[derive(Parser)]
struct Args {
    /// Weight format.
    #[arg(long, default_value = "bf16")]
    format: WeightFormat,
    /// Tokens in the decode step.
    #[arg(long, default_value_t = 1)]
    m: usize,
}

/// Weight copies cycled through while timing, so that no expert row is served from L2.
const LAYERS: usize = 4;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    let args = Args::parse();
    let spec = MoeSpec::builder(2048, 768, 128, 8).weight_format(args.format).build()?;
    let seed = fresh_seed();
    println!("spec {} (seed {seed})", spec.id());
    let weights = random_weights(&spec, seed);
    let (x, ids, rw) = random_step(&spec, args.m, 0.0, seed + 1);
    let t0 = std::time::Instant::now();
    let want = moe_forward(&spec, &weights, &x, &ids, &rw);
    println!("CPU f64 reference: {} outputs in {:.0} ms", want.len(), t0.elapsed().as_secs_f64() * 1e3);

    let dev = match Device::new(0) {
        Ok(d) => d,
        Err(e) => {
            let tk = toolkit()?;
            for arch in Arch::ALL {
                let src = render(&spec, KernelFamily::WarpDecode, arch)?;
                let t = std::time::Instant::now();
                let c = compile(&src, &CompileOptions::for_arch(tk, arch))?;
                println!(
                    "compiled {} for {arch}: {} entry points, {} B CUBIN, {:.1} s",
                    src.name,
                    src.entry_points.len(),
                    c.cubin.len(),
                    t.elapsed().as_secs_f64()
                );
            }
            println!("no GPU found ({e}): kernels rendered and compiled for all three archs, CPU reference run");
            return Ok(());
        }
    };

    println!("device: {} ({})", dev.name(), dev.arch());
    let layer = MoeLayer::load(&dev, spec, &weights)?;
    let s = dev.stream().clone();
    let xs: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
    let (xd, idd, wd) = (s.clone_htod(&xs)?, s.clone_htod(&ids)?, s.clone_htod(&rw)?);
    let mut yd = s.clone_htod(&vec![half::bf16::NAN; xs.len()])?;
    layer.forward(&xd, &idd, &wd, &mut yd)?;
    let got: Vec<f32> = s.clone_dtoh(&yd)?.into_iter().map(|v| v.to_f32()).collect();
    let (rel, cos) = compare(&got, &want);
    println!("check vs f64 reference: rel L2 {rel:.2e}, cosine {cos:.8}");
    if !(rel <= 5e-3 && cos >= 0.99999) {
        return Err(format!("output does not match the reference (rel {rel:.2e}, cos {cos:.8})").into());
    }

    // Timing: LAYERS copies of the weights, one forward each, captured in one graph.
    let layers: Vec<MoeLayer> = (0..LAYERS).map(|_| MoeLayer::load(&dev, spec, &weights)).collect::<Result<_, _>>()?;
    for l in &layers {
        l.reserve(args.m)?; // nothing may allocate inside the capture
    }
    let mut ys: Vec<_> = (0..LAYERS).map(|_| s.alloc_zeros::<half::bf16>(xs.len())).collect::<Result<_, _>>()?;
    let graph = capture(&s, || {
        for (l, y) in layers.iter().zip(ys.iter_mut()) {
            l.forward(&xd, &idd, &wd, y)?;
        }
        Ok(())
    })?;
    let us = time_graph(&s, &graph, 100)? / LAYERS as f64;
    let mut experts = ids.clone();
    experts.sort_unstable();
    experts.dedup();
    let bytes = (experts.len() * spec.expert_bytes() + 2 * xs.len() * 2 + ids.len() * 8) as f64;
    let copy = copy_gbps(&s)?;
    let gbps = bytes / (us * 1e-6) / 1e9;
    println!(
        "layer latency {us:.2} us at M={}: {:.1} MB touched, {gbps:.0} GB/s = {:.1}% of the {copy:.0} GB/s copy bandwidth",
        args.m,
        bytes / 1e6,
        100.0 * gbps / copy
    );
    Ok(())
}
