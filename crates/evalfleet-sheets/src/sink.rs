//! Results written back into the sheet they came from: each item's values
//! (`dataset.sheet.write`) into its row, at its block's columns.
//!
//! - While a run goes on, results reach the sink once the store has
//!   committed them ([`SheetSink::start`] gives the writer a tap); they wait
//!   in a buffer written in one `batchUpdate` when `flush_rows` rows wait,
//!   when the oldest has waited `flush_interval`, and at the end.
//! - Each write request (each try) takes its turn at the service account's
//!   write quota, which every run and worker of a PostgreSQL store writing
//!   as the account shares ([`crate::quota`], [`SheetSink::share_quota`]).
//! - A write that fails is tried again (429, 5xx, no answer) with backoff,
//!   the rows kept; when the tries are spent, the sink stops and says so,
//!   and the run goes on: every result is in the store.
//! - [`SheetSink::catch_up`] (a resume, `evalfleet sync`) reads the sheet,
//!   and writes only the items whose cells do not hold their values yet,
//!   and only into rows that still hold the item they came from.

use std::collections::BTreeMap;
use std::sync::Arc;

use evalfleet_types::{ItemStatus, ResultRecord, Scores};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::api::ValueRange;
use super::source::{self, Place};
use super::{SheetError, SheetsApi, a1};
use evalfleet_config::{SheetConfig, WriteValue};
use evalfleet_fleet::shared_rate::QuotaStore;
use evalfleet_io::dataset::Row;
use evalfleet_pipeline::ResultTap;
use evalfleet_store::{ExportRow, Store};

/// The most characters a cell holds (Google Sheets refuses more).
const CELL_LIMIT: usize = 50_000;
/// The most rows one write carries (besides its bytes: a row of a few
/// short cells is some 100 bytes).
const MAX_ROWS_PER_WRITE: usize = 10_000;
/// The most bytes of values one write carries (Google advises requests
/// of at most 2 MB).
const MAX_BYTES_PER_WRITE: usize = 2_000_000;

/// What an item's result gives its cells.
#[derive(Debug, Clone, Copy)]
pub struct Answer<'a> {
    pub item_id: &'a str,
    pub status: ItemStatus,
    pub output: Option<&'a str>,
    pub error: Option<&'a str>,
    pub parsed: Option<&'a Value>,
    pub scores: Option<&'a Scores>,
    pub model: Option<&'a str>,
    pub latency_ms: Option<f64>,
    /// It has an answer that could be used (it did not fail, and its
    /// answer parsed and met the schema, or was not checked).
    pub usable: bool,
}

impl<'a> Answer<'a> {
    pub fn of_result(r: &'a ResultRecord) -> Self {
        Self {
            item_id: &r.item_id,
            status: r.status,
            output: r.output.as_deref(),
            error: r.error.as_deref(),
            parsed: r.assessment.parsed.as_ref(),
            scores: Some(&r.assessment.scores),
            model: r.telemetry.as_ref().map(|t| t.model.as_str()),
            latency_ms: r.telemetry.as_ref().map(|t| t.latency_ms),
            usable: r.status == ItemStatus::Done
                && r.assessment
                    .verdict
                    .is_none_or(evalfleet_types::Verdict::is_ok),
        }
    }

    pub fn of_export(r: &'a ExportRow) -> Self {
        Self {
            item_id: &r.item_id,
            status: r.status,
            output: r.output.as_deref(),
            error: r.error.as_deref(),
            parsed: r.parsed.as_ref(),
            scores: r.scores.as_ref(),
            model: r.model.as_deref(),
            latency_ms: r.latency_ms,
            usable: r.status == ItemStatus::Done && r.valid != Some(false),
        }
    }
}

/// An item's values, in the order of `write`, at its place.
#[derive(Debug, Clone, PartialEq)]
pub struct Cells {
    pub place: Place,
    pub values: Vec<Value>,
}

