//! Means with their uncertainty, paired comparisons, and pass@k.
//!
//! Every figure here is made from running sums ([`Moments`]), never from
//! the values themselves, so a report's memory does not grow with the run
//! and one pass over a run of a million items makes it. That is why the
//! intervals are analytic, not bootstrapped: a bootstrap needs every value
//! and costs resamples × items (a thousand resamples of a million items is
//! a billion draws a figure). For 0/1 values the interval is Wilson's score
//! interval, which stays inside [0, 1] and is right on small samples; for
//! other values it is the normal interval, mean ± 1.96 standard errors.
//!
//! The sums are kept in fixed point (integers of 2⁻⁴⁰), so they do not
//! depend on the order values are added in: a run's figures are the same,
//! to the last bit, whether its report read it in dataset order or a
//! comparison read it in item-id order ([`estimate`] is the one function
//! that turns them into a mean and an interval, for the report, the
//! comparison and the CLI alike).

/// The mean, its standard error and a 95% interval.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct Estimate {
    pub mean: f64,
    /// Sample standard deviation over √n; 0 for fewer than two values.
    pub stderr: f64,
    pub ci_low: f64,
    pub ci_high: f64,
}

/// The normal quantile of a two-sided 95% interval.
const Z95: f64 = 1.959_963_984_540_054;

/// Fixed-point scale of [`Moments`]' sums: 2⁴⁰ (a value's resolution is
/// about 10⁻¹², exact below 2²⁰ in magnitude).
const SCALE: f64 = (1u64 << 40) as f64;

/// Running sums of values, enough for their mean, spread and interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Moments {
    pub n: u64,
    /// Σ v and Σ v², in units of 2⁻⁴⁰.
    sum: i128,
    sum_sq: i128,
    /// Every value so far is 0 or 1.
    binary: bool,
    /// Every value so far is between 0 and 1 (a share, a similarity): its
    /// mean's interval is kept there.
    unit: bool,
}

impl Default for Moments {
    fn default() -> Self {
        Self {
            n: 0,
            sum: 0,
            sum_sq: 0,
            binary: true,
            unit: true,
        }
    }
}

fn fixed(v: f64) -> i128 {
    // `as` saturates: a value beyond the range cannot wrap the sum.
    (v * SCALE).round() as i128
}

impl Moments {
    pub fn add(&mut self, v: f64) {
        self.n += 1;
        self.sum = self.sum.saturating_add(fixed(v));
        self.sum_sq = self.sum_sq.saturating_add(fixed(v * v));
        self.binary &= v == 0.0 || v == 1.0;
        self.unit &= (0.0..=1.0).contains(&v);
    }

    /// Empty sums of quantities (counts, tokens, times): their interval is
    /// the normal one even when every value is 0 or 1, which is not a
    /// share.
    pub fn quantities() -> Self {
        Self {
            binary: false,
            unit: false,
            ..Self::default()
        }
    }

    /// The sums of `n` values of 0 or 1, `ones` of them 1 (a share, whose
    /// interval is then Wilson's).
    pub fn counts(ones: u64, n: u64) -> Self {
        let ones = fixed(ones as f64);
        Self {
            n,
            sum: ones,
            sum_sq: ones,
            binary: true,
            unit: true,
        }
    }

    /// The sums of `values`.
    pub fn of(values: &[f64]) -> Self {
        let mut m = Self::default();
        for v in values {
            m.add(*v);
        }
        m
    }

    /// The mean (NaN with no values).
    pub fn mean(&self) -> f64 {
        if self.n == 0 {
            f64::NAN
        } else {
            self.sum as f64 / SCALE / self.n as f64
        }
    }

    /// The sample variance (0 for fewer than two values).
    fn variance(&self) -> f64 {
        if self.n < 2 {
            return 0.0;
        }
        let n = self.n as f64;
        let mean = self.mean();
        ((self.sum_sq as f64 / SCALE - n * mean * mean) / (n - 1.0)).max(0.0)
    }

    fn stderr(&self) -> f64 {
        if self.n < 2 {
            0.0
        } else {
            (self.variance() / self.n as f64).sqrt()
        }
    }
}

/// A run's mean with its standard error and 95% interval, from its sums:
/// Wilson's score interval for 0/1 values, else mean ± 1.96 standard
/// errors. The report, the comparison and the CLI all call this.
pub fn estimate(m: &Moments) -> Estimate {
    if m.n == 0 {
        return Estimate {
            mean: f64::NAN,
            stderr: f64::NAN,
            ci_low: f64::NAN,
            ci_high: f64::NAN,
        };
    }
    let (mean, stderr) = (m.mean(), m.stderr());
    let (ci_low, ci_high) = if m.binary {
        wilson(mean, m.n as f64)
    } else if m.unit {
        // Values between 0 and 1 have a mean between 0 and 1.
        (
            (mean - Z95 * stderr).max(0.0),
            (mean + Z95 * stderr).min(1.0),
        )
    } else {
        (mean - Z95 * stderr, mean + Z95 * stderr)
    };
    Estimate {
        mean,
        stderr,
        ci_low,
        ci_high,
    }
}

/// Wilson's 95% score interval of a proportion `p` of `n`.
fn wilson(p: f64, n: f64) -> (f64, f64) {
    let z2 = Z95 * Z95;
    let denominator = 1.0 + z2 / n;
    let centre = (p + z2 / (2.0 * n)) / denominator;
    let half = Z95 / denominator * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt();
    ((centre - half).max(0.0), (centre + half).min(1.0))
}

