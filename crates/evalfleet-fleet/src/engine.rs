//! Processes the fleet starts: engines (`local`), engines on other hosts
//! with their tunnels (`remote`), and one-off commands (`start_cmd`,
//! `stop_cmd`).
//!
//! A long-running process is started under a supervisor: `evalfleet
//! supervise`, which leaves the run's session and process group, puts the
//! command in a process group of its own and watches a pipe from the run.
//! When the run stops it, or dies in any way (SIGKILL, a closed terminal's
//! SIGHUP, a signal to the run's whole group: the kernel closes the pipe),
//! the supervisor ends the whole group (SIGTERM, a grace period, SIGKILL)
//! and runs its `--on-exit` command. So no engine outlives its run.
//!
//! Each supervisor holds a claim in the store's `.engines/` directory and
//! marks what it starts with it, so that the leftovers of a supervisor
//! killed before it could clean up are ended by the next start of the same
//! engine: a start never fails because a dead run left something behind.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::process::{Child, ChildStdin, Command};

use evalfleet_config::{Engine, Remote};

/// How to start supervised processes.
#[derive(Debug, Clone)]
pub struct Launcher {
    /// The `evalfleet` binary (its `supervise` command).
    pub program: PathBuf,
    /// Where engine logs go (`runs/RUN_ID/`).
    pub log_dir: PathBuf,
    /// Where supervisors hold their claims (`runs/.engines/`, an absolute
    /// path): one directory for every run of the store.
    pub claims: PathBuf,
}

/// What a supervised process claims.
#[derive(Debug, Clone)]
pub enum Claim {
    /// A claim of its own: a local engine. Before it starts, what dead
    /// supervisors of the same endpoint left is ended (several live runs of
    /// a store may each run an engine of that name, on ports of their own).
    Own { endpoint: String },
    /// A claim one run of the store holds at a time: a remote engine's
    /// tmux session on its host. A start waits up to `wait` for a live
    /// holder (a run still stopping it), then fails saying who holds it.
    Shared { key: String, wait: Duration },
}

/// One process to start under a supervisor.
#[derive(Debug, Clone)]
pub struct Job<'a> {
    /// Its log is `LOG_DIR/NAME.log`.
    pub name: &'a str,
    /// Run by `sh -c`.
    pub command: &'a str,
    /// What the log says was started, when the command is too long or
    /// holds secrets.
    pub label: Option<&'a str>,
    pub env: &'a [(String, String)],
    /// Run once the process group has ended.
    pub on_exit: Option<&'a str>,
    pub stop_grace: Duration,
    pub claim: Claim,
}

/// Who started a remote engine: the store (the same for every run of it)
/// and this start, written beside the engine's tmux session so that a
/// later start knows a leftover of this store from someone else's session,
/// and a stop ends only the session it started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub store: String,
    pub start: String,
}

/// The first 16 hex digits of the SHA-256 of `parts`, joined by NULs.
fn short_hash(parts: &[&[u8]]) -> String {
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update(part);
        hasher.update([0u8]);
    }
    hex::encode(hasher.finalize())[..16].to_owned()
}

impl Launcher {
    /// This store's key: the same for every run of the store on this
    /// machine, and not another store's.
    pub fn store_key(&self) -> String {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        short_hash(&[
            host.trim().as_bytes(),
            self.claims.as_os_str().as_encoded_bytes(),
        ])
    }

    /// A new owner for a remote engine's start.
    pub fn owner(&self) -> Owner {
        Owner {
            store: self.store_key(),
            start: format!("{:016x}", fastrand::u64(..)),
        }
    }

    /// Starts `job` under a supervisor, its output appended to
    /// `LOG_DIR/NAME.log`.
    pub async fn spawn(&self, job: &Job<'_>) -> std::io::Result<Supervised> {
        std::fs::create_dir_all(&self.log_dir)?;
        std::fs::create_dir_all(&self.claims)?;
        let log = self.log_dir.join(format!("{}.log", job.name));
        let pid_file = self.log_dir.join(format!("{}.pid", job.name));
        let _ = std::fs::remove_file(&pid_file);
        let mut out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        // Each start's lines follow a line of their own: a start failure
        // quotes this start's lines only.
        writeln!(
            out,
            "{START_MARK}{} at {}",
            job.name,
            humantime::format_rfc3339_seconds(std::time::SystemTime::now())
        )?;
        let err = out.try_clone()?;
        let mut cmd = Command::new(&self.program);
        cmd.arg("supervise")
            .arg("--pid-file")
            .arg(&pid_file)
            .arg("--grace")
            .arg(format!("{}ms", job.stop_grace.as_millis()));
        match &job.claim {
            // `@` is in no endpoint name: one endpoint's claims are not
            // another's whose name begins like it.
            Claim::Own { endpoint } => {
                let prefix = format!("local-{endpoint}@");
                cmd.arg("--claim")
                    .arg(
                        self.claims
                            .join(format!("{prefix}{:016x}.lock", fastrand::u64(..))),
                    )
                    .arg("--leftovers")
                    .arg(self.claims.join(prefix));
            }
            Claim::Shared { key, wait } => {
                cmd.arg("--claim")
                    .arg(self.claims.join(format!("{key}.lock")))
                    .arg("--claim-wait")
                    .arg(format!("{}ms", wait.as_millis()));
            }
        }
        if let Some(on_exit) = job.on_exit {
            cmd.arg("--on-exit").arg(on_exit);
        }
        if let Some(label) = job.label {
            cmd.arg("--label").arg(label);
        }
        cmd.arg("--")
            .arg(job.command)
            .envs(job.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::piped())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .kill_on_drop(false);
        let mut child = cmd.spawn()?;
        let stdin = child.stdin.take();
        let pid = read_pid(&pid_file, &mut child).await;
        Ok(Supervised {
            child,
            stdin,
            pid,
            log,
        })
    }
}