/// The cells of `answer`; `None` for an id that names no place.
pub fn cells(config: &SheetConfig, answer: &Answer<'_>) -> Option<Cells> {
    let place = Place::of_id(answer.item_id)?;
    let text = |s: Option<&str>| Value::String(clip(s.unwrap_or("")));
    // An item without a usable answer leaves the cells it has no value
    // for as they are (`null` is skipped by the API), never emptied over
    // what they held; its status says what happened.
    let lacking = |value: Value| match &value {
        Value::String(s) if s.is_empty() && !answer.usable => Value::Null,
        _ => value,
    };
    let values = config
        .write
        .iter()
        .map(|(_, what)| match what {
            WriteValue::Score(metric) => answer
                .scores
                .and_then(|scores| {
                    // The metric's key itself, else its newest version
                    // (`exact_match@2` over `exact_match@1`).
                    scores.get(metric).or_else(|| {
                        scores
                            .iter()
                            .filter(|(key, _)| key.split('@').next() == Some(metric.as_str()))
                            .max_by_key(|(key, _)| {
                                key.rsplit('@').next().and_then(|v| v.parse::<u64>().ok())
                            })
                            .map(|(_, score)| score)
                    })
                })
                .and_then(|score| score.value)
                .and_then(serde_json::Number::from_f64)
                .map_or_else(|| Value::String(String::new()), Value::Number),
            WriteValue::Answer => text(answer.output),
            WriteValue::Parsed(field) => {
                let mut value = answer.parsed;
                for key in field.iter().flat_map(|f| f.split('.')) {
                    value = value.and_then(|v| v.get(key));
                }
                match value {
                    None | Some(Value::Null) => Value::String(String::new()),
                    Some(Value::String(s)) => Value::String(clip(s)),
                    Some(v @ (Value::Number(_) | Value::Bool(_))) => v.clone(),
                    Some(other) => Value::String(clip(&other.to_string())),
                }
            }
            WriteValue::Status => {
                Value::String(if answer.status == ItemStatus::Done && !answer.usable {
                    "unusable".to_owned()
                } else {
                    answer.status.to_string()
                })
            }
            WriteValue::Error => text(answer.error),
            WriteValue::Model => text(answer.model),
            WriteValue::LatencyMs => answer
                .latency_ms
                .and_then(serde_json::Number::from_f64)
                .map_or_else(|| Value::String(String::new()), Value::Number),
            WriteValue::ItemId => Value::String(answer.item_id.to_owned()),
        })
        .map(lacking)
        .collect();
    Some(Cells { place, values })
}

/// The first column past every column `config` writes, over all its
/// blocks.
fn written_width(config: &SheetConfig) -> u32 {
    let extra = config
        .blocks
        .as_ref()
        .map_or(0, |b| (b.count - 1) * b.stride);
    config
        .write
        .iter()
        .map(|(c, _)| c + extra + 1)
        .max()
        .unwrap_or(1)
}

/// `text` cut to what a cell holds.
fn clip(text: &str) -> String {
    match text.char_indices().nth(CELL_LIMIT) {
        Some((at, _)) => text[..at].to_owned(),
        None => text.to_owned(),
    }
}

/// The columns of `cells`'s block that `write` names, in its order.
fn columns(config: &SheetConfig, place: Place) -> impl Iterator<Item = u32> + '_ {
    let shift = config.blocks.as_ref().map_or(0, |b| place.block * b.stride);
    config.write.iter().map(move |(c, _)| c + shift)
}

/// The range that writes `cells`: from its first column to its last, the
/// columns between left as they are (`null`).
fn range(config: &SheetConfig, cells: &Cells) -> ValueRange {
    let cols: Vec<u32> = columns(config, cells.place).collect();
    let first = cols.iter().copied().min().unwrap_or(0);
    let last = cols.iter().copied().max().unwrap_or(0);
    let mut row = vec![Value::Null; (last - first + 1) as usize];
    for (col, value) in cols.iter().zip(&cells.values) {
        row[(col - first) as usize] = value.clone();
    }
    let r = cells.place.row;
    ValueRange {
        range: a1(&config.tab, (first, r), Some((last, Some(r)))),
        major_dimension: "ROWS",
        values: vec![row],
    }
}

