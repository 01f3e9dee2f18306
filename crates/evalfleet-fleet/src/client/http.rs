//! The HTTP clients and their connections: TLS, pools whose idle
//! connections are reused only while the server keeps them, and a request
//! sent again at once when its connection was closed under it.

use std::time::Duration;

use reqwest::header::HeaderMap;

use super::ChatClient;
use super::headers::keep_alive_timeout;

/// Connections idle for longer than this are not reused: less than the 5 s
/// for which uvicorn (vLLM, SGLang, llama-cpp-python), llama.cpp's server,
/// Node and Apache keep an idle connection open, few of which say so in a
/// `Keep-Alive` header. A server that says it keeps them for less is
/// followed ([`reuse_within`]).
pub const POOL_IDLE: Duration = Duration::from_secs(4);

/// An HTTP client for probes and tests.
pub fn http_client(pool_size: usize) -> Result<reqwest::Client, reqwest::Error> {
    http_builder(pool_size, POOL_IDLE).build()
}

/// The settings of every HTTP client evalfleet makes: at most `pool_size`
/// idle connections to a host, each reused only within `idle`; TLS whose
/// root certificates are read once, at the first handshake
/// ([`super::tls`]).
pub(super) fn http_builder(pool_size: usize, idle: Duration) -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .tls_backend_preconfigured(super::tls::config())
        .pool_max_idle_per_host(pool_size)
        .pool_idle_timeout(idle)
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(10))
        // An API answers where it is asked; a redirect of a POST is a
        // misconfigured base URL, better reported than followed.
        .redirect(reqwest::redirect::Policy::none())
}

impl ChatClient {
    /// The client whose pooled connections the server keeps open.
    fn pooled(&self) -> &reqwest::Client {
        self.http_short.get().unwrap_or(&self.http)
    }

    /// Follows a server that says it closes idle connections sooner than
    /// [`POOL_IDLE`]: later requests go on a client that reuses them only
    /// within what it allows. Learned once (a server says the same each
    /// time).
    fn learn_keep_alive(&self, headers: &HeaderMap) {
        if self.http_short.get().is_some() {
            return;
        }
        let Some(idle) = keep_alive_timeout(headers).map(reuse_within) else {
            return;
        };
        if idle >= POOL_IDLE {
            return;
        }
        let built = http_builder(self.pool_size, idle)
            .default_headers(self.headers.clone())
            .build();
        let client = match built {
            Ok(client) => {
                tracing::debug!(
                    "Reusing connections only within {idle:?}, as the server keeps them."
                );
                client
            }
            Err(err) => {
                // Said once: the usual client goes on, and closed
                // connections are sent again.
                tracing::warn!(
                    "Cannot make an HTTP client that follows the server's keep-alive: {err}."
                );
                self.http.clone()
            }
        };
        // Another call may have learned it first: the same.
        let _ = self.http_short.set(client);
    }

    /// Sends the request `build` makes on a pooled connection; when that
    /// connection was closed under it (the server's keep-alive ended as it
    /// was sent), once more at once on a new connection: the server never
    /// took it up, so it costs no attempt.
    pub(super) async fn send(
        &self,
        build: impl Fn(&reqwest::Client) -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, reqwest::Error> {
        match build(self.pooled()).send().await {
            Err(err) if closed_under_it(&err) => {
                tracing::debug!(
                    "The connection was closed as the request was sent ({}); sending it again on a new one.",
                    evalfleet_types::root_cause(&err)
                );
                build(&self.http_fresh).send().await
            }
            Ok(response) => {
                self.learn_keep_alive(response.headers());
                Ok(response)
            }
            Err(err) => Err(err),
        }
    }
}

/// Whether a request failed because the connection it went on was closed
/// under it (closed before any byte of an answer, reset, or broken) rather
/// than because no connection could be made: what a server does to a
/// connection it keeps idle when its keep-alive ends just as a request is
/// sent on it. Such a request was never taken up by the server.
fn closed_under_it(err: &reqwest::Error) -> bool {
    if err.is_connect() || err.is_timeout() {
        return false;
    }
    let mut cause = std::error::Error::source(err);
    while let Some(inner) = cause {
        if inner
            .downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_incomplete_message)
        {
            return true;
        }
        if let Some(io) = inner.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
            );
        }
        cause = inner.source();
    }
    false
}

/// How long a connection may stay idle and still be reused, when the
/// server closes idle ones after `timeout`: a second less (half of it when
/// shorter), so that a request sent on it gets there before the server
/// closes it.
fn reuse_within(timeout: Duration) -> Duration {
    timeout.saturating_sub(Duration::from_secs(1).min(timeout / 2))
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    #[test]
    fn a_keep_alive_header_says_how_long_connections_may_be_reused() {
        let said = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert("keep-alive", HeaderValue::from_static(value));
            keep_alive_timeout(&headers)
        };
        assert_eq!(said("timeout=5, max=100"), Some(Duration::from_secs(5)));
        assert_eq!(said("max=100, Timeout = 2"), Some(Duration::from_secs(2)));
        assert_eq!(said("max=100"), None);
        assert_eq!(said("timeout=soon"), None);
        assert_eq!(keep_alive_timeout(&HeaderMap::new()), None);
        // A second's margin, or half of a shorter timeout.
        assert_eq!(reuse_within(Duration::from_secs(5)), POOL_IDLE);
        assert_eq!(
            reuse_within(Duration::from_secs(1)),
            Duration::from_millis(500)
        );
        assert_eq!(reuse_within(Duration::ZERO), Duration::ZERO);
    }
}
