//! An endpoint's rate limits: requests and tokens per minute, and the pauses
//! the endpoint asks for.
//!
//! - `rpm` and `tpm` are token buckets holding one second's worth. A call's
//!   token cost is estimated before it is sent and corrected from its `usage`
//!   afterwards (the bucket may go into debt, which later calls repay).
//! - `Retry-After` on a 429 pauses the whole endpoint until then, not only
//!   the item: pausing costs one wait instead of a string of 429s.
//! - Quotas an endpoint announces in `x-ratelimit-limit/remaining/reset-*`
//!   are mirrored: each call sent takes from the mirror, each response
//!   says what is left. Such a quota refills continuously (OpenAI's: the
//!   reset is the time until it is full again, so it refills at the limit
//!   over the window the reset implies, and calls are paced to that rate),
//!   unless the time it says it is full again stays put while a quarter of
//!   it is taken: then it comes back in windows, and a spent one waits for
//!   its window's end. A configured `rpm` or `tpm` is authoritative: the
//!   matching headers are then not paced to.
//! - With no `rpm` given and no quota announced, a 429 is a quota's only
//!   when it says so: with a precise `Retry-After` (under a second: a
//!   bucket that ran out), or when 429s are sustained (at least 3 in the
//!   last few seconds, and at least a tenth of the answers). A sporadic one
//!   (a whole-second or no `Retry-After`, amid answers) delays only its own
//!   call, as a 503 does: it neither pauses the endpoint nor caps its rate.
//!   A quota's 429 pauses the endpoint for its `Retry-After` and teaches a
//!   request rate: the higher of the rate calls succeeded at just before it and one
//!   call per `Retry-After` (a token bucket that has just run out asks to
//!   wait one token's time). Until the next 429 it probes upward fast (+5%
//!   a quiet second from a precise Retry-After, +25% without); after that
//!   each 429 lowers it (at most once a second) by 5%, or to what got
//!   through in the last second when that is lower. A cut is regained as
//!   fast as it came, along CUBIC's curve (a 5% cut in 2 s), and past the
//!   rate before it each quiet second raises it by 1%, so it keeps probing
//!   just under the quota.
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
/// ...and by this after the first cut, once the rate before it is regained.
const LEARNED_PROBE: f64 = 1.01;
/// How fast a cut is regained (CUBIC's constant, relative to the rate
/// before the cut): a 5% cut in 2 s, a 50% cut in 4.3 s.
const REGAIN: f64 = 0.00625;
/// Success counts kept for learning, one slot per second.
const WINDOW: usize = 4;
/// 429s are sustained (a quota's) with at least this many in the window...
const SUSTAINED_429S: u32 = 3;
/// ...that are at least this share of its answers (429s and successes).
const SUSTAINED_SHARE: f64 = 0.1;

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

/// How a quota the endpoint announces comes back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refill {
    /// A token at a time, as OpenAI's do: the reset is the time until it
    /// is full again.
    Continuous,
    /// All at once when its window ends.
    Window,
}

/// A quota the endpoint announces in its `x-ratelimit-*` headers, mirrored
/// here: each call sent takes from it, each response says what is left.
#[derive(Debug, Clone)]
struct Announced {
    limit: f64,
    level: f64,
    last: Instant,
    refill: Refill,
    /// While it refills continuously: the limit over the window its reset
    /// implies (unknown until it has been used enough to tell).
    per_second: Option<f64>,
    /// When it is full again (continuous) or its window ends (fixed).
    reset_at: Instant,
    /// The answer with the most left since it was last full (or since the
    /// last window): what was left, and when it said it would be full.
    anchor: (f64, Instant),
    /// A window ended here and the mirror was filled: the calls sent since
    /// are taken from it, and the new window's first answers must not
    /// give them back.
    rolled: bool,
}

