//! evalfleet's orchestration: creating, resuming and finishing runs,
//! re-scoring stored answers, benchmark matrices above runs, and the
//! checks a config gets before its run. The lower layers are crates of
//! their own (config, io, store, fleet, gateway, pipeline, sheets,
//! reports); this crate puts them together.

pub mod bench;
pub mod conversation;
mod error;
pub mod frontend;
pub mod matrix;
pub mod preflight;
pub mod rescore;
pub mod run;
pub mod session;
pub mod sheet;

pub use frontend::{Frontend, UsageError};

/// What kind of failure `err` is, when it is one of the library's errors
/// (each error type says its own kind).
pub fn fault_of(err: &(dyn std::error::Error + 'static)) -> Option<evalfleet_types::Fault> {
    macro_rules! kinds {
        ($($t:ty),+ $(,)?) => {
            $(if let Some(e) = err.downcast_ref::<$t>() {
                return Some(e.fault());
            })+
        };
    }
    kinds!(
        evalfleet_config::ConfigError,
        evalfleet_io::dataset::DatasetError,
        evalfleet_io::template::TemplateError,
        evalfleet_store::StoreError,
        evalfleet_store::CreateRunError,
        evalfleet_store::ExportError,
        run::ResumeError,
        evalfleet_pipeline::PipelineError,
        evalfleet_pipeline::task::TaskError,
        evalfleet_eval::metric_backend::BackendError,
        evalfleet_reports::ReportError,
        rescore::RescoreError,
        session::SessionError,
        frontend::UsageError,
        evalfleet_sandbox::CodeJudgeError,
        evalfleet_sheets::SheetError,
    );
    None
}
