//! A run as it goes: its timeline (a point a second, in spans for long
//! runs), and a server-sent event stream that starts with a full snapshot
//! (on every connection, a reconnection with `Last-Event-ID` included) and
//! then sends what changed each second.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::State;

use crate::extract::{Path, Query};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use evalfleet_reports::ResourcesReport;
use evalfleet_reports::view::{
    self, EndpointsView, RunDetail, RunState, RunSummary, TimelinePoint,
};
use evalfleet_store::Store;
use evalfleet_types::{Event, ResourcePoint};
use futures_util::Stream;
use serde::{Deserialize, Serialize};

use crate::error::{ApiError, ErrorBody};
use crate::state::AppState;

/// Points a timeline is kept to.
const POINTS: usize = 600;
/// Samples read at once (a week of seconds, for one worker).
const SAMPLES: usize = 1_000_000;

/// The query of a timeline.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct TimelineParams {
    /// Only what came after this time (ms since the Unix epoch).
    pub after: Option<i64>,
    /// At most this many points (default 600, 1 to 100,000): a longer run
    /// comes in spans of several seconds.
    pub points: Option<usize>,
}

fn timeline_of(
    store: &mut dyn Store,
    run_id: &str,
    after: i64,
    points: usize,
) -> Result<Vec<TimelinePoint>, ApiError> {
    let samples = store.samples(run_id, after, SAMPLES)?;
    Ok(view::timeline(&samples, points))
}

/// A run's timeline: a point a second (or a span of seconds): its counts,
/// items per second, and each endpoint's limit, calls in flight, rates,
/// latency, TTFT and TPOT percentiles and quota pauses.
#[utoipa::path(
    get,
    path = "/runs/{run_id}/timeline",
    tag = "live",
    params(("run_id" = String, Path, description = "The run's id"), TimelineParams),
    responses(
        (status = 200, description = "The timeline", body = Vec<TimelinePoint>),
        (status = 400, description = "A parameter is wrong", body = ErrorBody),
        (status = 404, description = "No such run", body = ErrorBody),
    )
)]
pub async fn timeline(
    State(state): State<Arc<AppState>>,
    Path(run_id): Path<String>,
    Query(params): Query<TimelineParams>,
) -> Result<Json<Vec<TimelinePoint>>, ApiError> {
    let points = params.points.unwrap_or(POINTS);
    if !(1..=100_000).contains(&points) {
        return Err(ApiError::BadRequest(format!(
            "points: must be 1 to 100000, got {points}"
        )));
    }
    let after = params.after.unwrap_or(i64::MIN);
    let timeline = state
        .with_store(move |store| timeline_of(store, &run_id, after, points))
        .await?;
    Ok(Json(timeline))
}

/// The query of a run's resource telemetry.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ResourcesParams {
    /// Only points whose last sample came after this time (ms since the
    /// Unix epoch); the summary is always the whole run's.
    pub after: Option<i64>,
}

/// A run's resource telemetry: its points, and each series' peak and mean.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ResourcesView {
    /// By series, then time; at most `POINTS_PER_SERIES` a series.
    pub points: Vec<ResourcePoint>,
    pub summary: ResourcesReport,
}

/// A run's resource telemetry (`telemetry:`): each GPU's memory and
/// utilisation, each endpoint's engine (RSS, CPU, GPU memory, KV cache,
/// requests running and waiting) and evalfleet's own RSS and CPU, as
/// bounded series, with each series' peak and mean.
#[utoipa::path(
    get,
    path = "/runs/{run_id}/resources",
    tag = "live",
    params(("run_id" = String, Path, description = "The run's id"), ResourcesParams),
    responses(
        (status = 200, description = "The run's resource series", body = ResourcesView),
        (status = 404, description = "No such run", body = ErrorBody),
    )
)]
pub async fn resources(
    State(state): State<Arc<AppState>>,
    Path(run_id): Path<String>,
    Query(params): Query<ResourcesParams>,
) -> Result<Json<ResourcesView>, ApiError> {
    let after = params.after.unwrap_or(i64::MIN);
    let view = state
        .with_store(move |store| {
            let all = store.resource_points(&run_id, i64::MIN)?;
            let summary = ResourcesReport::of(&all);
            let points = all.into_iter().filter(|p| p.until_ms > after).collect();
            Ok(ResourcesView { points, summary })
        })
        .await?;
    Ok(Json(view))
}

/// The first message of a stream: everything there is to show.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Snapshot {
    pub run: RunDetail,
    pub timeline: Vec<TimelinePoint>,
}

/// Each later message: what changed.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Update {
    pub run: RunSummary,
    pub endpoints: Option<EndpointsView>,
    /// New seconds of the timeline.
    pub points: Vec<TimelinePoint>,
    /// New events.
    pub events: Vec<Event>,
    /// What each worker has committed so far.
    pub work_by_worker: Vec<evalfleet_store::WorkerWork>,
}

/// What a message of a stream carries, as its `data` (JSON): a
/// `snapshot`, an `update`, or an `error`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(untagged)]
#[allow(dead_code)]
pub enum StreamEvent {
    Snapshot(Snapshot),
    Update(Update),
    Error(ErrorBody),
}

/// One server-sent event of a stream, as it goes over the wire: its kind
/// (`event`), its id (the time of the last timeline point sent), and its
/// `data`, the JSON text of a [`StreamEvent`].
#[allow(dead_code)]
pub struct SseMessage;

