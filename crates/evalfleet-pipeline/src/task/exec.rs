//! `kind: exec`: the user's own program (an agent, in any language) runs
//! once per item, in the sandbox, with the item as JSON and
//! `OPENAI_BASE_URL`/`OPENAI_API_KEY` set to the item's address at the
//! run's gateway, so that every model call it makes is the item's. Its
//! standard output is the answer, checked and scored as a chat task's is;
//! its exit status and the tail of its standard error are kept with the
//! result (`judge`). A run that exits non-zero, is killed, or outlives
//! `task.timeout` is a failed attempt, retried as `retry` says; each
//! attempt is stored with the calls it made.
//!
//! The sandbox's network namespace has its loopback up, and on it a single
//! listening socket, made inside the namespace by us: the gateway's. The
//! agent reaches `http://127.0.0.1:PORT` and nothing else. Where the
//! sandbox cannot be had (evalfleet not run as root), the gateway listens
//! on the host's loopback and the agent's network is not closed (the log
//! says so).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use evalfleet_sandbox::sandbox::{Ended, Execution, Isolation, Limits, Network, Options, Sandbox};
use evalfleet_types::{AgentCall, AttemptRecord, ErrorClass, RetryPolicy, Telemetry, ms, unix_ms};
use serde_json::Value;

use super::agent_server::{self, Reply as ServerReply, Servers};
use super::chat::Chat;
use super::{Attempted, Episode, Finish, ItemContext, Reply, Request, Step, Target, Task};
use evalfleet_config::{AgentMode, AgentNetwork, ExecInput, ExecSettings};
use evalfleet_gateway::Closed;
use evalfleet_gateway::Gateway;

/// Serves a gateway on a listener: the server's part, which this layer
/// cannot hold.
pub trait GatewayHost: Send + Sync {
    /// The server of `gateway` on `listener`, which ends when `stop` is
    /// cancelled (the gateway runs it).
    fn serve(
        &self,
        gateway: Arc<Gateway>,
        listener: std::net::TcpListener,
        stop: tokio_util::sync::CancellationToken,
    ) -> std::io::Result<futures_util::future::BoxFuture<'static, ()>>;
}

/// The exec task.
pub struct Exec {
    inner: Arc<Inner>,
    chat: Chat,
}

struct Inner {
    settings: ExecSettings,
    retry: RetryPolicy,
    sandbox: Arc<Sandbox>,
    /// `task.mode: server`: the agent's processes, which serve every item.
    servers: Option<Servers>,
    gateway: Arc<Gateway>,
    /// `http://127.0.0.1:PORT`, as the agent reaches the gateway.
    base: String,
    /// The command, its files of the config's folder given as the agent
    /// sees them.
    argv: Vec<String>,
    /// What of an item the agent is given.
    given: Given,
    limits: Limits,
    /// Ends the gateway's listener with the task.
    stop: tokio_util::sync::CancellationToken,
}

/// The fields of an item an agent is given.
enum Given {
    /// Those named (`task.input.fields`).
    Only(Vec<String>),
    /// All but these (the answer key: what the references read).
    AllBut(std::collections::BTreeSet<String>),
}

