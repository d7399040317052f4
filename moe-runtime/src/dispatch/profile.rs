//! A dispatch profile: the dispatcher's models fitted to steps timed on this GPU with the layer's
//! own weights, and the file that keeps it next to the kernel cache, one per (GPU name, spec id,
//! moeforge version). `MoeLayer::load` picks it up; `moe-jit profile` (or [`profile`]) writes it.
//!
//! The grid is RaMP's, with one token added (where warp decode and the fused family are close):
//! six token counts below the prefill threshold times five routings (each
//! token's experts drawn from all of them, or from the first eighth with probability 0.5, 0.85 or
//! 1, or every token on the same top-k experts), every family the layer has timed on each as CUDA-graph replays
//! of four steps with fresh routing (so the touched experts change from step to step). Then what
//! choosing on the device costs is measured on the steps whose choice the routing decides.

use super::model::{DispatchModel, ModelFitError, ModelSource, Sample};
use crate::error::{Result, RuntimeError};
use crate::layer::{ActElem, MoeLayer, DEFAULT_PREFILL_THRESHOLD};
use crate::timing::{capture, time_graph};
use crate::view::{DeviceTensor, DeviceTensorMut, TopkIds};
use cudarc::driver::CudaSlice;
use moe_codegen::{ActDtype, KernelFamily, MoeSpec};
use std::path::{Path, PathBuf};

/// Token counts the profile times.
pub const PROFILE_TOKENS: [usize; 6] = [1, 2, 4, 8, 12, 15];
/// Steps per timed graph.
const STEPS: usize = 4;

/// How a profiled step routes its tokens.
#[derive(Clone, Copy, Debug)]
enum Routing {
    /// Each token's experts from the first eighth with this probability, else from all.
    Skew(f64),
    /// Every token on the same top-k experts.
    Same,
}
const ROUTINGS: [Routing; 5] =
    [Routing::Skew(0.0), Routing::Skew(0.5), Routing::Skew(0.85), Routing::Skew(1.0), Routing::Same];

/// A fitted profile and what it was fitted on.
#[derive(Clone, Debug, PartialEq)]
pub struct DispatchProfile {
    /// The GPU's name as the driver reports it.
    pub device: String,
    /// [`MoeSpec::id`] of the layer's spec.
    pub spec_id: String,
    /// The moeforge version that timed it.
    pub version: String,
    /// The fitted models (with the measured device-dispatch cost).
    pub model: DispatchModel,
    /// The step size from which the grouped family's large-step tiles were the better choice
    /// against its default ones at every larger size timed ([`large_step_start`]); `None` where
    /// the layer has no such tiles (the heuristic's start then stands).
    pub large_step_tokens: Option<usize>,
    /// The timed steps.
    pub samples: Vec<Sample>,
}

/// Why a profile file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// Reading or writing the file failed.
    #[error("dispatch profile {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not a profile (truncated, edited, another format).
    #[error("dispatch profile {path} is corrupt: {why}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// The file is for another GPU, spec or version than its name says.
    #[error("dispatch profile {path} is for {got}, not {expected}")]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// What the file should hold.
        expected: String,
        /// What it holds.
        got: String,
    },
}

/// The file name part of a GPU name: letters and digits, the rest as `-`.
fn slug(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect()
}

impl DispatchProfile {
    /// Where the profile of `spec` on GPU `device` lives under the kernel cache folder `dir`.
    pub fn path(dir: &Path, device: &str, spec: &MoeSpec) -> PathBuf {
        dir.join("profiles").join(slug(device)).join(format!("{}-v{}.json", spec.id(), env!("CARGO_PKG_VERSION")))
    }

    /// The profile as JSON: coefficients, source, and the samples.
    pub fn to_json(&self) -> String {
        let cost = |c: &super::LinearCost| serde_json::json!([c.c0, c.per_expert, c.per_pair]);
        let samples: Vec<_> =
            self.samples.iter().map(|s| serde_json::json!([s.family.name(), s.m, s.distinct, s.pairs, s.us])).collect();
        serde_json::json!({
            "device": self.device,
            "spec": self.spec_id,
            "version": self.version,
            "decode": cost(&self.model.decode),
            "grouped": cost(&self.model.grouped),
            "fused": self.model.fused.as_ref().map(cost),
            "one_token": self.model.one_token.map(|f| f.name()),
            "overhead_us": self.model.overhead_us,
            "large_step_tokens": self.large_step_tokens,
            "samples": samples,
        })
        .to_string()
    }

