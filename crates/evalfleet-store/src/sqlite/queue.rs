//! The work queue: claims with a lease over ranges of pending items, and
//! commits checked against them.
//!
//! A claim covers the pending items of `first_seq..=last_seq` that were not
//! covered by another live claim when it was made (a range stops before
//! the first item another live claim holds), so no pending item is in two
//! live claims. Claims are a row per range, not per item: claiming, renewing
//! and checking a commit cost the same for 10 items or 10,000.

use std::collections::{BTreeSet, HashMap};
use std::sync::OnceLock;
use std::time::Duration;

use crate::{
    Batch, Claim, ClaimId, Claimed, Committed, PendingItem, Renewal, StoreError, WorkQueue,
};
use evalfleet_types::{AttemptRecord, ErrorClass, ItemStatus, ResultRecord, now_ms};
use rusqlite::{Transaction, params};

use super::{SqliteStore, db_err, execute_cached, opt_u64};
use crate::columns::{assessment_columns, images_column};

/// A live claim's range.
#[derive(Debug, Clone, Copy)]
struct Range {
    first: u64,
    last: u64,
    mine: bool,
}

/// The live claim that covers `seq`, in `ranges` sorted by `first`.
fn covering(ranges: &[Range], seq: u64) -> Option<Range> {
    let at = ranges.partition_point(|r| r.first <= seq);
    at.checked_sub(1)
        .map(|i| ranges[i])
        .filter(|r| r.last >= seq)
}

fn lease_until(now: i64, lease: Duration) -> i64 {
    now.saturating_add(i64::try_from(lease.as_millis()).unwrap_or(i64::MAX))
}

/// What a scan for claimable items found.
#[derive(Default)]
struct Scan {
    items: Vec<PendingItem>,
    /// A pending item was skipped because another worker holds it.
    held_by_others: bool,
}

/// Pending items after `after`, in order, up to `limit`, that no live
/// claim covers, whose stored wait has passed at `now`, and that follow
/// one another without another in between.
fn scan(
    tx: &Transaction<'_>,
    rid: i64,
    ranges: &[Range],
    after: Option<u64>,
    limit: usize,
    now: i64,
) -> Result<Scan, StoreError> {
    let err = db_err("cannot read pending items");
    let mut found = Scan::default();
    let mut cursor = after.map_or(-1, |s| s as i64);
    // An item's earlier attempts: the highest number used, so that the
    // next is above every stored one (calls answered from the cache take
    // a number but store no row; an agent's run may store its calls and
    // no attempt). It costs a lookup an item; when no item
    // from here on has any (a first session's items), it is skipped.
    let attempted: bool = tx
        .prepare_cached(
            "SELECT EXISTS (SELECT 1 FROM attempts WHERE rid = ?1 AND seq > ?2)
                 OR EXISTS (SELECT 1 FROM agent_calls WHERE rid = ?1 AND seq > ?2)",
        )
        .map_err(&err)?
        .query_row(params![rid, cursor], |row| row.get(0))
        .map_err(&err)?;
    let mut stmt = tx
        .prepare_cached(if attempted {
            "SELECT i.item_id, i.seq, i.line, i.offset,
                    max((SELECT COALESCE(MAX(a.attempt), 0) FROM attempts a
                         WHERE a.rid = i.rid AND a.seq = i.seq),
                        (SELECT COALESCE(MAX(c.attempt), 0) FROM agent_calls c
                         WHERE c.rid = i.rid AND c.seq = i.seq)),
                    i.not_before > ?4
             FROM items i
             WHERE i.rid = ?1 AND i.state = 'pending' AND i.seq > ?2
             ORDER BY i.seq LIMIT ?3"
        } else {
            "SELECT i.item_id, i.seq, i.line, i.offset, 0, i.not_before > ?4
             FROM items i
             WHERE i.rid = ?1 AND i.state = 'pending' AND i.seq > ?2
             ORDER BY i.seq LIMIT ?3"
        })
        .map_err(&err)?;
    'pages: loop {
        let page = stmt
            .query_map(params![rid, cursor, limit as i64, now], |row| {
                let item = PendingItem {
                    item_id: row.get(0)?,
                    seq: row.get::<_, i64>(1)? as u64,
                    line: row.get::<_, i64>(2)? as u64,
                    offset: row.get::<_, i64>(3)? as u64,
                    prior_attempts: row.get::<_, i64>(4)? as u32,
                };
                // NULL (no wait) compares as NULL: not waiting.
                Ok((item, row.get::<_, Option<bool>>(5)?.unwrap_or(false)))
            })
            .map_err(&err)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(&err)?;
        if page.is_empty() {
            return Ok(found);
        }
        for (item, waiting) in page {
            match covering(ranges, item.seq) {
                // It waits out a stored wait, held by no one: a claim's
                // range ends before it, as before an item another worker
                // holds, and the scan goes on past it in this page.
                None if waiting => {
                    if !found.items.is_empty() {
                        return Ok(found);
                    }
                    found.held_by_others = true;
                    cursor = item.seq as i64;
                }
                None => {
                    found.items.push(item);
                    if found.items.len() == limit {
                        return Ok(found);
                    }
                }
                // A claim is one range: it ends before an item someone holds.
                Some(_) if !found.items.is_empty() => return Ok(found),
                Some(range) => {
                    found.held_by_others |= !range.mine;
                    cursor = range.last as i64;
                    continue 'pages;
                }
            }
        }
        cursor = found.items.last().map_or(cursor, |i| i.seq as i64);
    }
}

