//! The routing-aware dispatcher on a real GPU: the device counts each step's distinct experts and
//! pairs and picks the family its models predict faster (in `moe_prepare`'s one block for a step
//! of a few tokens, else in `moe_choose`); the other families' kernels return at once. Ignored without a GPU; each test fails (never passes) when no GPU is found.

use moe_codegen::{KernelFamily, MoeSpec, WeightFormat};
use moe_runtime::cudarc::driver::CudaSlice;
use moe_runtime::dispatch::{DispatchModel, LinearCost, ModelSource};
use moe_runtime::reference::{compare, moe_forward, moe_forward_fp8_acts};
use moe_runtime::testing::{fresh_seed, random_step, random_weights};
use moe_runtime::timing::capture;
use moe_runtime::{Device, HostWeights, MoeLayer};

type Bf = half::bf16;

fn gpu() -> Device {
    Device::new(0).unwrap_or_else(|e| panic!("this test needs an NVIDIA GPU: {e}"))
}

fn bf(v: &[f32]) -> Vec<Bf> {
    v.iter().map(|&x| Bf::from_f32(x)).collect()
}

/// Distinct valid experts and valid pairs of a routing, as `moe_choose` counts them.
fn counts(ids: &[i32], experts: u32) -> (u32, u32) {
    let mut valid: Vec<i32> = ids.iter().copied().filter(|&e| e >= 0 && (e as u32) < experts).collect();
    let pairs = valid.len() as u32;
    valid.sort_unstable();
    valid.dedup();
    (valid.len() as u32, pairs)
}

/// Every token on the same `top_k` experts: the most sharing a step can have.
fn all_on_few(spec: &MoeSpec, m: usize) -> Vec<i32> {
    (0..m * spec.top_k() as usize).map(|j| (j % spec.top_k() as usize) as i32 * 3).collect()
}

/// The reference for the family that ran (the grouped fp8 GEMMs quantize the activations).
fn reference(spec: &MoeSpec, w: &HostWeights, family: KernelFamily, x: &[f32], ids: &[i32], rw: &[f32]) -> Vec<f64> {
    if family == KernelFamily::GroupedGemm && moe_codegen::grouped::quantizes_activations(spec) {
        moe_forward_fp8_acts(spec, w, x, ids, rw)
    } else {
        moe_forward(spec, w, x, ids, rw)
    }
}

