//! `evalfleet completions` and `evalfleet man`: made from the CLI's own
//! definition, so they name exactly the commands and options it parses.

use std::path::Path;

use clap::CommandFactory;

use crate::cli::{Cli, CompletionsArgs, ManArgs};

pub fn completions(args: CompletionsArgs) -> anyhow::Result<u8> {
    let mut command = Cli::command();
    clap_complete::generate(
        args.shell,
        &mut command,
        "evalfleet",
        &mut std::io::stdout(),
    );
    Ok(crate::EXIT_OK)
}

pub fn man(args: ManArgs) -> anyhow::Result<u8> {
    std::fs::create_dir_all(&args.out)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", args.out.display()))?;
    let mut command = Cli::command();
    command.build();
    write_pages(&command, &args.out)?;
    Ok(crate::EXIT_OK)
}

/// The command's page, then its subcommands' (evalfleet-bench-status.1),
/// leaving out the hidden ones.
fn write_pages(command: &clap::Command, dir: &Path) -> anyhow::Result<()> {
    let path = dir.join(format!(
        "{}.1",
        command.get_display_name().unwrap_or(command.get_name())
    ));
    let mut page = Vec::new();
    clap_mangen::Man::new(command.clone())
        .source(format!("evalfleet {}", crate::cli::VERSION))
        .render(&mut page)?;
    std::fs::write(&path, page)
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    eprintln!("wrote {}", path.display());
    // clap's own `help` subcommands have no page: `help` is in each page.
    for sub in command
        .get_subcommands()
        .filter(|s| !s.is_hide_set() && s.get_name() != "help")
    {
        write_pages(sub, dir)?;
    }
    Ok(())
}
