//! Decode latency of the whole MoE layer (gate_up + down) on the Qwen3-30B-A3B geometry.
//!
//! `cargo bench --bench decode` runs criterion; `cargo bench --bench decode -- --report [FILE]`
//! prints a table and appends one JSON object per row to FILE (see benches/results/): every
//! weight format with every dequant variant the device's arch has (field `dequant`), the split
//! kernels at the default token-tile cap and, for bf16 and fp8_e4m3, at a cap of 1 (rows `split_cap4`,
//! `split_cap1`), and at one token the resident kernel where the layer has it (`resident`: 16-bit
//! weights whose w2 share fits each block). `--formats a,b` and `--dequant lut,bits`
//! narrow the report. Bytes are the touched experts' packed weights plus every scale the kernels
//! read for them, plus x, y and the routing.
//! `--ms 1,8` and `--variants resident,split_cap4,split_cap1` narrow it further.
//! Each timed unit is a CUDA-graph replay of forward over enough copies of the weights (at least
//! MIN_LAYERS, and 4x the L2 at M = 1) that no expert row is served from L2; the device-to-device
//! copy bandwidth is measured in the same run. Every path (report, sweep, criterion) divides a
//! replay's time by the number of layers that graph holds, counted as it was captured
//! ([`Case::layers`]); `--self-check` runs the checks of that without a GPU
//! (`cargo test --bench decode -- --self-check`).

use moe_runtime::cudarc::driver::sys::CUdevice_attribute;
use moe_runtime::cudarc::driver::sys::CUevent_flags;
use moe_runtime::cudarc::driver::{CudaGraph, CudaSlice, CudaStream};
use moe_runtime::testing::{fresh_seed, random_step, random_weights};
use moe_runtime::timing::{self, capture, copy_gbps, time_graph};
use moe_runtime::{ActElem, Device, MoeLayer};
use moeforge::codegen::{
    render_warp_decode, resident_rows, ActDtype, DecodeTiles, DequantVariant, MoeSpec, WeightFormat,
};
use std::sync::Arc;
use std::time::Duration;

const MS: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];
/// Weight copies cycled through at least: at M = 1 each step touches ~75 MB (bf16), 4 copies >= 4x
/// L2. Smaller formats get more copies (`layer_copies`): a graph's layer count is [`Case::layers`],
/// never this constant.
const MIN_LAYERS: usize = 4;

/// One step's device buffers: x, topk ids, topk weights, y.
type StepBuffers<T> = (CudaSlice<T>, CudaSlice<i32>, CudaSlice<f32>, CudaSlice<T>);

mod case {
    use std::time::Duration;

    /// A captured graph of `layers` layer steps. The graph is private and the count is the number of
    /// forward calls the capture recorded, so every time read off the graph comes out per layer,
    /// divided by the count that graph holds (6 copies for fp8 and up to 12 for 4-bit formats on
    /// an H100, not `MIN_LAYERS`).
    pub struct Case<G = super::CudaGraph> {
        graph: G,
        layers: usize,
        /// Bytes one layer step must move: touched experts' weights and scales, x, y, routing.
        pub bytes_per_layer: f64,
        _keep: Box<dyn std::any::Any>,
    }

    impl<G> Case<G> {
        /// `layers`: the forward calls captured into `graph`; `bytes`: what all of them move.
        pub fn new(graph: G, layers: usize, bytes: f64, keep: Box<dyn std::any::Any>) -> Self {
            assert!(layers > 0, "a decode graph holds at least one layer");
            Case { graph, layers, bytes_per_layer: bytes / layers as f64, _keep: keep }
        }

        /// Layer steps one replay runs.
        pub fn layers(&self) -> usize {
            self.layers
        }

        /// One layer's share of `replays` (the time of whole-graph replays).
        pub fn per_layer(&self, replays: Duration) -> Duration {
            replays / self.layers as u32
        }

