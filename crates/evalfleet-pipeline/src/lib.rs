//! One session of a run: the reader claims items and starts each on its
//! task; each endpoint's dispatcher pulls the next call from its queues when
//! it has a free slot (so a fast endpoint takes more and a slow one fewer)
//! and makes it on the fleet's one call path; each reply goes back to the
//! item's task, whose next step is another call, work (running a program)
//! or the item's end; the one writer stores attempts and results. The
//! response cache wraps every call: a request answered there reaches no
//! endpoint.
//!
//! The pipeline knows no task's details: it drives steps ([`crate::task`]).
//!
//! Stopping: `stop` ends claiming and dispatching; calls in flight get
//! `shutdown_grace` to finish; then the writer commits what it has, the
//! worker's claims are released and the store comes back. Items not
//! finished stay pending for a resume or another worker.

mod dispatch;
mod item;
mod lease;
mod outcome;
mod reader;
pub mod task;
mod writer;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use evalfleet_types::{CacheEntry, ItemStatus, Verdict, now_ms};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::task::{Request, Target, Task};
use evalfleet_config::{Config, RetryPolicy};
use evalfleet_fleet::runtime::FleetHandle;
use evalfleet_fleet::{Endpoint, EndpointCounters};
use evalfleet_io::dataset::{DatasetError, RowReader};
use evalfleet_store::{Store, StoreError};
use evalfleet_types::RetryBudget;
use item::{Backlog, Item, Tally};
use outcome::{Message, Outcome};
use reader::Reader;
pub use writer::ResultTap;

/// Live counters of a session, read by progress displays.
pub struct Progress {
    /// Items in the run.
    pub total: u64,
    /// Items already done or failed when the session began.
    pub done_before: u64,
    pub failed_before: u64,
    /// Items that ended in this session.
    pub done: AtomicU64,
    pub failed: AtomicU64,
    /// Results committed to the store in this session.
    pub committed: AtomicU64,
    /// Calls made again in this session after a call failed (transport
    /// errors, refusals, timeouts, cut streams).
    pub retries: AtomicU64,
    /// Calls made in this session to ask the model again after an answer
    /// it could not use (unparsed or invalid).
    pub reasks: AtomicU64,
    /// Items that ended in this session with an answer that could not be
    /// parsed, or not checked valid, once their re-asks ran out.
    pub unparsed: AtomicU64,
    pub invalid: AtomicU64,
    /// Each endpoint's name and counters.
    pub endpoints: Vec<(String, Arc<EndpointCounters>)>,
}

impl Progress {
    pub fn new(
        total: u64,
        done_before: u64,
        failed_before: u64,
        endpoints: &[Arc<Endpoint>],
    ) -> Self {
        Self {
            total,
            done_before,
            failed_before,
            done: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            committed: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            reasks: AtomicU64::new(0),
            unparsed: AtomicU64::new(0),
            invalid: AtomicU64::new(0),
            endpoints: endpoints
                .iter()
                .map(|e| (e.name.clone(), e.counters.clone()))
                .collect(),
        }
    }

    fn ended(&self, status: ItemStatus, verdict: Option<Verdict>) {
        match status {
            ItemStatus::Done => self.done.fetch_add(1, Ordering::Relaxed),
            ItemStatus::Failed => self.failed.fetch_add(1, Ordering::Relaxed),
        };
        match verdict {
            Some(Verdict::Unparsed) => self.unparsed.fetch_add(1, Ordering::Relaxed),
            Some(Verdict::Invalid) => self.invalid.fetch_add(1, Ordering::Relaxed),
            Some(Verdict::Ok) | None => 0,
        };
    }
}

/// What a session works on.
pub struct Session {
    pub run_id: String,
    pub session: u32,
    pub config: Arc<Config>,
    pub task: Arc<dyn Task>,
    pub endpoints: Vec<Arc<Endpoint>>,
    /// The fleet, to report health changes and learn when it is exhausted.
    pub fleet: FleetHandle,
    /// This worker's id in the store.
    pub worker: Arc<str>,
    /// An exec task's gateway, which answers from the session's cache.
    pub gateway: Option<Arc<evalfleet_gateway::Gateway>>,
    /// Told of each result once it is committed.
    pub on_result: Option<ResultTap>,
}

/// Opens a connection to the session's store (each thread of the session
/// has its own).
pub type OpenStore = dyn Fn() -> Result<Box<dyn Store>, StoreError> + Send + Sync;

