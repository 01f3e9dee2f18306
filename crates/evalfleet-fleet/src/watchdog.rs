//! The run's resource telemetry (`telemetry:`): every interval, a sample of
//! each GPU the run uses (`nvidia-smi`), each local engine's process tree
//! (`/proc`), each engine's load as its poller last read it (no second
//! poll of its `/metrics`), and evalfleet itself. Samples go to the fleet's
//! housekeeping, which stores them with its own pass (bounded series, see
//! [`evalfleet_types::merge_evenly`]); limits crossed become events.
//!
//! `nvidia-smi` runs as a child process with a timeout, and `/proc` is read
//! on a blocking thread: nothing here blocks an async thread. A machine
//! without `nvidia-smi` has no GPU series, and says so once.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use evalfleet_types::{
    Event, EventKind, ResourceMetric, ResourcePoint, ResourceSeries, ResourceSource, now_ms,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::Endpoint;
use super::gpu::{self, GpuReport};
use super::procs::{self, CpuMeter, Proc};
use evalfleet_config::{EndpointKind, GpuSelection, TelemetryLimits, TelemetrySettings};

/// What one round of sampling found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tick {
    pub points: Vec<ResourcePoint>,
    /// Limits crossed, either way.
    pub events: Vec<Event>,
}

/// Which way a series crossed its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Crossing {
    /// It went above.
    Above,
    /// It came back to the limit or under.
    Back,
}

/// The series above their limits: a crossing is told once, and again only
/// after the series went back under.
#[derive(Debug, Default)]
pub struct LimitWatch {
    above: HashSet<ResourceSeries>,
}

impl LimitWatch {
    /// What a sample `value` of `series` with limit `limit` crossed.
    pub fn observe(&mut self, series: &ResourceSeries, value: f64, limit: f64) -> Option<Crossing> {
        if value > limit {
            self.above.insert(series.clone()).then_some(Crossing::Above)
        } else {
            self.above.remove(series).then_some(Crossing::Back)
        }
    }
}

/// The limit of `series`, if one is set.
pub fn limit_of(limits: &TelemetryLimits, series: &ResourceSeries) -> Option<u64> {
    use ResourceMetric::{GpuMemoryMb, RssMb};
    use ResourceSource::{Endpoint, Evalfleet, Gpu};
    match (series.source, series.metric) {
        (Gpu, GpuMemoryMb) => limits.gpu_memory_mb,
        (Endpoint, GpuMemoryMb) => limits.engine_gpu_memory_mb,
        (Endpoint, RssMb) => limits.engine_rss_mb,
        (Evalfleet, RssMb) => limits.evalfleet_rss_mb,
        _ => None,
    }
}

/// The config key of a limit, for messages.
fn limit_key(series: &ResourceSeries) -> &'static str {
    match (series.source, series.metric) {
        (ResourceSource::Gpu, _) => "gpu_memory_mb",
        (ResourceSource::Endpoint, ResourceMetric::GpuMemoryMb) => "engine_gpu_memory_mb",
        (ResourceSource::Endpoint, _) => "engine_rss_mb",
        (ResourceSource::Evalfleet, _) => "evalfleet_rss_mb",
    }
}

/// The event of a crossing.
pub fn crossing_event(
    series: &ResourceSeries,
    crossing: Crossing,
    value: f64,
    limit: u64,
    at_ms: i64,
) -> Event {
    let what = match (series.source, series.metric) {
        (ResourceSource::Gpu, _) => format!("GPU {}'s memory in use", series.name),
        (ResourceSource::Endpoint, ResourceMetric::GpuMemoryMb) => {
            format!("Endpoint {}'s GPU memory", series.name)
        }
        (ResourceSource::Endpoint, _) => format!("Endpoint {}'s engine's RSS", series.name),
        (ResourceSource::Evalfleet, _) => "evalfleet's RSS".to_owned(),
    };
    let key = limit_key(series);
    let (kind, message) = match crossing {
        Crossing::Above => (
            EventKind::ResourceLimit,
            format!("{what} is {value:.0} MiB, above telemetry.limits.{key} ({limit} MiB)."),
        ),
        Crossing::Back => (
            EventKind::ResourceBack,
            format!("{what} is {value:.0} MiB, back within telemetry.limits.{key} ({limit} MiB)."),
        ),
    };
    Event {
        at_ms,
        kind,
        endpoint: (series.source == ResourceSource::Endpoint).then(|| series.name.clone()),
        message,
    }
}

