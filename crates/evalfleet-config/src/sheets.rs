//! `dataset.sheet`: a Google Sheet as the dataset, and as the place the
//! results are written back to (columns of the same rows).

use std::collections::BTreeMap;
use std::time::Duration;

use schemars::JsonSchema;
use serde::Deserialize;

use super::problems::Problems;

/// The Sheets API's address.
pub const SHEETS_API: &str = "https://sheets.googleapis.com";
/// The variable that names the service account's key file by default, as
/// Google's own libraries read it.
pub const DEFAULT_KEY_ENV: &str = "GOOGLE_APPLICATION_CREDENTIALS";

/// A Google Sheet as the dataset: each row of a tab (or each block of a
/// row) is an item, and the results may be written back into columns of
/// the same rows (`write`). The sheet is read through the Sheets API v4
/// with a service account's key: share the sheet with the account's
/// email. The key is read from the file the variable `key_env` names; it
/// is never stored, logged or shown. The rows read are kept in a file of
/// their own (the run's dataset file); a resume reads the sheet again and
/// refuses to go on when the rows read have changed. Without `dataset.path`.
/// Default: none (the dataset is `dataset.path`).
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RawSheet {
    /// The spreadsheet: its id, or its address as the browser shows it
    /// (`https://docs.google.com/spreadsheets/d/ID/edit`). Required.
    pub spreadsheet: Option<String>,
    /// The tab (sheet) to read, by the name it shows at the bottom of the
    /// sheet. Default `Sheet1` (the first tab of a sheet made in English).
    pub tab: Option<String>,
    /// The row holding the columns' names (from 1), or 0 when there is
    /// none (then `columns` names every field). Default 1.
    pub header_row: Option<u32>,
    /// The first row of items (from 1). Default: the row after the header.
    pub first_row: Option<u32>,
    /// The last row of items. Default: the last row with a value.
    pub last_row: Option<u32>,
    /// Field name → column letter (`text: B`): the fields of each item.
    /// Default: every column with a name in the header row, by that name,
    /// but the columns `write` fills.
    pub columns: Option<BTreeMap<String, String>>,
    pub blocks: Option<RawBlocks>,
    /// Column letter → what is written there for each item (`E:
    /// score.exact_match`): `score.METRIC` (the item's score), `answer` (the
    /// model's answer), `parsed` (the extracted answer) or `parsed.FIELD`
    /// (a field of it), `status` (`done` or `failed`), `error` (why it
    /// failed), `model`, `latency_ms`, `item_id`. With `blocks`, block N's
    /// column is this one plus N-1 times `blocks.stride`. Values are
    /// written as they are (numbers as numbers, text as text, never as a
    /// formula); a value the item lacks clears the cell. Default: nothing
    /// is written.
    pub write: Option<BTreeMap<String, String>>,
    /// The environment variable naming the service account's JSON key
    /// file. Default `GOOGLE_APPLICATION_CREDENTIALS`.
    pub key_env: Option<String>,
    /// The Sheets API's address (a stand-in's, for tests). Default
    /// `https://sheets.googleapis.com`.
    pub api_url: Option<String>,
    /// Results are written when this many rows wait, 1 to 1000. Default 50.
    pub flush_rows: Option<usize>,
    /// ... or when the oldest waiting row has waited this long. Default
    /// `2s`.
    #[schemars(with = "Option<super::schema::Duration>")]
    pub flush_interval: Option<String>,
    /// Writes are at least this far apart; rows that come meanwhile join the
    /// next write (Google allows an account 60 writes a minute: see
    /// `writes_per_minute`). Default `1s`.
    #[schemars(with = "Option<super::schema::Duration>")]
    pub min_write_interval: Option<String>,
    /// A write that fails (429, 5xx, no answer) is tried again this many
    /// times, 0 to 10, with exponential backoff and jitter, the rows kept
    /// meanwhile; then writing stops, saying so (the results stay in the
    /// store: `evalfleet sync RUN_ID` writes them later). Default 5.
    pub retries: Option<u32>,
    /// The backoff's first ceiling; it doubles at each retry, up to 64
    /// times it. Default `1s`.
    #[schemars(with = "Option<super::schema::Duration>")]
    pub retry_backoff: Option<String>,
    /// How long a write answered 429 without a `Retry-After` waits before
    /// it is tried again: Google's write quota is a minute's, per user,
    /// shared by every run and worker writing as the same service account,
    /// so the wait outlasts its window. Default `60s`.
    #[schemars(with = "Option<super::schema::Duration>")]
    pub quota_wait: Option<String>,
    /// The service account's write quota: write requests a minute, tries
    /// again included. Google allows 60 a minute per account, shared by
    /// every run and worker writing as it, whatever sheet each writes to.
    /// Every write request takes its turn: with a PostgreSQL store, from
    /// the quota the store keeps for the account, so that all the runs and
    /// workers of the store keep within it together (a 429 pauses it for
    /// all of them); with SQLite, each run paces its own writes to it. A
    /// store that does not answer slows writes down, never stops them.
    /// 1 to 100000. Default 60.
    pub writes_per_minute: Option<u32>,
}

