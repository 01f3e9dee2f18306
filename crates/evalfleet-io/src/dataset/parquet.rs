//! Parquet datasets: one file, or a folder of shards in the Hugging Face
//! layout with a split chosen by name. Rows are decoded as a stream, a page
//! of each column at a time, so memory holds neither a file nor a row group
//! (pyarrow writes a million rows to a group unless told otherwise). A row's
//! place is its index across the split's shards, in the order of their
//! paths.
//!
//! Each row becomes a JSON object: a struct a nested object, a list an
//! array, a map an object, a null `null`, binary data base64 text (which an
//! image field takes as it is), dates, times and decimals text.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parquet::basic::{Compression, LogicalType, Repetition, Type as PhysicalType};
use parquet::data_type::{BoolType, ByteArray, ByteArrayType, DoubleType, Int64Type};
use parquet::errors::ParquetError;
use parquet::file::properties::WriterProperties;
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::file::writer::SerializedFileWriter;
use parquet::record::Field;
use parquet::record::reader::{ReaderIter, TreeBuilder};
use parquet::schema::types::{SchemaDescriptor, Type};
use serde_json::Value;

use super::{DatasetError, Row};
use crate::confine::Confine;

/// The split read from a folder whose shards hold several, unless one is
/// named.
pub const DEFAULT_SPLIT: &str = "train";

/// Every `.parquet` file under `dir` (in sub-folders too), sorted by path.
/// Confined (a config from outside), no link is followed.
pub(super) fn files_under(confine: &Confine, dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    confine.files_under(dir, &|path| {
        path.extension().is_some_and(|e| e == "parquet")
    })
}

/// The split a shard belongs to: its file name up to the first `-`
/// (`train-00000-of-00003.parquet`, `test.parquet`), or, when that is only
/// digits (`0000.parquet`), the name of its folder.
fn split_of(file: &Path) -> String {
    let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    let head = stem.split_once('-').map_or(stem, |(head, _)| head);
    let folder = file
        .parent()
        .and_then(Path::file_name)
        .and_then(|s| s.to_str());
    match folder {
        Some(folder) if head.is_empty() || head.bytes().all(|b| b.is_ascii_digit()) => {
            folder.to_owned()
        }
        _ => head.to_owned(),
    }
}

/// Whether the folder `path` is one the `datasets` library's
/// `save_to_disk` wrote: its `state.json` or `dataset_dict.json`, or Arrow
/// files, there or a level down (a `DatasetDict`'s splits).
fn saved_by_datasets(path: &Path) -> bool {
    let marks = |dir: &Path| {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .any(|entry| {
                let name = entry.file_name();
                let name = name.to_string_lossy();
                name == "state.json" || name == "dataset_dict.json" || name.ends_with(".arrow")
            })
    };
    marks(path)
        || std::fs::read_dir(path)
            .into_iter()
            .flatten()
            .flatten()
            .any(|entry| entry.path().is_dir() && marks(&entry.path()))
}

/// The files of the dataset at `path`: the file itself, or the shards of
/// `split` in a folder.
pub(super) fn shards(
    confine: &Confine,
    path: &Path,
    split: Option<&str>,
) -> Result<Vec<PathBuf>, DatasetError> {
    if !confine.is_dir(path) {
        return Ok(vec![path.to_owned()]);
    }
    let files = files_under(confine, path).map_err(|source| DatasetError::Open {
        path: path.to_owned(),
        source,
    })?;
    let bad = |message: String| DatasetError::Parquet {
        path: path.to_owned(),
        message,
    };
    if files.is_empty() {
        if saved_by_datasets(path) {
            return Err(bad(
                "the folder was written by the datasets library's save_to_disk (Arrow files), which evalfleet does not read: \
                 write it as Parquet instead (ds.to_parquet('items.parquet'), or for each split of a DatasetDict \
                 ds[split].to_parquet(f'data/{split}-00000-of-00001.parquet')) and name that"
                    .to_owned(),
            ));
        }
        return Err(bad("the folder holds no .parquet file".to_owned()));
    }
    let mut splits: Vec<String> = files.iter().map(|f| split_of(f)).collect();
    let chosen = match split {
        Some(split) => split.to_owned(),
        None => {
            let first = &splits[0];
            if splits.iter().all(|s| s == first) {
                first.clone()
            } else {
                DEFAULT_SPLIT.to_owned()
            }
        }
    };
    let picked: Vec<PathBuf> = files
        .iter()
        .zip(&splits)
        .filter(|(_, s)| **s == chosen)
        .map(|(f, _)| f.clone())
        .collect();
    if picked.is_empty() {
        splits.sort();
        splits.dedup();
        return Err(bad(format!(
            "no shard of split '{chosen}' (the splits here: {}); set dataset.split",
            splits.join(", ")
        )));
    }
    Ok(picked)
}

