//! A local stand-in of the Google Sheets API v4 (`values.get` and
//! `values.batchUpdate`) and of Google's OAuth token endpoint (the JWT
//! bearer grant of a service account), for tests and benchmarks of a
//! client. It checks what Google checks (the JWT's signature, issuer,
//! audience, scope and life; bearer tokens; A1 ranges; the grid's limits),
//! answers in Google's shapes, and records what it was sent: every write
//! call, how often each cell was written, and every credential and body
//! (so a test can show the private key never left the client).
//!
//! Routes: `POST /token`, `GET /v4/spreadsheets/{id}/values/{range}`,
//! `POST /v4/spreadsheets/{id}/values:batchUpdate`, and `GET
//! /_standin/stats` (the records, as JSON, for a benchmark's process).

mod a1;
mod jwt;
mod values;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::time::Instant;

pub use jwt::Trusted;
pub use values::user_entered;

use a1::{Area, Bounds};

/// The largest request body taken; larger ones get 413.
const MAX_BODY: usize = 10 << 20;
/// The audiences Google's token endpoint takes besides its own URL.
const GOOGLE_TOKEN_AUDIENCES: [&str; 3] = [
    "https://oauth2.googleapis.com/token",
    "https://www.googleapis.com/oauth2/v4/token",
    "https://accounts.google.com/o/oauth2/token",
];
/// How long an access token lives, as Google says in `expires_in`.
const TOKEN_LIFE_S: u64 = 3599;
/// A new tab's grid, as Sheets makes it: 1000 rows of columns A to Z (more
/// when its data needs more).
const GRID_ROWS: u32 = 1000;
const GRID_COLS: u32 = 26;

/// One `values:batchUpdate` call, as received.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteCall {
    /// When it arrived, in milliseconds since the stand-in was made.
    pub at_ms: u64,
    /// The status it was answered with.
    pub status: u16,
    /// The ranges of its `data`, as written (empty when the body could not
    /// be read).
    pub ranges: Vec<String>,
    /// Rows of values in it, over all ranges.
    pub rows: usize,
    /// Non-null cells in it, over all ranges.
    pub cells: usize,
}

/// What `GET /_standin/stats` answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StandInStats {
    pub writes: Vec<WriteCall>,
    /// Cell writes applied by successful calls, a cell written twice
    /// counting twice.
    pub cell_writes_total: u64,
    /// Cells written by more than one successful call (or twice in one).
    pub cells_written_twice: u64,
    pub tokens_issued: usize,
}

/// The stand-in: cheap to clone, every clone sharing one state.
#[derive(Clone)]
pub struct StandIn {
    inner: Arc<Inner>,
}

struct Inner {
    trusted: Trusted,
    started: Instant,
    state: Mutex<SheetsState>,
}

#[derive(Default)]
struct SheetsState {
    spreadsheets: HashMap<String, Vec<Tab>>,
    /// Access tokens: until when each lives, whether it may write, and
    /// the account it was issued to.
    tokens: HashMap<String, (Instant, bool, String)>,
    tokens_issued: usize,
    token_refusals: Vec<String>,
    fail_next: VecDeque<u16>,
    fail_always: Option<u16>,
    /// Every `n`th write call since it was set fails with the status.
    fail_every: Option<FailEvery>,
    /// Write calls an account may make in a window, as
    /// [`StandIn::write_quota`] sets it.
    write_quota: Option<(usize, Duration)>,
    /// When each account's write calls within the quota's window came.
    quota_used: HashMap<String, VecDeque<Instant>>,
    writes: Vec<WriteCall>,
    cell_writes: BTreeMap<(String, u32, u32), u32>,
    seen: String,
    /// Where `serve` listens: the token endpoint's own address is a valid
    /// audience whatever `Host` says.
    local: Option<SocketAddr>,
}

/// [`StandIn::fail_every`]'s setting, and the write calls counted since.
#[derive(Clone, Copy)]
struct FailEvery {
    every: u64,
    status: u16,
    seen: u64,
}

