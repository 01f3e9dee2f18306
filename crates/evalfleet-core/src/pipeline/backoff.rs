//! How long an item waits before its next attempt.

use std::time::Duration;

use crate::config::RetryPolicy;

/// The wait before retry number `retry` (1 for the first retry): exponential
/// backoff with full jitter (uniform between zero and `base * 2^(retry-1)`,
/// capped at `backoff_max`), and never less than the endpoint's
/// `Retry-After`. `unit` is a uniform draw from `[0, 1)`.
pub fn delay(
    policy: &RetryPolicy,
    retry: u32,
    retry_after: Option<Duration>,
    unit: f64,
) -> Duration {
    let exponent = retry.saturating_sub(1).min(30);
    let ceiling = policy
        .backoff_base
        .saturating_mul(1u32 << exponent)
        .min(policy.backoff_max);
    let jittered = ceiling.mul_f64(unit.clamp(0.0, 1.0));
    match retry_after {
        Some(wait) => wait.max(jittered),
        None => jittered,
    }
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
        assert_eq!(delay(&POLICY, 1, None, 1.0), Duration::from_millis(100));
        assert_eq!(delay(&POLICY, 3, None, 1.0), Duration::from_millis(400));
        assert_eq!(delay(&POLICY, 20, None, 1.0), Duration::from_secs(1));
        assert_eq!(delay(&POLICY, 3, None, 0.5), Duration::from_millis(200));
        assert_eq!(delay(&POLICY, 3, None, 0.0), Duration::ZERO);
    }

    #[test]
    fn retry_after_is_a_floor() {
        assert_eq!(
            delay(&POLICY, 1, Some(Duration::from_secs(3)), 0.9),
            Duration::from_secs(3)
        );
        assert_eq!(
            delay(&POLICY, 4, Some(Duration::from_millis(10)), 0.5),
            Duration::from_millis(400)
        );
    }
}
