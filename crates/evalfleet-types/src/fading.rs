//! A maximum that fades: what is normal for an endpoint (its longest
//! recent quiet spell in a stream, its longest recent call), from samples
//! that come one at a time, in constant space.

use std::time::Duration;

/// The largest recent sample: each new sample first fades the maximum by
/// `fade`, so an old peak counts less and less as samples come, and the
/// value follows roughly the top percentile of the last `1 / (1 - fade)`
/// samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FadingMax {
    fade: f64,
    value: f64,
    samples: u32,
}

impl FadingMax {
    pub const fn new(fade: f64) -> Self {
        Self {
            fade,
            value: 0.0,
            samples: 0,
        }
    }

    pub fn record(&mut self, sample: Duration) {
        self.value = (self.value * self.fade).max(sample.as_secs_f64());
        self.samples = self.samples.saturating_add(1);
    }

    /// The maximum, once at least `known` samples were seen.
    pub fn value(&self, known: u32) -> Option<Duration> {
        (self.samples >= known).then(|| Duration::from_secs_f64(self.value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peak_counts_fully_at_once_and_fades_as_samples_come() {
        let mut m = FadingMax::new(0.5);
        assert_eq!(m.value(0), Some(Duration::ZERO));
        m.record(Duration::from_secs(8));
        assert_eq!(m.value(2), None, "one sample is not two");
        assert_eq!(m.value(1), Some(Duration::from_secs(8)));
        m.record(Duration::from_secs(1));
        assert_eq!(m.value(2), Some(Duration::from_secs(4)));
        m.record(Duration::from_secs(3));
        assert_eq!(m.value(2), Some(Duration::from_secs(3)));
    }
}
