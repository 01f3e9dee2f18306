//! An endpoint's rate limits: requests and tokens per minute, and the pauses
//! the endpoint asks for.
//!
//! - `rpm` and `tpm` are token buckets holding one second's worth. A call's
//!   token cost is estimated before it is sent and corrected from its `usage`
//!   afterwards (the bucket may go into debt, which later calls repay).
//! - `Retry-After` on a 429 pauses the whole endpoint until then, not only
//!   the item; `x-ratelimit-remaining-*` near zero pauses it until the
//!   matching `x-ratelimit-reset-*`. Pausing costs one wait instead of a
//!   string of 429s.
//! - With no `rpm` given, a 429 teaches a request rate: the higher of the
//!   rate calls succeeded at just before it and one call per `Retry-After`
//!   (a token bucket that has just run out asks to wait one token's time).
//!   Until the next 429 it probes upward fast (+5% a quiet second from a
//!   precise Retry-After, +25% without); after that each 429 lowers it (at most once a second) by 5%, or to what got
//!   through in the last second when that is lower, and every quiet second
//!   raises it by 1%, so it keeps probing just under the quota.
//!
//! Time is passed in, so this runs on paused time in tests.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

pub use crate::client::Quota;

/// The learned rate starts this far below its estimate.
const LEARNED_START: f64 = 0.95;
/// Each further 429 multiplies the learned rate by this...
const LEARNED_CUT: f64 = 0.95;
/// ...or sets it this far below what got through in the last second.
const LEARNED_UNDER: f64 = 0.98;
/// Each quiet second multiplies it by this until its first cut, when the
/// first estimate came without a precise Retry-After...
const LEARNED_PROBE_FAST: f64 = 1.25;
/// ...or by this when it came with one (near the quota already)...
const LEARNED_PROBE_NEAR: f64 = 1.05;
/// ...and by this after the first cut.
const LEARNED_PROBE: f64 = 1.01;
/// Success counts kept for learning, one slot per second.
const WINDOW: usize = 4;

#[derive(Debug, Clone)]
struct Bucket {
    per_second: f64,
    capacity: f64,
    level: f64,
    last: Instant,
    /// The seconds' worth of calls it holds when full.
    burst: f64,
}

/// A configured quota allows a second's worth at once.
const CONFIGURED_BURST: f64 = 1.0;
/// A learned one paces closely: 20 ms' worth (at least one call).
const LEARNED_BURST: f64 = 0.02;

impl Bucket {
    fn per_minute(per_minute: f64, now: Instant) -> Self {
        let per_second = per_minute / 60.0;
        let capacity = (per_second * CONFIGURED_BURST).max(1.0);
        Self {
            per_second,
            capacity,
            level: capacity,
            last: now,
            burst: CONFIGURED_BURST,
        }
    }

    /// Starts empty: it begins where the endpoint just said no.
    fn learned(per_second: f64, now: Instant) -> Self {
        Self {
            per_second,
            capacity: (per_second * LEARNED_BURST).max(1.0),
            level: 0.0,
            last: now,
            burst: LEARNED_BURST,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.level = (self.level + elapsed * self.per_second).min(self.capacity);
        self.last = now;
    }

    /// How long until `cost` may be taken (a cost above the capacity waits
    /// for a full bucket and leaves it in debt).
    fn wait(&mut self, now: Instant, cost: f64) -> Duration {
        self.refill(now);
        let need = cost.min(self.capacity);
        if self.level >= need {
            Duration::ZERO
        } else {
            Duration::from_secs_f64((need - self.level) / self.per_second)
        }
    }

    fn set_rate(&mut self, now: Instant, per_second: f64) {
        self.refill(now);
        self.per_second = per_second;
        self.capacity = (per_second * self.burst).max(1.0);
        self.level = self.level.min(self.capacity);
    }
}

#[derive(Debug)]
struct Learned {
    bucket: Bucket,
    /// The last change up or down: probes come a second apart.
    last_change: Instant,
    /// The last cut: cuts come a second apart (a burst of 429s is one).
    last_cut: Instant,
    /// When the rate was first learned.
    since: Instant,
    /// How a quiet second raises the rate now.
    probe: f64,
}

#[derive(Debug)]
struct State {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
    paused_until: Option<Instant>,
    learned: Option<Learned>,
    /// Successes per second over the last few seconds, to learn from.
    successes: [u32; WINDOW],
    second: Instant,
    created: Instant,
}

/// What changed, for the endpoint's event log.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RateEvent {
    /// Sending is paused until then.
    Paused(Duration),
    /// A request rate was learned or lowered (requests per second).
    Learned(f64),
}