impl Given {
    /// The item as the agent gets it: JSON text of its fields given.
    fn of(&self, row: &evalfleet_io::dataset::Row) -> String {
        let given: serde_json::Map<String, Value> = match self {
            Self::Only(names) => names
                .iter()
                .filter_map(|name| row.get(name).map(|v| (name.clone(), v.clone())))
                .collect(),
            Self::AllBut(withheld) => row
                .iter()
                .filter(|(name, _)| !withheld.contains(*name))
                .map(|(name, v)| (name.clone(), v.clone()))
                .collect(),
        };
        Value::Object(given).to_string()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Why the exec task cannot start.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("cannot make the agents' sandbox under {dir}: {source}")]
    Sandbox {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot serve the gateway to the agents: {0}")]
    Gateway(String),
    /// The program, or a file it is given, is out of the agents' reach.
    #[error("task.command: {0}")]
    Unreachable(String),
}

impl Exec {
    /// Makes the sandbox (under `sandbox_dir`) and serves `gateway` in it
    /// with `host`. What of `hidden` (the store, its folder, the response
    /// cache) lies in the config's folder, which agents see, they see
    /// empty.
    pub async fn start(
        settings: &ExecSettings,
        retry: RetryPolicy,
        chat: Chat,
        gateway: Arc<Gateway>,
        host: &dyn GatewayHost,
        sandbox_dir: &std::path::Path,
        hidden: &[PathBuf],
    ) -> Result<Self, ExecError> {
        let dir = sandbox_dir.join(format!("agents-{}", std::process::id()));
        // The config's folder is bound read-only for the agents (they may
        // not reach it otherwise: a home folder is closed to other users).
        let agent_dir = settings
            .dir
            .canonicalize()
            .unwrap_or_else(|_| settings.dir.clone());
        // `network: open`: no namespaces (the host's network and file
        // system), still a user of its own per slot.
        let wanted = match settings.network {
            AgentNetwork::Gateway => Isolation::ALL,
            AgentNetwork::Open => Isolation {
                namespaces: false,
                read_only: false,
                own_uids: true,
            },
        };
        // The store's folder is made now (the sandbox's is in it), so that
        // it is found where the agents would see it.
        let _ = std::fs::create_dir_all(&dir);
        let hide = hidden
            .iter()
            .filter_map(|path| path.canonicalize().ok())
            .filter(|path| path.starts_with(&agent_dir) && *path != agent_dir)
            .collect();
        // A slot per agent process: one per item at once, or per server.
        let slots = match settings.mode {
            AgentMode::PerItem => settings.concurrency,
            AgentMode::Server { processes } => processes,
        };
        let mut sandbox = Sandbox::with_options(
            &dir,
            slots,
            std::slice::from_ref(&agent_dir),
            wanted,
            Options {
                network: Network::Loopback,
                hide,
                disk_bytes: Some(settings.disk_mb.saturating_mul(1 << 20)),
            },
        )
        .await
        .map_err(|source| ExecError::Sandbox {
            dir: dir.clone(),
            source,
        })?;
        // One memory limit for all the processes of a run of the agent.
        if let Err(why) = sandbox.limit_memory(settings.memory_mb.saturating_mul(1 << 20)) {
            tracing::info!("Agents' memory (task.memory_mb) is limited per process only: {why}.");
            if sandbox.disk_limited() {
                tracing::warn!(
                    "Agents' folders are file systems in memory of task.disk_mb ({} MiB) each, {} of them, not held to task.memory_mb here: lower task.disk_mb if this machine cannot spare that memory.",
                    settings.disk_mb,
                    slots
                );
            }
        }
        let listener = sandbox
            .listen()
            .map_err(|err| ExecError::Gateway(err.to_string()))?;
        let port = listener
            .local_addr()
            .map_err(|err| ExecError::Gateway(err.to_string()))?
            .port();
        let stop = tokio_util::sync::CancellationToken::new();
        let server = host
            .serve(gateway.clone(), listener, stop.clone())
            .map_err(|err| ExecError::Gateway(err.to_string()))?;
        gateway.spawn(server);
        let description = sandbox.describe();
        if sandbox.isolation().namespaces {
            tracing::info!("Agents' sandbox: {description}.");
        } else if settings.network == AgentNetwork::Open {
            tracing::info!(
                "Agents (task.network: open) run in folders of their own, as users of their own where evalfleet runs as root, with this machine's network and file system; the gateway is at 127.0.0.1:{port}."
            );
        } else {
            tracing::warn!(
                "Agents' sandbox: {description}. The agents' network is not closed: they reach the gateway on this machine's 127.0.0.1:{port}, and everything else too."
            );
        }
        if let Some(why) = out_of_reach(&settings.command, sandbox.isolation(), &agent_dir) {
            return Err(ExecError::Unreachable(why));
        }
        let inside_dir = sandbox.toolchain(0).unwrap_or_else(|| agent_dir.clone());
        let argv: Vec<String> = settings
            .command
            .iter()
            .enumerate()
            .map(|(i, word)| given_as(word, i, &agent_dir, &inside_dir))
            .collect();
        let timeout = settings.timeout;
        let limits = Limits {
            wall: timeout,
            cpu: timeout,
            memory_mb: settings.memory_mb,
            output_bytes: 16 << 20,
            file_bytes: 256 << 20,
            processes: 512,
        };
        let sandbox = Arc::new(sandbox);
        let base = format!("http://127.0.0.1:{port}");
        let servers = match settings.mode {
            AgentMode::PerItem => None,
            AgentMode::Server { processes } => {
                let mut env = vec![
                    ("EVALFLEET_GATEWAY".to_owned(), base.clone()),
                    (
                        "EVALFLEET_CONCURRENCY".to_owned(),
                        settings.concurrency.div_ceil(processes).to_string(),
                    ),
                ];
                env.extend(settings.env.iter().cloned());
                let spec = agent_server::Spec {
                    argv: argv.clone(),
                    env,
                    // It lives as long as the run: no CPU-time bound; its
                    // items' threads and children count as its processes.
                    limits: Limits {
                        cpu: Duration::from_secs(1 << 40),
                        processes: 4096,
                        ..limits
                    },
                };
                let gateway = gateway.clone();
                Some(Servers::start(&sandbox, processes, spec, move |work| {
                    gateway.spawn(work);
                }))
            }
        };
        // No agent is handed its answer key, unless its fields are named.
        let given = match &settings.fields {
            Some(names) => Given::Only(names.clone()),
            None => Given::AllBut(chat.reference_fields()),
        };
        Ok(Self {
            inner: Arc::new(Inner {
                settings: settings.clone(),
                retry,
                sandbox,
                servers,
                gateway,
                base,
                argv,
                given,
                limits,
                stop,
            }),
            chat,
        })
    }
}

/// `word` of the command as the agent is given it: a path that names a
/// file of the config's folder (relative to it, or absolute), as the agent
/// sees that file.
fn given_as(
    word: &str,
    index: usize,
    host_dir: &std::path::Path,
    inside_dir: &std::path::Path,
) -> String {
    let path = std::path::Path::new(word);
    let looks_like_path = index > 0 || word.contains('/');
    if word.starts_with('-') || !looks_like_path {
        return word.to_owned();
    }
    if path.is_relative() && host_dir.join(path).is_file() {
        return inside_dir.join(path).to_string_lossy().into_owned();
    }
    if let Ok(within) = path.strip_prefix(host_dir)
        && path.is_file()
    {
        return inside_dir.join(within).to_string_lossy().into_owned();
    }
    word.to_owned()
}

/// Folders each agent has a private, empty copy of (the sandbox's mount
/// namespace covers them): a host path under one is not seen.
const PRIVATE_TO_AGENTS: [&str; 6] = evalfleet_sandbox::sandbox::COVERED;

/// Why the agents cannot run `command` (found before the first item), if
/// they cannot: its program, or a file it names by absolute path, is under
/// a folder the sandbox gives each agent a private copy of, or (the agents
/// running as users of their own) behind a folder closed to other users, or
/// not readable or runnable by them. Files of the config's folder are given
/// to agents, wherever it is.
fn out_of_reach(
    command: &[String],
    isolation: Isolation,
    host_dir: &std::path::Path,
) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    use std::path::PathBuf;
    for (i, word) in command.iter().enumerate() {
        let path: PathBuf = if i == 0 && !word.contains('/') {
            // As the sandbox finds it (the agents' PATH).
            match evalfleet_sandbox::sandbox::resolve(word) {
                Ok(found) => found,
                Err(err) => {
                    return Some(format!(
                        "{err}, where agents find programs: name it by its path"
                    ));
                }
            }
        } else if word.starts_with('/') {
            PathBuf::from(word)
        } else if i == 0 {
            host_dir.join(word)
        } else {
            continue;
        };
        if path.starts_with(host_dir) || !path.exists() {
            if i == 0 && !path.exists() {
                return Some(format!("{} does not exist", path.display()));
            }
            continue;
        }
        if isolation.namespaces
            && let Some(private) = PRIVATE_TO_AGENTS.iter().find(|p| path.starts_with(p))
        {
            return Some(format!(
                "{} is under {private}, which agents do not see (each has an empty {private} of its own): put it in the config's folder ({}), or outside {}",
                path.display(),
                host_dir.display(),
                PRIVATE_TO_AGENTS.join(", ")
            ));
        }
        if !isolation.own_uids {
            continue;
        }
        // Every folder on the way must let others through, and the file be
        // readable (a script, a file given) or runnable (the program).
        let real = path.canonicalize().unwrap_or(path.clone());
        for dir in real.ancestors().skip(1) {
            let Ok(meta) = std::fs::metadata(dir) else {
                continue;
            };
            if meta.permissions().mode() & 0o001 == 0 {
                return Some(format!(
                    "agents run as users of their own, who cannot reach {}: {} is closed to other users (mode {:o}). Name a program they can run (/usr/bin/python3), or keep it in a folder others may enter (python3 -m venv /opt/agent-env)",
                    real.display(),
                    dir.display(),
                    meta.permissions().mode() & 0o7777
                ));
            }
        }
        let mode = std::fs::metadata(&real).map_or(0, |m| m.permissions().mode());
        let (bit, what) = if i == 0 {
            (0o001, "run")
        } else {
            (0o004, "read")
        };
        if mode & bit == 0 {
            return Some(format!(
                "agents run as users of their own, who may not {what} {} (mode {:o}): chmod o+{} it",
                real.display(),
                mode & 0o7777,
                if i == 0 { "rx" } else { "r" }
            ));
        }
    }
    None
}

