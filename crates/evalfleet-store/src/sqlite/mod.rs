//! The embedded store: one SQLite file in WAL mode. Results, item states and
//! attempts are committed together, one transaction per batch, with
//! `synchronous = FULL`, so a committed result survives a crash or a power
//! loss and an uncommitted one is simply still pending.
//!
//! Each concern of [`crate`] is implemented in a module of
//! its own: `runs`, `queue` (claims and commits), `results`, `cache`,
//! `events` (with the fleet mailbox), `explore` (pages of items), `kept`
//! (reports computed once) and `calls` (agents' calls read back).

mod cache;
mod calls;
mod events;
mod explore;
mod kept;
mod queue;
mod resources;
mod results;
mod runs;
pub mod schema;

use std::cell::Cell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::StoreError;
use rusqlite::{Connection, OpenFlags, OptionalExtension, TransactionBehavior};

/// A SQLite store file.
pub struct SqliteStore {
    conn: Connection,
    path: PathBuf,
    rids: HashMap<String, i64>,
    /// The database holding the cache table: `main`, or `cache_file` when
    /// a cache file of its own is attached.
    cache_db: &'static str,
}

/// A SQLite file is one machine's: no other worker shares its quotas, so
/// each endpoint's own rate limiter is the only one (the trait's defaults).
impl crate::Quotas for SqliteStore {}

pub(crate) fn db_err(context: &str) -> impl Fn(rusqlite::Error) -> StoreError + '_ {
    move |err| match unwritable(&err) {
        Some(reason) => StoreError::Unwritable {
            message: context.to_owned(),
            reason: format!("{reason} ({err})"),
        },
        None => StoreError::backend(context, err),
    }
}

/// Why SQLite refused a write, when `err` says it cannot write at all.
fn unwritable(err: &rusqlite::Error) -> Option<&'static str> {
    use rusqlite::ErrorCode;
    match err.sqlite_error_code()? {
        ErrorCode::DiskFull => Some("the disk holding it is full"),
        ErrorCode::ReadOnly => Some("its file or folder is read-only"),
        ErrorCode::CannotOpen | ErrorCode::PermissionDenied => {
            Some("its file or folder cannot be written")
        }
        ErrorCode::SystemIoFailure => Some("its disk failed a write (or is full)"),
        _ => None,
    }
}

pub(crate) use crate::columns::{json_column, json_err, opt_u64, unknown};

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
        check_header(path)?;
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

    /// Opens a store that must already exist, to read it only: nothing is
    /// written to it, so it may belong to another user or lie on a
    /// read-only disk. A store of an older evalfleet is brought up to date
    /// first, when this process may write it.
    pub fn open_read_only(path: &Path) -> Result<Self, StoreError> {
        if !path.is_file() {
            return Err(StoreError::NoStore(path.to_owned()));
        }
        let (conn, version) = connect_read_only(path)?;
        let version = match version {
            Some(version) => version,
            None => {
                return Err(StoreError::NotAStore {
                    path: path.to_owned(),
                    why: "the file is empty".to_owned(),
                });
            }
        };
        let conn = if version < schema::VERSION as i64 {
            drop(conn);
            drop(Self::open(path).map_err(|err| StoreError::Backend {
                message: format!(
                    "{} is a store of an older evalfleet (version {version}) and cannot be brought up to date by this process: {}",
                    path.display(),
                    evalfleet_types::error_text(&err)
                ),
                source: None,
            })?);
            connect_read_only(path)?.0
        } else {
            conn
        };
        size_the_cache(&conn)?;
        Ok(Self {
            conn,
            path: path.to_owned(),
            rids: HashMap::new(),
            cache_db: "main",
        })
    }

    fn init(mut conn: Connection, path: &Path) -> Result<Self, StoreError> {
        wait_for_locks(&conn)?;
        identify(&conn, path)?;
        size_the_cache(&conn)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(db_err("cannot switch the store to WAL mode"))?;
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(db_err("cannot set synchronous mode"))?;
        conn.pragma_update(None, "foreign_keys", "ON")
            .map_err(db_err("cannot enable foreign keys"))?;
        migrate(&mut conn, path)?;
        Ok(Self {
            conn,
            path: path.to_owned(),
            rids: HashMap::new(),
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

    /// Runs `work` without waiting for the disk, for writes whose loss in a
    /// power cut costs nothing: a claim, a renewal or a release (its items
    /// are still pending, and leases run out), an endpoint's snapshot (the
    /// next one replaces it). The next durable commit writes them to disk
    /// anyway (the write-ahead log is one sequential file). Each would
    /// otherwise wait for a sync, and hold the writer's commits up while it
    /// does.
    pub(super) fn without_sync<T>(
        &mut self,
        work: impl FnOnce(&mut Self) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        // Prepared once per connection: a claim, many a second, would
        // otherwise parse both pragmas each time.
        let relax = db_err("cannot set synchronous mode");
        execute_cached(&self.conn, "PRAGMA synchronous = NORMAL", []).map_err(&relax)?;
        let result = work(self);
        execute_cached(&self.conn, "PRAGMA synchronous = FULL", []).map_err(&relax)?;
        result
    }

    /// A write transaction that takes the file's write lock at once (one
    /// that read first could fail to take it later); `context` names what
    /// could not begin.
    fn write(&mut self, context: &str) -> Result<Write<'_>, StoreError> {
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(db_err(context))?;
        Ok(Write { tx, ended: Ended })
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
}

/// How long a connection waits for another's write lock before it gives up.
const LOCK_WAIT: Duration = Duration::from_secs(30);
/// How often it looks again meanwhile, at the latest.
const LOCK_POLL: Duration = Duration::from_micros(250);

/// A write transaction of this process (see [`SqliteStore::write`]): when
/// it ends, committed or not, the connections of this process waiting for
/// the write lock look again at once.
pub(super) struct Write<'c> {
    /// Dropped first: rolled back where it was not committed...
    tx: rusqlite::Transaction<'c>,
    /// ...then the waiters are told.
    ended: Ended,
}

/// Tells the waiters for the write lock that a write transaction ended.
struct Ended;

impl Drop for Ended {
    fn drop(&mut self) {
        LOCK_FREED.tell();
    }
}

impl<'c> std::ops::Deref for Write<'c> {
    type Target = rusqlite::Transaction<'c>;

    fn deref(&self) -> &Self::Target {
        &self.tx
    }
}

impl Write<'_> {
    pub(super) fn commit(self) -> rusqlite::Result<()> {
        let Self { tx, ended } = self;
        let committed = tx.commit();
        drop(ended);
        committed
    }
}

