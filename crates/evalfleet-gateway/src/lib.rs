//! The gateway: an OpenAI-compatible API over the run's fleet, for agents
//! (`kind: exec`). Each item's run of its agent gets an address of its own
//! ([`Pass`]: `…/gw/<token>/v1`, the token also taken as the API key), so
//! every call the agent makes is the item's, in order, whatever the agent
//! sends.
//!
//! A call is routed by the model name the agent asks for (`task.models`
//! maps names to endpoints) to whichever endpoint for it takes calls and
//! has a free slot first, under its limits and rates, and made on the
//! fleet's one call path ([`evalfleet_fleet::call::send_with`]), which feeds
//! its outcome back to the endpoint's limit, breaker and rates. A call that
//! fails before its first byte (no connection, a 429 or 5xx) goes to
//! another endpoint of the model; once the answer has begun it goes to the
//! agent as it comes (a stream chunk by chunk, with its usage asked for).
//! What the agent gets on failure is OpenAI's error format with the status
//! its SDK retries on (429, 503) or not (400, 401, 404).
//!
//! The HTTP side is the server's (`evalfleet_server::gateway`); this is
//! what it calls.

pub mod token;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use evalfleet_types::{AgentCall, CacheEntry, ErrorClass, Telemetry, now_ms};
use reqwest::header::HeaderValue;
use serde_json::{Map, Value};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use evalfleet_config::Budget;
use evalfleet_fleet::call::{self, Call, Exchange};
use evalfleet_fleet::client::{Api, CallError, Head};
use evalfleet_fleet::runtime::FleetHandle;
use evalfleet_fleet::{Endpoint, Permit};
use token::{Claims, Keys};

/// A run's gateway.
pub struct Gateway {
    run_id: String,
    keys: Keys,
    endpoints: Vec<Arc<Endpoint>>,
    routes: Routes,
    fleet: FleetHandle,
    /// The live attempts' grants, by (seq, attempt).
    grants: Mutex<HashMap<(u64, u32), Arc<Grant>>>,
    /// How long a call waits for an endpoint of its model to take it.
    wait: Duration,
    stop: CancellationToken,
    /// The run's response cache, once the session has linked it.
    cache: std::sync::OnceLock<CacheLink>,
    /// Its calls in flight, and the servers that serve it.
    tracker: tokio_util::task::TaskTracker,
}

/// Looks a key up in the response cache.
pub type CacheGet = Arc<
    dyn Fn(String) -> futures_util::future::BoxFuture<'static, Option<CacheEntry>> + Send + Sync,
>;
/// Hands an answer to the response cache (with the session's writer).
pub type CachePut = Arc<dyn Fn(CacheEntry) + Send + Sync>;

/// How the gateway reaches the session's response cache (`cache.mode`).
pub struct CacheLink {
    pub get: Option<CacheGet>,
    pub put: Option<CachePut>,
}

/// Which endpoints answer which model names.
struct Routes {
    /// `task.models`: a name, and the endpoints (indexes) it maps to.
    aliases: Vec<(String, Vec<usize>)>,
    /// Any other name (`*`, or the endpoints that answer items when
    /// `task.models` is empty).
    default: Option<Vec<usize>>,
}

/// One item's attempt, as the gateway knows it while it runs.
pub struct Grant {
    pub seq: u64,
    pub attempt: u32,
    /// Which of its row's samples the item is (`task.n`).
    sample: u32,
    budget: Budget,
    opened: Instant,
    next_index: AtomicU32,
    tokens: AtomicU64,
    calls: Mutex<Vec<AgentCall>>,
    /// Calls under way (their records not yet kept), and a wake-up when
    /// one ends.
    in_flight: AtomicU32,
    settled: tokio::sync::Notify,
    /// Set when the attempt has ended: no call is taken any more.
    closed: std::sync::atomic::AtomicBool,
    /// Cancels the calls still under way when the attempt ends.
    abandon: CancellationToken,
}

/// A call under way for a grant: the grant waits for it to be recorded.
struct Flight(Arc<Grant>);

impl Flight {
    /// A call of `grant` begins.
    fn enter(grant: &Arc<Grant>) -> Arc<Self> {
        grant.in_flight.fetch_add(1, Ordering::AcqRel);
        Arc::new(Self(grant.clone()))
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.0.settled.notify_waiters();
    }
}

/// How long an ended attempt waits for the records of its calls still
/// under way (cancelled as it ends).
const SETTLE: Duration = Duration::from_secs(5);