        /// One layer's share of a replay's microseconds.
        pub fn per_layer_us(&self, replay_us: f64) -> f64 {
            replay_us / self.layers as f64
        }
    }

    impl Case<super::CudaGraph> {
        /// Median microseconds per layer over `reps` replays.
        pub fn time_per_layer(&self, s: &std::sync::Arc<super::CudaStream>, reps: usize) -> f64 {
            self.per_layer_us(super::time_graph(s, &self.graph, reps).unwrap())
        }

        /// Replays the whole graph once (every layer).
        pub fn launch(&self) {
            self.graph.launch().unwrap();
        }
    }
}
use case::Case;

fn build_case(layers: &[MoeLayer], spec: &MoeSpec, m: usize) -> Case {
    match spec.act_dtype() {
        ActDtype::Bf16 => build_case_as::<half::bf16>(layers, spec, m),
        ActDtype::Fp16 => build_case_as::<half::f16>(layers, spec, m),
    }
}

fn build_case_as<T: ActElem + 'static>(layers: &[MoeLayer], spec: &MoeSpec, m: usize) -> Case {
    let s = layers[0].stream().clone();
    let mut keep = Vec::new();
    let mut bytes = 0f64;
    let mut steps = Vec::new();
    for _ in layers {
        let (x, ids, w) = random_step(spec, m, 0.0, fresh_seed());
        let mut uniq = ids.clone();
        uniq.sort_unstable();
        uniq.dedup();
        let h = spec.hidden() as usize;
        bytes += (uniq.len() * spec.expert_bytes() + 2 * m * h * 2 + ids.len() * 8) as f64;
        let xs: Vec<T> = x.iter().map(|&v| T::from_f32(v)).collect();
        let step: StepBuffers<T> = (
            s.clone_htod(&xs).unwrap(),
            s.clone_htod(&ids).unwrap(),
            s.clone_htod(&w).unwrap(),
            s.clone_htod(&vec![T::default(); m * h]).unwrap(),
        );
        steps.push(step);
    }
    for l in layers {
        l.reserve(m).unwrap();
    }
    // The layer count is the forward calls the capture made: the one number every path divides by.
    let mut captured = 0;
    let graph = capture(&s, || {
        for (l, st) in layers.iter().zip(steps.iter_mut()) {
            l.forward(&st.0, &st.1, &st.2, &mut st.3)?;
            captured += 1;
        }
        Ok(())
    })
    .unwrap();
    assert_eq!(captured, layers.len());
    keep.extend(steps);
    Case::new(graph, captured, bytes, Box::new(keep))
}

fn layers_for(dev: &Device, spec: MoeSpec) -> Vec<MoeLayer> {
    layers_with_tiles(dev, spec, DecodeTiles::for_spec(&spec))
}

fn layers_with_tiles(dev: &Device, spec: MoeSpec, tiles: DecodeTiles) -> Vec<MoeLayer> {
    layers_with(dev, spec, tiles)
}

/// Copies of the weights to cycle through so that M = 1 steps touch 4x the L2 between visits.
fn layer_copies(dev: &Device, spec: &MoeSpec) -> usize {
    let l2 =
        dev.context().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE).unwrap_or(50 << 20) as usize;
    copies_for(l2, spec)
}

/// [`layer_copies`] for an L2 of `l2` bytes.
fn copies_for(l2: usize, spec: &MoeSpec) -> usize {
    let touched = spec.top_k() as usize * spec.expert_bytes();
    (4 * l2).div_ceil(touched.max(1)).max(MIN_LAYERS)
}

fn layers_with(dev: &Device, spec: MoeSpec, tiles: DecodeTiles) -> Vec<MoeLayer> {
    let w = random_weights(&spec, fresh_seed());
    let src = render_warp_decode(&spec, dev.arch(), tiles).unwrap();
    (0..layer_copies(dev, &spec))
        .map(|_| {
            let mut l = MoeLayer::with_source(dev, spec, src.clone(), &w).unwrap();
            // Warp decode under test: keep every step off the grouped family.
            l.set_prefill_threshold(usize::MAX);
            l.set_validate_routing(false);
            l
        })
        .collect()
}

