//! Capability tokens: an item's address at the gateway. A token names the
//! run, the item's `seq`, its attempt and when it expires, and carries an
//! HMAC-SHA256 of all that under a key this process drew at random: it
//! cannot be made or changed without the key, and it is checked in
//! constant time. A token that checks is still dead once its attempt has
//! ended (the gateway keeps the live ones).

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::hmac;

/// What a token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claims {
    pub run_id: String,
    pub seq: u64,
    pub attempt: u32,
    pub expires_ms: i64,
}

/// The key tokens are signed with.
pub struct Keys {
    key: hmac::Key,
}

/// What every token starts with.
const PREFIX: &str = "ef1_";

impl Keys {
    /// A new random key.
    pub fn random() -> Self {
        let rng = ring::rand::SystemRandom::new();
        // Fails only where the system has no random source at all, and
        // then nothing else of TLS works either; a key from the clock and
        // the process would still be unguessable enough to be better than
        // stopping, but such a system does not run us.
        let key = hmac::Key::generate(hmac::HMAC_SHA256, &rng)
            .unwrap_or_else(|_| hmac::Key::new(hmac::HMAC_SHA256, &fallback_seed()));
        Self { key }
    }

    /// The token of `claims`.
    pub fn sign(&self, claims: &Claims) -> String {
        let payload = format!(
            "{}\n{}\n{}\n{}",
            claims.seq, claims.attempt, claims.expires_ms, claims.run_id
        );
        let tag = hmac::sign(&self.key, payload.as_bytes());
        format!(
            "{PREFIX}{}.{}",
            URL_SAFE_NO_PAD.encode(payload.as_bytes()),
            URL_SAFE_NO_PAD.encode(tag.as_ref())
        )
    }

    /// The claims of `token`, when it is one of ours (its tag checks, in
    /// constant time) and has not expired at `now_ms`.
    pub fn verify(&self, token: &str, now_ms: i64) -> Result<Claims, TokenError> {
        let (payload, tag) = decode(token).ok_or(TokenError::Malformed)?;
        hmac::verify(&self.key, &payload, &tag).map_err(|_| TokenError::Forged)?;
        let claims = parse(&payload).ok_or(TokenError::Malformed)?;
        if claims.expires_ms <= now_ms {
            return Err(TokenError::Expired);
        }
        Ok(claims)
    }
}

/// The run a token names, read without checking it (to find the gateway
/// that can).
pub fn run_of(token: &str) -> Option<String> {
    let (payload, _) = decode(token)?;
    parse(&payload).map(|claims| claims.run_id)
}

/// Why a token is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("the token is not an evalfleet gateway token")]
    Malformed,
    #[error("the token's signature does not check")]
    Forged,
    #[error("the token has expired")]
    Expired,
}

fn decode(token: &str) -> Option<(Vec<u8>, Vec<u8>)> {
    let rest = token.strip_prefix(PREFIX)?;
    let (payload, tag) = rest.split_once('.')?;
    if payload.len() > 4096 || tag.len() > 128 {
        return None;
    }
    Some((
        URL_SAFE_NO_PAD.decode(payload).ok()?,
        URL_SAFE_NO_PAD.decode(tag).ok()?,
    ))
}

fn parse(payload: &[u8]) -> Option<Claims> {
    let text = std::str::from_utf8(payload).ok()?;
    let mut parts = text.splitn(4, '\n');
    Some(Claims {
        seq: parts.next()?.parse().ok()?,
        attempt: parts.next()?.parse().ok()?,
        expires_ms: parts.next()?.parse().ok()?,
        run_id: parts.next()?.to_owned(),
    })
}

fn fallback_seed() -> [u8; 32] {
    let mut seed = [0u8; 32];
    for chunk in seed.chunks_mut(8) {
        chunk.copy_from_slice(&fastrand::u64(..).to_ne_bytes());
    }
    seed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims() -> Claims {
        Claims {
            run_id: "run-1:odd\nname".to_owned(),
            seq: 42,
            attempt: 3,
            expires_ms: 2_000,
        }
    }

    #[test]
    fn a_signed_token_checks_and_says_what_was_signed() {
        let keys = Keys::random();
        let token = keys.sign(&claims());
        assert_eq!(keys.verify(&token, 1_000).unwrap(), claims());
        assert_eq!(run_of(&token).as_deref(), Some("run-1:odd\nname"));
        // URL-safe: it goes in a path.
        assert!(
            token
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c))
        );
    }

    #[test]
    fn forged_expired_and_foreign_tokens_are_refused() {
        let keys = Keys::random();
        let token = keys.sign(&claims());
        assert_eq!(keys.verify(&token, 2_000), Err(TokenError::Expired));
        // Another process's key.
        assert_eq!(
            Keys::random().verify(&token, 1_000),
            Err(TokenError::Forged)
        );
        // The payload changed (another item), the tag kept.
        let (_, tag) = token.split_once('.').unwrap();
        let other = Claims {
            seq: 43,
            ..claims()
        };
        let (forged, _) = keys
            .sign(&other)
            .split_once('.')
            .map(|(a, b)| (a.to_owned(), b.to_owned()))
            .unwrap();
        assert_eq!(
            keys.verify(&format!("{forged}.{tag}"), 1_000),
            Err(TokenError::Forged)
        );
        for junk in ["", "ef1_", "ef1_a.b", "sk-123", "ef1_!!.??"] {
            assert!(keys.verify(junk, 1_000).is_err(), "{junk}");
        }
    }
}