impl SqliteStore {
    fn claim_now(
        &mut self,
        run_id: &str,
        worker: &str,
        after: Option<u64>,
        limit: usize,
        lease: Duration,
    ) -> Result<Claimed, StoreError> {
        let rid = self.rid(run_id)?;
        let err = db_err("cannot claim items");
        let tx = self.write("cannot claim items")?;
        let now = now_ms();
        // Claims whose lease ran out (their worker died or stalled): their
        // pending items are free again, and taken next, before the items
        // after `after`, not at the end of the run.
        let lapsed: Option<i64> = tx
            .prepare_cached(
                "SELECT MIN(first_seq) FROM claims WHERE rid = ?1 AND lease_until <= ?2",
            )
            .map_err(&err)?
            .query_row(params![rid, now], |row| row.get(0))
            .map_err(&err)?;
        execute_cached(
            &tx,
            "DELETE FROM claims WHERE rid = ?1 AND lease_until <= ?2",
            params![rid, now],
        )
        .map_err(&err)?;
        let after = match (lapsed, after) {
            (Some(first), Some(cursor)) if (first as u64) <= cursor => {
                first.checked_sub(1).map(|s| s as u64)
            }
            _ => after,
        };
        let ranges: Vec<Range> = tx
            .prepare_cached(
                "SELECT first_seq, last_seq, worker FROM claims WHERE rid = ?1 ORDER BY first_seq",
            )
            .map_err(&err)?
            .query_map([rid], |row| {
                Ok(Range {
                    first: row.get::<_, i64>(0)? as u64,
                    last: row.get::<_, i64>(1)? as u64,
                    mine: row.get::<_, String>(2)? == worker,
                })
            })
            .map_err(&err)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(&err)?;
        let limit = limit.max(1);
        let mut found = scan(&tx, rid, &ranges, after, limit, now)?;
        if found.items.is_empty() && after.is_some() {
            // Past the end: items before `after` may be free again (a lease
            // ran out, a worker stopped, failed items were put back).
            found = scan(&tx, rid, &ranges, None, limit, now)?;
        }
        let (Some(first), Some(last)) = (found.items.first(), found.items.last()) else {
            tx.commit().map_err(&err)?;
            return Ok(if found.held_by_others {
                Claimed::HeldByOthers
            } else {
                Claimed::Nothing
            });
        };
        execute_cached(
            &tx,
            "INSERT INTO claims (rid, worker, first_seq, last_seq, lease_until) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![rid, worker, first.seq as i64, last.seq as i64, lease_until(now, lease)],
        )
        .map_err(&err)?;
        let id = tx.last_insert_rowid();
        tx.commit().map_err(&err)?;
        Ok(Claimed::Items(Claim {
            id,
            items: found.items,
        }))
    }