impl Task for Exec {
    fn begin(&self, item: &ItemContext<'_>) -> (Box<dyn Episode>, Step) {
        let shared = Arc::new(std::sync::Mutex::new(Scoring {
            chat: self.chat.episode(),
            kept: None,
        }));
        let run = Run {
            inner: self.inner.clone(),
            scoring: shared.clone(),
            seq: item.seq,
            item_id: item.item_id.to_owned(),
            row_json: Value::Object(item.row().clone()).to_string(),
            given_json: self.inner.given.of(item.row()),
            sample: item.sample,
            attempt: item.attempt,
            keeper: item.keeper.cloned(),
        };
        (Box::new(ExecEpisode { scoring: shared }), run.step())
    }

    /// Agents running at once, and answers waiting on outside backends.
    fn work_limit(&self) -> usize {
        self.inner.settings.concurrency + self.chat.backend_queue()
    }

    fn keeps_calls(&self) -> bool {
        true
    }
}

/// How an agent's answer is checked and scored: as a chat task's answer
/// (LLM judges included); what is kept of the run that gave it goes with
/// the item's result.
struct Scoring {
    chat: super::chat::ChatEpisode,
    kept: Option<Value>,
}

/// An item's episode: the scoring of its answer, shared with the work that
/// runs its agent.
struct ExecEpisode {
    scoring: Arc<std::sync::Mutex<Scoring>>,
}

