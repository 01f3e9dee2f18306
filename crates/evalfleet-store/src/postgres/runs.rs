//! Runs: registration, sessions, status and counts, and their workers.
//!
//! A run's items are registered in batches of [`BATCH`] rows, each one
//! multi-row insert per table (`unnest` of arrays), so that a dataset of
//! millions of rows costs a few hundred round trips, not millions. Its
//! counts of items ended are the sums of its `tallies` rows (see the
//! schema), so that workers committing at once do not queue on its row.

use std::collections::{HashMap, HashSet};

use crate::{
    CreateRunError, ItemSource, NewItem, NewRun, RunRecord, Runs, SessionStart, StoreError,
    WorkerInfo, WorkerWork,
};
use evalfleet_types::{RunStatus, StateCounts, now_ms};
use postgres::{GenericClient, IsolationLevel, Row, Transaction};

use super::{Fail, PgStore, Tx, json_err, tally};
use crate::columns::RawRun;

/// Items registered per insert: large enough that round trips cost
/// little, small enough that a batch's arrays stay a few megabytes.
const BATCH: usize = 4_000;

/// The columns [`raw_run`] reads, of `runs r`. Its generation
/// there is its own part only: its commits' part is the sum of its
/// `tallies` ([`COMMITS`], or [`tally`]).
const RUN_COLUMNS: &str = "r.run_id, r.name, r.status, r.created_at, \
     GREATEST(r.updated_at, COALESCE((SELECT MAX(t.updated_at) FROM tallies t WHERE t.rid = r.rid), 0)), \
     r.config, r.config_dir, \
     r.fingerprint, r.dataset, r.total, r.sessions, r.message, r.generation";

/// The commits' part of run `r`'s generation, as a column.
const COMMITS: &str =
    "COALESCE((SELECT SUM(t.generation) FROM tallies t WHERE t.rid = r.rid), 0)::bigint";

/// The columns [`RUN_COLUMNS`] of a row.
fn raw_run(row: &Row) -> Result<RawRun, postgres::Error> {
    Ok(RawRun {
        run_id: row.try_get(0)?,
        name: row.try_get(1)?,
        status: row.try_get(2)?,
        created_at: row.try_get(3)?,
        updated_at: row.try_get(4)?,
        config: row.try_get(5)?,
        config_dir: row.try_get(6)?,
        fingerprint: row.try_get(7)?,
        dataset: row.try_get(8)?,
        total: row.try_get(9)?,
        sessions: i64::from(row.try_get::<_, i32>(10)?),
        message: row.try_get(11)?,
        generation: row.try_get(12)?,
    })
}

/// Registers the items of run `rid` from `items`, a batch at a time. The
/// outer error is the database's (the transaction may be run again); the
/// inner one is the dataset's or a duplicate id, final. Items are pulled
/// up to a batch ahead, so a duplicate is looked for in what was pulled
/// before an error of the source is reported: the first problem in the
/// file's order is the one named, as when items are inserted one by one.
fn register(
    tx: &mut Transaction<'_>,
    rid: i64,
    items: &mut dyn ItemSource,
) -> Tx<Result<(), CreateRunError>> {
    let mut batch: Vec<NewItem> = Vec::with_capacity(BATCH);
    loop {
        batch.clear();
        let mut failed = None;
        while batch.len() < BATCH {
            match items.next_item() {
                Ok(Some(item)) => batch.push(item),
                Ok(None) => break,
                Err(err) => {
                    failed = Some(err);
                    break;
                }
            }
        }
        let full = batch.len() == BATCH;
        if !batch.is_empty()
            && let Some(duplicate) = insert_batch(tx, rid, &batch, items)?
        {
            return Ok(Err(duplicate));
        }
        if let Some(err) = failed {
            return Ok(Err(err));
        }
        if !full {
            return Ok(Ok(()));
        }
    }
}

