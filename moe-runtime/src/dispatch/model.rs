//! The dispatcher's per-family cost models: a step's time as a linear function of what its live
//! routing touches, evaluated on the device each step (`moe_prepare` or `moe_choose`) and, where
//! the routing cannot change the answer, on the host.
//!
//! ```text
//! t(family) = c0 + per_expert * D + per_pair * P      (microseconds)
//! ```
//!
//! with `D` the distinct experts the step touches and `P` its valid (token, expert) pairs. Warp
//! decode streams each touched expert's gate/up rows once but reads w2 per pair (re-reads of a
//! shared expert come from L2), so both terms matter; the grouped GEMMs read each touched expert
//! once, after a fixed cost (alignment, two GEMM prologues, the combine). Skewed routing lowers `D`
//! for the same `P`, which is what moves the crossover.
//!
//! The models come from a profile (timed steps on this device, [`DispatchModel::fit`]) or, without
//! one, from [`DispatchModel::analytic`]: coefficients in units of the time one expert's weights take
//! to stream at the device's DRAM bandwidth, fitted once on an H200 over the four reference
//! geometries (docs/dispatch.md).

use moe_codegen::params::DispatchPlanes;
use moe_codegen::{KernelFamily, MoeSpec};

/// One family's modelled step time: `c0 + per_expert * D + per_pair * P` microseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearCost {
    /// Fixed cost (launches, pipeline fill), us.
    pub c0: f32,
    /// Per distinct expert touched, us.
    pub per_expert: f32,
    /// Per valid (token, expert) pair, us.
    pub per_pair: f32,
}

impl LinearCost {
    /// Predicted microseconds for `distinct` experts and `pairs` pairs, in the order and the
    /// (unfused, round-to-nearest) f32 arithmetic `moe_choose` uses, so host and device agree.
    pub fn predict(&self, distinct: u32, pairs: u32) -> f32 {
        (self.c0 + self.per_expert * distinct as f32) + self.per_pair * pairs as f32
    }
}

/// Where a model's coefficients came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelSource {
    /// Fitted to steps timed on this device ([`DispatchModel::fit`]).
    Profile,
    /// The analytic fallback ([`DispatchModel::analytic`]).
    Analytic,
}

/// The dispatcher's models of its candidate families: warp decode, the grouped GEMMs and, where
/// the layer has it, the fused family. The host picks one where its model says no routing of the
/// step's token count makes it much worse than the best; otherwise the device (`moe_choose`)
/// picks the least prediction for the step's live routing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DispatchModel {
    /// Warp decode.
    pub decode: LinearCost,
    /// The grouped GEMMs.
    pub grouped: LinearCost,
    /// The fused family, where the layer has it.
    pub fused: Option<LinearCost>,
    /// The family fastest in the profile's one-token steps. Every routing of one token touches
    /// `top_k` experts in `top_k` pairs, so there the timings settle the choice and the fitted
    /// planes (whose error is a few percent where two families nearly tie) are not consulted.
    pub one_token: Option<KernelFamily>,
    /// What choosing on the device costs a step, us: the choice and the early exits of the
    /// families not chosen. The host leaves a step's choice to the device only where the models
    /// predict a larger gain than this.
    pub overhead_us: f32,
    /// Where the coefficients came from.
    pub source: ModelSource,
}

/// The families a step's device weighs ([`DispatchModel::device_menu`]): the grouped GEMMs,
/// the fused family where `model` holds it, warp decode where `decode`. Only these launch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceMenu {
    /// The models, the fused family's only where it is a candidate.
    pub model: DispatchModel,
    /// Whether warp decode is a candidate.
    pub decode: bool,
}

impl DeviceMenu {
    /// The planes as the device reads them.
    pub fn planes(&self) -> DispatchPlanes {
        let abc = |c: LinearCost| [c.c0, c.per_expert, c.per_pair];
        let m = &self.model;
        DispatchPlanes {
            decode: abc(m.decode),
            grouped: abc(m.grouped),
            fused: m.fused.map_or([0.0; 3], abc),
            fused_on: m.fused.is_some() as i32,
            decode_on: self.decode as i32,
        }
    }

