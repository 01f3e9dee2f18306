//! Providers' quotas shared by every worker that uses the same API key.

use super::errors::StoreError;

/// What a shared quota counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuotaKind {
    /// Calls (a provider's requests per minute).
    Requests,
    /// Prompt and completion tokens (its tokens per minute).
    Tokens,
}

impl QuotaKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Requests => "requests",
            Self::Tokens => "tokens",
        }
    }
}

/// A provider's quota as every worker using the same API key for the same
/// model shares it: the quota belongs to the key, not to a worker, so
/// workers pacing themselves each to the whole of it would together send
/// several times it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SharedQuota {
    /// The SHA-256 of the API key, in hex: the key itself is never stored.
    pub key: String,
    pub model: String,
    pub kind: QuotaKind,
    /// Units a minute (as `rpm` or `tpm` says).
    pub per_minute: u64,
}

impl SharedQuota {
    /// The seconds one unit takes to come back.
    pub fn unit_secs(&self) -> f64 {
        60.0 / self.per_minute.max(1) as f64
    }

    /// Units that may be taken at once when none was for a while: one
    /// second's worth (at least one), as the endpoint's own bucket allows.
    pub fn burst(&self) -> f64 {
        (self.per_minute as f64 / 60.0).max(1.0)
    }
}

/// What a take of a shared quota got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Granted {
    /// Units granted (at most those asked for).
    pub units: u64,
    /// When none was: how long until one is (the rest of a cool-down, or
    /// the next unit's time). Zero when some were.
    pub wait: std::time::Duration,
}

/// Quotas shared by every worker of the store (see [`SharedQuota`]). A
/// store that workers do not share (SQLite, one machine's file) shares
/// nothing: its defaults grant whatever is asked, and each worker's own
/// rate limiter is then the only one.
pub trait Quotas {
    /// Whether takes are shared with other workers; when not, there is no
    /// point in asking.
    fn shares_quotas(&self) -> bool {
        false
    }

    /// Takes up to `want` units of `quota` now: as many as its burst
    /// allows, none during a cool-down.
    fn take_quota(&mut self, quota: &SharedQuota, want: u64) -> Result<Granted, StoreError> {
        let _ = quota;
        Ok(Granted {
            units: want,
            wait: std::time::Duration::ZERO,
        })
    }

    /// Gives back `units` taken and not used (a lease that ran out, a call
    /// that used fewer tokens than estimated); a negative number takes that
    /// many more, whatever is left (a call that used more than estimated
    /// has used them).
    fn refund_quota(&mut self, quota: &SharedQuota, units: i64) -> Result<(), StoreError> {
        let _ = (quota, units);
        Ok(())
    }

    /// Stops every take of `quota` for `wait` from now (a 429's
    /// `Retry-After`); a cool-down already longer stays.
    fn cool_quota(
        &mut self,
        quota: &SharedQuota,
        wait: std::time::Duration,
    ) -> Result<(), StoreError> {
        let _ = (quota, wait);
        Ok(())
    }
}
