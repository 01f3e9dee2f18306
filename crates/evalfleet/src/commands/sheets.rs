//! `evalfleet sync`: writes to a run's Google Sheet the stored results it
//! lacks (a run's sessions write them as they go: see
//! `evalfleet_core::sheet`).

use anyhow::Context;
use evalfleet_config as config;
use evalfleet_core::sheet::{describe, say_caught_up, target};
use evalfleet_sheets as sheets;
use evalfleet_store::{Location, OpenOptions};

use super::store_location;
use crate::attend::Lift;
use crate::cli::SyncArgs;
use crate::{EXIT_FAILED, EXIT_OK};

/// `evalfleet sync RUN_ID`: writes the stored results the sheet lacks.
pub async fn sync(mut args: SyncArgs) -> anyhow::Result<u8> {
    let location: Location = store_location(args.store.store.clone(), None)?;
    let mut store = evalfleet_store::open(&location, &OpenOptions::default())?;
    args.run_id = evalfleet_store::resolve_run_id(&mut *store, &args.run_id)?;
    let record = store.run(&args.run_id)?;
    let loaded = match &args.config {
        Some(file) => crate::attend::load(file, config::Overrides::default())?,
        None => config::load_snapshot(&record.config, std::path::Path::new(&record.config_dir))?,
    };
    let Some(sheet) = target(&loaded.config) else {
        anyhow::bail!(
            "run {} does not write its results to a sheet (its config has no dataset.sheet.write)",
            args.run_id
        );
    };
    let sink = evalfleet_core::sheet::open(sheet, &location).await.lift()?;
    let stored =
        tokio::task::block_in_place(|| sheets::sink::stored(&mut *store, &args.run_id, sheet))?;
    let rows = sink
        .read_rows()
        .await
        .with_context(|| format!("reading {}", describe(sheet)))?;
    let caught = sink.catch_up(stored, &rows).await;
    // What the sink holds of the account's write quota goes back.
    sink.finish().await;
    let caught = caught.with_context(|| {
        format!(
            "writing run {}'s results to {}",
            args.run_id,
            describe(sheet)
        )
    })?;
    say_caught_up(&caught, sheet);
    println!(
        "{} written, {} already in the sheet, {} not written (row changed), {} refused by the API",
        caught.written,
        caught.held,
        caught.changed.len(),
        caught.refused.len()
    );
    Ok(if caught.changed.is_empty() && caught.refused.is_empty() {
        EXIT_OK
    } else {
        EXIT_FAILED
    })
}
