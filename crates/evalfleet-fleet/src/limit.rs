//! How many calls an endpoint may have in flight: a pool of slots whose size
//! is fixed, or moved by the [`Aimd`] controller as calls report their
//! outcome. A free slot is what lets an endpoint take the next item.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::aimd::{Aimd, Decision, Signal};
pub use evalfleet_config::LimitMode;

#[derive(Debug)]
struct State {
    limit: usize,
    /// Slots to withdraw as they come back (the limit was cut while they
    /// were in use).
    debt: usize,
    in_flight: usize,
    controller: Option<Aimd>,
}

#[derive(Debug)]
pub struct ConcurrencyLimit {
    slots: Arc<Semaphore>,
    state: Mutex<State>,
}

/// One slot, held for the length of a call. Report the call's outcome with
/// [`Permit::finish`]; dropping it without does not teach the controller.
#[derive(Debug)]
pub struct Permit {
    limit: Arc<ConcurrencyLimit>,
    slot: Option<OwnedSemaphorePermit>,
    /// The limit when the call started, if it started with the limit
    /// reached: what the call teaches is about that level.
    level: Option<usize>,
    /// While a streamed endpoint's first calls are watched: whether this
    /// call's first token came (see [`Permit::first_token`]).
    flowed: Option<Arc<AtomicBool>>,
}

/// Tells the limit that a streamed call's first token came; does nothing
/// but for the first calls of a streamed endpoint (see
/// [`super::aimd::Aimd::open_streamed`]).
#[derive(Debug, Clone, Default)]
pub struct FirstToken(Option<(Arc<ConcurrencyLimit>, Arc<AtomicBool>)>);

impl FirstToken {
    /// Nothing to tell.
    pub fn none() -> Self {
        Self(None)
    }

    /// The call's first token came (once is told; later calls do nothing).
    pub fn came(&self) {
        let Some((limit, flowed)) = &self.0 else {
            return;
        };
        if flowed.swap(true, Ordering::Relaxed) {
            return;
        }
        limit.control(&mut limit.state(), |c| c.on_first_token(Instant::now()));
    }
}

impl ConcurrencyLimit {
    pub fn new(mode: LimitMode) -> Arc<Self> {
        let (limit, controller) = match mode {
            LimitMode::Fixed(n) => (n.max(1), None),
            LimitMode::Adaptive(settings) => {
                let controller = Aimd::new(settings, Instant::now());
                (controller.limit(), Some(controller))
            }
        };
        Arc::new(Self {
            slots: Arc::new(Semaphore::new(limit)),
            state: Mutex::new(State {
                limit,
                debt: 0,
                in_flight: 0,
                controller,
            }),
        })
    }

    /// A limit that never changes.
    pub fn fixed(limit: usize) -> Arc<Self> {
        Self::new(LimitMode::Fixed(limit))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits for a free slot.
    pub async fn acquire(self: &Arc<Self>) -> Permit {
        let slot = match self.slots.clone().acquire_owned().await {
            Ok(slot) => slot,
            // The semaphore is never closed; the caller's cancellation ends
            // this wait.
            Err(_) => std::future::pending().await,
        };
        let mut state = self.state();
        state.in_flight += 1;
        let in_flight = state.in_flight;
        // What level of the limit the call runs at, if the controller
        // counts it towards one.
        let level = state
            .controller
            .as_mut()
            .and_then(|controller| controller.on_start(in_flight));
        let watched = state.controller.as_ref().is_some_and(Aimd::stream_opening);
        drop(state);
        Permit {
            limit: self.clone(),
            slot: Some(slot),
            level,
            flowed: watched.then(Arc::default),
        }
    }

    /// The endpoint's calls are streamed: an adaptive limit opens at two
    /// calls until they show whether the server serves more than one
    /// stream at a time (before any call; see
    /// [`super::aimd::Aimd::open_streamed`]).
    pub fn open_streamed(&self) -> Option<Decision> {
        self.control(&mut self.state(), Aimd::open_streamed)
    }

    /// Tells the controller (if the limit is adaptive) what `event` says,
    /// and moves the limit where it decides.
    fn control(
        &self,
        state: &mut State,
        event: impl FnOnce(&mut Aimd) -> Option<Decision>,
    ) -> Option<Decision> {
        let decision = state.controller.as_mut().and_then(event)?;
        tracing::debug!(
            "Concurrency limit {} -> {} ({}).",
            decision.from,
            decision.to,
            decision.reason.as_str()
        );
        self.resize(state, decision.to);
        Some(decision)
    }

    /// The limit now.
    pub fn current(&self) -> usize {
        self.state().limit
    }

    /// Calls in flight now.
    pub fn in_flight(&self) -> usize {
        self.state().in_flight
    }

    pub fn is_adaptive(&self) -> bool {
        self.state().controller.is_some()
    }

    /// Whether the controller found that the endpoint serves one call at
    /// a time (streams cut when another call arrived).
    pub fn serves_one_at_a_time(&self) -> bool {
        self.state()
            .controller
            .as_ref()
            .is_some_and(Aimd::serves_one_at_a_time)
    }

    /// The engine says it serves `capacity` calls at once: an adaptive
    /// limit starts there and does not pass it.
    pub fn engine_capacity(&self, capacity: usize) -> Option<Decision> {
        self.control(&mut self.state(), |c| c.on_capacity(capacity))
    }

    /// The engine says `waiting` calls wait in its queue.
    pub fn engine_queue(&self, waiting: f64) {
        if let Some(controller) = self.state().controller.as_mut() {
            controller.on_engine_queue(waiting);
        }
    }

    fn resize(&self, state: &mut State, to: usize) {
        let from = state.limit;
        if to > from {
            let grow = to - from;
            let repaid = grow.min(state.debt);
            state.debt -= repaid;
            self.slots.add_permits(grow - repaid);
        } else if to < from {
            let shrink = from - to;
            let free = self.slots.available_permits().min(shrink);
            if free > 0
                && let Ok(taken) = self.slots.try_acquire_many(free as u32)
            {
                taken.forget();
                state.debt += shrink - free;
            } else {
                state.debt += shrink;
            }
        }
        state.limit = to;
    }
}

impl Permit {
    /// What the call tells when its first token comes (a stream's).
    pub fn first_token(&self) -> FirstToken {
        FirstToken(
            self.flowed
                .as_ref()
                .map(|flowed| (self.limit.clone(), flowed.clone())),
        )
    }

