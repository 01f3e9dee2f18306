//! The SQLite schema, as the migrations that built it: each is applied once,
//! in order, in one transaction with the others still to apply, and the file
//! remembers how many were (`PRAGMA user_version`), so a store written by an
//! earlier evalfleet is upgraded in place when it is opened.
//!
//! Items, results and attempts are keyed by the item's `seq` (its place in
//! the dataset): items are registered and mostly finished in that order, so
//! these clustered tables grow at their ends. Item ids have a narrow unique
//! index of their own. CHECK constraints use `OR`, not `IN (...)`, which
//! would build a temporary table for every row written.

use rusqlite_migration::{M, Migrations};

/// 1: runs, items, results, attempts, events, endpoint states and fleet
/// changes.
const RUNS: &str = r#"
CREATE TABLE runs (
    rid         INTEGER PRIMARY KEY,
    run_id      TEXT NOT NULL UNIQUE,
    name        TEXT NOT NULL,
    status      TEXT NOT NULL,
    created_at  INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL,
    config      TEXT NOT NULL,
    config_dir  TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    digest      TEXT NOT NULL,
    dataset     TEXT NOT NULL,
    total       INTEGER NOT NULL,
    sessions    INTEGER NOT NULL DEFAULT 0,
    -- Items done and failed, kept in the same transactions that change item
    -- states, so that counting a run does not read its items.
    done        INTEGER NOT NULL DEFAULT 0,
    failed      INTEGER NOT NULL DEFAULT 0,
    message     TEXT
);
CREATE TABLE items (
    rid        INTEGER NOT NULL REFERENCES runs(rid),
    seq        INTEGER NOT NULL,
    item_id    TEXT NOT NULL,
    line       INTEGER NOT NULL,
    offset     INTEGER NOT NULL,
    sample_key INTEGER NOT NULL,
    state      TEXT NOT NULL CHECK (state = 'pending' OR state = 'done' OR state = 'failed'),
    invalid    TEXT,
    PRIMARY KEY (rid, seq)
) WITHOUT ROWID;
CREATE UNIQUE INDEX items_by_id ON items (rid, item_id);
-- Only pending items are indexed: finishing one deletes its entry, and a
-- claim finds the next pending items at once.
CREATE INDEX items_pending ON items (rid, seq) WHERE state = 'pending';
CREATE TABLE results (
    rid               INTEGER NOT NULL REFERENCES runs(rid),
    seq               INTEGER NOT NULL,
    item_id           TEXT NOT NULL,
    status            TEXT NOT NULL CHECK (status = 'done' OR status = 'failed'),
    output            TEXT,
    error             TEXT,
    endpoint          TEXT,
    model             TEXT,
    attempts          INTEGER NOT NULL,
    latency_ms        REAL,
    ttft_ms           REAL,
    tpot_ms           REAL,
    prompt_tokens     INTEGER,
    completion_tokens INTEGER,
    finish_reason     TEXT,
    item              TEXT,
    finished_at       INTEGER NOT NULL,
    PRIMARY KEY (rid, seq)
) WITHOUT ROWID;
CREATE TABLE attempts (
    rid               INTEGER NOT NULL REFERENCES runs(rid),
    seq               INTEGER NOT NULL,
    attempt           INTEGER NOT NULL,
    session           INTEGER NOT NULL,
    endpoint          TEXT NOT NULL,
    model             TEXT NOT NULL,
    sent_at           INTEGER NOT NULL,
    latency_ms        REAL NOT NULL,
    ttft_ms           REAL,
    tpot_ms           REAL,
    prompt_tokens     INTEGER,
    completion_tokens INTEGER,
    finish_reason     TEXT,
    http_status       INTEGER,
    error_class       TEXT,
    error             TEXT,
    PRIMARY KEY (rid, seq, attempt)
) WITHOUT ROWID;
CREATE TABLE events (
    rid      INTEGER NOT NULL REFERENCES runs(rid),
    at       INTEGER NOT NULL,
    kind     TEXT NOT NULL,
    endpoint TEXT,
    message  TEXT NOT NULL
);
CREATE INDEX events_by_run ON events (rid, at);
-- What the running process last knew of each endpoint (for `status`).
CREATE TABLE endpoint_states (
    rid        INTEGER NOT NULL REFERENCES runs(rid),
    endpoint   TEXT NOT NULL,
    snapshot   TEXT NOT NULL,
    updated_at INTEGER NOT NULL,
    PRIMARY KEY (rid, endpoint)
);
-- `evalfleet fleet add|remove`, for the running process to apply.
CREATE TABLE fleet_changes (
    id       INTEGER PRIMARY KEY,
    rid      INTEGER NOT NULL REFERENCES runs(rid),
    at       INTEGER NOT NULL,
    action   TEXT NOT NULL CHECK (action = 'add' OR action = 'remove'),
    endpoint TEXT NOT NULL,
    taken    INTEGER NOT NULL DEFAULT 0
);
"#;

