//! The work queue of many workers: items claimed one row each with
//! `FOR UPDATE SKIP LOCKED`, leases on the database's clock, and commits
//! fenced by the claim.
//!
//! - A claim takes up to `limit` pending items whose wait has passed, in
//!   `seq` order, skipping rows another worker's transaction has locked
//!   (it is claiming or committing them): workers claiming at once never
//!   wait for each other and never take the same item. The rows are picked
//!   in a materialized CTE, so the update touches no more rows than the
//!   limit, and updated by their keys. Each claimed
//!   item's `attempt` is raised and its `claim_id` set to the claim's,
//!   from a sequence: the pair is the fencing token of that claim.
//! - Leases run on `now()` of the database, never a worker's clock. Any
//!   worker's claim returns to pending the items whose lease has passed
//!   (no leader reaps them), and takes them before the items after its
//!   cursor: before it takes, where its connection has not looked for
//!   them in the run for [`REAP_EVERY`] (an eighth of the lease where that
//!   is shorter), and after it found nothing else to take. The search
//!   walks every running item and every index entry that ever was one,
//!   until a vacuum clears them: run at each claim, it took a third of the
//!   database's time in a run of 100,000 items.
//! - One statement per heartbeat renews all of a worker's leases and tells
//!   it which items it lost since it last asked (the reaper notes whose
//!   lease it took back, in `lost_by`).
//! - A commit locks the rows of its batch's items, keeps only what was
//!   made under a claim that still holds its item (`state = 'running'`
//!   and the same `claim_id`), and in the same transaction moves those
//!   items to done or failed and stores their results: a worker whose
//!   lease was taken over (it was paused, cut off, or its clock is wrong)
//!   commits nothing, and `results`' key allows one result per item.
//!   Running a commit twice (its connection was lost after `COMMIT` was
//!   sent) stores it once: what the first run ended is recognized by its
//!   claim and counted as committed, not refused. A claim run twice hands
//!   out what its first run took, found by its id (taken before its
//!   transaction): no item is left held by a claim its worker never saw.
//!
//! No transaction is held across a model call or a sandbox run: a claim
//! and a commit are each one short transaction.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use crate::{
    Batch, Claim, ClaimId, Claimed, Committed, PendingItem, Renewal, StoreError, WorkQueue,
};
use evalfleet_types::{AttemptRecord, ErrorClass, ItemStatus, ResultRecord, now_ms};
use postgres::Transaction;

use super::{Conn, PgStore, Tx, opt_u64};
use crate::columns::{AssessmentColumns, assessment_columns, images_column};

/// Leases and waits are passed as milliseconds.
fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// Items whose lease passed, returned to pending, at most this many a
/// claim (the rest at the next).
const REAP_LIMIT: i64 = 10_000;

/// How long a connection's claims in a run go before they look for lapsed
/// leases again before taking (an eighth of the lease where that is
/// shorter; a claim that finds nothing else looks at once): what a lapsed
/// item may wait beyond its lease while a worker claims, at most.
pub const REAP_EVERY: Duration = Duration::from_secs(1);

/// Whether a claim on `conn` in run `rid` under `lease` reaps before it
/// takes.
fn reap_due(conn: &Conn, rid: i64, lease: Duration) -> bool {
    conn.reaped_at
        .get(&rid)
        .is_none_or(|at| at.elapsed() >= REAP_EVERY.min(lease / 8))
}

/// Returns to pending the run's items whose lease has passed. Rows locked
/// by another transaction (a commit under way) are left for later.
/// Puts back the items whose lease ran out; the first of them, if any.
const REAP: &str = "WITH lapsed AS MATERIALIZED (
             SELECT seq FROM items
             WHERE rid = $1 AND state = 'running' AND lease_until < now()
             LIMIT $2 FOR UPDATE SKIP LOCKED),
         put_back AS (
             UPDATE items i SET state = 'pending', lost_by = i.owner, owner = NULL,
                 lease_until = NULL
             WHERE i.rid = $1 AND i.seq = ANY(ARRAY(SELECT seq FROM lapsed))
             RETURNING i.seq)
         SELECT MIN(seq) FROM put_back";

fn reap(
    tx: &mut Transaction<'_>,
    statements: &Statements,
    rid: i64,
) -> Result<Option<i64>, postgres::Error> {
    let row = tx.query_one(&statements.reap, &[&rid, &REAP_LIMIT])?;
    row.try_get(0)
}

/// The claim's statements, prepared once per connection.
struct Statements {
    reap: postgres::Statement,
    take: postgres::Statement,
    held: postgres::Statement,
    others: postgres::Statement,
}

impl Statements {
    fn of(conn: &mut Conn) -> Result<Self, postgres::Error> {
        Ok(Self {
            reap: conn.statement(REAP)?,
            take: conn.statement(TAKE.as_str())?,
            held: conn.statement(HELD.as_str())?,
            others: conn.statement(OTHERS)?,
        })
    }
}

