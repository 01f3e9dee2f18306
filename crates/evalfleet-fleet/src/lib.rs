//! The endpoints of a run as the scheduler sees them, and the fleet that
//! looks after them.
//!
//! Control logic lives in types with no HTTP in them: the concurrency
//! controller ([`aimd`], driving [`limit`]), the circuit breaker
//! ([`breaker`]) and rate limits ([`rate`]). [`Endpoint`] puts them together
//! with a client; [`runtime`] starts, watches, restarts and stops endpoints.

pub mod aimd;
pub mod breaker;
pub mod call;
pub mod client;
pub mod engine;
pub mod gpu;
pub mod limit;
pub mod load;
pub mod open_files;
pub mod outlier;
pub mod procs;
pub mod prometheus;
pub mod rate;
pub mod runtime;
pub mod shared_rate;
pub mod turn;
pub mod watchdog;
pub mod window;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use aimd::{AimdSettings, Decision, Reason, Sample, Signal};
pub use breaker::{Breaker, BreakerState, Health, Transition};
pub use limit::{ConcurrencyLimit, LimitMode, Permit};
pub use load::{EngineLoad, LoadPoller, LoadReading, LoadState};
pub use rate::{Quota, RateEvent, RateLimiter};

use evalfleet_types::{EndpointSnapshot, EndpointState, ErrorClass, FadingMax};
use outlier::{Ejections, Outcomes, Tally};

use crate::client::ChatClient;
use evalfleet_config::EndpointConfig;

/// Counters of one endpoint in this session.
#[derive(Debug, Default)]
pub struct EndpointCounters {
    pub in_flight: AtomicU64,
    pub attempts: AtomicU64,
    pub successes: AtomicU64,
    /// By class, in the order of [`ErrorClass::FAILURES`].
    errors: [AtomicU64; ErrorClass::FAILURES.len()],
    /// Calls started in each of the last 60 seconds (a ring by second).
    minute: Mutex<Minute>,
}

#[derive(Debug)]
struct Minute {
    counts: [u32; 60],
    second: u64,
}

impl Default for Minute {
    fn default() -> Self {
        Self {
            counts: [0; 60],
            second: 0,
        }
    }
}

impl EndpointCounters {
    pub fn error(&self, class: ErrorClass) {
        self.errors[class_index(class)].fetch_add(1, Ordering::Relaxed);
    }

    pub fn errors(&self, class: ErrorClass) -> u64 {
        self.errors[class_index(class)].load(Ordering::Relaxed)
    }

    /// Counts a call started `at` seconds since some fixed origin.
    fn started(&self, second: u64) {
        let mut minute = self.minute.lock().unwrap_or_else(PoisonError::into_inner);
        Self::roll(&mut minute, second);
        minute.counts[(second % 60) as usize] += 1;
    }

    fn roll(minute: &mut Minute, second: u64) {
        if second > minute.second {
            for s in (minute.second + 1)..=second.min(minute.second + 60) {
                minute.counts[(s % 60) as usize] = 0;
            }
            minute.second = second;
        }
    }

    /// Calls started in the last 60 seconds.
    pub fn per_minute(&self, second: u64) -> u64 {
        let mut minute = self.minute.lock().unwrap_or_else(PoisonError::into_inner);
        Self::roll(&mut minute, second);
        minute.counts.iter().map(|c| u64::from(*c)).sum()
    }
}

fn class_index(class: ErrorClass) -> usize {
    // A re-asked answer is not a failed call; were it counted, it would be
    // as an unusable response.
    let class = match class {
        ErrorClass::InvalidAnswer => ErrorClass::BadResponse,
        other => other,
    };
    ErrorClass::FAILURES
        .iter()
        .position(|c| *c == class)
        .unwrap_or_default()
}

/// Where an endpoint is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Configured but not taking part (`--endpoints`, `fleet remove`).
    Idle,
    /// Being started (an engine loading, a start command running).
    Starting,
    /// Up: takes items while its breaker is closed.
    Ready,
    /// An engine being restarted.
    Restarting,
    /// Out of the run (its restarts are spent, or it could not start).
    Excluded,
}

#[derive(Debug)]
struct Status {
    phase: Phase,
    breaker: Breaker,
    base_url: Option<String>,
    pid: Option<u32>,
    restarts: u32,
    /// When the breaker last opened (for restarting engines that stay
    /// unhealthy).
    unhealthy_since: Option<Instant>,
    /// Its calls and failed calls of the last seconds, to judge it against
    /// its peers ([`outlier`]).
    outcomes: Outcomes,
    /// How long its next ejection lasts.
    ejections: Ejections,
    /// What its successful calls take: its longest recent ones.
    latency: FadingMax,
}

