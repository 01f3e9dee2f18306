//! The embedded store: one SQLite file in WAL mode. Results, item states and
//! attempts are committed together, one transaction per batch, with
//! `synchronous = FULL`, so a committed result survives a crash or a power
//! loss and an uncommitted one is simply still pending.

use std::collections::HashMap;
use std::fs::{File, TryLockError};
use std::path::{Path, PathBuf};
use std::time::Duration;

use evalfleet_core::dataset::DatasetIdentity;
use evalfleet_core::fingerprint::Fingerprint;
use evalfleet_core::store::{
    AttemptSample, Batch, CacheStats, CreateRunError, EndpointStates, ExportError, ExportRow,
    ItemSource, NewRun, PendingItem, RunGuard, RunRecord, SessionStart, Store, StoreError,
    StoredResult,
};
use evalfleet_types::{
    Assessment, CacheEntry, EndpointSnapshot, ErrorClass, Event, EventKind, FleetAction,
    FleetChange, ItemStatus, RunStatus, Scores, StateCounts, UnknownName, Verdict, now_ms,
};
use rusqlite::{
    Connection, ErrorCode, OpenFlags, OptionalExtension, Transaction, TransactionBehavior, params,
};

const SCHEMA_VERSION: i64 = 3;

/// Items, results and attempts are keyed by the item's `seq` (its place in
/// the dataset): items are registered and mostly finished in that order, so
/// these clustered tables grow at their ends. Item ids have a narrow unique
/// index of their own. (CHECK constraints use `OR`, not `IN (...)`, which
/// would build a temporary table for every row written.)
const SCHEMA: &str = r#"
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
-- resume finds the first pending item at once.
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
    -- Checking and scoring (schema 2); `evalfleet score` rewrites them.
    parsed            TEXT,
    verdict           TEXT,
    check_error       TEXT,
    scores            TEXT,
    reasks            INTEGER NOT NULL DEFAULT 0,
    -- The code judge's judgement (schema 3).
    judge             TEXT,
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
    cached            INTEGER NOT NULL DEFAULT 0,
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

/// Answers by the SHA-256 of their request (schema 2), shared by every run
/// of the store; rowid order is insertion order, so eviction takes the
/// oldest first.
const CACHE_TABLE: &str = "
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

/// From schema 2: the code judge's column.
const MIGRATE_2_TO_3: &str = "ALTER TABLE results ADD COLUMN judge TEXT;";

/// From schema 1: the columns of checking and scoring (and [`CACHE_TABLE`]).
const MIGRATE_1_TO_2: &str = "
ALTER TABLE results ADD COLUMN parsed TEXT;
ALTER TABLE results ADD COLUMN verdict TEXT;
ALTER TABLE results ADD COLUMN check_error TEXT;
ALTER TABLE results ADD COLUMN scores TEXT;
ALTER TABLE results ADD COLUMN reasks INTEGER NOT NULL DEFAULT 0;
ALTER TABLE attempts ADD COLUMN cached INTEGER NOT NULL DEFAULT 0;
";

/// Runs the `sql` parts and sets the schema version, in one transaction; another
/// process may have done the same meanwhile, which is fine.
fn schema_step(conn: &Connection, sql: &[&str], what: &str) -> Result<(), StoreError> {
    let sql = sql.concat();
    conn.execute_batch(&format!(
        "BEGIN IMMEDIATE; {sql} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;"
    ))
    .or_else(|err| {
        let now: i64 = conn
            .query_row("PRAGMA user_version", [], |row| row.get(0))
            .map_err(db_err("cannot read the schema version"))?;
        if now == SCHEMA_VERSION {
            Ok(())
        } else {
            Err(StoreError::backend(
                format!("cannot {what} the store's tables"),
                err,
            ))
        }
    })
}

/// A SQLite store file.
pub struct SqliteStore {
    conn: Connection,
    path: PathBuf,
    rids: HashMap<String, i64>,
    /// Whether a run had attempts when this connection first looked.
    had_attempts: HashMap<i64, bool>,
    /// The database holding the cache table: `main`, or `cache_file` when
    /// a cache file of its own is attached.
    cache_db: &'static str,
}

fn db_err(context: &str) -> impl Fn(rusqlite::Error) -> StoreError + '_ {
    move |err| StoreError::backend(context, err)
}

fn json_err(context: &str) -> impl Fn(serde_json::Error) -> StoreError + '_ {
    move |err| StoreError::backend(context, err)
}

