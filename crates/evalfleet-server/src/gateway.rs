//! The gateway's HTTP side: OpenAI's API (`/v1/chat/completions`,
//! `/v1/completions`, `/v1/responses`, `/v1/embeddings`, `/v1/models`)
//! under each item's address, `/gw/<token>/v1/...`, and under `/v1/...`
//! with the token as the API key (`Authorization: Bearer <token>`). The
//! token says which run's gateway answers; that gateway checks it.
//!
//! Served on the listener an exec task makes in its sandbox ([`Host`]),
//! and by `evalfleet serve` for the runs it answers ([`Registry`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use evalfleet_fleet::client::{Api, Head};
use evalfleet_gateway::{Answer, Asked, Gateway, GatewayError, token};
use tokio_util::sync::CancellationToken;

/// The largest request body an agent may send: the gateway's own cap, read
/// no further.
const BODY_LIMIT: usize = evalfleet_gateway::BODY_LIMIT;

/// The gateways a server answers for, by run.
#[derive(Default)]
pub struct Registry {
    gateways: Mutex<HashMap<String, Weak<Gateway>>>,
}

impl Registry {
    /// Answers for `gateway`'s run from now on (until the gateway is gone).
    pub fn add(&self, gateway: &Arc<Gateway>) {
        if let Ok(mut map) = self.gateways.lock() {
            map.retain(|_, g| g.strong_count() > 0);
            map.insert(gateway.run_id().to_owned(), Arc::downgrade(gateway));
        }
    }

    fn find(&self, run_id: &str) -> Option<Arc<Gateway>> {
        self.gateways.lock().ok()?.get(run_id)?.upgrade()
    }
}

/// The gateways of this process's runs: `evalfleet serve` answers for
/// them on its own port too.
pub fn registry() -> &'static Arc<Registry> {
    static REGISTRY: std::sync::LazyLock<Arc<Registry>> =
        std::sync::LazyLock::new(|| Arc::new(Registry::default()));
    &REGISTRY
}

/// Serves exec tasks' gateways on their sandboxes' listeners, and
/// registers them in [`registry`].
#[derive(Default, Clone)]
pub struct Host;

impl evalfleet_pipeline::task::exec::GatewayHost for Host {
    fn serve(
        &self,
        gateway: Arc<Gateway>,
        listener: std::net::TcpListener,
        stop: CancellationToken,
    ) -> std::io::Result<futures_util::future::BoxFuture<'static, ()>> {
        listener.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let registry = Arc::new(Registry::default());
        registry.add(&gateway);
        self::registry().add(&gateway);
        let app = router(registry);
        // Streams are many small writes: without TCP_NODELAY each waits for
        // the agent's delayed ACK (about 40 ms a call on a kept connection).
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        Ok(Box::pin(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await;
            if let Err(err) = served {
                tracing::warn!("The gateway stopped serving: {err}");
            }
        }))
    }
}

/// The gateway's routes, over the gateways of `registry`.
pub fn router(registry: Arc<Registry>) -> Router {
    let api = |api: Api| {
        move |State(registry): State<Arc<Registry>>, headers: HeaderMap, body: Body| async move {
            let token = bearer(&headers);
            call(&registry, token.as_deref(), api, &headers, body).await
        }
    };
    let api_at = |api: Api| {
        move |State(registry): State<Arc<Registry>>,
              Path(token): Path<String>,
              headers: HeaderMap,
              body: Body| async move { call(&registry, Some(&token), api, &headers, body).await }
    };
    let mut router = Router::new()
        .route("/v1/models", get(models))
        .route("/gw/{token}/v1/models", get(models_at));
    for (path, which) in [
        ("chat/completions", Api::ChatCompletions),
        ("completions", Api::Completions),
        ("responses", Api::Responses),
        ("embeddings", Api::Embeddings),
    ] {
        router = router
            .route(&format!("/v1/{path}"), post(api(which)))
            .route(&format!("/gw/{{token}}/v1/{path}"), post(api_at(which)));
    }
    router
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(registry)
}

/// The token of `Authorization: Bearer <token>` (or `api-key`, as Azure's
/// clients send it).
fn bearer(headers: &HeaderMap) -> Option<String> {
    if let Some(value) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        let value = value.trim();
        let token = value
            .strip_prefix("Bearer ")
            .or_else(|| value.strip_prefix("bearer "))
            .unwrap_or(value);
        return Some(token.trim().to_owned());
    }
    headers
        .get("api-key")
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_owned())
}

/// The gateway and live attempt that `token` names.
fn grant(
    registry: &Registry,
    token: Option<&str>,
) -> Result<(Arc<Gateway>, Arc<evalfleet_gateway::Grant>), GatewayError> {
    let Some(token) = token.filter(|t| !t.is_empty()) else {
        return Err(GatewayError::unauthorized(
            "No token: use the address evalfleet gave (OPENAI_BASE_URL), or its token as the API key.",
        ));
    };
    let gateway = token::run_of(token)
        .and_then(|run| registry.find(&run))
        .ok_or_else(|| {
            GatewayError::unauthorized("The token is not one of a run this server answers.")
        })?;
    let grant = gateway.check(token)?;
    Ok((gateway, grant))
}

