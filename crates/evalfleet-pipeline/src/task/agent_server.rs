//! `task.mode: server`: persistent agents. A few agent processes
//! (`task.servers`), each started once in a slot of the sandbox, serve
//! every item of the run over JSON lines: the item comes in on the
//! process's standard input with its own address at the run's gateway, and
//! its answer goes out on its standard output, so that the agent's imports
//! and set-up are paid once per process, not once per item, while each
//! item's calls, budget and timeout stay its own.
//!
//! The protocol (docs/agents.md), one JSON object per line:
//!
//! - to the agent: `{"type": "item", "key": K, "item": {...}, "item_id":
//!   ..., "attempt": N, "base_url": "http://127.0.0.1:PORT/v1", "api_key":
//!   "<token>", "timeout_s": S}`; and `{"type": "cancel", "key": K}` when
//!   the item's time is up or its run stops (its address is closed by then:
//!   its calls are refused);
//! - from the agent: `{"key": K, "output": "..."}` (a value that is not a
//!   string is given as its JSON), or `{"key": K, "error": "..."}` (a
//!   failed attempt). Other lines are ignored (logged).
//!
//! A process that ends (a crash, the kernel's memory kill) fails the items
//! it held, as attempts that are retried, and is started again, after a
//! pause that grows while it keeps ending soon after its start.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use evalfleet_sandbox::sandbox::{Ended, Limits, Sandbox};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, oneshot};

/// The Python helper that turns `def solve(item, client)` (or `async def`)
/// into a server of this protocol: written into each server's folder and
/// put on its `PYTHONPATH` as `evalfleet_agent`.
pub const PYTHON_HELPER: &str = include_str!("evalfleet_agent.py");

/// The longest line an agent may answer with; past it the process is
/// ended (and its items failed).
const MAX_LINE: usize = 64 << 20;
/// What is kept of a process's standard error, for the message of the
/// items it failed when it ended.
const STDERR_TAIL: usize = 4096;

/// How the agent's processes are started.
pub struct Spec {
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    pub limits: Limits,
}

/// What an item's agent came to.
#[derive(Debug)]
pub enum Reply {
    Output(String),
    /// The agent said it failed.
    Error(String),
    /// Its process ended while it held the item.
    Ended(String),
    /// Its process could not be started (a missing program, a sandbox that
    /// refuses it): no retry will do better.
    CannotStart(String),
    /// `task.timeout` passed: the agent was told to cancel it.
    TimedOut,
}

enum Message {
    Item {
        key: String,
        line: String,
        reply: oneshot::Sender<Reply>,
    },
    Cancel {
        key: String,
    },
}

struct Server {
    requests: mpsc::UnboundedSender<Message>,
    in_flight: Arc<AtomicUsize>,
}

/// The run's agent processes.
pub struct Servers {
    servers: Vec<Server>,
}

impl Servers {
    /// `count` processes as `spec` says, each supervised by work that
    /// `spawn` runs (the gateway's, which ends with the run): started now,
    /// so that their set-up overlaps the first items' wait.
    pub fn start(
        sandbox: &Arc<Sandbox>,
        count: usize,
        spec: Spec,
        spawn: impl Fn(futures_util::future::BoxFuture<'static, ()>),
    ) -> Self {
        let spec = Arc::new(spec);
        let servers = (0..count.max(1))
            .map(|index| {
                let (requests, inbox) = mpsc::unbounded_channel();
                spawn(Box::pin(supervise(
                    sandbox.clone(),
                    spec.clone(),
                    index,
                    inbox,
                )));
                Server {
                    requests,
                    in_flight: Arc::new(AtomicUsize::new(0)),
                }
            })
            .collect();
        Self { servers }
    }

    /// Hands `line` (an item's request, keyed `key`) to the least busy
    /// process and waits for its reply, at most `timeout`: past it, or if
    /// this future is dropped, the agent is told to cancel the item.
    pub async fn ask(&self, key: String, line: String, timeout: Duration) -> Reply {
        let Some(server) = self
            .servers
            .iter()
            .min_by_key(|s| s.in_flight.load(Ordering::Relaxed))
        else {
            return Reply::Ended("no agent process".to_owned());
        };
        server.in_flight.fetch_add(1, Ordering::Relaxed);
        let mut asked = Asked {
            server,
            key: Some(key.clone()),
        };
        let (reply, answer) = oneshot::channel();
        if server
            .requests
            .send(Message::Item { key, line, reply })
            .is_err()
        {
            asked.key = None;
            return Reply::Ended("the agent's processes were ended with the run".to_owned());
        }
        let reply = match tokio::time::timeout(timeout, answer).await {
            Ok(Ok(reply)) => {
                asked.key = None;
                reply
            }
            Ok(Err(_)) => {
                asked.key = None;
                Reply::Ended("the agent's processes were ended with the run".to_owned())
            }
            // `asked` tells the agent to cancel it.
            Err(_) => Reply::TimedOut,
        };
        drop(asked);
        reply
    }
}

/// An item handed to a process: while its key is held, dropping it tells
/// the process to cancel the item.
struct Asked<'a> {
    server: &'a Server,
    key: Option<String>,
}

