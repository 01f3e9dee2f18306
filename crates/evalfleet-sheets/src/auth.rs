//! A Google service account's key, and the access tokens it is exchanged
//! for (OAuth 2.0's JWT bearer grant, RFC 7523): a JWT naming the account
//! and the scopes, signed with the key (RS256), is posted to the key's
//! `token_uri`. The key stays in this process's memory: it is never
//! written, logged or shown (`Debug` shows the account's email only).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use ring::rand::SystemRandom;
use ring::signature::{RSA_PKCS1_SHA256, RsaKeyPair};
use serde::Deserialize;
use tokio::sync::Mutex;
use tokio::time::Instant;

use super::SheetError;

/// Read and write: what a sink needs.
pub const SCOPE_WRITE: &str = "https://www.googleapis.com/auth/spreadsheets";
/// Read only: what a source alone needs.
pub const SCOPE_READ: &str = "https://www.googleapis.com/auth/spreadsheets.readonly";

/// A token is renewed when it has less than this left.
const RENEW_BEFORE: Duration = Duration::from_secs(120);
/// How long an assertion asks its token to last (Google's most).
const ASSERTION_LIFETIME_S: u64 = 3600;

/// A service account's JSON key file, as Google's console writes it.
#[derive(Deserialize)]
struct KeyFile {
    #[serde(rename = "type")]
    kind: Option<String>,
    client_email: Option<String>,
    private_key: Option<String>,
    private_key_id: Option<String>,
    token_uri: Option<String>,
}

/// A service account: who it is, where its tokens come from, and its key.
pub struct ServiceKey {
    pub client_email: String,
    pub token_uri: String,
    key_id: Option<String>,
    key: RsaKeyPair,
}

impl std::fmt::Debug for ServiceKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceKey")
            .field("client_email", &self.client_email)
            .field("token_uri", &self.token_uri)
            .finish_non_exhaustive()
    }
}

impl ServiceKey {
    /// The key in the file that the variable `var` names, or in the
    /// variable itself when it holds the file's JSON (as CI secrets often
    /// do). Messages never show the variable's value when it is JSON.
    pub fn from_env(var: &str) -> Result<Self, SheetError> {
        let bad = |message: String| SheetError::Key {
            var: var.to_owned(),
            message,
        };
        let value = std::env::var_os(var)
            .filter(|p| !p.is_empty())
            .ok_or_else(|| {
                bad(
                    "is not set: set it to the path of the service account's JSON key file"
                        .to_owned(),
                )
            })?;
        let value = value.to_string_lossy();
        if value.trim_start().starts_with('{') {
            return Self::from_json(&value)
                .map_err(|message| bad(format!("holds JSON, not a usable key: {message}")));
        }
        let path = std::path::PathBuf::from(value.as_ref());
        let text = std::fs::read_to_string(&path)
            .map_err(|err| bad(format!("cannot read {}: {err}", path.display())))?;
        Self::from_json(&text).map_err(|message| bad(format!("{}: {message}", path.display())))
    }

    /// A key from a key file's text; the error says what is wrong, never
    /// what the file holds.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let file: KeyFile = serde_json::from_str(text).map_err(|err| {
            format!(
                "not a service account's JSON key file (line {}, column {})",
                err.line(),
                err.column()
            )
        })?;
        if let Some(kind) = file.kind.as_deref()
            && kind != "service_account"
        {
            return Err(format!(
                "holds credentials of type '{kind}'; a service account's key (type service_account) is needed"
            ));
        }
        let client_email = file
            .client_email
            .ok_or("has no client_email (the service account's email)")?;
        let pem = file.private_key.ok_or("has no private_key")?;
        let der = pem_body(&pem, "PRIVATE KEY")
            .ok_or("its private_key is not a PEM-encoded PKCS#8 key")?;
        let key = RsaKeyPair::from_pkcs8(&der)
            .map_err(|err| format!("its private_key is not a usable RSA key ({err})"))?;
        let token_uri = file
            .token_uri
            .unwrap_or_else(|| "https://oauth2.googleapis.com/token".to_owned());
        if !(token_uri.starts_with("https://") || token_uri.starts_with("http://")) {
            return Err("its token_uri is not an http(s) address".to_owned());
        }
        Ok(Self {
            client_email,
            token_uri,
            key_id: file.private_key_id,
            key,
        })
    }

    /// A signed JWT asking for `scope`, issued at `now_s` (seconds since
    /// the epoch).
    pub fn assertion(&self, scope: &str, now_s: u64) -> Result<String, SheetError> {
        let mut header = serde_json::json!({"alg": "RS256", "typ": "JWT"});
        if let Some(kid) = &self.key_id {
            header["kid"] = serde_json::Value::String(kid.clone());
        }
        let claims = serde_json::json!({
            "iss": self.client_email,
            "scope": scope,
            "aud": self.token_uri,
            "iat": now_s,
            "exp": now_s + ASSERTION_LIFETIME_S,
        });
        let signed = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(header.to_string()),
            URL_SAFE_NO_PAD.encode(claims.to_string())
        );
        let mut signature = vec![0; self.key.public().modulus_len()];
        self.key
            .sign(
                &RSA_PKCS1_SHA256,
                &SystemRandom::new(),
                signed.as_bytes(),
                &mut signature,
            )
            .map_err(|_| {
                SheetError::Token("the key could not sign the token request".to_owned())
            })?;
        Ok(format!("{signed}.{}", URL_SAFE_NO_PAD.encode(signature)))
    }
}

