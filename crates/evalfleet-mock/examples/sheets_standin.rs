//! The Sheets stand-in as a process of its own, for benchmarks: it trusts
//! one service account's key, serves one tab loaded from a CSV file, and
//! answers `GET /_standin/stats` with what it was sent.
//!
//! ```text
//! cargo run -p evalfleet-mock --example sheets_standin -- \
//!     --key sa.json --csv data.csv --spreadsheet bench --tab Data --port 0
//! ```
//!
//! The first line on stdout is `listening on http://127.0.0.1:PORT`.

use std::io::Write as _;
use std::path::PathBuf;

use clap::Parser;
use evalfleet_mock::sheets::{StandIn, Trusted, user_entered};

/// A stand-in of the Google Sheets API and Google's token endpoint.
#[derive(Parser)]
struct Args {
    /// The port on 127.0.0.1 (0: any free one).
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// The service account's JSON key file, whose key is trusted.
    #[arg(long)]
    key: PathBuf,
    /// A CSV file (no header handling: every line is a row) to load into
    /// the tab; its cells are read as Sheets reads typed text.
    #[arg(long)]
    csv: Option<PathBuf>,
    /// The spreadsheet's id.
    #[arg(long, default_value = "standin")]
    spreadsheet: String,
    /// The tab's name.
    #[arg(long, default_value = "Sheet1")]
    tab: String,
    /// Every Nth write call fails with `--fail-status`.
    #[arg(long)]
    fail_every: Option<u64>,
    /// The status of those failures.
    #[arg(long, default_value_t = 503)]
    fail_status: u16,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let key =
        std::fs::read_to_string(&args.key).map_err(|e| format!("{}: {e}", args.key.display()))?;
    let trusted =
        Trusted::from_key_json(&key).map_err(|e| format!("{}: {e}", args.key.display()))?;
    let standin = StandIn::new(trusted);
    let mut rows = Vec::new();
    if let Some(csv) = &args.csv {
        let mut reader = csv::ReaderBuilder::new()
            .has_headers(false)
            .flexible(true)
            .from_path(csv)
            .map_err(|e| format!("{}: {e}", csv.display()))?;
        for record in reader.records() {
            let record = record.map_err(|e| format!("{}: {e}", csv.display()))?;
            rows.push(record.iter().map(user_entered).collect());
        }
    }
    standin.put_tab(&args.spreadsheet, &args.tab, rows);
    if let Some(every) = args.fail_every {
        standin.fail_every(every, args.fail_status);
    }
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", args.port)).await?;
    let addr = listener.local_addr()?;
    let mut stdout = std::io::stdout();
    writeln!(stdout, "listening on http://{addr}")?;
    stdout.flush()?;
    tokio::select! {
        served = standin.serve(listener) => served?,
        _ = tokio::signal::ctrl_c() => {}
    }
    Ok(())
}
