//! Rate limits shared by every worker that uses one API key.
//!
//! A hosted provider's `rpm` and `tpm` belong to the API key: N workers
//! each pacing itself to `rpm` send N × `rpm` together and get 429s. When
//! the run's store is shared (PostgreSQL), an endpoint with an `api_key`
//! and a configured `rpm` or `tpm` takes its calls' units from the store's
//! quota for that key and model (see [`evalfleet_store::Quotas`]) as well as
//! from its own [`RateLimiter`](super::RateLimiter), which stays as it is.
//!
//! - Units are leased from the store in chunks of about a tenth of a
//!   second's worth (at least one, or a call's whole cost when it is more),
//!   so that a worker asks the store at most about ten times a second per
//!   quota, not once a call. Endpoints of this worker with the same key
//!   and model lease from one pool (paced to the lowest limit they name).
//! - What a chunk still holds a second after it was granted goes back to
//!   the store ([`LEASE`]): a worker that slowed down (or stopped) does not
//!   keep units the others could use, and units held never add much to the
//!   quota's burst.
//! - A call's token cost is estimated before it is sent and corrected from
//!   its usage afterwards: tokens it did not use go back into the chunk (or
//!   to the store, once the chunk lapsed), tokens it used beyond the
//!   estimate are taken from the chunk or charged to the store.
//! - A 429 with `Retry-After` cools the quota down for every worker.
//! - Store calls block: they run on the blocking pool, on a connection of
//!   the shared limiter's own, one at a time. A store that fails or does
//!   not answer within [`PATIENCE`] leaves the endpoints to their own
//!   limiters for [`ALONE_FOR`] (said once, until it answers again): a
//!   lost store slows calls down, never stops them.
//!
//! Refunds, charges and cool-downs are sent by a sweeper task every
//! [`SWEEP`] (at once for a cool-down), so that a call never waits for one.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::Endpoint;
use evalfleet_store::{Granted, QuotaKind, Quotas, SharedQuota, StoreError};

/// A chunk is about this many seconds' worth of a quota.
const CHUNK_SECS: f64 = 0.1;
/// Units of a chunk not used this long after it was granted go back.
pub const LEASE: Duration = Duration::from_secs(1);
/// How often lapsed units, corrections and cool-downs are sent.
pub const SWEEP: Duration = Duration::from_millis(250);
/// How long a call waits for the store before going on without it.
pub const PATIENCE: Duration = Duration::from_secs(2);
/// How long endpoints then go by their own limiters alone before the store
/// is asked again.
pub const ALONE_FOR: Duration = Duration::from_secs(10);
/// After a partial grant, the longest wait before asking for the rest.
const ASK_AGAIN_MAX: Duration = Duration::from_millis(100);

/// The store connection the shared limiter owns.
pub type QuotaStore = Box<dyn Quotas + Send>;

/// The units a pool holds, and what it owes the store. Time is passed in.
#[derive(Debug, Default)]
struct Held {
    /// Units leased and not used.
    units: u64,
    /// When they were last granted: they lapse [`LEASE`] after.
    since: Option<Instant>,
    /// Units to settle with the store: given back when positive, charged
    /// when negative.
    owed: i64,
    /// A take is under way: the others wait for what it brings.
    taking: bool,
    /// The store granted nothing (or not enough): no asking before then.
    not_before: Option<Instant>,
    /// A cool-down to send, until then.
    cool: Option<Instant>,
}

/// What a call waiting for units does next.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    /// Its units are taken: it may go.
    Go,
    /// Ask again after this.
    Sleep(Duration),
    /// Another call is taking: wait for it.
    Wait,
    /// Take this many from the store.
    Take(u64),
}

impl Held {
    /// Units held past their lease are owed back.
    fn lapse(&mut self, now: Instant) {
        if self.units > 0 && self.since.is_some_and(|since| now >= since + LEASE) {
            self.owed = self.owed.saturating_add(count(self.units));
            self.units = 0;
        }
    }