/// Claims: up to `$3` pending items after `$2`, in `seq` order.
static TAKE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "WITH picked AS MATERIALIZED (
             SELECT seq FROM items
             WHERE rid = $1 AND state = 'pending' AND seq > $2
               AND (not_before IS NULL OR not_before <= now())
             ORDER BY seq LIMIT $3
             FOR UPDATE SKIP LOCKED),
         claimed AS (
             UPDATE items i SET state = 'running', attempt = i.attempt + 1, claim_id = $4,
                 owner = $5, lease_until = now() + $6::bigint * interval '1 millisecond',
                 not_before = NULL,
                 -- A worker that takes back an item it lost is not told
                 -- it lost it (it would let go of its new claim's item).
                 lost_by = NULLIF(i.lost_by, $5)
             WHERE i.rid = $1 AND i.seq = ANY(ARRAY(SELECT seq FROM picked))
             RETURNING i.seq)
         {PENDING_ITEMS}"
    )
});

/// The items a claim holds.
static HELD: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "WITH claimed AS (
             SELECT seq FROM items
             WHERE rid = $1 AND claim_id = $2 AND owner = $3 AND state = 'running')
         {PENDING_ITEMS}"
    )
});

/// Whether others hold what is left (or it is pending), or this worker's
/// lease on some of it ran out: such items are another worker's to take
/// once the reap that holds them now commits (the reap and the take skip
/// rows another transaction has locked, and this worker, its own items let
/// go, would otherwise take "nothing left but mine" for the run's end).
const OTHERS: &str = "SELECT EXISTS (SELECT 1 FROM items WHERE rid = $1 AND state = 'pending')
         OR EXISTS (SELECT 1 FROM items WHERE rid = $1 AND state = 'running'
                    AND (owner <> $2 OR lease_until < now()))";

/// Claims up to `limit` items after `after` for `worker` under claim
/// `claim`, in `seq` order.
#[allow(clippy::too_many_arguments)]
fn take(
    tx: &mut Transaction<'_>,
    statements: &Statements,
    rid: i64,
    claim: i64,
    worker: &str,
    after: i64,
    limit: i64,
    lease_ms: i64,
) -> Result<Vec<PendingItem>, postgres::Error> {
    let rows = tx.query(
        &statements.take,
        &[&rid, &after, &limit, &claim, &worker, &lease_ms],
    )?;
    Ok(pending_items(&rows))
}

/// What a claim hands out of the items in `claimed` (a table of their
/// `seq`s) of run `$1`, in `seq` order: the columns [`pending_items`]
/// reads. An item's prior attempts are the highest attempt number stored
/// for it, of an attempt row or of its agent's calls.
///
/// The rows of a claim's items are looked up by their keys (`= ANY` of
/// an array), here and in the claim's update, not joined to the claimed
/// set: with the tables' statistics, the planner, pricing each lookup of
/// a key as a read from disk, hashed every row of a run of 10,000 items
/// to join a claim's 128 (3.5 ms a claim, against 1.2 ms); it cannot see
/// how many keys an array built in the statement holds, and looks them
/// up.
const PENDING_ITEMS: &str = "SELECT r.item_id, r.seq, r.line, r.\"offset\",
        GREATEST((SELECT COALESCE(MAX(a.attempt), 0) FROM attempts a
                  WHERE a.rid = $1 AND a.seq = r.seq),
                 (SELECT COALESCE(MAX(k.attempt), 0) FROM agent_calls k
                  WHERE k.rid = $1 AND k.seq = r.seq))
    FROM item_rows r WHERE r.rid = $1 AND r.seq = ANY(ARRAY(SELECT seq FROM claimed))
    ORDER BY r.seq";

/// Rows of [`PENDING_ITEMS`].
fn pending_items(rows: &[postgres::Row]) -> Vec<PendingItem> {
    rows.iter()
        .map(|row| PendingItem {
            item_id: row.get(0),
            seq: row.get::<_, i64>(1) as u64,
            line: row.get::<_, i64>(2) as u64,
            offset: row.get::<_, i64>(3) as u64,
            prior_attempts: row.get::<_, i32>(4).max(0) as u32,
        })
        .collect()
}

/// The items claim `claim` of `worker` holds: what a claim whose
/// `COMMIT` got through before its connection was lost took.
fn held(
    tx: &mut Transaction<'_>,
    statements: &Statements,
    rid: i64,
    claim: i64,
    worker: &str,
) -> Result<Vec<PendingItem>, postgres::Error> {
    let rows = tx.query(&statements.held, &[&rid, &claim, &worker])?;
    Ok(pending_items(&rows))
}

