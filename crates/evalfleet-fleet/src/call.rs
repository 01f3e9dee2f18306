//! The one path of every model call: an item's answer, a re-ask, an LLM
//! judge's call, a turn of a longer task all go the same way.
//!
//! An endpoint's dispatcher takes a slot of its [`ConcurrencyLimit`] when
//! the endpoint takes calls ([`admit`]), then the next call waiting for it,
//! then a token of its rate limits ([`pace`]); [`send`] makes the call under
//! its timeout, classifies the outcome, and feeds it back to the limit (its
//! round trip or back pressure), the breaker (health), the rate learner and
//! quota pauses, and the endpoint's counters. [`Exchange::record`] is what
//! the store keeps of it.
//!
//! [`ConcurrencyLimit`]: super::ConcurrencyLimit

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use evalfleet_types::{AttemptRecord, ErrorClass, Telemetry, ms, unix_ms};
use serde_json::value::RawValue;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::aimd::Sample;
use super::runtime::FleetHandle;
use super::window::Answered;
use super::{Endpoint, Health, Permit, Signal};
use crate::client::{CallError, ChatClient, Completion, Timing};

/// Waits until `endpoint` takes calls and one of its slots is free;
/// `None` once `halt` is cancelled.
pub async fn admit(endpoint: &Endpoint, halt: &CancellationToken) -> Option<Permit> {
    loop {
        if !endpoint.wait_accepting(halt).await {
            return None;
        }
        let permit = tokio::select! {
            biased;
            () = halt.cancelled() => return None,
            permit = endpoint.limit.acquire() => permit,
        };
        if endpoint.accepting() {
            return Some(permit);
        }
    }
}

/// What a call of `messages` costs the endpoint's token budget: its prompt
/// (about 4 bytes a token) and the completion it may use.
pub fn cost(messages: &RawValue, max_tokens: u64) -> u64 {
    messages.get().len() as u64 / 4 + max_tokens
}

/// Waits for a token of `endpoint`'s rate limits worth `cost`, then for
/// its share of its API key's quotas when other workers share them;
/// `false` once `halt` is cancelled.
pub async fn pace(endpoint: &Endpoint, cost: u64, halt: &CancellationToken) -> bool {
    let paced = async {
        endpoint.rate.acquire(cost).await;
        if let Some(shared) = endpoint.shared.get() {
            shared.acquire(cost).await;
        }
    };
    tokio::select! {
        biased;
        () = halt.cancelled() => false,
        () = paced => true,
    }
}

/// What a call came to.
pub enum Exchange {
    /// Abandoned at shutdown: nothing is recorded of it.
    Abandoned,
    /// The endpoint stopped taking calls while this one was in flight: it
    /// was cut off, through no fault of the call, to go elsewhere.
    Moved { sent_at: SystemTime },
    /// Another call for the same request answered first (a hedge): this
    /// one was cut off, and `why` says by which.
    Cancelled { sent_at: SystemTime, why: String },
    /// The endpoint answered, failed, or took too long.
    Done {
        result: Result<Completion, CallError>,
        timing: Timing,
        /// It said no because of its quota (429): the call did nothing
        /// wrong.
        rate_limited: bool,
    },
}

/// A call ready to go: the endpoint, its client, the slot it holds and the
/// rate token it took.
pub struct Call {
    pub endpoint: Arc<Endpoint>,
    pub client: Arc<ChatClient>,
    pub permit: Permit,
    /// The token cost taken from the endpoint's rate limits.
    pub cost: u64,
}

/// What a call sends: its messages, and the images they name by hash.
#[derive(Clone, Copy)]
pub struct Prompt<'a> {
    pub messages: &'a RawValue,
    pub images: &'a evalfleet_io::images::Images,
}

