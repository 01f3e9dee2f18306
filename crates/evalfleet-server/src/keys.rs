//! Digests of keys: the API key and the dashboard's session cookie are
//! kept and compared as SHA-256 digests, never as themselves.

use sha2::{Digest, Sha256};

/// The SHA-256 of `text`.
pub(crate) fn digest(text: &str) -> [u8; 32] {
    Sha256::digest(text.as_bytes()).into()
}

/// What the dashboard's session cookie holds for `key`: a digest of it, so
/// that the key itself is never sent back.
pub(crate) fn session_token(key: &str) -> String {
    digest(&format!("evalfleet-session\0{key}"))
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Whether two digests are equal, looking at every byte whatever they hold.
pub(crate) fn same(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}