impl Announced {
    fn new(now: Instant, limit: f64, remaining: f64, reset: Duration) -> Self {
        Self {
            limit,
            level: remaining,
            last: now,
            refill: Refill::Continuous,
            per_second: Self::rate(limit, remaining, reset),
            reset_at: now + reset,
            anchor: (remaining, now + reset),
            rolled: false,
        }
    }

    /// The refill rate a continuous quota's reset implies, once enough of
    /// it is used for the reset to say (a tenth).
    fn rate(limit: f64, remaining: f64, reset: Duration) -> Option<f64> {
        let used = limit - remaining;
        (used >= (limit * 0.1).max(1.0) && !reset.is_zero()).then(|| used / reset.as_secs_f64())
    }

    /// Brings the level up to `now`.
    fn refill(&mut self, now: Instant) {
        match self.refill {
            Refill::Continuous => {
                if let Some(rate) = self.per_second {
                    let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
                    self.level = (self.level + elapsed * rate).min(self.limit);
                }
            }
            Refill::Window => {
                if now >= self.reset_at && self.level < self.limit && !self.rolled {
                    self.level = self.limit;
                    self.rolled = true;
                }
            }
        }
        self.last = now;
    }

    /// How long until `cost` may be taken.
    fn wait(&mut self, now: Instant, cost: f64) -> Duration {
        self.refill(now);
        let need = cost.min(self.limit).max(0.0);
        if self.level >= need {
            return Duration::ZERO;
        }
        match (self.refill, self.per_second) {
            (Refill::Continuous, Some(rate)) => Duration::from_secs_f64((need - self.level) / rate),
            // Not known how fast it refills: it is full at its reset.
            _ => self
                .reset_at
                .saturating_duration_since(now)
                .max(Duration::from_millis(1)),
        }
    }