impl SqliteStore {
    /// Opens the store at `path`, creating it (and its directory) when absent.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|err| {
                StoreError::backend(
                    format!("cannot create the store's directory {}", dir.display()),
                    err,
                )
            })?;
        }
        // Each connection is used by one thread at a time, so SQLite's own
        // per-call mutex is not needed.
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_URI
            | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(path, flags).map_err(|err| {
            StoreError::backend(format!("cannot open store {}", path.display()), err)
        })?;
        Self::init(conn, path)
    }

    /// Opens a store that must already exist.
    pub fn open_existing(path: &Path) -> Result<Self, StoreError> {
        if !path.is_file() {
            return Err(StoreError::NoStore(path.to_owned()));
        }
        Self::open(path)
    }

    fn init(conn: Connection, path: &Path) -> Result<Self, StoreError> {
        conn.busy_timeout(Duration::from_secs(30))
            .map_err(db_err("cannot set the busy timeout"))?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(db_err("cannot switch the store to WAL mode"))?;
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(db_err("cannot set synchronous mode"))?;
        conn.pragma_update(None, "foreign_keys", "ON")
            .map_err(db_err("cannot enable foreign keys"))?;
        // 8 MiB of page cache per connection: batches append near the end of
        // their tables, so the pages they touch are few and recent.
        conn.pragma_update(None, "cache_size", -8_192)
            .map_err(db_err("cannot set the cache size"))?;
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |row| row.get(0))
            .map_err(db_err("cannot read the schema version"))?;
        match version {
            0 => schema_step(&conn, &[SCHEMA, CACHE_TABLE], "create")?,
            1 => schema_step(
                &conn,
                &[MIGRATE_1_TO_2, CACHE_TABLE, MIGRATE_2_TO_3],
                "upgrade",
            )?,
            2 => schema_step(&conn, &[MIGRATE_2_TO_3], "upgrade")?,
            SCHEMA_VERSION => {}
            newer => {
                return Err(StoreError::Backend {
                    message: format!(
                        "{} has schema version {newer}, newer than this evalfleet understands ({SCHEMA_VERSION})",
                        path.display()
                    ),
                    source: None,
                });
            }
        }
        Ok(Self {
            conn,
            path: path.to_owned(),
            rids: HashMap::new(),
            had_attempts: HashMap::new(),
            cache_db: "main",
        })
    }

    /// Keeps the cache in `path` (another store file, created when absent)
    /// instead of this store, so that runs of several stores share it.
    pub fn use_cache_file(&mut self, path: &Path) -> Result<(), StoreError> {
        // Opening it as a store creates it with the cache table.
        drop(Self::open(path)?);
        let name = path.to_str().ok_or_else(|| StoreError::Backend {
            message: format!("the cache file's name is not UTF-8: {}", path.display()),
            source: None,
        })?;
        self.conn
            .execute("ATTACH DATABASE ?1 AS cache_file", [name])
            .map_err(|err| {
                StoreError::backend(
                    format!("cannot attach the cache file {}", path.display()),
                    err,
                )
            })?;
        self.cache_db = "cache_file";
        Ok(())
    }

    /// The store's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn rid(&mut self, run_id: &str) -> Result<i64, StoreError> {
        if let Some(rid) = self.rids.get(run_id) {
            return Ok(*rid);
        }
        let rid: i64 = self
            .conn
            .query_row("SELECT rid FROM runs WHERE run_id = ?1", [run_id], |row| {
                row.get(0)
            })
            .optional()
            .map_err(db_err("cannot look up the run"))?
            .ok_or_else(|| StoreError::NoSuchRun(run_id.to_owned()))?;
        self.rids.insert(run_id.to_owned(), rid);
        Ok(rid)
    }

    fn lock_path(&self, run_id: &str) -> PathBuf {
        let mut dir = self.path.as_os_str().to_owned();
        dir.push(".locks");
        PathBuf::from(dir).join(format!("{run_id}.lock"))
    }

    fn try_lock(&self, run_id: &str) -> Result<Option<File>, StoreError> {
        let path = self.lock_path(run_id);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|err| {
                StoreError::backend(format!("cannot create {}", dir.display()), err)
            })?;
        }
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|err| {
                StoreError::backend(format!("cannot open lock file {}", path.display()), err)
            })?;
        match file.try_lock() {
            Ok(()) => Ok(Some(file)),
            Err(TryLockError::WouldBlock) => Ok(None),
            Err(TryLockError::Error(err)) => Err(StoreError::backend(
                format!("cannot lock {}", path.display()),
                err,
            )),
        }
    }
}

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

/// A stored name that this evalfleet does not know: the store was written
/// by another version, or damaged.
fn unknown(err: UnknownName) -> StoreError {
    StoreError::Invariant(format!("the store holds an {err}"))
}

