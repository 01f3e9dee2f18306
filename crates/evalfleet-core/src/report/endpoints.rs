//! Per-endpoint summaries of a run's attempts: counts, errors by class and
//! latency percentiles, from HDR histograms (constant memory however many
//! attempts there are).

use std::collections::BTreeMap;

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::store::{AttemptSample, Results, StoreError};

/// Percentiles of one measure, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Percentiles {
    pub count: u64,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

/// Milliseconds recorded in microseconds, from 1 µs to an hour.
struct Recorder(Option<Histogram<u64>>);

impl Recorder {
    fn new() -> Self {
        Self(Histogram::new_with_bounds(1, 3_600_000_000, 3).ok())
    }

    fn record(&mut self, ms: f64) {
        if let Some(h) = &mut self.0 {
            let micros = (ms * 1000.0).round().clamp(1.0, 3_600_000_000.0) as u64;
            h.saturating_record(micros);
        }
    }

    fn percentiles(&self) -> Option<Percentiles> {
        let h = self.0.as_ref()?;
        if h.is_empty() {
            return None;
        }
        let ms = |micros: u64| micros as f64 / 1000.0;
        Some(Percentiles {
            count: h.len(),
            mean: h.mean() / 1000.0,
            p50: ms(h.value_at_quantile(0.5)),
            p90: ms(h.value_at_quantile(0.9)),
            p99: ms(h.value_at_quantile(0.99)),
            max: ms(h.max()),
        })
    }
}

/// One endpoint's attempts in a run.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct EndpointSummary {
    pub endpoint: String,
    pub attempts: u64,
    pub successes: u64,
    /// Failed attempts by error class.
    pub errors: BTreeMap<String, u64>,
    pub completion_tokens: u64,
    /// Completion tokens over the time its successful calls took: what one
    /// call streams per second.
    pub tokens_per_second_per_call: f64,
    /// Latency of successful attempts.
    pub latency_ms: Option<Percentiles>,
    pub ttft_ms: Option<Percentiles>,
    pub tpot_ms: Option<Percentiles>,
}

struct Accumulator {
    attempts: u64,
    successes: u64,
    errors: BTreeMap<String, u64>,
    completion_tokens: u64,
    latency: Recorder,
    ttft: Recorder,
    tpot: Recorder,
}

impl Accumulator {
    fn add(&mut self, sample: &AttemptSample) {
        self.attempts += 1;
        match sample.error_class {
            Some(class) => *self.errors.entry(class.as_str().to_owned()).or_insert(0) += 1,
            None if sample.failed => *self.errors.entry(MOVED.to_owned()).or_insert(0) += 1,
            None => {
                self.successes += 1;
                self.latency.record(sample.latency_ms);
                if let Some(ttft) = sample.ttft_ms {
                    self.ttft.record(ttft);
                }
                if let Some(tpot) = sample.tpot_ms {
                    self.tpot.record(tpot);
                }
                self.completion_tokens += sample.completion_tokens.unwrap_or(0);
            }
        }
    }
}

/// Summarises every attempt of a run, per endpoint, in name order.
pub fn endpoints(
    store: &mut dyn Results,
    run_id: &str,
) -> Result<Vec<EndpointSummary>, StoreError> {
    let mut by_endpoint: BTreeMap<String, Accumulator> = BTreeMap::new();
    store.scan_attempts(run_id, &mut |sample| {
        by_endpoint
            .entry(sample.endpoint.clone())
            .or_insert_with(|| Accumulator {
                attempts: 0,
                successes: 0,
                errors: BTreeMap::new(),
                completion_tokens: 0,
                latency: Recorder::new(),
                ttft: Recorder::new(),
                tpot: Recorder::new(),
            })
            .add(&sample);
    })?;
    Ok(by_endpoint
        .into_iter()
        .map(|(endpoint, acc)| {
            let latency_ms = acc.latency.percentiles();
            let busy_s = latency_ms.map_or(0.0, |p| p.mean * p.count as f64 / 1000.0);
            EndpointSummary {
                endpoint,
                attempts: acc.attempts,
                successes: acc.successes,
                errors: acc.errors,
                completion_tokens: acc.completion_tokens,
                tokens_per_second_per_call: if busy_s > 0.0 {
                    acc.completion_tokens as f64 / busy_s
                } else {
                    0.0
                },
                latency_ms,
                ttft_ms: acc.ttft.percentiles(),
                tpot_ms: acc.tpot.percentiles(),
            }
        })
        .collect())
}

/// What summaries call calls moved to another endpoint when theirs stopped
/// taking items (not an error of the call).
pub const MOVED: &str = "moved";