    /// A response said `remaining` are left, full again (or a new window)
    /// in `reset`. `Some` when it shows the quota comes back in windows.
    fn observe(&mut self, now: Instant, remaining: f64, reset: Duration) -> Option<Refill> {
        self.refill(now);
        let mut changed = None;
        let reset_at = now + reset;
        // A continuous quota is full again later by a token's time for
        // each call taken; a quota that comes back in windows is full at
        // the window's end however many are taken. So once a quarter of
        // it has gone since the anchor, the time it says it is full again
        // tells them apart.
        let (anchor, anchor_reset) = self.anchor;
        if remaining >= anchor {
            self.anchor = (remaining, reset_at);
        } else if self.refill == Refill::Continuous
            && anchor - remaining >= (self.limit / 4.0).max(2.0)
            && let Some(rate) = Self::rate(self.limit, remaining, reset)
        {
            let expected = (anchor - remaining) / rate;
            let moved = reset_at
                .saturating_duration_since(anchor_reset)
                .as_secs_f64();
            if expected >= 0.02 && moved < expected / 2.0 {
                self.refill = Refill::Window;
                self.per_second = None;
                changed = Some(Refill::Window);
            }
        }
        if self.refill == Refill::Window
            && reset_at + Duration::from_secs(1).min(reset) < self.reset_at
        {
            // An answer from the window before, read late.
            return changed;
        }
        match self.refill {
            Refill::Continuous => {
                if let Some(rate) = Self::rate(self.limit, remaining, reset) {
                    self.per_second = Some(rate);
                }
                self.level = self.level.min(remaining);
            }
            Refill::Window => {
                if reset_at > self.reset_at + Duration::from_secs(1).min(reset / 2) {
                    // A new window: what it says is left, unless the mirror
                    // rolled over already and has counted the calls since.
                    self.level = if self.rolled {
                        self.level.min(remaining)
                    } else {
                        remaining
                    };
                    self.rolled = false;
                } else {
                    self.level = self.level.min(remaining);
                }
            }
        }
        self.reset_at = reset_at;
        changed
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
    /// After a cut: the rate before it, regained along a cubic curve
    /// (fast at first, slowing near it), then probed past slowly.
    regain: Option<f64>,
    /// The rate right after the last cut.
    cut_to: f64,
}

#[derive(Debug)]
struct State {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
    paused_until: Option<Instant>,
    learned: Option<Learned>,
    /// Quotas the endpoint announces (`x-ratelimit-*`), when no `rpm` or
    /// `tpm` is configured for them.
    announced_requests: Option<Announced>,
    announced_tokens: Option<Announced>,
    /// Successes per second over the last few seconds, to learn from.
    successes: [u32; WINDOW],
    /// 429s per second over the same seconds.
    limited: [u32; WINDOW],
    /// Calls sent per second over the same seconds.
    sent: [u32; WINDOW],
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
    /// The endpoint's request or token quota comes back all at once when
    /// its window ends (not a token at a time).
    Windowed(&'static str),
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
                announced_requests: None,
                announced_tokens: None,
                successes: [0; WINDOW],
                limited: [0; WINDOW],
                sent: [0; WINDOW],
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
        if let Some(announced) = state.announced_requests.as_mut() {
            wait = wait.max(announced.wait(now, 1.0));
        }
        if let Some(announced) = state.announced_tokens.as_mut() {
            wait = wait.max(announced.wait(now, tokens as f64));
        }
        if wait.is_zero() {
            Self::roll(&mut state, now);
            state.sent[0] += 1;
            if let Some(announced) = state.announced_requests.as_mut() {
                announced.level -= 1.0;
            }
            if let Some(announced) = state.announced_tokens.as_mut() {
                announced.level -= tokens as f64;
            }
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
        let mut state = self.state();
        let extra = actual as f64 - estimated as f64;
        if let Some(bucket) = state.tokens.as_mut() {
            bucket.level -= extra;
        }
        if let Some(announced) = state.announced_tokens.as_mut() {
            announced.level -= extra;
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

    /// Whether the window's 429s are a quota's: enough of them, and a
    /// large enough share of its calls: of those answered, or of those
    /// sent when more (a 429 comes back at once, a success after the
    /// model's time: as the first calls go out in growing bursts, the
    /// sporadic 429s of a burst are back before any of its successes, and
    /// among the answers alone they looked three times their share).
    fn sustained(state: &State) -> bool {
        let limited: u32 = state.limited.iter().sum();
        let answered = limited + state.successes.iter().sum::<u32>();
        let calls = answered.max(state.sent.iter().sum());
        limited >= SUSTAINED_429S && f64::from(limited) >= SUSTAINED_SHARE * f64::from(calls)
    }

    fn roll(state: &mut State, now: Instant) {
        let seconds = now.saturating_duration_since(state.second).as_secs() as usize;
        if seconds == 0 {
            return;
        }
        for _ in 0..seconds.min(WINDOW) {
            state.successes.rotate_right(1);
            state.successes[0] = 0;
            state.limited.rotate_right(1);
            state.limited[0] = 0;
            state.sent.rotate_right(1);
            state.sent[0] = 0;
        }
        state.second += Duration::from_secs(seconds as u64);
    }

    /// A successful call.
    pub fn on_success(&self, now: Instant) {
        let mut state = self.state();
        Self::roll(&mut state, now);
        state.successes[0] += 1;
        let Some(learned) = state.learned.as_mut() else {
            return;
        };
        if let Some(peak) = learned.regain {
            // CUBIC's curve: back at the peak after `k` seconds.
            let k = ((1.0 - learned.cut_to / peak) / REGAIN).cbrt();
            let t = now
                .saturating_duration_since(learned.last_cut)
                .as_secs_f64();
            if t >= k {
                learned.bucket.set_rate(now, peak);
                learned.regain = None;
                learned.last_change = now;
            } else {
                let rate = peak * (1.0 - REGAIN * (k - t).powi(3));
                learned.bucket.set_rate(now, rate.max(learned.cut_to));
            }
        } else if now.saturating_duration_since(learned.last_change) >= Duration::from_secs(1) {
            let rate = learned.bucket.per_second * learned.probe;
            learned.bucket.set_rate(now, rate);
            learned.last_change = now;
        }
    }

    /// A 429: the endpoint's quota said no.
    pub fn on_rate_limited(&self, now: Instant, retry_after: Option<Duration>) -> Vec<RateEvent> {
        let mut state = self.state();
        Self::roll(&mut state, now);
        state.limited[0] += 1;
        let trusted = state.requests.is_some() || state.announced_requests.is_some();
        let precise = retry_after.is_some_and(|w| !w.is_zero() && w < Duration::from_secs(1));
        if !trusted && state.learned.is_none() && !precise && !Self::sustained(&state) {
            // A sporadic 429: its call waits its Retry-After; the endpoint
            // goes on.
            return Vec::new();
        }
        let mut events = Vec::new();
        if let Some(wait) = retry_after {
            events.extend(Self::pause(&mut state, now, wait));
        }
        if let Some(announced) = state.announced_requests.as_mut() {
            // It announces its quota: none is left now.
            announced.level = announced.level.min(0.0);
        }
        if state.requests.is_some() || state.announced_requests.is_some() {
            // The user said what the quota is, or the endpoint does; trust
            // it and the pauses.
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
                    regain: None,
                    cut_to: rate,
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
                    let before = learned.bucket.per_second;
                    let mut rate = before * LEARNED_CUT;
                    // The rate to regain: the one before the cut, or what
                    // got through when that was less.
                    let mut peak = before;
                    if through > 0.0 && through * LEARNED_UNDER < rate {
                        rate = (through * LEARNED_UNDER).max(before * 0.5);
                        peak = through.max(rate);
                    }
                    let rate = rate.max(0.1);
                    learned.bucket.set_rate(now, rate);
                    learned.last_change = now;
                    learned.last_cut = now;
                    learned.probe = LEARNED_PROBE;
                    learned.regain = (peak > rate).then_some(peak);
                    learned.cut_to = rate;
                    events.push(RateEvent::Learned(rate));
                }
            }
        }
        events
    }

    /// A response's quota headers (`x-ratelimit-*`): mirrored, and paced
    /// to when no `rpm` or `tpm` is configured for them (what the config
    /// says stays authoritative). `Some` when a quota turns out to come
    /// back in windows.
    pub fn observe(&self, now: Instant, quota: &Quota) -> Vec<RateEvent> {
        let mut state = self.state();
        let state = &mut *state;
        let mut events = Vec::new();
        let dimensions = [
            (
                state.requests.is_none(),
                &mut state.announced_requests,
                quota.limit_requests,
                quota.remaining_requests,
                quota.reset_requests,
                "request",
            ),
            (
                state.tokens.is_none(),
                &mut state.announced_tokens,
                quota.limit_tokens,
                quota.remaining_tokens,
                quota.reset_tokens,
                "token",
            ),
        ];
        for (free, announced, limit, remaining, reset, what) in dimensions {
            let (true, Some(limit), Some(remaining), Some(reset)) = (free, limit, remaining, reset)
            else {
                continue;
            };
            if limit == 0 {
                continue;
            }
            let (limit, remaining) = (limit as f64, (remaining as f64).min(limit as f64));
            match announced {
                Some(announced) if announced.limit == limit => {
                    if announced.observe(now, remaining, reset) == Some(Refill::Window) {
                        events.push(RateEvent::Windowed(what));
                    }
                }
                // New, or its limit changed (another tier).
                _ => *announced = Some(Announced::new(now, limit, remaining, reset)),
            }
        }
        events
    }

    /// Whether calls are paced (by `rpm`, or by a learned rate): then a 429
    /// says the pace is a little high, not that too many calls are in flight.
    pub fn paces(&self) -> bool {
        let state = self.state();
        state.requests.is_some() || state.learned.is_some() || state.announced_requests.is_some()
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
    fn retry_after_pauses_the_endpoint() {
        let t0 = Instant::now();
        let limiter = RateLimiter::new(Some(6000), None, t0);
        limiter.on_rate_limited(t0, Some(Duration::from_secs(2)));
        assert_eq!(limiter.try_take(t0, 0), Duration::from_secs(2));
        assert_eq!(
            limiter.try_take(t0 + Duration::from_secs(1), 0),
            Duration::from_secs(1)
        );
    }

    fn requests(limit: u64, remaining: u64, reset_ms: u64) -> Quota {
        Quota {
            limit_requests: Some(limit),
            remaining_requests: Some(remaining),
            reset_requests: Some(Duration::from_millis(reset_ms)),
            ..Quota::default()
        }
    }

    /// Takes calls from `limiter` as they are allowed from `t` for
    /// `span`, answering each with the quota `server` reports; the number
    /// taken.
    fn drain(
        limiter: &RateLimiter,
        t: Instant,
        span: Duration,
        mut server: impl FnMut(Instant) -> Quota,
    ) -> u32 {
        let mut now = t;
        let mut taken = 0;
        while now < t + span {
            let wait = limiter.try_take(now, 0);
            if wait.is_zero() {
                taken += 1;
                assert!(limiter.observe(now, &server(now)).is_empty());
            } else {
                now += wait;
            }
        }
        taken
    }

    #[test]
    fn an_announced_quota_that_refills_continuously_is_paced_to_its_rate() {
        let t0 = Instant::now();
        let limiter = RateLimiter::new(None, None, t0);
        // OpenAI's headers: 600 a minute, spent, full again in 60 s. One
        // comes free every 100 ms, not only after 60 s.
        assert!(limiter.observe(t0, &requests(600, 0, 60_000)).is_empty());
        assert_eq!(limiter.try_take(t0, 0), Duration::from_millis(100));
        // A server refilling at 10 a second: in 10 s, 100 calls go.
        let mut level: f64 = 0.0;
        let mut last = t0;
        let taken = drain(&limiter, t0, Duration::from_secs(10), |now| {
            level = (level + now.duration_since(last).as_secs_f64() * 10.0).min(600.0) - 1.0;
            last = now;
            assert!(level > -1.0, "the server would refuse this call");
            requests(600, level.max(0.0) as u64, ((600.0 - level) * 100.0) as u64)
        });
        assert!((99..=101).contains(&taken), "{taken}");
    }

    #[test]
    fn a_quota_that_comes_back_in_windows_waits_for_the_window() {
        let t0 = Instant::now();
        let limiter = RateLimiter::new(None, None, t0);
        // 100 calls a 10 s window, all taken in its first second. A quarter
        // in, the window's end has not moved: it is a window.
        let mut events = Vec::new();
        for i in 0..100u64 {
            let now = t0 + Duration::from_millis(i * 10);
            assert_eq!(limiter.try_take(now, 0), Duration::ZERO, "call {i}");
            let said = limiter.observe(now, &requests(100, 99 - i, 10_000 - i * 10));
            events.extend(said.into_iter().map(|e| (i, e)));
        }
        assert_eq!(events, vec![(25, RateEvent::Windowed("request"))]);
        // Spent: the next call waits for the window's end, not a token's
        // time.
        let spent = t0 + Duration::from_secs(1);
        assert_eq!(limiter.try_take(spent, 0), Duration::from_secs(9));
        // At its end the calls go again, a whole window's worth, all sent
        // before the first answer comes back...
        let next = t0 + Duration::from_secs(10);
        for i in 0..100u64 {
            let now = next + Duration::from_millis(i);
            assert_eq!(limiter.try_take(now, 0), Duration::ZERO, "call {i}");
        }
        // ...and the new window's answers, which say what was left when
        // each arrived, do not give them back.
        for i in 0..100u64 {
            let now = next + Duration::from_millis(100 + i);
            let quota = requests(100, 99 - i, 9_900 - i);
            assert!(limiter.observe(now, &quota).is_empty());
            assert!(!limiter.try_take(now, 0).is_zero(), "answer {i}");
        }
        let later = next + Duration::from_millis(200);
        assert_eq!(limiter.try_take(later, 0), Duration::from_millis(9_800));
        // A late answer from the window before changes nothing.
        limiter.observe(later, &requests(100, 0, 1));
        assert_eq!(limiter.try_take(later, 0), Duration::from_millis(9_800));
    }

    #[test]
    fn a_continuous_quota_is_not_taken_for_a_window() {
        let t0 = Instant::now();
        let limiter = RateLimiter::new(None, None, t0);
        // The same burst against a quota of 100 refilling at 10 a second:
        // each call taken puts its fullness 100 ms later.
        for i in 0..100u64 {
            let now = t0 + Duration::from_millis(i * 10);
            let left = 100.0 - (i + 1) as f64 + (i as f64 * 0.1);
            if limiter.try_take(now, 0).is_zero() {
                let quota = requests(100, left as u64, ((100.0 - left) * 100.0) as u64);
                assert!(limiter.observe(now, &quota).is_empty(), "call {i}");
            }
        }
    }

    #[test]
    fn a_configured_rpm_outranks_the_headers() {
        let t0 = Instant::now();
        let limiter = RateLimiter::new(Some(6000), None, t0);
        // The headers say spent; the user said 100 a second.
        assert!(limiter.observe(t0, &requests(600, 0, 60_000)).is_empty());
        assert_eq!(limiter.try_take(t0, 0), Duration::ZERO);
        // A 429 still pauses for its Retry-After, and teaches no rate.
        limiter.on_rate_limited(t0, Some(Duration::from_millis(50)));
        assert_eq!(limiter.try_take(t0, 0), Duration::from_millis(50));
        assert_eq!(limiter.learned_rate(), None);
    }

    #[test]
    fn a_rate_is_learned_from_429s_and_probed_upward() {
        let t0 = Instant::now();
        let limiter = RateLimiter::new(None, None, t0);
        // Ten calls a second succeed for two seconds, then 429s: the first
        // two may be sporadic (they teach nothing, pause nothing); the third
        // makes them a tenth of the answers: a quota's.
        for i in 0..20 {
            limiter.on_success(t0 + Duration::from_millis(i * 100));
        }
        for at in [1990, 1995] {
            let events = limiter.on_rate_limited(t0 + Duration::from_millis(at), None);
            assert_eq!(events, vec![]);
            assert_eq!(
                limiter.try_take(t0 + Duration::from_millis(at), 0),
                Duration::ZERO
            );
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
        // It regains what got through along a cubic curve: fast at first,
        // slowing near it, there within k = cbrt((1 - 0.98) / REGAIN) s.
        let k = (0.02f64 / REGAIN).cbrt();
        limiter.on_success(t0 + Duration::from_millis(5100) + Duration::from_secs_f64(k / 2.0));
        let half = limiter.learned_rate().unwrap();
        assert!(half > 11.0 * 0.98 + (11.0 - 11.0 * 0.98) * 0.8, "{half}");
        assert!(half < 11.0, "{half}");
        limiter.on_success(t0 + Duration::from_millis(5100) + Duration::from_secs_f64(k + 0.001));
        assert_eq!(limiter.learned_rate(), Some(11.0));
        // Past it, probing is slow.
        limiter.on_success(t0 + Duration::from_millis(5100) + Duration::from_secs_f64(k + 1.011));
        let probed = limiter.learned_rate().unwrap();
        assert!((probed - 11.0 * 1.01).abs() < 1e-9, "{probed}");
    }

    #[test]
    fn the_sporadic_429s_of_a_burst_back_before_its_successes_teach_nothing() {
        // A run's first burst: 128 calls out at once; three sporadic 429s
        // come back at once, then the first 20 successes. Among the
        // answers, 3 of 23 (a quota's share); among the calls, 3 of 128.
        let t0 = Instant::now();
        let limiter = RateLimiter::new(None, None, t0);
        for _ in 0..128 {
            assert_eq!(limiter.try_take(t0, 0), Duration::ZERO);
        }
        for i in 0..3u64 {
            let now = t0 + Duration::from_millis(1 + i);
            assert_eq!(
                limiter.on_rate_limited(now, Some(Duration::from_secs(1))),
                vec![]
            );
        }
        for i in 0..20u64 {
            limiter.on_success(t0 + Duration::from_millis(50 + i));
        }
        assert_eq!(limiter.learned_rate(), None);
        // A quota's 429s are most of the burst: learned at once.
        let limiter = RateLimiter::new(None, None, t0);
        for _ in 0..16 {
            limiter.try_take(t0, 0);
        }
        let mut events = Vec::new();
        for i in 0..8u64 {
            events.extend(limiter.on_rate_limited(
                t0 + Duration::from_millis(1 + i),
                Some(Duration::from_secs(1)),
            ));
        }
        assert!(
            events.iter().any(|e| matches!(e, RateEvent::Learned(_))),
            "{events:?}"
        );
    }

    #[test]
    fn sporadic_429s_delay_only_their_calls_and_sustained_ones_teach_a_rate() {
        let t0 = Instant::now();
        let limiter = RateLimiter::new(None, None, t0);
        // 50 answers a second for 20 s, 2% of them 429s with Retry-After:
        // 1 (whole seconds): no pause, no rate learned.
        for second in 0..20u64 {
            for i in 0..50u64 {
                let now = t0 + Duration::from_millis(second * 1000 + i * 20);
                if i == 25 {
                    assert_eq!(
                        limiter.on_rate_limited(now, Some(Duration::from_secs(1))),
                        vec![]
                    );
                } else {
                    limiter.on_success(now);
                }
                assert_eq!(limiter.try_take(now, 0), Duration::ZERO);
            }
        }
        assert_eq!(limiter.learned_rate(), None);
        // Then a quarter of the answers are 429s: a quota's, within two
        // seconds (a tenth of the last four seconds' answers).
        let t1 = t0 + Duration::from_secs(20);
        let mut events = Vec::new();
        for i in 0..100u64 {
            let now = t1 + Duration::from_millis(i * 20);
            if i % 4 == 0 {
                events.extend(limiter.on_rate_limited(now, Some(Duration::from_secs(1))));
            } else {
                limiter.on_success(now);
            }
        }
        assert!(
            events.contains(&RateEvent::Paused(Duration::from_secs(1))),
            "{events:?}"
        );
        assert!(limiter.learned_rate().is_some(), "{events:?}");
    }

    #[test]
    fn a_deep_cut_is_regained_in_seconds() {
        let t0 = Instant::now();
        let limiter = RateLimiter::new(None, None, t0);
        limiter.on_rate_limited(t0, Some(Duration::from_millis(10)));
        assert_eq!(limiter.learned_rate(), Some(95.0));
        // Two seconds later only 50 got through in a second: cut to 49.
        for i in 0..50 {
            limiter.on_success(t0 + Duration::from_millis(1000 + i * 20));
        }
        let cut_at = t0 + Duration::from_millis(2000);
        let before = limiter.learned_rate().unwrap();
        limiter.on_rate_limited(cut_at, None);
        assert_eq!(limiter.learned_rate(), Some((before * 0.5).max(49.0)));
        // Calls succeed again: what got through (50) is back within 5 s.
        limiter.on_success(cut_at + Duration::from_secs(5));
        assert_eq!(
            limiter.learned_rate(),
            Some(50.0_f64.max((before * 0.5).max(49.0)))
        );
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
