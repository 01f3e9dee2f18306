//! A config's problems, collected rather than returned at the first one, so
//! that a file's problems are all reported at once; each keeps its path,
//! which finds its line.

use std::time::Duration;

use super::path;

/// A problem found while reading raw sections: the path it is at (to find its
/// line) and the whole message, which starts with the path.
pub type RawProblem = (String, String);

/// Collects problems; `push` returns `None` so that a field can be
/// `Some(value)` or a recorded problem in one expression.
pub(super) struct Problems<'a>(pub(super) &'a mut Vec<RawProblem>);

impl Problems<'_> {
    pub(super) fn push<T>(&mut self, at: &str, message: impl std::fmt::Display) -> Option<T> {
        self.0.push((at.to_owned(), format!("{at}: {message}")));
        None
    }

    /// `key`, unknown at `place` where the keys are `known`: reported with
    /// the nearest known key, as the raw sections' unknown keys are.
    pub(super) fn unknown_key<T>(&mut self, place: &str, key: &str, known: &[String]) -> Option<T> {
        let message = super::schema::unknown_key(place, key, known);
        self.0.push((path::key(place, key), message));
        None
    }

    pub(super) fn duration(
        &mut self,
        at: &str,
        text: Option<&str>,
        default: &str,
    ) -> Option<Duration> {
        let text = text.unwrap_or(default);
        match humantime::parse_duration(text) {
            Ok(d) if d.is_zero() => self.push(at, "must be longer than zero"),
            Ok(d) => Some(d),
            Err(_) => self.push(
                at,
                format!("expected a duration like 500ms, 30s or 5m, got '{text}'"),
            ),
        }
    }
}
