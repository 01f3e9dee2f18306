//! `evalfleet supervise` (internal): runs one engine command for a run and
//! makes sure nothing of it outlives the run.
//!
//! The supervisor leaves the run's session and process group at once
//! (`setsid`): what ends the run's group (a closed terminal's SIGHUP, a
//! SIGKILL of the whole group) does not end the supervisor with it, so it
//! is always there to clean up. The command runs under `sh -c` in a process
//! group of its own. The supervisor watches its standard input, a pipe from
//! the run: when the pipe closes (the run stopped the engine, or died in
//! any way, SIGKILL included), or the supervisor gets SIGTERM or SIGHUP, or
//! the command's leader exits, it ends the whole group: SIGTERM, then
//! SIGKILL after the grace period. SIGINT is ignored: the run decides.
//! Then it runs `--on-exit` (e.g. `ssh host ...` ending a tmux session).
//!
//! With `--claim`, what it starts carries the claim (see [`claim`]), so
//! that what a supervisor killed before it could clean up left behind is
//! ended by the next one, and a start never fails on a dead run's leftovers.

mod claim;

use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, Stdin};
use tokio::process::Command;
use tokio::signal::unix::{Signal, SignalKind, signal};

use crate::EXIT_FAILED;
use crate::cli::SuperviseArgs;
use claim::{CLAIM_VAR, Claim};

/// Sends `signal` to every process of group `pgid`.
#[allow(unsafe_code)]
fn signal_group(pgid: u32, signal: libc::c_int) {
    let Ok(pgid) = libc::pid_t::try_from(pgid) else {
        return;
    };
    if pgid <= 1 {
        return;
    }
    // SAFETY: kill(2) takes plain integers and touches no memory of ours; a
    // negative pid names the process group we created for the command.
    unsafe {
        libc::kill(-pgid, signal);
    }
}

/// Leaves the run's session and process group, so that a signal to the
/// run's group (a terminal's hangup, `kill -- -PGID`) does not reach the
/// supervisor; and adopts the command's orphans, so that a process the
/// command leaves when it dies is reaped here rather than left a zombie.
#[allow(unsafe_code)]
fn detach() {
    // SAFETY: setsid(2) and prctl(2) with these arguments take plain
    // integers and touch no memory of ours. setsid fails only when this
    // process already leads a group, and then it is apart already.
    unsafe {
        libc::setsid();
        #[cfg(target_os = "linux")]
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    }
}

/// Reaps the children that have ended (the orphans adopted by
/// [`detach`]), without waiting for any.
#[allow(unsafe_code)]
fn reap_ended() {
    loop {
        let mut status = 0;
        // SAFETY: waitpid(2) writes only to `status`, a local integer.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid <= 0 {
            return;
        }
    }
}

/// Whether any process of group `pgid` is still running. Zombies do not
/// count: they run nothing, and their parent reaps them.
fn group_alive(pgid: u32) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return group_exists(pgid);
    };
    entries.flatten().any(|entry| {
        let is_pid = entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()));
        if !is_pid {
            return false;
        }
        // /proc/PID/stat: "pid (comm) state ppid pgrp ..."; comm may hold
        // spaces and parentheses, so read after its last ')'.
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            return false;
        };
        let Some((_, rest)) = stat.rsplit_once(") ") else {
            return false;
        };
        let mut fields = rest.split_whitespace();
        let state = fields.next();
        let group = fields.nth(1).and_then(|g| g.parse::<u32>().ok());
        group == Some(pgid) && state != Some("Z")
    })
}

/// Whether group `pgid` exists (where /proc cannot be read).
#[allow(unsafe_code)]
fn group_exists(pgid: u32) -> bool {
    let Ok(pgid) = libc::pid_t::try_from(pgid) else {
        return false;
    };
    // SAFETY: as above; signal 0 only checks that the group exists.
    unsafe { libc::kill(-pgid, 0) == 0 }
}

/// What asks the supervisor to stop: the run's pipe closing, SIGTERM, or
/// SIGHUP (a hangup means the same as a termination here: the run that
/// owns the engine is going away).
struct Requests {
    stdin: Stdin,
    terminate: Signal,
    hangup: Signal,
    interrupt: Signal,
}

impl Requests {
    fn new() -> std::io::Result<Self> {
        Ok(Self {
            stdin: tokio::io::stdin(),
            terminate: signal(SignalKind::terminate())?,
            hangup: signal(SignalKind::hangup())?,
            interrupt: signal(SignalKind::interrupt())?,
        })
    }

