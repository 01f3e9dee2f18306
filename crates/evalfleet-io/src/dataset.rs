//! Streaming JSONL, CSV and Parquet readers. Memory does not grow with the
//! file: a run scans its dataset once (ids, line numbers, byte offsets and a
//! content hash, all written to the store), then reads each pending row
//! again by its offset when it is dispatched. A Parquet row's "line" is its
//! row number (from 1) and its "offset" its index (from 0), across the
//! shards of its split.

mod parquet;

use crate::confine::Confine;
use parquet::ParquetRows;
pub use parquet::{ColumnKind, ColumnValues, DEFAULT_SPLIT, TableWriter};

use evalfleet_types::Fault;
use std::collections::BTreeSet;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use evalfleet_config::{DatasetConfig, DatasetFormat};

/// One dataset row: field name to value.
pub type Row = Map<String, Value>;

/// At most this many distinct field names are remembered while scanning (for
/// checking templates against them).
const MAX_FIELD_NAMES: usize = 4096;
const BUFFER: usize = 256 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error("cannot open dataset {}: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot read dataset {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{}:{line}: {message}", path.display())]
    Row {
        path: PathBuf,
        line: u64,
        message: String,
    },
    #[error("{}: {message}", path.display())]
    Header { path: PathBuf, message: String },
    /// A Parquet file or folder that cannot be read: the file and why.
    #[error("{}: {message}", path.display())]
    Parquet { path: PathBuf, message: String },
    /// Not one row: nothing to run.
    #[error(
        "{}: the dataset has no items (a JSONL file has one JSON object a line; a CSV file a header line and a row a line; a Parquet file rows)",
        path.display()
    )]
    Empty { path: PathBuf },
}

/// Writes a conversation's made-up episodes (`config.episodes`, one
/// `{"episode": i}` a line) to `config.path` when the file is missing or
/// not what it should be; nothing for a dataset of the user's. Called where
/// a dataset is read, not where a config is: reports and the server read
/// configs without reading their datasets.
pub fn materialize(config: &DatasetConfig) -> io::Result<()> {
    let Some(n) = config.episodes else {
        return Ok(());
    };
    let path = &config.path;
    let line = |i: u64| format!("{{\"episode\":{i}}}\n");
    // 13 bytes a line besides the number's digits.
    let size: u64 = (0..n)
        .map(|i| 13 + u64::from(i.checked_ilog10().unwrap_or(0)) + 1)
        .sum();
    if std::fs::metadata(path).is_ok_and(|m| m.len() == size) {
        return Ok(());
    }
    let partial = path.with_extension(format!("{}.part", std::process::id()));
    let mut out = io::BufWriter::new(File::create(&partial)?);
    for i in 0..n {
        out.write_all(line(i).as_bytes())?;
    }
    out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    std::fs::rename(&partial, path)
}

/// [`materialize`], as a failure to open the dataset.
fn materialized(config: &DatasetConfig) -> Result<(), DatasetError> {
    materialize(config).map_err(|source| DatasetError::Open {
        path: config.path.clone(),
        source,
    })
}

impl DatasetError {
    /// A dataset that cannot be read is the user's to fix.
    pub fn fault(&self) -> Fault {
        Fault::BadInput
    }
}

/// What identifies a dataset file's content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatasetIdentity {
    pub path: PathBuf,
    pub size: u64,
    /// Modification time in nanoseconds since the epoch.
    pub mtime_ns: u128,
    /// SHA-256 of the file's bytes, hex.
    pub sha256: String,
}

impl DatasetIdentity {
    /// Whether `path` still holds this content. The size and modification
    /// time answer at once when unchanged; otherwise the file is hashed again.
    pub fn matches(&self, path: &Path) -> io::Result<bool> {
        self.matches_within(&Confine::default(), path)
    }