/// How a session ended.
pub struct SessionEnd {
    /// The store, back from the writer with everything committed.
    pub store: Box<dyn Store>,
}

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    #[error(transparent)]
    Task(#[from] crate::task::TaskError),
    #[error("internal error: {0}")]
    Internal(String),
}

impl PipelineError {
    pub fn fault(&self) -> evalfleet_types::Fault {
        match self {
            Self::Store(err) => err.fault(),
            Self::Dataset(err) => err.fault(),
            Self::Task(err) => err.fault(),
            Self::Internal(_) => evalfleet_types::Fault::Failure,
        }
    }
}

/// How the session uses the response cache.
struct CacheUse {
    /// The request identity of each target's answers (model and params):
    /// the endpoints that answer items, and each endpoint by name.
    items: Option<String>,
    named: HashMap<String, String>,
    /// Look answers up (entries stored before `since_ms` are too old).
    reads: bool,
    since_ms: i64,
    /// Store new answers.
    writes: bool,
}

impl CacheUse {
    /// The cache key of `request`, when the cache holds its answers.
    fn key(&self, request: &Request) -> Option<String> {
        let identity = match &request.target {
            Target::Items => self.items.as_deref(),
            Target::Endpoint(name) => self.named.get(&**name).map(String::as_str),
        }?;
        Some(evalfleet_config::cache::key(
            identity,
            request.sample,
            &request.messages,
        ))
    }

    /// The key to look `request` up under, when the session reads the cache.
    fn lookup_key(&self, request: &Request) -> Option<String> {
        if !self.reads {
            return None;
        }
        self.key(request)
    }

    /// The entry that stores `content` as the answer to `request`, when the
    /// session writes the cache.
    fn entry(
        &self,
        request: &Request,
        content: &str,
        telemetry: &evalfleet_types::Telemetry,
    ) -> Option<CacheEntry> {
        if !self.writes {
            return None;
        }
        let key = self.key(request)?;
        Some(CacheEntry {
            key,
            content: content.to_owned(),
            endpoint: telemetry.endpoint.clone(),
            model: telemetry.model.clone(),
            prompt_tokens: telemetry.prompt_tokens,
            // The cache keeps counted tokens only: an estimate read back
            // would pass for a count.
            completion_tokens: telemetry
                .completion_tokens
                .filter(|_| !telemetry.tokens_estimated),
            finish_reason: telemetry.finish_reason.clone(),
            latency_ms: telemetry.latency_ms,
            created_at_ms: now_ms(),
        })
    }
}

/// What every part of a session shares.
struct Shared {
    session: u32,
    retry: RetryPolicy,
    /// Retries of item calls, as a share of first tries.
    budget: RetryBudget,
    item_timeout: Duration,
    /// `retry.judge_for`: how long a call to a named endpoint is tried
    /// again, however many tries that takes.
    judge_for: Duration,
    /// Completion tokens a call may use, for estimating its token cost.
    max_tokens: u64,
    task: Arc<dyn Task>,
    /// Items for any endpoint that answers items.
    backlog: Backlog,
    /// Calls late on an endpoint taken out of service may be hedged on
    /// another (more than one endpoint answers items).
    hedging: bool,
    /// Calls addressed to an endpoint by name, and the endpoints.
    direct: HashMap<String, mpsc::UnboundedSender<Item>>,
    endpoints: HashMap<String, Arc<Endpoint>>,
    writer: mpsc::Sender<Message>,
    cache: CacheUse,
    /// Asks the cache-lookup thread (calls after the first of an item).
    lookups: Option<mpsc::UnboundedSender<dispatch::Lookup>>,
    /// Bounds the task's work steps running at once.
    work: Arc<Semaphore>,
    /// Stop taking items: everything is done, the user asked, the fleet is
    /// exhausted, or a part failed.
    halt: CancellationToken,
    /// Abandon calls in flight (the grace period is over, or a part failed).
    abort: CancellationToken,
    /// Every task of the session.
    tracker: TaskTracker,
    /// Items not ended.
    tally: Arc<Tally>,
    /// Whether the first items all failed alike (then the session gives up).
    first_failures: item::FirstFailures,
    progress: Arc<Progress>,
    fleet: FleetHandle,
    /// Until when the session's claims hold, and which it lost.
    leases: Arc<lease::LeaseGate>,
}

