//! The adaptive concurrency controller: additive increase, multiplicative
//! decrease, one decision per round trip.
//!
//! It sees only what a call's outcome says: the round-trip time of a
//! successful call, or that the endpoint pushed back (429, 503, 408, a
//! timeout, a refused connection). At the end of each interval (one baseline
//! RTT long) it decides once:
//!
//! - back pressure was seen: multiply the limit by `decrease_ratio`;
//! - the interval's mean RTT rose clearly above the baseline (mean + k ×
//!   deviation, and at least 5%): the endpoint is queueing. Multiply by
//!   `baseline / current` (what the limit was when RTT was normal), but never
//!   by less than `decrease_ratio`;
//! - the limit was reached and nothing was wrong: add one, or double it while
//!   in slow start (until the first decrease), so that a large limit is
//!   reached in a few round trips instead of hundreds.
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
    back_pressure: bool,
    reached: bool,
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
            back_pressure: false,
            reached: false,
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
        match signal {
            Signal::Success(rtt) => {
                self.samples += 1;
                self.rtt_sum += rtt.as_secs_f64();
            }
            Signal::BackPressure => self.back_pressure = true,
            Signal::Neutral => {}
        }
        if now < self.interval_end {
            return None;
        }
        self.decide(now)
    }

    fn decide(&mut self, now: Instant) -> Option<Decision> {
        let current = (self.samples > 0).then(|| self.rtt_sum / f64::from(self.samples));
        let from = self.limit;
        let settings = self.settings;
        let floor = settings.min.max(1);
        let mut rose = false;
        let decision = if self.back_pressure {
            self.slow_start = false;
            let to = ((from as f64 * settings.decrease_ratio) as usize).max(floor);
            Some((to, Reason::BackPressure))
        } else if let (Some(current), Some(base)) = (current, self.baseline)
            && current
                > base.mean
                    + (settings.rtt_deviation_k * base.deviation)
                        .max(settings.rtt_tolerance * base.mean)
        {
            rose = true;
            self.slow_start = false;
            let factor = (base.mean / current).max(settings.decrease_ratio);
            let to = ((from as f64 * factor) as usize).max(floor);
            Some((to, Reason::RttRise))
        } else if self.reached && from < settings.max {
            if self.slow_start {
                Some(((from * 2).min(settings.max), Reason::SlowStart))
            } else {
                Some((from + 1, Reason::Increase))
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
        self.back_pressure = false;
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
    fn slow_start_doubles_until_the_first_decrease_then_adds_one() {
        let mut now = Instant::now();
        let mut c = Aimd::new(settings(), now);
        let ok = Signal::Success(Duration::from_millis(100));
        assert_eq!(interval(&mut c, &mut now, ok).unwrap().to, 8);
        assert_eq!(interval(&mut c, &mut now, ok).unwrap().to, 16);
        let cut = interval(&mut c, &mut now, Signal::BackPressure).unwrap();
        assert_eq!((cut.to, cut.reason), (11, Reason::BackPressure));
        let up = interval(&mut c, &mut now, ok).unwrap();
        assert_eq!((up.to, up.reason), (12, Reason::Increase));
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
}
