//! evalfleet's engine: the config, dataset readers, templates, the OpenAI
//! client, the fleet of endpoints, the run pipeline and the store traits.

pub mod bench;
pub mod cache;
pub mod client;
pub mod config;
pub mod dataset;
pub mod eval;
pub mod fingerprint;
pub mod fleet;
pub mod gateway;
pub mod images;
pub mod jinja;
pub mod metric_backend;
pub mod pipeline;
pub mod preflight;
pub mod report;
pub mod rescore;
pub mod run;
pub mod sheets;
pub mod store;
pub mod task;
pub mod template;
pub mod view;
pub mod worker;

pub use evalfleet_sandbox as sandbox;
pub use evalfleet_types as types;

/// What kind of failure `err` is, when it is one of the library's errors
/// (each error type says its own kind).
pub fn fault_of(err: &(dyn std::error::Error + 'static)) -> Option<types::Fault> {
    macro_rules! kinds {
        ($($t:ty),+ $(,)?) => {
            $(if let Some(e) = err.downcast_ref::<$t>() {
                return Some(e.fault());
            })+
        };
    }
    kinds!(
        config::ConfigError,
        dataset::DatasetError,
        template::TemplateError,
        store::StoreError,
        store::CreateRunError,
        store::ExportError,
        run::ResumeError,
        pipeline::PipelineError,
        task::TaskError,
        metric_backend::BackendError,
        report::ReportError,
        rescore::RescoreError,
        sandbox::CodeJudgeError,
        sheets::SheetError,
    );
    None
}