/// The GPUs `selection` samples for a run of `endpoints`: `None` for none,
/// `Some(None)` for all of them.
fn gpus_of(selection: &GpuSelection, endpoints: &[Arc<Endpoint>]) -> Option<Option<Vec<u32>>> {
    match selection {
        GpuSelection::None => None,
        GpuSelection::All => Some(None),
        GpuSelection::Listed(list) => Some(Some(list.clone())),
        GpuSelection::Auto => {
            let mut listed = Vec::new();
            let mut any = false;
            for endpoint in endpoints {
                if let EndpointKind::Local(engine) = &endpoint.config.kind {
                    any = true;
                    match &engine.gpu {
                        // An engine given no GPU may use any.
                        None => return Some(None),
                        Some(devices) => listed.extend(
                            devices
                                .split(',')
                                .filter_map(|d| d.trim().parse::<u32>().ok()),
                        ),
                    }
                }
            }
            any.then_some(Some(listed))
        }
    }
}

/// Samples a run's resources every interval.
pub struct Watchdog {
    settings: TelemetrySettings,
    endpoints: Vec<Arc<Endpoint>>,
    /// `None`: no GPU is sampled; `Some(None)`: all of them.
    gpus: Option<Option<Vec<u32>>>,
    /// Why GPUs could not be read, last time (said once per change).
    gpus_unavailable: Option<String>,
    meters: HashMap<String, CpuMeter>,
    own: CpuMeter,
    limits: LimitWatch,
}

/// What the blocking read of `/proc` found: each local engine's tree, and
/// evalfleet itself.
struct ProcReading {
    trees: Vec<(String, Vec<Proc>)>,
    own: Option<Proc>,
    /// When `/proc` was read: CPU time is real time, measured against the
    /// real clock at the reading, not after `nvidia-smi` has answered.
    at: Instant,
}

/// Reads the process trees of `roots` (endpoint names and their root
/// pids) and evalfleet's own process; blocks.
fn read_procs(roots: Vec<(String, u32)>) -> ProcReading {
    let pids: Vec<u32> = roots.iter().map(|(_, pid)| *pid).collect();
    let trees = procs::trees(&pids);
    let trees = roots
        .into_iter()
        .zip(trees)
        .map(|((name, _), tree)| (name, procs::read_all(&tree)))
        .collect();
    let own = procs::process(std::process::id());
    ProcReading {
        trees,
        own,
        at: Instant::now(),
    }
}

impl Watchdog {
    /// The watchdog of a run of `endpoints`; `None` when telemetry is off.
    pub fn new(settings: &TelemetrySettings, endpoints: &[Arc<Endpoint>]) -> Option<Self> {
        settings.enabled.then(|| Self {
            gpus: gpus_of(&settings.gpus, endpoints),
            settings: settings.clone(),
            endpoints: endpoints.to_vec(),
            gpus_unavailable: None,
            meters: HashMap::new(),
            own: CpuMeter::default(),
            limits: LimitWatch::default(),
        })
    }

    /// Samples every interval until `stop`, sending each round to `out`
    /// (a round that finds `out` full is dropped: the store is behind).
    pub async fn run(
        mut self,
        tracker: TaskTracker,
        stop: CancellationToken,
        out: mpsc::Sender<Tick>,
    ) {
        let mut tick = tokio::time::interval(self.settings.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let round = tokio::select! {
                () = stop.cancelled() => return,
                round = self.sample(&tracker) => round,
            };
            if out.try_send(round).is_err() {
                tracing::debug!("A round of resource telemetry was dropped: its store is behind.");
            }
        }
    }