/// Several items in one row: groups of columns alike, side by side (the
/// categories of a row scored separately, say). Default: none (an item a
/// row).
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct RawBlocks {
    /// Blocks in a row, 1 to 1000. Required in `blocks`.
    pub count: Option<u32>,
    /// Columns from one block to the next. Required in `blocks`.
    pub stride: Option<u32>,
    /// The fields of `columns` that move with the block (their column is
    /// the first block's); the others are the row's, the same in each
    /// block. A block whose moving fields are all empty is no item.
    /// Required in `blocks`.
    pub fields: Option<Vec<String>>,
}

/// What a written column holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteValue {
    /// A metric's score (by its name, or its key with `@version`).
    Score(String),
    Answer,
    /// The extracted answer, or one field of it.
    Parsed(Option<String>),
    Status,
    Error,
    Model,
    LatencyMs,
    ItemId,
}

impl WriteValue {
    fn parse(text: &str) -> Result<Self, String> {
        Ok(match text {
            "answer" => Self::Answer,
            "parsed" => Self::Parsed(None),
            "status" => Self::Status,
            "error" => Self::Error,
            "model" => Self::Model,
            "latency_ms" => Self::LatencyMs,
            "item_id" => Self::ItemId,
            _ => {
                if let Some(metric) = text.strip_prefix("score.").filter(|m| !m.is_empty()) {
                    Self::Score(metric.to_owned())
                } else if let Some(field) = text.strip_prefix("parsed.").filter(|f| !f.is_empty()) {
                    Self::Parsed(Some(field.to_owned()))
                } else {
                    return Err(format!(
                        "'{text}' is not a value to write: score.METRIC, answer, parsed, parsed.FIELD, status, error, model, latency_ms or item_id"
                    ));
                }
            }
        })
    }
}

/// Blocks of a row, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blocks {
    pub count: u32,
    pub stride: u32,
    /// The fields that move with the block.
    pub fields: Vec<String>,
}

/// `dataset.sheet`, validated (see [`RawSheet`] for each key). Columns are
/// from 0 (`A` is 0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SheetConfig {
    pub spreadsheet_id: String,
    pub tab: String,
    pub header_row: u32,
    pub first_row: u32,
    pub last_row: Option<u32>,
    /// Field → column; empty: the header row's names.
    pub columns: Vec<(String, u32)>,
    pub blocks: Option<Blocks>,
    /// Column (of the first block) → what is written there, by column.
    pub write: Vec<(u32, WriteValue)>,
    pub key_env: String,
    pub api_url: String,
    pub flush_rows: usize,
    pub flush_interval: Duration,
    pub min_write_interval: Duration,
    pub retries: u32,
    pub retry_backoff: Duration,
    pub quota_wait: Duration,
    pub writes_per_minute: u32,
}

/// The field of a sheet's rows that holds each item's id: `r5` for row 5,
/// `r5b2` for its second block.
pub const ID_FIELD: &str = "_id";

