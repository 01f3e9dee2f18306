//! How values of ours are written to columns and read back from them, the
//! same in every backend.

use crate::{ResultView, StoreError};
use evalfleet_types::{Assessment, ErrorClass, ImageRef, ItemStatus, Verdict};

/// A store error naming what could not be read or written as JSON.
pub(crate) fn json_err(context: &str) -> impl Fn(serde_json::Error) -> StoreError + '_ {
    move |err| StoreError::backend(context, err)
}

/// A stored name that this evalfleet does not know: the store was written
/// by another version, or damaged.
pub(crate) fn unknown(err: evalfleet_types::UnknownName) -> StoreError {
    StoreError::Invariant(format!("the store holds an {err}"))
}

/// An error class column, parsed.
pub(crate) fn error_class_column(text: Option<String>) -> Result<Option<ErrorClass>, StoreError> {
    text.as_deref()
        .map(ErrorClass::parse)
        .transpose()
        .map_err(unknown)
}

pub(crate) fn opt_u64(value: Option<u64>) -> Option<i64> {
    value.map(|v| v as i64)
}

/// A column holding JSON text, parsed.
pub(crate) fn json_column(text: Option<String>) -> Result<Option<serde_json::Value>, StoreError> {
    text.map(|t| serde_json::from_str(&t).map_err(json_err("a stored value is not JSON")))
        .transpose()
}

/// An assessment's columns: parsed, verdict, check_error, scores, reasks,
/// judge (each JSON as text).
pub(crate) type AssessmentColumns<'a> = (
    Option<String>,
    Option<&'static str>,
    Option<&'a str>,
    Option<String>,
    u32,
    Option<String>,
);

pub(crate) fn assessment_columns(a: &Assessment) -> Result<AssessmentColumns<'_>, StoreError> {
    let scores = if a.scores.is_empty() {
        None
    } else {
        Some(
            serde_json::to_string(&a.scores)
                .map_err(|err| StoreError::backend("cannot encode scores", err))?,
        )
    };
    Ok((
        a.parsed.as_ref().map(ToString::to_string),
        a.verdict.map(Verdict::as_str),
        a.check_error.as_deref(),
        scores,
        a.reasks,
        a.code.as_ref().map(ToString::to_string),
    ))
}

/// A result's images as their column holds them: JSON, or NULL for none.
pub(crate) fn images_column(images: &[ImageRef]) -> Result<Option<String>, StoreError> {
    if images.is_empty() {
        return Ok(None);
    }
    serde_json::to_string(images)
        .map(Some)
        .map_err(|err| StoreError::backend("cannot encode a result's images", err))
}

/// A page's result from its columns (seq, then item_id, status, verdict,
/// scores, item and the failure's class as text), read in place by `text`.
pub(crate) fn result_view<'a>(
    seq: u64,
    text: impl Fn(usize) -> Result<Option<&'a str>, StoreError>,
) -> Result<ResultView<'a>, StoreError> {
    let unknown = |err: evalfleet_types::UnknownName| {
        StoreError::Invariant(format!("the store holds an {err}"))
    };
    Ok(ResultView {
        seq,
        item_id: text(1)?.unwrap_or_default(),
        status: ItemStatus::parse(text(2)?.unwrap_or_default()).map_err(unknown)?,
        verdict: text(3)?.map(Verdict::parse).transpose().map_err(unknown)?,
        scores: text(4)?,
        item: text(5)?,
        failure: text(6)?
            .map(ErrorClass::parse)
            .transpose()
            .map_err(unknown)?,
    })
}

/// A run's row as stored, before its JSON columns are read.
pub(crate) struct RawRun {
    pub run_id: String,
    pub name: String,
    pub status: String,
    pub created_at: i64,
    pub updated_at: i64,
    pub config: String,
    pub config_dir: String,
    pub fingerprint: String,
    pub dataset: String,
    pub total: i64,
    pub sessions: i64,
    pub message: Option<String>,
    pub generation: i64,
}

impl RawRun {
    /// The run, its JSON columns read.
    pub(crate) fn decode(self) -> Result<crate::RunRecord, StoreError> {
        let json = |what: &'static str| move |err| StoreError::backend(what, err);
        Ok(crate::RunRecord {
            status: evalfleet_types::RunStatus::parse(&self.status)
                .map_err(|err| StoreError::Invariant(format!("the store holds an {err}")))?,
            config: serde_json::from_str(&self.config)
                .map_err(json("the stored config is not JSON"))?,
            fingerprint: serde_json::from_str(&self.fingerprint)
                .map_err(json("the stored fingerprint cannot be read"))?,
            dataset: serde_json::from_str(&self.dataset)
                .map_err(json("the stored dataset identity cannot be read"))?,
            run_id: self.run_id,
            name: self.name,
            created_at_ms: self.created_at,
            updated_at_ms: self.updated_at,
            config_dir: self.config_dir,
            total: self.total.max(0) as u64,
            sessions: self.sessions.max(0) as u32,
            message: self.message,
            generation: self.generation.max(0) as u64,
        })
    }
}

