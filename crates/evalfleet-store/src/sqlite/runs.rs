//! Runs: registration, sessions, status and counts, and their workers.

use crate::{
    CreateRunError, ItemSource, NewRun, RunRecord, Runs, SessionStart, StoreError, WorkerInfo,
    WorkerWork,
};
use evalfleet_types::{RunStatus, StateCounts, now_ms};
use rusqlite::{ErrorCode, OptionalExtension, Transaction, params};

use super::{SqliteStore, db_err, json_err};
use crate::columns::RawRun;

fn register(
    tx: &Transaction<'_>,
    rid: i64,
    items: &mut dyn ItemSource,
) -> Result<(), CreateRunError> {
    let mut insert = tx
        .prepare_cached(
            "INSERT INTO items (rid, item_id, seq, line, offset, sample_key, state, invalid)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'pending', ?7)",
        )
        .map_err(db_err("cannot prepare the item insert"))?;
    while let Some(item) = items.next_item()? {
        let inserted = insert.execute(params![
            rid,
            item.item_id,
            item.seq as i64,
            item.line as i64,
            item.offset as i64,
            item.sample_key,
            item.invalid,
        ]);
        match inserted {
            Ok(_) => {}
            Err(rusqlite::Error::SqliteFailure(failure, _))
                if failure.code == ErrorCode::ConstraintViolation =>
            {
                let first_line: i64 = tx
                    .query_row(
                        "SELECT line FROM items WHERE rid = ?1 AND item_id = ?2",
                        params![rid, item.item_id],
                        |row| row.get(0),
                    )
                    .map_err(db_err("cannot look up a duplicate item"))?;
                return Err(CreateRunError::DuplicateId {
                    path: items.path(),
                    id: item.item_id,
                    first_line: first_line as u64,
                    second_line: item.line,
                });
            }
            Err(err) => return Err(StoreError::backend("cannot register an item", err).into()),
        }
    }
    Ok(())
}

const RUN_COLUMNS: &str = "run_id, name, status, created_at, updated_at, config, config_dir, fingerprint, dataset, \
                           total, sessions, message, generation";

fn run_from_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<RawRun> {
    Ok(RawRun {
        run_id: row.get(0)?,
        name: row.get(1)?,
        status: row.get(2)?,
        created_at: row.get(3)?,
        updated_at: row.get(4)?,
        config: row.get(5)?,
        config_dir: row.get(6)?,
        fingerprint: row.get(7)?,
        dataset: row.get(8)?,
        total: row.get(9)?,
        sessions: row.get(10)?,
        message: row.get(11)?,
        generation: row.get(12)?,
    })
}

