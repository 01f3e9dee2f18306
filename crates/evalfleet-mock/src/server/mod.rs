//! The HTTP server: `GET /v1/models`, `POST /v1/chat/completions` (streaming
//! and not; scripted tool calls), `POST /v1/completions` (legacy text
//! completions, answered as chat is), `POST /v1/embeddings` (vectors drawn
//! from a hash of each input), `GET /mock/stats` (counters for tests and benchmarks),
//! `GET /health`, and its load told as engines tell theirs: `GET /props`
//! and `GET /slots` as llama.cpp's server answers them, and `GET /metrics`
//! with llama.cpp's, vLLM's and SGLang's gauges of requests running and
//! waiting.

mod answer;
mod chat;
mod embeddings;
mod fate;
mod images;
mod quota;
mod reply;
mod request;
mod response;
mod state;
mod stats;
mod status;
mod stream;

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, OnceLock};

use axum::Router;
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use self::chat::{chat, completions};
use self::embeddings::embeddings;
use self::quota::{Bucket, QuotaBucket};
use self::state::MockState;
pub use self::stats::{Stats, StatsSnapshot};
use self::status::{health, metrics, models, props, slots, stats_handler};
use crate::settings::MockSettings;

/// The mock's router, for tests that call it without a socket.
pub fn app(settings: MockSettings, stats: Arc<Stats>, shutdown: CancellationToken) -> Router {
    let bucket = settings.rpm.map(|rpm| {
        Mutex::new(Bucket {
            tokens: f64::from(settings.burst),
            last: Instant::now(),
            per_second: f64::from(rpm) / 60.0,
            capacity: f64::from(settings.burst),
        })
    });
    let quota = settings
        .quota
        .map(|quota| Mutex::new(QuotaBucket::new(quota, Instant::now())));
    let capacity = settings
        .capacity
        .map(|k| Arc::new(Semaphore::new(k as usize)));
    let answers = settings
        .answers
        .as_deref()
        .map_or_else(|| Ok(HashMap::new()), crate::settings::load_answers);
    let state = Arc::new(MockState {
        answers,
        scripted_seen: Mutex::new(HashMap::new()),
        settings,
        stats,
        prompt_counts: Mutex::new(HashMap::new()),
        bucket,
        quota,
        first_chat: OnceLock::new(),
        running: Mutex::new(CancellationToken::new()),
        admitted: AtomicU64::new(0),
        capacity,
        answering: AtomicU64::new(0),
        queued: AtomicU64::new(0),
        shutdown,
        next_id: AtomicU64::new(0),
    });
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/mock/stats", get(stats_handler))
        .route("/health", get(health))
        .route("/props", get(props))
        .route("/slots", get(slots))
        .route("/metrics", get(metrics))
        // Requests with images are large: 64 MB, where axum's default is 2.
        .layer(axum::extract::DefaultBodyLimit::max(64 << 20))
        .with_state(state)
}

/// Serves the mock on `listener` until `shutdown` is cancelled. Requests held
/// open (hangs, queues) end when it is.
pub async fn serve(
    listener: TcpListener,
    settings: MockSettings,
    stats: Arc<Stats>,
    shutdown: CancellationToken,
) -> io::Result<()> {
    let router = app(settings, stats, shutdown.clone());
    // Streams are many small writes; without TCP_NODELAY each can wait for
    // the client's delayed ACK.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, router)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}

/// A mock running in this process, stopped when [`MockServer::shutdown`] is
/// called or the handle is dropped.
pub struct MockServer {
    addr: SocketAddr,
    stats: Arc<Stats>,
    shutdown: CancellationToken,
    task: Option<tokio::task::JoinHandle<io::Result<()>>>,
}

impl MockServer {
    /// Binds `bind` (use port 0 for any free port) and starts serving.
    pub async fn start(bind: SocketAddr, settings: MockSettings) -> io::Result<Self> {
        let listener = TcpListener::bind(bind).await?;
        let addr = listener.local_addr()?;
        let stats = Arc::new(Stats::default());
        let shutdown = CancellationToken::new();
        // The server's task is owned by this handle: dropping it (or
        // `stop`) shuts it down.
        #[allow(clippy::disallowed_methods)]
        let task = tokio::spawn(serve(listener, settings, stats.clone(), shutdown.clone()));
        Ok(Self {
            addr,
            stats,
            shutdown,
            task: Some(task),
        })
    }

    /// Starts a mock on a free port of 127.0.0.1.
    pub async fn start_local(settings: MockSettings) -> io::Result<Self> {
        Self::start(SocketAddr::from(([127, 0, 0, 1], 0)), settings).await
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The OpenAI base URL, `http://ADDR/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// The counters now.
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// Stops accepting, ends held requests and waits for the server to stop.
    pub async fn shutdown(mut self) -> io::Result<()> {
        self.shutdown.cancel();
        match self.task.take() {
            Some(task) => task.await.unwrap_or_else(|err| Err(io::Error::other(err))),
            None => Ok(()),
        }
    }
}

impl Drop for MockServer {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}
