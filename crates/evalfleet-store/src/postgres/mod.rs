//! The shared store: a PostgreSQL database, for workers on many machines
//! that share one run (`--store postgres://...`). PostgreSQL coordinates
//! them: items are claimed with `FOR UPDATE SKIP LOCKED`, leases are
//! measured on the database's clock, and a commit is fenced by the claim it
//! was made under (`queue`), so every item gets exactly one result whoever
//! answers it and whatever dies meanwhile.
//!
//! Each concern of [`crate`] is implemented in a module of
//! its own, as for SQLite. Every method is one transaction, run by
//! [`PgStore::with`]: when the connection is lost (the server restarted,
//! the network cut), it connects again and runs the transaction again, for
//! up to [`RECONNECT_FOR`] (`EVALFLEET_STORE_WAIT`), or for as long as it
//! takes for a run's working connections (a worker rides out an outage of
//! any length); transactions are written so that running one twice stores
//! what running it once does.

mod cache;
mod call_row;
mod calls;
mod events;
mod explore;
mod kept;
mod queue;
mod quotas;
mod resources;
mod results;
mod runs;
pub mod schema;

pub use queue::REAP_EVERY;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::StoreError;
use postgres::error::SqlState;
use postgres::{Client, Config, NoTls};

/// How long a store keeps connecting again after it lost its connection,
/// before the method fails (`EVALFLEET_STORE_WAIT` says otherwise).
pub const RECONNECT_FOR: Duration = Duration::from_secs(120);
/// How often a store that keeps trying says so.
const STILL_TRYING_EVERY: Duration = Duration::from_secs(30);

/// How long a store keeps trying: `EVALFLEET_STORE_WAIT` (a duration,
/// `2m`, `30s`), else [`RECONNECT_FOR`].
fn store_wait() -> Duration {
    std::env::var("EVALFLEET_STORE_WAIT")
        .ok()
        .and_then(|text| humantime::parse_duration(text.trim()).ok())
        .unwrap_or(RECONNECT_FOR)
}
/// The longest wait between two tries.
const RECONNECT_PAUSE_MAX: Duration = Duration::from_secs(2);

/// Why a transaction failed: the database (which may be tried again), or
/// the store's own judgement (which is final).
#[derive(Debug)]
pub(crate) enum Fail {
    Db(postgres::Error),
    Store(StoreError),
}

impl From<postgres::Error> for Fail {
    fn from(err: postgres::Error) -> Self {
        Self::Db(err)
    }
}

impl From<StoreError> for Fail {
    fn from(err: StoreError) -> Self {
        Self::Store(err)
    }
}

pub(crate) type Tx<T> = Result<T, Fail>;

/// Whether a transaction that failed with `err` may be run again: the
/// connection was lost or the server is going away or starting, or the
/// server chose it as a deadlock's or a serialization conflict's loser.
fn transient(err: &postgres::Error) -> bool {
    if err.is_closed() {
        return true;
    }
    if let Some(code) = err.code() {
        let class = &code.code()[..2];
        return class == "08"
            || *code == SqlState::ADMIN_SHUTDOWN
            || *code == SqlState::CRASH_SHUTDOWN
            || *code == SqlState::CANNOT_CONNECT_NOW
            || *code == SqlState::T_R_SERIALIZATION_FAILURE
            || *code == SqlState::T_R_DEADLOCK_DETECTED
            || *code == SqlState::IDLE_SESSION_TIMEOUT;
    }
    // No SQLSTATE: an I/O error, or the server hung up.
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        if cause.is::<std::io::Error>() {
            return true;
        }
        source = cause.source();
    }
    false
}

/// A store error naming what could not be done.
pub(crate) fn db_err(context: &str) -> impl Fn(postgres::Error) -> StoreError + '_ {
    move |err| match unwritable(&err) {
        Some(reason) => StoreError::Unwritable {
            message: context.to_owned(),
            reason: format!("{reason} ({err})"),
        },
        None => StoreError::backend(context, err),
    }
}