/// Inserts one batch of items into `item_rows` and `items`: an invalid
/// row is an item failed from the start. Returns the first duplicate id
/// of the batch in its order, against the items before it or within it;
/// nothing of the batch need be undone then (the run's transaction is).
fn insert_batch(
    tx: &mut Transaction<'_>,
    rid: i64,
    batch: &[NewItem],
    items: &dyn ItemSource,
) -> Tx<Option<CreateRunError>> {
    // A duplicate within the batch: the rows before it are inserted (one
    // of them may repeat an earlier batch's id, which comes first).
    let mut lines: HashMap<&str, u64> = HashMap::with_capacity(batch.len());
    let mut inner = None;
    for (at, item) in batch.iter().enumerate() {
        if let Some(first_line) = lines.get(item.item_id.as_str()) {
            inner = Some((at, *first_line));
            break;
        }
        lines.insert(&item.item_id, item.line);
    }
    let rows = &batch[..inner.map_or(batch.len(), |(at, _)| at)];
    let seqs: Vec<i64> = rows.iter().map(|i| i.seq as i64).collect();
    let ids: Vec<&str> = rows.iter().map(|i| i.item_id.as_str()).collect();
    let line_numbers: Vec<i64> = rows.iter().map(|i| i.line as i64).collect();
    let offsets: Vec<i64> = rows.iter().map(|i| i.offset as i64).collect();
    let keys: Vec<i64> = rows.iter().map(|i| i.sample_key).collect();
    let invalid: Vec<Option<&str>> = rows.iter().map(|i| i.invalid.as_deref()).collect();
    let inserted: HashSet<i64> = tx
        .query(
            r#"INSERT INTO item_rows (rid, seq, item_id, line, "offset", sample_key, invalid)
               SELECT $1, * FROM unnest($2::bigint[], $3::text[], $4::bigint[], $5::bigint[],
                                        $6::bigint[], $7::text[])
               ON CONFLICT DO NOTHING
               RETURNING seq"#,
            &[&rid, &seqs, &ids, &line_numbers, &offsets, &keys, &invalid],
        )?
        .iter()
        .map(|row| row.try_get(0))
        .collect::<Result<_, _>>()?;
    if inserted.len() < rows.len()
        && let Some(item) = rows.iter().find(|i| !inserted.contains(&(i.seq as i64)))
    {
        let first = tx.query_opt(
            "SELECT line FROM item_rows WHERE rid = $1 AND item_id = $2",
            &[&rid, &item.item_id],
        )?;
        let Some(first) = first else {
            return Err(Fail::Store(StoreError::Invariant(format!(
                "{}:{}: item {} has the number of another item",
                items.path(),
                item.line,
                item.seq
            ))));
        };
        return Ok(Some(CreateRunError::DuplicateId {
            path: items.path(),
            id: item.item_id.clone(),
            first_line: first.try_get::<_, i64>(0)? as u64,
            second_line: item.line,
        }));
    }
    if let Some((at, first_line)) = inner {
        let item = &batch[at];
        return Ok(Some(CreateRunError::DuplicateId {
            path: items.path(),
            id: item.item_id.clone(),
            first_line,
            second_line: item.line,
        }));
    }
    let bad: Vec<bool> = rows.iter().map(|i| i.invalid.is_some()).collect();
    tx.execute(
        "INSERT INTO items (rid, seq, state)
         SELECT $1, seq, CASE WHEN bad THEN 'failed' ELSE 'pending' END
         FROM unnest($2::bigint[], $3::boolean[]) AS u(seq, bad)",
        &[&rid, &seqs, &bad],
    )?;
    Ok(None)
}

/// Brings the planner's statistics of the queue's tables up to date after
/// a run's items were added. Until it has them (autovacuum analyzes a
/// table some time after it grew, or never where it is off), the planner
/// takes `items` for nearly empty and reads a commit's or a claim's
/// hundreds of items by scanning every row of the run: a run of 100,000
/// items spent 16 ms a commit locking its rows, against 0.8 ms with them.
/// A failure is no reason to stop (ANALYZE of a table this role does not
/// own only warns, in the server's log): the run goes on, slower.
fn analyze(conn: &mut super::Conn) {
    if let Err(err) = conn.client.batch_execute("ANALYZE items, item_rows") {
        tracing::warn!(
            "Could not analyze the store's queue tables ({err}): claims and commits may be slow until autovacuum does."
        );
    }
}

