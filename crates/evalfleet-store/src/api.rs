//! The store: runs, the work queue of their items, attempts and results,
//! the response cache, events and the fleet mailbox, each concern a trait of
//! its own; [`Store`] is all of them, as a backend implements them.
//!
//! The traits are synchronous: each thread of a session (the reader, the
//! writer, the fleet's housekeeping) owns a connection of its own. Several
//! workers (sessions, in one process or many) share a run through the work
//! queue: each claims items for a lease, renews it while it works, and
//! commits their results under it; a commit under a lease that has expired
//! is refused, so every item gets exactly one result whoever answers it.
//! SQLite implements them in `evalfleet-store`, opened by URL; PostgreSQL
//! goes beside it.

use serde::Serialize;

use evalfleet_types::{CacheEntry, EndpointSnapshot, Event, FleetChange, ResourcePoint, RunSample};

mod errors;
mod explore;
mod queue;
mod quotas;
mod results;
mod runs;

pub use errors::*;
pub use explore::*;
pub use queue::*;
pub use quotas::*;
pub use results::*;
pub use runs::*;

/// What `evalfleet cache stats` shows.
#[derive(Debug, Clone, Default, PartialEq, Serialize, utoipa::ToSchema)]
pub struct CacheStats {
    pub entries: u64,
    /// Bytes of cached answers.
    pub content_bytes: u64,
    pub oldest_ms: Option<i64>,
    pub newest_ms: Option<i64>,
    /// Calls answered from the cache, over every run of the store.
    pub hits: u64,
}

/// The response cache, shared by every run of the store (or kept in a file
/// of its own).
pub trait ResponseCache {
    /// This connection is about to look up many answers (a run that reads
    /// the cache): a backend may read differently for it, and reads as
    /// before where it cannot. Nothing by default.
    fn prepare_for_lookups(&mut self) {}

    /// The cached answer for `key`, if stored at or after `since_ms`.
    fn cache_get(&mut self, key: &str, since_ms: i64) -> Result<Option<CacheEntry>, StoreError>;

    /// The cached answers for `keys`, in their order (in one read of the
    /// store).
    fn cache_get_many(
        &mut self,
        keys: &[&str],
        since_ms: i64,
    ) -> Result<Vec<Option<CacheEntry>>, StoreError>;

    /// Drops entries older than `before_ms`, then the oldest beyond
    /// `max_entries`; returns how many went.
    fn cache_evict(
        &mut self,
        before_ms: Option<i64>,
        max_entries: Option<u64>,
    ) -> Result<u64, StoreError>;

    fn cache_stats(&mut self) -> Result<CacheStats, StoreError>;

    /// Empties the cache; returns how many entries went.
    fn cache_clear(&mut self) -> Result<u64, StoreError>;
}

/// The endpoints of a run as its workers last wrote them.
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointStates {
    pub updated_at_ms: i64,
    pub endpoints: Vec<EndpointSnapshot>,
}

/// Lifecycle facts and what the workers last saw of their endpoints.
pub trait Events {
    fn add_events(&mut self, run_id: &str, events: &[Event]) -> Result<(), StoreError>;

    fn events(&mut self, run_id: &str) -> Result<Vec<Event>, StoreError>;

    /// Replaces `worker`'s snapshots of these endpoints (each worker keeps
    /// its own: what several saw of one endpoint is summed when read).
    fn put_endpoint_states(
        &mut self,
        run_id: &str,
        worker: &str,
        states: &[EndpointSnapshot],
    ) -> Result<(), StoreError>;

    /// The run's endpoint snapshots, if a worker wrote any.
    fn endpoint_states(&mut self, run_id: &str) -> Result<Option<EndpointStates>, StoreError>;

    /// Adds a second of the run as a worker saw it (its timeline).
    fn add_sample(&mut self, run_id: &str, sample: &RunSample) -> Result<(), StoreError>;

    /// The run's samples after `after_ms` (every worker's), oldest first,
    /// at most `limit`.
    fn samples(
        &mut self,
        run_id: &str,
        after_ms: i64,
        limit: usize,
    ) -> Result<Vec<RunSample>, StoreError>;
}

/// Requests to change the fleet of a running run (`evalfleet fleet`),
/// read by each of its workers.
pub trait FleetMailbox {
    /// Posts a change; returns it with its id.
    fn request_fleet_change(
        &mut self,
        run_id: &str,
        change: &FleetChange,
    ) -> Result<FleetChange, StoreError>;

    /// The changes posted after `after_id`, oldest first.
    fn fleet_changes(
        &mut self,
        run_id: &str,
        after_id: i64,
    ) -> Result<Vec<FleetChange>, StoreError>;
}

/// A report or comparison computed once and kept with the runs it reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptReport {
    /// The generations of the runs it was computed from (see
    /// [`RunRecord::generation`]): it holds while they are unchanged.
    pub fingerprint: String,
    /// The report, as served.
    pub body: String,
}

/// Reports kept per run, at most.
pub const KEPT_PER_RUN: usize = 32;

/// Reports and comparisons kept, so that a finished run's are computed
/// once for every process that shares the store.
pub trait KeptReports {
    /// What was kept for `run_id` under `key`, whatever its fingerprint.
    fn kept_report(&mut self, run_id: &str, key: &str) -> Result<Option<KeptReport>, StoreError>;

    /// Keeps `report` for `run_id` under `key`, replacing what was; of a
    /// run's reports only the [`KEPT_PER_RUN`] kept last stay (the
    /// questions asked of a run are chosen by whoever asks).
    fn keep_report(
        &mut self,
        run_id: &str,
        key: &str,
        report: &KeptReport,
    ) -> Result<(), StoreError>;
}

/// A run's resource telemetry (`telemetry:`): bounded series of points.
pub trait Resources {
    /// Adds points (single samples) to the run's series. A series keeps at
    /// most [`evalfleet_types::POINTS_PER_SERIES`] points: past that,
    /// neighbours are merged into points of even width
    /// ([`evalfleet_types::merge_evenly`]), peaks and means kept exact. A point at the same time as a stored one
    /// of its series is merged into it.
    fn add_resource_points(
        &mut self,
        run_id: &str,
        points: &[ResourcePoint],
    ) -> Result<(), StoreError>;

    /// The run's points whose last sample is after `after_ms`, by series,
    /// then time.
    fn resource_points(
        &mut self,
        run_id: &str,
        after_ms: i64,
    ) -> Result<Vec<ResourcePoint>, StoreError>;
}

/// The store's traits, to call their methods on a `dyn Store`.
pub mod prelude {
    pub use super::{
        Events, Explore, FleetMailbox, KeptReports, Quotas, Resources, ResponseCache, Results,
        Runs, Store, WorkQueue,
    };
}

/// Every concern of a store, as a backend implements them.
pub trait Store:
    Runs
    + WorkQueue
    + Results
    + ResponseCache
    + Events
    + FleetMailbox
    + Explore
    + KeptReports
    + Resources
    + Quotas
    + Send
{
}

impl<
    T: Runs
        + WorkQueue
        + Results
        + ResponseCache
        + Events
        + FleetMailbox
        + Explore
        + KeptReports
        + Resources
        + Quotas
        + Send,
> Store for T
{
}