/// Claims items under claim `id`, its id taken from the sequence the first
/// time (and kept in `id`). The id is taken before the transaction, so
/// that a claim run again after its connection was lost knows it: if the
/// first run's `COMMIT` got through, its items are handed out again rather
/// than left held by a claim that no one knows of (renewed with the
/// worker's other leases until it stops, and answered by no one).
fn claim_once(
    conn: &mut Conn,
    run_id: &str,
    worker: &str,
    after: Option<u64>,
    limit: usize,
    lease: Duration,
    id: &mut Option<ClaimId>,
) -> Tx<Claimed> {
    let rid = conn.rid(run_id)?;
    let statements = Statements::of(conn)?;
    let (claim, again) = match *id {
        Some(claim) => (claim, true),
        None => {
            let next = conn.statement("SELECT nextval('claim_ids')")?;
            let claim: i64 = conn.client.query_one(&next, &[])?.get(0);
            *id = Some(claim);
            (claim, false)
        }
    };
    let reaped = reap_due(conn, rid, lease);
    // When this claim looked for lapsed items, noted once it commits.
    let mut looked = None;
    let mut tx = conn.client.transaction()?;
    if again {
        let items = held(&mut tx, &statements, rid, claim, worker)?;
        if !items.is_empty() {
            tx.commit()?;
            return Ok(Claimed::Items(Claim { id: claim, items }));
        }
    }
    let lapsed = if reaped {
        looked = Some(std::time::Instant::now());
        reap(&mut tx, &statements, rid)?
    } else {
        None
    };
    let limit = i64::try_from(limit.max(1)).unwrap_or(i64::MAX);
    let lease_ms = millis(lease);
    // Items whose lease ran out (their worker died or stalled) are taken
    // next, before the items after `after`, not at the end of the run.
    let from = |lapsed: Option<i64>| match (lapsed, after) {
        (Some(first), Some(cursor)) if first <= cursor as i64 => first - 1,
        _ => after.map_or(-1, |seq| seq as i64),
    };
    let take_from = |tx: &mut Transaction<'_>, from: i64| {
        take(tx, &statements, rid, claim, worker, from, limit, lease_ms)
    };
    let mut items = take_from(&mut tx, from(lapsed))?;
    if items.is_empty() && !reaped {
        // Nothing else to take: lapsed items are looked for now, not at
        // the next reap.
        looked = Some(std::time::Instant::now());
        let lapsed = reap(&mut tx, &statements, rid)?;
        if lapsed.is_some() {
            items = take_from(&mut tx, from(lapsed))?;
        }
    }
    if items.is_empty() && after.is_some() {
        // Past the end: items before `after` may be free again (a lease
        // ran out, a worker stopped, failed items were put back).
        items = take_from(&mut tx, -1)?;
    }
    let claimed = if !items.is_empty() {
        Claimed::Items(Claim { id: claim, items })
    } else if tx
        .query_one(&statements.others, &[&rid, &worker])?
        .get::<_, bool>(0)
    {
        // Nothing to take: others hold what is left (or are claiming it
        // right now, or it waits out a wait)...
        Claimed::HeldByOthers
    } else {
        // ...or nothing is left but this worker's.
        Claimed::Nothing
    };
    tx.commit()?;
    if let Some(at) = looked {
        conn.reaped_at.insert(rid, at);
    }
    Ok(claimed)
}

/// What a commit found of the items of its batch.
struct Holds {
    /// Items still held by the claim their entries were made under.
    held: HashMap<u64, ClaimId>,
    /// Items that claim already ended: a run of this same commit whose
    /// `COMMIT` got through before the connection was lost.
    ended: HashMap<u64, ClaimId>,
}

impl Holds {
    fn holds(&self, claim: ClaimId, seq: u64) -> bool {
        self.held.get(&seq) == Some(&claim)
    }

    fn ended(&self, claim: ClaimId, seq: u64) -> bool {
        self.ended.get(&seq) == Some(&claim)
    }
}

/// The rows of a batch's items, locked in `seq` order, and who holds them
/// (none: a pending item never claimed). No other condition: statistics
/// taken when the run was registered say that no item has a claim, and
/// with `claim_id IS NOT NULL` here the planner expected one row of a
/// commit's hundreds.
const LOCK: &str = "SELECT seq, state, claim_id FROM items
     WHERE rid = $1 AND seq = ANY($2)
     ORDER BY seq FOR UPDATE";

/// A worker's tally of the items it ended.
const TALLY: &str = "INSERT INTO tallies (rid, worker, done, failed, generation, updated_at)
     VALUES ($1, $2, $3, $4, 1, $5)
     ON CONFLICT (rid, worker) DO UPDATE SET done = tallies.done + EXCLUDED.done,
         failed = tallies.failed + EXCLUDED.failed, generation = tallies.generation + 1,
         updated_at = GREATEST(tallies.updated_at, EXCLUDED.updated_at)";

/// Locks the rows of the batch's items (in `seq` order, as every commit
/// does) and reads who holds them.
fn lock(
    tx: &mut Transaction<'_>,
    statement: &postgres::Statement,
    rid: i64,
    batch: &Batch,
) -> Result<Holds, postgres::Error> {
    let seqs: BTreeSet<i64> = batch
        .attempts
        .iter()
        .map(|(_, a)| a.seq)
        .chain(batch.results.iter().map(|(_, r)| r.seq))
        .chain(batch.calls.iter().map(|(_, c)| c.seq))
        .chain(batch.waits.iter().map(|(_, w)| w.seq))
        .map(|seq| seq as i64)
        .collect();
    let seqs: Vec<i64> = seqs.into_iter().collect();
    let mut holds = Holds {
        held: HashMap::new(),
        ended: HashMap::new(),
    };
    if seqs.is_empty() {
        return Ok(holds);
    }
    let rows = tx.query(statement, &[&rid, &seqs])?;
    for row in rows {
        let seq = row.get::<_, i64>(0) as u64;
        let state: &str = row.get(1);
        let Some(claim) = row.get::<_, Option<i64>>(2) else {
            continue;
        };
        match state {
            "running" => holds.held.insert(seq, claim),
            "done" | "failed" => holds.ended.insert(seq, claim),
            _ => None,
        };
    }
    Ok(holds)
}