/// The folder that keeps the rows read from sheets: the user's cache
/// (`$XDG_CACHE_HOME/evalfleet/sheets`, else `~/.cache/evalfleet/sheets`),
/// made readable by its owner only when it is made (rows of a sheet may be
/// private).
pub fn snapshot_dir() -> std::path::PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|home| std::path::PathBuf::from(home).join(".cache"))
        })
        .unwrap_or_else(std::env::temp_dir);
    cache.join("evalfleet").join("sheets")
}

/// The dataset file of a sheet not read yet: reading it
/// (`sheets::source::read_dataset`) names the file after the rows read.
pub fn unread_path() -> std::path::PathBuf {
    snapshot_dir().join("not-read-yet.jsonl")
}

/// Column letters (`A`, `Z`, `AA`, ...) to a column from 0.
pub fn column_index(letters: &str) -> Option<u32> {
    if letters.is_empty() || letters.len() > 3 {
        return None;
    }
    let mut n: u32 = 0;
    for b in letters.bytes() {
        let b = b.to_ascii_uppercase();
        if !b.is_ascii_uppercase() {
            return None;
        }
        n = n * 26 + u32::from(b - b'A') + 1;
    }
    Some(n - 1)
}

/// A column from 0 as letters.
pub fn column_letters(mut index: u32) -> String {
    let mut out = Vec::new();
    loop {
        out.push(b'A' + u8::try_from(index % 26).unwrap_or(0));
        if index < 26 {
            break;
        }
        index = index / 26 - 1;
    }
    out.reverse();
    String::from_utf8(out).unwrap_or_default()
}

/// The last column Google Sheets has (`ZZZ`).
const MAX_COLUMN: u32 = 18_277;

/// The id in a spreadsheet's address, or the text itself when it is an id.
fn spreadsheet_id(text: &str) -> Option<String> {
    let text = text.trim();
    // `/spreadsheets/d/ID/...`, also under an account (`/spreadsheets/u/0/d/ID`).
    let id = match text.find("/spreadsheets/") {
        Some(at) => {
            let rest = &text[at + "/spreadsheets/".len()..];
            let after_d = rest.find("d/").map_or("", |d| &rest[d + 2..]);
            after_d.split(['/', '?', '#']).next().unwrap_or("")
        }
        None => text,
    };
    let ok = !id.is_empty()
        && id.len() <= 200
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    ok.then(|| id.to_owned())
}

