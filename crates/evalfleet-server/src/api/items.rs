//! A run's items: a page at a time, filtered and sorted in the store; one
//! item in full.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;

use crate::extract::{Path, Query};
use evalfleet_io::template::Message;
use evalfleet_store::{ItemCursor, ItemQuery, ItemRecord, ItemRow, ItemState, ScoreRange, SortKey};
use evalfleet_types::ErrorClass;
use serde::Serialize;

use crate::error::{ApiError, ErrorBody};
use crate::state::AppState;

/// The query of `GET /api/v1/runs/{run_id}/items` (as documented; the
/// handler reads the pairs themselves, as `field` and `score` repeat).
#[derive(Debug, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[allow(dead_code)]
pub struct ItemsParams {
    /// States, comma-separated: `pending`, `done`, `failed`.
    state: Option<String>,
    /// A dataset field's value, `NAME:VALUE`; repeat for more fields (all
    /// must match).
    field: Option<Vec<String>>,
    /// A score range, `METRIC:MIN:MAX` (either bound may be empty:
    /// `em:1:`); repeat for more metrics.
    score: Option<Vec<String>>,
    /// Items one of whose calls failed with this class (`retryable`,
    /// `back_pressure`, `first_byte_timeout`, `stalled`, `bad_response`,
    /// `fatal`).
    error_class: Option<String>,
    /// Items answered by this endpoint.
    endpoint: Option<String>,
    /// Latency range in ms, `MIN:MAX`.
    latency_ms: Option<String>,
    /// Completion tokens range, `MIN:MAX`.
    tokens: Option<String>,
    /// Text the answer or the error contains (any case).
    q: Option<String>,
    /// `seq` (dataset order, the default), `latency`, `ttft`, `tpot`,
    /// `tokens`, `attempts`, `finished`, or `score:METRIC`.
    sort: Option<String>,
    /// `asc` (the default) or `desc`.
    order: Option<String>,
    /// Where the previous page ended (its `next`).
    after: Option<String>,
    /// Rows on the page, 1 to 1000 (default 50).
    limit: Option<u32>,
}

/// A page of items.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ItemsPage {
    pub rows: Vec<ItemRow>,
    /// Pass as `after` for the next page; absent on the last.
    pub next: Option<String>,
}

/// One item in full, with the messages its run's templates make of it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ItemDetail {
    #[serde(flatten)]
    pub record: ItemRecord,
    /// The rendered messages of its first call (absent for a pending item,
    /// whose row is not stored yet).
    pub messages: Option<Vec<MessageBody>>,
    /// Why the messages could not be rendered, when they could not.
    pub messages_error: Option<String>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct MessageBody {
    pub role: String,
    pub content: String,
}

impl From<Message> for MessageBody {
    fn from(m: Message) -> Self {
        Self {
            role: m.role,
            content: m.content,
        }
    }
}

fn bad(param: &str, what: impl std::fmt::Display) -> ApiError {
    ApiError::BadRequest(format!("{param}: {what}"))
}

fn number<T: std::str::FromStr>(param: &str, text: &str) -> Result<Option<T>, ApiError> {
    if text.is_empty() {
        return Ok(None);
    }
    text.parse()
        .map(Some)
        .map_err(|_| bad(param, format!("'{text}' is not a number")))
}

fn range<T: std::str::FromStr>(
    param: &str,
    text: &str,
) -> Result<(Option<T>, Option<T>), ApiError> {
    let (low, high) = text
        .split_once(':')
        .ok_or_else(|| bad(param, format!("'{text}' is not MIN:MAX")))?;
    Ok((number(param, low)?, number(param, high)?))
}

/// The cursor as the API gives it: `VALUE,SEQ` (`-` for no value).
pub fn cursor_text(cursor: ItemCursor) -> String {
    match cursor.value {
        Some(value) => format!("{value},{}", cursor.seq),
        None => format!("-,{}", cursor.seq),
    }
}

fn cursor(text: &str) -> Result<ItemCursor, ApiError> {
    let wrong = || bad("after", format!("'{text}' is not a cursor this API gave"));
    let (value, seq) = text.split_once(',').ok_or_else(wrong)?;
    let value = match value {
        "-" => None,
        v => Some(v.parse::<f64>().map_err(|_| wrong())?).filter(|v| v.is_finite()),
    };
    Ok(ItemCursor {
        value,
        seq: seq.parse().map_err(|_| wrong())?,
    })
}

