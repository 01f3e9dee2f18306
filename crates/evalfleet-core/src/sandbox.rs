//! Runs untrusted programs (model-written code) on this machine, contained.
//!
//! Each execution runs in a fresh directory, in its own process group, with:
//! - a wall-clock timeout, a CPU-time limit (`RLIMIT_CPU`), a memory limit
//!   (`RLIMIT_AS`), a cap on file size (`RLIMIT_FSIZE`) and on processes
//!   (`RLIMIT_NPROC`), set with `prlimit`;
//! - a cap on output: past it the program is killed;
//! - when the kernel allows it (`unshare`): its own network namespace (no
//!   network at all) and PID namespace (when it ends, everything it started
//!   ends with it);
//! - when evalfleet runs as root: the uid of `nobody` (`setpriv`), so that it
//!   can write only where anyone may, cannot signal our processes, and its
//!   process limit is its own.
//!
//! [`Isolation::detect`] finds out what this machine allows and
//! [`Isolation::describe`] says it, so a run says plainly what is enforced.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

/// The namespace's first process: puts the working directory at /mnt (so
/// that it is reachable whatever the directories above it allow, and stays
/// visible when /tmp is covered), covers /tmp, /var/tmp and /dev/shm with
/// private empty file systems, and runs the program there; it reports a
/// signal as 128 + its number.
const SANDBOX_SHELL: &str = "mount --bind \"$PWD\" /mnt && \
    for d in /tmp /var/tmp /dev/shm; do [ -d $d ] && mount -t tmpfs -o size=64m,mode=1777 tmpfs $d; done; \
    cd /mnt && \"$@\"; exit $?";

/// What an execution may use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    pub wall: Duration,
    pub cpu: Duration,
    pub memory_mb: u64,
    /// Bytes of stdout plus stderr kept; past them the program is killed.
    pub output_bytes: usize,
    /// Largest file it may write, in bytes.
    pub file_bytes: u64,
    /// Processes (and threads) it may have at once (with its own uid).
    pub processes: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            // The CPU limit catches a busy loop; the wall clock, a program
            // that waits. It is longer, so that a busy machine does not
            // turn a slow-but-right program into a timeout.
            wall: Duration::from_secs(30),
            cpu: Duration::from_secs(10),
            memory_mb: 1024,
            output_bytes: 1 << 20,
            file_bytes: 16 << 20,
            processes: 64,
        }
    }
}

/// What this machine lets the sandbox enforce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Isolation {
    /// `unshare --net --pid --fork` works.
    pub namespaces: bool,
    /// Running as root: programs run as `nobody` (uid, gid).
    pub nobody: Option<(u32, u32)>,
    /// `prlimit` is here.
    pub rlimits: bool,
}

impl Isolation {
    /// Probes `unshare`, `prlimit` and whether we are root.
    pub async fn detect() -> Self {
        let works = |program: &str, args: &[&str]| {
            let mut command = Command::new(program);
            command
                .args(args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            async move { command.status().await.is_ok_and(|s| s.success()) }
        };
        let namespaces = works(
            "unshare",
            &[
                "--net",
                "--pid",
                "--mount",
                "--fork",
                "--kill-child",
                "sh",
                "-c",
                "mount -t tmpfs tmpfs /tmp",
            ],
        )
        .await;
        let rlimits = works("prlimit", &["--cpu=1", "true"]).await;
        #[allow(unsafe_code)]
        // SAFETY: geteuid has no preconditions and cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        let nobody = (root
            && works(
                "setpriv",
                &["--reuid=65534", "--regid=65534", "--clear-groups", "true"],
            )
            .await)
            .then_some((65534, 65534));
        Self {
            namespaces,
            nobody,
            rlimits,
        }
    }

