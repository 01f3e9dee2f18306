//! Reports and comparisons of runs that no longer change, computed once and
//! kept in the store, for every process that shares it and across
//! restarts.
//!
//! What is kept is the serialized report, under the run (a comparison:
//! under its first run) and what was asked, with the runs' generations (see
//! [`RunRecord::generation`]): a commit of results, a new session (a
//! resume) or a rescore changes a run's generation, so what was kept before
//! no longer matches and is computed again. A run that is running is never
//! kept: its report is computed each time it is asked for. The generations
//! are read before the results, so a change during a computation leaves
//! what it keeps already stale, never wrong.
//!
//! A process that may not write the store (`evalfleet serve --read-only`)
//! keeps what it computes in its own memory instead ([`Keeping::Memory`]),
//! a bounded number of reports, and still serves what others kept in the
//! store.

use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};

use super::{ReportError, compare, report};
use evalfleet_store::{KeptReport, RunRecord, Store};
use evalfleet_types::RunStatus;

/// Where computed reports are kept.
#[derive(Clone, Copy)]
pub enum Keeping<'a> {
    /// In the store, for every process that shares it.
    Store,
    /// In this process only: it writes nothing to the store.
    Memory(&'a KeptInMemory),
}

/// Reports kept in a process's memory, the most recently kept last; the
/// oldest go first once there are [`KeptInMemory::CAPACITY`].
#[derive(Default)]
pub struct KeptInMemory {
    reports: Mutex<VecDeque<(String, String, KeptReport)>>,
}

impl KeptInMemory {
    /// Reports kept at most (each is a report's JSON: a few kB to a few
    /// hundred kB with many categories).
    pub const CAPACITY: usize = 64;

    fn get(&self, run_id: &str, key: &str) -> Option<KeptReport> {
        let reports = self.reports.lock().unwrap_or_else(PoisonError::into_inner);
        reports
            .iter()
            .find(|(run, k, _)| run == run_id && k == key)
            .map(|(_, _, report)| report.clone())
    }

    fn put(&self, run_id: &str, key: &str, report: KeptReport) {
        let mut reports = self.reports.lock().unwrap_or_else(PoisonError::into_inner);
        reports.retain(|(run, k, _)| !(run == run_id && k == key));
        if reports.len() >= Self::CAPACITY {
            reports.pop_front();
        }
        reports.push_back((run_id.to_owned(), key.to_owned(), report));
    }
}

/// A report as JSON, and whether it was kept from an earlier request.
#[derive(Debug, Clone)]
pub struct KeptBody {
    pub body: String,
    pub kept: bool,
}

/// The runs' generations, or `None` when one of them is still running.
fn fingerprint(runs: &[RunRecord]) -> Option<String> {
    runs.iter()
        .all(|r| r.status != RunStatus::Running)
        .then(|| {
            runs.iter()
                .map(|r| format!("{}:{}", r.run_id, r.generation))
                .collect::<Vec<_>>()
                .join(",")
        })
}

fn serialize<T: serde::Serialize>(value: &T) -> Result<String, ReportError> {
    serde_json::to_string(value).map_err(|err| ReportError::Metrics(err.to_string()))
}

/// What was kept under `key` for `runs[0]` if it still holds; else
/// `compute`'s answer, kept (where `keeping` says) when every run has
/// stopped.
fn kept_or(
    store: &mut dyn Store,
    keeping: Keeping<'_>,
    runs: &[String],
    key: &str,
    compute: impl FnOnce(&mut dyn Store) -> Result<String, ReportError>,
) -> Result<KeptBody, ReportError> {
    let records: Vec<RunRecord> = runs
        .iter()
        .map(|id| store.run(id))
        .collect::<Result<_, _>>()?;
    let fingerprint = fingerprint(&records);
    if let Some(fingerprint) = &fingerprint {
        // What this process kept, unless it is stale: then what others
        // kept in the store may still hold.
        let current = |kept: &KeptReport| kept.fingerprint == *fingerprint;
        let in_memory = match keeping {
            Keeping::Memory(memory) => memory.get(&runs[0], key).filter(current),
            Keeping::Store => None,
        };
        let kept = match in_memory {
            Some(kept) => Some(kept),
            None => store.kept_report(&runs[0], key)?.filter(current),
        };
        if let Some(kept) = kept {
            return Ok(KeptBody {
                body: kept.body,
                kept: true,
            });
        }
    }
    let body = compute(store)?;
    if let Some(fingerprint) = fingerprint {
        let report = KeptReport { fingerprint, body };
        match keeping {
            Keeping::Memory(memory) => memory.put(&runs[0], key, report.clone()),
            // A store that cannot be written (a read-only file) still answers.
            Keeping::Store => {
                if let Err(err) = store.keep_report(&runs[0], key, &report) {
                    tracing::warn!("cannot keep the report of {}: {err}", runs[0]);
                }
            }
        }
        return Ok(KeptBody {
            body: report.body,
            kept: false,
        });
    }
    Ok(KeptBody { body, kept: false })
}

/// What a report by `by` is kept under.
pub fn report_key(by: &[String]) -> String {
    format!("report/2?by={}", by.join(","))
}

/// What a comparison is kept under (under its first run).
pub fn compare_key(runs: &[String], by: &[String], metric: Option<&str>, limit: usize) -> String {
    format!(
        "compare/2?runs={}&by={}&metric={}&limit={limit}",
        runs.join(","),
        by.join(","),
        metric.unwrap_or("")
    )
}

/// [`report`](super::report) of `run_id` by `by`, as JSON: kept once the
/// run has stopped.
pub fn kept_report(
    store: &mut dyn Store,
    keeping: Keeping<'_>,
    run_id: &str,
    by: &[String],
) -> Result<KeptBody, ReportError> {
    let key = report_key(by);
    kept_or(store, keeping, &[run_id.to_owned()], &key, |store| {
        serialize(&report(store, run_id, by, None)?)
    })
}

/// [`compare`](super::compare) of `runs` as JSON: kept once every run has
/// stopped.
pub fn kept_compare(
    store: &mut dyn Store,
    keeping: Keeping<'_>,
    runs: &[String],
    by: &[String],
    metric: Option<&str>,
    limit: usize,
) -> Result<KeptBody, ReportError> {
    if runs.len() < 2 {
        // Said as `compare` says it.
        compare(store, runs, by, metric, limit)?;
    }
    let key = compare_key(runs, by, metric, limit);
    kept_or(store, keeping, runs, &key, |store| {
        serialize(&compare(store, runs, by, metric, limit)?)
    })
}