    /// [`Self::matches`], its files opened as `confine` allows.
    pub fn matches_within(&self, confine: &Confine, path: &Path) -> io::Result<bool> {
        let (size, mtime_ns) = stat(confine, path)?;
        if size == self.size && mtime_ns == self.mtime_ns {
            return Ok(true);
        }
        if size != self.size {
            return Ok(false);
        }
        Ok(hash_within(confine, path)? == self.sha256)
    }
}

/// SHA-256 of a file's bytes, hex; of a folder of Parquet shards, of all
/// its `.parquet` files' bytes one after the other, in the order of their
/// paths (every split, so that any change is seen).
pub fn hash_file(path: &Path) -> io::Result<String> {
    hash_within(&Confine::default(), path)
}

/// [`hash_file`], its files opened as `confine` allows.
pub fn hash_within(confine: &Confine, path: &Path) -> io::Result<String> {
    let mut hasher = Sha256::new();
    for file in dataset_files(confine, path)? {
        io::copy(&mut confine.open(&file)?, &mut HashWriter(&mut hasher))?;
    }
    Ok(hex::encode(hasher.finalize()))
}

/// The files whose bytes make up the dataset at `path`.
fn dataset_files(confine: &Confine, path: &Path) -> io::Result<Vec<PathBuf>> {
    if confine.is_dir(path) {
        parquet::files_under(confine, path)
    } else {
        Ok(vec![path.to_owned()])
    }
}

/// Size and modification time; of a folder, the sum of its files' sizes and
/// the latest of their times.
fn stat(confine: &Confine, path: &Path) -> io::Result<(u64, u128)> {
    let mut size = 0;
    let mut latest = 0;
    for file in dataset_files(confine, path)? {
        let meta = confine.open(&file)?.metadata()?;
        let mtime_ns = meta
            .modified()?
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        size += meta.len();
        latest = latest.max(mtime_ns);
    }
    Ok((size, latest))
}

struct HashWriter<'a>(&'a mut Sha256);

impl io::Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Hashes everything read through it.
struct HashingReader<R> {
    inner: R,
    hasher: Sha256,
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// One row found by the scan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScannedRow {
    /// The item id; for an invalid row, `line:N`.
    pub id: String,
    /// 1-based line where the row starts.
    pub line: u64,
    /// Byte offset where the row starts.
    pub offset: u64,
    /// Why the row cannot be used, when it cannot.
    pub invalid: Option<String>,
    /// What the check of [`Scanner::next_row_checked`] found wrong with
    /// the row (a JSONL row: the others are checked by their columns).
    pub problem: Option<String>,
}

/// What a finished scan learned about the file.
#[derive(Debug, Clone)]
pub struct ScanSummary {
    pub identity: DatasetIdentity,
    /// Field names seen in valid rows (up to a few thousand).
    pub fields: BTreeSet<String>,
    /// Rows found, valid or not.
    pub rows: u64,
}

/// Reads a dataset from start to end once, yielding each row's id and place.
pub struct Scanner {
    path: PathBuf,
    id_field: Option<String>,
    format: Scan,
    /// A Parquet dataset's hash, taken when it was opened.
    sha256: Option<String>,
    fields: BTreeSet<String>,
    rows: u64,
    size: u64,
    mtime_ns: u128,
}

enum Scan {
    Jsonl {
        reader: BufReader<HashingReader<File>>,
        buf: Vec<u8>,
        offset: u64,
        line: u64,
    },
    Csv {
        reader: Box<csv::Reader<HashingReader<File>>>,
        headers: Vec<String>,
        record: csv::StringRecord,
    },
    Parquet {
        rows: Box<ParquetRows>,
        next: u64,
        /// The top-level columns: a whole row's keys.
        columns: Vec<String>,
    },
}

