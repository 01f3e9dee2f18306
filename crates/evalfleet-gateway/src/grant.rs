//! An item's attempt at the gateway: its grant (budget, calls recorded,
//! calls under way) and its pass, the address that lives while the
//! attempt does.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use evalfleet_config::Budget;
use evalfleet_types::{AgentCall, now_ms};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Gateway;
use super::error::GatewayError;
use super::token::Claims;

/// Where an attempt's calls are stored as each ends, so that none is lost
/// with the attempt (an agent killed, the run stopped or killed): takes a
/// call, or gives it back when it cannot take it now (it then goes with
/// the attempt's end, [`Pass::close`]).
pub type Keep = Arc<dyn Fn(AgentCall) -> Option<AgentCall> + Send + Sync>;

/// What an attempt's calls came to, whether they were kept as they ended
/// or are handed over at its end.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Made {
    /// Calls made (refused ones included).
    pub calls: u32,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// The endpoint (and its model) that answered the last call answered
    /// by one.
    pub last: Option<(String, String)>,
}

/// An attempt's calls at its end: what they came to, and those not kept
/// yet (in order), for the caller to store.
#[derive(Debug, Default)]
pub struct Closed {
    pub made: Made,
    pub calls: Vec<AgentCall>,
}

/// One item's attempt, as the gateway knows it while it runs.
pub struct Grant {
    pub seq: u64,
    pub attempt: u32,
    /// Which of its row's samples the item is (`task.n`).
    pub(crate) sample: u32,
    pub(crate) budget: Budget,
    pub(crate) opened: Instant,
    pub(crate) next_index: AtomicU32,
    pub(crate) tokens: AtomicU64,
    /// Bytes of request bodies sent so far.
    pub(crate) sent: AtomicU64,
    /// Its calls not yet kept (all of them, without `keep`).
    pub(crate) calls: Mutex<Vec<AgentCall>>,
    pub(crate) made: Mutex<Made>,
    pub(crate) keep: Option<Keep>,
    /// The endpoint that answered its first call (not from the cache): its
    /// next calls go there while it is healthy and has room, so that an
    /// engine's prefix cache serves the next turn.
    pub(crate) home: Mutex<Option<String>>,
    /// Calls under way (their records not yet kept), and a wake-up when
    /// one ends.
    pub(crate) in_flight: AtomicU32,
    pub(crate) settled: tokio::sync::Notify,
    /// Set when the attempt has ended: no call is taken any more.
    pub(crate) closed: std::sync::atomic::AtomicBool,
    /// Cancels the calls still under way when the attempt ends.
    pub(crate) abandon: CancellationToken,
}

/// A call under way for a grant: the grant waits for it to be recorded.
pub(crate) struct Flight(Arc<Grant>);

impl Flight {
    /// A call of `grant` begins.
    pub(crate) fn enter(grant: &Arc<Grant>) -> Arc<Self> {
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
    /// gives what its calls came to and those not kept yet, in order, once
    /// they are recorded (or after a few seconds: a call recorded later is
    /// still kept).
    pub async fn close(self) -> Closed {
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
        let mut calls = self.grant.take_calls();
        calls.sort_by_key(|c| c.index);
        let made = self
            .grant
            .made
            .lock()
            .map(|m| m.clone())
            .unwrap_or_default();
        Closed { made, calls }
    }
}

impl Drop for Pass {
    /// Closed or not (its attempt abandoned: the run stopped), its calls
    /// not yet kept are offered to the store.
    fn drop(&mut self) {
        self.gateway.forget(&self.grant);
        self.grant.closed.store(true, Ordering::Release);
        self.grant.abandon.cancel();
        if let Some(keep) = &self.grant.keep {
            let lost = self
                .grant
                .take_calls()
                .into_iter()
                .filter_map(|call| keep(call))
                .count();
            if lost > 0 {
                tracing::warn!(
                    "Item {} attempt {}: {lost} calls of its abandoned attempt could not be stored.",
                    self.grant.seq,
                    self.grant.attempt
                );
            }
        }
    }
}

impl Grant {
    /// The refusal of call `index` when it is past the attempt's budget.
    pub(crate) fn over_budget(&self, index: u32) -> Option<GatewayError> {
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

    /// The refusal of a request body of `len` bytes: past
    /// [`crate::BODY_LIMIT`], or past [`crate::ATTEMPT_BODY_LIMIT`] with
    /// the attempt's earlier ones.
    pub(crate) fn too_large(&self, len: usize) -> Option<GatewayError> {
        let refuse = |what: String| {
            Some(
                GatewayError::new(413, "invalid_request_error", "request_too_large", what).final_(),
            )
        };
        if len > crate::BODY_LIMIT {
            return refuse(format!(
                "The request body is {:.1} MiB: the gateway takes at most {} MiB.",
                len as f64 / f64::from(1 << 20),
                crate::BODY_LIMIT >> 20
            ));
        }
        let len = len as u64;
        let sent = self.sent.fetch_add(len, Ordering::AcqRel) + len;
        if sent > crate::ATTEMPT_BODY_LIMIT {
            return refuse(format!(
                "This item's requests came to more than {} MiB: the gateway takes no more from it.",
                crate::ATTEMPT_BODY_LIMIT >> 20
            ));
        }
        None
    }

    fn take_calls(&self) -> Vec<AgentCall> {
        self.calls
            .lock()
            .map(|mut calls| std::mem::take(&mut *calls))
            .unwrap_or_default()
    }

    /// A call ended: its tokens are counted and its record kept (stored
    /// now where it can be, else held for the attempt's end).
    pub(crate) fn ended(&self, record: AgentCall) {
        let (prompt, completion) = (
            record.telemetry.prompt_tokens.unwrap_or(0),
            record.telemetry.completion_tokens.unwrap_or(0),
        );
        self.tokens.fetch_add(prompt + completion, Ordering::AcqRel);
        if let Ok(mut made) = self.made.lock() {
            made.calls += 1;
            made.prompt_tokens += prompt;
            made.completion_tokens += completion;
            if !record.telemetry.endpoint.is_empty() {
                made.last = Some((
                    record.telemetry.endpoint.clone(),
                    record.telemetry.model.clone(),
                ));
            }
        }
        if record.http_status == 200
            && !record.cached
            && !record.telemetry.endpoint.is_empty()
            && let Ok(mut home) = self.home.lock()
            && home.is_none()
        {
            *home = Some(record.telemetry.endpoint.clone());
        }
        let held = match &self.keep {
            Some(keep) => keep(record),
            None => Some(record),
        };
        if let Some(record) = held
            && let Ok(mut calls) = self.calls.lock()
        {
            calls.push(record);
        }
    }
}

impl Gateway {
    /// Opens the address of attempt `attempt` of item `seq`, live for at
    /// most `ttl`, with `budget`; its calls go to `keep` as they end.
    pub fn open(
        self: &Arc<Self>,
        seq: u64,
        sample: u32,
        attempt: u32,
        budget: Budget,
        ttl: Duration,
        keep: Option<Keep>,
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
            sent: AtomicU64::new(0),
            calls: Mutex::new(Vec::new()),
            made: Mutex::new(Made::default()),
            keep,
            home: Mutex::new(None),
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
}