impl Episode for ExecEpisode {
    fn next(&mut self, item: &ItemContext<'_>, asked: Request, reply: Reply) -> Step {
        let Ok(mut scoring) = self.scoring.lock() else {
            return Step::Finish(Finish::failed(
                "internal error: the item's scoring was poisoned".to_owned(),
                evalfleet_types::Assessment::default(),
            ));
        };
        let step = scoring.chat.next(item, asked, reply);
        let kept = scoring.kept.clone();
        keeping(step, kept)
    }
}

/// `step`, whose finish keeps `kept` (the agent's exit and stderr) as the
/// result's `judge`.
fn keeping(step: Step, kept: Option<Value>) -> Step {
    match step {
        Step::Finish(mut finish) => {
            if finish.assessment.code.is_none() {
                finish.assessment.code = kept;
            }
            Step::Finish(finish)
        }
        Step::Work(work) => Step::Work(Box::pin(async move { keeping(work.await, kept) })),
        Step::Wait(wait) => Step::Wait(Box::pin(async move { keeping(wait.await, kept) })),
        Step::Attempted(mut attempted) => {
            attempted.then = keeping(attempted.then, kept);
            Step::Attempted(attempted)
        }
        call @ Step::Call(_) => call,
    }
}

/// An item's run of its agent.
struct Run {
    inner: Arc<Inner>,
    scoring: Arc<std::sync::Mutex<Scoring>>,
    seq: u64,
    item_id: String,
    row_json: String,
    /// The item as the agent gets it (its answer key withheld).
    given_json: String,
    sample: u32,
    attempt: u32,
    /// Where its calls are stored as they end.
    keeper: Option<super::CallSink>,
}

/// How a run of the agent went.
struct Outcome {
    answer: Result<String, (String, ErrorClass)>,
    record: AttemptRecord,
    calls: Vec<AgentCall>,
    /// What is kept of it with the result: exit status, stderr's tail.
    kept: Value,
}