fn qwen(format: WeightFormat) -> MoeSpec {
    MoeSpec::builder(2048, 768, 128, 8).weight_format(format).build().unwrap()
}

/// One timed configuration of the report.
struct Row {
    format: WeightFormat,
    dequant: DequantVariant,
    kernel: &'static str,
    m: usize,
    us: f64,
    pct: f64,
}

/// A kernel variant by its token-tile cap; 0: the resident one-token kernel (`moe_decode_resident`).
fn variant_name(tile_cap: u32) -> &'static str {
    match tile_cap {
        0 => "resident",
        1 => "split_cap1",
        2 => "split_cap2",
        _ => "split_cap4",
    }
}

#[allow(clippy::too_many_arguments)]
fn report_rows(
    dev: &Device,
    s: &Arc<CudaStream>,
    spec: MoeSpec,
    tile_cap: u32,
    ms: &[usize],
    copy: f64,
    date: &str,
    rows: &mut String,
    table: &mut Vec<Row>,
) {
    let format = spec.weight_format();
    let dequant = spec.dequant_for(dev.arch()).expect("only variants the arch has are reported");
    let mut layers = layers_with(dev, spec, DecodeTiles::for_spec(&spec));
    for l in &mut layers {
        l.set_max_token_tile(tile_cap.max(1)).unwrap();
        l.set_resident_one_token(tile_cap == 0);
    }
    let variant = variant_name(tile_cap);
    // The resident kernel takes one-token steps only.
    for m in ms.iter().copied().filter(|&m| tile_cap != 0 || m == 1) {
        let case = build_case(&layers, &spec, m);
        let copies = case.layers();
        let us = case.time_per_layer(s, 100);
        let gbps = case.bytes_per_layer / (us * 1e-6) / 1e9;
        let pct = 100.0 * gbps / copy;
        println!(
            "{:<15} {:<9} {variant:<11} {m:>3} {us:>10.2} {gbps:>10.0} {pct:>7.1}%",
            format.name(),
            dequant.name()
        );
        rows.push_str(&format!(
            "{{\"device\":\"{}\",\"family\":\"warp_decode\",\"variant\":\"{variant}\",\"format\":\"{}\",\
             \"dequant\":\"{}\",\"geometry\":\"qwen3-30b-a3b\",\"hidden\":2048,\"intermediate\":768,\"experts\":128,\
             \"top_k\":8,\"m\":{m},\"median_us\":{us:.3},\"bytes\":{:.0},\"achieved_gbps\":{gbps:.1},\
             \"copy_gbps\":{copy:.1},\"pct_of_copy\":{pct:.2},\"layers_rotated\":{copies},\"date\":\"{date}\"}}\n",
            dev.name(),
            format.name(),
            dequant.name(),
            case.bytes_per_layer
        ));
        table.push(Row { format, dequant, kernel: variant, m, us, pct });
    }
}

/// Every (format, variant) spec the report covers on `dev`, narrowed by the filters.
fn report_specs(dev: &Device, formats: &[WeightFormat], dequants: &[DequantVariant]) -> Vec<MoeSpec> {
    let mut out = Vec::new();
    for f in WeightFormat::ALL.into_iter().filter(|f| formats.is_empty() || formats.contains(f)) {
        for &d in f.dequant_variants().iter().filter(|d| dequants.is_empty() || dequants.contains(d)) {
            let spec = MoeSpec::builder(2048, 768, 128, 8).weight_format(f).dequant(d).build().unwrap();
            match spec.dequant_for(dev.arch()) {
                Ok(_) => out.push(spec),
                Err(why) => println!("{:<15} {:<9} skipped on {}: {why}", f.name(), d.name(), dev.arch()),
            }
        }
    }
    out
}

