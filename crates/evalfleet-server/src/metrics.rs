//! `/metrics` for Prometheus: what the store knows of its runs, read at
//! each scrape: items by state, and per endpoint of each run whose workers
//! live, calls by outcome and error class, latency, TTFT and TPOT
//! histograms, concurrency limits, calls in flight and quota pauses; and
//! the response cache's hits; and the latest resource telemetry of each
//! running run (`evalfleet_gpu_*`, `evalfleet_engine_*`,
//! `evalfleet_process_*`). Names start with `evalfleet_`; endpoints'
//! figures count from their worker's start.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use evalfleet_store::Store;
use std::collections::BTreeMap;

use evalfleet_reports::view::{self, RunSummary};
use evalfleet_types::{
    BUCKETS_MS, Buckets, EndpointSnapshot, ResourceMetric, ResourcePoint, ResourceSeries,
    ResourceSource, now_ms,
};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::error::ApiError;
use crate::state::AppState;

type Labels = Vec<(String, String)>;

/// A gauge family's help and its series.
type Family<'a> = (&'a str, Vec<(Labels, f64)>);

/// What one scrape reads.
#[derive(Debug)]
struct Scrape {
    runs: Vec<RunSummary>,
    /// Each stopped run's outcome (`complete`, `incomplete`, `failed`)
    /// and its items scored.
    outcomes: Vec<(String, String, u64)>,
    /// Each running run's endpoints, as its workers last wrote them.
    endpoints: Vec<(String, Vec<EndpointSnapshot>)>,
    cache_hits: u64,
    cache_entries: u64,
    /// Each running run's resource series, their latest point each.
    resources: Vec<(String, Vec<ResourcePoint>)>,
}

/// A series' latest point counts as current for this long.
const CURRENT_MS: i64 = 30_000;

/// The gauge of a resource series: its name and help.
fn resource_gauge(series: &ResourceSeries) -> (&'static str, &'static str) {
    use ResourceMetric as M;
    use ResourceSource as S;
    match (series.source, series.metric) {
        (S::Gpu, M::GpuMemoryTotalMb) => ("evalfleet_gpu_memory_total_mib", "A GPU's memory."),
        (S::Gpu, M::GpuUtilizationPct) => {
            ("evalfleet_gpu_utilization_percent", "A GPU's utilisation.")
        }
        (S::Gpu, _) => (
            "evalfleet_gpu_memory_used_mib",
            "Memory in use on a GPU a run samples.",
        ),
        (S::Endpoint, M::GpuMemoryMb) => (
            "evalfleet_engine_gpu_memory_mib",
            "GPU memory of a local engine's processes.",
        ),
        (S::Endpoint, M::CpuPct) => (
            "evalfleet_engine_cpu_percent",
            "CPU of a local engine's process tree, in percent of a core.",
        ),
        (S::Endpoint, M::KvCachePct) => (
            "evalfleet_engine_kv_cache_percent",
            "KV cache in use, as the engine's /metrics tells it.",
        ),
        (S::Endpoint, M::Running) => (
            "evalfleet_engine_requests_running",
            "Requests the engine runs, as its /metrics tells it.",
        ),
        (S::Endpoint, M::Waiting) => (
            "evalfleet_engine_requests_waiting",
            "Requests waiting in the engine's queue.",
        ),
        (S::Endpoint, _) => (
            "evalfleet_engine_rss_mib",
            "Resident memory of a local engine's process tree.",
        ),
        (S::Evalfleet, M::CpuPct) => (
            "evalfleet_process_cpu_percent",
            "CPU of the evalfleet process running the run, in percent of a core.",
        ),
        (S::Evalfleet, _) => (
            "evalfleet_process_rss_mib",
            "Resident memory of the evalfleet process running the run.",
        ),
    }
}

/// What a resource series' label names: its GPU, its endpoint, or nothing
/// for evalfleet's own.
fn resource_label(source: ResourceSource) -> Option<&'static str> {
    match source {
        ResourceSource::Gpu => Some("gpu"),
        ResourceSource::Endpoint => Some("endpoint"),
        ResourceSource::Evalfleet => None,
    }
}