    /// Returns when a stop is asked for. Cancel-safe.
    async fn stop(&mut self) {
        let mut buf = [0u8; 64];
        loop {
            tokio::select! {
                _ = self.terminate.recv() => return,
                _ = self.hangup.recv() => return,
                // A terminal's Ctrl-C may reach the run and this process
                // alike; the run decides when its engines stop (calls in
                // flight may finish).
                _ = self.interrupt.recv() => {}
                read = self.stdin.read(&mut buf) => match read {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                },
            }
        }
    }
}

/// How a status reads in the log.
fn shown(status: &std::io::Result<ExitStatus>) -> String {
    match status {
        Ok(status) => status.to_string(),
        Err(err) => format!("not known ({err})"),
    }
}

pub async fn supervise(args: SuperviseArgs) -> anyhow::Result<u8> {
    detach();
    let mut requests = Requests::new()?;
    let claim = match &args.claim {
        None => None,
        Some(path) => {
            let taken = tokio::select! {
                taken = Claim::take(path, args.claim_wait, args.grace) => taken,
                () = requests.stop() => {
                    eprintln!("evalfleet supervise: stopped before the engine started");
                    std::process::exit(i32::from(EXIT_FAILED));
                }
            };
            match taken {
                Ok(claim) => Some(claim),
                Err(why) => {
                    eprintln!("evalfleet supervise: error: {why}");
                    std::process::exit(i32::from(EXIT_FAILED));
                }
            }
        }
    };
    if let (Some(prefix), Some(claim)) = (&args.leftovers, &claim) {
        claim::end_leftovers(prefix, claim.path(), args.grace).await;
    }
    let code = run(&args, claim.as_ref(), &mut requests).await?;
    if let Some(claim) = claim {
        claim.release(args.leftovers.is_some());
    }
    // Exit now: the runtime's shutdown would wait for the blocking read of
    // stdin, and the run watches this process's exit to learn the engine died.
    std::process::exit(code)
}

/// Runs the command until it exits or a stop is asked for, ends its group,
/// and runs `--on-exit`. Returns the exit code for the supervisor.
async fn run(
    args: &SuperviseArgs,
    claim: Option<&Claim>,
    requests: &mut Requests,
) -> anyhow::Result<i32> {
    let fail = i32::from(EXIT_FAILED);
    let command = args.command.join(" ");
    let mut sh = Command::new("sh");
    sh.arg("-c")
        .arg(&command)
        .stdin(Stdio::null())
        .process_group(0);
    if let Some(claim) = claim {
        sh.env(CLAIM_VAR, claim.path());
    }
    let mut child = sh.spawn()?;
    let Some(pid) = child.id() else {
        return Ok(fail);
    };
    std::fs::write(&args.pid_file, format!("{pid}\n"))?;
    eprintln!(
        "evalfleet supervise: started pid {pid}: {}",
        args.label.as_deref().unwrap_or(&command)
    );

    let exited = tokio::select! {
        status = child.wait() => Some(status),
        () = requests.stop() => None,
    };
    match &exited {
        Some(status) => eprintln!(
            "evalfleet supervise: pid {pid} exited ({}); ending its group",
            shown(status)
        ),
        None => eprintln!("evalfleet supervise: stopping pid {pid} and its group"),
    }
    // End the whole group: what the leader started goes too.
    signal_group(pid, libc::SIGTERM);
    let deadline = tokio::time::Instant::now() + args.grace;
    let mut reaped = exited.is_some();
    while tokio::time::Instant::now() < deadline {
        if !reaped && matches!(child.try_wait(), Ok(Some(_))) {
            reaped = true;
        }
        if reaped && !group_alive(pid) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if group_alive(pid) {
        eprintln!("evalfleet supervise: group {pid} outlived the grace period; SIGKILL");
        signal_group(pid, libc::SIGKILL);
    }
    let code = match exited {
        Some(Ok(status)) => status.code().unwrap_or(fail),
        _ => child.wait().await.ok().and_then(|s| s.code()).unwrap_or(0),
    };
    // What left the group (a daemon of the engine's) still carries the claim.
    if let Some(claim) = claim {
        claim::end_carriers(claim.path(), args.grace, "that left the engine's group").await;
    }
    reap_ended();
    if let Some(on_exit) = &args.on_exit {
        let run = Command::new("sh")
            .arg("-c")
            .arg(on_exit)
            .stdin(Stdio::null())
            .status();
        // The on-exit command may itself wait out a grace period (a remote
        // engine's).
        let limit = args.grace * 2 + Duration::from_secs(60);
        match tokio::time::timeout(limit, run).await {
            Ok(Ok(status)) => eprintln!("evalfleet supervise: on-exit command: {status}"),
            Ok(Err(err)) => eprintln!("evalfleet supervise: on-exit command failed: {err}"),
            Err(_) => eprintln!("evalfleet supervise: on-exit command timed out"),
        }
        reap_ended();
    }
    Ok(code)
}
