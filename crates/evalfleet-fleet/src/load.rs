//! What an engine says of its own load: how many requests it can run at
//! once, how many it runs, how many wait in its queue, and how full its KV
//! cache is. The concurrency controller starts from the first and takes
//! the queue as the sign of overload, instead of guessing both from round
//! trips.
//!
//! Each engine tells it in its own way (see `docs/fleet.md`):
//! - llama.cpp's server: `GET /props` gives `total_slots` (its
//!   `--parallel`); `GET /metrics` (with `--metrics`) gives
//!   `llamacpp:requests_processing` and `llamacpp:requests_deferred`;
//!   `GET /slots` (on unless `--no-slots`) gives one entry per slot with
//!   `is_processing` (`state`, non-zero when busy, before late 2024).
//! - vLLM's `GET /metrics`: `vllm:num_requests_running`,
//!   `vllm:num_requests_waiting` (and `vllm:num_requests_swapped` in its
//!   old engine), `vllm:kv_cache_usage_perc` (`vllm:gpu_cache_usage_perc`
//!   before 0.9); one series per engine of a data-parallel server.
//! - SGLang's `GET /metrics` (with `--enable-metrics`):
//!   `sglang:num_running_reqs`, `sglang:num_queue_reqs`,
//!   `sglang:num_grammar_queue_reqs`, `sglang:token_usage`; one series
//!   per rank.
//!
//! vLLM and SGLang do not tell how many requests they run at once; their
//! command does when it sets it (`--max-num-seqs`,
//! `--max-running-requests`), and so does llama.cpp's (`-np`).
//!
//! A [`LoadPoller`] reads an endpoint's engine off the call path and
//! publishes what it read on the endpoint ([`super::Endpoint::engine_load`]).
//! Answers come over HTTP: they are hostile until proven otherwise, and an
//! engine that does not answer in its format is taken as one that does not
//! report its load, never as an error of the run.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::EndpointCounters;
use super::prometheus::{self, Sample};
use evalfleet_config::{LoadEngine, LoadSettings};

/// What an engine said of its load at one reading.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineLoad {
    /// How many requests it runs at once (llama.cpp's slots, or what its
    /// command sets), if known.
    pub capacity: Option<usize>,
    /// Requests it runs now (in its batch, or in a busy slot).
    pub running: Option<usize>,
    /// Requests it holds and has not started: its queue.
    pub waiting: Option<usize>,
    /// The share of its KV cache in use, from 0 to 1 (the fullest one,
    /// when it has several engines).
    pub kv_cache: Option<f64>,
}

/// A reading and when it was made.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadReading {
    pub at: Instant,
    pub load: EngineLoad,
}

/// What is known of an endpoint's engine's load.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadState {
    /// How many requests it runs at once, once known: its own word, else
    /// its command's. Kept while readings stop (between engine starts).
    pub capacity: Option<usize>,
    /// The latest reading of this stretch of serving; `None` before the
    /// first and after the stretch ends.
    pub latest: Option<LoadReading>,
    /// Whether it reports its load: `None` while not known yet (or not
    /// asked), `Some(false)` once it showed it does not.
    pub reported: Option<bool>,
    /// Between readings while calls are in flight.
    pub interval: Duration,
}

impl LoadState {
    pub fn new(capacity: Option<usize>, interval: Duration) -> Self {
        Self {
            capacity,
            latest: None,
            reported: None,
            interval,
        }
    }

    /// The latest reading, if made within [`FRESH_READINGS`] intervals of
    /// `now`.
    pub fn fresh(&self, now: Instant) -> Option<EngineLoad> {
        let reading = self.latest?;
        let age = now.saturating_duration_since(reading.at);
        (age <= self.interval * FRESH_READINGS).then_some(reading.load)
    }
}

/// A reading stays current for this many intervals (a missed reading or
/// two, a slow answer, do not make it useless at once).
pub const FRESH_READINGS: u32 = 3;

/// The most an answer may hold; a larger one is not the engine's.
const MAX_ANSWER: usize = 4 << 20;

/// The most requests a reading may say (a larger count is not real).
const MAX_COUNT: f64 = 1e9;

