//! Benchmark matrices: their names, and each one's report (every cell's
//! state and scores). Read only: a matrix is run by `evalfleet bench`.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use evalfleet_core::bench::{self, BenchReport, Manifest};

use crate::error::{ApiError, ErrorBody};
use crate::extract::Path;
use crate::state::AppState;

/// The report of bench `name`, its plan read from beside the store; the
/// files and the store are read off the async threads.
pub(crate) async fn report(state: &Arc<AppState>, name: String) -> Result<BenchReport, ApiError> {
    let Some(location) = state.benches.clone() else {
        return Err(ApiError::NotFound(
            "this server shows no benches".to_owned(),
        ));
    };
    if !bench::is_bench_name(&name) {
        return Err(ApiError::NotFound(format!("no bench '{name}'")));
    }
    state
        .with_store(move |store| {
            let manifest = Manifest::read(&location.dir(), &name)
                .ok()
                .filter(|m| m.is_over(&location))
                .ok_or_else(|| ApiError::NotFound(format!("no bench '{name}'")))?;
            Ok(bench::report(store, &manifest)?)
        })
        .await
}

/// The benchmark matrices kept beside the store, by name.
#[utoipa::path(
    get,
    path = "/benches",
    tag = "benches",
    responses((status = 200, description = "Their names", body = Vec<String>))
)]
pub async fn list_benches(
    State(state): State<Arc<AppState>>,
) -> Result<Json<Vec<String>>, ApiError> {
    let location = state.benches.clone();
    state
        .blocking(move || Ok(location.map(|l| Manifest::list(&l)).unwrap_or_default()))
        .await
        .map(Json)
}

/// A matrix's report: every cell (model × dataset × sweep point) with its
/// state, its run's id, its headline metric and interval, by category,
/// latency, TTFT, TPOT, tokens/s and its engine's start time.
#[utoipa::path(
    get,
    path = "/benches/{name}",
    tag = "benches",
    params(("name" = String, Path, description = "The bench's name")),
    responses(
        (status = 200, description = "The report", body = BenchReport),
        (status = 404, description = "No such bench", body = ErrorBody),
    )
)]
pub async fn get_bench(
    State(state): State<Arc<AppState>>,
    Path(name): Path<String>,
) -> Result<Json<BenchReport>, ApiError> {
    report(&state, name).await.map(Json)
}
