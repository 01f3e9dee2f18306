//! What calls took, in constant memory: HDR histograms of milliseconds
//! (recorded in microseconds, 1 µs to an hour), for a run's report and for
//! each second of an endpoint's calls.

use std::time::Duration;

use evalfleet_types::{EndpointSample, Quantiles, Timings};
use hdrhistogram::Histogram;

/// Milliseconds recorded in microseconds, from 1 µs to an hour.
#[derive(Debug, Clone)]
pub struct Recorder(Option<Histogram<u64>>);

impl Recorder {
    /// `digits` significant decimal digits (2 or 3).
    pub fn new(digits: u8) -> Self {
        Self(Histogram::new_with_bounds(1, 3_600_000_000, digits).ok())
    }

    pub fn record(&mut self, ms: f64) {
        if let Some(h) = &mut self.0 {
            let micros = (ms * 1000.0).round().clamp(1.0, 3_600_000_000.0) as u64;
            h.saturating_record(micros);
        }
    }

    pub fn len(&self) -> u64 {
        self.0.as_ref().map_or(0, Histogram::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn mean(&self) -> f64 {
        self.0.as_ref().map_or(f64::NAN, |h| h.mean() / 1000.0)
    }

    pub fn max(&self) -> f64 {
        self.0
            .as_ref()
            .map_or(f64::NAN, |h| h.max() as f64 / 1000.0)
    }

    /// The value at quantile `q` (0 to 1), in ms.
    pub fn at(&self, q: f64) -> f64 {
        self.0
            .as_ref()
            .map_or(f64::NAN, |h| h.value_at_quantile(q) as f64 / 1000.0)
    }

    pub fn quantiles(&self) -> Option<Quantiles> {
        (!self.is_empty()).then(|| Quantiles {
            p50: self.at(0.5),
            p90: self.at(0.9),
            p99: self.at(0.99),
        })
    }

    pub fn reset(&mut self) {
        if let Some(h) = &mut self.0 {
            h.reset();
        }
    }
}

/// An endpoint's calls since its last sample.
#[derive(Debug)]
pub struct Window {
    latency: Recorder,
    ttft: Recorder,
    tpot: Recorder,
    calls: u64,
    successes: u64,
    completion_tokens: u64,
    /// Quota pauses counted when the last sample was taken.
    pauses_before: u64,
    /// Since the endpoint was made: calls, answers, and what answers took.
    pub total_calls: u64,
    pub total_successes: u64,
    pub timings: Timings,
}

impl Default for Window {
    fn default() -> Self {
        Self {
            latency: Recorder::new(2),
            ttft: Recorder::new(2),
            tpot: Recorder::new(2),
            calls: 0,
            successes: 0,
            completion_tokens: 0,
            pauses_before: 0,
            total_calls: 0,
            total_successes: 0,
            timings: Timings::default(),
        }
    }
}

/// What a call that answered took.
#[derive(Debug, Clone, Copy)]
pub struct Answered {
    pub latency: Duration,
    pub ttft: Option<Duration>,
    pub tpot: Option<Duration>,
    pub completion_tokens: Option<u64>,
}

impl Window {
    /// A call ended: it answered, or (`None`) it failed.
    pub fn record(&mut self, answered: Option<Answered>) {
        self.calls += 1;
        self.total_calls += 1;
        let Some(a) = answered else {
            return;
        };
        self.successes += 1;
        self.total_successes += 1;
        let latency = evalfleet_types::ms(a.latency);
        self.latency.record(latency);
        self.timings.latency.record(latency);
        if let Some(ttft) = a.ttft {
            let ttft = evalfleet_types::ms(ttft);
            self.ttft.record(ttft);
            self.timings.ttft.record(ttft);
        }
        if let Some(tpot) = a.tpot {
            let tpot = evalfleet_types::ms(tpot);
            self.tpot.record(tpot);
            self.timings.tpot.record(tpot);
        }
        self.completion_tokens += a.completion_tokens.unwrap_or(0);
    }

    /// The sample of the calls since the last one (the endpoint's own
    /// fields are the caller's), starting a new window.
    pub fn take(&mut self, pauses: u64) -> EndpointSample {
        let sample = EndpointSample {
            endpoint: String::new(),
            state: evalfleet_types::EndpointState::Idle,
            limit: 0,
            in_flight: 0,
            calls: self.calls,
            successes: self.successes,
            failures: self.calls - self.successes,
            completion_tokens: self.completion_tokens,
            latency_ms: self.latency.quantiles(),
            ttft_ms: self.ttft.quantiles(),
            tpot_ms: self.tpot.quantiles(),
            quota_pauses: pauses.saturating_sub(self.pauses_before),
        };
        self.latency.reset();
        self.ttft.reset();
        self.tpot.reset();
        self.calls = 0;
        self.successes = 0;
        self.completion_tokens = 0;
        self.pauses_before = pauses;
        sample
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_counts_its_calls_and_starts_over_when_taken() {
        let mut w = Window::default();
        for ms in [10u64, 20, 30, 40] {
            w.record(Some(Answered {
                latency: Duration::from_millis(ms),
                ttft: Some(Duration::from_millis(ms / 2)),
                tpot: None,
                completion_tokens: Some(5),
            }));
        }
        w.record(None);
        let s = w.take(3);
        assert_eq!((s.calls, s.successes, s.failures), (5, 4, 1));
        assert_eq!(s.completion_tokens, 20);
        let latency = s.latency_ms.unwrap();
        assert!((latency.p50 - 20.0).abs() < 0.5, "{latency:?}");
        assert!((latency.p99 - 40.0).abs() < 0.5, "{latency:?}");
        assert!(s.ttft_ms.is_some() && s.tpot_ms.is_none());
        assert_eq!(s.quota_pauses, 3);
        let empty = w.take(5);
        assert_eq!((empty.calls, empty.quota_pauses), (0, 2));
        assert!(empty.latency_ms.is_none());
        // The totals stay: 10, 20 and 30 ms in their buckets, 40 in the next.
        assert_eq!((w.total_calls, w.total_successes), (5, 4));
        assert_eq!(w.timings.latency.count(), 4);
        assert_eq!(w.timings.latency.counts[1], 1, "10 ms: at most 10");
        assert_eq!(w.timings.latency.counts[2], 1, "20 ms: at most 25");
        assert_eq!(w.timings.latency.counts[3], 2, "30 and 40 ms: at most 50");
        assert_eq!(w.timings.latency.sum_ms, 100.0);
        assert_eq!(w.timings.ttft.count(), 4);
    }
}