/// The most slots an engine may have (as many as a limit can be).
const MAX_CAPACITY: usize = 100_000;

/// Why a reading did not give the load.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// The engine does not report its load there: the path is absent or
    /// off (404, 501, a 4xx), or its answer is not the engine's format.
    #[error("{0}")]
    NotReported(String),
    /// This answer could not be used (no answer in time, a 5xx, a value
    /// that is not a count): the next one may be.
    #[error("{0}")]
    Unusable(String),
}

impl LoadError {
    fn not_reported(why: impl Into<String>) -> Self {
        Self::NotReported(why.into())
    }

    fn unusable(why: impl Into<String>) -> Self {
        Self::Unusable(why.into())
    }
}

/// The metrics of an engine's `/metrics` answer that tell its load.
struct Names {
    /// Every one of its metrics starts with this.
    prefix: &'static str,
    /// Summed over its series; required.
    running: &'static [&'static str],
    /// Summed over its series and names.
    waiting: &'static [&'static str],
    /// The highest of its series, from the first name that has any.
    kv_cache: &'static [&'static str],
}

fn names(engine: LoadEngine) -> Names {
    match engine {
        LoadEngine::LlamaCpp => Names {
            prefix: "llamacpp:",
            running: &["llamacpp:requests_processing"],
            waiting: &["llamacpp:requests_deferred"],
            // Older servers only.
            kv_cache: &["llamacpp:kv_cache_usage_ratio"],
        },
        LoadEngine::Vllm => Names {
            prefix: "vllm:",
            running: &["vllm:num_requests_running"],
            // Swapped requests (the old engine's preempted ones) wait too.
            waiting: &["vllm:num_requests_waiting", "vllm:num_requests_swapped"],
            kv_cache: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
        },
        LoadEngine::Sglang => Names {
            prefix: "sglang:",
            running: &["sglang:num_running_reqs"],
            waiting: &["sglang:num_queue_reqs", "sglang:num_grammar_queue_reqs"],
            kv_cache: &["sglang:token_usage"],
        },
    }
}

/// Whether a series counts. A tensor or pipeline rank other than the
/// first repeats the first one's requests (SGLang writes one series per
/// rank when asked to); data-parallel ranks and engines each have their
/// own, and are added up.
fn counts(sample: &Sample) -> bool {
    ["tp_rank", "pp_rank", "attn_tp_rank"]
        .iter()
        .all(|rank| sample.label(rank).is_none_or(|r| r == "0"))
}

/// Reads `engine`'s load from its Prometheus `text`. Its running requests
/// are required; the rest is read when there.
pub fn read_metrics(engine: LoadEngine, text: &str) -> Result<EngineLoad, LoadError> {
    let names = names(engine);
    let running = sum(text, names.running)?.ok_or_else(|| {
        LoadError::not_reported(if prometheus::has_prefix(text, names.prefix) {
            format!("its metrics have no {}", names.running.join(" or "))
        } else {
            format!(
                "its answer has no {}* metric (is it {}'s?)",
                names.prefix,
                engine.name()
            )
        })
    })?;
    let waiting = sum(text, names.waiting)?;
    let mut kv_cache = None;
    for name in names.kv_cache {
        let found: Vec<Sample> = prometheus::samples(text, name)
            .into_iter()
            .filter(counts)
            .collect();
        if found.is_empty() {
            continue;
        }
        let mut fullest: f64 = 0.0;
        for sample in &found {
            if !(0.0..=1.0).contains(&sample.value) {
                return Err(LoadError::unusable(format!(
                    "{name} is {}, not a share from 0 to 1",
                    sample.value
                )));
            }
            fullest = fullest.max(sample.value);
        }
        kv_cache = Some(fullest);
        break;
    }
    Ok(EngineLoad {
        capacity: None,
        running: Some(running),
        waiting,
        kv_cache,
    })
}

/// The sum of the counting series of metrics `names`; `None` when none is
/// in `text`.
fn sum(text: &str, names: &[&str]) -> Result<Option<usize>, LoadError> {
    let mut total: Option<usize> = None;
    for name in names {
        for sample in prometheus::samples(text, name) {
            if !counts(&sample) {
                continue;
            }
            let n = count(name, sample.value)?;
            total = Some(total.unwrap_or(0).saturating_add(n));
        }
    }
    Ok(total)
}

