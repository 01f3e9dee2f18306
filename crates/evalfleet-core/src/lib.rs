//! evalfleet's engine: the config, dataset readers, templates, the OpenAI
//! client, the fleet of endpoints, the run pipeline and the store traits.

pub mod config;