/// Whether a cell read back (unformatted) holds `value`.
fn holds(cell: Option<&Value>, value: &Value) -> bool {
    match (cell, value) {
        // Left as it is: whatever it holds.
        (_, Value::Null) => true,
        (None | Some(Value::Null), Value::String(s)) => s.is_empty(),
        (Some(Value::String(a)), Value::String(b)) => a == b,
        (Some(Value::Number(a)), Value::Number(b)) => a.as_f64() == b.as_f64(),
        (Some(Value::Bool(a)), Value::Bool(b)) => a == b,
        _ => false,
    }
}

/// What a catch-up found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CatchUp {
    /// Items written.
    pub written: u64,
    /// Items whose cells held their values already.
    pub held: u64,
    /// Items whose row no longer holds the item (edited, moved or
    /// deleted since the run read it): not written. Their ids.
    pub changed: Vec<String>,
    /// Writes (`batchUpdate` calls) made.
    pub calls: u64,
    /// Items whose cells the API refused on their own (a 400 for their
    /// row alone): their ids and why.
    pub refused: Vec<(String, String)>,
}

/// How a sink's live writing ended.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SinkReport {
    /// Items written while the run went on.
    pub written: u64,
    /// `batchUpdate` calls, retries included (a catch-up's too).
    pub calls: u64,
    /// Why writing stopped early; `None` when every result was written.
    pub stopped: Option<String>,
    /// Results not written because writing had stopped.
    pub unwritten: u64,
    /// Items whose cells the API refused on their own: ids and why.
    pub refused: Vec<(String, String)>,
}

/// The stored results of `run_id`, each with the row it came from.
pub fn stored(
    store: &mut dyn Store,
    run_id: &str,
    config: &SheetConfig,
) -> Result<Vec<(Row, Cells)>, SheetError> {
    let mut out = Vec::new();
    store.export(run_id, &mut |row| {
        if let (Value::Object(item), Some(cells)) =
            (&row.item, cells(config, &Answer::of_export(&row)))
        {
            out.push((item.clone(), cells));
        }
        Ok(())
    })?;
    Ok(out)
}

/// Writes a run's results into its sheet.
pub struct SheetSink {
    api: Arc<SheetsApi>,
    config: Arc<SheetConfig>,
    /// The live writer, once started; it ends when the tap is dropped.
    live: Option<JoinHandle<SinkReport>>,
    /// The shared write quota's sweeper, stopped by `finish` (or a drop).
    quota_tasks: TaskTracker,
    quota_stop: CancellationToken,
}

impl Drop for SheetSink {
    fn drop(&mut self) {
        self.quota_stop.cancel();
    }
}

impl SheetSink {
    /// A sink for `config`'s sheet; it fetches a token at once, so that a
    /// key that does not work is said before the run starts.
    pub async fn open(config: &SheetConfig) -> Result<Self, SheetError> {
        let api = SheetsApi::open(config, true)?;
        api.ready().await?;
        Ok(Self {
            api: Arc::new(api),
            config: Arc::new(config.clone()),
            live: None,
            quota_tasks: TaskTracker::new(),
            quota_stop: CancellationToken::new(),
        })
    }

    /// Takes the account's write quota from `store` (a connection of the
    /// sink's own) as well, when the store shares quotas with the other
    /// runs and workers of the account (see [`crate::quota`]). Whether it
    /// does.
    pub fn share_quota(&self, store: QuotaStore) -> bool {
        let shared = self
            .api
            .quota()
            .share(store, &self.quota_tasks, self.quota_stop.clone());
        if shared {
            tracing::info!(
                "Writes to the sheet share {}'s quota ({} a minute) with the store's other runs and workers.",
                self.api.account(),
                self.api.quota().per_minute()
            );
        }
        shared
    }

