//! How values of ours are written to a column, the same in every backend.

use evalfleet_core::store::{ResultView, StoreError};
use evalfleet_types::{Assessment, ErrorClass, ImageRef, ItemStatus, Verdict};

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
