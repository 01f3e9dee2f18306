//! The HTTP clients and their connections: TLS, pools whose idle
//! connections are reused only while the server keeps them, and a request
//! sent again at once when its connection was closed under it.
//!
//! A plain `http://` endpoint reached without a proxy (a vLLM, SGLang or
//! llama.cpp server on the LAN, where the client's CPU bounds a fast
//! endpoint's throughput) is called on hyper's pooled client directly:
//! reqwest wraps every client in a redirect layer that parses each
//! request's URL twice, IDNA included, even with redirects off (4.5% of
//! the client's CPU in W1's profile), and converts its own URL to a URI at
//! every request. TLS endpoints, any endpoint behind a proxy (`HTTP_PROXY`,
//! `ALL_PROXY`) and URLs with a user and password go through reqwest.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client as Pooled;
use hyper_util::client::legacy::connect::HttpConnector;
use reqwest::ResponseBuilderExt;
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

/// How long a connection may take to be made, the name's lookup included.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// TCP keepalive on every connection (idle time before the first probe,
/// between probes, probes) and how long sent data may go unacknowledged
/// (`TCP_USER_TIMEOUT`, Linux): a server that went away without a word
/// (powered off, or behind a firewall that drops) fails the call within
/// about 30 to 45 s as a broken connection, not at the attempt's timeout
/// as back pressure. (reqwest's own defaults, set on both transports.)
const KEEPALIVE: Duration = Duration::from_secs(15);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(15);
const KEEPALIVE_RETRIES: u32 = 3;
#[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
const USER_TIMEOUT: Duration = Duration::from_secs(30);

/// The settings of every HTTP client evalfleet makes: at most `pool_size`
/// idle connections to a host, each reused only within `idle`; TLS whose
/// root certificates are read once, at the first handshake
/// ([`super::tls`]).
pub(super) fn http_builder(pool_size: usize, idle: Duration) -> reqwest::ClientBuilder {
    let builder = reqwest::Client::builder()
        .tls_backend_preconfigured(super::tls::config())
        .pool_max_idle_per_host(pool_size)
        .pool_idle_timeout(idle)
        .tcp_nodelay(true)
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_keepalive(KEEPALIVE)
        .tcp_keepalive_interval(KEEPALIVE_INTERVAL)
        .tcp_keepalive_retries(KEEPALIVE_RETRIES)
        // An API answers where it is asked; a redirect of a POST is a
        // misconfigured base URL, better reported than followed.
        .redirect(reqwest::redirect::Policy::none());
    #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
    let builder = builder.tcp_user_timeout(USER_TIMEOUT);
    builder
}

/// hyper's client on plain TCP, pooled and connected as [`http_builder`]'s.
type Direct = Pooled<Timed<HttpConnector>, Full<Bytes>>;

fn direct(pool_size: usize, idle: Duration) -> Direct {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_keepalive(Some(KEEPALIVE));
    connector.set_keepalive_interval(Some(KEEPALIVE_INTERVAL));
    connector.set_keepalive_retries(Some(KEEPALIVE_RETRIES));
    #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
    connector.set_tcp_user_timeout(Some(USER_TIMEOUT));
    Pooled::builder(hyper_util::rt::TokioExecutor::new())
        .pool_timer(hyper_util::rt::TokioTimer::new())
        .pool_max_idle_per_host(pool_size)
        .pool_idle_timeout(idle)
        .build(Timed {
            inner: connector,
            limit: CONNECT_TIMEOUT,
        })
}

/// A connector whose connections must be made within `limit`, the name's
/// lookup included (hyper's own timeout covers the TCP connect only: a
/// resolver that hangs would hold the call to its attempt's timeout).
#[derive(Debug, Clone)]
pub(super) struct Timed<C> {
    inner: C,
    limit: Duration,
}

