//! Reports and comparisons: the core's typed reports, as JSON.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;

use crate::extract::{Path, Query};
use evalfleet_core::report::{self, Comparison, Disagreements, Report};
use serde::{Deserialize, Serialize};

use crate::error::{ApiError, ErrorBody};
use crate::state::AppState;

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
    /// Item fields the categories are made of, comma-separated.
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
) -> Result<Json<Report>, ApiError> {
    let by = fields(params.by.as_deref());
    let report = state
        .with_store(move |store| Ok(report::report(store, &run_id, &by, None)?))
        .await?;
    Ok(Json(report))
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

/// Runs side by side.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ComparisonBody {
    /// Per metric and category, each run against the first: both means
    /// with their intervals, the paired difference with its interval and
    /// p-value, McNemar's test for 0/1 scores.
    pub comparisons: Vec<Comparison>,
    /// Per run after the first: the items it and the first scored
    /// differently on `metric`.
    pub disagreements: Vec<Disagreements>,
}

/// Compares runs on the items they share.
#[utoipa::path(
    get,
    path = "/compare",
    tag = "reports",
    params(CompareParams),
    responses(
        (status = 200, description = "The comparison", body = ComparisonBody),
        (status = 400, description = "A parameter is wrong", body = ErrorBody),
        (status = 404, description = "No such run", body = ErrorBody),
        (status = 422, description = "The runs cannot be compared", body = ErrorBody),
    )
)]
pub async fn compare(
    State(state): State<Arc<AppState>>,
    Query(params): Query<CompareParams>,
) -> Result<Json<ComparisonBody>, ApiError> {
    let runs = fields(Some(&params.runs));
    if runs.len() < 2 {
        return Err(ApiError::BadRequest(
            "runs: give two or more run ids, comma-separated".to_owned(),
        ));
    }
    let by = fields(params.by.as_deref());
    let limit = params.limit.unwrap_or(100).min(1000);
    let body = state
        .with_store(move |store| {
            let comparisons = report::compare(store, &runs, &by)?;
            let metric = match params.metric {
                Some(metric) => metric,
                None => comparisons
                    .first()
                    .map(|c| c.metric.clone())
                    .unwrap_or_default(),
            };
            let disagreements = runs[1..]
                .iter()
                .map(|other| report::disagreements(store, &runs[0], other, &metric, &by, limit))
                .collect::<Result<_, _>>()?;
            Ok(ComparisonBody {
                comparisons,
                disagreements,
            })
        })
        .await?;
    Ok(Json(body))
}