    /// The items the sheet holds now, by place.
    pub async fn read_rows(&self) -> Result<BTreeMap<Place, Row>, SheetError> {
        Ok(source::read(&self.api, &self.config).await?.items)
    }

    /// Writes the `stored` results the sheet does not hold yet, into rows
    /// that still hold their item: `rows`, the items the sheet holds now
    /// (as [`read_rows`](Self::read_rows) reads them, or as the dataset's
    /// file holds them right after the sheet was read into it).
    pub async fn catch_up(
        &self,
        stored: Vec<(Row, Cells)>,
        rows: &BTreeMap<Place, Row>,
    ) -> Result<CatchUp, SheetError> {
        let config = &*self.config;
        let calls_before = self.api.write_calls();
        let mut report = CatchUp::default();
        if stored.is_empty() {
            return Ok(report);
        }
        let outputs = a1(
            &config.tab,
            (0, config.first_row),
            Some((written_width(config) - 1, config.last_row)),
        );
        let grid = self.api.get(&outputs, true).await?;
        let mut missing = Vec::new();
        for (item, cells) in stored {
            if rows.get(&cells.place) != Some(&item) {
                report.changed.push(cells.place.id(config.blocks.is_some()));
                continue;
            }
            let at = (cells.place.row - config.first_row) as usize;
            let row = grid.get(at);
            let held = columns(config, cells.place)
                .zip(&cells.values)
                .all(|(col, value)| holds(row.and_then(|r| r.get(col as usize)), value));
            if held {
                report.held += 1;
            } else {
                missing.push(cells);
            }
        }
        let mut pace = Pace::new(config.min_write_interval);
        while !missing.is_empty() {
            let batch = take_batch(&mut missing, config);
            pace.wait().await;
            let wrote = write_batch(&self.api, batch).await;
            pace.mark();
            report.written += wrote.written;
            report.refused.extend(wrote.refused);
            if let Some(err) = wrote.stopped {
                return Err(err);
            }
        }
        report.calls = self.api.write_calls() - calls_before;
        Ok(report)
    }

    /// Starts writing results as they are committed: the tap to give the
    /// session's writer.
    pub fn start(&mut self) -> ResultTap {
        let (tx, rx) = mpsc::unbounded_channel();
        // Awaited by `finish`, which the session's owner always calls.
        #[allow(clippy::disallowed_methods)]
        let task = tokio::spawn(write_live(self.api.clone(), self.config.clone(), rx));
        self.live = Some(task);
        let config = self.config.clone();
        Arc::new(move |result: &ResultRecord| {
            if let Some(cells) = cells(&config, &Answer::of_result(result)) {
                // The sink has ended only when the session has.
                let _ = tx.send(cells);
            }
        })
    }

    /// Writes what waits and ends: how it went. The live writer ends when
    /// the tap [`start`](Self::start) gave is dropped (with the session's
    /// writer), so this is called after.
    pub async fn finish(mut self) -> SinkReport {
        let mut report = match self.live.take() {
            Some(task) => task.await.unwrap_or_else(|err| SinkReport {
                stopped: Some(format!("the sheet's writer failed: {err}")),
                ..SinkReport::default()
            }),
            None => SinkReport::default(),
        };
        report.calls = self.api.write_calls();
        // What the shared quota holds goes back to the store.
        self.quota_stop.cancel();
        self.quota_tasks.close();
        self.quota_tasks.wait().await;
        report
    }
}

