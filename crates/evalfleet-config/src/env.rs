//! `${VAR}` in config strings: the process environment first, then a `.env`
//! file beside the config. `${VAR:-default}` gives a default; `$${` is a
//! literal `${`.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use serde_json::Value;

use super::path;

/// Where variables come from.
#[derive(Debug, Clone, Default)]
pub struct Vars {
    dotenv: HashMap<String, String>,
    /// Only these names are read (a config from outside); `None`: any.
    only: Option<BTreeSet<String>>,
}

impl Vars {
    /// The process environment, and `dir/.env` when it exists. A `.env` that
    /// cannot be read is an error, reported as `(line, message)`.
    pub fn load(dir: &Path) -> Result<Self, String> {
        let file = dir.join(".env");
        if !file.exists() {
            return Ok(Self::default());
        }
        let iter =
            dotenvy::from_path_iter(&file).map_err(|err| format!("{}: {err}", file.display()))?;
        let mut dotenv = HashMap::new();
        for entry in iter {
            let (key, value) = entry.map_err(|err| format!("{}: {err}", file.display()))?;
            dotenv.insert(key, value);
        }
        Ok(Self { dotenv, only: None })
    }

    /// Variables from this map only (no process environment), for tests.
    pub fn from_map(dotenv: HashMap<String, String>) -> Self {
        Self { dotenv, only: None }
    }

    /// The same, reading only the variables `names`: any other is unset.
    pub fn only(self, names: BTreeSet<String>) -> Self {
        Self {
            only: Some(names),
            ..self
        }
    }

    pub(super) fn get(&self, name: &str) -> Option<String> {
        if self.only.as_ref().is_some_and(|only| !only.contains(name)) {
            return None;
        }
        std::env::var(name)
            .ok()
            .or_else(|| self.dotenv.get(name).cloned())
    }
}

/// One `${VAR}` that could not be resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unresolved {
    pub path: String,
    pub message: String,
}

/// Whether a string refers to a variable (and so holds no literal secret).
pub fn has_reference(text: &str) -> bool {
    text.replace("$${", "").contains("${")
}

/// Whether `name` may name a variable: letters, digits and `_`.
pub fn is_name(name: &str) -> bool {
    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// `text` with each `${...}` replaced by what `value_of` makes of what is
/// inside the braces (and whether they were closed), and `$${` by a
/// literal `${`: the one reading of references that expanding and listing
/// them share.
fn substitute(
    text: &str,
    mut value_of: impl FnMut(&str, bool) -> Result<String, String>,
) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(pos) = rest.find('$') {
        out.push_str(&rest[..pos]);
        let after = &rest[pos..];
        if let Some(tail) = after.strip_prefix("$${") {
            out.push_str("${");
            rest = tail;
        } else if let Some(tail) = after.strip_prefix("${") {
            let (inner, closed, next) = match tail.find('}') {
                Some(end) => (&tail[..end], true, &tail[end + 1..]),
                None => (tail, false, ""),
            };
            out.push_str(&value_of(inner, closed)?);
            rest = next;
        } else {
            out.push('$');
            rest = &after[1..];
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// The names of the variables `text` refers to (`${NAME}` and
/// `${NAME:-default}`; not `$${`), including malformed ones as written.
pub fn references(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    // Listing never fails: every reference gives an empty text.
    let _ = substitute(text, |inner, _| {
        let name = inner.split_once(":-").map_or(inner, |(name, _)| name);
        out.push(name.to_owned());
        Ok(String::new())
    });
    out
}

/// Replaces every `${VAR}` in every string of `value`, collecting the ones
/// that cannot be resolved.
pub fn interpolate(value: &mut Value, at: &str, vars: &Vars, problems: &mut Vec<Unresolved>) {
    match value {
        Value::String(text) if text.contains('$') => match expand(text, vars) {
            Ok(expanded) => *text = expanded,
            Err(message) => problems.push(Unresolved {
                path: at.to_owned(),
                message,
            }),
        },
        Value::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                interpolate(item, &path::index(at, i), vars, problems);
            }
        }
        Value::Object(map) => {
            for (key, item) in map.iter_mut() {
                interpolate(item, &path::key(at, key), vars, problems);
            }
        }
        _ => {}
    }
}

fn expand(text: &str, vars: &Vars) -> Result<String, String> {
    substitute(text, |inner, closed| {
        if !closed {
            return Err("unclosed '${' (write '$${' for a literal '${')".to_owned());
        }
        let (name, default) = match inner.split_once(":-") {
            Some((name, default)) => (name, Some(default)),
            None => (inner, None),
        };
        if !is_name(name) {
            return Err(format!(
                "'${{{inner}}}' is not a variable reference: names are letters, digits and '_'"
            ));
        }
        match (vars.get(name), default) {
            (Some(value), _) => Ok(value),
            (None, Some(default)) => Ok(default.to_owned()),
            (None, None) => Err(format!(
                "environment variable {name} is not set (nor in a .env file beside the config)"
            )),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars() -> Vars {
        Vars::from_map(HashMap::from([(
            "EF_TEST_KEY".to_owned(),
            "sk-1".to_owned(),
        )]))
    }

    #[test]
    fn references_defaults_and_escapes() {
        let v = vars();
        assert_eq!(expand("Bearer ${EF_TEST_KEY}", &v).unwrap(), "Bearer sk-1");
        assert_eq!(expand("${EF_TEST_NOPE:-x}", &v).unwrap(), "x");
        assert_eq!(
            expand("$${EF_TEST_KEY} $5", &v).unwrap(),
            "${EF_TEST_KEY} $5"
        );
        let err = expand("${EF_TEST_NOPE}", &v).unwrap_err();
        assert!(err.contains("EF_TEST_NOPE"), "{err}");
        assert!(expand("${unclosed", &v).is_err());
    }

    #[test]
    fn references_are_listed_by_name() {
        assert_eq!(
            references("a ${X} $${Y} ${Z:-d} $5 ${W"),
            vec!["X".to_owned(), "Z".to_owned(), "W".to_owned()]
        );
        let only = vars().only(BTreeSet::new());
        assert!(expand("${EF_TEST_KEY}", &only).is_err());
    }

    #[test]
    fn every_unresolved_reference_is_reported_with_its_path() {
        let mut value =
            serde_json::json!({"a": ["${EF_TEST_X1}", "ok"], "b": {"c": "${EF_TEST_X2}"}});
        let mut problems = Vec::new();
        interpolate(&mut value, "", &vars(), &mut problems);
        let paths: Vec<_> = problems.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(paths, vec!["a[0]", "b.c"]);
    }
}
