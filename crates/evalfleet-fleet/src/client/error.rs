//! Why a call failed, as a class that retry and concurrency logic read
//! (never the message), and the error bodies and transport failures it is
//! made of.

use std::time::Duration;

use evalfleet_types::ErrorClass;
use futures_util::StreamExt;
use serde_json::Value;

use super::headers::retry_after;
use super::http::SendError;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("cannot connect: {0}")]
    Connect(#[source] Unanswered),
    #[error("no answer within {}", humantime::format_duration(*.0))]
    Timeout(Duration),
    #[error("HTTP {status}: {message}")]
    Status {
        status: u16,
        message: String,
        retry_after: Option<Duration>,
    },
    #[error("the connection failed: {0}")]
    Transport(#[source] Unanswered),
    #[error("bad response: {0}")]
    BadResponse(String),
    #[error("the response ended before the answer was complete")]
    Truncated,
    /// The stream ended cleanly (`[DONE]`, or the body was whole) but no
    /// choice said why it finished: by the OpenAI contract every choice
    /// ends with a `finish_reason`, so the answer is incomplete (servers
    /// that cut a running stream when another request arrives do this).
    #[error("the answer ended without a finish_reason (cut off by the server)")]
    Unfinished,
    /// The stream said why it finished, then closed without `data:
    /// [DONE]`: it was cut before its end (its usage chunk, if asked for,
    /// never came), or the server never ends its streams so.
    #[error(
        "the stream closed without data: [DONE] after its finish_reason (cut short; a server that never sends [DONE] needs task.stream: false)"
    )]
    Unended,
    #[error("no first byte of the answer within {}", humantime::format_duration(*.0))]
    FirstByteTimeout(Duration),
    #[error("the stream sent nothing for {}", humantime::format_duration(*.0))]
    Stalled(Duration),
}

impl CallError {
    pub fn class(&self) -> ErrorClass {
        match self {
            Self::Connect(_) | Self::Transport(_) => ErrorClass::Retryable,
            Self::Timeout(_) => ErrorClass::BackPressure,
            Self::Status { status, .. } => match *status {
                408 | 429 | 503 => ErrorClass::BackPressure,
                400..=499 => ErrorClass::Fatal,
                _ => ErrorClass::Retryable,
            },
            Self::BadResponse(_) | Self::Truncated | Self::Unfinished | Self::Unended => {
                ErrorClass::BadResponse
            }
            Self::FirstByteTimeout(_) => ErrorClass::FirstByteTimeout,
            Self::Stalled(_) => ErrorClass::Stalled,
        }
    }

    /// How long the endpoint asked us to wait (`Retry-After`, `retry-after-ms`).
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    /// The same error without anything the endpoint wrote: an error
    /// answer by its status and reason phrase, a bad response by what was
    /// wrong, not what it held (a parser's message quotes the values it
    /// met). For endpoints whose replies are not the reader's to see.
    #[must_use]
    pub fn quieted(self) -> Self {
        match self {
            Self::Status {
                status,
                retry_after,
                ..
            } => {
                let reason = reqwest::StatusCode::from_u16(status)
                    .ok()
                    .and_then(|s| s.canonical_reason())
                    .unwrap_or("error");
                Self::Status {
                    status,
                    message: format!("{reason} (the endpoint's message is not shown)"),
                    retry_after,
                }
            }
            Self::BadResponse(message) => {
                let what = message
                    .split_once(": ")
                    .map_or(message.as_str(), |(what, _)| what);
                let what: String = what.chars().take(60).collect();
                Self::BadResponse(format!("{what} (the endpoint's message is not shown)"))
            }
            other => other,
        }
    }

    /// A connection this process could not open for want of files (see
    /// [`Unanswered::out_of_files`]).
    pub fn out_of_files(&self) -> bool {
        matches!(self, Self::Connect(unanswered) if unanswered.out_of_files())
    }

