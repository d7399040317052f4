//! The wave cost model of RaMP (the dispatcher's design, `../shared/seeds/001`): a kernel
//! configuration's time as a function of its CTA grid alone, four terms fitted by least squares
//! from a few timed steps,
//!
//! ```text
//! t(G) = c0 + c1 * ceil(G / S) + c2 * G + c3 * sqrt(L / S)
//! ```
//!
//! with `G` the step's CTAs, `S` the CTAs one wave holds (SMs times CTAs per SM) and `L` the CTAs
//! of the last, possibly partial, wave. `c0` is the launch and pipeline fill, `c1` the cost of a
//! wave, `c2` the per-CTA traffic, `c3` the diminishing return of a partial wave. The last term is
//! fitted only for configurations measured mostly below one wave, where the curve is concave
//! (elsewhere it overfits), and the wave term only where the samples span more than one wave
//! count (else it is the constant's). The grid of a grouped configuration follows from the live expert
//! histogram ([`grouped_ctas`]), which is what makes the choice routing-aware.

/// A fitted model of one configuration on one device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WaveModel {
    /// `[c0, c1, c2, c3]` in microseconds (`c3` is 0 where the term is not fitted).
    pub coef: [f64; 4],
    /// CTAs one wave holds.
    pub wave: u32,
}

/// Why a model could not be fitted.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum FitError {
    /// Fewer samples, or fewer distinct grids, than the terms to fit.
    #[error("{distinct} distinct grid(s) among {samples} sample(s): {terms} terms need at least as many")]
    TooFewGrids {
        /// Samples given.
        samples: usize,
        /// Distinct grid sizes among them.
        distinct: usize,
        /// Terms the fit needs.
        terms: usize,
    },
    /// A wave of no CTAs, or a sample that is not a finite positive time.
    #[error("invalid input: {0}")]
    Invalid(String),
}

/// The model's terms for a grid of `ctas` CTAs, `wave` to a wave.
pub fn features(ctas: u32, wave: u32) -> [f64; 4] {
    let (g, s) = (ctas as f64, wave as f64);
    let last = if ctas == 0 { 0 } else { ctas - (ctas - 1) / wave * wave };
    [1.0, ctas.div_ceil(wave) as f64, g, (last as f64 / s).sqrt()]
}

impl WaveModel {
    /// Fit from `(ctas, microseconds)` samples. The partial-wave term is fitted when the median
    /// sample's grid is below one wave, the wave term when the samples span several wave counts.
    pub fn fit(samples: &[(u32, f64)], wave: u32) -> Result<WaveModel, FitError> {
        if wave == 0 {
            return Err(FitError::Invalid("a wave of 0 CTAs".into()));
        }
        if let Some(&(_, t)) = samples.iter().find(|(_, t)| !(t.is_finite() && *t > 0.0)) {
            return Err(FitError::Invalid(format!("a sample time of {t} us")));
        }
        let mut grids: Vec<u32> = samples.iter().map(|s| s.0).collect();
        grids.sort_unstable();
        let sub_wave = grids.get(grids.len() / 2).is_some_and(|&g| g < wave);
        let several_waves = grids.first().map(|g| g.div_ceil(wave)) != grids.last().map(|g| g.div_ceil(wave));
        // Which of the four terms this fit takes.
        let terms: Vec<usize> = [(0, true), (1, several_waves), (2, true), (3, sub_wave)]
            .into_iter()
            .filter_map(|(t, on)| on.then_some(t))
            .collect();
        grids.dedup();
        let too_few = || FitError::TooFewGrids { samples: samples.len(), distinct: grids.len(), terms: terms.len() };
        if grids.len() < terms.len() {
            return Err(too_few());
        }
        let rows: Vec<Vec<f64>> =
            samples.iter().map(|&(g, _)| terms.iter().map(|&t| features(g, wave)[t]).collect()).collect();
        let y: Vec<f64> = samples.iter().map(|s| s.1).collect();
        let beta = least_squares(&rows, &y).ok_or_else(too_few)?;
        let mut coef = [0.0; 4];
        terms.iter().zip(beta).for_each(|(&t, b)| coef[t] = b);
        Ok(WaveModel { coef, wave })
    }

