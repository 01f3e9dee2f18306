//! The gateway: an OpenAI-compatible API over the run's fleet, for agents
//! (`kind: exec`). Each item's run of its agent gets an address of its own
//! ([`Pass`]: `…/gw/<token>/v1`, the token also taken as the API key), so
//! every call the agent makes is the item's, in order, whatever the agent
//! sends.
//!
//! A call is routed by the model name the agent asks for (`task.models`
//! maps names to endpoints) to whichever endpoint for it takes calls and
//! has a free slot first, under its limits and rates, and made on the
//! fleet's one call path ([`evalfleet_fleet::call::send_with`]), which feeds
//! its outcome back to the endpoint's limit, breaker and rates. A call that
//! fails before its first byte (no connection, a 429 or 5xx) goes to
//! another endpoint of the model; once the answer has begun it goes to the
//! agent as it comes (a stream chunk by chunk, with its usage asked for).
//! What the agent gets on failure is OpenAI's error format with the status
//! its SDK retries on (429, 503) or not (400, 401, 404).
//!
//! The HTTP side is the server's (`evalfleet_server::gateway`); this is
//! what it calls.

pub mod token;

mod cache;
mod calls;
mod error;
mod grant;
mod routes;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use evalfleet_fleet::Endpoint;
use evalfleet_fleet::client::{Api, Head};
use evalfleet_fleet::runtime::FleetHandle;
use routes::Routes;

/// The largest request body the gateway takes (413 past it): a model's
/// request, images inlined, fits; what an agent sends is held in memory
/// while its call is made.
pub const BODY_LIMIT: usize = evalfleet_types::BODY_KEPT;

/// The request bodies one attempt may send in all (413 past it): agents
/// running at once cannot take the run's memory with them.
pub const ATTEMPT_BODY_LIMIT: u64 = 256 << 20;
use token::Keys;

pub use cache::{CacheGet, CacheLink, CachePut};
pub use error::GatewayError;
pub use grant::{Closed, Grant, Keep, Made, Pass};

/// A run's gateway.
pub struct Gateway {
    run_id: String,
    keys: Keys,
    endpoints: Vec<Arc<Endpoint>>,
    routes: Routes,
    fleet: FleetHandle,
    /// The live attempts' grants, by (seq, attempt).
    grants: Mutex<HashMap<(u64, u32), Arc<Grant>>>,
    /// How long a call waits for an endpoint of its model to take it.
    wait: Duration,
    stop: CancellationToken,
    /// The run's response cache, once the session has linked it.
    cache: std::sync::OnceLock<CacheLink>,
    /// Its calls in flight, and the servers that serve it.
    tracker: tokio_util::task::TaskTracker,
}

/// A request an agent sent.
pub struct Asked {
    pub api: Api,
    pub body: Bytes,
    /// `traceparent`, when the agent sent one.
    pub traceparent: Option<String>,
}

/// What the agent gets.
pub enum Answer {
    /// The endpoint's answer (or its error response, passed on as it came:
    /// the request's own fault).
    Head(Head),
    /// Our error.
    Error(GatewayError),
}

impl Gateway {
    /// The gateway of run `run_id` over `endpoints`, routing the names of
    /// `models` (name → endpoint name or model; `*` any other).
    pub fn new(
        run_id: &str,
        endpoints: Vec<Arc<Endpoint>>,
        fleet: FleetHandle,
        models: &[(String, String)],
        wait: Duration,
        stop: CancellationToken,
    ) -> Result<Arc<Self>, String> {
        let routes = Routes::new(&endpoints, models)?;
        Ok(Arc::new(Self {
            run_id: run_id.to_owned(),
            keys: Keys::random(),
            endpoints,
            routes,
            fleet,
            grants: Mutex::new(HashMap::new()),
            wait,
            stop,
            cache: std::sync::OnceLock::new(),
            tracker: tokio_util::task::TaskTracker::new(),
        }))
    }

    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Runs `work` (a server of the gateway) until it ends or the gateway
    /// shuts down.
    pub fn spawn(&self, work: futures_util::future::BoxFuture<'static, ()>) {
        let stop = self.stop.clone();
        self.tracker.spawn(async move {
            tokio::select! {
                () = work => {}
                () = stop.cancelled() => {}
            }
        });
    }

    /// Ends its calls in flight (abandoned) and its servers, and waits for
    /// them.
    pub async fn shutdown(&self) {
        self.stop.cancel();
        self.tracker.close();
        self.tracker.wait().await;
    }

    /// Answers calls from the session's response cache, and keeps their
    /// answers there, as `link` says (once per gateway).
    pub fn link_cache(&self, link: CacheLink) {
        let _ = self.cache.set(link);
    }

    /// `GET /v1/models`: the names the agent may ask for.
    pub fn models(&self) -> Value {
        let mut names: Vec<&str> = self
            .routes
            .aliases
            .iter()
            .map(|(n, _)| n.as_str())
            .collect();
        for endpoint in &self.endpoints {
            if endpoint.config.takes_items() && !names.contains(&endpoint.model.as_str()) {
                names.push(&endpoint.model);
            }
        }
        names.retain(|n| *n != "*");
        let data: Vec<Value> = names
            .iter()
            .map(|name| serde_json::json!({"id": name, "object": "model", "created": 0, "owned_by": "evalfleet"}))
            .collect();
        serde_json::json!({"object": "list", "data": data})
    }
}
