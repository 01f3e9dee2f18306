//! The store's errors: its own failures, why a run could not be created,
//! and why an export stopped.

use evalfleet_types::Fault;

use evalfleet_io::dataset::DatasetError;
use evalfleet_io::template::TemplateError;

/// A failure of the store itself (I/O, corruption, a broken invariant).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store: {message}")]
    Backend {
        message: String,
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    #[error("no run '{0}' in this store")]
    NoSuchRun(String),
    /// A prefix of more than one run's id.
    #[error("'{given}' begins the ids of {} runs: {}; give more of it", matches.len(), matches.join(", "))]
    AmbiguousRun { given: String, matches: Vec<String> },
    #[error("no store at {} (pass --store PATH to name another)", .0.display())]
    NoStore(std::path::PathBuf),
    /// The file is there, but it is not an evalfleet store.
    #[error("{} is not an evalfleet store ({why}); pass --store PATH to name one", path.display())]
    NotAStore {
        path: std::path::PathBuf,
        why: String,
    },
    /// A store written by a newer evalfleet, which this one cannot read.
    #[error(
        "{} was written by a newer evalfleet (store version {version}; this one reads up to {known}): upgrade evalfleet to read it",
        path.display()
    )]
    NewerStore {
        path: std::path::PathBuf,
        version: i64,
        known: i64,
    },
    /// `--store` (or `store:`) names no store this evalfleet can open.
    #[error("--store: {0}")]
    BadLocation(String),
    #[error("store invariant broken: {0}")]
    Invariant(String),
    /// The store could not be reached for as long as the command waits
    /// for it (`EVALFLEET_STORE_WAIT`): nothing committed is lost.
    #[error("store: {message}")]
    Unreachable {
        message: String,
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// The store refuses writes (its disk full, its file or folder
    /// read-only, its database in read-only mode): nothing of the write was
    /// kept, and what was committed before stays.
    #[error("store: {message}: {reason}")]
    Unwritable { message: String, reason: String },
}

impl StoreError {
    pub fn fault(&self) -> Fault {
        match self {
            Self::NoSuchRun(_)
            | Self::AmbiguousRun { .. }
            | Self::NoStore(_)
            | Self::NotAStore { .. }
            | Self::NewerStore { .. }
            | Self::BadLocation(_) => Fault::BadInput,
            Self::Unreachable { .. } => Fault::Unreachable,
            Self::Backend { .. } | Self::Invariant(_) | Self::Unwritable { .. } => Fault::Failure,
        }
    }

    pub fn backend(
        message: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self::Backend {
            message: message.into(),
            source: Some(Box::new(source)),
        }
    }
}

/// Why a run could not be created. Nothing of it is stored.
#[derive(Debug, thiserror::Error)]
pub enum CreateRunError {
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    #[error("{path}:{second_line}: duplicate item id '{id}' (first on line {first_line})")]
    DuplicateId {
        path: String,
        id: String,
        first_line: u64,
        second_line: u64,
    },
    #[error(transparent)]
    Template(#[from] TemplateError),
    /// A template problem placed in the config file, with its line.
    #[error(transparent)]
    Config(evalfleet_config::ConfigError),
    #[error(
        "a run with id '{0}' already exists in this store (resume it with `evalfleet resume {0}`)"
    )]
    RunExists(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl CreateRunError {
    pub fn fault(&self) -> Fault {
        match self {
            Self::Store(err) => err.fault(),
            Self::Dataset(_)
            | Self::DuplicateId { .. }
            | Self::Template(_)
            | Self::Config(_)
            | Self::RunExists(_) => Fault::BadInput,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot write the export: {0}")]
    Write(#[from] std::io::Error),
}

impl ExportError {
    pub fn fault(&self) -> Fault {
        match self {
            Self::Store(err) => err.fault(),
            Self::Write(_) => Fault::Failure,
        }
    }
}