fn read(store: &mut dyn Store, state: &AppState) -> Result<Scrape, ApiError> {
    let runs = view::summaries(store)?;
    // A stopped run's outcome comes from its report, kept once computed.
    let mut outcomes = Vec::new();
    for run in runs.iter().filter(|r| r.workers == 0) {
        let Ok(kept) = evalfleet_reports::kept_report(store, state.keeping(), &run.run_id, &[])
        else {
            continue;
        };
        let Ok(report) = serde_json::from_str::<serde_json::Value>(&kept.body) else {
            continue;
        };
        let outcome = &report["outcome"];
        if let Some(kind) = outcome["outcome"].as_str() {
            outcomes.push((
                run.run_id.clone(),
                kind.to_owned(),
                outcome["scored"].as_u64().unwrap_or(0),
            ));
        }
    }
    let mut endpoints = Vec::new();
    for run in runs.iter().filter(|r| r.workers > 0) {
        if let Some(states) = store.endpoint_states(&run.run_id)? {
            endpoints.push((run.run_id.clone(), states.endpoints));
        }
    }
    let since = now_ms() - CURRENT_MS;
    let mut resources = Vec::new();
    for run in runs.iter().filter(|r| r.workers > 0) {
        let mut latest: BTreeMap<ResourceSeries, ResourcePoint> = BTreeMap::new();
        for point in store.resource_points(&run.run_id, since)? {
            latest.insert(point.series.clone(), point);
        }
        resources.push((run.run_id.clone(), latest.into_values().collect()));
    }
    let cache = store.cache_stats()?;
    Ok(Scrape {
        runs,
        outcomes,
        resources,
        endpoints,
        cache_hits: cache.hits,
        cache_entries: cache.entries,
    })
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// Gauges (or counters) of one family: `(labels, value)` each.
fn family(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    series: &[(Labels, f64)],
) -> Result<(), std::fmt::Error> {
    if series.is_empty() {
        return Ok(());
    }
    let mut metric = encoder.encode_descriptor(name, help, None, kind)?;
    for (labels, value) in series {
        let mut one = metric.encode_family(labels)?;
        match kind {
            MetricType::Counter => {
                one.encode_counter::<NoLabelSet, _, f64>(&(*value as u64), None)?
            }
            _ => one.encode_gauge(value)?,
        }
    }
    Ok(())
}

fn histograms(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: &[(Labels, &Buckets)],
) -> Result<(), std::fmt::Error> {
    if series.is_empty() {
        return Ok(());
    }
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Histogram)?;
    for (labels, buckets) in series {
        let bounds: Vec<(f64, u64)> = BUCKETS_MS
            .iter()
            .map(|ms| ms / 1000.0)
            .chain([f64::MAX])
            .zip(buckets.counts.iter().copied())
            .collect();
        metric
            .encode_family(labels)?
            .encode_histogram::<NoLabelSet>(
                buckets.sum_ms / 1000.0,
                buckets.count(),
                &bounds,
                None,
            )?;
    }
    Ok(())
}