impl Drop for Asked<'_> {
    fn drop(&mut self) {
        self.server.in_flight.fetch_sub(1, Ordering::Relaxed);
        if let Some(key) = self.key.take() {
            let _ = self.server.requests.send(Message::Cancel { key });
        }
    }
}

/// One agent process, started again whenever it ends, until the run's
/// requests end (then it is ended).
async fn supervise(
    sandbox: Arc<Sandbox>,
    spec: Arc<Spec>,
    index: usize,
    mut inbox: mpsc::UnboundedReceiver<Message>,
) {
    let mut quick_ends = 0u32;
    loop {
        let started = Instant::now();
        let why = match serve_once(&sandbox, &spec, &mut inbox).await {
            Some(why) => why,
            // The run is over.
            None => return,
        };
        quick_ends = if started.elapsed() < Duration::from_secs(10) {
            quick_ends + 1
        } else {
            0
        };
        let pause = Duration::from_millis(100)
            .saturating_mul(1 << quick_ends.min(7))
            .min(Duration::from_secs(10));
        tracing::warn!(
            "The agent's process {index} ended ({why}); starting it again in {}.",
            humantime::format_duration(pause)
        );
        // Items that come meanwhile wait in the inbox; cancels of items it
        // no longer holds have nothing to do.
        tokio::time::sleep(pause).await;
    }
}

