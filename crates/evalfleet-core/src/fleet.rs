//! The endpoints of a run as the scheduler sees them: a client, a concurrency
//! limit and counters. Control logic lives in its own types with no HTTP in
//! them, so that adaptive limits and health can replace the fixed ones here.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::client::{ChatClient, ErrorClass};
use crate::config::EndpointConfig;

/// How many calls an endpoint may have in flight. A free slot (permit) is
/// what lets an endpoint take the next item.
#[derive(Debug)]
pub struct ConcurrencyLimit {
    slots: Arc<Semaphore>,
    limit: usize,
}

/// One slot of a [`ConcurrencyLimit`], freed when dropped.
#[derive(Debug)]
pub struct Permit {
    _slot: OwnedSemaphorePermit,
}

impl ConcurrencyLimit {
    /// A limit that never changes.
    pub fn fixed(limit: usize) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(limit)),
            limit,
        }
    }

    /// Waits for a free slot.
    pub async fn acquire(&self) -> Permit {
        match self.slots.clone().acquire_owned().await {
            Ok(slot) => Permit { _slot: slot },
            // The semaphore is never closed; waiting forever is the honest
            // answer if it were, and the caller's cancellation ends the wait.
            Err(_) => std::future::pending().await,
        }
    }

    pub fn current(&self) -> usize {
        self.limit
    }
}

/// Counters of one endpoint in this session.
#[derive(Debug, Default)]
pub struct EndpointCounters {
    pub in_flight: AtomicU64,
    pub attempts: AtomicU64,
    pub successes: AtomicU64,
    errors: [AtomicU64; 4],
}

impl EndpointCounters {
    pub fn error(&self, class: ErrorClass) {
        self.errors[class_index(class)].fetch_add(1, Ordering::Relaxed);
    }

    pub fn errors(&self, class: ErrorClass) -> u64 {
        self.errors[class_index(class)].load(Ordering::Relaxed)
    }
}

fn class_index(class: ErrorClass) -> usize {
    match class {
        ErrorClass::Retryable => 0,
        ErrorClass::BackPressure => 1,
        ErrorClass::Fatal => 2,
        ErrorClass::BadResponse => 3,
    }
}

/// An endpoint taking part in a run.
pub struct Endpoint {
    pub name: String,
    pub model: String,
    pub client: ChatClient,
    pub limit: ConcurrencyLimit,
    /// Per-attempt timeout.
    pub timeout: Duration,
    pub counters: Arc<EndpointCounters>,
}

impl Endpoint {
    pub fn new(config: &EndpointConfig, client: ChatClient, default_timeout: Duration) -> Self {
        Self {
            name: config.name.clone(),
            model: config.model.clone(),
            client,
            limit: ConcurrencyLimit::fixed(config.concurrency as usize),
            timeout: config.timeout.unwrap_or(default_timeout),
            counters: Arc::new(EndpointCounters::default()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_fixed_limit_gives_out_that_many_slots() {
        let limit = ConcurrencyLimit::fixed(2);
        let a = limit.acquire().await;
        let _b = limit.acquire().await;
        let third = tokio::time::timeout(Duration::from_secs(1), limit.acquire()).await;
        assert!(third.is_err(), "a third slot was handed out");
        drop(a);
        let third = tokio::time::timeout(Duration::from_secs(1), limit.acquire()).await;
        assert!(third.is_ok(), "a freed slot was not handed out again");
    }
}