/// One tab: its cells (row-major from A1; `Null` is empty) and its grid.
struct Tab {
    name: String,
    cells: Vec<Vec<Value>>,
    rows: u32,
    cols: u32,
}

impl StandIn {
    /// A stand-in with no spreadsheets that trusts `trusted`'s key.
    pub fn new(trusted: Trusted) -> Self {
        Self {
            inner: Arc::new(Inner {
                trusted,
                started: Instant::now(),
                state: Mutex::new(SheetsState::default()),
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, SheetsState> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The routes, for a caller that serves them itself.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/token", post(token))
            .route("/_standin/stats", get(stats))
            .fallback(values_api)
            .with_state(self.clone())
    }

    /// Serves on `listener` until the future is dropped.
    pub async fn serve(self, listener: TcpListener) -> io::Result<()> {
        self.state().local = listener.local_addr().ok();
        axum::serve(listener, self.router()).await
    }

    /// Sets a tab's cells, row-major from A1, replacing the tab (its place
    /// among the tabs is kept). Creates the spreadsheet if it is new. A
    /// `Null` or `""` cell is empty.
    pub fn put_tab(&self, spreadsheet_id: &str, tab: &str, rows: Vec<Vec<Value>>) {
        let cells: Vec<Vec<Value>> = rows
            .into_iter()
            .map(|row| row.into_iter().map(values::stored).collect())
            .collect();
        let width = cells.iter().map(Vec::len).max().unwrap_or(0);
        let new = Tab {
            name: tab.to_owned(),
            rows: u32::try_from(cells.len())
                .unwrap_or(u32::MAX)
                .max(GRID_ROWS),
            cols: u32::try_from(width).unwrap_or(u32::MAX).max(GRID_COLS),
            cells,
        };
        let mut state = self.state();
        let tabs = state
            .spreadsheets
            .entry(spreadsheet_id.to_owned())
            .or_default();
        match tabs.iter_mut().find(|t| t.name == tab) {
            Some(old) => *old = new,
            None => tabs.push(new),
        }
    }

    /// The tab's cells as stored (values as written: numbers stay numbers),
    /// trailing empties of each row and trailing empty rows trimmed; an
    /// empty cell before others is `""`, as a read shows it. Empty when the
    /// tab does not exist.
    pub fn tab(&self, spreadsheet_id: &str, tab: &str) -> Vec<Vec<Value>> {
        let state = self.state();
        let Some(tab) = state
            .spreadsheets
            .get(spreadsheet_id)
            .and_then(|tabs| tabs.iter().find(|t| t.name == tab))
        else {
            return Vec::new();
        };
        let bounds = Bounds {
            first_row: 1,
            first_col: 1,
            last_row: tab.rows,
            last_col: tab.cols,
        };
        values::read(&tab.cells, bounds, |v| {
            if v.is_null() {
                Value::String(String::new())
            } else {
                v.clone()
            }
        })
    }

    /// The next write calls answer these statuses, one each, in order,
    /// applying nothing.
    pub fn fail_next(&self, statuses: &[u16]) {
        self.state().fail_next.extend(statuses.iter().copied());
    }

    /// Every write call from now on answers `status` (`None`: back to
    /// normal). Calls queued by [`StandIn::fail_next`] come first.
    pub fn fail_always(&self, status: Option<u16>) {
        self.state().fail_always = status;
    }

    /// Every `every`th write call from now on (counting calls that passed
    /// the token check) answers `status`; `every` 0 turns it off.
    pub fn fail_every(&self, every: u64, status: u16) {
        self.state().fail_every = (every > 0).then_some(FailEvery {
            every,
            status,
            seen: 0,
        });
    }

    /// At most `limit` write calls of one account (a service account's
    /// tokens, whatever spreadsheet they write) in any `window`; the calls
    /// past it answer 429 and apply nothing, as Google's "write requests
    /// per minute per user" do (60 in a minute): without a `Retry-After`,
    /// and without counting against the quota. `None`: no quota (the
    /// default).
    pub fn write_quota(&self, quota: Option<(usize, Duration)>) {
        let mut state = self.state();
        state.write_quota = quota;
        state.quota_used.clear();
    }

    /// Every write call received, in order.
    pub fn writes(&self) -> Vec<WriteCall> {
        self.state().writes.clone()
    }

    /// How many times each cell was written by a write call that
    /// succeeded: (tab, row from 1, column from 1) -> count. A `null` in a
    /// call writes nothing; `""` counts (it clears the cell).
    pub fn cell_writes(&self) -> BTreeMap<(String, u32, u32), u32> {
        self.state().cell_writes.clone()
    }

    /// Access tokens issued.
    pub fn tokens_issued(&self) -> usize {
        self.state().tokens_issued
    }

    /// Token requests refused, each with the reason.
    pub fn token_refusals(&self) -> Vec<String> {
        self.state().token_refusals.clone()
    }

    /// Makes every access token issued so far expired, as an hour's wait
    /// would: the next call with one gets 401.
    pub fn expire_tokens(&self) {
        let now = Instant::now();
        for (expiry, _, _) in self.state().tokens.values_mut() {
            *expiry = now;
        }
    }

    /// Every value of an `Authorization` header and every request body
    /// received, one after the other.
    pub fn seen_text(&self) -> String {
        self.state().seen.clone()
    }

    /// The records, as `GET /_standin/stats` answers them.
    pub fn stats(&self) -> StandInStats {
        let state = self.state();
        StandInStats {
            writes: state.writes.clone(),
            cell_writes_total: state.cell_writes.values().map(|&n| u64::from(n)).sum(),
            cells_written_twice: state.cell_writes.values().filter(|&&n| n > 1).count() as u64,
            tokens_issued: state.tokens_issued,
        }
    }

    /// Whether `account` may make a write call now; one that may is
    /// counted.
    fn within_quota(&self, account: &str) -> bool {
        let mut state = self.state();
        let Some((limit, window)) = state.write_quota else {
            return true;
        };
        let now = Instant::now();
        let used = state.quota_used.entry(account.to_owned()).or_default();
        while used
            .front()
            .is_some_and(|at| now.duration_since(*at) >= window)
        {
            used.pop_front();
        }
        if used.len() >= limit {
            return false;
        }
        used.push_back(now);
        true
    }

    fn since_start_ms(&self) -> u64 {
        u64::try_from(self.inner.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Reads the body (at most [`MAX_BODY`]) and records it and the
    /// `Authorization` header in `seen`.
    async fn take_body(&self, headers: &HeaderMap, body: Body) -> Result<Vec<u8>, Response> {
        let bytes = axum::body::to_bytes(body, MAX_BODY).await;
        let mut state = self.state();
        for auth in headers.get_all(header::AUTHORIZATION) {
            state
                .seen
                .push_str(&String::from_utf8_lossy(auth.as_bytes()));
            state.seen.push('\n');
        }
        match bytes {
            Ok(bytes) => {
                state.seen.push_str(&String::from_utf8_lossy(&bytes));
                state.seen.push('\n');
                Ok(bytes.to_vec())
            }
            Err(e) => {
                drop(state);
                let too_large = std::error::Error::source(&e)
                    .is_some_and(|s| s.to_string().contains("length limit"))
                    || e.to_string().contains("length limit");
                Err(if too_large {
                    google_error(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        &format!("Request payload size exceeds the limit: {MAX_BODY} bytes."),
                    )
                } else {
                    google_error(
                        StatusCode::BAD_REQUEST,
                        &format!("The request body could not be read: {e}"),
                    )
                })
            }
        }
    }

    /// The account whose live access token the request carries (of the
    /// read-write scope when it `writes`); `Err` is the 401 (or 403) to
    /// answer.
    fn authorise(&self, headers: &HeaderMap, writes: bool) -> Result<String, Unauthenticated> {
        let token = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim());
        let refusal = match token {
            None => {
                "Request is missing required authentication credential. Expected OAuth 2 \
                     access token, login cookie or other valid authentication credential."
            }
            Some(token) => match self.state().tokens.get(token) {
                Some((expiry, may_write, account)) if *expiry > Instant::now() => {
                    if writes && !may_write {
                        return Err(Unauthenticated::Scope);
                    }
                    return Ok(account.clone());
                }
                Some(_) => {
                    "Request had invalid authentication credentials. The access token has expired."
                }
                None => {
                    "Request had invalid authentication credentials. Expected OAuth 2 \
                         access token, login cookie or other valid authentication credential."
                }
            },
        };
        Err(Unauthenticated::Token(refusal))
    }
}

/// A request without a live access token, and why; or with a token that
/// may only read, for a write.
enum Unauthenticated {
    Token(&'static str),
    Scope,
}

impl IntoResponse for Unauthenticated {
    fn into_response(self) -> Response {
        let why = match self {
            Self::Token(why) => why,
            Self::Scope => {
                return google_error(
                    StatusCode::FORBIDDEN,
                    "Request had insufficient authentication scopes.",
                );
            }
        };
        let mut response = google_error(StatusCode::UNAUTHORIZED, why);
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer realm=\"https://accounts.google.com/\""),
        );
        response
    }
}

/// An error in Google's shape: `{"error": {"code", "message", "status"}}`.
fn google_error(status: StatusCode, message: &str) -> Response {
    let name = match status.as_u16() {
        400 | 413 => "INVALID_ARGUMENT",
        401 => "UNAUTHENTICATED",
        403 => "PERMISSION_DENIED",
        404 => "NOT_FOUND",
        409 => "ABORTED",
        429 => "RESOURCE_EXHAUSTED",
        501 => "UNIMPLEMENTED",
        503 => "UNAVAILABLE",
        504 => "DEADLINE_EXCEEDED",
        _ => "INTERNAL",
    };
    let body = json!({"error": {"code": status.as_u16(), "message": message, "status": name}});
    (
        status,
        [(header::CONTENT_TYPE, "application/json; charset=UTF-8")],
        body.to_string(),
    )
        .into_response()
}

/// What Google answers for a spreadsheet id it does not know.
fn no_spreadsheet() -> Response {
    google_error(StatusCode::NOT_FOUND, "Requested entity was not found.")
}

/// The message Google sends with a status injected by `fail_*`.
fn injected_message(status: u16) -> &'static str {
    match status {
        429 => {
            "Quota exceeded for quota metric 'Write requests' and limit 'Write requests per minute \
             per user' of service 'sheets.googleapis.com'."
        }
        400 => "Invalid requests: injected by the stand-in.",
        401 => "Request had invalid authentication credentials.",
        403 => "The caller does not have permission",
        503 => "The service is currently unavailable.",
        _ => "Internal error encountered.",
    }
}

fn json_response(status: StatusCode, body: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json; charset=UTF-8")],
        body.to_string(),
    )
        .into_response()
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// `GET /_standin/stats`.
async fn stats(State(standin): State<StandIn>) -> Response {
    json_response(StatusCode::OK, &json!(standin.stats()))
}

/// `POST /token`: the JWT bearer grant.
async fn token(State(standin): State<StandIn>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let body = match standin.take_body(&parts.headers, body).await {
        Ok(body) => body,
        Err(response) => return response,
    };
    let form = values::form(&String::from_utf8_lossy(&body));
    let field = |name: &str| {
        form.iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    let refuse = |error: &str, why: String| {
        standin.state().token_refusals.push(why.clone());
        json_response(
            StatusCode::BAD_REQUEST,
            &json!({"error": error, "error_description": why}),
        )
    };
    match field("grant_type") {
        Some("urn:ietf:params:oauth:grant-type:jwt-bearer") => {}
        other => {
            return refuse(
                "unsupported_grant_type",
                format!("Invalid grant_type: {}", other.unwrap_or("")),
            );
        }
    }
    let Some(assertion) = field("assertion").filter(|a| !a.is_empty()) else {
        return refuse(
            "invalid_request",
            "Missing required parameter: assertion".to_owned(),
        );
    };
    let host = parts
        .headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(str::to_owned);
    let local = standin.state().local;
    let audience_ok = |aud: &str| {
        // Google's endpoint takes its own addresses as the audience,
        // whatever `token_uri` says: google-auth always names the first.
        if GOOGLE_TOKEN_AUDIENCES.contains(&aud) {
            return true;
        }
        let Some(rest) = aud
            .strip_prefix("http://")
            .or_else(|| aud.strip_prefix("https://"))
        else {
            return false;
        };
        let Some((authority, "token")) = rest.split_once('/') else {
            return false;
        };
        host.as_deref()
            .is_some_and(|h| h.eq_ignore_ascii_case(authority))
            || local.is_some_and(|l| l.to_string() == authority)
    };
    let writes = match jwt::check(assertion, &standin.inner.trusted, unix_now(), audience_ok) {
        Ok(writes) => writes,
        Err(why) => return refuse("invalid_grant", why),
    };
    let mut bytes = [0u8; 32];
    if ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes).is_err() {
        return google_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "No randomness for a token.",
        );
    }
    let access_token = format!("ya29.standin-{}", hex::encode(bytes));
    let mut state = standin.state();
    let account = standin.inner.trusted.client_email.clone();
    state.tokens.insert(
        access_token.clone(),
        (
            Instant::now() + Duration::from_secs(TOKEN_LIFE_S),
            writes,
            account,
        ),
    );
    state.tokens_issued += 1;
    drop(state);
    json_response(
        StatusCode::OK,
        &json!({"access_token": access_token, "expires_in": TOKEN_LIFE_S, "token_type": "Bearer"}),
    )
}

/// What a path under `/v4/spreadsheets/{id}/` asks for.
enum Call {
    Get { id: String, range: String },
    BatchUpdate { id: String },
}

/// Reads `/v4/spreadsheets/{id}/values/{range}` and
/// `/v4/spreadsheets/{id}/values:batchUpdate` (segments percent-decoded, so
/// `values%3AbatchUpdate` is the same).
fn route(method: &Method, path: &str) -> Option<Call> {
    let mut segments = path.strip_prefix("/v4/spreadsheets/")?.split('/');
    let id = values::percent_decode(segments.next()?)?;
    if id.is_empty() {
        return None;
    }
    let what = values::percent_decode(segments.next()?)?;
    let range = segments.next().map(values::percent_decode);
    if segments.next().is_some() {
        return None;
    }
    match (what.as_str(), range, method) {
        ("values", Some(Some(range)), &Method::GET) => Some(Call::Get { id, range }),
        ("values:batchUpdate", None, &Method::POST) => Some(Call::BatchUpdate { id }),
        _ => None,
    }
}

/// Every request that is not `/token` or the stats.
async fn values_api(State(standin): State<StandIn>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let body = match standin.take_body(&parts.headers, body).await {
        Ok(body) => body,
        Err(response) => return response,
    };
    match route(&parts.method, parts.uri.path()) {
        Some(Call::Get { id, range }) => {
            if let Err(refusal) = standin.authorise(&parts.headers, false) {
                return refusal.into_response();
            }
            get_values(&standin, &id, &range, parts.uri.query().unwrap_or(""))
        }
        Some(Call::BatchUpdate { id }) => {
            let at_ms = standin.since_start_ms();
            let (response, record) = match standin.authorise(&parts.headers, true) {
                Err(refusal) => (refusal.into_response(), values::summary(&body)),
                Ok(account) if !standin.within_quota(&account) => (
                    google_error(StatusCode::TOO_MANY_REQUESTS, injected_message(429)),
                    values::summary(&body),
                ),
                Ok(_) => batch_update(&standin, &id, &body),
            };
            let (ranges, rows, cells) = record;
            standin.state().writes.push(WriteCall {
                at_ms,
                status: response.status().as_u16(),
                ranges,
                rows,
                cells,
            });
            response
        }
        None => google_error(
            StatusCode::NOT_FOUND,
            &format!(
                "{} {} is not a method of this API.",
                parts.method,
                parts.uri.path()
            ),
        ),
    }
}

/// `values.get`.
fn get_values(standin: &StandIn, id: &str, range: &str, query: &str) -> Response {
    let mut render = values::Render::Formatted;
    let mut columns = false;
    for (key, value) in values::form(query) {
        match (key.as_str(), value.as_str()) {
            ("valueRenderOption", "FORMATTED_VALUE") => render = values::Render::Formatted,
            ("valueRenderOption", "UNFORMATTED_VALUE") => render = values::Render::Unformatted,
            // Formulas are stored as the text they are.
            ("valueRenderOption", "FORMULA") => render = values::Render::Unformatted,
            ("majorDimension", "ROWS" | "DIMENSION_UNSPECIFIED") => columns = false,
            ("majorDimension", "COLUMNS") => columns = true,
            ("dateTimeRenderOption", "SERIAL_NUMBER" | "FORMATTED_STRING")
            | ("alt", "json")
            | ("prettyPrint" | "fields" | "key" | "quotaUser" | "$.xgafv", _) => {}
            (
                key @ ("valueRenderOption" | "majorDimension" | "dateTimeRenderOption" | "alt"),
                value,
            ) => {
                return google_error(
                    StatusCode::BAD_REQUEST,
                    &format!("Invalid value at '{key}' ({value:?})"),
                );
            }
            (key, _) => {
                return google_error(
                    StatusCode::BAD_REQUEST,
                    &format!(
                        "Invalid JSON payload received. Unknown name \"{key}\": Cannot bind query parameter."
                    ),
                );
            }
        }
    }
    let state = standin.state();
    let Some(tabs) = state.spreadsheets.get(id) else {
        return no_spreadsheet();
    };
    let (tab, bounds) = match resolve(tabs, range) {
        Ok((index, _, bounds)) => (&tabs[index], bounds),
        Err(message) => return google_error(StatusCode::BAD_REQUEST, &message),
    };
    let mut rows = values::read(&tab.cells, bounds, |v| values::render(v, render));
    if columns {
        rows = values::transpose(&rows, &Value::String(String::new()));
    }
    let mut body = json!({
        "range": a1::format(&tab.name, bounds),
        "majorDimension": if columns { "COLUMNS" } else { "ROWS" },
    });
    if !rows.is_empty() {
        body["values"] = json!(rows);
    }
    json_response(StatusCode::OK, &body)
}

/// The tab and cells `range` names, within the tab's grid; `Err` is the
/// message of a 400.
fn resolve(tabs: &[Tab], range: &str) -> Result<(usize, Area, Bounds), String> {
    let unparsable = || format!("Unable to parse range: {range}");
    let parsed = a1::parse(range).ok_or_else(unparsable)?;
    let (index, area) = match tabs.iter().position(|t| t.name == parsed.tab) {
        Some(index) => (index, parsed.area),
        None => match parsed.or_first_tab {
            Some(area) if !tabs.is_empty() => (0, area),
            _ => return Err(unparsable()),
        },
    };
    let tab = &tabs[index];
    let bounds = area
        .bounds(tab.rows, tab.cols)
        .ok_or_else(|| exceeds_grid(range, tab))?;
    Ok((index, area, bounds))
}

/// The message of a range that reaches past its tab's grid.
fn exceeds_grid(range: &str, tab: &Tab) -> String {
    format!(
        "Range ({range}) exceeds grid limits. Max rows: {}, max columns: {}",
        tab.rows, tab.cols
    )
}

/// `values.batchUpdate`'s body.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct BatchUpdate {
    value_input_option: Option<String>,
    #[serde(default)]
    data: Vec<ValueRange>,
    #[serde(default)]
    include_values_in_response: bool,
    #[allow(dead_code)] // accepted, as Google accepts it; nothing to render
    response_value_render_option: Option<String>,
    #[allow(dead_code)]
    response_date_time_render_option: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ValueRange {
    range: String,
    major_dimension: Option<String>,
    #[serde(default)]
    values: Vec<Vec<Value>>,
}

/// One range of a batch, checked: where its cells go.
struct Planned {
    tab: usize,
    tab_name: String,
    origin: (u32, u32),
    rows: Vec<Vec<Value>>,
}

/// `values.batchUpdate`: the response, and what the call carried (ranges,
/// rows, non-null cells) for its record.
fn batch_update(
    standin: &StandIn,
    id: &str,
    body: &[u8],
) -> (Response, (Vec<String>, usize, usize)) {
    let record = values::summary(body);
    let fail = |status: u16| {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        google_error(status, injected_message(status.as_u16()))
    };
    let mut state = standin.state();
    let every = state.fail_every.as_mut().and_then(|f| {
        f.seen += 1;
        f.seen.is_multiple_of(f.every).then_some(f.status)
    });
    let injected = state.fail_next.pop_front().or(state.fail_always).or(every);
    if let Some(status) = injected {
        return (fail(status), record);
    }
    let request: BatchUpdate = match serde_json::from_slice(body) {
        Ok(request) => request,
        Err(e) => {
            return (
                google_error(
                    StatusCode::BAD_REQUEST,
                    &format!("Invalid JSON payload received. {e}"),
                ),
                record,
            );
        }
    };
    let user_entered = match request.value_input_option.as_deref() {
        Some("RAW") => false,
        Some("USER_ENTERED") => true,
        other => {
            return (
                google_error(
                    StatusCode::BAD_REQUEST,
                    &format!(
                        "Invalid valueInputOption: {other:?}; it must be RAW or USER_ENTERED."
                    ),
                ),
                record,
            );
        }
    };
    let Some(tabs) = state.spreadsheets.get(id) else {
        return (no_spreadsheet(), record);
    };
    // Every range is checked before any cell changes: a batch is applied
    // whole or not at all.
    let mut plan = Vec::with_capacity(request.data.len());
    for (i, data) in request.data.into_iter().enumerate() {
        match plan_range(tabs, i, data, user_entered) {
            Ok(planned) => plan.push(planned),
            Err(message) => return (google_error(StatusCode::BAD_REQUEST, &message), record),
        }
    }
    let mut responses = Vec::with_capacity(plan.len());
    let mut totals = (0u64, 0u64, 0u64);
    let mut sheets_touched = std::collections::BTreeSet::new();
    let SheetsState {
        spreadsheets,
        cell_writes,
        ..
    } = &mut *state;
    let Some(tabs) = spreadsheets.get_mut(id) else {
        return (no_spreadsheet(), record);
    };
    for planned in plan {
        let Some(tab) = tabs.get_mut(planned.tab) else {
            continue;
        };
        let written = values::write(&mut tab.cells, planned.origin, &planned.rows);
        for &(row, col) in &written.cells {
            *cell_writes
                .entry((planned.tab_name.clone(), row, col))
                .or_insert(0) += 1;
        }
        let (r0, c0) = planned.origin;
        let height = planned.rows.len() as u32;
        let width = planned.rows.iter().map(Vec::len).max().unwrap_or(0) as u32;
        let mut response = json!({"spreadsheetId": id});
        if height > 0 && width > 0 {
            let bounds = Bounds {
                first_row: r0,
                first_col: c0,
                last_row: r0 + height - 1,
                last_col: c0 + width - 1,
            };
            response["updatedRange"] = json!(a1::format(&planned.tab_name, bounds));
        } else {
            response["updatedRange"] = json!(a1::format(
                &planned.tab_name,
                Bounds {
                    first_row: r0,
                    first_col: c0,
                    last_row: r0,
                    last_col: c0
                }
            ));
        }
        let counts = [
            ("updatedRows", written.rows),
            ("updatedColumns", written.cols),
            ("updatedCells", written.cells.len() as u64),
        ];
        for (name, n) in counts {
            if n > 0 {
                response[name] = json!(n);
            }
        }
        if request.include_values_in_response {
            response["updatedData"] = json!({
                "range": response["updatedRange"].clone(),
                "majorDimension": "ROWS",
                "values": planned.rows,
            });
        }
        totals.0 += written.rows;
        totals.1 += written.cols;
        totals.2 += written.cells.len() as u64;
        if !written.cells.is_empty() {
            sheets_touched.insert(planned.tab);
        }
        responses.push(response);
    }
    drop(state);
    let mut body = json!({"spreadsheetId": id});
    let counts = [
        ("totalUpdatedRows", totals.0),
        ("totalUpdatedColumns", totals.1),
        ("totalUpdatedCells", totals.2),
        ("totalUpdatedSheets", sheets_touched.len() as u64),
    ];
    for (name, n) in counts {
        if n > 0 {
            body[name] = json!(n);
        }
    }
    if !responses.is_empty() {
        body["responses"] = json!(responses);
    }
    (json_response(StatusCode::OK, &body), record)
}

/// Checks one range of a batch: its tab exists, its values fit in the
/// range and in the tab's grid, and each value is a scalar.
fn plan_range(tabs: &[Tab], i: usize, data: ValueRange, typed: bool) -> Result<Planned, String> {
    let columns = match data.major_dimension.as_deref() {
        None | Some("ROWS" | "DIMENSION_UNSPECIFIED") => false,
        Some("COLUMNS") => true,
        Some(other) => {
            return Err(format!(
                "Invalid value at 'data[{i}].major_dimension' ({other:?})"
            ));
        }
    };
    let range = data.range.as_str();
    let (index, area, _) = resolve(tabs, range)?;
    let tab = &tabs[index];
    let mut rows = data.values;
    if columns {
        rows = values::transpose(&rows, &Value::Null);
    }
    for (r, row) in rows.iter_mut().enumerate() {
        for (c, cell) in row.iter_mut().enumerate() {
            if cell.is_array() || cell.is_object() {
                return Err(format!(
                    "Invalid data[{i}]: values[{r}][{c}] is {cell}, not a number, string or boolean."
                ));
            }
            if typed && let Value::String(text) = cell {
                *cell = user_entered(text);
            }
        }
    }
    let (r0, c0) = area.origin();
    let height = rows.len() as u64;
    let width = rows.iter().map(Vec::len).max().unwrap_or(0) as u64;
    let (max_rows, max_cols) = area.write_limit();
    if let Some(max) = max_rows
        && height > u64::from(max)
    {
        return Err(format!(
            "Requested writing within range [{range}], but tried writing to row [{}]",
            u64::from(r0) + height - 1
        ));
    }
    if let Some(max) = max_cols
        && width > u64::from(max)
    {
        return Err(format!(
            "Requested writing within range [{range}], but tried writing to column [{}]",
            a1::column_letters((u64::from(c0) + width - 1).min(u64::from(u32::MAX)) as u32)
        ));
    }
    let last_row = u64::from(r0) + height.max(1) - 1;
    let last_col = u64::from(c0) + width.max(1) - 1;
    if area == Area::Whole && height == 0 {
        // Nothing to write; the range only has to exist.
    } else if last_row > u64::from(tab.rows) || last_col > u64::from(tab.cols) {
        return Err(exceeds_grid(range, tab));
    }
    Ok(Planned {
        tab: index,
        tab_name: tab.name.clone(),
        origin: (r0, c0),
        rows,
    })
}
