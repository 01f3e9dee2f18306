//! The service account's write quota (`writes_per_minute`): Google allows
//! an account 60 write requests a minute, whatever sheet each goes to, so
//! every writer of the account takes its turn before each request, tries
//! again included.
//!
//! - Each writer paces itself to the quota ([`Pace`], a GCRA cell: one
//!   second's worth at most at once, then one a unit's time apart), so that
//!   a writer alone keeps within it.
//! - When the run's store shares quotas (PostgreSQL), each request also
//!   takes a unit of the store's quota for the account (its email's
//!   SHA-256, model [`MODEL`]) through the fleet's shared limiter
//!   ([`evalfleet_fleet::shared_rate`]), so that the runs and workers of
//!   the store keep within it together. A store that does not answer leaves
//!   the writer to its own pace for a while: it slows writes, never stops
//!   them.
//! - A 429 pauses the quota for its `Retry-After` (else `quota_wait`): this
//!   writer's pace, and the store's quota for every writer of the account.

use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use evalfleet_fleet::shared_rate::{self, QuotaStore, SharedLimit};
use evalfleet_store::{QuotaKind, SharedQuota};

/// The quota's model in the store: Google Sheets' writes, whatever sheet.
pub const MODEL: &str = "google-sheets";

/// A GCRA cell on this process's clock: `tat`, when the quota is full
/// again. Time is passed in.
#[derive(Debug)]
struct Pace {
    unit: Duration,
    /// How far `tat` may run ahead of now: a burst's worth less one unit.
    slack: Duration,
    tat: Option<Instant>,
    cool_until: Option<Instant>,
}

impl Pace {
    fn new(per_minute: u32) -> Self {
        let per_minute = per_minute.max(1);
        let unit = Duration::from_secs(60) / per_minute;
        let burst = (per_minute / 60).max(1);
        Self {
            unit,
            slack: unit * (burst - 1),
            tat: None,
            cool_until: None,
        }
    }

    /// Takes a unit now (zero), or says how long until one is.
    fn take(&mut self, now: Instant) -> Duration {
        if let Some(until) = self.cool_until.filter(|until| *until > now) {
            return until - now;
        }
        let tat = self.tat.map_or(now, |tat| tat.max(now));
        if tat > now + self.slack {
            return tat - (now + self.slack);
        }
        self.tat = Some(tat + self.unit);
        Duration::ZERO
    }

    /// No unit before `until`; a pause already longer stays.
    fn cool(&mut self, until: Instant) {
        self.cool_until = Some(self.cool_until.map_or(until, |c| c.max(until)));
    }
}

/// A writer's turns at the account's write quota.
pub struct WriteQuota {
    quota: SharedQuota,
    pace: Mutex<Pace>,
    /// The store's quota for the account, once shared.
    shared: OnceLock<SharedLimit>,
}

impl std::fmt::Debug for WriteQuota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteQuota")
            .field("per_minute", &self.quota.per_minute)
            .field("shared", &self.shared.get().is_some())
            .finish_non_exhaustive()
    }
}

impl WriteQuota {
    /// The quota of the account `account` (its email), `per_minute` writes.
    pub fn new(account: &str, per_minute: u32) -> Self {
        Self {
            quota: SharedQuota {
                key: hex::encode(Sha256::digest(account.as_bytes())),
                model: MODEL.to_owned(),
                kind: QuotaKind::Requests,
                per_minute: u64::from(per_minute.max(1)),
            },
            pace: Mutex::new(Pace::new(per_minute)),
            shared: OnceLock::new(),
        }
    }

    /// Writes a minute.
    pub fn per_minute(&self) -> u64 {
        self.quota.per_minute
    }

    /// Takes the account's quota from `store` too (a connection of its
    /// own), when it shares quotas; its sweeper runs on `tracker` until
    /// `stop`, then gives back what it holds. Whether it shares.
    pub fn share(&self, store: QuotaStore, tracker: &TaskTracker, stop: CancellationToken) -> bool {
        if !store.shares_quotas() || self.shared.get().is_some() {
            tracker.spawn_blocking(move || drop(store));
            return false;
        }
        let limit = shared_rate::share_quota(self.quota.clone(), store, tracker, stop);
        self.shared.set(limit).is_ok()
    }

    /// Waits for this writer's turn, and the account's when it is shared.
    pub async fn acquire(&self) {
        loop {
            let wait = self
                .pace
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(Instant::now());
            if wait.is_zero() {
                break;
            }
            tokio::time::sleep(wait).await;
        }
        if let Some(shared) = self.shared.get() {
            shared.acquire(0).await;
        }
    }

    /// A 429: no write of the account for `wait`, by this writer or (when
    /// shared) any other.
    pub fn rate_limited(&self, wait: Duration) {
        self.pace
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .cool(Instant::now() + wait);
        if let Some(shared) = self.shared.get() {
            shared.on_rate_limited(Some(wait));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[tokio::test(start_paused = true)]
    async fn a_writer_alone_keeps_to_the_quota() {
        let t0 = Instant::now();
        // 60 a minute: one a second.
        let mut pace = Pace::new(60);
        assert_eq!(pace.take(t0), Duration::ZERO);
        assert_eq!(pace.take(t0 + ms(400)), ms(600));
        assert_eq!(pace.take(t0 + ms(1000)), Duration::ZERO);
        // 600 a minute: ten at once, then one each 100 ms.
        let mut pace = Pace::new(600);
        for _ in 0..10 {
            assert_eq!(pace.take(t0), Duration::ZERO);
        }
        assert_eq!(pace.take(t0), ms(100));
        assert_eq!(pace.take(t0 + ms(100)), Duration::ZERO);
        // Idle for long: no more than a burst at once, still.
        let later = t0 + Duration::from_secs(60);
        for _ in 0..10 {
            assert_eq!(pace.take(later), Duration::ZERO);
        }
        assert_eq!(pace.take(later), ms(100));
    }

    #[tokio::test(start_paused = true)]
    async fn a_429_pauses_the_writer_for_its_wait() {
        let quota = WriteQuota::new("runner@example.iam.gserviceaccount.com", 6000);
        quota.acquire().await;
        quota.rate_limited(Duration::from_secs(3));
        quota.rate_limited(Duration::from_secs(1));
        let t0 = Instant::now();
        quota.acquire().await;
        assert_eq!(Instant::now() - t0, Duration::from_secs(3));
        assert_eq!(quota.quota.model, MODEL);
        assert_eq!(quota.quota.key.len(), 64, "the email's SHA-256, in hex");
    }
}
