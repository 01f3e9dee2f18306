//! What determines a run's results: the dataset's content and how it is read,
//! and the task. A resume is refused when any of it changed; the endpoints
//! and their concurrency may change freely.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::dataset::write_canonical;
use evalfleet_config::{Config, Part};

/// How the dataset is read into items.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatasetOptions {
    pub format: String,
    pub id_field: Option<String>,
    pub sample_n: Option<u64>,
    pub sample_seed: Option<u64>,
    pub skip_invalid: bool,
    /// A Parquet folder's `dataset.split`, as given (absent from older
    /// runs' fingerprints, and when not given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fingerprint {
    /// SHA-256 of the dataset file.
    pub dataset_sha256: String,
    pub dataset_options: DatasetOptions,
    /// SHA-256 of `task.messages` (canonical JSON).
    pub messages_sha256: String,
    /// SHA-256 of `task.params` (canonical JSON).
    pub params_sha256: String,
    /// `task.n` (left out when 1, so fingerprints stored before it existed
    /// read the same).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub samples: u32,
    /// SHA-256 of what in `task.images` determines the bytes sent (left out
    /// when no message has images).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub images_sha256: Option<String>,
}

fn one() -> u32 {
    1
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's signature
fn is_one(n: &u32) -> bool {
    *n == 1
}

fn canonical_sha256(value: &Value) -> String {
    let mut out = Vec::new();
    write_canonical(value, &mut out);
    hex::encode(Sha256::digest(&out))
}

/// `task.messages`, with the rules of `task.prompts` when there are any
/// (so that the fingerprints of runs without rules read as before). A
/// rule's model condition is in as written: which endpoints serve the run
/// may change between sessions, and each result records its rule.
fn prompts_value(config: &Config, messages: Vec<Value>) -> Value {
    let messages = Value::Array(messages);
    if config.task.prompts.is_empty() {
        return messages;
    }
    let rules: Vec<Value> = config
        .task
        .prompts
        .iter()
        .map(|rule| {
            serde_json::json!({
                "name": rule.name,
                "when": rule.when,
                "model": rule.model,
                "messages": rule.messages.iter()
                    .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
                    .collect::<Vec<_>>(),
            })
        })
        .collect();
    serde_json::json!({"messages": messages, "prompts": rules})
}

impl Fingerprint {
    /// The fingerprint of `config` over a dataset whose content hashes to
    /// `dataset_sha256`.
    pub fn new(config: &Config, dataset_sha256: String) -> Self {
        let messages: Vec<Value> = config
            .task
            .messages
            .iter()
            .map(|m| {
                if m.parts.is_empty() {
                    return serde_json::json!({"role": m.role, "content": m.content});
                }
                let parts: Vec<Value> = m
                    .parts
                    .iter()
                    .map(|part| match part {
                        Part::Text(text) => serde_json::json!({"text": text}),
                        Part::Image(image) => serde_json::json!({"image": image}),
                    })
                    .collect();
                serde_json::json!({"role": m.role, "content": parts})
            })
            .collect();
        let has_images = config
            .task
            .messages
            .iter()
            .any(|m| m.parts.iter().any(|p| matches!(p, Part::Image(_))));
        let dataset = &config.dataset;
        Self {
            dataset_sha256,
            dataset_options: DatasetOptions {
                format: dataset.format.as_str().to_owned(),
                id_field: dataset.id_field.clone(),
                sample_n: dataset.sample.map(|s| s.n),
                sample_seed: dataset.sample.map(|s| s.seed),
                skip_invalid: dataset.skip_invalid,
                split: dataset.split.clone(),
            },
            messages_sha256: canonical_sha256(&prompts_value(config, messages)),
            params_sha256: canonical_sha256(&Value::Object(config.task.params.clone())),
            samples: config.task.samples,
            images_sha256: has_images.then(|| canonical_sha256(&config.task.images.identity())),
        }
    }

    /// A short digest of the whole fingerprint.
    pub fn digest(&self) -> String {
        let value = serde_json::to_value(self).unwrap_or(Value::Null);
        canonical_sha256(&value)[..16].to_owned()
    }

    /// What differs between the stored fingerprint (`self`) and `current`,
    /// in words; empty when they match.
    pub fn differences(&self, current: &Self) -> Vec<String> {
        let mut out = Vec::new();
        if self.dataset_sha256 != current.dataset_sha256 {
            out.push(format!(
                "the dataset's content changed (sha256 {} -> {})",
                &self.dataset_sha256[..12.min(self.dataset_sha256.len())],
                &current.dataset_sha256[..12.min(current.dataset_sha256.len())]
            ));
        }
        let (a, b) = (&self.dataset_options, &current.dataset_options);
        let mut option = |name: &str, old: String, new: String| {
            if old != new {
                out.push(format!("dataset.{name} changed ({old} -> {new})"));
            }
        };
        option("format", a.format.clone(), b.format.clone());
        option("id_field", show(&a.id_field), show(&b.id_field));
        option("sample.n", show(&a.sample_n), show(&b.sample_n));
        option("sample.seed", show(&a.sample_seed), show(&b.sample_seed));
        option(
            "skip_invalid",
            a.skip_invalid.to_string(),
            b.skip_invalid.to_string(),
        );
        option("split", show(&a.split), show(&b.split));
        if self.messages_sha256 != current.messages_sha256 {
            out.push("task.messages changed (or task.prompts)".to_owned());
        }
        if self.params_sha256 != current.params_sha256 {
            out.push("task.params changed".to_owned());
        }
        if self.samples != current.samples {
            out.push(format!(
                "task.n changed ({} -> {})",
                self.samples, current.samples
            ));
        }
        out
    }
}

fn show<T: ToString>(value: &Option<T>) -> String {
    value
        .as_ref()
        .map_or_else(|| "unset".to_owned(), ToString::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(task: &str) -> Config {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("d.jsonl"), "{\"q\": 1}\n").unwrap();
        let text = format!(
            "name: f\ndataset: {{ path: d.jsonl }}\nendpoints:\n  - {{ name: m, kind: mock }}\ntask:\n{task}"
        );
        evalfleet_config::load_text(&text, dir.path(), Default::default(), "f.yaml", None)
            .unwrap()
            .config
    }

    #[test]
    fn prompt_rules_are_part_of_the_fingerprint_and_runs_without_them_keep_theirs() {
        let plain = config("  messages: [{ role: user, content: \"{{ q }}\" }]\n");
        // What fingerprints stored before prompt rules existed hashed.
        let messages = serde_json::json!([{"role": "user", "content": "{{ q }}"}]);
        assert_eq!(
            Fingerprint::new(&plain, String::new()).messages_sha256,
            canonical_sha256(&messages)
        );
        let ruled = |content: &str| {
            config(&format!(
                "  messages: [{{ role: user, content: \"{{{{ q }}}}\" }}]\n  prompts:\n    - when: {{ q: 1 }}\n      messages: [{{ role: user, content: \"{content}\" }}]\n"
            ))
        };
        let a = Fingerprint::new(&ruled("A {{ q }}"), String::new());
        let b = Fingerprint::new(&ruled("B {{ q }}"), String::new());
        assert_ne!(a.messages_sha256, canonical_sha256(&messages));
        assert_eq!(
            a.differences(&b),
            vec!["task.messages changed (or task.prompts)".to_owned()]
        );
    }
}