impl Shared {
    /// Hands an outcome to the writer; if the writer is gone (it failed), the
    /// session stops.
    async fn send(&self, outcome: Outcome) -> bool {
        if self.writer.send(Message::One(outcome)).await.is_err() {
            self.halt.cancel();
            self.abort.cancel();
            return false;
        }
        true
    }
}

/// The completion tokens a call may use: `max_tokens` (or
/// `max_completion_tokens`) from the task, else a guess.
fn max_tokens(config: &Config) -> u64 {
    ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|key| {
            config
                .task
                .params
                .get(*key)
                .and_then(serde_json::Value::as_u64)
        })
        .unwrap_or(256)
}

/// How an exec task's gateway uses the session's cache: the lookup thread
/// answers its reads; the writer stores its answers (through senders that
/// keep neither open).
fn gateway_cache(
    lookups: Option<&mpsc::UnboundedSender<dispatch::Lookup>>,
    cache: &CacheUse,
    writer: &mpsc::Sender<Message>,
) -> evalfleet_gateway::CacheLink {
    // Weak senders: the lookup thread and the writer end with the
    // session's own senders, whoever holds the gateway.
    let get = lookups.map(|tx| {
        let tx = tx.downgrade();
        let get: evalfleet_gateway::CacheGet = Arc::new(move |key| {
            let tx = tx.upgrade();
            Box::pin(async move { dispatch::look_up(&tx?, key).await })
        });
        get
    });
    let put = cache.writes.then(|| {
        let writer = writer.downgrade();
        let put: evalfleet_gateway::CachePut = Arc::new(move |entry| {
            if let Some(writer) = writer.upgrade() {
                // A full writer drops the entry: the cache is not the
                // run's record.
                let _ = writer.try_send(Message::One(Outcome {
                    claim: 0,
                    attempt: None,
                    result: None,
                    cache: Some(entry),
                    calls: Vec::new(),
                    wait: None,
                }));
            }
        });
        put
    });
    evalfleet_gateway::CacheLink { get, put }
}

/// The request identities of the session's endpoints, for the cache.
fn cache_use(config: &Config, endpoints: &[Arc<Endpoint>]) -> CacheUse {
    let identity = |e: &Endpoint| config.cache_identity(&e.config);
    CacheUse {
        items: endpoints
            .iter()
            .find(|e| e.config.takes_items())
            .map(|e| identity(e)),
        named: endpoints
            .iter()
            .map(|e| (e.name.clone(), identity(e)))
            .collect(),
        reads: config.cache.mode.reads(),
        since_ms: config.cache.ttl.map_or(0, |ttl| {
            now_ms() - i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX)
        }),
        writes: config.cache.mode.writes(),
    }
}

