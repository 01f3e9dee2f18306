//! Outside metric backends at work: each declared backend
//! (`task.metric_backends`) is one long-lived process, fed one JSON line per
//! answer on its stdin, whose JSON lines of scores come back on its stdout
//! (`docs/metrics.md`, "Metric backends", is the protocol).
//!
//! One task per backend owns its process and the answers it holds: it sends
//! up to `queue` answers ahead of their scores, matches replies by id, and
//! turns whatever goes wrong (the process exits, stops answering within
//! `timeout`, writes a line that is no reply) into errors of the answers it
//! held, with its stderr's last lines: never a score. The process is started
//! again for the answers after. Items wait on their scores as
//! work (`Step::Work`), outside any endpoint's slot, so calls go on
//! while a backend works; when `queue` answers wait, the items behind them
//! wait too, which bounds memory.
//!
//! A backend's `setup` is run once, in a folder of the cache named by the
//! hash of the setup command and the config's folder, under a lock, so
//! concurrent runs make it once and a changed setup makes a new one. It runs
//! in a process group of its own, killed whole at its `setup_timeout` or
//! when the run waiting on it stops.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use evalfleet_types::Score;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::BackendRequest;
use crate::backend::BackendSpec;

/// How many of a process's last stderr lines an error carries.
const STDERR_LINES: usize = 10;
/// How much of one stderr or stdout line an error shows.
const EXCERPT: usize = 300;
/// Starts in a row that end with no score before a backend is given up
/// (its answers after are errors at once).
const MAX_FRUITLESS_STARTS: u32 = 3;
/// The longest line read from a backend's stdout or stderr: a longer one is
/// not held in memory.
const MAX_LINE: usize = 1 << 20;
/// How often a run waiting on another's setup looks at its lock.
const LOCK_POLL: Duration = Duration::from_millis(200);
/// How long a process that was asked to stop may take to exit.
const EXIT_GRACE: Duration = Duration::from_secs(2);

/// Why a backend cannot start: a config or setup problem, found before a
/// run's first call.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(
        "metric backend '{backend}': no cache folder for its setup (set XDG_CACHE_HOME or HOME)"
    )]
    NoCache { backend: String },
    #[error("metric backend '{backend}': cannot prepare {}: {source}", path.display())]
    Io {
        backend: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("metric backend '{backend}': its setup {command} {outcome} (in {}); its output:\n{output}", dir.display())]
    Setup {
        backend: String,
        command: String,
        outcome: String,
        dir: PathBuf,
        output: String,
    },
    #[error("metric backend '{backend}': cannot start {program}: {source}")]
    Start {
        backend: String,
        program: String,
        #[source]
        source: std::io::Error,
    },
}

impl BackendError {
    pub fn fault(&self) -> evalfleet_types::Fault {
        evalfleet_types::Fault::BadInput
    }
}

/// The cache folder setups are made in:
/// `$XDG_CACHE_HOME/evalfleet/metric-backends`, else
/// `$HOME/.cache/evalfleet/metric-backends`.
pub fn cache_root() -> Option<PathBuf> {
    let absolute = |name: &str| {
        std::env::var_os(name)
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
    };
    absolute("XDG_CACHE_HOME")
        .or_else(|| absolute("HOME").map(|home| home.join(".cache")))
        .map(|cache| cache.join("evalfleet").join("metric-backends"))
}

/// A program path as given, or relative to `dir` when it is a relative path
/// with a folder in it (`./score.py`), since the child's own working folder
/// is not where the program is looked up everywhere.
fn program_in(program: &str, dir: &Path) -> PathBuf {
    let path = Path::new(program);
    if path.is_relative() && program.contains('/') {
        dir.join(path)
    } else {
        path.to_owned()
    }
}

