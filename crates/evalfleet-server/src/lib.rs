//! evalfleet's HTTP server: a JSON API under `/api/v1` (described by the
//! OpenAPI document at `/api/openapi.json`) over the store, and the runs
//! this process executes.
//!
//! [`app`] is the whole service (tests call it without a socket);
//! [`serve`] runs it on a listener until `shutdown`.

mod api;
mod auth;
pub mod control;
pub mod env;
mod error;
mod extract;
pub mod gateway;
mod hosts;
mod keys;
mod metrics;
pub mod pages;
mod sessions;
mod state;

use std::future::IntoFuture;
use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use tokio_util::sync::CancellationToken;

pub use control::{RunControl, StartRun};
pub use error::ApiError;
pub use hosts::HostPolicy;
pub use keys::open_bind_refusal;
pub use state::{AppState, ServerOptions};

/// The whole service.
pub fn app(state: Arc<AppState>) -> Router {
    let hosts = Arc::new(state.hosts.clone());
    let (api, openapi) = api::router();
    let openapi = Arc::new(openapi);
    Router::new()
        .nest("/api/v1", api)
        .route(
            "/api/openapi.json",
            get(move || {
                let openapi = openapi.clone();
                async move { Json((*openapi).clone()) }
            }),
        )
        .route("/metrics", get(metrics::metrics))
        .route("/", get(pages::runs))
        .route("/runs/{run_id}", get(pages::run))
        .route("/runs/{run_id}/items", get(pages::items))
        .route("/runs/{run_id}/items/{item_id}", get(pages::item))
        .route("/compare", get(pages::compare))
        .route("/benches/{name}", get(pages::bench))
        .route("/new", get(pages::new_run))
        .route("/login", get(pages::login_page).merge(post(pages::login)))
        .route("/assets/{*path}", get(pages::asset))
        .fallback(|| async { ApiError::NotFound("no such page".to_owned()) })
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::guard,
        ))
        .layer(DefaultBodyLimit::max(state.body_limit))
        .with_state(state)
        // Agents' calls carry their own credentials (the item's token);
        // they too must be sent to one of the server's names.
        .merge(
            gateway::router(gateway::registry().clone())
                .layer(axum::middleware::from_fn_with_state(hosts, hosts::guard)),
        )
}

/// The OpenAPI document.
pub fn openapi() -> utoipa::openapi::OpenApi {
    api::router().1
}

/// How long requests in progress at a shutdown have to finish: the server
/// stops then however busy it is.
pub const GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Serves [`app`] on `listener` until `shutdown`; requests in progress then
/// get [`GRACE`] to finish, and those still going are dropped.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let app = app(state);
    // Streams (the live pages, agents' calls) are many small writes.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    // Each client's address, for how many wrong keys it may offer.
    let app = app.into_make_service_with_connect_info::<std::net::SocketAddr>();
    let stopping = shutdown.clone();
    let serving = axum::serve(listener, app)
        .with_graceful_shutdown(async move { stopping.cancelled().await })
        .into_future();
    tokio::select! {
        served = serving => served,
        () = async {
            shutdown.cancelled().await;
            tokio::time::sleep(GRACE).await;
        } => {
            tracing::warn!(
                "Requests still in progress {} s after the shutdown began were dropped.",
                GRACE.as_secs()
            );
            Ok(())
        }
    }
}