    /// The least prediction among the menu's families.
    fn floor(&self, distinct: u32, pairs: u32) -> f32 {
        self.model
            .candidates()
            .filter(|&(f, _)| self.decode || f != KernelFamily::WarpDecode)
            .map(|(_, c)| c.predict(distinct, pairs))
            .fold(f32::INFINITY, f32::min)
    }
}

/// How much closer to the best (relative regret) the device's choice must be predicted than the
/// host's for the host to defer to it: the profiles' `overhead_us` under-reads what a step the
/// device chooses costs in a report's runs (docs/dispatch.md), and in a replay of the measured
/// H100 report this margin left no case more than 2% slower than the fixed threshold.
pub const DEVICE_MARGIN: f32 = 0.1;

/// Device dispatch's cost where no profile measured it, us (H200, docs/dispatch.md: 4 to 14, and
/// 3.4 to 6 since the one-block front lost its unused code; not re-fitted to that).
pub const DEFAULT_OVERHEAD_US: f32 = 8.0;

/// A timed step a profile fits from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// The family that ran the step.
    pub family: KernelFamily,
    /// Tokens in the step.
    pub m: usize,
    /// Distinct experts the step touched.
    pub distinct: u32,
    /// Valid (token, expert) pairs.
    pub pairs: u32,
    /// Median microseconds.
    pub us: f64,
}

/// Why a profile could not be fitted.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ModelFitError {
    /// A family has fewer samples with independent features than the model's three terms.
    #[error("{family}: {samples} sample(s) do not determine three terms (vary the tokens and the routing's skew)")]
    Underdetermined {
        /// The family.
        family: KernelFamily,
        /// Its samples.
        samples: usize,
    },
    /// A sample that is not a finite positive time.
    #[error("a sample time of {0} us")]
    BadTime(f64),
}

/// Fallback coefficients (H200 fit, docs/dispatch.md), in units of one expert's streaming time,
/// except the constants (us): grouped `(c0, per_expert, per_pair)`, then warp decode's, for
/// formats the grouped GEMMs take as they are stored (16-bit, fp8) and for those they decode in
/// registers.
const FALLBACK_STORED: [[f32; 3]; 2] = [[25.0, 1.1, 0.1], [10.0, 0.55, 0.75]];
const FALLBACK_DECODED: [[f32; 3]; 2] = [[25.0, 2.0, 0.1], [10.0, 0.5, 2.0]];
/// The fused family's fallback (H100 fit, docs/dispatch.md), in the same units: 16-bit weights,
/// then every format it decodes.
const FALLBACK_FUSED: [[f32; 3]; 2] = [[11.0, 0.66, 0.42], [11.0, 0.8, 0.6]];

impl DispatchModel {
    /// The analytic fallback for `spec` on a device of `dram_gbps` peak bandwidth.
    pub fn analytic(spec: &MoeSpec, dram_gbps: f64) -> DispatchModel {
        // One expert's weights and scales at the peak bandwidth, us (H100-like if unknown).
        let gbps = if dram_gbps > 0.0 { dram_gbps } else { 3350.0 };
        let tau = (spec.expert_bytes() as f64 / (gbps * 1e3)) as f32;
        let c = if moe_codegen::grouped::decodes_weights(spec) { FALLBACK_DECODED } else { FALLBACK_STORED };
        let cost = |[c0, d, p]: [f32; 3]| LinearCost { c0, per_expert: d * tau, per_pair: p * tau };
        let sixteen_bit =
            matches!(spec.weight_format(), moe_codegen::WeightFormat::Bf16 | moe_codegen::WeightFormat::Fp16);
        DispatchModel {
            grouped: cost(c[0]),
            decode: cost(c[1]),
            fused: moe_codegen::fused_support(spec).is_ok().then(|| cost(FALLBACK_FUSED[!sixteen_bit as usize])),
            one_token: None,
            overhead_us: DEFAULT_OVERHEAD_US,
            source: ModelSource::Analytic,
        }
    }

    /// The planes as the device reads them (`moe_choose`, a one-block `moe_prepare`), every
    /// modelled family a candidate.
    pub fn planes(&self) -> DispatchPlanes {
        DeviceMenu { model: *self, decode: true }.planes()
    }

