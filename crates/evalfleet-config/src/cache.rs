//! The response cache: a successful answer stored under the SHA-256 of the
//! canonical request, so that the same request in a later run (or a resume)
//! is answered without calling any endpoint. Errors are never stored.

use std::time::Duration;

use serde_json::value::RawValue;
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

/// `cache.mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheMode {
    /// Look answers up and store new ones.
    ReadWrite,
    /// Look up only.
    Read,
    /// Store only (refresh a cache without reading it).
    Write,
    /// Neither (the default).
    #[default]
    Off,
}

impl CacheMode {
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "read_write" => Some(Self::ReadWrite),
            "read" => Some(Self::Read),
            "write" => Some(Self::Write),
            "off" => Some(Self::Off),
            _ => None,
        }
    }

    pub fn reads(self) -> bool {
        matches!(self, Self::ReadWrite | Self::Read)
    }

    pub fn writes(self) -> bool {
        matches!(self, Self::ReadWrite | Self::Write)
    }
}

/// `cache:` in a config.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CacheSettings {
    pub mode: CacheMode,
    /// A file of its own for the cache (shared by runs of several stores),
    /// relative to the current directory like `store`; default: the run's
    /// store.
    pub path: Option<std::path::PathBuf>,
    /// Entries older than this are not used (and are evicted first).
    pub ttl: Option<Duration>,
    /// The most entries kept; the oldest go first.
    pub max_entries: Option<u64>,
}

/// What a request is, for the cache, apart from its messages and sample
/// index: the model and the generation parameters (the task's, with the
/// endpoint's over them). The text is canonical JSON (keys sorted), so equal
/// requests give equal keys whatever order a config lists them in.
pub fn identity(
    model: &str,
    task_params: &Map<String, Value>,
    endpoint_params: &Map<String, Value>,
) -> String {
    let mut params = task_params.clone();
    for (k, v) in endpoint_params {
        params.insert(k.clone(), v.clone());
    }
    // serde_json's map is ordered by key: this is canonical.
    json!({ "model": model, "params": params }).to_string()
}

/// The key of a request: SHA-256 over its identity, its sample index (`n:
/// K` samples of one item are distinct requests) and its messages.
pub fn key(identity: &str, sample: u32, messages: &RawValue) -> String {
    let mut hasher = Sha256::new();
    hasher.update(identity.as_bytes());
    hasher.update([0]);
    hasher.update(sample.to_le_bytes());
    hasher.update(messages.get().as_bytes());
    hex::encode(hasher.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_depend_on_every_part_of_the_request_and_nothing_else() {
        let params = |v: Value| v.as_object().unwrap().clone();
        let task = params(json!({"temperature": 0, "max_tokens": 64}));
        let same = params(json!({"max_tokens": 64, "temperature": 0}));
        let none = Map::new();
        let messages =
            RawValue::from_string(r#"[{"role":"user","content":"hi"}]"#.to_owned()).unwrap();
        let other =
            RawValue::from_string(r#"[{"role":"user","content":"ho"}]"#.to_owned()).unwrap();
        let a = key(&identity("m", &task, &none), 0, &messages);
        let same_key = key(&identity("m", &same, &none), 0, &messages);
        assert_eq!(a, same_key, "key order does not matter");
        assert_ne!(a, key(&identity("m2", &task, &none), 0, &messages));
        let sample = key(&identity("m", &task, &none), 1, &messages);
        assert_ne!(a, sample, "samples are distinct");
        let hot = params(json!({"temperature": 1}));
        assert_ne!(a, key(&identity("m", &task, &hot), 0, &messages));
        assert_ne!(a, key(&identity("m", &task, &none), 0, &other));
        assert_eq!(a.len(), 64);
    }
}
