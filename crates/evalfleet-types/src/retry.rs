//! The one retry policy: how many tries, and how long to wait between them
//! (exponential backoff with full jitter, never less than what the other
//! side asked for). Item calls, LLM-judge calls and the SandboxFusion client
//! all retry through here. A [`RetryBudget`] keeps a session's retries to a
//! share of its calls, so that an outage does not multiply the load.

use std::future::Future;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// How failed tries are retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Tries in all, the first included.
    pub max_attempts: u32,
    /// The wait's ceiling before the first retry; it doubles each time.
    pub backoff_base: Duration,
    /// The longest wait.
    pub backoff_max: Duration,
}

impl RetryPolicy {
    /// The wait before retry number `retry` (1 for the first retry):
    /// uniform between zero and `backoff_base * 2^(retry-1)` (capped at
    /// `backoff_max`), and never less than `retry_after`. `unit` is a draw
    /// from `[0, 1)`.
    pub fn delay(&self, retry: u32, retry_after: Option<Duration>, unit: f64) -> Duration {
        let exponent = retry.saturating_sub(1).min(30);
        let ceiling = self
            .backoff_base
            .saturating_mul(1u32 << exponent)
            .min(self.backoff_max);
        let jittered = ceiling.mul_f64(unit.clamp(0.0, 1.0));
        match retry_after {
            Some(wait) => wait.max(jittered),
            None => jittered,
        }
    }

    /// [`delay`](Self::delay) with a random draw.
    pub fn backoff(&self, retry: u32, retry_after: Option<Duration>) -> Duration {
        self.delay(retry, retry_after, fastrand::f64())
    }

    /// Runs `op` until it succeeds, `verdict` says its error is final, or
    /// the tries are spent; between tries it waits its backoff.
    pub async fn run<T, E, F, Fut>(&self, op: F, verdict: impl Fn(&E) -> Retry) -> Result<T, E>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.run_within(Duration::MAX, op, verdict).await
    }

    /// [`run`](Self::run), bounded by time as well: it tries again while
    /// the next try would start within `within` of the first (a server
    /// restarting is ridden out, however many tries that takes, up to
    /// `max_attempts`).
    pub async fn run_within<T, E, F, Fut>(
        &self,
        within: Duration,
        mut op: F,
        verdict: impl Fn(&E) -> Retry,
    ) -> Result<T, E>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let first = Instant::now();
        let mut tries = 0;
        loop {
            tries += 1;
            match op().await {
                Ok(value) => return Ok(value),
                Err(err) => match verdict(&err) {
                    Retry::After(retry_after) if tries < self.max_attempts => {
                        let wait = self.backoff(tries, retry_after);
                        if first.elapsed().saturating_add(wait) > within {
                            return Err(err);
                        }
                        tokio::time::sleep(wait).await;
                    }
                    _ => return Err(err),
                },
            }
        }
    }
}

/// A [`RetryBudget`]'s settings (`retry.budget`, `retry.budget_floor`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BudgetSettings {
    /// Retries allowed per first try.
    pub share: f64,
    /// Retries allowed a second whatever the first tries.
    pub floor: f64,
}

impl Default for BudgetSettings {
    fn default() -> Self {
        Self {
            share: 0.5,
            floor: 10.0,
        }
    }
}

/// Seconds of calls a [`RetryBudget`] counts over.
const BUDGET_WINDOW: usize = 10;

/// Retries allowed as a share of first tries over the last ten seconds,
/// plus a small floor per second (Finagle's `RetryBudget`; gRPC's retry
/// throttling works the same way): a fault rate of a few percent is retried
/// at once, while an endpoint refusing everything gets at most that share
/// more calls, not `max_attempts` times as many. A retry the budget cannot
/// pay for waits; it is not dropped.
#[derive(Debug)]
pub struct RetryBudget {
    share: f64,
    floor: f64,
    state: Mutex<BudgetState>,
}

#[derive(Debug)]
struct BudgetState {
    /// First tries and retries per second, the current second first.
    firsts: [u32; BUDGET_WINDOW],
    retries: [u32; BUDGET_WINDOW],
    second: Instant,
}

impl RetryBudget {
    /// Retries up to `share` of first tries, plus `floor` a second.
    pub fn new(settings: BudgetSettings, now: Instant) -> Self {
        Self {
            share: settings.share.max(0.0),
            floor: settings.floor.max(0.0),
            state: Mutex::new(BudgetState {
                firsts: [0; BUDGET_WINDOW],
                retries: [0; BUDGET_WINDOW],
                second: now,
            }),
        }
    }

    fn state(&self, now: Instant) -> std::sync::MutexGuard<'_, BudgetState> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let seconds = now.saturating_duration_since(state.second).as_secs() as usize;
        if seconds > 0 {
            for _ in 0..seconds.min(BUDGET_WINDOW) {
                state.firsts.rotate_right(1);
                state.firsts[0] = 0;
                state.retries.rotate_right(1);
                state.retries[0] = 0;
            }
            state.second += Duration::from_secs(seconds as u64);
        }
        state
    }

    /// A call's first try was sent.
    pub fn first_try(&self, now: Instant) {
        self.state(now).firsts[0] += 1;
    }

    /// Whether a retry may be sent now; when it may, it is counted.
    pub fn try_retry(&self, now: Instant) -> bool {
        let mut state = self.state(now);
        let firsts: u32 = state.firsts.iter().sum();
        let retries: u32 = state.retries.iter().sum();
        let allowed = self.share * f64::from(firsts) + self.floor * BUDGET_WINDOW as f64;
        if f64::from(retries) + 1.0 <= allowed {
            state.retries[0] += 1;
            true
        } else {
            false
        }
    }
}

