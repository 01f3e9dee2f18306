//! What `status` shows of an endpoint.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ErrorClass;

/// Where an endpoint stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointState {
    /// Configured but not taking part (`--endpoints`, `fleet remove`).
    Idle,
    /// Being started.
    Starting,
    /// Up and taking items.
    Healthy,
    /// Its breaker is open: no new items.
    Unhealthy,
    /// Probes answer again; waiting for it to stay up.
    Recovering,
    /// Its engine is being started again.
    Restarting,
    /// Out of the run.
    Excluded,
}

crate::names!(EndpointState, "endpoint state", {
    Idle => "idle",
    Starting => "starting",
    Healthy => "healthy",
    Unhealthy => "unhealthy",
    Recovering => "recovering",
    Restarting => "restarting",
    Excluded => "excluded",
});

/// An endpoint as its worker last saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EndpointSnapshot {
    pub endpoint: String,
    /// Its config's kind: `mock`, `external`, `local` or `remote`.
    pub kind: String,
    pub state: EndpointState,
    pub limit: usize,
    pub adaptive: bool,
    pub in_flight: u64,
    /// Calls started in the last minute.
    pub requests_per_minute: u64,
    /// Failed calls by class.
    pub errors: BTreeMap<ErrorClass, u64>,
    pub base_url: Option<String>,
    pub pid: Option<u32>,
    pub restarts: u32,
    /// The request rate learned from 429s, per second.
    pub learned_rate: Option<f64>,
    /// Calls that ended since its worker started, and those that answered.
    #[serde(default)]
    pub calls: u64,
    #[serde(default)]
    pub successes: u64,
    /// Pauses its quota asked for since its worker started.
    #[serde(default)]
    pub quota_pauses: u64,
    /// What its calls that answered took, in buckets (Prometheus's
    /// histograms), since its worker started.
    #[serde(default)]
    pub timings: Option<Timings>,
}

impl EndpointSnapshot {
    /// Adds what another worker saw of the same endpoint: its calls,
    /// errors, timings and restarts are summed, and so are its limit, calls
    /// in flight and rate when `live` (its worker's snapshot is current);
    /// the state is the one that takes items if either does.
    pub fn merge(&mut self, other: &EndpointSnapshot, live: bool) {
        self.calls += other.calls;
        self.successes += other.successes;
        self.quota_pauses += other.quota_pauses;
        self.restarts += other.restarts;
        for (class, n) in &other.errors {
            *self.errors.entry(*class).or_default() += n;
        }
        match (&mut self.timings, &other.timings) {
            (Some(mine), Some(theirs)) => {
                mine.latency.merge(&theirs.latency);
                mine.ttft.merge(&theirs.ttft);
                mine.tpot.merge(&theirs.tpot);
            }
            (None, Some(theirs)) => self.timings = Some(theirs.clone()),
            _ => {}
        }
        if live {
            self.limit += other.limit;
            self.in_flight += other.in_flight;
            self.requests_per_minute += other.requests_per_minute;
            if other.state == EndpointState::Healthy {
                self.state = EndpointState::Healthy;
            }
        }
        self.adaptive |= other.adaptive;
        if self.learned_rate.is_none() {
            self.learned_rate = other.learned_rate;
        }
        if self.base_url.is_none() {
            self.base_url.clone_from(&other.base_url);
        }
    }
}

/// The upper bounds of [`Buckets`], in ms.
pub const BUCKETS_MS: [f64; 16] = [
    5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1_000.0, 2_500.0, 5_000.0, 10_000.0, 30_000.0,
    60_000.0, 120_000.0, 300_000.0, 600_000.0,
];

/// Measures counted in the buckets of [`BUCKETS_MS`] (and one beyond the
/// last), with their sum.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Buckets {
    /// Per bucket (not cumulative), the last one past every bound.
    pub counts: Vec<u64>,
    pub sum_ms: f64,
}

impl Default for Buckets {
    fn default() -> Self {
        Self {
            counts: vec![0; BUCKETS_MS.len() + 1],
            sum_ms: 0.0,
        }
    }
}

impl Buckets {
    /// Adds `other`'s counts to these.
    pub fn merge(&mut self, other: &Buckets) {
        if self.counts.len() < other.counts.len() {
            self.counts.resize(other.counts.len(), 0);
        }
        for (mine, theirs) in self.counts.iter_mut().zip(&other.counts) {
            *mine += theirs;
        }
        self.sum_ms += other.sum_ms;
    }

    pub fn record(&mut self, ms: f64) {
        let at = BUCKETS_MS
            .iter()
            .position(|bound| ms <= *bound)
            .unwrap_or(BUCKETS_MS.len());
        if let Some(count) = self.counts.get_mut(at) {
            *count += 1;
        }
        self.sum_ms += ms;
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }
}

/// Latency, TTFT and TPOT in buckets.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Timings {
    pub latency: Buckets,
    pub ttft: Buckets,
    pub tpot: Buckets,
}

/// The 50th, 90th and 99th percentiles of what calls took, in ms.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Quantiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

/// One endpoint over one second of a run, as one worker saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EndpointSample {
    pub endpoint: String,
    pub state: EndpointState,
    pub limit: usize,
    pub in_flight: u64,
    /// Calls that ended in the second, those that answered, and those that
    /// failed.
    pub calls: u64,
    pub successes: u64,
    pub failures: u64,
    /// Completion tokens of the calls that answered.
    pub completion_tokens: u64,
    /// Of the calls that answered: latency, TTFT (streams) and TPOT.
    pub latency_ms: Option<Quantiles>,
    pub ttft_ms: Option<Quantiles>,
    pub tpot_ms: Option<Quantiles>,
    /// Pauses its quota asked for in the second.
    pub quota_pauses: u64,
}

/// One second of a run as one of its workers saw it: the run's counts then,
/// and each of its endpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RunSample {
    /// The second's end, ms since the Unix epoch.
    pub at_ms: i64,
    pub worker: String,
    pub counts: crate::StateCounts,
    pub endpoints: Vec<EndpointSample>,
}
