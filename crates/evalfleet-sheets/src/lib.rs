//! Google Sheets as a run's dataset and as the place its results go back
//! to (`dataset.sheet`).
//!
//! - [`source`]: the rows (or blocks of rows) of a tab become items, kept in
//!   a JSONL file that the dataset readers read like any other; a resume
//!   reads the sheet again into the same file, so a changed sheet is seen.
//! - [`sink`]: results are written into columns of the same rows, buffered,
//!   retried, and never written where the sheet already holds them, so
//!   that a resume or `evalfleet sync` writes only what is missing.
//! - [`api`] and [`auth`]: the Sheets API v4 and a service account's
//!   tokens; [`quota`]: the account's write quota, shared by its writers.

pub mod api;
pub mod auth;
pub mod quota;
pub mod sink;
pub mod source;

pub use api::SheetsApi;
pub use sink::{Answer, CatchUp, SheetSink, SinkReport};
pub use source::read_dataset;

use evalfleet_config::column_letters;

#[derive(Debug, thiserror::Error)]
pub enum SheetError {
    /// The service account's key cannot be had.
    #[error("{var}: {message}")]
    Key { var: String, message: String },
    /// No access token.
    #[error("{0}")]
    Token(String),
    /// No answer.
    #[error("{what}: {message}")]
    Transport {
        what: String,
        message: String,
        retry: bool,
    },
    /// An answer of the API's that is not a success.
    #[error("{what}: the Sheets API answered {status} ({message})")]
    Api {
        what: String,
        status: u16,
        message: String,
    },
    /// What the sheet holds cannot be used.
    #[error("{0}")]
    Sheet(String),
    /// The file the rows read are kept in.
    #[error("{}: {source}", path.display())]
    Snapshot {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Export(#[from] evalfleet_store::ExportError),
}

impl SheetError {
    pub fn fault(&self) -> evalfleet_types::Fault {
        use evalfleet_types::Fault;
        match self {
            Self::Key { .. } | Self::Sheet(_) => Fault::BadInput,
            Self::Api {
                status: 400 | 403 | 404,
                ..
            } => Fault::BadInput,
            _ => Fault::Failure,
        }
    }

    /// Whether another try may do better.
    pub fn retries(&self) -> bool {
        match self {
            Self::Transport { retry, .. } => *retry,
            Self::Api { status, .. } => matches!(status, 401 | 408 | 429 | 500..=599),
            _ => false,
        }
    }
}

/// A transport error in a line, without the address's query.
pub(crate) fn transport_message(err: &reqwest::Error) -> String {
    let kind = if err.is_timeout() {
        "timed out"
    } else if err.is_connect() {
        "could not connect"
    } else {
        "failed"
    };
    let mut source: Option<&dyn std::error::Error> = std::error::Error::source(err);
    let mut last = None;
    while let Some(s) = source {
        last = Some(s.to_string());
        source = s.source();
    }
    match last {
        Some(cause) => format!("{kind} ({cause})"),
        None => kind.to_owned(),
    }
}

/// The body of an answer, up to 64 MB (a range's values are read whole:
/// a tab of 10,000 rows of text is a few MB); a larger one is an error
/// that says so.
pub(crate) async fn read_limited(response: reqwest::Response) -> Result<String, String> {
    const LIMIT: usize = 64 * 1024 * 1024;
    let mut response = response;
    let mut out = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                if out.len() + chunk.len() > LIMIT {
                    return Err(
                        "the answer is larger than 64 MB; read fewer rows at once (dataset.sheet.last_row)"
                            .to_owned(),
                    );
                }
                out.extend_from_slice(&chunk);
            }
            Ok(None) => break,
            Err(err) => return Err(format!("the answer was cut ({})", transport_message(&err))),
        }
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// A whole tab: its name quoted, its quotes doubled.
pub fn tab(name: &str) -> String {
    format!("'{}'", name.replace('\'', "''"))
}

/// `'Tab'!A1:C9`, `'Tab'!A2:C` (to the last row with values), `'Tab'!E5`.
pub fn a1(tab: &str, from: (u32, u32), to: Option<(u32, Option<u32>)>) -> String {
    let tab = self::tab(tab);
    let cell = |(col, row): (u32, u32)| format!("{}{row}", column_letters(col));
    match to {
        None => format!("{tab}!{}", cell(from)),
        Some((col, Some(row))) => format!("{tab}!{}:{}", cell(from), cell((col, row))),
        Some((col, None)) => format!("{tab}!{}:{}", cell(from), column_letters(col)),
    }
}

/// A sheet's settings for unit tests: tab `T`, header row 1, no columns,
/// blocks or writes, writes not paced.
#[cfg(test)]
pub(crate) fn test_config() -> evalfleet_config::SheetConfig {
    evalfleet_config::SheetConfig {
        spreadsheet_id: "s".to_owned(),
        tab: "T".to_owned(),
        header_row: 1,
        first_row: 2,
        last_row: None,
        columns: Vec::new(),
        blocks: None,
        write: Vec::new(),
        key_env: "K".to_owned(),
        api_url: "http://127.0.0.1:1".to_owned(),
        flush_rows: 50,
        flush_interval: std::time::Duration::from_secs(2),
        min_write_interval: std::time::Duration::ZERO,
        retries: 5,
        retry_backoff: std::time::Duration::from_secs(1),
        quota_wait: std::time::Duration::from_secs(60),
        writes_per_minute: 60,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_quote_their_tab() {
        assert_eq!(a1("Sheet1", (4, 5), None), "'Sheet1'!E5");
        assert_eq!(a1("My 'tab'", (0, 2), Some((5, None))), "'My ''tab'''!A2:F");
        assert_eq!(a1("T", (26, 1), Some((27, Some(9)))), "'T'!AA1:AB9");
    }
}