    fn renew_now(
        &mut self,
        run_id: &str,
        worker: &str,
        lease: Duration,
    ) -> Result<Vec<ClaimId>, StoreError> {
        let rid = self.rid(run_id)?;
        let err = db_err("cannot renew the lease");
        let tx = self.write("cannot renew the lease")?;
        let now = now_ms();
        let renewed: Vec<ClaimId> = tx
            .prepare_cached(
                "UPDATE claims SET lease_until = ?4 WHERE rid = ?1 AND worker = ?2 AND lease_until > ?3
                 RETURNING claim_id",
            )
            .map_err(&err)?
            .query_map(params![rid, worker, now, lease_until(now, lease)], |row| {
                row.get(0)
            })
            .map_err(&err)?
            .collect::<Result<_, _>>()
            .map_err(&err)?;
        tx.execute(
            "UPDATE workers SET heartbeat_at = ?3, lease_ms = ?4 WHERE rid = ?1 AND worker = ?2",
            params![
                rid,
                worker,
                now,
                i64::try_from(lease.as_millis()).unwrap_or(i64::MAX)
            ],
        )
        .map_err(&err)?;
        tx.commit().map_err(&err)?;
        Ok(renewed)
    }

    fn release_now(&mut self, run_id: &str, worker: &str) -> Result<(), StoreError> {
        let rid = self.rid(run_id)?;
        let err = db_err("cannot release the worker's claims");
        let tx = self.write("cannot release the worker's claims")?;
        tx.execute(
            "DELETE FROM claims WHERE rid = ?1 AND worker = ?2",
            params![rid, worker],
        )
        .map_err(&err)?;
        tx.execute(
            "DELETE FROM workers WHERE rid = ?1 AND worker = ?2",
            params![rid, worker],
        )
        .map_err(&err)?;
        tx.commit().map_err(&err)
    }
}

impl WorkQueue for SqliteStore {
    fn claim(
        &mut self,
        run_id: &str,
        worker: &str,
        after: Option<u64>,
        limit: usize,
        lease: Duration,
    ) -> Result<Claimed, StoreError> {
        self.without_sync(|store| store.claim_now(run_id, worker, after, limit, lease))
    }

    fn renew(
        &mut self,
        run_id: &str,
        worker: &str,
        lease: Duration,
    ) -> Result<Renewal, StoreError> {
        let held = self.without_sync(|store| store.renew_now(run_id, worker, lease))?;
        Ok(Renewal {
            claims: held.len() as u64,
            held,
            lost: Vec::new(),
        })
    }

    fn release(&mut self, run_id: &str, worker: &str) -> Result<(), StoreError> {
        self.without_sync(|store| store.release_now(run_id, worker))
    }