/// How many write transactions of this process have ended, and a wait for
/// the next to end.
struct Freed {
    state: Mutex<FreedState>,
    changed: Condvar,
}

struct FreedState {
    ended: u64,
    /// Connections waiting: a write that ends with none wakes no one (no
    /// system call at every commit of a process that never waits).
    waiting: u32,
}

static LOCK_FREED: Freed = Freed::new();

impl Freed {
    const fn new() -> Self {
        Self {
            state: Mutex::new(FreedState {
                ended: 0,
                waiting: 0,
            }),
            changed: Condvar::new(),
        }
    }

    fn tell(&self) {
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        state.ended = state.ended.wrapping_add(1);
        if state.waiting > 0 {
            self.changed.notify_all();
        }
    }

    /// Waits until a write transaction of this process ends, for at most
    /// `limit`; whether one ended.
    fn wait(&self, limit: Duration) -> bool {
        let Ok(mut state) = self.state.lock() else {
            std::thread::sleep(limit);
            return false;
        };
        let seen = state.ended;
        state.waiting += 1;
        let (mut state, woken) = match self
            .changed
            .wait_timeout_while(state, limit, |state| state.ended == seen)
        {
            Ok((state, waited)) => (state, !waited.timed_out()),
            Err(poisoned) => {
                let (state, _) = poisoned.into_inner();
                (state, false)
            }
        };
        state.waiting -= 1;
        woken
    }
}

