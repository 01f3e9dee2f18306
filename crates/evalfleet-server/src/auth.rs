//! Who may ask: with an API key set, every request carries it (`X-API-Key`,
//! `Authorization: Bearer`, or the cookie the dashboard's sign-in sets);
//! keys are compared by their SHA-256 digests in constant time, so neither
//! a key's length nor its first wrong byte shows in the time an answer
//! takes. A request that changes something must come from the server's own
//! pages or a client that is not a browser: a browser sends `Origin` with
//! it, and one naming another site is refused (CORS is closed: no
//! cross-site reads, and no cross-site writes either).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::keys::{digest, same};
use crate::state::AppState;

/// The cookie the dashboard's sign-in sets.
pub const COOKIE: &str = "evalfleet_key";

/// The key a request carries in a header, if any.
fn header_key(headers: &HeaderMap) -> Option<String> {
    if let Some(key) = headers.get("x-api-key").and_then(|v| v.to_str().ok()) {
        return Some(key.trim().to_owned());
    }
    let auth = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())?;
    auth.strip_prefix("Bearer ")
        .or_else(|| auth.strip_prefix("bearer "))
        .map(|token| token.trim().to_owned())
}

/// The session cookie a request carries, if any.
fn cookie(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|pair| {
            let (name, value) = pair.trim().split_once('=')?;
            (name == COOKIE).then(|| value.to_owned())
        })
}

/// Whether `key` is the server's (always, when it has none).
pub fn accepts(state: &AppState, key: Option<&str>) -> bool {
    match (&state.key_digest, key) {
        (None, _) => true,
        (Some(expected), Some(key)) => same(expected, &digest(key)),
        (Some(_), None) => false,
    }
}

/// Whether a request may be served: no key is set, or it carries the key
/// (a header) or the session cookie of a sign-in.
fn authorized(state: &AppState, headers: &HeaderMap) -> bool {
    let Some(expected) = &state.key_digest else {
        return true;
    };
    if let Some(key) = header_key(headers) {
        return same(expected, &digest(&key));
    }
    match (cookie(headers), &state.session_digest) {
        (Some(token), Some(session)) => same(session, &digest(&token)),
        _ => false,
    }
}

/// A request from a browser page of another site, to change something.
fn cross_site(method: &Method, headers: &HeaderMap) -> bool {
    if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        return false;
    }
    let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let origin_host = origin
        .split_once("://")
        .map_or(origin, |(_, rest)| rest)
        .trim_end_matches('/');
    origin_host != host
}

/// The middleware in front of everything but the sign-in page.
pub async fn guard(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let path = request.uri().path();
    let open = path == "/login" || path.starts_with("/assets/");
    if !open && !authorized(&state, request.headers()) {
        if request.method() == Method::GET && !path.starts_with("/api") && path != "/metrics" {
            // A person at a page: to the sign-in.
            return axum::response::Redirect::to("/login").into_response();
        }
        return ApiError::Unauthorized.into_response();
    }
    if cross_site(request.method(), request.headers()) {
        return ApiError::Forbidden(
            "a request from another site's page may not change anything here".to_owned(),
        )
        .into_response();
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_read_from_any_of_their_places() {
        let mut headers = HeaderMap::new();
        assert_eq!(header_key(&headers), None);
        headers.insert(header::COOKIE, "a=b; evalfleet_key=k3".parse().unwrap());
        assert_eq!(cookie(&headers).as_deref(), Some("k3"));
        headers.insert(header::AUTHORIZATION, "Bearer k2".parse().unwrap());
        assert_eq!(header_key(&headers).as_deref(), Some("k2"));
        headers.insert("x-api-key", "k1".parse().unwrap());
        assert_eq!(header_key(&headers).as_deref(), Some("k1"));
        assert_ne!(crate::keys::session_token("k1"), "k1");
        assert_eq!(crate::keys::session_token("k1").len(), 64);
    }

    #[test]
    fn digests_compare_equal_only_when_equal() {
        let a = digest("secret");
        assert!(same(&a, &digest("secret")));
        assert!(!same(&a, &digest("secreT")));
        assert!(!same(&a, &digest("")));
    }

    #[test]
    fn only_changes_from_another_site_are_cross_site() {
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, "127.0.0.1:8080".parse().unwrap());
        assert!(
            !cross_site(&Method::POST, &headers),
            "no Origin: not a browser"
        );
        headers.insert(header::ORIGIN, "http://127.0.0.1:8080".parse().unwrap());
        assert!(!cross_site(&Method::POST, &headers));
        headers.insert(header::ORIGIN, "https://evil.example".parse().unwrap());
        assert!(cross_site(&Method::POST, &headers));
        assert!(!cross_site(&Method::GET, &headers));
    }
}
