//! `evalfleet supervise` (internal): runs one engine command for a run and
//! makes sure nothing of it outlives the run.
//!
//! The command runs under `sh -c` in a process group of its own. The
//! supervisor watches its standard input, a pipe from the run: when the pipe
//! closes (the run stopped the engine, or died in any way, SIGKILL included),
//! or the supervisor gets SIGTERM, or the command's leader exits, it ends the
//! whole group: SIGTERM, then SIGKILL after the grace period. SIGINT is
//! ignored: Ctrl-C in a terminal reaches it too, and the run decides.
//! Then it runs `--on-exit` (e.g. `ssh host tmux kill-session -t S`).

use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::process::Command;
use tokio::signal::unix::{SignalKind, signal};

use crate::EXIT_FAILED;
use crate::cli::SuperviseArgs;

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

/// Whether any process of group `pgid` is still running. Zombies do not
/// count: an orphan that died waits for init to reap it, which may take a
/// while, and it runs nothing meanwhile.
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

pub async fn supervise(args: SuperviseArgs) -> anyhow::Result<u8> {
    let fail = i32::from(EXIT_FAILED);
    let command = args.command.join(" ");
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(&command)
        .stdin(Stdio::null())
        .process_group(0)
        .spawn()?;
    let Some(pid) = child.id() else {
        return Ok(EXIT_FAILED);
    };
    std::fs::write(&args.pid_file, format!("{pid}\n"))?;
    eprintln!("evalfleet supervise: started pid {pid}: {command}");

    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut stdin = tokio::io::stdin();
    let mut buf = [0u8; 64];
    let exited = loop {
        tokio::select! {
            status = child.wait() => break Some(status),
            _ = terminate.recv() => break None,
            // A terminal's Ctrl-C reaches the run and this process alike; the
            // run decides when its engines stop (calls in flight may finish).
            _ = interrupt.recv() => {}
            read = stdin.read(&mut buf) => match read {
                Ok(0) | Err(_) => break None,
                Ok(_) => {}
            },
        }
    };
    match &exited {
        Some(status) => {
            eprintln!("evalfleet supervise: pid {pid} exited ({status:?}); ending its group")
        }
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
    if let Some(on_exit) = &args.on_exit {
        let run = Command::new("sh")
            .arg("-c")
            .arg(on_exit)
            .stdin(Stdio::null())
            .status();
        match tokio::time::timeout(Duration::from_secs(60), run).await {
            Ok(Ok(status)) => eprintln!("evalfleet supervise: on-exit `{on_exit}`: {status}"),
            Ok(Err(err)) => eprintln!("evalfleet supervise: on-exit `{on_exit}` failed: {err}"),
            Err(_) => eprintln!("evalfleet supervise: on-exit `{on_exit}` timed out"),
        }
    }
    // Exit now: the runtime's shutdown would wait for the blocking read of
    // stdin, and the run watches this process's exit to learn the engine died.
    std::process::exit(code)
}
