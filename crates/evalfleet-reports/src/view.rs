//! A run as people look at it: a summary for lists (its state, counts and
//! times) and its detail for a page (its dataset, endpoints as its workers
//! last saw them, workers, events), typed for the CLI, the HTTP API and
//! the dashboard to render. Read from the store alone, so a run is seen the
//! same whichever process runs it.

use serde::Serialize;
use serde_json::Value;

use evalfleet_types::{
    EndpointSample, EndpointSnapshot, Event, Quantiles, RunSample, RunStatus, StateCounts,
};

use evalfleet_store::worker;
use evalfleet_store::{RunRecord, Store, StoreError, WorkerInfo, WorkerWork};

/// Where a run is, as a person means it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    /// A worker is answering its items.
    Running,
    /// Marked running, but no worker of it lives: its process crashed or
    /// was killed. Resume it.
    Stopped,
    /// Stopped before every item ended (Ctrl-C, no endpoint left).
    Interrupted,
    /// Every item ended.
    Finished,
}

impl RunState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Stopped => "stopped",
            Self::Interrupted => "interrupted",
            Self::Finished => "finished",
        }
    }
}

/// A run in a list.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct RunSummary {
    pub run_id: String,
    pub name: String,
    pub state: RunState,
    /// As stored (`running` for a run whose process is gone too).
    pub status: RunStatus,
    /// Workers of it that live now.
    pub workers: usize,
    /// Why it stopped, when it stopped early.
    pub message: Option<String>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// Items in the run.
    pub total: u64,
    pub counts: StateCounts,
    pub sessions: u32,
}

/// The run's dataset as registered.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct DatasetView {
    pub path: String,
    pub size: u64,
    pub sha256: String,
}

/// The endpoints as the run's workers last wrote them.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct EndpointsView {
    pub updated_at_ms: i64,
    /// Whether a worker lives (the states are live) or not (as last seen).
    pub live: bool,
    pub endpoints: Vec<EndpointSnapshot>,
}

/// A run in full.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct RunDetail {
    #[serde(flatten)]
    pub summary: RunSummary,
    pub dataset: DatasetView,
    /// What determines the run's results, as a digest.
    pub fingerprint: String,
    /// The config as stored: secrets masked.
    #[schema(value_type = Object)]
    pub config: Value,
    pub endpoints: Option<EndpointsView>,
    pub live_workers: Vec<WorkerInfo>,
    /// What each worker that committed results committed, live or gone:
    /// which worker did what.
    pub work_by_worker: Vec<WorkerWork>,
    /// The latest events, oldest first (at most [`EVENTS`]).
    pub events: Vec<Event>,
}

/// Events a detail holds.
pub const EVENTS: usize = 200;

/// What `run`'s stored status means now.
pub fn state(run: &RunRecord, live_workers: usize) -> RunState {
    match run.status {
        RunStatus::Running if live_workers == 0 => RunState::Stopped,
        RunStatus::Running => RunState::Running,
        RunStatus::Interrupted => RunState::Interrupted,
        RunStatus::Finished => RunState::Finished,
    }
}

fn summary_of(run: &RunRecord, counts: StateCounts, workers: usize) -> RunSummary {
    RunSummary {
        run_id: run.run_id.clone(),
        name: run.name.clone(),
        state: state(run, workers),
        status: run.status,
        workers,
        message: run.message.clone(),
        created_at_ms: run.created_at_ms,
        updated_at_ms: run.updated_at_ms,
        total: run.total,
        counts,
        sessions: run.sessions,
    }
}

/// One run's summary.
pub fn summary(store: &mut dyn Store, run: &RunRecord) -> Result<RunSummary, StoreError> {
    let counts = store.counts(&run.run_id)?;
    let workers = if run.status == RunStatus::Running {
        worker::live_workers(store, &run.run_id)?.len()
    } else {
        0
    };
    Ok(summary_of(run, counts, workers))
}

/// Every run's summary, newest first.
pub fn summaries(store: &mut dyn Store) -> Result<Vec<RunSummary>, StoreError> {
    let runs = store.runs()?;
    runs.iter().map(|run| summary(store, run)).collect()
}