/// No connection within the connect timeout.
#[derive(Debug, thiserror::Error)]
#[error("no connection within {}", humantime::format_duration(*.0))]
struct ConnectTimeout(Duration);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<C> tower_service::Service<http::Uri> for Timed<C>
where
    C: tower_service::Service<http::Uri>,
    C::Response: Send + 'static,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<C::Response, BoxError>> + Send>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connecting = self.inner.call(uri);
        let limit = self.limit;
        Box::pin(async move {
            match tokio::time::timeout(limit, connecting).await {
                Ok(connected) => connected.map_err(Into::into),
                Err(_) => Err(ConnectTimeout(limit).into()),
            }
        })
    }
}

/// Environment variables naming a proxy that reqwest would follow for an
/// `http://` URL.
const PROXY_VARS: [&str; 4] = ["HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"];

/// Whether the environment names a proxy for `http://` URLs.
pub(super) fn env_proxy() -> bool {
    PROXY_VARS
        .iter()
        .any(|var| std::env::var_os(var).is_some_and(|value| !value.is_empty()))
}

/// How a client sends its requests.
#[derive(Clone)]
pub(super) enum Transport {
    /// hyper's pooled client: a plain `http://` endpoint with no proxy.
    Direct(Direct),
    /// reqwest: TLS, proxies.
    Reqwest(reqwest::Client),
}

impl Transport {
    /// The transport for `url` with these pool settings and `headers` on
    /// every request.
    pub(super) fn new(
        url: &reqwest::Url,
        pool_size: usize,
        idle: Duration,
        headers: &HeaderMap,
    ) -> Result<Self, reqwest::Error> {
        let proxied = env_proxy();
        // (A user and password in the URL are reqwest's to send as Basic
        // authorization.)
        let userinfo = !url.username().is_empty() || url.password().is_some();
        if url.scheme() == "http" && !proxied && !userinfo {
            return Ok(Self::Direct(direct(pool_size, idle)));
        }
        http_builder(pool_size, idle)
            .default_headers(headers.clone())
            .build()
            .map(Self::Reqwest)
    }

    /// Whether requests go on hyper's client directly.
    #[cfg(test)]
    pub(super) fn is_direct(&self) -> bool {
        matches!(self, Self::Direct(_))
    }

    async fn request(
        &self,
        post: Option<&Bytes>,
        url: &Target,
        headers: &HeaderMap,
    ) -> Result<reqwest::Response, SendError> {
        match self {
            Self::Reqwest(http) => {
                let request = match post {
                    Some(body) => http.post(url.url.clone()).body(body.clone()),
                    None => http.get(url.url.clone()),
                };
                request.send().await.map_err(SendError::Reqwest)
            }
            Self::Direct(http) => {
                let mut request = http::Request::new(Full::new(post.cloned().unwrap_or_default()));
                if post.is_some() {
                    *request.method_mut() = http::Method::POST;
                }
                *request.uri_mut() = url.uri.clone();
                *request.headers_mut() = headers.clone();
                let response = http
                    .request(request)
                    .await
                    .map_err(|err| SendError::Direct(err, url.url.clone()))?;
                Ok(answer(response, &url.url))
            }
        }
    }
}

/// hyper's answer as reqwest's, which the reading code takes, its body
/// read as it comes. Its URL is set through reqwest's own extension
/// (the only public way): a response without one gets a placeholder URL
/// parsed anew for each answer, the very work this client avoids.
fn answer(
    response: http::Response<hyper::body::Incoming>,
    url: &reqwest::Url,
) -> reqwest::Response {
    let (mut parts, body) = response.into_parts();
    if let Ok(tagged) = http::Response::builder().url(url.clone()).body(()) {
        parts.extensions.extend(tagged.into_parts().0.extensions);
    }
    reqwest::Response::from(http::Response::from_parts(parts, reqwest::Body::wrap(body)))
}

/// A request's address, parsed once: as reqwest's URL and as hyper's URI.
#[derive(Debug, Clone)]
pub(super) struct Target {
    pub(super) url: reqwest::Url,
    uri: http::Uri,
}