/// The live writer: receives cells until the tap is dropped, and writes
/// them in batches, no two writes closer than `min_write_interval`.
async fn write_live(
    api: Arc<SheetsApi>,
    config: Arc<SheetConfig>,
    mut inbox: mpsc::UnboundedReceiver<Cells>,
) -> SinkReport {
    let mut report = SinkReport::default();
    // The latest values of each place waiting (an item answered again
    // replaces its older values).
    let mut waiting: BTreeMap<Place, Cells> = BTreeMap::new();
    // When the oldest waiting row must be written.
    let mut due: Option<Instant> = None;
    let mut pace = Pace::new(config.min_write_interval);
    let mut open = true;
    loop {
        let flush = !waiting.is_empty()
            && report.stopped.is_none()
            && (waiting.len() >= config.flush_rows
                || due.is_some_and(|at| at <= Instant::now())
                || !open);
        let mut wake = due;
        if flush {
            // The last write, once the run has ended, goes at once: one
            // write sooner than the pace cannot pass the quota.
            match pace.earliest() {
                Some(at) if at > Instant::now() && open => wake = Some(at),
                _ => {
                    let mut rows: Vec<Cells> = std::mem::take(&mut waiting).into_values().collect();
                    let batch = take_batch(&mut rows, &config);
                    due = None;
                    if !rows.is_empty() {
                        // More waited than one write carries: the rest
                        // go next.
                        waiting.extend(rows.into_iter().map(|c| (c.place, c)));
                        due = Some(Instant::now());
                    }
                    let wrote = write_batch(&api, batch).await;
                    pace.mark();
                    // Rows that came while the write went on (waiting for
                    // its turn at the account's quota, for one) wait for
                    // the next, as they would have had the loop received
                    // them meanwhile.
                    while let Ok(cells) = inbox.try_recv() {
                        waiting.insert(cells.place, cells);
                        due.get_or_insert_with(|| Instant::now() + config.flush_interval);
                    }
                    report.written += wrote.written;
                    report.refused.extend(wrote.refused);
                    if let Some(err) = wrote.stopped {
                        let why = format!("{err}{}", hint(&err, &api, &config));
                        tracing::error!(
                            "Writing results to the sheet stopped: {why}. The run goes on and keeps every result in its store; `evalfleet sync RUN_ID` writes them to the sheet once it takes writes again."
                        );
                        report.unwritten += wrote.unwritten;
                        report.stopped = Some(why);
                    }
                    continue;
                }
            }
        }
        if !open && (waiting.is_empty() || report.stopped.is_some()) {
            break;
        }
        tokio::select! {
            received = inbox.recv(), if open => match received {
                Some(cells) => {
                    if report.stopped.is_some() {
                        report.unwritten += 1;
                        continue;
                    }
                    waiting.insert(cells.place, cells);
                    due.get_or_insert_with(|| Instant::now() + config.flush_interval);
                }
                None => open = false,
            },
            () = sleep_until(wake.unwrap_or_else(Instant::now)), if wake.is_some() => {}
        }
    }
    report.unwritten += waiting.len() as u64;
    report
}

/// What a 403 asks for (share the sheet), and what a 429 means: the
/// account's write quota stayed spent for as long as the sink waits.
fn hint(err: &SheetError, api: &SheetsApi, config: &SheetConfig) -> String {
    match err {
        SheetError::Api { status: 403, .. } => {
            format!(" (share the sheet with {} as an Editor)", api.account())
        }
        SheetError::Api { status: 429, .. } => format!(
            " (the write quota of {}, {} writes a minute shared by every run and worker writing as it, stayed spent through {} tries; dataset.sheet.writes_per_minute, retries and quota_wait say how far writes keep to it and wait for it)",
            api.account(),
            api.quota().per_minute(),
            config.retries + 1
        ),
        _ => String::new(),
    }
}

/// Keeps writes at least `min` apart.
struct Pace {
    min: std::time::Duration,
    last: Option<Instant>,
}

impl Pace {
    fn new(min: std::time::Duration) -> Self {
        Self { min, last: None }
    }