/// Why the server refused a write, when `err` says it cannot write at all.
fn unwritable(err: &postgres::Error) -> Option<&'static str> {
    use postgres::error::SqlState;
    let code = err.code()?;
    if *code == SqlState::DISK_FULL {
        Some("the server's disk is full")
    } else if *code == SqlState::READ_ONLY_SQL_TRANSACTION {
        Some("the server takes no writes (a read-only server or replica)")
    } else if *code == SqlState::INSUFFICIENT_RESOURCES || *code == SqlState::OUT_OF_MEMORY {
        Some("the server is out of resources")
    } else {
        None
    }
}

pub(crate) use crate::columns::{json_column, json_err, opt_u64, unknown};

// For the modules that write optional counts (the queue's commits, the
// cache), which are not all here yet.

/// A read-only transaction that sees one snapshot of the store throughout:
/// for reads of several statements that must agree with each other.
pub(crate) fn snapshot(client: &mut Client) -> Result<postgres::Transaction<'_>, postgres::Error> {
    client
        .build_transaction()
        .isolation_level(postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
}

/// A connection and what it learned of the store.
pub(crate) struct Conn {
    pub client: Client,
    rids: HashMap<String, i64>,
    /// Statements prepared on this connection, by their text: each is
    /// prepared once per connection, not once per transaction.
    statements: HashMap<&'static str, postgres::Statement>,
    /// When a claim on this connection last looked for lapsed items to
    /// return to pending, by run (see `queue::reap`): set once its
    /// transaction committed.
    pub reaped_at: HashMap<i64, Instant>,
}

impl Conn {
    pub fn new(client: Client) -> Self {
        Self {
            client,
            rids: HashMap::new(),
            statements: HashMap::new(),
            reaped_at: HashMap::new(),
        }
    }

    /// `sql` prepared on this connection (the first time it is asked for).
    pub fn statement(&mut self, sql: &'static str) -> Result<postgres::Statement, postgres::Error> {
        if let Some(statement) = self.statements.get(sql) {
            return Ok(statement.clone());
        }
        let statement = self.client.prepare(sql)?;
        self.statements.insert(sql, statement.clone());
        Ok(statement)
    }

    /// The run's row id.
    pub fn rid(&mut self, run_id: &str) -> Tx<i64> {
        if let Some(rid) = self.rids.get(run_id) {
            return Ok(*rid);
        }
        let row = self
            .client
            .query_opt("SELECT rid FROM runs WHERE run_id = $1", &[&run_id])?;
        let rid: i64 = row
            .ok_or_else(|| StoreError::NoSuchRun(run_id.to_owned()))?
            .get(0);
        self.rids.insert(run_id.to_owned(), rid);
        Ok(rid)
    }
}

/// A run's counts of items ended and its generation (see `tallies` in the
/// schema), read in `client`'s transaction.
pub(crate) fn tally(
    client: &mut impl postgres::GenericClient,
    rid: i64,
) -> Result<Tally, postgres::Error> {
    let row = client.query_one(
        "SELECT COALESCE(SUM(done), 0)::bigint, COALESCE(SUM(failed), 0)::bigint,
                COALESCE(SUM(generation), 0)::bigint
         FROM tallies WHERE rid = $1",
        &[&rid],
    )?;
    Ok(Tally {
        done: row.get::<_, i64>(0).max(0) as u64,
        failed: row.get::<_, i64>(1).max(0) as u64,
        generation: row.get::<_, i64>(2).max(0) as u64,
    })
}

/// What the rows of `tallies` of a run add up to.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Tally {
    pub done: u64,
    pub failed: u64,
    /// Commits' part of the run's generation (add `runs.generation`).
    pub generation: u64,
}

/// Runs `work`, which blocks on the `postgres` client, where blocking is
/// allowed. The client drives its connection on a runtime of its own,
/// which cannot be entered from a thread of another runtime: the store's
/// methods are called from async code too (as SQLite's are, being quick),
/// so on a worker thread of the process's (multi-threaded) runtime the
/// work is moved out of it first (`block_in_place`), the thread's other
/// tasks going to other workers meanwhile. Elsewhere (a blocking thread,
/// a thread of our own) it runs as it is.
fn outside_runtime<R>(work: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(work)
        }
        _ => work(),
    }
}

