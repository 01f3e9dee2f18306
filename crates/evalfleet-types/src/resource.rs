//! Resource telemetry: what a run's GPUs, engines and evalfleet itself
//! used while it ran, as bounded series of points (see
//! `evalfleet_fleet::watchdog` for what is sampled, and
//! [`merge_evenly`] for the bound).

use serde::{Deserialize, Serialize};

/// What a series is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ResourceSource {
    /// A GPU, named by its index.
    Gpu,
    /// A run's endpoint (its engine's process tree, its load).
    Endpoint,
    /// The evalfleet process itself.
    Evalfleet,
}

crate::names!(ResourceSource, "resource source", {
    Gpu => "gpu",
    Endpoint => "endpoint",
    Evalfleet => "evalfleet",
});

/// What a series measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ResourceMetric {
    /// GPU memory in use, in MiB (a GPU's whole, or an engine's processes').
    GpuMemoryMb,
    /// A GPU's total memory, in MiB.
    GpuMemoryTotalMb,
    /// A GPU's utilisation, in percent.
    GpuUtilizationPct,
    /// Resident memory of a process tree, in MiB.
    RssMb,
    /// CPU time of a process tree, in percent of one core.
    CpuPct,
    /// The share of an engine's KV cache in use, in percent.
    KvCachePct,
    /// Requests an engine runs.
    Running,
    /// Requests waiting in an engine's queue.
    Waiting,
}

crate::names!(ResourceMetric, "resource metric", {
    GpuMemoryMb => "gpu_memory_mb",
    GpuMemoryTotalMb => "gpu_memory_total_mb",
    GpuUtilizationPct => "gpu_utilization_pct",
    RssMb => "rss_mb",
    CpuPct => "cpu_pct",
    KvCachePct => "kv_cache_pct",
    Running => "running",
    Waiting => "waiting",
});

/// One series of a run: a source (`gpu` 0, `endpoint` gpu0, `evalfleet`)
/// and what is measured of it.
#[derive(
    Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, utoipa::ToSchema,
)]
pub struct ResourceSeries {
    pub source: ResourceSource,
    /// The GPU's index, the endpoint's name; empty for evalfleet.
    pub name: String,
    pub metric: ResourceMetric,
}

impl ResourceSeries {
    pub fn new(source: ResourceSource, name: impl Into<String>, metric: ResourceMetric) -> Self {
        Self {
            source,
            name: name.into(),
            metric,
        }
    }

    /// `gpu 0 gpu_memory_mb`, `endpoint gpu0 rss_mb`, `evalfleet rss_mb`.
    pub fn label(&self) -> String {
        if self.name.is_empty() {
            format!("{} {}", self.source, self.metric)
        } else {
            format!("{} {} {}", self.source, self.name, self.metric)
        }
    }
}

/// One point of a series: one sample, or several merged (older points are
/// merged to keep a series bounded), with their mean and their peak, so
/// that a run's peak and mean stay exact whatever was merged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ResourcePoint {
    pub series: ResourceSeries,
    /// The first sample's time, ms since the Unix epoch.
    pub at_ms: i64,
    /// The last sample's time (`at_ms` for one sample).
    pub until_ms: i64,
    pub mean: f64,
    pub peak: f64,
    /// Samples merged into it.
    pub samples: u64,
}

impl ResourcePoint {
    /// One sample of `series`.
    pub fn sample(series: ResourceSeries, at_ms: i64, value: f64) -> Self {
        Self {
            series,
            at_ms,
            until_ms: at_ms,
            mean: value,
            peak: value,
            samples: 1,
        }
    }

    /// `self` and the point after it, as one.
    pub fn merged(&self, next: &Self) -> Self {
        let samples = self.samples + next.samples;
        let mean = if samples == 0 {
            0.0
        } else {
            (self.mean * self.samples as f64 + next.mean * next.samples as f64) / samples as f64
        };
        Self {
            series: self.series.clone(),
            at_ms: self.at_ms.min(next.at_ms),
            until_ms: self.until_ms.max(next.until_ms),
            mean,
            peak: self.peak.max(next.peak),
            samples,
        }
    }
}

/// The most points a series keeps per run.
pub const POINTS_PER_SERIES: usize = 1000;

