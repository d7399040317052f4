//! Quantized weight formats on a real GPU, every format x dequant variant the device's arch has.
//! Ignored without a GPU; each test fails (never passes) when no GPU is found. Run on a GPU machine:
//!
//! ```text
//! cargo test --release -p moe-runtime --test gpu_formats -- --ignored --nocapture --test-threads=1
//! ```
//!
//! (`--release`: the tests quantize and dequantize hundreds of millions of weights on the CPU.)
//!
//! - `dequant_probe_is_bit_exact`: the probe kernel (the very dequant include the kernels render)
//!   decodes random packed matrices, every code and, in a second pass, scales over their whole
//!   range; each `w * group_scale * row_scale` must equal the Rust dequantizer's bit for bit.
//! - `qwen3_30b_a3b_formats_match_reference`, `gpt_oss_20b_formats_match_reference`: the layer,
//!   its weights quantized from random f32 weights, against the f64 reference on the dequantized
//!   weights (asserted: relative L2 <= 5e-3, cosine >= 0.99999) for M = 1, 8, 64, with tiles of one token and the default cap;
//!   the error against the original f32 weights is printed, not asserted.

use moe_codegen::{render, render_dequant_probe, KernelFamily, MoeSpec, WeightFormat, REFERENCE_GEOMETRIES};
use moe_runtime::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use moe_runtime::reference::{compare, moe_forward, moe_forward_f32};
use moe_runtime::testing::{fresh_seed, random_f32_weights, random_packed, random_step};
use moe_runtime::{ActElem, Device, HostWeights, MoeLayer};

fn gpu() -> Device {
    Device::new(0).unwrap_or_else(|e| panic!("this test needs an NVIDIA GPU: {e}"))
}

// ---------------------------------------------------------------------------------------------
// (a) Bit-exact dequant.