async fn models(State(registry): State<Arc<Registry>>, headers: HeaderMap) -> Response {
    listed(&registry, bearer(&headers).as_deref())
}

async fn models_at(State(registry): State<Arc<Registry>>, Path(token): Path<String>) -> Response {
    listed(&registry, Some(&token))
}

fn listed(registry: &Registry, token: Option<&str>) -> Response {
    match grant(registry, token) {
        Ok((gateway, _)) => axum::Json(gateway.models()).into_response(),
        Err(error) => refused(&error),
    }
}

/// How long a body past the cap is read on (and dropped) so that its
/// client, still sending, reads the 413 and not a reset connection.
const DRAIN_FOR: std::time::Duration = std::time::Duration::from_secs(2);

/// The body whole, at most `limit` bytes. Past it, the rest is read and
/// dropped, as much again at most and for [`DRAIN_FOR`] at most: a
/// connection closed with a body unread is reset under a client still
/// sending it (an agent posting 17 MiB met `Connection reset` instead of
/// the 413, now and then under load).
async fn read_capped(body: Body, limit: usize) -> Result<Bytes, String> {
    use futures_util::StreamExt;
    let mut stream = body.into_data_stream();
    let mut whole = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|err| err.to_string())?;
        if whole.len() + chunk.len() > limit {
            let mut dropped = 0;
            let _ = tokio::time::timeout(DRAIN_FOR, async {
                while dropped < limit {
                    match stream.next().await {
                        Some(Ok(chunk)) => dropped += chunk.len(),
                        _ => break,
                    }
                }
            })
            .await;
            return Err("length limit exceeded".to_owned());
        }
        whole.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(whole))
}

async fn call(
    registry: &Registry,
    token: Option<&str>,
    api: Api,
    headers: &HeaderMap,
    body: Body,
) -> Response {
    // The token first: nobody without one makes the server read a body.
    let (gateway, grant) = match grant(registry, token) {
        Ok(found) => found,
        Err(error) => return refused(&error),
    };
    let body = match read_capped(body, BODY_LIMIT).await {
        Ok(body) => body,
        Err(err) => {
            return refused(&GatewayError::new(
                413,
                "invalid_request_error",
                "request_too_large",
                format!(
                    "The request body could not be read whole (at most {} MiB): {err}",
                    BODY_LIMIT >> 20
                ),
            ));
        }
    };
    let traceparent = headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let answer = gateway
        .call(
            grant,
            Asked {
                api,
                body,
                traceparent,
            },
        )
        .await;
    match answer {
        Answer::Error(error) => refused(&error),
        Answer::Head(Head::Whole {
            status,
            content_type,
            body,
        }) => with_type(status, content_type, Body::from(body)),
        Answer::Head(Head::Failed {
            status,
            content_type,
            body,
        }) => with_type(status.unwrap_or(502), content_type, Body::from(body)),
        Answer::Head(Head::Stream {
            status,
            content_type,
            chunks,
            complete,
        }) => {
            let stream = tokio_stream_of(chunks, complete);
            let mut response = with_type(status, content_type, Body::from_stream(stream));
            response
                .headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            response
        }
    }
}

/// A stream of a channel's chunks, which ends in an error (the agent's
/// connection cut, as the endpoint's stream was) when the channel closes
/// before `complete` is set.
fn tokio_stream_of(
    mut chunks: tokio::sync::mpsc::Receiver<Bytes>,
    complete: Arc<std::sync::atomic::AtomicBool>,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> {
    let mut ended = false;
    futures_util::stream::poll_fn(move |cx| {
        if ended {
            return std::task::Poll::Ready(None);
        }
        match chunks.poll_recv(cx) {
            std::task::Poll::Ready(Some(chunk)) => std::task::Poll::Ready(Some(Ok(chunk))),
            std::task::Poll::Ready(None) => {
                ended = true;
                if complete.load(std::sync::atomic::Ordering::Acquire) {
                    std::task::Poll::Ready(None)
                } else {
                    std::task::Poll::Ready(Some(Err(std::io::Error::other(
                        "the endpoint's stream was cut short",
                    ))))
                }
            }
            std::task::Poll::Pending => std::task::Poll::Pending,
        }
    })
}

fn with_type(status: u16, content_type: Option<HeaderValue>, body: Body) -> Response {
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        content_type.unwrap_or(HeaderValue::from_static("application/json")),
    );
    response
}

/// Our error, as OpenAI's SDKs read one.
fn refused(error: &GatewayError) -> Response {
    let mut response = (
        StatusCode::from_u16(error.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        axum::Json(error.body()),
    )
        .into_response();
    let headers = response.headers_mut();
    if let Some(seconds) = error.retry_after
        && let Ok(value) = HeaderValue::from_str(&seconds.to_string())
    {
        headers.insert(header::RETRY_AFTER, value);
    }
    if let Some(retry) = error.should_retry {
        headers.insert(
            "x-should-retry",
            HeaderValue::from_static(if retry { "true" } else { "false" }),
        );
    }
    response
}
