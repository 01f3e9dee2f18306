//! Quotas shared by every worker that uses one API key: a provider's `rpm`
//! and `tpm` belong to the key, so workers on many machines take from one
//! row of `quotas` instead of each pacing itself to the whole quota.
//!
//! Each row is a GCRA (generic cell rate algorithm) cell: `tat`, the
//! theoretical arrival time of the next unit, on the database's clock. The
//! quota is full while `tat` is now or past; taking `k` units moves it
//! `k` unit times forward, and a take may move it at most a burst (one
//! second's worth) past now. That is a token bucket kept as one timestamp:
//! nothing refills it, time does.
//!
//! - A take is one statement: `INSERT ... ON CONFLICT DO UPDATE` creates the
//!   row on first use or locks and updates it. Workers taking at once queue
//!   on that row lock, and each computes its grant from the row as the one
//!   before left it (READ COMMITTED re-reads a row updated while the
//!   statement waited for it), so together they never get more than the
//!   rate and a burst. A statement that waited for the lock computes with
//!   the `now()` from before the wait, which can only grant less.
//! - The grant's size comes back through `granted`, written by the same
//!   update: an update cannot return the values the row had before it.
//! - A refund moves `tat` back, never before now (a full quota does not
//!   fill further); a charge (a call used more tokens than estimated)
//!   moves it forward whatever is left, as the tokens were used.
//! - `cool_until` stops every take until then (a 429's `Retry-After`): a
//!   later cool-down extends it, a shorter one changes nothing.
//!
//! A statement run again after its connection was lost may have been
//! applied once already: a take then grants units nobody uses, which only
//! slows the quota's users down for a moment; a refund or charge may count
//! twice, within one chunk's worth.

use std::time::Duration;

use crate::{Granted, Quotas, SharedQuota, StoreError};

use super::PgStore;

/// The units a take grants, from the row as it is (`q`), for the want
/// (`$4`), burst (`$5`, units) and unit time (`$6`, seconds) passed: none
/// during a cool-down, else what fits between the burst and how far `tat`
/// is ahead of now. The small addition keeps a whole unit whole after
/// microsecond rounding.
macro_rules! grant {
    () => {
        "(CASE WHEN q.cool_until > now() THEN 0
               ELSE GREATEST(0, LEAST($4::bigint,
                   floor(($5::float8 * $6::float8
                          - GREATEST(extract(epoch FROM q.tat - now())::float8, 0))
                         / $6::float8 + 1e-6)))
          END)::bigint"
    };
}

/// Takes up to `$4` units; returns those granted and, when none was, the
/// seconds until one is (the rest of a cool-down, or the next unit's time).
const TAKE: &str = concat!(
    "INSERT INTO quotas AS q (key_hash, model, kind, tat, granted)
     VALUES ($1, $2, $3,
             now() + interval '1 second' * ($6::float8 * LEAST($4::bigint, floor($5::float8 + 1e-6))),
             LEAST($4::bigint, floor($5::float8 + 1e-6))::bigint)
     ON CONFLICT (key_hash, model, kind) DO UPDATE SET
         granted = ",
    grant!(),
    ",
         tat = GREATEST(q.tat, now()) + interval '1 second' * ($6::float8 * ",
    grant!(),
    ")
     RETURNING granted,
         CASE WHEN granted > 0 THEN 0::float8
              ELSE GREATEST(extract(epoch FROM GREATEST(cool_until, now()) - now())::float8,
                            extract(epoch FROM tat - now())::float8
                                - ($5::float8 - 1) * $6::float8,
                            0)
         END"
);

/// Gives `$4` units of unit time `$5` back: `tat` moves back, but not
/// before now (nor forward, when it is past already).
const REFUND: &str = "UPDATE quotas
     SET tat = GREATEST(tat - interval '1 second' * ($4::float8 * $5::float8), LEAST(tat, now()))
     WHERE key_hash = $1 AND model = $2 AND kind = $3";

/// Takes `$4` more units of unit time `$5`, whatever is left.
const CHARGE: &str = "INSERT INTO quotas AS q (key_hash, model, kind, tat)
     VALUES ($1, $2, $3, now() + interval '1 second' * ($4::float8 * $5::float8))
     ON CONFLICT (key_hash, model, kind) DO UPDATE
     SET tat = GREATEST(q.tat, now()) + interval '1 second' * ($4::float8 * $5::float8)";

/// Stops takes for `$4` seconds from now, unless they are stopped longer.
const COOL: &str = "INSERT INTO quotas AS q (key_hash, model, kind, tat, cool_until)
     VALUES ($1, $2, $3, now(), now() + interval '1 second' * $4::float8)
     ON CONFLICT (key_hash, model, kind) DO UPDATE
     SET cool_until = GREATEST(q.cool_until, EXCLUDED.cool_until)";

/// A count of units as the statements take it.
fn units(count: u64) -> i64 {
    i64::try_from(count).unwrap_or(i64::MAX)
}

impl Quotas for PgStore {
    fn shares_quotas(&self) -> bool {
        true
    }

    fn take_quota(&mut self, quota: &SharedQuota, want: u64) -> Result<Granted, StoreError> {
        let (kind, want) = (quota.kind.as_str(), units(want));
        let (burst, unit) = (quota.burst(), quota.unit_secs());
        self.with("cannot take from a shared quota", |conn| {
            let row = conn.client.query_one(
                TAKE,
                &[&quota.key, &quota.model, &kind, &want, &burst, &unit],
            )?;
            let granted: i64 = row.get(0);
            let wait: f64 = row.get(1);
            Ok(Granted {
                units: granted.max(0) as u64,
                wait: Duration::try_from_secs_f64(wait.max(0.0)).unwrap_or(Duration::MAX),
            })
        })
    }

    fn refund_quota(&mut self, quota: &SharedQuota, units: i64) -> Result<(), StoreError> {
        if units == 0 {
            return Ok(());
        }
        let (kind, unit) = (quota.kind.as_str(), quota.unit_secs());
        let (statement, count) = if units > 0 {
            (REFUND, units as f64)
        } else {
            (CHARGE, units.unsigned_abs() as f64)
        };
        self.with("cannot give back to a shared quota", |conn| {
            conn.client
                .execute(statement, &[&quota.key, &quota.model, &kind, &count, &unit])?;
            Ok(())
        })
    }

    fn cool_quota(&mut self, quota: &SharedQuota, wait: Duration) -> Result<(), StoreError> {
        let kind = quota.kind.as_str();
        let secs = wait.as_secs_f64();
        self.with("cannot pause a shared quota", |conn| {
            conn.client
                .execute(COOL, &[&quota.key, &quota.model, &kind, &secs])?;
            Ok(())
        })
    }
}