/// Registers the run and its items in `tx`; returns its row id. The inner
/// error is final (see [`register`]).
fn create(
    tx: &mut Transaction<'_>,
    run: &NewRun,
    config: &str,
    items: &mut dyn ItemSource,
    pulled: &mut bool,
) -> Tx<Result<i64, CreateRunError>> {
    // A run of the same id made meanwhile by another process is waited
    // for: once it is committed, this one is refused, as when the checks
    // take turns.
    let made = tx.query_opt(
        "INSERT INTO runs (run_id, name, status, created_at, updated_at, config, config_dir,
                           fingerprint, digest, dataset, total)
         VALUES ($1, $2, 'running', $3, $3, $4, $5, '', '', '', 0)
         ON CONFLICT (run_id) DO NOTHING
         RETURNING rid",
        &[
            &run.run_id,
            &run.name,
            &run.created_at_ms,
            &config,
            &run.config_dir,
        ],
    )?;
    let Some(made) = made else {
        return Ok(Err(CreateRunError::RunExists(run.run_id.clone())));
    };
    let rid: i64 = made.try_get(0)?;
    *pulled = true;
    if let Err(err) = register(tx, rid, items)? {
        return Ok(Err(err));
    }
    let identity = match items.finish() {
        Ok(identity) => identity,
        Err(err) => return Ok(Err(err)),
    };
    if let Some(n) = identity.sample_n {
        let n = i64::try_from(n).unwrap_or(i64::MAX);
        // Byte order of the ids breaks ties, as SQLite compares them. The
        // rows after the first `n` are joined, not looked up in a list of
        // those kept (which may not fit in memory, and is then searched
        // row by row).
        tx.execute(
            r#"DELETE FROM item_rows r USING (
                   SELECT seq FROM item_rows WHERE rid = $1
                   ORDER BY sample_key, item_id COLLATE "C" OFFSET $2) AS gone
               WHERE r.rid = $1 AND r.seq = gone.seq"#,
            &[&rid, &n],
        )?;
        tx.execute(
            "DELETE FROM items i WHERE i.rid = $1 AND NOT EXISTS (
                 SELECT 1 FROM item_rows r WHERE r.rid = i.rid AND r.seq = i.seq)",
            &[&rid],
        )?;
    }
    // An invalid row has its result from the start: failed, saying why.
    let invalid = tx.execute(
        "INSERT INTO results (rid, seq, item_id, status, error, attempts, finished_at,
                              claim_attempt, worker)
         SELECT rid, seq, item_id, 'failed',
                'invalid dataset row (line ' || line || '): ' || invalid, 0, $2, 0, ''
         FROM item_rows WHERE rid = $1 AND invalid IS NOT NULL",
        &[&rid, &now_ms()],
    )?;
    if invalid > 0 {
        // Counted as no worker's.
        tx.execute(
            "INSERT INTO tallies (rid, worker, failed) VALUES ($1, '', $2)",
            &[&rid, &(invalid as i64)],
        )?;
    }
    let total: i64 = tx
        .query_one("SELECT COUNT(*) FROM item_rows WHERE rid = $1", &[&rid])?
        .try_get(0)?;
    let fingerprint = serde_json::to_string(&identity.fingerprint)
        .map_err(json_err("cannot encode the fingerprint"))?;
    let dataset =
        serde_json::to_string(&identity.dataset).map_err(json_err("cannot encode the dataset"))?;
    tx.execute(
        "UPDATE runs SET fingerprint = $2, digest = $3, dataset = $4, total = $5 WHERE rid = $1",
        &[
            &rid,
            &fingerprint,
            &identity.fingerprint.digest(),
            &dataset,
            &total,
        ],
    )?;
    Ok(Ok(rid))
}

/// Run `rid`'s counts, read in `client`'s transaction: its items ended are
/// its tallies' sums, and the rest (pending or running) are pending.
fn counts_in(client: &mut impl GenericClient, rid: i64, run_id: &str) -> Tx<StateCounts> {
    let total: i64 = client
        .query_one("SELECT total FROM runs WHERE rid = $1", &[&rid])?
        .try_get(0)?;
    let tally = tally(client, rid)?;
    let (done, failed) = (tally.done as i64, tally.failed as i64);
    let pending = total - done - failed;
    if pending < 0 {
        return Err(Fail::Store(StoreError::Invariant(format!(
            "run '{run_id}' counts {done} done and {failed} failed of {total} items"
        ))));
    }
    Ok(StateCounts {
        pending: pending as u64,
        done: done as u64,
        failed: failed as u64,
    })
}

/// The message of a registration cut off by a lost connection after its
/// items were read: they cannot be read again in this call.
fn cut_off(run_id: &str) -> StoreError {
    StoreError::Backend {
        message: format!(
            "the connection to the store was lost while run '{run_id}' was being registered, and its items cannot be read again here: `evalfleet runs` shows whether it was stored (the connection may have been lost after it was); if not, create it again"
        ),
        source: None,
    }
}

