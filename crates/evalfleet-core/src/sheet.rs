//! A session whose dataset is a Google Sheet (`dataset.sheet`): the sheet
//! read before the session starts, its results written back while it runs.

use std::sync::Arc;

use evalfleet_config::{Config, SheetConfig};
use evalfleet_pipeline::ResultTap;
use evalfleet_sheets::{self as sheets, SheetError, SheetSink, SinkReport};
use evalfleet_store::{Location, OpenOptions, Store};

use crate::error::SessionError;
use crate::frontend::Say;

/// Reads the sheet of `config`'s dataset, when it is one, into the
/// dataset's file (which becomes `config.dataset.path`).
pub async fn read(config: &mut Config) -> Result<(), SessionError> {
    let Some(sheet) = config.dataset.sheet.clone() else {
        return Ok(());
    };
    let items = sheets::read_dataset(&mut config.dataset)
        .await
        .map_err(|source| SessionError::Sheet {
            what: describe(&sheet),
            source,
        })?;
    tracing::info!(
        "Read {} items from {}.",
        items.unwrap_or(0),
        describe(&sheet)
    );
    Ok(())
}

/// A sheet as messages name it.
pub fn describe(sheet: &SheetConfig) -> String {
    format!(
        "tab '{}' of spreadsheet {}",
        sheet.tab, sheet.spreadsheet_id
    )
}

/// The sheet `config`'s results go to, when they go to one.
pub fn target(config: &Config) -> Option<&SheetConfig> {
    config
        .dataset
        .sheet
        .as_ref()
        .filter(|s| !s.write.is_empty())
}

/// A session's writer of results into its sheet.
pub struct Live {
    sink: SheetSink,
    /// Why the catch-up before the session failed, if it did.
    stopped: Option<String>,
    run_id: String,
    say: Arc<Say>,
}

/// Opens the sink of `config`'s sheet (when it has one) for a session of
/// `run_id`: what the store holds and the sheet lacks is written first;
/// the tap then writes each result as it is committed. A sheet that cannot
/// be written does not stop the run: the results stay in the store.
pub async fn start(
    config: &Config,
    store: &mut dyn Store,
    location: &Location,
    run_id: &str,
    say: Arc<Say>,
) -> Result<Option<(Live, ResultTap)>, SessionError> {
    let Some(sheet) = target(config) else {
        return Ok(None);
    };
    let mut sink = open(sheet, location).await?;
    let stored = tokio::task::block_in_place(|| sheets::sink::stored(store, run_id, sheet))?;
    let stopped = if stored.is_empty() {
        None
    } else {
        // The sheet was read into the dataset's file as this session
        // started: the rows it holds now.
        let caught = match sheets::source::rows_of_file(&config.dataset.path) {
            Ok(rows) => sink.catch_up(stored, &rows).await,
            Err(err) => Err(err),
        };
        match caught {
            Ok(caught) => {
                say_caught_up(&caught, sheet);
                None
            }
            Err(err) => {
                tracing::error!(
                    "Could not write the stored results to {}: {err}. The run goes on and keeps every result in its store; `evalfleet sync {run_id}` writes them later.",
                    describe(sheet)
                );
                Some(err.to_string())
            }
        }
    };
    let tap = sink.start();
    Ok(Some((
        Live {
            sink,
            stopped,
            run_id: run_id.to_owned(),
            say,
        },
        tap,
    )))
}

/// Logs what a catch-up wrote, and what it could not.
pub fn say_caught_up(caught: &sheets::CatchUp, sheet: &SheetConfig) {
    tracing::info!(
        "{}: {} stored results written, {} already there ({} writes).",
        describe(sheet),
        caught.written,
        caught.held,
        caught.calls
    );
    if !caught.changed.is_empty() {
        let shown: Vec<&str> = caught.changed.iter().take(10).map(String::as_str).collect();
        tracing::warn!(
            "{}: {} items were not written because their row no longer holds what the run read (edited, moved or deleted since): {}{}.",
            describe(sheet),
            caught.changed.len(),
            shown.join(", "),
            if caught.changed.len() > shown.len() {
                ", ..."
            } else {
                ""
            }
        );
    }
}

impl Live {
    /// Writes what waits; says how writing went, and whether it failed. A
    /// Ctrl-C meanwhile gives up the writing (the results are in the
    /// store: `sync` writes them).
    pub async fn finish(self) -> bool {
        let run_id = self.run_id.clone();
        let report: SinkReport = tokio::select! {
            report = self.sink.finish() => report,
            _ = tokio::signal::ctrl_c() => {
                (self.say)(&format!(
                    "Stopped writing results to the sheet; every result is in the store: `evalfleet sync {run_id}` writes what the sheet lacks."
                ));
                return false;
            }
        };
        if !report.refused.is_empty() {
            let shown: Vec<&str> = report
                .refused
                .iter()
                .take(5)
                .map(|(cells, _)| cells.as_str())
                .collect();
            (self.say)(&format!(
                "error: the Sheets API refused {} rows' cells, left as they were: {}{} (first: {})",
                report.refused.len(),
                shown.join(", "),
                if report.refused.len() > shown.len() {
                    ", ..."
                } else {
                    ""
                },
                report.refused[0].1
            ));
        }
        match self.stopped.or(report.stopped) {
            None if !report.refused.is_empty() => false,
            None => {
                tracing::info!(
                    "Wrote {} results to the sheet in {} writes.",
                    report.written,
                    report.calls
                );
                true
            }
            Some(why) => {
                (self.say)(&format!(
                    "error: the results were not all written to the sheet ({why}); {} written, {} not. Every result is in the store: `evalfleet sync {}` writes what the sheet lacks.",
                    report.written, report.unwritten, self.run_id
                ));
                false
            }
        }
    }
}

/// Opens the sink of `sheet`, for writing: its writes share the service
/// account's write quota with the other runs and workers of the store at
/// `location`, when it shares quotas (on a connection of the sink's own).
/// `finish` it when done, so that what it holds of the quota goes back.
pub async fn open(sheet: &SheetConfig, location: &Location) -> Result<SheetSink, SessionError> {
    let sink = SheetSink::open(sheet)
        .await
        .map_err(|source| SessionError::Sheet {
            what: format!("cannot write results to {}", describe(sheet)),
            source,
        })?;
    // A store that does not share (SQLite) is closed at once.
    match evalfleet_store::open(location, &OpenOptions::default()) {
        Ok(store) => {
            sink.share_quota(store);
        }
        Err(err) => tracing::warn!(
            "Cannot share the sheet's write quota through the store ({}): this run keeps to dataset.sheet.writes_per_minute on its own.",
            evalfleet_types::error_text(&err)
        ),
    }
    Ok(sink)
}

impl From<SheetError> for SessionError {
    fn from(err: SheetError) -> Self {
        Self::Sheets(err)
    }
}