    /// The family the device picks for `distinct` experts and `pairs` pairs, as `moe_choose`
    /// decides: the least prediction of every family this model holds ([`DispatchModel::best`];
    /// a step's device is given [`DispatchModel::device_menu`]).
    pub fn choose(&self, distinct: u32, pairs: u32) -> KernelFamily {
        self.best(distinct, pairs)
    }

    /// The candidates the device weighs for a step of `m` tokens: the grouped GEMMs (whose front
    /// makes the choice), and warp decode and the fused family only where their models make them
    /// the fastest for some number of experts the step can touch (`top_k` to
    /// `min(m * top_k, experts)`). Elsewhere their kernels, launched to return at once, would only
    /// add to the step (warp decode's skipped gate_up most: docs/dispatch.md).
    pub fn device_menu(&self, m: usize, top_k: u32, experts: u32) -> DeviceMenu {
        let pairs = (m as u64 * top_k as u64).min(u32::MAX as u64) as u32;
        let (few, most) = (top_k.min(pairs), pairs.min(experts));
        let wins = |f: KernelFamily| (few..=most).any(|d| self.best(d, pairs) == f);
        DeviceMenu {
            model: DispatchModel { fused: self.fused.filter(|_| wins(KernelFamily::Fused)), ..*self },
            decode: wins(KernelFamily::WarpDecode),
        }
    }

    /// The least prediction over the modelled families.
    fn floor(&self, distinct: u32, pairs: u32) -> f32 {
        self.candidates().map(|(_, c)| c.predict(distinct, pairs)).fold(f32::INFINITY, f32::min)
    }

    /// The model without the fused family where `fused` is false (a layer without it).
    pub fn restricted(self, fused: bool) -> DispatchModel {
        DispatchModel {
            fused: self.fused.filter(|_| fused),
            one_token: self.one_token.filter(|&f| fused || f != KernelFamily::Fused),
            ..self
        }
    }

    /// Every modelled family with its model.
    fn candidates(&self) -> impl Iterator<Item = (KernelFamily, LinearCost)> {
        [(KernelFamily::WarpDecode, self.decode), (KernelFamily::GroupedGemm, self.grouped)]
            .into_iter()
            .chain(self.fused.map(|f| (KernelFamily::Fused, f)))
    }

    /// The family predicted fastest among all modelled ones (ties to the first of warp decode,
    /// grouped, fused).
    pub fn best(&self, distinct: u32, pairs: u32) -> KernelFamily {
        self.candidates()
            .fold((KernelFamily::WarpDecode, f32::INFINITY), |b, (f, c)| {
                let t = c.predict(distinct, pairs);
                if t < b.1 {
                    (f, t)
                } else {
                    b
                }
            })
            .0
    }

    /// The family for a step of `m` tokens where the host can settle it, `None` where the device
    /// should choose (among every modelled family) from the live routing. The host
    /// weighs three routings: every token's experts drawn from the hottest eighth of them (the
    /// skew real traffic reaches; `top_k` experts where an eighth is fewer), uniform, and every
    /// expert distinct (`min(m * top_k, experts)`). It takes the family whose predicted time is
    /// least above the best at its worst of the three, relative to that best, unless the device's
    /// own choice, what choosing costs included, is predicted closer by more than
    /// [`DEVICE_MARGIN`]. (Weighing the fewest experts
    /// m tokens can touch instead, or keeping uniform routing's family within an absolute margin,
    /// did worse in a replay of the measured H100 report: docs/dispatch.md.) A step of one token
    /// takes [`DispatchModel::one_token`] where the profile timed one.
    pub fn fixed_choice(&self, m: usize, top_k: u32, experts: u32) -> Option<KernelFamily> {
        if let (1, Some(f)) = (m, self.one_token) {
            return Some(f);
        }
        let pairs = (m as u64 * top_k as u64).min(u32::MAX as u64) as u32;
        let (few, most) = (top_k.min(pairs), pairs.min(experts));
        let distinct = |pool: u32| {
            // Expected distinct experts of m tokens, each with top_k of `pool` experts.
            let untouched = (1.0 - top_k as f64 / pool.max(1) as f64).max(0.0).powi(m.min(1 << 20) as i32);
            ((pool as f64 * (1.0 - untouched)).round() as u32).clamp(few, most)
        };
        let points = [distinct((experts / 8).max(top_k)), distinct(experts), most];
        let floor = |d: u32| self.floor(d, pairs).max(1e-3);
        let regret =
            |t: &dyn Fn(u32) -> f32| points.iter().map(|&d| (t(d) - floor(d)) / floor(d)).fold(0.0f32, f32::max);
        let usual = self.best(points[1], pairs);
        let (host, host_regret) = self
            .candidates()
            .map(|(f, c)| (f, regret(&|d| c.predict(d, pairs))))
            .fold((usual, regret(&|d| self.model_of(usual).predict(d, pairs))), |b, c| if c.1 < b.1 { c } else { b });
        let menu = self.device_menu(m, top_k, experts);
        let device_regret = regret(&|d| menu.floor(d, pairs) + self.overhead_us);
        (host_regret <= device_regret + DEVICE_MARGIN).then_some(host)
    }