impl Scanner {
    pub fn open(config: &DatasetConfig) -> Result<Self, DatasetError> {
        materialized(config)?;
        let path = config.path.clone();
        let open_err = |source| DatasetError::Open {
            path: path.clone(),
            source,
        };
        let confine = Confine::of(config.roots.as_deref());
        let (size, mtime_ns) = stat(&confine, &path).map_err(open_err)?;
        let hashing = || -> Result<_, DatasetError> {
            Ok(HashingReader {
                inner: confine.open(&path).map_err(open_err)?,
                hasher: Sha256::new(),
            })
        };
        let mut sha256 = None;
        let format = match config.format {
            DatasetFormat::Jsonl => Scan::Jsonl {
                reader: BufReader::with_capacity(BUFFER, hashing()?),
                buf: Vec::new(),
                offset: 0,
                line: 0,
            },
            DatasetFormat::Csv => {
                let (reader, headers) = open_csv(&path, hashing()?)?;
                Scan::Csv {
                    reader,
                    headers,
                    record: csv::StringRecord::new(),
                }
            }
            DatasetFormat::Parquet => {
                // The scan needs a row's id, not the rest of it: with an id
                // field only that column is decoded, and the field names
                // are the schema's.
                let rows = ParquetRows::open(
                    &confine,
                    parquet::shards(&confine, &path, config.split.as_deref())?,
                    config.id_field.as_deref(),
                )?;
                let columns = rows.columns();
                // Rows are decoded from column chunks, not read as one
                // stream of the file's bytes, so the hash is a pass of its
                // own.
                sha256 =
                    Some(
                        hash_within(&confine, &path).map_err(|source| DatasetError::Read {
                            path: path.clone(),
                            source,
                        })?,
                    );
                Scan::Parquet {
                    rows: Box::new(rows),
                    next: 0,
                    columns,
                }
            }
        };
        Ok(Self {
            path,
            id_field: config.id_field.clone(),
            format,
            sha256,
            fields: BTreeSet::new(),
            rows: 0,
            size,
            mtime_ns,
        })
    }

    /// The CSV columns, known before any row is read; `None` for JSONL.
    pub fn columns(&self) -> Option<&[String]> {
        match &self.format {
            Scan::Csv { headers, .. } => Some(headers),
            Scan::Jsonl { .. } | Scan::Parquet { .. } => None,
        }
    }

    /// The next row, or `None` at the end. Only I/O errors are errors: a
    /// malformed row comes back with `invalid` set.
    pub fn next_row(&mut self) -> Result<Option<ScannedRow>, DatasetError> {
        self.next_row_checked(&mut |_| None)
    }

    /// [`Scanner::next_row`], with `check` asked about each valid JSONL
    /// row as it is read (its answer is the row's `problem`).
    pub fn next_row_checked(
        &mut self,
        check: &mut dyn FnMut(&Row) -> Option<String>,
    ) -> Result<Option<ScannedRow>, DatasetError> {
        let read_err = |path: &Path, source| DatasetError::Read {
            path: path.to_owned(),
            source,
        };
        let (line, offset, parsed) = match &mut self.format {
            Scan::Jsonl {
                reader,
                buf,
                offset,
                line,
            } => loop {
                buf.clear();
                let n = reader
                    .read_until(b'\n', buf)
                    .map_err(|e| read_err(&self.path, e))?;
                if n == 0 {
                    return Ok(None);
                }
                *line += 1;
                let start = *offset;
                *offset += n as u64;
                if buf.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                break (*line, start, parse_jsonl(buf));
            },
            Scan::Csv {
                reader,
                headers,
                record,
            } => {
                let position = reader.position().clone();
                match reader.read_record(record) {
                    Ok(false) => return Ok(None),
                    Ok(true) => (
                        position.line(),
                        position.byte(),
                        Ok(csv_row(headers, record)),
                    ),
                    Err(err) => match err.kind() {
                        csv::ErrorKind::Io(_) => {
                            return Err(read_err(&self.path, io::Error::other(err.to_string())));
                        }
                        _ => (
                            err.position().map_or(position.line(), csv::Position::line),
                            position.byte(),
                            Err(csv_message(&err)),
                        ),
                    },
                }
            }
            Scan::Parquet { rows, next, .. } => {
                let Some(row) = rows.take(*next)? else {
                    return Ok(None);
                };
                *next += 1;
                (*next, *next - 1, Ok(row))
            }
        };
        self.rows += 1;
        let jsonl = matches!(self.format, Scan::Jsonl { .. });
        let mut problem = None;
        let scanned = match parsed.and_then(|row| {
            let id = item_id(&row, self.id_field.as_deref())?;
            if jsonl {
                problem = check(&row);
            }
            if self.fields.len() < MAX_FIELD_NAMES {
                match &self.format {
                    // The row may hold the id column alone.
                    Scan::Parquet { columns, .. } => {
                        if self.fields.is_empty() {
                            self.fields.extend(columns.iter().cloned());
                        }
                    }
                    Scan::Jsonl { .. } | Scan::Csv { .. } => {
                        self.fields.extend(row.keys().cloned());
                    }
                }
            }
            Ok(id)
        }) {
            Ok(id) => ScannedRow {
                id,
                line,
                offset,
                invalid: None,
                problem,
            },
            Err(message) => ScannedRow {
                id: format!("line:{line}"),
                line,
                offset,
                invalid: Some(message),
                problem: None,
            },
        };
        Ok(Some(scanned))
    }

