//! The fleet at run time: each endpoint that takes part has a keeper task
//! that starts it (a mock, a start command, an engine and its readiness),
//! probes its health, restarts an engine that dies or stays unhealthy (up to
//! `restarts` times, `restart_delay` apart) and leaves it out after that.
//! A housekeeping task stores lifecycle events and endpoint snapshots, and
//! applies `evalfleet fleet add|remove` requests. When no endpoint is left,
//! or none could take items for `timeouts.no_endpoint`, the fleet says it is
//! exhausted and the run stops, resumable.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::{Map, Value};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::engine::Launcher;
use super::gpu::GpuReport;
use super::{Endpoint, Phase, RateEvent, Transition};
use evalfleet_config::{Config, MockSettings};
use evalfleet_types::{EventKind, now_ms};

use evalfleet_store::Store;

mod housekeeping;
mod keeper;
mod watch;

pub(crate) use keeper::{Running, launch, ready};
pub use watch::health_url;

use housekeeping::housekeep;
use keeper::keep;
use watch::report_transition;

/// Keeps an in-process mock alive while held.
pub type MockGuard = Box<dyn Send + Sync>;

/// Starts `kind: mock` endpoints (the binary has the server).
pub trait MockStarter: Send + Sync {
    #[allow(clippy::type_complexity)]
    fn start(
        &self,
        settings: MockSettings,
    ) -> Pin<Box<dyn Future<Output = std::io::Result<(String, MockGuard)>> + Send>>;
}

/// Whether an engine may start on a GPU someone else is using.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuPolicy {
    /// Refuse (the endpoint is left out, saying why).
    Refuse,
    /// Start anyway (`-y`, or the user said yes).
    Allow,
}

/// How a fleet is run.
#[derive(Clone)]
pub struct FleetOptions {
    pub launcher: Launcher,
    pub mocks: Arc<dyn MockStarter>,
    /// The endpoints that take part from the start (`--endpoints`); `None`:
    /// all of them.
    pub active: Option<Vec<String>>,
    pub gpu_policy: GpuPolicy,
    /// How long the run may have no endpoint able to take items.
    pub no_endpoint_timeout: Duration,
    /// How long it waits for a first answer when none ever came.
    pub first_answer_timeout: Duration,
}

/// A lifecycle fact about an endpoint.
#[derive(Debug, Clone)]
struct FleetEvent {
    at_ms: i64,
    endpoint: String,
    kind: EventKind,
    message: String,
}

struct Shared {
    options: FleetOptions,
    task_params: Map<String, Value>,
    stream: bool,
    stalls: crate::client::Stalls,
    events: mpsc::UnboundedSender<FleetEvent>,
    exhausted: CancellationToken,
    reason: Mutex<Option<String>>,
    keepers: Mutex<HashMap<String, CancellationToken>>,
    tracker: TaskTracker,
    gpus: tokio::sync::OnceCell<GpuReport>,
    /// Every endpoint of the run, to judge one against the others.
    peers: Vec<Arc<Endpoint>>,
    /// Why each endpoint left out of the run was left out.
    excluded: Mutex<HashMap<String, String>>,
}

impl Shared {
    fn event(&self, endpoint: &Endpoint, kind: EventKind, message: String) {
        if kind.is_warning() {
            tracing::warn!("{message}");
        } else {
            tracing::info!("{message}");
        }
        let _ = self.events.send(FleetEvent {
            at_ms: now_ms(),
            endpoint: endpoint.name.clone(),
            kind,
            message,
        });
    }

    fn exhaust(&self, reason: String) {
        let mut slot = self.reason.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.is_none() {
            tracing::warn!("{reason}");
            *slot = Some(reason);
        }
        self.exhausted.cancel();
    }
}

/// The run's endpoints and the tasks that look after them.
pub struct Fleet {
    pub endpoints: Vec<Arc<Endpoint>>,
    shared: Arc<Shared>,
    events: Option<mpsc::UnboundedReceiver<FleetEvent>>,
    /// Stops the endpoints' keepers.
    stop: CancellationToken,
    /// The housekeeping's tasks (apart from the keepers': it outlives them
    /// to store their last events), and what stops it.
    housekeeping: TaskTracker,
    housekeeping_done: CancellationToken,
    /// Samples the run's resources (`telemetry:`), when on.
    watchdog: Option<super::watchdog::Watchdog>,
    /// The open files the endpoints' calls may hold, taken from what this
    /// process's other fleets left until this one is dropped.
    _files: crate::open_files::Taken<'static>,
}

impl Fleet {
    pub fn new(config: &Config, options: FleetOptions) -> Self {
        // Every call in flight holds a socket: the endpoints' limits stay
        // within the open files the process may keep.
        let (bounded, files) = crate::open_files::bound(&config.endpoints);
        let endpoints: Vec<_> = bounded
            .iter()
            .map(|e| Arc::new(Endpoint::new(e, config.timeouts.attempt)))
            .collect();
        let (events, receiver) = mpsc::unbounded_channel();
        let watchdog = super::watchdog::Watchdog::new(&config.telemetry, &endpoints);
        Self {
            _files: files,
            watchdog,
            endpoints: endpoints.clone(),
            shared: Arc::new(Shared {
                options,
                task_params: config.task.params.clone(),
                stream: config.task.stream,
                stalls: crate::client::Stalls {
                    first_byte: config.timeouts.first_byte,
                    idle: config.timeouts.stream_idle,
                },
                events,
                exhausted: CancellationToken::new(),
                reason: Mutex::new(None),
                keepers: Mutex::new(HashMap::new()),
                tracker: TaskTracker::new(),
                gpus: tokio::sync::OnceCell::new(),
                peers: endpoints,
                excluded: Mutex::new(HashMap::new()),
            }),
            events: Some(receiver),
            stop: CancellationToken::new(),
            housekeeping: TaskTracker::new(),
            housekeeping_done: CancellationToken::new(),
        }
    }