/// Successful calls an endpoint makes before what they take counts as
/// what it normally takes.
const LATENCY_KNOWN: u32 = 20;
/// Each successful call, the longest latency known fades by this.
const LATENCY_FADE: f64 = 0.995;
/// Faults in a row make an endpoint suspect once they have gone on for
/// as long as its calls normally take (at least [`SPAN_FLOOR`];
/// [`SPAN_UNKNOWN`] before that is known).
const SPAN_FLOOR: Duration = Duration::from_millis(10);
const SPAN_UNKNOWN: Duration = Duration::from_millis(100);

/// An endpoint taking part in a run.
pub struct Endpoint {
    pub name: String,
    pub model: String,
    pub config: EndpointConfig,
    pub limit: Arc<ConcurrencyLimit>,
    pub rate: RateLimiter,
    /// Its share of its API key's quotas, when the run's store shares them
    /// with other workers ([`shared_rate`]): taken as well as `rate`.
    pub shared: OnceLock<shared_rate::SharedLimit>,
    pub counters: Arc<EndpointCounters>,
    /// Per-attempt timeout.
    pub timeout: Duration,
    client: RwLock<Option<Arc<ChatClient>>>,
    status: Mutex<Status>,
    accepting: watch::Sender<bool>,
    evict: Mutex<CancellationToken>,
    /// Cancelled while its breaker is open (its calls in flight may then be
    /// hedged elsewhere).
    opened: Mutex<CancellationToken>,
    /// Cancelled while the endpoint is out of the run.
    excluded: Mutex<CancellationToken>,
    origin: Instant,
    /// Pauses the endpoint's quota asked for (counted for the event log).
    pub quota_pauses: AtomicU64,
    /// Wakes its prober: its calls fail one after another.
    pub probe_now: tokio::sync::Notify,
    /// Its calls since its last sample.
    window: Mutex<window::Window>,
    /// Whether it ever answered since the run started (see
    /// [`Endpoint::reached`]).
    reach: Mutex<Reach>,
    /// Set once it answered: every later call skips the lock above.
    answered: AtomicBool,
    /// What its engine says of its load ([`load`]).
    load: Arc<watch::Sender<LoadState>>,
}

/// Whether an endpoint ever answered an HTTP request (a call's or a
/// probe's, whatever its status), and, until it has, why the last try to
/// reach it failed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Reach {
    /// Nothing tried yet.
    #[default]
    Untried,
    /// Every try failed before an answer; the last one's error.
    Never(String),
    Answered,
}

impl Endpoint {
    pub fn new(config: &EndpointConfig, default_timeout: Duration) -> Self {
        let now = Instant::now();
        // What its engine's command says it runs at once, until the engine
        // says it itself.
        let capacity = config
            .load
            .engine
            .zip(config.kind.engine())
            .and_then(|(load, engine)| engine.capacity_in_command(load));
        let limit = ConcurrencyLimit::new(config.concurrency);
        if let Some(capacity) = capacity {
            limit.engine_capacity(capacity);
        }
        Self {
            name: config.name.clone(),
            model: config.model.clone(),
            limit,
            rate: RateLimiter::new(config.rpm, config.tpm, now),
            shared: OnceLock::new(),
            counters: Arc::new(EndpointCounters::default()),
            timeout: config.timeout.unwrap_or(default_timeout),
            client: RwLock::new(None),
            status: Mutex::new(Status {
                phase: Phase::Idle,
                breaker: Breaker::new(config.health.max_failures, config.health.recover_after),
                base_url: None,
                pid: None,
                restarts: 0,
                unhealthy_since: None,
                outcomes: Outcomes::default(),
                ejections: Ejections::default(),
                latency: FadingMax::new(LATENCY_FADE),
            }),
            accepting: watch::channel(false).0,
            evict: Mutex::new(CancellationToken::new()),
            opened: Mutex::new(CancellationToken::new()),
            excluded: Mutex::new(CancellationToken::new()),
            origin: now,
            quota_pauses: AtomicU64::new(0),
            probe_now: tokio::sync::Notify::new(),
            window: Mutex::new(window::Window::default()),
            reach: Mutex::new(Reach::Untried),
            answered: AtomicBool::new(false),
            load: Arc::new(watch::channel(LoadState::new(capacity, config.load.interval)).0),
            config: config.clone(),
        }
    }

