//! What an answer is worth: whether it could be used, and its scores.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Whether an answer could be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// Parsed and, with a schema, valid.
    Ok,
    /// It could not be parsed.
    Unparsed,
    /// Parsed, but not of the task's schema.
    Invalid,
}

crate::names!(Verdict, "verdict", {
    Ok => "ok",
    Unparsed => "unparsed",
    Invalid => "invalid",
});

impl Verdict {
    pub fn is_ok(self) -> bool {
        self == Self::Ok
    }
}

/// One metric's score of one item: its value, or why it has none, and what
/// the metric adds (edit counts, matched fields, the judge's verdict...).
/// Read by hand (below), not derived: serde's `flatten` would buffer every
/// field of every score, and reports read a score per item and metric.
#[derive(Debug, Clone, Default, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Score {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<f64>,
    /// Why the item could not be scored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(flatten)]
    pub detail: Map<String, Value>,
}

impl<'de> Deserialize<'de> for Score {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(ScoreVisitor)
    }
}

/// A score's key: its two own, or one the metric added.
enum ScoreKey {
    Value,
    Error,
    Detail(String),
}

impl<'de> Deserialize<'de> for ScoreKey {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl serde::de::Visitor<'_> for KeyVisitor {
            type Value = ScoreKey;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a score's key")
            }
            fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<ScoreKey, E> {
                Ok(match key {
                    "value" => ScoreKey::Value,
                    "error" => ScoreKey::Error,
                    other => ScoreKey::Detail(other.to_owned()),
                })
            }
        }
        deserializer.deserialize_str(KeyVisitor)
    }
}

struct ScoreVisitor;

impl<'de> serde::de::Visitor<'de> for ScoreVisitor {
    type Value = Score;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a score: an object with a value or an error")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Score, A::Error> {
        let mut score = Score::default();
        while let Some(key) = map.next_key::<ScoreKey>()? {
            match key {
                ScoreKey::Value => score.value = map.next_value()?,
                ScoreKey::Error => score.error = map.next_value()?,
                ScoreKey::Detail(key) => {
                    let value: Value = map.next_value()?;
                    score.detail.insert(key, value);
                }
            }
        }
        Ok(score)
    }
}

impl Score {
    pub fn value(value: f64) -> Self {
        Self {
            value: Some(value),
            ..Self::default()
        }
    }

    pub fn error(error: impl Into<String>) -> Self {
        Self {
            error: Some(error.into()),
            ..Self::default()
        }
    }

    /// A score from its JSON form: `{"value": v, ...}` or `{"error": e}`;
    /// anything else is kept as detail, with no value.
    pub fn from_json(value: Value) -> Self {
        serde_json::from_value(value).unwrap_or_else(|err| Self::error(err.to_string()))
    }

    /// A number the metric added (`edits`, `tp`, ...).
    pub fn count(&self, key: &str) -> u64 {
        self.detail.get(key).and_then(Value::as_u64).unwrap_or(0)
    }

    /// A text the metric added (`reference`, `predicted`, ...).
    pub fn text(&self, key: &str) -> &str {
        self.detail.get(key).and_then(Value::as_str).unwrap_or("")
    }
}

/// An item's scores by metric key (`exact_match@1`, or the metric's `as:`).
pub type Scores = BTreeMap<String, Score>;

/// What checking and scoring made of an item's answer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Assessment {
    /// The extracted answer (`None`: not parsed, or the task has no parser).
    pub parsed: Option<Value>,
    /// `None` when the task checks nothing.
    pub verdict: Option<Verdict>,
    /// Why the answer is not valid.
    pub check_error: Option<String>,
    pub scores: Scores,
    /// Times the model was asked again after an answer it could not use.
    pub reasks: u32,
    /// The code judge's judgement of the answer as a program.
    pub code: Option<Value>,
}

impl Assessment {
    /// Whether the answer could be used: it was checked and found wanting
    /// otherwise.
    pub fn usable(&self) -> bool {
        self.verdict.is_none_or(Verdict::is_ok)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_score_reads_its_value_its_error_and_what_the_metric_added() {
        let score: super::Score =
            serde_json::from_str(r#"{"value": 0.5, "edits": 3, "reference": "x"}"#).unwrap();
        assert_eq!(score.value, Some(0.5));
        assert_eq!((score.count("edits"), score.text("reference")), (3, "x"));
        let score: super::Score =
            serde_json::from_str(r#"{"value": null, "error": "no number"}"#).unwrap();
        assert_eq!(
            (score.value, score.error.as_deref()),
            (None, Some("no number"))
        );
        assert_eq!(
            serde_json::to_value(&score).unwrap(),
            serde_json::json!({"error": "no number"})
        );
        assert!(serde_json::from_str::<super::Score>(r#"{"value": "high"}"#).is_err());
    }

    use super::*;

    #[test]
    fn scores_keep_their_stored_json_form() {
        let stored = r#"{"a":{"value":1.0},"b":{"error":"no reference"},"c":{"edits":2,"length":5,"value":0.4}}"#;
        let scores: Scores = serde_json::from_str(stored).unwrap();
        assert_eq!(scores["a"], Score::value(1.0));
        assert_eq!(scores["b"].error.as_deref(), Some("no reference"));
        assert_eq!(
            (scores["c"].count("edits"), scores["c"].value),
            (2, Some(0.4))
        );
        let again: Scores = serde_json::from_str(&serde_json::to_string(&scores).unwrap()).unwrap();
        assert_eq!(again, scores);
        assert_eq!(Verdict::parse("invalid"), Ok(Verdict::Invalid));
        assert!(Verdict::parse("fine").is_err());
    }
}
