//! The mock's shared state, and the guards that count a request while it is
//! in flight, admitted, queued or being answered.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::Response;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::quota::{Bucket, QuotaBucket};
use super::response::error_response;
use super::stats::{Stats, unix_now_ms};
use crate::settings::MockSettings;

pub(super) struct MockState {
    pub(super) settings: MockSettings,
    pub(super) stats: Arc<Stats>,
    pub(super) prompt_counts: Mutex<HashMap<u64, u32>>,
    pub(super) bucket: Option<Mutex<Bucket>>,
    pub(super) quota: Option<Mutex<QuotaBucket>>,
    /// When the first chat request arrived (the `outage` counts from it).
    pub(super) first_chat: OnceLock<Instant>,
    /// Cancelled when the next chat request arrives, with
    /// `interrupt_on_arrival`: the streams being sent end.
    pub(super) running: Mutex<CancellationToken>,
    pub(super) admitted: AtomicU64,
    pub(super) capacity: Option<Arc<Semaphore>>,
    /// Chat requests being answered (holding a slot of `capacity`, when
    /// it is set).
    pub(super) answering: AtomicU64,
    /// Chat requests waiting for a slot of `capacity`.
    pub(super) queued: AtomicU64,
    pub(super) shutdown: CancellationToken,
    pub(super) next_id: AtomicU64,
    /// Scripted answers by first user message, or why they could not be
    /// read (then every request gets a 500 saying so).
    pub(super) answers: Result<HashMap<String, crate::settings::Script>, String>,
    /// Requests seen per scripted prompt (for `samples`).
    pub(super) scripted_seen: Mutex<HashMap<String, usize>>,
}

impl MockState {
    /// The status the `outage` answers with at `now`, if it is on.
    pub(super) fn outage_now(&self, now: Instant) -> Option<StatusCode> {
        let outage = self.settings.outage?;
        let since_first = now.saturating_duration_since(*self.first_chat.get()?);
        (outage.after..outage.after + outage.duration)
            .contains(&since_first)
            .then(|| StatusCode::from_u16(outage.status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE))
    }

    /// A token that is cancelled when the next chat request arrives, if the
    /// mock interrupts streams (`interrupt_on_arrival`); the streams running
    /// now are interrupted.
    pub(super) fn arrival(&self) -> CancellationToken {
        let fresh = CancellationToken::new();
        if self.settings.interrupt_on_arrival {
            let mut running = self
                .running
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            std::mem::replace(&mut *running, fresh.clone()).cancel();
        }
        fresh
    }
}

/// Counts a request as in flight until dropped.
pub(super) struct InFlight(Arc<MockState>);

impl InFlight {
    pub(super) fn enter(state: &Arc<MockState>) -> Self {
        let now = state.stats.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        state.stats.max_in_flight.fetch_max(now, Ordering::Relaxed);
        Self(state.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Releases an admission slot of `max_concurrency` when dropped.
pub(super) struct Admitted(pub(super) Arc<MockState>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.admitted.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a response holds on to while it is being produced.
pub(super) struct Held {
    pub(super) _in_flight: InFlight,
    pub(super) _admitted: Option<Admitted>,
    pub(super) _slot: Option<OwnedSemaphorePermit>,
    pub(super) _answering: Counted,
}

/// Counts a request in one of the mock's load gauges until dropped.
pub(super) struct Counted {
    state: Arc<MockState>,
    gauge: fn(&MockState) -> &AtomicU64,
}

impl Counted {
    pub(super) fn enter(state: &Arc<MockState>, gauge: fn(&MockState) -> &AtomicU64) -> Self {
        gauge(state).fetch_add(1, Ordering::Relaxed);
        Self {
            state: state.clone(),
            gauge,
        }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        (self.gauge)(&self.state).fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counts a request that arrived at `arrived`; during an outage, the
/// refusal it gets.
pub(super) fn arrive(state: &MockState, arrived: Instant) -> Option<Response> {
    if state.stats.requests.fetch_add(1, Ordering::Relaxed) == 0 {
        state
            .stats
            .first_request_at_ms
            .store(unix_now_ms(), Ordering::Relaxed);
    }
    state.first_chat.get_or_init(|| arrived);
    if let Some(status) = state.outage_now(arrived) {
        state.stats.outage_refused.fetch_add(1, Ordering::Relaxed);
        return Some(error_response(status, "mock outage"));
    }
    None
}

/// Waits `duration`, or less if the mock shuts down (then `false`).
pub(super) async fn pause(state: &MockState, duration: Duration) -> bool {
    if duration.is_zero() {
        return true;
    }
    tokio::select! {
        () = tokio::time::sleep(duration) => true,
        () = state.shutdown.cancelled() => false,
    }
}