thread_local! {
    /// When this thread's connection began to wait for the write lock.
    static WAITING_SINCE: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// SQLite's busy handler: waits for another's write lock for up to
/// `LOCK_WAIT`, trying again as soon as a write transaction of this
/// process ends, and every `LOCK_POLL` at the latest (for a lock another
/// process holds). A session's connections take turns at the write lock
/// many times a second (the writer's commits, the reader's claims):
/// SQLite's own timeout backs off to sleeps of tens of milliseconds, long
/// enough to leave the endpoints without work; and a plain sleep of
/// `LOCK_POLL` kept a claim that waited for a commit asleep after the lock
/// was free (part of a run of 200,000 cached items under strace: 1,598
/// such waits of the reader's claims).
fn wait_for_the_lock(tries: i32) -> bool {
    let now = Instant::now();
    let since = WAITING_SINCE.with(|since| {
        if tries == 0 || since.get().is_none() {
            since.set(Some(now));
        }
        since.get().unwrap_or(now)
    });
    if now.duration_since(since) >= LOCK_WAIT {
        return false;
    }
    LOCK_FREED.wait(LOCK_POLL);
    true
}

/// What every connection has, reading or writing: a wait for another's
/// write lock (set before anything is read)...
fn wait_for_locks(conn: &Connection) -> Result<(), StoreError> {
    conn.busy_handler(Some(wait_for_the_lock))
        .map_err(db_err("cannot set the busy handler"))
}

/// ...and its page cache (set once the file is known to be a store).
fn size_the_cache(conn: &Connection) -> Result<(), StoreError> {
    // Room for every statement a connection prepares once and keeps (a
    // writer's commit alone uses about twenty; rusqlite keeps 16 by default and
    // parses again whatever it dropped).
    conn.set_prepared_statement_cache_capacity(64);
    // 8 MiB of page cache per connection: batches append near the end of
    // their tables, so the pages they touch are few and recent.
    conn.pragma_update(None, "cache_size", -8_192)
        .map_err(db_err("cannot set the cache size"))
}

/// Runs `sql` as a statement prepared once per connection (kept in its
/// statement cache): for statements run many times a second.
pub(super) fn execute_cached(
    conn: &Connection,
    sql: &str,
    params: impl rusqlite::Params,
) -> rusqlite::Result<usize> {
    conn.prepare_cached(sql)?.execute(params)
}

/// A connection that looks up many cached answers reads the file through
/// a memory map. In WAL mode every commit of another connection (the
/// writer's, hundreds a run) empties a connection's page cache, so each
/// page of lookups reads its pages again: from the map that is a pointer,
/// not a `pread` and a copy of each page (W6's lookups spent nearly half
/// their time there). Pages of the write-ahead log and past the map's end are
/// read as before. Only such connections map (runs that read the cache:
/// the reader's and the lookup thread's): the pages a mapping touches
/// count in the process's resident size, and a run of a million items
/// that mapped every connection showed 291 MB where it uses 46 (W5).
const MAP_BYTES: i64 = 1 << 30;

pub(super) fn map_reads(conn: &Connection) {
    // The pragma answers with the size it took (0 where the build cannot
    // map); reads work either way, so a refusal is only logged.
    if let Err(err) = conn
        .query_row(&format!("PRAGMA mmap_size = {MAP_BYTES}"), [], |_| Ok(()))
        .optional()
    {
        tracing::debug!("The store is read without a map: {err}.");
    }
}

/// Whether the file at `path` (open on `conn`) is an evalfleet store, read
/// before anything is written to it: its schema version, or `None` for an
/// empty database (a store about to be made). A file that is not SQLite,
/// a database of another program, or a store of a newer evalfleet is
/// refused, named with its path.
fn identify(conn: &Connection, path: &Path) -> Result<Option<i64>, StoreError> {
    let not_a_store = |why: &str| StoreError::NotAStore {
        path: path.to_owned(),
        why: why.to_owned(),
    };
    let version: i64 = match conn.query_row("PRAGMA user_version", [], |row| row.get(0)) {
        Ok(version) => version,
        Err(err) if err.sqlite_error_code() == Some(rusqlite::ErrorCode::NotADatabase) => {
            return Err(not_a_store("the file is not a SQLite database"));
        }
        Err(err) => {
            return Err(StoreError::backend(
                format!("cannot read {}", path.display()),
                err,
            ));
        }
    };
    if version > schema::VERSION as i64 {
        return Err(StoreError::NewerStore {
            path: path.to_owned(),
            version,
            known: schema::VERSION as i64,
        });
    }
    if version > 0 {
        return Ok(Some(version));
    }
    let tables: i64 = conn
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table'",
            [],
            |row| row.get(0),
        )
        .map_err(db_err("cannot list the file's tables"))?;
    if tables > 0 {
        return Err(not_a_store(
            "a SQLite database of another program: it has tables but no evalfleet schema",
        ));
    }
    Ok(None)
}

/// Refuses a file that holds bytes but does not begin as every SQLite
/// database does (SQLite would take a file of a few bytes for an empty
/// database, and a store would be made over it).
fn check_header(path: &Path) -> Result<(), StoreError> {
    use std::io::Read;
    let Ok(file) = std::fs::File::open(path) else {
        // Absent (it is made), or unreadable (opening it says why).
        return Ok(());
    };
    let mut head = Vec::with_capacity(16);
    file.take(16)
        .read_to_end(&mut head)
        .map_err(|err| StoreError::backend(format!("cannot read {}", path.display()), err))?;
    if head.is_empty() || head == b"SQLite format 3\0" {
        return Ok(());
    }
    Err(StoreError::NotAStore {
        path: path.to_owned(),
        why: "the file is not a SQLite database".to_owned(),
    })
}