/// Makes `call` with `prompt` for at most `limit` (or until `abort`), and
/// feeds what happened back to the endpoint and the fleet.
pub async fn send(
    call: Call,
    prompt: Prompt<'_>,
    limit: Duration,
    abort: &CancellationToken,
    fleet: &FleetHandle,
) -> Exchange {
    let client = call.client.clone();
    let first = call.permit.first_token();
    send_with(
        call,
        client.complete_watched(prompt.messages, prompt.images, &first),
        limit,
        abort,
        fleet,
    )
    .await
}

/// Makes `call` as `doing` does it (a chat completion of ours, or a request
/// an agent sent through the gateway), and feeds what happened back as
/// [`send`] does.
pub async fn send_with(
    call: Call,
    doing: impl std::future::Future<Output = crate::client::CallOutcome>,
    limit: Duration,
    abort: &CancellationToken,
    fleet: &FleetHandle,
) -> Exchange {
    let Call {
        endpoint,
        client: _,
        permit,
        cost,
    } = call;
    let counters = &endpoint.counters;
    // Counted out however the call ends, a call dropped half-way (a hedge
    // that lost) included.
    let in_flight = InFlight::new(counters);
    // Calls started before this one, to tell afterwards whether another
    // started while it ran.
    let before = counters.attempts.fetch_add(1, Ordering::Relaxed);
    endpoint.started();
    let sent_at = SystemTime::now();
    let evicted = endpoint.eviction();
    let ended = tokio::select! {
        biased;
        () = abort.cancelled() => None,
        () = evicted.cancelled() => Some(None),
        timed = tokio::time::timeout(limit, doing) => Some(Some(timed)),
    };
    drop(in_flight);
    let timed = match ended {
        None => return Exchange::Abandoned,
        Some(None) => return Exchange::Moved { sent_at },
        Some(Some(timed)) => timed,
    };
    let (result, timing, quota) = match timed {
        Ok(outcome) => (outcome.result, outcome.timing, outcome.quota),
        Err(_) => (
            Err(CallError::Timeout(limit)),
            Timing {
                sent_at,
                ttft: None,
                latency: limit,
            },
            None,
        ),
    };

    // What the outcome teaches the fleet. A 429 is the quota's: it teaches
    // the rate (a 503 or 408, even with `Retry-After`, is load or a fault:
    // its `Retry-After` delays that call's retry only). Once calls are
    // paced, a 429 means the pace is a little high, not that too many
    // calls are in flight.
    let rate_limited = result
        .as_ref()
        .err()
        .is_some_and(|err| err.http_status() == Some(429));
    let signal = if rate_limited && endpoint.rate.paces() {
        Signal::Neutral
    } else {
        let overtaken = counters.attempts.load(Ordering::Relaxed) > before + 1;
        signal(&result, &timing, overtaken)
    };
    // (The limit logs what it decides.)
    permit.finish(signal);
    if let Some(reach) = reached(&result) {
        endpoint.tried(reach);
    }
    let transition = endpoint.on_call(health(&result), timing.latency);
    if transition.is_some() {
        let why = result
            .as_ref()
            .err()
            .map_or_else(String::new, |err| evalfleet_types::error_text(err));
        fleet.call_transition(&endpoint, transition, &why);
    }
    endpoint.record(result.as_ref().ok().map(|completion| Answered {
        latency: timing.latency,
        ttft: timing.ttft,
        tpot: timing.tpot(completion.completion_tokens),
        completion_tokens: completion.completion_tokens,
    }));
    let now = Instant::now();
    match &result {
        Ok(completion) => {
            counters.successes.fetch_add(1, Ordering::Relaxed);
            endpoint.rate.on_success(now);
            if let (Some(prompt), Some(completion)) =
                (completion.prompt_tokens, completion.completion_tokens)
            {
                endpoint.rate.correct(cost, prompt + completion);
                if let Some(shared) = endpoint.shared.get() {
                    shared.correct(cost, prompt + completion);
                }
            }
        }
        Err(err) => {
            counters.error(err.class());
            if rate_limited {
                for event in endpoint.rate.on_rate_limited(now, err.retry_after()) {
                    fleet.rate_event(&endpoint, event);
                }
                if let Some(shared) = endpoint.shared.get() {
                    shared.on_rate_limited(err.retry_after());
                }
            }
        }
    }
    if let Some(quota) = &quota {
        for event in endpoint.rate.observe(now, quota) {
            fleet.rate_event(&endpoint, event);
        }
    }
    Exchange::Done {
        result,
        timing,
        rate_limited,
    }
}

