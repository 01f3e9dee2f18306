//! Why a session could not be made, or stopped: the errors of the layers
//! below, and what the orchestration adds to them.

use evalfleet_config::ConfigError;
use evalfleet_io::dataset::DatasetError;
use evalfleet_io::template::TemplateError;
use evalfleet_pipeline::PipelineError;
use evalfleet_sheets::SheetError;
use evalfleet_store::{CreateRunError, StoreError};
use evalfleet_types::Fault;

use crate::frontend::UsageError;
use crate::run::ResumeError;

/// Why a session could not be made, or stopped.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Usage(#[from] UsageError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    CreateRun(#[from] CreateRunError),
    #[error(transparent)]
    Resume(#[from] ResumeError),
    #[error(transparent)]
    Sheets(SheetError),
    /// A sheet could not be read or written (`what`: which, and what was
    /// being done).
    #[error("{what}")]
    Sheet {
        what: String,
        #[source]
        source: SheetError,
    },
    #[error(
        "the rows read from the sheet are not those run {run_id} read (a cell of an item edited, rows inserted or removed, or a column named in the header added): its results cannot go back to their rows"
    )]
    SheetChanged {
        run_id: String,
        #[source]
        source: ResumeError,
    },
    #[error("run {run_id} stopped; fix the dataset or resume with the original file")]
    Dataset {
        run_id: String,
        #[source]
        source: DatasetError,
    },
    #[error(
        "run {run_id} stopped: its store cannot be written. What was committed before is kept: fix the store (free space on its disk, or make it writable), then `evalfleet resume {run_id}` goes on from there"
    )]
    StoreUnwritable {
        run_id: String,
        #[source]
        source: Box<PipelineError>,
    },
    #[error("run {run_id} stopped")]
    Stopped {
        run_id: String,
        #[source]
        source: Box<PipelineError>,
    },
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A file or folder could not be written (`what`: which, and why it
    /// was).
    #[error("{what}")]
    Write {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

impl SessionError {
    pub fn fault(&self) -> Fault {
        match self {
            Self::Usage(e) => e.fault(),
            Self::Config(e) => e.fault(),
            Self::Template(e) => e.fault(),
            Self::Store(e) => e.fault(),
            Self::CreateRun(e) => e.fault(),
            Self::Resume(e) | Self::SheetChanged { source: e, .. } => e.fault(),
            Self::Sheets(e) | Self::Sheet { source: e, .. } => e.fault(),
            Self::Dataset { source, .. } => source.fault(),
            Self::Stopped { source, .. } | Self::StoreUnwritable { source, .. } => source.fault(),
            Self::Io(_) | Self::Json(_) | Self::Write { .. } => Fault::Failure,
        }
    }
}
