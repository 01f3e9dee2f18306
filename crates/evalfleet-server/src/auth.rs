//! Who may ask: with an API key set, every request carries it (`X-API-Key`,
//! `Authorization: Bearer`), or the cookie of a session the dashboard's
//! sign-in opened (a random token, see [`crate::sessions`]); keys are
//! compared by their SHA-256 digests in constant time, so neither a key's
//! length nor its first wrong byte shows in the time an answer takes. A
//! client that offers too many wrong keys waits before the next is looked
//! at (429). A request that changes something must come from the server's own
//! pages or a client that is not a browser: a browser sends `Origin` with
//! it, and one naming another site is refused (CORS is closed: no
//! cross-site reads, and no cross-site writes either).

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::hosts;
use crate::keys::{digest, same};
use crate::state::AppState;

/// The cookie the dashboard's sign-in sets: its session's token.
pub const COOKIE: &str = "evalfleet_session";

/// The key a request carries in a header, if any.
pub(crate) fn header_key(headers: &HeaderMap) -> Option<String> {
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

/// The address of the client that sent `request`; one address (`::`)
/// stands for every client whose address is not known (a server without a
/// socket, in tests).
pub(crate) fn client_of(extensions: &axum::http::Extensions) -> IpAddr {
    extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map_or(IpAddr::V6(Ipv6Addr::UNSPECIFIED), |info| info.0.ip())
}

/// Judges a key `client` offered at `now`: while the client must wait
/// (after too many wrong ones), it is not looked at; a wrong one counts.
pub(crate) fn offered(
    state: &AppState,
    client: IpAddr,
    key: &str,
    now: Instant,
) -> Result<(), ApiError> {
    let Some(expected) = &state.key_digest else {
        return Ok(());
    };
    if let Some(wait) = state.attempts.wait(client, now) {
        let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        return Err(ApiError::TooManyTries(seconds.max(1)));
    }
    if same(expected, &digest(key)) {
        state.attempts.succeeded(client);
        Ok(())
    } else {
        state.attempts.failed(client, now);
        Err(ApiError::Unauthorized)
    }
}

/// Whether a request may be served: no key is set, or it carries the key
/// (a header) or the cookie of an open session.
fn authorized(state: &AppState, request: &Request, now: Instant) -> Result<(), ApiError> {
    if state.key_digest.is_none() {
        return Ok(());
    }
    let headers = request.headers();
    if let Some(key) = header_key(headers) {
        return offered(state, client_of(request.extensions()), &key, now);
    }
    match cookie(headers) {
        Some(token) if state.sessions.check(&token, now) => Ok(()),
        _ => Err(ApiError::Unauthorized),
    }
}

/// Why a request sent by a browser page may not be served: its page is of
/// another site (its `Origin` is not this server, scheme and name), or its
/// `Origin` names no site at all (`null`: a sandboxed or local page) and it
/// would change something. `None`: no `Origin` (not a browser's cross-site
/// request), or this server's own page.
fn foreign_origin(method: &Method, headers: &HeaderMap, host: Option<&str>) -> Option<String> {
    let origin = headers.get(header::ORIGIN)?;
    let origin = origin.to_str().unwrap_or_default();
    let safe = matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS);
    let Some((scheme, authority)) = hosts::origin_parts(origin) else {
        return (!safe)
            .then(|| format!("a page of origin '{origin}' may not change anything here"));
    };
    let ours = matches!(scheme, "http" | "https")
        && host.is_some_and(|host| host.eq_ignore_ascii_case(authority));
    (!ours)
        .then(|| format!("a page of another site ({scheme}://{authority}) may not use this server"))
}

/// Whether a request only reads (or signs in, which changes nothing stored).
fn only_reads(method: &Method, path: &str) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
        || (*method == Method::POST && path == "/login")
}

/// The one layer in front of every route, checked before any handler, in
/// this order: the request is addressed to this server (DNS rebinding gets
/// 421), a read-only server is asked to read only, the key, and a browser
/// page asking is this server's own.
pub async fn guard(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    if let Some(refused) = hosts::misdirected(&state.hosts, &request) {
        return refused;
    }
    let host = hosts::addressed_to(&request).map(str::to_owned);
    let path = request.uri().path();
    if state.read_only && !only_reads(request.method(), path) {
        return ApiError::NotHere(
            "this server is read-only (evalfleet serve --read-only): it changes nothing".to_owned(),
        )
        .into_response();
    }
    let open = path == "/login" || path.starts_with("/assets/");
    if !open && let Err(refused) = authorized(&state, &request, Instant::now()) {
        let page =
            request.method() == Method::GET && !path.starts_with("/api") && path != "/metrics";
        if page && matches!(refused, ApiError::Unauthorized) {
            // A person at a page: to the sign-in.
            return axum::response::Redirect::to("/login").into_response();
        }
        return refused.into_response();
    }
    if let Some(why) = foreign_origin(request.method(), request.headers(), host.as_deref()) {
        return ApiError::Forbidden(why).into_response();
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
        headers.insert(header::COOKIE, "a=b; evalfleet_session=k3".parse().unwrap());
        assert_eq!(cookie(&headers).as_deref(), Some("k3"));
        headers.insert(header::AUTHORIZATION, "Bearer k2".parse().unwrap());
        assert_eq!(header_key(&headers).as_deref(), Some("k2"));
        headers.insert("x-api-key", "k1".parse().unwrap());
        assert_eq!(header_key(&headers).as_deref(), Some("k1"));
    }

    #[test]
    fn digests_compare_equal_only_when_equal() {
        let a = digest("secret");
        assert!(same(&a, &digest("secret")));
        assert!(!same(&a, &digest("secreT")));
        assert!(!same(&a, &digest("")));
    }

    #[test]
    fn only_this_servers_own_pages_are_not_foreign() {
        let host = Some("127.0.0.1:8080");
        let mut headers = HeaderMap::new();
        assert_eq!(
            foreign_origin(&Method::POST, &headers, host),
            None,
            "no Origin: not a browser"
        );
        headers.insert(header::ORIGIN, "http://127.0.0.1:8080".parse().unwrap());
        assert_eq!(foreign_origin(&Method::POST, &headers, host), None);
        for foreign in [
            "https://evil.example",
            "http://127.0.0.1:9090",
            "ftp://127.0.0.1:8080",
        ] {
            headers.insert(header::ORIGIN, foreign.parse().unwrap());
            assert!(
                foreign_origin(&Method::POST, &headers, host).is_some(),
                "{foreign}"
            );
            assert!(
                foreign_origin(&Method::GET, &headers, host).is_some(),
                "{foreign}"
            );
        }
        headers.insert(header::ORIGIN, "null".parse().unwrap());
        assert!(foreign_origin(&Method::POST, &headers, host).is_some());
        assert_eq!(foreign_origin(&Method::GET, &headers, host), None);
    }
}