/// One shard: its reader (the footer read) and its row groups' sizes.
struct Shard {
    path: PathBuf,
    reader: SerializedFileReader<File>,
    /// Index of the shard's first row among all the shards' rows.
    start: u64,
    /// Rows in each row group.
    groups: Vec<u64>,
}

/// Where the rows are being decoded: a row group's rows, streamed page by
/// page, and the index of the row they yield next.
struct Cursor {
    shard: usize,
    group: usize,
    /// Index (across the shards) of the row `rows` yields next.
    next: u64,
    /// Index of the first row after the group.
    end: u64,
    rows: ReaderIter,
}

/// A split's rows, by index. A row group is decoded as a stream (each
/// column a page at a time), so memory holds a page of each column and one
/// row, whatever the size of the group. Reading forward costs nothing
/// more than the rows passed over; going back reopens the group and decodes
/// it from its start to the row.
pub(super) struct ParquetRows {
    shards: Vec<Shard>,
    /// With a name: rows hold only that top-level column, where a shard
    /// has it (the scan needs the id, not the rest of the row).
    only: Option<String>,
    cursor: Option<Cursor>,
    /// The row read last, kept for the next read of the same row (the
    /// items of `task.n` > 1 read one row several times in a row).
    last: Option<(u64, Row)>,
    total: u64,
}

impl ParquetRows {
    /// Opens each of `files` and reads its footer. With `only`, rows hold
    /// that column alone, in the shards that have it.
    pub(super) fn open(
        confine: &Confine,
        files: Vec<PathBuf>,
        only: Option<&str>,
    ) -> Result<Self, DatasetError> {
        let mut shards = Vec::with_capacity(files.len());
        let mut start = 0;
        for path in files {
            let file = confine.open(&path).map_err(|source| DatasetError::Open {
                path: path.clone(),
                source,
            })?;
            let reader = SerializedFileReader::new(file).map_err(|err| DatasetError::Parquet {
                path: path.clone(),
                message: format!("not a readable Parquet file: {err}"),
            })?;
            let groups: Vec<u64> = reader
                .metadata()
                .row_groups()
                .iter()
                .map(|g| u64::try_from(g.num_rows()).unwrap_or(0))
                .collect();
            let rows: u64 = groups.iter().sum();
            shards.push(Shard {
                path,
                reader,
                start,
                groups,
            });
            start += rows;
        }
        Ok(Self {
            shards,
            only: only.map(str::to_owned),
            cursor: None,
            last: None,
            total: start,
        })
    }

    /// How many rows the shards hold.
    pub(super) fn len(&self) -> u64 {
        self.total
    }

    /// The top-level columns of the shards, each once, in the order of the
    /// shards and of their schemas: the keys of a whole row.
    pub(super) fn columns(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for shard in &self.shards {
            let schema = shard.reader.metadata().file_metadata().schema();
            for field in schema.get_fields() {
                if !names.iter().any(|n| n == field.name()) {
                    names.push(field.name().to_owned());
                }
            }
        }
        names
    }

    /// Row `index` (0-based, across the shards); `None` past the end. The
    /// same row asked for twice in a row is decoded once.
    pub(super) fn get(&mut self, index: u64) -> Result<Option<&Row>, DatasetError> {
        if !matches!(&self.last, Some((at, _)) if *at == index) {
            self.last = None;
            let Some(row) = self.take(index)? else {
                return Ok(None);
            };
            self.last = Some((index, row));
        }
        Ok(self.last.as_ref().map(|(_, row)| row))
    }