/// An item's open address at the gateway: its token dies when this is
/// closed or dropped.
pub struct Pass {
    gateway: Arc<Gateway>,
    grant: Arc<Grant>,
    /// The token: the path segment `/gw/<token>/v1` and the API key.
    pub token: String,
}

impl Pass {
    /// Ends the attempt's address: no call is taken from now on, and those
    /// still under way (a stream the agent left unread) are cancelled;
    /// gives its calls, in order, once they are recorded (or after a few
    /// seconds).
    pub async fn close(self) -> Vec<AgentCall> {
        self.gateway.forget(&self.grant);
        self.grant.closed.store(true, Ordering::Release);
        self.grant.abandon.cancel();
        let deadline = Instant::now() + SETTLE;
        loop {
            let settled = self.grant.settled.notified();
            if self.grant.in_flight.load(Ordering::Acquire) == 0 {
                break;
            }
            if tokio::time::timeout_at(deadline, settled).await.is_err() {
                tracing::warn!(
                    "Item {} attempt {}: calls still under way when it ended were not recorded.",
                    self.grant.seq,
                    self.grant.attempt
                );
                break;
            }
        }
        let mut calls = self
            .grant
            .calls
            .lock()
            .map(|mut calls| std::mem::take(&mut *calls))
            .unwrap_or_default();
        calls.sort_by_key(|c| c.index);
        calls
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        self.gateway.forget(&self.grant);
    }
}

/// An error as the agent gets it: OpenAI's format and a status its SDK
/// knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayError {
    pub status: u16,
    /// `error.type`.
    pub kind: &'static str,
    /// `error.code`.
    pub code: &'static str,
    pub message: String,
    /// `Retry-After`, in seconds.
    pub retry_after: Option<u64>,
    /// `x-should-retry`, which OpenAI's SDKs follow.
    pub should_retry: Option<bool>,
}

impl GatewayError {
    pub fn new(status: u16, kind: &'static str, code: &'static str, message: String) -> Self {
        Self {
            status,
            kind,
            code,
            message,
            retry_after: None,
            should_retry: None,
        }
    }

    /// 401: no token, or not a live one.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(
            401,
            "invalid_request_error",
            "invalid_api_key",
            message.into(),
        )
        .final_()
    }

    /// 400: the request cannot be forwarded.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(
            400,
            "invalid_request_error",
            "invalid_request",
            message.into(),
        )
    }

    fn final_(mut self) -> Self {
        self.should_retry = Some(false);
        self
    }

    /// The error body.
    pub fn body(&self) -> Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": null,
                "code": self.code,
            }
        })
    }
}

/// A request an agent sent.
pub struct Asked {
    pub api: Api,
    pub body: Bytes,
    /// `traceparent`, when the agent sent one.
    pub traceparent: Option<String>,
}

/// What the agent gets.
pub enum Answer {
    /// The endpoint's answer (or its error response, passed on as it came:
    /// the request's own fault).
    Head(Head),
    /// Our error.
    Error(GatewayError),
}

impl Gateway {
    /// The gateway of run `run_id` over `endpoints`, routing the names of
    /// `models` (name → endpoint name or model; `*` any other).
    pub fn new(
        run_id: &str,
        endpoints: Vec<Arc<Endpoint>>,
        fleet: FleetHandle,
        models: &[(String, String)],
        wait: Duration,
        stop: CancellationToken,
    ) -> Result<Arc<Self>, String> {
        let routes = Routes::new(&endpoints, models)?;
        Ok(Arc::new(Self {
            run_id: run_id.to_owned(),
            keys: Keys::random(),
            endpoints,
            routes,
            fleet,
            grants: Mutex::new(HashMap::new()),
            wait,
            stop,
            cache: std::sync::OnceLock::new(),
            tracker: tokio_util::task::TaskTracker::new(),
        }))
    }

    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Runs `work` (a server of the gateway) until it ends or the gateway
    /// shuts down.
    pub fn spawn(&self, work: futures_util::future::BoxFuture<'static, ()>) {
        let stop = self.stop.clone();
        self.tracker.spawn(async move {
            tokio::select! {
                () = work => {}
                () = stop.cancelled() => {}
            }
        });
    }

    /// Ends its calls in flight (abandoned) and its servers, and waits for
    /// them.
    pub async fn shutdown(&self) {
        self.stop.cancel();
        self.tracker.close();
        self.tracker.wait().await;
    }