/// One run in full.
pub fn detail(store: &mut dyn Store, run_id: &str) -> Result<RunDetail, StoreError> {
    let run = store.run(run_id)?;
    let live_workers = worker::live_workers(store, run_id)?;
    let counts = store.counts(run_id)?;
    let summary = summary_of(&run, counts, live_workers.len());
    let live = !live_workers.is_empty();
    let endpoints = store.endpoint_states(run_id)?.map(|s| EndpointsView {
        updated_at_ms: s.updated_at_ms,
        live,
        endpoints: s.endpoints,
    });
    let mut events = store.events(run_id)?;
    if events.len() > EVENTS {
        events.drain(..events.len() - EVENTS);
    }
    Ok(RunDetail {
        summary,
        dataset: DatasetView {
            path: run.dataset.path.display().to_string(),
            size: run.dataset.size,
            sha256: run.dataset.sha256.clone(),
        },
        fingerprint: run.fingerprint.digest(),
        config: run.config.clone(),
        endpoints,
        live_workers,
        work_by_worker: store.worker_work(run_id)?,
        events,
    })
}

/// One endpoint at one point of a run's timeline (every worker's view of
/// it added up).
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct EndpointPoint {
    pub endpoint: String,
    pub state: evalfleet_types::EndpointState,
    pub limit: usize,
    pub in_flight: u64,
    /// Calls that ended per second, answered, failed.
    pub calls_per_s: f64,
    pub successes_per_s: f64,
    pub failures_per_s: f64,
    /// Completion tokens per second.
    pub tokens_per_s: f64,
    pub latency_ms: Option<Quantiles>,
    pub ttft_ms: Option<Quantiles>,
    pub tpot_ms: Option<Quantiles>,
    pub quota_pauses: u64,
}

/// A point of a run's timeline: the run's counts at its end, what ended
/// per second over it, and each endpoint.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct TimelinePoint {
    /// The end of the span, ms since the Unix epoch.
    pub at_ms: i64,
    /// Seconds it stands for.
    pub seconds: u32,
    pub counts: StateCounts,
    /// Items that ended per second over the span.
    pub items_per_s: f64,
    pub endpoints: Vec<EndpointPoint>,
}

/// An endpoint's samples over a span, added up.
#[derive(Default)]
struct Span {
    state: Option<evalfleet_types::EndpointState>,
    limit: usize,
    in_flight: u64,
    calls: u64,
    successes: u64,
    failures: u64,
    tokens: u64,
    pauses: u64,
    /// The quantiles of the sample with the most answers.
    latency: Option<(u64, Timing)>,
}

/// Latency, TTFT and TPOT quantiles.
type Timing = (Option<Quantiles>, Option<Quantiles>, Option<Quantiles>);

impl Span {
    fn add(&mut self, s: &EndpointSample, last_second: bool) {
        if last_second {
            // Where it stands: as at the span's end (every worker's slots).
            self.state = Some(s.state);
            self.limit += s.limit;
            self.in_flight += s.in_flight;
        }
        self.calls += s.calls;
        self.successes += s.successes;
        self.failures += s.failures;
        self.tokens += s.completion_tokens;
        self.pauses += s.quota_pauses;
        if self.latency.as_ref().is_none_or(|(n, ..)| s.successes > *n) {
            self.latency = Some((s.successes, (s.latency_ms, s.ttft_ms, s.tpot_ms)));
        }
    }
}

