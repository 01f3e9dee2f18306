//! The one retry policy: how many tries, and how long to wait between them
//! (exponential backoff with full jitter, never less than what the other
//! side asked for). Item calls, LLM-judge calls and the SandboxFusion client
//! all retry through here.

use std::future::Future;
use std::time::Duration;

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
    pub async fn run<T, E, F, Fut>(&self, mut op: F, verdict: impl Fn(&E) -> Retry) -> Result<T, E>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let mut tries = 0;
        loop {
            tries += 1;
            match op().await {
                Ok(value) => return Ok(value),
                Err(err) => match verdict(&err) {
                    Retry::After(retry_after) if tries < self.max_attempts => {
                        tokio::time::sleep(self.backoff(tries, retry_after)).await;
                    }
                    _ => return Err(err),
                },
            }
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
