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
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::engine::{
    Claim, Job, Launcher, RemoteCommands, Supervised, free_port, remote_claim, run_shell,
    shell_join,
};
use super::gpu::{self, GpuReport};
use super::{Endpoint, Phase, RateEvent, Reach, Transition};
use crate::client::{ChatClient, http_client};
use evalfleet_config::{Config, EndpointConfig, EndpointKind, Engine, MockSettings};
use evalfleet_types::{Event, EventKind, FleetAction, FleetChange, RunSample, now_ms};

use evalfleet_store::Store;

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
}

impl Fleet {
    pub fn new(config: &Config, options: FleetOptions) -> Self {
        let endpoints: Vec<_> = config
            .endpoints
            .iter()
            .map(|e| Arc::new(Endpoint::new(e, config.timeouts.attempt)))
            .collect();
        let (events, receiver) = mpsc::unbounded_channel();
        let watchdog = super::watchdog::Watchdog::new(&config.telemetry, &endpoints);
        Self {
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

/// A URL's scheme, host and port.
/// Where an endpoint is probed.
pub fn health_url(config: &EndpointConfig, base_url: &str) -> String {
    let path = config
        .health
        .path
        .clone()
        .or_else(|| config.kind.engine().map(|e| e.health_path().to_owned()));
    match path {
        Some(path) => format!("{}{path}", super::load::origin(base_url)),
        None => format!("{}/models", base_url.trim_end_matches('/')),
    }
}

/// One health probe: `GET` answered with 2xx within the timeout. Any
/// answer tells that the endpoint can be reached ([`Endpoint::tried`]).
async fn probe(
    endpoint: &Endpoint,
    http: &reqwest::Client,
    url: &str,
    timeout: Duration,
) -> Result<(), String> {
    match tokio::time::timeout(timeout, http.get(url).send()).await {
        Err(_) => Err(format!(
            "no answer within {}",
            humantime::format_duration(timeout)
        )),
        Ok(Err(err)) => {
            let why = evalfleet_types::root_cause(&err);
            if err.is_connect() {
                let shown = err.url().map_or_else(String::new, crate::client::shown_url);
                endpoint.tried(Err(format!("GET {shown}: {why}")));
            }
            Err(why)
        }
        Ok(Ok(response)) => {
            endpoint.tried(Ok(()));
            if response.status().is_success() {
                Ok(())
            } else {
                Err(format!("HTTP {}", response.status().as_u16()))
            }
        }
    }
}

/// Makes the endpoint's client for `base_url` and marks it ready.
fn serve(
    shared: &Shared,
    endpoint: &Endpoint,
    base_url: &str,
    pid: Option<u32>,
) -> Result<(), String> {
    let client = ChatClient::new(
        &endpoint.config,
        base_url,
        &shared.task_params,
        shared.stream,
    )?
    .with_stalls(shared.stalls);
    endpoint.set_client(client, base_url.to_owned(), pid);
    endpoint.set_phase(Phase::Ready);
    // Its engine's load is read off the call path while it serves.
    if let Some(poller) = endpoint.load_poller(base_url) {
        shared
            .tracker
            .spawn(tracing::Instrument::in_current_span(poller.run()));
    }
    Ok(())
}

/// What ended a stretch of serving.
enum Ended {
    Stopped,
    /// The process ended (managed engines).
    Died(String),
    /// Unhealthy for longer than allowed (managed engines).
    StayedUnhealthy,
}

/// Watches the endpoint while it serves, until stopped, the process dies,
/// or (when `restart_after` is set) it stays unhealthy. Its calls are the
/// health signal while they go well: it is probed only once it has shown
/// no sign of life for `interval` ([`probe_due`]), at once when its calls
/// fail one after another or it stops taking items, and five times as
/// often while unhealthy.
async fn watch(
    shared: &Shared,
    endpoint: &Endpoint,
    base_url: &str,
    stop: &CancellationToken,
    mut process: Option<&mut Supervised>,
    restart_after: Option<Duration>,
) -> Ended {
    let health = &endpoint.config.health;
    let url = health_url(&endpoint.config, base_url);
    let Ok(http) = http_client(1) else {
        return Ended::Died("cannot build an HTTP client for probes".to_owned());
    };
    // While unhealthy it is probed five times as often, so that it comes
    // back soon after it recovers; a change of state probes at once.
    let recovering = (health.interval / 5).max(Duration::from_millis(100));
    let mut changes = endpoint.changes();
    // When the next probe is due, the last one made at `probed`.
    let due = |probed| {
        probe_due(
            endpoint.breaker_state(),
            probed,
            endpoint.last_sign_of_life(),
            health.interval,
            recovering,
        )
    };
    let mut probed = Instant::now();
    loop {
        let exited = async {
            match process.as_mut() {
                Some(process) => process.wait().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = stop.cancelled() => return Ended::Stopped,
            status = exited => {
                let how = match status {
                    Ok(status) => format!("exited ({status})"),
                    Err(err) => format!("could not be watched ({err})"),
                };
                return Ended::Died(how);
            }
            () = tokio::time::sleep_until(due(probed)) => {
                // Its calls may have shown it works meanwhile.
                if due(probed) > Instant::now() {
                    continue;
                }
            }
            _ = changes.changed() => {}
            () = endpoint.probe_now.notified() => {}
        }
        let result = probe(endpoint, &http, &url, health.timeout).await;
        probed = Instant::now();
        match endpoint.on_probe(result.is_ok()) {
            Some(Transition::Faulty) => judge_faulty(shared, endpoint),
            transition => report_transition(shared, endpoint, transition, result.err()),
        }
        if let (Some(after), Some(for_how_long)) =
            (restart_after, endpoint.unhealthy_for(Instant::now()))
            && for_how_long >= after
        {
            return Ended::StayedUnhealthy;
        }
    }
}

/// When an endpoint whose breaker is in `state`, last probed at `probed`,
/// is due for its next probe. While it takes items, `interval` after it
/// last showed a sign of life, its last probe's or its calls' (`life`): an
/// endpoint whose calls go well is never probed, one that is idle, or whose
/// calls fail or hang, once an interval; no probe competes with calls that
/// go well (on a server that serves one request at a time, a probe that
/// waits cuts the running stream). While unhealthy, `recovering` after its
/// last probe.
fn probe_due(
    state: super::BreakerState,
    probed: Instant,
    life: Option<Instant>,
    interval: Duration,
    recovering: Duration,
) -> Instant {
    if state == super::BreakerState::Closed {
        life.map_or(probed, |life| life.max(probed)) + interval
    } else {
        probed + recovering
    }
}

/// Ejection caps: at most this share of the endpoints that take items is
/// ejected for faults (endpoints that are down do not count against it).
const MAX_EJECTION: f64 = 0.5;

/// Whether the others can carry `endpoint`'s load: another endpoint takes
/// items, and at most [`MAX_EJECTION`] of them would be out with it. When
/// they cannot, a faulty endpoint keeps its calls (panic mode: better a
/// faulty endpoint than none).
fn may_eject(shared: &Shared, endpoint: &Endpoint) -> bool {
    if !endpoint.config.takes_items() {
        // A judge endpoint's calls can go nowhere else.
        return false;
    }
    let takers: Vec<_> = shared
        .peers
        .iter()
        .filter(|p| p.config.takes_items() && p.phase() == Phase::Ready)
        .collect();
    let out = takers.iter().filter(|p| !p.accepting()).count();
    let others = takers
        .iter()
        .filter(|p| p.name != endpoint.name && p.accepting())
        .count();
    others > 0 && (out + 1) as f64 <= MAX_EJECTION * takers.len() as f64
}

/// Takes a faulty endpoint out for a while ([`Endpoint::eject`]), saying
/// why.
fn eject(shared: &Shared, endpoint: &Endpoint, why: &str) {
    let (transition, length) = endpoint.eject(endpoint.config.health.ejection);
    if transition == Some(Transition::Opened) {
        shared.event(
            endpoint,
            EventKind::Ejected,
            format!(
                "Endpoint {} is ejected for {}: {why}; the others take its items, and its calls in flight go on.",
                endpoint.name,
                humantime::format_duration(length)
            ),
        );
    }
}

/// An endpoint whose calls fail one after another while its probe
/// answers: ejected when the others can carry the load; otherwise it keeps
/// its calls.
fn judge_faulty(shared: &Shared, endpoint: &Endpoint) {
    let why = format!(
        "{} calls in a row failed while it answers probes",
        super::breaker::FAULTS_IN_A_ROW
    );
    if may_eject(shared, endpoint) {
        eject(shared, endpoint, &why);
    } else if endpoint.config.takes_items() {
        shared.event(
            endpoint,
            EventKind::Unhealthy,
            format!(
                "Endpoint {}: {why}; it keeps its calls, as the others cannot carry its load.",
                endpoint.name
            ),
        );
    }
}

/// Ejects the endpoints whose calls fail clearly more often than their
/// peers' ([`super::outlier`]), worst first, while the others can carry
/// the load.
fn eject_outliers(shared: &Shared, endpoints: &[Arc<Endpoint>]) {
    let peers: Vec<&Arc<Endpoint>> = endpoints
        .iter()
        .filter(|e| e.config.takes_items() && e.accepting())
        .collect();
    if peers.len() < 2 {
        return;
    }
    let tallies: Vec<_> = peers.iter().map(|e| e.outcomes()).collect();
    for found in super::outlier::outliers(&tallies) {
        let endpoint = peers[found.index];
        let why = format!(
            "{:.0}% of its last {} calls failed, against {:.0}% of {} on the others",
            100.0 * found.own.share(),
            found.own.calls,
            100.0 * found.others.share(),
            found.others.calls
        );
        if may_eject(shared, endpoint) {
            eject(shared, endpoint, &why);
        } else {
            tracing::debug!(
                "Endpoint {} is an outlier ({why}) but the others cannot carry its load.",
                endpoint.name
            );
        }
    }
}

fn report_transition(
    shared: &Shared,
    endpoint: &Endpoint,
    transition: Option<Transition>,
    why: Option<String>,
) {
    match transition {
        Some(Transition::Opened) => shared.event(
            endpoint,
            EventKind::Unhealthy,
            format!(
                "Endpoint {} is unhealthy ({}); it takes no new calls until it recovers.",
                endpoint.name,
                why.unwrap_or_else(|| "calls failed".to_owned())
            ),
        ),
        Some(Transition::HalfOpened) => shared.event(
            endpoint,
            EventKind::Recovering,
            format!(
                "Endpoint {} answers probes again; waiting for it to stay up.",
                endpoint.name
            ),
        ),
        Some(Transition::Closed) => shared.event(
            endpoint,
            EventKind::Recovered,
            format!(
                "Endpoint {} is healthy again and takes items.",
                endpoint.name
            ),
        ),
        Some(Transition::Suspected) => endpoint.probe_now.notify_one(),
        Some(Transition::Faulty) | None => {}
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

async fn keep(shared: Arc<Shared>, endpoint: Arc<Endpoint>, stop: CancellationToken) {
    let config = endpoint.config.clone();
    match &config.kind {
        EndpointKind::Mock(settings) => {
            let started = shared.options.mocks.start((**settings).clone()).await;
            match started {
                Ok((url, guard)) => {
                    if let Err(err) = serve(&shared, &endpoint, &url, None) {
                        exclude(&shared, &endpoint, format!("cannot reach its mock: {err}"));
                        return;
                    }
                    watch(&shared, &endpoint, &url, &stop, None, None).await;
                    drop(guard);
                }
                Err(err) => {
                    exclude(&shared, &endpoint, format!("its mock did not start: {err}"));
                    return;
                }
            }
        }
        EndpointKind::External {
            base_url,
            start_cmd,
            stop_cmd,
        } => {
            if let Some(command) = start_cmd {
                match run_shell(command, Duration::from_secs(600)).await {
                    Ok(()) => shared.event(
                        &endpoint,
                        EventKind::Started,
                        format!("Ran start_cmd of {}.", endpoint.name),
                    ),
                    Err(err) => {
                        exclude(&shared, &endpoint, format!("its start_cmd failed: {err}"));
                        return;
                    }
                }
            }
            if let Err(err) = serve(&shared, &endpoint, base_url, None) {
                exclude(&shared, &endpoint, err);
                return;
            }
            watch(&shared, &endpoint, base_url, &stop, None, None).await;
            if let Some(command) = stop_cmd {
                match run_shell(command, Duration::from_secs(120)).await {
                    Ok(()) => shared.event(
                        &endpoint,
                        EventKind::Stopped,
                        format!("Ran stop_cmd of {}.", endpoint.name),
                    ),
                    Err(err) => shared.event(
                        &endpoint,
                        EventKind::StopFailed,
                        format!("stop_cmd of {} failed: {err}", endpoint.name),
                    ),
                }
            }
        }
        EndpointKind::Local(_) | EndpointKind::Remote(_) => {
            keep_engine(&shared, &endpoint, &stop).await;
        }
    }
    if endpoint.phase() != Phase::Excluded {
        endpoint.set_phase(Phase::Idle);
    }
}

fn exclude(shared: &Shared, endpoint: &Endpoint, why: String) {
    endpoint.set_phase(Phase::Excluded);
    shared
        .excluded
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(endpoint.name.clone(), why.clone());
    shared.event(
        endpoint,
        EventKind::Excluded,
        format!("Endpoint {} is left out of the run: {why}.", endpoint.name),
    );
}

/// An engine that is up: its process (for remote ones, the tunnel) and URL.
pub(super) struct Running {
    pub(super) process: Supervised,
    pub(super) base_url: String,
}

pub(super) async fn launch(
    launcher: &Launcher,
    endpoint: &Endpoint,
    local_port: u16,
) -> Result<Running, String> {
    let base_url = format!("http://127.0.0.1:{local_port}/v1");
    match &endpoint.config.kind {
        EndpointKind::Local(engine) => {
            let command = engine.render(&endpoint.model, local_port);
            let mut env: Vec<(String, String)> = engine
                .env
                .iter()
                .map(|(k, v)| (k.clone(), v.expose().to_owned()))
                .collect();
            if let Some(gpu) = &engine.gpu {
                env.push(("CUDA_VISIBLE_DEVICES".to_owned(), gpu.clone()));
            }
            let process = launcher
                .spawn(&Job {
                    name: &endpoint.name,
                    command: &command,
                    label: None,
                    env: &env,
                    on_exit: None,
                    stop_grace: engine.stop_grace,
                    claim: Claim::Own {
                        endpoint: endpoint.name.clone(),
                    },
                })
                .await
                .map_err(|err| format!("cannot start `{command}`: {err}"))?;
            Ok(Running { process, base_url })
        }
        EndpointKind::Remote(remote) => {
            let remote_port = remote.engine.port.unwrap_or(8000);
            let owner = launcher.owner();
            let commands =
                RemoteCommands::new(remote, &endpoint.model, remote_port, local_port, &owner);
            // The start runs under the supervisor too: a run killed while
            // the session is being made still has it ended.
            let label = format!(
                "{}: tmux session {} (engine on port {remote_port}), tunnel from port {local_port}, following its output",
                remote.host, remote.session
            );
            let grace = remote.engine.stop_grace;
            let process = launcher
                .spawn(&Job {
                    name: &endpoint.name,
                    command: &commands.supervised(),
                    label: Some(&label),
                    env: &[],
                    on_exit: Some(&shell_join(&commands.stop)),
                    stop_grace: grace,
                    claim: Claim::Shared {
                        key: remote_claim(remote),
                        // A run that is stopping it lets go within its
                        // grace, twice (tunnel, then engine), and an SSH
                        // login.
                        wait: grace * 2 + Duration::from_secs(30),
                    },
                })
                .await
                .map_err(|err| format!("cannot start `{}`: {err}", remote.ssh))?;
            Ok(Running { process, base_url })
        }
        _ => Err("not an engine".to_owned()),
    }
}

/// Waits until the engine answers its health path, it exits, the start-up
/// timeout passes, or the run stops. A failure says what the engine said
/// last.
pub(super) async fn ready(
    endpoint: &Endpoint,
    running: &mut Running,
    timeout: Duration,
    every: Duration,
    stop: &CancellationToken,
) -> Result<(), String> {
    let url = health_url(&endpoint.config, &running.base_url);
    let http = http_client(1).map_err(|err| err.to_string())?;
    let deadline = Instant::now() + timeout;
    let mut last = "not started".to_owned();
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            () = stop.cancelled() => return Err("the run is stopping".to_owned()),
            status = running.process.wait() => {
                return Err(running.process.with_last_lines(format!(
                    "it exited before it was ready ({}; log {})",
                    status.map_or_else(|e| e.to_string(), |s| s.to_string()),
                    running.process.log.display()
                )));
            }
            () = tokio::time::sleep_until(deadline) => {
                return Err(running.process.with_last_lines(format!(
                    "not ready within {} (last probe: {last}; log {})",
                    humantime::format_duration(timeout),
                    running.process.log.display()
                )));
            }
            _ = tick.tick() => {}
        }
        match probe(endpoint, &http, &url, Duration::from_secs(5)).await {
            Ok(()) => return Ok(()),
            Err(err) => last = err,
        }
    }
}

async fn keep_engine(shared: &Shared, endpoint: &Endpoint, stop: &CancellationToken) {
    let Some(engine) = endpoint.config.kind.engine().cloned() else {
        return;
    };
    let requested_port = match &endpoint.config.kind {
        EndpointKind::Remote(remote) => remote.local_port,
        _ => engine.port,
    };
    let local_port = match requested_port.map_or_else(free_port, Ok) {
        Ok(port) => port,
        Err(err) => {
            exclude(shared, endpoint, format!("no free port: {err}"));
            return;
        }
    };
    if let (EndpointKind::Local(_), Some(devices)) = (&endpoint.config.kind, &engine.gpu)
        && let Some(why) = gpu_refusal(shared, &engine, devices).await
    {
        exclude(shared, endpoint, why);
        return;
    }
    // What went wrong last, for the reason it is left out.
    let mut last_failure = String::new();
    loop {
        let phase = if endpoint.restarts() == 0 {
            Phase::Starting
        } else {
            Phase::Restarting
        };
        endpoint.set_phase(phase);
        let started = Instant::now();
        let ended = match launch(&shared.options.launcher, endpoint, local_port).await {
            Err(err) => Err(err),
            Ok(mut running) => {
                shared.event(
                    endpoint,
                    EventKind::Started,
                    format!(
                        "Started {} (pid {}, log {}).",
                        endpoint.name,
                        running
                            .process
                            .pid
                            .map_or_else(|| "?".to_owned(), |p| p.to_string()),
                        running.process.log.display()
                    ),
                );
                match ready(
                    endpoint,
                    &mut running,
                    engine.startup_timeout,
                    Duration::from_millis(250),
                    stop,
                )
                .await
                {
                    Err(err) => {
                        running.process.stop(engine.stop_grace).await;
                        Err(err)
                    }
                    Ok(()) => match serve(shared, endpoint, &running.base_url, running.process.pid)
                    {
                        Err(err) => {
                            running.process.stop(engine.stop_grace).await;
                            Err(err)
                        }
                        Ok(()) => {
                            shared.event(
                                endpoint,
                                EventKind::Ready,
                                format!(
                                    "Endpoint {} is ready at {} ({:.1}s).",
                                    endpoint.name,
                                    running.base_url,
                                    started.elapsed().as_secs_f64()
                                ),
                            );
                            let url = running.base_url.clone();
                            let ended = watch(
                                shared,
                                endpoint,
                                &url,
                                stop,
                                Some(&mut running.process),
                                Some(engine.restart_delay),
                            )
                            .await;
                            if let Ended::Died(how) = &ended {
                                endpoint.trip();
                                last_failure =
                                    running.process.with_last_lines(format!("its engine {how}"));
                                shared.event(
                                    endpoint,
                                    EventKind::Died,
                                    format!("Engine of {} {how}.", endpoint.name),
                                );
                            } else if let Ended::StayedUnhealthy = ended {
                                last_failure = format!(
                                    "it stayed unhealthy for {}",
                                    humantime::format_duration(engine.restart_delay)
                                );
                                shared.event(
                                    endpoint,
                                    EventKind::Unhealthy,
                                    format!(
                                        "Endpoint {} stayed unhealthy for {}; restarting it.",
                                        endpoint.name,
                                        humantime::format_duration(engine.restart_delay)
                                    ),
                                );
                            }
                            endpoint.set_phase(Phase::Restarting);
                            running.process.stop(engine.stop_grace).await;
                            Ok(ended)
                        }
                    },
                }
            }
        };
        match ended {
            Ok(Ended::Stopped) => {
                shared.event(
                    endpoint,
                    EventKind::Stopped,
                    format!("Stopped {}.", endpoint.name),
                );
                return;
            }
            Err(_) if stop.is_cancelled() => return,
            Err(err) => {
                shared.event(
                    endpoint,
                    EventKind::StartFailed,
                    format!("{} did not start: {err}", endpoint.name),
                );
                last_failure = err;
            }
            Ok(_) => {}
        }
        let restarts = endpoint.count_restart();
        if restarts > engine.restarts {
            exclude(
                shared,
                endpoint,
                format!(
                    "it failed again after {} restarts: {last_failure}",
                    engine.restarts
                ),
            );
            return;
        }
        shared.event(
            endpoint,
            EventKind::Restarting,
            format!(
                "Restarting {} in {} (restart {restarts} of {}).",
                endpoint.name,
                humantime::format_duration(engine.restart_delay),
                engine.restarts
            ),
        );
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(engine.restart_delay) => {}
        }
    }
}

async fn gpu_refusal(shared: &Shared, engine: &Engine, devices: &str) -> Option<String> {
    let report = shared.gpus.get_or_init(gpu::report).await;
    let busy = gpu::busy(report, devices, engine.gpu_memory_threshold_mb);
    if busy.is_empty() {
        return None;
    }
    match shared.options.gpu_policy {
        GpuPolicy::Allow => {
            tracing::warn!("Starting on a busy GPU as asked: {}.", busy.join("; "));
            None
        }
        GpuPolicy::Refuse => Some(format!("{} (run with -y to start anyway)", busy.join("; "))),
    }
}

/// Every second: fleet changes, snapshots, events, and whether any endpoint
/// is left.
#[allow(clippy::too_many_arguments)]
async fn housekeep(
    shared: Arc<Shared>,
    endpoints: Vec<Arc<Endpoint>>,
    run_id: String,
    worker: String,
    store: Box<dyn Store>,
    mut events: mpsc::UnboundedReceiver<FleetEvent>,
    mut telemetry: Option<mpsc::Receiver<super::watchdog::Tick>>,
    stop: CancellationToken,
    fleet_stop: CancellationToken,
    tracker: TaskTracker,
) {
    let mut store = Some(store);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut limits: HashMap<String, usize> = HashMap::new();
    let mut ticks: u64 = 0;
    let mut unavailable_since: Option<Instant> = None;
    // The last fleet change seen (`None` before the first look).
    let mut mailbox: Option<i64> = None;
    loop {
        let stopping = tokio::select! {
            _ = tick.tick() => false,
            () = stop.cancelled() => true,
        };
        ticks += 1;
        let mut pending: Vec<FleetEvent> = Vec::new();
        while let Ok(event) = events.try_recv() {
            pending.push(event);
        }
        let mut resources = Vec::new();
        let mut resource_events = Vec::new();
        while let Some(round) = telemetry.as_mut().and_then(|t| t.try_recv().ok()) {
            resources.extend(round.points);
            resource_events.extend(round.events);
        }
        // Limit changes, summarised every 5 seconds.
        if ticks.is_multiple_of(5) || stopping {
            for endpoint in &endpoints {
                let now = endpoint.limit.current();
                let before = limits.insert(endpoint.name.clone(), now);
                if endpoint.limit.is_adaptive() && before.is_some_and(|b| b != now) {
                    let verb = if before < Some(now) { "raised" } else { "cut" };
                    let message = format!(
                        "Concurrency limit of {} {verb} from {} to {now}.",
                        endpoint.name,
                        before.unwrap_or(now)
                    );
                    tracing::info!("{message}");
                    pending.push(FleetEvent {
                        at_ms: now_ms(),
                        endpoint: endpoint.name.clone(),
                        kind: EventKind::Limit,
                        message,
                    });
                }
            }
        }
        let snapshots: Vec<_> = endpoints.iter().map(|e| e.snapshot()).collect();
        // Endpoints out of the run are left out, unless calls ended on them
        // since the last sample (the last sample of a run comes after its
        // endpoints were stopped).
        let samples: Vec<_> = endpoints
            .iter()
            .map(|e| e.sample())
            .filter(|s| s.calls > 0 || s.state != evalfleet_types::EndpointState::Idle)
            .collect();
        let Some(mut owned) = store.take() else {
            return;
        };
        let id = run_id.clone();
        let me = worker.clone();
        let after = mailbox;
        let result = tracker
            .spawn_blocking(move || {
                let events: Vec<Event> = pending
                    .iter()
                    .map(|event| Event {
                        at_ms: event.at_ms,
                        kind: event.kind,
                        endpoint: Some(event.endpoint.clone()),
                        message: event.message.clone(),
                    })
                    .chain(resource_events)
                    .collect();
                // Telemetry lost is no reason to stop the rest.
                if let Err(err) = owned.add_resource_points(&id, &resources) {
                    tracing::warn!("Cannot store resource telemetry: {err}.");
                }
                let outcome = owned
                    .add_events(&id, &events)
                    .and_then(|()| owned.put_endpoint_states(&id, &snapshots))
                    .and_then(|()| owned.counts(&id))
                    .and_then(|counts| {
                        owned.add_sample(
                            &id,
                            &RunSample {
                                at_ms: now_ms(),
                                worker: me,
                                counts,
                                endpoints: samples,
                            },
                        )
                    })
                    .and_then(|()| owned.fleet_changes(&id, after.unwrap_or(0)))
                    .map(|changes| {
                        let seen = changes.last().map_or(after.unwrap_or(0), |c| c.id);
                        // The first look only learns where the mailbox is:
                        // changes posted before this session are not for it.
                        (seen, if after.is_some() { changes } else { Vec::new() })
                    });
                (owned, outcome)
            })
            .await;
        let changes = match result {
            Ok((owned, outcome)) => {
                store = Some(owned);
                match outcome {
                    Ok((seen, changes)) => {
                        mailbox = Some(seen);
                        changes
                    }
                    Err(err) => {
                        tracing::warn!("Cannot store the fleet's state: {err}.");
                        Vec::new()
                    }
                }
            }
            Err(err) => {
                tracing::warn!("The fleet's housekeeping failed: {err}.");
                return;
            }
        };
        if stopping {
            return;
        }
        for change in changes {
            apply(&shared, &endpoints, &change, &fleet_stop);
        }
        eject_outliers(&shared, &endpoints);
        check_exhausted(&shared, &endpoints, &mut unavailable_since);
    }
}

fn apply(
    shared: &Arc<Shared>,
    endpoints: &[Arc<Endpoint>],
    change: &FleetChange,
    stop: &CancellationToken,
) {
    let Some(endpoint) = endpoints.iter().find(|e| e.name == change.endpoint) else {
        tracing::warn!(
            "Fleet change for unknown endpoint '{}' ignored.",
            change.endpoint
        );
        return;
    };
    match change.action {
        FleetAction::Add => {
            if endpoint.phase() == Phase::Excluded {
                endpoint.set_phase(Phase::Idle);
            }
            activate(shared, endpoint, stop);
            shared.event(
                endpoint,
                EventKind::Added,
                format!("Endpoint {} joined the run.", endpoint.name),
            );
        }
        FleetAction::Remove => {
            if deactivate(shared, endpoint) {
                endpoint.set_phase(Phase::Idle);
                shared.event(
                    endpoint,
                    EventKind::Removed,
                    format!(
                        "Endpoint {} left the run; its calls in flight move to others.",
                        endpoint.name
                    ),
                );
            }
        }
    }
}

/// Why the run should stop when no endpoint that takes items has answered
/// anything in the `wait` (`timeouts.first_answer`) since they were made,
/// every one could not be reached when tried and none has a call in
/// flight: each one's address and last error. An address that is wrong,
/// or a server that is not up, is told within seconds rather than after
/// `timeouts.no_endpoint` (which is for endpoints that answered before).
fn never_reached(endpoints: &[&Arc<Endpoint>], wait: Duration) -> Option<String> {
    let mut why = Vec::new();
    for endpoint in endpoints {
        let in_flight = endpoint
            .counters
            .in_flight
            .load(std::sync::atomic::Ordering::Relaxed);
        if endpoint.age() < wait || in_flight > 0 {
            return None;
        }
        match endpoint.reached() {
            Reach::Never(error) => why.push(format!(
                "{} ({}): {error}",
                endpoint.name,
                endpoint
                    .base_url()
                    .and_then(|u| reqwest::Url::parse(&u).ok())
                    .map_or_else(String::new, |u| crate::client::shown_url(&u))
            )),
            Reach::Answered | Reach::Untried => return None,
        }
    }
    (!why.is_empty()).then(|| {
        format!(
            "No endpoint answered in the {} since the run started: {}. Check that the server is up and its base_url, then resume the run.",
            humantime::format_duration(wait),
            why.join("; ")
        )
    })
}

fn check_exhausted(shared: &Shared, endpoints: &[Arc<Endpoint>], since: &mut Option<Instant>) {
    // Judge endpoints take no items: only the others keep a run going.
    let endpoints: Vec<&Arc<Endpoint>> = endpoints
        .iter()
        .filter(|e| e.config.takes_items())
        .collect();
    let phases: Vec<Phase> = endpoints.iter().map(|e| e.phase()).collect();
    let coming = phases
        .iter()
        .any(|p| matches!(p, Phase::Starting | Phase::Restarting | Phase::Ready));
    if !coming && phases.contains(&Phase::Excluded) && !phases.contains(&Phase::Idle) {
        let why = shared
            .excluded
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let left: Vec<String> = endpoints
            .iter()
            .map(|e| match why.get(&e.name) {
                Some(why) => format!("{} is left out of the run: {why}", e.name),
                None => format!("{} is left out of the run", e.name),
            })
            .collect();
        shared.exhaust(format!("No endpoint is left: {}.", left.join("; ")));
        return;
    }
    let serving = endpoints.iter().any(|e| e.accepting());
    let starting = phases
        .iter()
        .any(|p| matches!(p, Phase::Starting | Phase::Restarting));
    // Nothing answered yet: told after timeouts.first_answer, naming each
    // address and its error.
    let first_wait = shared.options.first_answer_timeout;
    if !starting && let Some(reason) = never_reached(&endpoints, first_wait) {
        shared.exhaust(reason);
        return;
    }
    if serving || starting {
        *since = None;
        return;
    }
    let since = *since.get_or_insert_with(Instant::now);
    let timeout = shared.options.no_endpoint_timeout;
    if since.elapsed() >= timeout {
        shared.exhaust(format!(
            "No endpoint could take items for {}.",
            humantime::format_duration(timeout)
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BreakerState;

    /// The endpoints of a config whose `endpoints:` are `endpoints`.
    fn endpoints(endpoints: Value) -> Vec<EndpointConfig> {
        // The config names a dataset that exists; nothing reads it.
        let dataset = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
        let config = serde_json::json!({
            "name": "t",
            "dataset": {"path": dataset, "format": "jsonl"},
            "endpoints": endpoints,
            "task": {"messages": [{"role": "user", "content": "{{ q }}"}]},
        });
        evalfleet_config::load_snapshot(&config, std::path::Path::new("."))
            .unwrap()
            .config
            .endpoints
    }

    #[test]
    fn each_engine_is_probed_on_a_path_that_costs_it_nothing() {
        let local = |name: &str, preset: &str| serde_json::json!({"name": name, "kind": "local", "preset": preset, "model": "m"});
        let configs = endpoints(serde_json::json!([
            local("l", "llama.cpp"),
            local("v", "vllm"),
            local("s", "sglang"),
            local("o", "ollama"),
            {"name": "c", "kind": "local", "command": "serve --port {port}", "model": "m"},
            {"name": "e", "kind": "external", "base_url": "http://h:1/api/v1/", "model": "m"},
            {"name": "p", "kind": "external", "base_url": "http://h:1/v1", "model": "m",
             "health": {"path": "/ping"}},
        ]));
        let urls: Vec<String> = configs
            .iter()
            .map(|c| health_url(c, "http://127.0.0.1:9/v1"))
            .collect();
        assert_eq!(
            urls,
            [
                "http://127.0.0.1:9/health",
                "http://127.0.0.1:9/health",
                "http://127.0.0.1:9/health",
                "http://127.0.0.1:9/api/version",
                "http://127.0.0.1:9/v1/models",
                "http://127.0.0.1:9/v1/models",
                "http://127.0.0.1:9/ping",
            ]
        );
    }

    #[test]
    fn a_probe_is_due_only_an_interval_after_the_last_sign_of_life() {
        let interval = Duration::from_secs(5);
        let recovering = Duration::from_secs(1);
        let probed = Instant::now();
        let due = |state, life| probe_due(state, probed, life, interval, recovering);
        // Idle since its last probe: an interval after it.
        assert_eq!(due(BreakerState::Closed, None), probed + interval);
        // A call answered or streamed since: an interval after that, so
        // an endpoint whose calls go on showing life is never probed.
        let life = probed + Duration::from_secs(3);
        assert_eq!(due(BreakerState::Closed, Some(life)), life + interval);
        // Life before the last probe counts from the probe.
        let earlier = probed.checked_sub(Duration::from_secs(3));
        assert_eq!(due(BreakerState::Closed, earlier), probed + interval);
        // Unhealthy: five times as often, whatever its calls in flight say.
        for state in [BreakerState::Open, BreakerState::HalfOpen] {
            assert_eq!(due(state, Some(life)), probed + recovering);
        }
    }
}
