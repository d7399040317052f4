//! One MoE layer of a local Hugging Face checkpoint, loaded into moeforge and run.
//!
//! Loads layer `--layer` of the snapshot in `--model` (config.json + safetensors shards), prints
//! the spec, routes `--tokens` random tokens through the checkpoint's own router and computes the
//! layer with the f64 CPU reference. With a GPU it then runs the same step on the device (routing
//! there too, from the router logits), checks it against the reference, and prints the kernel
//! family the step took and the layer's latency (CUDA-graph replay). gpt-oss runs like the others:
//! its spec has the clamped SwiGLU (`swiglu_oai`) and per-expert biases, its router logits the
//! router bias; a spec with biases runs warp decode at every step size. Shared experts
//! (DeepSeek-V3, Kimi-K2, Qwen2-MoE) are in the layer and computed in the same step, from the
//! routed routing alone.
//!
//! `cargo run --release -p moe-checkpoint --example load_checkpoint -- --model DIR --layer N [--tokens M]`

use clap::Parser;
use moe_checkpoint::{load_layer, LoadedLayer};
use moe_runtime::reference::{compare, moe_forward, route};
use moe_runtime::timing::{capture, time_graph};
use moe_runtime::{ActElem, Device, MoeLayer};
use rand::{Rng, SeedableRng};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
struct Args {
    /// The checkpoint directory (a Hugging Face snapshot: config.json and *.safetensors).
    #[arg(long)]
    model: PathBuf,
    /// The layer to load.
    #[arg(long)]
    layer: usize,
    /// Tokens in the step.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    tokens: u32,
}

/// The bound the decode GPU tests hold every format to.
const MAX_REL_L2: f64 = 1e-2;

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let cfg = moe_checkpoint::inspect(&args.model)?;
    println!(
        "{}: {} layers, hidden {}, {} experts of intermediate {}, top-{}, router {}, {:?}",
        cfg.model, cfg.layers, cfg.hidden, cfg.experts, cfg.intermediate, cfg.top_k, cfg.router, cfg.quant
    );
    let t0 = std::time::Instant::now();
    let l = load_layer(&args.model, args.layer)?;
    println!("layer {} loaded in {:.2} s: spec {}", args.layer, t0.elapsed().as_secs_f64(), l.spec.id());
    if l.spec.has_bias() {
        println!(
            "activation {}, per-expert biases (w13_bias {} f32, w2_bias {} f32){}",
            l.spec.activation(),
            l.weights.w13_bias.len(),
            l.weights.w2_bias.len(),
            if l.router.logit_bias.is_some() { ", router logit bias" } else { "" }
        );
    }
    if l.spec.shared_experts() > 0 {
        let how = if l.spec.shared_gated() { "weight sigmoid(shared_gate . x)" } else { "weight 1" };
        println!(
            "{} shared experts of intermediate {} after the {} routed ones ({how}), computed in the step",
            l.spec.shared_experts(),
            l.spec.intermediate(),
            l.spec.experts()
        );
    }

    let (h, m) = (l.spec.hidden() as usize, args.tokens as usize);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    let act = l.spec.act_dtype();
    let x: Vec<f32> = (0..m * h).map(|_| act.round(rng.random_range(-1.0f32..1.0))).collect();
    let logits = l.router.logits(&x);
    let bias = l.router.correction_bias.clone().unwrap_or_else(|| vec![0.0; l.spec.experts() as usize]);
    let (ids, w) = route(&l.spec, &logits, &bias);
    let t = std::time::Instant::now();
    // The routed routing [M, k]: the reference appends the shared experts itself.
    let want = moe_forward(&l.spec, &l.weights, &x, &ids, &w);
    let rms = (want.iter().map(|v| v * v).sum::<f64>() / want.len() as f64).sqrt();
    println!(
        "CPU f64 reference, {m} tokens in {:.0} ms: token 0 -> experts {:?} weights {:?}; output rms {rms:.4e}, y[0][..4] {:?}",
        t.elapsed().as_secs_f64() * 1e3,
        &ids[..l.spec.top_k() as usize],
        &w[..l.spec.top_k() as usize],
        &want[..4.min(h)]
    );

    let dev = match Device::new(0) {
        Ok(d) => d,
        Err(e) => {
            println!("no GPU ({e}): CPU reference only");
            return Ok(());
        }
    };
    println!("device: {} ({})", dev.name(), dev.arch());
    match act {
        moe_codegen::ActDtype::Bf16 => on_gpu::<half::bf16>(&dev, &l, &x, &logits, &want),
        moe_codegen::ActDtype::Fp16 => on_gpu::<half::f16>(&dev, &l, &x, &logits, &want),
    }
}

/// The step on the device (routing from the logits there), checked, then timed.
fn on_gpu<T: ActElem>(
    dev: &Device,
    l: &LoadedLayer,
    x: &[f32],
    logits: &[f32],
    want: &[f64],
) -> Result<(), Box<dyn std::error::Error>> {
    let m = x.len() / l.spec.hidden() as usize;
    let t = std::time::Instant::now();
    let mut layer = MoeLayer::load(dev, l.spec, &l.weights)?;
    if let Some(b) = &l.router.correction_bias {
        layer.set_router_bias(b)?;
    }
    layer.reserve(m)?;
    println!("uploaded and compiled in {:.2} s", t.elapsed().as_secs_f64());
    let s = layer.stream().clone();
    let xs: Vec<T> = x.iter().map(|&v| T::from_f32(v)).collect();
    let (dx, dl) = (s.clone_htod(&xs)?, s.clone_htod(logits)?);
    let mut y = s.clone_htod(&vec![T::from_f32(0.0); xs.len()])?;
    layer.forward_logits(&dx, &dl, &mut y)?;
    let got: Vec<f32> = s.clone_dtoh(&y)?.into_iter().map(T::to_f32).collect();
    let (rel, cos) = compare(&got, want);
    println!("GPU step vs CPU reference: rel L2 {rel:.2e}, cosine {cos:.8}");
    if rel > MAX_REL_L2 {
        return Err(format!("the GPU step does not match the reference (rel L2 {rel:.2e} > {MAX_REL_L2:.0e})").into());
    }
    // The family moe_runtime::dispatch picks for this step size, and the layer's latency.
    let graph = capture(&s, || layer.forward_logits(&dx, &dl, &mut y))?;
    let us = time_graph(&s, &graph, 100)?;
    let family = layer.last_choice()?.family;
    println!("layer, M = {m}: family {family}, {us:.2} us per step (router and shared experts included)");
    Ok(())
}