/// A run's timeline from its samples (every worker's, in time order):
/// one point a second, or, with more seconds than `points`, one a span of
/// several, so that a long run's timeline stays a few hundred points. The
/// first point has no rate of items (nothing before it to count from).
pub fn timeline(samples: &[RunSample], points: usize) -> Vec<TimelinePoint> {
    // The seconds, each with its samples.
    let mut seconds: Vec<(i64, Vec<&RunSample>)> = Vec::new();
    for sample in samples {
        let second = sample.at_ms.div_euclid(1000);
        match seconds.last_mut() {
            Some((s, group)) if *s == second => group.push(sample),
            _ => seconds.push((second, vec![sample])),
        }
    }
    let points = points.max(1);
    let per_point = seconds.len().div_ceil(points).max(1);
    let mut out: Vec<TimelinePoint> = Vec::new();
    let mut ended_before: Option<(i64, u64)> = None;
    for chunk in seconds.chunks(per_point) {
        let Some((last_second, last)) = chunk.last() else {
            continue;
        };
        let counts = last
            .iter()
            .map(|s| s.counts)
            .max_by_key(|c| c.done + c.failed)
            .unwrap_or_default();
        // Where each endpoint stands at the span's end: every worker's
        // latest sample of the last second, once each (a worker may write
        // two samples in a second: at its tick and as it stops).
        let latest = |sample: &RunSample| {
            !last
                .iter()
                .any(|other| other.worker == sample.worker && other.at_ms > sample.at_ms)
        };
        let mut spans: Vec<(String, Span)> = Vec::new();
        for (second, group) in chunk {
            for sample in group {
                let standing = second == last_second && latest(sample);
                for e in &sample.endpoints {
                    let at = match spans.iter().position(|(name, _)| *name == e.endpoint) {
                        Some(at) => at,
                        None => {
                            spans.push((e.endpoint.clone(), Span::default()));
                            spans.len() - 1
                        }
                    };
                    spans[at].1.add(e, standing);
                }
            }
        }
        let seconds = chunk.len() as u32;
        let span_s = f64::from(seconds);
        let ended = counts.done + counts.failed;
        let at_ms = last
            .iter()
            .map(|s| s.at_ms)
            .max()
            .unwrap_or(last_second * 1000);
        let items_per_s = match ended_before {
            Some((before_ms, before)) if at_ms > before_ms => {
                ended.saturating_sub(before) as f64 / ((at_ms - before_ms) as f64 / 1000.0)
            }
            _ => 0.0,
        };
        ended_before = Some((at_ms, ended));
        out.push(TimelinePoint {
            at_ms,
            seconds,
            counts,
            items_per_s,
            endpoints: spans
                .into_iter()
                .map(|(endpoint, s)| {
                    let (_, (latency_ms, ttft_ms, tpot_ms)) = s.latency.unwrap_or_default();
                    EndpointPoint {
                        endpoint,
                        state: s.state.unwrap_or(evalfleet_types::EndpointState::Idle),
                        limit: s.limit,
                        in_flight: s.in_flight,
                        calls_per_s: s.calls as f64 / span_s,
                        successes_per_s: s.successes as f64 / span_s,
                        failures_per_s: s.failures as f64 / span_s,
                        tokens_per_s: s.tokens as f64 / span_s,
                        latency_ms,
                        ttft_ms,
                        tpot_ms,
                        quota_pauses: s.pauses,
                    }
                })
                .collect(),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use evalfleet_types::EndpointState;

    fn sample(at_ms: i64, worker: &str, done: u64, calls: u64, limit: usize) -> RunSample {
        RunSample {
            at_ms,
            worker: worker.to_owned(),
            counts: StateCounts {
                pending: 100 - done,
                done,
                failed: 0,
            },
            endpoints: vec![EndpointSample {
                endpoint: "e".to_owned(),
                state: EndpointState::Healthy,
                limit,
                in_flight: limit as u64,
                calls,
                successes: calls,
                failures: 0,
                completion_tokens: calls * 10,
                latency_ms: Some(Quantiles {
                    p50: 50.0,
                    p90: 60.0,
                    p99: 70.0,
                }),
                ttft_ms: None,
                tpot_ms: None,
                quota_pauses: 0,
            }],
        }
    }

    #[test]
    fn workers_of_a_second_add_up_and_long_timelines_come_in_spans() {
        // Two workers, three seconds.
        let samples = vec![
            sample(1_000, "a", 10, 10, 4),
            sample(1_100, "b", 12, 2, 2),
            sample(2_000, "a", 20, 8, 4),
            sample(2_050, "b", 24, 4, 2),
            sample(3_000, "a", 30, 6, 4),
            sample(3_001, "b", 36, 6, 2),
        ];
        let points = timeline(&samples, 100);
        assert_eq!(points.len(), 3);
        let second = &points[1];
        assert_eq!(second.counts.done, 24);
        assert_eq!(second.endpoints[0].limit, 6, "both workers' slots");
        assert_eq!(second.endpoints[0].calls_per_s, 12.0);
        assert_eq!(second.endpoints[0].tokens_per_s, 120.0);
        // 12 more ended in the 0.95 s since the first point.
        assert!((second.items_per_s - 12.0 / 0.95).abs() < 1e-9);
        // Two spans of two seconds and one: rates per second.
        let spans = timeline(&samples, 2);
        assert_eq!(spans.len(), 2);
        assert_eq!(spans[0].seconds, 2);
        assert_eq!(spans[0].endpoints[0].calls_per_s, 12.0);
        assert_eq!(spans[0].endpoints[0].limit, 6, "as at the span's end");
        assert_eq!(spans[1].counts.done, 36);
    }

    #[test]
    fn a_worker_that_writes_twice_in_a_second_is_counted_once() {
        // Its tick, and its last sample as it stops, in the same second.
        let samples = vec![
            sample(1_000, "a", 10, 10, 4),
            sample(2_000, "a", 20, 10, 4),
            sample(2_400, "a", 24, 4, 4),
        ];
        let points = timeline(&samples, 100);
        assert_eq!(points.len(), 2);
        assert_eq!(points[1].endpoints[0].limit, 4, "the configured limit");
        assert_eq!(points[1].endpoints[0].in_flight, 4);
        assert_eq!(points[1].counts.done, 24);
    }
}