/// The store's query from the request's pairs, every problem named.
pub fn query(pairs: &[(String, String)]) -> Result<ItemQuery, ApiError> {
    let mut query = ItemQuery {
        limit: 50,
        ..ItemQuery::default()
    };
    for (key, value) in pairs {
        match key.as_str() {
            "state" => {
                for name in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                    let state = ItemState::parse(name).ok_or_else(|| {
                        bad("state", format!("'{name}' is not pending, done or failed"))
                    })?;
                    query.states.push(state);
                }
            }
            "field" => {
                let (name, wanted) = value
                    .split_once(':')
                    .ok_or_else(|| bad("field", format!("'{value}' is not NAME:VALUE")))?;
                if name.is_empty() {
                    return Err(bad("field", "the field's name is empty"));
                }
                query.fields.push((name.to_owned(), wanted.to_owned()));
            }
            "score" => {
                let mut parts = value.rsplitn(3, ':');
                let (Some(max), Some(min), Some(metric)) =
                    (parts.next(), parts.next(), parts.next())
                else {
                    return Err(bad("score", format!("'{value}' is not METRIC:MIN:MAX")));
                };
                if metric.is_empty() {
                    return Err(bad("score", "the metric is empty"));
                }
                query.scores.push(ScoreRange {
                    metric: metric.to_owned(),
                    min: number("score", min)?,
                    max: number("score", max)?,
                });
            }
            "error_class" => {
                query.error_class =
                    Some(ErrorClass::parse(value).map_err(|err| bad("error_class", err))?);
            }
            "endpoint" => query.endpoint = Some(value.clone()),
            "latency_ms" => query.latency_ms = range("latency_ms", value)?,
            "tokens" => query.completion_tokens = range("tokens", value)?,
            "q" => query.text = Some(value.clone()),
            "sort" => {
                query.sort = match value.as_str() {
                    "seq" => SortKey::Seq,
                    "latency" => SortKey::Latency,
                    "ttft" => SortKey::Ttft,
                    "tpot" => SortKey::Tpot,
                    "tokens" => SortKey::CompletionTokens,
                    "attempts" => SortKey::Attempts,
                    "finished" => SortKey::Finished,
                    other => match other.strip_prefix("score:") {
                        Some(metric) if !metric.is_empty() => SortKey::Score(metric.to_owned()),
                        _ => {
                            return Err(bad(
                                "sort",
                                format!(
                                    "'{other}' is not seq, latency, ttft, tpot, tokens, attempts, finished or score:METRIC"
                                ),
                            ));
                        }
                    },
                }
            }
            "order" => {
                query.descending = match value.as_str() {
                    "asc" => false,
                    "desc" => true,
                    other => return Err(bad("order", format!("'{other}' is not asc or desc"))),
                }
            }
            "after" => query.after = Some(cursor(value)?),
            "limit" => {
                let limit: u32 = number("limit", value)?.unwrap_or(50);
                if !(1..=1000).contains(&limit) {
                    return Err(bad("limit", format!("must be 1 to 1000, got {limit}")));
                }
                query.limit = limit;
            }
            other => return Err(bad(other, "no such parameter")),
        }
    }
    Ok(query)
}

/// A page of the run's items.
#[utoipa::path(
    get,
    path = "/runs/{run_id}/items",
    tag = "items",
    params(("run_id" = String, Path, description = "The run's id"), ItemsParams),
    responses(
        (status = 200, description = "A page of items", body = ItemsPage),
        (status = 400, description = "A parameter is wrong", body = ErrorBody),
        (status = 404, description = "No such run", body = ErrorBody),
    )
)]
pub async fn items(
    State(state): State<Arc<AppState>>,
    Path(run_id): Path<String>,
    Query(pairs): Query<Vec<(String, String)>>,
) -> Result<Json<ItemsPage>, ApiError> {
    let query = query(&pairs)?;
    let page = state
        .with_store(move |store| Ok(store.items(&run_id, &query)?))
        .await?;
    Ok(Json(ItemsPage {
        rows: page.rows,
        next: page.next.map(cursor_text),
    }))
}

/// One item in full: its answer, checking and scores, the judge's details
/// and every attempt.
#[utoipa::path(
    get,
    path = "/runs/{run_id}/items/{item_id}",
    tag = "items",
    params(
        ("run_id" = String, Path, description = "The run's id"),
        ("item_id" = String, Path, description = "The item's id"),
    ),
    responses(
        (status = 200, description = "The item", body = ItemDetail),
        (status = 404, description = "No such run or item", body = ErrorBody),
    )
)]
pub async fn item(
    State(state): State<Arc<AppState>>,
    Path((run_id, item_id)): Path<(String, String)>,
) -> Result<Json<ItemDetail>, ApiError> {
    let templates = state.clone();
    let detail = state
        .with_store(move |store| {
            let record = store.item(&run_id, &item_id)?.ok_or_else(|| {
                ApiError::NotFound(format!("run {run_id} has no item '{item_id}'"))
            })?;
            let (messages, messages_error) = match &record.row.item {
                None => (None, None),
                Some(row) => match templates.render(store, &run_id, row) {
                    Ok(messages) => (Some(messages), None),
                    Err(err) => (None, Some(err)),
                },
            };
            Ok(ItemDetail {
                record,
                messages,
                messages_error,
            })
        })
        .await?;
    Ok(Json(detail))
}

impl AppState {
    /// The messages `run_id`'s templates make of `row`.
    fn render(
        &self,
        store: &mut dyn evalfleet_store::Store,
        run_id: &str,
        row: &serde_json::Value,
    ) -> Result<Vec<MessageBody>, String> {
        let templates = self.templates(store, run_id)?;
        let row = match row {
            serde_json::Value::Object(map) => map.clone(),
            _ => return Err("the stored row is not an object".to_owned()),
        };
        templates
            .render(&row)
            .map(|messages| messages.into_iter().map(MessageBody::from).collect())
    }
}