    fn status(&self) -> std::sync::MutexGuard<'_, Status> {
        self.status.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The client, once the endpoint's server is known.
    pub fn client(&self) -> Option<Arc<ChatClient>> {
        self.client
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub fn set_client(&self, client: ChatClient, base_url: String, pid: Option<u32>) {
        *self.client.write().unwrap_or_else(PoisonError::into_inner) = Some(Arc::new(client));
        let mut status = self.status();
        status.base_url = Some(base_url);
        status.pid = pid;
    }

    pub fn phase(&self) -> Phase {
        self.status().phase
    }

    pub fn breaker_state(&self) -> BreakerState {
        self.status().breaker.state()
    }

    pub fn base_url(&self) -> Option<String> {
        self.status().base_url.clone()
    }

    pub fn pid(&self) -> Option<u32> {
        self.status().pid
    }

    pub fn restarts(&self) -> u32 {
        self.status().restarts
    }

    pub fn count_restart(&self) -> u32 {
        let mut status = self.status();
        status.restarts += 1;
        status.restarts
    }

    /// How long the breaker has been open, if it is.
    pub fn unhealthy_for(&self, now: Instant) -> Option<Duration> {
        self.status()
            .unhealthy_since
            .map(|since| now.saturating_duration_since(since))
    }

    /// Whether the endpoint takes items now.
    pub fn accepting(&self) -> bool {
        *self.accepting.borrow()
    }

    /// Waits until the endpoint takes items; `false` if `stop` came first.
    pub async fn wait_accepting(&self, stop: &CancellationToken) -> bool {
        let mut rx = self.accepting.subscribe();
        tokio::select! {
            result = rx.wait_for(|accepting| *accepting) => result.is_ok(),
            () = stop.cancelled() => false,
        }
    }

    /// Changes whenever the endpoint starts or stops taking items.
    pub fn changes(&self) -> watch::Receiver<bool> {
        self.accepting.subscribe()
    }

    /// Cancelled when the endpoint's calls in flight must move elsewhere.
    pub fn eviction(&self) -> CancellationToken {
        self.evict
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn evict_in_flight(&self) {
        let mut evict = self.evict.lock().unwrap_or_else(PoisonError::into_inner);
        evict.cancel();
        *evict = CancellationToken::new();
    }

    /// Recomputes whether items may be sent. It cuts off no call in
    /// flight: an endpoint whose breaker opened may still answer them
    /// (only leaving the run's service, [`Self::set_phase`] and
    /// [`Self::trip`], does).
    fn update(&self, status: &mut Status) {
        let accepting = status.phase == Phase::Ready && status.breaker.admits();
        // Watchers hear of a change only: a probe or a call that leaves it
        // as it was must not wake the prober (which would probe at once,
        // and so on, without end).
        self.accepting.send_if_modified(|value| {
            let was = std::mem::replace(value, accepting);
            was != accepting
        });
    }

    /// Moves to `phase`.
    pub fn set_phase(&self, phase: Phase) {
        let mut status = self.status();
        status.phase = phase;
        if phase == Phase::Ready {
            status.breaker.reset();
            status.unhealthy_since = None;
        }
        self.update(&mut status);
        // Out of service (stopped, restarting, removed): its calls in
        // flight go elsewhere.
        if phase != Phase::Ready {
            self.evict_in_flight();
        }
        let mut excluded = self.excluded.lock().unwrap_or_else(PoisonError::into_inner);
        if phase == Phase::Excluded {
            excluded.cancel();
        } else if excluded.is_cancelled() {
            *excluded = CancellationToken::new();
        }
    }

    /// Cancelled once the endpoint is out of the run (and no longer, when
    /// it comes back: ask again).
    pub fn exclusion(&self) -> CancellationToken {
        self.excluded
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn apply(&self, status: &mut Status, transition: Option<Transition>) -> Option<Transition> {
        match transition {
            Some(Transition::Opened) => {
                status.unhealthy_since = Some(Instant::now());
                self.opened
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .cancel();
            }
            Some(Transition::Closed) => {
                status.unhealthy_since = None;
                let mut opened = self.opened.lock().unwrap_or_else(PoisonError::into_inner);
                if opened.is_cancelled() {
                    *opened = CancellationToken::new();
                }
            }
            _ => {}
        }
        self.update(status);
        transition
    }

    /// Cancelled once its breaker opens (and no longer, when it closes:
    /// ask again).
    pub fn opened(&self) -> CancellationToken {
        self.opened
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// A health probe's result.
    pub fn on_probe(&self, ok: bool) -> Option<Transition> {
        let mut status = self.status();
        let transition = status.breaker.probe(ok, Instant::now());
        self.apply(&mut status, transition)
    }

    /// A call's result as far as health goes (see [`Breaker::call`]), and
    /// what it took when it succeeded.
    pub fn on_call(&self, health: Health, latency: Duration) -> Option<Transition> {
        let second = self.second();
        let mut status = self.status();
        match health {
            Health::Up => {
                status.outcomes.record(second, false);
                status.latency.record(latency);
            }
            Health::Down | Health::Fault => status.outcomes.record(second, true),
            Health::Silent => {}
        }
        // Faults in a row say it is down only when they go on for longer
        // than its calls take, or outnumber the calls it can have in
        // flight.
        let span = status
            .latency
            .value(LATENCY_KNOWN)
            .map_or(SPAN_UNKNOWN, |normal| normal.max(SPAN_FLOOR));
        let burst = u32::try_from(self.limit.current()).unwrap_or(u32::MAX);
        let transition = status.breaker.call(health, Instant::now(), span, burst);
        self.apply(&mut status, transition)
    }

    /// Its calls and failed calls over the last seconds.
    pub fn outcomes(&self) -> Tally {
        let second = self.second();
        self.status().outcomes.totals(second)
    }

    /// Whether its calls fail now and then rather than broadly: over the
    /// last seconds it made [`outlier::MIN_CALLS`] calls at least and most
    /// were answered. One call's fault then says nothing of the next
    /// call's, and a retry needs no longer wait than a first one.
    pub fn fails_sporadically(&self) -> bool {
        /// The share of failed calls below which they are sporadic.
        const SPORADIC_SHARE: f64 = 0.5;
        let tally = self.outcomes();
        tally.calls >= outlier::MIN_CALLS && tally.share() < SPORADIC_SHARE
    }

    /// When its calls last showed that it works (an answer that was not a
    /// 5xx, an event of a stream: [`crate::client::Pulse`]), since its
    /// client was made.
    pub fn last_sign_of_life(&self) -> Option<Instant> {
        self.client().and_then(|client| client.pulse().last())
    }

    /// What its calls normally take at most, once it has made enough.
    pub fn normal_latency(&self) -> Option<Duration> {
        self.status().latency.value(LATENCY_KNOWN)
    }

    /// The engine died: unhealthy at once, and its calls in flight move.
    pub fn trip(&self) -> Option<Transition> {
        let mut status = self.status();
        let transition = status.breaker.trip();
        let transition = self.apply(&mut status, transition);
        drop(status);
        self.evict_in_flight();
        transition
    }

    /// Ejects a faulty endpoint for `base` times its recent ejections (see
    /// [`outlier::Ejections`]): it takes no new calls until then (and its
    /// probes bring it back); its calls in flight go on. Returns the
    /// transition and how long it is out.
    pub fn eject(&self, base: Duration) -> (Option<Transition>, Duration) {
        let now = Instant::now();
        let mut status = self.status();
        let length = status.ejections.eject(now, base);
        let transition = status.breaker.eject(now + length);
        if transition.is_some() {
            status.outcomes.clear();
        }
        (self.apply(&mut status, transition), length)
    }

    /// A try to reach it: answered (any HTTP response), or failed before
    /// an answer, and why.
    pub fn tried(&self, answered: Result<(), String>) {
        // Once answered, it stays so: the calls of a healthy endpoint (all
        // but its first) take no lock here.
        if self.answered.load(Ordering::Relaxed) {
            return;
        }
        let mut reach = self.reach.lock().unwrap_or_else(PoisonError::into_inner);
        match answered {
            Ok(()) => {
                *reach = Reach::Answered;
                self.answered.store(true, Ordering::Relaxed);
            }
            Err(why) if *reach != Reach::Answered => *reach = Reach::Never(why),
            Err(_) => {}
        }
    }

    /// Whether it ever answered since the run started.
    pub fn reached(&self) -> Reach {
        self.reach
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// How many requests its engine runs at once, once known: the engine's
    /// own word (llama.cpp's slots), else its command's (`--max-num-seqs`,
    /// `--max-running-requests`, `-np`). `None` when its load is not read
    /// (`load.engine: none`) or nothing tells it.
    pub fn engine_capacity(&self) -> Option<usize> {
        self.load.borrow().capacity
    }

    /// Its engine's latest load reading, while it is current (made within
    /// [`load::FRESH_READINGS`] intervals): `None` before the first
    /// reading, while it is idle (it is not read then), and when its engine
    /// does not report its load.
    pub fn engine_load(&self) -> Option<EngineLoad> {
        self.load.borrow().fresh(Instant::now())
    }

    /// All that is known of its engine's load, changed at each reading.
    pub fn load_updates(&self) -> watch::Receiver<LoadState> {
        self.load.subscribe()
    }

    /// The task that reads its engine's load at `base_url`'s origin while
    /// it serves, if its load is read: made once it is ready, it ends when
    /// it leaves the run's service (it is stopped, restarted, removed).
    pub fn load_poller(&self, base_url: &str) -> Option<LoadPoller> {
        let engine = self.config.load.engine?;
        let stop = self.eviction();
        // Taken after the token: were it no longer serving, that token
        // might be a fresh one, never cancelled.
        if self.phase() != Phase::Ready {
            return None;
        }
        Some(LoadPoller {
            endpoint: self.name.clone(),
            origin: load::origin(base_url),
            engine,
            settings: self.config.load.clone(),
            counters: self.counters.clone(),
            state: self.load.clone(),
            limit: self.limit.clone(),
            stop,
        })
    }

    /// How long ago the endpoint was made (when the run's fleet was).
    pub fn age(&self) -> Duration {
        Instant::now().saturating_duration_since(self.origin)
    }

    /// Seconds since the endpoint was made.
    fn second(&self) -> u64 {
        Instant::now()
            .saturating_duration_since(self.origin)
            .as_secs()
    }

    /// Counts a call as started now.
    pub fn started(&self) {
        self.counters.started(self.second());
    }

    /// A call ended: it answered (what it took), or it failed.
    pub fn record(&self, answered: Option<window::Answered>) {
        self.window
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .record(answered);
    }

    /// Its calls since the last sample, and where it stands now.
    pub fn sample(&self) -> evalfleet_types::EndpointSample {
        let pauses = self.quota_pauses.load(std::sync::atomic::Ordering::Relaxed);
        let mut sample = self
            .window
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take(pauses);
        sample.endpoint = self.name.clone();
        sample.state = self.state();
        sample.limit = self.limit.current();
        sample.in_flight = self.limit.in_flight() as u64;
        sample
    }

    /// Where the endpoint stands, as `status` shows it.
    pub fn state(&self) -> EndpointState {
        Self::state_of(&self.status())
    }

    fn state_of(status: &Status) -> EndpointState {
        match status.phase {
            Phase::Idle => EndpointState::Idle,
            Phase::Starting => EndpointState::Starting,
            Phase::Ready => match status.breaker.state() {
                BreakerState::Closed => EndpointState::Healthy,
                BreakerState::Open => EndpointState::Unhealthy,
                BreakerState::HalfOpen => EndpointState::Recovering,
            },
            Phase::Restarting => EndpointState::Restarting,
            Phase::Excluded => EndpointState::Excluded,
        }
    }

    pub fn snapshot(&self) -> EndpointSnapshot {
        let window = self.window.lock().unwrap_or_else(PoisonError::into_inner);
        let status = self.status();
        let state = Self::state_of(&status);
        let errors = ErrorClass::FAILURES
            .iter()
            .map(|class| (*class, self.counters.errors(*class)))
            .filter(|(_, n)| *n > 0)
            .collect();
        EndpointSnapshot {
            endpoint: self.name.clone(),
            kind: self.config.kind.name().to_owned(),
            state,
            limit: self.limit.current(),
            adaptive: self.limit.is_adaptive(),
            in_flight: self.limit.in_flight() as u64,
            requests_per_minute: self.counters.per_minute(
                Instant::now()
                    .saturating_duration_since(self.origin)
                    .as_secs(),
            ),
            errors,
            base_url: status.base_url.clone(),
            pid: status.pid,
            restarts: status.restarts,
            learned_rate: self.rate.learned_rate(),
            calls: window.total_calls,
            successes: window.total_successes,
            quota_pauses: self.quota_pauses.load(std::sync::atomic::Ordering::Relaxed),
            timings: Some(window.timings.clone()),
        }
    }
}