    /// Ends the scan: the file's identity and the field names seen.
    pub fn finish(self) -> ScanSummary {
        let hasher = match self.format {
            Scan::Jsonl { mut reader, .. } => {
                // Read to the end so that the hash covers every byte even if
                // the caller stopped early.
                let _ = io::copy(&mut reader, &mut io::sink());
                reader.into_inner().hasher
            }
            Scan::Csv { reader, .. } => {
                let mut inner = reader.into_inner();
                let _ = io::copy(&mut inner, &mut io::sink());
                inner.hasher
            }
            Scan::Parquet { .. } => Sha256::new(),
        };
        let sha256 = self
            .sha256
            .unwrap_or_else(|| hex::encode(hasher.finalize()));
        ScanSummary {
            identity: DatasetIdentity {
                path: self.path,
                size: self.size,
                mtime_ns: self.mtime_ns,
                sha256,
            },
            fields: self.fields,
            rows: self.rows,
        }
    }
}

fn parse_jsonl(line: &[u8]) -> Result<Row, String> {
    match serde_json::from_slice::<Value>(line) {
        Ok(Value::Object(row)) => Ok(row),
        Ok(other) => Err(format!("expected a JSON object, got {}", json_kind(&other))),
        Err(err) => Err(format!("invalid JSON: {err}")),
    }
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A CSV reader over `input`, with its header row read and checked.
fn open_csv<R: Read>(
    path: &Path,
    input: R,
) -> Result<(Box<csv::Reader<R>>, Vec<String>), DatasetError> {
    let mut reader = csv::ReaderBuilder::new()
        .buffer_capacity(BUFFER)
        .from_reader(input);
    let headers = csv_headers(path, &mut reader)?;
    Ok((Box::new(reader), headers))
}

fn csv_headers<R: Read>(
    path: &Path,
    reader: &mut csv::Reader<R>,
) -> Result<Vec<String>, DatasetError> {
    let header_err = |message: String| DatasetError::Header {
        path: path.to_owned(),
        message,
    };
    let headers = reader
        .headers()
        .map_err(|err| header_err(format!("cannot read the header row: {}", csv_message(&err))))?;
    let mut out: Vec<String> = Vec::with_capacity(headers.len());
    for (i, name) in headers.iter().enumerate() {
        if name.is_empty() {
            return Err(header_err(format!(
                "column {} has an empty name in the header row",
                i + 1
            )));
        }
        if out.iter().any(|n| n == name) {
            return Err(header_err(format!(
                "column '{name}' appears twice in the header row"
            )));
        }
        out.push(name.to_owned());
    }
    if out.is_empty() {
        return Err(header_err("the header row is empty".to_owned()));
    }
    Ok(out)
}

fn csv_row(headers: &[String], record: &csv::StringRecord) -> Row {
    headers
        .iter()
        .zip(record.iter())
        .map(|(name, field)| (name.clone(), Value::String(field.to_owned())))
        .collect()
}

fn csv_message(err: &csv::Error) -> String {
    match err.kind() {
        csv::ErrorKind::UnequalLengths {
            expected_len, len, ..
        } => format!("expected {expected_len} fields like the header row, found {len}"),
        csv::ErrorKind::Utf8 { err, .. } => format!("field {} is not valid UTF-8", err.field() + 1),
        _ => err.to_string(),
    }
}

/// An item's id: the `id_field` (a string or an integer), or a hash of the
/// row's content (canonical JSON, keys sorted), which does not depend on the
/// row's place in the file.
pub fn item_id(row: &Row, id_field: Option<&str>) -> Result<String, String> {
    match id_field {
        Some(field) => match row.get(field) {
            Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
            Some(Value::String(_)) => Err(format!("id field '{field}' is empty")),
            Some(Value::Number(n)) if n.is_i64() || n.is_u64() => Ok(n.to_string()),
            Some(other) => Err(format!(
                "id field '{field}' must be a string or an integer, got {}",
                json_kind(other)
            )),
            None => Err(format!("id field '{field}' is missing")),
        },
        None => {
            let mut canonical = Vec::with_capacity(256);
            write_canonical_object(row, &mut canonical);
            Ok(hex::encode(&Sha256::digest(&canonical)[..8]))
        }
    }
}

/// JSON with object keys sorted at every level, whatever order the map keeps.
pub fn write_canonical(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Object(map) => write_canonical_object(map, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out);
            }
            out.push(b']');
        }
        scalar => {
            serde_json::to_writer(&mut *out, scalar).ok();
        }
    }
}