/// A supervised process.
#[derive(Debug)]
pub struct Supervised {
    child: Child,
    stdin: Option<ChildStdin>,
    /// The command's own process (the leader of its group).
    pub pid: Option<u32>,
    pub log: PathBuf,
}

/// Quotes a word for `sh`.
pub fn shell_quote(word: &str) -> String {
    if !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=@,+%".contains(c))
    {
        return word.to_owned();
    }
    format!("'{}'", word.replace('\'', r"'\''"))
}

/// A command line from words, quoted for `sh`.
pub fn shell_join<S: AsRef<str>>(words: &[S]) -> String {
    words
        .iter()
        .map(|w| shell_quote(w.as_ref()))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The supervisor writes the command's pid once it has started it.
async fn read_pid(pid_file: &Path, child: &mut Child) -> Option<u32> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut wait = Duration::from_millis(1);
    while tokio::time::Instant::now() < deadline {
        if let Ok(text) = std::fs::read_to_string(pid_file)
            && let Ok(pid) = text.trim().parse()
        {
            return Some(pid);
        }
        if matches!(child.try_wait(), Ok(Some(_))) {
            return None;
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_millis(50));
    }
    None
}

impl Supervised {
    /// Waits for the process (and its supervisor) to end.
    pub async fn wait(&mut self) -> std::io::Result<ExitStatus> {
        self.child.wait().await
    }

    /// `why`, then the engine's own last lines in its log (the
    /// supervisor's notes left out, its errors kept), when it printed any.
    pub fn with_last_lines(&self, why: String) -> String {
        match last_lines(&self.log, 6) {
            Some(lines) => format!("{why}; its last lines: {lines}"),
            None => why,
        }
    }

    /// Stops it: closing the pipe tells the supervisor to end the group
    /// gracefully; if it has not after `grace` twice and a margin (a
    /// remote engine's stop waits out the grace on its host after the
    /// tunnel's), it is killed.
    pub async fn stop(mut self, grace: Duration) {
        drop(self.stdin.take());
        let margin = grace * 2 + Duration::from_secs(10);
        if tokio::time::timeout(margin, self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// The line of an engine's log before each start's lines.
const START_MARK: &str = "==== evalfleet: starting ";

/// The last `n` lines of the last start in the log at `path` that the
/// engine wrote (or that say why the supervisor could not start it), each
/// cut to 240 characters.
pub fn last_lines(path: &Path, n: usize) -> Option<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(path).ok()?;
    let len = file.metadata().ok()?.len();
    // The end of the log is enough; an engine may log a lot.
    file.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)))
        .ok()?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).ok()?;
    let text = String::from_utf8_lossy(&bytes);
    let mut lines: Vec<String> = text
        .lines()
        .rev()
        .take_while(|line| !line.starts_with(START_MARK))
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .filter(|line| {
            !line.starts_with("evalfleet supervise: ")
                || line.starts_with("evalfleet supervise: error:")
        })
        .take(n)
        .map(|line| {
            if line.chars().count() > 240 {
                format!("{}…", line.chars().take(240).collect::<String>())
            } else {
                line.to_owned()
            }
        })
        .collect();
    lines.reverse();
    (!lines.is_empty()).then(|| lines.join(" | "))
}

/// Runs a one-off shell command to completion, within `timeout`; the error
/// says what it printed.
pub async fn run_shell(command: &str, timeout: Duration) -> Result<(), String> {
    run_argv(&["sh", "-c", command], timeout).await
}