/// A step of `m` tokens through `forward` (optionally a graph replay) into a poisoned y.
fn step(layer: &MoeLayer, x: &[f32], ids: &[i32], rw: &[f32], graph: bool) -> Vec<f32> {
    let s = layer.stream().clone();
    let (dx, dids, dw) = (s.clone_htod(&bf(x)).unwrap(), s.clone_htod(ids).unwrap(), s.clone_htod(rw).unwrap());
    let mut y: CudaSlice<Bf> = s.clone_htod(&vec![Bf::from_f32(f32::NAN); x.len()]).unwrap();
    if graph {
        let g = capture(&s, || layer.forward(&dx, &dids, &dw, &mut y)).unwrap();
        g.launch().unwrap();
    } else {
        layer.forward(&dx, &dids, &dw, &mut y).unwrap();
    }
    s.clone_dtoh(&y).unwrap().into_iter().map(|v| v.to_f32()).collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn dispatched_steps_match_the_reference_and_the_host_model() {
    let dev = gpu();
    for format in [WeightFormat::Bf16, WeightFormat::Fp8E4m3, WeightFormat::Mxfp4] {
        let spec = MoeSpec::builder(2048, 768, 128, 8).weight_format(format).build().unwrap();
        let w = random_weights(&spec, fresh_seed());
        let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
        layer.set_validate_routing(false);
        layer.reserve(64).unwrap();
        let model = layer.dispatch_model().expect("the dispatcher is on by default");
        assert_eq!(model.source, ModelSource::Analytic);
        assert!(model.fused.is_some(), "the layer has the fused family, so the model does");
        // Without the fused model (its own test is below), every step this window leaves to
        // routing goes to the device, which chooses between warp decode and the grouped GEMMs.
        let model = model.restricted(false);
        layer.set_dispatch_model(Some(model));
        let mut seen = [0usize; 2];
        for m in [2usize, 4, 8, 12] {
            for (routing, graph) in [("uniform", false), ("skewed", true), ("few", false), ("few", true)] {
                let seed = fresh_seed();
                let skew = if routing == "skewed" { 0.85 } else { 0.0 };
                let (x, mut ids, rw) = random_step(&spec, m, skew, seed);
                if routing == "few" {
                    ids = all_on_few(&spec, m);
                }
                let got = step(&layer, &x, &ids, &rw, graph);
                let c = layer.last_choice().unwrap();
                let (d, p) = counts(&ids, spec.experts());
                let what = format!("{} m={m} {routing} graph={graph} seed={seed}: {c:?}", spec.id());
                assert_eq!(c.on_device, layer.family_for(m).is_none(), "{what}");
                if c.on_device {
                    assert_eq!((c.distinct, c.pairs), (d, p), "{what}");
                    assert_eq!(c.family, model.choose(d, p), "{what}: device and host models disagree");
                    assert_eq!(c.predicted_decode_us, model.decode.predict(d, p), "{what}");
                }
                seen[(c.family == KernelFamily::GroupedGemm) as usize] += 1;
                let unwritten = got.iter().filter(|v| !v.is_finite()).count();
                assert_eq!(unwritten, 0, "{what}: {unwritten} outputs unwritten");
                let (rel, cos) = compare(&got, &reference(&spec, &w, c.family, &x, &ids, &rw));
                println!("{what}: rel_l2={rel:.3e} cos={cos:.8}");
                let (max_rel, min_cos) =
                    if moe_codegen::grouped::quantizes_activations(&spec) { (2.5e-2, 0.9995) } else { (5e-3, 0.99999) };
                assert!(rel <= max_rel && cos >= min_cos, "{what}: rel_l2 {rel:.3e} cos {cos:.8}");
            }
        }
        assert!(seen[0] > 0 && seen[1] > 0, "{}: the window's steps took one family only ({seen:?})", spec.id());
    }
}

/// Above 32 tokens `moe_prepare` runs more than one block and `moe_choose` makes the choice in a
/// launch of its own: a dispatcher window raised to 64 tokens, 40-token steps spread over most
/// experts (warp decode) and on 8 (the grouped GEMMs), eager and replayed.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn the_device_chooses_for_steps_of_several_alignment_blocks() {
    let dev = gpu();
    let spec = MoeSpec::builder(2048, 768, 128, 8).build().unwrap();
    let w = random_weights(&spec, fresh_seed());
    let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
    layer.set_validate_routing(false);
    layer.set_prefill_threshold(64);
    // 320 pairs: decode 320, grouped 4 an expert (least up to 80 experts).
    let model = planes(lin(0.0, 0.0, 1.0), lin(0.0, 4.0, 0.0), None);
    layer.set_dispatch_model(Some(model));
    let m = 40;
    layer.reserve(m).unwrap();
    assert_eq!(layer.family_for(m), None, "the device chooses");
    let mut families = Vec::new();
    for (few, graph) in [(false, false), (true, false), (false, true), (true, true)] {
        let seed = fresh_seed();
        let (x, mut ids, rw) = random_step(&spec, m, 0.0, seed);
        if few {
            ids = all_on_few(&spec, m);
        }
        let got = step(&layer, &x, &ids, &rw, graph);
        let c = layer.last_choice().unwrap();
        let (d, p) = counts(&ids, spec.experts());
        let what = format!("few={few} graph={graph} seed={seed}: {c:?}");
        assert!(c.on_device, "{what}");
        assert_eq!((c.distinct, c.pairs), (d, p), "{what}");
        assert_eq!(c.family, model.choose(d, p), "{what}");
        let (rel, cos) = compare(&got, &moe_forward(&spec, &w, &x, &ids, &rw));
        println!("{what}: rel_l2={rel:.3e} cos={cos:.8}");
        assert!(rel <= 5e-3 && cos >= 0.99999, "{what}: rel_l2 {rel:.3e} cos {cos:.8}");
        families.push(c.family);
    }
    use KernelFamily::{GroupedGemm as G, WarpDecode as D};
    assert_eq!(families, [D, G, D, G]);
}