    /// Parse [`DispatchProfile::to_json`]'s output (`path` names the file in errors).
    pub fn from_json(text: &str, path: &Path) -> std::result::Result<DispatchProfile, ProfileError> {
        let corrupt = |why: String| ProfileError::Corrupt { path: path.to_path_buf(), why };
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| corrupt(e.to_string()))?;
        let text_of = |k: &str| v[k].as_str().map(String::from).ok_or_else(|| corrupt(format!("no string `{k}`")));
        let finite = |x: &serde_json::Value| x.as_f64().filter(|f| f.is_finite());
        let cost = |k: &str| -> std::result::Result<super::LinearCost, ProfileError> {
            let c: Vec<f64> = v[k].as_array().map(|a| a.iter().filter_map(finite).collect()).unwrap_or_default();
            match c[..] {
                [c0, d, p] => Ok(super::LinearCost { c0: c0 as f32, per_expert: d as f32, per_pair: p as f32 }),
                _ => Err(corrupt(format!("`{k}` is not three finite numbers"))),
            }
        };
        let overhead = finite(&v["overhead_us"]).ok_or_else(|| corrupt("no finite `overhead_us`".into()))?;
        let family_named = |n: &str| {
            [KernelFamily::WarpDecode, KernelFamily::GroupedGemm, KernelFamily::Fused]
                .into_iter()
                .find(|f| f.name() == n)
        };
        // Absent or null: fitted before the one-token choice existed, or without one-token samples.
        let one_token = match &v["one_token"] {
            serde_json::Value::Null => None,
            n => Some(
                n.as_str().and_then(family_named).ok_or_else(|| corrupt(format!("`one_token` {n} names no family")))?,
            ),
        };
        // Absent or null: profiled before the large-step start was measured, or without such tiles.
        let large_step_tokens = match &v["large_step_tokens"] {
            serde_json::Value::Null => None,
            n => Some(
                n.as_u64()
                    .filter(|&t| t > 0)
                    .ok_or_else(|| corrupt(format!("`large_step_tokens` {n} is not a positive count")))?
                    as usize,
            ),
        };
        let mut samples = Vec::new();
        for s in v["samples"].as_array().ok_or_else(|| corrupt("no `samples` array".into()))? {
            let Some(family) = s[0].as_str().and_then(family_named) else {
                return Err(corrupt(format!("a sample of no known family: {s}")));
            };
            let n = |i: usize| s[i].as_u64().ok_or_else(|| corrupt(format!("sample {s}: field {i}")));
            let us = finite(&s[4]).ok_or_else(|| corrupt(format!("sample {s}: no time")))?;
            samples.push(Sample { family, m: n(1)? as usize, distinct: n(2)? as u32, pairs: n(3)? as u32, us });
        }
        Ok(DispatchProfile {
            device: text_of("device")?,
            spec_id: text_of("spec")?,
            version: text_of("version")?,
            model: DispatchModel {
                decode: cost("decode")?,
                grouped: cost("grouped")?,
                // Absent or null: profiled without the fused family.
                fused: if v["fused"].is_null() { None } else { Some(cost("fused")?) },
                one_token,
                overhead_us: overhead as f32,
                source: ModelSource::Profile,
            },
            large_step_tokens,
            samples,
        })
    }

    /// Write the profile to its place under the cache folder `dir`; returns the path.
    pub fn save(&self, dir: &Path, spec: &MoeSpec) -> std::result::Result<PathBuf, ProfileError> {
        let path = DispatchProfile::path(dir, &self.device, spec);
        let io = |source| ProfileError::Io { path: path.clone(), source };
        std::fs::create_dir_all(path.parent().expect("a profile path has a folder")).map_err(io)?;
        // Written whole, then renamed: a reader never sees half a file.
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, self.to_json()).map_err(io)?;
        std::fs::rename(&tmp, &path).map_err(io)?;
        Ok(path)
    }

    /// The profile of `spec` on GPU `device` under `dir`, if there is one.
    pub fn load(
        dir: &Path,
        device: &str,
        spec: &MoeSpec,
    ) -> std::result::Result<Option<DispatchProfile>, ProfileError> {
        let path = DispatchProfile::path(dir, device, spec);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(ProfileError::Io { path, source }),
        };
        let p = DispatchProfile::from_json(&text, &path)?;
        let want = format!("{device} / {} / {}", spec.id(), env!("CARGO_PKG_VERSION"));
        let got = format!("{} / {} / {}", p.device, p.spec_id, p.version);
        if want != got {
            return Err(ProfileError::Mismatch { path, expected: want, got });
        }
        Ok(Some(p))
    }
}