    /// Decodes row `index` and hands it over; `None` past the end. Rows
    /// between the cursor and `index` in its group are decoded and dropped.
    pub(super) fn take(&mut self, index: u64) -> Result<Option<Row>, DatasetError> {
        if index >= self.total {
            return Ok(None);
        }
        let cursor = match self.cursor.take() {
            Some(cursor) if (cursor.next..cursor.end).contains(&index) => cursor,
            _ => match self.open_group_of(index)? {
                Some(cursor) => cursor,
                None => return Ok(None),
            },
        };
        // The cursor goes back only when the row was read: a row group
        // that fails to decode is opened again at the next read.
        let (cursor, row) = self.read_at(cursor, index)?;
        self.cursor = Some(cursor);
        Ok(Some(row))
    }

    /// Moves `cursor` to row `index` of its group and decodes that row.
    fn read_at(&self, mut cursor: Cursor, index: u64) -> Result<(Cursor, Row), DatasetError> {
        let shard = &self.shards[cursor.shard];
        let group = cursor.group;
        let bad = |message: String| DatasetError::Parquet {
            path: shard.path.clone(),
            message: format!("cannot read row group {group}: {}", codec_hint(&message)),
        };
        loop {
            let row = match cursor.rows.next() {
                Some(row) => row.map_err(|err| bad(err.to_string()))?,
                None => {
                    return Err(bad(format!(
                        "it ends before row {} of {}",
                        cursor.next - shard.start,
                        cursor.end - shard.start
                    )));
                }
            };
            cursor.next += 1;
            if cursor.next > index {
                return Ok((cursor, row_to_json(row)));
            }
        }
    }

    /// Opens the row group that holds row `index`, its cursor at the
    /// group's first row.
    fn open_group_of(&self, index: u64) -> Result<Option<Cursor>, DatasetError> {
        let Some((at, shard)) = self
            .shards
            .iter()
            .enumerate()
            .find(|(_, s)| index < s.start + s.groups.iter().sum::<u64>())
        else {
            return Ok(None);
        };
        let mut start = shard.start;
        let mut group = 0;
        while group + 1 < shard.groups.len() && start + shard.groups[group] <= index {
            start += shard.groups[group];
            group += 1;
        }
        let bad = |err: ParquetError| DatasetError::Parquet {
            path: shard.path.clone(),
            message: format!(
                "cannot read row group {group}: {}",
                codec_hint(&err.to_string())
            ),
        };
        let schema = shard.reader.metadata().file_metadata().schema_descr_ptr();
        let root = schema.root_schema();
        let projected = self.only.as_deref().and_then(|name| {
            let field = root.get_fields().iter().find(|f| f.name() == name)?;
            Type::group_type_builder(root.name())
                .with_fields(vec![Arc::clone(field)])
                .build()
                .ok()
        });
        let schema = match projected {
            Some(projected) => Arc::new(SchemaDescriptor::new(Arc::new(projected))),
            None => schema,
        };
        let reader = shard.reader.get_row_group(group).map_err(bad)?;
        let rows = TreeBuilder::new().as_iter(schema, &*reader).map_err(bad)?;
        Ok(Some(Cursor {
            shard: at,
            group,
            next: start,
            end: start + shard.groups[group],
            rows,
        }))
    }
}

/// A decoded row as a JSON object, as the record API's `to_json_value`
/// makes it, with the column names and the text of text columns moved
/// rather than copied.
fn row_to_json(row: parquet::record::Row) -> Row {
    row.into_columns()
        .into_iter()
        .map(|(name, field)| {
            let value = match field {
                Field::Str(text) => Value::String(text),
                Field::Group(group) => Value::Object(row_to_json(group)),
                other => other.to_json_value(),
            };
            (name, value)
        })
        .collect()
}

/// What a column of a [`TableWriter`] holds; every column may hold nulls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColumnKind {
    /// UTF-8 text.
    Text,
    /// 64-bit floats.
    Float,
    /// 64-bit signed integers.
    Int,
    Bool,
}