/// A paired comparison of B against A on the same items.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct Paired {
    /// Mean of B − A.
    pub diff: f64,
    /// 95% interval of the mean difference (normal, from the differences'
    /// spread).
    pub ci_low: f64,
    pub ci_high: f64,
    /// Two-sided p-value of the paired test that the mean difference is 0
    /// (the differences' mean over its standard error, against the normal).
    pub p_value: f64,
    /// McNemar's exact test, for 0/1 scores (None otherwise).
    pub p_mcnemar: Option<f64>,
    /// Items A got right and B wrong, and the reverse (0/1 scores).
    pub a_only: u64,
    pub b_only: u64,
}

/// Pairs (A's value, B's value) of the same items, as they come.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pairs {
    pub a: Moments,
    pub b: Moments,
    diff: Moments,
    a_only: u64,
    b_only: u64,
}

impl Pairs {
    pub fn add(&mut self, a: f64, b: f64) {
        self.a.add(a);
        self.b.add(b);
        self.diff.add(b - a);
        if a == 1.0 && b == 0.0 {
            self.a_only += 1;
        } else if a == 0.0 && b == 1.0 {
            self.b_only += 1;
        }
    }

    pub fn n(&self) -> u64 {
        self.diff.n
    }

    pub fn paired(&self) -> Paired {
        let n = self.diff.n;
        let diff = self.diff.mean();
        let se = self.diff.stderr();
        let (ci_low, ci_high) = if n == 0 {
            (f64::NAN, f64::NAN)
        } else {
            (diff - Z95 * se, diff + Z95 * se)
        };
        let p_value = if n == 0 {
            f64::NAN
        } else if se == 0.0 {
            if diff == 0.0 { 1.0 } else { 0.0 }
        } else {
            erfc((diff / se).abs() / std::f64::consts::SQRT_2)
        };
        let binary = self.a.binary && self.b.binary;
        Paired {
            diff,
            ci_low,
            ci_high,
            p_value,
            p_mcnemar: (binary && n > 0).then(|| mcnemar_exact(self.a_only, self.b_only)),
            a_only: if binary { self.a_only } else { 0 },
            b_only: if binary { self.b_only } else { 0 },
        }
    }
}

/// The complementary error function (W. J. Cody's rational Chebyshev
/// approximation as in Numerical Recipes' `erfcc`: relative error below
/// 1.2 × 10⁻⁷ everywhere).
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * poly.exp();
    if x >= 0.0 { r } else { 2.0 - r }
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

    /// The paired comparison of `b` against `a`, item by item.
    fn paired(a: &[f64], b: &[f64]) -> Paired {
        let mut pairs = Pairs::default();
        for (x, y) in a.iter().zip(b) {
            pairs.add(*x, *y);
        }
        pairs.paired()
    }

    #[test]
    fn estimates_of_a_known_sample() {
        let values = [1.0, 0.0, 1.0, 1.0];
        let e = estimate(&Moments::of(&values));
        assert_eq!(e.mean, 0.75);
        assert!((e.stderr - 0.25).abs() < 1e-12);
        assert!(e.ci_low <= e.mean && e.mean <= e.ci_high);
        assert!(e.ci_low >= 0.0 && e.ci_high <= 1.0);
        // Wilson's interval of 3 of 4.
        assert!(
            (e.ci_low - 0.300_6).abs() < 1e-3 && (e.ci_high - 0.954_4).abs() < 1e-3,
            "{e:?}"
        );
        let spread = estimate(&Moments::of(&[0.5, 0.7, 0.9]));
        assert!((spread.mean - 0.7).abs() < 1e-12);
        assert!((spread.ci_high - spread.mean - Z95 * spread.stderr).abs() < 1e-12);
        // Similarities near 1 (ANLS): the interval stays inside [0, 1].
        let near_one = estimate(&Moments::of(&[1.0, 1.0, 0.93, 1.0, 0.99]));
        assert!(
            near_one.mean < 1.0 && near_one.ci_high == 1.0,
            "{near_one:?}"
        );
        let near_zero = estimate(&Moments::of(&[0.0, 0.0, 0.2, 0.01]));
        assert_eq!(near_zero.ci_low, 0.0, "{near_zero:?}");
        // Values past 1 (an error rate over 100%) keep the normal interval.
        let past = estimate(&Moments::of(&[1.5, 0.0, 0.2]));
        assert!(past.ci_low < 0.0, "{past:?}");
    }

    #[test]
    fn the_sums_do_not_depend_on_the_order_of_the_values() {
        let values: Vec<f64> = (0..1000).map(|i| f64::from(i) * 0.013_7 % 1.0).collect();
        let mut reversed = values.clone();
        reversed.reverse();
        assert_eq!(Moments::of(&values), Moments::of(&reversed));
        assert_eq!(
            estimate(&Moments::of(&values)),
            estimate(&Moments::of(&reversed))
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
    fn erfc_matches_known_values() {
        assert!((erfc(0.0) - 1.0).abs() < 1e-6);
        // Two-sided p of z = 1.96 is 0.05.
        assert!((erfc(Z95 / std::f64::consts::SQRT_2) - 0.05).abs() < 1e-6);
        assert!((erfc(-1.0) - 1.842_700_79).abs() < 1e-6);
    }

    #[test]
    fn a_clear_difference_is_significant() {
        let a: Vec<f64> = (0..200).map(|i| f64::from(u8::from(i % 2 == 0))).collect();
        let b: Vec<f64> = (0..200).map(|i| f64::from(u8::from(i % 10 != 0))).collect();
        let p = paired(&a, &b);
        assert!((p.diff - 0.4).abs() < 1e-12);
        assert!(p.p_value < 0.01 && p.p_mcnemar.unwrap() < 0.001);
        assert!(p.ci_low > 0.0 && p.ci_high < 0.6);
        assert_eq!((p.a_only, p.b_only), (20, 100));
    }
}