/// What a failed try says of the next one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Try again, not before this long if given.
    After(Option<Duration>),
    /// Another try would fail the same way.
    Never,
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: RetryPolicy = RetryPolicy {
        max_attempts: 5,
        backoff_base: Duration::from_millis(100),
        backoff_max: Duration::from_secs(1),
    };

    #[test]
    fn the_ceiling_doubles_and_is_capped() {
        assert_eq!(POLICY.delay(1, None, 1.0), Duration::from_millis(100));
        assert_eq!(POLICY.delay(3, None, 1.0), Duration::from_millis(400));
        assert_eq!(POLICY.delay(20, None, 1.0), Duration::from_secs(1));
        assert_eq!(POLICY.delay(3, None, 0.5), Duration::from_millis(200));
        assert_eq!(POLICY.delay(3, None, 0.0), Duration::ZERO);
    }

    #[test]
    fn retry_after_is_a_floor() {
        assert_eq!(
            POLICY.delay(1, Some(Duration::from_secs(3)), 0.9),
            Duration::from_secs(3)
        );
        assert_eq!(
            POLICY.delay(4, Some(Duration::from_millis(10)), 0.5),
            Duration::from_millis(400)
        );
    }

    #[test]
    fn the_budget_allows_a_share_of_first_tries_plus_a_floor() {
        let t0 = Instant::now();
        // 20% of first tries, and 1 a second.
        let budget = RetryBudget::new(
            BudgetSettings {
                share: 0.2,
                floor: 1.0,
            },
            t0,
        );
        // The floor alone: ten seconds' worth.
        assert_eq!((0..20).filter(|_| budget.try_retry(t0)).count(), 10);
        // 100 first tries pay for 20 more.
        for _ in 0..100 {
            budget.first_try(t0);
        }
        assert_eq!((0..40).filter(|_| budget.try_retry(t0)).count(), 20);
        // Ten seconds on, all of that has gone out of the window.
        let later = t0 + Duration::from_secs(10);
        assert_eq!((0..20).filter(|_| budget.try_retry(later)).count(), 10);
        // Half way, only the seconds still in it count.
        let budget = RetryBudget::new(
            BudgetSettings {
                share: 0.5,
                floor: 0.0,
            },
            t0,
        );
        for _ in 0..10 {
            budget.first_try(t0);
        }
        for _ in 0..10 {
            budget.first_try(t0 + Duration::from_secs(5));
        }
        let in_window = t0 + Duration::from_secs(12);
        assert_eq!((0..20).filter(|_| budget.try_retry(in_window)).count(), 5);
    }

    #[tokio::test(start_paused = true)]
    async fn run_within_rides_out_an_outage_of_its_time_and_no_longer() {
        let policy = RetryPolicy {
            max_attempts: u32::MAX,
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(16),
        };
        // Down for 40 s: a minute's retries outlast it.
        let start = Instant::now();
        let tries = std::cell::Cell::new(0);
        let ridden: Result<u32, &str> = policy
            .run_within(
                Duration::from_secs(60),
                || async {
                    tries.set(tries.get() + 1);
                    if start.elapsed() < Duration::from_secs(40) {
                        Err("down")
                    } else {
                        Ok(tries.get())
                    }
                },
                |_| Retry::After(None),
            )
            .await;
        assert!(ridden.is_ok(), "{ridden:?}");
        // Down for good: it gives up within its minute.
        let start = Instant::now();
        let spent: Result<(), &str> = policy
            .run_within(
                Duration::from_secs(60),
                || async { Err("down") },
                |_| Retry::After(None),
            )
            .await;
        assert_eq!(spent, Err("down"));
        assert!(start.elapsed() <= Duration::from_secs(60));
        // A Retry-After past the minute ends it at once.
        let start = Instant::now();
        let _: Result<(), &str> = policy
            .run_within(
                Duration::from_secs(60),
                || async { Err("later") },
                |_| Retry::After(Some(Duration::from_secs(600))),
            )
            .await;
        assert_eq!(start.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn run_stops_at_success_at_a_final_error_or_when_the_tries_are_spent() {
        let tries = std::cell::Cell::new(0);
        let spent: Result<(), &str> = POLICY
            .run(
                || async {
                    tries.set(tries.get() + 1);
                    Err("busy")
                },
                |_| Retry::After(None),
            )
            .await;
        assert_eq!((spent, tries.get()), (Err("busy"), 5));

        tries.set(0);
        let final_error: Result<(), &str> = POLICY
            .run(
                || async {
                    tries.set(tries.get() + 1);
                    Err("refused")
                },
                |_| Retry::Never,
            )
            .await;
        assert_eq!((final_error, tries.get()), (Err("refused"), 1));

        tries.set(0);
        let started = tokio::time::Instant::now();
        let third: Result<u32, &str> = POLICY
            .run(
                || async {
                    tries.set(tries.get() + 1);
                    if tries.get() == 3 { Ok(3) } else { Err("busy") }
                },
                |_| Retry::After(Some(Duration::from_secs(2))),
            )
            .await;
        assert_eq!(third, Ok(3));
        assert!(
            started.elapsed() >= Duration::from_secs(4),
            "each wait honours the floor"
        );
    }
}