/// A call in flight, as the endpoint's counters see it.
struct InFlight<'a>(&'a super::EndpointCounters);

impl<'a> InFlight<'a> {
    fn new(counters: &'a super::EndpointCounters) -> Self {
        counters.in_flight.fetch_add(1, Ordering::Relaxed);
        Self(counters)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Exchange {
    /// Whether the endpoint answered with a completion.
    pub fn answered(&self) -> bool {
        matches!(self, Self::Done { result: Ok(_), .. })
    }

    /// What the store keeps of this call to `endpoint`: attempt `number` of
    /// item `seq` in `session` (`None` when it was abandoned).
    pub fn record(
        &self,
        endpoint: &Endpoint,
        seq: u64,
        number: u32,
        session: u32,
    ) -> Option<AttemptRecord> {
        let (sent_at, telemetry, http_status, error_class, error) = match self {
            Self::Abandoned => return None,
            Self::Moved { sent_at } => cut_off(
                endpoint,
                *sent_at,
                format!(
                    "moved to another endpoint: {} stopped taking items",
                    endpoint.name
                ),
            ),
            Self::Cancelled { sent_at, why } => {
                cut_off(endpoint, *sent_at, format!("cancelled: {why}"))
            }
            Self::Done { result, timing, .. } => {
                let (completion_tokens, estimated, prompt_tokens, finish_reason, status) =
                    match result {
                        Ok(c) => (
                            c.completion_tokens,
                            c.tokens_estimated,
                            c.prompt_tokens,
                            c.finish_reason.clone(),
                            Some(c.http_status),
                        ),
                        Err(err) => (None, false, None, None, err.http_status()),
                    };
                (
                    timing.sent_at,
                    Telemetry {
                        endpoint: endpoint.name.clone(),
                        model: endpoint.model.clone(),
                        latency_ms: ms(timing.latency),
                        ttft_ms: timing.ttft.map(ms),
                        tpot_ms: timing.tpot(completion_tokens).map(ms),
                        prompt_tokens,
                        completion_tokens,
                        tokens_estimated: estimated,
                        finish_reason,
                    },
                    status,
                    result.as_ref().err().map(CallError::class),
                    result
                        .as_ref()
                        .err()
                        .map(|err| evalfleet_types::error_text(err)),
                )
            }
        };
        Some(AttemptRecord {
            seq,
            attempt: number,
            session,
            sent_at_ms: unix_ms(sent_at),
            telemetry,
            http_status,
            error_class,
            error,
        })
    }
}

/// What is recorded of a call cut off through no fault of its own.
fn cut_off(
    endpoint: &Endpoint,
    sent_at: SystemTime,
    error: String,
) -> (
    SystemTime,
    Telemetry,
    Option<u16>,
    Option<ErrorClass>,
    Option<String>,
) {
    (
        sent_at,
        Telemetry {
            endpoint: endpoint.name.clone(),
            model: endpoint.model.clone(),
            latency_ms: ms(sent_at.elapsed().unwrap_or_default()),
            ..Telemetry::default()
        },
        None,
        None,
        Some(error),
    )
}

/// What a call's outcome says to the concurrency controller: a successful
/// call's round trip, latency and tokens (its work); back pressure: a
/// refused connection, a 429, 503 or 408, no answer in time, a stream
/// dropped after another call arrived (`overtaken`); and a stream ended
/// cleanly without a `finish_reason` after another call arrived, a cut
/// (servers that serve one stream at a time end the running one so). A
/// fault of the call alone (a 500, a stall, a broken stream) says nothing
/// about load. The controller itself tells load from
/// back pressure that comes whatever the load (see [`super::aimd`]).
fn signal(result: &Result<Completion, CallError>, timing: &Timing, overtaken: bool) -> Signal {
    match result {
        Ok(completion) => Signal::Success(Sample {
            latency: timing.latency,
            work: completion
                .completion_tokens
                .filter(|tokens| *tokens > 0)
                .map_or(1.0, |tokens| tokens as f64),
        }),
        Err(CallError::Connect(_)) => Signal::BackPressure,
        Err(CallError::Unfinished) if overtaken => Signal::Cut,
        Err(CallError::Truncated | CallError::Unended) if overtaken => Signal::BackPressure,
        Err(err) if err.class().is_back_pressure() => Signal::BackPressure,
        Err(_) => Signal::Neutral,
    }
}

/// Whether a call reached the endpoint: any HTTP response did; a
/// connection that could not be made (refused, no such host, TLS) did
/// not, and why; a timeout or a connection lost on the way says neither.
fn reached(result: &Result<Completion, CallError>) -> Option<Result<(), String>> {
    match result {
        // This process had no file left for the connection: nothing tried.
        Err(err) if err.out_of_files() => None,
        Err(CallError::Connect(err)) => Some(Err(format!(
            "POST {}: {}",
            err.url().map_or_else(String::new, crate::client::shown_url),
            evalfleet_types::root_cause(err)
        ))),
        Err(CallError::Transport(_) | CallError::Timeout(_) | CallError::FirstByteTimeout(_)) => {
            None
        }
        _ => Some(Ok(())),
    }
}

/// What a call's outcome says about the endpoint's health (see
/// [`super::breaker`]): down when it cannot be reached; a fault of the
/// call when it failed otherwise (a 503 included), which says the
/// endpoint is down only when nothing gets through; nothing when it said
/// no and is up (a 4xx, a 429: quotas are the rate limiter's business).
fn health(result: &Result<Completion, CallError>) -> Health {
    match result {
        Ok(_) => Health::Up,
        // This process had no file left for the connection: its own fault.
        Err(err) if err.out_of_files() => Health::Silent,
        Err(CallError::Connect(_)) => Health::Down,
        Err(CallError::Status { status, .. }) if *status < 500 => Health::Silent,
        Err(_) => Health::Fault,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::Unanswered;

    fn refused(code: i32) -> Result<Completion, CallError> {
        let io = std::io::Error::from_raw_os_error(code);
        Err(CallError::Connect(Unanswered::new(Box::new(io), None)))
    }

    /// The same under an `io::Error` that wraps it (whose `source` skips
    /// what it wraps).
    fn refused_wrapped(code: i32) -> Result<Completion, CallError> {
        let io = std::io::Error::other(std::io::Error::from_raw_os_error(code));
        Err(CallError::Connect(Unanswered::new(Box::new(io), None)))
    }

    #[test]
    fn a_connect_without_a_file_left_is_no_fault_of_the_endpoint() {
        let out_of_files = refused(rustix::io::Errno::MFILE.raw_os_error());
        assert_eq!(health(&out_of_files), Health::Silent);
        assert_eq!(reached(&out_of_files), None);
        // The limit is still cut: fewer calls hold fewer files.
        let timing = Timing {
            sent_at: std::time::SystemTime::now(),
            ttft: None,
            latency: std::time::Duration::from_millis(1),
        };
        assert_eq!(signal(&out_of_files, &timing, false), Signal::BackPressure);
        let system_wide = refused(rustix::io::Errno::NFILE.raw_os_error());
        assert_eq!(health(&system_wide), Health::Silent);
        let wrapped = refused_wrapped(rustix::io::Errno::MFILE.raw_os_error());
        assert_eq!(health(&wrapped), Health::Silent);
        // A refused connection is the endpoint's.
        let refused = refused(rustix::io::Errno::CONNREFUSED.raw_os_error());
        assert_eq!(health(&refused), Health::Down);
        assert!(matches!(reached(&refused), Some(Err(_))));
    }
}