/// A small deterministic generator (xorshift64*): profiles need no statistical quality, and the
/// library no `rand`.
struct Gen(u64);
impl Gen {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() >> 33) as usize % n.max(1)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// One step's routing: `m` tokens, each with `k` distinct experts of `e`; `j` varies `Same`.
fn routing(g: &mut Gen, r: Routing, m: usize, k: usize, e: usize, j: usize) -> Vec<i32> {
    let mut ids = Vec::with_capacity(m * k);
    for _ in 0..m {
        let pool = match r {
            Routing::Same => {
                ids.extend((0..k).map(|s| ((s + j * k) % e) as i32));
                continue;
            }
            Routing::Skew(p) if g.unit() < p => (e / 8).max(k),
            Routing::Skew(_) => e,
        };
        let start = ids.len();
        while ids.len() < start + k {
            let id = g.below(pool) as i32;
            if !ids[start..].contains(&id) {
                ids.push(id);
            }
        }
    }
    ids
}

/// A step's inputs on the device: x as raw 16-bit values, the routing, its weights.
struct Step {
    x: CudaSlice<u16>,
    ids: CudaSlice<i32>,
    w: CudaSlice<f32>,
    y: CudaSlice<u16>,
    distinct: u32,
}

fn steps(layer: &MoeLayer, g: &mut Gen, r: Routing, m: usize) -> Result<Vec<Step>> {
    let spec = layer.spec();
    let (h, k, e) = (spec.hidden() as usize, spec.top_k() as usize, spec.experts() as usize);
    let s = layer.stream();
    (0..STEPS)
        .map(|j| {
            let ids = routing(g, r, m, k, e, j);
            let mut d = ids.clone();
            d.sort_unstable();
            d.dedup();
            let x: Vec<u16> = (0..m * h)
                .map(|_| {
                    let v = (g.unit() * 2.0 - 1.0) as f32;
                    match spec.act_dtype() {
                        ActDtype::Bf16 => half::bf16::from_f32(v).to_bits(),
                        ActDtype::Fp16 => half::f16::from_f32(v).to_bits(),
                    }
                })
                .collect();
            Ok(Step {
                x: s.clone_htod(&x)?,
                ids: s.clone_htod(&ids)?,
                w: s.clone_htod(&vec![1.0 / k as f32; m * k])?,
                y: s.alloc_zeros(m * h)?,
                distinct: d.len() as u32,
            })
        })
        .collect()
}

/// Enqueue `steps` on the layer's stream: on `family`, or as `forward` picks it.
fn enqueue<T: ActElem + 'static>(layer: &MoeLayer, family: Option<KernelFamily>, steps: &[Step]) -> Result<()> {
    let s = layer.stream();
    for st in steps {
        let p = |b: &CudaSlice<u16>| crate::launch::ptr(b, s);
        // SAFETY: the step's own buffers, of m x H 16-bit values (T is the spec's activation type).
        let (x, y) = unsafe {
            (DeviceTensor::<T>::from_raw(p(&st.x), st.x.len()), DeviceTensorMut::<T>::from_raw(p(&st.y), st.y.len()))
        };
        let (ids, w) = (TopkIds::I32(DeviceTensor::new(&st.ids, s)), DeviceTensor::new(&st.w, s));
        match family {
            Some(f) => layer.forward_family_on(s, f, x, ids, w, y)?,
            None => layer.forward_on(s, x, ids, w, y)?,
        }
    }
    Ok(())
}

/// Median microseconds per step of `steps` run as `family` (or dispatched), graph replays.
fn time(layer: &MoeLayer, family: Option<KernelFamily>, steps: &[Step]) -> Result<f64> {
    let run = || match layer.spec().act_dtype() {
        ActDtype::Bf16 => enqueue::<half::bf16>(layer, family, steps),
        ActDtype::Fp16 => enqueue::<half::f16>(layer, family, steps),
    };
    let g = capture(layer.stream(), run)?;
    Ok(time_graph(layer.stream(), &g, 20)? / STEPS as f64)
}