    fn step(&mut self, now: Instant, cost: u64, chunk: u64) -> Step {
        self.lapse(now);
        if self.units >= cost {
            self.units -= cost;
            return Step::Go;
        }
        if let Some(until) = self.not_before.filter(|until| *until > now) {
            return Step::Sleep(until - now);
        }
        if self.taking {
            return Step::Wait;
        }
        self.taking = true;
        Step::Take(chunk.max(cost - self.units))
    }

    /// The store granted `got` of the `asked` units, at `now`.
    fn granted(&mut self, now: Instant, asked: u64, got: Granted, unit: Duration) {
        self.taking = false;
        if got.units > 0 {
            self.lapse(now);
            self.units += got.units;
            self.since = Some(now);
        }
        self.not_before = if got.units == 0 {
            Some(now + got.wait.max(Duration::from_millis(1)))
        } else if got.units < asked {
            // All there was: the rest comes a unit's time apart.
            let rest = unit.saturating_mul(u32::try_from(asked - got.units).unwrap_or(u32::MAX));
            Some(now + rest.min(ASK_AGAIN_MAX))
        } else {
            None
        };
    }

    /// A call that took `estimated` units used `actual`.
    fn correct(&mut self, now: Instant, estimated: u64, actual: u64) {
        self.lapse(now);
        if actual <= estimated {
            let spare = estimated - actual;
            if self.since.is_some_and(|since| now < since + LEASE) {
                self.units += spare;
            } else {
                self.owed = self.owed.saturating_add(count(spare));
            }
        } else {
            let extra = actual - estimated;
            let covered = extra.min(self.units);
            self.units -= covered;
            self.owed = self.owed.saturating_sub(count(extra - covered));
        }
    }

    /// What is to be sent now: units owed (every unit held too, when
    /// `all`), and a cool-down's end.
    fn settle(&mut self, now: Instant, all: bool) -> (i64, Option<Instant>) {
        self.lapse(now);
        if all {
            self.owed = self.owed.saturating_add(count(self.units));
            self.units = 0;
        }
        (std::mem::take(&mut self.owed), self.cool.take())
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn count(units: u64) -> i64 {
    i64::try_from(units).unwrap_or(i64::MAX)
}

/// One quota as this worker leases it: shared by its endpoints with the
/// same key and model.
struct Pool {
    quota: SharedQuota,
    chunk: u64,
    held: Mutex<Held>,
    /// Told when a take ends.
    taken: Notify,
}

impl Pool {
    fn new(quota: SharedQuota) -> Self {
        let chunk = ((quota.per_minute as f64 / 60.0) * CHUNK_SECS)
            .round()
            .max(1.0) as u64;
        Self {
            quota,
            chunk,
            held: Mutex::new(Held::default()),
            taken: Notify::new(),
        }
    }

    fn held(&self) -> MutexGuard<'_, Held> {
        lock(&self.held)
    }

    fn unit(&self) -> Duration {
        Duration::from_secs_f64(self.quota.unit_secs())
    }

    /// Waits until `cost` units are this worker's (or the store is out of
    /// reach).
    async fn acquire(&self, broker: &Broker, cost: u64) {
        if cost == 0 {
            return;
        }
        loop {
            let taken = self.taken.notified();
            tokio::pin!(taken);
            taken.as_mut().enable();
            let step = self.held().step(Instant::now(), cost, self.chunk);
            match step {
                Step::Go => return,
                Step::Sleep(wait) => tokio::time::sleep(wait).await,
                Step::Wait => taken.await,
                Step::Take(ask) => {
                    // Ends the take however this call ends (it may be
                    // dropped while it waits for the store).
                    let _taking = Taking(self);
                    let quota = self.quota.clone();
                    let got = broker
                        .call(move |store| store.take_quota(&quota, ask))
                        .await;
                    let Some(got) = got else {
                        // The store is out of reach: the endpoint's own
                        // limiter alone.
                        return;
                    };
                    self.held().granted(Instant::now(), ask, got, self.unit());
                }
            }
        }
    }
}

/// A take under way: when it ends, the pool takes no longer and the calls
/// waiting for it look again.
struct Taking<'a>(&'a Pool);

impl Drop for Taking<'_> {
    fn drop(&mut self) {
        self.0.held().taking = false;
        self.0.taken.notify_waiters();
    }
}