/// [`write_canonical`] of an object, without wrapping it in a [`Value`]
/// (a row is hashed this way, and a copy of it costs more than the hash).
fn write_canonical_object(map: &Row, out: &mut Vec<u8>) {
    let mut entries: Vec<(&String, &Value)> = map.iter().collect();
    entries.sort_unstable_by_key(|(key, _)| *key);
    out.push(b'{');
    for (i, (key, value)) in entries.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        // Serialising a string cannot fail.
        serde_json::to_writer(&mut *out, key).ok();
        out.push(b':');
        write_canonical(value, out);
    }
    out.push(b'}');
}

/// The key that orders items for sampling: the `n` items with the smallest
/// keys are the sample. It depends only on the seed and the id, so a sample
/// does not change when the file is shuffled.
pub fn sample_key(seed: u64, id: &str) -> i64 {
    let mut hasher = Sha256::new();
    hasher.update(seed.to_le_bytes());
    hasher.update(id.as_bytes());
    let digest = hasher.finalize();
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&digest[..8]);
    i64::from_le_bytes(bytes)
}

/// Reads rows by their byte offset, cheaply when they come in file order.
pub struct RowReader {
    path: PathBuf,
    id_field: Option<String>,
    inner: RowSource,
}

enum RowSource {
    Jsonl {
        reader: BufReader<File>,
        position: u64,
        buf: Vec<u8>,
    },
    Csv {
        reader: Box<csv::Reader<File>>,
        headers: Vec<String>,
        record: csv::StringRecord,
    },
    Parquet(Box<ParquetRows>),
}

impl RowReader {
    pub fn open(config: &DatasetConfig) -> Result<Self, DatasetError> {
        materialized(config)?;
        let path = config.path.clone();
        let confine = Confine::of(config.roots.as_deref());
        let file = || {
            confine.open(&path).map_err(|source| DatasetError::Open {
                path: path.clone(),
                source,
            })
        };
        let inner = match config.format {
            DatasetFormat::Jsonl => RowSource::Jsonl {
                reader: BufReader::with_capacity(BUFFER, file()?),
                position: 0,
                buf: Vec::new(),
            },
            DatasetFormat::Csv => {
                let (reader, headers) = open_csv(&path, file()?)?;
                RowSource::Csv {
                    reader,
                    headers,
                    record: csv::StringRecord::new(),
                }
            }
            DatasetFormat::Parquet => RowSource::Parquet(Box::new(ParquetRows::open(
                &confine,
                parquet::shards(&confine, &path, config.split.as_deref())?,
                None,
            )?)),
        };
        Ok(Self {
            path,
            id_field: config.id_field.clone(),
            inner,
        })
    }