impl Runs for PgStore {
    fn create_run(
        &mut self,
        run: &NewRun,
        items: &mut dyn ItemSource,
    ) -> Result<RunRecord, CreateRunError> {
        let config =
            serde_json::to_string(&run.config).map_err(json_err("cannot encode the config"))?;
        // The items are pulled once: a transaction cut off after it began
        // pulling them cannot be run again.
        let mut pulled = false;
        let made = self.with("cannot create the run", |conn| {
            if pulled {
                return Err(Fail::Store(cut_off(&run.run_id)));
            }
            let mut tx = conn.client.transaction()?;
            match create(&mut tx, run, &config, items, &mut pulled)? {
                Ok(rid) => {
                    tx.commit()?;
                    analyze(conn);
                    Ok(Ok(rid))
                }
                // Dropping the transaction undoes everything.
                Err(err) => Ok(Err(err)),
            }
        })?;
        made?;
        Ok(self.run(&run.run_id)?)
    }

    fn run(&mut self, run_id: &str) -> Result<RunRecord, StoreError> {
        let raw = self.with("cannot read the run", |conn| {
            let rid = conn.rid(run_id)?;
            let mut tx = conn
                .client
                .build_transaction()
                .read_only(true)
                .isolation_level(IsolationLevel::RepeatableRead)
                .start()?;
            let row = tx.query_one(
                &format!("SELECT {RUN_COLUMNS} FROM runs r WHERE r.rid = $1"),
                &[&rid],
            )?;
            let mut raw = raw_run(&row)?;
            raw.generation += tally(&mut tx, rid)?.generation as i64;
            tx.commit()?;
            Ok(raw)
        })?;
        raw.decode()
    }

    fn runs(&mut self) -> Result<Vec<RunRecord>, StoreError> {
        let raws = self.with("cannot list runs", |conn| {
            let rows = conn.client.query(
                &format!(
                    "SELECT {RUN_COLUMNS}, {COMMITS} FROM runs r
                     ORDER BY r.created_at DESC, r.rid DESC"
                ),
                &[],
            )?;
            let mut raws = Vec::with_capacity(rows.len());
            for row in &rows {
                let mut raw = raw_run(row)?;
                raw.generation += row.try_get::<_, i64>(13)?;
                raws.push(raw);
            }
            Ok(raws)
        })?;
        raws.into_iter().map(RawRun::decode).collect()
    }