/// What the report covers: formats and dequant variants (empty: all), step sizes and kernel
/// variants (`split_cap4`, `split_cap1`; empty: all).
struct Filters {
    formats: Vec<WeightFormat>,
    dequants: Vec<DequantVariant>,
    ms: Vec<usize>,
    variants: Vec<String>,
}

fn report(dev: &Device, out: Option<&str>, filters: &Filters) {
    let Filters { formats, dequants, ms, variants } = filters;
    let ms: &[usize] = if ms.is_empty() { &MS } else { ms };
    let s = dev.stream().clone();
    let copy = copy_gbps(&s).unwrap();
    let date = timing::today();
    println!("device: {}  copy bandwidth: {copy:.0} GB/s  date: {date}", dev.name());
    let specs = report_specs(dev, formats, dequants);
    // Compile every module up front, on every core.
    let sources: Vec<_> =
        specs.iter().map(|sp| render_warp_decode(sp, dev.arch(), DecodeTiles::for_spec(sp)).unwrap()).collect();
    dev.prepare(&sources).unwrap();
    println!(
        "{:<15} {:<9} {:<6} {:>3} {:>10} {:>10} {:>8}",
        "format", "dequant", "kernel", "m", "median_us", "GB/s", "% copy"
    );
    let mut rows = String::new();
    let mut table = Vec::new();
    for &spec in &specs {
        let f = spec.weight_format();
        // The cap of 1 is measured on bf16 and fp8 only.
        let more = matches!(f, WeightFormat::Bf16 | WeightFormat::Fp8E4m3);
        let resident = resident_rows(&spec, dev.arch(), dev.sm_count(), dev.max_smem_optin()).is_some();
        for v in [0, 4, 1].into_iter().filter(|&v| v == 4 || (v == 1 && more) || (v == 0 && resident)) {
            if variants.is_empty() || variants.iter().any(|n| n == variant_name(v)) {
                report_rows(dev, &s, spec, v, ms, copy, &date, &mut rows, &mut table);
            }
        }
    }
    summary(&table);
    if let Some(path) = out {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path).unwrap();
        f.write_all(rows.as_bytes()).unwrap();
        println!("appended {} rows to {path}", rows.lines().count());
    }
}

/// The bar at M = 1 (split kernels): 8-bit formats >= 65% and 4-bit >= 55% of the copy
/// bandwidth, and the LUT-free variant at least as fast as the LUT one. Printed, not asserted.
fn summary(table: &[Row]) {
    println!("\nM = 1, split kernels: % of copy bandwidth per dequant variant (bar: 8-bit >= 65%, 4-bit >= 55%; bits <= lut in us)");
    let mut formats: Vec<WeightFormat> = table.iter().map(|r| r.format).collect();
    formats.dedup();
    for f in formats {
        let at = |d: DequantVariant| {
            table.iter().find(|r| r.format == f && r.dequant == d && r.m == 1 && r.kernel == "split_cap4")
        };
        let mut line = format!("{:<15}", f.name());
        for d in DequantVariant::ALL {
            if let Some(r) = at(d) {
                line += &format!("  {}: {:6.2} us {:5.1}%", d.name(), r.us, r.pct);
            }
        }
        let bar = match f.elem_bits() {
            8 => Some(65.0),
            4 => Some(55.0),
            _ => None,
        };
        let default = at(f.default_dequant(moeforge::codegen::Arch::Sm90a)).or_else(|| at(DequantVariant::Bits));
        if let (Some(bar), Some(r)) = (bar, default) {
            line +=
                &format!("  [default {}: {}]", r.dequant.name(), if r.pct >= bar { "meets bar" } else { "BELOW bar" });
        }
        if let (Some(b), Some(l)) = (at(DequantVariant::Bits), at(DequantVariant::Lut)) {
            line += if b.us <= l.us { "  [bits <= lut]" } else { "  [bits SLOWER than lut]" };
        }
        println!("{line}");
    }
}