/// Qwen3-30B-A3B bf16 dispatched by `model`, one 8-token step captured once and replayed on
/// uniform routing and on every token on the same 8 experts (`few`), in `order`; each replay
/// against the reference and the host's prediction of the device's choice. Returns the layer, its
/// weights, the step's x and routing weights, the `few` ids and the family of each replay.
fn replays(
    model: DispatchModel,
    order: &[bool],
) -> (MoeLayer, HostWeights, Vec<f32>, Vec<f32>, Vec<i32>, Vec<KernelFamily>) {
    let dev = gpu();
    let spec = MoeSpec::builder(2048, 768, 128, 8).build().unwrap();
    let w = random_weights(&spec, fresh_seed());
    let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
    layer.set_validate_routing(false);
    layer.set_dispatch_model(Some(model));
    assert_eq!(layer.dispatch_model().and_then(|m| m.fused), model.fused, "the layer has the fused family");
    let m = 8;
    layer.reserve(m).unwrap();
    assert_eq!(layer.family_for(m), None);
    let s = layer.stream().clone();
    let seed = fresh_seed();
    let (x, uniform, rw) = random_step(&spec, m, 0.0, seed);
    let few = all_on_few(&spec, m);
    let (dx, dw) = (s.clone_htod(&bf(&x)).unwrap(), s.clone_htod(&rw).unwrap());
    let mut dids = s.clone_htod(&uniform).unwrap();
    let mut y: CudaSlice<Bf> = s.alloc_zeros(x.len()).unwrap();
    let g = capture(&s, || layer.forward(&dx, &dids, &dw, &mut y)).unwrap();
    let mut families = Vec::new();
    for &on_few in order {
        let ids = if on_few { &few } else { &uniform };
        s.memcpy_htod(ids, &mut dids).unwrap();
        s.memcpy_htod(&vec![Bf::from_f32(f32::NAN); x.len()], &mut y).unwrap();
        g.launch().unwrap();
        let got: Vec<f32> = s.clone_dtoh(&y).unwrap().into_iter().map(|v| v.to_f32()).collect();
        let c = layer.last_choice().unwrap();
        let (d, p) = counts(ids, spec.experts());
        assert_eq!(c.family, model.choose(d, p), "seed {seed}: {c:?}");
        assert_eq!(c.predicted_fused_us, model.fused.map_or(0.0, |f| f.predict(d, p)), "seed {seed}: {c:?}");
        let (rel, cos) = compare(&got, &moe_forward(&spec, &w, &x, ids, &rw));
        println!("replay on {d} experts: {} rel_l2={rel:.3e} cos={cos:.8}", c.family);
        assert!(rel <= 5e-3 && cos >= 0.99999, "seed {seed} {c:?}: rel_l2 {rel:.3e} cos {cos:.8}");
        families.push(c.family);
    }
    (layer, w, x, rw, few, families)
}

fn lin(c0: f32, per_expert: f32, per_pair: f32) -> LinearCost {
    LinearCost { c0, per_expert, per_pair }
}

/// Hand-set models that leave choosing free (no overhead, no one-token choice).
fn planes(decode: LinearCost, grouped: LinearCost, fused: Option<LinearCost>) -> DispatchModel {
    DispatchModel { decode, grouped, fused, one_token: None, overhead_us: 0.0, source: ModelSource::Profile }
}

/// The fused family on the device's menu: the device sends 8 tokens on 8 experts to the fused
/// kernel and 8 spread over 50-odd to warp decode, replay by replay of one graph.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn the_device_chooses_the_fused_family_where_it_is_predicted_least() {
    // 8 tokens: decode 32; grouped 3 an expert; fused 12 + 0.6 an expert. On 8 experts the
    // fused kernel is least (16.8), from 34 experts on warp decode.
    let model = planes(lin(0.0, 0.0, 0.5), lin(0.0, 3.0, 0.0), Some(lin(12.0, 0.6, 0.0)));
    let (.., families) = replays(model, &[true, false, true]);
    assert_eq!(families, [KernelFamily::Fused, KernelFamily::WarpDecode, KernelFamily::Fused]);
}