/// The batch's attempts, from arrays of their columns.
const INSERT_ATTEMPTS: &str =
    "INSERT INTO attempts (rid, seq, attempt, session, endpoint, model, sent_at,
         latency_ms, ttft_ms, tpot_ms, prompt_tokens, completion_tokens, finish_reason,
         http_status, error_class, error, tokens_estimated, worker)
     SELECT $1, u.*, $2 FROM UNNEST($3::bigint[], $4::int[], $5::int[], $6::text[], $7::text[],
         $8::bigint[], $9::float8[], $10::float8[], $11::float8[], $12::bigint[], $13::bigint[],
         $14::text[], $15::int[], $16::text[], $17::text[], $18::bool[]) AS u
     ON CONFLICT (rid, seq, attempt) DO NOTHING";

/// The batch's results: each item still running under its claim ends, and
/// its result is stored with the claim's attempt number; the seqs stored
/// come back.
const INSERT_RESULTS: &str = "WITH u AS (
         SELECT * FROM UNNEST($3::bigint[], $4::bigint[], $5::text[], $6::text[], $7::text[],
             $8::text[], $9::text[], $10::text[], $11::int[], $12::float8[], $13::float8[],
             $14::float8[], $15::bigint[], $16::bigint[], $17::text[], $18::text[], $19::bigint[],
             $20::text[], $21::text[], $22::text[], $23::text[], $24::int[], $25::text[],
             $26::int[], $27::bool[], $28::text[], $29::text[])
             AS u(seq, claim, item_id, status, output, error, endpoint, model, attempts,
                  latency_ms, ttft_ms, tpot_ms, prompt_tokens, completion_tokens, finish_reason,
                  item, finished_at, parsed, verdict, check_error, scores, reasks, judge, cached,
                  tokens_estimated, prompt, images)),
     ended AS (
         UPDATE items i SET state = u.status, owner = NULL, lease_until = NULL, not_before = NULL
         FROM u
         WHERE i.rid = $1 AND i.seq = ANY($3) AND i.seq = u.seq AND i.claim_id = u.claim
           AND i.state = 'running'
         RETURNING i.seq, i.attempt)
     INSERT INTO results (rid, seq, item_id, status, output, error, endpoint, model, attempts,
         latency_ms, ttft_ms, tpot_ms, prompt_tokens, completion_tokens, finish_reason, item,
         finished_at, parsed, verdict, check_error, scores, reasks, judge, cached,
         tokens_estimated, prompt, images, claim_attempt, worker)
     SELECT $1, u.seq, u.item_id, u.status, u.output, u.error, u.endpoint, u.model, u.attempts,
         u.latency_ms, u.ttft_ms, u.tpot_ms, u.prompt_tokens, u.completion_tokens,
         u.finish_reason, u.item, u.finished_at, u.parsed, u.verdict, u.check_error, u.scores,
         u.reasks, u.judge, u.cached, u.tokens_estimated, u.prompt, u.images, ended.attempt, $2
     FROM u JOIN ended ON ended.seq = u.seq
     RETURNING seq";

/// Waits of items that go on under their claim.
const SET_WAITS: &str = "UPDATE items i SET not_before = now() + u.wait * interval '1 millisecond'
     FROM UNNEST($2::bigint[], $3::bigint[], $4::bigint[]) AS u(seq, claim, wait)
     WHERE i.rid = $1 AND i.seq = ANY($2) AND i.seq = u.seq AND i.claim_id = u.claim
       AND i.state = 'running'";

/// A call of an agent, keyed by its item, attempt and place: sent again, it
/// replaces itself (see the SQLite store).
const INSERT_CALL: &str =
    "INSERT INTO agent_calls (rid, seq, attempt, idx, call_id, api, asked_model, sent_at,
             endpoint, model, latency_ms, ttft_ms, tpot_ms, prompt_tokens, completion_tokens,
             tokens_estimated, finish_reason, stream, cached, http_status, error_class, error,
             request, request_cut, response, tags, failovers, request_z, response_z)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17,
                 $18, $19, $20, $21, $22, $23, $24, $25, $26, $27, $28, $29)
         ON CONFLICT (rid, seq, attempt, idx) DO UPDATE SET
             call_id = EXCLUDED.call_id, api = EXCLUDED.api, asked_model = EXCLUDED.asked_model,
             sent_at = EXCLUDED.sent_at, endpoint = EXCLUDED.endpoint, model = EXCLUDED.model,
             latency_ms = EXCLUDED.latency_ms, ttft_ms = EXCLUDED.ttft_ms,
             tpot_ms = EXCLUDED.tpot_ms, prompt_tokens = EXCLUDED.prompt_tokens,
             completion_tokens = EXCLUDED.completion_tokens,
             tokens_estimated = EXCLUDED.tokens_estimated,
             finish_reason = EXCLUDED.finish_reason, stream = EXCLUDED.stream,
             cached = EXCLUDED.cached, http_status = EXCLUDED.http_status,
             error_class = EXCLUDED.error_class, error = EXCLUDED.error,
             request = EXCLUDED.request, request_cut = EXCLUDED.request_cut,
             response = EXCLUDED.response, tags = EXCLUDED.tags,
             failovers = EXCLUDED.failovers, request_z = EXCLUDED.request_z,
             response_z = EXCLUDED.response_z";