    fn commit(
        &mut self,
        run_id: &str,
        worker: &str,
        batch: &Batch,
    ) -> Result<Committed, StoreError> {
        let rid = self.rid(run_id)?;
        let cache_db = self.cache_db;
        let tx = self.write("cannot begin a batch")?;
        // This worker's live claims: what it may commit.
        let mine: HashMap<ClaimId, (u64, u64)> = tx
            .prepare_cached(
                "SELECT claim_id, first_seq, last_seq FROM claims
                 WHERE rid = ?1 AND worker = ?2 AND lease_until > ?3",
            )
            .map_err(db_err("cannot read claims"))?
            .query_map(params![rid, worker, now_ms()], |row| {
                Ok((
                    row.get::<_, i64>(0)?,
                    (row.get::<_, i64>(1)? as u64, row.get::<_, i64>(2)? as u64),
                ))
            })
            .map_err(db_err("cannot read claims"))?
            .collect::<Result<_, _>>()
            .map_err(db_err("cannot read claims"))?;
        let held = |claim: ClaimId, seq: u64| {
            mine.get(&claim)
                .is_some_and(|(first, last)| (*first..=*last).contains(&seq))
        };
        let mut refused = BTreeSet::new();
        let mut touched = BTreeSet::new();
        let mut done = 0i64;
        let mut failed = 0i64;
        let mut calls_stored = false;
        {
            let mut attempts: Vec<&AttemptRecord> = Vec::with_capacity(batch.attempts.len());
            for (claim, a) in &batch.attempts {
                if held(*claim, a.seq) {
                    attempts.push(a);
                } else {
                    refused.insert(a.seq);
                }
            }
            store_rows(&tx, rid, &attempts, &ATTEMPTS)?;
            // A call is keyed by its item, attempt and place: the same call
            // sent again (a batch retried after its commit failed) replaces
            // itself rather than failing the batch, and a later version of
            // a call carries no less than an earlier one. A new run of the
            // agent takes a new attempt number (see `scan`), so no call of
            // one attempt can replace another's.
            let mut call = tx
                .prepare_cached(
                    "INSERT OR REPLACE INTO agent_calls (rid, seq, attempt, idx, call_id, api, asked_model,
                         sent_at, endpoint, model, latency_ms, ttft_ms, tpot_ms, prompt_tokens,
                         completion_tokens, tokens_estimated, finish_reason, stream, cached, http_status,
                         error_class, error, request, request_cut, response, tags, failovers,
                         request_z, response_z)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17,
                             ?18, ?19, ?20, ?21, ?22, ?23, ?24, ?25, ?26, ?27, ?28, ?29)",
                )
                .map_err(db_err("cannot prepare the agent call insert"))?;
            for (claim, c) in &batch.calls {
                if !held(*claim, c.seq) {
                    refused.insert(c.seq);
                    continue;
                }
                let t = &c.telemetry;
                let (request, request_z) = crate::columns::pack(&c.request);
                let (response, response_z) = match c.response.as_deref() {
                    Some(text) => crate::columns::pack(text),
                    None => (None, None),
                };
                call.execute(params![
                    rid,
                    c.seq as i64,
                    c.attempt,
                    c.index,
                    c.call_id,
                    c.api,
                    c.asked_model,
                    c.sent_at_ms,
                    t.endpoint,
                    t.model,
                    t.latency_ms,
                    t.ttft_ms,
                    t.tpot_ms,
                    opt_u64(t.prompt_tokens),
                    opt_u64(t.completion_tokens),
                    t.tokens_estimated,
                    t.finish_reason,
                    c.stream,
                    c.cached,
                    c.http_status,
                    c.error_class.map(ErrorClass::as_str),
                    c.error,
                    request.unwrap_or(""),
                    c.request_cut,
                    response,
                    c.tags,
                    crate::failovers_column(&c.failovers),
                    request_z,
                    response_z,
                ])
                .map_err(db_err("cannot record an agent call"))?;
                calls_stored = true;
            }
            if !batch.cache.is_empty() {
                let mut put = tx
                    .prepare_cached(&format!(
                        "INSERT OR REPLACE INTO {db}.cache (key, content, endpoint, model, prompt_tokens,
                             completion_tokens, finish_reason, latency_ms, created_at)
                         VALUES (unhex(?1), ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
                        db = cache_db
                    ))
                    .map_err(db_err("cannot prepare the cache insert"))?;
                for c in &batch.cache {
                    put.execute(params![
                        c.key,
                        c.content,
                        c.endpoint,
                        c.model,
                        opt_u64(c.prompt_tokens),
                        opt_u64(c.completion_tokens),
                        c.finish_reason,
                        c.latency_ms,
                        c.created_at_ms,
                    ])
                    .map_err(db_err("cannot store a cached answer"))?;
                }
            }
            // Results: each item ends (pending to its status) and its
            // result is stored, many rows a statement (see `in_chunks`).
            let mut ending: Vec<&ResultRecord> = Vec::with_capacity(batch.results.len());
            for (claim, r) in &batch.results {
                if !held(*claim, r.seq) {
                    refused.insert(r.seq);
                    continue;
                }
                match r.status {
                    ItemStatus::Done => done += 1,
                    ItemStatus::Failed => failed += 1,
                }
                touched.insert(*claim);
                ending.push(r);
            }
            end_items(&tx, rid, run_id, &ending)?;
            store_rows(&tx, rid, &ending, &RESULTS)?;
            // Waits are stored with their items (an item that ended in the
            // same batch has no more use for one).
            let mut wait = tx
                .prepare_cached(
                    "UPDATE items SET not_before = ?3 WHERE rid = ?1 AND seq = ?2 AND state = 'pending'",
                )
                .map_err(db_err("cannot prepare the wait update"))?;
            let now = now_ms();
            for (claim, w) in &batch.waits {
                if !held(*claim, w.seq) {
                    refused.insert(w.seq);
                    continue;
                }
                let until =
                    now.saturating_add(i64::try_from(w.wait.as_millis()).unwrap_or(i64::MAX));
                wait.execute(params![rid, w.seq as i64, until])
                    .map_err(db_err("cannot store an item's wait"))?;
            }
            // A claim whose items have all ended is of no more use.
            let mut open = tx
                .prepare_cached(
                    "SELECT EXISTS (SELECT 1 FROM items
                         WHERE rid = ?1 AND state = 'pending' AND seq BETWEEN ?2 AND ?3)",
                )
                .map_err(db_err("cannot check a claim"))?;
            let mut drop_claim = tx
                .prepare_cached("DELETE FROM claims WHERE claim_id = ?1")
                .map_err(db_err("cannot drop a claim"))?;
            for claim in touched {
                let Some((first, last)) = mine.get(&claim) else {
                    continue;
                };
                let pending: bool = open
                    .query_row(params![rid, *first as i64, *last as i64], |row| row.get(0))
                    .map_err(db_err("cannot check a claim"))?;
                if !pending {
                    drop_claim
                        .execute([claim])
                        .map_err(db_err("cannot drop a claim"))?;
                }
            }
        }
        if done + failed > 0 || calls_stored {
            // Calls change what a report says of the run (its agents'
            // figures) even before their item's result comes.
            execute_cached(
                &tx,
                "UPDATE runs SET updated_at = ?2, done = done + ?3, failed = failed + ?4,
                     generation = generation + 1
                 WHERE rid = ?1",
                params![rid, now_ms(), done, failed],
            )
            .map_err(db_err("cannot update the run"))?;
        }
        if done + failed > 0 {
            execute_cached(
                &tx,
                "INSERT INTO worker_tallies (rid, worker, done, failed) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (rid, worker) DO UPDATE SET done = done + excluded.done,
                     failed = failed + excluded.failed",
                params![rid, worker, done, failed],
            )
            .map_err(db_err("cannot count the worker's results"))?;
        }
        tx.commit().map_err(db_err("cannot commit a batch"))?;
        Ok(Committed {
            results: (done + failed) as u64,
            refused: refused.into_iter().collect(),
        })
    }
}