/// A number of requests: a whole, finite, non-negative value of sane size.
fn count(name: &str, value: f64) -> Result<usize, LoadError> {
    if value.is_finite() && (0.0..=MAX_COUNT).contains(&value) && value.fract() == 0.0 {
        // In range and whole: the cast is exact.
        Ok(value as usize)
    } else {
        Err(LoadError::unusable(format!(
            "{name} is {value}, not a count of requests"
        )))
    }
}

/// Reads llama.cpp's `GET /slots` answer: its slots are its capacity, the
/// busy ones its running requests (its queue is not there). A slot says
/// `is_processing`, or (before late 2024) `state`, 0 when idle.
pub fn read_slots(body: &[u8]) -> Result<EngineLoad, LoadError> {
    let slots: Vec<serde_json::Value> = serde_json::from_slice(body).map_err(|err| {
        LoadError::not_reported(format!(
            "its answer is not a list of llama.cpp's slots ({err})"
        ))
    })?;
    if slots.is_empty() || slots.len() > MAX_CAPACITY {
        return Err(LoadError::not_reported(format!(
            "it lists {} slots",
            slots.len()
        )));
    }
    let mut running = 0;
    for slot in &slots {
        let busy = slot.as_object().and_then(|slot| {
            match (slot.get("is_processing"), slot.get("state")) {
                (Some(busy), _) => busy.as_bool(),
                (None, Some(state)) => state.as_i64().map(|state| state != 0),
                (None, None) => None,
            }
        });
        match busy {
            Some(busy) => running += usize::from(busy),
            None => {
                return Err(LoadError::not_reported(format!(
                    "a slot says neither is_processing nor state: {}",
                    shown(slot)
                )));
            }
        }
    }
    Ok(EngineLoad {
        capacity: Some(slots.len()),
        running: Some(running),
        waiting: None,
        kv_cache: None,
    })
}

/// A JSON value as a log may show it: short, on one line.
fn shown(value: &serde_json::Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(80) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text,
    }
}

/// Reads llama.cpp's `GET /props` answer: its `total_slots`.
pub fn read_props(body: &[u8]) -> Result<usize, LoadError> {
    let props: serde_json::Value = serde_json::from_slice(body).map_err(|err| {
        LoadError::not_reported(format!("its answer is not llama.cpp's props ({err})"))
    })?;
    let total = props
        .as_object()
        .and_then(|props| props.get("total_slots"))
        .ok_or_else(|| LoadError::not_reported("its props have no total_slots"))?;
    total
        .as_u64()
        .and_then(|n| usize::try_from(n).ok())
        .filter(|n| (1..=MAX_CAPACITY).contains(n))
        .ok_or_else(|| {
            LoadError::not_reported(format!(
                "its total_slots is {total}, not a number of slots from 1 to {MAX_CAPACITY}"
            ))
        })
}

/// Reads an endpoint's engine's load while the endpoint serves, and
/// publishes it on the endpoint. Made by
/// [`super::Endpoint::load_poller`]; [`LoadPoller::run`] is its task.
pub struct LoadPoller {
    pub(super) endpoint: String,
    pub(super) origin: String,
    pub(super) engine: LoadEngine,
    pub(super) settings: LoadSettings,
    pub(super) counters: Arc<EndpointCounters>,
    pub(super) state: Arc<watch::Sender<LoadState>>,
    /// The endpoint's limit, told the engine's capacity and queue.
    pub(super) limit: Arc<super::ConcurrencyLimit>,
    /// Cancelled when this stretch of serving ends.
    pub(super) stop: CancellationToken,
}

/// What became of a try to learn the capacity from `/props`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Props {
    /// Not asked (not llama.cpp, or a path of the user's own).
    NotAsked,
    /// To ask (again: the last try got no usable answer).
    Pending,
    Settled,
}

impl LoadPoller {
    /// Reads once at once, then every interval while the endpoint has
    /// calls in flight, until the stretch of serving ends or the engine
    /// shows it does not report its load. Its latest reading is cleared
    /// when it ends.
    pub async fn run(self) {
        let stop = self.stop.clone();
        tokio::select! {
            () = stop.cancelled() => {}
            () = self.read_while_serving() => {}
        }
        self.state.send_modify(|state| state.latest = None);
    }