/// Runs one process until it ends (`Some(why)`; the items it held are
/// failed) or the inbox closes (`None`: ended by us).
async fn serve_once(
    sandbox: &Sandbox,
    spec: &Spec,
    inbox: &mut mpsc::UnboundedReceiver<Message>,
) -> Option<String> {
    let slot = sandbox.slot().await;
    let started = slot.workdir().and_then(|dir| {
        dir.write_file("evalfleet_agent.py", PYTHON_HELPER.as_bytes())?;
        let mut env = spec.env.clone();
        env.push((
            "PYTHONPATH".to_owned(),
            dir.inside().to_string_lossy().into_owned(),
        ));
        let running = slot.start(&spec.argv, &dir, &spec.limits, &env)?;
        Ok((dir, running))
    });
    let (_dir, mut running) = match started {
        Ok(started) => started,
        Err(err) => {
            let why = format!("cannot start the agent: {err}");
            fail_waiting(inbox, &why);
            return Some(why);
        }
    };
    let (Some(mut stdin), Some(stdout), Some(stderr)) = running.streams() else {
        return Some("its standard streams were taken".to_owned());
    };
    let tail = Arc::new(Mutex::new(VecDeque::with_capacity(STDERR_TAIL)));
    let mut lines = Lines::new(stdout);
    let mut pending: HashMap<String, oneshot::Sender<Reply>> = HashMap::new();
    // Lines to write go through a queue of their own, so that an agent that
    // is slow to read never keeps us from reading what it writes.
    let (to_agent, mut outbox) = mpsc::unbounded_channel::<String>();
    let writer = async move {
        while let Some(line) = outbox.recv().await {
            stdin.write_all(line.as_bytes()).await?;
        }
        Ok::<(), std::io::Error>(())
    };
    tokio::pin!(writer);
    let reader = keep_tail(stderr, tail.clone());
    tokio::pin!(reader);
    let mut stderr_done = false;
    enum Event {
        Inbox(Option<Message>),
        Line(std::io::Result<Option<Vec<u8>>>),
        Ended(String),
    }
    let why = loop {
        let event = tokio::select! {
            message = inbox.recv() => Event::Inbox(message),
            line = lines.next() => Event::Line(line),
            written = &mut writer => Event::Ended(format!(
                "its standard input cannot be written: {}",
                written.err().map_or_else(|| "closed".to_owned(), |e| e.to_string())
            )),
            () = &mut reader, if !stderr_done => {
                stderr_done = true;
                continue;
            }
            ended = running.wait() => Event::Ended(ended_in_words(ended)),
        };
        match event {
            Event::Inbox(None) => {
                running.end().await;
                return None;
            }
            Event::Inbox(Some(Message::Item { key, line, reply })) => {
                let _ = to_agent.send(line + "\n");
                pending.insert(key, reply);
            }
            Event::Inbox(Some(Message::Cancel { key })) => {
                if pending.remove(&key).is_some() {
                    let cancel = serde_json::json!({"type": "cancel", "key": key});
                    let _ = to_agent.send(format!("{cancel}\n"));
                }
            }
            Event::Line(Ok(Some(line))) => answer(&line, &mut pending),
            Event::Line(Ok(None)) => break "it closed its standard output".to_owned(),
            Event::Line(Err(err)) => break err.to_string(),
            Event::Ended(why) => break why,
        }
    };
    // Its own end, where it closed its output or input first.
    let _ = tokio::time::timeout(Duration::from_secs(1), running.wait()).await;
    let ended = running.end().await;
    // What it wrote last, now that every process that could write it has
    // ended.
    if !stderr_done {
        let _ = tokio::time::timeout(Duration::from_secs(1), &mut reader).await;
    }
    let why = match ended {
        // Ended by itself (not by us): how says more than what we saw.
        Ended::Exited(_) | Ended::MemoryLimit | Ended::CpuLimit => ended_in_words(ended),
        Ended::Signaled(signal) if signal != SIGKILL => ended_in_words(ended),
        _ => why,
    };
    let stderr = tail
        .lock()
        .map(|t| String::from_utf8_lossy(&t.iter().copied().collect::<Vec<u8>>()).into_owned())
        .unwrap_or_default();
    let message = if stderr.trim().is_empty() {
        format!("the agent's process ended while it held the item: {why}")
    } else {
        format!(
            "the agent's process ended while it held the item: {why}; stderr: {}",
            stderr.trim()
        )
    };
    for (_, reply) in pending.drain() {
        let _ = reply.send(Reply::Ended(message.clone()));
    }
    Some(why)
}

/// SIGKILL: how we end a process (so no news of how it ended by itself).
const SIGKILL: i32 = 9;

/// How an agent's process ended, in the words of its item's error (an
/// agent run per item's too).
pub(super) fn ended_in_words(ended: Ended) -> String {
    match ended {
        Ended::Exited(code) => format!("exited with status {code}"),
        Ended::Signaled(signal) => format!("killed by signal {signal}"),
        Ended::CpuLimit => "past its CPU-time limit: killed".to_owned(),
        Ended::MemoryLimit => {
            "its processes together went past task.memory_mb: the kernel killed one".to_owned()
        }
        Ended::TimedOut | Ended::OutputLimit => format!("{ended:?}"),
    }
}

/// Fails the items already waiting for a process that could not start.
fn fail_waiting(inbox: &mut mpsc::UnboundedReceiver<Message>, why: &str) {
    while let Ok(message) = inbox.try_recv() {
        if let Message::Item { reply, .. } = message {
            let _ = reply.send(Reply::CannotStart(why.to_owned()));
        }
    }
}