/// The last `limit` bytes of `text`, at a character boundary.
fn tail(text: &str, limit: usize) -> &str {
    let mut start = text.len().saturating_sub(limit);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

/// The first [`EXCERPT`] characters of `line`.
fn excerpt(line: &str) -> String {
    let short: String = line.chars().take(EXCERPT).collect();
    if short.len() < line.len() {
        format!("{short}…")
    } else {
        short
    }
}

/// Kills a setup's process group when dropped: whether the setup ended,
/// timed out, or the run that waited on it was stopped (its future dropped),
/// nothing it started goes on writing in the folder.
struct SetupGroup(Option<u32>);

impl Drop for SetupGroup {
    fn drop(&mut self) {
        if let Some(pgid) = self.0 {
            evalfleet_sandbox::kill_group(pgid);
        }
    }
}

/// Runs `spec`'s setup, once: the folder it made, or none without a setup.
/// It waits on a lock, then on the setup, at most `setup_timeout`; the
/// setup runs in a process group of its own, killed whole when it times out
/// or when this future is dropped (a stopped run).
pub async fn prepare(spec: &BackendSpec) -> Result<Option<PathBuf>, BackendError> {
    let (Some(setup), Some(key)) = (&spec.setup, spec.setup_key()) else {
        return Ok(None);
    };
    let backend = || spec.name.clone();
    let root = cache_root().ok_or_else(|| BackendError::NoCache { backend: backend() })?;
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| BackendError::Io {
            backend: spec.name.clone(),
            path,
            source,
        }
    };
    std::fs::create_dir_all(&root).map_err(io(&root))?;
    let lock_path = root.join(format!("{key}.lock"));
    let lock = std::fs::File::create(&lock_path).map_err(io(&lock_path))?;
    // Held until the folder is made: a run beside this one waits here, then
    // finds the folder ready. Polled, so that a stopped run stops waiting.
    loop {
        match lock.try_lock() {
            Ok(()) => break,
            Err(std::fs::TryLockError::WouldBlock) => {
                tokio::time::sleep(LOCK_POLL).await;
            }
            Err(std::fs::TryLockError::Error(err)) => return Err(io(&lock_path)(err)),
        }
    }
    let dir = root.join(&key);
    let ready = dir.join(".ready");
    if ready.exists() {
        return Ok(Some(dir));
    }
    if dir.exists() {
        // A setup that failed or was killed: made again from nothing.
        std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
    }
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    let command = setup.join(" ");
    tracing::info!(
        "Metric backend '{}': running its setup `{command}` in {}.",
        spec.name,
        dir.display()
    );
    let failed = |outcome: String, output: String| BackendError::Setup {
        backend: backend(),
        command: command.clone(),
        outcome,
        dir: dir.clone(),
        output,
    };
    // Its output goes to the log as it is written: none is held in memory,
    // and a slow setup can be watched.
    let log = dir.join("setup.log");
    let out = std::fs::File::create(&log).map_err(io(&log))?;
    let err = out.try_clone().map_err(io(&log))?;
    let mut child = Command::new(program_in(&setup[0], &spec.dir))
        .args(&setup[1..])
        .current_dir(&dir)
        .env("EVALFLEET_BACKEND_DIR", &dir)
        .env("EVALFLEET_CONFIG_DIR", &spec.dir)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|err| failed(format!("cannot start: {err}"), String::new()))?;
    let group = SetupGroup(child.id());
    let outcome = match tokio::time::timeout(spec.setup_timeout, child.wait()).await {
        Ok(Ok(status)) if status.success() => None,
        Ok(Ok(status)) => Some(format!("failed ({status})")),
        Ok(Err(err)) => Some(format!("could not be waited on: {err}")),
        Err(_) => Some(format!(
            "did not finish within {} (setup_timeout); it was killed with every process it started",
            humantime::format_duration(spec.setup_timeout)
        )),
    };
    // What it started in the background ends with it.
    drop(group);
    let _ = child.wait().await;
    if let Some(outcome) = outcome {
        let text = std::fs::read(&log).unwrap_or_default();
        let text = String::from_utf8_lossy(&text);
        return Err(failed(outcome, tail(&text, 4000).to_owned()));
    }
    std::fs::write(&ready, &command).map_err(io(&ready))?;
    Ok(Some(dir))
}