/// Compare tile configurations at a few step sizes (tuning aid; prints only):
/// `--sweep [format[:dequant],...] [m,m...]`.
fn sweep(dev: &Device, specs: &[MoeSpec], ms: &[usize]) {
    let s = dev.stream().clone();
    let copy = copy_gbps(&s).unwrap();
    println!("sweep: copy bandwidth {copy:.0} GB/s");
    let configs = |spec: &MoeSpec| {
        let d = DecodeTiles::for_spec(spec);
        [d, DecodeTiles { bulk_dn_h2: !d.bulk_dn_h2, ..d }, DecodeTiles { bulk_gu: !d.bulk_gu, ..d }]
    };
    // Compile every configuration up front, in parallel.
    let sources: Vec<_> =
        specs.iter().flat_map(|s| configs(s).map(|t| render_warp_decode(s, dev.arch(), t).unwrap())).collect();
    dev.prepare(&sources).unwrap();
    for &spec in specs {
        let format = spec.weight_format();
        let dequant = spec.dequant().unwrap_or(format.default_dequant(dev.arch()));
        for t in configs(&spec) {
            let layers = layers_with(dev, spec, t);
            let kind = "split";
            let xs = if t.stage_x { "xs" } else { "xg" };
            let gu = if t.bulk_gu { format!("w{}x{}", t.bulk_gu_warps, t.bulk_gu_stages) } else { "regs".into() };
            let h2 = if t.bulk_dn_h2 { " h2" } else { "" };
            let dn = if t.bulk_dn { format!("w{}x{}{h2}", t.bulk_dn_warps, t.bulk_dn_stages) } else { "regs".into() };
            let bk = format!("gate_up {gu} down {dn}");
            let mut line = format!(
                "{:<9} {dequant:<8} {kind} {bk} w{} gu{}/{} dn{}x{} {xs} st{}:",
                format.name(),
                t.warps,
                t.gu_chunk,
                t.gu_lanes,
                t.dn_chunk,
                t.dn_rows,
                t.dn_stash
            );
            for &m in ms {
                let case = build_case(&layers, &spec, m);
                let us = case.time_per_layer(&s, 50);
                let pct = 100.0 * case.bytes_per_layer / (us * 1e-6) / 1e9 / copy;
                line += &format!("  m{m} {us:7.2}us {pct:5.1}%");
            }
            println!("{line}");
        }
    }
}

/// Graph replays for a profiler: `--profile bf16 1`.
fn profile(dev: &Device, format: WeightFormat, m: usize) {
    let spec = qwen(format);
    let layers = layers_with(dev, spec, DecodeTiles::for_spec(&spec));
    let case = build_case(&layers, &spec, m);
    for _ in 0..3 {
        case.launch();
    }
    dev.stream().synchronize().unwrap();
    println!("profiled {format} m={m} ({} layers a replay)", case.layers());
}

fn criterion_bench(dev: &Device) {
    let mut c = criterion::Criterion::default().configure_from_args();
    let s = dev.stream().clone();
    for format in [WeightFormat::Bf16, WeightFormat::Fp8E4m3] {
        let spec = qwen(format);
        let layers = layers_for(dev, spec);
        let mut group = c.benchmark_group(format!("warp_decode/qwen3-30b-a3b/{format}"));
        for m in MS {
            let case = build_case(&layers, &spec, m);
            if m == MS[0] {
                println!("warp_decode/qwen3-30b-a3b/{format}: {} layers a replay; times are per layer", case.layers());
            }
            group.bench_function(format!("m{m}"), |b| {
                b.iter_custom(|iters| {
                    let a = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
                    for _ in 0..iters {
                        case.launch();
                    }
                    let e = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
                    e.synchronize().unwrap();
                    case.per_layer(Duration::from_secs_f64(a.elapsed_ms(&e).unwrap() as f64 * 1e-3))
                })
            });
        }
        group.finish();
    }
    c.final_summary();
}