    /// Answers calls from the session's response cache, and keeps their
    /// answers there, as `link` says (once per gateway).
    pub fn link_cache(&self, link: CacheLink) {
        let _ = self.cache.set(link);
    }

    /// Opens the address of attempt `attempt` of item `seq`, live for at
    /// most `ttl`, with `budget`.
    pub fn open(
        self: &Arc<Self>,
        seq: u64,
        sample: u32,
        attempt: u32,
        budget: Budget,
        ttl: Duration,
    ) -> Pass {
        let expires_ms =
            now_ms().saturating_add(i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX));
        let token = self.keys.sign(&Claims {
            run_id: self.run_id.clone(),
            seq,
            attempt,
            expires_ms,
        });
        let grant = Arc::new(Grant {
            seq,
            attempt,
            sample,
            budget,
            opened: Instant::now(),
            next_index: AtomicU32::new(0),
            tokens: AtomicU64::new(0),
            calls: Mutex::new(Vec::new()),
            in_flight: AtomicU32::new(0),
            settled: tokio::sync::Notify::new(),
            closed: std::sync::atomic::AtomicBool::new(false),
            abandon: self.stop.child_token(),
        });
        if let Ok(mut grants) = self.grants.lock() {
            grants.insert((seq, attempt), grant.clone());
        }
        Pass {
            gateway: self.clone(),
            grant,
            token,
        }
    }

    fn forget(&self, grant: &Arc<Grant>) {
        if let Ok(mut grants) = self.grants.lock()
            && grants
                .get(&(grant.seq, grant.attempt))
                .is_some_and(|g| Arc::ptr_eq(g, grant))
        {
            grants.remove(&(grant.seq, grant.attempt));
        }
    }

    /// The live attempt `token` names (401 when there is none).
    pub fn check(&self, token: &str) -> Result<Arc<Grant>, GatewayError> {
        let claims = self
            .keys
            .verify(token, now_ms())
            .map_err(|err| GatewayError::unauthorized(format!("{err}.")))?;
        if claims.run_id != self.run_id {
            return Err(GatewayError::unauthorized("the token is not for this run."));
        }
        self.grants
            .lock()
            .ok()
            .and_then(|grants| grants.get(&(claims.seq, claims.attempt)).cloned())
            .ok_or_else(|| {
                GatewayError::unauthorized("the token's attempt has ended: it is no longer valid.")
            })
    }

    /// `GET /v1/models`: the names the agent may ask for.
    pub fn models(&self) -> Value {
        let mut names: Vec<&str> = self
            .routes
            .aliases
            .iter()
            .map(|(n, _)| n.as_str())
            .collect();
        for endpoint in &self.endpoints {
            if endpoint.config.takes_items() && !names.contains(&endpoint.model.as_str()) {
                names.push(&endpoint.model);
            }
        }
        names.retain(|n| *n != "*");
        let data: Vec<Value> = names
            .iter()
            .map(|name| serde_json::json!({"id": name, "object": "model", "created": 0, "owned_by": "evalfleet"}))
            .collect();
        serde_json::json!({"object": "list", "data": data})
    }

    /// Makes the call `asked` for the attempt of `grant`.
    pub async fn call(self: &Arc<Self>, grant: Arc<Grant>, asked: Asked) -> Answer {
        // Counted under way before the attempt can be seen closed: a close
        // then waits for this call's record.
        let flight = Flight::enter(&grant);
        if grant.closed.load(Ordering::Acquire) {
            return Answer::Error(GatewayError::unauthorized(
                "the token's attempt has ended: it is no longer valid.",
            ));
        }
        let index = grant.next_index.fetch_add(1, Ordering::AcqRel) + 1;
        let mut record = AgentCall {
            seq: grant.seq,
            attempt: grant.attempt,
            index,
            call_id: format!("{}.{}.{}", grant.seq, grant.attempt, index),
            api: asked.api.name().to_owned(),
            sent_at_ms: now_ms(),
            request: evalfleet_fleet::client::cut_body(&String::from_utf8_lossy(&asked.body)),
            request_cut: asked.body.len() > evalfleet_types::BODY_KEPT,
            ..AgentCall::default()
        };
        if let Some(refused) = grant.over_budget(index) {
            return self.refuse(&grant, record, refused);
        }
        let body = match serde_json::from_slice::<Value>(&asked.body) {
            Ok(Value::Object(body)) => body,
            Ok(_) => {
                return self.refuse(
                    &grant,
                    record,
                    GatewayError::bad_request("the request body must be a JSON object."),
                );
            }
            Err(err) => {
                return self.refuse(
                    &grant,
                    record,
                    GatewayError::bad_request(format!("the request body is not JSON: {err}.")),
                );
            }
        };
        record.tags = tags(&body, asked.traceparent.as_deref());
        let Some(asked_model) = body.get("model").and_then(Value::as_str).map(str::to_owned) else {
            return self.refuse(
                &grant,
                record,
                GatewayError::bad_request("the request names no model."),
            );
        };
        record.asked_model = asked_model.clone();
        let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
        record.stream = stream;
        if stream && asked.api == Api::Embeddings {
            return self.refuse(
                &grant,
                record,
                GatewayError::bad_request("embeddings are not streamed."),
            );
        }
        let Some(candidates) = self.routes.resolve(&asked_model, &self.endpoints) else {
            let error = GatewayError::new(
                404,
                "invalid_request_error",
                "model_not_found",
                format!("The model '{asked_model}' is not served by this run (task.models names the models an agent may ask for)."),
            )
            .final_();
            return self.refuse(&grant, record, error);
        };
        let cache_key = self.cache_key(asked.api, grant.sample, index, &candidates, &body);
        // A retry reads nothing from the cache: the answers that made the
        // attempt before it fail would make it fail again.
        let reads = grant.attempt == 1;
        if let (Some(key), Some(get), true) = (
            &cache_key,
            self.cache.get().and_then(|c| c.get.clone()),
            reads,
        ) && let Some(hit) = get(key.clone()).await
            && let Some(answer) = from_cache(&hit, stream)
        {
            record.cached = true;
            record.http_status = 200;
            record.telemetry = Telemetry {
                endpoint: hit.endpoint.clone(),
                model: hit.model.clone(),
                prompt_tokens: hit.prompt_tokens,
                completion_tokens: hit.completion_tokens,
                finish_reason: hit.finish_reason.clone(),
                ..Telemetry::default()
            };
            record.response = message_of(&hit.content);
            grant.ended(record);
            return answer;
        }
        let max_tokens = body
            .get("max_completion_tokens")
            .or_else(|| body.get("max_tokens"))
            .or_else(|| body.get("max_output_tokens"))
            .and_then(Value::as_u64)
            .unwrap_or(256);
        let cost = asked.body.len() as u64 / 4 + max_tokens;
        let mut left: Vec<Arc<Endpoint>> = candidates
            .iter()
            .map(|i| self.endpoints[*i].clone())
            .collect();
        let mut last: Option<(Exchange, Arc<Endpoint>, Head)> = None;
        while !left.is_empty() {
            let Some((endpoint, permit, client)) = self.admit_any(&left).await else {
                break;
            };
            left.retain(|e| !Arc::ptr_eq(e, &endpoint));
            if !call::pace(&endpoint, cost, &self.stop).await {
                break;
            }
            let sent = rewrite(&body, &endpoint.model, asked.api, stream);
            let (head_tx, head_rx) = oneshot::channel();
            let (done_tx, done_rx) = oneshot::channel();
            let fleet = self.fleet.clone();
            let api = asked.api;
            let for_call = endpoint.clone();
            let grant_for = grant.clone();
            let mut partial = record.clone();
            let put = cache_key
                .clone()
                .zip(self.cache.get().and_then(|c| c.put.clone()));
            let flight_for = flight.clone();
            let abandon = grant.abandon.clone();
            self.tracker.spawn(async move {
                let _flight = flight_for;
                let mut kept = None;
                let delivered = std::sync::atomic::AtomicBool::new(false);
                let timeout = for_call.timeout;
                let exchange = call::send_with(
                    Call {
                        endpoint: for_call.clone(),
                        client: client.clone(),
                        permit,
                        cost,
                    },
                    async {
                        let forwarded =
                            client.forward(api, sent, stream, head_tx, &delivered).await;
                        kept = forwarded.response;
                        forwarded.outcome
                    },
                    timeout,
                    &abandon,
                    &fleet,
                )
                .await;
                if delivered.load(Ordering::Acquire) {
                    // The agent has (or is reading) this answer: it is the
                    // call's record.
                    partial.response = kept;
                    fill(&mut partial, &exchange, &for_call);
                    if let (Some((key, put)), Exchange::Done { result: Ok(_), .. }) =
                        (put, &exchange)
                        && let Some(entry) = to_cache(key, api, &partial)
                    {
                        put(entry);
                    }
                    grant_for.ended(partial);
                } else if let Err((exchange, kept)) = done_tx.send((exchange, kept)) {
                    // Nobody waits for it (the agent went away): recorded
                    // as it ended.
                    partial.response = kept;
                    fill(&mut partial, &exchange, &for_call);
                    grant_for.ended(partial);
                }
            });
            // No head: the call ended before its first byte without a word
            // (its time ran out, its endpoint was taken out of service, the
            // attempt ended): a failure like any other before the first byte.
            let head = head_rx.await.unwrap_or(Head::Failed {
                status: None,
                content_type: None,
                body: Bytes::new(),
            });
            match head {
                Head::Failed {
                    status,
                    content_type,
                    body: error_body,
                } => {
                    let (exchange, kept) = match done_rx.await {
                        Ok(done) => done,
                        Err(_) => break,
                    };
                    let failed = Head::Failed {
                        status,
                        content_type,
                        body: error_body,
                    };
                    // An endpoint's own refusal of evalfleet (its key, a
                    // model or API it lacks) is its fault, not the agent's.
                    let again = match status {
                        None => true,
                        Some(status) => {
                            matches!(status, 401 | 403 | 404 | 408 | 429) || status >= 500
                        }
                    };
                    if again && !left.is_empty() {
                        tracing::debug!(
                            "Gateway call {} failed on {} before its first byte; trying another endpoint.",
                            record.call_id,
                            endpoint.name
                        );
                        last = Some((exchange, endpoint, failed));
                        continue;
                    }
                    record.response = kept;
                    fill(&mut record, &exchange, &endpoint);
                    let answer = failure_answer(&exchange, failed);
                    grant.ended(record);
                    return answer;
                }
                head => return Answer::Head(head),
            }
        }
        if let Some((exchange, endpoint, failed)) = last {
            fill(&mut record, &exchange, &endpoint);
            let answer = failure_answer(&exchange, failed);
            grant.ended(record);
            return answer;
        }
        let mut error = GatewayError::new(
            503,
            "server_error",
            "no_endpoint",
            format!(
                "No endpoint for model '{asked_model}' took the call within {}.",
                humantime::format_duration(self.wait)
            ),
        );
        error.retry_after = Some(1);
        self.refuse(&grant, record, error)
    }

    /// Records a call refused before any endpoint was asked, and answers it.
    fn refuse(&self, grant: &Grant, mut record: AgentCall, error: GatewayError) -> Answer {
        record.http_status = error.status;
        record.error = Some(error.message.clone());
        record.error_class = Some(if error.status == 429 || error.status == 503 {
            ErrorClass::BackPressure
        } else {
            ErrorClass::Fatal
        });
        grant.ended(record);
        Answer::Error(error)
    }

    /// Waits until one of `endpoints` takes calls and has a free slot; the
    /// first to have one takes the call.
    async fn admit_any(
        &self,
        endpoints: &[Arc<Endpoint>],
    ) -> Option<(
        Arc<Endpoint>,
        Permit,
        Arc<evalfleet_fleet::client::ChatClient>,
    )> {
        let deadline = Instant::now() + self.wait;
        loop {
            // The least loaded first (in flight for its limit; ties drawn
            // at random): the first of them with a free slot takes the call.
            let mut ordered: Vec<(f64, u64, &Arc<Endpoint>)> = endpoints
                .iter()
                .map(|e| {
                    let load = e.limit.in_flight() as f64 / e.limit.current().max(1) as f64;
                    (load, fastrand::u64(..), e)
                })
                .collect();
            ordered.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            let waits: Vec<_> = ordered
                .into_iter()
                .map(|(_, _, endpoint)| {
                    let stop = self.stop.clone();
                    Box::pin(async move {
                        let permit = call::admit(endpoint, &stop).await?;
                        Some((endpoint.clone(), permit))
                    })
                })
                .collect();
            let first =
                tokio::time::timeout_at(deadline, futures_util::future::select_all(waits)).await;
            let (endpoint, permit) = match first {
                Ok((Some(admitted), _, _)) => admitted,
                Ok((None, _, _)) | Err(_) => return None,
            };
            match endpoint.client() {
                Some(client) => return Some((endpoint, permit, client)),
                // Not started yet (or restarting): another turn.
                None => {
                    drop(permit);
                    if tokio::time::timeout_at(
                        deadline,
                        tokio::time::sleep(Duration::from_millis(50)),
                    )
                    .await
                    .is_err()
                    {
                        return None;
                    }
                }
            }
        }
    }
}

