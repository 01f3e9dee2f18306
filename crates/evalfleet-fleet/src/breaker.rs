//! An endpoint's health as a circuit breaker, with all its state here.
//!
//! Closed: the endpoint takes items. It opens (takes no new items; calls in
//! flight go on) when the endpoint is down, not when it is merely faulty
//! (Envoy's outlier detection, fitted to fleets of one or a few):
//!
//! - `max_failures` failures in a row that say it is down (probes that
//!   fail, calls whose connection was refused) open it;
//! - [`FAULTS_IN_A_ROW`] calls in a row that failed (a 5xx, no answer in
//!   time, a broken, cut or stalled stream) make it suspect, once they
//!   have gone on for longer than its calls take (`span`) or outnumber the
//!   calls it can have in flight (`burst`, its concurrency limit) by
//!   [`FAULTS_IN_A_ROW`]: sporadic faults, even at 15% of calls, practically
//!   never come that many in a row (0.15^20 ≈ 3 × 10^-17), while an
//!   endpoint that fails everything gets there in a moment. The span or
//!   the count matters where failures come back at once and answers take
//!   a while: of a hundred calls sent together, the fifteen that fail all
//!   end before the first answer; an endpoint that refuses everything at
//!   once is caught by the count before its span is over (calls failing
//!   at once free their slots at once). A suspect endpoint is probed at once: a probe
//!   that fails opens it; one that answers leaves the choice to the fleet
//!   ([`Transition::Faulty`]): it is ejected only while the others can
//!   carry the load (at most half the endpoints out, and one left taking
//!   items), else it keeps its calls (panic mode).
//!
//! While open, only probes run; the first probe that succeeds half-opens
//! it, and `recover_after` probes in a row that succeed close it again. A
//! failure while half-open opens it. Needing several of each keeps a flaky
//! endpoint from flapping. An endpoint ejected for its faults
//! ([`Breaker::eject`]) answers probes all along: its probes count only once
//! its ejection is over.

use std::time::Duration;

use tokio::time::Instant;

/// The breaker's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

/// What an observation did to the breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// Closed or half-open to open: stop sending, move calls in flight away.
    Opened,
    /// Open to half-open: a probe answered.
    HalfOpened,
    /// Back to closed: take items again.
    Closed,
    /// Its calls fail one after another: probe it now.
    Suspected,
    /// Its calls fail one after another while its probe answers: eject it
    /// if the others can carry the load.
    Faulty,
}

/// What a call says about the endpoint's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// It answered.
    Up,
    /// It could not be reached: the connection was refused.
    Down,
    /// This call failed (a 5xx, a 503 included, no answer in time, a
    /// stream cut or stalled): a fault of the call, which says the
    /// endpoint is down only when nothing else gets through.
    Fault,
    /// Nothing (it said no and is up: a 4xx, a 429).
    Silent,
}

/// Calls in a row that failed with faults before the endpoint counts as
/// down.
pub const FAULTS_IN_A_ROW: u32 = 20;

#[derive(Debug, Clone)]
pub struct Breaker {
    state: BreakerState,
    failures: u32,
    faults: u32,
    successes: u32,
    max_failures: u32,
    recover_after: u32,
    /// Its calls failed [`FAULTS_IN_A_ROW`] times in a row; a probe decides.
    suspect: bool,
    /// Ejected until then: probes before it say nothing.
    held_until: Option<Instant>,
    /// When the first of the faults in a row came.
    first_fault: Option<Instant>,
}

impl Breaker {
    pub fn new(max_failures: u32, recover_after: u32) -> Self {
        Self {
            state: BreakerState::Closed,
            failures: 0,
            faults: 0,
            successes: 0,
            max_failures: max_failures.max(1),
            recover_after: recover_after.max(1),
            suspect: false,
            held_until: None,
            first_fault: None,
        }
    }

    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// Whether calls may be sent.
    pub fn admits(&self) -> bool {
        self.state == BreakerState::Closed
    }

    /// A health probe's result, at `now`.
    pub fn probe(&mut self, ok: bool, now: Instant) -> Option<Transition> {
        if let Some(until) = self.held_until {
            if self.state == BreakerState::Open && now < until {
                return None;
            }
            self.held_until = None;
        }
        match (self.state, ok) {
            (BreakerState::Closed, true) if self.suspect => {
                self.suspect = false;
                self.faults = 0;
                self.failures = 0;
                Some(Transition::Faulty)
            }
            (BreakerState::Closed, true) => {
                self.failures = 0;
                None
            }
            (BreakerState::Closed, false) if self.suspect => self.open(),
            (BreakerState::Closed, false) => self.fail(),
            (BreakerState::Open, true) => {
                self.state = BreakerState::HalfOpen;
                self.successes = 1;
                self.close_if_recovered().or(Some(Transition::HalfOpened))
            }
            (BreakerState::Open, false) => None,
            (BreakerState::HalfOpen, true) => {
                self.successes += 1;
                self.close_if_recovered()
            }
            (BreakerState::HalfOpen, false) => self.open(),
        }
    }

