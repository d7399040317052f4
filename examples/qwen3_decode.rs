//! The main job: one Qwen3-30B-A3B-shaped MoE layer (hidden 2048, intermediate 768, 128 experts,
//! top-8) through warp decode.
//!
//! With a GPU: random weights, a random decode step, the output checked against the f64 CPU
//! reference, then the latency of the whole layer (CUDA-graph replay over weight copies that
//! exceed L2) and its share of the device-to-device copy bandwidth measured in the same run.
//! Without a GPU: the kernels are rendered and compiled for sm_90a, sm_100a and sm_120a, and the
//! CPU reference runs on one step.
//!
//! `cargo run --release --example qwen3_decode -- [--format FORMAT] [--act-dtype bf16|fp16] [--m 1]`
//! (every weight format; the activations `x` / `y` take the spec's dtype: the format's default
//! unless `--act-dtype` names one).

use clap::Parser;
use moeforge::codegen::{render, ActDtype, Arch, KernelFamily, MoeSpec, SpecError, WeightFormat};
use moeforge::runtime::reference::{compare, moe_forward};
use moeforge::runtime::testing::{fresh_seed, random_step, random_weights};
use moeforge::runtime::timing::{capture, copy_gbps, time_graph};
use moeforge::runtime::{compile, toolkit::toolkit, ActElem, CompileOptions, Device, HostWeights, MoeLayer};
use std::process::ExitCode;

#[derive(Parser)]
struct Args {
    /// Weight format (bf16, fp16, fp8_e4m3, int4_g128, nvfp4, ...).
    #[arg(long, default_value = "bf16")]
    format: WeightFormat,
    /// Activation dtype of `x` and `y` (bf16 or fp16); default: the format's (fp16 for fp16
    /// weights, bf16 otherwise).
    #[arg(long)]
    act_dtype: Option<ActDtype>,
    /// Tokens in the decode step (at least 1).
    #[arg(long, default_value_t = 1, value_parser = tokens)]
    m: usize,
}

/// `--m`: a token count of at least 1 (a step of 0 tokens would check and time nothing).
fn tokens(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("a decode step needs at least 1 token".into()),
        Ok(m) => Ok(m),
        Err(e) => Err(e.to_string()),
    }
}

/// The error the output may have against the f64 reference (on the same quantized weights): the
/// bound the GPU tests hold every format to (moe-runtime/tests/gpu_decode.rs, gpu_formats.rs).
const MAX_REL_L2: f64 = 5e-3;
const MIN_COSINE: f64 = 0.99999;

/// Weight copies cycled through while timing, so that no expert row is served from L2.
const LAYERS: usize = 4;

fn main() -> ExitCode {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Qwen3-30B-A3B's MoE layer in the format and activation dtype asked for.
fn spec(args: &Args) -> Result<MoeSpec, SpecError> {
    let b = MoeSpec::builder(2048, 768, 128, 8).weight_format(args.format);
    match args.act_dtype {
        Some(d) => b.act_dtype(d).build(),
        None => b.build(),
    }
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let spec = spec(&args)?;
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
    let step = Step { spec, weights: &weights, x: &x, ids: &ids, rw: &rw, want: &want, m: args.m };
    match spec.act_dtype() {
        ActDtype::Bf16 => on_gpu::<half::bf16>(&dev, &step),
        ActDtype::Fp16 => on_gpu::<half::f16>(&dev, &step),
    }
}

/// The step the GPU runs and what it must produce.
struct Step<'a> {
    spec: MoeSpec,
    weights: &'a HostWeights,
    x: &'a [f32],
    ids: &'a [i32],
    rw: &'a [f32],
    want: &'a [f64],
    m: usize,
}