impl Run {
    /// The work of this attempt, and of the next ones while they fail and
    /// tries are left.
    fn step(self) -> Step {
        Step::Work(Box::pin(async move {
            let outcome = self.once().await;
            let Outcome {
                answer,
                record,
                calls,
                kept,
            } = outcome;
            let then = match answer {
                Ok(answer) => self.score(answer, kept),
                Err((reason, class)) => {
                    let tries = self.attempt;
                    let retryable = class.is_retryable();
                    if retryable && tries < self.inner.retry.max_attempts {
                        let wait = self.inner.retry.backoff(tries, None);
                        let next = Run {
                            attempt: self.attempt + 1,
                            ..self
                        };
                        Step::Work(Box::pin(async move {
                            tokio::time::sleep(wait).await;
                            next.step()
                        }))
                    } else {
                        let assessment = evalfleet_types::Assessment {
                            code: Some(kept),
                            ..Default::default()
                        };
                        Step::Finish(Finish::failed(
                            format!("the agent failed ({tries} attempts): {reason}"),
                            assessment,
                        ))
                    }
                }
            };
            Step::Attempted(Box::new(Attempted {
                record,
                calls,
                then,
            }))
        }))
    }

    /// The agent's answer, checked and scored as a chat task's: an LLM
    /// judge's call, if any, is the pipeline's, whose reply comes back to
    /// the item's episode.
    fn score(&self, answer: String, kept: Value) -> Step {
        let row = std::cell::OnceCell::new();
        let item = ItemContext::new(&self.item_id, &row, &self.row_json, self.sample)
            .numbered(self.seq, self.attempt);
        let Ok(mut scoring) = self.scoring.lock() else {
            return Step::Finish(Finish::failed(
                "internal error: the item's scoring was poisoned".to_owned(),
                evalfleet_types::Assessment::default(),
            ));
        };
        scoring.kept = Some(kept.clone());
        let step = scoring
            .chat
            .next(&item, answered_request(), Reply::Answer(answer));
        keeping(step, Some(kept))
    }

    /// Runs the agent once.
    async fn once(&self) -> Outcome {
        let settings = &self.inner.settings;
        let (ran, Closed { made, calls }) = self.execute().await;
        let (sent_at, elapsed) = match &ran {
            Ok((_, sent_at, started)) => (*sent_at, started.elapsed()),
            Err(_) => (std::time::SystemTime::now(), Duration::ZERO),
        };
        let ran = ran.map(|(execution, _, _)| execution);
        let (prompt, completion) = (made.prompt_tokens, made.completion_tokens);
        let last_endpoint = made.last.unwrap_or_default();
        let made_calls = made.calls as usize;
        let telemetry = Telemetry {
            endpoint: last_endpoint.0,
            model: last_endpoint.1,
            latency_ms: ms(elapsed),
            ttft_ms: None,
            tpot_ms: None,
            prompt_tokens: Some(prompt),
            completion_tokens: Some(completion),
            tokens_estimated: false,
            finish_reason: None,
        };
        let (answer, kept) = match ran {
            Ok(Ran::Program(execution)) => judge(&execution, settings.timeout, made_calls),
            Ok(Ran::Server(reply)) => judge_reply(reply, settings.timeout, made_calls, elapsed),
            Err(err) => (
                Err((format!("cannot run the agent: {err}"), ErrorClass::Fatal)),
                serde_json::json!({"error": err.to_string(), "calls": made_calls}),
            ),
        };
        let (error_class, error) = match &answer {
            Ok(_) => (None, None),
            Err((reason, class)) => (Some(*class), Some(reason.clone())),
        };
        Outcome {
            answer,
            record: AttemptRecord {
                seq: self.seq,
                attempt: self.attempt,
                session: 0,
                sent_at_ms: unix_ms(sent_at),
                telemetry,
                http_status: None,
                error_class,
                error,
            },
            calls,
            kept,
        }
    }

