//! What a run stores ([`Store`] and the records it takes and gives), and
//! its backends, opened by URL: a
//! path or `sqlite://PATH` is the embedded SQLite store (the default);
//! `postgres://` (or `postgresql://`) is a PostgreSQL database, which
//! workers on many machines share. Nothing outside this crate names a
//! backend's type, except tests that look inside one.

mod api;
mod columns;
mod postgres;
mod sqlite;
pub mod worker;

use std::fmt;
use std::path::{Path, PathBuf};

pub use api::*;
pub use postgres::PgStore;
pub use postgres::REAP_EVERY as POSTGRES_REAP_EVERY;
pub use postgres::schema::VERSION as POSTGRES_SCHEMA_VERSION;
pub use sqlite::SqliteStore;
pub use sqlite::schema::VERSION as SQLITE_SCHEMA_VERSION;

/// Where a store is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A SQLite file.
    Sqlite(PathBuf),
    /// A PostgreSQL database, by its URL (`postgres://USER@HOST/DB`).
    Postgres(String),
}

/// Where a run whose store is a database keeps what it writes beside its
/// store (engine logs, sandboxes, reports): a folder of the current one,
/// as beside the default SQLite store.
const LOCAL_DIR: &str = "runs";

impl Location {
    /// A store from `--store`: a path, or a URL whose scheme names the
    /// backend.
    pub fn parse(text: &str) -> Result<Self, StoreError> {
        let text = text.trim();
        if text.is_empty() {
            return Err(StoreError::BadLocation("the store is empty".to_owned()));
        }
        if let Some(path) = text
            .strip_prefix("sqlite://")
            .or_else(|| text.strip_prefix("sqlite:"))
        {
            if path.is_empty() {
                return Err(StoreError::BadLocation(format!(
                    "'{text}' names no file (sqlite://PATH)"
                )));
            }
            return Ok(Self::Sqlite(PathBuf::from(path)));
        }
        if let Some((scheme, rest)) = text.split_once("://") {
            return match scheme {
                "postgres" | "postgresql" if rest.is_empty() => Err(StoreError::BadLocation(
                    format!("'{text}' names no server (postgres://USER@HOST:PORT/DATABASE)"),
                )),
                "postgres" | "postgresql" => Ok(Self::Postgres(text.to_owned())),
                other => Err(StoreError::BadLocation(format!(
                    "unknown store scheme '{other}://' (a path, sqlite://PATH or postgres://USER@HOST/DATABASE)"
                ))),
            };
        }
        Ok(Self::Sqlite(PathBuf::from(text)))
    }

    /// Whether a store is there already.
    pub fn exists(&self) -> bool {
        match self {
            Self::Sqlite(path) => path.is_file(),
            // A database is made by its administrator: whether it holds a
            // store is known once connected.
            Self::Postgres(_) => true,
        }
    }

    /// The directory for what a run keeps beside its store (engine logs,
    /// sandboxes, reports).
    pub fn dir(&self) -> PathBuf {
        match self {
            Self::Sqlite(path) => path
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."))
                .to_owned(),
            Self::Postgres(_) => PathBuf::from(LOCAL_DIR),
        }
    }

    /// Whether this is the default location (`runs/evalfleet.db`), which
    /// commands need not be told.
    pub fn is(&self, path: &Path) -> bool {
        matches!(self, Self::Sqlite(p) if p == path)
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Sqlite(path) => write!(f, "{}", path.display()),
            Self::Postgres(url) => f.write_str(&postgres::masked(url)),
        }
    }
}

/// How a store is opened.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// Create it when absent (else a missing store is
    /// [`StoreError::NoStore`]).
    pub create: bool,
    /// Keep the response cache in this file instead (`cache.path`), shared
    /// by the runs of several stores.
    pub cache_file: Option<PathBuf>,
    /// Only read it (an existing store): nothing is written, so a store the
    /// user may not write can be read.
    pub read_only: bool,
    /// Wait for a database that cannot be reached for as long as it takes
    /// (a run's working connections: a worker rides out an outage of any
    /// length), instead of `EVALFLEET_STORE_WAIT` (default 2 minutes).
    pub ride_out_outages: bool,
}

impl OpenOptions {
    /// An existing store, to read only.
    pub fn read_only() -> Self {
        Self {
            read_only: true,
            ..Self::default()
        }
    }
}

/// Opens the store at `location`: one connection, for one thread at a time.
pub fn open(location: &Location, options: &OpenOptions) -> Result<Box<dyn Store>, StoreError> {
    match location {
        Location::Sqlite(path) => {
            let mut store = if options.read_only {
                SqliteStore::open_read_only(path)?
            } else if options.create {
                SqliteStore::open(path)?
            } else {
                SqliteStore::open_existing(path)?
            };
            if let Some(file) = &options.cache_file {
                store.use_cache_file(file)?;
            }
            Ok(Box::new(store))
        }
        Location::Postgres(url) => {
            if options.cache_file.is_some() {
                return Err(StoreError::BadLocation(
                    "cache.path keeps the response cache in a SQLite file of its own; a PostgreSQL store keeps it in its database (leave cache.path out)".to_owned(),
                ));
            }
            let mut store = PgStore::open(url, options.read_only)?;
            if options.ride_out_outages {
                store.ride_out_outages();
            }
            Ok(Box::new(store))
        }
    }
}

/// Removes a store this process created and stored nothing in (a run whose
/// registration failed), with what the backend keeps beside it; an empty
/// directory it made goes too.
pub fn remove(location: &Location) {
    match location {
        Location::Sqlite(path) => {
            for suffix in ["", "-wal", "-shm"] {
                let mut file = path.as_os_str().to_owned();
                file.push(suffix);
                let _ = std::fs::remove_file(PathBuf::from(file));
            }
            if let Some(dir) = path.parent() {
                // Only removes the directory when it is empty.
                let _ = std::fs::remove_dir(dir);
            }
        }
        // A run whose registration failed stored nothing: its transaction
        // was rolled back.
        Location::Postgres(_) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_are_paths_or_urls_with_a_known_scheme() {
        assert_eq!(
            Location::parse("runs/a.db").unwrap(),
            Location::Sqlite("runs/a.db".into())
        );
        assert_eq!(
            Location::parse("sqlite:///tmp/a.db").unwrap(),
            Location::Sqlite("/tmp/a.db".into())
        );
        assert_eq!(
            Location::parse("sqlite://a.db").unwrap(),
            Location::Sqlite("a.db".into())
        );
        assert_eq!(
            Location::parse("postgres://u:secret@localhost/evals").unwrap(),
            Location::Postgres("postgres://u:secret@localhost/evals".into())
        );
        assert_eq!(
            Location::parse("postgres://u:secret@localhost:5432/evals")
                .unwrap()
                .to_string(),
            "postgres://u:***@localhost:5432/evals"
        );
        assert!(Location::parse("postgresql://").is_err());
        assert!(Location::parse("redis://x").is_err());
        assert!(Location::parse("sqlite://").is_err());
        assert_eq!(
            Location::parse("runs/a.db").unwrap().dir(),
            PathBuf::from("runs")
        );
        assert_eq!(Location::parse("a.db").unwrap().dir(), PathBuf::from("."));
    }
}