/// Runs the store calls, one at a time on the blocking pool, and decides
/// when the store is out of reach.
struct Broker {
    /// `None` once the sweeper has closed it.
    store: Arc<tokio::sync::Mutex<Option<QuotaStore>>>,
    tracker: TaskTracker,
    reach: Arc<Mutex<Reach>>,
}

#[derive(Debug, Default)]
struct Reach {
    /// Endpoints go by their own limiters alone until then.
    alone_until: Option<Instant>,
    /// Whether that was said (once, until the store answers again).
    said: bool,
    /// When the store call under way started (on the blocking pool's
    /// clock): one that outlived [`PATIENCE`] (a connection being made
    /// again, for minutes) holds the connection, and the calls after it
    /// go on without waiting for it.
    busy_since: Option<std::time::Instant>,
}

impl Broker {
    fn new(store: QuotaStore, tracker: &TaskTracker) -> Arc<Self> {
        Arc::new(Self {
            store: Arc::new(tokio::sync::Mutex::new(Some(store))),
            tracker: tracker.clone(),
            reach: Arc::new(Mutex::new(Reach::default())),
        })
    }

    /// Closes the store connection, on the blocking pool: a connection may
    /// block as it closes (PostgreSQL's says goodbye to the server). Later
    /// calls get `None`.
    async fn close(&self) {
        let store = self.store.lock().await.take();
        if let Some(store) = store {
            let _ = self.tracker.spawn_blocking(move || drop(store)).await;
        }
    }

    fn reach(&self) -> MutexGuard<'_, Reach> {
        lock(&self.reach)
    }

    /// Runs `op` on the store; `None` when the store failed or did not
    /// answer in time, or was out of reach lately.
    async fn call<T: Send + 'static>(
        &self,
        op: impl FnOnce(&mut dyn Quotas) -> Result<T, StoreError> + Send + 'static,
    ) -> Option<T> {
        {
            let reach = self.reach();
            let alone = reach
                .alone_until
                .is_some_and(|until| Instant::now() < until);
            let stuck = reach
                .busy_since
                .is_some_and(|since| since.elapsed() >= PATIENCE);
            if alone || stuck {
                return None;
            }
        }
        let (store, tracker, reach) =
            (self.store.clone(), self.tracker.clone(), self.reach.clone());
        let work = async move {
            let mut store = store.lock_owned().await;
            tracker
                .spawn_blocking(move || {
                    lock(&reach).busy_since = Some(std::time::Instant::now());
                    let done = match store.as_mut() {
                        Some(store) => op(&mut **store),
                        None => Err(StoreError::Invariant(
                            "the shared quotas' store connection is closed".into(),
                        )),
                    };
                    lock(&reach).busy_since = None;
                    done
                })
                .await
        };
        let why = match tokio::time::timeout(PATIENCE, work).await {
            Ok(Ok(Ok(value))) => {
                let mut reach = self.reach();
                if reach.said {
                    tracing::info!("The store answers again: quotas are shared again.");
                }
                reach.alone_until = None;
                reach.said = false;
                return Some(value);
            }
            Ok(Ok(Err(err))) => evalfleet_types::error_text(&err),
            Ok(Err(err)) => format!("its call failed: {err}"),
            Err(_) => format!("no answer in {} s", PATIENCE.as_secs()),
        };
        let mut reach = self.reach();
        reach.alone_until = Some(Instant::now() + ALONE_FOR);
        if !reach.said {
            reach.said = true;
            tracing::warn!(
                "Cannot share rate limits through the store ({why}): each endpoint keeps to its own rpm and tpm until it answers."
            );
        }
        None
    }
}

/// An endpoint's share of the quotas of its API key.
pub struct SharedLimit {
    requests: Option<Arc<Pool>>,
    tokens: Option<Arc<Pool>>,
    broker: Arc<Broker>,
    /// Wakes the sweeper (a cool-down to send).
    wake: Arc<Notify>,
}

impl std::fmt::Debug for SharedLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedLimit")
            .field("requests", &self.requests.as_ref().map(|p| &p.quota))
            .field("tokens", &self.tokens.as_ref().map(|p| &p.quota))
            .finish()
    }
}