    /// The program, run in a slot of the sandbox with the item's address;
    /// and when it started (once it had its slot).
    async fn execute(
        &self,
    ) -> (
        std::io::Result<(Ran, std::time::SystemTime, Instant)>,
        Closed,
    ) {
        let inner = &*self.inner;
        // A program run per item waits for its slot; a server holds its own.
        let slot = match inner.servers {
            None => Some(inner.sandbox.slot().await),
            Some(_) => None,
        };
        // The address opens once the agent can start, and lives a little
        // longer than the run may: the token's expiry is a bound, the
        // attempt's end (closing it) the rule.
        let pass = inner.gateway.open(
            self.seq,
            self.sample,
            self.attempt,
            inner.settings.budget,
            inner.settings.timeout + Duration::from_secs(60),
            self.keeper.as_ref().map(|sink| sink.0.clone()),
        );
        let sent_at = std::time::SystemTime::now();
        let started = Instant::now();
        let ran = match (&slot, &inner.servers) {
            (Some(slot), _) => self.run_in(slot, &pass.token).await.map(Ran::Program),
            (None, Some(servers)) => Ok(Ran::Server(self.ask(servers, &pass.token).await)),
            (None, None) => Err(std::io::Error::other(
                "the agent has neither a slot nor a server",
            )),
        };
        let closed = pass.close().await;
        (ran.map(|ran| (ran, sent_at, started)), closed)
    }

    /// The item handed to a persistent agent with the address `token`, and
    /// its reply.
    async fn ask(&self, servers: &Servers, token: &str) -> ServerReply {
        let inner = &*self.inner;
        let key = format!("{}-{}-{}", self.seq, self.sample, self.attempt);
        let line = format!(
            "{{\"type\":\"item\",\"key\":{},\"item\":{},\"item_id\":{},\"attempt\":{},\"base_url\":{},\"api_key\":{},\"timeout_s\":{}}}",
            Value::String(key.clone()),
            self.given_json,
            Value::String(self.item_id.clone()),
            self.attempt,
            // One address for every item, the item told by its key (the
            // token as the bearer): clients that keep a connection pool per
            // address (LangChain's ChatOpenAI) keep one for the process.
            Value::String(format!("{}/v1", inner.base)),
            Value::String(token.to_owned()),
            inner.settings.timeout.as_secs_f64(),
        );
        servers.ask(key, line, inner.settings.timeout).await
    }

    /// The program, run in `slot` with the address `token`.
    async fn run_in(
        &self,
        slot: &evalfleet_sandbox::sandbox::Slot<'_>,
        token: &str,
    ) -> std::io::Result<Execution> {
        let inner = &*self.inner;
        let dir = slot.workdir()?;
        let mut argv = inner.argv.clone();
        let mut env = vec![
            (
                "OPENAI_BASE_URL".to_owned(),
                format!("{}/gw/{token}/v1", inner.base),
            ),
            ("OPENAI_API_KEY".to_owned(), token.to_owned()),
            ("EVALFLEET_ITEM_ID".to_owned(), self.item_id.clone()),
            ("EVALFLEET_ATTEMPT".to_owned(), self.attempt.to_string()),
        ];
        let mut stdin: &[u8] = &[];
        match inner.settings.input {
            ExecInput::Stdin => stdin = self.given_json.as_bytes(),
            ExecInput::Args => argv.push(self.given_json.clone()),
            ExecInput::File => {
                dir.write_file("item.json", self.given_json.as_bytes())?;
                let path = dir
                    .inside()
                    .join("item.json")
                    .to_string_lossy()
                    .into_owned();
                env.push(("EVALFLEET_ITEM_FILE".to_owned(), path.clone()));
                argv.push(path);
            }
        }
        env.extend(inner.settings.env.iter().cloned());
        slot.run_with(&argv, &dir, stdin, &inner.limits, &env).await
    }
}

/// An agent's run for one attempt: its program's, or a server's reply.
enum Ran {
    Program(Execution),
    Server(ServerReply),
}

