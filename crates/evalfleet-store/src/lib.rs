//! Store implementations of [`evalfleet_core::store::Store`]: SQLite, the
//! embedded default (PostgreSQL, for runs shared by many workers, comes later).

mod sqlite;

pub use sqlite::SqliteStore;
