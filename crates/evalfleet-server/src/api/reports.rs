//! Reports and comparisons: the core's typed reports, as JSON. A stopped
//! run's are computed once and kept in the store (`report::kept`), so a
//! second visit reads one row; a running run's are computed each time.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};

use crate::extract::{Path, Query};
use evalfleet_reports::{self as report, Compared, KeptBody, Report};
use serde::Deserialize;

use crate::error::{ApiError, ErrorBody};
use crate::state::AppState;

/// A report's JSON as the core made (or kept) it; `X-Evalfleet-Kept` says
/// whether it was kept from an earlier request.
fn json(kept: KeptBody) -> Response {
    (
        [
            (header::CONTENT_TYPE, "application/json"),
            (
                header::HeaderName::from_static("x-evalfleet-kept"),
                if kept.kept { "true" } else { "false" },
            ),
        ],
        kept.body,
    )
        .into_response()
}
fn fields(by: Option<&str>) -> Vec<String> {
    by.map(|b| {
        b.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    })
    .unwrap_or_default()
}

/// The query of a report.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ReportParams {
    /// Item fields the categories are made of, comma-separated (`@prompt`:
    /// the rule of task.prompts). Default: the run's report.by, else
    /// doc_type when its items have that field.
    pub by: Option<String>,
}

/// A run's report: each metric overall and by category with its 95%
/// interval, how many answers could be used, pass@k and majority votes,
/// the code judge's verdicts, and each endpoint's latency and errors.
#[utoipa::path(
    get,
    path = "/runs/{run_id}/report",
    tag = "reports",
    params(("run_id" = String, Path, description = "The run's id"), ReportParams),
    responses(
        (status = 200, description = "The report", body = Report),
        (status = 404, description = "No such run", body = ErrorBody),
        (status = 422, description = "The run's stored task cannot be used", body = ErrorBody),
    )
)]
pub async fn report(
    State(state): State<Arc<AppState>>,
    Path(run_id): Path<String>,
    Query(params): Query<ReportParams>,
) -> Result<Response, ApiError> {
    let by = fields(params.by.as_deref());
    let server = state.clone();
    let kept = state
        .with_store(move |store| Ok(report::kept_report(store, server.keeping(), &run_id, &by)?))
        .await?;
    Ok(json(kept))
}

/// The query of a comparison.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct CompareParams {
    /// Two or more run ids, comma-separated: each is compared with the
    /// first.
    pub runs: String,
    /// Item fields the categories are made of, comma-separated.
    pub by: Option<String>,
    /// The metric whose disagreeing items are listed (default: the first
    /// the runs share).
    pub metric: Option<String>,
    /// How many disagreeing items to list per run (default 100, at most
    /// 1000).
    pub limit: Option<usize>,
}

/// Compares runs on the items they share: per run after the first, how
/// many items each has and how many were paired (`coverage`: runs of
/// different datasets are compared on the paired items only); per metric
/// and category, each run's own mean and interval (as its report gives
/// them), both means on the paired items, the paired difference with its
/// interval and p-value, McNemar's test for 0/1 scores; and the items each
/// run and the first scored differently on `metric`.
#[utoipa::path(
    get,
    path = "/compare",
    tag = "reports",
    params(CompareParams),
    responses(
        (status = 200, description = "The comparison", body = Compared),
        (status = 400, description = "A parameter is wrong", body = ErrorBody),
        (status = 404, description = "No such run", body = ErrorBody),
        (status = 422, description = "The runs cannot be compared", body = ErrorBody),
    )
)]
pub async fn compare(
    State(state): State<Arc<AppState>>,
    Query(params): Query<CompareParams>,
) -> Result<Response, ApiError> {
    let runs = fields(Some(&params.runs));
    if runs.len() < 2 {
        return Err(ApiError::BadRequest(
            "runs: give two or more run ids, comma-separated".to_owned(),
        ));
    }
    let by = fields(params.by.as_deref());
    let limit = params.limit.unwrap_or(100).min(1000);
    let server = state.clone();
    let kept = state
        .with_store(move |store| {
            Ok(report::kept_compare(
                store,
                server.keeping(),
                &runs,
                &by,
                params.metric.as_deref(),
                limit,
            )?)
        })
        .await?;
    Ok(json(kept))
}