/// Rows a multi-row statement of a commit takes at most. A statement's own
/// cost (its start, its end, the release of its registers) is paid once
/// for these rows instead of once a row: in a run answered from the cache
/// the end of each statement alone was an eighth of the commit's samples.
const ROWS_AT_ONCE: usize = 32;

/// Statement sizes, largest first: a batch's rows go in statements of
/// [`ROWS_AT_ONCE`] rows, then of 8, then one by one, so that at most 10
/// statements take the rest, from a few prepared statements.
const SIZES: [usize; 3] = [ROWS_AT_ONCE, 8, 1];

/// Runs `run` over `rows` in slices of the [`SIZES`], largest first.
fn in_chunks<T>(
    rows: &[T],
    mut run: impl FnMut(&[T]) -> Result<(), StoreError>,
) -> Result<(), StoreError> {
    let mut rest = rows;
    for size in SIZES {
        while rest.len() >= size {
            let (chunk, tail) = rest.split_at(size);
            run(chunk)?;
            rest = tail;
        }
    }
    Ok(())
}

/// A statement made once for each size of [`SIZES`].
struct BySize(OnceLock<[String; 3]>);

impl BySize {
    const fn new() -> Self {
        Self(OnceLock::new())
    }

    /// The statement for `rows` rows (a size [`in_chunks`] gives; any other
    /// gets the one-row statement, whose binding past its parameters
    /// fails), made by `make` for every size the first time.
    fn get(&self, rows: usize, make: impl FnMut(usize) -> String) -> &str {
        let all = self.0.get_or_init(|| SIZES.map(make));
        let at = SIZES
            .iter()
            .position(|&size| size == rows)
            .unwrap_or(SIZES.len() - 1);
        &all[at]
    }
}