    /// When the next write may start; `None`: now.
    fn earliest(&self) -> Option<Instant> {
        self.last.map(|at| at + self.min)
    }

    async fn wait(&self) {
        if let Some(at) = self.earliest() {
            sleep_until(at).await;
        }
    }

    fn mark(&mut self) {
        self.last = Some(Instant::now());
    }
}

/// Takes the first rows of `rows` that one write carries (by count and by
/// bytes; at least one).
fn take_batch(rows: &mut Vec<Cells>, config: &SheetConfig) -> Vec<ValueRange> {
    let mut bytes = 0;
    let mut n = 0;
    for cells in rows.iter() {
        let size: usize = cells
            .values
            .iter()
            .map(|v| v.to_string().len() + 1)
            .sum::<usize>()
            + 64;
        if n > 0 && (n == MAX_ROWS_PER_WRITE || bytes + size > MAX_BYTES_PER_WRITE) {
            break;
        }
        bytes += size;
        n += 1;
    }
    rows.drain(..n).map(|c| range(config, &c)).collect()
}

/// How one batch went.
#[derive(Default)]
struct Wrote {
    written: u64,
    refused: Vec<(String, String)>,
    /// Why writing must stop (the tries are spent, or the sheet refuses
    /// every write), and how many rows were left unwritten by it.
    stopped: Option<SheetError>,
    unwritten: u64,
}

/// Writes `batch` in one `batchUpdate`. When the API refuses it as a whole
/// (400, 413: a bad cell, too large), the halves are written on their own,
/// down to the single row it refuses, which is left out and named; the
/// other rows are written.
async fn write_batch(api: &SheetsApi, batch: Vec<ValueRange>) -> Wrote {
    let mut wrote = Wrote::default();
    let mut pending = vec![batch];
    while let Some(part) = pending.pop() {
        if wrote.stopped.is_some() {
            wrote.unwritten += part.len() as u64;
            continue;
        }
        match api.batch_update(&part).await {
            Ok(()) => wrote.written += part.len() as u64,
            Err(SheetError::Api {
                status: 400 | 413,
                message,
                ..
            }) if part.len() == 1 => {
                let cells = part[0].range.clone();
                tracing::warn!(
                    "The Sheets API refused the cells {cells} ({message}); they are left as they were."
                );
                wrote.refused.push((cells, message));
            }
            Err(SheetError::Api {
                status: 400 | 413, ..
            }) => {
                let mut first = part;
                let second = first.split_off(first.len() / 2);
                pending.push(second);
                pending.push(first);
            }
            Err(err) => {
                wrote.unwritten += part.len() as u64;
                wrote.stopped = Some(err);
            }
        }
    }
    wrote
}

#[cfg(test)]
mod tests {
    use super::*;
    use evalfleet_types::Score;
    use serde_json::json;

    fn config() -> SheetConfig {
        SheetConfig {
            columns: vec![("text".to_owned(), 0), ("category".to_owned(), 1)],
            blocks: Some(evalfleet_config::Blocks {
                count: 3,
                stride: 3,
                fields: vec!["category".to_owned()],
            }),
            write: vec![
                (2, WriteValue::Score("exact_match".to_owned())),
                (3, WriteValue::Parsed(Some("label.name".to_owned()))),
            ],
            ..crate::test_config()
        }
    }

