//! Digests of keys: the API key and the dashboard's session tokens are
//! kept and compared as SHA-256 digests, never as themselves.

use std::net::SocketAddr;

use sha2::{Digest, Sha256};

/// Why a server may not listen on `bind` with no API key (`key` is the
/// key it was given, if any): any address but a loopback one is reachable
/// by others, who would then need nothing to use it. `None`: it may. One
/// rule for every server of this crate (`evalfleet serve`, `evalfleet env`).
pub fn open_bind_refusal(bind: SocketAddr, key: Option<&str>) -> Option<String> {
    let keyless = key.is_none_or(|key| key.trim().is_empty());
    (!bind.ip().is_loopback() && keyless).then(|| {
        format!(
            "--bind {bind}: an address other than a loopback one needs an API key: set EVALFLEET_API_KEY, which requests then send as X-API-Key or Authorization: Bearer"
        )
    })
}

/// The SHA-256 of `text`.
pub(crate) fn digest(text: &str) -> [u8; 32] {
    Sha256::digest(text.as_bytes()).into()
}

/// Whether two digests are equal, looking at every byte whatever they hold.
pub(crate) fn same(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}
