//! Processes the fleet starts: engines (`local`), SSH tunnels (`remote`), and
//! one-off commands (`start_cmd`, `stop_cmd`, tmux over SSH).
//!
//! A long-running process is started under a supervisor: `evalfleet
//! supervise`, which puts the command in a process group of its own and
//! watches a pipe from the run. When the run stops it, or dies in any way
//! (even SIGKILL: the kernel closes the pipe), the supervisor ends the whole
//! group (SIGTERM, a grace period, SIGKILL) and runs its `--on-exit` command.
//! So no engine outlives its run.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::process::{Child, ChildStdin, Command};

use crate::config::{Engine, Remote};

/// How to start supervised processes.
#[derive(Debug, Clone)]
pub struct Launcher {
    /// The `evalfleet` binary (its `supervise` command).
    pub program: PathBuf,
    /// Where engine logs go (`runs/RUN_ID/`).
    pub log_dir: PathBuf,
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

impl Launcher {
    /// Starts `command` (run by `sh -c`) under a supervisor, its output
    /// appended to `LOG_DIR/NAME.log`.
    pub async fn spawn(
        &self,
        name: &str,
        command: &str,
        env: &[(String, String)],
        on_exit: Option<&str>,
        stop_grace: Duration,
    ) -> std::io::Result<Supervised> {
        std::fs::create_dir_all(&self.log_dir)?;
        let log = self.log_dir.join(format!("{name}.log"));
        let pid_file = self.log_dir.join(format!("{name}.pid"));
        let _ = std::fs::remove_file(&pid_file);
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        let err = out.try_clone()?;
        let mut cmd = Command::new(&self.program);
        cmd.arg("supervise")
            .arg("--pid-file")
            .arg(&pid_file)
            .arg("--grace")
            .arg(format!("{}ms", stop_grace.as_millis()));
        if let Some(on_exit) = on_exit {
            cmd.arg("--on-exit").arg(on_exit);
        }
        cmd.arg("--")
            .arg(command)
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
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

    /// Stops it: closing the pipe tells the supervisor to end the group
    /// gracefully; if it has not after `grace` and a margin, it is killed.
    pub async fn stop(mut self, grace: Duration) {
        drop(self.stdin.take());
        let margin = grace + Duration::from_secs(5);
        if tokio::time::timeout(margin, self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
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

/// The commands of a remote engine, as argument lists (no local shell).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteCommands {
    /// Starts the engine in a detached tmux session on the host.
    pub start: Vec<String>,
    /// Forwards `local_port` to the engine's port (runs until stopped).
    pub tunnel: Vec<String>,
    /// Ends the tmux session.
    pub stop: Vec<String>,
}

impl RemoteCommands {
    pub fn new(
        remote: &Remote,
        model: &str,
        remote_port: impl std::fmt::Display,
        local_port: impl std::fmt::Display,
    ) -> Self {
        let engine: &Engine = &remote.engine;
        let mut script = Vec::new();
        if let Some(gpu) = &engine.gpu {
            script.push(format!("export CUDA_VISIBLE_DEVICES={}", shell_quote(gpu)));
        }
        for (key, value) in &engine.env {
            script.push(format!("export {key}={}", shell_quote(value.expose())));
        }
        script.push(format!("exec {}", engine.render(model, &remote_port)));
        let ssh = |tail: Vec<String>| -> Vec<String> {
            let mut argv = vec![remote.ssh.clone()];
            argv.extend(remote.ssh_options.iter().cloned());
            argv.extend(tail);
            argv
        };
        Self {
            start: ssh(vec![
                remote.host.clone(),
                format!(
                    "tmux new-session -d -s {} {}",
                    shell_quote(&remote.session),
                    shell_quote(&script.join("; "))
                ),
            ]),
            tunnel: ssh(vec![
                "-N".to_owned(),
                "-o".to_owned(),
                "ExitOnForwardFailure=yes".to_owned(),
                "-L".to_owned(),
                format!("{local_port}:127.0.0.1:{remote_port}"),
                remote.host.clone(),
            ]),
            stop: ssh(vec![
                remote.host.clone(),
                format!("tmux kill-session -t {}", shell_quote(&remote.session)),
            ]),
        }
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
    fn quoting_keeps_words_whole() {
        assert_eq!(shell_quote("plain-word_1.2"), "plain-word_1.2");
        assert_eq!(shell_quote("two words"), "'two words'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_join(&["echo", "a b", ""]), "echo 'a b' ''");
    }
}