/// The state update of `rows` items (`?1` the run, `?2` the state, then
/// each item's seq): only pending items end.
fn end_sql(rows: usize) -> String {
    let seqs: Vec<String> = (0..rows).map(|i| format!("?{}", i + 3)).collect();
    format!(
        "UPDATE items SET state = ?2 WHERE rid = ?1 AND state = 'pending' AND seq IN ({})",
        seqs.join(", ")
    )
}

/// A table a commit inserts many rows into at once: its statement's
/// head, its columns after `rid`, and how a row's values are bound.
struct Rows<T> {
    insert: &'static str,
    columns: usize,
    bind: fn(&mut rusqlite::Statement<'_>, usize, &T) -> Result<(), StoreError>,
    what: &'static str,
    sql: BySize,
}

impl<T> Rows<T> {
    /// The insert of `rows` rows: `?1` the run, then `columns` parameters
    /// a row.
    fn sql(&self, rows: usize) -> &str {
        self.sql.get(rows, |rows| {
            let values: Vec<String> = (0..rows)
                .map(|row| {
                    let first = 2 + row * self.columns;
                    let params: Vec<String> = (first..first + self.columns)
                        .map(|i| format!("?{i}"))
                        .collect();
                    format!("(?1, {})", params.join(", "))
                })
                .collect();
            format!("{} VALUES {}", self.insert, values.join(", "))
        })
    }
}

/// Columns after `rid`, bound by [`bind_result`] and [`bind_attempt`].
const RESULT_COLUMNS: usize = 26;
const ATTEMPT_COLUMNS: usize = 16;

static RESULTS: Rows<ResultRecord> = Rows {
    insert: "INSERT INTO results (rid, seq, item_id, status, output, error, endpoint, model, attempts,
                 latency_ms, ttft_ms, tpot_ms, prompt_tokens, completion_tokens, finish_reason, item,
                 finished_at, parsed, verdict, check_error, scores, reasks, judge, cached,
                 tokens_estimated, prompt, images)",
    columns: RESULT_COLUMNS,
    bind: bind_result,
    what: "cannot record a result",
    sql: BySize::new(),
};

static ATTEMPTS: Rows<AttemptRecord> = Rows {
    insert:
        "INSERT INTO attempts (rid, seq, attempt, session, endpoint, model, sent_at, latency_ms,
                 ttft_ms, tpot_ms, prompt_tokens, completion_tokens, finish_reason, http_status,
                 error_class, error, tokens_estimated)",
    columns: ATTEMPT_COLUMNS,
    bind: bind_attempt,
    what: "cannot record an attempt",
    sql: BySize::new(),
};

