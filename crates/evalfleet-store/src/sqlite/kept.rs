//! Reports and comparisons computed once and kept (see the `kept_reports`
//! table in `schema`).

use crate::{KEPT_PER_RUN, KeptReport, KeptReports, StoreError};
use evalfleet_types::now_ms;
use rusqlite::{OptionalExtension, params};

use super::{SqliteStore, db_err};

impl KeptReports for SqliteStore {
    fn kept_report(&mut self, run_id: &str, key: &str) -> Result<Option<KeptReport>, StoreError> {
        let rid = self.rid(run_id)?;
        self.conn
            .prepare_cached(
                "SELECT fingerprint, body FROM kept_reports WHERE rid = ?1 AND key = ?2",
            )
            .and_then(|mut stmt| {
                stmt.query_row(params![rid, key], |row| {
                    Ok(KeptReport {
                        fingerprint: row.get(0)?,
                        body: row.get(1)?,
                    })
                })
                .optional()
            })
            .map_err(db_err("cannot read a kept report"))
    }

    fn keep_report(
        &mut self,
        run_id: &str,
        key: &str,
        report: &KeptReport,
    ) -> Result<(), StoreError> {
        let rid = self.rid(run_id)?;
        // Losing it in a power cut costs only its computation again.
        self.without_sync(|store| {
            store
                .conn
                .execute(
                    "INSERT OR REPLACE INTO kept_reports (rid, key, fingerprint, body, made_at)
                     VALUES (?1, ?2, ?3, ?4, ?5)",
                    params![rid, key, report.fingerprint, report.body, now_ms()],
                )
                .map_err(db_err("cannot keep a report"))?;
            // A replaced row is inserted anew: the latest rowids are the
            // reports kept last.
            store
                .conn
                .execute(
                    "DELETE FROM kept_reports WHERE rid = ?1 AND rowid NOT IN
                       (SELECT rowid FROM kept_reports WHERE rid = ?1
                        ORDER BY rowid DESC LIMIT ?2)",
                    params![rid, KEPT_PER_RUN as i64],
                )
                .map_err(db_err("cannot keep a report"))?;
            Ok(())
        })
    }
}