/// 2: checking and scoring of answers, and the response cache: answers by
/// the SHA-256 of their request, shared by every run of the store; rowid
/// order is insertion order, so eviction takes the oldest first.
const ASSESSMENTS_AND_CACHE: &str = "
ALTER TABLE results ADD COLUMN parsed TEXT;
ALTER TABLE results ADD COLUMN verdict TEXT;
ALTER TABLE results ADD COLUMN check_error TEXT;
ALTER TABLE results ADD COLUMN scores TEXT;
ALTER TABLE results ADD COLUMN reasks INTEGER NOT NULL DEFAULT 0;
ALTER TABLE attempts ADD COLUMN cached INTEGER NOT NULL DEFAULT 0;
CREATE TABLE cache (
    key               BLOB NOT NULL UNIQUE, -- the SHA-256 itself (32 bytes)
    content           TEXT NOT NULL,
    endpoint          TEXT NOT NULL,
    model             TEXT NOT NULL,
    prompt_tokens     INTEGER,
    completion_tokens INTEGER,
    finish_reason     TEXT,
    latency_ms        REAL NOT NULL,
    created_at        INTEGER NOT NULL
);
";

/// 3: the code judge's judgement.
const CODE_JUDGEMENT: &str = "ALTER TABLE results ADD COLUMN judge TEXT;";

/// 4: workers sharing a run through claims with a lease. A claim holds the
/// pending items of a range of `seq` until `lease_until`; no two live
/// claims hold the same pending item. A worker registers with its process,
/// so that `status` tells a live run from one whose process is gone.
const WORKERS_AND_CLAIMS: &str = "
CREATE TABLE workers (
    rid           INTEGER NOT NULL REFERENCES runs(rid),
    worker        TEXT NOT NULL,
    session       INTEGER NOT NULL,
    host          TEXT NOT NULL,
    pid           INTEGER NOT NULL,
    process_start INTEGER NOT NULL,
    started_at    INTEGER NOT NULL,
    heartbeat_at  INTEGER NOT NULL,
    lease_ms      INTEGER NOT NULL,
    PRIMARY KEY (rid, worker)
);
CREATE TABLE claims (
    claim_id    INTEGER PRIMARY KEY,
    rid         INTEGER NOT NULL REFERENCES runs(rid),
    worker      TEXT NOT NULL,
    first_seq   INTEGER NOT NULL,
    last_seq    INTEGER NOT NULL,
    lease_until INTEGER NOT NULL
);
CREATE INDEX claims_by_run ON claims (rid, first_seq);
";

/// 5: calls answered from the cache are counted with their item's result,
/// not stored as attempts of their own.
const CACHED_CALLS: &str = "ALTER TABLE results ADD COLUMN cached INTEGER NOT NULL DEFAULT 0;";

