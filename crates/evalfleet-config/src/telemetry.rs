//! `telemetry:` what the run's watchdog samples, how often, and the limits
//! that raise an event when crossed (`fleet::watchdog`).

use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;

use super::problems::Problems;
use super::schema;

/// Resource telemetry: while the run runs, a watchdog samples its GPUs
/// (`nvidia-smi`: memory in use and utilisation, and each process's memory
/// where the driver says), each local engine's process tree (CPU and RSS,
/// from `/proc`), each engine's load as its `/metrics` tells it (KV cache,
/// requests running and waiting), and evalfleet itself. Each series is
/// stored with the run, bounded; reports give its peak and mean. Default:
/// on, every second, GPUs `auto`, no limits.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RawTelemetry {
    /// Sample at all. Default `true`.
    pub enabled: Option<bool>,
    /// Between two samples (at least `100ms`). Default `1s`.
    #[schemars(with = "Option<schema::Duration>")]
    pub interval: Option<String>,
    /// The GPUs sampled: `auto` (those the run's local engines are given
    /// with `gpu:`, or every GPU when one of them is given none; no GPU
    /// when the run has no local engine), `all`, `none`, or indices
    /// (`"0,1"`). A machine without `nvidia-smi` has no GPU series (said
    /// once). Default `auto`.
    pub gpus: Option<String>,
    pub limits: Option<RawTelemetryLimits>,
}

/// Limits that raise a `resource_limit` event (stored with the run, shown by
/// `status` and the dashboard) when a sample goes above them, once per
/// crossing: again only after a sample went back under (a `resource_back`
/// event). Default: none.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RawTelemetryLimits {
    /// Memory in use on each sampled GPU, in MiB. Default: none.
    pub gpu_memory_mb: Option<u64>,
    /// GPU memory of each local engine's processes, in MiB. Default: none.
    pub engine_gpu_memory_mb: Option<u64>,
    /// Resident memory of each local engine's process tree, in MiB.
    /// Default: none.
    pub engine_rss_mb: Option<u64>,
    /// Resident memory of evalfleet itself, in MiB. Default: none.
    pub evalfleet_rss_mb: Option<u64>,
}

/// Which GPUs are sampled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuSelection {
    /// Those of the run's local engines.
    Auto,
    All,
    None,
    Listed(Vec<u32>),
}

/// The limits of `telemetry.limits`, in MiB.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TelemetryLimits {
    pub gpu_memory_mb: Option<u64>,
    pub engine_gpu_memory_mb: Option<u64>,
    pub engine_rss_mb: Option<u64>,
    pub evalfleet_rss_mb: Option<u64>,
}

/// `telemetry:` validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TelemetrySettings {
    pub enabled: bool,
    pub interval: Duration,
    pub gpus: GpuSelection,
    pub limits: TelemetryLimits,
}

impl Default for TelemetrySettings {
    fn default() -> Self {
        Self {
            enabled: true,
            interval: Duration::from_secs(1),
            gpus: GpuSelection::Auto,
            limits: TelemetryLimits::default(),
        }
    }
}

pub(super) fn telemetry(raw: RawTelemetry, p: &mut Problems<'_>) -> Option<TelemetrySettings> {
    let interval = p
        .duration("telemetry.interval", raw.interval.as_deref(), "1s")
        .and_then(|d| {
            if d < Duration::from_millis(100) {
                p.push(
                    "telemetry.interval",
                    format!(
                        "must be at least 100ms, got {}",
                        humantime::format_duration(d)
                    ),
                )
            } else {
                Some(d)
            }
        });
    let gpus = match raw.gpus.as_deref().map(str::trim) {
        None | Some("auto") => Some(GpuSelection::Auto),
        Some("all") => Some(GpuSelection::All),
        Some("none") => Some(GpuSelection::None),
        Some(list) => list
            .split(',')
            .map(|i| i.trim().parse::<u32>())
            .collect::<Result<Vec<_>, _>>()
            .ok()
            .filter(|l| !l.is_empty())
            .map(GpuSelection::Listed)
            .or_else(|| {
                p.push(
                    "telemetry.gpus",
                    format!("must be auto, all, none or GPU indices like \"0,1\", got '{list}'"),
                )
            }),
    };
    let limits = raw.limits.unwrap_or_default();
    let mut limit = |key: &str, value: Option<u64>| match value {
        Some(0) => p.push(
            &format!("telemetry.limits.{key}"),
            "must be at least 1, got 0",
        ),
        other => Some(other),
    };
    let gpu_memory_mb = limit("gpu_memory_mb", limits.gpu_memory_mb);
    let engine_gpu_memory_mb = limit("engine_gpu_memory_mb", limits.engine_gpu_memory_mb);
    let engine_rss_mb = limit("engine_rss_mb", limits.engine_rss_mb);
    let evalfleet_rss_mb = limit("evalfleet_rss_mb", limits.evalfleet_rss_mb);
    Some(TelemetrySettings {
        enabled: raw.enabled.unwrap_or(true),
        interval: interval?,
        gpus: gpus?,
        limits: TelemetryLimits {
            gpu_memory_mb: gpu_memory_mb?,
            engine_gpu_memory_mb: engine_gpu_memory_mb?,
            engine_rss_mb: engine_rss_mb?,
            evalfleet_rss_mb: evalfleet_rss_mb?,
        },
    })
}