impl Gateway {
    /// The cache key of call `index` of an attempt of sample `sample` of a
    /// row: its API, the models that may answer it, its place in the
    /// attempt (an agent that asks the same twice means to ask twice; the
    /// same agent run again asks the same things in the same order), the
    /// sample, and its body without the model's name. `None` where the cache is not used: it is off, or the API is
    /// neither chat completions nor embeddings.
    fn cache_key(
        &self,
        api: Api,
        sample: u32,
        index: u32,
        candidates: &[usize],
        body: &Map<String, Value>,
    ) -> Option<String> {
        self.cache.get()?;
        if !matches!(api, Api::ChatCompletions | Api::Embeddings) {
            return None;
        }
        let mut models: Vec<&str> = candidates
            .iter()
            .map(|i| self.endpoints[*i].model.as_str())
            .collect();
        models.sort_unstable();
        models.dedup();
        let identity = format!("gateway\n{}\n{}\n{index}", api.name(), models.join("\n"));
        let mut body = body.clone();
        body.remove("model");
        // Whether it is streamed changes nothing of the answer.
        body.remove("stream");
        body.remove("stream_options");
        let text = serde_json::value::to_raw_value(&body).ok()?;
        Some(evalfleet_config::cache::key(&identity, sample, &text))
    }
}

