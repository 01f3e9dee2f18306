//! What the session's tasks hand to the one writer: an attempt's record, an
//! item's result, an answer for the cache, an agent's calls, each under the
//! claim its item was handed out under. Apart from the writer and the
//! dispatchers, so that both name it and neither names the other.

use std::time::Duration;

use evalfleet_store::ClaimId;
use evalfleet_types::{AttemptRecord, CacheEntry, ResultRecord};

/// What an attempt leaves for the writer when the item goes on: its record
/// and the answer for the cache, sent with whatever the item sends next.
#[derive(Default)]
pub struct Carry {
    pub attempt: Option<AttemptRecord>,
    pub cache: Option<CacheEntry>,
    /// Calls an agent made in the attempt carried.
    pub calls: Vec<evalfleet_types::AgentCall>,
}

impl Carry {
    pub fn is_empty(&self) -> bool {
        self.attempt.is_none() && self.cache.is_none() && self.calls.is_empty()
    }
}

/// Where an item's agent calls go as each ends (`kind: exec`): the
/// gateway's sink for the item of `claim`, which hands each call to the
/// writer, ahead of the item's result, so that a call is stored even when
/// its attempt never ends (the run stopped or was killed). A call the
/// writer has no room for now is given back, to go with the attempt's
/// record; the sink does not hold the writer open (a call that ends after
/// the writer does is given back too).
pub fn call_sink(
    claim: ClaimId,
    writer: &tokio::sync::mpsc::Sender<Message>,
) -> evalfleet_gateway::Keep {
    let writer = writer.downgrade();
    std::sync::Arc::new(move |call| {
        let Some(writer) = writer.upgrade() else {
            return Some(call);
        };
        let outcome = Outcome {
            calls: vec![call],
            ..Outcome::empty(claim)
        };
        match writer.try_send(Message::One(outcome)) {
            Ok(()) => None,
            Err(err) => match err.into_inner() {
                Message::One(mut outcome) => outcome.calls.pop(),
                Message::Many(_) => None,
            },
        }
    })
}

/// What an attempt task hands to the writer.
#[derive(Debug)]
pub struct Outcome {
    /// The claim its item was handed out under.
    pub claim: ClaimId,
    pub attempt: Option<AttemptRecord>,
    pub result: Option<ResultRecord>,
    /// A successful answer for the cache.
    pub cache: Option<CacheEntry>,
    /// Calls an agent made in its attempt (`kind: exec`).
    pub calls: Vec<evalfleet_types::AgentCall>,
    /// How long its item waits before its next call (a retry's backoff).
    pub wait: Option<Duration>,
}

impl Outcome {
    /// Nothing yet, for the item of `claim`.
    pub fn empty(claim: ClaimId) -> Self {
        Self {
            claim,
            attempt: None,
            result: None,
            cache: None,
            calls: Vec::new(),
            wait: None,
        }
    }

    /// An attempt alone (its item goes on).
    pub fn attempt(claim: ClaimId, attempt: AttemptRecord) -> Self {
        Self {
            attempt: Some(attempt),
            ..Self::empty(claim)
        }
    }

    /// An attempt that failed, after which its item waits `wait` before
    /// it is sent again.
    pub fn retried(claim: ClaimId, attempt: AttemptRecord, wait: Duration) -> Self {
        Self {
            wait: Some(wait),
            ..Self::attempt(claim, attempt)
        }
    }

    /// What an item carried from its last call, sent before it goes on.
    pub fn carried(claim: ClaimId, carry: Carry) -> Self {
        Self {
            claim,
            attempt: carry.attempt,
            result: None,
            cache: carry.cache,
            calls: carry.calls,
            wait: None,
        }
    }
}

/// What the writer receives: one outcome (an attempt task), or many at
/// once (the reader's cache hits, a page at a time, so that the writer
/// wakes once per page rather than once per item).
// `One` is the hot path (every call); boxing it would cost an allocation
// per call, and channel slots were this size before `Many` existed.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Message {
    One(Outcome),
    Many(Vec<Outcome>),
}