/// A PostgreSQL store: one connection, for one thread at a time.
pub struct PgStore {
    conn: Option<Conn>,
    config: Config,
    /// The URL without its password, for messages.
    shown: String,
    read_only: bool,
    /// How long a transaction keeps trying while the server cannot be
    /// reached; `None`: for as long as it takes.
    wait: Option<Duration>,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore").field("url", &self.shown).finish()
    }
}

/// `url` with its password replaced by `***`.
pub fn masked(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (authority, tail) = match rest.find(['/', '?']) {
        Some(at) => rest.split_at(at),
        None => (rest, ""),
    };
    let Some((user_info, host)) = authority.rsplit_once('@') else {
        return url.to_owned();
    };
    match user_info.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}{tail}"),
        None => url.to_owned(),
    }
}

impl PgStore {
    /// Connects to the database at `url` and brings its schema up to date
    /// (creating it in an empty database). With `read_only`, nothing is
    /// written: the schema must be there already.
    pub fn open(url: &str, read_only: bool) -> Result<Self, StoreError> {
        outside_runtime(|| Self::open_here(url, read_only))
    }

    fn open_here(url: &str, read_only: bool) -> Result<Self, StoreError> {
        let shown = masked(url);
        let mut config: Config = url.parse().map_err(|err: postgres::Error| {
            StoreError::BadLocation(format!("'{shown}' is not a PostgreSQL URL: {err}"))
        })?;
        if config.get_application_name().is_none() {
            config.application_name("evalfleet");
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(10));
        }
        // A worker cut off from the server notices within a minute (20 s
        // idle, then 4 probes 10 s apart), rather than when the kernel
        // gives up on the connection (hours); then it connects again.
        config.keepalives(true);
        config.keepalives_idle(Duration::from_secs(20));
        config.keepalives_interval(Duration::from_secs(10));
        config.keepalives_retries(4);
        // And one whose data goes unacknowledged for a minute (a request
        // sent into a cut link) fails, rather than after the kernel's
        // retransmissions give up (about 15 minutes).
        if config.get_tcp_user_timeout().is_none() {
            config.tcp_user_timeout(Duration::from_secs(60));
        }
        let mut store = Self {
            conn: None,
            wait: Some(store_wait()),
            config,
            shown,
            read_only,
        };
        let client = store.config.connect(NoTls).map_err(|err| {
            let message = format!("cannot connect to the store {}", store.shown);
            if transient(&err) {
                StoreError::Unreachable {
                    message,
                    source: Some(Box::new(err)),
                }
            } else {
                StoreError::backend(message, err)
            }
        })?;
        store.conn = Some(Conn::new(client));
        store.prepare()?;
        Ok(store)
    }

    /// From now on a transaction keeps trying while the server cannot be
    /// reached for as long as it takes (a run's working connections).
    pub fn ride_out_outages(&mut self) {
        self.wait = None;
    }

    /// The URL, without its password.
    pub fn url(&self) -> &str {
        &self.shown
    }

    /// Sets the session up and migrates (see `open`).
    fn prepare(&mut self) -> Result<(), StoreError> {
        let (read_only, shown) = (self.read_only, self.shown.clone());
        let conn = self.conn.as_mut().ok_or_else(|| lost(&shown))?;
        match setup(&mut conn.client, read_only, &shown) {
            Ok(()) => Ok(()),
            Err(Fail::Store(err)) => Err(err),
            Err(Fail::Db(err)) => Err(StoreError::backend(
                format!("cannot set up the store {shown}"),
                err,
            )),
        }
    }

    /// Runs `work` (one transaction) on the connection; when the
    /// connection was lost, connects again and runs it again, for up to
    /// [`RECONNECT_FOR`]. `context` names what failed.
    pub(crate) fn with<T>(
        &mut self,
        context: &str,
        work: impl FnMut(&mut Conn) -> Tx<T>,
    ) -> Result<T, StoreError> {
        outside_runtime(|| self.with_here(context, work))
    }

    fn with_here<T>(
        &mut self,
        context: &str,
        mut work: impl FnMut(&mut Conn) -> Tx<T>,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let mut pause = Duration::from_millis(50);
        let mut said = Duration::ZERO;
        loop {
            let outcome = match self.conn.as_mut() {
                Some(conn) => work(conn),
                None => self.reconnect().and_then(|()| match self.conn.as_mut() {
                    Some(conn) => work(conn),
                    None => Err(Fail::Store(lost(&self.shown))),
                }),
            };
            let err = match outcome {
                Ok(value) => return Ok(value),
                Err(Fail::Store(err)) => return Err(err),
                Err(Fail::Db(err)) => err,
            };
            if !transient(&err) {
                return Err(db_err(context)(err));
            }
            let waited = started.elapsed();
            if let Some(wait) = self.wait
                && waited >= wait
            {
                return Err(StoreError::Unreachable {
                    message: format!(
                        "{context}: the store {} could not be reached for {} (EVALFLEET_STORE_WAIT); nothing committed is lost",
                        self.shown,
                        humantime::format_duration(Duration::from_secs(wait.as_secs()))
                    ),
                    source: Some(Box::new(err)),
                });
            }
            if waited >= said + STILL_TRYING_EVERY {
                said = waited;
                tracing::warn!(
                    "The store {} has not answered for {}: still trying ({context}; the run goes on once it is back).",
                    self.shown,
                    humantime::format_duration(Duration::from_secs(waited.as_secs()))
                );
            }
            if let Some(conn) = &self.conn
                && conn.client.is_closed()
            {
                tracing::warn!(
                    "Lost the connection to the store {} ({}); connecting again.",
                    self.shown,
                    evalfleet_types::error_text(&err)
                );
                self.conn = None;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(RECONNECT_PAUSE_MAX);
        }
    }

    /// Runs `work` (a write of the run `run_id` that would store something
    /// twice if run twice: events, a fleet change, resource samples) in
    /// one transaction, once: when the connection is lost after its
    /// `COMMIT` reached the server, the run again finds the token this
    /// call drew and returns what the first run returned (`work`'s value,
    /// say the id of what it inserted) without running `work` again.
    pub(crate) fn with_once(
        &mut self,
        context: &str,
        run_id: &str,
        work: impl FnMut(&mut postgres::Transaction<'_>, i64) -> Tx<i64>,
    ) -> Result<i64, StoreError> {
        self.with_token(fastrand::i64(..), context, run_id, work)
    }

    /// [`PgStore::with_once`] under `token`.
    fn with_token(
        &mut self,
        token: i64,
        context: &str,
        run_id: &str,
        mut work: impl FnMut(&mut postgres::Transaction<'_>, i64) -> Tx<i64>,
    ) -> Result<i64, StoreError> {
        self.with(context, |conn| {
            let rid = conn.rid(run_id)?;
            let mut tx = conn.client.transaction()?;
            if let Some(row) =
                tx.query_opt("SELECT value FROM applied WHERE token = $1", &[&token])?
            {
                return Ok(row.get(0));
            }
            let value = work(&mut tx, rid)?;
            tx.execute(
                "INSERT INTO applied (token, value) VALUES ($1, $2)",
                &[&token, &value],
            )?;
            // Now and then, the tokens of a day ago go.
            if token % 64 == 0 {
                tx.execute(
                    "DELETE FROM applied WHERE at < now() - interval '1 day'",
                    &[],
                )?;
            }
            tx.commit()?;
            Ok(value)
        })
    }

    /// Connects again after the connection was lost.
    fn reconnect(&mut self) -> Tx<()> {
        let mut client = self.config.connect(NoTls)?;
        setup(&mut client, self.read_only, &self.shown)?;
        self.conn = Some(Conn::new(client));
        tracing::info!("Connected to the store {} again.", self.shown);
        Ok(())
    }
}

impl Drop for PgStore {
    fn drop(&mut self) {
        // Closing the connection stops the client's runtime, which must
        // happen where blocking is allowed (see `outside_runtime`).
        if let Some(conn) = self.conn.take() {
            outside_runtime(|| drop(conn));
        }
    }
}

fn lost(shown: &str) -> StoreError {
    StoreError::Backend {
        message: format!("not connected to the store {shown}"),
        source: None,
    }
}

/// What every connection does first: its tables are in `evalfleet`, and
/// the schema is brought up to date (created in a database without one).
fn setup(client: &mut Client, read_only: bool, shown: &str) -> Tx<()> {
    // Statements are prepared once per connection (no parse per call),
    // and planned for the values of each call: a generic plan would not
    // know a claim's cursor or a commit's few items and could scan the
    // run's items.
    client
        .batch_execute("SET search_path TO evalfleet; SET plan_cache_mode = force_custom_plan")?;
    let version = schema_version(client)?;
    if version > schema::VERSION {
        return Err(Fail::Store(StoreError::BadLocation(format!(
            "{shown} was written by a newer evalfleet (store version {version}; this one reads up to {}): upgrade evalfleet to use it",
            schema::VERSION
        ))));
    }
    if version == schema::VERSION {
        return Ok(());
    }
    if read_only {
        return Err(Fail::Store(StoreError::BadLocation(if version == 0 {
            format!("{shown} holds no evalfleet store (no run was made in it)")
        } else {
            format!(
                "{shown} is a store of an older evalfleet (version {version}): open it once as a user that may write it to bring it up to date"
            )
        })));
    }
    Ok(migrate(client)?)
}

/// The store's schema version: 0 when the database has no evalfleet store.
fn schema_version(client: &mut Client) -> Result<i32, postgres::Error> {
    let exists: bool = client
        .query_one(
            "SELECT to_regclass('evalfleet.schema_version') IS NOT NULL",
            &[],
        )?
        .get(0);
    if !exists {
        return Ok(0);
    }
    Ok(client
        .query_opt("SELECT version FROM schema_version", &[])?
        .map_or(0, |row| row.get(0)))
}

/// Applies the migrations this store lacks, in one transaction, under an
/// advisory lock (another process may be migrating: it waits, then finds
/// nothing left to do).
fn migrate(client: &mut Client) -> Result<(), postgres::Error> {
    let mut tx = client.transaction()?;
    // Any number: the lock only has to be the same for every evalfleet.
    tx.execute("SELECT pg_advisory_xact_lock(7201553339)", &[])?;
    tx.batch_execute(
        "CREATE SCHEMA IF NOT EXISTS evalfleet;
         CREATE TABLE IF NOT EXISTS evalfleet.schema_version (version integer NOT NULL)",
    )?;
    let version: i32 = tx
        .query_opt("SELECT version FROM schema_version", &[])?
        .map_or(0, |row| row.get(0));
    for migration in schema::MIGRATIONS.iter().skip(version.max(0) as usize) {
        tx.batch_execute(migration)?;
    }
    tx.execute("DELETE FROM schema_version", &[])?;
    tx.execute(
        "INSERT INTO schema_version (version) VALUES ($1)",
        &[&schema::VERSION.max(version)],
    )?;
    tx.commit()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_run_again_under_its_token_is_stored_once() {
        let Some(db) = evalfleet_testkit::scratch_db!() else {
            return;
        };
        let mut store = PgStore::open(&db.url, false).unwrap();
        store
            .with("a run", |conn| {
                conn.client.execute(
                    "INSERT INTO runs (run_id, name, status, created_at, updated_at, config,
                         config_dir, fingerprint, digest, dataset, total)
                     VALUES ('r', 'r', 'running', 0, 0, '{}', '.', '{}', '', '{}', 0)",
                    &[],
                )?;
                Ok(())
            })
            .unwrap();
        let mut runs = 0;
        let mut add = |store: &mut PgStore| {
            store
                .with_token(42, "an event", "r", |tx, rid| {
                    runs += 1;
                    let row = tx.query_one(
                        "INSERT INTO events (rid, at, kind, message) VALUES ($1, 1, 'x', 'y')
                         RETURNING id",
                        &[&rid],
                    )?;
                    Ok(row.get(0))
                })
                .unwrap()
        };
        // The second call stands for the first run again after its COMMIT
        // got through unanswered.
        let first = add(&mut store);
        let again = add(&mut store);
        assert_eq!(first, again, "the first run's value comes back");
        assert_eq!(runs, 1);
        let events: i64 = store
            .with("count", |conn| {
                Ok(conn
                    .client
                    .query_one("SELECT count(*) FROM events", &[])?
                    .get(0))
            })
            .unwrap();
        assert_eq!(events, 1);
    }
}
