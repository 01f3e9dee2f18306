//! A SandboxFusion server as the judge's sandbox: each test is one call to
//! its `POST /run_code`, and its answer becomes an [`Execution`] that gets
//! the same verdicts as one run here.
//!
//! The request: `code`, `language`, `stdin`, `compile_timeout`,
//! `run_timeout` (seconds), `memory_limit_MB`. The answer: `status`
//! (`Success`, `Failed`, or `SandboxError` when the sandbox itself failed),
//! `message`, and `compile_result` / `run_result`, each with `status`
//! (`Finished`, `TimeLimitExceeded`, `Error`), `execution_time`,
//! `return_code`, `stdout` and `stderr`.

use std::time::Duration;

use evalfleet_types::RetryPolicy;
use evalfleet_types::retry::Retry;
use serde::{Deserialize, Serialize};

use crate::lang::Language;
use crate::sandbox::{Ended, Execution, Limits};

/// Bytes of an error answer kept for its message.
const ERROR_BODY: usize = 2048;

#[derive(Debug, thiserror::Error)]
pub enum FusionError {
    #[error("cannot reach SandboxFusion at {url}: {source}")]
    Http {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("SandboxFusion at {url} answered HTTP {status}: {body}")]
    Status {
        url: String,
        status: u16,
        body: String,
        /// The server's `Retry-After`, when it gave one.
        retry_after: Option<Duration>,
    },
    #[error("SandboxFusion at {url} answered with what is not a run_code result: {detail}")]
    Protocol { url: String, detail: String },
    #[error("SandboxFusion's sandbox failed: {message}")]
    Sandbox { message: String },
}