/// What [`LineReader::next`] read.
#[derive(Debug, PartialEq)]
enum Read {
    Line(String),
    /// A line longer than [`MAX_LINE`]: its start. The rest of it is
    /// skipped by the next reads.
    TooLong(String),
    End,
}

/// Reads lines of at most [`MAX_LINE`] bytes. Cancel-safe (what was read
/// of a line is kept here), so it can wait in a `select!`.
struct LineReader<R> {
    reader: BufReader<R>,
    line: Vec<u8>,
    /// Skipping the rest of a line too long to read.
    skipping: bool,
}

impl<R: tokio::io::AsyncRead + Unpin> LineReader<R> {
    fn new(inner: R) -> Self {
        Self {
            reader: BufReader::new(inner),
            line: Vec::new(),
            skipping: false,
        }
    }

    async fn next(&mut self) -> std::io::Result<Read> {
        loop {
            let available = self.reader.fill_buf().await?;
            if available.is_empty() {
                if self.line.is_empty() {
                    return Ok(Read::End);
                }
                let line = String::from_utf8_lossy(&self.line).into_owned();
                self.line.clear();
                return Ok(Read::Line(line));
            }
            let newline = available.iter().position(|&b| b == b'\n');
            let taken = newline.map_or(available.len(), |at| at + 1);
            let skipping = self.skipping;
            if !skipping {
                let bytes = &available[..newline.unwrap_or(available.len())];
                self.line.extend_from_slice(bytes);
            }
            self.reader.consume(taken);
            if skipping {
                self.skipping = newline.is_none();
                continue;
            }
            if self.line.len() > MAX_LINE {
                let start = String::from_utf8_lossy(&self.line[..EXCERPT * 4]).into_owned();
                self.line.clear();
                self.skipping = newline.is_none();
                return Ok(Read::TooLong(start));
            }
            if newline.is_some() {
                let line = String::from_utf8_lossy(&self.line).into_owned();
                self.line.clear();
                return Ok(Read::Line(line));
            }
        }
    }
}

/// The last lines a process wrote on its stderr.
type StderrTail = Arc<Mutex<VecDeque<String>>>;

/// A backend's process as it runs.
struct Process {
    child: Child,
    stdin: ChildStdin,
    stdout: LineReader<ChildStdout>,
    stderr: StderrTail,
    /// Ends when its stderr does.
    stderr_done: tokio::task::JoinHandle<()>,
    /// Lines read from its stdout.
    lines: u64,
}

/// How a backend's program is started.
struct Launcher {
    spec: Arc<BackendSpec>,
    setup_dir: Option<PathBuf>,
    tracker: TaskTracker,
}