    /// The row that starts at `offset` (on `line`), checked against the id the
    /// scan gave it: a different id means the file changed since.
    pub fn read(&mut self, offset: u64, line: u64, expected_id: &str) -> Result<Row, DatasetError> {
        self.read_with_json(offset, line, expected_id)
            .map(|(row, _)| row)
    }

    /// Like [`RowReader::read`], with the row as JSON text too (for JSONL,
    /// the line itself, without parsing it twice).
    pub fn read_with_json(
        &mut self,
        offset: u64,
        line: u64,
        expected_id: &str,
    ) -> Result<(Row, String), DatasetError> {
        let row_err = |message: String| DatasetError::Row {
            path: self.path.clone(),
            line,
            message,
        };
        let read_err = |source: io::Error| DatasetError::Read {
            path: self.path.clone(),
            source,
        };
        let (row, json) = match &mut self.inner {
            RowSource::Jsonl {
                reader,
                position,
                buf,
            } => {
                if *position != offset {
                    let delta = offset as i64 - *position as i64;
                    if (0..BUFFER as i64).contains(&delta) {
                        reader.seek_relative(delta).map_err(read_err)?;
                    } else {
                        reader.seek(SeekFrom::Start(offset)).map_err(read_err)?;
                    }
                }
                buf.clear();
                let n = reader.read_until(b'\n', buf).map_err(read_err)?;
                *position = offset + n as u64;
                let row = parse_jsonl(buf).map_err(row_err)?;
                let json = String::from_utf8_lossy(buf.trim_ascii()).into_owned();
                (row, json)
            }
            RowSource::Csv {
                reader,
                headers,
                record,
            } => {
                if reader.position().byte() != offset {
                    let mut position = csv::Position::new();
                    position.set_byte(offset).set_line(line);
                    reader
                        .seek(position)
                        .map_err(|err| read_err(io::Error::other(err.to_string())))?;
                }
                match reader.read_record(record) {
                    Ok(true) => {
                        let row = csv_row(headers, record);
                        let json = serde_json::to_string(&row).unwrap_or_default();
                        (row, json)
                    }
                    Ok(false) => return Err(row_err("the file ends before this row".to_owned())),
                    Err(err) => return Err(row_err(csv_message(&err))),
                }
            }
            RowSource::Parquet(rows) => {
                let total = rows.len();
                let Some(row) = rows.get(offset)? else {
                    return Err(row_err(format!(
                        "the dataset has {total} rows now: the dataset changed after the run started"
                    )));
                };
                let json = serde_json::to_string(row).unwrap_or_default();
                (row.clone(), json)
            }
        };
        let id = item_id(&row, self.id_field.as_deref()).map_err(row_err)?;
        if id != expected_id {
            return Err(row_err(format!(
                "this row's id is now '{id}', not '{expected_id}': the dataset changed after the run started"
            )));
        }
        Ok((row, json))
    }
}

/// The item id of sample `k` of a row.
pub fn sample_id(row_id: &str, k: u32) -> String {
    format!("{row_id}#{k}")
}