impl Collector for Scrape {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut items = Vec::new();
        for run in &self.runs {
            for (state, n) in [
                ("pending", run.counts.pending),
                ("done", run.counts.done),
                ("failed", run.counts.failed),
            ] {
                items.push((labels(&[("run", &run.run_id), ("state", state)]), n as f64));
            }
        }
        family(
            &mut encoder,
            "evalfleet_items",
            "Items of each run by state.",
            MetricType::Gauge,
            &items,
        )?;
        // 1 for each stopped run's outcome, 0 for the others it could have.
        let mut outcomes = Vec::new();
        let mut scored = Vec::new();
        for (run, kind, n) in &self.outcomes {
            for each in ["complete", "incomplete", "failed"] {
                outcomes.push((
                    labels(&[("run", run), ("outcome", each)]),
                    f64::from(u8::from(each == kind)),
                ));
            }
            scored.push((labels(&[("run", run)]), *n as f64));
        }
        family(
            &mut encoder,
            "evalfleet_run_outcome",
            "What each stopped run came to: complete (every item scored), incomplete or failed (no item answered).",
            MetricType::Gauge,
            &outcomes,
        )?;
        family(
            &mut encoder,
            "evalfleet_run_scored_items",
            "Items of each stopped run with a usable, scored answer.",
            MetricType::Gauge,
            &scored,
        )?;
        let running: Vec<(Labels, f64)> = self
            .runs
            .iter()
            .map(|r| {
                (
                    labels(&[("run", &r.run_id), ("state", r.state.as_str())]),
                    r.workers as f64,
                )
            })
            .collect();
        family(
            &mut encoder,
            "evalfleet_run_workers",
            "Workers of each run that live now.",
            MetricType::Gauge,
            &running,
        )?;
        let (mut calls, mut errors, mut limits, mut in_flight, mut pauses) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut latency, mut ttft, mut tpot) = (Vec::new(), Vec::new(), Vec::new());
        for (run, endpoints) in &self.endpoints {
            for e in endpoints {
                let at = labels(&[("run", run), ("endpoint", &e.endpoint)]);
                let with = |key: &str, value: &str| {
                    let mut l = at.clone();
                    l.push((key.to_owned(), value.to_owned()));
                    l
                };
                calls.push((with("outcome", "answered"), e.successes as f64));
                calls.push((
                    with("outcome", "failed"),
                    e.calls.saturating_sub(e.successes) as f64,
                ));
                for (class, n) in &e.errors {
                    errors.push((with("class", class.as_str()), *n as f64));
                }
                limits.push((at.clone(), e.limit as f64));
                in_flight.push((at.clone(), e.in_flight as f64));
                pauses.push((at.clone(), e.quota_pauses as f64));
                if let Some(t) = &e.timings {
                    latency.push((at.clone(), &t.latency));
                    ttft.push((at.clone(), &t.ttft));
                    tpot.push((at.clone(), &t.tpot));
                }
            }
        }
        family(
            &mut encoder,
            "evalfleet_calls",
            "Calls that ended, by outcome.",
            MetricType::Counter,
            &calls,
        )?;
        family(
            &mut encoder,
            "evalfleet_call_errors",
            "Failed calls by error class.",
            MetricType::Counter,
            &errors,
        )?;
        family(
            &mut encoder,
            "evalfleet_concurrency_limit",
            "Calls an endpoint may have in flight.",
            MetricType::Gauge,
            &limits,
        )?;
        family(
            &mut encoder,
            "evalfleet_in_flight",
            "Calls in flight.",
            MetricType::Gauge,
            &in_flight,
        )?;
        family(
            &mut encoder,
            "evalfleet_quota_pauses",
            "Pauses an endpoint's quota asked for.",
            MetricType::Counter,
            &pauses,
        )?;
        histograms(
            &mut encoder,
            "evalfleet_latency_seconds",
            "Latency of calls that answered (send to last byte).",
            &latency,
        )?;
        histograms(
            &mut encoder,
            "evalfleet_ttft_seconds",
            "Time to the first token of streamed answers.",
            &ttft,
        )?;
        histograms(
            &mut encoder,
            "evalfleet_tpot_seconds",
            "Time per output token after the first.",
            &tpot,
        )?;
        let mut gauges: BTreeMap<&str, Family<'_>> = BTreeMap::new();
        for (run, points) in &self.resources {
            for point in points {
                let (name, help) = resource_gauge(&point.series);
                let mut at = labels(&[("run", run)]);
                if let Some(label) = resource_label(point.series.source) {
                    at.push((label.to_owned(), point.series.name.clone()));
                }
                // A merged point's mean; a sample's value.
                gauges
                    .entry(name)
                    .or_insert((help, Vec::new()))
                    .1
                    .push((at, point.mean));
            }
        }
        for (name, (help, series)) in &gauges {
            family(&mut encoder, name, help, MetricType::Gauge, series)?;
        }
        family(
            &mut encoder,
            "evalfleet_cache_hits",
            "Calls answered from the response cache, over the store's runs.",
            MetricType::Counter,
            &[(Vec::new(), self.cache_hits as f64)],
        )?;
        family(
            &mut encoder,
            "evalfleet_cache_entries",
            "Answers in the response cache.",
            MetricType::Gauge,
            &[(Vec::new(), self.cache_entries as f64)],
        )
    }
}

/// `GET /metrics`.
pub async fn metrics(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let reading = state.clone();
    let scrape = state.with_store(move |store| read(store, &reading)).await?;
    let mut registry = Registry::default();
    registry.register_collector(Box::new(scrape));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry)
        .map_err(|err| ApiError::Internal(format!("cannot write the metrics: {err}")))?;
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
        )],
        text,
    )
        .into_response())
}