/// A response kept in the cache (the last one for a key wins).
const PUT_CACHE: &str =
    "INSERT INTO cache (key, content, endpoint, model, prompt_tokens, completion_tokens,
                 finish_reason, latency_ms, created_at)
             VALUES (decode($1, 'hex'), $2, $3, $4, $5, $6, $7, $8, $9)
             ON CONFLICT (key) DO UPDATE SET content = EXCLUDED.content,
                 endpoint = EXCLUDED.endpoint, model = EXCLUDED.model,
                 prompt_tokens = EXCLUDED.prompt_tokens,
                 completion_tokens = EXCLUDED.completion_tokens,
                 finish_reason = EXCLUDED.finish_reason, latency_ms = EXCLUDED.latency_ms,
                 created_at = EXCLUDED.created_at";

fn commit_once(conn: &mut Conn, run_id: &str, worker: &str, batch: &Batch) -> Tx<Committed> {
    let rid = conn.rid(run_id)?;
    let attempts = conn.statement(INSERT_ATTEMPTS)?;
    let results = conn.statement(INSERT_RESULTS)?;
    let wait = conn.statement(SET_WAITS)?;
    let locking = conn.statement(LOCK)?;
    let tally = conn.statement(TALLY)?;
    // Prepared once per connection, and only when a batch has such rows.
    let call = (!batch.calls.is_empty())
        .then(|| conn.statement(INSERT_CALL))
        .transpose()?;
    let put = (!batch.cache.is_empty())
        .then(|| conn.statement(PUT_CACHE))
        .transpose()?;
    let mut tx = conn.client.transaction()?;
    let holds = lock(&mut tx, &locking, rid, batch)?;
    let mut refused = BTreeSet::new();
    let mut refuse = |claim: ClaimId, seq: u64| {
        if !holds.ended(claim, seq) {
            refused.insert(seq);
        }
    };
    // The batch's attempts in one statement, its columns as arrays.
    let held: Vec<&AttemptRecord> = batch
        .attempts
        .iter()
        .filter_map(|(claim, a)| {
            if holds.holds(*claim, a.seq) {
                Some(a)
            } else {
                refuse(*claim, a.seq);
                None
            }
        })
        .collect();
    if !held.is_empty() {
        let telemetry: Vec<_> = held.iter().map(|a| &a.telemetry).collect();
        tx.execute(
            &attempts,
            &[
                &rid,
                &worker,
                &held.iter().map(|a| a.seq as i64).collect::<Vec<_>>(),
                &held.iter().map(|a| a.attempt as i32).collect::<Vec<_>>(),
                &held.iter().map(|a| a.session as i32).collect::<Vec<_>>(),
                &telemetry
                    .iter()
                    .map(|t| t.endpoint.as_str())
                    .collect::<Vec<_>>(),
                &telemetry
                    .iter()
                    .map(|t| t.model.as_str())
                    .collect::<Vec<_>>(),
                &held.iter().map(|a| a.sent_at_ms).collect::<Vec<_>>(),
                &telemetry.iter().map(|t| t.latency_ms).collect::<Vec<_>>(),
                &telemetry.iter().map(|t| t.ttft_ms).collect::<Vec<_>>(),
                &telemetry.iter().map(|t| t.tpot_ms).collect::<Vec<_>>(),
                &telemetry
                    .iter()
                    .map(|t| opt_u64(t.prompt_tokens))
                    .collect::<Vec<_>>(),
                &telemetry
                    .iter()
                    .map(|t| opt_u64(t.completion_tokens))
                    .collect::<Vec<_>>(),
                &telemetry
                    .iter()
                    .map(|t| t.finish_reason.as_deref())
                    .collect::<Vec<_>>(),
                &held
                    .iter()
                    .map(|a| a.http_status.map(i32::from))
                    .collect::<Vec<_>>(),
                &held
                    .iter()
                    .map(|a| a.error_class.map(ErrorClass::as_str))
                    .collect::<Vec<_>>(),
                &held.iter().map(|a| a.error.as_deref()).collect::<Vec<_>>(),
                &telemetry
                    .iter()
                    .map(|t| t.tokens_estimated)
                    .collect::<Vec<_>>(),
            ],
        )?;
    }
    let mut calls_stored = false;
    if let Some(statement) = &call {
        for (claim, c) in &batch.calls {
            if !holds.holds(*claim, c.seq) {
                refuse(*claim, c.seq);
                continue;
            }
            let t = &c.telemetry;
            let (request, request_z) = crate::columns::pack(&c.request);
            let (response, response_z) = match c.response.as_deref() {
                Some(text) => crate::columns::pack(text),
                None => (None, None),
            };
            tx.execute(
                statement,
                &[
                    &rid,
                    &(c.seq as i64),
                    &(c.attempt as i32),
                    &(c.index as i32),
                    &c.call_id,
                    &c.api,
                    &c.asked_model,
                    &c.sent_at_ms,
                    &t.endpoint,
                    &t.model,
                    &t.latency_ms,
                    &t.ttft_ms,
                    &t.tpot_ms,
                    &opt_u64(t.prompt_tokens),
                    &opt_u64(t.completion_tokens),
                    &t.tokens_estimated,
                    &t.finish_reason,
                    &c.stream,
                    &c.cached,
                    &i32::from(c.http_status),
                    &c.error_class.map(ErrorClass::as_str),
                    &c.error,
                    &request.unwrap_or(""),
                    &c.request_cut,
                    &response,
                    &c.tags,
                    &crate::failovers_column(&c.failovers),
                    &request_z,
                    &response_z,
                ],
            )?;
            calls_stored = true;
        }
    }
    if let Some(put) = &put {
        for c in &batch.cache {
            if c.key.len() != 64 || !c.key.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(StoreError::Invariant(format!(
                    "a cache key is not a hex SHA-256: '{}'",
                    c.key
                ))
                .into());
            }
            tx.execute(
                put,
                &[
                    &c.key,
                    &c.content,
                    &c.endpoint,
                    &c.model,
                    &opt_u64(c.prompt_tokens),
                    &opt_u64(c.completion_tokens),
                    &c.finish_reason,
                    &c.latency_ms,
                    &c.created_at_ms,
                ],
            )?;
        }
    }
    // Results: each item ends under its claim, and its result is stored
    // with the claim's attempt number, in the same transaction: one
    // statement for the batch. An item that did not end (a broken
    // invariant) has no row back, and the transaction is dropped.
    let (mut done, mut failed, mut already) = (0i64, 0i64, 0u64);
    let mut ended_here = BTreeSet::new();
    let mut rows: Vec<(
        ClaimId,
        &ResultRecord,
        AssessmentColumns<'_>,
        Option<String>,
    )> = Vec::new();
    for (claim, r) in &batch.results {
        if holds.ended(*claim, r.seq) {
            already += 1;
            continue;
        }
        if !holds.holds(*claim, r.seq) {
            refuse(*claim, r.seq);
            continue;
        }
        if !ended_here.insert(r.seq) {
            return Err(StoreError::Invariant(format!(
                "item '{}' of run '{run_id}' got a second result",
                r.item_id
            ))
            .into());
        }
        rows.push((
            *claim,
            r,
            assessment_columns(&r.assessment)?,
            images_column(&r.images)?,
        ));
    }
    if !rows.is_empty() {
        let telemetry: Vec<_> = rows
            .iter()
            .map(|(_, r, _, _)| r.telemetry.as_ref())
            .collect();
        let stored = tx.query(
            &results,
            &[
                &rid,
                &worker,
                &rows
                    .iter()
                    .map(|(_, r, _, _)| r.seq as i64)
                    .collect::<Vec<_>>(),
                &rows.iter().map(|(c, _, _, _)| *c).collect::<Vec<_>>(),
                &rows
                    .iter()
                    .map(|(_, r, _, _)| r.item_id.as_str())
                    .collect::<Vec<_>>(),
                &rows
                    .iter()
                    .map(|(_, r, _, _)| r.status.as_str())
                    .collect::<Vec<_>>(),
                &rows
                    .iter()
                    .map(|(_, r, _, _)| r.output.as_deref())
                    .collect::<Vec<_>>(),
                &rows
                    .iter()
                    .map(|(_, r, _, _)| r.error.as_deref())
                    .collect::<Vec<_>>(),
                &telemetry
                    .iter()
                    .map(|t| t.map(|t| t.endpoint.as_str()))
                    .collect::<Vec<_>>(),
                &telemetry
                    .iter()
                    .map(|t| t.map(|t| t.model.as_str()))
                    .collect::<Vec<_>>(),
                &rows
                    .iter()
                    .map(|(_, r, _, _)| r.attempts as i32)
                    .collect::<Vec<_>>(),
                &telemetry
                    .iter()
                    .map(|t| t.map(|t| t.latency_ms))
                    .collect::<Vec<_>>(),
                &telemetry
                    .iter()
                    .map(|t| t.and_then(|t| t.ttft_ms))
                    .collect::<Vec<_>>(),
                &telemetry
                    .iter()
                    .map(|t| t.and_then(|t| t.tpot_ms))
                    .collect::<Vec<_>>(),
                &telemetry
                    .iter()
                    .map(|t| opt_u64(t.and_then(|t| t.prompt_tokens)))
                    .collect::<Vec<_>>(),
                &telemetry
                    .iter()
                    .map(|t| opt_u64(t.and_then(|t| t.completion_tokens)))
                    .collect::<Vec<_>>(),
                &telemetry
                    .iter()
                    .map(|t| t.and_then(|t| t.finish_reason.as_deref()))
                    .collect::<Vec<_>>(),
                &rows
                    .iter()
                    .map(|(_, r, _, _)| r.item.as_deref())
                    .collect::<Vec<_>>(),
                &rows
                    .iter()
                    .map(|(_, r, _, _)| r.finished_at_ms)
                    .collect::<Vec<_>>(),
                &rows
                    .iter()
                    .map(|(_, _, a, _)| a.0.as_deref())
                    .collect::<Vec<_>>(),
                &rows.iter().map(|(_, _, a, _)| a.1).collect::<Vec<_>>(),
                &rows.iter().map(|(_, _, a, _)| a.2).collect::<Vec<_>>(),
                &rows
                    .iter()
                    .map(|(_, _, a, _)| a.3.as_deref())
                    .collect::<Vec<_>>(),
                &rows
                    .iter()
                    .map(|(_, _, a, _)| a.4 as i32)
                    .collect::<Vec<_>>(),
                &rows
                    .iter()
                    .map(|(_, _, a, _)| a.5.as_deref())
                    .collect::<Vec<_>>(),
                &rows
                    .iter()
                    .map(|(_, r, _, _)| r.cached as i32)
                    .collect::<Vec<_>>(),
                &telemetry
                    .iter()
                    .map(|t| t.is_some_and(|t| t.tokens_estimated))
                    .collect::<Vec<_>>(),
                &rows
                    .iter()
                    .map(|(_, r, _, _)| r.prompt.as_deref())
                    .collect::<Vec<_>>(),
                &rows
                    .iter()
                    .map(|(_, _, _, i)| i.as_deref())
                    .collect::<Vec<_>>(),
            ],
        )?;
        if stored.len() != rows.len() {
            let back: BTreeSet<i64> = stored.iter().map(|row| row.get::<_, i64>(0)).collect();
            let missing = rows
                .iter()
                .find(|(_, r, _, _)| !back.contains(&(r.seq as i64)))
                .map_or("?", |(_, r, _, _)| r.item_id.as_str());
            return Err(StoreError::Invariant(format!(
                "item '{missing}' of run '{run_id}' got a second result"
            ))
            .into());
        }
        for (_, r, _, _) in &rows {
            match r.status {
                ItemStatus::Done => done += 1,
                ItemStatus::Failed => failed += 1,
            }
        }
    }
    // Waits, for the items that go on under this claim: one statement.
    let waits: Vec<(ClaimId, i64, i64)> = batch
        .waits
        .iter()
        .filter_map(|(claim, w)| {
            if holds.holds(*claim, w.seq) {
                Some((*claim, w.seq as i64, millis(w.wait)))
            } else {
                refuse(*claim, w.seq);
                None
            }
        })
        .collect();
    if !waits.is_empty() {
        tx.execute(
            &wait,
            &[
                &rid,
                &waits.iter().map(|w| w.1).collect::<Vec<_>>(),
                &waits.iter().map(|w| w.0).collect::<Vec<_>>(),
                &waits.iter().map(|w| w.2).collect::<Vec<_>>(),
            ],
        )?;
    }
    if done + failed > 0 || calls_stored {
        // The worker's own row: workers committing at once do not wait
        // for each other here.
        tx.execute(&tally, &[&rid, &worker, &done, &failed, &now_ms()])?;
    }
    tx.commit()?;
    Ok(Committed {
        results: (done + failed) as u64 + already,
        refused: refused.into_iter().collect(),
    })
}