pub(super) fn sheet(raw: RawSheet, p: &mut Problems<'_>) -> Option<SheetConfig> {
    let at = |key: &str| format!("dataset.sheet.{key}");
    let problems_before = p.0.len();
    let spreadsheet_id = match raw.spreadsheet.as_deref() {
        None => p.push(
            &at("spreadsheet"),
            "is required (the spreadsheet's id, or its address)",
        ),
        Some(text) => match spreadsheet_id(text) {
            Some(id) => Some(id),
            None => p.push(
                &at("spreadsheet"),
                format!(
                    "'{text}' is neither a spreadsheet id (letters, digits, - and _) nor an address with /spreadsheets/d/ID"
                ),
            ),
        },
    };
    let tab = match raw.tab {
        Some(t) if t.trim().is_empty() => p.push(&at("tab"), "must not be empty"),
        Some(t) => Some(t),
        None => Some("Sheet1".to_owned()),
    };
    let header_row = raw.header_row.unwrap_or(1);
    let first_row = match raw.first_row {
        Some(0) => p.push(&at("first_row"), "rows count from 1"),
        Some(r) if r <= header_row => p.push(
            &at("first_row"),
            format!("must come after the header row ({header_row})"),
        ),
        Some(r) => Some(r),
        None => Some(header_row + 1),
    };
    let last_row = match (raw.last_row, first_row) {
        (Some(last), Some(first)) if last < first => p.push(
            &at("last_row"),
            format!("must not come before first_row ({first})"),
        ),
        (last, _) => Some(last),
    };
    let column = |key: &str, letters: &str, p: &mut Problems<'_>| match column_index(letters) {
        Some(c) => Some(c),
        None => p.push(
            &at(key),
            format!("'{letters}' is not a column: letters such as B or AA"),
        ),
    };
    let columns: Vec<(String, u32)> = raw
        .columns
        .unwrap_or_default()
        .into_iter()
        .filter_map(|(name, letters)| {
            let c = column(&format!("columns.{name}"), &letters, p)?;
            Some((name, c))
        })
        .collect();
    if header_row == 0 && columns.is_empty() {
        p.push::<()>(
            &at("columns"),
            "is required when header_row is 0 (no row names the columns)",
        );
    }
    let mut write = Vec::new();
    for (letters, what) in raw.write.unwrap_or_default() {
        let key = format!("write.{letters}");
        let Some(c) = column(&key, &letters, p) else {
            continue;
        };
        match WriteValue::parse(what.trim()) {
            Ok(value) => write.push((c, value)),
            Err(message) => {
                p.push::<()>(&at(&key), message);
            }
        }
    }
    write.sort_by_key(|(c, _)| *c);
    let blocks = match raw.blocks {
        None => Some(None),
        Some(b) => blocks(b, &columns, p).map(Some),
    };
    if let Some(b) = blocks.as_ref() {
        overlaps(&columns, b.as_ref(), &write, p);
    }
    let key_env = match raw.key_env {
        Some(name) if !super::is_variable_name(&name) => p.push(
            &at("key_env"),
            format!("'{name}' is not a variable name (letters, digits and _)"),
        ),
        Some(name) => Some(name),
        None => Some(DEFAULT_KEY_ENV.to_owned()),
    };
    let api_url = match raw.api_url {
        Some(url) if !(url.starts_with("http://") || url.starts_with("https://")) => {
            p.push(&at("api_url"), format!("'{url}' is not an http(s) address"))
        }
        Some(url) => Some(url.trim_end_matches('/').to_owned()),
        None => Some(SHEETS_API.to_owned()),
    };
    let flush_rows = match raw.flush_rows {
        Some(n) if !(1..=1000).contains(&n) => {
            p.push(&at("flush_rows"), format!("must be 1 to 1000, got {n}"))
        }
        other => Some(other.unwrap_or(50)),
    };
    let flush_interval = p.duration(&at("flush_interval"), raw.flush_interval.as_deref(), "2s");
    let min_write_interval = match raw.min_write_interval.as_deref() {
        Some("0" | "0s" | "0ms") => Some(Duration::ZERO),
        other => p.duration(&at("min_write_interval"), other, "1s"),
    };
    let retries = match raw.retries {
        Some(n) if n > 10 => p.push(&at("retries"), format!("must be 0 to 10, got {n}")),
        other => Some(other.unwrap_or(5)),
    };
    let retry_backoff = p.duration(&at("retry_backoff"), raw.retry_backoff.as_deref(), "1s");
    let quota_wait = p.duration(&at("quota_wait"), raw.quota_wait.as_deref(), "60s");
    let writes_per_minute = match raw.writes_per_minute {
        Some(n) if !(1..=100_000).contains(&n) => p.push(
            &at("writes_per_minute"),
            format!("must be 1 to 100000, got {n}"),
        ),
        other => Some(other.unwrap_or(60)),
    };
    if p.0.len() > problems_before {
        return None;
    }
    Some(SheetConfig {
        spreadsheet_id: spreadsheet_id?,
        tab: tab?,
        header_row,
        first_row: first_row?,
        last_row: last_row?,
        columns,
        blocks: blocks?,
        write,
        key_env: key_env?,
        api_url: api_url?,
        flush_rows: flush_rows?,
        flush_interval: flush_interval?,
        min_write_interval: min_write_interval?,
        retries: retries?,
        retry_backoff: retry_backoff?,
        quota_wait: quota_wait?,
        writes_per_minute: writes_per_minute?,
    })
}