/// A read-only connection to the store at `path`, and what it holds (see
/// [`identify`]). A store in WAL mode is read through its `-shm` file;
/// when that is absent and cannot be made (a directory this user may not
/// write), and no write-ahead log holds changes the file lacks, the file
/// is opened as immutable: no writer has it open then (a writer keeps
/// both files while it lives).
fn connect_read_only(path: &Path) -> Result<(Connection, Option<i64>), StoreError> {
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY
        | OpenFlags::SQLITE_OPEN_URI
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let open = |target: &str| {
        let conn = Connection::open_with_flags(target, flags).map_err(|err| {
            StoreError::backend(format!("cannot open store {}", path.display()), err)
        })?;
        wait_for_locks(&conn)?;
        Ok::<_, StoreError>(conn)
    };
    let plain = path.to_str().map(|p| format!("file:{}", uri_path(p)));
    let Some(plain) = plain else {
        return Err(StoreError::Backend {
            message: format!("the store's name is not UTF-8: {}", path.display()),
            source: None,
        });
    };
    check_header(path)?;
    let conn = open(&plain)?;
    match identify(&conn, path) {
        Ok(version) => Ok((conn, version)),
        Err(StoreError::Backend {
            source: Some(source),
            ..
        }) if matches!(
            source
                .downcast_ref::<rusqlite::Error>()
                .and_then(rusqlite::Error::sqlite_error_code),
            Some(rusqlite::ErrorCode::CannotOpen | rusqlite::ErrorCode::ReadOnly)
        ) =>
        {
            drop(conn);
            let mut wal = path.as_os_str().to_owned();
            wal.push("-wal");
            let wal = PathBuf::from(wal);
            if std::fs::metadata(&wal).is_ok_and(|m| m.len() > 0) {
                return Err(StoreError::Backend {
                    message: format!(
                        "cannot read {}: its write-ahead log {} holds changes the file lacks, and this user cannot open it to read them (a process that writes the store is still running, or one that crashed left them: they are folded into the file when a process that may write it next closes it)",
                        path.display(),
                        wal.display()
                    ),
                    source: None,
                });
            }
            let conn = open(&format!("{plain}?immutable=1"))?;
            let version = identify(&conn, path)?;
            Ok((conn, version))
        }
        Err(err) => Err(err),
    }
}

/// A path as the path of a `file:` URI: the characters a URI gives a
/// meaning to escaped.
fn uri_path(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for c in path.chars() {
        match c {
            '%' => out.push_str("%25"),
            '?' => out.push_str("%3f"),
            '#' => out.push_str("%23"),
            c => out.push(c),
        }
    }
    out
}

/// Brings the file's schema to [`schema::VERSION`]. Migrations take the
/// write lock first; another process may have run them meanwhile, which is
/// fine.
fn migrate(conn: &mut Connection, path: &Path) -> Result<(), StoreError> {
    conn.set_transaction_behavior(TransactionBehavior::Immediate);
    let result = schema::migrations().to_latest(conn);
    conn.set_transaction_behavior(TransactionBehavior::Deferred);
    let Err(err) = result else {
        return Ok(());
    };
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |row| row.get(0))
        .map_err(db_err("cannot read the schema version"))?;
    if version > schema::VERSION as i64 {
        return Err(StoreError::NewerStore {
            path: path.to_owned(),
            version,
            known: schema::VERSION as i64,
        });
    }
    if version == schema::VERSION as i64 {
        return Ok(());
    }
    Err(StoreError::backend(
        format!("cannot bring the tables of {} up to date", path.display()),
        err,
    ))
}

#[cfg(test)]
mod lock_tests {
    use super::*;

    #[test]
    fn a_wait_for_the_write_lock_ends_when_a_write_of_this_process_ends() {
        let freed = Freed::new();
        std::thread::scope(|scope| {
            // A limit past the test's deadline: only a write's end returns
            // it in time.
            let waiter = scope.spawn(|| freed.wait(Duration::from_secs(60)));
            // Told until it returns: a write that ended before it began to
            // wait does not wake it.
            let deadline = Instant::now() + Duration::from_secs(30);
            while !waiter.is_finished() && Instant::now() < deadline {
                freed.tell();
                std::thread::yield_now();
            }
            assert!(
                waiter.is_finished(),
                "the waiter was not woken by the end of a write"
            );
            assert!(waiter.join().unwrap());
        });
        // With no write ending, it waits out its limit; no one waits after.
        assert!(!freed.wait(Duration::from_millis(1)));
        assert_eq!(freed.state.lock().unwrap().waiting, 0);
    }

    #[test]
    fn the_wait_for_the_write_lock_is_bounded_in_time_not_in_tries() {
        // Woken early by every write of this process, a connection counts
        // its tries faster than its time: it gives up after `LOCK_WAIT`
        // since its first try, however many.
        assert!(wait_for_the_lock(0));
        assert!(wait_for_the_lock(1_000_000));
        let long_ago = Instant::now()
            .checked_sub(LOCK_WAIT + Duration::from_secs(1))
            .expect("a clock past its first half minute");
        WAITING_SINCE.with(|since| since.set(Some(long_ago)));
        assert!(!wait_for_the_lock(3));
        // A new wait starts its own count.
        assert!(wait_for_the_lock(0));
    }
}