/// For a failed result (`r`), the class of its item's last failed call:
/// why it failed, read from the attempts (their key finds them at once).
pub(crate) const FAILURE: &str = "CASE WHEN r.status = 'failed' THEN (SELECT a.error_class FROM attempts a \
                       WHERE a.rid = r.rid AND a.seq = r.seq AND a.error_class IS NOT NULL \
                       ORDER BY a.attempt DESC LIMIT 1) END";

/// A result from its `seq`, its re-asks, and its other columns read as
/// text by `text`: item_id (1), status, output, endpoint, model, item,
/// parsed, verdict, check_error, scores (10), judge (12), prompt, the
/// failure's class ([`FAILURE`], 14) and the error (15).
pub(crate) fn stored_result<'a>(
    seq: u64,
    reasks: u32,
    text: impl Fn(usize) -> Result<Option<&'a str>, StoreError>,
) -> Result<crate::StoredResult, StoreError> {
    let unknown = |err: evalfleet_types::UnknownName| {
        StoreError::Invariant(format!("the store holds an {err}"))
    };
    let owned = |i: usize| Ok::<_, StoreError>(text(i)?.map(str::to_owned));
    let json = |i: usize| {
        text(i)?
            .map(serde_json::from_str)
            .transpose()
            .map_err(|err| StoreError::backend("a stored value is not JSON", err))
    };
    let scores = match text(10)? {
        Some(text) => serde_json::from_str::<evalfleet_types::Scores>(text)
            .map_err(|err| StoreError::backend("stored scores cannot be read", err))?,
        None => evalfleet_types::Scores::new(),
    };
    Ok(crate::StoredResult {
        seq,
        item_id: text(1)?.unwrap_or_default().to_owned(),
        status: ItemStatus::parse(text(2)?.unwrap_or_default()).map_err(unknown)?,
        output: owned(3)?,
        endpoint: owned(4)?,
        model: owned(5)?,
        item: owned(6)?,
        assessment: Assessment {
            parsed: json(7)?,
            verdict: text(8)?.map(Verdict::parse).transpose().map_err(unknown)?,
            check_error: owned(9)?,
            scores,
            reasks,
            code: json(12)?,
        },
        prompt: owned(13)?,
        failure: text(14)?
            .map(ErrorClass::parse)
            .transpose()
            .map_err(unknown)?,
        error: owned(15)?,
    })
}

/// How recent a worker's snapshot must be (against the newest) for its
/// figures of the moment to count.
const SNAPSHOT_CURRENT_MS: i64 = 10_000;

/// A run's endpoint snapshots from their rows (JSON, when written), or
/// `None` when no worker wrote any.
pub(crate) fn endpoint_states(
    rows: Vec<(String, i64)>,
) -> Result<Option<crate::EndpointStates>, StoreError> {
    if rows.is_empty() {
        return Ok(None);
    }
    let updated_at_ms = rows.iter().map(|(_, at)| *at).max().unwrap_or(0);
    // Rows come by endpoint, a row per worker that saw it: summed, the
    // figures of the moment (limit, calls in flight, state) only from the
    // workers whose snapshot is current; a current one leads.
    let seen = rows
        .into_iter()
        .map(|(json, at)| {
            serde_json::from_str::<evalfleet_types::EndpointSnapshot>(&json)
                .map(|snapshot| (snapshot, at >= updated_at_ms - SNAPSHOT_CURRENT_MS))
                .map_err(|err| StoreError::backend("a stored endpoint state cannot be read", err))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut endpoints = Vec::new();
    for rows in seen.chunk_by(|a, b| a.0.endpoint == b.0.endpoint) {
        let lead = rows.iter().position(|(_, live)| *live).unwrap_or(0);
        let mut summed = rows[lead].0.clone();
        for (i, (snapshot, live)) in rows.iter().enumerate() {
            if i != lead {
                summed.merge(snapshot, *live);
            }
        }
        endpoints.push(summed);
    }
    Ok(Some(crate::EndpointStates {
        updated_at_ms,
        endpoints,
    }))
}

/// Bodies shorter than this are stored as text; longer ones compressed.
const PACK_FROM: usize = 1024;

/// zstd's level for stored bodies: its default, fast to write (an agent's
/// history sent again each turn compresses well at any level).
const PACK_LEVEL: i32 = 3;

/// An agent call's body (request or response) as it is stored, whole:
/// as text when short, else compressed (zstd), in a column beside it.
pub(crate) fn pack(text: &str) -> (Option<&str>, Option<Vec<u8>>) {
    if text.len() < PACK_FROM {
        return (Some(text), None);
    }
    match zstd::bulk::compress(text.as_bytes(), PACK_LEVEL) {
        Ok(packed) if packed.len() < text.len() => (None, Some(packed)),
        _ => (Some(text), None),
    }
}

/// A body stored by [`pack`]: its text column, or its compressed one.
pub(crate) fn unpack(
    text: Option<String>,
    packed: Option<Vec<u8>>,
) -> Result<Option<String>, StoreError> {
    let Some(packed) = packed else {
        return Ok(text);
    };
    let bytes = zstd::stream::decode_all(packed.as_slice())
        .map_err(|err| StoreError::backend("a stored call's body cannot be decompressed", err))?;
    String::from_utf8(bytes)
        .map(Some)
        .map_err(|err| StoreError::backend("a stored call's body is not UTF-8", err))
}