    /// Starts the endpoints that take part and the housekeeping, which keeps
    /// `store` (its own connection) for events, snapshots, the timeline
    /// (written as `worker`'s) and fleet changes.
    pub fn start(&mut self, run_id: &str, worker: &str, store: Box<dyn Store>) {
        for endpoint in &self.endpoints {
            let active = self
                .shared
                .options
                .active
                .as_ref()
                .is_none_or(|names| names.contains(&endpoint.name));
            if active {
                activate(&self.shared, endpoint, &self.stop);
            }
        }
        let telemetry = self.watchdog.take().map(|watchdog| {
            // Rounds wait here while the housekeeping stores the last ones.
            let (rounds, receiver) = mpsc::channel(64);
            self.shared.tracker.spawn(watchdog.run(
                self.shared.tracker.clone(),
                self.stop.clone(),
                rounds,
            ));
            receiver
        });
        if let Some(events) = self.events.take() {
            let housekeeping = housekeep(
                self.shared.clone(),
                self.endpoints.clone(),
                run_id.to_owned(),
                worker.to_owned(),
                store,
                events,
                telemetry,
                self.housekeeping_done.clone(),
                self.stop.clone(),
                self.housekeeping.clone(),
            );
            self.housekeeping.spawn(housekeeping);
        }
    }

    /// Shares the API keys' quotas of the endpoints with the other workers
    /// of the run, through `store` (a connection of its own), when the store
    /// shares them (see [`super::shared_rate`]); until this is called, and
    /// with a store that does not share, each endpoint keeps to its own
    /// limits. Returns how many endpoints share. Stops with the
    /// housekeeping, giving back what it holds.
    pub fn share_quotas(&self, store: Box<dyn Store>) -> usize {
        if !store.shares_quotas() {
            return 0;
        }
        let sharing = super::shared_rate::share(
            &self.endpoints,
            store,
            &self.housekeeping,
            self.housekeeping_done.clone(),
        );
        if sharing > 0 {
            tracing::info!(
                "{sharing} endpoint(s) share their API keys' rpm and tpm with the run's other workers."
            );
        }
        sharing
    }

    /// Cancelled when no endpoint is left to take items.
    pub fn exhausted(&self) -> CancellationToken {
        self.shared.exhausted.clone()
    }

    /// Why the fleet is exhausted.
    pub fn exhausted_reason(&self) -> Option<String> {
        self.shared
            .reason
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Stops every endpoint (engines, tunnels, stop commands), then lets the
    /// housekeeping store the last events and states.
    pub async fn stop(self) {
        self.stop.cancel();
        self.shared.tracker.close();
        self.shared.tracker.wait().await;
        self.housekeeping_done.cancel();
        self.housekeeping.close();
        self.housekeeping.wait().await;
    }
}

fn activate(shared: &Arc<Shared>, endpoint: &Arc<Endpoint>, fleet_stop: &CancellationToken) {
    let mut keepers = shared
        .keepers
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if keepers.contains_key(&endpoint.name) {
        return;
    }
    let stop = fleet_stop.child_token();
    keepers.insert(endpoint.name.clone(), stop.clone());
    drop(keepers);
    endpoint.set_phase(Phase::Starting);
    let span = tracing::info_span!("endpoint", name = %endpoint.name);
    shared.tracker.spawn(tracing::Instrument::instrument(
        keep(shared.clone(), endpoint.clone(), stop),
        span,
    ));
}

fn deactivate(shared: &Shared, endpoint: &Endpoint) -> bool {
    let keeper = shared
        .keepers
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(&endpoint.name);
    match keeper {
        Some(stop) => {
            stop.cancel();
            true
        }
        None => false,
    }
}

/// What the pipeline holds of the fleet: to report what calls did to
/// endpoints, and to learn when no endpoint is left.
#[derive(Clone)]
pub struct FleetHandle(Arc<Shared>);

impl FleetHandle {
    /// A call changed the endpoint's health.
    pub fn call_transition(&self, endpoint: &Endpoint, transition: Option<Transition>, why: &str) {
        report_transition(&self.0, endpoint, transition, Some(why.to_owned()));
    }

    /// A call paused the endpoint or taught it a rate.
    pub fn rate_event(&self, endpoint: &Endpoint, event: RateEvent) {
        match event {
            RateEvent::Paused(wait) => {
                endpoint.quota_pauses.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::debug!(endpoint = %endpoint.name, "Paused for {wait:?} by the endpoint's quota.");
            }
            RateEvent::Learned(rate) => self.0.event(
                endpoint,
                EventKind::Quota,
                format!(
                    "Endpoint {} answers 429: sending at most {rate:.2} requests/s (learned from its answers).",
                    endpoint.name
                ),
            ),
            RateEvent::Windowed(what) => self.0.event(
                endpoint,
                EventKind::Quota,
                format!(
                    "Endpoint {}'s {what} quota comes back all at once when its window ends: once spent, calls wait for the next window.",
                    endpoint.name
                ),
            ),
        }
    }

    pub fn exhausted(&self) -> CancellationToken {
        self.0.exhausted.clone()
    }

    /// Gives the run up for `reason`, as when no endpoint is left: it
    /// stops taking items (calls in flight may finish) and ends
    /// interrupted, its reason stored, resumable.
    pub fn give_up(&self, reason: String) {
        self.0.exhaust(reason);
    }

    pub fn exhausted_reason(&self) -> Option<String> {
        self.0
            .reason
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Fleet {
    pub fn handle(&self) -> FleetHandle {
        FleetHandle(self.shared.clone())
    }
}