#[derive(Debug)]
pub struct RateLimiter {
    state: Mutex<State>,
}

impl RateLimiter {
    pub fn new(rpm: Option<u32>, tpm: Option<u64>, now: Instant) -> Self {
        Self {
            state: Mutex::new(State {
                requests: rpm.map(|r| Bucket::per_minute(f64::from(r), now)),
                tokens: tpm.map(|t| Bucket::per_minute(t as f64, now)),
                paused_until: None,
                learned: None,
                successes: [0; WINDOW],
                second: now,
                created: now,
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How long to wait before a call costing `tokens` may go; zero means it
    /// may go now, and its cost has been taken.
    pub fn try_take(&self, now: Instant, tokens: u64) -> Duration {
        let mut state = self.state();
        let mut wait = state
            .paused_until
            .map_or(Duration::ZERO, |until| until.saturating_duration_since(now));
        if let Some(bucket) = state.requests.as_mut() {
            wait = wait.max(bucket.wait(now, 1.0));
        }
        if let Some(learned) = state.learned.as_mut() {
            wait = wait.max(learned.bucket.wait(now, 1.0));
        }
        if let Some(bucket) = state.tokens.as_mut() {
            wait = wait.max(bucket.wait(now, tokens as f64));
        }
        if wait.is_zero() {
            if let Some(bucket) = state.requests.as_mut() {
                bucket.level -= 1.0;
            }
            if let Some(learned) = state.learned.as_mut() {
                learned.bucket.level -= 1.0;
            }
            if let Some(bucket) = state.tokens.as_mut() {
                bucket.level -= tokens as f64;
            }
        }
        wait
    }

    /// Waits until a call costing `tokens` may go, and takes its cost.
    pub async fn acquire(&self, tokens: u64) {
        loop {
            let wait = self.try_take(Instant::now(), tokens);
            if wait.is_zero() {
                return;
            }
            tokio::time::sleep(wait).await;
        }
    }

    /// Corrects a call's token cost once its usage is known.
    pub fn correct(&self, estimated: u64, actual: u64) {
        if let Some(bucket) = self.state().tokens.as_mut() {
            bucket.level -= actual as f64 - estimated as f64;
        }
    }

    /// Pauses sending until `until` (a later pause wins).
    fn pause(state: &mut State, now: Instant, wait: Duration) -> Option<RateEvent> {
        let until = now + wait;
        if state.paused_until.is_some_and(|p| p >= until) {
            return None;
        }
        state.paused_until = Some(until);
        Some(RateEvent::Paused(wait))
    }

    fn roll(state: &mut State, now: Instant) {
        let seconds = now.saturating_duration_since(state.second).as_secs() as usize;
        if seconds == 0 {
            return;
        }
        for _ in 0..seconds.min(WINDOW) {
            state.successes.rotate_right(1);
            state.successes[0] = 0;
        }
        state.second += Duration::from_secs(seconds as u64);
    }

    /// A successful call.
    pub fn on_success(&self, now: Instant) {
        let mut state = self.state();
        Self::roll(&mut state, now);
        state.successes[0] += 1;
        if let Some(learned) = state.learned.as_mut()
            && now.saturating_duration_since(learned.last_change) >= Duration::from_secs(1)
        {
            let rate = learned.bucket.per_second * learned.probe;
            learned.bucket.set_rate(now, rate);
            learned.last_change = now;
        }
    }

    /// A 429 (or a 503 with `Retry-After`).
    pub fn on_rate_limited(&self, now: Instant, retry_after: Option<Duration>) -> Vec<RateEvent> {
        let mut state = self.state();
        Self::roll(&mut state, now);
        let mut events = Vec::new();
        if let Some(wait) = retry_after {
            events.extend(Self::pause(&mut state, now, wait));
        }
        if state.requests.is_some() {
            // The user said what the quota is; trust it and the pauses.
            return events;
        }
        // What got through in the last full second.
        let through = f64::from(state.successes[1]);
        match state.learned.as_mut() {
            None => {
                // Calls succeeded at this rate just before the quota said no.
                let seen: u32 = state.successes.iter().sum();
                let span = now
                    .saturating_duration_since(state.created)
                    .min(Duration::from_secs(WINDOW as u64))
                    .max(Duration::from_secs(1));
                let succeeded = f64::from(seen) / span.as_secs_f64();
                // A bucket that just ran out asks to wait for one token. A
                // whole second is too coarse to say more than "slow down".
                let per_token = retry_after
                    .filter(|w| !w.is_zero() && *w < Duration::from_secs(1))
                    .map(|w| 1.0 / w.as_secs_f64());
                // Once there are a few seconds of history, both are upper
                // bounds (the successes include a first burst, a partly
                // refilled bucket asks for less than a token's time), so take
                // the lower, a little below; before that the successes say
                // little. With a precise Retry-After it is near the quota
                // already and probes up by 5% a second until its first cut;
                // without, by 25%.
                let history =
                    now.saturating_duration_since(state.created) >= Duration::from_secs(2);
                let estimate = match per_token {
                    Some(p) if history => p.min(succeeded),
                    Some(p) => p,
                    None => succeeded,
                };
                let rate = (estimate * LEARNED_START).max(0.5);
                state.learned = Some(Learned {
                    bucket: Bucket::learned(rate, now),
                    last_change: now,
                    last_cut: now,
                    since: now,
                    probe: if per_token.is_some() {
                        LEARNED_PROBE_NEAR
                    } else {
                        LEARNED_PROBE_FAST
                    },
                });
                events.push(RateEvent::Learned(rate));
            }
            Some(learned) => {
                // In the first second each precise Retry-After is another
                // upper bound of the quota: keep the tightest.
                let tighter = retry_after
                    .filter(|w| !w.is_zero() && *w < Duration::from_secs(1))
                    .map(|w| LEARNED_START / w.as_secs_f64())
                    .filter(|r| *r < learned.bucket.per_second);
                if let Some(rate) = tighter
                    && now.saturating_duration_since(learned.since) < Duration::from_secs(1)
                {
                    learned.bucket.set_rate(now, rate.max(0.5));
                    events.push(RateEvent::Learned(rate.max(0.5)));
                } else if now.saturating_duration_since(learned.last_cut) >= Duration::from_secs(1)
                {
                    // While paced above the quota, what got through in the last
                    // full second is the quota.
                    let mut rate = learned.bucket.per_second * LEARNED_CUT;
                    if through > 0.0 {
                        rate = rate
                            .min((through * LEARNED_UNDER).max(learned.bucket.per_second * 0.5));
                    }
                    let rate = rate.max(0.1);
                    learned.bucket.set_rate(now, rate);
                    learned.last_change = now;
                    learned.last_cut = now;
                    learned.probe = LEARNED_PROBE;
                    events.push(RateEvent::Learned(rate));
                }
            }
        }
        events
    }

    /// A response's quota headers: when one is nearly spent, pause until it
    /// resets.
    pub fn observe(&self, now: Instant, quota: &Quota) -> Option<RateEvent> {
        let nearly_spent = |remaining: Option<u64>, limit: Option<u64>| match remaining {
            Some(remaining) => remaining <= limit.map_or(0, |l| l / 100),
            None => false,
        };
        let mut wait = Duration::ZERO;
        if nearly_spent(quota.remaining_requests, quota.limit_requests) {
            wait = wait.max(quota.reset_requests.unwrap_or_default());
        }
        if nearly_spent(quota.remaining_tokens, quota.limit_tokens) {
            wait = wait.max(quota.reset_tokens.unwrap_or_default());
        }
        if wait.is_zero() {
            return None;
        }
        Self::pause(&mut self.state(), now, wait)
    }

    /// Whether calls are paced (by `rpm`, or by a learned rate): then a 429
    /// says the pace is a little high, not that too many calls are in flight.
    pub fn paces(&self) -> bool {
        let state = self.state();
        state.requests.is_some() || state.learned.is_some()
    }

    /// The learned request rate, per second.
    pub fn learned_rate(&self) -> Option<f64> {
        self.state().learned.as_ref().map(|l| l.bucket.per_second)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rpm_paces_requests() {
        let t0 = Instant::now();
        let limiter = RateLimiter::new(Some(120), None, t0);
        // Two a second: the bucket holds two, then one every 500 ms.
        assert_eq!(limiter.try_take(t0, 0), Duration::ZERO);
        assert_eq!(limiter.try_take(t0, 0), Duration::ZERO);
        assert_eq!(limiter.try_take(t0, 0), Duration::from_millis(500));
        assert_eq!(
            limiter.try_take(t0 + Duration::from_millis(500), 0),
            Duration::ZERO
        );
    }

    #[test]
    fn tokens_are_estimated_then_corrected() {
        let t0 = Instant::now();
        let limiter = RateLimiter::new(None, Some(6000), t0);
        // 100 tokens a second; a 100-token call goes, then the bucket is empty.
        assert_eq!(limiter.try_take(t0, 100), Duration::ZERO);
        assert_eq!(limiter.try_take(t0, 50), Duration::from_millis(500));
        // It used only 50: 50 more may go now.
        limiter.correct(100, 50);
        assert_eq!(limiter.try_take(t0, 50), Duration::ZERO);
    }

    #[test]
    fn retry_after_and_spent_quotas_pause_the_endpoint() {
        let t0 = Instant::now();
        let limiter = RateLimiter::new(Some(6000), None, t0);
        limiter.on_rate_limited(t0, Some(Duration::from_secs(2)));
        assert_eq!(limiter.try_take(t0, 0), Duration::from_secs(2));
        let quota = Quota {
            limit_requests: Some(1000),
            remaining_requests: Some(3),
            reset_requests: Some(Duration::from_secs(5)),
            ..Quota::default()
        };
        assert_eq!(
            limiter.observe(t0, &quota),
            Some(RateEvent::Paused(Duration::from_secs(5)))
        );
        assert_eq!(
            limiter.try_take(t0 + Duration::from_secs(1), 0),
            Duration::from_secs(4)
        );
    }

    #[test]
    fn a_rate_is_learned_from_429s_and_probed_upward() {
        let t0 = Instant::now();
        let limiter = RateLimiter::new(None, None, t0);
        // Ten calls a second succeed for two seconds, then a 429.
        for i in 0..20 {
            limiter.on_success(t0 + Duration::from_millis(i * 100));
        }
        let events = limiter.on_rate_limited(t0 + Duration::from_millis(2000), None);
        assert_eq!(events, vec![RateEvent::Learned(9.5)]);
        // A quiet second: it probes upward fast.
        limiter.on_success(t0 + Duration::from_millis(3100));
        assert_eq!(limiter.learned_rate(), Some(9.5 * 1.25));
        // A 429 within a second of the last cut (the first 429, at 2000 ms)
        // changes nothing.
        assert!(
            limiter
                .on_rate_limited(t0 + Duration::from_millis(2900), None)
                .is_empty()
        );
        // In the next second 11 calls get through (and the rate is probed up
        // once more, at 4160 ms); a 429 brings the rate down to what got
        // through, even right after a probe.
        for i in 0..11 {
            limiter.on_success(t0 + Duration::from_millis(4000 + i * 80));
        }
        assert_eq!(limiter.learned_rate(), Some(9.5 * 1.25 * 1.25));
        let cut = limiter.on_rate_limited(t0 + Duration::from_millis(5100), None);
        assert_eq!(cut, vec![RateEvent::Learned(11.0 * 0.98)]);
        // Probing is slow now.
        limiter.on_success(t0 + Duration::from_millis(6300));
        let probed = limiter.learned_rate().unwrap();
        assert!((probed - 11.0 * 0.98 * 1.01).abs() < 1e-9, "{probed}");
    }

    #[test]
    fn a_precise_retry_after_gives_the_quota_at_once() {
        let t0 = Instant::now();
        let limiter = RateLimiter::new(None, None, t0);
        // A burst of 30 went through, then the bucket said one token takes
        // 50 ms: the quota is 20 a second, not 30.
        for _ in 0..30 {
            limiter.on_success(t0);
        }
        let events = limiter.on_rate_limited(
            t0 + Duration::from_millis(10),
            Some(Duration::from_millis(50)),
        );
        assert_eq!(
            events,
            vec![
                RateEvent::Paused(Duration::from_millis(50)),
                RateEvent::Learned(19.0)
            ]
        );
    }

    #[test]
    fn in_the_first_second_a_longer_retry_after_tightens_the_rate() {
        let t0 = Instant::now();
        let limiter = RateLimiter::new(None, None, t0);
        limiter.on_rate_limited(t0, Some(Duration::from_millis(10)));
        assert_eq!(limiter.learned_rate(), Some(95.0));
        let events = limiter.on_rate_limited(
            t0 + Duration::from_millis(30),
            Some(Duration::from_millis(50)),
        );
        let close = |rate: f64| (rate - 19.0).abs() < 1e-9;
        assert!(
            matches!(events.last(), Some(RateEvent::Learned(r)) if close(*r)),
            "{events:?}"
        );
        // A shorter one says nothing new.
        limiter.on_rate_limited(
            t0 + Duration::from_millis(60),
            Some(Duration::from_millis(20)),
        );
        assert!(close(limiter.learned_rate().unwrap()));
    }
}
