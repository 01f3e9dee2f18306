//! The configuration reference (`docs/config.md`), made from the config's
//! schema and so from the doc comments of the raw structs, which are the
//! one place a key is documented. A test fails when a key has no
//! description or no default, or when the page is not what this makes;
//! `EVALFLEET_BLESS=1 cargo test -p evalfleet-config config_reference`
//! writes the page again.

use serde_json::Value;

use super::raw;
use super::schema::{self, alternatives};

/// Where the page lives, from the workspace's root.
pub const PAGE: &str = "docs/config.md";

/// The command that writes the page again.
pub const REGENERATE: &str = "EVALFLEET_BLESS=1 cargo test -p evalfleet-config config_reference";

/// A mapping of the config and its keys.
#[derive(Debug, Clone, PartialEq)]
pub struct Section {
    /// Its path with `[]` for any item of a list (`endpoints[].health`);
    /// empty for the top level.
    pub path: String,
    /// What it is, from its doc comments.
    pub description: String,
    pub keys: Vec<Key>,
}

/// One key of a [`Section`].
#[derive(Debug, Clone, PartialEq)]
pub struct Key {
    /// Its full path (`endpoints[].concurrency.initial`).
    pub path: String,
    /// Its type, as a config writes it (`duration`, `list of string`).
    pub kind: String,
    /// Its default (or `required`), from its doc comment's sentence that
    /// starts with `Default` (or `Required`), else from the schema.
    pub default: Option<String>,
    /// What it does: its doc comment, less the default's sentence.
    pub description: String,
    /// The path of its own section when it is (or lists) mappings.
    pub section: Option<String>,
}

/// The config's sections: the top level first, then each mapping after the
/// one that holds it.
pub fn sections() -> Vec<Section> {
    sections_of(&raw::config())
}

/// The sections of any schema (its root is the top level).
pub fn sections_of(root: &Value) -> Vec<Section> {
    let mut out = Vec::new();
    section(root, "", description(root), &mut out);
    out
}