/// One column's values in a row group; `None` is null.
#[derive(Debug, Clone, PartialEq)]
pub enum ColumnValues {
    Text(Vec<Option<String>>),
    Float(Vec<Option<f64>>),
    Int(Vec<Option<i64>>),
    Bool(Vec<Option<bool>>),
}

impl ColumnValues {
    /// An empty column of `kind`.
    pub fn new(kind: ColumnKind) -> Self {
        match kind {
            ColumnKind::Text => Self::Text(Vec::new()),
            ColumnKind::Float => Self::Float(Vec::new()),
            ColumnKind::Int => Self::Int(Vec::new()),
            ColumnKind::Bool => Self::Bool(Vec::new()),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Self::Text(v) => v.len(),
            Self::Float(v) => v.len(),
            Self::Int(v) => v.len(),
            Self::Bool(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn clear(&mut self) {
        match self {
            Self::Text(v) => v.clear(),
            Self::Float(v) => v.clear(),
            Self::Int(v) => v.clear(),
            Self::Bool(v) => v.clear(),
        }
    }
}

/// The values present, and a definition level per row (1 present, 0 null).
fn levels<T: Clone>(values: &[Option<T>]) -> (Vec<T>, Vec<i16>) {
    let present = values.iter().flatten().cloned().collect();
    let defined = values.iter().map(|v| i16::from(v.is_some())).collect();
    (present, defined)
}

/// A flat Parquet table (snappy-compressed), written one row group at a
/// time, so that memory holds one group.
pub struct TableWriter<W: Write + Send> {
    inner: SerializedFileWriter<W>,
}

impl<W: Write + Send> TableWriter<W> {
    /// A table of `columns` (name and kind, in order) written to `out`.
    pub fn new(out: W, columns: &[(String, ColumnKind)]) -> Result<Self, ParquetError> {
        let mut fields = Vec::with_capacity(columns.len());
        for (name, kind) in columns {
            let (physical, logical) = match kind {
                ColumnKind::Text => (PhysicalType::BYTE_ARRAY, Some(LogicalType::String)),
                ColumnKind::Float => (PhysicalType::DOUBLE, None),
                ColumnKind::Int => (PhysicalType::INT64, None),
                ColumnKind::Bool => (PhysicalType::BOOLEAN, None),
            };
            let field = Type::primitive_type_builder(name, physical)
                .with_logical_type(logical)
                .with_repetition(Repetition::OPTIONAL)
                .build()?;
            fields.push(Arc::new(field));
        }
        let schema = Type::group_type_builder("schema")
            .with_fields(fields)
            .build()?;
        let props = WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .build();
        Ok(Self {
            inner: SerializedFileWriter::new(out, Arc::new(schema), Arc::new(props))?,
        })
    }

    /// Writes one row group: every column's values, in the order of the
    /// columns, all of the same length; leaves them empty.
    pub fn write_group(&mut self, columns: &mut [ColumnValues]) -> Result<(), ParquetError> {
        let mut group = self.inner.next_row_group()?;
        for values in columns.iter_mut() {
            let Some(mut column) = group.next_column()? else {
                return Err(ParquetError::General(
                    "more columns of values than the table has".to_owned(),
                ));
            };
            match values {
                ColumnValues::Text(v) => {
                    let (present, defined) = levels(v);
                    let present: Vec<ByteArray> = present
                        .into_iter()
                        .map(|s| ByteArray::from(s.into_bytes()))
                        .collect();
                    column
                        .typed::<ByteArrayType>()
                        .write_batch(&present, Some(&defined), None)?;
                }
                ColumnValues::Float(v) => {
                    let (present, defined) = levels(v);
                    column
                        .typed::<DoubleType>()
                        .write_batch(&present, Some(&defined), None)?;
                }
                ColumnValues::Int(v) => {
                    let (present, defined) = levels(v);
                    column
                        .typed::<Int64Type>()
                        .write_batch(&present, Some(&defined), None)?;
                }
                ColumnValues::Bool(v) => {
                    let (present, defined) = levels(v);
                    column
                        .typed::<BoolType>()
                        .write_batch(&present, Some(&defined), None)?;
                }
            }
            column.close()?;
            values.clear();
        }
        group.close()?;
        Ok(())
    }

    /// Writes the footer; the table is complete.
    pub fn finish(self) -> Result<W, ParquetError> {
        self.inner.into_inner()
    }
}

/// A decoding error, or what to do when it says the file is compressed
/// with a codec this build does not read.
fn codec_hint(message: &str) -> String {
    const DISABLED: &str = "Disabled feature at compile time: ";
    match message.split_once(DISABLED) {
        Some((_, codec)) => format!(
            "it is compressed with {}, which evalfleet does not read (it reads snappy, zstd, gzip and lz4, and files not compressed): write it again with one of them (pyarrow: compression='zstd'; polars writes zstd by default)",
            codec.trim()
        ),
        None => message.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::{RowReader, Scanner};
    use evalfleet_config::{DatasetConfig, DatasetFormat};
    use parquet::basic::Compression;
    use parquet::data_type::{
        BoolType, ByteArray, ByteArrayType, DoubleType, Int32Type, Int64Type,
    };
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;
    use serde_json::json;
    use std::sync::Arc;

    /// One leaf column's part of a row group: values, definition and
    /// repetition levels.
    enum Leaf {
        I64(Vec<i64>),
        I32(Vec<i32>, Vec<i16>),
        F64(Vec<f64>),
        Bool(Vec<bool>),
        Bytes(Vec<&'static [u8]>, Vec<i16>),
        List(Vec<&'static [u8]>, Vec<i16>, Vec<i16>),
    }

    fn write(path: &Path, schema: &str, groups: Vec<Vec<Leaf>>) {
        let schema = Arc::new(parse_message_type(schema).unwrap());
        let props = Arc::new(
            WriterProperties::builder()
                .set_compression(Compression::SNAPPY)
                .build(),
        );
        let file = File::create(path).unwrap();
        let mut writer = SerializedFileWriter::new(file, schema, props).unwrap();
        for group in groups {
            let mut rg = writer.next_row_group().unwrap();
            for leaf in group {
                let mut col = rg.next_column().unwrap().unwrap();
                let bytes = |v: Vec<&[u8]>| v.into_iter().map(ByteArray::from).collect::<Vec<_>>();
                match leaf {
                    Leaf::I64(v) => col.typed::<Int64Type>().write_batch(&v, None, None),
                    Leaf::I32(v, d) => col.typed::<Int32Type>().write_batch(&v, Some(&d), None),
                    Leaf::F64(v) => col.typed::<DoubleType>().write_batch(&v, None, None),
                    Leaf::Bool(v) => col.typed::<BoolType>().write_batch(&v, None, None),
                    Leaf::Bytes(v, d) => {
                        col.typed::<ByteArrayType>()
                            .write_batch(&bytes(v), Some(&d), None)
                    }
                    Leaf::List(v, d, r) => {
                        col.typed::<ByteArrayType>()
                            .write_batch(&bytes(v), Some(&d), Some(&r))
                    }
                }
                .unwrap();
                col.close().unwrap();
            }
            rg.close().unwrap();
        }
        writer.close().unwrap();
    }

    const SCHEMA: &str = "message m {
        required int64 id;
        optional binary name (STRING);
        required double score;
        required boolean ok;
        optional int32 n;
        optional binary blob;
        optional group meta {
            optional binary lang (STRING);
            optional int32 level;
        }
        optional group tags (LIST) {
            repeated group list {
                optional binary element (STRING);
            }
        }
    }";

    /// Three rows in two row groups, `first_id` counting up: every kind of
    /// column, nulls, a nested struct, lists full, empty and null.
    fn write_sample(path: &Path, first_id: i64) {
        let (a, b, c) = (first_id, first_id + 1, first_id + 2);
        write(
            path,
            SCHEMA,
            vec![
                vec![
                    Leaf::I64(vec![a, b]),
                    Leaf::Bytes(vec![b"a"], vec![1, 0]),
                    Leaf::F64(vec![0.5, 1.5]),
                    Leaf::Bool(vec![true, false]),
                    Leaf::I32(vec![7], vec![1, 0]),
                    Leaf::Bytes(vec![&[0, 1, 2]], vec![1, 0]),
                    Leaf::Bytes(vec![b"en"], vec![2, 0]),
                    Leaf::I32(vec![3], vec![2, 0]),
                    Leaf::List(vec![b"x", b"y"], vec![3, 3, 1], vec![0, 1, 0]),
                ],
                vec![
                    Leaf::I64(vec![c]),
                    Leaf::Bytes(vec![b"c"], vec![1]),
                    Leaf::F64(vec![2.0]),
                    Leaf::Bool(vec![true]),
                    Leaf::I32(vec![9], vec![1]),
                    Leaf::Bytes(vec![b"hi"], vec![1]),
                    Leaf::Bytes(vec![b"fr"], vec![2]),
                    Leaf::I32(vec![], vec![1]),
                    Leaf::List(vec![], vec![0], vec![0]),
                ],
            ],
        );
    }

    fn config(path: &Path, split: Option<&str>) -> DatasetConfig {
        DatasetConfig {
            path: path.to_owned(),
            format: DatasetFormat::Parquet,
            split: split.map(str::to_owned),
            id_field: Some("id".to_owned()),
            sample: None,
            limit: None,
            skip_invalid: false,
            episodes: None,
            sheet: None,
            roots: None,
        }
    }

    fn scan(config: &DatasetConfig) -> Vec<crate::dataset::ScannedRow> {
        let mut scanner = Scanner::open(config).unwrap();
        let mut rows = Vec::new();
        while let Some(row) = scanner.next_row().unwrap() {
            rows.push(row);
        }
        rows
    }

    #[test]
    fn a_parquet_file_reads_as_json_rows_group_by_group() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.parquet");
        write_sample(&path, 1);
        let cfg = config(&path, None);
        let rows = scan(&cfg);
        let ids: Vec<_> = rows
            .iter()
            .map(|r| (r.id.as_str(), r.line, r.offset))
            .collect();
        assert_eq!(ids, [("1", 1, 0), ("2", 2, 1), ("3", 3, 2)]);
        assert!(rows.iter().all(|r| r.invalid.is_none()));

        let mut reader = RowReader::open(&cfg).unwrap();
        let read = |reader: &mut RowReader, i: usize| {
            let r = &rows[i];
            Value::Object(reader.read(r.offset, r.line, &r.id).unwrap())
        };
        // Out of order: the third row (the second group), then the first.
        assert_eq!(
            read(&mut reader, 2),
            json!({"id": 3, "name": "c", "score": 2.0, "ok": true, "n": 9,
                   "blob": "aGk=", "meta": {"lang": "fr", "level": null}, "tags": null})
        );
        assert_eq!(
            read(&mut reader, 0),
            json!({"id": 1, "name": "a", "score": 0.5, "ok": true, "n": 7,
                   "blob": "AAEC", "meta": {"lang": "en", "level": 3}, "tags": ["x", "y"]})
        );
        assert_eq!(
            read(&mut reader, 1),
            json!({"id": 2, "name": null, "score": 1.5, "ok": false, "n": null,
                   "blob": null, "meta": null, "tags": []})
        );
        let err = reader.read(0, 1, "2").unwrap_err().to_string();
        assert!(err.contains("the dataset changed"), "{err}");
    }

    #[test]
    fn rows_of_one_large_group_are_read_forward_back_and_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("one.parquet");
        let n = 3000;
        let file = File::create(&path).unwrap();
        let mut writer = TableWriter::new(
            file,
            &[
                ("id".to_owned(), ColumnKind::Text),
                ("n".to_owned(), ColumnKind::Int),
            ],
        )
        .unwrap();
        writer
            .write_group(&mut [
                ColumnValues::Text((0..n).map(|i| Some(format!("r{i}"))).collect()),
                ColumnValues::Int((0..n).map(|i| (i % 7 != 0).then_some(i)).collect()),
            ])
            .unwrap();
        writer.finish().unwrap();

        // The scan decodes the id column alone; the fields are every column.
        let cfg = config(&path, None);
        let mut scanner = Scanner::open(&cfg).unwrap();
        let mut last = None;
        while let Some(row) = scanner.next_row().unwrap() {
            last = Some(row);
        }
        let last = last.unwrap();
        assert_eq!(
            (last.id.as_str(), last.line, last.offset),
            ("r2999", 3000, 2999)
        );
        let summary = scanner.finish();
        assert_eq!(summary.rows, 3000);
        assert_eq!(
            summary.fields.iter().collect::<Vec<_>>(),
            [&"id".to_owned(), &"n".to_owned()]
        );

        // Forward with gaps, the same row twice, back, and forward again.
        let mut reader = RowReader::open(&cfg).unwrap();
        for i in [0u64, 5, 1500, 1500, 2999, 7, 8, 2000] {
            let row = reader.read(i, i + 1, &format!("r{i}")).unwrap();
            let n = if i % 7 == 0 { json!(null) } else { json!(i) };
            assert_eq!(Value::Object(row), json!({"id": format!("r{i}"), "n": n}));
        }
        let err = reader.read(3000, 3001, "r3000").unwrap_err().to_string();
        assert!(err.contains("the dataset has 3000 rows now"), "{err}");
    }

    #[test]
    fn a_folder_of_shards_reads_the_chosen_split_in_path_order() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        write_sample(&data.join("train-00001-of-00002.parquet"), 4);
        write_sample(&data.join("train-00000-of-00002.parquet"), 1);
        write_sample(&data.join("test-00000-of-00001.parquet"), 100);
        let ids = |split| {
            scan(&config(dir.path(), split))
                .into_iter()
                .map(|r| r.id)
                .collect::<Vec<_>>()
        };
        assert_eq!(ids(None), ["1", "2", "3", "4", "5", "6"]);
        assert_eq!(ids(Some("test")), ["100", "101", "102"]);
        let err = Scanner::open(&config(dir.path(), Some("validation")))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("no shard of split 'validation' (the splits here: test, train)"),
            "{err}"
        );

        // Rows are read back across shards; the identity covers every file.
        let cfg = config(dir.path(), None);
        let mut scanner = Scanner::open(&cfg).unwrap();
        while scanner.next_row().unwrap().is_some() {}
        let summary = scanner.finish();
        assert_eq!(summary.rows, 6);
        assert!(summary.fields.contains("meta"));
        let mut reader = RowReader::open(&cfg).unwrap();
        assert_eq!(reader.read(4, 5, "5").unwrap()["score"], 1.5);
        assert!(summary.identity.matches(dir.path()).unwrap());
        write_sample(&data.join("test-00000-of-00001.parquet"), 200);
        assert!(!summary.identity.matches(dir.path()).unwrap());
    }

    #[test]
    fn a_folder_with_one_split_reads_it_without_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let split = dir.path().join("default").join("test");
        std::fs::create_dir_all(&split).unwrap();
        write_sample(&split.join("0000.parquet"), 1);
        let rows = scan(&config(dir.path(), None));
        assert_eq!(rows.len(), 3);
        assert!(scan(&config(dir.path(), Some("test"))).len() == 3);
    }

    #[test]
    fn a_corrupt_parquet_file_is_named_with_the_problem() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.parquet");
        std::fs::write(&path, b"PAR1 this is not parquet at all").unwrap();
        let err = Scanner::open(&config(&path, None))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.starts_with(&format!(
                "{}: not a readable Parquet file: ",
                path.display()
            )),
            "{err}"
        );
        // A file whose footer is fine but whose data pages are not.
        let good = dir.path().join("good.parquet");
        write_sample(&good, 1);
        let mut bytes = std::fs::read(&good).unwrap();
        for b in &mut bytes[4..40] {
            *b = 0xff;
        }
        std::fs::write(&good, &bytes).unwrap();
        let mut scanner = Scanner::open(&config(&good, None)).unwrap();
        let err = scanner.next_row().err().unwrap().to_string();
        assert!(
            err.starts_with(&format!("{}: cannot read row group 0: ", good.display())),
            "{err}"
        );
    }

    #[test]
    fn an_empty_folder_says_it_holds_no_parquet() {
        let dir = tempfile::tempdir().unwrap();
        let err = Scanner::open(&config(dir.path(), None))
            .err()
            .unwrap()
            .to_string();
        assert!(err.ends_with("the folder holds no .parquet file"), "{err}");
    }
}