/// A call's answer as the cache keeps it: a whole response body (a chat
/// completion, put together from a stream's message; embeddings as they
/// came).
fn to_cache(key: String, api: Api, record: &AgentCall) -> Option<CacheEntry> {
    let response = record.response.as_deref()?;
    if response.len() >= evalfleet_types::BODY_KEPT {
        return None;
    }
    let content = match api {
        Api::ChatCompletions => {
            let message: Value = serde_json::from_str(response).ok()?;
            serde_json::json!({
                "id": format!("chatcmpl-cached-{}", record.call_id),
                "object": "chat.completion",
                "created": record.sent_at_ms / 1000,
                "model": record.telemetry.model,
                "choices": [{"index": 0, "message": message, "finish_reason": record.telemetry.finish_reason}],
                "usage": {
                    "prompt_tokens": record.telemetry.prompt_tokens,
                    "completion_tokens": record.telemetry.completion_tokens,
                    "total_tokens": record.telemetry.prompt_tokens.unwrap_or(0) + record.telemetry.completion_tokens.unwrap_or(0),
                },
            })
            .to_string()
        }
        Api::Embeddings => response.to_owned(),
        Api::Completions | Api::Responses => return None,
    };
    Some(CacheEntry {
        key,
        content,
        endpoint: record.telemetry.endpoint.clone(),
        model: record.telemetry.model.clone(),
        prompt_tokens: record.telemetry.prompt_tokens,
        completion_tokens: record
            .telemetry
            .completion_tokens
            .filter(|_| !record.telemetry.tokens_estimated),
        finish_reason: record.telemetry.finish_reason.clone(),
        latency_ms: record.telemetry.latency_ms,
        created_at_ms: now_ms(),
    })
}

