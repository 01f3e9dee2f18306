//! What the agent gets when its call fails: OpenAI's error format, with
//! a status its SDK retries on (429, 503) or not (400, 401, 404).

use serde_json::Value;

use evalfleet_fleet::call::Exchange;
use evalfleet_fleet::client::{CallError, Head};

use super::Answer;

/// An error as the agent gets it: OpenAI's format and a status its SDK
/// knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayError {
    pub status: u16,
    /// `error.type`.
    pub kind: &'static str,
    /// `error.code`.
    pub code: &'static str,
    pub message: String,
    /// `Retry-After`, in seconds.
    pub retry_after: Option<u64>,
    /// `x-should-retry`, which OpenAI's SDKs follow.
    pub should_retry: Option<bool>,
}

impl GatewayError {
    pub fn new(status: u16, kind: &'static str, code: &'static str, message: String) -> Self {
        Self {
            status,
            kind,
            code,
            message,
            retry_after: None,
            should_retry: None,
        }
    }

    /// 401: no token, or not a live one.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(
            401,
            "invalid_request_error",
            "invalid_api_key",
            message.into(),
        )
        .final_()
    }

    /// 400: the request cannot be forwarded.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(
            400,
            "invalid_request_error",
            "invalid_request",
            message.into(),
        )
    }

    pub(crate) fn final_(mut self) -> Self {
        self.should_retry = Some(false);
        self
    }

    /// The error body.
    pub fn body(&self) -> Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": null,
                "code": self.code,
            }
        })
    }
}

/// What the agent gets when its call failed before any byte of an answer
/// on every endpoint tried: the endpoint's own error response where it
/// gave one that is the request's fault (4xx), else ours.
pub(crate) fn failure_answer(exchange: &Exchange, failed: Head) -> Answer {
    if let Head::Failed {
        status: Some(status),
        ..
    } = &failed
        && (400..500).contains(status)
        && !matches!(*status, 401 | 403 | 408 | 429)
    {
        return Answer::Head(failed);
    }
    let error = match exchange {
        Exchange::Done {
            result: Err(err), ..
        } => err,
        _ => {
            let mut error = GatewayError::new(
                503,
                "server_error",
                "endpoint_unavailable",
                "The endpoint stopped taking calls.".to_owned(),
            );
            error.retry_after = Some(1);
            return Answer::Error(error);
        }
    };
    let retry_after = error.retry_after().map(|d| d.as_secs().max(1));
    let mut answer = match error {
        CallError::Status {
            status: status @ (401 | 403),
            message,
            ..
        } => GatewayError::new(
            502,
            "server_error",
            "endpoint_refused",
            format!(
                "The endpoint refused evalfleet's request (HTTP {status}: {message}): check the endpoint's api_key."
            ),
        ),
        CallError::Status {
            status: 429,
            message,
            ..
        } => GatewayError::new(
            429,
            "rate_limit_error",
            "rate_limit_exceeded",
            format!("Rate limited by the endpoint: {message}"),
        ),
        CallError::Status {
            status, message, ..
        } => GatewayError::new(
            if *status >= 500 { *status } else { 502 },
            "server_error",
            "upstream_error",
            format!("The endpoint failed: HTTP {status}: {message}"),
        ),
        CallError::Connect(_) => GatewayError::new(
            503,
            "server_error",
            "endpoint_unreachable",
            format!(
                "No endpoint could be reached: {}",
                evalfleet_types::error_text(error)
            ),
        ),
        CallError::Timeout(_) | CallError::FirstByteTimeout(_) => GatewayError::new(
            504,
            "server_error",
            "upstream_timeout",
            format!("The endpoint did not answer in time: {error}"),
        ),
        other => GatewayError::new(
            502,
            "server_error",
            "upstream_error",
            format!(
                "The endpoint's answer was not usable: {}",
                evalfleet_types::error_text(other)
            ),
        ),
    };
    answer.retry_after = retry_after.or((answer.status == 503).then_some(1));
    Answer::Error(answer)
}