/// Runs a program with arguments (no shell) to completion, within `timeout`.
pub async fn run_argv<S: AsRef<str>>(argv: &[S], timeout: Duration) -> Result<(), String> {
    let Some((program, args)) = argv.split_first() else {
        return Err("empty command".to_owned());
    };
    let run = Command::new(program.as_ref())
        .args(args.iter().map(AsRef::as_ref))
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(timeout, run).await {
        Err(_) => Err(format!(
            "did not finish within {}",
            humantime::format_duration(timeout)
        )),
        Ok(Err(err)) => Err(format!("cannot run {}: {err}", program.as_ref())),
        Ok(Ok(out)) if out.status.success() => Ok(()),
        Ok(Ok(out)) => {
            let said = String::from_utf8_lossy(&out.stderr);
            let said = said.trim();
            Err(format!(
                "exited with {}{}",
                out.status,
                if said.is_empty() {
                    String::new()
                } else {
                    format!(": {}", said.chars().take(500).collect::<String>())
                }
            ))
        }
    }
}

/// Where a remote host keeps each engine's output, owner and lock,
/// relative to the SSH login's home directory.
pub const REMOTE_STATE: &str = ".local/state/evalfleet";

/// The commands of a remote engine, as argument lists (no local shell).
///
/// The engine runs in a detached tmux session on the host, its output in
/// `REMOTE_STATE/SESSION.log` there; beside it, `SESSION.owner` says which
/// store and which start made the session, and `SESSION.lock` (`flock`,
/// where the host has it) keeps a start and a stop from crossing. Every
/// remote command runs under `sh -c`, whatever the login shell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteCommands {
    /// Starts the engine in its tmux session; a session left by an earlier
    /// run of the same store is replaced, anyone else's is refused.
    pub start: Vec<String>,
    /// Forwards `local_port` to the engine's port and prints the engine's
    /// output until the engine exits.
    pub tunnel: Vec<String>,
    /// Ends the session if it is still the one `start` made: SIGTERM to
    /// the engine's process group, SIGKILL after the grace period.
    pub stop: Vec<String>,
}

/// The part of every remote script that names the session, takes the
/// host's lock and knows how to end the session.
fn remote_prelude(session: &str, owner: &Owner, grace: Duration) -> String {
    let tenths = (grace.as_millis() / 100).max(1);
    // A start or a stop holds the lock for one grace period at most.
    let wait = grace.as_secs() * 2 + 60;
    format!(
        r#"cd || exit 1
S={session}
me={me}
d={REMOTE_STATE}
mkdir -p "$d" || exit 1
exec 9>>"$d/$S.lock"
if command -v flock >/dev/null 2>&1 && ! flock -w {wait} 9; then
  echo "evalfleet: $d/$S.lock on $(uname -n) stayed locked for {wait}s" >&2; exit 1
fi
end_session() {{
  p=$(tmux display-message -p -t "=$S:" '#{{pane_pid}}' 2>/dev/null)
  if [ -n "$p" ]; then
    kill -TERM -"$p" 2>/dev/null
    n=0
    while kill -0 -"$p" 2>/dev/null && [ "$n" -lt {tenths} ]; do sleep 0.1; n=$((n+1)); done
    kill -KILL -"$p" 2>/dev/null
  fi
  tmux kill-session -t "=$S" 2>/dev/null 9>&-
  return 0
}}
"#,
        session = shell_quote(session),
        me = shell_quote(&format!("{} {}", owner.store, owner.start)),
    )
}

/// The claim of a remote engine: its host and session, which one run of a
/// store at a time may keep.
pub fn remote_claim(remote: &Remote) -> String {
    format!(
        "remote-{}",
        short_hash(&[remote.host.as_bytes(), remote.session.as_bytes()])
    )
}