impl Target {
    pub(super) fn parse(address: &str) -> Result<Self, String> {
        let url = reqwest::Url::parse(address).map_err(|err| format!("{address}: {err}"))?;
        let uri = url
            .as_str()
            .parse()
            .map_err(|err| format!("{address}: {err}"))?;
        Ok(Self { url, uri })
    }
}

/// A request that got no answer.
#[derive(Debug)]
pub(crate) enum SendError {
    Reqwest(reqwest::Error),
    Direct(hyper_util::client::legacy::Error, reqwest::Url),
}

impl SendError {
    /// No connection could be made.
    pub(super) fn is_connect(&self) -> bool {
        match self {
            Self::Reqwest(err) => err.is_connect(),
            Self::Direct(err, _) => err.is_connect(),
        }
    }

    fn is_timeout(&self) -> bool {
        match self {
            Self::Reqwest(err) => err.is_timeout(),
            Self::Direct(..) => false,
        }
    }
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Reqwest(err) => err.fmt(f),
            Self::Direct(err, _) => err.fmt(f),
        }
    }
}

impl std::error::Error for SendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Reqwest(err) => err.source(),
            Self::Direct(err, _) => err.source(),
        }
    }
}

impl ChatClient {
    /// The client whose pooled connections the server keeps open.
    fn pooled(&self) -> &Transport {
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
        let built = Transport::new(
            &self.completions_url().url,
            self.pool_size,
            idle,
            &self.headers,
        );
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

    /// Sends a request to `url` (a POST of `post`, else a GET) on a pooled
    /// connection; when that connection was closed under it (the server's
    /// keep-alive ended as it was sent), once more at once on a new
    /// connection: the server never took it up, so it costs no attempt.
    pub(super) async fn send(
        &self,
        post: Option<&Bytes>,
        url: &Target,
    ) -> Result<reqwest::Response, SendError> {
        match self.pooled().request(post, url, &self.headers).await {
            Err(err) if closed_under_it(&err) => {
                tracing::debug!(
                    "The connection was closed as the request was sent ({}); sending it again on a new one.",
                    evalfleet_types::root_cause(&err)
                );
                self.http_fresh.request(post, url, &self.headers).await
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
fn closed_under_it(err: &SendError) -> bool {
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
    use tower_service::Service;

    /// A connector whose connections come after `after` (never: `None`).
    #[derive(Clone)]
    struct Slow(Option<Duration>);

    impl Service<http::Uri> for Slow {
        type Response = &'static str;
        type Error = std::io::Error;
        type Future = std::pin::Pin<
            Box<dyn std::future::Future<Output = std::io::Result<&'static str>> + Send>,
        >;

        fn poll_ready(
            &mut self,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: http::Uri) -> Self::Future {
            let after = self.0;
            Box::pin(async move {
                match after {
                    Some(after) => {
                        tokio::time::sleep(after).await;
                        Ok("connected")
                    }
                    None => std::future::pending().await,
                }
            })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_not_made_within_the_timeout_fails_whatever_held_it() {
        // A lookup or a connect that never ends fails at the limit...
        let uri: http::Uri = "http://engine.internal:8000/v1".parse().unwrap();
        let mut timed = Timed {
            inner: Slow(None),
            limit: CONNECT_TIMEOUT,
        };
        let started = tokio::time::Instant::now();
        let err = timed.call(uri.clone()).await.unwrap_err();
        assert_eq!(started.elapsed(), CONNECT_TIMEOUT);
        assert_eq!(err.to_string(), "no connection within 10s");
        // ...and one made in time is the connection.
        let mut timed = Timed {
            inner: Slow(Some(Duration::from_secs(9))),
            limit: CONNECT_TIMEOUT,
        };
        assert_eq!(timed.call(uri).await.unwrap(), "connected");
    }

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