fn status_of(text: &str) -> Result<RunStatus, StoreError> {
    RunStatus::parse(text).map_err(unknown)
}

/// An assessment's columns: parsed, verdict, check_error, scores, reasks,
/// judge (each JSON as text).
type AssessmentColumns<'a> = (
    Option<String>,
    Option<&'static str>,
    Option<&'a str>,
    Option<String>,
    u32,
    Option<String>,
);

fn assessment_columns(a: &Assessment) -> Result<AssessmentColumns<'_>, StoreError> {
    let scores = if a.scores.is_empty() {
        None
    } else {
        Some(serde_json::to_string(&a.scores).map_err(json_err("cannot encode scores"))?)
    };
    Ok((
        a.parsed.as_ref().map(ToString::to_string),
        a.verdict.map(Verdict::as_str),
        a.check_error.as_deref(),
        scores,
        a.reasks,
        a.code.as_ref().map(ToString::to_string),
    ))
}

/// An assessment from its stored columns.
fn assessment_of(
    parsed: Option<String>,
    verdict: Option<String>,
    check_error: Option<String>,
    scores: Option<String>,
    reasks: u32,
    judge: Option<String>,
) -> Result<Assessment, StoreError> {
    Ok(Assessment {
        parsed: json_column(parsed)?,
        verdict: verdict
            .as_deref()
            .map(Verdict::parse)
            .transpose()
            .map_err(unknown)?,
        check_error,
        scores: match scores {
            Some(text) => serde_json::from_str::<Scores>(&text)
                .map_err(json_err("stored scores cannot be read"))?,
            None => Scores::new(),
        },
        reasks,
        code: json_column(judge)?,
    })
}

const RUN_COLUMNS: &str = "run_id, name, status, created_at, updated_at, config, config_dir, fingerprint, dataset, \
                           total, sessions, message";

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
    })
}

struct RawRun {
    run_id: String,
    name: String,
    status: String,
    created_at: i64,
    updated_at: i64,
    config: String,
    config_dir: String,
    fingerprint: String,
    dataset: String,
    total: i64,
    sessions: i64,
    message: Option<String>,
}

impl RawRun {
    fn decode(self) -> Result<RunRecord, StoreError> {
        Ok(RunRecord {
            status: status_of(&self.status)?,
            config: serde_json::from_str(&self.config)
                .map_err(json_err("the stored config is not JSON"))?,
            fingerprint: serde_json::from_str::<Fingerprint>(&self.fingerprint)
                .map_err(json_err("the stored fingerprint cannot be read"))?,
            dataset: serde_json::from_str::<DatasetIdentity>(&self.dataset)
                .map_err(json_err("the stored dataset identity cannot be read"))?,
            run_id: self.run_id,
            name: self.name,
            created_at_ms: self.created_at,
            updated_at_ms: self.updated_at,
            config_dir: self.config_dir,
            total: self.total as u64,
            sessions: self.sessions as u32,
            message: self.message,
        })
    }
}

fn opt_u64(value: Option<u64>) -> Option<i64> {
    value.map(|v| v as i64)
}

