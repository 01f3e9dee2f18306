//! The `rpm` token bucket, and the `quota` with OpenAI's `x-ratelimit-*`
//! headers.

use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue};
use tokio::time::Instant;

use crate::settings::{Quota, QuotaMode};

/// A token bucket for the `rpm` quota.
pub(super) struct Bucket {
    pub(super) tokens: f64,
    pub(super) last: Instant,
    pub(super) per_second: f64,
    pub(super) capacity: f64,
}

impl Bucket {
    /// Takes one request's token, or says how long until one is available.
    pub(super) fn take(&mut self, now: Instant) -> Result<(), Duration> {
        let elapsed = now.duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.per_second).min(self.capacity);
        self.last = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64(
                (1.0 - self.tokens) / self.per_second,
            ))
        }
    }
}

/// A [`Quota`] and what is left of it.
pub(super) struct QuotaBucket {
    quota: Quota,
    state: QuotaState,
}

enum QuotaState {
    /// Requests in the bucket (a fraction of one is refilling), as of `last`.
    Refill { tokens: f64, last: Instant },
    /// Requests taken in the window that began at `start` (none yet: no
    /// window has begun).
    Fixed { start: Option<Instant>, used: u32 },
}

/// What a [`QuotaBucket`] said of one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct QuotaVerdict {
    limit: u32,
    /// Whole requests left after this one.
    remaining: u32,
    /// How long until the quota is whole again.
    reset: Duration,
    /// `None`: the request may go on; else how long until one could.
    pub(super) refused_for: Option<Duration>,
}

/// Lets a refill that float arithmetic left a hair short of a whole request
/// count as one.
const TOKEN_SLACK: f64 = 1e-9;

impl QuotaBucket {
    pub(super) fn new(quota: Quota, now: Instant) -> Self {
        let state = match quota.mode {
            QuotaMode::Refill => QuotaState::Refill {
                tokens: f64::from(quota.limit),
                last: now,
            },
            QuotaMode::Fixed => QuotaState::Fixed {
                start: None,
                used: 0,
            },
        };
        Self { quota, state }
    }

    /// Takes one request from the quota if it has one.
    pub(super) fn take(&mut self, now: Instant) -> QuotaVerdict {
        let limit = self.quota.limit;
        let window = self.quota.window;
        match &mut self.state {
            QuotaState::Refill { tokens, last } => {
                let capacity = f64::from(limit);
                let per_second = capacity / window.as_secs_f64();
                let refilled = now.saturating_duration_since(*last).as_secs_f64() * per_second;
                *tokens = (*tokens + refilled).min(capacity);
                *last = now;
                let refused_for = if *tokens + TOKEN_SLACK >= 1.0 {
                    *tokens = (*tokens - 1.0).max(0.0);
                    None
                } else {
                    Some(seconds((1.0 - *tokens) / per_second))
                };
                QuotaVerdict {
                    limit,
                    remaining: (*tokens + TOKEN_SLACK).floor() as u32,
                    reset: seconds((capacity - *tokens) / per_second),
                    refused_for,
                }
            }
            QuotaState::Fixed { start, used } => {
                let start = start.get_or_insert(now);
                let elapsed = now.saturating_duration_since(*start);
                if elapsed >= window {
                    // Windows stay aligned to the first request's.
                    let whole = elapsed.as_nanos() / window.as_nanos() * window.as_nanos();
                    *start += Duration::from_nanos(u64::try_from(whole).unwrap_or(u64::MAX));
                    *used = 0;
                }
                let reset = (*start + window).saturating_duration_since(now);
                let refused_for = if *used < limit {
                    *used += 1;
                    None
                } else {
                    Some(reset)
                };
                QuotaVerdict {
                    limit,
                    remaining: limit - *used,
                    reset,
                    refused_for,
                }
            }
        }
    }
}

impl QuotaVerdict {
    /// OpenAI's `x-ratelimit-*-requests` headers.
    pub(super) fn add_headers(&self, headers: &mut HeaderMap) {
        headers.insert("x-ratelimit-limit-requests", HeaderValue::from(self.limit));
        headers.insert(
            "x-ratelimit-remaining-requests",
            HeaderValue::from(self.remaining),
        );
        if let Ok(reset) = HeaderValue::from_str(&openai_duration(self.reset)) {
            headers.insert("x-ratelimit-reset-requests", reset);
        }
    }
}

fn seconds(value: f64) -> Duration {
    Duration::try_from_secs_f64(value.max(0.0)).unwrap_or(Duration::MAX)
}