/// Refuses a layout in which two things of different blocks (a field read,
/// a value written) share a column, or one lies past column ZZZ: each
/// column is named with the blocks that meet there.
fn overlaps(
    columns: &[(String, u32)],
    blocks: Option<&Blocks>,
    write: &[(u32, WriteValue)],
    p: &mut Problems<'_>,
) {
    let (count, stride) = blocks.map_or((1, 0), |b| (b.count, b.stride));
    let moves = |name: &str| blocks.is_some_and(|b| b.fields.iter().any(|f| f == name));
    let mut taken: BTreeMap<u64, String> = BTreeMap::new();
    let mut place = |column: u64, what: String, p: &mut Problems<'_>| {
        if column > u64::from(MAX_COLUMN) {
            p.push::<()>(
                "dataset.sheet.blocks",
                format!("{what} lies past column ZZZ"),
            );
        } else if let Some(first) = taken.get(&column) {
            let letters = column_letters(u32::try_from(column).unwrap_or(MAX_COLUMN));
            p.push::<()>(
                "dataset.sheet",
                format!("column {letters} is both {first} and {what}; move the columns or change blocks.stride"),
            );
        } else {
            taken.insert(column, what);
        }
    };
    for (name, column) in columns {
        if moves(name) {
            for block in 0..count {
                let at = u64::from(*column) + u64::from(block) * u64::from(stride);
                place(at, format!("field '{name}' of block {}", block + 1), p);
            }
        } else {
            place(u64::from(*column), format!("field '{name}'"), p);
        }
    }
    for (column, _) in write {
        for block in 0..count {
            let at = u64::from(*column) + u64::from(block) * u64::from(stride);
            let what = if blocks.is_some() {
                format!("write.{} of block {}", column_letters(*column), block + 1)
            } else {
                format!("write.{}", column_letters(*column))
            };
            place(at, what, p);
        }
    }
}

fn blocks(raw: RawBlocks, columns: &[(String, u32)], p: &mut Problems<'_>) -> Option<Blocks> {
    let at = |key: &str| format!("dataset.sheet.blocks.{key}");
    let count = match raw.count {
        None => p.push(&at("count"), "is required in blocks"),
        Some(n) if !(1..=1000).contains(&n) => {
            p.push(&at("count"), format!("must be 1 to 1000, got {n}"))
        }
        Some(n) => Some(n),
    };
    let stride = match raw.stride {
        None => p.push(&at("stride"), "is required in blocks"),
        Some(0) => p.push(&at("stride"), "must be at least 1"),
        Some(n) => Some(n),
    };
    let fields = match raw.fields {
        None => p.push(
            &at("fields"),
            "is required in blocks (the fields that move with the block)",
        ),
        Some(f) if f.is_empty() => p.push(&at("fields"), "must name at least one field"),
        Some(f) => {
            let unknown: Vec<&str> = f
                .iter()
                .filter(|name| !columns.iter().any(|(c, _)| c == *name))
                .map(String::as_str)
                .collect();
            if unknown.is_empty() {
                Some(f)
            } else {
                p.push(
                    &at("fields"),
                    format!(
                        "{} not in dataset.sheet.columns (blocks need their columns named)",
                        unknown.join(", ")
                    ),
                )
            }
        }
    };
    Some(Blocks {
        count: count?,
        stride: stride?,
        fields: fields?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_letters_round_trip() {
        for (letters, index) in [
            ("A", 0),
            ("Z", 25),
            ("AA", 26),
            ("AZ", 51),
            ("BA", 52),
            ("ZZZ", 18_277),
        ] {
            assert_eq!(column_index(letters), Some(index), "{letters}");
            assert_eq!(column_letters(index), letters);
        }
        assert_eq!(column_index("e"), Some(4));
        for bad in ["", "A1", "AAAA", "-"] {
            assert_eq!(column_index(bad), None, "{bad}");
        }
    }

    #[test]
    fn spreadsheet_ids_come_from_addresses_too() {
        let id = "1BxiMVs0XRA5nFMdKvBdBZjgmUUqptlbs74OgvE2upms";
        assert_eq!(spreadsheet_id(id).as_deref(), Some(id));
        let url = format!("https://docs.google.com/spreadsheets/d/{id}/edit#gid=0");
        assert_eq!(spreadsheet_id(&url).as_deref(), Some(id));
        let url = format!("https://docs.google.com/spreadsheets/u/0/d/{id}/edit");
        assert_eq!(spreadsheet_id(&url).as_deref(), Some(id));
        assert_eq!(spreadsheet_id("a b"), None);
        assert_eq!(
            spreadsheet_id("https://docs.google.com/spreadsheets/d/"),
            None
        );
    }
}
