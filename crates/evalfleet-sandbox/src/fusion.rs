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
//!
//! The server's `run_timeout` is on the wall clock, from the program's
//! start (at 469de08, `run_command_bare`), so a program that waits its turn
//! for a core on a busy server times out there and passes here. The limits
//! are made to mean what they mean in the local sandbox: the program sets
//! its own CPU-time limit (the local one, [`Limits::cpu_seconds`]) and
//! address-space limit (`memory_mb`) before anything of the answer runs,
//! `run_timeout` is the local wall clock (`wall_timeout`), and the
//! server's report of a program killed by SIGXCPU is the local CPU-limit
//! verdict. `memory_limit_MB` is -1: the server would set the stack limit
//! to it as well, and a thread's stack is as large as that, so at 1024 MB
//! a program cannot start one thread, nor Rust's linker link. How each
//! language sets its limits:
//!
//! - Python: the code sent is a driver that sets the limit and `exec`s the
//!   interpreter on the program, sent beside it as `main.py` (in `files`):
//!   the program runs as `python main.py`, as it does here, so its
//!   tracebacks name the same file and lines.
//! - C++: one line before the program, a constructor that calls
//!   `setrlimit` through a name of its own (no header: nothing of the
//!   program can clash with it), then `#line 1 "main.cpp"`: the compiler's
//!   messages and `__LINE__` are the program's own.
//! - Rust: the same constructor after the program (in `.init_array`), so
//!   no line moves.

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine as _;
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
    memory_limit_mb: i64,
    /// Files put beside the code: path to base64.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    files: BTreeMap<&'static str, String>,
}

/// What is sent for `program`: the code, and the files beside it, such
/// that the program runs under the CPU-time and memory limits of `limits`
/// as the local sandbox runs it.
fn submission(
    language: Language,
    program: &str,
    limits: &Limits,
) -> (String, BTreeMap<&'static str, String>) {
    let (soft, hard) = limits.cpu_seconds();
    let bytes = limits.memory_mb.saturating_mul(1024 * 1024);
    match language {
        Language::Python => {
            let driver = format!(
                "import os, resource, sys\n\
                 resource.setrlimit(resource.RLIMIT_CPU, ({soft}, {hard}))\n\
                 resource.setrlimit(resource.RLIMIT_AS, ({bytes}, {bytes}))\n\
                 os.execv(sys.executable, [sys.executable, \"main.py\"])\n"
            );
            let encoded = base64::engine::general_purpose::STANDARD.encode(program);
            (driver, BTreeMap::from([("main.py", encoded)]))
        }
        Language::Cpp => (
            format!(
                "extern \"C\" int __evalfleet_setrlimit(int, const unsigned long *) __asm__(\"setrlimit\"); \
                 __attribute__((constructor)) static void __evalfleet_limits() {{ \
                 const unsigned long cpu[2] = {{{soft}, {hard}}}, memory[2] = {{{bytes}, {bytes}}}; \
                 __evalfleet_setrlimit({RLIMIT_CPU}, cpu); __evalfleet_setrlimit({RLIMIT_AS}, memory); }}\n\
                 #line 1 \"main.cpp\"\n{program}"
            ),
            BTreeMap::new(),
        ),
        Language::Rust => (
            format!(
                "{program}\n\
                 #[allow(non_upper_case_globals, dead_code)]\n\
                 mod __evalfleet_limit {{\n\
                 extern \"C\" {{\n\
                 #[link_name = \"setrlimit\"]\n\
                 fn limit(resource: i32, limit: *const u64) -> i32;\n\
                 }}\n\
                 extern \"C\" fn limits() {{\n\
                 let cpu: [u64; 2] = [{soft}, {hard}];\n\
                 let memory: [u64; 2] = [{bytes}, {bytes}];\n\
                 unsafe {{ limit({RLIMIT_CPU}, cpu.as_ptr()); limit({RLIMIT_AS}, memory.as_ptr()); }}\n\
                 }}\n\
                 #[used]\n\
                 #[link_section = \".init_array\"]\n\
                 static limits_at_start: extern \"C\" fn() = limits;\n\
                 }}\n"
            ),
            BTreeMap::new(),
        ),
    }
}

