//! When a call has waited too long: for the first byte of its answer, or
//! in a quiet spell of its stream, as measured against what is normal for
//! the endpoint; and when the endpoint last showed that it works.

use std::time::Duration;

use evalfleet_types::FadingMax;
use tokio::time::Instant;

/// How long a call may wait for the first byte of its answer, and how
/// long a stream may then send nothing (`timeouts.first_byte`,
/// `timeouts.stream_idle`). A non-streamed answer comes whole, so only the
/// attempt timeout bounds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stalls {
    pub first_byte: Duration,
    pub idle: Duration,
}

impl Default for Stalls {
    fn default() -> Self {
        Self {
            first_byte: Duration::from_secs(120),
            idle: Duration::from_secs(30),
        }
    }
}

/// Streams an endpoint answered in full before its quiet spells say what
/// is normal for it.
const GAPS_KNOWN: u32 = 20;
/// A stream is stalled once quiet this many times its endpoint's longest
/// recent quiet spell...
const GAP_MARGIN: f64 = 8.0;
/// ...and never sooner than this (nor later than `timeouts.stream_idle`).
pub(super) const GAP_FLOOR: Duration = Duration::from_secs(1);
/// Each stream, the longest spell known fades by this.
const GAP_FADE: f64 = 0.99;

/// Complete streams of the endpoint, while one is quiet, that show it has
/// stalled once it has been quiet for [`GAP_FLOOR`] too: its neighbours
/// went from their first token to their last while it sent nothing.
pub(super) const PEERS_PASSED: u64 = 20;

/// What is a normal quiet spell in an endpoint's streams: the longest gap
/// between events of its recent complete streams, as a maximum that fades.
/// A stream quiet for [`GAP_MARGIN`] times that has stalled, however long
/// `timeouts.stream_idle` would still wait: a server that streams a token
/// every 20 ms and then sends nothing for 20 s is not thinking. Before
/// enough streams are known (at the start of a run), a stream quiet for
/// [`GAP_FLOOR`] while [`PEERS_PASSED`] others were answered in full has
/// stalled too.
#[derive(Debug)]
pub struct Gaps {
    longest: std::sync::Mutex<FadingMax>,
    /// Streams answered in full.
    completed: std::sync::atomic::AtomicU64,
}

impl Default for Gaps {
    fn default() -> Self {
        Self {
            longest: std::sync::Mutex::new(FadingMax::new(GAP_FADE)),
            completed: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

impl Gaps {
    fn longest(&self) -> std::sync::MutexGuard<'_, FadingMax> {
        self.longest
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// How long a stream may be quiet, at most `idle`.
    pub fn limit(&self, idle: Duration) -> Duration {
        match self.longest().value(GAPS_KNOWN) {
            None => idle,
            Some(longest) => longest.mul_f64(GAP_MARGIN).max(GAP_FLOOR).min(idle),
        }
    }

    /// A stream answered in full, its longest gap `longest`.
    pub fn record(&self, longest: Duration) {
        self.longest().record(longest);
        self.completed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Streams answered in full so far.
    pub fn completed(&self) -> u64 {
        self.completed.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// When an endpoint last showed that it works: an answer that was not a
/// 5xx, an event of a stream, a whole body. The health monitor probes an
/// endpoint only when it has shown nothing for a while, so that a probe
/// never competes with calls that go well (a server that serves one
/// request at a time cuts its running stream for any request that waits,
/// a probe's included).
#[derive(Debug)]
pub struct Pulse {
    origin: Instant,
    /// Milliseconds from `origin` to the last sign, plus one (0: none yet).
    last: std::sync::atomic::AtomicU64,
}

impl Default for Pulse {
    fn default() -> Self {
        Self {
            origin: Instant::now(),
            last: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

impl Pulse {
    /// The endpoint showed it works, now.
    pub fn beat(&self) {
        let since = Instant::now().saturating_duration_since(self.origin);
        let ms = u64::try_from(since.as_millis()).unwrap_or(u64::MAX - 1) + 1;
        self.last
            .fetch_max(ms, std::sync::atomic::Ordering::Relaxed);
    }

    /// When it last did (to the millisecond), if ever.
    pub fn last(&self) -> Option<Instant> {
        match self.last.load(std::sync::atomic::Ordering::Relaxed) {
            0 => None,
            ms => Some(self.origin + Duration::from_millis(ms - 1)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_pulse_remembers_the_last_sign_of_life() {
        let pulse = Pulse::default();
        assert_eq!(pulse.last(), None);
        tokio::time::advance(Duration::from_secs(3)).await;
        let now = Instant::now();
        pulse.beat();
        assert_eq!(pulse.last(), Some(now));
    }

    #[test]
    fn a_stall_is_told_by_what_is_normal_for_the_endpoint() {
        let idle = Duration::from_secs(30);
        let gaps = Gaps::default();
        // Until enough streams are known, the configured limit.
        for _ in 1..GAPS_KNOWN {
            gaps.record(Duration::from_millis(300));
        }
        assert_eq!(gaps.limit(idle), idle);
        gaps.record(Duration::from_millis(300));
        // Then eight times its longest recent gap...
        assert_eq!(gaps.limit(idle), Duration::from_millis(2400));
        // ...which fades when streams flow faster, down to a floor...
        for _ in 0..1000 {
            gaps.record(Duration::from_millis(5));
        }
        assert_eq!(gaps.limit(idle), GAP_FLOOR);
        // ...and never past the configured limit.
        gaps.record(Duration::from_secs(20));
        assert_eq!(gaps.limit(idle), idle);
    }
}