impl Runs for SqliteStore {
    fn create_run(
        &mut self,
        run: &NewRun,
        items: &mut dyn ItemSource,
    ) -> Result<RunRecord, CreateRunError> {
        let tx = self.write("cannot begin the run's transaction")?;
        let exists: bool = tx
            .query_row(
                "SELECT EXISTS (SELECT 1 FROM runs WHERE run_id = ?1)",
                [&run.run_id],
                |row| row.get(0),
            )
            .map_err(db_err("cannot check the run id"))?;
        if exists {
            return Err(CreateRunError::RunExists(run.run_id.clone()));
        }
        let config =
            serde_json::to_string(&run.config).map_err(json_err("cannot encode the config"))?;
        tx.execute(
            "INSERT INTO runs (run_id, name, status, created_at, updated_at, config, config_dir, fingerprint, digest,
                               dataset, total)
             VALUES (?1, ?2, 'running', ?3, ?3, ?4, ?5, '', '', '', 0)",
            params![run.run_id, run.name, run.created_at_ms, config, run.config_dir],
        )
        .map_err(db_err("cannot insert the run"))?;
        let rid = tx.last_insert_rowid();
        register(&tx, rid, items)?;
        let identity = items.finish()?;
        if let Some(n) = identity.sample_n {
            tx.execute(
                "DELETE FROM items WHERE rid = ?1 AND seq NOT IN (
                     SELECT seq FROM items WHERE rid = ?1 ORDER BY sample_key, item_id LIMIT ?2)",
                params![rid, n as i64],
            )
            .map_err(db_err("cannot take the sample"))?;
        }
        tx.execute(
            "UPDATE items SET state = 'failed' WHERE rid = ?1 AND invalid IS NOT NULL",
            [rid],
        )
        .map_err(db_err("cannot mark invalid rows"))?;
        tx.execute(
            "INSERT INTO results (rid, seq, item_id, status, error, attempts, finished_at)
             SELECT rid, seq, item_id, 'failed', 'invalid dataset row (line ' || line || '): ' || invalid, 0, ?2
             FROM items WHERE rid = ?1 AND invalid IS NOT NULL",
            params![rid, now_ms()],
        )
        .map_err(db_err("cannot record invalid rows"))?;
        let total: i64 = tx
            .query_row("SELECT COUNT(*) FROM items WHERE rid = ?1", [rid], |row| {
                row.get(0)
            })
            .map_err(db_err("cannot count items"))?;
        let fingerprint = serde_json::to_string(&identity.fingerprint)
            .map_err(json_err("cannot encode the fingerprint"))?;
        let dataset = serde_json::to_string(&identity.dataset)
            .map_err(json_err("cannot encode the dataset"))?;
        tx.execute(
            "UPDATE runs SET fingerprint = ?2, digest = ?3, dataset = ?4, total = ?5,
                 failed = (SELECT COUNT(*) FROM items WHERE rid = ?1 AND state = 'failed')
             WHERE rid = ?1",
            params![
                rid,
                fingerprint,
                identity.fingerprint.digest(),
                dataset,
                total
            ],
        )
        .map_err(db_err("cannot update the run"))?;
        tx.commit().map_err(db_err("cannot commit the new run"))?;
        self.rids.insert(run.run_id.clone(), rid);
        Ok(self.run(&run.run_id)?)
    }

    fn run(&mut self, run_id: &str) -> Result<RunRecord, StoreError> {
        self.conn
            .query_row(
                &format!("SELECT {RUN_COLUMNS} FROM runs WHERE run_id = ?1"),
                [run_id],
                run_from_row,
            )
            .optional()
            .map_err(db_err("cannot read the run"))?
            .ok_or_else(|| StoreError::NoSuchRun(run_id.to_owned()))?
            .decode()
    }

    fn runs(&mut self) -> Result<Vec<RunRecord>, StoreError> {
        let mut stmt = self
            .conn
            .prepare(&format!(
                "SELECT {RUN_COLUMNS} FROM runs ORDER BY created_at DESC, rid DESC"
            ))
            .map_err(db_err("cannot list runs"))?;
        let rows = stmt
            .query_map([], run_from_row)
            .map_err(db_err("cannot list runs"))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(db_err("cannot list runs"))?;
        rows.into_iter().map(RawRun::decode).collect()
    }

    fn begin_session(
        &mut self,
        run_id: &str,
        worker: &mut WorkerInfo,
        retry_failed: bool,
    ) -> Result<SessionStart, StoreError> {
        let rid = self.rid(run_id)?;
        let tx = self.write("cannot begin a session")?;
        let mut reset = 0;
        if retry_failed {
            tx.execute(
                "DELETE FROM results WHERE rid = ?1 AND seq IN (
                     SELECT seq FROM items WHERE rid = ?1 AND state = 'failed' AND invalid IS NULL)",
                [rid],
            )
            .map_err(db_err("cannot reset failed items"))?;
            reset = tx
                .execute(
                    "UPDATE items SET state = 'pending' WHERE rid = ?1 AND state = 'failed' AND invalid IS NULL",
                    [rid],
                )
                .map_err(db_err("cannot reset failed items"))? as u64;
        }
        let now = now_ms();
        tx.execute(
            "UPDATE runs SET status = 'running', sessions = sessions + 1, updated_at = ?2, message = NULL,
                 failed = failed - ?3, generation = generation + 1
             WHERE rid = ?1",
            params![rid, now, reset as i64],
        )
        .map_err(db_err("cannot start the session"))?;
        let session: i64 = tx
            .query_row("SELECT sessions FROM runs WHERE rid = ?1", [rid], |row| {
                row.get(0)
            })
            .map_err(db_err("cannot read the session"))?;
        worker.session = session as u32;
        worker.started_at_ms = now;
        worker.heartbeat_at_ms = now;
        tx.execute(
            "INSERT OR REPLACE INTO workers (rid, worker, session, host, pid, process_start, started_at,
                 heartbeat_at, lease_ms, pid_scope)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7, ?8, ?9)",
            params![
                rid,
                worker.worker,
                session,
                worker.host,
                worker.pid,
                worker.process_start as i64,
                now,
                worker.lease_ms,
                worker.pid_scope
            ],
        )
        .map_err(db_err("cannot register the worker"))?;
        tx.commit()
            .map_err(db_err("cannot commit the session start"))?;
        Ok(SessionStart {
            session: session as u32,
            reset,
            counts: self.counts(run_id)?,
        })
    }

    fn set_status(
        &mut self,
        run_id: &str,
        status: RunStatus,
        message: Option<&str>,
    ) -> Result<bool, StoreError> {
        let rid = self.rid(run_id)?;
        let err = db_err("cannot set the run's status");
        let changed = self
            .conn
            .execute(
                "UPDATE runs SET status = ?2, message = ?3, updated_at = ?4
                 WHERE rid = ?1 AND status <> ?2",
                params![rid, status.as_str(), message, now_ms()],
            )
            .map_err(&err)?;
        if changed == 0 {
            self.conn
                .execute(
                    "UPDATE runs SET message = ?2, updated_at = ?3 WHERE rid = ?1",
                    params![rid, message, now_ms()],
                )
                .map_err(&err)?;
        }
        Ok(changed > 0)
    }

    fn counts(&mut self, run_id: &str) -> Result<StateCounts, StoreError> {
        let rid = self.rid(run_id)?;
        let (total, done, failed): (i64, i64, i64) = self
            .conn
            .prepare_cached("SELECT total, done, failed FROM runs WHERE rid = ?1")
            .and_then(|mut stmt| {
                stmt.query_row([rid], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)))
            })
            .map_err(db_err("cannot count items"))?;
        let pending = total - done - failed;
        if pending < 0 {
            return Err(StoreError::Invariant(format!(
                "run '{run_id}' counts {done} done and {failed} failed of {total} items"
            )));
        }
        Ok(StateCounts {
            pending: pending as u64,
            done: done as u64,
            failed: failed as u64,
        })
    }

    fn worker_work(&mut self, run_id: &str) -> Result<Vec<WorkerWork>, StoreError> {
        let rid = self.rid(run_id)?;
        let err = db_err("cannot read what the workers did");
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT worker, done, failed FROM worker_tallies WHERE rid = ?1 ORDER BY worker",
            )
            .map_err(&err)?;
        stmt.query_map([rid], |row| {
            Ok(WorkerWork {
                worker: row.get(0)?,
                done: row.get::<_, i64>(1)?.max(0) as u64,
                failed: row.get::<_, i64>(2)?.max(0) as u64,
            })
        })
        .map_err(&err)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(&err)
    }

    fn workers(&mut self, run_id: &str) -> Result<Vec<WorkerInfo>, StoreError> {
        let rid = self.rid(run_id)?;
        let err = db_err("cannot read the run's workers");
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT worker, session, host, pid, process_start, started_at, heartbeat_at, lease_ms,
                        pid_scope
                 FROM workers WHERE rid = ?1 ORDER BY session",
            )
            .map_err(&err)?;
        stmt.query_map([rid], |row| {
            Ok(WorkerInfo {
                worker: row.get(0)?,
                session: row.get(1)?,
                host: row.get(2)?,
                pid: row.get(3)?,
                process_start: row.get::<_, i64>(4)? as u64,
                started_at_ms: row.get(5)?,
                heartbeat_at_ms: row.get(6)?,
                lease_ms: row.get(7)?,
                pid_scope: row.get(8)?,
            })
        })
        .map_err(&err)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(&err)
    }
}
