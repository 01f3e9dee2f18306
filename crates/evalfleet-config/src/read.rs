//! A raw section read out of the document: its unknown keys and its type
//! error are recorded with their full paths instead of stopping the read, so
//! that one pass finds every problem of a file.

use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::path;
use super::problems::RawProblem;
use super::schema::{self, Segment};

/// Deserialises `value` (found at `at`) as `T`, recording unknown keys (each
/// with the nearest known key, from `T`'s schema) and a type error, each with
/// its full path. Returns `None` on a type error.
pub fn section<T: DeserializeOwned + JsonSchema>(
    value: &Value,
    at: &str,
    problems: &mut Vec<RawProblem>,
) -> Option<T> {
    let schema = schema::of::<T>();
    // Keys of closed mappings (`deny_unknown_fields`) are taken out first, so
    // that they are reported like the others and do not hide other problems.
    let mut value = value.clone();
    let mut unknown = schema::take_unknown(&mut value, &schema);
    let result: Result<T, _> = {
        let mut record = |p: serde_ignored::Path<'_>| unknown.push(segments(&p));
        let de = serde_ignored::Deserializer::new(&value, &mut record);
        serde_path_to_error::deserialize(de)
    };
    for key_path in unknown {
        let Some((Segment::Key(key), parent)) = key_path.split_last() else {
            continue;
        };
        let place = schema::render(at, parent);
        let known = schema::keys_at(&schema, parent);
        let message = schema::unknown_key(
            if place.is_empty() { "config" } else { &place },
            key,
            &known,
        );
        problems.push((path::key(&place, key), message));
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

/// Where serde_ignored found a key, from the section's root.
fn segments(p: &serde_ignored::Path<'_>) -> Vec<Segment> {
    match p {
        serde_ignored::Path::Root => Vec::new(),
        serde_ignored::Path::Seq { parent, index } => {
            let mut out = segments(parent);
            out.push(Segment::Index(*index));
            out
        }
        serde_ignored::Path::Map { parent, key } => {
            let mut out = segments(parent);
            out.push(Segment::Key(key.clone()));
            out
        }
        serde_ignored::Path::Some { parent }
        | serde_ignored::Path::NewtypeStruct { parent }
        | serde_ignored::Path::NewtypeVariant { parent } => segments(parent),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raw::RawDataset;

    #[test]
    fn unknown_keys_and_type_errors_carry_full_paths() {
        let value = serde_json::json!({"path": "d.jsonl", "colour": "red", "sample": {"a": 1, "n": "many"}});
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
        assert_eq!(
            unknown.1,
            "dataset: unknown key 'colour' (known: format, id_field, limit, path, sample, sheet, skip_invalid, split)"
        );
        let nested = problems
            .iter()
            .find(|(p, _)| p == "dataset.sample.a")
            .unwrap();
        assert_eq!(nested.1, "dataset.sample: unknown key 'a' (known: n, seed)");
    }
}