fn section(schema: &Value, at: &str, intro: String, out: &mut Vec<Section>) {
    let mut keys = Vec::new();
    let mut inner = Vec::new();
    for mapping in alternatives(schema) {
        let Some(properties) = mapping.get("properties").and_then(Value::as_object) else {
            continue;
        };
        let required: Vec<&str> = mapping
            .get("required")
            .and_then(Value::as_array)
            .map(|list| list.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        for (name, property) in properties {
            let path = if at.is_empty() {
                name.clone()
            } else {
                format!("{at}.{name}")
            };
            if keys.iter().any(|k: &Key| k.path == path) {
                continue;
            }
            let text = description(property);
            let (rest, stated) = split_default(&text);
            let default = stated
                .or_else(|| property.get("default").map(json_default))
                .or_else(|| {
                    required
                        .contains(&name.as_str())
                        .then(|| "required".to_owned())
                });
            // The mappings it holds: its own, or its items'.
            let (child, child_schema) = match mappings_in(property) {
                Some(_) => (path.clone(), Some(property)),
                None => match alternatives(property)
                    .into_iter()
                    .find_map(|s| s.get("items"))
                    .filter(|items| mappings_in(items).is_some())
                {
                    Some(items) => (format!("{path}[]"), Some(items)),
                    None => (String::new(), None),
                },
            };
            if let Some(child_schema) = child_schema {
                let mut text = text.clone();
                // What its mapping is, when that says more than the key.
                let own = mappings_in(child_schema)
                    .and_then(|found| found.into_iter().find(|s| s.get("description").is_some()))
                    .map(description)
                    .unwrap_or_default();
                if !own.is_empty() && own != text {
                    text = [text, own].join("\n\n").trim().to_owned();
                }
                inner.push((child.clone(), child_schema, text));
            }
            keys.push(Key {
                path,
                kind: kind(property),
                default,
                description: rest,
                section: child_schema.map(|_| child),
            });
        }
    }
    out.push(Section {
        path: at.to_owned(),
        description: intro,
        keys,
    });
    for (path, schema, intro) in inner {
        section(schema, &path, intro, out);
    }
}

/// The alternatives of `schema` that are mappings with keys of their own.
fn mappings_in(schema: &Value) -> Option<Vec<&Value>> {
    let found: Vec<&Value> = alternatives(schema)
        .into_iter()
        .filter(|s| s.get("properties").is_some())
        .collect();
    (!found.is_empty()).then_some(found)
}

/// A schema's description, with rustdoc's links (``[`X`]``) as plain code.
fn description(schema: &Value) -> String {
    let text = alternatives(schema)
        .into_iter()
        .find_map(|s| s.get("description").and_then(Value::as_str))
        .unwrap_or_default();
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(open) = rest.find("[`") {
        let after = &rest[open + 1..];
        match after.find("`]") {
            Some(close) if !after[close + 2..].starts_with('(') => {
                out.push_str(&rest[..open]);
                out.push_str(&after[..close + 1]);
                rest = &after[close + 2..];
            }
            _ => {
                out.push_str(&rest[..open + 2]);
                rest = &rest[open + 2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The text's sentences, each with its closing full stop; a full stop
/// inside a code span (`` `.jsonl` ``) ends none.
fn sentences(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut in_code = false;
    let bytes = text.as_bytes();
    for (i, byte) in bytes.iter().enumerate() {
        match byte {
            b'`' => in_code = !in_code,
            b'.' if !in_code
                && bytes
                    .get(i + 1)
                    .is_none_or(|next| next.is_ascii_whitespace()) =>
            {
                out.push(text[start..=i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    if !text[start..].trim().is_empty() {
        out.push(text[start..].trim());
    }
    out
}

/// The description without its default's sentence, and that default: what
/// follows `Default` (`Default `30s`.`, `Default: none.`), or the sentence
/// itself when it says the key is `Required`.
pub fn split_default(text: &str) -> (String, Option<String>) {
    let mut rest = Vec::new();
    let mut default = None;
    for sentence in sentences(text) {
        let sentence_text = sentence.strip_suffix('.').unwrap_or(sentence);
        if default.is_none() {
            if let Some(value) = sentence_text.strip_prefix("Default") {
                default = Some(value.trim_start_matches(':').trim().to_owned());
                continue;
            }
            if let Some(value) = sentence_text.strip_prefix("Required") {
                default = Some(format!("required{value}"));
                continue;
            }
        }
        rest.push(sentence);
    }
    (rest.join(" "), default)
}

/// A default given by the schema, as a config would write it.
fn json_default(value: &Value) -> String {
    match value {
        Value::Null => "none".to_owned(),
        Value::String(text) => format!("`{text}`"),
        Value::Number(number) => number.to_string(),
        other => format!("`{other}`"),
    }
}

/// What a key takes, as a config writes it.
fn kind(schema: &Value) -> String {
    let mut parts: Vec<String> = Vec::new();
    for shape in alternatives(schema) {
        let wrapper = ["anyOf", "oneOf", "allOf"]
            .iter()
            .any(|keyword| shape.get(keyword).is_some());
        let described = ["const", "enum", "type"]
            .iter()
            .any(|keyword| shape.get(keyword).is_some());
        if wrapper && !described {
            continue;
        }
        let mut add = |part: String| {
            if !parts.contains(&part) {
                parts.push(part);
            }
        };
        if let Some(value) = shape.get("const") {
            add(literal(value));
        } else if let Some(values) = shape.get("enum").and_then(Value::as_array) {
            values.iter().map(literal).for_each(add);
        } else if let Some(types) = shape.get("type") {
            let types: Vec<&str> = match types {
                Value::String(one) => vec![one.as_str()],
                Value::Array(many) => many.iter().filter_map(Value::as_str).collect(),
                _ => Vec::new(),
            };
            for name in types {
                match name {
                    "null" => {}
                    "string" if shape.get("format") == Some(&Value::from("humantime")) => {
                        add("duration".to_owned());
                    }
                    "array" => add(format!(
                        "list of {}",
                        shape.get("items").map_or("any".to_owned(), kind)
                    )),
                    "object" => match shape.get("additionalProperties") {
                        Some(values @ Value::Object(_)) if shape.get("properties").is_none() => {
                            add(format!("mapping of {}", kind(values)));
                        }
                        _ => add("mapping".to_owned()),
                    },
                    other => add(other.to_owned()),
                }
            }
        } else if !wrapper {
            add("any".to_owned());
        }
    }
    match parts.split_last() {
        None => "any".to_owned(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
    }
}

fn literal(value: &Value) -> String {
    match value {
        Value::String(text) => format!("`{text}`"),
        other => format!("`{other}`"),
    }
}

/// Keys the reference could not document: no description, or neither a
/// default nor `Required`.
pub fn undocumented(sections: &[Section]) -> Vec<String> {
    let mut out = Vec::new();
    for key in sections.iter().flat_map(|s| &s.keys) {
        if key.description.trim().is_empty() {
            out.push(format!(
                "{}: no description (give its field or its type a doc comment)",
                key.path
            ));
        }
        if key.default.is_none() {
            out.push(format!(
                "{}: no default (add a sentence 'Default ...' or 'Required ...')",
                key.path
            ));
        }
    }
    out
}

/// GitHub's anchor for a heading of `path`.
fn anchor(path: &str) -> String {
    if path.is_empty() {
        return "top-level".to_owned();
    }
    path.chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '_' | '-'))
        .flat_map(char::to_lowercase)
        .collect()
}

/// Text for one cell of a table: one line, pipes escaped.
fn cell(text: &str) -> String {
    text.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|")
}

/// The page of `sections`.
pub fn markdown_of(sections: &[Section]) -> String {
    let mut out = String::new();
    out.push_str("# Configuration reference\n\n");
    out.push_str(&format!(
        "<!-- Generated from the config's doc comments by \
         crates/evalfleet-config/src/reference.rs: do not edit. \
         Regenerate with `{REGENERATE}`. -->\n\n"
    ));
    out.push_str(&format!(
        "This page is generated from the doc comments of the config's structs \
         (`crates/evalfleet-config/src/` and, for `mock:`, \
         `crates/evalfleet-mock/src/settings.rs`), so do not edit it by hand: \
         change a doc comment, then run `{REGENERATE}`. The same test fails \
         when a key has no description or no default, or when this page is \
         not what the doc comments make.\n\n"
    ));
    out.push_str(
        "Every key is optional unless its default says *required*. Unknown \
         keys are errors, reported with the nearest known key. A *duration* \
         is text like `500ms`, `30s`, `5m`, `1h` or `7d`; `[]` in a path \
         stands for any item of a list.\n\n",
    );
    out.push_str("## Sections\n\n");
    for section in sections {
        let title = if section.path.is_empty() {
            "Top level".to_owned()
        } else {
            format!("`{}`", section.path)
        };
        out.push_str(&format!("- [{title}](#{})\n", anchor(&section.path)));
    }
    render_sections(sections, &mut out);
    out
}

/// Each section's heading, description and table of keys.
fn render_sections(sections: &[Section], out: &mut String) {
    for section in sections {
        if section.path.is_empty() {
            out.push_str("\n## Top level\n\n");
        } else {
            out.push_str(&format!("\n## `{}`\n\n", section.path));
        }
        if !section.description.is_empty() {
            for paragraph in section.description.split("\n\n") {
                out.push_str(&paragraph.split_whitespace().collect::<Vec<_>>().join(" "));
                out.push_str("\n\n");
            }
        }
        out.push_str("| Key | Type | Default | Description |\n");
        out.push_str("|---|---|---|---|\n");
        for key in &section.keys {
            let description = match &key.section {
                Some(child) => {
                    let link = format!("[`{child}`](#{})", anchor(child));
                    if key.description.is_empty() {
                        format!("See {link}.")
                    } else {
                        format!("{} See {link}.", key.description)
                    }
                }
                None => key.description.clone(),
            };
            out.push_str(&format!(
                "| `{}` | {} | {} | {} |\n",
                key.path,
                cell(&key.kind),
                cell(key.default.as_deref().unwrap_or("")),
                cell(&description),
            ));
        }
    }
}

/// Sections of a bench file that are a run config's, as the run config's
/// sections name them.
const BENCH_BORROWS: [(&str, &str); 9] = [
    ("models[].endpoint", "endpoints[]"),
    ("models[].messages[]", "task.messages[]"),
    ("datasets[].dataset", "dataset"),
    ("datasets[].task", "task"),
    ("retry", "retry"),
    ("timeouts", "timeouts"),
    ("writer", "writer"),
    ("report", "report"),
    ("telemetry", "telemetry"),
];

/// Where a bench file's section `path` is documented: a run config's
/// section it borrows, or its own (`bench models[]`).
fn bench_path(path: &str) -> (String, bool) {
    for (from, to) in BENCH_BORROWS {
        if let Some(rest) = path.strip_prefix(from)
            && (rest.is_empty() || rest.starts_with(['.', '[']))
        {
            return (format!("{to}{rest}"), true);
        }
    }
    if path.is_empty() {
        ("bench".to_owned(), false)
    } else {
        (format!("bench {path}"), false)
    }
}

/// The bench file's own sections (`evalfleet bench CONFIG`); its keys that
/// take a run config's sections as they are link to those.
pub fn bench_sections() -> Vec<Section> {
    sections_of(&schema::of::<super::bench::RawBench>())
        .into_iter()
        .filter_map(|mut section| {
            let (path, borrowed) = bench_path(&section.path);
            if borrowed {
                return None;
            }
            section.path = path;
            for key in &mut section.keys {
                key.section = key.section.as_deref().map(|s| bench_path(s).0);
            }
            Some(section)
        })
        .collect()
}

/// The whole page: the run config, then the bench file.
pub fn markdown() -> String {
    let mut out = markdown_of(&sections());
    out.push_str(
        "\n# Benchmark matrix (`evalfleet bench`)\n\n\
         A bench file names models and datasets; every model answers every \
         dataset (at every point of `sweep`), one model's engine loaded at a \
         time. Each cell is a run config of its own, made of the model's \
         `endpoint` (as `endpoints[]` above), the dataset's `dataset` and \
         `task` (as above), the model's `params` over the task's and its \
         `messages` instead of the task's, and `retry`, `timeouts`, \
         `writer`, `report`, `telemetry` and `shutdown_grace` as written: a problem in \
         any of them is reported once, with the bench file's path and line. \
         See docs/commands.md, `evalfleet bench`.\n",
    );
    render_sections(&bench_sections(), &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The page, from the workspace's root.
    fn page() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(PAGE)
    }

    #[test]
    fn config_reference_documents_every_key_and_is_current() {
        let mut sections = sections();
        sections.extend(bench_sections());
        let undocumented = undocumented(&sections);
        assert!(
            undocumented.is_empty(),
            "keys the reference cannot document:\n  {}",
            undocumented.join("\n  ")
        );
        let made = markdown();
        if std::env::var_os("EVALFLEET_BLESS").is_some() {
            std::fs::write(page(), &made).unwrap();
            return;
        }
        let written = std::fs::read_to_string(page()).unwrap_or_default();
        let first_difference = written
            .lines()
            .zip(made.lines())
            .position(|(old, new)| old != new)
            .unwrap_or(written.lines().count().min(made.lines().count()));
        assert!(
            written == made,
            "{PAGE} is not what the config's doc comments make (from its line {}: {:?}, made {:?}): \
             run `{REGENERATE}` and commit it",
            first_difference + 1,
            written.lines().nth(first_difference).unwrap_or(""),
            made.lines().nth(first_difference).unwrap_or(""),
        );
    }

    #[test]
    fn config_reference_finds_a_key_with_no_doc_comment() {
        #[derive(schemars::JsonSchema)]
        #[allow(dead_code, reason = "a shape for the schema only")]
        struct Raw {
            /// Documented. Default 1.
            documented: Option<u32>,
            bare: Option<u32>,
            /// Said what it does, but not its default.
            no_default: Option<u32>,
        }
        let found = undocumented(&sections_of(&schema::of::<Raw>()));
        assert_eq!(
            found,
            [
                "bare: no description (give its field or its type a doc comment)",
                "bare: no default (add a sentence 'Default ...' or 'Required ...')",
                "no_default: no default (add a sentence 'Default ...' or 'Required ...')",
            ]
        );
    }

    #[test]
    fn config_reference_gives_every_metric_parameter() {
        let metrics = sections()
            .into_iter()
            .find(|s| s.path == "task.metrics[]")
            .unwrap();
        for info in evalfleet_eval::metrics::REGISTRY {
            for param in info.params {
                let path = format!("task.metrics[].{param}");
                assert!(
                    metrics.keys.iter().any(|k| k.path == path),
                    "{} takes {param}, which the reference does not give",
                    info.name
                );
            }
        }
    }

    #[test]
    fn defaults_are_split_from_descriptions() {
        assert_eq!(
            split_default("One call. Default `300s`."),
            ("One call.".to_owned(), Some("`300s`".to_owned()))
        );
        assert_eq!(
            split_default("`jsonl` or `csv`. Default: from the file's extension (`.jsonl`)."),
            (
                "`jsonl` or `csv`.".to_owned(),
                Some("from the file's extension (`.jsonl`)".to_owned())
            )
        );
        assert_eq!(
            split_default("The file. Required."),
            ("The file.".to_owned(), Some("required".to_owned()))
        );
        assert_eq!(
            split_default("Its host. Required for `kind: remote`."),
            (
                "Its host.".to_owned(),
                Some("required for `kind: remote`".to_owned())
            )
        );
    }
}