/// Warp decode off the device's menu (its model never the least for 8 tokens): its kernels are not
/// launched, and the device sends 8 tokens on 8 experts to the grouped GEMMs and 8 spread over
/// 50-odd to the fused kernel, replay by replay of one graph.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn the_device_chooses_without_warp_decode_where_it_cannot_win() {
    // 8 tokens: decode 320; grouped 3 an expert; fused 60 + 0.6 an expert, the least from 26
    // experts on.
    let model = planes(lin(0.0, 0.0, 5.0), lin(0.0, 3.0, 0.0), Some(lin(60.0, 0.6, 0.0)));
    let menu = model.device_menu(8, 8, 128);
    assert!(!menu.decode && menu.model.fused.is_some(), "{menu:?}");
    let (.., families) = replays(model, &[true, false, true, false]);
    let (g, f) = (KernelFamily::GroupedGemm, KernelFamily::Fused);
    assert_eq!(families, [g, f, g, f]);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn one_graph_follows_the_routing_of_each_replay() {
    // Decode costs a pair, grouped two an expert: 8 tokens on 8 experts go grouped, spread over
    // 50-odd experts they go to warp decode.
    let model = planes(lin(0.0, 0.0, 1.0), lin(0.0, 2.0, 0.0), None);
    let (mut layer, w, x, rw, few, families) = replays(model, &[false, true, false, true]);
    assert_eq!(
        families,
        [KernelFamily::WarpDecode, KernelFamily::GroupedGemm, KernelFamily::WarpDecode, KernelFamily::GroupedGemm]
    );
    let (spec, m) = (*layer.spec(), 8);
    // Ids out of range are skipped by both families and not counted as pairs.
    let mut bad = few.clone();
    bad[0] = 128;
    bad[9] = -1;
    let got = step(&layer, &x, &bad, &rw, false);
    let c = layer.last_choice().unwrap();
    assert_eq!((c.distinct, c.pairs), counts(&bad, spec.experts()), "{c:?}");
    // The reference: those pairs weighted 0 (on a valid expert).
    let (mut rid, mut rrw) = (bad.clone(), rw.clone());
    for j in [0, 9] {
        (rid[j], rrw[j]) = (0, 0.0);
    }
    let (rel, _) = compare(&got, &moe_forward(&spec, &w, &x, &rid, &rrw));
    assert!(rel <= 5e-3, "out-of-range ids through the dispatcher: rel_l2 {rel:.3e}");
    // A fixed threshold turns the dispatcher off.
    layer.set_prefill_threshold(16);
    assert_eq!(layer.family_for(m), Some(KernelFamily::WarpDecode));
    assert!(layer.dispatch_model().is_none());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_profile_fits_the_timed_steps_and_later_loads_use_it() {
    let cache = tempfile::tempdir().unwrap();
    // The kernel cache (and so the profile's folder) of this test only; modules compile anew.
    let dev = gpu().with_cache(moe_runtime::DiskCache::new(cache.path()));
    let spec = MoeSpec::builder(2048, 768, 128, 8).build().unwrap();
    let w = random_weights(&spec, fresh_seed());
    let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
    assert_eq!(layer.dispatch_model().unwrap().source, ModelSource::Analytic);
    let start = std::time::Instant::now();
    let p = moe_runtime::dispatch::profile(&mut layer).unwrap();
    println!("profile in {:.1} s: {:?}", start.elapsed().as_secs_f64(), p.model);
    // The layer's own dispatcher is left as it was.
    assert_eq!(layer.dispatch_model().unwrap().source, ModelSource::Analytic);
    // 6 token counts x 5 routings x 3 families (warp decode, grouped, fused).
    assert_eq!(p.samples.len(), 90);
    assert!(p.model.fused.is_some());
    for s in &p.samples {
        let c = match s.family {
            KernelFamily::GroupedGemm => p.model.grouped,
            KernelFamily::Fused => p.model.fused.unwrap(),
            _ => p.model.decode,
        };
        let err = (c.predict(s.distinct, s.pairs) as f64 / s.us - 1.0).abs();
        assert!(err < 0.3, "{s:?}: predicted {} us", c.predict(s.distinct, s.pairs));
    }
    assert!(p.model.overhead_us >= 0.0 && p.model.overhead_us < 50.0, "{:?}", p.model);
    // bf16 weights have no large-step tiles to place.
    assert_eq!((p.large_step_tokens, layer.large_step_tokens()), (None, None));
    // One token takes the family of least median time over the profile's one-token steps.
    let one = p.model.one_token.expect("every family was timed at one token");
    assert_eq!(p.model.fixed_choice(1, 8, 128), Some(one));
    let at_one = |f: KernelFamily| {
        let mut t: Vec<f64> = p.samples.iter().filter(|s| s.m == 1 && s.family == f).map(|s| s.us).collect();
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    for f in [KernelFamily::WarpDecode, KernelFamily::GroupedGemm, KernelFamily::Fused] {
        assert!(at_one(one) <= at_one(f), "{one}: {} us against {f}: {} us", at_one(one), at_one(f));
    }
    let path = p.save(dev.cache_dir(), &spec).unwrap();
    let again = MoeLayer::load(&dev, spec, &w).unwrap();
    assert_eq!(again.dispatch_model(), Some(p.model), "{}", path.display());
    // A corrupt profile is passed over (reported), not used.
    std::fs::write(&path, "{\"device\": 1").unwrap();
    let third = MoeLayer::load(&dev, spec, &w).unwrap();
    assert_eq!(third.dispatch_model().unwrap().source, ModelSource::Analytic);
}

/// Weights decoded in registers have a second set of grouped tiles for large steps: the profile
/// times both around the heuristic's start and places the start where the large tiles stay
/// ahead; later loads take it.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_profile_places_the_start_of_the_large_step_tiles() {
    let cache = tempfile::tempdir().unwrap();
    let dev = gpu().with_cache(moe_runtime::DiskCache::new(cache.path()));
    let spec = MoeSpec::builder(1024, 512, 64, 8).weight_format(WeightFormat::Int8).build().unwrap();
    let w = random_weights(&spec, fresh_seed());
    let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
    let heuristic = layer.large_step_tokens().expect("int8 on sm_90a has large-step tiles");
    assert_eq!(heuristic, 512);
    let p = moe_runtime::dispatch::profile(&mut layer).unwrap();
    let start = p.large_step_tokens.expect("timed");
    println!("large-step tiles from {start} tokens (heuristic {heuristic})");
    // One of the sizes timed (half to four times the heuristic's), or one past the last.
    assert!([256, 384, 512, 768, 1024, 2048, 2049].contains(&start), "{start}");
    // The layer's own start is left as it was.
    assert_eq!(layer.large_step_tokens(), Some(heuristic));
    p.save(dev.cache_dir(), &spec).unwrap();
    let mut again = MoeLayer::load(&dev, spec, &w).unwrap();
    assert_eq!(again.large_step_tokens(), Some(start));
    let large = |l: &MoeLayer, m: usize| l.grouped_tiles_for(m).unwrap().warp_specialized;
    assert!(large(&again, start) && !large(&again, start - 1));
    // Moved by hand, and correct on both sides of the move.
    again.set_large_step_tokens(300);
    assert!(large(&again, 300) && !large(&again, 299));
    again.set_validate_routing(false);
    for m in [299, 300] {
        let (x, ids, rw) = random_step(&spec, m, 0.5, fresh_seed());
        let want = reference(&spec, &w, KernelFamily::GroupedGemm, &x, &ids, &rw);
        let got = step(&again, &x, &ids, &rw, false);
        let (rel, cos) = compare(&got, &want);
        assert!(rel < 5e-3 && cos > 0.99999, "m={m}: rel {rel:.3e} cos {cos:.8}");
    }
}
