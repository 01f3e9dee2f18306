//! Which names the server answers to. A browser page of any site can make
//! its own name resolve to 127.0.0.1 (DNS rebinding) and then talk to a
//! server on the loopback as if it were the same site: its `Origin` and
//! `Host` agree. What gives it away is the name in `Host`, which is the
//! attacker's, so the server answers only requests addressed to one of its
//! own names. An address written as digits cannot be rebound, so a server
//! bound to every address (`0.0.0.0`) answers any IP literal.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// The names a server answers to.
#[derive(Debug, Clone)]
pub struct HostPolicy {
    /// Lower-case names and IP literals (without brackets), no port.
    names: Vec<String>,
    /// Whether any IP literal is the server's (it is bound to every address).
    any_address: bool,
}

impl HostPolicy {
    /// The bound address, `localhost` and the loopback addresses when bound
    /// to one, every IP literal when bound to all, and `extra` names
    /// (`--allow-host`; a leading `.` allows every name under it).
    pub fn new(bind: SocketAddr, extra: &[String]) -> Self {
        let mut names: Vec<String> = extra.iter().map(|n| normalize(n)).collect();
        let ip = bind.ip();
        if ip.is_loopback() || ip.is_unspecified() {
            names.extend(["localhost", "127.0.0.1", "::1"].map(str::to_owned));
        }
        if !ip.is_unspecified() {
            names.push(ip.to_string());
        }
        Self {
            names,
            any_address: ip.is_unspecified(),
        }
    }

    /// A server on the loopback, answering to its usual names.
    pub fn loopback() -> Self {
        Self::new(SocketAddr::from(([127, 0, 0, 1], 0)), &[])
    }

    /// Whether `authority` (`name`, `name:port`, `[v6]:port`) is the server's.
    pub fn allows(&self, authority: &str) -> bool {
        let name = name_of(authority);
        if name.is_empty() {
            return false;
        }
        if self.any_address && name.parse::<IpAddr>().is_ok() {
            return true;
        }
        self.names.iter().any(|allowed| {
            allowed == &name
                || (allowed.starts_with('.')
                    && name.ends_with(allowed.as_str())
                    && name.len() > allowed.len())
        })
    }
}

/// The authority a request is addressed to: HTTP/2's `:authority`, or
/// `Host`; `None` when it names none (not a browser: browsers always do).
pub fn addressed_to(request: &Request) -> Option<&str> {
    request.uri().authority().map(|a| a.as_str()).or_else(|| {
        request
            .headers()
            .get(header::HOST)
            .map(|v| v.to_str().unwrap_or("\u{fffd}"))
    })
}

/// The refusal of a request addressed to a name that is not the server's;
/// `None` when it is the server's, or names none.
pub fn misdirected(hosts: &HostPolicy, request: &Request) -> Option<Response> {
    let host = addressed_to(request)?;
    (!hosts.allows(host)).then(|| {
        ApiError::Misdirected(format!(
            "this server does not answer to '{host}' (start it with --allow-host NAME to add a name it is reached by)"
        ))
        .into_response()
    })
}

/// A middleware that refuses requests addressed to other names, for a
/// server that has no other guard (the environment server).
pub async fn guard(State(hosts): State<Arc<HostPolicy>>, request: Request, next: Next) -> Response {
    match misdirected(&hosts, &request) {
        Some(refused) => refused,
        None => next.run(request).await,
    }
}

/// The name of an authority, lower-case, without its port, brackets or a
/// trailing dot.
fn name_of(authority: &str) -> String {
    let authority = authority.trim();
    let host = if let Some(rest) = authority.strip_prefix('[') {
        rest.split_once(']').map_or(rest, |(inside, _)| inside)
    } else {
        match authority.rsplit_once(':') {
            // One colon: a port. More: a bare IPv6 address.
            Some((host, port))
                if !host.contains(':') && port.bytes().all(|b| b.is_ascii_digit()) =>
            {
                host
            }
            _ => authority,
        }
    };
    normalize(host)
}

fn normalize(name: &str) -> String {
    name.trim()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .trim_end_matches('.')
        .to_ascii_lowercase()
}

/// What an `Origin` header names: its scheme and authority; `None` for
/// `null` or anything that is not `scheme://authority`.
pub fn origin_parts(origin: &str) -> Option<(&str, &str)> {
    let (scheme, rest) = origin.split_once("://")?;
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.is_empty() || authority.contains('/') {
        return None;
    }
    Some((scheme, authority))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loopback_server_answers_its_own_names_only() {
        let hosts = HostPolicy::loopback();
        for ok in [
            "127.0.0.1:8080",
            "localhost:8080",
            "LOCALHOST.",
            "[::1]:80",
            "127.0.0.1",
        ] {
            assert!(hosts.allows(ok), "{ok}");
        }
        for refused in [
            "evil.example:8080",
            "127.0.0.1.evil.example",
            "10.0.0.1:8080",
            "",
            ":80",
        ] {
            assert!(!hosts.allows(refused), "{refused}");
        }
    }

    #[test]
    fn a_server_on_every_address_answers_addresses_and_named_hosts() {
        let hosts = HostPolicy::new(
            "0.0.0.0:8080".parse().unwrap(),
            &["evals.lab.example".to_owned(), ".gpu.example".to_owned()],
        );
        assert!(hosts.allows("10.1.2.3:8080"));
        assert!(hosts.allows("[fe80::1]:8080"));
        assert!(hosts.allows("evals.lab.example:8080"));
        assert!(hosts.allows("node7.gpu.example"));
        assert!(!hosts.allows("gpu.example"));
        assert!(!hosts.allows("rebound.attacker.example:8080"));
    }

    #[test]
    fn origins_are_split_into_scheme_and_authority() {
        assert_eq!(
            origin_parts("http://127.0.0.1:8080"),
            Some(("http", "127.0.0.1:8080"))
        );
        assert_eq!(origin_parts("null"), None);
        assert_eq!(origin_parts("http://a/b"), None);
    }
}