/// The shell that runs in the tmux pane: the environment, the engine's
/// command as written (so a leading `VAR=value` works), then its status.
fn pane_script(engine: &Engine, model: &str, remote_port: &str) -> String {
    let mut script = Vec::new();
    if let Some(gpu) = &engine.gpu {
        script.push(format!("export CUDA_VISIBLE_DEVICES={}", shell_quote(gpu)));
    }
    for (key, value) in &engine.env {
        script.push(format!("export {key}={}", shell_quote(value.expose())));
    }
    script.push(engine.render(model, remote_port));
    script.push(r#"echo "evalfleet: the engine exited with status $?""#.to_owned());
    script.join("\n")
}

/// `sh -c SCRIPT`, as one word for the remote login shell.
fn remote_sh(script: &str) -> String {
    format!("sh -c {}", shell_quote(script))
}

impl RemoteCommands {
    pub fn new(
        remote: &Remote,
        model: &str,
        remote_port: impl std::fmt::Display,
        local_port: impl std::fmt::Display,
        owner: &Owner,
    ) -> Self {
        let engine: &Engine = &remote.engine;
        let remote_port = remote_port.to_string();
        let prelude = remote_prelude(&remote.session, owner, engine.stop_grace);
        let pane = format!(
            "exec sh -c {} >>{REMOTE_STATE}/{}.log 2>&1",
            shell_quote(&pane_script(engine, model, &remote_port)),
            shell_quote(&remote.session),
        );
        let start = format!(
            r#"{prelude}if [ "$(cat "$d/$S.stopped" 2>/dev/null)" = "$me" ]; then
  echo "evalfleet: the run stopped this engine before it started" >&2; exit 1
fi
if tmux has-session -t "=$S" 2>/dev/null 9>&-; then
  case "$(cat "$d/$S.owner" 2>/dev/null)" in
    {store}' '*) echo "evalfleet: replacing tmux session $S, left by an earlier run of this store" >&2; end_session ;;
    *) echo "evalfleet: tmux session $S on $(uname -n) was not started by a run of this store: end it (tmux kill-session -t $S) or give the endpoint another session" >&2; exit 1 ;;
  esac
fi
printf '%s\n' "$me" > "$d/$S.owner"
: > "$d/$S.log"
tmux new-session -d -s "$S" -c "$HOME" {pane} 9>&-
"#,
            store = shell_quote(&owner.store),
            pane = shell_quote(&pane),
        );
        let follow = format!(
            r#"cd || exit 1
S={session}
log={REMOTE_STATE}/$S.log
p=$(tmux display-message -p -t "=$S:" '#{{pane_pid}}' 2>/dev/null)
if [ -z "$p" ]; then
  cat "$log" 2>/dev/null; echo "evalfleet: tmux session $S has ended" >&2; exit 1
fi
exec tail -n +1 -f --pid="$p" "$log"
"#,
            session = shell_quote(&remote.session),
        );
        let stop = format!(
            r#"{prelude}printf '%s\n' "$me" > "$d/$S.stopped"
if [ "$(cat "$d/$S.owner" 2>/dev/null)" = "$me" ]; then end_session; fi
"#
        );
        let ssh = |tail: Vec<String>| -> Vec<String> {
            let mut argv = vec![remote.ssh.clone()];
            argv.extend(remote.ssh_options.iter().cloned());
            argv.extend(tail);
            argv
        };
        Self {
            start: ssh(vec![remote.host.clone(), remote_sh(&start)]),
            tunnel: ssh(vec![
                "-o".to_owned(),
                "ExitOnForwardFailure=yes".to_owned(),
                "-L".to_owned(),
                format!("{local_port}:127.0.0.1:{remote_port}"),
                remote.host.clone(),
                remote_sh(&follow),
            ]),
            stop: ssh(vec![remote.host.clone(), remote_sh(&stop)]),
        }
    }

    /// What the supervisor runs: the start, then the tunnel in its place.
    pub fn supervised(&self) -> String {
        format!(
            "{} && exec {}",
            shell_join(&self.start),
            shell_join(&self.tunnel)
        )
    }
}

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind(("127.0.0.1", 0))?
        .local_addr()?
        .port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_failure_quotes_the_engine_s_lines_of_that_start_only() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("engine.log");
        let long = "x".repeat(300);
        std::fs::write(
            &log,
            format!(
                "{START_MARK}engine at 2026-01-01T00:00:00Z\n\
                 error: an earlier start's line\n\
                 {START_MARK}engine at 2026-01-01T00:01:00Z\n\
                 evalfleet supervise: started pid 7: llama-server --model error: in a path\n\
                 loading model\n\n{long}\n\
                 error: failed to open /m.gguf\n\
                 evalfleet supervise: pid 7 exited (exit status: 1); ending its group\n"
            ),
        )
        .unwrap();
        assert_eq!(
            last_lines(&log, 6).unwrap(),
            format!(
                "loading model | {}… | error: failed to open /m.gguf",
                "x".repeat(240)
            )
        );
        assert_eq!(
            last_lines(&log, 1).unwrap(),
            "error: failed to open /m.gguf"
        );
        std::fs::write(
            &log,
            format!(
                "{START_MARK}engine at 2026-01-01T00:00:00Z\n\
                 evalfleet supervise: error: another live run of this store keeps this engine\n"
            ),
        )
        .unwrap();
        assert_eq!(
            last_lines(&log, 6).unwrap(),
            "evalfleet supervise: error: another live run of this store keeps this engine",
            "the supervisor's own errors are the engine's lines"
        );
        std::fs::write(&log, format!("{START_MARK}engine at now\n")).unwrap();
        assert_eq!(last_lines(&log, 6), None);
    }

    #[test]
    fn quoting_keeps_words_whole() {
        assert_eq!(shell_quote("plain-word_1.2"), "plain-word_1.2");
        assert_eq!(shell_quote("two words"), "'two words'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_join(&["echo", "a b", ""]), "echo 'a b' ''");
    }
}
