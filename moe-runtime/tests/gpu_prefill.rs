//! The grouped-GEMM (prefill) family on a real GPU: router and alignment against CPU references,
//! the whole layer against the f64 reference, graph capture. Ignored without a GPU; each test
//! fails (never passes) when no GPU is found.

use moe_codegen::{GroupLimited, KernelFamily, MoeSpec, Router, WeightFormat, REFERENCE_GEOMETRIES};
use moe_runtime::cudarc::driver::CudaSlice;
use moe_runtime::reference::{compare, moe_forward, moe_forward_fp8_acts, route};
use moe_runtime::testing::{fresh_seed, random_step, random_weights};
use moe_runtime::timing::capture;
use moe_runtime::{Device, HostWeights, MoeLayer};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

type Bf = half::bf16;

fn gpu() -> Device {
    Device::new(0).unwrap_or_else(|e| panic!("this test needs an NVIDIA GPU: {e}"))
}

fn up<T: moe_runtime::cudarc::driver::DeviceRepr + Copy>(layer: &MoeLayer, v: &[T]) -> CudaSlice<T> {
    layer.stream().clone_htod(v).unwrap()
}
fn bf(v: &[f32]) -> Vec<Bf> {
    v.iter().map(|&x| Bf::from_f32(x)).collect()
}
fn poisoned(layer: &MoeLayer, n: usize) -> CudaSlice<Bf> {
    up(layer, &vec![Bf::from_f32(f32::NAN); n])
}
fn down(layer: &MoeLayer, y: &CudaSlice<Bf>) -> Vec<f32> {
    layer.stream().clone_dtoh(y).unwrap().into_iter().map(|v| v.to_f32()).collect()
}