    pub fn http_status(&self) -> Option<u16> {
        match self {
            Self::Status { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// A request that got no HTTP answer, told by its innermost cause
/// ("Connection refused (os error 111)", "connection closed before message
/// completed", "Connection reset by peer (os error 104)", a DNS or TLS
/// failure), which is also its source: the HTTP client's wrappers around
/// it ("error sending request for url (...)", "client error
/// (SendRequest)") say nothing of why, and the URL they show may carry a
/// key in its query.
#[derive(Debug)]
pub struct Unanswered {
    error: Box<dyn std::error::Error + Send + Sync>,
    url: Option<reqwest::Url>,
}

impl Unanswered {
    pub(crate) fn new(
        error: Box<dyn std::error::Error + Send + Sync>,
        url: Option<reqwest::Url>,
    ) -> Self {
        Self { error, url }
    }

    /// Whether this process had no open file left for the connection
    /// (EMFILE, ENFILE): its own fault, not the endpoint's.
    pub fn out_of_files(&self) -> bool {
        out_of_files(&*self.error)
    }

    /// The URL the request went to.
    pub fn url(&self) -> Option<&reqwest::Url> {
        self.url.as_ref()
    }

    /// The innermost error under the client's.
    fn cause(&self) -> Option<&(dyn std::error::Error + 'static)> {
        let mut cause = self.error.source()?;
        while let Some(inner) = cause.source() {
            cause = inner;
        }
        Some(cause)
    }
}

/// Whether `err`, or an error under it, is EMFILE or ENFILE (an
/// `io::Error` that wraps another is looked into as well: its `source`
/// skips what it wraps).
fn out_of_files(err: &(dyn std::error::Error + 'static)) -> bool {
    if let Some(io) = err.downcast_ref::<std::io::Error>() {
        let code = io.raw_os_error();
        if [rustix::io::Errno::MFILE, rustix::io::Errno::NFILE]
            .iter()
            .any(|errno| Some(errno.raw_os_error()) == code)
        {
            return true;
        }
        if let Some(inner) = io.get_ref()
            && out_of_files(inner)
        {
            return true;
        }
    }
    err.source().is_some_and(out_of_files)
}

impl std::fmt::Display for Unanswered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.cause() {
            Some(cause) => std::fmt::Display::fmt(cause, f),
            None => std::fmt::Display::fmt(&self.error, f),
        }
    }
}

impl std::error::Error for Unanswered {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause()
    }
}

/// Bodies of error responses are read up to this size for their message.
pub(crate) const ERROR_BODY_LIMIT: usize = 8 * 1024;

pub(crate) fn request_error(err: SendError) -> CallError {
    let connect = err.is_connect();
    let unanswered = match err {
        SendError::Reqwest(err) => {
            let url = err.url().cloned();
            Unanswered::new(Box::new(err), url)
        }
        SendError::Direct(err, url) => Unanswered::new(Box::new(err), Some(url)),
    };
    if connect {
        CallError::Connect(unanswered)
    } else {
        CallError::Transport(unanswered)
    }
}

pub(crate) fn body_error(err: reqwest::Error) -> CallError {
    if err.is_decode() {
        CallError::BadResponse(err.to_string())
    } else {
        CallError::Truncated
    }
}

pub(super) async fn status_error(response: reqwest::Response) -> CallError {
    let status = response.status().as_u16();
    let retry_after = retry_after(response.headers());
    let mut body = Vec::new();
    let mut stream = response.bytes_stream();
    while let Some(Ok(chunk)) = stream.next().await {
        body.extend_from_slice(&chunk);
        if body.len() >= ERROR_BODY_LIMIT {
            body.truncate(ERROR_BODY_LIMIT);
            break;
        }
    }
    CallError::Status {
        status,
        // An endpoint that quotes the request would put images' bytes in
        // the attempt's record.
        message: evalfleet_io::images::redact(&error_message(&body)),
        retry_after,
    }
}

/// What an answer that is a web page says: the address is a site's, not
/// the API's (most often a `base_url` without its `/v1`).
pub(crate) const HTML_HINT: &str = "answered HTML, not JSON: does base_url end in /v1?";

/// Whether a response says it is a web page.
pub(crate) fn is_html(headers: &reqwest::header::HeaderMap) -> bool {
    headers
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().to_ascii_lowercase().starts_with("text/html"))
}

/// Whether a body is a web page (it opens with `<!doctype` or `<html`).
fn looks_like_html(text: &str) -> bool {
    let head: String = text
        .chars()
        .take(16)
        .collect::<String>()
        .to_ascii_lowercase();
    head.starts_with("<!doctype") || head.starts_with("<html")
}

/// The message of an error body: OpenAI's `error.message` when present.
pub(crate) fn error_message(body: &[u8]) -> String {
    if let Ok(value) = serde_json::from_slice::<Value>(body) {
        let message = value
            .pointer("/error/message")
            .or_else(|| value.get("message"))
            .or_else(|| value.get("detail"))
            .and_then(Value::as_str);
        if let Some(message) = message {
            return message.to_owned();
        }
    }
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    if text.is_empty() {
        "(no message)".to_owned()
    } else if looks_like_html(text) {
        HTML_HINT.to_owned()
    } else {
        text.chars().take(300).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_follow_status_codes() {
        let status = |status| CallError::Status {
            status,
            message: String::new(),
            retry_after: None,
        };
        assert_eq!(status(429).class(), ErrorClass::BackPressure);
        assert_eq!(status(503).class(), ErrorClass::BackPressure);
        assert_eq!(status(408).class(), ErrorClass::BackPressure);
        assert_eq!(status(500).class(), ErrorClass::Retryable);
        assert_eq!(status(502).class(), ErrorClass::Retryable);
        assert_eq!(status(400).class(), ErrorClass::Fatal);
        assert_eq!(status(401).class(), ErrorClass::Fatal);
        assert_eq!(CallError::Truncated.class(), ErrorClass::BadResponse);
        assert_eq!(
            CallError::Timeout(Duration::from_secs(1)).class(),
            ErrorClass::BackPressure
        );
        assert!(!ErrorClass::Fatal.is_retryable());
    }

    #[test]
    fn a_quieted_error_tells_nothing_the_endpoint_wrote() {
        let status = CallError::Status {
            status: 400,
            message: "internal reply: db password hunter2".to_owned(),
            retry_after: Some(Duration::from_secs(3)),
        }
        .quieted();
        assert_eq!(
            status.to_string(),
            "HTTP 400: Bad Request (the endpoint's message is not shown)"
        );
        assert_eq!(status.class(), ErrorClass::Fatal);
        assert_eq!(status.retry_after(), Some(Duration::from_secs(3)));
        let bad = CallError::BadResponse(
            "not a chat completion: invalid type: string \"hunter2\"".to_owned(),
        )
        .quieted();
        assert_eq!(
            bad.to_string(),
            "bad response: not a chat completion (the endpoint's message is not shown)"
        );
        assert!(matches!(
            CallError::Truncated.quieted(),
            CallError::Truncated
        ));
    }

    #[test]
    fn error_messages_come_from_openai_error_bodies() {
        assert_eq!(
            error_message(br#"{"error": {"message": "slow down"}}"#),
            "slow down"
        );
        assert_eq!(error_message(b"plain text"), "plain text");
        assert_eq!(
            error_message(b"\n<!DOCTYPE html><html><body>Not Found</body></html>"),
            HTML_HINT
        );
        assert_eq!(error_message(b""), "(no message)");
    }
}
