//! What the store's test files share: a dataset of named items to register
//! (an id starting with `bad` is an invalid row), and a worker of this
//! process.

#![allow(dead_code)]

use evalfleet_store::{ListedItems, NewItem, WorkerInfo};

/// Items for a new run, in the order given.
pub fn items(ids: &[&str], sample_n: Option<u64>) -> ListedItems {
    let items: Vec<NewItem> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| NewItem {
            item_id: (*id).to_owned(),
            seq: i as u64 + 1,
            line: i as u64 + 1,
            offset: i as u64 * 10,
            sample_key: evalfleet_io::dataset::sample_key(1, id),
            invalid: id.starts_with("bad").then(|| "broken row".to_owned()),
        })
        .collect();
    ListedItems::new(items, sample_n)
}

/// A worker of this process named `name`, with leases of a minute.
pub fn worker(name: &str) -> WorkerInfo {
    WorkerInfo {
        worker: name.to_owned(),
        ..evalfleet_store::worker::this_process(std::time::Duration::from_secs(60))
    }
}

/// Ten times a series' bound of samples of a GPU's memory and of
/// evalfleet's RSS, ten samples a write (as the housekeeping writes a
/// second of 100 ms samples), 100 ms apart; the GPU peaks once, at sample
/// 17, in the oldest part. Returns the writes, and the two series.
pub fn resource_writes() -> (
    Vec<Vec<evalfleet_types::ResourcePoint>>,
    evalfleet_types::ResourceSeries,
    evalfleet_types::ResourceSeries,
) {
    use evalfleet_types::{
        POINTS_PER_SERIES, ResourceMetric, ResourcePoint, ResourceSeries, ResourceSource,
    };
    let gpu = ResourceSeries::new(ResourceSource::Gpu, "0", ResourceMetric::GpuMemoryMb);
    let rss = ResourceSeries::new(ResourceSource::Evalfleet, "", ResourceMetric::RssMb);
    let total = 10 * POINTS_PER_SERIES as i64;
    let writes = (0..total)
        .step_by(10)
        .map(|start| {
            (start..start + 10)
                .flat_map(|at| {
                    [
                        ResourcePoint::sample(gpu.clone(), at * 100, gpu_value(at)),
                        ResourcePoint::sample(rss.clone(), at * 100, 42.0),
                    ]
                })
                .collect()
        })
        .collect();
    (writes, gpu, rss)
}

/// The GPU's memory at sample `at` of [`resource_writes`].
pub fn gpu_value(at: i64) -> f64 {
    if at == 17 {
        143_771.0
    } else {
        (at % 100) as f64
    }
}
