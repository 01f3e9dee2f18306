//! `evalfleet metrics`: the metric registry, with a config's backends.

use evalfleet_config::{self as config, Overrides};
use evalfleet_eval::metrics::listing;

use crate::EXIT_OK;
use crate::cli::MetricsArgs;

pub fn metrics(args: MetricsArgs) -> anyhow::Result<u8> {
    let backends = match &args.config {
        Some(file) => {
            config::load_file(file, Overrides::default())?
                .config
                .task
                .eval
                .backends
        }
        None => Vec::new(),
    };
    let listed = listing(&backends);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&listed)?);
        return Ok(EXIT_OK);
    }
    let mut rows = vec![[
        "NAME".to_owned(),
        "BACKEND".to_owned(),
        "VERSION".to_owned(),
        "KEY".to_owned(),
        "PARAMS".to_owned(),
        "BETTER".to_owned(),
        "SUMMARY".to_owned(),
    ]];
    for m in &listed {
        let params = match &m.params {
            None => "(its program's)".to_owned(),
            Some(p) if p.is_empty() => "-".to_owned(),
            Some(p) => p.join(", "),
        };
        let summary = match (&m.command, m.summary.is_empty()) {
            (Some(command), true) => format!("by `{}`", command.join(" ")),
            _ => m.summary.clone(),
        };
        rows.push([
            m.name.clone(),
            m.backend.clone(),
            m.version.to_string(),
            m.key.clone(),
            params,
            if m.higher_is_better {
                "higher"
            } else {
                "lower"
            }
            .to_owned(),
            summary,
        ]);
    }
    super::inspect::print_table(&rows);
    Ok(EXIT_OK)
}