    /// Predicted microseconds for a grid of `ctas` CTAs.
    pub fn predict(&self, ctas: u32) -> f64 {
        features(ctas, self.wave).iter().zip(self.coef).map(|(f, c)| f * c).sum()
    }
}

/// CTAs of a grouped configuration for a step: each expert's tokens in tiles of `block_m` rows,
/// times the output's column tiles and the split-K factor.
pub fn grouped_ctas(histogram: &[u32], block_m: u32, column_tiles: u32, split_k: u32) -> u32 {
    histogram.iter().map(|&n| n.div_ceil(block_m.max(1))).sum::<u32>() * column_tiles * split_k
}

/// The configuration a cost model picks: the index of the least predicted time (the first of
/// equals), `None` for no candidates.
pub fn argmin(predicted: impl IntoIterator<Item = f64>) -> Option<usize> {
    predicted
        .into_iter()
        .enumerate()
        .fold(None, |best: Option<(usize, f64)>, (i, t)| match best {
            Some((_, b)) if b <= t => best,
            _ => Some((i, t)),
        })
        .map(|(i, _)| i)
}

/// Least squares by Householder QR (no normal equations: the terms differ by orders of
/// magnitude). `None` when the columns are dependent.
#[allow(clippy::needless_range_loop)] // column indices into row-major rows
fn least_squares(rows: &[Vec<f64>], y: &[f64]) -> Option<Vec<f64>> {
    let (m, n) = (rows.len(), rows.first()?.len());
    // Columns scaled to unit norm first, undone at the end.
    let scale: Vec<f64> = (0..n).map(|j| rows.iter().map(|r| r[j] * r[j]).sum::<f64>().sqrt()).collect();
    if scale.contains(&0.0) {
        return None;
    }
    let mut a: Vec<Vec<f64>> = rows.iter().map(|r| r.iter().zip(&scale).map(|(v, s)| v / s).collect()).collect();
    let mut b = y.to_vec();
    for k in 0..n {
        let norm = (k..m).map(|i| a[i][k] * a[i][k]).sum::<f64>().sqrt();
        if norm < 1e-12 {
            return None;
        }
        let alpha = if a[k][k] > 0.0 { -norm } else { norm };
        let mut v: Vec<f64> = (k..m).map(|i| a[i][k]).collect();
        v[0] -= alpha;
        let vv: f64 = v.iter().map(|x| x * x).sum();
        for j in k..n {
            let d = (k..m).map(|i| v[i - k] * a[i][j]).sum::<f64>() * 2.0 / vv;
            (k..m).for_each(|i| a[i][j] -= d * v[i - k]);
        }
        let d = (k..m).map(|i| v[i - k] * b[i]).sum::<f64>() * 2.0 / vv;
        (k..m).for_each(|i| b[i] -= d * v[i - k]);
    }
    // R is the upper triangle of a; back-substitute.
    let mut x = vec![0.0; n];
    for k in (0..n).rev() {
        let s: f64 = (k + 1..n).map(|j| a[k][j] * x[j]).sum();
        if a[k][k].abs() < 1e-12 {
            return None;
        }
        x[k] = (b[k] - s) / a[k][k];
    }
    Some(x.iter().zip(&scale).map(|(v, s)| v / s).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    const WAVE: u32 = 132;

    fn truth(c: [f64; 4], g: u32) -> f64 {
        features(g, WAVE).iter().zip(c).map(|(f, c)| f * c).sum()
    }

    #[test]
    fn features_count_waves_and_the_last_partial_one() {
        assert_eq!(features(1, WAVE)[3], (1.0 / 132.0f64).sqrt());
        assert_eq!(features(132, WAVE)[3], 1.0);
        assert_eq!(features(133, WAVE)[3], (1.0 / 132.0f64).sqrt());
        assert_eq!((features(264, WAVE)[1], features(265, WAVE)[1]), (2.0, 3.0));
    }

    #[test]
    fn a_multi_wave_fit_recovers_three_terms_and_leaves_the_fourth_out() {
        let c = [12.0, 40.0, 0.05, 0.0];
        let samples: Vec<(u32, f64)> = [150, 300, 600, 1200, 2400, 4800].iter().map(|&g| (g, truth(c, g))).collect();
        let m = WaveModel::fit(&samples, WAVE).unwrap();
        for (got, want) in m.coef.iter().zip(c) {
            assert!((got - want).abs() < 1e-6 * want.abs().max(1.0), "{:?}", m.coef);
        }
        assert!((m.predict(1000) - truth(c, 1000)).abs() < 1e-6);
    }

    #[test]
    fn a_sub_wave_fit_takes_the_concave_term() {
        // Below one wave the wave count is 1: its cost is part of the constant.
        let c = [8.0, 0.0, 0.02, 30.0];
        let samples: Vec<(u32, f64)> = [4, 9, 17, 33, 66, 100, 130].iter().map(|&g| (g, truth(c, g))).collect();
        let m = WaveModel::fit(&samples, WAVE).unwrap();
        for (got, want) in m.coef.iter().zip(c) {
            assert!((got - want).abs() < 1e-6 * want.abs().max(1.0), "{:?}", m.coef);
        }
    }

    #[test]
    fn noisy_samples_still_rank_configurations_right() {
        // Two configurations: small tiles (more CTAs, cheap each) and large ones. A skewed
        // histogram (few tokens on many experts) pads large tiles; a balanced one fills them.
        let (small, large) = ([10.0, 30.0, 0.03, 0.0], [14.0, 55.0, 0.05, 0.0]);
        let mut seed = 7u64;
        let mut noisy = |t: f64| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            t * (1.0 + ((seed >> 33) as f64 / (1u64 << 31) as f64 - 0.5) * 0.04)
        };
        let grids = [140u32, 280, 560, 1100, 2200, 4400, 8800];
        let fit = |c: [f64; 4], noisy: &mut dyn FnMut(f64) -> f64| {
            WaveModel::fit(&grids.iter().map(|&g| (g, noisy(truth(c, g)))).collect::<Vec<_>>(), WAVE).unwrap()
        };
        let (ms, ml) = (fit(small, &mut noisy), fit(large, &mut noisy));
        let skewed: Vec<u32> = (0..128).map(|e| if e < 16 { 200 } else { 9 }).collect();
        let balanced = vec![256u32; 128];
        for (hist, want) in [(&skewed, 0), (&balanced, 1)] {
            let (gs, gl) = (grouped_ctas(hist, 64, 12, 1), grouped_ctas(hist, 128, 12, 1));
            let exact = argmin([truth(small, gs), truth(large, gl)]).unwrap();
            assert_eq!(exact, want, "the synthetic truth itself");
            assert_eq!(argmin([ms.predict(gs), ml.predict(gl)]), Some(want));
        }
    }

    #[test]
    fn degenerate_inputs_are_errors() {
        assert!(matches!(
            WaveModel::fit(&[(200, 5.0), (200, 6.0), (400, 7.0)], WAVE),
            Err(FitError::TooFewGrids { .. })
        ));
        assert!(matches!(WaveModel::fit(&[(200, f64::NAN)], WAVE), Err(FitError::Invalid(_))));
        assert!(matches!(WaveModel::fit(&[(200, 1.0)], 0), Err(FitError::Invalid(_))));
        assert_eq!(argmin(Vec::<f64>::new()), None);
        assert_eq!(argmin([3.0, 1.0, 1.0]), Some(1));
        // 0, 1, 1 and 2 tiles of 64 rows, times 3 column tiles and split-K 2.
        assert_eq!(grouped_ctas(&[0, 1, 64, 65], 64, 3, 2), 4 * 3 * 2);
    }
}