impl FusionError {
    /// Whether another try may go better: the network, the server's own
    /// failures and overload, not a request it refused.
    fn retryable(&self) -> bool {
        match self {
            Self::Http { .. } | Self::Sandbox { .. } => true,
            Self::Status { status, .. } => *status >= 500 || *status == 429 || *status == 408,
            Self::Protocol { .. } => false,
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

#[derive(Serialize)]
struct RunCode<'a> {
    code: &'a str,
    language: &'a str,
    stdin: &'a str,
    compile_timeout: f64,
    run_timeout: f64,
    #[serde(rename = "memory_limit_MB")]
    memory_limit_mb: u64,
}

#[derive(Deserialize)]
struct RunCodeResponse {
    status: String,
    #[serde(default)]
    message: Option<String>,
    #[serde(default)]
    compile_result: Option<CommandResult>,
    #[serde(default)]
    run_result: Option<CommandResult>,
}

#[derive(Deserialize)]
struct CommandResult {
    status: String,
    #[serde(default)]
    execution_time: Option<f64>,
    #[serde(default)]
    return_code: Option<i32>,
    #[serde(default)]
    stdout: Option<String>,
    #[serde(default)]
    stderr: Option<String>,
}

/// What a remote run came to.
#[derive(Debug)]
pub enum RemoteRun {
    /// The program ran (or was stopped).
    Executed(Execution),
    /// It did not compile: what the compiler said.
    NotCompiled(String),
}

/// A SandboxFusion server.
pub struct Fusion {
    http: reqwest::Client,
    url: String,
    retry: RetryPolicy,
    /// How long a call is tried again for.
    retry_for: Duration,
}

impl Fusion {
    /// A client of the server at `base` (`http://host:8080`), trying a
    /// call again when the network or the server fails, for up to
    /// `retry_for` after its first try (and at most `retries` more times,
    /// when given), waiting as SandboxFusion's own client does (1, 2, 4, 8
    /// s, then 16 s; with jitter), and never less than a `Retry-After`.
    pub fn new(
        http: reqwest::Client,
        base: &str,
        retries: Option<u32>,
        retry_for: Duration,
    ) -> Self {
        Self {
            http,
            url: format!("{}/run_code", base.trim_end_matches('/')),
            retry: RetryPolicy {
                max_attempts: retries.map_or(u32::MAX, |r| r.saturating_add(1)),
                backoff_base: Duration::from_secs(1),
                backoff_max: Duration::from_secs(16),
            },
            retry_for,
        }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// Runs `code` with `stdin`, retrying what may pass on another try.
    pub async fn run(
        &self,
        language: Language,
        code: &str,
        stdin: &str,
        limits: &Limits,
        compile_timeout: Duration,
    ) -> Result<RemoteRun, FusionError> {
        let request = RunCode {
            code,
            language: language.as_str(),
            stdin,
            compile_timeout: compile_timeout.as_secs_f64(),
            // The server's limit is on the wall clock, as it sees it: the
            // task's per-test time limit.
            run_timeout: limits.cpu.as_secs_f64(),
            memory_limit_mb: limits.memory_mb,
        };
        let body = serde_json::to_vec(&request).map_err(|e| FusionError::Protocol {
            url: self.url.clone(),
            detail: e.to_string(),
        })?;
        // The server's own limits plus time for the call itself.
        let deadline = compile_timeout + limits.cpu + Duration::from_secs(60);
        self.retry
            .run_within(
                self.retry_for,
                || self.once(&body, deadline),
                |err| {
                    if err.retryable() {
                        Retry::After(err.retry_after())
                    } else {
                        Retry::Never
                    }
                },
            )
            .await
    }

    async fn once(&self, body: &[u8], deadline: Duration) -> Result<RemoteRun, FusionError> {
        let http_err = |source| FusionError::Http {
            url: self.url.clone(),
            source,
        };
        let response = self
            .http
            .post(&self.url)
            .header("content-type", "application/json")
            .timeout(deadline)
            .body(body.to_vec())
            .send()
            .await
            .map_err(http_err)?;
        let status = response.status();
        // Whole seconds, as servers behind a proxy send it.
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let bytes = response.bytes().await.map_err(http_err)?;
        if !status.is_success() {
            let text = String::from_utf8_lossy(&bytes[..bytes.len().min(ERROR_BODY)]);
            return Err(FusionError::Status {
                url: self.url.clone(),
                status: status.as_u16(),
                body: text.trim().to_owned(),
                retry_after,
            });
        }
        let answer: RunCodeResponse =
            serde_json::from_slice(&bytes).map_err(|e| FusionError::Protocol {
                url: self.url.clone(),
                detail: e.to_string(),
            })?;
        self.interpret(answer)
    }

    fn interpret(&self, answer: RunCodeResponse) -> Result<RemoteRun, FusionError> {
        let sandbox_error = |message: Option<String>| FusionError::Sandbox {
            message: message
                .filter(|m| !m.trim().is_empty())
                .unwrap_or_else(|| "no message".to_owned()),
        };
        if answer.status == "SandboxError" {
            return Err(sandbox_error(answer.message));
        }
        if let Some(compile) = &answer.compile_result {
            match compile.status.as_str() {
                "Error" => return Err(sandbox_error(compile.stderr.clone())),
                "TimeLimitExceeded" => {
                    return Ok(RemoteRun::NotCompiled(
                        "the compiler ran past compile_timeout".to_owned(),
                    ));
                }
                _ if compile.return_code != Some(0) => {
                    let said = [&compile.stderr, &compile.stdout]
                        .into_iter()
                        .flatten()
                        .map(|s| s.trim())
                        .filter(|s| !s.is_empty())
                        .collect::<Vec<_>>()
                        .join("\n");
                    return Ok(RemoteRun::NotCompiled(crate::code::compiler_excerpt(
                        said.as_bytes(),
                    )));
                }
                _ => {}
            }
        }
        let Some(run) = answer.run_result else {
            return Err(FusionError::Protocol {
                url: self.url.clone(),
                detail: format!("status {} with no run_result", answer.status),
            });
        };
        let ended = match (run.status.as_str(), run.return_code) {
            ("Error", _) => return Err(sandbox_error(run.stderr)),
            ("TimeLimitExceeded", _) => Ended::TimedOut,
            (_, Some(code)) if code >= 0 => Ended::Exited(code),
            // Python's subprocess reports death by a signal as its negative.
            (_, Some(code)) => Ended::Signaled(-code),
            (_, None) => Ended::Signaled(0),
        };
        Ok(RemoteRun::Executed(Execution {
            ended,
            stdout: run.stdout.unwrap_or_default().into_bytes(),
            stderr: run.stderr.unwrap_or_default().into_bytes(),
            elapsed: Duration::try_from_secs_f64(run.execution_time.unwrap_or(0.0))
                .unwrap_or_default(),
        }))
    }
}