    fn begin_session(
        &mut self,
        run_id: &str,
        worker: &mut WorkerInfo,
        retry_failed: bool,
    ) -> Result<SessionStart, StoreError> {
        let me: &WorkerInfo = worker;
        let (session, reset, counts, now) = self.with("cannot begin a session", |conn| {
            let rid = conn.rid(run_id)?;
            let mut tx = conn.client.transaction()?;
            let mut reset = 0;
            if retry_failed {
                // The items first: the update waits for a commit that is
                // ending one of them right now, and once it has them no
                // commit can end them again (they are pending, their claim
                // gone). Then their results, by a statement of its own,
                // whose snapshot sees what such a commit stored.
                let seqs: Vec<i64> = tx
                    .query(
                        "UPDATE items i SET state = 'pending', claim_id = NULL, owner = NULL,
                             lease_until = NULL, not_before = NULL
                         FROM item_rows ir
                         WHERE i.rid = $1 AND ir.rid = $1 AND ir.seq = i.seq
                           AND i.state = 'failed' AND ir.invalid IS NULL
                         RETURNING i.seq",
                        &[&rid],
                    )?
                    .iter()
                    .map(|row| row.get(0))
                    .collect();
                tx.execute(
                    "DELETE FROM results WHERE rid = $1 AND seq = ANY($2)",
                    &[&rid, &seqs],
                )?;
                reset = seqs.len() as u64;
            }
            let now = now_ms();
            let session: i32 = tx
                .query_one(
                    "UPDATE runs SET status = 'running', sessions = sessions + 1, updated_at = $2,
                         message = NULL, generation = generation + 1
                     WHERE rid = $1 RETURNING sessions",
                    &[&rid, &now],
                )?
                .try_get(0)?;
            if reset > 0 {
                // The items put back are no longer failed: taken off the
                // run's own row (worker ''), as the sums are what count; a
                // worker's row keeps what it committed.
                tx.execute(
                    "INSERT INTO tallies (rid, worker, failed) VALUES ($1, '', $2)
                     ON CONFLICT (rid, worker) DO UPDATE SET failed = tallies.failed + EXCLUDED.failed",
                    &[&rid, &-(reset as i64)],
                )?;
            }
            tx.execute(
                "INSERT INTO workers (rid, worker, session, host, pid, process_start, started_at,
                                      heartbeat_at, lease_ms, pid_scope)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, now(), $8, $9)
                 ON CONFLICT (rid, worker) DO UPDATE SET session = EXCLUDED.session,
                     host = EXCLUDED.host, pid = EXCLUDED.pid, pid_scope = EXCLUDED.pid_scope,
                     process_start = EXCLUDED.process_start, started_at = EXCLUDED.started_at,
                     heartbeat_at = EXCLUDED.heartbeat_at, lease_ms = EXCLUDED.lease_ms",
                &[
                    &rid,
                    &me.worker,
                    &session,
                    &me.host,
                    &i64::from(me.pid),
                    &(me.process_start as i64),
                    &now,
                    &me.lease_ms,
                    &me.pid_scope,
                ],
            )?;
            let counts = counts_in(&mut tx, rid, run_id)?;
            tx.commit()?;
            Ok((session, reset, counts, now))
        })?;
        worker.session = session.max(0) as u32;
        worker.started_at_ms = now;
        worker.heartbeat_at_ms = now;
        Ok(SessionStart {
            session: worker.session,
            reset,
            counts,
        })
    }

    fn set_status(
        &mut self,
        run_id: &str,
        status: RunStatus,
        message: Option<&str>,
    ) -> Result<bool, StoreError> {
        self.with("cannot set the run's status", |conn| {
            let rid = conn.rid(run_id)?;
            let changed = conn.client.execute(
                "UPDATE runs SET status = $2, message = $3, updated_at = $4
                 WHERE rid = $1 AND status <> $2",
                &[&rid, &status.as_str(), &message, &now_ms()],
            )?;
            if changed == 0 {
                conn.client.execute(
                    "UPDATE runs SET message = $2, updated_at = $3 WHERE rid = $1",
                    &[&rid, &message, &now_ms()],
                )?;
            }
            Ok(changed > 0)
        })
    }

    fn counts(&mut self, run_id: &str) -> Result<StateCounts, StoreError> {
        self.with("cannot count items", |conn| {
            let rid = conn.rid(run_id)?;
            let mut tx = conn
                .client
                .build_transaction()
                .read_only(true)
                .isolation_level(IsolationLevel::RepeatableRead)
                .start()?;
            let counts = counts_in(&mut tx, rid, run_id)?;
            tx.commit()?;
            Ok(counts)
        })
    }

    fn worker_work(&mut self, run_id: &str) -> Result<Vec<WorkerWork>, StoreError> {
        self.with("cannot read what the workers did", |conn| {
            let rid = conn.rid(run_id)?;
            let rows = conn.client.query(
                "SELECT worker, done, failed FROM tallies
                 WHERE rid = $1 AND worker <> '' ORDER BY worker",
                &[&rid],
            )?;
            Ok(rows
                .iter()
                .map(|row| WorkerWork {
                    worker: row.get(0),
                    done: row.get::<_, i64>(1).max(0) as u64,
                    failed: row.get::<_, i64>(2).max(0) as u64,
                })
                .collect())
        })
    }

    fn workers(&mut self, run_id: &str) -> Result<Vec<WorkerInfo>, StoreError> {
        self.with("cannot read the run's workers", |conn| {
            let rid = conn.rid(run_id)?;
            // A heartbeat's age is measured on the database's clock, then
            // placed on this machine's, so that a reader whose clock is off
            // still judges by it whether a worker lives.
            let rows = conn.client.query(
                "SELECT worker, session, host, pid, process_start, started_at,
                        (EXTRACT(EPOCH FROM (now() - heartbeat_at)) * 1000)::bigint, lease_ms,
                        pid_scope
                 FROM workers WHERE rid = $1 ORDER BY session, worker",
                &[&rid],
            )?;
            let now = now_ms();
            rows.iter()
                .map(|row| {
                    Ok(WorkerInfo {
                        worker: row.try_get(0)?,
                        session: row.try_get::<_, i32>(1)?.max(0) as u32,
                        host: row.try_get(2)?,
                        pid: u32::try_from(row.try_get::<_, i64>(3)?).unwrap_or(0),
                        process_start: row.try_get::<_, i64>(4)? as u64,
                        started_at_ms: row.try_get(5)?,
                        heartbeat_at_ms: now - row.try_get::<_, i64>(6)?,
                        lease_ms: row.try_get(7)?,
                        pid_scope: row.try_get(8)?,
                    })
                })
                .collect()
        })
    }
}