/// Inserts `rows` into `table`, [`ROWS_AT_ONCE`] rows a statement.
fn store_rows<T>(
    tx: &Transaction<'_>,
    rid: i64,
    rows: &[&T],
    table: &Rows<T>,
) -> Result<(), StoreError> {
    in_chunks(rows, |chunk| {
        let mut stmt = tx
            .prepare_cached(table.sql(chunk.len()))
            .map_err(db_err(table.what))?;
        stmt.raw_bind_parameter(1, rid)
            .map_err(db_err(table.what))?;
        debug_assert_eq!(stmt.parameter_count(), 1 + chunk.len() * table.columns);
        for (row, value) in chunk.iter().enumerate() {
            (table.bind)(&mut stmt, 2 + row * table.columns, value)?;
        }
        stmt.raw_execute().map_err(db_err(table.what))?;
        Ok(())
    })
}

/// Binds `values` from parameter `first` on.
fn bind_all(
    stmt: &mut rusqlite::Statement<'_>,
    first: usize,
    values: &[&dyn rusqlite::ToSql],
    what: &'static str,
) -> Result<(), StoreError> {
    for (i, value) in values.iter().enumerate() {
        stmt.raw_bind_parameter(first + i, value)
            .map_err(db_err(what))?;
    }
    Ok(())
}

/// Binds a result's [`RESULT_COLUMNS`] columns after `rid` from parameter
/// `first` on.
fn bind_result(
    stmt: &mut rusqlite::Statement<'_>,
    first: usize,
    r: &ResultRecord,
) -> Result<(), StoreError> {
    let (parsed, verdict, check_error, scores, reasks, judge) = assessment_columns(&r.assessment)?;
    let images = images_column(&r.images)?;
    let t = r.telemetry.as_ref();
    let values: [&dyn rusqlite::ToSql; RESULT_COLUMNS] = [
        &(r.seq as i64),
        &r.item_id,
        &r.status.as_str(),
        &r.output,
        &r.error,
        &t.map(|t| &t.endpoint),
        &t.map(|t| &t.model),
        &r.attempts,
        &t.map(|t| t.latency_ms),
        &t.and_then(|t| t.ttft_ms),
        &t.and_then(|t| t.tpot_ms),
        &opt_u64(t.and_then(|t| t.prompt_tokens)),
        &opt_u64(t.and_then(|t| t.completion_tokens)),
        &t.and_then(|t| t.finish_reason.as_ref()),
        &r.item,
        &r.finished_at_ms,
        &parsed,
        &verdict,
        &check_error,
        &scores,
        &reasks,
        &judge,
        &r.cached,
        &t.is_some_and(|t| t.tokens_estimated),
        &r.prompt,
        &images,
    ];
    bind_all(stmt, first, &values, RESULTS.what)
}

/// Binds an attempt's [`ATTEMPT_COLUMNS`] columns after `rid` from
/// parameter `first` on.
fn bind_attempt(
    stmt: &mut rusqlite::Statement<'_>,
    first: usize,
    a: &AttemptRecord,
) -> Result<(), StoreError> {
    let t = &a.telemetry;
    let values: [&dyn rusqlite::ToSql; ATTEMPT_COLUMNS] = [
        &(a.seq as i64),
        &a.attempt,
        &a.session,
        &t.endpoint,
        &t.model,
        &a.sent_at_ms,
        &t.latency_ms,
        &t.ttft_ms,
        &t.tpot_ms,
        &opt_u64(t.prompt_tokens),
        &opt_u64(t.completion_tokens),
        &t.finish_reason,
        &a.http_status,
        &a.error_class.map(ErrorClass::as_str),
        &a.error,
        &t.tokens_estimated,
    ];
    bind_all(stmt, first, &values, ATTEMPTS.what)
}

