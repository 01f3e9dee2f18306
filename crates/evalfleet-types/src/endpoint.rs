//! What `status` shows of an endpoint.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ErrorClass;

/// Where an endpoint stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointState {
    /// Configured but not taking part (`--endpoints`, `fleet remove`).
    Idle,
    /// Being started.
    Starting,
    /// Up and taking items.
    Healthy,
    /// Its breaker is open: no new items.
    Unhealthy,
    /// Probes answer again; waiting for it to stay up.
    Recovering,
    /// Its engine is being started again.
    Restarting,
    /// Out of the run.
    Excluded,
}

crate::names!(EndpointState, "endpoint state", {
    Idle => "idle",
    Starting => "starting",
    Healthy => "healthy",
    Unhealthy => "unhealthy",
    Recovering => "recovering",
    Restarting => "restarting",
    Excluded => "excluded",
});

/// An endpoint as its worker last saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EndpointSnapshot {
    pub endpoint: String,
    /// Its config's kind: `mock`, `external`, `local` or `remote`.
    pub kind: String,
    pub state: EndpointState,
    pub limit: usize,
    pub adaptive: bool,
    pub in_flight: u64,
    /// Calls started in the last minute.
    pub requests_per_minute: u64,
    /// Failed calls by class.
    pub errors: BTreeMap<ErrorClass, u64>,
    pub base_url: Option<String>,
    pub pid: Option<u32>,
    pub restarts: u32,
    /// The request rate learned from 429s, per second.
    pub learned_rate: Option<f64>,
}