/// 6: completion tokens counted from a stream's chunks are marked as
/// estimated.
const ESTIMATED_TOKENS: &str = "
ALTER TABLE attempts ADD COLUMN tokens_estimated INTEGER NOT NULL DEFAULT 0;
ALTER TABLE results ADD COLUMN tokens_estimated INTEGER NOT NULL DEFAULT 0;
";

/// 7: a run's timeline: each second, each worker's view of the run's
/// counts and of its endpoints (JSON).
const TIMELINE: &str = "
CREATE TABLE samples (
    rid    INTEGER NOT NULL REFERENCES runs(rid),
    at     INTEGER NOT NULL,
    worker TEXT NOT NULL,
    sample TEXT NOT NULL,
    PRIMARY KEY (rid, at, worker)
) WITHOUT ROWID;
";

/// 8: reports and comparisons computed once and kept, each under the run
/// it is of (a comparison: its first run) and what was asked (`key`), with
/// the generations of the runs it read (`fingerprint`). A run's generation
/// changes with every commit of its results, every session and every
/// rescore, so a kept report whose fingerprint differs from the runs' is
/// stale: it is computed again and replaced.
const KEPT_REPORTS: &str = "
ALTER TABLE runs ADD COLUMN generation INTEGER NOT NULL DEFAULT 0;
CREATE TABLE kept_reports (
    rid         INTEGER NOT NULL REFERENCES runs(rid),
    key         TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    body        TEXT NOT NULL,
    made_at     INTEGER NOT NULL,
    PRIMARY KEY (rid, key)
);
";

/// 9: resource telemetry, one row per point of a run's series (a GPU's
/// memory, an engine's RSS, ...): a sample, or older samples merged with
/// their mean, peak and count. Each series is kept within
/// `evalfleet_types::POINTS_PER_SERIES` points by the writer.
const TELEMETRY: &str = "
CREATE TABLE resource_points (
    rid     INTEGER NOT NULL REFERENCES runs(rid),
    source  TEXT NOT NULL,
    name    TEXT NOT NULL,
    metric  TEXT NOT NULL,
    at      INTEGER NOT NULL,
    until   INTEGER NOT NULL,
    mean    REAL NOT NULL,
    peak    REAL NOT NULL,
    samples INTEGER NOT NULL,
    PRIMARY KEY (rid, source, name, metric, at)
) WITHOUT ROWID;
";

/// 10: the rule of `task.prompts` that made each result's messages. Kept
/// reports are dropped (they are computed again when asked for): those
/// kept before have no figures by group.
const PROMPT_RULES: &str = "
ALTER TABLE results ADD COLUMN prompt TEXT;
DELETE FROM kept_reports;
";

/// 11: the images each result's request sent: source, page, SHA-256 of
/// the bytes sent and their size (JSON), never the bytes.
const IMAGES: &str = "ALTER TABLE results ADD COLUMN images TEXT;";

/// 12: the calls agents made through the gateway (`kind: exec`), each
/// under its item's attempt (one run of the agent) in the order it was
/// made. A table with rowids, its key an index: a call keeps its request
/// and response (up to 256 KiB each), and rows that large belong outside
/// the B-tree of their key (SQLite advises WITHOUT ROWID for small rows
/// only).
const AGENT_CALLS: &str = "
CREATE TABLE agent_calls (
    rid               INTEGER NOT NULL REFERENCES runs(rid),
    seq               INTEGER NOT NULL,
    attempt           INTEGER NOT NULL,
    idx               INTEGER NOT NULL,
    call_id           TEXT NOT NULL,
    api               TEXT NOT NULL,
    asked_model       TEXT NOT NULL,
    sent_at           INTEGER NOT NULL,
    endpoint          TEXT NOT NULL,
    model             TEXT NOT NULL,
    latency_ms        REAL NOT NULL,
    ttft_ms           REAL,
    tpot_ms           REAL,
    prompt_tokens     INTEGER,
    completion_tokens INTEGER,
    tokens_estimated  INTEGER NOT NULL DEFAULT 0,
    finish_reason     TEXT,
    stream            INTEGER NOT NULL,
    cached            INTEGER NOT NULL,
    http_status       INTEGER NOT NULL,
    error_class       TEXT,
    error             TEXT,
    request           TEXT NOT NULL,
    request_cut       INTEGER NOT NULL,
    response          TEXT,
    tags              TEXT,
    PRIMARY KEY (rid, seq, attempt, idx)
);
";

