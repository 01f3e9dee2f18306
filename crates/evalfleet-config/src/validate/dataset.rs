//! `dataset:`, validated: a file beside the config (or a folder of Parquet
//! shards), or a Google Sheet whose rows are read into a file of their own.

use std::path::Path;

use crate::problems::Problems;
use crate::raw::{RawDataset, RawSample};
use crate::{DatasetConfig, DatasetFormat, Sample, sheets};

pub(super) fn dataset(
    mut raw: RawDataset,
    dir: &Path,
    p: &mut Problems<'_>,
) -> Option<DatasetConfig> {
    if let Some(sheet) = raw.sheet.take() {
        return sheet_dataset(sheet, raw, p);
    }
    let path = match raw.path.as_deref() {
        None => p.push("dataset.path", "is required"),
        Some(s) if s.trim().is_empty() => p.push("dataset.path", "must not be empty"),
        Some(s) => {
            let resolved = dir.join(s);
            if resolved.is_file() {
                Some(resolved)
            } else if resolved.is_dir() && matches!(raw.format.as_deref(), None | Some("parquet")) {
                // A folder of Parquet shards; which ones is the dataset
                // reader's business.
                Some(resolved)
            } else if resolved.is_dir() {
                p.push(
                    "dataset.path",
                    format!(
                        "{} is a folder: only a Parquet dataset may be a folder of shards",
                        resolved.display()
                    ),
                )
            } else {
                p.push(
                    "dataset.path",
                    format!("no such file: {}", resolved.display()),
                )
            }
        }
    };
    let format = match raw.format.as_deref() {
        Some("jsonl") => Some(DatasetFormat::Jsonl),
        Some("csv") => Some(DatasetFormat::Csv),
        Some("parquet") => Some(DatasetFormat::Parquet),
        Some(other) => p.push(
            "dataset.format",
            format!("must be 'jsonl', 'csv' or 'parquet', got '{other}'"),
        ),
        None => match raw
            .path
            .as_deref()
            .and_then(|s| Path::new(s).extension())
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            Some("jsonl" | "ndjson") => Some(DatasetFormat::Jsonl),
            Some("csv") => Some(DatasetFormat::Csv),
            Some("parquet") => Some(DatasetFormat::Parquet),
            _ if raw.path.is_none() => None,
            _ if path.as_ref().is_some_and(|p| p.is_dir()) => Some(DatasetFormat::Parquet),
            _ => p.push(
                "dataset.format",
                "cannot tell the format from the file's extension; set format: jsonl, csv or parquet",
            ),
        },
    };
    let id_field = match raw.id_field {
        Some(f) if f.is_empty() => p.push("dataset.id_field", "must not be empty"),
        other => Some(other),
    };
    let raw_has_sample = raw.sample.is_some();
    let sample = sample(raw.sample, p);
    let limit = limit(raw.limit, raw_has_sample, p);
    let split = match raw.split {
        Some(s) if s.trim().is_empty() => p.push("dataset.split", "must not be empty"),
        Some(s) if path.as_ref().is_some_and(|p| p.is_file()) => p.push(
            "dataset.split",
            format!(
                "only a folder of Parquet shards has splits; dataset.path is a file, so leave out split: {s}"
            ),
        ),
        other => Some(other),
    };
    Some(DatasetConfig {
        path: path?,
        format: format?,
        split: split?,
        id_field: id_field?,
        sample: sample?,
        limit: limit?,
        skip_invalid: raw.skip_invalid.unwrap_or(false),
        episodes: None,
        sheet: None,
        roots: None,
    })
}

/// `dataset.limit`, validated (`sample`: the dataset has one too).
fn limit(raw: Option<u64>, sample: bool, p: &mut Problems<'_>) -> Option<Option<u64>> {
    match raw {
        Some(0) => p.push("dataset.limit", "must be at least 1, got 0"),
        Some(_) if sample => p.push(
            "dataset.limit",
            "picks the first rows, dataset.sample (or --n-sample) a sample of them all: use one",
        ),
        other => Some(other),
    }
}

/// `dataset.sample`, validated.
fn sample(raw: Option<RawSample>, p: &mut Problems<'_>) -> Option<Option<Sample>> {
    match raw {
        Some(s) => match s.n {
            Some(0) => p.push("dataset.sample.n", "must be at least 1, got 0"),
            Some(n) => Some(Some(Sample {
                n,
                seed: s.seed.unwrap_or(0),
            })),
            None => p.push("dataset.sample.n", "is required in a sample"),
        },
        None => Some(None),
    }
}

/// A dataset read from a Google Sheet: its rows are kept in a JSONL file
/// of their own, named after what is read, with each item's id (its row,
/// and block) in `_id`.
fn sheet_dataset(
    sheet: sheets::RawSheet,
    raw: RawDataset,
    p: &mut Problems<'_>,
) -> Option<DatasetConfig> {
    let mut clash = false;
    for (key, set) in [
        ("path", raw.path.is_some()),
        ("format", raw.format.is_some()),
        ("split", raw.split.is_some()),
        ("id_field", raw.id_field.is_some()),
    ] {
        if set {
            clash = true;
            p.push::<()>(
                &format!("dataset.{key}"),
                "a dataset read from a sheet (dataset.sheet) has no file of its own: leave it out",
            );
        }
    }
    let raw_has_sample = raw.sample.is_some();
    let sample = sample(raw.sample, p);
    let limit = limit(raw.limit, raw_has_sample, p);
    let sheet = sheets::sheet(sheet, p)?;
    if clash {
        return None;
    }
    Some(DatasetConfig {
        path: sheets::unread_path(),
        format: DatasetFormat::Jsonl,
        split: None,
        id_field: Some(sheets::ID_FIELD.to_owned()),
        sample: sample?,
        limit: limit?,
        skip_invalid: raw.skip_invalid.unwrap_or(false),
        episodes: None,
        sheet: Some(sheet),
        roots: None,
    })
}