    /// A call's result at `now`, as far as the endpoint's health goes;
    /// faults in a row make it suspect only once they have gone on for
    /// `span` or number `burst` more than [`FAULTS_IN_A_ROW`].
    pub fn call(
        &mut self,
        health: Health,
        now: Instant,
        span: Duration,
        burst: u32,
    ) -> Option<Transition> {
        // Calls finishing after the breaker opened say nothing new.
        if self.state != BreakerState::Closed {
            return None;
        }
        match health {
            Health::Up => {
                self.failures = 0;
                self.faults = 0;
                self.suspect = false;
                self.first_fault = None;
                None
            }
            Health::Down => self.fail(),
            Health::Fault => {
                self.faults += 1;
                let first = *self.first_fault.get_or_insert(now);
                let lasting = now.saturating_duration_since(first) >= span
                    || self.faults >= burst.saturating_add(FAULTS_IN_A_ROW);
                if self.faults >= FAULTS_IN_A_ROW && lasting && !self.suspect {
                    self.suspect = true;
                    Some(Transition::Suspected)
                } else {
                    None
                }
            }
            Health::Silent => None,
        }
    }

    /// Opens the breaker whatever its counts (the engine's process died,
    /// or the fleet ejects a faulty endpoint).
    pub fn trip(&mut self) -> Option<Transition> {
        if self.state == BreakerState::Open {
            None
        } else {
            self.open()
        }
    }

    /// Ejects the endpoint for its faults until `until`: open, and probes
    /// count again only from then on. An endpoint that is open already
    /// stays as it is.
    pub fn eject(&mut self, until: Instant) -> Option<Transition> {
        if self.state == BreakerState::Open {
            return None;
        }
        let transition = self.open();
        self.held_until = Some(until);
        transition
    }

    /// Until when it is ejected, if it is.
    pub fn held_until(&self) -> Option<Instant> {
        self.held_until.filter(|_| self.state == BreakerState::Open)
    }

    /// Back to closed with clean counts (a restarted engine became ready).
    pub fn reset(&mut self) -> Option<Transition> {
        let was = self.state;
        *self = Self::new(self.max_failures, self.recover_after);
        (was != BreakerState::Closed).then_some(Transition::Closed)
    }

    fn fail(&mut self) -> Option<Transition> {
        self.failures += 1;
        if self.failures >= self.max_failures {
            self.open()
        } else {
            None
        }
    }

    fn open(&mut self) -> Option<Transition> {
        self.state = BreakerState::Open;
        self.held_until = None;
        self.failures = 0;
        self.faults = 0;
        self.successes = 0;
        self.suspect = false;
        Some(Transition::Opened)
    }