/// An agent's line: the reply to the item it names, if that item is still
/// waiting.
fn answer(line: &[u8], pending: &mut HashMap<String, oneshot::Sender<Reply>>) {
    let Ok(Value::Object(mut said)) = serde_json::from_slice::<Value>(line) else {
        tracing::debug!(
            "The agent wrote a line that is not a reply: {}",
            String::from_utf8_lossy(&line[..line.len().min(200)])
        );
        return;
    };
    let Some(Value::String(key)) = said.remove("key") else {
        return;
    };
    let Some(reply) = pending.remove(&key) else {
        return;
    };
    let reply_is = match (said.remove("output"), said.remove("error")) {
        (_, Some(error)) if !error.is_null() => Reply::Error(match error {
            Value::String(text) => text,
            other => other.to_string(),
        }),
        (Some(Value::String(text)), _) => Reply::Output(text),
        (Some(other), _) => Reply::Output(other.to_string()),
        (None, _) => Reply::Error("its reply has neither output nor error".to_owned()),
    };
    let _ = reply.send(reply_is);
}

/// Keeps the last bytes of `stream` in `tail`; ends when the stream does.
async fn keep_tail(stream: impl AsyncRead + Unpin, tail: Arc<Mutex<VecDeque<u8>>>) {
    let mut stream = stream;
    let mut buf = [0u8; 8192];
    loop {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if let Ok(mut tail) = tail.lock() {
                    tail.extend(&buf[..n]);
                    let over = tail.len().saturating_sub(STDERR_TAIL);
                    tail.drain(..over);
                }
            }
        }
    }
}

/// Lines of a stream, each at most [`MAX_LINE`] bytes; a partial line is
/// kept across calls, so that `next` may be dropped in a `select!`.
struct Lines<R> {
    reader: BufReader<R>,
    line: Vec<u8>,
}

impl<R: AsyncRead + Unpin> Lines<R> {
    fn new(stream: R) -> Self {
        Self {
            reader: BufReader::new(stream),
            line: Vec::new(),
        }
    }

    /// The next whole line (without its newline); `None` at the end.
    async fn next(&mut self) -> std::io::Result<Option<Vec<u8>>> {
        loop {
            let available = self.reader.fill_buf().await?;
            if available.is_empty() {
                return Ok(None);
            }
            let (taken, whole) = match available.iter().position(|&b| b == b'\n') {
                Some(at) => (at + 1, true),
                None => (available.len(), false),
            };
            self.line.extend_from_slice(&available[..taken]);
            self.reader.consume(taken);
            if self.line.len() > MAX_LINE + 1 {
                return Err(std::io::Error::other(format!(
                    "it wrote a line of more than {} MiB",
                    MAX_LINE >> 20
                )));
            }
            if whole {
                let mut line = std::mem::take(&mut self.line);
                line.pop();
                return Ok(Some(line));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn lines_come_whole_across_reads_and_a_long_one_is_refused() {
        let data: &[u8] = b"{\"key\": \"a\"}\nsecond\nno end";
        let mut lines = Lines::new(data);
        assert_eq!(lines.next().await.unwrap().unwrap(), b"{\"key\": \"a\"}");
        assert_eq!(lines.next().await.unwrap().unwrap(), b"second");
        // A last line without its newline is not a reply.
        assert!(lines.next().await.unwrap().is_none());
        let long = vec![b'x'; MAX_LINE + 2];
        let mut lines = Lines::new(long.as_slice());
        assert!(lines.next().await.is_err());
    }

    #[test]
    fn replies_go_to_their_items_only() {
        let mut pending = HashMap::new();
        let (a, mut got_a) = oneshot::channel();
        let (b, mut got_b) = oneshot::channel();
        let (c, mut got_c) = oneshot::channel();
        pending.insert("a".to_owned(), a);
        pending.insert("b".to_owned(), b);
        pending.insert("c".to_owned(), c);
        answer(br#"{"key": "b", "output": {"x": 1}}"#, &mut pending);
        answer(br#"{"key": "zz", "output": "stray"}"#, &mut pending);
        answer(b"not json", &mut pending);
        answer(br#"{"key": "a", "error": "no tool"}"#, &mut pending);
        answer(br#"{"key": "c"}"#, &mut pending);
        assert!(matches!(got_b.try_recv(), Ok(Reply::Output(t)) if t == r#"{"x":1}"#));
        assert!(matches!(got_a.try_recv(), Ok(Reply::Error(t)) if t == "no tool"));
        assert!(matches!(got_c.try_recv(), Ok(Reply::Error(_))));
        assert!(pending.is_empty());
    }
}
