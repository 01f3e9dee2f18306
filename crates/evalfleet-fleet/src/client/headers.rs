//! What a response's headers say: the quota left (`x-ratelimit-*`), when
//! to ask again (`Retry-After`), how long the server keeps an idle
//! connection (`Keep-Alive`).

use std::time::{Duration, SystemTime};

use reqwest::header::{HeaderMap, RETRY_AFTER};

/// A quota a response reported (`x-ratelimit-*` headers).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Quota {
    pub limit_requests: Option<u64>,
    pub remaining_requests: Option<u64>,
    pub reset_requests: Option<Duration>,
    pub limit_tokens: Option<u64>,
    pub remaining_tokens: Option<u64>,
    pub reset_tokens: Option<Duration>,
}

impl Quota {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// A reset time in OpenAI's format (`1s`, `6m0s`, `20ms`, `1m30.5s`), or plain
/// seconds.
pub fn parse_reset(text: &str) -> Option<Duration> {
    let text = text.trim();
    if let Ok(seconds) = text.parse::<f64>() {
        return (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds));
    }
    let mut total = 0.0;
    let mut rest = text;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let value: f64 = rest[..number_len].parse().ok()?;
        rest = &rest[number_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        total += value * scale;
        rest = &rest[unit_len..];
    }
    (total.is_finite() && total >= 0.0).then(|| Duration::from_secs_f64(total))
}

/// The `x-ratelimit-*` headers of a response (OpenAI's names).
pub fn quota_headers(headers: &HeaderMap) -> Option<Quota> {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let number = |name: &str| text(name).and_then(|v| v.trim().parse::<u64>().ok());
    let reset = |name: &str| text(name).and_then(parse_reset);
    let quota = Quota {
        limit_requests: number("x-ratelimit-limit-requests"),
        remaining_requests: number("x-ratelimit-remaining-requests"),
        reset_requests: reset("x-ratelimit-reset-requests"),
        limit_tokens: number("x-ratelimit-limit-tokens"),
        remaining_tokens: number("x-ratelimit-remaining-tokens"),
        reset_tokens: reset("x-ratelimit-reset-tokens"),
    };
    (!quota.is_empty()).then_some(quota)
}

/// `retry-after-ms` (milliseconds), or `Retry-After` in seconds or as an
/// HTTP date.
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    if let Some(ms) = headers
        .get("retry-after-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|ms| ms.is_finite() && *ms >= 0.0)
    {
        return Some(Duration::from_secs_f64(ms / 1000.0));
    }
    let text = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(seconds) = text.parse::<f64>() {
        return (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds));
    }
    let date = httpdate::parse_http_date(text).ok()?;
    Some(
        date.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

/// How long the server keeps an idle connection open, as its
/// `Keep-Alive: timeout=N` header says.
pub(super) fn keep_alive_timeout(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get("keep-alive")?.to_str().ok()?;
    value.split(',').find_map(|part| {
        let (key, seconds) = part.split_once('=')?;
        if !key.trim().eq_ignore_ascii_case("timeout") {
            return None;
        }
        let seconds: f64 = seconds.trim().parse().ok()?;
        (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    #[test]
    fn retry_after_reads_seconds_milliseconds_and_dates() {
        let mut headers = HeaderMap::new();
        headers.insert(RETRY_AFTER, HeaderValue::from_static("3"));
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(3)));
        headers.insert("retry-after-ms", HeaderValue::from_static("250"));
        assert_eq!(retry_after(&headers), Some(Duration::from_millis(250)));
        let mut headers = HeaderMap::new();
        let later = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(120));
        headers.insert(RETRY_AFTER, HeaderValue::from_str(&later).unwrap());
        let wait = retry_after(&headers).unwrap();
        assert!(
            wait > Duration::from_secs(100) && wait <= Duration::from_secs(120),
            "{wait:?}"
        );
    }

    #[test]
    fn resets_parse_in_openai_format() {
        assert_eq!(parse_reset("1s"), Some(Duration::from_secs(1)));
        assert_eq!(parse_reset("6m0s"), Some(Duration::from_secs(360)));
        assert_eq!(parse_reset("20ms"), Some(Duration::from_millis(20)));
        assert_eq!(parse_reset("1m30.5s"), Some(Duration::from_millis(90_500)));
        assert_eq!(parse_reset("2.5"), Some(Duration::from_millis(2500)));
        assert_eq!(parse_reset("soon"), None);
    }
}