    /// One round.
    pub async fn sample(&mut self, tracker: &TaskTracker) -> Tick {
        let roots: Vec<(String, u32)> = self
            .endpoints
            .iter()
            .filter_map(|e| {
                let pid = match e.config.kind {
                    EndpointKind::Local(_) => e.pid(),
                    // An engine started outside the run (a bench's).
                    _ => e.config.engine_pid,
                };
                pid.map(|pid| (e.name.clone(), pid))
            })
            .collect();
        let reading = tracker
            .spawn_blocking(move || read_procs(roots))
            .await
            .unwrap_or_else(|_| ProcReading {
                trees: Vec::new(),
                own: None,
                at: Instant::now(),
            });
        let report = match &self.gpus {
            Some(_) => Some(gpu::report().await),
            None => None,
        };
        let now = reading.at;
        let at_ms = now_ms();
        let mut points = Vec::new();
        let mut add = |source, name: &str, metric, value: f64| {
            if value.is_finite() {
                points.push(ResourcePoint::sample(
                    ResourceSeries::new(source, name, metric),
                    at_ms,
                    value,
                ));
            }
        };
        let gpu_processes = match report {
            Some(GpuReport::Gpus { gpus, processes }) => {
                if self.gpus_unavailable.take().is_some() {
                    tracing::info!("GPU telemetry: nvidia-smi answers again.");
                }
                let wanted = self.gpus.clone().flatten();
                for g in gpus
                    .iter()
                    .filter(|g| wanted.as_ref().is_none_or(|w| w.contains(&g.index)))
                {
                    let index = g.index.to_string();
                    add(
                        ResourceSource::Gpu,
                        &index,
                        ResourceMetric::GpuMemoryMb,
                        g.memory_used_mb as f64,
                    );
                    add(
                        ResourceSource::Gpu,
                        &index,
                        ResourceMetric::GpuMemoryTotalMb,
                        g.memory_total_mb as f64,
                    );
                    if let Some(u) = g.utilization_pct {
                        add(
                            ResourceSource::Gpu,
                            &index,
                            ResourceMetric::GpuUtilizationPct,
                            f64::from(u),
                        );
                    }
                }
                Some(processes)
            }
            Some(GpuReport::Unavailable(why)) => {
                if self.gpus_unavailable.as_deref() != Some(why.as_str()) {
                    tracing::info!("No GPU telemetry for now: {why}.");
                    self.gpus_unavailable = Some(why);
                }
                None
            }
            None => None,
        };
        for (name, tree) in &reading.trees {
            let usage = self.meters.entry(name.clone()).or_default().read(tree, now);
            if tree.is_empty() {
                continue;
            }
            add(
                ResourceSource::Endpoint,
                name,
                ResourceMetric::RssMb,
                usage.rss_mb,
            );
            if let Some(cpu) = usage.cpu_pct {
                add(ResourceSource::Endpoint, name, ResourceMetric::CpuPct, cpu);
            }
            if let Some(processes) = &gpu_processes {
                let pids: HashSet<u32> = tree.iter().map(|p| p.pid).collect();
                let used: u64 = processes
                    .iter()
                    .filter(|p| pids.contains(&p.pid))
                    .filter_map(|p| p.used_memory_mb)
                    .sum();
                add(
                    ResourceSource::Endpoint,
                    name,
                    ResourceMetric::GpuMemoryMb,
                    used as f64,
                );
            }
        }
        for endpoint in &self.endpoints {
            if let Some(load) = endpoint.engine_load() {
                let name = &endpoint.name;
                if let Some(kv) = load.kv_cache {
                    add(
                        ResourceSource::Endpoint,
                        name,
                        ResourceMetric::KvCachePct,
                        100.0 * kv,
                    );
                }
                if let Some(running) = load.running {
                    add(
                        ResourceSource::Endpoint,
                        name,
                        ResourceMetric::Running,
                        running as f64,
                    );
                }
                if let Some(waiting) = load.waiting {
                    add(
                        ResourceSource::Endpoint,
                        name,
                        ResourceMetric::Waiting,
                        waiting as f64,
                    );
                }
            }
        }
        if let Some(own) = reading.own {
            let usage = self.own.read(&[own], now);
            add(
                ResourceSource::Evalfleet,
                "",
                ResourceMetric::RssMb,
                usage.rss_mb,
            );
            if let Some(cpu) = usage.cpu_pct {
                add(ResourceSource::Evalfleet, "", ResourceMetric::CpuPct, cpu);
            }
        }
        let events = self.crossings(&points, at_ms);
        Tick { points, events }
    }