impl Store for SqliteStore {
    fn create_run(
        &mut self,
        run: &NewRun,
        items: &mut dyn ItemSource,
    ) -> Result<RunRecord, CreateRunError> {
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(db_err("cannot begin the run's transaction"))?;
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

    fn lock_run(&mut self, run_id: &str) -> Result<RunGuard, StoreError> {
        match self.try_lock(run_id)? {
            Some(file) => Ok(RunGuard(Box::new(file))),
            None => Err(StoreError::RunBusy(run_id.to_owned())),
        }
    }

    fn is_run_active(&mut self, run_id: &str) -> Result<bool, StoreError> {
        Ok(self.try_lock(run_id)?.is_none())
    }

    fn begin_session(
        &mut self,
        run_id: &str,
        retry_failed: bool,
    ) -> Result<SessionStart, StoreError> {
        let rid = self.rid(run_id)?;
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(db_err("cannot begin a session"))?;
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
        tx.execute(
            "UPDATE runs SET status = 'running', sessions = sessions + 1, updated_at = ?2, message = NULL,
                 failed = failed - ?3
             WHERE rid = ?1",
            params![rid, now_ms(), reset as i64],
        )
        .map_err(db_err("cannot start the session"))?;
        let session: i64 = tx
            .query_row("SELECT sessions FROM runs WHERE rid = ?1", [rid], |row| {
                row.get(0)
            })
            .map_err(db_err("cannot read the session"))?;
        tx.commit()
            .map_err(db_err("cannot commit the session start"))?;
        Ok(SessionStart {
            session: session as u32,
            reset,
            counts: self.counts(run_id)?,
        })
    }

    fn pending_items(
        &mut self,
        run_id: &str,
        after_seq: Option<u64>,
        limit: usize,
    ) -> Result<Vec<PendingItem>, StoreError> {
        let rid = self.rid(run_id)?;
        // Counting earlier attempts costs a lookup per item; a run without
        // attempts (a first session) skips it. Asked once per connection, so
        // this session's own attempts never count as earlier ones.
        let had_attempts = match self.had_attempts.get(&rid) {
            Some(had) => *had,
            None => {
                let had: bool = self
                    .conn
                    .query_row(
                        "SELECT EXISTS (SELECT 1 FROM attempts WHERE rid = ?1)",
                        [rid],
                        |row| row.get(0),
                    )
                    .map_err(db_err("cannot read attempts"))?;
                self.had_attempts.insert(rid, had);
                had
            }
        };
        let sql = if had_attempts {
            "SELECT i.item_id, i.seq, i.line, i.offset,
                    (SELECT COUNT(*) FROM attempts a WHERE a.rid = i.rid AND a.seq = i.seq)
             FROM items i
             WHERE i.rid = ?1 AND i.state = 'pending' AND i.seq > ?2
             ORDER BY i.seq LIMIT ?3"
        } else {
            "SELECT i.item_id, i.seq, i.line, i.offset, 0
             FROM items i
             WHERE i.rid = ?1 AND i.state = 'pending' AND i.seq > ?2
             ORDER BY i.seq LIMIT ?3"
        };
        let mut stmt = self
            .conn
            .prepare_cached(sql)
            .map_err(db_err("cannot read pending items"))?;
        let after = after_seq.map_or(-1, |s| s as i64);
        stmt.query_map(params![rid, after, limit as i64], |row| {
            Ok(PendingItem {
                item_id: row.get(0)?,
                seq: row.get::<_, i64>(1)? as u64,
                line: row.get::<_, i64>(2)? as u64,
                offset: row.get::<_, i64>(3)? as u64,
                prior_attempts: row.get::<_, i64>(4)? as u32,
            })
        })
        .map_err(db_err("cannot read pending items"))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(db_err("cannot read pending items"))
    }

    fn commit(&mut self, run_id: &str, batch: &Batch) -> Result<(), StoreError> {
        let rid = self.rid(run_id)?;
        let cache_db = self.cache_db;
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(db_err("cannot begin a batch"))?;
        {
            let mut attempt = tx
                .prepare_cached(
                    "INSERT INTO attempts (rid, seq, attempt, session, endpoint, model, sent_at, latency_ms,
                         ttft_ms, tpot_ms, prompt_tokens, completion_tokens, finish_reason, http_status,
                         error_class, error, cached)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17)",
                )
                .map_err(db_err("cannot prepare the attempt insert"))?;
            for a in &batch.attempts {
                attempt
                    .execute(params![
                        rid,
                        a.seq as i64,
                        a.attempt,
                        a.session,
                        a.telemetry.endpoint,
                        a.telemetry.model,
                        a.sent_at_ms,
                        a.telemetry.latency_ms,
                        a.telemetry.ttft_ms,
                        a.telemetry.tpot_ms,
                        opt_u64(a.telemetry.prompt_tokens),
                        opt_u64(a.telemetry.completion_tokens),
                        a.telemetry.finish_reason,
                        a.http_status,
                        a.error_class.map(ErrorClass::as_str),
                        a.error,
                        a.cached,
                    ])
                    .map_err(db_err("cannot record an attempt"))?;
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
            let mut state = tx
                .prepare_cached(
                    "UPDATE items SET state = ?3 WHERE rid = ?1 AND seq = ?2 AND state = 'pending'",
                )
                .map_err(db_err("cannot prepare the state update"))?;
            let mut result = tx
                .prepare_cached(
                    "INSERT INTO results (rid, seq, item_id, status, output, error, endpoint, model, attempts,
                         latency_ms, ttft_ms, tpot_ms, prompt_tokens, completion_tokens, finish_reason, item,
                         finished_at, parsed, verdict, check_error, scores, reasks, judge)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17,
                             ?18, ?19, ?20, ?21, ?22, ?23)",
                )
                .map_err(db_err("cannot prepare the result insert"))?;
            for r in &batch.results {
                let changed = state
                    .execute(params![rid, r.seq as i64, r.status.as_str()])
                    .map_err(db_err("cannot update an item's state"))?;
                if changed != 1 {
                    return Err(StoreError::Invariant(format!(
                        "item '{}' of run '{run_id}' got a second result",
                        r.item_id
                    )));
                }
                let (parsed, verdict, check_error, scores, reasks, judge) =
                    assessment_columns(&r.assessment)?;
                let t = r.telemetry.as_ref();
                result
                    .execute(params![
                        rid,
                        r.seq as i64,
                        r.item_id,
                        r.status.as_str(),
                        r.output,
                        r.error,
                        t.map(|t| &t.endpoint),
                        t.map(|t| &t.model),
                        r.attempts,
                        t.map(|t| t.latency_ms),
                        t.and_then(|t| t.ttft_ms),
                        t.and_then(|t| t.tpot_ms),
                        opt_u64(t.and_then(|t| t.prompt_tokens)),
                        opt_u64(t.and_then(|t| t.completion_tokens)),
                        t.and_then(|t| t.finish_reason.as_ref()),
                        r.item,
                        r.finished_at_ms,
                        parsed,
                        verdict,
                        check_error,
                        scores,
                        reasks,
                        judge,
                    ])
                    .map_err(db_err("cannot record a result"))?;
            }
        }
        let failed = batch
            .results
            .iter()
            .filter(|r| r.status == ItemStatus::Failed)
            .count() as i64;
        let done = batch.results.len() as i64 - failed;
        tx.execute(
            "UPDATE runs SET updated_at = ?2, done = done + ?3, failed = failed + ?4 WHERE rid = ?1",
            params![rid, now_ms(), done, failed],
        )
        .map_err(db_err("cannot update the run"))?;
        tx.commit().map_err(db_err("cannot commit a batch"))
    }

    fn set_status(
        &mut self,
        run_id: &str,
        status: RunStatus,
        message: Option<&str>,
    ) -> Result<(), StoreError> {
        let rid = self.rid(run_id)?;
        self.conn
            .execute(
                "UPDATE runs SET status = ?2, message = ?3, updated_at = ?4 WHERE rid = ?1",
                params![rid, status.as_str(), message, now_ms()],
            )
            .map_err(db_err("cannot set the run's status"))?;
        Ok(())
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

    fn add_event(&mut self, run_id: &str, event: &Event) -> Result<(), StoreError> {
        let rid = self.rid(run_id)?;
        self.conn
            .execute(
                "INSERT INTO events (rid, at, kind, endpoint, message) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![
                    rid,
                    event.at_ms,
                    event.kind.as_str(),
                    event.endpoint,
                    event.message
                ],
            )
            .map_err(db_err("cannot record an event"))?;
        Ok(())
    }

    fn events(&mut self, run_id: &str) -> Result<Vec<Event>, StoreError> {
        let rid = self.rid(run_id)?;
        let mut stmt = self
            .conn
            .prepare(
                "SELECT at, kind, endpoint, message FROM events WHERE rid = ?1 ORDER BY at, rowid",
            )
            .map_err(db_err("cannot read events"))?;
        let rows = stmt
            .query_map([rid], |row| {
                Ok((
                    row.get::<_, i64>(0)?,
                    row.get::<_, String>(1)?,
                    row.get::<_, Option<String>>(2)?,
                    row.get::<_, String>(3)?,
                ))
            })
            .map_err(db_err("cannot read events"))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(db_err("cannot read events"))?;
        rows.into_iter()
            .map(|(at_ms, kind, endpoint, message)| {
                Ok(Event {
                    at_ms,
                    kind: EventKind::parse(&kind).map_err(unknown)?,
                    endpoint,
                    message,
                })
            })
            .collect()
    }

    fn scan_attempts(
        &mut self,
        run_id: &str,
        each: &mut dyn FnMut(AttemptSample),
    ) -> Result<(), StoreError> {
        let rid = self.rid(run_id)?;
        let mut stmt = self
            .conn
            .prepare(
                "SELECT endpoint, latency_ms, ttft_ms, tpot_ms, completion_tokens, error_class,
                        error IS NOT NULL
                 FROM attempts WHERE rid = ?1",
            )
            .map_err(db_err("cannot read attempts"))?;
        let mut rows = stmt.query([rid]).map_err(db_err("cannot read attempts"))?;
        while let Some(row) = rows.next().map_err(db_err("cannot read attempts"))? {
            let class: Option<String> = row.get(5).map_err(db_err("cannot read attempts"))?;
            each(AttemptSample {
                endpoint: row.get(0).map_err(db_err("cannot read attempts"))?,
                latency_ms: row.get(1).map_err(db_err("cannot read attempts"))?,
                ttft_ms: row.get(2).map_err(db_err("cannot read attempts"))?,
                tpot_ms: row.get(3).map_err(db_err("cannot read attempts"))?,
                completion_tokens: row
                    .get::<_, Option<i64>>(4)
                    .map_err(db_err("cannot read attempts"))?
                    .map(|t| t as u64),
                error_class: class
                    .as_deref()
                    .map(ErrorClass::parse)
                    .transpose()
                    .map_err(unknown)?,
                failed: row.get(6).map_err(db_err("cannot read attempts"))?,
            });
        }
        Ok(())
    }

    fn put_endpoint_states(
        &mut self,
        run_id: &str,
        states: &[EndpointSnapshot],
    ) -> Result<(), StoreError> {
        let rid = self.rid(run_id)?;
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(db_err("cannot store endpoint states"))?;
        {
            let mut upsert = tx
                .prepare_cached(
                    "INSERT INTO endpoint_states (rid, endpoint, snapshot, updated_at) VALUES (?1, ?2, ?3, ?4)
                     ON CONFLICT (rid, endpoint) DO UPDATE SET snapshot = ?3, updated_at = ?4",
                )
                .map_err(db_err("cannot store endpoint states"))?;
            let now = now_ms();
            for state in states {
                let json = serde_json::to_string(state)
                    .map_err(json_err("cannot encode an endpoint state"))?;
                upsert
                    .execute(params![rid, state.endpoint, json, now])
                    .map_err(db_err("cannot store endpoint states"))?;
            }
        }
        tx.commit().map_err(db_err("cannot store endpoint states"))
    }

    fn endpoint_states(&mut self, run_id: &str) -> Result<Option<EndpointStates>, StoreError> {
        let rid = self.rid(run_id)?;
        let mut stmt = self
            .conn
            .prepare(
                "SELECT snapshot, updated_at FROM endpoint_states WHERE rid = ?1 ORDER BY endpoint",
            )
            .map_err(db_err("cannot read endpoint states"))?;
        let rows = stmt
            .query_map([rid], |row| {
                Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)?))
            })
            .map_err(db_err("cannot read endpoint states"))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(db_err("cannot read endpoint states"))?;
        if rows.is_empty() {
            return Ok(None);
        }
        let updated_at_ms = rows.iter().map(|(_, at)| *at).max().unwrap_or(0);
        let endpoints = rows
            .into_iter()
            .map(|(json, _)| {
                serde_json::from_str(&json)
                    .map_err(json_err("a stored endpoint state cannot be read"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Some(EndpointStates {
            updated_at_ms,
            endpoints,
        }))
    }

    fn request_fleet_change(
        &mut self,
        run_id: &str,
        change: &FleetChange,
    ) -> Result<(), StoreError> {
        let rid = self.rid(run_id)?;
        self.conn
            .execute(
                "INSERT INTO fleet_changes (rid, at, action, endpoint) VALUES (?1, ?2, ?3, ?4)",
                params![rid, change.at_ms, change.action.as_str(), change.endpoint],
            )
            .map_err(db_err("cannot record the fleet change"))?;
        Ok(())
    }

    fn take_fleet_changes(&mut self, run_id: &str) -> Result<Vec<FleetChange>, StoreError> {
        let rid = self.rid(run_id)?;
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(db_err("cannot read fleet changes"))?;
        let changes = {
            let mut stmt = tx
                .prepare_cached("SELECT id, at, action, endpoint FROM fleet_changes WHERE rid = ?1 AND taken = 0 ORDER BY id")
                .map_err(db_err("cannot read fleet changes"))?;
            let rows = stmt
                .query_map([rid], |row| {
                    Ok((
                        row.get::<_, i64>(0)?,
                        row.get::<_, i64>(1)?,
                        row.get::<_, String>(2)?,
                        row.get::<_, String>(3)?,
                    ))
                })
                .map_err(db_err("cannot read fleet changes"))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(db_err("cannot read fleet changes"))?;
            rows.into_iter()
                .map(|(id, at_ms, action, endpoint)| {
                    Ok(FleetChange {
                        id,
                        action: FleetAction::parse(&action).map_err(unknown)?,
                        endpoint,
                        at_ms,
                    })
                })
                .collect::<Result<Vec<_>, StoreError>>()?
        };
        if !changes.is_empty() {
            tx.execute(
                "UPDATE fleet_changes SET taken = 1 WHERE rid = ?1 AND taken = 0",
                [rid],
            )
            .map_err(db_err("cannot mark fleet changes"))?;
        }
        tx.commit().map_err(db_err("cannot read fleet changes"))?;
        Ok(changes)
    }

    fn export(
        &mut self,
        run_id: &str,
        each: &mut dyn FnMut(ExportRow) -> std::io::Result<()>,
    ) -> Result<(), ExportError> {
        let rid = self.rid(run_id)?;
        let mut stmt = self
            .conn
            .prepare(
                "SELECT r.item_id, r.status, r.output, r.error, r.endpoint, r.model, r.attempts, r.latency_ms,
                        r.ttft_ms, r.tpot_ms, r.prompt_tokens, r.completion_tokens, r.item,
                        r.parsed, r.verdict, r.scores, r.judge
                 FROM results r WHERE r.rid = ?1 ORDER BY r.seq",
            )
            .map_err(db_err("cannot export"))?;
        let mut rows = stmt.query([rid]).map_err(db_err("cannot export"))?;
        while let Some(row) = rows.next().map_err(db_err("cannot export"))? {
            let get_err = db_err("cannot export");
            let item: Option<String> = row.get(12).map_err(&get_err)?;
            let item = match item {
                Some(text) => {
                    serde_json::from_str(&text).map_err(json_err("a stored item is not JSON"))?
                }
                None => serde_json::Value::Null,
            };
            let status: String = row.get(1).map_err(&get_err)?;
            let scores: Option<String> = row.get(15).map_err(&get_err)?;
            each(ExportRow {
                item_id: row.get(0).map_err(&get_err)?,
                status: ItemStatus::parse(&status).map_err(unknown)?,
                output: row.get(2).map_err(&get_err)?,
                error: row.get(3).map_err(&get_err)?,
                endpoint: row.get(4).map_err(&get_err)?,
                model: row.get(5).map_err(&get_err)?,
                attempts: row.get(6).map_err(&get_err)?,
                latency_ms: row.get(7).map_err(&get_err)?,
                ttft_ms: row.get(8).map_err(&get_err)?,
                tpot_ms: row.get(9).map_err(&get_err)?,
                prompt_tokens: row
                    .get::<_, Option<i64>>(10)
                    .map_err(&get_err)?
                    .map(|t| t as u64),
                completion_tokens: row
                    .get::<_, Option<i64>>(11)
                    .map_err(&get_err)?
                    .map(|t| t as u64),
                item,
                parsed: json_column(row.get(13).map_err(&get_err)?)?,
                valid: row
                    .get::<_, Option<String>>(14)
                    .map_err(&get_err)?
                    .map(|v| v == "ok"),
                scores: scores
                    .map(|text| {
                        serde_json::from_str::<Scores>(&text)
                            .map_err(json_err("stored scores cannot be read"))
                    })
                    .transpose()?,
                judge: json_column(row.get(16).map_err(&get_err)?)?,
            })?;
        }
        Ok(())
    }

    fn cache_get(&mut self, key: &str, since_ms: i64) -> Result<Option<CacheEntry>, StoreError> {
        let err = db_err("cannot read the cache");
        self.conn
            .prepare_cached(&format!(
                "SELECT content, endpoint, model, prompt_tokens, completion_tokens, finish_reason,
                        latency_ms, created_at
                 FROM {db}.cache WHERE key = unhex(?1) AND created_at >= ?2",
                db = self.cache_db
            ))
            .map_err(&err)?
            .query_row(params![key, since_ms], |row| {
                Ok(CacheEntry {
                    key: key.to_owned(),
                    content: row.get(0)?,
                    endpoint: row.get(1)?,
                    model: row.get(2)?,
                    prompt_tokens: row.get::<_, Option<i64>>(3)?.map(|t| t as u64),
                    completion_tokens: row.get::<_, Option<i64>>(4)?.map(|t| t as u64),
                    finish_reason: row.get(5)?,
                    latency_ms: row.get(6)?,
                    created_at_ms: row.get(7)?,
                })
            })
            .optional()
            .map_err(&err)
    }

    fn cache_evict(
        &mut self,
        before_ms: Option<i64>,
        max_entries: Option<u64>,
    ) -> Result<u64, StoreError> {
        let err = db_err("cannot evict from the cache");
        let mut gone = 0;
        if let Some(before) = before_ms {
            gone += self
                .conn
                .execute(
                    &format!(
                        "DELETE FROM {db}.cache WHERE created_at < ?1",
                        db = self.cache_db
                    ),
                    [before],
                )
                .map_err(&err)? as u64;
        }
        if let Some(max) = max_entries {
            gone += self
                .conn
                .execute(
                    &format!(
                        "DELETE FROM {db}.cache WHERE rowid IN (SELECT rowid FROM {db}.cache ORDER BY rowid
                         LIMIT max(0, (SELECT COUNT(*) FROM {db}.cache) - ?1))",
                        db = self.cache_db
                    ),
                    [max as i64],
                )
                .map_err(&err)? as u64;
        }
        Ok(gone)
    }

    fn cache_stats(&mut self) -> Result<CacheStats, StoreError> {
        let err = db_err("cannot read the cache");
        let (entries, content_bytes, oldest_ms, newest_ms): (i64, i64, Option<i64>, Option<i64>) = self
            .conn
            .query_row(
                &format!(
                    "SELECT COUNT(*), COALESCE(SUM(length(CAST(content AS BLOB))), 0), MIN(created_at), MAX(created_at) FROM {db}.cache",
                    db = self.cache_db
                ),
                [],
                |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?)),
            )
            .map_err(&err)?;
        let hits: i64 = self
            .conn
            .query_row(
                "SELECT COUNT(*) FROM attempts WHERE cached = 1",
                [],
                |row| row.get(0),
            )
            .map_err(&err)?;
        Ok(CacheStats {
            entries: entries as u64,
            content_bytes: content_bytes as u64,
            oldest_ms,
            newest_ms,
            hits: hits as u64,
        })
    }

    fn cache_clear(&mut self) -> Result<u64, StoreError> {
        self.conn
            .execute(&format!("DELETE FROM {db}.cache", db = self.cache_db), [])
            .map(|n| n as u64)
            .map_err(db_err("cannot clear the cache"))
    }

    fn scan_results(
        &mut self,
        run_id: &str,
        each: &mut dyn FnMut(StoredResult),
    ) -> Result<(), StoreError> {
        let rid = self.rid(run_id)?;
        let err = db_err("cannot read results");
        let mut stmt = self
            .conn
            .prepare(
                "SELECT seq, item_id, status, output, endpoint, model, item, parsed, verdict,
                        check_error, scores, reasks, judge
                 FROM results WHERE rid = ?1 ORDER BY seq",
            )
            .map_err(&err)?;
        let mut rows = stmt.query([rid]).map_err(&err)?;
        while let Some(row) = rows.next().map_err(&err)? {
            let status: String = row.get(2).map_err(&err)?;
            each(StoredResult {
                seq: row.get::<_, i64>(0).map_err(&err)? as u64,
                item_id: row.get(1).map_err(&err)?,
                status: ItemStatus::parse(&status).map_err(unknown)?,
                output: row.get(3).map_err(&err)?,
                endpoint: row.get(4).map_err(&err)?,
                model: row.get(5).map_err(&err)?,
                item: row.get(6).map_err(&err)?,
                assessment: assessment_of(
                    row.get(7).map_err(&err)?,
                    row.get(8).map_err(&err)?,
                    row.get(9).map_err(&err)?,
                    row.get(10).map_err(&err)?,
                    row.get(11).map_err(&err)?,
                    row.get(12).map_err(&err)?,
                )?,
            });
        }
        Ok(())
    }

    fn put_assessments(
        &mut self,
        run_id: &str,
        assessments: &[(u64, Assessment)],
        config: &serde_json::Value,
    ) -> Result<(), StoreError> {
        let rid = self.rid(run_id)?;
        let err = db_err("cannot store new scores");
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(&err)?;
        {
            let mut update = tx
                .prepare_cached(
                    "UPDATE results SET parsed = ?3, verdict = ?4, check_error = ?5, scores = ?6,
                         judge = COALESCE(?7, judge)
                     WHERE rid = ?1 AND seq = ?2",
                )
                .map_err(&err)?;
            for (seq, a) in assessments {
                let (parsed, verdict, check_error, scores, _, judge) = assessment_columns(a)?;
                update
                    .execute(params![
                        rid,
                        *seq as i64,
                        parsed,
                        verdict,
                        check_error,
                        scores,
                        judge
                    ])
                    .map_err(&err)?;
            }
            let config =
                serde_json::to_string(config).map_err(json_err("cannot store the config"))?;
            tx.execute(
                "UPDATE runs SET config = ?2, updated_at = ?3 WHERE rid = ?1",
                params![rid, config, now_ms()],
            )
            .map_err(&err)?;
        }
        tx.commit().map_err(&err)
    }
}

/// A column holding JSON text, parsed.
fn json_column(text: Option<String>) -> Result<Option<serde_json::Value>, StoreError> {
    text.map(|t| serde_json::from_str(&t).map_err(json_err("a stored value is not JSON")))
        .transpose()
}
