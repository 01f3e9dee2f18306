//! The counters a running mock keeps, and a snapshot of them.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// Counters kept by a running mock. Tests read them to count what reached the
/// endpoint; `GET /mock/stats` serves them as JSON.
#[derive(Debug)]
pub struct Stats {
    pub(super) requests: AtomicU64,
    completed: AtomicU64,
    pub(super) injected_errors: AtomicU64,
    pub(super) rate_limited: AtomicU64,
    pub(super) hung: AtomicU64,
    pub(super) truncated: AtomicU64,
    pub(super) bad_requests: AtomicU64,
    pub(super) images: AtomicU64,
    pub(super) image_bytes: AtomicU64,
    pub(super) bad_images: AtomicU64,
    faults: AtomicU64,
    faults_by_status: Mutex<BTreeMap<u16, u64>>,
    pub(super) stalled: AtomicU64,
    pub(super) cut: AtomicU64,
    pub(super) unended: AtomicU64,
    pub(super) interrupted: AtomicU64,
    pub(super) outage_refused: AtomicU64,
    pub(super) in_flight: AtomicU64,
    pub(super) max_in_flight: AtomicU64,
    pub(super) model_listings: AtomicU64,
    pub(super) load_readings: AtomicU64,
    pub(super) health_checks: AtomicU64,
    pub(super) first_request_at_ms: AtomicU64,
    last_completed_at_ms: AtomicU64,
    /// Served latencies: bucket `i` counts responses that took `i` ms from
    /// arrival to their last byte; the last bucket holds everything longer.
    served_ms: Box<[AtomicU64]>,
}

/// Served latencies above this many milliseconds share the last bucket.
const SERVED_BUCKETS: usize = 60_000;

impl Default for Stats {
    fn default() -> Self {
        Self {
            requests: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            injected_errors: AtomicU64::new(0),
            rate_limited: AtomicU64::new(0),
            hung: AtomicU64::new(0),
            truncated: AtomicU64::new(0),
            bad_requests: AtomicU64::new(0),
            images: AtomicU64::new(0),
            image_bytes: AtomicU64::new(0),
            bad_images: AtomicU64::new(0),
            faults: AtomicU64::new(0),
            faults_by_status: Mutex::new(BTreeMap::new()),
            stalled: AtomicU64::new(0),
            cut: AtomicU64::new(0),
            unended: AtomicU64::new(0),
            interrupted: AtomicU64::new(0),
            outage_refused: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            max_in_flight: AtomicU64::new(0),
            model_listings: AtomicU64::new(0),
            load_readings: AtomicU64::new(0),
            health_checks: AtomicU64::new(0),
            first_request_at_ms: AtomicU64::new(0),
            last_completed_at_ms: AtomicU64::new(0),
            served_ms: (0..=SERVED_BUCKETS).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

/// A copy of [`Stats`] at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct StatsSnapshot {
    /// Chat completion requests received (answered or not).
    pub requests: u64,
    /// Requests answered in full with 200.
    pub completed: u64,
    /// Requests answered with an injected error status.
    pub injected_errors: u64,
    /// Requests refused with 429 by `rpm`, `quota` or `max_concurrency`.
    pub rate_limited: u64,
    /// Requests accepted and never answered.
    pub hung: u64,
    /// Responses cut off half-way.
    pub truncated: u64,
    /// Requests whose body was not a valid chat completion request.
    pub bad_requests: u64,
    /// Images received in requests (data URLs and base64 decoded and
    /// checked; URLs counted as they are).
    pub images: u64,
    /// Their decoded bytes (data URLs and base64 only).
    pub image_bytes: u64,
    /// Requests refused with 400 because an image could not be decoded.
    pub bad_images: u64,
    /// Requests answered with one of `faults`.
    pub faults: u64,
    /// The same, by status.
    pub faults_by_status: BTreeMap<u16, u64>,
    /// Responses that stalled (`stall_rate`).
    pub stalled: u64,
    /// Streams ended early with `data: [DONE]` (`cut_rate`).
    pub cut: u64,
    /// Streams closed after their finish_reason without `[DONE]`
    /// (`unended_rate`).
    pub unended: u64,
    /// Streams ended early by the arrival of another request
    /// (`interrupt_on_arrival`).
    pub interrupted: u64,
    /// Chat completion requests refused by the `outage`.
    pub outage_refused: u64,
    /// Chat completion requests being handled now.
    pub in_flight: u64,
    /// The most chat completion requests handled at once.
    pub max_in_flight: u64,
    /// `GET /v1/models` requests.
    pub model_listings: u64,
    /// `GET /props`, `GET /slots` and `GET /metrics` requests (readings
    /// of its load).
    pub load_readings: u64,
    /// `GET /health` requests.
    pub health_checks: u64,
    /// When the first chat completion request arrived, in milliseconds since
    /// the Unix epoch (0: none yet). Benchmarks time start-up with it.
    pub first_request_at_ms: u64,
    /// When the last request answered in full finished, in milliseconds
    /// since the Unix epoch (0: none yet).
    pub last_completed_at_ms: u64,
    /// The median time from a request's arrival to its last byte, over the
    /// requests answered in full, in whole milliseconds (0: none yet).
    /// Benchmarks compare clients by it: it includes time queued at the
    /// server.
    pub served_p50_ms: u64,
    /// The 99th percentile of the same.
    pub served_p99_ms: u64,
}

pub(super) fn unix_now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Stats {
    /// The counters now.
    pub fn snapshot(&self) -> StatsSnapshot {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            requests: load(&self.requests),
            completed: load(&self.completed),
            injected_errors: load(&self.injected_errors),
            rate_limited: load(&self.rate_limited),
            hung: load(&self.hung),
            truncated: load(&self.truncated),
            bad_requests: load(&self.bad_requests),
            images: load(&self.images),
            image_bytes: load(&self.image_bytes),
            bad_images: load(&self.bad_images),
            faults: load(&self.faults),
            faults_by_status: self
                .faults_by_status
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
            stalled: load(&self.stalled),
            cut: load(&self.cut),
            unended: load(&self.unended),
            interrupted: load(&self.interrupted),
            outage_refused: load(&self.outage_refused),
            in_flight: load(&self.in_flight),
            max_in_flight: load(&self.max_in_flight),
            model_listings: load(&self.model_listings),
            load_readings: load(&self.load_readings),
            health_checks: load(&self.health_checks),
            first_request_at_ms: load(&self.first_request_at_ms),
            last_completed_at_ms: load(&self.last_completed_at_ms),
            served_p50_ms: self.served_quantile(0.5),
            served_p99_ms: self.served_quantile(0.99),
        }
    }

    /// A request answered in full, `arrived` when it came in.
    pub(super) fn completed(&self, arrived: Instant) {
        self.completed.fetch_add(1, Ordering::Relaxed);
        let ms = (arrived.elapsed().as_millis() as usize).min(SERVED_BUCKETS);
        self.served_ms[ms].fetch_add(1, Ordering::Relaxed);
        self.last_completed_at_ms
            .fetch_max(unix_now_ms(), Ordering::Relaxed);
    }

    pub(super) fn fault(&self, status: u16) {
        self.faults.fetch_add(1, Ordering::Relaxed);
        *self
            .faults_by_status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(status)
            .or_insert(0) += 1;
    }

    fn served_quantile(&self, q: f64) -> u64 {
        let counts: Vec<u64> = self
            .served_ms
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return 0;
        }
        let rank = ((q * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (ms, count) in counts.iter().enumerate() {
            seen += count;
            if seen >= rank {
                return ms as u64;
            }
        }
        SERVED_BUCKETS as u64
    }
}