/// Probe geometry: 128-row multiples for the block format, K a multiple of every group and of
/// 128, several tensors for the per-tensor NVFP4 global.
const PROBE: (usize, usize, usize) = (3, 256, 512);

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn dequant_probe_is_bit_exact() {
    let dev = gpu();
    let arch = dev.arch();
    let (t, n, k) = PROBE;
    let mut cases = Vec::new();
    let mut skipped = Vec::new();
    for f in WeightFormat::ALL {
        for &d in f.dequant_variants() {
            match render_dequant_probe(f, Some(d), arch, t, n, k) {
                Ok(src) => cases.push((f, d, src)),
                Err(e) => skipped.push(format!("{f} {d}: {e}")),
            }
        }
    }
    dev.prepare(&cases.iter().map(|c| c.2.clone()).collect::<Vec<_>>()).unwrap();
    let s = dev.stream().clone();
    let seed = fresh_seed();
    let mut failures = Vec::new();
    for (idx, (f, d, src)) in cases.iter().enumerate() {
        let module = dev.load(src).unwrap();
        let func = module.load_function("dequant_probe").unwrap();
        for wide in [false, true] {
            let p = random_packed(*f, t, n, k, seed.wrapping_add(idx as u64), wide);
            let want = f.dequantize(&p);
            let w: CudaSlice<u8> = s.clone_htod(&p.data).unwrap();
            let sc: CudaSlice<u8> = s.clone_htod(if p.scales.is_empty() { &[0u8; 16][..] } else { &p.scales }).unwrap();
            let mut out: CudaSlice<f32> = s.clone_htod(&vec![f32::NAN; want.len()]).unwrap();
            let vecs = (t * n * k / f.elems_per_16b() as usize) as u32;
            let cfg = LaunchConfig {
                grid_dim: (vecs.div_ceil(src.block_threads).min(4096), 1, 1),
                block_dim: (src.block_threads, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut launch = s.launch_builder(&func);
            launch.arg(&w).arg(&sc).arg(&mut out);
            unsafe { launch.launch(cfg) }.unwrap();
            let got = s.clone_dtoh(&out).unwrap();
            let bad: Vec<usize> = (0..got.len()).filter(|&j| got[j].to_bits() != want[j].to_bits()).collect();
            if let Some(&j) = bad.first() {
                failures.push(format!(
                    "{f} {d} wide={wide}: {} of {} differ; first at row {} col {}: gpu {} ({:#010x}), rust {} ({:#010x})",
                    bad.len(),
                    got.len(),
                    j / k,
                    j % k,
                    got[j],
                    got[j].to_bits(),
                    want[j],
                    want[j].to_bits()
                ));
            }
        }
        println!("{:<16} {:<9} {arch}: checked", f.name(), d.name());
    }
    for sk in &skipped {
        println!("skipped (not on {arch}): {sk}");
    }
    assert!(failures.is_empty(), "seed {seed}:\n{}", failures.join("\n"));
    println!("{} format x variant probes bit-exact on {arch}, {} skipped (seed {seed})", cases.len(), skipped.len());
}

// ---------------------------------------------------------------------------------------------
// (b) Layer correctness.

const MS: [usize; 3] = [1, 8, 64];

/// Run a step with the default token-tile cap and with tiles of one token; the worse (rel L2,
/// cos) of the two against `want`, and the default's output.
fn run_step<T: ActElem>(
    layer: &mut MoeLayer,
    x: &[f32],
    ids: &[i32],
    rw: &[f32],
    want: &[f64],
) -> ((f64, f64), Vec<f32>) {
    let s = layer.stream().clone();
    let xs: Vec<T> = x.iter().map(|&v| T::from_f32(v)).collect();
    let (xd, idd, rwd) = (s.clone_htod(&xs).unwrap(), s.clone_htod(ids).unwrap(), s.clone_htod(rw).unwrap());
    let mut worst = (0f64, 1f64);
    let mut out = Vec::new();
    for cap in [1, moe_runtime::DEFAULT_MAX_TOKEN_TILE] {
        layer.set_max_token_tile(cap).unwrap();
        // Poisoned with NaN so that an unwritten output cannot pass.
        let mut y = s.clone_htod(&vec![T::from_f32(f32::NAN); x.len()]).unwrap();
        layer.forward(&xd, &idd, &rwd, &mut y).unwrap();
        let got: Vec<f32> = s.clone_dtoh(&y).unwrap().into_iter().map(T::to_f32).collect();
        let unwritten = got.iter().filter(|v| !v.is_finite()).count();
        assert_eq!(unwritten, 0, "{} cap={cap}: {unwritten} outputs unwritten or non-finite", layer.spec().id());
        let (rel, cos) = compare(&got, want);
        worst = (worst.0.max(rel), worst.1.min(cos));
        out = got;
    }
    (worst, out)
}

fn geometry_formats(name: &str) {
    let dev = gpu();
    let arch = dev.arch();
    let (_, h, i, e, k) = REFERENCE_GEOMETRIES.iter().copied().find(|g| g.0 == name).unwrap();
    let base = MoeSpec::builder(h, i, e, k).build().unwrap();
    let seed = fresh_seed();
    println!("{name}: seed {seed}");
    let (w13, w2) = random_f32_weights(&base, seed);
    let steps: Vec<_> = MS.iter().map(|&m| random_step(&base, m, 0.3, seed.wrapping_add(m as u64))).collect();
    // The exact layer on the original f32 weights, once per step (bf16-rounded x: the same for
    // every format but fp16's, whose x is fp16-rounded; see below).
    let exact: Vec<Vec<f64>> = steps.iter().map(|(x, ids, rw)| moe_forward_f32(&base, &w13, &w2, x, ids, rw)).collect();

    // Every (format, variant) the geometry and the arch take; compile them all up front, in parallel.
    let mut specs = Vec::new();
    for f in WeightFormat::ALL {
        match MoeSpec::builder(h, i, e, k).weight_format(f).build() {
            Ok(_) => {}
            Err(err) => {
                println!("{name}: {f} skipped: {err}");
                continue;
            }
        }
        for &d in f.dequant_variants() {
            let spec = MoeSpec::builder(h, i, e, k).weight_format(f).dequant(d).build().unwrap();
            match render(&spec, KernelFamily::WarpDecode, arch) {
                Ok(src) => specs.push((spec, src)),
                Err(err) => println!("{name}: {f} {d} skipped: {err}"),
            }
        }
    }
    dev.prepare(&specs.iter().map(|s| s.1.clone()).collect::<Vec<_>>()).unwrap();

    let mut failures = Vec::new();
    let mut rows = Vec::new();
    for f in WeightFormat::ALL {
        let variants: Vec<_> = specs.iter().filter(|s| s.0.weight_format() == f).collect();
        let Some(first) = variants.first() else { continue };
        let spec0 = first.0;
        let t0 = std::time::Instant::now();
        let w = HostWeights::quantize(&spec0, &w13, &w2).unwrap();
        let quant_s = t0.elapsed().as_secs_f64();
        // The reference on the dequantized weights, once per step, shared by the variants.
        let refs: Vec<(Vec<f32>, Vec<f64>)> = steps
            .iter()
            .map(|(x, ids, rw)| {
                let x: Vec<f32> = x.iter().map(|&v| spec0.act_dtype().round(v)).collect();
                let want = moe_forward(&spec0, &w, &x, ids, rw);
                (x, want)
            })
            .collect();
        for (spec, src) in variants {
            let d = spec.dequant().expect("named");
            let mut layer = MoeLayer::with_source(&dev, *spec, src.clone(), &w).unwrap();
            // Warp decode under test: keep every step off the grouped family.
            layer.set_prefill_threshold(usize::MAX);
            layer.set_validate_routing(true);
            for (si, &m) in MS.iter().enumerate() {
                let (x, want) = &refs[si];
                let (_, ids, rw) = &steps[si];
                let ((rel, cos), got) = match spec.act_dtype() {
                    moe_codegen::ActDtype::Bf16 => run_step::<half::bf16>(&mut layer, x, ids, rw, want),
                    moe_codegen::ActDtype::Fp16 => run_step::<half::f16>(&mut layer, x, ids, rw, want),
                };
                // Against the original weights (x rounded to bf16 there; fp16 for fp16 weights).
                let exact_m = if spec.act_dtype() == base.act_dtype() {
                    exact[si].clone()
                } else {
                    moe_forward_f32(&base, &w13, &w2, x, ids, rw)
                };
                let (rel_f32, cos_f32) = compare(&got, &exact_m);
                let line = format!(
                    "{name:<14} {:<15} {:<9} m={m:<3} vs dequantized: rel_l2={rel:.3e} cos={cos:.8}   vs f32 weights: rel_l2={rel_f32:.3e} cos={cos_f32:.6}",
                    f.name(),
                    d.name()
                );
                println!("{line}");
                rows.push(line);
                if !(rel <= 5e-3 && cos >= 0.99999) {
                    failures.push(format!("{} {d} m={m}: rel_l2 {rel:.3e}, cos {cos:.8}", f.name()));
                }
            }
        }
        println!("{name:<14} {:<15} quantized in {quant_s:.1} s", f.name());
    }
    assert!(failures.is_empty(), "{name} (seed {seed}):\n{}", failures.join("\n"));
    println!("{name}: {} (format, variant, m) cases within rel_l2 <= 5e-3, cos >= 0.99999", rows.len());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn qwen3_30b_a3b_formats_match_reference() {
    geometry_formats("qwen3-30b-a3b");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpt_oss_20b_formats_match_reference() {
    geometry_formats("gpt-oss-20b");
}