impl Launcher {
    fn start(&self) -> Result<Process, BackendError> {
        let spec = &self.spec;
        let dir = self
            .setup_dir
            .as_ref()
            .map(|d| d.to_string_lossy().into_owned())
            .unwrap_or_default();
        let args: Vec<String> = spec
            .command
            .iter()
            .map(|a| a.replace("{setup_dir}", &dir))
            .collect();
        let mut command = Command::new(program_in(&args[0], &spec.dir));
        command
            .args(&args[1..])
            .current_dir(&spec.dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let Some(setup_dir) = &self.setup_dir {
            command.env("EVALFLEET_BACKEND_DIR", setup_dir);
        }
        let start_error = |source| BackendError::Start {
            backend: spec.name.clone(),
            program: args[0].clone(),
            source,
        };
        let mut child = command.spawn().map_err(start_error)?;
        let missing = || start_error(std::io::Error::other("its pipes were not made"));
        let stdin = child.stdin.take().ok_or_else(missing)?;
        let stdout = child.stdout.take().ok_or_else(missing)?;
        let stderr = child.stderr.take().ok_or_else(missing)?;
        let tail: StderrTail = Arc::default();
        let kept = tail.clone();
        let name = spec.name.clone();
        let stderr_done = self.tracker.spawn(async move {
            let mut lines = LineReader::new(stderr);
            loop {
                let line = match lines.next().await {
                    Ok(Read::Line(line)) => line,
                    Ok(Read::TooLong(start)) => {
                        format!("{} (a line longer than {MAX_LINE} bytes)", excerpt(&start))
                    }
                    Ok(Read::End) | Err(_) => break,
                };
                tracing::debug!("Metric backend '{name}' says: {line}");
                if let Ok(mut kept) = kept.lock() {
                    if kept.len() == STDERR_LINES {
                        kept.pop_front();
                    }
                    kept.push_back(excerpt(&line));
                }
            }
        });
        Ok(Process {
            child,
            stdin,
            stdout: LineReader::new(stdout),
            stderr: tail,
            stderr_done,
            lines: 0,
        })
    }
}

impl Process {
    /// Stops the process (killed with `kill`): how it ended, and what its
    /// stderr ended with.
    async fn stop(mut self, kill: bool) -> (String, String) {
        if kill {
            let _ = self.child.start_kill();
        }
        drop(self.stdin);
        let status = match tokio::time::timeout(EXIT_GRACE, self.child.wait()).await {
            Ok(Ok(status)) => status.to_string(),
            Ok(Err(err)) => format!("status unknown: {err}"),
            Err(_) => {
                let _ = self.child.start_kill();
                "still running; killed".to_owned()
            }
        };
        // Its last words, once it has written them.
        let _ = tokio::time::timeout(EXIT_GRACE, &mut self.stderr_done).await;
        let stderr: Vec<String> = self
            .stderr
            .lock()
            .map(|t| t.iter().cloned().collect())
            .unwrap_or_default();
        let stderr = if stderr.is_empty() {
            "nothing on its stderr".to_owned()
        } else {
            // One line, as errors are shown in tables and summaries.
            format!("its stderr ends: {}", stderr.join(" | "))
        };
        (status, stderr)
    }
}

/// An answer to score, and where its score goes.
struct Job {
    item: String,
    metric: String,
    answer: Value,
    references: Vec<Value>,
    params: serde_json::Map<String, Value>,
    reply: oneshot::Sender<Score>,
}

/// The started backends of a task.
/// Dropped, they take no more answers; each backend's task scores those it
/// holds, closes its process's input and stops it.
pub struct Backends {
    by_name: HashMap<String, mpsc::Sender<Job>>,
    queue: usize,
}

impl Backends {
    /// Prepares (runs setups) and starts the backends of `specs` that
    /// `used` names; `None` when it names none.
    pub async fn start(
        specs: &[BackendSpec],
        used: &[&str],
    ) -> Result<Option<Arc<Self>>, BackendError> {
        let specs: Vec<Arc<BackendSpec>> = specs
            .iter()
            .filter(|s| used.contains(&s.name.as_str()))
            .cloned()
            .map(Arc::new)
            .collect();
        if specs.is_empty() {
            return Ok(None);
        }
        let tracker = TaskTracker::new();
        let mut by_name = HashMap::new();
        let mut queue = 0usize;
        for spec in specs {
            let setup_dir = prepare(&spec).await?;
            let launcher = Launcher {
                spec: spec.clone(),
                setup_dir,
                tracker: tracker.clone(),
            };
            // A program that cannot be started at all is found now.
            let first = launcher.start()?;
            let (jobs, receiver) = mpsc::channel(spec.queue);
            queue = queue.saturating_add(spec.queue);
            by_name.insert(spec.name.clone(), jobs);
            tracker.spawn(serve(launcher, first, receiver));
        }
        tracker.close();
        Ok(Some(Arc::new(Self { by_name, queue })))
    }

    /// How many answers the backends hold at most, together.
    pub fn queue(&self) -> usize {
        self.queue
    }

    /// Scores `item`'s answers, one per request: metric key → score (an
    /// error when its backend could not score it).
    pub async fn score(&self, item: &str, requests: Vec<BackendRequest>) -> Vec<(String, Score)> {
        let scored = requests
            .into_iter()
            .map(|request| self.score_one(item, request.backend.clone(), request));
        futures_util::future::join_all(scored).await
    }