/// Small layer for router / alignment tests (weights do not matter there).
fn small(dev: &Device, router: Router, experts: u32, top_k: u32) -> (MoeLayer, HostWeights) {
    let spec = MoeSpec::builder(256, 128, experts, top_k).build().unwrap().with_router(router).unwrap();
    let w = random_weights(&spec, fresh_seed());
    let mut layer = MoeLayer::load(dev, spec, &w).unwrap();
    layer.set_prefill_threshold(1);
    (layer, w)
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn router_matches_the_cpu_reference_ties_included() {
    let routers = [
        Router::Softmax { renormalize: true },
        Router::Softmax { renormalize: false },
        Router::GroupLimited(GroupLimited::new(8, 4, true, 2.5)),
        Router::GroupLimited(GroupLimited::new(4, 2, false, 1.0)),
    ];
    for router in routers {
        let (mut layer, _) = small(&gpu(), router, 64, 6);
        let spec = *layer.spec();
        let seed = fresh_seed();
        let mut rng = SmallRng::seed_from_u64(seed);
        let bias: Vec<f32> = (0..64).map(|_| rng.random_range(-0.1f32..0.1)).collect();
        layer.set_router_bias(&bias).unwrap();
        for (m, ties) in [(1usize, false), (17, true), (1000, false), (333, true)] {
            // Ties: logits from a handful of values, so many experts share a score.
            let logits: Vec<f32> = (0..m * 64)
                .map(|_| if ties { rng.random_range(0..4) as f32 * 0.5 } else { rng.random_range(-4.0f32..4.0) })
                .collect();
            let x = up(&layer, &bf(&vec![0.5; m * 256]));
            let mut y = poisoned(&layer, m * 256);
            layer.forward_logits(&x, &up(&layer, &logits), &mut y).unwrap();
            let (ids, w) = layer.last_routing(m).unwrap();
            let (want_ids, want_w) = route(&spec, &logits, &bias);
            // Where two sigmoid scores are a few ulps apart (not equal), the kernel's f32 expf and
            // the reference's f64 sigmoid may order them either way: at the edge of the choice
            // the token is skipped, inside it the same experts must be chosen in either order.
            let near = near_ties(&spec, &logits, &bias);
            let skipped = near.iter().filter(|n| n.edge).count();
            assert!(skipped <= m / 50 + 1, "{router} m={m}: {skipped} tokens on near-ties");
            let k = spec.top_k() as usize;
            let mut err = 0f32;
            for t in (0..m).filter(|&t| !near[t].edge) {
                let r = t * k..(t + 1) * k;
                let (got, want) = (&ids[r.clone()], &want_ids[r.clone()]);
                let sorted = |v: &[i32]| {
                    let mut v = v.to_vec();
                    v.sort();
                    v
                };
                if near[t].order {
                    assert_eq!(sorted(got), sorted(want), "{router} m={m} token {t} seed={seed}");
                } else {
                    assert_eq!(got, want, "{router} m={m} ties={ties} token {t} seed={seed}");
                }
                for (s, id) in got.iter().enumerate() {
                    let j = want.iter().position(|v| v == id).unwrap();
                    let (a, b) = (w[r.start + s], want_w[r.start + j]);
                    err = err.max((a - b).abs() / b.abs().max(1e-6));
                }
            }
            assert!(err < 1e-5, "{router} m={m}: weight rel err {err}");
            println!(
                "router {router:<16} m={m:<5} ties={ties:<5} ids exact, weights max rel err {err:.2e} \
                 ({skipped} tokens on near-ties)"
            );
        }
    }
}

/// Where a token's group-limited choice rests on two f32 scores that differ by less than 1e-6
/// (exact ties, which both sides break to the lowest id, count as decided): at the edge of the
/// kept groups or of the top k (`edge`: the set may differ), or between two chosen experts
/// (`order`: their slots may swap). Softmax routing chooses on the logits themselves, so both
/// sides compare the same values: never.
struct NearTie {
    edge: bool,
    order: bool,
}
fn near_ties(spec: &MoeSpec, logits: &[f32], bias: &[f32]) -> Vec<NearTie> {
    let (e, k) = (spec.experts() as usize, spec.top_k() as usize);
    let Router::GroupLimited(g) = spec.router() else {
        return logits.chunks(e).map(|_| NearTie { edge: false, order: false }).collect();
    };
    let close = |a: f32, b: f32| a != b && (a - b).abs() < 1e-6;
    let desc = |mut v: Vec<f32>| {
        v.sort_by(|a, b| b.total_cmp(a));
        v
    };
    let (gsize, kg) = (e / g.groups as usize, g.topk_groups as usize);
    logits
        .chunks(e)
        .map(|row| {
            let score: Vec<f32> =
                row.iter().zip(bias).map(|(&v, &b)| (1.0 / (1.0 + (-(v as f64)).exp())) as f32 + b).collect();
            let group = |j: usize| desc(score[j * gsize..(j + 1) * gsize].to_vec());
            let gscore: Vec<f32> = (0..g.groups as usize).map(|j| group(j)[0] + group(j)[1]).collect();
            let cut = desc(gscore.clone())[kg - 1];
            let inside = desc((0..g.groups as usize).filter(|&j| gscore[j] >= cut).flat_map(group).collect());
            let gs = desc(gscore);
            let edge =
                (kg < gs.len() && close(gs[kg - 1], gs[kg])) || (k < inside.len() && close(inside[k - 1], inside[k]));
            let order = inside[..k].windows(2).any(|p| close(p[0], p[1]));
            NearTie { edge, order }
        })
        .collect()
}

/// Routing whose histogram has empty experts, one expert taking everything, or spreads evenly.
fn routing_case(name: &str, m: usize, e: usize, k: usize, rng: &mut SmallRng) -> Vec<i32> {
    (0..m)
        .flat_map(|t| {
            let mut row: Vec<i32> = match name {
                // Every token on experts 0..k (with top-1: all on expert 0), the rest empty.
                "same_experts" => (0..k as i32).collect(),
                "few_experts" => (0..k).map(|s| (s * 2) as i32).collect(),
                _ => {
                    let mut v: Vec<i32> = (0..e as i32).collect();
                    for j in 0..k {
                        let r = rng.random_range(j..e);
                        v.swap(j, r);
                    }
                    v[..k].to_vec()
                }
            };
            row.rotate_left(t % k);
            row
        })
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn alignment_is_an_expert_contiguous_padded_permutation() {
    for k in [4usize, 1] {
        for cluster in [1, 2] {
            alignment_cases(k, cluster);
        }
    }
}

/// `cluster`: the GEMM blocks per cluster (warp-specialised pipeline only; elsewhere the case runs
/// with the device's default tiles), which must not change the padding.
fn alignment_cases(k: usize, cluster: u32) {
    let dev = gpu();
    let (mut layer, _) = small(&dev, Router::default(), 32, k as u32);
    let tiles = layer.grouped_tiles().unwrap();
    if tiles.warp_specialized && cluster > 1 {
        // Two column blocks per GEMM, which a cluster splits an expert's odd tile over.
        let t = moe_codegen::GemmTiles { cluster, bn1: 128, bn2: 128, ..tiles };
        layer.set_grouped_tiles(&dev, t).unwrap();
    }
    let e = 32usize;
    let mut rng = SmallRng::seed_from_u64(fresh_seed());
    for name in ["same_experts", "few_experts", "uniform"] {
        for m in [1usize, 17, 128, 1000, 20000] {
            let ids = routing_case(name, m, e, k, &mut rng);
            let w = vec![1.0 / k as f32; m * k];
            let x = up(&layer, &bf(&vec![0.1; m * 256]));
            let mut y = poisoned(&layer, m * 256);
            layer.forward_family(KernelFamily::GroupedGemm, &x, &up(&layer, &ids), &up(&layer, &w), &mut y).unwrap();
            let a = layer.last_alignment().unwrap();
            let (sorted, pos, tile_e, ntiles) = (a.sorted_rows, a.pair_pos, a.tile_expert, a.num_tiles);
            let mut count = vec![0usize; e];
            ids.iter().for_each(|&i| count[i as usize] += 1);
            // Each expert pads to whole 128-row tiles, in clusters too.
            let cl = layer.grouped_tiles().unwrap().cluster as usize;
            let tiles_of = |c: usize| c.div_ceil(128);
            let want_tiles: usize = count.iter().map(|&c| tiles_of(c)).sum();
            assert_eq!(ntiles as usize, want_tiles, "{name} m={m}");
            // Tiles in expert order, the hot experts' (HOT_TILES or more) first, each expert's count
            // of them.
            let hot = |x: usize| tiles_of(count[x]) >= moe_codegen::grouped::HOT_TILES as usize;
            let order: Vec<usize> = (0..e).filter(|&x| hot(x)).chain((0..e).filter(|&x| !hot(x))).collect();
            let mut want_e = Vec::new();
            for &x in &order {
                want_e.extend(std::iter::repeat_n(x as i32, tiles_of(count[x])));
            }
            assert_eq!(&tile_e[..want_tiles], &want_e[..], "{name} m={m}");
            let hot_tiles: usize = (0..e).filter(|&x| hot(x)).map(|x| tiles_of(count[x])).sum();
            assert_eq!(a.hot_tiles as usize, hot_tiles, "{name} m={m}: hot tiles");
            // Each tile's span: (first tile, tiles, expert, pairs) of its expert, the GEMMs' work order.
            let mut want_span = Vec::new();
            for &x in &order {
                let (first, t) = (want_span.len() as i32 / 4, tiles_of(count[x]) as i32);
                (0..t).for_each(|_| want_span.extend([first, t, x as i32, count[x] as i32]));
            }
            assert_eq!(&a.tile_span[..4 * want_tiles], &want_span[..], "{name} m={m}: tile spans");
            // GEMM1's own tiles: with extended items an expert's last tile holding no more than
            // `ext` pairs for each tile before it joins them; the spans' expert carries (layout
            // tile - GEMM1 tile) in its high 16 bits.
            let ext = layer.grouped_tiles().unwrap().extended_rows(layer.spec()) as usize;
            let spread = moe_codegen::grouped::ext_spread(layer.spec()) as usize;
            let joins = |c: usize| {
                let t = tiles_of(c);
                ext > 0 && t >= 2 && c - (t - 1) * 128 <= ext * (t - 1).min(spread)
            };
            let tiles1_of = |c: usize| tiles_of(c) - joins(c) as usize;
            let want1: usize = count.iter().map(|&c| tiles1_of(c)).sum();
            let hot1: usize = (0..e).filter(|&x| hot(x)).map(|x| tiles1_of(count[x])).sum();
            assert_eq!((a.num_tiles1 as usize, a.hot_tiles1 as usize), (want1, hot1), "{name} m={m}: GEMM1 tiles");
            let extended = count.iter().filter(|&&c| joins(c)).count();
            if ext > 0 {
                let (mut want_span1, mut first) = (Vec::new(), 0i32);
                for &x in &order {
                    let (f1, t1, t) =
                        (want_span1.len() as i32 / 4, tiles1_of(count[x]) as i32, tiles_of(count[x]) as i32);
                    let shifted = x as i32 | (first - f1) << 16;
                    (0..t1).for_each(|_| want_span1.extend([f1, t1, shifted, count[x] as i32]));
                    first += t;
                }
                assert_eq!(&a.tile_span1[..4 * want1], &want_span1[..], "{name} m={m}: GEMM1 spans");
            }
            let mut seen = vec![false; m * k];
            for (row, &p) in sorted[..want_tiles * 128].iter().enumerate() {
                if p < 0 {
                    continue;
                }
                let p = p as usize;
                assert!(!seen[p], "{name} m={m}: pair {p} twice");
                seen[p] = true;
                assert_eq!(ids[p], tile_e[row / 128], "{name} m={m}: pair {p} in a tile of another expert");
                assert_eq!(pos[p] as usize, row, "{name} m={m}: inverse map");
            }
            assert!(seen.iter().all(|&s| s), "{name} m={m}: a pair is missing");
            let pads = sorted[..want_tiles * 128].iter().filter(|&&p| p < 0).count();
            assert_eq!(pads, want_tiles * 128 - m * k, "{name} m={m}: padding rows");
            assert!(down(&layer, &y).iter().all(|v| v.is_finite()), "{name} m={m}: unwritten outputs");
            println!(
                "alignment k={k} cluster={cl} {name:<12} m={m:<5} {want_tiles} tiles ({extended} extended), \
                 permutation and padding exact"
            );
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn out_of_range_ids_are_counted_and_their_pairs_skipped() {
    let dev = gpu();
    let (mut layer, w) = small(&dev, Router::default(), 16, 2);
    let spec = *layer.spec();
    layer.set_validate_routing(false);
    // 40 tokens: moe_prepare's cooperative path; 12: its one-block path (a token per warp).
    for m in [40, 12] {
        let (x, mut ids, rw) = random_step(&spec, m, 0.0, fresh_seed());
        ids[3] = 16;
        ids[20] = -1;
        let mut y = poisoned(&layer, m * 256);
        let (dx, did, dw) = (up(&layer, &bf(&x)), up(&layer, &ids), up(&layer, &rw));
        layer.forward_family(KernelFamily::GroupedGemm, &dx, &did, &dw, &mut y).unwrap();
        assert_eq!(layer.take_routing_errors().unwrap(), 2);
        let a = layer.last_alignment().unwrap();
        assert_eq!((a.pair_pos[3], a.pair_pos[20]), (-1, -1), "m={m}: bad pairs take no row");
        assert!(!a.sorted_rows.contains(&3) && !a.sorted_rows.contains(&20));
        // The reference drops the two pairs: any valid id with weight 0.
        let (mut ref_ids, mut ref_w) = (ids.clone(), rw.clone());
        for p in [3, 20] {
            ref_ids[p] = 0;
            ref_w[p] = 0.0;
        }
        let (rel, cos) = compare(&down(&layer, &y), &moe_forward(&spec, &w, &x, &ref_ids, &ref_w));
        println!("m={m}, two ids out of range, skipped: rel_l2={rel:.3e} cos={cos:.8}");
        assert!(rel <= 5e-3 && cos >= 0.9999, "m={m}: rel_l2={rel:.3e} cos={cos:.8}");
    }
}

/// Whole layer, grouped family, against the f64 reference on up to 96 sampled tokens.
fn layer_case(layer: &mut MoeLayer, w: &HostWeights, m: usize, skew: f64, seed: u64) -> (f64, f64) {
    let (x, ids, rw) = random_step(layer.spec(), m, skew, seed);
    step_case(layer, w, (&x, &ids, &rw), seed)
}

/// One step `(x, ids, weights)` against the reference (`layer_case`); `seed` samples the tokens.
fn step_case(layer: &mut MoeLayer, w: &HostWeights, step: (&[f32], &[i32], &[f32]), seed: u64) -> (f64, f64) {
    let spec = *layer.spec();
    let (x, ids, rw) = step;
    let m = ids.len() / spec.top_k() as usize;
    let (dx, did, dw) = (up(layer, &bf(x)), up(layer, ids), up(layer, rw));
    let mut y = poisoned(layer, x.len());
    layer.forward_family(KernelFamily::GroupedGemm, &dx, &did, &dw, &mut y).unwrap();
    let got = down(layer, &y);
    assert!(got.iter().all(|v| v.is_finite()), "{} m={m}: unwritten or non-finite outputs", spec.id());
    let h = spec.hidden() as usize;
    let k = spec.top_k() as usize;
    let mut rng = SmallRng::seed_from_u64(seed);
    let tokens: Vec<usize> = if m <= 96 { (0..m).collect() } else { (0..96).map(|_| rng.random_range(0..m)).collect() };
    let pick = |v: &[f32], w: usize| tokens.iter().flat_map(|&t| v[t * w..(t + 1) * w].to_vec()).collect::<Vec<_>>();
    let ids_s: Vec<i32> = tokens.iter().flat_map(|&t| ids[t * k..(t + 1) * k].to_vec()).collect();
    let (xs, ws) = (pick(x, h), pick(rw, k));
    let fp8 = moe_codegen::grouped::quantizes_activations(&spec);
    let want =
        if fp8 { moe_forward_fp8_acts(&spec, w, &xs, &ids_s, &ws) } else { moe_forward(&spec, w, &xs, &ids_s, &ws) };
    let r = compare(&pick(&got, h), &want);
    if fp8 {
        // Reported, not asserted: the error the fp8 activations add against bf16 activations.
        let plain = compare(&pick(&got, h), &moe_forward(&spec, w, &xs, &ids_s, &ws));
        println!("    (against bf16 activations: rel_l2={:.3e} cos={:.7})", plain.0, plain.1);
    }
    r
}

fn geometry_cases(format: WeightFormat, ms: &[usize]) {
    let dev = gpu();
    // `MOE_GEOMETRIES=gpt-oss-20b,olmoe` runs only those.
    let only: Option<Vec<String>> =
        std::env::var("MOE_GEOMETRIES").ok().map(|v| v.split(',').map(str::to_owned).collect());
    let chosen = |name: &str| only.as_ref().is_none_or(|o| o.iter().any(|n| n == name));
    for (name, h, i, e, k) in REFERENCE_GEOMETRIES.into_iter().filter(|g| chosen(g.0)) {
        let Ok(spec) = MoeSpec::builder(h, i, e, k).weight_format(format).build() else { continue };
        if moe_codegen::grouped_support(&spec).is_err() {
            println!(
                "{name:<14} {format}: grouped family not available ({})",
                moe_codegen::grouped_support(&spec).unwrap_err()
            );
            continue;
        }
        let seed = fresh_seed();
        let w = random_weights(&spec, seed);
        let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
        layer.set_validate_routing(true);
        for (n, &m) in ms.iter().enumerate() {
            for skew in [0.0, 0.85] {
                let case_seed = seed.wrapping_add(1 + 2 * n as u64 + (skew > 0.0) as u64);
                let (rel, cos) = layer_case(&mut layer, &w, m, skew, case_seed);
                println!(
                    "{name:<14} {format:<14} m={m:<5} skew={skew:<4} rel_l2={rel:.3e} cos={cos:.8} seed={case_seed}"
                );
                let (tol, min_cos) = tolerance(&spec);
                assert!(rel <= tol && cos >= min_cos, "{name} {format} m={m} skew={skew}: rel {rel:.3e} cos {cos:.8}");
            }
        }
    }
}

/// Capture one grouped step of `m` tokens (x, ids, weights on the device) after reserving for it,
/// and replay it twice: each replay must equal `eager`, the same step run eagerly, bit for bit.
fn assert_replays_bit_for_bit(
    layer: &MoeLayer,
    m: usize,
    (dx, did, dw): (&CudaSlice<Bf>, &CudaSlice<i32>, &CudaSlice<f32>),
    eager: &[f32],
    what: &str,
) {
    layer.reserve(m).unwrap();
    let mut y = poisoned(layer, m * layer.spec().hidden() as usize);
    let graph =
        capture(layer.stream(), || layer.forward_family(KernelFamily::GroupedGemm, dx, did, dw, &mut y)).unwrap();
    for _ in 0..2 {
        graph.launch().unwrap();
        let got = down(layer, &y);
        let differ: Vec<usize> = (0..got.len()).filter(|&i| got[i].to_bits() != eager[i].to_bits()).collect();
        assert!(
            differ.is_empty(),
            "{what}: replay differs in {} of {} outputs, first at {} ({} against {})",
            differ.len(),
            got.len(),
            differ[0],
            got[differ[0]],
            eager[differ[0]]
        );
    }
}

/// Relative L2 error and least cosine allowed against the reference. FP8 is compared with a reference that
/// quantizes x and the intermediate to e4m3 as the kernels do, but Hopper's fp8 wgmma sums each
/// k-tile with reduced precision, so some of the intermediate's bf16 values land on the other side
/// of an e4m3 rounding step (12.5% apart) than the reference's: the ldmatrix + mma.sync fp8 path
/// measured 1.7-2.4e-3 where the wgmma one measured 5-7e-3 on the same steps (H100); at M = 1
/// (a few thousand outputs) one of 24 cases in two runs reached 1.16e-2. Per-channel fp8 scales x
/// per token, so GEMM1 sums the whole of K in that accumulator (`x_per_token`): 8.7e-3 to 1.54e-2
/// on the H100 (M = 1 and Mixtral-8x7B, K = 4096, highest; cosines down to 0.99988), against 4.7e-3
/// to 9.3e-3 when it was scaled per k-tile; either is small beside the 4.3e-2 that e4m3
/// activations cost against bf16 ones. A wrong tile or scale gives errors near 1.
/// Weights decoded in registers (`gemm_wq.cuh`) multiply in bf16: e2m1 and e4m3 codes times
/// their power-of-two or e4m3 scales are exact there, int4 / int8 codes times an fp16 group scale
/// are rounded once per weight.
fn tolerance(spec: &MoeSpec) -> (f64, f64) {
    match spec.weight_format() {
        _ if moe_codegen::grouped::decodes_weights(spec) => (5e-3, 0.99999),
        WeightFormat::Bf16 | WeightFormat::Fp16 => (5e-3, 0.9999),
        WeightFormat::Fp8E4m3 => (2.5e-2, 0.9995),
        WeightFormat::Fp8E4m3B128 => (1.5e-2, 0.9999),
        _ => (5e-3, 0.99999),
    }
}

const MS: [usize; 5] = [1, 17, 128, 1000, 4096];

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn grouped_bf16_matches_reference_on_every_geometry() {
    geometry_cases(WeightFormat::Bf16, &MS);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn grouped_fp8_matches_reference_on_every_geometry() {
    geometry_cases(WeightFormat::Fp8E4m3, &MS);
    geometry_cases(WeightFormat::Fp8E4m3B128, &MS);
}

/// Every format the grouped family decodes in registers (int8, int4, mxfp8, nvfp4, mxfp4 and their
/// group and zero-point variants), on every reference geometry that takes it. `MOE_FORMATS=a,b`
/// narrows the run to those formats, `MOE_GEOMETRIES=gpt-oss-20b` to those geometries.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn grouped_quantized_formats_match_reference() {
    let only: Option<Vec<String>> =
        std::env::var("MOE_FORMATS").ok().map(|v| v.split(',').map(str::to_owned).collect());
    for format in WeightFormat::ALL.into_iter().filter(|&f| moe_codegen::grouped::dequantizes_weights(f)) {
        if only.as_ref().is_some_and(|o| !o.iter().any(|n| n == format.name())) {
            continue;
        }
        geometry_cases(format, &[16, 33, 300, 4096]);
    }
}

/// One small case per codec of the weights decoded in registers (int8 per channel and in groups of
/// 64, int4 with zero points, e2m1 with e8m0 and with NVFP4 scales, e4m3 with e8m0 and per
/// channel), with K ending in half a 128-code stage
/// (hidden 320, intermediate 192): two out-of-range ids are counted and their pairs skipped, and a
/// captured step replays bit for bit. Small enough to run under compute-sanitizer (memcheck,
/// racecheck): `compute-sanitizer --tool racecheck gpu_prefill --ignored quantized_per_codec`.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn quantized_per_codec_edges_and_graph_replay() {
    use WeightFormat::*;
    let dev = gpu();
    // Per-channel fp8 at hidden 320 (not whole 128-byte e4m3 tiles) is decoded in registers too;
    // int8 g64's scales hold for whole stages (scaled in fp32 per stage, WQ_STAGE_SCALE).
    for format in [Int8, Int8G64, Int4AsymG32, Mxfp4, Nvfp4, Mxfp8, Fp8E4m3] {
        let spec = MoeSpec::builder(320, 192, 16, 4).weight_format(format).build().unwrap();
        assert!(moe_codegen::grouped::decodes_weights(&spec), "{format}");
        let w = random_weights(&spec, fresh_seed());
        let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
        layer.set_validate_routing(false);
        let m = 33;
        let (x, mut ids, rw) = random_step(&spec, m, 0.0, fresh_seed());
        ids[3] = 16;
        ids[20] = -1;
        let (dx, did, dw) = (up(&layer, &bf(&x)), up(&layer, &ids), up(&layer, &rw));
        let mut y = poisoned(&layer, m * 320);
        layer.forward_family(KernelFamily::GroupedGemm, &dx, &did, &dw, &mut y).unwrap();
        assert_eq!(layer.take_routing_errors().unwrap(), 2, "{format}");
        let eager = down(&layer, &y);
        let (mut ref_ids, mut ref_w) = (ids.clone(), rw.clone());
        for p in [3, 20] {
            ref_ids[p] = 0;
            ref_w[p] = 0.0;
        }
        let (rel, cos) = compare(&eager, &moe_forward(&spec, &w, &x, &ref_ids, &ref_w));
        println!("{format:<14} two ids out of range, skipped: rel_l2={rel:.3e} cos={cos:.8}");
        let (tol, min_cos) = tolerance(&spec);
        assert!(rel <= tol && cos >= min_cos, "{format}: rel_l2={rel:.3e} cos={cos:.8}");
        assert_replays_bit_for_bit(&layer, m, (&dx, &did, &dw), &eager, format.name());
        layer.take_routing_errors().unwrap();
    }
}

/// Every decoded format on the warp-specialised pipeline, its producer decoding the weights into
/// wgmma's stages (`gemm_wsq.cuh`), against the reference on the same dequantized weights: 256-
/// and 128-wide tiles, token counts that leave tiles partly empty and that give experts several
/// tiles, uniform and skewed routing, fresh weights per format; then a captured step replays the
/// eager one bit for bit. `MOE_FORMATS=int8_g32,mxfp4` runs only those (e.g. under
/// compute-sanitizer).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn decoded_weights_on_the_warp_specialised_pipeline_match_reference() {
    let dev = gpu();
    if dev.arch() != moe_codegen::Arch::Sm90a {
        panic!("this test needs an sm_90a GPU (wgmma), found {:?}", dev.arch());
    }
    let only: Option<Vec<String>> =
        std::env::var("MOE_FORMATS").ok().map(|v| v.split(',').map(str::to_owned).collect());
    let decoded = WeightFormat::ALL.into_iter().filter(|&f| moe_codegen::grouped::dequantizes_weights(f));
    for format in decoded.filter(|f| only.as_ref().is_none_or(|o| o.iter().any(|n| n == f.name()))) {
        let spec = MoeSpec::builder(1024, 512, 16, 4).weight_format(format).build().unwrap();
        let w = random_weights(&spec, fresh_seed());
        let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
        layer.set_validate_routing(true);
        let defaults = layer.grouped_tiles().unwrap();
        for option in ["256,256,3,1,1,bm128", "128,128,4,1,1,bm128"] {
            let tiles = defaults.parse(option).unwrap();
            layer.set_grouped_tiles(&dev, tiles).unwrap();
            for (m, skew) in [(33, 0.0), (300, 0.85), (1500, 0.0)] {
                let seed = fresh_seed();
                let (rel, cos) = layer_case(&mut layer, &w, m, skew, seed);
                println!("{format:<14} {option:<20} m={m:<5} skew={skew:<4} rel_l2={rel:.3e} cos={cos:.8}");
                let (tol, min_cos) = tolerance(&spec);
                assert!(rel <= tol && cos >= min_cos, "{format} {option} m={m}: rel {rel:.3e} cos {cos:.8}");
            }
        }
        let (x, ids, rw) = random_step(&spec, 200, 0.5, fresh_seed());
        let (dx, did, dw) = (up(&layer, &bf(&x)), up(&layer, &ids), up(&layer, &rw));
        let mut y = poisoned(&layer, 200 * 1024);
        layer.forward_family(KernelFamily::GroupedGemm, &dx, &did, &dw, &mut y).unwrap();
        let eager = down(&layer, &y);
        let (rel, _) = compare(&eager, &moe_forward(&spec, &w, &x, &ids, &rw));
        let (tol, _) = tolerance(&spec);
        assert!(rel <= tol, "{format}: rel {rel:.3e}");
        layer.set_validate_routing(false); // its host check cannot be captured
        assert_replays_bit_for_bit(&layer, 200, (&dx, &did, &dw), &eager, format.name());
    }
}

/// The mixed-input GEMMs' tile options that are not defaults (16- and 32-token tiles, three and
/// four blocks per SM) against the reference, for one format per code width and per scale
/// kind, on a geometry with 128-row GEMM2 tiles and one with 64 (two warps along the tokens).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn decoded_tile_options_match_reference() {
    use WeightFormat::*;
    let dev = gpu();
    for (h, i) in [(1024, 512), (320, 192)] {
        for format in [Mxfp4, Int8, Int4AsymG32] {
            let spec = MoeSpec::builder(h, i, 16, 4).weight_format(format).build().unwrap();
            let w = random_weights(&spec, fresh_seed());
            let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
            layer.set_validate_routing(true);
            let defaults = layer.grouped_tiles().unwrap();
            for option in ["128,128,6,3,bm16", "128,128,4,4,bm16", "128,128,5,2,bm32"] {
                let tiles = defaults.parse(option).unwrap();
                let tiles = moe_codegen::GemmTiles { bn2: defaults.bn2, ..tiles };
                layer.set_grouped_tiles(&dev, tiles).unwrap();
                for (m, skew) in [(33, 0.0), (300, 0.85)] {
                    let seed = fresh_seed();
                    let (rel, cos) = layer_case(&mut layer, &w, m, skew, seed);
                    println!("{format:<14} h={h} {option:<18} m={m:<4} skew={skew:<4} rel_l2={rel:.3e} cos={cos:.8}");
                    let (tol, min_cos) = tolerance(&spec);
                    assert!(rel <= tol && cos >= min_cos, "{format} h={h} {option} m={m}: rel {rel:.3e} cos {cos:.8}");
                }
            }
        }
    }
}

/// MXFP4 scales of 2 and more, past the decode's one multiply into bf16 (`WQ_BIG_SCALES` in
/// gemm_wq.cuh): every 97th e8m0 scale of both matrices raised 256-fold, so that about half of
/// the warps' stages (64 scales each) take the two-multiply decode and the others not, against
/// the reference on the same weights.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn mx_scales_past_one_multiply_match_reference() {
    let dev = gpu();
    let spec = MoeSpec::builder(512, 256, 16, 4).weight_format(WeightFormat::Mxfp4).build().unwrap();
    let mut w = random_weights(&spec, fresh_seed());
    let mut raised = 0;
    for b in w.w13_scales.iter_mut().chain(w.w2_scales.iter_mut()).step_by(97) {
        *b = (*b).min(246) + 8;
        raised += (*b >= 128) as usize;
    }
    assert!(raised > 0, "no scale reached 2");
    let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
    layer.set_validate_routing(true);
    for (m, skew) in [(33, 0.0), (300, 0.85)] {
        let seed = fresh_seed();
        let (rel, cos) = layer_case(&mut layer, &w, m, skew, seed);
        println!("mxfp4 {raised} scales >= 2, m={m} skew={skew}: rel_l2={rel:.3e} cos={cos:.8} seed={seed}");
        let (tol, min_cos) = tolerance(&spec);
        assert!(rel <= tol && cos >= min_cos, "m={m}: rel_l2={rel:.3e} cos={cos:.8}");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn deterministic_combine_is_bitwise_reproducible_and_agrees_with_atomics() {
    let dev = gpu();
    let spec = MoeSpec::builder(2048, 768, 128, 8).build().unwrap();
    let w = random_weights(&spec, fresh_seed());
    let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
    let m = 1000;
    let (x, ids, rw) = random_step(&spec, m, 0.5, fresh_seed());
    let (dx, did, dw) = (up(&layer, &bf(&x)), up(&layer, &ids), up(&layer, &rw));
    let run = |layer: &mut MoeLayer, det: bool| {
        layer.set_deterministic(det);
        let mut y = poisoned(layer, x.len());
        layer.forward_family(KernelFamily::GroupedGemm, &dx, &did, &dw, &mut y).unwrap();
        down(layer, &y)
    };
    let a = run(&mut layer, true);
    let b = run(&mut layer, true);
    assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()), "deterministic mode differs run to run");
    let c = run(&mut layer, false);
    let (rel, _) = compare(&c, &a.iter().map(|&v| v as f64).collect::<Vec<_>>());
    println!("atomic vs deterministic combine: rel_l2 {rel:.3e}");
    assert!(rel < 5e-3);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn whole_layer_from_logits_is_captured_and_replayed() {
    let dev = gpu();
    let spec = MoeSpec::builder(2048, 768, 128, 8).build().unwrap();
    let w = random_weights(&spec, fresh_seed());
    let layer = MoeLayer::load(&dev, spec, &w).unwrap();
    let m = 300;
    assert_eq!(layer.family_for(m), Some(KernelFamily::GroupedGemm));
    // (One token takes warp decode or the fused kernel, as the dispatcher's rule decides.)
    assert_ne!(layer.family_for(1), Some(KernelFamily::GroupedGemm));
    layer.reserve(m).unwrap();
    let mut rng = SmallRng::seed_from_u64(fresh_seed());
    let mut dx = up(&layer, &bf(&vec![0.0; m * 2048]));
    let mut dl = up(&layer, &vec![0f32; m * 128]);
    let mut y = poisoned(&layer, m * 2048);
    let graph = capture(layer.stream(), || layer.forward_logits(&dx, &dl, &mut y)).unwrap();
    for replay in 0..3 {
        let x: Vec<f32> = (0..m * 2048).map(|_| Bf::from_f32(rng.random_range(-1.0f32..1.0)).to_f32()).collect();
        let logits: Vec<f32> = (0..m * 128).map(|_| rng.random_range(-3.0f32..3.0)).collect();
        layer.stream().memcpy_htod(&bf(&x), &mut dx).unwrap();
        layer.stream().memcpy_htod(&logits, &mut dl).unwrap();
        graph.launch().unwrap();
        let got = down(&layer, &y);
        let (ids, rw) = route(&spec, &logits, &[0.0; 128]);
        let want = moe_forward(&spec, &w, &x[..64 * 2048], &ids[..64 * 8], &rw[..64 * 8]);
        let (rel, cos) = compare(&got[..64 * 2048], &want);
        println!("graph replay {replay}: rel_l2={rel:.3e} cos={cos:.8}");
        assert!(rel <= 5e-3 && cos >= 0.99999, "replay {replay}: rel {rel:.3e}");
    }
}

/// Whether `MOE_FORMATS=a,b` (unset: every format) names `f`.
fn wanted(f: WeightFormat) -> bool {
    std::env::var("MOE_FORMATS").map_or(true, |v| v.split(',').any(|n| n == f.name()))
}

/// Extended items (an expert's short last tile computed with the tiles before it, up to 16 of its
/// pairs each, over up to EXT_SPREAD tiles),
/// on routings whose expert counts sit on either side of that edge, against the reference and
/// against the same kernels without them (Qwen3-30B-A3B's geometry: bf16, per-channel fp8, and
/// mxfp4, int8, nvfp4 and mxfp8 (no spread) on the decoding producer's large-step tiles).
/// `MOE_FORMATS` picks some.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn extended_items_match_reference() {
    use moe_codegen::GemmTiles;
    let dev = gpu();
    let (m, e, k) = (1024usize, 128usize, 8usize);
    // Counts: past one tile by 1..17 pairs, past 2 or 3 tiles by up to 33 (the short tile's rows
    // spread over the 2 before it, EXT_SPREAD), whole tiles, a lone tile of 1 and 16, an empty
    // expert; the rest share what is left.
    assert_eq!(moe_codegen::grouped::EXT_SPREAD, 2, "the counts below sit on its edges");
    let edge: [usize; 19] = [129, 131, 136, 143, 144, 145, 257, 272, 273, 288, 289, 392, 416, 417, 16, 1, 0, 128, 256];
    // The experts whose short last tile joins the ones before it, at a spread of s tiles.
    let joining = |s: usize| {
        edge.iter()
            .filter(|&&c| c > 128 && c - (c.div_ceil(128) - 1) * 128 <= 16 * (c.div_ceil(128) - 1).min(s))
            .count()
    };
    assert_eq!((joining(1), joining(2)), (8, 11));
    let rest = m * k - edge.iter().sum::<usize>();
    let others = e - edge.len();
    let counts: Vec<usize> =
        edge.iter().copied().chain((0..others).map(|j| rest / others + (j < rest % others) as usize)).collect();
    // Each expert's pairs go to consecutive tokens (no count exceeds m, so a token never takes
    // an expert twice); the experts in a shuffled order.
    let mut rng = SmallRng::seed_from_u64(fresh_seed());
    let mut order: Vec<usize> = (0..e).collect();
    for j in (1..e).rev() {
        order.swap(j, rng.random_range(0..=j));
    }
    let labels: Vec<i32> = order.iter().flat_map(|&x| std::iter::repeat_n(x as i32, counts[x])).collect();
    let mut ids = vec![0i32; m * k];
    for (j, &x) in labels.iter().enumerate() {
        ids[(j % m) * k + j / m] = x;
    }
    let formats = [
        WeightFormat::Bf16,
        WeightFormat::Fp8E4m3,
        WeightFormat::Mxfp4,
        WeightFormat::Int8,
        WeightFormat::Nvfp4,
        WeightFormat::Mxfp8,
    ];
    for format in formats.into_iter().filter(|f| wanted(*f)) {
        let spec = MoeSpec::builder(2048, 768, e as u32, k as u32).weight_format(format).build().unwrap();
        let seed = fresh_seed();
        let w = random_weights(&spec, seed);
        let (x, _, rw) = random_step(&spec, m, 0.0, seed);
        let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
        layer.set_validate_routing(true);
        // Decoded weights: the large-step tiles (1024 tokens is where they start on this geometry).
        let tiles = layer.grouped_tiles_for(m).unwrap();
        // On by default for bf16 and the decoded formats' large steps; per-channel fp8 takes them
        // as an option (GemmTiles::tail).
        let default = if format == WeightFormat::Fp8E4m3 { 0 } else { 16 };
        assert_eq!(tiles.extended_rows(&spec), default, "{format}: extended items by default on sm_90a");
        let (tol, min_cos) = tolerance(&spec);
        let mut outputs = Vec::new();
        for tail in [16, 0] {
            layer.set_grouped_tiles(&dev, GemmTiles { tail, ..tiles }).unwrap();
            for deterministic in [false, true] {
                layer.set_deterministic(deterministic);
                let (rel, cos) = step_case(&mut layer, &w, (&x, &ids, &rw), seed);
                let a = layer.last_alignment().unwrap();
                println!(
                    "{format} tail={tail} rows={deterministic}: {} tiles, {} for GEMM1: rel_l2={rel:.3e} cos={cos:.8}",
                    a.num_tiles, a.num_tiles1
                );
                let joined = if tail > 0 { joining(moe_codegen::grouped::ext_spread(&spec) as usize) } else { 0 };
                assert_eq!(a.num_tiles - a.num_tiles1, joined as i32, "{format} tail={tail}");
                assert!(rel <= tol && cos >= min_cos, "{format} tail={tail}: rel {rel:.3e} cos {cos:.8}");
                if deterministic {
                    let mut y = poisoned(&layer, m * 2048);
                    let (dx, did, dw) = (up(&layer, &bf(&x)), up(&layer, &ids), up(&layer, &rw));
                    layer.forward_family(KernelFamily::GroupedGemm, &dx, &did, &dw, &mut y).unwrap();
                    outputs.push(down(&layer, &y));
                }
            }
        }
        // The extended rows take the same tensor-core sums as a tile of their own (the operands
        // swapped, the same 32-byte k-steps), so the deterministic outputs agree bit for bit.
        let (rel, cos) = compare(&outputs[0], &outputs[1].iter().map(|&v| v as f64).collect::<Vec<_>>());
        println!("{format}: with against without extended items: rel_l2={rel:.3e} cos={cos:.8}");
        assert!(outputs[0] == outputs[1], "{format}: rel {rel:.3e} cos {cos:.8}");
    }
}

/// The pipelines the device does not take by default: on an H100 the warp-specialised kernels
/// in 2-block clusters (the weight tile multicast), with consumer warpgroups two k-tiles apart
/// and (fp8) with 128-column tiles, the
/// block-barrier wgmma kernels and the ldmatrix + mma.sync ones (what sm_100a and sm_120a run),
/// bf16 and fp8, both combines.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn every_gemm_pipeline_matches_reference() {
    use moe_codegen::{GemmTiles, Mma};
    let dev = gpu();
    for format in [WeightFormat::Bf16, WeightFormat::Fp8E4m3B128] {
        let spec = MoeSpec::builder(2048, 768, 128, 8).weight_format(format).build().unwrap();
        let seed = fresh_seed();
        let w = random_weights(&spec, seed);
        let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
        let defaults = layer.grouped_tiles().unwrap();
        // fp8 past 128 columns needs the warp-specialised pipeline's column halves.
        let narrow =
            |t: GemmTiles| if format == WeightFormat::Bf16 { t } else { GemmTiles { bn1: 128, bn2: 128, ..t } };
        let others = [
            GemmTiles { cluster: 2, ..defaults },
            GemmTiles { lag: 2, ..defaults },
            // fp8: 128-column tiles, whose mid is quantized by moe_quant_mid rather than GEMM1
            // (bf16: the defaults again, skipped).
            if format == WeightFormat::Bf16 { defaults } else { narrow(GemmTiles { stages: 6, ..defaults }) },
            narrow(GemmTiles { warp_specialized: false, stages: 4, cluster: 1, ..defaults }),
            GemmTiles {
                mma: Mma::MmaSync,
                warp_specialized: false,
                bn1: 128,
                bn2: 128,
                stages: 4,
                cluster: 1,
                ..defaults
            },
        ];
        for tiles in others.into_iter().filter(|t| *t != defaults) {
            layer.set_grouped_tiles(&dev, tiles).unwrap();
            for (m, deterministic) in [(17, true), (1000, false), (1000, true)] {
                layer.set_deterministic(deterministic);
                let (rel, cos) = layer_case(&mut layer, &w, m, 0.5, seed.wrapping_add(m as u64));
                println!("{format} {tiles:?} m={m} rows={deterministic}: rel_l2={rel:.3e} cos={cos:.8}");
                let (tol, min_cos) = tolerance(&spec);
                assert!(rel <= tol && cos >= min_cos, "{format} {tiles:?} m={m}: rel {rel:.3e} cos {cos:.8}");
            }
        }
    }
}