/// The row id and sample index of an item of a run with `task.n` > 1.
pub fn split_sample_id(item_id: &str) -> Option<(&str, u32)> {
    let (row, k) = item_id.rsplit_once('#')?;
    Some((row, k.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn config(
        dir: &Path,
        name: &str,
        text: &str,
        format: DatasetFormat,
        id_field: Option<&str>,
    ) -> DatasetConfig {
        let path = dir.join(name);
        std::fs::File::create(&path)
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        DatasetConfig {
            path,
            format,
            split: None,
            id_field: id_field.map(str::to_owned),
            episodes: None,
            sample: None,
            limit: None,
            skip_invalid: false,
            sheet: None,
            roots: None,
        }
    }

    fn scan_all(config: &DatasetConfig) -> (Vec<ScannedRow>, ScanSummary) {
        let mut scanner = Scanner::open(config).unwrap();
        let mut rows = Vec::new();
        while let Some(row) = scanner.next_row().unwrap() {
            rows.push(row);
        }
        (rows, scanner.finish())
    }

    #[test]
    fn jsonl_rows_have_lines_offsets_and_reasons() {
        let dir = tempfile::tempdir().unwrap();
        let text = "{\"id\": 1, \"q\": \"a\"}\n\n{\"id\": \"two\"}\n[1]\n{bad\n{\"q\": 3}\n";
        let cfg = config(
            dir.path(),
            "d.jsonl",
            text,
            DatasetFormat::Jsonl,
            Some("id"),
        );
        let (rows, summary) = scan_all(&cfg);
        assert_eq!(rows.len(), 5);
        assert_eq!(
            (rows[0].id.as_str(), rows[0].line, rows[0].offset),
            ("1", 1, 0)
        );
        assert_eq!((rows[1].id.as_str(), rows[1].line), ("two", 3));
        assert_eq!(
            rows[2].invalid.as_deref(),
            Some("expected a JSON object, got an array")
        );
        assert!(
            rows[3]
                .invalid
                .as_deref()
                .unwrap()
                .starts_with("invalid JSON")
        );
        assert_eq!(rows[3].id, "line:5");
        assert_eq!(rows[4].invalid.as_deref(), Some("id field 'id' is missing"));
        assert_eq!(summary.identity.size, text.len() as u64);
        assert_eq!(
            summary.identity.sha256,
            hex::encode(Sha256::digest(text.as_bytes()))
        );
        assert!(summary.fields.contains("q"));

        let mut reader = RowReader::open(&cfg).unwrap();
        let second = reader.read(rows[1].offset, rows[1].line, "two").unwrap();
        assert_eq!(second["id"], "two");
        let first = reader.read(0, 1, "1").unwrap();
        assert_eq!(first["q"], "a");
        let err = reader
            .read(rows[1].offset, rows[1].line, "1")
            .unwrap_err()
            .to_string();
        assert!(err.contains("the dataset changed"), "{err}");
    }

    #[test]
    fn csv_rows_are_read_back_by_offset() {
        let dir = tempfile::tempdir().unwrap();
        let text = "id,question\n1,\"two\nlines\"\n2,plain\n3\n";
        let cfg = config(dir.path(), "d.csv", text, DatasetFormat::Csv, Some("id"));
        let (rows, _) = scan_all(&cfg);
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[1].line, 4);
        assert_eq!(
            rows[2].invalid.as_deref(),
            Some("expected 2 fields like the header row, found 1")
        );
        let mut reader = RowReader::open(&cfg).unwrap();
        assert_eq!(
            reader.read(rows[1].offset, rows[1].line, "2").unwrap()["question"],
            "plain"
        );
        assert_eq!(
            reader.read(rows[0].offset, rows[0].line, "1").unwrap()["question"],
            "two\nlines"
        );
    }

    #[test]
    fn content_ids_ignore_key_order() {
        let a: Row = serde_json::from_str(r#"{"a": 1, "b": {"y": 2, "x": 1}}"#).unwrap();
        let b: Row = serde_json::from_str(r#"{"b": {"x": 1, "y": 2}, "a": 1}"#).unwrap();
        assert_eq!(item_id(&a, None), item_id(&b, None));
        assert_eq!(item_id(&a, None).unwrap().len(), 16);
    }

    #[test]
    fn identity_notices_a_changed_file() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(
            dir.path(),
            "d.jsonl",
            "{\"a\": 1}\n",
            DatasetFormat::Jsonl,
            None,
        );
        let (_, summary) = scan_all(&cfg);
        assert!(summary.identity.matches(&cfg.path).unwrap());
        std::fs::write(&cfg.path, "{\"a\": 2}\n").unwrap();
        assert!(!summary.identity.matches(&cfg.path).unwrap());
    }
}