/// The assistant's message of a cached chat completion (what a call's
/// record keeps), or the body.
fn message_of(content: &str) -> Option<String> {
    let value: Value = serde_json::from_str(content).ok()?;
    Some(match value.pointer("/choices/0/message") {
        Some(message) => message.to_string(),
        None => content.to_owned(),
    })
}

/// What the agent gets from a cached answer: the body, or a stream made
/// of it (the whole message in one chunk, then its finish and usage).
fn from_cache(hit: &CacheEntry, stream: bool) -> Option<Answer> {
    let json = Some(HeaderValue::from_static("application/json"));
    if !stream {
        return Some(Answer::Head(Head::Whole {
            status: 200,
            content_type: json,
            body: Bytes::from(hit.content.clone()),
        }));
    }
    let value: Value = serde_json::from_str(&hit.content).ok()?;
    let mut message = value.pointer("/choices/0/message")?.clone();
    if let Some(calls) = message.get_mut("tool_calls").and_then(Value::as_array_mut) {
        for (i, call) in calls.iter_mut().enumerate() {
            call["index"] = Value::from(i);
        }
    }
    let base = serde_json::json!({
        "id": value.get("id"), "object": "chat.completion.chunk",
        "created": value.get("created"), "model": value.get("model"),
    });
    let chunk = |choices: Value, usage: Option<&Value>| {
        let mut chunk = base.clone();
        chunk["choices"] = choices;
        if let Some(usage) = usage {
            chunk["usage"] = usage.clone();
        }
        format!("data: {chunk}\n\n")
    };
    let mut text = chunk(
        serde_json::json!([{"index": 0, "delta": message, "finish_reason": null}]),
        None,
    );
    text.push_str(&chunk(
        serde_json::json!([{"index": 0, "delta": {}, "finish_reason": value.pointer("/choices/0/finish_reason")}]),
        None,
    ));
    text.push_str(&chunk(serde_json::json!([]), value.get("usage")));
    text.push_str("data: [DONE]\n\n");
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let _ = tx.try_send(Bytes::from(text));
    Some(Answer::Head(Head::Stream {
        status: 200,
        content_type: Some(HeaderValue::from_static("text/event-stream")),
        chunks: rx,
        complete: Arc::new(std::sync::atomic::AtomicBool::new(true)),
    }))
}