/// 13: how long an item waits before it is sent again (a server's
/// `Retry-After`, a backoff), as the time it may be claimed from (ms since
/// the epoch; NULL: at once), so that a worker that takes it after
/// another stopped waits it out too; and what each worker committed
/// (results done and failed), kept by its commits.
const NOT_BEFORE: &str = "
ALTER TABLE items ADD COLUMN not_before INTEGER;
CREATE TABLE worker_tallies (
    rid    INTEGER NOT NULL REFERENCES runs(rid),
    worker TEXT NOT NULL,
    done   INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (rid, worker)
);
";

/// 14: an agent call's tries that failed on other endpoints before the
/// gateway made it on the one that answered (JSON; NULL for none).
const FAILOVERS: &str = "ALTER TABLE agent_calls ADD COLUMN failovers TEXT;";

/// 16: where a worker's pid means it (see `WorkerInfo::pid_scope`).
const PID_SCOPE: &str = "ALTER TABLE workers ADD COLUMN pid_scope TEXT NOT NULL DEFAULT '';";

/// 17: each worker keeps its own snapshot of an endpoint (they are summed
/// when read): one worker's no longer replaces another's.
const ENDPOINT_STATES_PER_WORKER: &str = "
CREATE TABLE endpoint_states_per_worker (
    rid        INTEGER NOT NULL REFERENCES runs(rid),
    endpoint   TEXT NOT NULL,
    worker     TEXT NOT NULL DEFAULT '',
    snapshot   TEXT NOT NULL,
    updated_at INTEGER NOT NULL,
    PRIMARY KEY (rid, endpoint, worker)
);
INSERT INTO endpoint_states_per_worker (rid, endpoint, snapshot, updated_at)
    SELECT rid, endpoint, snapshot, updated_at FROM endpoint_states;
DROP TABLE endpoint_states;
ALTER TABLE endpoint_states_per_worker RENAME TO endpoint_states;
";

/// 15: an agent call's request and response kept whole: a long one
/// compressed (zstd) in these columns, its text column then empty
/// (`request`) or NULL (`response`).
const WHOLE_BODIES: &str = "
ALTER TABLE agent_calls ADD COLUMN request_z BLOB;
ALTER TABLE agent_calls ADD COLUMN response_z BLOB;
";

/// 18: a claim's id is never given again once its claim is gone (a claim
/// is dropped when its items have all ended, when its worker releases it,
/// or by the next claim once its lease ran out).
/// A worker's renewal took each claim it handed out that the store no
/// longer had for lost (finished ones too, until the worker learned to
/// forget a claim whose items have all ended), and a new claim that got
/// such an id back was taken for lost too: its items were let go while
/// the store held them for the worker (a run of 200,000 items ended with
/// 57,344 pending).
///
/// Two processes opening a store of version 17 at once may both run it
/// (the version is read before the write lock is taken): the second
/// fails on its guard instead of dropping the new table's sequence, and
/// finds the store current.
const UNIQUE_CLAIM_IDS: &str = "
CREATE TEMP TABLE claims_not_yet_unique (n INTEGER CHECK (n = 0));
INSERT INTO claims_not_yet_unique SELECT count(*) FROM sqlite_master
    WHERE type = 'table' AND name = 'claims' AND sql LIKE '%AUTOINCREMENT%';
