//! The two calls of the Sheets API v4 evalfleet makes: reading a range
//! (`values.get`) and writing many (`values.batchUpdate`), each tried again
//! through the one retry policy on 429, 5xx and failed connections.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use evalfleet_types::RetryPolicy;
use evalfleet_types::retry::Retry;
use serde::Serialize;
use serde_json::Value;

use super::SheetError;
use super::auth::{SCOPE_READ, SCOPE_WRITE, ServiceKey, Tokens};
use super::quota::WriteQuota;
use evalfleet_config::SheetConfig;

/// How long one call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest `Retry-After` heeded.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

/// One range written, as the API takes it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ValueRange {
    pub range: String,
    #[serde(rename = "majorDimension")]
    pub major_dimension: &'static str,
    /// Rows of cells; `null` leaves a cell as it is.
    pub values: Vec<Vec<Value>>,
}

/// A spreadsheet, through the API.
pub struct SheetsApi {
    http: reqwest::Client,
    base: String,
    spreadsheet: String,
    tokens: Tokens,
    policy: RetryPolicy,
    /// `batchUpdate` calls sent, retries included.
    writes: AtomicU64,
    /// What a 429 without a `Retry-After` waits (`quota_wait`).
    quota_wait: Duration,
    /// The account's write quota: every write request takes its turn.
    quota: WriteQuota,
}

/// How a call failed, and whether another try may do better.
struct Failed {
    error: SheetError,
    retry: Retry,
}

impl SheetsApi {
    /// A client of `config`'s spreadsheet, with the key `config.key_env`
    /// names; `write`: it may write (a token of the read-write scope).
    pub fn open(config: &SheetConfig, write: bool) -> Result<Self, SheetError> {
        let key = ServiceKey::from_env(&config.key_env)?;
        let http =
            evalfleet_fleet::client::http_client(4).map_err(|err| SheetError::Transport {
                what: "an HTTP client".to_owned(),
                message: err.to_string(),
                retry: false,
            })?;
        let scope = if write { SCOPE_WRITE } else { SCOPE_READ };
        let quota = WriteQuota::new(&key.client_email, config.writes_per_minute);
        Ok(Self {
            tokens: Tokens::new(key, scope, http.clone()),
            http,
            base: config.api_url.clone(),
            spreadsheet: config.spreadsheet_id.clone(),
            policy: RetryPolicy {
                max_attempts: config.retries + 1,
                backoff_base: config.retry_backoff,
                backoff_max: config.retry_backoff.saturating_mul(64),
            },
            writes: AtomicU64::new(0),
            quota_wait: config.quota_wait,
            quota,
        })
    }

    /// The account's write quota.
    pub fn quota(&self) -> &WriteQuota {
        &self.quota
    }

    /// The service account's email (to share the sheet with).
    pub fn account(&self) -> &str {
        self.tokens.account()
    }

    /// Fetches a token now, so that a key that does not work is said at
    /// once.
    pub async fn ready(&self) -> Result<(), SheetError> {
        self.tokens.get().await.map(drop)
    }

