//! The adaptive concurrency controller: additive increase, multiplicative
//! decrease, one decision per round trip.
//!
//! It sees only what a call's outcome says: the round-trip time of a
//! successful call, or that the endpoint pushed back (429, 503, 408, a
//! timeout, a refused connection). At the end of each interval (one baseline
//! RTT long) it decides once:
//!
//! - back pressure was seen, beyond what comes whatever the load: back to
//!   the share of calls that got through (by `decrease_ratio` at least, by
//!   half at most);
//! - the interval's mean RTT rose clearly above the baseline (mean + k ×
//!   deviation, and at least 5%): the endpoint is queueing. Multiply by
//!   `baseline / current` (what the limit was when RTT was normal), but never
//!   by less than `decrease_ratio`;
//! - the limit was reached and nothing was wrong: add one, or double it while
//!   in slow start (until the first decrease), so that a large limit is
//!   reached in a few round trips instead of hundreds. After a cut for back
//!   pressure, the limit grows back along CUBIC's curve: quickly towards
//!   where it was cut, flattening as it gets there, then probing past it
//!   faster and faster; a cut that was a fluke costs a few round trips, not
//!   the hundreds adding one at a time would take.
//!
//! Some endpoints refuse a share of calls at any load (a 503 or 408 now and
//! then, with no quota behind it). Cutting the limit for each would bring it
//! down to nothing. Overload shows as a share of refusals that grows with
//! the limit once it passes what the endpoint takes; sporadic refusals keep
//! their share whatever the limit. So the controller keeps the share of
//! back pressure seen at each level of the limit (recent intervals weigh
//! most), takes the share over the lowest levels, as many as it takes to
//! have seen a thousand calls, as the background, and counts an interval's
//! back pressure only when its share is clearly above it: by [`Z`]
//! standard errors of the difference of two shares, the interval's and the
//! background's (a background known from few calls is uncertain too; with
//! a test on the interval's share alone, one in a few intervals crossed the
//! line at 7% sporadic refusals, and each crossing cut the limit).
//!
//! The baseline follows the lower envelope of interval RTTs: it falls at once
//! when round trips get shorter and rises only slowly, and not at all while
//! they are raised, so a queue that grows one call at a time is not absorbed
//! into it. Its deviation measures the noise between intervals, not the
//! drift of a growing queue. A rise must be
//! clear by both measures: k deviations and `rtt_tolerance` of the baseline
//! (engines batch: a call gets somewhat slower as more run beside it, well
//! before anything queues). A lasting change of workload (longer answers)
//! still moves the baseline, slowly.

use std::time::Duration;

use tokio::time::Instant;

pub use crate::config::AimdSettings;

/// Weight of a shorter interval RTT in the baseline (it falls fast).
const ALPHA_DOWN: f64 = 0.5;
/// Weight of a longer one that is not a rise (it climbs slowly).
const ALPHA_UP: f64 = 0.01;
/// Weight of a new interval in the deviation.
const ALPHA_DEVIATION: f64 = 0.3;
/// Weight of a raised interval RTT in the baseline: a lasting change of
/// workload is absorbed over a few dozen intervals.
const ALPHA_RAISED: f64 = 0.02;
/// The interval before any RTT is known.
const FIRST_INTERVAL: Duration = Duration::from_millis(100);
/// A share of back pressure that always counts, whatever the background.
const MOSTLY: f64 = 0.5;
/// Each interval, what is known of every level of the limit fades by this.
const LEVEL_FADE: f64 = 0.99;
/// Calls (faded) the background is taken over.
const LEVEL_KNOWN: f64 = 200.0;
/// Standard errors by which an interval's share of back pressure must
/// exceed the background's to count.
const Z: f64 = 3.5;
/// CUBIC's constant, in limit units per round trip cubed.
const CUBIC_C: f64 = 0.4;
/// The most the curve may raise the limit in one round trip, as a share of
/// it (past where it was cut, the curve steepens; refusals show only at the
/// next decision).
const CUBIC_STEP: f64 = 0.25;
/// The background share assumed in the test of an interval, at least (so
/// that one refusal among a handful of calls is not proof of overload).
const BACKGROUND_FLOOR: f64 = 0.05;

