//! Means with their uncertainty, paired comparisons, and pass@k.

/// The mean, its standard error and a 95% bootstrap interval.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct Estimate {
    pub mean: f64,
    /// Sample standard deviation over √n; 0 for fewer than two values.
    pub stderr: f64,
    pub ci_low: f64,
    pub ci_high: f64,
}

/// Resamples per bootstrap interval.
pub const RESAMPLES: usize = 1000;

/// Mean, standard error and the percentile bootstrap 95% interval
/// ([`RESAMPLES`] resamples, a fixed seed, so a report is reproducible).
pub fn estimate(values: &[f64], seed: u64) -> Estimate {
    let n = values.len();
    if n == 0 {
        return Estimate {
            mean: f64::NAN,
            stderr: f64::NAN,
            ci_low: f64::NAN,
            ci_high: f64::NAN,
        };
    }
    let mean = values.iter().sum::<f64>() / n as f64;
    let stderr = if n < 2 {
        0.0
    } else {
        let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        (var / n as f64).sqrt()
    };
    let (ci_low, ci_high) = bootstrap(n, seed, |pick| {
        (0..n).map(|_| values[pick()]).sum::<f64>() / n as f64
    });
    Estimate {
        mean,
        stderr,
        ci_low,
        ci_high,
    }
}

/// The 2.5th and 97.5th percentiles of `statistic` over resamples of `n`
/// indices drawn with replacement.
fn bootstrap(
    n: usize,
    seed: u64,
    statistic: impl Fn(&mut dyn FnMut() -> usize) -> f64,
) -> (f64, f64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut stats: Vec<f64> = (0..RESAMPLES)
        .map(|_| statistic(&mut || rng.usize(0..n)))
        .collect();
    stats.sort_by(f64::total_cmp);
    let at = |q: f64| stats[((q * (RESAMPLES - 1) as f64).round() as usize).min(RESAMPLES - 1)];
    (at(0.025), at(0.975))
}

/// A paired comparison of B against A on the same items.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct Paired {
    /// Mean of B − A.
    pub diff: f64,
    pub ci_low: f64,
    pub ci_high: f64,
    /// Two-sided paired bootstrap p-value: how often the resampled
    /// difference falls on the other side of zero, doubled.
    pub p_bootstrap: f64,
    /// McNemar's exact test, for 0/1 scores (None otherwise).
    pub p_mcnemar: Option<f64>,
    /// Items A got right and B wrong, and the reverse (0/1 scores).
    pub a_only: u64,
    pub b_only: u64,
}

pub fn paired(a: &[f64], b: &[f64], seed: u64) -> Paired {
    let n = a.len().min(b.len());
    let d: Vec<f64> = (0..n).map(|i| b[i] - a[i]).collect();
    let diff = if n == 0 {
        f64::NAN
    } else {
        d.iter().sum::<f64>() / n as f64
    };
    let mut below = 0usize;
    let mut above = 0usize;
    let (ci_low, ci_high) = if n == 0 {
        (f64::NAN, f64::NAN)
    } else {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut means: Vec<f64> = (0..RESAMPLES)
            .map(|_| (0..n).map(|_| d[rng.usize(0..n)]).sum::<f64>() / n as f64)
            .collect();
        below = means.iter().filter(|m| **m <= 0.0).count();
        above = means.iter().filter(|m| **m >= 0.0).count();
        means.sort_by(f64::total_cmp);
        let at = |q: f64| means[((q * (RESAMPLES - 1) as f64).round() as usize).min(RESAMPLES - 1)];
        (at(0.025), at(0.975))
    };
    let p_bootstrap = if n == 0 {
        f64::NAN
    } else {
        (2.0 * below.min(above) as f64 / RESAMPLES as f64).min(1.0)
    };
    let binary = a[..n].iter().chain(&b[..n]).all(|v| *v == 0.0 || *v == 1.0);
    let a_only = (0..n).filter(|&i| a[i] == 1.0 && b[i] == 0.0).count() as u64;
    let b_only = (0..n).filter(|&i| a[i] == 0.0 && b[i] == 1.0).count() as u64;
    Paired {
        diff,
        ci_low,
        ci_high,
        p_bootstrap,
        p_mcnemar: binary.then(|| mcnemar_exact(a_only, b_only)),
        a_only,
        b_only,
    }
}

/// McNemar's exact test: the two-sided binomial p-value of `b` successes
/// in `b + c` discordant pairs at p = 1/2.
pub fn mcnemar_exact(b: u64, c: u64) -> f64 {
    let n = b + c;
    if n == 0 {
        return 1.0;
    }
    let k = b.min(c);
    // P(X <= k) for X ~ Binomial(n, 1/2), summed in log space.
    let ln_half_n = -(n as f64) * std::f64::consts::LN_2;
    let mut ln_choose = 0.0f64; // ln C(n, 0)
    let mut tail = 0.0f64;
    for i in 0..=k {
        if i > 0 {
            ln_choose += ((n - i + 1) as f64).ln() - (i as f64).ln();
        }
        tail += (ln_choose + ln_half_n).exp();
    }
    (2.0 * tail).min(1.0)
}

/// The unbiased pass@k estimator (Chen et al., 2021): 1 − C(n−c, k) / C(n, k)
/// for `n` samples of which `c` pass.
pub fn pass_at_k(n: u64, c: u64, k: u64) -> f64 {
    if n < k || n - c < k {
        return 1.0;
    }
    let mut fail_all = 1.0f64;
    for i in (n - c + 1)..=n {
        fail_all *= 1.0 - k as f64 / i as f64;
    }
    1.0 - fail_all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimates_of_a_known_sample() {
        let values = [1.0, 0.0, 1.0, 1.0];
        let e = estimate(&values, 7);
        assert_eq!(e.mean, 0.75);
        assert!((e.stderr - 0.25).abs() < 1e-12);
        assert!(e.ci_low <= e.mean && e.mean <= e.ci_high);
        assert!(e.ci_low >= 0.0 && e.ci_high <= 1.0);
        assert_eq!(
            estimate(&values, 7),
            e,
            "a fixed seed gives the same interval"
        );
    }

    #[test]
    fn mcnemar_matches_the_binomial() {
        // 0 vs 5 discordant: 2 * 0.5^5.
        assert!((mcnemar_exact(0, 5) - 0.0625).abs() < 1e-12);
        // 2 vs 8: 2 * P(X <= 2 | n = 10) = 2 * 56 / 1024.
        assert!((mcnemar_exact(8, 2) - 112.0 / 1024.0).abs() < 1e-12);
        assert_eq!(mcnemar_exact(3, 3), 1.0);
    }

    #[test]
    fn a_clear_difference_is_significant() {
        let a: Vec<f64> = (0..200).map(|i| f64::from(u8::from(i % 2 == 0))).collect();
        let b: Vec<f64> = (0..200).map(|i| f64::from(u8::from(i % 10 != 0))).collect();
        let p = paired(&a, &b, 1);
        assert!((p.diff - 0.4).abs() < 1e-12);
        assert!(p.p_bootstrap < 0.01 && p.p_mcnemar.unwrap() < 0.001);
        assert_eq!((p.a_only, p.b_only), (20, 100));
    }
}