/// The tile tests' three steps against the reference: 17 tokens and 1000 (deterministic
/// combine), 300 skewed (atomic), each from `seed`; `what` names the case in messages.
fn tile_cases(layer: &mut MoeLayer, w: &HostWeights, seed: u64, what: &str) {
    let (tol, min_cos) = tolerance(layer.spec());
    for (m, skew, deterministic) in [(17, 0.0, true), (300, 0.85, false), (1000, 0.0, true)] {
        layer.set_deterministic(deterministic);
        let (rel, cos) = layer_case(layer, w, m, skew, seed.wrapping_add(m as u64));
        println!("{what} m={m} rows={deterministic}: rel_l2={rel:.3e} cos={cos:.8}");
        assert!(rel <= tol && cos >= min_cos, "{what} m={m}: rel {rel:.3e} cos {cos:.8}");
    }
}

/// 16-bit weights on the warp-specialised pipeline take column tiles of any multiple of 16 up to
/// 256 (`GemmTiles::takes_any_width`): widths that are not powers of two, and not multiples of 64
/// (whose epilogues store a partial last chunk, and an odd last fragment as pairs), alone and in
/// 2-block clusters, with biases, both combines; weights the producer decodes take 192 columns.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn column_tiles_of_any_multiple_of_16_match_reference() {
    use moe_codegen::GemmTiles;
    let dev = gpu();
    // Hidden and intermediate 960 = 4 x 240 = 5 x 192 = 6 x 160 = 8 x 120 = 20 x 48.
    {
        let format = WeightFormat::Bf16;
        let spec = MoeSpec::builder(960, 960, 16, 4).weight_format(format).bias(true).build().unwrap();
        let seed = fresh_seed();
        let w = random_weights(&spec, seed);
        let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
        layer.set_validate_routing(true);
        let defaults = layer.grouped_tiles().unwrap();
        assert_eq!((defaults.bn1, defaults.bn2), (240, 240), "{format}: {defaults:?}");
        for (bn1, bn2, cluster) in [(240, 240, 1), (240, 240, 2), (96, 192, 1), (240, 80, 1), (160, 160, 2)] {
            let tiles = GemmTiles { bn1, bn2, cluster, ..defaults };
            layer.set_grouped_tiles(&dev, tiles).unwrap_or_else(|e| panic!("{tiles:?}: {e}"));
            tile_cases(&mut layer, &w, seed, &format!("{format} {bn1}x{bn2} c{cluster}"));
        }
    }
    // Weights the producer decodes: 192-column tiles (96 neurons in GEMM1: the large-step
    // tiles' default where 256 columns do not divide), the consumers decoding two thirds of each
    // 4-bit k-tile.
    for format in [WeightFormat::Mxfp4, WeightFormat::Nvfp4, WeightFormat::Int8, WeightFormat::Fp8E4m3] {
        let spec = MoeSpec::builder(960, 960, 16, 4).weight_format(format).build().unwrap();
        let seed = fresh_seed();
        let w = random_weights(&spec, seed);
        let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
        layer.set_validate_routing(true);
        layer.set_large_step_tokens(1);
        let tiles = layer.grouped_tiles_for(17).unwrap();
        assert!(tiles.warp_specialized && (tiles.bn1, tiles.bn2) == (192, 192), "{format}: {tiles:?}");
        tile_cases(&mut layer, &w, seed, &format!("{format} 192x192"));
    }
}

