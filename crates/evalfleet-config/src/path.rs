//! Paths into a config document, written the way users read them:
//! `endpoints[1].concurrency`.

/// `parent.key`, or `key` at the root.
pub fn key(parent: &str, key: &str) -> String {
    if parent.is_empty() {
        key.to_owned()
    } else {
        format!("{parent}.{key}")
    }
}

/// `parent[index]`.
pub fn index(parent: &str, index: usize) -> String {
    format!("{parent}[{index}]")
}

/// The enclosing path, or `None` at the root.
pub fn parent(path: &str) -> Option<&str> {
    if path.is_empty() {
        return None;
    }
    let cut = path.rfind(['.', '[']).unwrap_or(0);
    Some(&path[..cut])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parents_walk_up_to_the_root() {
        assert_eq!(parent("endpoints[1].concurrency"), Some("endpoints[1]"));
        assert_eq!(parent("endpoints[1]"), Some("endpoints"));
        assert_eq!(parent("endpoints"), Some(""));
        assert_eq!(parent(""), None);
        assert_eq!(key(&index("endpoints", 2), "name"), "endpoints[2].name");
    }
}