impl SharedLimit {
    /// Waits until a call costing `tokens` may go as far as the shared
    /// quotas go, and takes its cost.
    pub async fn acquire(&self, tokens: u64) {
        if let Some(pool) = &self.requests {
            pool.acquire(&self.broker, 1).await;
        }
        if let Some(pool) = &self.tokens {
            pool.acquire(&self.broker, tokens).await;
        }
    }

    /// Corrects a call's token cost once its usage is known.
    pub fn correct(&self, estimated: u64, actual: u64) {
        if let Some(pool) = &self.tokens {
            pool.held().correct(Instant::now(), estimated, actual);
        }
    }

    /// A 429: its `Retry-After` cools the key's quotas down for every
    /// worker.
    pub fn on_rate_limited(&self, retry_after: Option<Duration>) {
        let Some(wait) = retry_after.filter(|w| !w.is_zero()) else {
            return;
        };
        let until = Instant::now() + wait;
        for pool in [&self.requests, &self.tokens].into_iter().flatten() {
            let mut held = pool.held();
            held.cool = Some(held.cool.map_or(until, |c| c.max(until)));
        }
        self.wake.notify_one();
    }
}

/// The quota of `endpoint` in `kind`, when it can be shared: it has an API
/// key, and a limit is configured for it.
fn quota_of(endpoint: &Endpoint, kind: QuotaKind) -> Option<SharedQuota> {
    let key = endpoint.config.api_key.as_ref()?;
    let per_minute = match kind {
        QuotaKind::Requests => u64::from(endpoint.config.rpm?),
        QuotaKind::Tokens => endpoint.config.tpm?,
    };
    if per_minute == 0 {
        return None;
    }
    Some(SharedQuota {
        key: hex::encode(Sha256::digest(key.expose().as_bytes())),
        model: endpoint.model.clone(),
        kind,
        per_minute,
    })
}

/// Shares the quotas of `endpoints` through `store` (a connection of their
/// own): each endpoint with an API key and a configured `rpm` or `tpm` gets
/// its [`SharedLimit`], and a sweeper task (on `tracker`, until `stop`)
/// gives back what lapses. Returns how many endpoints share.
pub fn share(
    endpoints: &[Arc<Endpoint>],
    store: QuotaStore,
    tracker: &TaskTracker,
    stop: CancellationToken,
) -> usize {
    // One pool per key, model and kind, at the lowest limit its endpoints
    // name.
    let mut quotas: HashMap<(String, String, QuotaKind), SharedQuota> = HashMap::new();
    for endpoint in endpoints {
        for kind in [QuotaKind::Requests, QuotaKind::Tokens] {
            if let Some(quota) = quota_of(endpoint, kind) {
                quotas
                    .entry((quota.key.clone(), quota.model.clone(), kind))
                    .and_modify(|q| q.per_minute = q.per_minute.min(quota.per_minute))
                    .or_insert(quota);
            }
        }
    }
    let pools: HashMap<_, _> = quotas
        .into_iter()
        .map(|(id, quota)| (id, Arc::new(Pool::new(quota))))
        .collect();
    if pools.is_empty() {
        // Closed on the blocking pool, as a connection may block as it
        // closes.
        tracker.spawn_blocking(move || drop(store));
        return 0;
    }
    let broker = Broker::new(store, tracker);
    let wake = Arc::new(Notify::new());
    let mut sharing = 0;
    for endpoint in endpoints {
        let pool = |kind| {
            quota_of(endpoint, kind)
                .and_then(|q| pools.get(&(q.key, q.model, kind)))
                .cloned()
        };
        let (requests, tokens) = (pool(QuotaKind::Requests), pool(QuotaKind::Tokens));
        if requests.is_none() && tokens.is_none() {
            continue;
        }
        let limit = SharedLimit {
            requests,
            tokens,
            broker: broker.clone(),
            wake: wake.clone(),
        };
        if endpoint.shared.set(limit).is_ok() {
            sharing += 1;
        }
    }
    tracker.spawn(sweep(pools.into_values().collect(), broker, wake, stop));
    sharing
}