    async fn score_one(
        &self,
        item: &str,
        backend: String,
        request: BackendRequest,
    ) -> (String, Score) {
        let BackendRequest {
            key,
            metric,
            answer,
            references,
            params,
            ..
        } = request;
        let references = match references {
            Ok(references) => references,
            Err(error) => return (key, Score::error(error)),
        };
        let Some(jobs) = self.by_name.get(&backend) else {
            return (
                key,
                Score::error(format!("metric backend '{backend}' is not started")),
            );
        };
        let (reply, score) = oneshot::channel();
        let job = Job {
            item: item.to_owned(),
            metric,
            answer,
            references,
            params,
            reply,
        };
        if jobs.send(job).await.is_err() {
            return (
                key,
                Score::error(format!("metric backend '{backend}' has stopped")),
            );
        }
        let score = score.await.unwrap_or_else(|_| {
            Score::error(format!(
                "metric backend '{backend}' stopped before scoring it"
            ))
        });
        (key, score)
    }
}

/// A sent answer waiting for its score.
struct Pending {
    reply: oneshot::Sender<Score>,
}

/// One backend: its process and the answers it holds.
struct Serving {
    launcher: Launcher,
    process: Option<Process>,
    pending: HashMap<String, Pending>,
    next_id: u64,
    /// When the backend last showed progress (a reply, or an answer sent
    /// while it held none): it must reply within its timeout of it.
    progress: Instant,
    /// Starts in a row that ended with no score, and how the last ended.
    fruitless: u32,
    last_end: String,
    /// Whether the running process has scored anything.
    scored: bool,
}

async fn next_line(process: &mut Option<Process>) -> std::io::Result<Read> {
    match process {
        Some(p) => p.stdout.next().await,
        None => std::future::pending().await,
    }
}

async fn serve(launcher: Launcher, first: Process, mut jobs: mpsc::Receiver<Job>) {
    let mut s = Serving {
        launcher,
        process: Some(first),
        pending: HashMap::new(),
        next_id: 0,
        progress: Instant::now(),
        fruitless: 0,
        last_end: String::new(),
        scored: false,
    };
    let queue = s.launcher.spec.queue;
    let timeout = s.launcher.spec.timeout;
    let mut open = true;
    loop {
        if !open && s.pending.is_empty() {
            break;
        }
        let deadline = s.progress + timeout;
        tokio::select! {
            job = jobs.recv(), if open && s.pending.len() < queue => match job {
                Some(job) => s.send(job).await,
                None => open = false,
            },
            line = next_line(&mut s.process) => match line {
                Ok(Read::Line(line)) => s.read(line).await,
                Ok(Read::TooLong(start)) => s.too_long(&start).await,
                Ok(Read::End) | Err(_) => {
                    s.end(false, |how| format!("exited ({how}) before scoring it")).await;
                }
            },
            () = tokio::time::sleep_until(deadline), if !s.pending.is_empty() => {
                s.end(true, |how| format!(
                    "gave no score within {} (it was stopped: {how})",
                    humantime::format_duration(timeout)
                )).await;
            }
        }
    }
    if let Some(process) = s.process.take() {
        // Its input ends: a well-behaved backend exits by itself.
        let _ = process.stop(false).await;
    }
}

impl Serving {
    fn name(&self) -> &str {
        &self.launcher.spec.name
    }