/// Ends the items of `ending` (their state from pending to their status),
/// a statement per slice of items of one status. An item that is not
/// pending (ended before, or twice in this batch) breaks an invariant:
/// the error names it and the transaction is dropped.
fn end_items(
    tx: &Transaction<'_>,
    rid: i64,
    run_id: &str,
    ending: &[&ResultRecord],
) -> Result<(), StoreError> {
    static SQL: BySize = BySize::new();
    // The items by the status they end in, in the batch's order.
    let mut by_status: Vec<(ItemStatus, Vec<&ResultRecord>)> = Vec::new();
    for &r in ending {
        match by_status.iter_mut().find(|(status, _)| *status == r.status) {
            Some((_, rows)) => rows.push(r),
            None => by_status.push((r.status, vec![r])),
        }
    }
    for (group, (status, rows)) in by_status.iter().enumerate() {
        // Items of this status ended by the statements before.
        let mut ended = 0;
        in_chunks(rows, |chunk| {
            let mut stmt = tx
                .prepare_cached(SQL.get(chunk.len(), end_sql))
                .map_err(db_err("cannot prepare the state update"))?;
            stmt.raw_bind_parameter(1, rid)
                .and_then(|()| stmt.raw_bind_parameter(2, status.as_str()))
                .map_err(db_err("cannot update an item's state"))?;
            for (i, r) in chunk.iter().enumerate() {
                stmt.raw_bind_parameter(i + 3, r.seq as i64)
                    .map_err(db_err("cannot update an item's state"))?;
            }
            let changed = stmt
                .raw_execute()
                .map_err(db_err("cannot update an item's state"))?;
            if changed == chunk.len() {
                ended += chunk.len();
                return Ok(());
            }
            let before = by_status[..group]
                .iter()
                .flat_map(|(_, rows)| rows.iter())
                .chain(&rows[..ended]);
            Err(StoreError::Invariant(format!(
                "item '{}' of run '{run_id}' got a second result",
                second_result(tx, rid, before, chunk)
            )))
        })?;
    }
    Ok(())
}

/// Which item of `chunk` (a slice whose state update changed fewer rows
/// than it has) was not pending, the first in the order they were ended:
/// one ended by an update `before` it or earlier in the slice, one with a
/// result stored before the batch, or one that is not an item of the run.
fn second_result<'a>(
    tx: &Transaction<'_>,
    rid: i64,
    before: impl Iterator<Item = &'a &'a ResultRecord>,
    chunk: &[&ResultRecord],
) -> String {
    let mut seen: std::collections::HashSet<u64> = before.map(|r| r.seq).collect();
    let exists = |sql: &str, seq: u64| {
        tx.query_row(sql, params![rid, seq as i64], |_| Ok(()))
            .is_ok()
    };
    chunk
        .iter()
        .find(|r| {
            !seen.insert(r.seq)
                || exists("SELECT 1 FROM results WHERE rid = ?1 AND seq = ?2", r.seq)
                || !exists("SELECT 1 FROM items WHERE rid = ?1 AND seq = ?2", r.seq)
        })
        .map_or_else(|| "?".to_owned(), |r| r.item_id.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn covering_finds_the_range_of_a_seq() {
        let ranges = [
            Range {
                first: 1,
                last: 5,
                mine: true,
            },
            Range {
                first: 9,
                last: 9,
                mine: false,
            },
        ];
        assert_eq!(covering(&ranges, 0).map(|r| r.first), None);
        assert_eq!(covering(&ranges, 1).map(|r| r.first), Some(1));
        assert_eq!(covering(&ranges, 5).map(|r| r.first), Some(1));
        assert_eq!(covering(&ranges, 6).map(|r| r.first), None);
        assert_eq!(covering(&ranges, 9).map(|r| r.mine), Some(false));
        assert_eq!(covering(&ranges, 10).map(|r| r.first), None);
    }
}