/// `RLIMIT_CPU` and `RLIMIT_AS` as Linux numbers them (on x86 and Arm).
const RLIMIT_CPU: i32 = 0;
const RLIMIT_AS: i32 = 9;

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
    /// The program ran (or was stopped), compiled first in so long (a
    /// compiled language).
    Executed {
        run: Execution,
        compiled: Option<Duration>,
    },
    /// It did not compile: what the compiler said, after so long.
    NotCompiled { message: String, seconds: f64 },
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
        let (code, files) = submission(language, code, limits);
        let request = RunCode {
            code: &code,
            language: language.as_str(),
            stdin,
            compile_timeout: compile_timeout.as_secs_f64(),
            // CPU time is limited by the program itself; the server's limit
            // is on the wall clock, as the local sandbox's `wall` is.
            run_timeout: limits.wall.as_secs_f64(),
            // The program limits its own memory (see above).
            memory_limit_mb: -1,
            files,
        };
        let body = serde_json::to_vec(&request).map_err(|e| FusionError::Protocol {
            url: self.url.clone(),
            detail: e.to_string(),
        })?;
        // The server's own limits plus time for the call itself.
        let deadline = compile_timeout + limits.wall + Duration::from_secs(60);
        self.retry
            .run_within(
                self.retry_for,
                || self.once(&body, deadline, limits.cpu),
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

    async fn once(
        &self,
        body: &[u8],
        deadline: Duration,
        cpu: Duration,
    ) -> Result<RemoteRun, FusionError> {
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
        self.interpret(answer, cpu)
    }

    /// The answer as a run here; `cpu` is the program's CPU-time limit.
    fn interpret(&self, answer: RunCodeResponse, cpu: Duration) -> Result<RemoteRun, FusionError> {
        let sandbox_error = |message: Option<String>| FusionError::Sandbox {
            message: message
                .filter(|m| !m.trim().is_empty())
                .unwrap_or_else(|| "no message".to_owned()),
        };
        if answer.status == "SandboxError" {
            return Err(sandbox_error(answer.message));
        }
        let seconds = |result: &CommandResult| result.execution_time.unwrap_or(0.0).max(0.0);
        if let Some(compile) = &answer.compile_result {
            match compile.status.as_str() {
                "Error" => return Err(sandbox_error(compile.stderr.clone())),
                "TimeLimitExceeded" => {
                    return Ok(RemoteRun::NotCompiled {
                        message: "the compiler ran past compile_timeout".to_owned(),
                        seconds: seconds(compile),
                    });
                }
                _ if compile.return_code != Some(0) => {
                    let said = [&compile.stderr, &compile.stdout]
                        .into_iter()
                        .flatten()
                        .map(|s| s.trim())
                        .filter(|s| !s.is_empty())
                        .collect::<Vec<_>>()
                        .join("\n");
                    return Ok(RemoteRun::NotCompiled {
                        message: crate::code::compiler_excerpt(said.as_bytes()),
                        seconds: seconds(compile),
                    });
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
        let elapsed = Duration::try_from_secs_f64(seconds(&run)).unwrap_or_default();
        let ended = match (run.status.as_str(), run.return_code) {
            ("Error", _) => return Err(sandbox_error(run.stderr)),
            ("TimeLimitExceeded", _) => Ended::TimedOut,
            // Python's subprocess reports death by a signal as its negative
            // (the server's shell execs the program); a shell that waits
            // for it says 128 plus the signal.
            (_, Some(code)) if code == -libc::SIGXCPU || code == 128 + libc::SIGXCPU => {
                Ended::CpuLimit
            }
            // The hard limit kills a program that ignores SIGXCPU; one
            // killed sooner than its limit on the wall clock cannot have
            // used it (the server's cores are not known: one is assumed).
            (_, Some(code)) if code == -libc::SIGKILL && elapsed >= cpu => Ended::CpuLimit,
            (_, Some(code)) if code >= 0 => Ended::Exited(code),
            (_, Some(code)) => Ended::Signaled(-code),
            (_, None) => Ended::Signaled(0),
        };
        Ok(RemoteRun::Executed {
            compiled: answer
                .compile_result
                .as_ref()
                .and_then(|c| Duration::try_from_secs_f64(seconds(c)).ok()),
            run: Execution {
                ended,
                stdout: run.stdout.unwrap_or_default().into_bytes(),
                stderr: run.stderr.unwrap_or_default().into_bytes(),
                elapsed,
            },
        })
    }
}