/// Check one forward against the reference, then time the layer, with activations of type `T`
/// (the spec's activation dtype).
fn on_gpu<T: ActElem>(dev: &Device, st: &Step) -> Result<(), Box<dyn std::error::Error>> {
    let spec = st.spec;
    let layer = MoeLayer::load(dev, spec, st.weights)?;
    let s = dev.stream().clone();
    let xs: Vec<T> = st.x.iter().map(|&v| T::from_f32(v)).collect();
    let (xd, idd, wd) = (s.clone_htod(&xs)?, s.clone_htod(st.ids)?, s.clone_htod(st.rw)?);
    // Poisoned with NaN, so that an output the kernels do not write cannot pass.
    let mut yd = s.clone_htod(&vec![T::from_f32(f32::NAN); xs.len()])?;
    layer.forward(&xd, &idd, &wd, &mut yd)?;
    let got: Vec<f32> = s.clone_dtoh(&yd)?.into_iter().map(T::to_f32).collect();
    let (rel, cos) = compare(&got, st.want);
    println!("check vs f64 reference: rel L2 {rel:.2e}, cosine {cos:.8}");
    if !(rel <= MAX_REL_L2 && cos >= MIN_COSINE) {
        return Err(format!(
            "output does not match the reference (rel L2 {rel:.2e}, cosine {cos:.8}; \
             bound rel L2 <= {MAX_REL_L2:.0e}, cosine >= {MIN_COSINE})"
        )
        .into());
    }

    // Timing: LAYERS copies of the weights, one forward each, captured in one graph.
    let layers: Vec<MoeLayer> = (0..LAYERS).map(|_| MoeLayer::load(dev, spec, st.weights)).collect::<Result<_, _>>()?;
    for l in &layers {
        l.reserve(st.m)?; // nothing may allocate inside the capture
    }
    let zeros = vec![T::from_f32(0.0); xs.len()];
    let mut ys: Vec<_> = (0..LAYERS).map(|_| s.clone_htod(&zeros)).collect::<Result<_, _>>()?;
    let graph = capture(&s, || {
        for (l, y) in layers.iter().zip(ys.iter_mut()) {
            l.forward(&xd, &idd, &wd, y)?;
        }
        Ok(())
    })?;
    let us = time_graph(&s, &graph, 100)? / LAYERS as f64;
    let mut experts = st.ids.to_vec();
    experts.sort_unstable();
    experts.dedup();
    let act_bytes = 2 * xs.len() * std::mem::size_of::<T>(); // x read, y written
    let bytes = (experts.len() * spec.expert_bytes() + act_bytes + st.ids.len() * 8) as f64;
    let copy = copy_gbps(&s)?;
    let gbps = bytes / (us * 1e-6) / 1e9;
    println!(
        "layer latency {us:.2} us at M={}: {:.1} MB touched, {gbps:.0} GB/s = {:.1}% of the {copy:.0} GB/s copy bandwidth",
        st.m,
        bytes / 1e6,
        100.0 * gbps / copy
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("qwen3_decode").chain(args.iter().copied()))
    }

    #[test]
    fn a_step_of_zero_tokens_is_refused() {
        let e = parse(&["--m", "0"]).err().expect("--m 0 must be refused");
        assert!(e.to_string().contains("at least 1 token"), "{e}");
        assert_eq!(parse(&["--format", "fp8_e4m3", "--m", "4"]).unwrap().m, 4);
    }

    /// Every format gives a spec (whose activation dtype `on_gpu` is then run with); `--act-dtype`
    /// overrides the format's default where the pair is valid.
    #[test]
    fn every_format_gives_a_spec() {
        for f in WeightFormat::ALL {
            let s = spec(&parse(&["--format", f.name()]).unwrap()).unwrap();
            assert_eq!((s.weight_format(), s.act_dtype()), (f, f.default_act_dtype()));
        }
        let s = spec(&parse(&["--act-dtype", "fp16"]).unwrap()).unwrap();
        assert_eq!(s.act_dtype(), ActDtype::Fp16);
        assert!(spec(&parse(&["--format", "fp16", "--act-dtype", "bf16"]).unwrap()).is_err());
    }
}