    fn model_of(&self, family: KernelFamily) -> LinearCost {
        match family {
            KernelFamily::GroupedGemm => self.grouped,
            KernelFamily::Fused => self.fused.unwrap_or(self.grouped),
            _ => self.decode,
        }
    }

    /// Fit each family's model by least squares on relative error to timed steps (the fused
    /// family's where there are samples of it).
    pub fn fit(samples: &[Sample]) -> Result<DispatchModel, ModelFitError> {
        if let Some(s) = samples.iter().find(|s| !(s.us.is_finite() && s.us > 0.0)) {
            return Err(ModelFitError::BadTime(s.us));
        }
        let one = |family: KernelFamily| -> Result<LinearCost, ModelFitError> {
            // Relative error is what a choice costs: each sample weighted by 1 / its time, so the
            // few-token steps count as much as the long ones.
            let rows: Vec<[f64; 3]> = samples
                .iter()
                .filter(|s| s.family == family)
                .map(|s| [1.0 / s.us, s.distinct as f64 / s.us, s.pairs as f64 / s.us])
                .collect();
            let y: Vec<f64> = samples.iter().filter(|s| s.family == family).map(|_| 1.0).collect();
            let c = solve3(&rows, &y).ok_or(ModelFitError::Underdetermined { family, samples: rows.len() })?;
            Ok(LinearCost { c0: c[0] as f32, per_expert: c[1] as f32, per_pair: c[2] as f32 })
        };
        let fused = samples.iter().any(|s| s.family == KernelFamily::Fused);
        Ok(DispatchModel {
            decode: one(KernelFamily::WarpDecode)?,
            grouped: one(KernelFamily::GroupedGemm)?,
            fused: if fused { Some(one(KernelFamily::Fused)?) } else { None },
            one_token: fastest_one_token(samples),
            overhead_us: DEFAULT_OVERHEAD_US,
            source: ModelSource::Profile,
        })
    }
}

/// The family of least median time over the one-token samples, where every family sampled at all
/// was sampled at one token (ties to the first of warp decode, grouped, fused).
fn fastest_one_token(samples: &[Sample]) -> Option<KernelFamily> {
    let families = [KernelFamily::WarpDecode, KernelFamily::GroupedGemm, KernelFamily::Fused];
    let mut best: Option<(KernelFamily, f64)> = None;
    for family in families.into_iter().filter(|&f| samples.iter().any(|s| s.family == f)) {
        let mut t: Vec<f64> = samples.iter().filter(|s| s.family == family && s.m == 1).map(|s| s.us).collect();
        if t.is_empty() {
            return None;
        }
        t.sort_by(f64::total_cmp);
        let median = t[t.len() / 2];
        if best.is_none_or(|(_, b)| median < b) {
            best = Some((family, median));
        }
    }
    best.map(|(f, _)| f)
}