    fn crossings(&mut self, points: &[ResourcePoint], at_ms: i64) -> Vec<Event> {
        let mut events = Vec::new();
        for point in points {
            let Some(limit) = limit_of(&self.settings.limits, &point.series) else {
                continue;
            };
            if let Some(crossing) = self.limits.observe(&point.series, point.peak, limit as f64) {
                let event = crossing_event(&point.series, crossing, point.peak, limit, at_ms);
                match crossing {
                    Crossing::Above => tracing::warn!("{}", event.message),
                    Crossing::Back => tracing::info!("{}", event.message),
                }
                events.push(event);
            }
        }
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_time_of_a_proc_reading_is_taken_with_the_reading() {
        // The CPU meter divides the ticks read by the time between two
        // readings: that time is the reading's own, taken on the blocking
        // thread, so nothing awaited after it (nvidia-smi) adds to it.
        let before = Instant::now();
        let reading = read_procs(vec![("self".to_owned(), std::process::id())]);
        let after = Instant::now();
        assert!(before <= reading.at && reading.at <= after);
        assert_eq!(reading.trees.len(), 1);
        assert!(!reading.trees[0].1.is_empty());
        assert!(reading.own.is_some());
    }

    #[test]
    fn each_crossing_of_a_configured_limit_is_one_event_either_way() {
        let settings = TelemetrySettings {
            limits: TelemetryLimits {
                gpu_memory_mb: Some(2000),
                evalfleet_rss_mb: Some(100),
                ..TelemetryLimits::default()
            },
            ..TelemetrySettings::default()
        };
        let mut watchdog = Watchdog::new(&settings, &[]).unwrap();
        let gpu = ResourceSeries::new(ResourceSource::Gpu, "0", ResourceMetric::GpuMemoryMb);
        let util = ResourceSeries::new(ResourceSource::Gpu, "0", ResourceMetric::GpuUtilizationPct);
        let own = ResourceSeries::new(ResourceSource::Evalfleet, "", ResourceMetric::RssMb);
        let mut seen = Vec::new();
        // GPU memory: idle, a process holds 2575 MiB for three samples,
        // exits, then holds it again; utilisation has no limit.
        for (at, (memory, rss)) in [
            (0.0, 50.0),
            (2575.0, 50.0),
            (2575.0, 150.0),
            (2575.0, 150.0),
            (0.0, 50.0),
            (2575.0, 50.0),
        ]
        .into_iter()
        .enumerate()
        {
            let points = [
                ResourcePoint::sample(gpu.clone(), at as i64, memory),
                ResourcePoint::sample(util.clone(), at as i64, 100.0),
                ResourcePoint::sample(own.clone(), at as i64, rss),
            ];
            seen.extend(watchdog.crossings(&points, at as i64));
        }
        let told: Vec<(i64, EventKind, &str)> = seen
            .iter()
            .map(|e| (e.at_ms, e.kind, e.message.as_str()))
            .collect();
        assert_eq!(
            told,
            vec![
                (
                    1,
                    EventKind::ResourceLimit,
                    "GPU 0's memory in use is 2575 MiB, above telemetry.limits.gpu_memory_mb (2000 MiB)."
                ),
                (
                    2,
                    EventKind::ResourceLimit,
                    "evalfleet's RSS is 150 MiB, above telemetry.limits.evalfleet_rss_mb (100 MiB)."
                ),
                (
                    4,
                    EventKind::ResourceBack,
                    "GPU 0's memory in use is 0 MiB, back within telemetry.limits.gpu_memory_mb (2000 MiB)."
                ),
                (
                    4,
                    EventKind::ResourceBack,
                    "evalfleet's RSS is 50 MiB, back within telemetry.limits.evalfleet_rss_mb (100 MiB)."
                ),
                (
                    5,
                    EventKind::ResourceLimit,
                    "GPU 0's memory in use is 2575 MiB, above telemetry.limits.gpu_memory_mb (2000 MiB)."
                ),
            ]
        );
        assert!(seen.iter().all(|e| e.endpoint.is_none()));
    }

    #[test]
    fn a_limit_is_told_once_per_crossing_and_again_after_going_back_under() {
        let series = ResourceSeries::new(ResourceSource::Gpu, "0", ResourceMetric::GpuMemoryMb);
        let mut watch = LimitWatch::default();
        let seen: Vec<Option<Crossing>> = [10.0, 120.0, 130.0, 125.0, 100.0, 90.0, 101.0, 150.0]
            .iter()
            .map(|v| watch.observe(&series, *v, 100.0))
            .collect();
        assert_eq!(
            seen,
            vec![
                None,
                Some(Crossing::Above),
                None,
                None,
                Some(Crossing::Back),
                None,
                Some(Crossing::Above),
                None
            ]
        );
    }
}