impl WorkQueue for PgStore {
    fn claim(
        &mut self,
        run_id: &str,
        worker: &str,
        after: Option<u64>,
        limit: usize,
        lease: Duration,
    ) -> Result<Claimed, StoreError> {
        let mut id = None;
        self.with("cannot claim items", |conn| {
            claim_once(conn, run_id, worker, after, limit, lease, &mut id)
        })
    }

    fn renew(
        &mut self,
        run_id: &str,
        worker: &str,
        lease: Duration,
    ) -> Result<Renewal, StoreError> {
        let lease_ms = millis(lease);
        self.with("cannot renew the lease", |conn| {
            let rid = conn.rid(run_id)?;
            // One statement: every lease of the worker, its heartbeat, and
            // the items it lost since it last asked (told once). Claims
            // are counted as SQLite counts them, not their items.
            let row = conn.client.query_one(
                "WITH renewed AS (
                     UPDATE items SET lease_until = now() + $3::bigint * interval '1 millisecond'
                     WHERE rid = $1 AND owner = $2 AND state = 'running'
                     RETURNING claim_id),
                 lost AS (
                     UPDATE items SET lost_by = NULL
                     WHERE rid = $1 AND lost_by = $2
                     RETURNING seq),
                 beat AS (
                     UPDATE workers SET heartbeat_at = now(), lease_ms = $3
                     WHERE rid = $1 AND worker = $2
                     RETURNING 1)
                 SELECT (SELECT count(DISTINCT claim_id) FROM renewed),
                        (SELECT COALESCE(array_agg(seq ORDER BY seq), '{}') FROM lost),
                        (SELECT count(*) FROM beat),
                        (SELECT COALESCE(array_agg(DISTINCT claim_id), '{}') FROM renewed)",
                &[&rid, &worker, &lease_ms],
            )?;
            Ok(Renewal {
                claims: row.get::<_, i64>(0).max(0) as u64,
                held: row.get::<_, Vec<i64>>(3),
                lost: row
                    .get::<_, Vec<i64>>(1)
                    .into_iter()
                    .map(|seq| seq as u64)
                    .collect(),
            })
        })
    }

    fn commit(
        &mut self,
        run_id: &str,
        worker: &str,
        batch: &Batch,
    ) -> Result<Committed, StoreError> {
        self.with("cannot commit a batch", |conn| {
            commit_once(conn, run_id, worker, batch)
        })
    }

    fn release(&mut self, run_id: &str, worker: &str) -> Result<(), StoreError> {
        self.with("cannot release the worker's claims", |conn| {
            let rid = conn.rid(run_id)?;
            let mut tx = conn.client.transaction()?;
            tx.execute(
                "UPDATE items SET state = 'pending', owner = NULL, lease_until = NULL
                 WHERE rid = $1 AND owner = $2 AND state = 'running'",
                &[&rid, &worker],
            )?;
            tx.execute(
                "DELETE FROM workers WHERE rid = $1 AND worker = $2",
                &[&rid, &worker],
            )?;
            tx.commit()?;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    /// A claim whose connection was lost after its `COMMIT` reached the
    /// server is run again by `PgStore::with`; it cannot be made to lose
    /// its connection at that moment, so its second run is called here as
    /// `with` calls it: with the claim's id it kept.
    #[test]
    fn a_claim_run_again_after_its_commit_got_through_hands_out_the_same_items() {
        let Some(db) = evalfleet_testkit::scratch_db!() else {
            return;
        };
        let mut store = PgStore::open(&db.url, false).unwrap();
        let conn = store.conn.as_mut().unwrap();
        conn.client
            .batch_execute(
                "INSERT INTO runs (run_id, name, status, created_at, updated_at, config,
                                   config_dir, fingerprint, digest, dataset, total)
                 VALUES ('r', 'r', 'running', 1, 1, '{}', '.', '{}', 'd', '{}', 5);
                 INSERT INTO item_rows (rid, seq, item_id, line, \"offset\", sample_key)
                 SELECT 1, s, 'id' || s, s, 0, s FROM generate_series(1, 5) s;
                 INSERT INTO items (rid, seq, state)
                 SELECT 1, s, 'pending' FROM generate_series(1, 5) s;",
            )
            .unwrap();
        let lease = Duration::from_secs(60);
        let seqs = |claimed: &Claimed| match claimed {
            Claimed::Items(claim) => claim.items.iter().map(|i| i.seq).collect::<Vec<_>>(),
            other => panic!("{other:?}"),
        };
        let mut id = None;
        let first = claim_once(conn, "r", "w", None, 2, lease, &mut id).unwrap();
        assert_eq!(seqs(&first), [1, 2]);
        let again = claim_once(conn, "r", "w", None, 2, lease, &mut id).unwrap();
        assert_eq!(again, first, "the items it took, not two more");
        let next = claim_once(conn, "r", "w", None, 2, lease, &mut None).unwrap();
        assert_eq!(seqs(&next), [3, 4], "a new claim takes the next items");
        // A first run that did not get through took nothing: run again
        // under its id, it claims anew.
        let mut unused = Some(10_000);
        let fresh = claim_once(conn, "r", "w", None, 2, lease, &mut unused).unwrap();
        assert_eq!(seqs(&fresh), [5]);
    }

    /// Registering a run brings the planner's statistics of the queue's
    /// tables up to date, and a commit's lock of its rows is planned as a
    /// lookup of their keys: without statistics (autovacuum analyzes a
    /// grown table late, or never where it is off), or with a condition
    /// they misjudge, it read every row of the run (16 ms a commit at
    /// 100,000 items, against 1 ms).
    #[test]
    fn a_commits_rows_are_looked_up_by_key_once_a_run_is_registered() {
        use crate::{ListedItems, NewItem, NewRun, Runs};
        let Some(db) = evalfleet_testkit::scratch_db!() else {
            return;
        };
        let mut store = PgStore::open(&db.url, false).unwrap();
        let items: Vec<NewItem> = (1..=100_000u64)
            .map(|seq| NewItem {
                item_id: format!("id{seq}"),
                seq,
                line: seq,
                offset: 0,
                sample_key: seq as i64,
                invalid: None,
            })
            .collect();
        let run = NewRun {
            run_id: "r".to_owned(),
            name: "r".to_owned(),
            config: serde_json::json!({}),
            config_dir: ".".to_owned(),
            created_at_ms: 1,
        };
        store
            .create_run(&run, &mut ListedItems::new(items, None))
            .unwrap();
        let conn = store.conn.as_mut().unwrap();
        for table in ["items", "item_rows"] {
            let known: f32 = conn
                .client
                .query_one(
                    "SELECT reltuples FROM pg_class WHERE oid = $1::text::regclass",
                    &[&table],
                )
                .unwrap()
                .get(0);
            assert!(
                known >= 95_000.0,
                "{table}: the planner knows of {known} rows"
            );
        }
        let seqs: Vec<i64> = (10_001..=10_512).collect();
        let plan: Vec<String> = conn
            .client
            .query(&format!("EXPLAIN {LOCK}"), &[&1i64, &seqs])
            .unwrap()
            .iter()
            .map(|row| row.get(0))
            .collect();
        let plan = plan.join("\n");
        assert!(
            plan.lines().any(
                |line| line.contains("Index Cond: ((rid = ") && line.contains("AND (seq = ANY")
            ),
            "a commit's rows are not looked up by key:\n{plan}"
        );
    }
}
