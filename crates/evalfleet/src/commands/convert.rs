//! `evalfleet convert`: a config of the original Python conversation
//! system as an evalfleet config.

use std::io::Write;

use evalfleet_config as config;

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
