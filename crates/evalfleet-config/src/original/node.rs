//! The converted config as a tree whose every value keeps the original
//! key it came from (for its line) and what its comment says, written out
//! as YAML that a reader can follow back to the original.

use serde_json::{Map, Value};

use crate::{Document, path};

/// A value of the converted config, with where it came from.
#[derive(Debug, Clone)]
pub(super) enum Node {
    Scalar(Value),
    Map(Vec<Entry>),
    Seq(Vec<Node>),
}

#[derive(Debug, Clone)]
pub(super) struct Entry {
    key: String,
    node: Node,
    /// The original's path it came from (for its line).
    from: Option<String>,
    /// Said above it in the YAML.
    pub(super) comment: Option<String>,
}

pub(super) fn entry(key: &str, node: Node) -> Entry {
    Entry {
        key: key.to_owned(),
        node,
        from: None,
        comment: None,
    }
}

impl Entry {
    pub(super) fn from(mut self, path: &str) -> Self {
        self.from = Some(path.to_owned());
        self
    }

    pub(super) fn said(mut self, comment: impl Into<String>) -> Self {
        self.comment = Some(comment.into());
        self
    }
}

pub(super) fn scalar(value: impl Into<Value>) -> Node {
    Node::Scalar(value.into())
}

/// A string copied from the original: a `${` in it stays literal.
pub(super) fn text(value: &str) -> Node {
    Node::Scalar(Value::String(value.replace("${", "$${")))
}

impl Node {
    pub(super) fn value(&self) -> Value {
        match self {
            Self::Scalar(v) => v.clone(),
            Self::Map(entries) => Value::Object(
                entries
                    .iter()
                    .map(|e| (e.key.clone(), e.node.value()))
                    .collect::<Map<_, _>>(),
            ),
            Self::Seq(items) => Value::Array(items.iter().map(Node::value).collect()),
        }
    }

    pub(super) fn lines(
        &self,
        at: &str,
        doc: &Document,
        out: &mut std::collections::HashMap<String, usize>,
    ) {
        match self {
            Self::Scalar(_) => {}
            Self::Map(entries) => {
                for e in entries {
                    let here = path::key(at, &e.key);
                    if let Some(line) = e.from.as_deref().and_then(|from| doc.line_of(from)) {
                        out.insert(here.clone(), line);
                    }
                    e.node.lines(&here, doc, out);
                }
            }
            Self::Seq(items) => {
                for (i, item) in items.iter().enumerate() {
                    item.lines(&path::index(at, i), doc, out);
                }
            }
        }
    }

    /// Block YAML at `indent` (a mapping's entries, or a sequence's
    /// items), each entry's comment above it.
    pub(super) fn emit(&self, indent: usize, out: &mut String) {
        let pad = " ".repeat(indent);
        match self {
            Self::Scalar(v) => {
                out.push_str(&pad);
                out.push_str(&yaml_scalar(v, indent));
                out.push('\n');
            }
            Self::Map(entries) => {
                for e in entries {
                    if let Some(comment) = &e.comment {
                        out.push_str(&comment_lines(comment, indent));
                    }
                    out.push_str(&pad);
                    out.push_str(&yaml_key(&e.key));
                    out.push(':');
                    match &e.node {
                        Self::Scalar(v) => {
                            out.push(' ');
                            out.push_str(&yaml_scalar(v, indent + 2));
                            out.push('\n');
                        }
                        Self::Map(m) if m.is_empty() => out.push_str(" {}\n"),
                        Self::Seq(items) if items.iter().all(|i| matches!(i, Self::Scalar(_))) => {
                            // A list of words on one line (JSON is YAML).
                            out.push(' ');
                            out.push_str(&e.node.value().to_string());
                            out.push('\n');
                        }
                        node => {
                            out.push('\n');
                            node.emit(indent + 2, out);
                        }
                    }
                }
            }
            Self::Seq(items) => {
                for item in items {
                    let mut block = String::new();
                    item.emit(indent + 2, &mut block);
                    // The first line that is not a comment carries the dash.
                    let mut dashed = false;
                    for line in block.lines() {
                        if !dashed && line.trim_start().starts_with('#') {
                            out.push_str(&pad);
                            out.push_str(line.trim_start());
                        } else if !dashed {
                            out.push_str(&pad);
                            out.push_str("- ");
                            out.push_str(line.get(indent + 2..).unwrap_or(line.trim_start()));
                            dashed = true;
                        } else {
                            out.push_str(line);
                        }
                        out.push('\n');
                    }
                }
            }
        }
    }
}

pub(super) fn comment_lines(comment: &str, indent: usize) -> String {
    let pad = " ".repeat(indent);
    comment
        .lines()
        .map(|line| format!("{pad}# {line}\n"))
        .collect()
}

fn yaml_key(key: &str) -> String {
    let plain = key
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if plain {
        key.to_owned()
    } else {
        Value::String(key.to_owned()).to_string()
    }
}

/// A scalar as YAML: a text of several lines as a literal block, any other
/// as JSON (which YAML reads as it is).
fn yaml_scalar(value: &Value, indent: usize) -> String {
    if let Value::String(s) = value {
        let block = s.contains('\n')
            && !s.contains('\r')
            && !s.starts_with([' ', '\t', '\n'])
            && !s.ends_with("\n\n")
            && s.lines().all(|l| !l.ends_with([' ', '\t']));
        if block {
            let pad = " ".repeat(indent);
            let mut out = String::from(if s.ends_with('\n') { "|" } else { "|-" });
            for line in s.lines() {
                out.push('\n');
                if !line.is_empty() {
                    out.push_str(&pad);
                    out.push_str(line);
                }
            }
            return out;
        }
        if plain(s) {
            return s.clone();
        }
    }
    value.to_string()
}

/// Whether YAML reads `s` unquoted as this very text: words, names,
/// URLs, model names (`qwen3:8b`), Japanese; nothing that could be read
/// as a number, a boolean or null, or that holds YAML's signs.
fn plain(s: &str) -> bool {
    let Some(first) = s.chars().next() else {
        return false;
    };
    let reserved = [
        "true", "false", "null", "yes", "no", "on", "off", "y", "n", "~",
    ];
    first.is_alphabetic()
        && !reserved.contains(&s.to_ascii_lowercase().as_str())
        && !s.ends_with(':')
        && !s.contains(": ")
        && s.chars()
            .all(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | '/' | ':' | '@'))
}