/// Least squares for three unknowns through the normal equations, solved by Cramer's rule on
/// column-scaled features; `None` when they are (nearly) dependent.
fn solve3(rows: &[[f64; 3]], y: &[f64]) -> Option<[f64; 3]> {
    let scale: Vec<f64> = (0..3).map(|j| rows.iter().map(|r| r[j] * r[j]).sum::<f64>().sqrt()).collect();
    if rows.len() < 3 || scale.contains(&0.0) {
        return None;
    }
    let mut a = [[0.0f64; 3]; 3];
    let mut b = [0.0f64; 3];
    for (r, &t) in rows.iter().zip(y) {
        let r = [r[0] / scale[0], r[1] / scale[1], r[2] / scale[2]];
        for i in 0..3 {
            b[i] += r[i] * t;
            for j in 0..3 {
                a[i][j] += r[i] * r[j];
            }
        }
    }
    let det = |m: &[[f64; 3]; 3]| {
        m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
    };
    let d = det(&a);
    if d.abs() < 1e-9 {
        return None;
    }
    let mut x = [0.0; 3];
    for (k, xk) in x.iter_mut().enumerate() {
        let mut m = a;
        (0..3).for_each(|i| m[i][k] = b[i]);
        *xk = det(&m) / d / scale[k];
    }
    Some(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use moe_codegen::WeightFormat;

    fn lin(c0: f32, per_expert: f32, per_pair: f32) -> LinearCost {
        LinearCost { c0, per_expert, per_pair }
    }

    /// A profiled model of these planes and device overhead, without a one-token choice.
    fn profiled(decode: LinearCost, grouped: LinearCost, fused: Option<LinearCost>, overhead_us: f32) -> DispatchModel {
        DispatchModel { decode, grouped, fused, one_token: None, overhead_us, source: ModelSource::Profile }
    }

    fn qwen(f: WeightFormat) -> MoeSpec {
        MoeSpec::builder(2048, 768, 128, 8).weight_format(f).build().unwrap()
    }

    #[test]
    fn the_device_reads_the_models_as_planes() {
        let m = profiled(lin(1.0, 2.0, 3.0), lin(4.0, 5.0, 6.0), Some(lin(7.0, 8.0, 9.0)), 0.0);
        let p = m.planes();
        assert_eq!((p.decode, p.grouped, p.fused, p.fused_on), ([1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0], 1));
        let p = DispatchModel { fused: None, ..m }.planes();
        assert_eq!((p.fused, p.fused_on), ([0.0; 3], 0));
    }

    #[test]
    fn the_fused_family_is_on_the_device_menu_only_where_it_can_win() {
        // 8 tokens, top-8 of 128: decode 32; grouped 3 an expert; fused 12 + 0.6 an expert, the
        // least from 8 to 33 experts.
        let m = profiled(lin(0.0, 0.0, 0.5), lin(0.0, 3.0, 0.0), Some(lin(12.0, 0.6, 0.0)), 0.0);
        assert_eq!(m.device_menu(8, 8, 128).model.fused, m.fused);
        // A fused constant above every other prediction: off the menu.
        let slow = DispatchModel { fused: Some(lin(500.0, 0.0, 0.0)), ..m };
        assert_eq!(slow.device_menu(8, 8, 128).model.fused, None);
        assert_eq!(slow.device_menu(8, 8, 128).model.decode, slow.decode);
        assert_eq!(slow.device_menu(8, 8, 128).planes().fused_on, 0);
    }

    #[test]
    fn warp_decode_is_on_the_device_menu_only_where_it_can_win() {
        // As above: warp decode (32) is the least from 34 experts on, the fused kernel below.
        let m = profiled(lin(0.0, 0.0, 0.5), lin(0.0, 3.0, 0.0), Some(lin(12.0, 0.6, 0.0)), 0.0);
        let menu = m.device_menu(8, 8, 128);
        assert!(menu.decode && menu.model.fused.is_some());
        assert_eq!((menu.planes().decode_on, menu.planes().fused_on), (1, 1));
        // Least only at one count of experts (32 against the fused kernel's 32.4 at 34, from
        // the grouped GEMMs' 102): still a candidate.
        let edge = DispatchModel { fused: Some(lin(12.0, 0.6, 0.0)), decode: lin(31.99, 0.0, 0.0), ..m };
        assert!(edge.device_menu(8, 8, 34).decode);
        // Above the least at every count the step can touch: not launched, not chosen.
        // (The fused kernel from 26 experts on, the grouped GEMMs below.)
        let slow = DispatchModel { decode: lin(0.0, 0.0, 5.0), fused: Some(lin(60.0, 0.6, 0.0)), ..m };
        let menu = slow.device_menu(8, 8, 128);
        assert!(!menu.decode && menu.model.fused.is_some());
        assert_eq!(menu.planes().decode_on, 0);
        // The host weighs what the device then picks from: the fused kernel and the grouped GEMMs.
        assert_eq!(slow.fixed_choice(8, 8, 128), None, "a free device choice between two families");
    }

    #[test]
    fn a_fit_recovers_the_coefficients_and_rejects_too_little() {
        let (dec, grp) = ([12.0, 1.2, 1.4], [26.0, 2.1, 0.1]);
        let mut samples = Vec::new();
        for (m, d) in [(2, 16), (4, 20), (4, 31), (8, 22), (8, 50), (16, 40), (16, 81)] {
            for (family, c) in [(KernelFamily::WarpDecode, dec), (KernelFamily::GroupedGemm, grp)] {
                let p = m as f64 * 8.0;
                samples.push(Sample {
                    family,
                    m,
                    distinct: d,
                    pairs: m as u32 * 8,
                    us: c[0] + c[1] * d as f64 + c[2] * p,
                });
            }
        }
        let model = DispatchModel::fit(&samples).unwrap();
        assert_eq!(model.source, ModelSource::Profile);
        for (got, want) in [(model.decode, dec), (model.grouped, grp)] {
            for (g, w) in [got.c0, got.per_expert, got.per_pair].into_iter().zip(want) {
                assert!((g as f64 - w).abs() < 1e-3 * w.max(1.0), "{got:?} vs {want:?}");
            }
        }
        // Uniform at M = 2: decode; 8 tokens on 22 experts: grouped.
        assert_eq!(model.choose(16, 16), KernelFamily::WarpDecode);
        assert_eq!(model.choose(22, 64), KernelFamily::GroupedGemm);
        // One token per family cannot fix three terms; a NaN time is refused.
        let few: Vec<Sample> = samples.iter().take(4).copied().collect();
        assert!(matches!(DispatchModel::fit(&few), Err(ModelFitError::Underdetermined { .. })));
        let mut bad = samples.clone();
        bad[3].us = f64::NAN;
        assert!(matches!(DispatchModel::fit(&bad), Err(ModelFitError::BadTime(_))));
    }

    #[test]
    fn the_routing_fixes_the_choice_only_between_the_bounds() {
        let model = DispatchModel { fused: None, ..DispatchModel::analytic(&qwen(WeightFormat::Bf16), 3350.0) };
        // One token touches top_k experts whatever the routing: the host decides (decode).
        assert_eq!(model.fixed_choice(1, 8, 128), Some(KernelFamily::WarpDecode));
        assert_eq!(model.choose(8, 32), KernelFamily::GroupedGemm);
        assert_eq!(model.choose(32, 32), KernelFamily::WarpDecode);
        // Many tokens: grouped at every routing.
        assert_eq!(model.fixed_choice(64, 8, 128), Some(KernelFamily::GroupedGemm));
        // Four tokens of top-8 over 128 experts: 15 experts from the hot eighth, 29 uniform, 32
        // distinct. Decode costs 145.5 / 152.5 / 154 us there, grouped 120 / 204 / 222: each is
        // 21% or 44% off the best at one of them, so the device chooses where that costs less
        // than the margin...
        let split = profiled(lin(10.0, 0.5, 4.0), lin(30.0, 6.0, 0.0), None, 0.0);
        assert_eq!(split.fixed_choice(4, 8, 128), None);
        // ... and the host takes decode (least worst regret) where choosing costs 30 us.
        let costly = DispatchModel { overhead_us: 30.0, ..split };
        assert_eq!(costly.fixed_choice(4, 8, 128), Some(KernelFamily::WarpDecode));
    }

    #[test]
    fn the_host_takes_the_fused_family_where_no_routing_makes_it_much_worse() {
        let model = profiled(lin(10.0, 1.0, 2.0), lin(30.0, 2.5, 0.0), Some(lin(20.0, 1.6, 0.5)), 8.0);
        // 4 tokens: 15 / 29 / 32 experts (hot eighth, uniform, distinct). Decode costs 89 / 103 /
        // 106 us, grouped 67.5 / 102.5 / 110, fused 60 / 82.4 / 87.2: fused is best at all three.
        assert_eq!(model.best(15, 32), KernelFamily::Fused);
        assert_eq!(model.fixed_choice(4, 8, 128), Some(KernelFamily::Fused));
        // One token: decode (34 against 36.8).
        assert_eq!(model.fixed_choice(1, 8, 128), Some(KernelFamily::WarpDecode));
        // Without the fused family: grouped is best at 15 and 29 experts and 3.8% off at 32,
        // decode 31.9% off at 15. The host keeps grouped: the device's choice, 8 us over the best
        // (up to 11.9% at 15 experts), is not closer, even were choosing free (0 against 3.8%,
        // inside the margin).
        let two = DispatchModel { fused: None, ..model };
        assert_eq!(two.fixed_choice(4, 8, 128), Some(KernelFamily::GroupedGemm));
        let free = DispatchModel { overhead_us: 0.0, ..two };
        assert_eq!(free.fixed_choice(4, 8, 128), Some(KernelFamily::GroupedGemm));
    }

    #[test]
    fn one_token_steps_take_the_family_the_profile_timed_fastest() {
        // Planes that tie at one token (decode 10 + 1.5 * 8 + 1.25 * 8 = 32 against fused
        // 16 + 1 * 8 + 1 * 8 = 32), while the timings put fused 5% ahead.
        let (dec, grp, fus) = (lin(10.0, 1.5, 1.25), lin(30.0, 2.5, 0.0), lin(16.0, 1.0, 1.0));
        let mut samples = Vec::new();
        for (m, d) in [(1u32, 8u32), (2, 16), (4, 15), (4, 29), (8, 22), (8, 50), (12, 60), (15, 70)] {
            for (family, c) in
                [(KernelFamily::WarpDecode, dec), (KernelFamily::GroupedGemm, grp), (KernelFamily::Fused, fus)]
            {
                let mut us = c.predict(d, m * 8) as f64;
                if m == 1 {
                    us *= if family == KernelFamily::Fused { 0.97 } else { 1.02 };
                }
                for _ in 0..if m == 1 { 5 } else { 1 } {
                    samples.push(Sample { family, m: m as usize, distinct: d, pairs: m * 8, us });
                }
            }
        }
        let model = DispatchModel::fit(&samples).unwrap();
        assert_eq!(model.one_token, Some(KernelFamily::Fused));
        assert_eq!(model.fixed_choice(1, 8, 128), Some(KernelFamily::Fused));
        // A layer without the fused family has no fused one-token choice: the planes decide.
        let two = model.restricted(false);
        assert_eq!((two.fused, two.one_token), (None, None));
        assert_eq!(two.fixed_choice(1, 8, 128), Some(KernelFamily::WarpDecode));
        // No one-token samples of a family that has samples: no one-token choice.
        let partial: Vec<Sample> =
            samples.iter().filter(|s| s.m > 1 || s.family != KernelFamily::GroupedGemm).copied().collect();
        assert_eq!(DispatchModel::fit(&partial).unwrap().one_token, None);
    }

    #[test]
    fn the_fallback_scales_with_bytes_and_bandwidth() {
        let (bf16, fp4) = (qwen(WeightFormat::Bf16), qwen(WeightFormat::Mxfp4));
        let a = DispatchModel::analytic(&bf16, 3350.0);
        let b = DispatchModel::analytic(&bf16, 6700.0);
        assert!((a.grouped.per_expert / b.grouped.per_expert - 2.0).abs() < 1e-5);
        assert!(DispatchModel::analytic(&fp4, 3350.0).grouped.per_expert < a.grouped.per_expert);
        // An unknown bandwidth still gives a usable model.
        assert!(DispatchModel::analytic(&bf16, 0.0).decode.per_pair > 0.0);
        assert_eq!(a.source, ModelSource::Analytic);
    }
}