DROP TABLE claims_not_yet_unique;
CREATE TABLE claims_unique (
    claim_id    INTEGER PRIMARY KEY AUTOINCREMENT,
    rid         INTEGER NOT NULL REFERENCES runs(rid),
    worker      TEXT NOT NULL,
    first_seq   INTEGER NOT NULL,
    last_seq    INTEGER NOT NULL,
    lease_until INTEGER NOT NULL
);
INSERT INTO claims_unique (claim_id, rid, worker, first_seq, last_seq, lease_until)
    SELECT claim_id, rid, worker, first_seq, last_seq, lease_until FROM claims;
DROP TABLE claims;
ALTER TABLE claims_unique RENAME TO claims;
CREATE INDEX claims_by_run ON claims (rid, first_seq);
";

/// The schema version a store has once every migration ran.
pub const VERSION: usize = 18;

pub fn migrations() -> Migrations<'static> {
    Migrations::new(vec![
        M::up(RUNS),
        M::up(ASSESSMENTS_AND_CACHE),
        M::up(CODE_JUDGEMENT),
        M::up(WORKERS_AND_CLAIMS),
        M::up(CACHED_CALLS),
        M::up(ESTIMATED_TOKENS),
        M::up(TIMELINE),
        M::up(KEPT_REPORTS),
        M::up(TELEMETRY),
        M::up(PROMPT_RULES),
        M::up(IMAGES),
        M::up(AGENT_CALLS),
        M::up(NOT_BEFORE),
        M::up(FAILOVERS),
        M::up(WHOLE_BODIES),
        M::up(PID_SCOPE),
        M::up(ENDPOINT_STATES_PER_WORKER),
        M::up(UNIQUE_CLAIM_IDS),
    ])
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_migrations_are_valid_and_end_at_the_version() {
        assert!(super::migrations().validate().is_ok());
        let mut conn = rusqlite::Connection::open_in_memory().unwrap();
        super::migrations().to_latest(&mut conn).unwrap();
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |row| row.get(0))
            .unwrap();
        assert_eq!(version, super::VERSION as i64);
    }

    #[test]
    fn claims_keep_their_ids_across_migration_18_and_no_id_comes_back() {
        let mut conn = rusqlite::Connection::open_in_memory().unwrap();
        super::migrations().to_version(&mut conn, 17).unwrap();
        conn.execute_batch(
            "INSERT INTO runs (rid, run_id, name, status, created_at, updated_at, config, config_dir,
                 fingerprint, digest, dataset, total)
                 VALUES (1, 'r', 'r', 'running', 0, 0, '{}', '.', '', '', '', 20);
             INSERT INTO claims VALUES (5, 1, 'w', 1, 10, 0), (7, 1, 'w', 11, 20, 0);",
        )
        .unwrap();
        super::migrations().to_latest(&mut conn).unwrap();
        let ids = |conn: &rusqlite::Connection| -> Vec<i64> {
            let mut ids = conn
                .prepare("SELECT claim_id FROM claims ORDER BY claim_id")
                .unwrap();
            ids.query_map([], |row| row.get(0))
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap()
        };
        assert_eq!(ids(&conn), [5, 7]);
        // The newest claim dropped: the next is not given its id.
        let add = "INSERT INTO claims (rid, worker, first_seq, last_seq, lease_until) VALUES (1, 'w', 21, 30, 0)";
        conn.execute_batch(add).unwrap();
        conn.execute_batch("DELETE FROM claims WHERE claim_id = 8")
            .unwrap();
        conn.execute_batch(add).unwrap();
        assert_eq!(ids(&conn), [5, 7, 9]);
        // Run again (two processes migrating at once), it fails on its
        // guard and leaves the table and its sequence as they were.
        assert!(conn.execute_batch(super::UNIQUE_CLAIM_IDS).is_err());
        conn.execute_batch(add).unwrap();
        assert_eq!(ids(&conn), [5, 7, 9, 10]);
    }
}
