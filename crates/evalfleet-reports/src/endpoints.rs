//! Per-endpoint summaries of a run's attempts: counts, errors by class and
//! latency percentiles, from HDR histograms (constant memory however many
//! attempts there are).

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use evalfleet_fleet::window::Recorder;
use evalfleet_store::{AttemptSample, Results, StoreError};
use evalfleet_types::ErrorClass;

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

/// Percentiles of what `recorder` holds.
fn percentiles(recorder: &Recorder) -> Option<Percentiles> {
    if recorder.is_empty() {
        return None;
    }
    Some(Percentiles {
        count: recorder.len(),
        mean: recorder.mean(),
        p50: recorder.at(0.5),
        p90: recorder.at(0.9),
        p99: recorder.at(0.99),
        max: recorder.max(),
    })
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

/// Summarises every call of a run, per endpoint, in name order. In a run of
/// agents (`kind: exec`) an item's attempt is a run of its agent, not a
/// call: the endpoints' figures are then those of the calls the agents made
/// through the gateway (with their tries that failed on an endpoint before
/// the gateway made them on another), and of the calls the pipeline made
/// itself (a judge's).
pub fn endpoints(
    store: &mut dyn Results,
    run_id: &str,
) -> Result<Vec<EndpointSummary>, StoreError> {
    let mut by_endpoint: BTreeMap<String, Accumulator> = BTreeMap::new();
    let mut add = |sample: &AttemptSample| {
        by_endpoint
            .entry(sample.endpoint.clone())
            .or_insert_with(|| Accumulator {
                attempts: 0,
                successes: 0,
                errors: BTreeMap::new(),
                completion_tokens: 0,
                latency: Recorder::new(3),
                ttft: Recorder::new(3),
                tpot: Recorder::new(3),
            })
            .add(sample);
    };
    // The endpoints agents called: an attempt on one of them (or on none)
    // is an agent's run.
    let mut called: BTreeSet<String> = BTreeSet::new();
    let mut agents = false;
    store.scan_call_samples(run_id, &mut |call| {
        agents = true;
        for tried in &call.failovers {
            called.insert(tried.endpoint.clone());
            add(&AttemptSample {
                endpoint: tried.endpoint.clone(),
                latency_ms: tried.latency_ms,
                ttft_ms: None,
                tpot_ms: None,
                completion_tokens: None,
                error_class: tried.error_class,
                failed: true,
            });
        }
        // Answered from the cache, or refused before any endpoint was
        // asked: no endpoint's call.
        if call.cached || call.endpoint.is_empty() {
            return;
        }
        called.insert(call.endpoint.clone());
        add(&AttemptSample {
            endpoint: call.endpoint,
            latency_ms: call.latency_ms,
            ttft_ms: call.ttft_ms,
            tpot_ms: call.tpot_ms,
            completion_tokens: call.completion_tokens,
            // A status the endpoint answered that is no success, with no
            // class of its own, is the endpoint's refusal.
            error_class: call
                .error_class
                .or(call.failed.then_some(ErrorClass::Fatal)),
            failed: call.failed,
        });
    })?;
    store.scan_attempts(run_id, &mut |sample| {
        if agents && (sample.endpoint.is_empty() || called.contains(&sample.endpoint)) {
            return;
        }
        add(&sample);
    })?;
    Ok(by_endpoint
        .into_iter()
        .map(|(endpoint, acc)| {
            let latency_ms = percentiles(&acc.latency);
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
                ttft_ms: percentiles(&acc.ttft),
                tpot_ms: percentiles(&acc.tpot),
            }
        })
        .collect())
}

/// What summaries call calls moved to another endpoint when theirs stopped
/// taking items (not an error of the call).
pub const MOVED: &str = "moved";