/// What a persistent agent's reply came to, as [`judge`] says of a run.
fn judge_reply(
    reply: ServerReply,
    timeout: Duration,
    calls: usize,
    elapsed: Duration,
) -> (Result<String, (String, ErrorClass)>, Value) {
    let mut kept = serde_json::json!({
        "mode": "server",
        "elapsed_ms": ms(elapsed),
        "calls": calls,
    });
    let answer = match reply {
        ServerReply::Output(text) => Ok(text.trim().to_owned()),
        ServerReply::Error(said) => {
            let said = redact_tokens(&said);
            kept["error"] = Value::String(said.clone());
            Err((
                format!("the agent failed the item: {said}"),
                ErrorClass::Retryable,
            ))
        }
        ServerReply::Ended(why) => {
            let why = redact_tokens(&why);
            kept["error"] = Value::String(why.clone());
            Err((why, ErrorClass::Retryable))
        }
        ServerReply::CannotStart(why) => {
            kept["error"] = Value::String(why.clone());
            Err((why, ErrorClass::Fatal))
        }
        ServerReply::TimedOut => Err((
            format!(
                "still running after task.timeout ({}): the agent was told to cancel it",
                humantime::format_duration(timeout)
            ),
            ErrorClass::Retryable,
        )),
    };
    (answer, kept)
}

/// What a run of the agent came to: its answer (standard output), or why
/// it failed and how that counts; and what is kept of it.
fn judge(
    execution: &Execution,
    timeout: Duration,
    calls: usize,
) -> (Result<String, (String, ErrorClass)>, Value) {
    // An SDK's error names the address it called, the item's token in it:
    // dead by now, and still not kept.
    let stderr = redact_tokens(&tail(&execution.stderr, 2000));
    let (exit, signal) = match execution.ended {
        Ended::Exited(code) => (Some(code), None),
        Ended::Signaled(signal) => (None, Some(signal)),
        _ => (None, None),
    };
    let kept = serde_json::json!({
        "exit": exit,
        "signal": signal,
        "ended": format!("{:?}", execution.ended),
        "elapsed_ms": ms(execution.elapsed),
        "stderr": stderr,
        "calls": calls,
    });
    let with_stderr = |what: String| {
        if stderr.trim().is_empty() {
            what
        } else {
            format!("{what}; stderr: {}", stderr.trim())
        }
    };
    let answer = match execution.ended {
        Ended::Exited(0) => Ok(String::from_utf8_lossy(&execution.stdout).trim().to_owned()),
        Ended::Exited(_) if stderr.contains("No space left on device") => Err((
            with_stderr(format!(
                "{} (its folder was full: its files together may hold task.disk_mb)",
                agent_server::ended_in_words(execution.ended)
            )),
            ErrorClass::Retryable,
        )),
        Ended::Exited(_) | Ended::Signaled(_) | Ended::CpuLimit | Ended::MemoryLimit => Err((
            with_stderr(agent_server::ended_in_words(execution.ended)),
            ErrorClass::Retryable,
        )),
        Ended::TimedOut => Err((
            with_stderr(format!(
                "still running after task.timeout ({}): killed",
                humantime::format_duration(timeout)
            )),
            ErrorClass::Retryable,
        )),
        Ended::OutputLimit => Err((
            "wrote more than 16 MiB of output: killed".to_owned(),
            ErrorClass::Fatal,
        )),
    };
    (answer, kept)
}

/// `text` with every gateway token in it replaced by `ef1_…`.
fn redact_tokens(text: &str) -> String {
    static TOKEN: std::sync::LazyLock<Option<regex::Regex>> =
        std::sync::LazyLock::new(|| regex::Regex::new(r"ef1_[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+").ok());
    match TOKEN.as_ref() {
        Some(token) => token.replace_all(text, "ef1_…").into_owned(),
        None => text.to_owned(),
    }
}

/// The last `n` bytes of `bytes` as text (from a character's start).
fn tail(bytes: &[u8], n: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    if text.len() <= n {
        return text.into_owned();
    }
    let mut start = text.len() - n;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    text[start..].to_owned()
}

/// The request an agent's answer stands for, to the chat task's episode
/// (which reads nothing of it but its images and sample, an exec answer
/// being asked for again never).
pub(super) fn answered_request() -> Request {
    Request {
        target: Target::Items,
        messages: serde_json::value::RawValue::NULL.to_owned(),
        sample: 0,
        rejected: None,
        prompt: None,
        images: Default::default(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn tokens_are_not_kept_in_what_an_agent_wrote() {
        let said = "openai.APIConnectionError: http://127.0.0.1:4000/gw/ef1_MTIzCjQ.AbC-_d9/v1/chat/completions";
        assert_eq!(
            super::redact_tokens(said),
            "openai.APIConnectionError: http://127.0.0.1:4000/gw/ef1_…/v1/chat/completions"
        );
    }
}