/// The mixed-input `mma.sync` GEMM2 ends on a narrower column block where its tiles do not divide
/// the hidden size (`GemmTiles::partial_gemm2`): hidden 960 is 7 x 128 + 64 and 3 x 256 + 192,
/// so the last block's warps past its rows sit out (one fragment a warp at 128, two at 256).
/// Every codec family once (e2m1 with both scale kinds, int8, int4 with zero points, e4m3 whose K
/// is not whole 128-byte tiles), both combines, uniform and skewed.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn mixed_input_gemm2_takes_a_narrower_last_column_block() {
    use moe_codegen::GemmTiles;
    let dev = gpu();
    for format in
        [WeightFormat::Mxfp4, WeightFormat::Nvfp4, WeightFormat::Int8, WeightFormat::Int4AsymG64, WeightFormat::Fp8E4m3]
    {
        let spec = MoeSpec::builder(960, 640, 16, 4).weight_format(format).build().unwrap();
        let seed = fresh_seed();
        let w = random_weights(&spec, seed);
        let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
        layer.set_validate_routing(true);
        let defaults = layer.grouped_tiles_for(17).unwrap();
        assert!(!defaults.warp_specialized && defaults.bn2 == 128, "{format}: {defaults:?}");
        assert!(defaults.partial_gemm2(&spec), "{format}: {defaults:?}");
        for bn2 in [128, 256] {
            let tiles = GemmTiles { bn2, ..defaults };
            layer.set_grouped_tiles(&dev, tiles).unwrap_or_else(|e| panic!("{format} {tiles:?}: {e}"));
            tile_cases(&mut layer, &w, seed, &format!("{format} bn2={bn2}"));
        }
    }
}