    /// Frees the slot and tells the controller how the call went; returns the
    /// change of limit it decided, if any.
    pub fn finish(mut self, signal: Signal) -> Option<Decision> {
        let limit = self.limit.clone();
        // (Taken: dropped now, the permit has nothing more to tell.)
        let flowed = self
            .flowed
            .take()
            .is_some_and(|flowed| flowed.load(Ordering::Relaxed));
        let decision = limit.control(&mut limit.state(), |c| {
            c.on_stream_end(Instant::now(), signal, self.level, flowed)
        });
        drop(self);
        decision
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let Some(slot) = self.slot.take() else { return };
        let mut state = self.limit.state();
        // A call of a streamed endpoint's opening dropped without its end
        // told (moved, a hedge that lost, abandoned).
        if let Some(flowed) = self.flowed.take() {
            self.limit.control(&mut state, |c| {
                c.on_dropped(Instant::now(), flowed.load(Ordering::Relaxed))
            });
        }
        state.in_flight -= 1;
        if state.debt > 0 {
            state.debt -= 1;
            slot.forget();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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

    #[tokio::test(start_paused = true)]
    async fn a_cut_while_slots_are_busy_is_repaid_as_they_return() {
        let limit = ConcurrencyLimit::fixed(4);
        let held: Vec<Permit> =
            futures_util::future::join_all((0..4).map(|_| limit.acquire())).await;
        {
            let mut state = limit.state();
            limit.resize(&mut state, 2);
        }
        drop(held);
        assert_eq!(limit.slots.available_permits(), 2);
        assert_eq!(limit.state().debt, 0);
        {
            let mut state = limit.state();
            limit.resize(&mut state, 5);
        }
        assert_eq!(limit.slots.available_permits(), 5);
        assert_eq!(limit.in_flight(), 0);
    }

    /// An adaptive limit starting at 8 calls, at least `min`.
    fn adaptive(min: usize) -> Arc<ConcurrencyLimit> {
        ConcurrencyLimit::new(LimitMode::Adaptive(evalfleet_config::AimdSettings {
            initial: 8,
            min,
            ..Default::default()
        }))
    }

    #[tokio::test(start_paused = true)]
    async fn a_streamed_endpoint_gives_out_two_slots_until_two_streams_flow() {
        let limit = adaptive(1);
        let opened = limit.open_streamed().unwrap();
        assert_eq!((opened.from, opened.to), (8, 2));
        let a = limit.acquire().await;
        let b = limit.acquire().await;
        let third = tokio::time::timeout(Duration::from_secs(1), limit.acquire()).await;
        assert!(third.is_err(), "a third call went out during the opening");
        // One stream's first token, told twice, is one stream.
        a.first_token().came();
        a.first_token().came();
        assert_eq!(limit.current(), 2);
        b.first_token().came();
        assert_eq!(limit.current(), 8);
        assert_eq!(limit.slots.available_permits(), 6);
        // Later calls have nothing to tell.
        let c = limit.acquire().await;
        assert!(c.first_token().0.is_none());
        assert_eq!(limit.open_streamed(), None, "opened once");
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_of_the_opening_dropped_after_its_first_token_no_longer_flows() {
        let limit = adaptive(1);
        limit.open_streamed();
        let a = limit.acquire().await;
        let b = limit.acquire().await;
        // A flows, then is moved (dropped without its end told); B's
        // first token alone is not two streams at once.
        a.first_token().came();
        drop(a);
        b.first_token().came();
        assert_eq!(limit.current(), 2);
        assert_eq!(limit.slots.available_permits(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_least_of_three_opens_at_three() {
        let limit = adaptive(3);
        let opened = limit.open_streamed().unwrap();
        assert_eq!(opened.to, 3);
        let limit = adaptive(8);
        assert_eq!(limit.open_streamed(), None);
        assert_eq!(limit.current(), 8);
    }

    #[tokio::test(start_paused = true)]
    async fn a_cut_at_the_opening_leaves_one_slot() {
        let limit = adaptive(1);
        limit.open_streamed();
        let a = limit.acquire().await;
        let b = limit.acquire().await;
        a.first_token().came();
        let cut = a.finish(Signal::Cut).unwrap();
        assert_eq!(cut.to, 1);
        assert!(limit.serves_one_at_a_time());
        drop(b);
        assert_eq!(limit.slots.available_permits(), 1);
    }
}