impl Grant {
    /// The refusal of call `index` when it is past the attempt's budget.
    fn over_budget(&self, index: u32) -> Option<GatewayError> {
        let spent = |what: String| {
            Some(GatewayError::new(429, "insufficient_quota", "budget_exhausted", what).final_())
        };
        if let Some(calls) = self.budget.calls
            && index > calls
        {
            return spent(format!("This item's budget of {calls} calls is spent."));
        }
        if let Some(tokens) = self.budget.tokens
            && self.tokens.load(Ordering::Acquire) >= tokens
        {
            return spent(format!("This item's budget of {tokens} tokens is spent."));
        }
        if let Some(time) = self.budget.time
            && self.opened.elapsed() >= time
        {
            return spent(format!(
                "This item's time budget of {} is spent.",
                humantime::format_duration(time)
            ));
        }
        None
    }

    /// A call ended: its record is kept and its tokens counted.
    fn ended(&self, record: AgentCall) {
        let tokens = record.telemetry.prompt_tokens.unwrap_or(0)
            + record.telemetry.completion_tokens.unwrap_or(0);
        self.tokens.fetch_add(tokens, Ordering::AcqRel);
        if let Ok(mut calls) = self.calls.lock() {
            calls.push(record);
        }
    }
}

impl Routes {
    fn new(endpoints: &[Arc<Endpoint>], models: &[(String, String)]) -> Result<Self, String> {
        let items: Vec<usize> = (0..endpoints.len())
            .filter(|i| endpoints[*i].config.takes_items())
            .collect();
        let mut aliases = Vec::new();
        let mut default = None;
        for (name, to) in models {
            let targets: Vec<usize> = (0..endpoints.len())
                .filter(|i| endpoints[*i].name == *to || endpoints[*i].model == *to)
                .collect();
            if targets.is_empty() {
                return Err(format!(
                    "task.models.{name}: no endpoint is named '{to}' or serves a model of that name"
                ));
            }
            if name == "*" {
                default = Some(targets);
            } else {
                aliases.push((name.clone(), targets));
            }
        }
        if models.is_empty() && !items.is_empty() {
            default = Some(items);
        }
        Ok(Self { aliases, default })
    }

    /// The endpoints for the model `name`.
    fn resolve(&self, name: &str, endpoints: &[Arc<Endpoint>]) -> Option<Vec<usize>> {
        if let Some((_, targets)) = self.aliases.iter().find(|(n, _)| n == name) {
            return Some(targets.clone());
        }
        // A judge's endpoint is reached only where task.models names it.
        let named: Vec<usize> = (0..endpoints.len())
            .filter(|i| endpoints[*i].config.takes_items())
            .filter(|i| endpoints[*i].model == name || endpoints[*i].name == name)
            .collect();
        if !named.is_empty() {
            return Some(named);
        }
        self.default.clone()
    }
}

/// The body sent to an endpoint: the agent's, with the endpoint's model,
/// and a stream's usage asked for.
fn rewrite(body: &Map<String, Value>, model: &str, api: Api, stream: bool) -> Bytes {
    let mut body = body.clone();
    body.insert("model".to_owned(), Value::String(model.to_owned()));
    if stream && matches!(api, Api::ChatCompletions | Api::Completions) {
        let options = body
            .entry("stream_options")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(options) = options {
            options.insert("include_usage".to_owned(), Value::Bool(true));
        } else {
            *options = serde_json::json!({"include_usage": true});
        }
    }
    Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
}