/// A duration the way OpenAI writes `x-ratelimit-reset-*` (Go's format, to
/// the millisecond, rounded up): `0s`, `100ms`, `1s`, `1m30.5s`, `6m0s`,
/// `1h0m0s`.
fn openai_duration(duration: Duration) -> String {
    // To the microsecond first, so that float noise does not round up a
    // whole millisecond.
    let ms = duration.as_micros().div_ceil(1000);
    if ms == 0 {
        return "0s".to_owned();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let hours = ms / 3_600_000;
    let minutes = ms / 60_000 % 60;
    let mut seconds = (ms / 1000 % 60).to_string();
    let fraction = ms % 1000;
    if fraction > 0 {
        seconds.push('.');
        seconds.push_str(format!("{fraction:03}").trim_end_matches('0'));
    }
    match (hours, minutes) {
        (0, 0) => format!("{seconds}s"),
        (0, minutes) => format!("{minutes}m{seconds}s"),
        (hours, minutes) => format!("{hours}h{minutes}m{seconds}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_durations_are_written_as_go_writes_them() {
        let ms = Duration::from_millis;
        for (duration, text) in [
            (Duration::ZERO, "0s"),
            (Duration::from_micros(400), "1ms"),
            (ms(100), "100ms"),
            (Duration::from_nanos(100_000_001), "100ms"),
            (ms(1000), "1s"),
            (ms(8640), "8.64s"),
            (ms(90_500), "1m30.5s"),
            (ms(360_000), "6m0s"),
            (ms(3_600_000), "1h0m0s"),
            (ms(3_723_004), "1h2m3.004s"),
        ] {
            assert_eq!(openai_duration(duration), text, "{duration:?}");
        }
    }

    fn quota(limit: u32, window: Duration, mode: QuotaMode) -> QuotaBucket {
        QuotaBucket::new(
            Quota {
                limit,
                window,
                mode,
            },
            Instant::now(),
        )
    }

    /// Whether two durations computed in floating point are the same to the
    /// microsecond.
    fn about(a: Option<Duration>, b: Duration) -> bool {
        a.is_some_and(|a| a.abs_diff(b) < Duration::from_micros(1))
    }

    #[test]
    fn a_refilling_quota_counts_down_and_refills_at_its_rate() {
        let start = Instant::now();
        let mut bucket = quota(10, Duration::from_secs(1), QuotaMode::Refill);
        let first = bucket.take(start);
        assert_eq!(first.remaining, 9);
        assert!(
            about(Some(first.reset), Duration::from_millis(100)),
            "{first:?}"
        );
        assert_eq!(first.refused_for, None);
        for left in (0..9).rev() {
            assert_eq!(bucket.take(start).remaining, left);
        }
        let refused = bucket.take(start);
        assert_eq!(refused.remaining, 0);
        assert!(
            about(refused.refused_for, Duration::from_millis(100)),
            "{refused:?}"
        );
        assert!(
            about(Some(refused.reset), Duration::from_secs(1)),
            "{refused:?}"
        );
        // Half a request back: still refused, for the other half.
        let refused = bucket.take(start + Duration::from_millis(50));
        assert!(
            about(refused.refused_for, Duration::from_millis(50)),
            "{refused:?}"
        );
        let taken = bucket.take(start + Duration::from_millis(100));
        assert_eq!((taken.remaining, taken.refused_for), (0, None));
        // Long idle: full again, never more.
        let later = bucket.take(start + Duration::from_secs(60));
        assert_eq!(later.remaining, 9);
    }

    #[test]
    fn a_fixed_quota_gives_everything_back_when_its_window_ends() {
        let ms = Duration::from_millis;
        let mut bucket = quota(3, ms(300), QuotaMode::Fixed);
        // The window begins with the first request, not with the bucket.
        let start = Instant::now() + ms(1000);
        let verdicts: Vec<_> = [0, 100, 200, 250]
            .map(|at| bucket.take(start + ms(at)))
            .into_iter()
            .map(|v| (v.remaining, v.reset, v.refused_for))
            .collect();
        assert_eq!(
            verdicts,
            [
                (2, ms(300), None),
                (1, ms(200), None),
                (0, ms(100), None),
                (0, ms(50), Some(ms(50))),
            ]
        );
        // Windows stay aligned to the first: 700 ms is 100 ms into the third.
        let next = bucket.take(start + ms(700));
        assert_eq!(
            (next.remaining, next.reset, next.refused_for),
            (2, ms(200), None)
        );
    }
}
