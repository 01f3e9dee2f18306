//! The judge of a run: its settings, where programs run (this machine's
//! sandbox or a SandboxFusion server), and the judging of one answer: the
//! program is compiled once (a compiled language, here), then its tests run
//! concurrently within the run's slots, each to a verdict.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use serde_json::Value;
use tokio::sync::Semaphore;

use crate::code::{self, Compilation, Extraction, Format, Judgement, TestCase, Verdict};
use crate::fusion::{Fusion, FusionError, RemoteRun};
use crate::lang::{Language, Toolchain};
use crate::sandbox::{Execution, Limits, Sandbox, Workdir};

/// Where programs run (`task.code.backend`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// This machine's sandbox.
    Local,
    /// A SandboxFusion server (`task.code.sandbox_url`), each call tried up
    /// to `retries` more times when the network or the server fails.
    SandboxFusion {
        url: String,
        /// At most this many more tries of a call (none: as many as
        /// `retry_for` allows).
        retries: Option<u32>,
        /// How long a failed call is tried again for.
        retry_for: std::time::Duration,
    },
}

/// The judge's settings (`task.code`).
#[derive(Debug, Clone, PartialEq)]
pub struct CodeSettings {
    pub format: Format,
    pub language: Language,
    /// The interpreter or compiler; `None`: the language's usual one.
    pub tool: Option<String>,
    /// Wall clock and CPU, memory and output per execution.
    pub limits: Limits,
    /// CPU time a compilation may take (twice that on the wall clock).
    pub compile_timeout: Duration,
    /// Stop a problem's remaining tests at its first failure.
    pub early_exit: bool,
    /// Executions (or remote calls) at once over the whole run.
    pub concurrency: usize,
    /// Compare numbers in stdio output within this tolerance (absolute or
    /// relative); `None`: exact text.
    pub float_tolerance: Option<f64>,
    /// The fields holding a stdio problem's tests, in order.
    pub stdio_fields: Vec<String>,
    pub backend: Backend,
}

