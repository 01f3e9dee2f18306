//! Lifecycle facts stored with a run, and requests to change its fleet.

use serde::{Deserialize, Serialize};

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// A session (a run, a resume, a worker joining) began.
    SessionStarted,
    /// Every item ended.
    Finished,
    /// A session stopped with items pending.
    Interrupted,
    /// An endpoint's start command or engine was started.
    Started,
    /// An engine answers its readiness probe.
    Ready,
    /// An endpoint was stopped at the end.
    Stopped,
    /// Its stop command failed.
    StopFailed,
    /// It could not be started.
    StartFailed,
    /// Its engine's process ended.
    Died,
    /// Its breaker opened: it takes no items.
    Unhealthy,
    /// It was taken out for a while for its faults (it answers probes).
    Ejected,
    /// Probes answer again.
    Recovering,
    /// Its breaker closed: it takes items again.
    Recovered,
    /// Its engine is being started again.
    Restarting,
    /// It is out of the run.
    Excluded,
    /// `evalfleet fleet add` took effect.
    Added,
    /// `evalfleet fleet remove` took effect.
    Removed,
    /// Its concurrency limit moved.
    Limit,
    /// A rate was learned from its 429s.
    Quota,
    /// A conversation's policy collapsed (one strategy dominates, one
    /// vanished, or their entropy fell below the floor).
    Alarm,
    /// A resource (GPU memory, a process tree's RSS) went above its
    /// configured limit (`telemetry.limits`).
    ResourceLimit,
    /// A resource above its limit went back under it.
    ResourceBack,
}

crate::names!(EventKind, "event kind", {
    SessionStarted => "session_started",
    Finished => "finished",
    Interrupted => "interrupted",
    Started => "started",
    Ready => "ready",
    Stopped => "stopped",
    StopFailed => "stop_failed",
    StartFailed => "start_failed",
    Died => "died",
    Unhealthy => "unhealthy",
    Ejected => "ejected",
    Recovering => "recovering",
    Recovered => "recovered",
    Restarting => "restarting",
    Excluded => "excluded",
    Added => "added",
    Removed => "removed",
    Limit => "limit",
    Quota => "quota",
    Alarm => "alarm",
    ResourceLimit => "resource_limit",
    ResourceBack => "resource_back",
});

impl EventKind {
    /// Whether the event is bad news, logged as a warning.
    pub fn is_warning(self) -> bool {
        matches!(
            self,
            Self::Unhealthy
                | Self::Ejected
                | Self::Died
                | Self::Excluded
                | Self::StartFailed
                | Self::Alarm
                | Self::ResourceLimit
        )
    }
}

/// A lifecycle fact stored with a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Event {
    pub at_ms: i64,
    pub kind: EventKind,
    /// The endpoint it is about, if any.
    pub endpoint: Option<String>,
    pub message: String,
}

/// What `evalfleet fleet` asks of a running run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FleetAction {
    /// The endpoint takes part.
    Add,
    /// The endpoint stops taking items; its calls in flight move.
    Remove,
}

crate::names!(FleetAction, "fleet action", {
    Add => "add",
    Remove => "remove",
});

/// A request to change the fleet of a running run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FleetChange {
    /// Its place in the run's mailbox (0 before it is stored).
    #[serde(default)]
    pub id: i64,
    pub action: FleetAction,
    pub endpoint: String,
    pub at_ms: i64,
}