    /// Sends `job`'s answer, starting the process first when none runs.
    async fn send(&mut self, job: Job) {
        if self.process.is_none() {
            if self.fruitless >= MAX_FRUITLESS_STARTS {
                let _ = job.reply.send(Score::error(format!(
                    "metric backend '{}' was given up: it stopped {} times in a row without a score; the last time it {}",
                    self.name(),
                    self.fruitless,
                    self.last_end
                )));
                return;
            }
            match self.launcher.start() {
                Ok(process) => {
                    self.process = Some(process);
                    self.scored = false;
                }
                Err(err) => {
                    let _ = job.reply.send(Score::error(err.to_string()));
                    return;
                }
            }
        }
        self.next_id += 1;
        let id = self.next_id.to_string();
        let mut line = json!({
            "id": id,
            "item": job.item,
            "metric": job.metric,
            "answer": job.answer,
            "references": job.references,
            "params": job.params,
        })
        .to_string();
        line.push('\n');
        if self.pending.is_empty() {
            self.progress = Instant::now();
        }
        self.pending.insert(id, Pending { reply: job.reply });
        let deadline = self.progress + self.launcher.spec.timeout;
        let Some(process) = self.process.as_mut() else {
            return;
        };
        match tokio::time::timeout_at(deadline, process.stdin.write_all(line.as_bytes())).await {
            Ok(Ok(())) => {}
            // Its input is closed: it exited, which its output says next.
            Ok(Err(_)) => {}
            Err(_) => {
                let timeout = self.launcher.spec.timeout;
                self.end(true, |how| {
                    format!(
                        "took no input within {} (it was stopped: {how})",
                        humantime::format_duration(timeout)
                    )
                })
                .await;
            }
        }
    }

    /// A line of the process's stdout longer than [`MAX_LINE`]: a broken
    /// protocol, for every answer it holds.
    async fn too_long(&mut self, start: &str) {
        let number = self.process.as_mut().map_or(0, |p| {
            p.lines += 1;
            p.lines
        });
        self.end(true, |how| {
            format!(
                "wrote line {number} of its output longer than {MAX_LINE} bytes, which is no reply: {} (it was stopped: {how})",
                excerpt(start)
            )
        })
        .await;
    }

    /// One line of the process's stdout.
    async fn read(&mut self, line: String) {
        let number = self.process.as_mut().map_or(0, |p| {
            p.lines += 1;
            p.lines
        });
        if line.trim().is_empty() {
            return;
        }
        let name = self.name().to_owned();
        let parsed = serde_json::from_str::<Value>(&line);
        let id = match &parsed {
            Ok(value) => match value.get("id") {
                Some(Value::String(s)) => Some(s.clone()),
                Some(Value::Number(n)) => Some(n.to_string()),
                _ => None,
            },
            // A line that is not JSON is still one answer's when its id can
            // be read (Python writes NaN so).
            Err(_) => id_in(&line),
        };
        let Some(pending) = id.as_ref().and_then(|id| self.pending.remove(id)) else {
            let why = match (&parsed, &id) {
                (Err(err), _) => format!("is not JSON ({err})"),
                (Ok(_), None) => "has no id".to_owned(),
                (Ok(_), Some(id)) => format!("answers id {id}, which is not waiting for a score"),
            };
            self.end(true, |how| {
                format!(
                    "wrote line {number} of its output, which {why}: {} (it was stopped: {how})",
                    excerpt(&line)
                )
            })
            .await;
            return;
        };
        self.progress = Instant::now();
        let score = match parsed {
            Err(err) => Score::error(format!(
                "metric backend '{name}': line {number} of its output is not JSON ({err}): {}",
                excerpt(&line)
            )),
            Ok(value) => reply_score(&name, number, &line, value),
        };
        if score.value.is_some() {
            self.scored = true;
            self.fruitless = 0;
        }
        let _ = pending.reply.send(score);
    }