    async fn read_while_serving(&self) {
        let Ok(http) = crate::client::http_client(1) else {
            tracing::debug!("Cannot build an HTTP client to read the engine's load.");
            return;
        };
        let interval = self.settings.interval;
        // An answer may take up to an interval, and no less than a second
        // (llama.cpp answers between two steps of its batch).
        let timeout = interval.max(Duration::from_secs(1));
        // The paths to read, best first: one that the engine does not
        // serve gives way to the next.
        let mut sources: Vec<String> = match &self.settings.path {
            Some(path) => vec![path.clone()],
            None => match self.engine {
                LoadEngine::LlamaCpp => vec!["/metrics".to_owned(), "/slots".to_owned()],
                LoadEngine::Vllm | LoadEngine::Sglang => vec!["/metrics".to_owned()],
            },
        };
        let mut props = if self.engine == LoadEngine::LlamaCpp && self.settings.path.is_none() {
            Props::Pending
        } else {
            Props::NotAsked
        };
        let mut absent: Vec<String> = Vec::new();
        // Until a reading worked, it is read idle or not: to learn at once
        // whether the engine reports its load, and what it can run.
        let mut settled = false;
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if settled && self.counters.in_flight.load(Ordering::Relaxed) == 0 {
                continue;
            }
            if props == Props::Pending {
                props = self.learn_capacity(&http, timeout).await;
            }
            let Some(source) = sources.first().cloned() else {
                return;
            };
            match self.read(&http, &source, timeout).await {
                Ok(load) => {
                    settled = true;
                    self.publish(&source, load);
                }
                Err(LoadError::Unusable(why)) => {
                    tracing::debug!(
                        "Endpoint {}: no load reading from GET {source} this time: {why}.",
                        self.endpoint,
                    );
                }
                Err(LoadError::NotReported(why)) => {
                    absent.push(format!("GET {source}: {why}"));
                    sources.remove(0);
                    if sources.is_empty() {
                        self.not_reported(&absent);
                        return;
                    }
                    // The next source is tried at once.
                    tick.reset_immediately();
                }
            }
        }
    }

    /// Asks llama.cpp's `/props` for its slots.
    async fn learn_capacity(&self, http: &reqwest::Client, timeout: Duration) -> Props {
        match get(http, &self.origin, "/props", timeout)
            .await
            .and_then(|body| read_props(&body))
        {
            Ok(slots) => {
                // Told again after a restart only if it changed: the limit
                // may have found fewer calls serve as well.
                if self.state.borrow().capacity != Some(slots) {
                    self.limit.engine_capacity(slots);
                }
                self.state.send_modify(|state| state.capacity = Some(slots));
                Props::Settled
            }
            Err(LoadError::Unusable(_)) => Props::Pending,
            Err(LoadError::NotReported(why)) => {
                tracing::debug!(
                    "Endpoint {}: GET /props does not tell its slots: {why}.",
                    self.endpoint
                );
                Props::Settled
            }
        }
    }

    async fn read(
        &self,
        http: &reqwest::Client,
        path: &str,
        timeout: Duration,
    ) -> Result<EngineLoad, LoadError> {
        let body = get(http, &self.origin, path, timeout).await?;
        read_answer(self.engine, &body)
    }

    fn publish(&self, path: &str, load: EngineLoad) {
        let now = Instant::now();
        let mut first = false;
        // The limit starts at what the engine runs at once, and calls that
        // wait in its queue are the sign of overload (the limit is told
        // before the reading is published).
        let learnt = load
            .capacity
            .filter(|capacity| Some(*capacity) != self.state.borrow().capacity);
        if let Some(capacity) = learnt {
            self.limit.engine_capacity(capacity);
        }
        if let Some(waiting) = load.waiting {
            self.limit.engine_queue(waiting as f64);
        }
        self.state.send_modify(|state| {
            // The engine's own count of its slots comes before its
            // command's.
            if load.capacity.is_some() {
                state.capacity = load.capacity;
            }
            first = state.reported != Some(true);
            state.reported = Some(true);
            state.latest = Some(LoadReading {
                at: now,
                load: EngineLoad {
                    capacity: state.capacity,
                    ..load
                },
            });
        });
        if first {
            let capacity = self.state.borrow().capacity;
            tracing::info!(
                "Endpoint {} reads its engine's load at GET {path}{}.",
                self.endpoint,
                capacity.map_or_else(
                    || " (it does not say how many requests it runs at once)".to_owned(),
                    |n| format!("; the engine runs {n} requests at once")
                )
            );
        }
    }

    fn not_reported(&self, why: &[String]) {
        let mut known = false;
        self.state.send_modify(|state| {
            known = state.reported == Some(false);
            state.reported = Some(false);
            state.latest = None;
        });
        // Said once, not again at each restart of the engine.
        if known {
            return;
        }
        tracing::info!(
            "Endpoint {}: its engine does not report its load ({}); its concurrency limit is found from its answers alone.",
            self.endpoint,
            why.join("; ")
        );
    }
}