    #[test]
    fn cells_go_to_their_blocks_columns() {
        let mut scores = Scores::new();
        scores.insert(
            "exact_match@1".to_owned(),
            Score {
                value: Some(0.5),
                ..Score::default()
            },
        );
        let parsed = json!({"label": {"name": "=HYPERLINK(\"x\")"}});
        let answer = Answer {
            item_id: "r7b2",
            status: ItemStatus::Done,
            output: Some("out"),
            error: None,
            parsed: Some(&parsed),
            scores: Some(&scores),
            model: None,
            latency_ms: None,
            usable: true,
        };
        let Some(cells) = cells(&config(), &answer) else {
            panic!("r7b2 names a place")
        };
        assert_eq!(cells.values, vec![json!(0.5), json!("=HYPERLINK(\"x\")")]);
        let written = range(&config(), &cells);
        // Block 2 is 3 columns right of block 1's C and D: F and G.
        assert_eq!(written.range, "'T'!F7:G7");
        assert_eq!(
            written.values,
            vec![vec![json!(0.5), json!("=HYPERLINK(\"x\")")]]
        );
        let failed = Answer {
            status: ItemStatus::Failed,
            scores: None,
            parsed: None,
            usable: false,
            ..answer
        };
        let kept = cells_of(&failed);
        assert_eq!(
            kept,
            vec![Value::Null, Value::Null],
            "a value a failed item lacks leaves its cell as it is"
        );
        let unusable = Answer {
            status: ItemStatus::Done,
            parsed: None,
            scores: None,
            usable: false,
            ..answer
        };
        assert_eq!(cells_of(&unusable), vec![Value::Null, Value::Null]);
        assert!(holds(Some(&json!("earlier")), &Value::Null));
        assert!(
            super::cells(
                &config(),
                &Answer {
                    item_id: "abc",
                    ..answer
                }
            )
            .is_none()
        );
    }

    fn cells_of(answer: &Answer<'_>) -> Vec<Value> {
        cells(&config(), answer)
            .map(|c| c.values)
            .unwrap_or_default()
    }

    #[test]
    fn a_range_leaves_the_columns_between_as_they_are() {
        let mut config = config();
        config.blocks = None;
        config.write = vec![(1, WriteValue::Status), (4, WriteValue::ItemId)];
        let cells = Cells {
            place: Place { row: 3, block: 0 },
            values: vec![json!("done"), json!("r3")],
        };
        let written = range(&config, &cells);
        assert_eq!(written.range, "'T'!B3:E3");
        assert_eq!(
            written.values,
            vec![vec![json!("done"), Value::Null, Value::Null, json!("r3")]]
        );
    }

    #[test]
    fn cells_read_back_are_compared_by_value() {
        assert!(holds(Some(&json!(0.5)), &json!(0.5)));
        assert!(holds(Some(&json!(1)), &json!(1.0)));
        assert!(holds(None, &json!("")));
        assert!(!holds(None, &json!(0)));
        assert!(!holds(Some(&json!("0.5")), &json!(0.5)));
        assert!(!holds(Some(&json!("old")), &json!("new")));
    }

    #[test]
    fn a_write_carries_at_most_ten_thousand_rows_and_two_megabytes() {
        let mut config = config();
        config.blocks = None;
        config.write = vec![(2, WriteValue::Answer)];
        let row = |i: u32, size: usize| Cells {
            place: Place {
                row: i + 2,
                block: 0,
            },
            values: vec![json!("x".repeat(size))],
        };
        let mut small: Vec<Cells> = (0..12_500).map(|i| row(i, 10)).collect();
        assert_eq!(take_batch(&mut small, &config).len(), 10_000);
        assert_eq!(small.len(), 2500);
        assert_eq!(small[0].place.row, 10_002, "the rest wait in order");
        let mut large: Vec<Cells> = (0..100).map(|i| row(i, 45_000)).collect();
        let batch = take_batch(&mut large, &config);
        assert_eq!(
            batch.len(),
            44,
            "44 rows of 45 kB are under 2 MB, 45 are not"
        );
        let mut huge = vec![row(0, 3_000_000)];
        assert_eq!(
            take_batch(&mut huge, &config).len(),
            1,
            "a row alone goes, whatever its size"
        );
    }

    #[test]
    fn long_answers_are_cut_to_a_cell() {
        let long = "é".repeat(CELL_LIMIT + 10);
        assert_eq!(clip(&long).chars().count(), CELL_LIMIT);
        assert_eq!(clip("short"), "short");
    }
}