/// Runs one session until this worker has no item left to claim and every
/// item it claimed has ended, `stop` is cancelled (and calls in flight have
/// finished or the grace period is over), or the fleet has no endpoint left.
pub async fn execute(
    session: Session,
    open: Arc<OpenStore>,
    rows: RowReader,
    progress: Arc<Progress>,
    stop: CancellationToken,
) -> Result<SessionEnd, PipelineError> {
    let run_id: Arc<str> = Arc::from(session.run_id.as_str());
    let config = session.config.clone();
    let total_slots: usize = session
        .endpoints
        .iter()
        .map(|e| e.config.max_concurrency())
        .sum();
    let (fresh_tx, fresh_rx) = mpsc::channel(total_slots.clamp(64, 16_384));
    let (writer_tx, writer_rx) = mpsc::channel(config.writer.batch_size.clamp(1024, 65_536) * 2);
    let halt = stop.child_token();
    let abort = CancellationToken::new();
    let tracker = TaskTracker::new();
    let leases = Arc::new(lease::LeaseGate::new(config.timeouts.lease));
    let tally = Tally::new(halt.clone(), progress.clone(), leases.clone());
    let cache = cache_use(&config, &session.endpoints);

    let writer_task = {
        let (halt, abort) = (halt.clone(), abort.clone());
        let task = writer::run(
            writer_rx,
            open()?,
            writer::Worker {
                run_id: run_id.clone(),
                worker: session.worker.clone(),
                lease: config.timeouts.lease,
            },
            config.writer,
            writer::Told {
                progress: progress.clone(),
                tap: session.on_result.clone(),
                leases: leases.clone(),
                tally: tally.clone(),
            },
        );
        tracker.spawn(async move {
            let result = task.await;
            if result.is_err() {
                halt.cancel();
                abort.cancel();
            }
            result
        })
    };
    let lookups = if cache.reads {
        Some(dispatch::cache_lookups(open()?, cache.since_ms, &tracker))
    } else {
        None
    };

    if let Some(gateway) = session
        .gateway
        .as_ref()
        .filter(|_| cache.reads || cache.writes)
    {
        gateway.link_cache(gateway_cache(lookups.as_ref(), &cache, &writer_tx));
    }

    let mut direct = HashMap::new();
    let mut inboxes = Vec::with_capacity(session.endpoints.len());
    for endpoint in &session.endpoints {
        let (tx, rx) = mpsc::unbounded_channel();
        direct.insert(endpoint.name.clone(), tx);
        inboxes.push((endpoint.clone(), rx));
    }
    let shared = Arc::new(Shared {
        session: session.session,
        retry: config.retry,
        budget: RetryBudget::new(config.retry_budget, tokio::time::Instant::now()),
        item_timeout: config.timeouts.item,
        judge_for: config.judge_retry_for,
        max_tokens: max_tokens(&config),
        work: Arc::new(Semaphore::new(session.task.work_limit().max(1))),
        task: session.task.clone(),
        backlog: Backlog::new(fresh_rx),
        hedging: session
            .endpoints
            .iter()
            .filter(|e| e.config.takes_items())
            .count()
            > 1,
        direct,
        endpoints: session
            .endpoints
            .iter()
            .map(|e| (e.name.clone(), e.clone()))
            .collect(),
        writer: writer_tx,
        cache,
        lookups,
        halt: halt.clone(),
        abort: abort.clone(),
        tracker: tracker.clone(),
        tally: tally.clone(),
        first_failures: item::FirstFailures::default(),
        progress: progress.clone(),
        fleet: session.fleet.clone(),
        leases,
    });

    let reader_task = {
        let mut store = open()?;
        if shared.cache.reads {
            store.prepare_for_lookups();
        }
        let reader = Reader::new(
            store,
            rows,
            run_id.clone(),
            session.worker.clone(),
            config.timeouts.lease,
            reader::claim_size(total_slots.max(session.task.work_limit())),
            config.task.samples,
            shared.clone(),
            fresh_tx,
        );
        let runtime = tokio::runtime::Handle::current();
        let (halt, tally) = (halt.clone(), tally.clone());
        tracker.spawn_blocking(move || {
            let result = reader.run(&runtime);
            if result.is_err() {
                halt.cancel();
            }
            // Nothing more to claim: the session ends with its last item.
            tally.release();
            result
        })
    };

    for (endpoint, inbox) in inboxes {
        let span = tracing::info_span!("endpoint", name = %endpoint.name);
        tracker.spawn(dispatch::dispatch(shared.clone(), endpoint, inbox).instrument(span));
    }
    {
        // No endpoint left: stop like a Ctrl-C (calls in flight may finish).
        let (exhausted, halt) = (session.fleet.exhausted(), halt.clone());
        tracker.spawn(async move {
            tokio::select! {
                () = exhausted.cancelled() => halt.cancel(),
                () = halt.cancelled() => {}
            }
        });
    }

    halt.cancelled().await;
    let interrupted = stop.is_cancelled() || session.fleet.exhausted().is_cancelled();
    let outstanding = tally.outstanding();
    // Dropping the shared state closes the writer's inbox once the last
    // task holding it ends.
    drop(shared);
    let reader_result = reader_task
        .await
        .map_err(|err| PipelineError::Internal(format!("the reader failed: {err}")))?;
    tracker.close();
    if interrupted && outstanding > 0 {
        tokio::select! {
            () = tracker.wait() => {}
            () = tokio::time::sleep(config.shutdown_grace) => {
                tracing::warn!("Grace period over: abandoning calls still in flight; their items stay pending.");
                abort.cancel();
                tracker.wait().await;
            }
        }
    } else {
        tracker.wait().await;
    }
    let lost = tally.lost();
    if lost > 0 {
        tracing::error!(
            "The session lost track of {lost} items (a bug): they were neither finished nor queued, and stay pending for a resume."
        );
    }
    let store = writer_task
        .await
        .map_err(|err| PipelineError::Internal(format!("the writer failed: {err}")))??;
    reader_result?;
    Ok(SessionEnd { store })
}