/// What choosing on the device costs, us: dispatched steps whose choice the routing decides,
/// against the same steps on the family chosen (the layer dispatches with `free`).
fn dispatch_costs(layer: &mut MoeLayer, g: &mut Gen, free: DispatchModel) -> Result<Vec<f32>> {
    let spec = *layer.spec();
    let k = spec.kernel_spec();
    let mut costs = Vec::new();
    for m in [4usize, 8, 12] {
        if free.fixed_choice(m, k.top_k(), k.experts()).is_some() {
            continue;
        }
        for r in [Routing::Skew(0.0), Routing::Skew(0.85)] {
            let st = steps(layer, g, r, m)?;
            let mut chosen = Vec::new();
            for s in st.chunks(1) {
                match spec.act_dtype() {
                    ActDtype::Bf16 => enqueue::<half::bf16>(layer, None, s)?,
                    ActDtype::Fp16 => enqueue::<half::f16>(layer, None, s)?,
                }
                chosen.push(layer.last_choice()?.family);
            }
            if chosen.iter().all(|&f| f == chosen[0]) {
                costs.push((time(layer, None, &st)? - time(layer, Some(chosen[0]), &st)?) as f32);
            }
        }
    }
    Ok(costs)
}

/// Where the large-step tiles should start, from whether they were the better choice against the
/// default tiles at each of the ascending step sizes `grid` (no worse a worst relative regret
/// over uniform and skewed routing): the first size from which they were at every larger one,
/// else one past the last.
pub fn large_step_start(grid: &[usize], large_wins: &[bool]) -> usize {
    assert_eq!(grid.len(), large_wins.len(), "one verdict per step size");
    (0..grid.len()).find(|&i| large_wins[i..].iter().all(|&w| w)).map_or(grid.last().map_or(1, |&m| m + 1), |i| grid[i])
}

/// The grouped family's large-step tiles against its default ones at half to four times the
/// heuristic's start (`moe_codegen::heuristics::large_step_tokens`), uniform and skewed routing
/// (85% of each token's experts from the first eighth):
/// the start [`large_step_start`] picks, or `None` where the layer has no large-step tiles. The
/// right start depends on the format, the geometry and the GPU (an H200: per-channel int8 on
/// Qwen3-30B-A3B 11-23% faster on the large tiles at 768 and 896 tokens, below the heuristic's
/// 1024, while MXFP8 on every reference geometry and gpt-oss-20b's int8 and fp8 ran up to 60%
/// slower on them at the sizes a start of 48 pairs an expert would have given them;
/// docs/dispatch.md).
fn measure_large_step_start(layer: &mut MoeLayer, g: &mut Gen) -> Result<Option<usize>> {
    let Some(heuristic) = layer.large_step_tokens() else { return Ok(None) };
    let grid: Vec<usize> = [2, 3, 4, 6, 8, 16].iter().map(|q| (heuristic * q / 4).max(1)).collect();
    let mut wins = Vec::new();
    for &m in &grid {
        // Each tile set's worst relative regret over the two routings, as the host weighs families.
        let (mut large_regret, mut default_regret) = (0.0f64, 0.0f64);
        for r in [Routing::Skew(0.0), Routing::Skew(0.85)] {
            let st = steps(layer, g, r, m)?;
            let mut on = |from: usize| -> Result<f64> {
                layer.set_large_step_tokens(from);
                layer.reserve(m)?;
                time(layer, Some(KernelFamily::GroupedGemm), &st)
            };
            // Each twice, interleaved, the better median kept: near the crossover the two differ
            // by a few percent, about what one timing's interference is.
            let (d1, l1, d2, l2) = (on(m + 1)?, on(1)?, on(m + 1)?, on(1)?);
            let (default, large) = (d1.min(d2), l1.min(l2));
            large_regret = large_regret.max(large / default - 1.0);
            default_regret = default_regret.max(default / large - 1.0);
        }
        wins.push(large_regret <= default_regret);
    }
    let start = large_step_start(&grid, &wins);
    tracing::info!(?grid, ?wins, start, "large-step tiles timed");
    Ok(Some(start))
}

