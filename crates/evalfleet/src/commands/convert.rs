//! `evalfleet convert`: a config of the original Python conversation
//! system as an evalfleet config; and the loading of a config file by the
//! commands that run one, which read such a file directly.

use std::io::Write;
use std::path::Path;

use evalfleet_config::{self as config, LoadedConfig, Overrides};

use crate::cli::ConvertArgs;

pub fn convert(args: ConvertArgs) -> anyhow::Result<u8> {
    let conversion = config::convert_original_file(&args.original)?;
    let origin = args.original.display().to_string();
    for note in &conversion.notes {
        eprintln!("{}", note.render(&origin));
    }
    match &args.output {
        Some(out) => {
            std::fs::write(out, &conversion.yaml)
                .map_err(|err| anyhow::anyhow!("cannot write {}: {err}", out.display()))?;
            eprintln!(
                "Wrote {} from {origin} ({} of its keys not converted{}).",
                out.display(),
                conversion.notes.len(),
                if conversion.notes.is_empty() {
                    ""
                } else {
                    ", named above"
                }
            );
        }
        None => std::io::stdout().write_all(conversion.yaml.as_bytes())?,
    }
    Ok(crate::EXIT_OK)
}

/// The config in `file`, with `overrides`; a config of the original
/// system is converted on the way, and its keys that had no place are
/// named on stderr.
pub fn load(file: &Path, overrides: Overrides) -> anyhow::Result<LoadedConfig> {
    let loaded = config::load_file(file, overrides)?;
    if !loaded.notes.is_empty() {
        eprintln!(
            "{}: a config of the original system, converted (`evalfleet convert` writes the conversion out); {} of its keys not converted:",
            file.display(),
            loaded.notes.len()
        );
        for note in &loaded.notes {
            eprintln!("  {note}");
        }
    }
    Ok(loaded)
}