    fn close_if_recovered(&mut self) -> Option<Transition> {
        if self.successes >= self.recover_after {
            self.state = BreakerState::Closed;
            self.failures = 0;
            self.faults = 0;
            self.successes = 0;
            Some(Transition::Closed)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_in_a_row_open_and_successes_in_a_row_close() {
        let mut b = Breaker::new(3, 2);
        assert_eq!(b.probe(false, Instant::now()), None);
        assert_eq!(
            b.call(Health::Down, Instant::now(), Duration::ZERO, 0),
            None
        );
        assert_eq!(
            b.call(Health::Up, Instant::now(), Duration::ZERO, 0),
            None,
            "a success resets the count"
        );
        assert_eq!(b.probe(false, Instant::now()), None);
        assert_eq!(
            b.call(Health::Down, Instant::now(), Duration::ZERO, 0),
            None
        );
        assert_eq!(b.probe(false, Instant::now()), Some(Transition::Opened));
        assert!(!b.admits());
        assert_eq!(
            b.call(Health::Up, Instant::now(), Duration::ZERO, 0),
            None,
            "late calls do not close it"
        );
        assert_eq!(b.probe(true, Instant::now()), Some(Transition::HalfOpened));
        assert!(!b.admits());
        assert_eq!(b.probe(true, Instant::now()), Some(Transition::Closed));
        assert!(b.admits());
    }

    #[test]
    fn a_failure_while_half_open_opens_again_and_neutral_calls_count_for_nothing() {
        let mut b = Breaker::new(1, 3);
        assert_eq!(
            b.call(Health::Silent, Instant::now(), Duration::ZERO, 0),
            None
        );
        assert_eq!(
            b.call(Health::Down, Instant::now(), Duration::ZERO, 0),
            Some(Transition::Opened)
        );
        assert_eq!(b.probe(true, Instant::now()), Some(Transition::HalfOpened));
        assert_eq!(b.probe(false, Instant::now()), Some(Transition::Opened));
        assert_eq!(b.state(), BreakerState::Open);
        assert_eq!(b.trip(), None, "already open");
        assert_eq!(b.reset(), Some(Transition::Closed));
    }

    #[test]
    fn faults_make_it_suspect_only_when_nothing_gets_through() {
        let mut b = Breaker::new(1, 1);
        // A fault rate of one in three, for a long time: never suspect.
        for i in 0..3_000 {
            let health = if i % 3 == 0 {
                Health::Fault
            } else {
                Health::Up
            };
            assert_eq!(
                b.call(health, Instant::now(), Duration::ZERO, 0),
                None,
                "call {i}"
            );
        }
        // Failures that are all there is: suspect, after FAULTS_IN_A_ROW,
        // once.
        for _ in 1..FAULTS_IN_A_ROW {
            assert_eq!(
                b.call(Health::Fault, Instant::now(), Duration::ZERO, 0),
                None
            );
        }
        assert_eq!(
            b.call(Health::Fault, Instant::now(), Duration::ZERO, 0),
            Some(Transition::Suspected)
        );
        assert_eq!(
            b.call(Health::Fault, Instant::now(), Duration::ZERO, 0),
            None
        );
        assert!(b.admits(), "suspect is not out");
        // Its probe fails: down, out at once.
        assert_eq!(b.probe(false, Instant::now()), Some(Transition::Opened));
        assert!(!b.admits());
    }

    #[test]
    fn faults_that_end_before_the_answers_of_their_burst_are_not_a_string() {
        let t0 = Instant::now();
        let span = Duration::from_millis(50);
        let mut b = Breaker::new(3, 1);
        // A burst's failures all come back within 4 ms, before its answers.
        for i in 0..40 {
            let at = t0 + Duration::from_micros(100 * i);
            assert_eq!(b.call(Health::Fault, at, span, 100), None, "fault {i}");
        }
        assert_eq!(b.call(Health::Up, t0 + span, span, 100), None);
        for i in 0..40 {
            let at = t0 + span + Duration::from_micros(100 * i);
            assert_eq!(b.call(Health::Fault, at, span, 100), None, "fault {i}");
        }
        // Faults, and nothing else, for longer than calls take: suspect.
        assert_eq!(
            b.call(Health::Fault, t0 + span * 2, span, 100),
            Some(Transition::Suspected)
        );
        // Or at once, when more fail in a row than could have been in
        // flight together.
        let mut b = Breaker::new(3, 1);
        for i in 1..(30 + FAULTS_IN_A_ROW) {
            assert_eq!(b.call(Health::Fault, t0, span, 30), None, "fault {i}");
        }
        assert_eq!(
            b.call(Health::Fault, t0, span, 30),
            Some(Transition::Suspected)
        );
    }

    #[test]
    fn a_suspect_that_answers_its_probe_is_for_the_fleet_to_judge() {
        let mut b = Breaker::new(3, 1);
        for _ in 1..FAULTS_IN_A_ROW {
            b.call(Health::Fault, Instant::now(), Duration::ZERO, 0);
        }
        assert_eq!(
            b.call(Health::Fault, Instant::now(), Duration::ZERO, 0),
            Some(Transition::Suspected)
        );
        assert_eq!(b.probe(true, Instant::now()), Some(Transition::Faulty));
        assert!(b.admits());
        // Not suspect any more: another string of faults asks again.
        for _ in 1..FAULTS_IN_A_ROW {
            assert_eq!(
                b.call(Health::Fault, Instant::now(), Duration::ZERO, 0),
                None
            );
        }
        assert_eq!(
            b.call(Health::Fault, Instant::now(), Duration::ZERO, 0),
            Some(Transition::Suspected)
        );
        // A success in between clears it.
        assert_eq!(b.call(Health::Up, Instant::now(), Duration::ZERO, 0), None);
        assert_eq!(
            b.probe(false, Instant::now()),
            None,
            "one failed probe of max_failures"
        );
        assert!(b.admits());
        // The fleet ejects it.
        assert_eq!(b.trip(), Some(Transition::Opened));
    }

    #[test]
    fn an_ejected_endpoint_comes_back_through_its_probes_only_after_its_ejection() {
        let t0 = Instant::now();
        let mut b = Breaker::new(3, 2);
        let until = t0 + std::time::Duration::from_secs(30);
        assert_eq!(b.eject(until), Some(Transition::Opened));
        assert_eq!(b.held_until(), Some(until));
        assert!(!b.admits());
        // Its probes answer, but it is out until its time is up.
        for s in [1, 10, 29] {
            assert_eq!(b.probe(true, t0 + std::time::Duration::from_secs(s)), None);
        }
        assert_eq!(b.probe(true, until), Some(Transition::HalfOpened));
        assert_eq!(b.held_until(), None);
        assert_eq!(b.probe(true, until), Some(Transition::Closed));
        // An endpoint that is down is not ejected on top of it (nor held).
        b.trip();
        assert_eq!(b.eject(until), None);
        assert_eq!(b.held_until(), None);
    }
}