#[derive(Debug, thiserror::Error)]
pub enum CodeJudgeError {
    /// The item is not a problem of the task's format.
    #[error("{0}")]
    Problem(String),
    #[error("the sandbox failed: {0}")]
    Sandbox(#[source] std::io::Error),
    #[error(transparent)]
    Remote(#[from] FusionError),
    /// The judge cannot start: its toolchain or its sandbox does not work.
    #[error("{0}")]
    Setup(String),
}

impl CodeJudgeError {
    /// A judge that cannot start (its toolchain, its sandbox, its server)
    /// is the user's to fix; the rest are failures.
    pub fn fault(&self) -> evalfleet_types::Fault {
        match self {
            Self::Setup(_) => evalfleet_types::Fault::BadInput,
            Self::Problem(_) | Self::Sandbox(_) | Self::Remote(_) => {
                evalfleet_types::Fault::Failure
            }
        }
    }
}

enum Runner {
    Local {
        sandbox: Box<Sandbox>,
        toolchain: Toolchain,
    },
    Remote {
        fusion: Fusion,
        slots: Semaphore,
    },
}

/// A program ready to run its tests.
enum Prepared {
    /// A script, written with each test.
    Script,
    /// Compiled here (in so many seconds): the sealed directory holding
    /// `main`.
    Built(Workdir, f64),
    /// Sent with each test to the remote sandbox.
    Remote,
}

/// One test's run.
enum Ran {
    /// It ran; compiled first in so long where the remote sandbox compiles
    /// each test's program.
    Executed(Execution, Option<Duration>),
    /// It did not compile (remotely): what the compiler said, and how long
    /// it took.
    NotCompiled(Compilation),
}

/// The judge of a run.
pub struct CodeJudge {
    settings: CodeSettings,
    runner: Runner,
}

impl CodeJudge {
    /// Makes the judge: the sandbox under `dir` (or the client of the remote
    /// one, over `http`, which a remote backend needs), and checks that a
    /// trivial program of the task's language runs there, so that a missing
    /// compiler or an unreachable server stops the run at its start, not at
    /// every item.
    pub async fn new(
        settings: CodeSettings,
        dir: &Path,
        http: Option<reqwest::Client>,
    ) -> Result<Self, CodeJudgeError> {
        let runner = match &settings.backend {
            Backend::Local => {
                let mut toolchain = Toolchain::resolve(settings.language, settings.tool.as_deref())
                    .await
                    .map_err(CodeJudgeError::Setup)?;
                let binds: Vec<PathBuf> = toolchain.host_dir.iter().cloned().collect();
                let sandbox = Sandbox::new(dir, settings.concurrency, &binds)
                    .await
                    .map_err(|e| {
                        CodeJudgeError::Setup(format!(
                            "cannot make the sandbox under {}: {e}",
                            dir.display()
                        ))
                    })?;
                if let Some(inside) = sandbox.toolchain(0) {
                    toolchain.bound_at(&inside);
                }
                Runner::Local {
                    sandbox: Box::new(sandbox),
                    toolchain,
                }
            }
            Backend::SandboxFusion {
                url,
                retries,
                retry_for,
            } => {
                let http = http.ok_or_else(|| {
                    CodeJudgeError::Setup("a SandboxFusion backend needs an HTTP client".to_owned())
                })?;
                Runner::Remote {
                    fusion: Fusion::new(http, url, *retries, *retry_for),
                    slots: Semaphore::new(settings.concurrency),
                }
            }
        };
        let judge = Self { settings, runner };
        judge.check().await?;
        Ok(judge)
    }

    async fn check(&self) -> Result<(), CodeJudgeError> {
        let hello = self.settings.language.hello();
        let case = TestCase {
            program: hello.to_owned(),
            stdin: String::new(),
            expected: Some("ok".to_owned()),
        };
        let failed = |detail: String| {
            CodeJudgeError::Setup(format!(
                "a {} program does not run {}: {detail}",
                self.settings.language.as_str(),
                self.place()
            ))
        };
        let prepared = match self.prepare(hello).await {
            Ok(Ok(prepared)) => prepared,
            Ok(Err(compilation)) => {
                return Err(failed(compilation.message.unwrap_or_default()));
            }
            Err(err) => return Err(failed(err.to_string())),
        };
        let stop = AtomicBool::new(false);
        match self.execute(&prepared, &case, &stop).await {
            Ok(Some(Ran::Executed(run, _))) => {
                // Judged like any test, expecting `ok`.
                let result = code::test_result(0, &run, case.expected.as_deref(), None);
                if result.verdict == Verdict::Success {
                    return Ok(());
                }
                Err(failed(format!(
                    "{} ({:?}), saying {:?} {:?}",
                    result.verdict.as_str(),
                    run.ended,
                    code::excerpt(&run.stdout),
                    code::excerpt(&run.stderr)
                )))
            }
            Ok(Some(Ran::NotCompiled(compilation))) => {
                Err(failed(compilation.message.unwrap_or_default()))
            }
            Ok(None) => Ok(()),
            Err(err) => Err(failed(err.to_string())),
        }
    }

    fn place(&self) -> String {
        match &self.runner {
            Runner::Local { toolchain, .. } => {
                format!("in the sandbox with '{}'", toolchain.tool)
            }
            Runner::Remote { fusion, .. } => format!("on {}", fusion.url()),
        }
    }

    /// Where programs run and what is enforced, in words.
    pub fn describe(&self) -> String {
        match &self.runner {
            Runner::Local { sandbox, .. } => sandbox.describe(),
            Runner::Remote { fusion, .. } => format!(
                "SandboxFusion at {} (its isolation is the server's)",
                fusion.url()
            ),
        }
    }

    /// Whether the local sandbox lacks something it enforces where it can
    /// (a run says so loudly).
    pub fn degraded(&self) -> bool {
        match &self.runner {
            Runner::Local { sandbox, .. } => sandbox.isolation() != crate::sandbox::Isolation::ALL,
            Runner::Remote { .. } => false,
        }
    }

    pub fn settings(&self) -> &CodeSettings {
        &self.settings
    }

    /// Judges `answer` as the program for the problem `item`.
    pub async fn judge(&self, item: &Value, answer: &str) -> Result<Judgement, CodeJudgeError> {
        let (program, extraction) = code::extract(answer, self.settings.language);
        let cases = code::tests(
            self.settings.format,
            item,
            &program,
            &self.settings.stdio_fields,
        )
        .map_err(CodeJudgeError::Problem)?;
        let total = cases.len();
        let prepared = match self.prepare(&program).await? {
            Ok(prepared) => prepared,
            Err(compilation) => {
                return Ok(Judgement::not_compiled(total, extraction, compilation));
            }
        };
        let compilation = match &prepared {
            Prepared::Built(_, seconds) => Some(Compilation {
                ok: true,
                seconds: *seconds,
                message: None,
            }),
            _ => None,
        };
        self.run_tests(&prepared, &cases, extraction, compilation)
            .await
    }

    async fn run_tests(
        &self,
        prepared: &Prepared,
        cases: &[TestCase],
        extraction: Extraction,
        compilation: Option<Compilation>,
    ) -> Result<Judgement, CodeJudgeError> {
        let stop = AtomicBool::new(false);
        let mut running: FuturesUnordered<_> = cases
            .iter()
            .enumerate()
            .map(|(index, case)| {
                let stop = &stop;
                async move {
                    let ran = self.execute(prepared, case, stop).await?;
                    Ok::<_, CodeJudgeError>(ran.map(|ran| (index, ran)))
                }
            })
            .collect();
        let mut results = Vec::with_capacity(cases.len());
        let mut compilation = compilation;
        let mut not_compiled = None;
        while let Some(ran) = running.next().await {
            let Some((index, ran)) = ran? else { continue };
            let case = &cases[index];
            match ran {
                Ran::Executed(run, compiled) => {
                    // A remote sandbox compiles for each test: the first
                    // compilation reported stands for the program's.
                    if let (None, Some(took)) = (&compilation, compiled) {
                        compilation = Some(Compilation {
                            ok: true,
                            seconds: took.as_secs_f64(),
                            message: None,
                        });
                    }
                    let result = code::test_result(
                        index,
                        &run,
                        case.expected.as_deref(),
                        self.settings.float_tolerance,
                    );
                    if result.verdict != Verdict::Success && self.settings.early_exit {
                        stop.store(true, Ordering::Relaxed);
                    }
                    results.push(result);
                }
                Ran::NotCompiled(failed) => {
                    // The same program for every test: one compile error
                    // is the problem's, as when it is compiled here once.
                    stop.store(true, Ordering::Relaxed);
                    not_compiled.get_or_insert(failed);
                }
            }
        }
        if let Some(failed) = not_compiled {
            return Ok(Judgement::not_compiled(cases.len(), extraction, failed));
        }
        Ok(Judgement::of(results, cases.len(), extraction, compilation))
    }

    /// Gets `program` ready: compiled once here for a compiled language
    /// (`Err` with the compiler's complaint when it does not compile).
    async fn prepare(
        &self,
        program: &str,
    ) -> Result<Result<Prepared, Compilation>, CodeJudgeError> {
        let Runner::Local { sandbox, toolchain } = &self.runner else {
            return Ok(Ok(Prepared::Remote));
        };
        let Some(argv) = toolchain.compile_argv() else {
            return Ok(Ok(Prepared::Script));
        };
        let slot = sandbox.slot().await;
        let build = slot.workdir().map_err(CodeJudgeError::Sandbox)?;
        std::fs::write(build.path().join(toolchain.language.source_file()), program)
            .map_err(CodeJudgeError::Sandbox)?;
        let limits = Limits {
            cpu: self.settings.compile_timeout,
            wall: self.settings.compile_timeout * 2,
            // Compilers reserve more address space than programs use.
            memory_mb: self.settings.limits.memory_mb.max(4096),
            processes: self.settings.limits.processes.max(256),
            file_bytes: self.settings.limits.file_bytes.max(256 << 20),
            output_bytes: 1 << 20,
        };
        let run = slot
            .run(&argv, &build, b"", &limits)
            .await
            .map_err(CodeJudgeError::Sandbox)?;
        if !run.success() {
            let (verdict, said) = code::classify(&run, None, None);
            let mut message = String::from_utf8_lossy(&run.stderr).into_owned();
            message.push_str(&String::from_utf8_lossy(&run.stdout));
            let message = if verdict == Verdict::Timeout {
                "the compiler ran past compile_timeout".to_owned()
            } else if message.trim().is_empty() {
                said.unwrap_or_else(|| format!("the compiler ended {:?}", run.ended))
            } else {
                code::compiler_excerpt(message.as_bytes())
            };
            return Ok(Err(Compilation {
                ok: false,
                seconds: run.elapsed.as_secs_f64(),
                message: Some(message),
            }));
        }
        build.seal().map_err(CodeJudgeError::Sandbox)?;
        Ok(Ok(Prepared::Built(build, run.elapsed.as_secs_f64())))
    }

    /// Runs one test when a slot is free; `None` when `stop` was set by
    /// then.
    async fn execute(
        &self,
        prepared: &Prepared,
        case: &TestCase,
        stop: &AtomicBool,
    ) -> Result<Option<Ran>, CodeJudgeError> {
        match &self.runner {
            Runner::Local { sandbox, toolchain } => {
                let slot = sandbox.slot().await;
                if stop.load(Ordering::Relaxed) {
                    return Ok(None);
                }
                let dir = slot.workdir().map_err(CodeJudgeError::Sandbox)?;
                let argv = match prepared {
                    Prepared::Built(build, _) => toolchain.run_argv(Some(build.inside())),
                    _ => {
                        std::fs::write(
                            dir.path().join(toolchain.language.source_file()),
                            &case.program,
                        )
                        .map_err(CodeJudgeError::Sandbox)?;
                        toolchain.run_argv(None)
                    }
                };
                let run = slot
                    .run(&argv, &dir, case.stdin.as_bytes(), &self.settings.limits)
                    .await
                    .map_err(CodeJudgeError::Sandbox)?;
                Ok(Some(Ran::Executed(run, None)))
            }
            Runner::Remote { fusion, slots } => {
                let _permit = slots.acquire().await.ok();
                if stop.load(Ordering::Relaxed) {
                    return Ok(None);
                }
                let ran = fusion
                    .run(
                        self.settings.language,
                        &case.program,
                        &case.stdin,
                        &self.settings.limits,
                        self.settings.compile_timeout,
                    )
                    .await?;
                Ok(Some(match ran {
                    RemoteRun::Executed { run, compiled } => Ran::Executed(run, compiled),
                    RemoteRun::NotCompiled { message, seconds } => Ran::NotCompiled(Compilation {
                        ok: false,
                        seconds,
                        message: Some(message),
                    }),
                }))
            }
        }
    }
}