    /// What is enforced, in words, for logs and `evalfleet check`.
    pub fn describe(&self) -> String {
        let mut on = vec![
            "own directory",
            "process group",
            "wall-clock timeout",
            "output cap",
        ];
        let mut off = Vec::new();
        if self.rlimits {
            on.push("CPU, memory, file-size and process limits");
        } else {
            off.push("CPU/memory/process limits (no prlimit)");
        }
        if self.namespaces {
            on.push("no network (own network namespace)");
            on.push("all its processes end with it (own PID namespace)");
            on.push("empty private /tmp, /var/tmp and /dev/shm (own mount namespace)");
        } else {
            off.push("network isolation and PID namespace (unshare not allowed here)");
        }
        if self.nobody.is_some() {
            on.push("runs as nobody (writes only where anyone may)");
        } else {
            off.push(
                "a separate user (not root: programs run as this user and may write where it can)",
            );
        }
        let mut text = format!("sandbox: {}", on.join(", "));
        if !off.is_empty() {
            text.push_str(&format!("; NOT enforced: {}", off.join("; ")));
        }
        text
    }
}

/// How an execution ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    Exited(i32),
    /// Killed by a signal (SIGXCPU or SIGKILL at the CPU limit, a crash).
    Signaled(i32),
    /// Past the wall-clock limit.
    TimedOut,
    /// Wrote more than `output_bytes`.
    OutputLimit,
}

/// One execution's outcome.
#[derive(Debug, Clone)]
pub struct Execution {
    pub ended: Ended,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub elapsed: Duration,
}

impl Execution {
    pub fn success(&self) -> bool {
        self.ended == Ended::Exited(0)
    }

    /// Whether it ran out of memory: Python's `MemoryError`, or a
    /// failed allocation reported by the C runtime.
    pub fn out_of_memory(&self) -> bool {
        let err = String::from_utf8_lossy(&self.stderr);
        err.contains("MemoryError")
            || err.contains("std::bad_alloc")
            || err.contains("memory allocation of")
    }

    /// Killed at the CPU limit (SIGXCPU, or SIGKILL past the hard limit).
    pub fn cpu_exceeded(&self) -> bool {
        matches!(self.ended, Ended::Signaled(s) if s == libc::SIGXCPU || s == libc::SIGKILL)
    }
}

/// A fresh directory for one execution, removed when dropped.
pub struct Workdir {
    path: PathBuf,
}

impl Workdir {
    /// Creates a directory under `parent` that the sandboxed user may write.
    pub fn new(parent: &Path, isolation: &Isolation) -> std::io::Result<Self> {
        std::fs::create_dir_all(parent)?;
        let dir = tempfile_dir(parent)?;
        if let Some((uid, gid)) = isolation.nobody {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid))?;
        }
        Ok(Self { path: dir })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Workdir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

fn tempfile_dir(parent: &Path) -> std::io::Result<PathBuf> {
    for _ in 0..16 {
        let path = parent.join(format!("sbx-{:016x}", fastrand::u64(..)));
        match std::fs::create_dir(&path) {
            Ok(()) => return Ok(path),
            Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(err) => return Err(err),
        }
    }
    Err(std::io::Error::other("cannot create a sandbox directory"))
}