/// Keeps one series (its points in time order) within `cap` points, its
/// resolution even over time: once it holds more, neighbouring points are
/// merged into points of `width` samples each, `width` being the most any
/// point holds, doubled until the series is down to about half of `cap`.
/// Every point then holds `width` samples but the last merged one (what
/// is left) and the newest, kept as it is (the present value, as
/// `/metrics` reads it), so each covers about as much of the run as any
/// other; samples added later are single points until the next merge.
/// Peaks and means stay exact. Returns whether anything was merged.
pub fn merge_evenly(points: &mut Vec<ResourcePoint>, cap: usize) -> bool {
    let cap = cap.max(3);
    if points.len() <= cap {
        return false;
    }
    let Some(newest) = points.pop() else {
        return false;
    };
    let target = cap / 2;
    let mut width = points.iter().map(|p| p.samples).max().unwrap_or(1).max(1);
    loop {
        let packed = pack(points, width);
        if packed.len() <= target {
            *points = packed;
            points.push(newest);
            return true;
        }
        width = width.saturating_mul(2);
    }
}

/// `points` with neighbours merged, oldest first, while a merged point
/// holds at most `width` samples.
fn pack(points: &[ResourcePoint], width: u64) -> Vec<ResourcePoint> {
    let mut packed: Vec<ResourcePoint> = Vec::with_capacity(points.len() / 2 + 1);
    for point in points {
        match packed.last_mut() {
            Some(last) if last.samples.saturating_add(point.samples) <= width => {
                *last = last.merged(point);
            }
            _ => packed.push(point.clone()),
        }
    }
    packed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merging_keeps_the_peak_and_the_mean_exact_and_the_series_bounded() {
        let series = ResourceSeries::new(ResourceSource::Gpu, "0", ResourceMetric::GpuMemoryMb);
        let mut points = Vec::new();
        let mut sum = 0.0;
        for i in 0..100_000_i64 {
            let value = ((i * 7919) % 1000) as f64;
            sum += value;
            points.push(ResourcePoint::sample(series.clone(), i, value));
            merge_evenly(&mut points, 100);
            assert!(points.len() <= 100);
        }
        let samples: u64 = points.iter().map(|p| p.samples).sum();
        assert_eq!(samples, 100_000);
        let mean = points
            .iter()
            .map(|p| p.mean * p.samples as f64)
            .sum::<f64>()
            / samples as f64;
        assert!((mean - sum / 100_000.0).abs() < 1e-6);
        assert_eq!(points.iter().map(|p| p.peak).fold(0.0, f64::max), 999.0);
        assert_eq!(points[0].at_ms, 0);
        assert_eq!(points.last().unwrap().until_ms, 99_999);
        // The newest point is the newest sample.
        assert_eq!(points.last().unwrap().samples, 1);
        assert!(points.windows(2).all(|w| w[0].until_ms < w[1].at_ms));
    }

    #[test]
    fn a_long_series_keeps_its_resolution_even_over_time() {
        // Ten hours at a sample a second: no part of the run is squashed
        // into one point while the rest keeps its detail.
        let series = ResourceSeries::new(ResourceSource::Gpu, "0", ResourceMetric::GpuMemoryMb);
        let total = 36_000_i64;
        let value = |i: i64| {
            if i == 20_000 {
                5_000.0
            } else {
                (i % 60) as f64
            }
        };
        let mut points = Vec::new();
        for i in 0..total {
            points.push(ResourcePoint::sample(series.clone(), i * 1000, value(i)));
            merge_evenly(&mut points, POINTS_PER_SERIES);
            assert!(points.len() <= POINTS_PER_SERIES);
            // No point holds more than a few times its share of the samples.
            let most = points.iter().map(|p| p.samples).max().unwrap();
            let share = (i + 1) as f64 / points.len() as f64;
            assert!(
                most as f64 <= 4.0 * share.max(1.0),
                "after {} samples a point holds {most}, the average {share}",
                i + 1
            );
        }
        // Each hour of the run has its part of the points (the newest, not
        // merged yet, have more).
        for hour in 0..10 {
            let within = points
                .iter()
                .filter(|p| p.at_ms / 3_600_000 == hour)
                .count();
            assert!(
                within * 40 >= points.len(),
                "hour {hour}: {within} of {}",
                points.len()
            );
        }
        let samples: u64 = points.iter().map(|p| p.samples).sum();
        assert_eq!(samples, total as u64);
        let mean = points
            .iter()
            .map(|p| p.mean * p.samples as f64)
            .sum::<f64>()
            / samples as f64;
        let exact = (0..total).map(value).sum::<f64>() / total as f64;
        assert!((mean - exact).abs() < 1e-9, "{mean} against {exact}");
        let peak = points.iter().find(|p| p.peak == 5_000.0).unwrap();
        assert!(peak.at_ms <= 20_000_000 && 20_000_000 <= peak.until_ms);
        assert!(points.windows(2).all(|w| w[0].until_ms < w[1].at_ms));
    }
}