impl utoipa::PartialSchema for SseMessage {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ObjectBuilder, Type};
        ObjectBuilder::new()
            .description(Some(
                "A server-sent event: `event` is snapshot, update or error; `data` is JSON text of a StreamEvent.",
            ))
            .property(
                "event",
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .enum_values(Some(["snapshot", "update", "error"])),
            )
            .property("id", ObjectBuilder::new().schema_type(Type::String))
            .property(
                "data",
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .content_media_type("application/json"),
            )
            .property("retry", ObjectBuilder::new().schema_type(Type::Integer))
            .required("data")
            .into()
    }
}

impl utoipa::ToSchema for SseMessage {
    fn schemas(
        schemas: &mut Vec<(
            String,
            utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
        )>,
    ) {
        // What `data` holds is documented beside it.
        schemas.push((
            "StreamEvent".to_owned(),
            <StreamEvent as utoipa::PartialSchema>::schema(),
        ));
        <StreamEvent as utoipa::ToSchema>::schemas(schemas);
    }
}

/// Where a stream is.
struct Cursor {
    run_id: String,
    /// The last point sent.
    last_ms: i64,
    /// Events sent.
    events: usize,
    snapshot_sent: bool,
    ended: bool,
}

fn sse(kind: &str, id: i64, body: &impl Serialize) -> SseEvent {
    let data = serde_json::to_string(body)
        .unwrap_or_else(|err| format!("{{\"error\": \"cannot encode the {kind}: {err}\"}}"));
    SseEvent::default()
        .event(kind)
        .id(id.to_string())
        .data(data)
}

/// The next message of a stream, reading the store on a blocking thread.
async fn next(state: &Arc<AppState>, cursor: &mut Cursor) -> Result<Option<SseEvent>, ApiError> {
    if cursor.ended {
        return Ok(None);
    }
    if !cursor.snapshot_sent {
        let run_id = cursor.run_id.clone();
        let (run, timeline, events) = state
            .with_store(move |store| {
                let run = view::detail(store, &run_id)?;
                let timeline = timeline_of(store, &run_id, i64::MIN, POINTS)?;
                let events = store.events(&run_id)?.len();
                Ok((run, timeline, events))
            })
            .await?;
        cursor.snapshot_sent = true;
        cursor.events = events;
        cursor.last_ms = timeline.last().map_or(0, |p| p.at_ms);
        let id = cursor.last_ms;
        return Ok(Some(sse("snapshot", id, &Snapshot { run, timeline })));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let run_id = cursor.run_id.clone();
    let (last_ms, seen) = (cursor.last_ms, cursor.events);
    let (update, events_now) = state
        .with_store(move |store| {
            let record = store.run(&run_id)?;
            let run = view::summary(store, &record)?;
            let endpoints = store.endpoint_states(&run_id)?.map(|s| EndpointsView {
                updated_at_ms: s.updated_at_ms,
                live: run.workers > 0,
                endpoints: s.endpoints,
            });
            // From the second before the last sent, for the first new
            // point's rate.
            let points: Vec<TimelinePoint> =
                timeline_of(store, &run_id, last_ms - 1500, usize::MAX)?
                    .into_iter()
                    .filter(|p| p.at_ms > last_ms)
                    .collect();
            let all = store.events(&run_id)?;
            let count = all.len();
            let events = all.into_iter().skip(seen).collect();
            let work_by_worker = store.worker_work(&run_id)?;
            Ok((
                Update {
                    run,
                    endpoints,
                    points,
                    events,
                    work_by_worker,
                },
                count,
            ))
        })
        .await?;
    cursor.events = events_now;
    if let Some(last) = update.points.last() {
        cursor.last_ms = last.at_ms;
    }
    if update.run.state != RunState::Running {
        // It stopped: this is the last message (reconnect after a resume).
        cursor.ended = true;
    }
    Ok(Some(sse("update", cursor.last_ms, &update)))
}

/// A run's live stream (server-sent events): `snapshot` first (the run in
/// full and its timeline; again on every reconnection), then an `update`
/// a second (its summary, endpoints, new timeline points and new events)
/// until it stops running; an `error` event if the store cannot be read.
#[utoipa::path(
    get,
    path = "/runs/{run_id}/stream",
    tag = "live",
    params(("run_id" = String, Path, description = "The run's id")),
    responses(
        (status = 200, description = "Events: `snapshot` (a Snapshot), then `update`s (an Update each); `error` (an ErrorBody) if the store cannot be read", content_type = "text/event-stream", body = SseMessage),
        (status = 404, description = "No such run", body = ErrorBody),
    )
)]
pub async fn stream(
    State(state): State<Arc<AppState>>,
    Path(run_id): Path<String>,
) -> Result<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>, ApiError> {
    // A run that does not exist is a 404, not an empty stream.
    let id = run_id.clone();
    state
        .with_store(move |store| Ok(store.run(&id).map(|_| ())?))
        .await?;
    let cursor = Cursor {
        run_id,
        last_ms: 0,
        events: 0,
        snapshot_sent: false,
        ended: false,
    };
    let events = futures_util::stream::unfold((state, cursor), |(state, mut cursor)| async move {
        match next(&state, &mut cursor).await {
            Ok(Some(event)) => Some((Ok(event), (state, cursor))),
            Ok(None) => None,
            Err(err) => {
                cursor.ended = true;
                let event = SseEvent::default().event("error").data(err.to_string());
                Some((Ok(event), (state, cursor)))
            }
        }
    });
    Ok(Sse::new(events).keep_alive(KeepAlive::default()))
}
