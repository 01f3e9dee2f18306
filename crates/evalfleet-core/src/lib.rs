//! evalfleet's engine: the config, dataset readers, templates, the OpenAI
//! client, the fleet of endpoints, the run pipeline and the store traits.

pub mod cache;
pub mod client;
pub mod config;
pub mod dataset;
pub mod eval;
pub mod fingerprint;
pub mod fleet;
pub mod pipeline;
pub mod run;
pub mod store;
pub mod summary;
pub mod task;
pub mod template;
pub mod worker;

pub use evalfleet_judge as judge;
pub use evalfleet_types as types;
