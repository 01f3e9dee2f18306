//! What a run's resources came to (`telemetry:`): each series' peak and
//! mean, per GPU, per endpoint and for evalfleet, exact whatever the store
//! merged to keep the series bounded.

use std::collections::BTreeMap;

use evalfleet_types::{ResourceMetric, ResourcePoint, ResourceSeries, ResourceSource};
use serde::Serialize;

use evalfleet_store::{Store, StoreError};

/// One series over the run.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct SeriesSummary {
    pub series: ResourceSeries,
    pub peak: f64,
    pub mean: f64,
    /// Samples taken.
    pub samples: u64,
    /// The first and last samples' times, ms since the Unix epoch.
    pub first_ms: i64,
    pub last_ms: i64,
}

/// A run's resource telemetry, summed up.
#[derive(Debug, Clone, Default, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ResourcesReport {
    /// Every series: GPUs first, then endpoints, then evalfleet.
    pub series: Vec<SeriesSummary>,
    /// The most memory in use on any sampled GPU at once, in MiB (the
    /// whole GPU's, whoever used it); `None` when no GPU was sampled.
    pub gpu_memory_peak_mb: Option<f64>,
}

impl ResourcesReport {
    /// The summary of points in any order.
    pub fn of(points: &[ResourcePoint]) -> Self {
        let mut by_series: BTreeMap<&ResourceSeries, SeriesSummary> = BTreeMap::new();
        for point in points {
            let summary = by_series
                .entry(&point.series)
                .or_insert_with(|| SeriesSummary {
                    series: point.series.clone(),
                    peak: f64::NEG_INFINITY,
                    mean: 0.0,
                    samples: 0,
                    first_ms: point.at_ms,
                    last_ms: point.until_ms,
                });
            let samples = summary.samples + point.samples;
            if samples > 0 {
                summary.mean = (summary.mean * summary.samples as f64
                    + point.mean * point.samples as f64)
                    / samples as f64;
            }
            summary.samples = samples;
            summary.peak = summary.peak.max(point.peak);
            summary.first_ms = summary.first_ms.min(point.at_ms);
            summary.last_ms = summary.last_ms.max(point.until_ms);
        }
        let series: Vec<SeriesSummary> = by_series.into_values().collect();
        let gpu_memory_peak_mb = series
            .iter()
            .filter(|s| {
                s.series.source == ResourceSource::Gpu
                    && s.series.metric == ResourceMetric::GpuMemoryMb
            })
            .map(|s| s.peak)
            .reduce(f64::max);
        Self {
            series,
            gpu_memory_peak_mb,
        }
    }

    /// The summary of one series, if it was sampled.
    pub fn get(
        &self,
        source: ResourceSource,
        name: &str,
        metric: ResourceMetric,
    ) -> Option<&SeriesSummary> {
        self.series.iter().find(|s| {
            s.series.source == source && s.series.name == name && s.series.metric == metric
        })
    }

    /// The series of endpoint `name`.
    pub fn endpoint<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a SeriesSummary> {
        self.series
            .iter()
            .filter(move |s| s.series.source == ResourceSource::Endpoint && s.series.name == name)
    }

    pub fn is_empty(&self) -> bool {
        self.series.is_empty()
    }
}

/// Run `run_id`'s resource telemetry, summed up.
pub fn resources(store: &mut dyn Store, run_id: &str) -> Result<ResourcesReport, StoreError> {
    Ok(ResourcesReport::of(
        &store.resource_points(run_id, i64::MIN)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_and_mean_are_per_series_and_weighted_by_samples() {
        let gpu = ResourceSeries::new(ResourceSource::Gpu, "0", ResourceMetric::GpuMemoryMb);
        let rss = ResourceSeries::new(ResourceSource::Endpoint, "e", ResourceMetric::RssMb);
        let merged = ResourcePoint::sample(gpu.clone(), 0, 100.0)
            .merged(&ResourcePoint::sample(gpu.clone(), 1, 300.0))
            .merged(&ResourcePoint::sample(gpu.clone(), 2, 200.0));
        let points = vec![
            ResourcePoint::sample(rss.clone(), 5, 7.0),
            merged,
            ResourcePoint::sample(gpu.clone(), 3, 600.0),
        ];
        let report = ResourcesReport::of(&points);
        let g = report
            .get(ResourceSource::Gpu, "0", ResourceMetric::GpuMemoryMb)
            .unwrap();
        assert_eq!(g.samples, 4);
        assert!((g.mean - 300.0).abs() < 1e-9);
        assert_eq!(g.peak, 600.0);
        assert_eq!((g.first_ms, g.last_ms), (0, 3));
        assert_eq!(report.gpu_memory_peak_mb, Some(600.0));
        assert_eq!(report.endpoint("e").count(), 1);
        assert_eq!(ResourcesReport::of(&[]).gpu_memory_peak_mb, None);
    }
}