/// What a finished call tells the controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// A successful call and its round-trip time.
    Success(Duration),
    /// The endpoint pushed back: 429, 503, 408, a timeout, a refused connection.
    BackPressure,
    /// Neither (a 500, a malformed answer): no evidence about load.
    Neutral,
}

/// Why the limit moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    SlowStart,
    Increase,
    BackPressure,
    RttRise,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SlowStart => "slow start",
            Self::Increase => "no back pressure at the limit",
            Self::BackPressure => "back pressure",
            Self::RttRise => "round trips grew (the endpoint is queueing)",
        }
    }
}

/// A change of the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub from: usize,
    pub to: usize,
    pub reason: Reason,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Regain {
    /// The limit the cut came from (CUBIC's W_max).
    from: f64,
    /// Round trips until the curve is back there (CUBIC's K).
    k: f64,
    /// Round trips since the cut.
    intervals: u32,
}

impl Regain {
    fn new(from: usize, to: usize) -> Self {
        let from = from as f64;
        let k = ((from - to as f64).max(0.0) / CUBIC_C).cbrt();
        Self {
            from,
            k,
            intervals: 0,
        }
    }

    /// The limit on the curve one more round trip on.
    fn next(&mut self) -> f64 {
        self.intervals += 1;
        let t = f64::from(self.intervals) - self.k;
        self.from + CUBIC_C * t * t * t
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Baseline {
    mean: f64,
    deviation: f64,
}

/// The controller's state. Time is passed in, so it runs on any clock.
#[derive(Debug, Clone)]
pub struct Aimd {
    settings: AimdSettings,
    limit: usize,
    slow_start: bool,
    interval_end: Instant,
    samples: u32,
    rtt_sum: f64,
    /// Calls that ended in this interval, and those that pushed back.
    ended: u32,
    pushed_back: u32,
    /// Per level of the limit (eight a doubling): calls seen and those
    /// that pushed back, fading.
    levels: Vec<(i32, f64, f64)>,
    reached: bool,
    /// Since the last cut for back pressure: the limit before it, and the
    /// round trips since (CUBIC's regain).
    regain: Option<Regain>,
    baseline: Option<Baseline>,
    /// The previous interval's mean RTT (the deviation measures the noise
    /// between intervals, not the drift of a growing queue).
    previous: Option<f64>,
}

impl Aimd {
    pub fn new(settings: AimdSettings, now: Instant) -> Self {
        let limit = settings
            .initial
            .clamp(settings.min.max(1), settings.max.max(1));
        Self {
            settings,
            limit,
            slow_start: limit < settings.max,
            interval_end: now + FIRST_INTERVAL,
            samples: 0,
            rtt_sum: 0.0,
            ended: 0,
            pushed_back: 0,
            levels: Vec::new(),
            reached: false,
            regain: None,
            baseline: None,
            previous: None,
        }
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The baseline RTT, once known.
    pub fn baseline_rtt(&self) -> Option<Duration> {
        self.baseline.map(|b| Duration::from_secs_f64(b.mean))
    }

    /// Called when a call starts, with the calls in flight counting it.
    pub fn on_start(&mut self, in_flight: usize) {
        if in_flight >= self.limit {
            self.reached = true;
        }
    }

    /// Called when a call ends; decides when an interval is over.
    pub fn on_end(&mut self, now: Instant, signal: Signal) -> Option<Decision> {
        self.ended += 1;
        match signal {
            Signal::Success(rtt) => {
                self.samples += 1;
                self.rtt_sum += rtt.as_secs_f64();
            }
            Signal::BackPressure => self.pushed_back += 1,
            Signal::Neutral => {}
        }
        if now < self.interval_end {
            return None;
        }
        self.decide(now)
    }

    /// The share of back pressure at the lowest levels of the limit seen
    /// lately, over at least [`LEVEL_KNOWN`] calls where there were as
    /// many, and the calls it is taken over.
    fn background(&self) -> (f64, f64) {
        let (mut calls, mut pushed) = (0.0, 0.0);
        for (_, c, p) in &self.levels {
            if calls >= LEVEL_KNOWN {
                break;
            }
            calls += c;
            pushed += p;
        }
        if calls > 0.0 {
            (pushed / calls, calls)
        } else {
            (0.0, 0.0)
        }
    }

    /// Adds the interval's calls to what is known of the limit's level
    /// `limit` (unless `overloaded`: refusals that counted as overload are
    /// not background, and learning them as such would make overload look
    /// like the norm), and fades the rest.
    fn learn_level(&mut self, limit: usize, overloaded: bool) {
        let level = (8.0 * (limit.max(1) as f64).log2()).round() as i32;
        for entry in &mut self.levels {
            entry.1 *= LEVEL_FADE;
            entry.2 *= LEVEL_FADE;
        }
        self.levels.retain(|(_, calls, _)| *calls >= 1.0);
        if overloaded {
            return;
        }
        let (ended, pushed) = (f64::from(self.ended), f64::from(self.pushed_back));
        match self.levels.iter_mut().find(|(l, _, _)| *l == level) {
            Some(entry) => {
                entry.1 += ended;
                entry.2 += pushed;
            }
            None if ended > 0.0 => {
                self.levels.push((level, ended, pushed));
                self.levels.sort_by_key(|(level, _, _)| *level);
            }
            None => {}
        }
    }

    fn decide(&mut self, now: Instant) -> Option<Decision> {
        let current = (self.samples > 0).then(|| self.rtt_sum / f64::from(self.samples));
        let from = self.limit;
        let settings = self.settings;
        let floor = settings.min.max(1);
        let mut rose = false;
        let (background, known) = self.background();
        // The share of calls pushed back beyond the background, when it is
        // clearly beyond (or most calls were: that is never background).
        let excess = {
            let n = f64::from(self.ended.max(1));
            let share = f64::from(self.pushed_back) / n;
            let p = background.max(BACKGROUND_FLOOR);
            let beyond = known > 0.0
                && share > background + Z * (p * (1.0 - p) * (1.0 / n + 1.0 / known)).sqrt();
            (self.pushed_back > 0 && (beyond || share > MOSTLY))
                .then_some((share - background).max(0.0))
        };
        self.learn_level(from, excess.is_some());
        let decision = if let Some(excess) = excess {
            // Back to what the endpoint took: the calls beyond it were the
            // excess; by `decrease_ratio` at least, by half at most.
            self.slow_start = false;
            let factor = (1.0 - excess).max(0.5).min(settings.decrease_ratio);
            let to = ((from as f64 * factor) as usize).max(floor);
            // Cut again below where the last cut came from: the endpoint
            // takes less than it did, so aim lower (CUBIC's fast
            // convergence).
            let peak = match self.regain {
                Some(regain) if (from as f64) < regain.from => {
                    (from as f64 * (1.0 + factor) / 2.0) as usize
                }
                _ => from,
            };
            self.regain = Some(Regain::new(peak, to));
            Some((to, Reason::BackPressure))
        } else if let (Some(current), Some(base)) = (current, self.baseline)
            && current
                > base.mean
                    + (settings.rtt_deviation_k * base.deviation)
                        .max(settings.rtt_tolerance * base.mean)
        {
            rose = true;
            self.slow_start = false;
            // A queue, not refusals: back by one at a time from here.
            self.regain = None;
            let factor = (base.mean / current).max(settings.decrease_ratio);
            let to = ((from as f64 * factor) as usize).max(floor);
            Some((to, Reason::RttRise))
        } else if self.reached && from < settings.max {
            if self.slow_start {
                Some(((from * 2).min(settings.max), Reason::SlowStart))
            } else {
                let curve = self.regain.as_mut().map_or(0.0, Regain::next);
                let step = (from as f64 * (1.0 + CUBIC_STEP)) as usize;
                let to = (from + 1).max((curve as usize).min(step)).min(settings.max);
                Some((to, Reason::Increase))
            }
        } else {
            None
        };

        if let Some(current) = current {
            self.baseline = Some(match self.baseline {
                None => Baseline {
                    mean: current,
                    deviation: 0.0,
                },
                Some(base) if rose => Baseline {
                    mean: base.mean + ALPHA_RAISED * (current - base.mean),
                    deviation: base.deviation,
                },
                Some(base) => {
                    let alpha = if current < base.mean {
                        ALPHA_DOWN
                    } else {
                        ALPHA_UP
                    };
                    let noise = self.previous.map_or(0.0, |p| (current - p).abs());
                    Baseline {
                        mean: base.mean + alpha * (current - base.mean),
                        deviation: base.deviation + ALPHA_DEVIATION * (noise - base.deviation),
                    }
                }
            });
            self.previous = Some(current);
        }
        // One decision per round trip as it is now: after a cut, the calls
        // that queued before it must come back before the next decision.
        let interval = self
            .baseline
            .map_or(FIRST_INTERVAL, |b| {
                Duration::from_secs_f64(b.mean.max(current.unwrap_or(0.0)))
            })
            .clamp(Duration::from_millis(1), Duration::from_secs(30));
        self.interval_end = now + interval;
        self.samples = 0;
        self.rtt_sum = 0.0;
        self.ended = 0;
        self.pushed_back = 0;
        self.reached = false;

        let (to, reason) = decision?;
        if to == from {
            return None;
        }
        if to >= settings.max {
            self.slow_start = false;
        }
        self.limit = to;
        Some(Decision { from, to, reason })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> AimdSettings {
        AimdSettings {
            initial: 4,
            min: 1,
            max: 64,
            decrease_ratio: 0.7,
            rtt_deviation_k: 2.0,
            rtt_tolerance: 0.2,
        }
    }

    /// Runs one interval: `n` calls started (reaching the limit) and ended
    /// with `signal`.
    fn interval(c: &mut Aimd, now: &mut Instant, signal: Signal) -> Option<Decision> {
        c.on_start(c.limit());
        *now += c.baseline_rtt().unwrap_or(FIRST_INTERVAL);
        c.on_end(*now, signal)
    }

    #[test]
    fn slow_start_doubles_until_the_first_decrease_then_regains_along_a_cubic() {
        let mut now = Instant::now();
        let mut c = Aimd::new(settings(), now);
        let ok = Signal::Success(Duration::from_millis(100));
        assert_eq!(interval(&mut c, &mut now, ok).unwrap().to, 8);
        assert_eq!(interval(&mut c, &mut now, ok).unwrap().to, 16);
        // Every call of the interval pushed back: half of 16 (the least
        // the cut keeps), not 16 x 0.7.
        let cut = interval(&mut c, &mut now, Signal::BackPressure).unwrap();
        assert_eq!((cut.to, cut.reason), (8, Reason::BackPressure));
        // Back towards 16 quickly (by a quarter a round trip at most),
        // flat near it, then probing past it, faster and faster.
        let mut limits = Vec::new();
        for _ in 0..7 {
            let up = interval(&mut c, &mut now, ok).unwrap();
            assert_eq!(up.reason, Reason::Increase);
            limits.push(up.to);
        }
        assert_eq!(limits, vec![10, 12, 15, 16, 20, 25, 31]);
    }

    #[test]
    fn after_a_queue_the_limit_grows_back_one_at_a_time() {
        let mut now = Instant::now();
        let mut c = Aimd::new(
            AimdSettings {
                initial: 40,
                ..settings()
            },
            now,
        );
        for _ in 0..5 {
            c.on_end(now, Signal::Success(Duration::from_millis(100)));
            now += Duration::from_millis(100);
            c.on_end(now, Signal::Success(Duration::from_millis(100)));
        }
        // A cut for refusals, then one for a queue: no curve after the
        // queue's (the queue says where the limit is).
        let cut = interval(&mut c, &mut now, Signal::BackPressure).unwrap();
        assert_eq!(cut.reason, Reason::BackPressure);
        let mut decision = None;
        for _ in 0..3 {
            c.on_start(c.limit());
            decision = decision.or(c.on_end(now, Signal::Success(Duration::from_millis(150))));
            now += Duration::from_millis(60);
        }
        let queue = decision.unwrap();
        assert_eq!(queue.reason, Reason::RttRise);
        now += Duration::from_millis(200);
        let up = interval(
            &mut c,
            &mut now,
            Signal::Success(Duration::from_millis(100)),
        )
        .unwrap();
        assert_eq!(up.to, queue.to + 1);
    }

    #[test]
    fn a_queueing_rtt_cuts_back_to_where_rtt_was_normal() {
        let mut now = Instant::now();
        let mut c = Aimd::new(
            AimdSettings {
                initial: 40,
                ..settings()
            },
            now,
        );
        for _ in 0..5 {
            c.on_end(now, Signal::Success(Duration::from_millis(100)));
            now += Duration::from_millis(100);
            c.on_end(now, Signal::Success(Duration::from_millis(100)));
        }
        // RTT 25% up: the limit goes to 40 / 1.25 = 32, not to 0.7 x 40 = 28.
        let mut decision = None;
        for _ in 0..3 {
            decision = decision.or(c.on_end(now, Signal::Success(Duration::from_millis(125))));
            now += Duration::from_millis(60);
        }
        let decision = decision.unwrap();
        assert_eq!(decision.reason, Reason::RttRise);
        assert_eq!(decision.to, 32);
    }

    #[test]
    fn nothing_changes_below_the_limit_and_limits_hold() {
        let mut now = Instant::now();
        let mut c = Aimd::new(settings(), now);
        now += Duration::from_secs(1);
        assert_eq!(
            c.on_end(now, Signal::Success(Duration::from_millis(10))),
            None
        );
        for _ in 0..20 {
            interval(&mut c, &mut now, Signal::BackPressure);
        }
        assert_eq!(c.limit(), 1);
        for _ in 0..200 {
            interval(&mut c, &mut now, Signal::Success(Duration::from_millis(10)));
        }
        assert_eq!(c.limit(), 64);
    }

    /// Runs `intervals` round trips of 100 ms with the limit's worth of
    /// calls each; `refused(i, limit, draw)` says whether call `i` of an
    /// interval pushed back. Returns the limits seen over the last half.
    fn simulate(intervals: usize, refused: impl Fn(usize, usize, f64) -> bool) -> (usize, usize) {
        let mut now = Instant::now();
        let mut c = Aimd::new(
            AimdSettings {
                initial: 8,
                max: 128,
                decrease_ratio: 0.9,
                ..settings()
            },
            now,
        );
        let mut rng = fastrand::Rng::with_seed(7);
        let mut seen = Vec::new();
        for round in 0..intervals {
            let limit = c.limit();
            for _ in 0..limit {
                c.on_start(limit);
            }
            // Their ends spread over the round trip, in a random order.
            let start = now;
            let mut order: Vec<usize> = (0..limit).collect();
            rng.shuffle(&mut order);
            for (k, i) in order.into_iter().enumerate() {
                now = start + Duration::from_millis(100) * (k as u32 + 1) / limit as u32;
                let signal = if refused(i, limit, rng.f64()) {
                    Signal::BackPressure
                } else {
                    Signal::Success(Duration::from_millis(100))
                };
                c.on_end(now, signal);
            }
            if round >= intervals / 2 {
                seen.push(c.limit());
            }
        }
        (*seen.iter().min().unwrap(), *seen.iter().max().unwrap())
    }

    #[test]
    fn refusals_that_come_at_any_load_do_not_hold_the_limit_down() {
        // 7% of calls refused (503, 408) whatever the load.
        let (low, _) = simulate(400, |_, _, draw| draw < 0.07);
        assert!(low >= 100, "the limit fell to {low}");
    }

    #[test]
    fn refusals_that_come_with_load_still_cut_the_limit() {
        // An endpoint that takes 40 at once and refuses the rest, with 7%
        // refused at any load besides.
        let (low, high) = simulate(400, |i, _, draw| i >= 40 || draw < 0.07);
        assert!(high <= 60, "the limit rose to {high}");
        assert!(low >= 25, "the limit fell to {low}");
    }

    #[test]
    fn a_decrease_ratio_below_one_half_is_kept_to() {
        let mut now = Instant::now();
        let mut c = Aimd::new(
            AimdSettings {
                initial: 20,
                decrease_ratio: 0.3,
                ..settings()
            },
            now,
        );
        // An interval of refusals: the cut is by the ratio (x 0.3), which
        // is deeper than the half a cut keeps otherwise.
        let cut = interval(&mut c, &mut now, Signal::BackPressure).unwrap();
        assert_eq!((cut.to, cut.reason), (6, Reason::BackPressure));
    }
}