    /// `batchUpdate` calls sent so far, retries included.
    pub fn write_calls(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// The cells of `range` (A1 notation), row by row, trailing empty cells
    /// left out as the API leaves them out. `unformatted`: numbers as
    /// numbers (for comparing with what was written); else as the sheet
    /// shows them.
    pub async fn get(&self, range: &str, unformatted: bool) -> Result<Vec<Vec<Value>>, SheetError> {
        let mut url = self.url(&["values", range])?;
        url.query_pairs_mut()
            .append_pair("majorDimension", "ROWS")
            .append_pair(
                "valueRenderOption",
                if unformatted {
                    "UNFORMATTED_VALUE"
                } else {
                    "FORMATTED_VALUE"
                },
            );
        let what = format!("reading {range}");
        let body = self
            .policy
            .run(
                || self.send(self.http.get(url.clone()), &what),
                |f: &Failed| f.retry,
            )
            .await
            .map_err(|f| f.error)?;
        let answer: Value = serde_json::from_str(&body).map_err(|err| SheetError::Api {
            what: what.clone(),
            status: 200,
            message: format!("the answer is not JSON ({err})"),
        })?;
        match answer.get("values") {
            None => Ok(Vec::new()),
            Some(Value::Array(rows)) => Ok(rows
                .iter()
                .map(|row| row.as_array().cloned().unwrap_or_default())
                .collect()),
            Some(_) => Err(SheetError::Api {
                what,
                status: 200,
                message: "its values are not a list of rows".to_owned(),
            }),
        }
    }

    /// Writes `data` in one `batchUpdate` (values as they are: `RAW`, so
    /// that no answer becomes a formula), tried again as the policy says;
    /// each try waits for its turn at the account's write quota, and a 429
    /// pauses the quota for every writer of the account.
    pub async fn batch_update(&self, data: &[ValueRange]) -> Result<(), SheetError> {
        let url = self.url(&["values:batchUpdate"])?;
        let body = serde_json::to_vec(&serde_json::json!({
            "valueInputOption": "RAW",
            "data": data,
        }))
        .map_err(|err| SheetError::Api {
            what: "a write".to_owned(),
            status: 0,
            message: err.to_string(),
        })?;
        let what = format!("writing {} ranges", data.len());
        self.policy
            .run(
                || async {
                    self.quota.acquire().await;
                    self.writes.fetch_add(1, Ordering::Relaxed);
                    let request = self
                        .http
                        .post(url.clone())
                        .header("content-type", "application/json")
                        .body(body.clone());
                    let sent = self.send(request, &what).await;
                    if let Err(Failed {
                        error: SheetError::Api { status: 429, .. },
                        retry: Retry::After(Some(wait)),
                    }) = &sent
                    {
                        self.quota.rate_limited(*wait);
                    }
                    sent
                },
                |f: &Failed| f.retry,
            )
            .await
            .map(drop)
            .map_err(|f| f.error)
    }

    /// `{base}/v4/spreadsheets/{id}/` and `segments`, each encoded.
    fn url(&self, segments: &[&str]) -> Result<reqwest::Url, SheetError> {
        let mut url = reqwest::Url::parse(&self.base).map_err(|err| SheetError::Transport {
            what: format!("the address {}", self.base),
            message: err.to_string(),
            retry: false,
        })?;
        url.path_segments_mut()
            .map_err(|()| SheetError::Transport {
                what: format!("the address {}", self.base),
                message: "it cannot have a path".to_owned(),
                retry: false,
            })?
            .pop_if_empty()
            .extend(["v4", "spreadsheets", self.spreadsheet.as_str()])
            .extend(segments);
        Ok(url)
    }

    /// One try: the answer's body, or why not and whether to try again.
    async fn send(&self, request: reqwest::RequestBuilder, what: &str) -> Result<String, Failed> {
        let token = self.tokens.get().await.map_err(|error| Failed {
            retry: if error.retries() {
                Retry::After(None)
            } else {
                Retry::Never
            },
            error,
        })?;
        let response = request
            .bearer_auth(token)
            .timeout(CALL_TIMEOUT)
            .send()
            .await
            .map_err(|err| Failed {
                error: SheetError::Transport {
                    what: what.to_owned(),
                    message: super::transport_message(&err),
                    retry: true,
                },
                retry: Retry::After(None),
            })?;
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(|s| Duration::from_secs(s).min(MAX_RETRY_AFTER));
        let body = super::read_limited(response)
            .await
            .map_err(|error| Failed {
                error: SheetError::Api {
                    what: what.to_owned(),
                    status,
                    message: error,
                },
                retry: Retry::Never,
            })?;
        if (200..300).contains(&status) {
            return Ok(body);
        }
        if status == 401 {
            // Revoked or expired early: the next try gets a new token.
            self.tokens.forget().await;
        }
        let retry = match status {
            // Google's write quota is a minute's (60 writes a minute per
            // user, shared by every writer of the account): a 429 without
            // a Retry-After waits out the window, not a backoff's seconds.
            429 => Retry::After(Some(retry_after.unwrap_or(self.quota_wait))),
            401 | 408 | 500..=599 => Retry::After(retry_after),
            _ => Retry::Never,
        };
        Err(Failed {
            error: SheetError::Api {
                what: what.to_owned(),
                status,
                message: google_message(&body),
            },
            retry,
        })
    }
}

/// The message of a Google error body (`{"error": {"message", "status"}}`),
/// or the start of the body.
fn google_message(body: &str) -> String {
    let parsed: Option<Value> = serde_json::from_str(body).ok();
    let error = parsed.as_ref().and_then(|v| v.get("error"));
    match (
        error.and_then(|e| e.get("status")).and_then(Value::as_str),
        error.and_then(|e| e.get("message")).and_then(Value::as_str),
    ) {
        (Some(status), Some(message)) => format!("{status}: {message}"),
        (None, Some(message)) => message.to_owned(),
        _ => body.chars().take(200).collect(),
    }
}
