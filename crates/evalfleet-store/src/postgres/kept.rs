//! Reports and comparisons computed once and kept (see the `kept_reports`
//! table in `schema`).

use crate::{KEPT_PER_RUN, KeptReport, KeptReports, StoreError};
use evalfleet_types::now_ms;

use super::PgStore;

impl KeptReports for PgStore {
    fn kept_report(&mut self, run_id: &str, key: &str) -> Result<Option<KeptReport>, StoreError> {
        self.with("cannot read a kept report", |conn| {
            let rid = conn.rid(run_id)?;
            let row = conn.client.query_opt(
                "SELECT fingerprint, body FROM kept_reports WHERE rid = $1 AND key = $2",
                &[&rid, &key],
            )?;
            Ok(match row {
                Some(row) => Some(KeptReport {
                    fingerprint: row.try_get(0)?,
                    body: row.try_get(1)?,
                }),
                None => None,
            })
        })
    }

    fn keep_report(
        &mut self,
        run_id: &str,
        key: &str,
        report: &KeptReport,
    ) -> Result<(), StoreError> {
        let limit = KEPT_PER_RUN as i64;
        self.with("cannot keep a report", |conn| {
            let rid = conn.rid(run_id)?;
            let mut tx = conn.client.transaction()?;
            // The reports kept last stay: `made_at` orders them, so each
            // report kept is made later than every other of its run's
            // (by a millisecond when the clock has not moved on, or was
            // set back), and a replaced one moves to the end.
            tx.execute(
                "INSERT INTO kept_reports (rid, key, fingerprint, body, made_at)
                 VALUES ($1, $2, $3, $4, GREATEST($5,
                     (SELECT COALESCE(MAX(made_at), 0) + 1 FROM kept_reports WHERE rid = $1)))
                 ON CONFLICT (rid, key) DO UPDATE SET fingerprint = EXCLUDED.fingerprint,
                     body = EXCLUDED.body, made_at = EXCLUDED.made_at",
                &[&rid, &key, &report.fingerprint, &report.body, &now_ms()],
            )?;
            tx.execute(
                "DELETE FROM kept_reports WHERE rid = $1 AND key NOT IN (
                     SELECT key FROM kept_reports WHERE rid = $1
                     ORDER BY made_at DESC, key DESC LIMIT $2)",
                &[&rid, &limit],
            )?;
            tx.commit()?;
            Ok(())
        })
    }
}
