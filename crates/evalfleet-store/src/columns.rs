//! How values of ours are written to a column, the same in every backend.

use evalfleet_core::store::StoreError;
use evalfleet_types::{Assessment, ImageRef, Verdict};

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