/// The tags a request carries: `traceparent`, `user`, `metadata`.
fn tags(body: &Map<String, Value>, traceparent: Option<&str>) -> Option<String> {
    let mut tags = Map::new();
    if let Some(trace) = traceparent {
        tags.insert(
            "traceparent".to_owned(),
            Value::String(trace.chars().take(256).collect()),
        );
    }
    for key in ["user", "metadata"] {
        if let Some(value) = body.get(key).filter(|v| !v.is_null()) {
            tags.insert(key.to_owned(), value.clone());
        }
    }
    (!tags.is_empty()).then(|| evalfleet_fleet::client::cut_body(&Value::Object(tags).to_string()))
}

/// Fills `record` with what `exchange` on `endpoint` came to.
fn fill(record: &mut AgentCall, exchange: &Exchange, endpoint: &Endpoint) {
    record.telemetry = Telemetry {
        endpoint: endpoint.name.clone(),
        model: endpoint.model.clone(),
        ..Telemetry::default()
    };
    match exchange {
        // What the store keeps of any call (an attempt's record), with the
        // status the agent got.
        Exchange::Done { .. } => {
            if let Some(attempt) = exchange.record(endpoint, record.seq, record.attempt, 0) {
                record.sent_at_ms = attempt.sent_at_ms;
                record.telemetry = attempt.telemetry;
                record.http_status = attempt.http_status.unwrap_or(502);
                record.error_class = attempt.error_class;
                record.error = attempt.error;
            }
        }
        Exchange::Moved { .. } => {
            record.http_status = 503;
            record.error_class = Some(ErrorClass::BackPressure);
            record.error = Some(format!(
                "{} stopped taking calls during the call",
                endpoint.name
            ));
        }
        Exchange::Cancelled { why, .. } => {
            record.http_status = 499;
            record.error = Some(format!("cancelled: {why}"));
        }
        Exchange::Abandoned => {
            record.http_status = 499;
            record.error = Some("abandoned: the run stopped".to_owned());
        }
    }
}

/// What the agent gets when its call failed before any byte of an answer
/// on every endpoint tried: the endpoint's own error response where it
/// gave one that is the request's fault (4xx), else ours.
fn failure_answer(exchange: &Exchange, failed: Head) -> Answer {
    if let Head::Failed {
        status: Some(status),
        ..
    } = &failed
        && (400..500).contains(status)
        && !matches!(*status, 401 | 403 | 408 | 429)
    {
        return Answer::Head(failed);
    }
    let error = match exchange {
        Exchange::Done {
            result: Err(err), ..
        } => err,
        _ => {
            let mut error = GatewayError::new(
                503,
                "server_error",
                "endpoint_unavailable",
                "The endpoint stopped taking calls.".to_owned(),
            );
            error.retry_after = Some(1);
            return Answer::Error(error);
        }
    };
    let retry_after = error.retry_after().map(|d| d.as_secs().max(1));
    let mut answer = match error {
        CallError::Status {
            status: status @ (401 | 403),
            message,
            ..
        } => GatewayError::new(
            502,
            "server_error",
            "endpoint_refused",
            format!(
                "The endpoint refused evalfleet's request (HTTP {status}: {message}): check the endpoint's api_key."
            ),
        ),
        CallError::Status {
            status: 429,
            message,
            ..
        } => GatewayError::new(
            429,
            "rate_limit_error",
            "rate_limit_exceeded",
            format!("Rate limited by the endpoint: {message}"),
        ),
        CallError::Status {
            status, message, ..
        } => GatewayError::new(
            if *status >= 500 { *status } else { 502 },
            "server_error",
            "upstream_error",
            format!("The endpoint failed: HTTP {status}: {message}"),
        ),
        CallError::Connect(_) => GatewayError::new(
            503,
            "server_error",
            "endpoint_unreachable",
            format!(
                "No endpoint could be reached: {}",
                evalfleet_types::error_text(error)
            ),
        ),
        CallError::Timeout(_) | CallError::FirstByteTimeout(_) => GatewayError::new(
            504,
            "server_error",
            "upstream_timeout",
            format!("The endpoint did not answer in time: {error}"),
        ),
        other => GatewayError::new(
            502,
            "server_error",
            "upstream_error",
            format!(
                "The endpoint's answer was not usable: {}",
                evalfleet_types::error_text(other)
            ),
        ),
    };
    answer.retry_after = retry_after.or((answer.status == 503).then_some(1));
    Answer::Error(answer)
}