/// A URL's scheme, host and port: an engine's own paths are there, not
/// under its API's base URL.
pub(super) fn origin(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(parsed) => parsed.origin().ascii_serialization(),
        Err(_) => url.trim_end_matches('/').to_owned(),
    }
}

/// Reads an answer of `engine` by its shape: a JSON list is llama.cpp's
/// slots; anything else is taken as Prometheus text.
pub fn read_answer(engine: LoadEngine, body: &[u8]) -> Result<EngineLoad, LoadError> {
    let text = String::from_utf8_lossy(body);
    if engine == LoadEngine::LlamaCpp && text.trim_start().starts_with('[') {
        return read_slots(body);
    }
    read_metrics(engine, &text)
}

/// `GET origin + path`: the body of a 2xx answer, at most [`MAX_ANSWER`]
/// long.
async fn get(
    http: &reqwest::Client,
    origin: &str,
    path: &str,
    timeout: Duration,
) -> Result<Vec<u8>, LoadError> {
    let url = format!("{origin}{path}");
    let answer = async {
        let mut response = http
            .get(&url)
            .send()
            .await
            .map_err(|err| LoadError::unusable(evalfleet_types::root_cause(&err)))?;
        let status = response.status();
        if !status.is_success() {
            let why = format!("HTTP {}{}", status.as_u16(), excerpt(response).await);
            // A server error or a refusal may pass; a path that is absent,
            // off or forbidden stays so.
            return Err(
                if status.is_server_error() && status.as_u16() != 501
                    || status.as_u16() == 429
                    || status.as_u16() == 408
                {
                    LoadError::unusable(why)
                } else {
                    LoadError::not_reported(why)
                },
            );
        }
        if response
            .content_length()
            .is_some_and(|n| n > MAX_ANSWER as u64)
        {
            return Err(too_large());
        }
        let mut body = Vec::new();
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|err| LoadError::unusable(evalfleet_types::root_cause(&err)))?
        {
            if body.len() + chunk.len() > MAX_ANSWER {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    };
    match tokio::time::timeout(timeout, answer).await {
        Ok(result) => result,
        Err(_) => Err(LoadError::unusable(format!(
            "no answer within {}",
            humantime::format_duration(timeout)
        ))),
    }
}

fn too_large() -> LoadError {
    LoadError::not_reported(format!(
        "its answer is larger than {} MiB",
        MAX_ANSWER >> 20
    ))
}

/// The start of an error answer's text, for the log: llama.cpp says there
/// how to turn the path on.
async fn excerpt(response: reqwest::Response) -> String {
    const SHOWN: usize = 200;
    let Ok(bytes) = response.bytes().await else {
        return String::new();
    };
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(4096)]);
    // llama.cpp's errors are `{"error": {"message": ...}}`.
    let message = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v.pointer("/error/message")?.as_str().map(str::to_owned))
        .unwrap_or_else(|| text.into_owned());
    let clean: String = message
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(SHOWN)
        .collect();
    let clean = clean.trim();
    if clean.is_empty() {
        String::new()
    } else {
        format!(": {clean}")
    }
}