    /// The process ends (killed with `kill`): every answer it held gets an
    /// error saying how (`what` is given its exit status) and what its
    /// stderr ended with.
    async fn end(&mut self, kill: bool, what: impl FnOnce(&str) -> String) {
        let (status, stderr) = match self.process.take() {
            Some(process) => process.stop(kill).await,
            None => ("not running".to_owned(), String::new()),
        };
        let message = format!("{}; {stderr}", what(&status));
        if !self.scored {
            self.fruitless += 1;
        }
        self.scored = false;
        if !self.pending.is_empty() {
            tracing::warn!(
                "Metric backend '{}' {message}; {} answer(s) it held are not scored.",
                self.name(),
                self.pending.len()
            );
        }
        let error = format!("metric backend '{}' {message}", self.name());
        for (_, pending) in self.pending.drain() {
            let _ = pending.reply.send(Score::error(error.clone()));
        }
        self.last_end = message;
    }
}

/// The id of a line that is not JSON, when one can be read from it.
fn id_in(line: &str) -> Option<String> {
    let at = line.find("\"id\"")? + 4;
    let rest = line[at..].trim_start().strip_prefix(':')?.trim_start();
    if let Some(quoted) = rest.strip_prefix('"') {
        return quoted.split('"').next().map(str::to_owned);
    }
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    (!digits.is_empty()).then_some(digits)
}

/// The score a reply line gives: its `score` (a finite number) with its
/// `details`, or its `error`.
fn reply_score(backend: &str, number: u64, line: &str, reply: Value) -> Score {
    let bad = |why: &str| {
        Score::error(format!(
            "metric backend '{backend}': line {number} of its output {why}: {}",
            excerpt(line)
        ))
    };
    if let Some(error) = reply.get("error").filter(|e| !e.is_null()) {
        let error = error
            .as_str()
            .map_or_else(|| error.to_string(), str::to_owned);
        return Score::error(format!("metric backend '{backend}': {error}"));
    }
    let Some(value) = reply.get("score") else {
        return bad("has neither a score nor an error");
    };
    let Some(value) = value.as_f64().filter(|v| v.is_finite()) else {
        return bad("has a score that is not a finite number");
    };
    let mut score = Score::value(value);
    match reply.get("details") {
        None | Some(Value::Null) => {}
        Some(Value::Object(details)) => {
            for (k, v) in details {
                if k != "value" && k != "error" {
                    score.detail.insert(k.clone(), v.clone());
                }
            }
        }
        Some(_) => return bad("has details that are not a JSON object"),
    }
    score
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_is_a_finite_score_or_an_error_and_nothing_else() {
        let score = |line: &str| reply_score("b", 3, line, serde_json::from_str(line).unwrap());
        let good = score(r#"{"id": "1", "score": 0.5, "details": {"edits": 2}}"#);
        assert_eq!((good.value, good.count("edits")), (Some(0.5), 2));
        let err = score(r#"{"id": "1", "error": "no reference"}"#);
        assert_eq!(
            err.error.as_deref(),
            Some("metric backend 'b': no reference")
        );
        for (line, why) in [
            (r#"{"id": "1"}"#, "neither a score nor an error"),
            (r#"{"id": "1", "score": "0.5"}"#, "not a finite number"),
            (r#"{"id": "1", "score": null}"#, "not a finite number"),
            (
                r#"{"id": "1", "score": 1, "details": 3}"#,
                "not a JSON object",
            ),
        ] {
            let s = score(line);
            assert_eq!(s.value, None, "{line}");
            let message = s.error.unwrap();
            assert!(
                message.contains(why) && message.contains("line 3"),
                "{message}"
            );
        }
    }

    #[tokio::test]
    async fn a_line_longer_than_the_limit_is_not_held_and_the_next_is_read() {
        let mut input = b"short\n".to_vec();
        input.extend(std::iter::repeat_n(b'x', 3 * MAX_LINE));
        input.extend(b"\nafter\nlast");
        let mut lines = LineReader::new(&input[..]);
        assert_eq!(lines.next().await.unwrap(), Read::Line("short".to_owned()));
        let Read::TooLong(start) = lines.next().await.unwrap() else {
            panic!("a long line is read whole");
        };
        assert!(start.len() < 2000 && start.starts_with("xxx"));
        assert!(lines.line.capacity() < 2 * MAX_LINE + 2 * 8192);
        assert_eq!(lines.next().await.unwrap(), Read::Line("after".to_owned()));
        assert_eq!(lines.next().await.unwrap(), Read::Line("last".to_owned()));
        assert_eq!(lines.next().await.unwrap(), Read::End);
    }

    #[test]
    fn the_id_of_a_line_that_is_not_json_is_read_when_it_can_be() {
        assert_eq!(id_in(r#"{"id": "7", "score": NaN}"#).as_deref(), Some("7"));
        assert_eq!(id_in(r#"{"score": NaN, "id":12}"#).as_deref(), Some("12"));
        assert_eq!(id_in("Traceback (most recent call last):"), None);
    }
}