/// Checks that need no GPU (`--self-check`; also run, silently, before every bench run): the layer
/// counts of the issue (4 bf16, 6 fp8 and up to 12 4-bit copies on a 50 MiB L2) and that a graph's
/// per-layer time divides by the count it holds.
fn self_check(verbose: bool) {
    let l2 = 50 << 20; // H100
    let copies = |f: WeightFormat| copies_for(l2, &qwen(f));
    assert_eq!(copies(WeightFormat::Bf16), 4);
    assert_eq!(copies(WeightFormat::Fp8E4m3), 6);
    let most = WeightFormat::ALL.into_iter().filter(|f| f.elem_bits() == 4).map(copies).max().unwrap();
    assert!((11..=12).contains(&most), "4-bit formats cycle {most} copies");
    for f in WeightFormat::ALL {
        let n = copies(f);
        assert!(n >= MIN_LAYERS);
        // A graph of n layers: n x 10 ms of replays come back as 10 ms a layer, whatever MIN_LAYERS is.
        let case: Case<()> = Case::new((), n, 1e6 * n as f64, Box::new(()));
        assert_eq!(case.layers(), n);
        assert_eq!(case.per_layer(Duration::from_millis(10) * n as u32), Duration::from_millis(10));
        assert!((case.per_layer_us(1000.0) - 1000.0 / n as f64).abs() < 1e-9);
        assert_eq!(case.bytes_per_layer, 1e6);
        if verbose {
            println!("{:<15} {n:>2} layers a graph on a 50 MiB L2", f.name());
        }
    }
    if verbose {
        println!("self-check passed");
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    self_check(args.iter().any(|a| a == "--self-check"));
    if args.iter().any(|a| a == "--self-check") {
        return;
    }
    let dev = match Device::new(0) {
        Ok(d) => d,
        Err(e) => {
            println!("decode benchmark skipped: {e}");
            return;
        }
    };
    if let Some(i) = args.iter().position(|a| a == "--sweep") {
        let spec = |f: &str| {
            let (format, dequant) = f.split_once(':').map_or((f, None), |(f, d)| (f, Some(d)));
            let b = MoeSpec::builder(2048, 768, 128, 8).weight_format(format.parse().unwrap());
            match dequant {
                Some(d) => b.dequant(d.parse().unwrap()).build().unwrap(),
                None => b.build().unwrap(),
            }
        };
        let specs: Vec<MoeSpec> = match args.get(i + 1).filter(|a| !a.starts_with("--")) {
            Some(list) => list.split(',').map(spec).collect(),
            None => ["bf16", "fp8_e4m3", "int4_g128"].map(spec).to_vec(),
        };
        let ms: Vec<usize> = match args.get(i + 2).filter(|a| !a.starts_with("--")) {
            Some(list) => list.split(',').map(|m| m.parse().unwrap()).collect(),
            None => vec![1, 2, 8],
        };
        sweep(&dev, &specs, &ms);
    } else if let Some(i) = args.iter().position(|a| a == "--profile") {
        let format: WeightFormat = args[i + 1].parse().unwrap();
        profile(&dev, format, args[i + 2].parse().unwrap());
    } else if let Some(i) = args.iter().position(|a| a == "--report") {
        let out = args.get(i + 1).filter(|a| !a.starts_with("--")).map(String::as_str);
        let list = |flag: &str| -> Vec<String> {
            args.iter()
                .position(|a| a == flag)
                .and_then(|j| args.get(j + 1))
                .map(|v| v.split(',').map(str::to_string).collect())
                .unwrap_or_default()
        };
        let filters = Filters {
            formats: list("--formats").iter().map(|f| f.parse().unwrap()).collect(),
            dequants: list("--dequant").iter().map(|d| d.parse().unwrap()).collect(),
            ms: list("--ms").iter().map(|m| m.parse().unwrap()).collect(),
            variants: list("--variants"),
        };
        report(&dev, out, &filters);
    } else {
        criterion_bench(&dev);
    }
}
