//! YAML text to a JSON value plus the line of every path in it, so that later
//! steps can work on plain values and still point at the line of a problem.

use std::collections::HashMap;

use saphyr::{LoadableYamlNode, MarkedYaml, Scalar, YamlData};
use serde_json::{Map, Number, Value};

use super::path;

/// A parsed YAML document.
#[derive(Debug, Clone, Default)]
pub struct Document {
    /// The document as a JSON value.
    pub value: Value,
    /// The 1-based line of each path (`endpoints[1].concurrency`): for a
    /// mapping entry, the line of its key; for a sequence element, its own.
    pub lines: HashMap<String, usize>,
}

impl Document {
    /// The line of `path`, or of its nearest ancestor that has one.
    pub fn line_of(&self, path: &str) -> Option<usize> {
        let mut current = path;
        loop {
            if let Some(line) = self.lines.get(current) {
                return Some(*line);
            }
            current = path::parent(current)?;
        }
    }
}

/// A YAML text that could not be read as one document of plain data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct YamlError {
    /// 1-based line.
    pub line: usize,
    /// 1-based column.
    pub column: usize,
    pub message: String,
}

/// Parses `text`, which must hold exactly one YAML document.
pub fn parse(text: &str) -> Result<Document, YamlError> {
    let docs = MarkedYaml::load_from_str(text).map_err(|err| YamlError {
        line: err.marker().line(),
        column: err.marker().col() + 1,
        message: err.info().to_owned(),
    })?;
    let mut docs = docs.into_iter();
    let Some(root) = docs.next() else {
        return Ok(Document {
            value: Value::Null,
            lines: HashMap::new(),
        });
    };
    if let Some(extra) = docs.next() {
        return Err(YamlError {
            line: extra.span.start.line(),
            column: extra.span.start.col() + 1,
            message: "a config file holds one YAML document; found a second".to_owned(),
        });
    }
    let mut lines = HashMap::new();
    let value = convert(&root, "", &mut lines)?;
    Ok(Document { value, lines })
}

fn convert(
    node: &MarkedYaml<'_>,
    at: &str,
    lines: &mut HashMap<String, usize>,
) -> Result<Value, YamlError> {
    let error = |message: String| YamlError {
        line: node.span.start.line(),
        column: node.span.start.col() + 1,
        message,
    };
    Ok(match &node.data {
        YamlData::Value(scalar) => scalar_value(scalar),
        YamlData::Representation(text, _, _) => Value::String(text.to_string()),
        YamlData::Sequence(items) => {
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let item_path = path::index(at, i);
                lines.insert(item_path.clone(), item.span.start.line());
                out.push(convert(item, &item_path, lines)?);
            }
            Value::Array(out)
        }
        YamlData::Mapping(entries) => {
            let mut out = Map::new();
            for (key, value) in entries {
                let name = match &key.data {
                    YamlData::Value(Scalar::String(s)) => s.to_string(),
                    YamlData::Value(scalar) => match scalar_value(scalar) {
                        Value::String(s) => s,
                        other => other.to_string(),
                    },
                    YamlData::Representation(text, _, _) => text.to_string(),
                    _ => {
                        return Err(YamlError {
                            line: key.span.start.line(),
                            column: key.span.start.col() + 1,
                            message: "mapping keys must be plain scalars".to_owned(),
                        });
                    }
                };
                let entry_path = path::key(at, &name);
                lines.insert(entry_path.clone(), key.span.start.line());
                let converted = convert(value, &entry_path, lines)?;
                out.insert(name, converted);
            }
            Value::Object(out)
        }
        YamlData::Tagged(_, inner) => convert(inner, at, lines)?,
        YamlData::Alias(_) => {
            return Err(error(
                "YAML aliases are not supported in config files".to_owned(),
            ));
        }
        YamlData::BadValue => return Err(error("this value cannot be read".to_owned())),
    })
}

fn scalar_value(scalar: &Scalar<'_>) -> Value {
    match scalar {
        Scalar::Null => Value::Null,
        Scalar::Boolean(b) => Value::Bool(*b),
        Scalar::Integer(i) => Value::Number((*i).into()),
        Scalar::FloatingPoint(f) => Number::from_f64(f.into_inner())
            .map(Value::Number)
            .unwrap_or_else(|| Value::String(f.to_string())),
        Scalar::String(s) => Value::String(s.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_point_at_keys_and_elements() {
        let doc =
            parse("name: x\nendpoints:\n  - name: a\n    concurrency: 0\n  - name: b\n").unwrap();
        assert_eq!(doc.lines["name"], 1);
        assert_eq!(doc.lines["endpoints[0]"], 3);
        assert_eq!(doc.lines["endpoints[0].concurrency"], 4);
        assert_eq!(doc.lines["endpoints[1].name"], 5);
        assert_eq!(doc.line_of("endpoints[1].colour"), Some(5));
        assert_eq!(doc.value["endpoints"][0]["concurrency"], 0);
    }

    #[test]
    fn syntax_errors_have_a_position() {
        let err = parse("a: [1, 2\nb: 3\n").unwrap_err();
        assert!(err.line >= 1, "{err:?}");
    }
}