/// Shares one quota that is no endpoint's (a Google service account's
/// writes, say) through `store` (a connection of its own), as [`share`]
/// shares endpoints': the limit's [`acquire`](SharedLimit::acquire) takes
/// one of `quota`'s units (its `kind` is taken to be
/// [`QuotaKind::Requests`]), and a sweeper task (on `tracker`, until
/// `stop`) gives back what lapses.
pub fn share_quota(
    quota: SharedQuota,
    store: QuotaStore,
    tracker: &TaskTracker,
    stop: CancellationToken,
) -> SharedLimit {
    let pool = Arc::new(Pool::new(SharedQuota {
        kind: QuotaKind::Requests,
        ..quota
    }));
    let broker = Broker::new(store, tracker);
    let wake = Arc::new(Notify::new());
    tracker.spawn(sweep(
        vec![pool.clone()],
        broker.clone(),
        wake.clone(),
        stop,
    ));
    SharedLimit {
        requests: Some(pool),
        tokens: None,
        broker,
        wake,
    }
}

/// Every [`SWEEP`] (and when woken): sends the pools' cool-downs, lapsed
/// units and corrections to the store; at `stop`, gives back every unit
/// held, and ends.
async fn sweep(
    pools: Vec<Arc<Pool>>,
    broker: Arc<Broker>,
    wake: Arc<Notify>,
    stop: CancellationToken,
) {
    loop {
        let stopping = tokio::select! {
            () = tokio::time::sleep(SWEEP) => false,
            () = wake.notified() => false,
            () = stop.cancelled() => true,
        };
        for pool in &pools {
            let now = Instant::now();
            let (owed, cool) = pool.held().settle(now, stopping);
            if let Some(until) = cool.filter(|until| *until > now) {
                let quota = pool.quota.clone();
                let sent = broker
                    .call(move |store| store.cool_quota(&quota, until - now))
                    .await;
                if sent.is_none() {
                    let mut held = pool.held();
                    held.cool = Some(held.cool.map_or(until, |c| c.max(until)));
                }
            }
            if owed != 0 {
                let quota = pool.quota.clone();
                let sent = broker
                    .call(move |store| store.refund_quota(&quota, owed))
                    .await;
                if sent.is_none() && !stopping {
                    let mut held = pool.held();
                    held.owed = held.owed.saturating_add(owed);
                }
            }
        }
        if stopping {
            broker.close().await;
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use evalfleet_config::{EndpointConfig, Secret};

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn grant(units: u64) -> Granted {
        Granted {
            units,
            wait: Duration::ZERO,
        }
    }

    #[test]
    fn a_chunk_serves_calls_until_it_is_spent_or_lapses() {
        let t0 = Instant::now();
        let mut held = Held::default();
        // Nothing held: one call takes a chunk for itself and the next.
        assert_eq!(held.step(t0, 1, 10), Step::Take(10));
        // Another call meanwhile waits for that take.
        assert_eq!(held.step(t0, 1, 10), Step::Wait);
        held.granted(t0, 10, grant(10), ms(10));
        for _ in 0..10 {
            assert_eq!(held.step(t0 + ms(500), 1, 10), Step::Go);
        }
        assert_eq!(held.step(t0 + ms(500), 1, 10), Step::Take(10));
        held.granted(t0 + ms(500), 10, grant(10), ms(10));
        assert_eq!(held.step(t0 + ms(600), 1, 10), Step::Go);
        // A second after the grant, the 9 left are owed back, and a call
        // takes anew.
        assert_eq!(held.step(t0 + ms(1500), 1, 10), Step::Take(10));
        held.taking = false;
        assert_eq!(held.settle(t0 + ms(1500), false), (9, None));
        // A call costing more than a chunk asks for what it lacks.
        held.granted(t0 + ms(1500), 10, grant(10), ms(10));
        assert_eq!(held.step(t0 + ms(1500), 25, 10), Step::Take(15));
    }

    #[test]
    fn a_refusal_or_a_partial_grant_waits_before_asking_again() {
        let t0 = Instant::now();
        let mut held = Held::default();
        assert_eq!(held.step(t0, 1, 10), Step::Take(10));
        let refused = Granted {
            units: 0,
            wait: ms(700),
        };
        held.granted(t0, 10, refused, ms(10));
        assert_eq!(held.step(t0 + ms(200), 1, 10), Step::Sleep(ms(500)));
        assert_eq!(held.step(t0 + ms(700), 1, 10), Step::Take(10));
        // 4 of 10: the 6 others come 10 ms apart, asked for in 60 ms...
        held.granted(t0 + ms(700), 10, grant(4), ms(10));
        assert_eq!(held.step(t0 + ms(700), 4, 10), Step::Go);
        assert_eq!(held.step(t0 + ms(700), 5, 10), Step::Sleep(ms(60)));
        // ...but at most 100 ms later, however many are missing.
        held.granted(t0 + ms(700), 1000, grant(1), ms(10));
        assert_eq!(held.step(t0 + ms(700), 5, 10), Step::Sleep(ms(100)));
    }

    #[test]
    fn token_estimates_are_corrected_in_the_chunk_or_with_the_store() {
        let t0 = Instant::now();
        let mut held = Held::default();
        assert_eq!(held.step(t0, 250, 100), Step::Take(250));
        held.granted(t0, 250, grant(250), ms(1));
        assert_eq!(held.step(t0, 250, 100), Step::Go);
        // It used 100: 150 are back in the chunk for the next call.
        held.correct(t0 + ms(100), 250, 100);
        assert_eq!(held.step(t0 + ms(100), 120, 100), Step::Go);
        // That one used 300: the 30 left cover part, 150 are charged.
        held.correct(t0 + ms(200), 120, 300);
        assert_eq!(held.settle(t0 + ms(200), false), (-150, None));
        // Once the chunk lapsed, what a call did not use goes to the store.
        held.correct(t0 + ms(1200), 50, 20);
        assert_eq!(held.settle(t0 + ms(1200), false), (30, None));
    }

    /// A store's quotas as the tests script them: a budget of units,
    /// refused with `wait` once spent, or failing.
    #[derive(Debug, Default)]
    struct Script {
        budget: u64,
        wait: Duration,
        fail: bool,
        /// The next call blocks this long first (a connection being made
        /// again).
        hang: Option<Duration>,
        takes: Vec<(QuotaKind, u64)>,
        refunds: Vec<(QuotaKind, i64)>,
        cools: Vec<(QuotaKind, Duration)>,
        calls: u32,
    }

    struct Fake(Arc<Mutex<Script>>);

    impl Fake {
        fn script(&self) -> MutexGuard<'_, Script> {
            self.0.lock().unwrap()
        }

        fn called(&self) -> Result<MutexGuard<'_, Script>, StoreError> {
            let hang = self.script().hang.take();
            if let Some(hang) = hang {
                std::thread::sleep(hang);
            }
            let mut script = self.script();
            script.calls += 1;
            if script.fail {
                return Err(StoreError::Invariant("the store is down".into()));
            }
            Ok(script)
        }
    }

    impl Quotas for Fake {
        fn shares_quotas(&self) -> bool {
            true
        }

        fn take_quota(&mut self, quota: &SharedQuota, want: u64) -> Result<Granted, StoreError> {
            let mut script = self.called()?;
            script.takes.push((quota.kind, want));
            let units = want.min(script.budget);
            script.budget -= units;
            let wait = if units == 0 {
                script.wait
            } else {
                Duration::ZERO
            };
            Ok(Granted { units, wait })
        }

        fn refund_quota(&mut self, quota: &SharedQuota, units: i64) -> Result<(), StoreError> {
            self.called()?.refunds.push((quota.kind, units));
            Ok(())
        }

        fn cool_quota(&mut self, quota: &SharedQuota, wait: Duration) -> Result<(), StoreError> {
            self.called()?.cools.push((quota.kind, wait));
            Ok(())
        }
    }

    /// Endpoints of one API key and model, with these `rpm` and `tpm`.
    fn endpoints(limits: &[(Option<u32>, Option<u64>)]) -> Vec<Arc<Endpoint>> {
        let dataset = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
        let list: Vec<_> = (0..limits.len())
            .map(|i| {
                serde_json::json!({"name": format!("e{i}"), "kind": "external",
                    "base_url": "https://api.example.invalid/v1", "model": "gpt-x"})
            })
            .collect();
        let config = serde_json::json!({
            "name": "t",
            "dataset": {"path": dataset, "format": "jsonl"},
            "endpoints": list,
            "task": {"messages": [{"role": "user", "content": "{{ q }}"}]},
        });
        let configs: Vec<EndpointConfig> =
            evalfleet_config::load_snapshot(&config, std::path::Path::new("."))
                .unwrap()
                .config
                .endpoints;
        configs
            .into_iter()
            .zip(limits)
            .map(|(mut config, (rpm, tpm))| {
                config.api_key = Some(Secret::new("sk-test"));
                config.rpm = *rpm;
                config.tpm = *tpm;
                Arc::new(Endpoint::new(&config, Duration::from_secs(10)))
            })
            .collect()
    }

    struct Setup {
        endpoints: Vec<Arc<Endpoint>>,
        script: Arc<Mutex<Script>>,
        tracker: TaskTracker,
        stop: CancellationToken,
    }

    impl Setup {
        fn new(limits: &[(Option<u32>, Option<u64>)], script: Script) -> Self {
            let endpoints = endpoints(limits);
            let script = Arc::new(Mutex::new(script));
            let tracker = TaskTracker::new();
            let stop = CancellationToken::new();
            share(
                &endpoints,
                Box::new(Fake(script.clone())),
                &tracker,
                stop.clone(),
            );
            Self {
                endpoints,
                script,
                tracker,
                stop,
            }
        }

        fn limit(&self, i: usize) -> &SharedLimit {
            self.endpoints[i].shared.get().unwrap()
        }

        fn script(&self) -> MutexGuard<'_, Script> {
            self.script.lock().unwrap()
        }

        async fn stop(&self) {
            self.stop.cancel();
            self.tracker.close();
            self.tracker.wait().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn calls_lease_chunks_rather_than_ask_the_store_each() {
        // 6000 a minute: chunks of 10. Two endpoints of the same key and
        // model lease from one pool.
        let setup = Setup::new(
            &[(Some(6000), None), (Some(9000), None)],
            Script {
                budget: u64::MAX,
                ..Script::default()
            },
        );
        for i in 0..25 {
            setup.limit(i % 2).acquire(100).await;
        }
        assert_eq!(
            setup.script().takes,
            vec![(QuotaKind::Requests, 10); 3],
            "one pool, at the lower limit, and no tokens quota"
        );
        // The 5 left lapse and go back, without a call to ask for it.
        tokio::time::sleep(LEASE + SWEEP * 2).await;
        assert_eq!(setup.script().refunds, vec![(QuotaKind::Requests, 5)]);
        setup.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn calls_wait_while_the_store_refuses_and_for_one_take_at_a_time() {
        let setup = Setup::new(
            &[(Some(600), None)],
            Script {
                wait: ms(700),
                ..Script::default()
            },
        );
        let t0 = Instant::now();
        // Many calls at once: they queue behind one take, which is
        // refused; none goes before the budget comes.
        let calls: Vec<_> = (0..5)
            .map(|_| {
                let limit = setup.endpoints[0].clone();
                setup.tracker.spawn(async move {
                    limit.shared.get().unwrap().acquire(1).await;
                    Instant::now()
                })
            })
            .collect();
        tokio::time::sleep(ms(300)).await;
        assert_eq!(setup.script().takes, vec![(QuotaKind::Requests, 1)]);
        setup.script().budget = 5;
        for call in calls {
            let went = call.await.unwrap();
            assert!(went >= t0 + ms(700), "{:?}", went - t0);
        }
        assert_eq!(setup.script().budget, 0);
        setup.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn tokens_are_corrected_and_what_is_held_goes_back_at_the_end() {
        // 60,000 tokens a minute: chunks of 100.
        let setup = Setup::new(
            &[(None, Some(60_000))],
            Script {
                budget: u64::MAX,
                ..Script::default()
            },
        );
        let limit = setup.limit(0);
        limit.acquire(250).await;
        limit.correct(250, 100);
        limit.acquire(120).await;
        limit.correct(120, 300);
        limit.acquire(40).await;
        limit.correct(40, 40);
        setup.stop().await;
        let script = setup.script();
        // The first call's chunk served the second; the charge left none
        // for the third.
        assert_eq!(
            script.takes,
            vec![(QuotaKind::Tokens, 250), (QuotaKind::Tokens, 100)]
        );
        // What was taken, less what was given back, is what the calls used.
        let taken: u64 = script.takes.iter().map(|(_, n)| n).sum();
        let back: i64 = script.refunds.iter().map(|(_, n)| n).sum();
        assert_eq!(taken as i64 - back, 100 + 300 + 40, "{:?}", script.refunds);
    }

    #[tokio::test(start_paused = true)]
    async fn a_429_cools_the_keys_quotas_down_for_every_worker() {
        let setup = Setup::new(
            &[(Some(600), Some(60_000))],
            Script {
                budget: u64::MAX,
                ..Script::default()
            },
        );
        setup.limit(0).on_rate_limited(None);
        setup.limit(0).on_rate_limited(Some(Duration::from_secs(3)));
        tokio::time::sleep(ms(10)).await;
        let mut cools = setup.script().cools.clone();
        cools.sort_by_key(|(kind, _)| kind.as_str());
        assert_eq!(
            cools,
            vec![
                (QuotaKind::Requests, Duration::from_secs(3)),
                (QuotaKind::Tokens, Duration::from_secs(3))
            ]
        );
        setup.stop().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_store_out_of_reach_leaves_each_endpoint_to_its_own_limits() {
        let setup = Setup::new(
            &[(Some(600), None)],
            Script {
                fail: true,
                ..Script::default()
            },
        );
        // The calls go, and the store is not asked again for a while.
        for _ in 0..20 {
            setup.limit(0).acquire(1).await;
        }
        assert_eq!(setup.script().calls, 1);
        // Once it answers again, calls take from it again.
        {
            let mut script = setup.script();
            script.fail = false;
            script.budget = 1;
        }
        tokio::time::sleep(ALONE_FOR).await;
        setup.limit(0).acquire(1).await;
        assert_eq!(setup.script().takes, vec![(QuotaKind::Requests, 1)]);
        setup.stop().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_that_does_not_answer_is_not_waited_for_long() {
        // Real time: the store blocks on the blocking pool, for longer
        // than a call waits for it.
        let setup = Setup::new(
            &[(Some(600), None)],
            Script {
                budget: u64::MAX,
                hang: Some(PATIENCE + Duration::from_secs(1)),
                ..Script::default()
            },
        );
        let began = std::time::Instant::now();
        setup.limit(0).acquire(1).await;
        let waited = began.elapsed();
        assert!(
            waited >= PATIENCE && waited < PATIENCE + ms(500),
            "{waited:?}"
        );
        // The next calls go at once, without asking.
        setup.limit(0).acquire(1).await;
        assert!(began.elapsed() < PATIENCE + ms(500));
        setup.stop().await;
        assert_eq!(setup.script().takes, vec![(QuotaKind::Requests, 1)]);
    }

    #[test]
    fn only_endpoints_with_a_key_and_a_limit_share() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let endpoints = endpoints(&[(Some(60), None), (None, None)]);
            let mut keyless = endpoints[0].config.clone();
            keyless.api_key = None;
            let keyless = Arc::new(Endpoint::new(&keyless, Duration::from_secs(1)));
            let all = vec![endpoints[0].clone(), endpoints[1].clone(), keyless.clone()];
            let tracker = TaskTracker::new();
            let stop = CancellationToken::new();
            let script = Arc::new(Mutex::new(Script::default()));
            assert_eq!(
                share(&all, Box::new(Fake(script)), &tracker, stop.clone()),
                1
            );
            assert!(endpoints[1].shared.get().is_none());
            assert!(keyless.shared.get().is_none());
            stop.cancel();
            tracker.close();
            tracker.wait().await;
        });
    }
}
