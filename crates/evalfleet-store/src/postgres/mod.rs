//! The shared store: a PostgreSQL database, for workers on many machines
//! that share one run (`--store postgres://...`). PostgreSQL coordinates
//! them: items are claimed with `FOR UPDATE SKIP LOCKED`, leases are
//! measured on the database's clock, and a commit is fenced by the claim it
//! was made under (`queue`), so every item gets exactly one result whoever
//! answers it and whatever dies meanwhile.
//!
//! Each concern of [`evalfleet_core::store`] is implemented in a module of
//! its own, as for SQLite. Every method is one transaction, run by
//! [`PgStore::with`]: when the connection is lost (the server restarted,
//! the network cut), it connects again and runs the transaction again, for
//! up to [`RECONNECT_FOR`]; transactions are written so that running one
//! twice stores what running it once does.

mod queue;
mod quotas;
pub mod schema;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use evalfleet_core::store::StoreError;
use evalfleet_types::UnknownName;
use postgres::error::SqlState;
use postgres::{Client, Config, NoTls};

/// How long a store keeps connecting again after it lost its connection,
/// before the method fails.
pub const RECONNECT_FOR: Duration = Duration::from_secs(120);
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
    move |err| StoreError::backend(context, err)
}

pub(crate) fn json_err(context: &str) -> impl Fn(serde_json::Error) -> StoreError + '_ {
    move |err| StoreError::backend(context, err)
}

/// A stored name that this evalfleet does not know.
pub(crate) fn unknown(err: UnknownName) -> StoreError {
    StoreError::Invariant(format!("the store holds an {err}"))
}

pub(crate) fn opt_u64(value: Option<u64>) -> Option<i64> {
    value.map(|v| v as i64)
}

/// A column holding JSON text, parsed.
pub(crate) fn json_column(text: Option<String>) -> Result<Option<serde_json::Value>, StoreError> {
    text.map(|t| serde_json::from_str(&t).map_err(json_err("a stored value is not JSON")))
        .transpose()
}

/// A connection and what it learned of the store.
pub(crate) struct Conn {
    pub client: Client,
    rids: HashMap<String, i64>,
}

impl Conn {
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
                COALESCE(SUM(generation), 0)::bigint, COALESCE(MAX(updated_at), 0)::bigint
         FROM tallies WHERE rid = $1",
        &[&rid],
    )?;
    Ok(Tally {
        done: row.get::<_, i64>(0).max(0) as u64,
        failed: row.get::<_, i64>(1).max(0) as u64,
        generation: row.get::<_, i64>(2).max(0) as u64,
        updated_at_ms: row.get(3),
    })
}

/// What the rows of `tallies` of a run add up to.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Tally {
    pub done: u64,
    pub failed: u64,
    /// Commits' part of the run's generation (add `runs.generation`).
    pub generation: u64,
    /// The last commit's time (the run was updated at the later of this
    /// and `runs.updated_at`).
    pub updated_at_ms: i64,
}

/// A PostgreSQL store: one connection, for one thread at a time.
pub struct PgStore {
    conn: Option<Conn>,
    config: Config,
    /// The URL without its password, for messages.
    shown: String,
    read_only: bool,
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
        // A worker cut off from the server notices within a minute, rather
        // than when the kernel gives up on the connection.
        config.keepalives(true);
        config.keepalives_idle(Duration::from_secs(20));
        let mut store = Self {
            conn: None,
            config,
            shown,
            read_only,
        };
        let client = store.config.connect(NoTls).map_err(|err| {
            StoreError::backend(format!("cannot connect to the store {}", store.shown), err)
        })?;
        store.conn = Some(Conn {
            client,
            rids: HashMap::new(),
        });
        store.prepare()?;
        Ok(store)
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
        mut work: impl FnMut(&mut Conn) -> Tx<T>,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let mut pause = Duration::from_millis(50);
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
            if !transient(&err) || started.elapsed() >= RECONNECT_FOR {
                return Err(StoreError::backend(context.to_owned(), err));
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

    /// Connects again after the connection was lost.
    fn reconnect(&mut self) -> Tx<()> {
        let mut client = self.config.connect(NoTls)?;
        setup(&mut client, self.read_only, &self.shown)?;
        self.conn = Some(Conn {
            client,
            rids: HashMap::new(),
        });
        tracing::info!("Connected to the store {} again.", self.shown);
        Ok(())
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
    client.batch_execute("SET search_path TO evalfleet")?;
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