/// Runs `argv` in `dir` with `stdin`, within `limits`.
pub async fn run(
    argv: &[String],
    dir: &Path,
    stdin: &[u8],
    limits: &Limits,
    isolation: &Isolation,
) -> std::io::Result<Execution> {
    let mut full: Vec<String> = Vec::new();
    if isolation.namespaces {
        // Fresh, private temporary directories: the shared ones are the
        // places anyone may write besides its own directory. The shell
        // stays as the namespace's first process: when it ends, the kernel
        // ends everything else in it.
        full.extend(
            [
                "unshare",
                "--net",
                "--pid",
                "--mount",
                "--fork",
                "--kill-child=SIGKILL",
                "--",
                "sh",
                "-c",
                SANDBOX_SHELL,
                "sandbox",
            ]
            .map(String::from),
        );
    }
    if isolation.rlimits {
        let cpu = limits.cpu.as_secs().max(1);
        full.extend([
            "prlimit".to_owned(),
            // Soft limit: SIGXCPU; one second later the hard limit kills.
            format!("--cpu={cpu}:{}", cpu + 1),
            format!("--as={}", limits.memory_mb * 1024 * 1024),
            format!("--fsize={}", limits.file_bytes),
            format!("--nproc={}", limits.processes),
            "--".to_owned(),
        ]);
    }
    if let Some((uid, gid)) = isolation.nobody {
        full.extend([
            "setpriv".to_owned(),
            format!("--reuid={uid}"),
            format!("--regid={gid}"),
            "--clear-groups".to_owned(),
            "--".to_owned(),
        ]);
    }
    full.extend(argv.iter().cloned());
    let mut command = Command::new(&full[0]);
    command
        .args(&full[1..])
        .current_dir(dir)
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", dir)
        .env("LANG", "C.UTF-8")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let started = Instant::now();
    let mut child = command.spawn()?;
    let pgid = child.id();
    let mut input = child.stdin.take();
    let data = stdin.to_vec();
    let feed = async move {
        if let Some(input) = input.as_mut() {
            // A program that does not read its input is not an error.
            let _ = input.write_all(&data).await;
        }
        drop(input);
    };
    let (Some(mut out), Some(mut err)) = (child.stdout.take(), child.stderr.take()) else {
        return Err(std::io::Error::other(
            "the program's output pipes are missing",
        ));
    };
    let cap = limits.output_bytes;
    let collect = async {
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        let (mut buf_o, mut buf_e) = ([0u8; 8192], [0u8; 8192]);
        let (mut open_o, mut open_e) = (true, true);
        while open_o || open_e {
            tokio::select! {
                n = out.read(&mut buf_o), if open_o => match n {
                    Ok(0) | Err(_) => open_o = false,
                    Ok(n) => stdout.extend_from_slice(&buf_o[..n]),
                },
                n = err.read(&mut buf_e), if open_e => match n {
                    Ok(0) | Err(_) => open_e = false,
                    Ok(n) => stderr.extend_from_slice(&buf_e[..n]),
                },
            }
            if stdout.len() + stderr.len() > cap {
                return (stdout, stderr, true);
            }
        }
        (stdout, stderr, false)
    };
    let outcome = tokio::time::timeout(limits.wall, async {
        let ((stdout, stderr, over), ()) = tokio::join!(collect, feed);
        if over {
            return (None, stdout, stderr, true);
        }
        let status = child.wait().await.ok();
        (status, stdout, stderr, false)
    })
    .await;
    let (ended, stdout, stderr) = match outcome {
        Ok((_, mut stdout, mut stderr, true)) => {
            stdout.truncate(cap);
            stderr.truncate(cap.saturating_sub(stdout.len()));
            (Ended::OutputLimit, stdout, stderr)
        }
        Ok((Some(status), stdout, stderr, false)) => {
            use std::os::unix::process::ExitStatusExt;
            let ended = match (status.code(), status.signal()) {
                // In namespaces the program is a child of a shell, which
                // reports a signal as 128 + its number.
                (Some(code), _) if isolation.namespaces && (129..160).contains(&code) => {
                    Ended::Signaled(code - 128)
                }
                (Some(code), _) => Ended::Exited(code),
                (None, Some(signal)) => Ended::Signaled(signal),
                (None, None) => Ended::Signaled(0),
            };
            (ended, stdout, stderr)
        }
        Ok((None, stdout, stderr, false)) => (Ended::Signaled(0), stdout, stderr),
        Err(_) => (Ended::TimedOut, Vec::new(), Vec::new()),
    };
    // Whatever it started ends now: the group (and, with a PID namespace,
    // everything in it once its first process is gone).
    if let Some(pgid) = pgid {
        kill_group(pgid);
    }
    let _ = child.kill().await;
    Ok(Execution {
        ended,
        stdout,
        stderr,
        elapsed: started.elapsed(),
    })
}

#[allow(unsafe_code)]
fn kill_group(pgid: u32) {
    let Ok(pgid) = libc::pid_t::try_from(pgid) else {
        return;
    };
    if pgid <= 1 {
        return;
    }
    // SAFETY: kill has no memory-safety preconditions; a negative pid names
    // a process group, here one we created for this execution.
    unsafe {
        libc::kill(-pgid, libc::SIGKILL);
    }
}
