//! The config as written: every field optional, so that one pass can read all
//! of a file and the validator can report every problem at once. Unknown keys
//! are collected (not silently ignored) while deserialising.

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::path;

/// A problem found while reading raw sections: the path it is at (to find its
/// line) and the whole message, which starts with the path.
pub type RawProblem = (String, String);

#[derive(Debug, Default, Deserialize)]
pub struct RawConfig {
    pub name: Option<String>,
    pub dataset: Option<Value>,
    pub endpoints: Option<Value>,
    pub task: Option<Value>,
    pub retry: Option<Value>,
    pub timeouts: Option<Value>,
    pub writer: Option<Value>,
    pub cache: Option<Value>,
    pub report: Option<Value>,
    pub shutdown_grace: Option<String>,
    pub store: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub struct RawDataset {
    pub path: Option<String>,
    pub format: Option<String>,
    pub id_field: Option<String>,
    pub sample: Option<RawSample>,
    pub skip_invalid: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
pub struct RawSample {
    pub n: Option<u64>,
    pub seed: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
pub struct RawTask {
    pub kind: Option<String>,
    pub messages: Option<Vec<RawMessage>>,
    pub params: Option<Map<String, Value>>,
    pub stream: Option<bool>,
    pub n: Option<u32>,
    pub parse: Option<Value>,
    pub schema: Option<Value>,
    pub schema_file: Option<String>,
    pub max_reasks: Option<u32>,
    pub structured_output: Option<bool>,
    pub metrics: Option<Vec<Value>>,
    pub code: Option<Value>,
    pub refine: Option<Value>,
    pub conversation: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
pub struct RawRefine {
    pub prompt: Option<String>,
    pub rounds: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
pub struct RawCode {
    pub format: Option<String>,
    pub language: Option<String>,
    pub timeout: Option<String>,
    pub wall_timeout: Option<String>,
    pub memory_mb: Option<u64>,
    pub output_bytes: Option<usize>,
    pub early_exit: Option<bool>,
    pub judge_concurrency: Option<usize>,
    pub float_tolerance: Option<f64>,
    pub python: Option<String>,
    pub compiler: Option<String>,
    pub compile_timeout: Option<String>,
    pub tests_field: Option<OneOrMany>,
    pub backend: Option<String>,
    pub sandbox_url: Option<String>,
    pub sandbox_retries: Option<u32>,
}

/// A text, or a list of texts.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
pub struct RawMessage {
    pub role: Option<String>,
    pub content: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub struct RawRetry {
    pub max_attempts: Option<u32>,
    pub backoff_base: Option<String>,
    pub backoff_max: Option<String>,
    pub budget: Option<f64>,
    pub budget_floor: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
pub struct RawTimeouts {
    pub attempt: Option<String>,
    pub item: Option<String>,
    pub no_endpoint: Option<String>,
    pub lease: Option<String>,
    pub first_byte: Option<String>,
    pub stream_idle: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub struct RawReport {
    pub max_unscored: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
pub struct RawWriter {
    pub batch_size: Option<usize>,
    pub flush_interval: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub struct RawCache {
    pub mode: Option<String>,
    pub path: Option<String>,
    pub ttl: Option<String>,
    pub max_entries: Option<u64>,
}

/// Deserialises `value` (found at `at`) as `T`, recording unknown keys and a
/// type error, each with its full path. Returns `None` on a type error.
pub fn section<T: DeserializeOwned>(
    value: &Value,
    at: &str,
    problems: &mut Vec<RawProblem>,
) -> Option<T> {
    let mut unknown = Vec::new();
    let result: Result<T, _> = {
        let mut record = |p: serde_ignored::Path<'_>| unknown.push(ignored_path(at, &p));
        let de = serde_ignored::Deserializer::new(value, &mut record);
        serde_path_to_error::deserialize(de)
    };
    for key_path in unknown {
        let (parent, key) = match key_path.rfind('.') {
            Some(cut) => (key_path[..cut].to_owned(), key_path[cut + 1..].to_owned()),
            None => (String::new(), key_path.clone()),
        };
        let place = if parent.is_empty() {
            "config".to_owned()
        } else {
            parent
        };
        problems.push((key_path, format!("{place}: unknown key '{key}'")));
    }
    match result {
        Ok(value) => Some(value),
        Err(err) => {
            let mut full = at.to_owned();
            for segment in err.path().iter() {
                full = match segment {
                    serde_path_to_error::Segment::Seq { index } => path::index(&full, *index),
                    serde_path_to_error::Segment::Map { key } => path::key(&full, key),
                    serde_path_to_error::Segment::Enum { variant } => path::key(&full, variant),
                    serde_path_to_error::Segment::Unknown => full,
                };
            }
            let message = format!("{full}: {}", err.into_inner());
            problems.push((full, message));
            None
        }
    }
}

fn ignored_path(at: &str, p: &serde_ignored::Path<'_>) -> String {
    match p {
        serde_ignored::Path::Root => at.to_owned(),
        serde_ignored::Path::Seq { parent, index } => {
            path::index(&ignored_path(at, parent), *index)
        }
        serde_ignored::Path::Map { parent, key } => path::key(&ignored_path(at, parent), key),
        serde_ignored::Path::Some { parent }
        | serde_ignored::Path::NewtypeStruct { parent }
        | serde_ignored::Path::NewtypeVariant { parent } => ignored_path(at, parent),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_keys_and_type_errors_carry_full_paths() {
        let value = serde_json::json!({"path": "d.jsonl", "colour": "red", "sample": {"n": "many", "x": 1}});
        let mut problems = Vec::new();
        let parsed: Option<RawDataset> = section(&value, "dataset", &mut problems);
        assert!(parsed.is_none());
        let paths: Vec<_> = problems.iter().map(|(p, _)| p.as_str()).collect();
        assert!(paths.contains(&"dataset.colour"), "{problems:?}");
        assert!(paths.contains(&"dataset.sample.n"), "{problems:?}");
        let unknown = problems
            .iter()
            .find(|(p, _)| p == "dataset.colour")
            .unwrap();
        assert_eq!(unknown.1, "dataset: unknown key 'colour'");
    }
}
