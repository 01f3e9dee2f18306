//! The service account's key, and the JWT bearer grant (RFC 7523) as
//! Google's token endpoint checks it: an RS256 signature by the trusted
//! key, the issuer, the audience, the Sheets scope and a short life.

use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use ring::signature::{self, KeyPair as _};
use serde_json::Value;

/// The scope that reading and writing spreadsheets needs.
pub(crate) const SHEETS_SCOPE: &str = "https://www.googleapis.com/auth/spreadsheets";
/// The scope that reading them needs.
pub(crate) const SHEETS_READ_SCOPE: &str = "https://www.googleapis.com/auth/spreadsheets.readonly";

/// How far in the future `iat` may be (clock skew), in seconds.
const SKEW_S: i64 = 60;
/// The longest life a token request may ask for, in seconds.
const MAX_LIFE_S: i64 = 3600;

/// A service account the stand-in trusts: its email, and the public half of
/// its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trusted {
    pub client_email: String,
    /// PKCS#1 `RSAPublicKey`, DER.
    pub public_key_der: Vec<u8>,
}

impl Trusted {
    /// From a Google service-account JSON key file's text (`type`
    /// `service_account`, `client_email`, `private_key` as PKCS#8 PEM):
    /// the public key is derived from the private one.
    pub fn from_key_json(text: &str) -> Result<Self, String> {
        let key: Value = serde_json::from_str(text)
            .map_err(|e| format!("service account key: not JSON: {e}"))?;
        let field = |name: &str| {
            key.get(name)
                .and_then(Value::as_str)
                .ok_or_else(|| format!("service account key: `{name}` is missing or not a string"))
        };
        let kind = field("type")?;
        if kind != "service_account" {
            return Err(format!(
                "service account key: `type` is {kind:?}, not \"service_account\""
            ));
        }
        let client_email = field("client_email")?.to_owned();
        let der = pem_body(field("private_key")?, "PRIVATE KEY")?;
        let pair = signature::RsaKeyPair::from_pkcs8(&der).map_err(|e| {
            format!("service account key: `private_key` is not a PKCS#8 RSA key: {e}")
        })?;
        Ok(Self {
            client_email,
            public_key_der: pair.public_key().as_ref().to_vec(),
        })
    }
}

/// The DER inside a PEM block labelled `label`.
fn pem_body(pem: &str, label: &str) -> Result<Vec<u8>, String> {
    let begin = format!("-----BEGIN {label}-----");
    let end = format!("-----END {label}-----");
    let body = pem
        .split_once(&begin)
        .and_then(|(_, rest)| rest.split_once(&end))
        .map(|(body, _)| body)
        .ok_or_else(|| format!("service account key: `private_key` has no {begin} block"))?;
    let base64: String = body.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    STANDARD
        .decode(base64)
        .map_err(|e| format!("service account key: `private_key` is not base64: {e}"))
}

/// Checks a grant's `assertion`; `Err` says why it is refused, in words a
/// test can match. `now` is Unix seconds; `audience_ok` says whether an
/// `aud` names this token endpoint.
pub(crate) fn check(
    assertion: &str,
    trusted: &Trusted,
    now: i64,
    audience_ok: impl Fn(&str) -> bool,
) -> Result<bool, String> {
    let mut parts = assertion.split('.');
    let (Some(header), Some(claims), Some(sig), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err("Invalid JWT: not three base64url parts".to_owned());
    };
    let header_json = decode_json(header, "header")?;
    let claims_json = decode_json(claims, "claims")?;
    let sig = URL_SAFE_NO_PAD
        .decode(sig.trim_end_matches('='))
        .map_err(|_| "Invalid JWT: signature is not base64url".to_owned())?;
    match header_json.get("alg").and_then(Value::as_str) {
        Some("RS256") => {}
        other => return Err(format!("Invalid JWT: alg is {other:?}, not RS256")),
    }
    if let Some(typ) = header_json.get("typ")
        && typ.as_str() != Some("JWT")
    {
        return Err(format!("Invalid JWT: typ is {typ}, not \"JWT\""));
    }
    let iss = claims_json.get("iss").and_then(Value::as_str);
    if iss != Some(trusted.client_email.as_str()) {
        return Err(format!("Invalid email or User ID: iss is {iss:?}"));
    }
    let signed = &assertion[..header.len() + 1 + claims.len()];
    signature::UnparsedPublicKey::new(
        &signature::RSA_PKCS1_2048_8192_SHA256,
        &trusted.public_key_der,
    )
    .verify(signed.as_bytes(), &sig)
    .map_err(|_| "Invalid JWT Signature.".to_owned())?;
    let aud = claims_json.get("aud").and_then(Value::as_str);
    if !aud.is_some_and(&audience_ok) {
        return Err(format!(
            "Invalid JWT: aud is {aud:?}, not this token endpoint"
        ));
    }
    let scope = claims_json.get("scope").and_then(Value::as_str);
    let has = |wanted: &str| scope.is_some_and(|s| s.split_whitespace().any(|s| s == wanted));
    let writes = has(SHEETS_SCOPE);
    if !writes && !has(SHEETS_READ_SCOPE) {
        return Err(format!(
            "invalid_scope: scope {scope:?} includes neither {SHEETS_SCOPE} nor {SHEETS_READ_SCOPE}"
        ));
    }
    let time = |name: &str| {
        claims_json
            .get(name)
            .and_then(|v| v.as_i64().or_else(|| v.as_f64().map(|f| f as i64)))
            .ok_or_else(|| format!("Invalid JWT: `{name}` is missing or not a number"))
    };
    let (iat, exp) = (time("iat")?, time("exp")?);
    if iat > now.saturating_add(SKEW_S) || exp <= now || exp.saturating_sub(iat) > MAX_LIFE_S {
        return Err(format!(
            "Invalid JWT: Token must be a short-lived token (60 minutes) and in a reasonable \
             timeframe. Check your iat and exp values in the JWT claim. (iat {iat}, exp {exp}, now {now})"
        ));
    }
    Ok(writes)
}

fn decode_json(part: &str, what: &str) -> Result<Value, String> {
    let bytes = URL_SAFE_NO_PAD
        .decode(part.trim_end_matches('='))
        .map_err(|_| format!("Invalid JWT: {what} is not base64url"))?;
    let value: Value =
        serde_json::from_slice(&bytes).map_err(|_| format!("Invalid JWT: {what} is not JSON"))?;
    if value.is_object() {
        Ok(value)
    } else {
        Err(format!("Invalid JWT: {what} is not a JSON object"))
    }
}