/// Time every family over the profile's grid on this GPU with the layer's weights, fit the
/// dispatcher's models, measure what choosing on the device costs and, where the grouped family
/// has large-step tiles, where they should start. The layer's threshold, dispatcher and
/// large-step start are restored, not changed: set the result with `set_dispatch_model` and
/// `set_large_step_tokens` (or save it, and later loads pick it up). About 10 s on an H200 for
/// Qwen3-30B-A3B bf16 (compiles excluded); formats with large-step tiles add their timing at
/// up to four times the heuristic's start (4096 tokens there).
pub fn profile(layer: &mut MoeLayer) -> Result<DispatchProfile> {
    if let Err(why) = layer.grouped_available() {
        return Err(RuntimeError::FamilyUnavailable { family: KernelFamily::GroupedGemm, why: why.into() });
    }
    let saved = (layer.prefill_threshold(), layer.dispatch_model(), layer.large_step_tokens());
    let result = profile_steps(layer);
    // The layer's own settings back, whatever the measurements gave.
    layer.set_prefill_threshold(saved.0);
    layer.set_dispatch_model(saved.1);
    if let Some(from) = saved.2 {
        layer.set_large_step_tokens(from);
    }
    result
}

fn profile_steps(layer: &mut MoeLayer) -> Result<DispatchProfile> {
    let spec = *layer.spec();
    // Warp decode's scratch covers the steps the profile times whatever the layer's threshold.
    layer.set_prefill_threshold(DEFAULT_PREFILL_THRESHOLD);
    layer.reserve(*PROFILE_TOKENS.iter().max().expect("tokens"))?;
    let mut g = Gen(0x9e37_79b9_7f4a_7c15);
    let mut samples = Vec::new();
    for m in PROFILE_TOKENS {
        for r in ROUTINGS {
            let st = steps(layer, &mut g, r, m)?;
            // As moe_choose counts them: the shared experts' slots too (`MoeSpec::kernel_spec`).
            let shared = spec.shared_experts();
            let distinct = st.iter().map(|s| s.distinct).sum::<u32>() / STEPS as u32 + shared;
            let pairs = (m * (spec.top_k() + shared) as usize) as u32;
            let fused = layer.fused_available().is_ok().then_some(KernelFamily::Fused);
            for family in [KernelFamily::WarpDecode, KernelFamily::GroupedGemm].into_iter().chain(fused) {
                let us = time(layer, Some(family), &st)?;
                samples.push(Sample { family, m, distinct, pairs, us });
            }
        }
    }
    let fit = DispatchModel::fit(&samples).map_err(|e: ModelFitError| RuntimeError::Profile(e.to_string()))?;
    // What the device's choice costs: dispatched steps against the same steps on the family chosen.
    let free = DispatchModel { overhead_us: 0.0, ..fit };
    layer.set_dispatch_model(Some(free));
    let mut costs = dispatch_costs(layer, &mut g, free)?;
    let large_step_tokens = measure_large_step_start(layer, &mut g)?;
    costs.sort_by(f32::total_cmp);
    let overhead_us = costs.get(costs.len() / 2).map_or(fit.overhead_us, |c| c.max(0.0));
    let device = layer.stream().context().name().unwrap_or_else(|_| "unknown".into());
    tracing::info!(?fit, ?costs, "dispatch profile fitted");
    Ok(DispatchProfile {
        device,
        spec_id: spec.id(),
        version: env!("CARGO_PKG_VERSION").into(),
        model: DispatchModel { overhead_us, ..fit },
        large_step_tokens,
        samples,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::LinearCost;

    fn sample_profile() -> (MoeSpec, DispatchProfile) {
        let spec = MoeSpec::builder(2048, 768, 128, 8).build().unwrap();
        let lin = |c0, per_expert, per_pair| LinearCost { c0, per_expert, per_pair };
        let p = DispatchProfile {
            device: "NVIDIA H100 80GB HBM3".into(),
            spec_id: spec.id(),
            version: env!("CARGO_PKG_VERSION").into(),
            model: DispatchModel {
                decode: lin(6.5, 0.93, 1.57),
                grouped: lin(27.25, 2.15, 0.024),
                fused: Some(lin(11.0, 1.9, 1.2)),
                one_token: Some(KernelFamily::Fused),
                overhead_us: 9.9,
                source: ModelSource::Profile,
            },
            large_step_tokens: Some(768),
            samples: vec![Sample { family: KernelFamily::GroupedGemm, m: 8, distinct: 22, pairs: 64, us: 86.5 }],
        };
        (spec, p)
    }

    #[test]
    fn a_profile_round_trips_through_its_file() {
        let (spec, p) = sample_profile();
        let dir = tempfile::tempdir().unwrap();
        let path = p.save(dir.path(), &spec).unwrap();
        assert!(path.starts_with(dir.path().join("profiles").join("NVIDIA-H100-80GB-HBM3")), "{}", path.display());
        assert_eq!(DispatchProfile::load(dir.path(), &p.device, &spec).unwrap(), Some(p.clone()));
        // No file: no profile. Another GPU's name: another file.
        assert_eq!(DispatchProfile::load(dir.path(), "NVIDIA H200", &spec).unwrap(), None);
        // A file from before the one-token choice (no `one_token`) reads as none.
        let old = p.to_json().replacen("\"one_token\":\"fused\",", "", 1);
        assert_ne!(old, p.to_json());
        let read = DispatchProfile::from_json(&old, &path).unwrap();
        assert_eq!(read.model, DispatchModel { one_token: None, ..p.model });
        // Nor one from before the large-step start was measured.
        let old = p.to_json().replacen("\"large_step_tokens\":768,", "", 1);
        assert_ne!(old, p.to_json());
        assert_eq!(DispatchProfile::from_json(&old, &path).unwrap().large_step_tokens, None);
    }

    #[test]
    fn the_large_step_tiles_start_where_they_stay_ahead() {
        let grid = [512, 768, 1024, 1536, 2048, 4096];
        let t = true;
        let f = false;
        assert_eq!(large_step_start(&grid, &[f, t, t, t, t, t]), 768);
        assert_eq!(large_step_start(&grid, &[t, t, t, t, t, t]), 512);
        // A win below a loss does not count: the tiles must stay ahead from their start on.
        assert_eq!(large_step_start(&grid, &[t, f, t, f, t, t]), 2048);
        assert_eq!(large_step_start(&grid, &[t, t, t, t, t, f]), 4097);
        assert_eq!(large_step_start(&grid, &[f; 6]), 4097);
    }

    #[test]
    fn corrupt_and_mismatched_files_are_typed_errors() {
        let (spec, p) = sample_profile();
        let dir = tempfile::tempdir().unwrap();
        let path = p.save(dir.path(), &spec).unwrap();
        let json = p.to_json();
        let no_overhead = json.replacen("\"overhead_us\":", "\"overhead_us\":null,\"was\":", 1);
        let odd_family = json.replacen("\"one_token\":\"fused\"", "\"one_token\":\"fastest\"", 1);
        assert_ne!(odd_family, json);
        let no_start = json.replacen("\"large_step_tokens\":768", "\"large_step_tokens\":0", 1);
        assert_ne!(no_start, json);
        for bad in [&json[..json.len() / 2], "[]", &no_overhead, &odd_family, &no_start] {
            std::fs::write(&path, bad).unwrap();
            let e = DispatchProfile::load(dir.path(), &p.device, &spec).unwrap_err();
            assert!(matches!(e, ProfileError::Corrupt { .. }), "{bad}: {e}");
        }
        std::fs::write(&path, json.replace(&spec.id(), "h4096_i14336_e8_k2_bf16_bf16_silu")).unwrap();
        let e = DispatchProfile::load(dir.path(), &p.device, &spec).unwrap_err();
        assert!(matches!(e, ProfileError::Mismatch { .. }), "{e}");
    }

    #[test]
    fn profiled_routings_have_distinct_experts_per_token_and_their_skew() {
        let mut g = Gen(7);
        let (m, k, e) = (15, 8, 128);
        for r in ROUTINGS {
            let ids = routing(&mut g, r, m, k, e, 1);
            assert_eq!(ids.len(), m * k);
            for t in ids.chunks(k) {
                let mut s = t.to_vec();
                s.sort_unstable();
                s.dedup();
                assert_eq!(s.len(), k, "{r:?}: {t:?}");
                assert!(t.iter().all(|&id| (0..e as i32).contains(&id)));
            }
            if let Routing::Skew(p) = r {
                let hot = ids.iter().filter(|&&id| id < 16).count() as f64 / ids.len() as f64;
                // All tokens in the hot eighth at p = 1; about an eighth at p = 0.
                assert!((hot - (p + (1.0 - p) / 8.0)).abs() < 0.2, "{r:?}: {hot}");
            }
        }
    }
}