/// The bytes of a PEM block of `label`.
fn pem_body(pem: &str, label: &str) -> Option<Vec<u8>> {
    let begin = format!("-----BEGIN {label}-----");
    let end = format!("-----END {label}-----");
    let start = pem.find(&begin)? + begin.len();
    let stop = start + pem[start..].find(&end)?;
    let body: String = pem[start..stop]
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    STANDARD.decode(body).ok()
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Access tokens of one account and scope, each fetched when the last is
/// about to run out.
pub struct Tokens {
    key: ServiceKey,
    scope: &'static str,
    http: reqwest::Client,
    current: Mutex<Option<(String, Instant)>>,
}

#[derive(Deserialize)]
struct TokenAnswer {
    access_token: Option<String>,
    expires_in: Option<u64>,
    error: Option<String>,
    error_description: Option<String>,
}

impl Tokens {
    pub fn new(key: ServiceKey, scope: &'static str, http: reqwest::Client) -> Self {
        Self {
            key,
            scope,
            http,
            current: Mutex::new(None),
        }
    }

    pub fn account(&self) -> &str {
        &self.key.client_email
    }

    /// A token good for a while yet.
    pub async fn get(&self) -> Result<String, SheetError> {
        let mut current = self.current.lock().await;
        if let Some((token, until)) = current.as_ref()
            && *until > Instant::now() + RENEW_BEFORE
        {
            return Ok(token.clone());
        }
        let (token, lasts) = self.fetch().await?;
        *current = Some((token.clone(), Instant::now() + lasts));
        Ok(token)
    }

    /// Forgets the token (the API refused it).
    pub async fn forget(&self) {
        *self.current.lock().await = None;
    }

    async fn fetch(&self) -> Result<(String, Duration), SheetError> {
        let assertion = self.key.assertion(self.scope, now_s())?;
        let body = format!(
            "grant_type=urn%3Aietf%3Aparams%3Aoauth%3Agrant-type%3Ajwt-bearer&assertion={assertion}"
        );
        let uri = &self.key.token_uri;
        let response = self
            .http
            .post(uri)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body)
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .map_err(|err| SheetError::Transport {
                what: format!("the token request to {uri}"),
                message: super::transport_message(&err),
                retry: true,
            })?;
        let status = response.status();
        let text = super::read_limited(response).await.unwrap_or_default();
        let answer: Option<TokenAnswer> = serde_json::from_str(&text).ok();
        match answer {
            Some(TokenAnswer {
                access_token: Some(token),
                expires_in,
                ..
            }) if status.is_success() => Ok((
                token,
                Duration::from_secs(expires_in.unwrap_or(3600).clamp(60, 86_400)),
            )),
            other => {
                let why = other
                    .and_then(|a| match (a.error, a.error_description) {
                        (Some(e), Some(d)) => Some(format!("{e}: {d}")),
                        (Some(e), None) => Some(e),
                        (None, d) => d,
                    })
                    .unwrap_or_else(|| format!("HTTP {status}"));
                let message = format!("{uri} refused a token to {} ({why})", self.key.client_email);
                if status.as_u16() == 429 || status.is_server_error() {
                    // Busy or down for a moment: tried again.
                    Err(SheetError::Transport {
                        what: "the token request".to_owned(),
                        message,
                        retry: true,
                    })
                } else {
                    Err(SheetError::Token(message))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_files_are_refused_without_showing_their_content() {
        for (text, says) in [
            ("{", "not a service account's JSON key file"),
            (r#"{"type":"authorized_user"}"#, "type 'authorized_user'"),
            (r#"{"type":"service_account"}"#, "client_email"),
            (
                r#"{"type":"service_account","client_email":"a@b","private_key":"secret-bytes"}"#,
                "not a PEM-encoded",
            ),
        ] {
            let err = ServiceKey::from_json(text).err().unwrap_or_default();
            assert!(err.contains(says), "{err}");
            assert!(!err.contains("secret-bytes"), "{err}");
        }
    }

    #[test]
    fn pem_bodies_are_decoded_across_lines() {
        let pem = "-----BEGIN PRIVATE KEY-----\nAAEC\nAwQ=\n-----END PRIVATE KEY-----\n";
        assert_eq!(pem_body(pem, "PRIVATE KEY"), Some(vec![0, 1, 2, 3, 4]));
        assert_eq!(pem_body(pem, "PUBLIC KEY"), None);
    }
}
