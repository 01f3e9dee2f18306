//! The workers of a run: who this process is to the store, and whether a
//! registered worker still lives.
//!
//! A worker on this host is alive while its process is: its pid exists and
//! started when the worker said (so a pid reused by another process does
//! not count). A worker on another host is alive while it renews its lease.

use std::time::Duration;

use evalfleet_types::now_ms;

use crate::{Runs, StoreError, WorkQueue, WorkerInfo};

/// This process as a worker of a run, claiming items for `lease`.
pub fn this_process(lease: Duration) -> WorkerInfo {
    let pid = std::process::id();
    let host = hostname();
    WorkerInfo {
        worker: format!("{host}-{pid}-{:08x}", fastrand::u32(..)),
        session: 0,
        host,
        pid,
        pid_scope: pid_scope(),
        process_start: process_start(pid).unwrap_or(0),
        started_at_ms: now_ms(),
        heartbeat_at_ms: now_ms(),
        lease_ms: i64::try_from(lease.as_millis()).unwrap_or(i64::MAX),
    }
}

/// Whether `worker` still lives (see the module's doc).
pub fn is_alive(worker: &WorkerInfo) -> bool {
    // Its pid names a process here only in the same scope (a worker
    // registered before scopes were kept: on the same host).
    let pid_here = if worker.pid_scope.is_empty() {
        worker.host == hostname()
    } else {
        worker.pid_scope == pid_scope()
    };
    if pid_here {
        return process_start(worker.pid).is_some_and(|start| start == worker.process_start);
    }
    worker.heartbeat_at_ms.saturating_add(worker.lease_ms) > now_ms()
}

/// The run's live workers.
pub fn live_workers(store: &mut dyn Runs, run_id: &str) -> Result<Vec<WorkerInfo>, StoreError> {
    Ok(store
        .workers(run_id)?
        .into_iter()
        .filter(is_alive)
        .collect())
}

/// Releases the claims of the run's workers whose process is gone, so that
/// their items are free at once instead of when their leases run out.
/// Returns how many there were.
pub fn release_dead<S: Runs + WorkQueue + ?Sized>(
    store: &mut S,
    run_id: &str,
) -> Result<usize, StoreError> {
    let dead: Vec<WorkerInfo> = store
        .workers(run_id)?
        .into_iter()
        .filter(|w| !is_alive(w))
        .collect();
    for worker in &dead {
        store.release(run_id, &worker.worker)?;
    }
    Ok(dead.len())
}

/// The host's name, as workers record it (read once).
fn hostname() -> String {
    static NAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NAME.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .ok()
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "localhost".to_owned())
    })
    .clone()
}

/// Where this process's pid means it: the kernel's boot id and its pid
/// namespace (read once; empty when neither can be read).
fn pid_scope() -> String {
    static SCOPE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SCOPE
        .get_or_init(|| {
            let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
                .map(|b| b.trim().to_owned())
                .unwrap_or_default();
            let namespace = std::fs::read_link("/proc/self/ns/pid")
                .map(|ns| ns.to_string_lossy().into_owned())
                .unwrap_or_default();
            if boot.is_empty() && namespace.is_empty() {
                String::new()
            } else {
                format!("{boot}/{namespace}")
            }
        })
        .clone()
}

/// When process `pid` started, in clock ticks since boot (`/proc/PID/stat`,
/// field 22); `None` when there is no such process, or it has ended and
/// only waits to be reaped (a zombie).
fn process_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces.
    let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace();
    if matches!(fields.next()?, "Z" | "X") {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_a_reused_pid_is_not() {
        let me = this_process(Duration::from_secs(30));
        assert!(me.process_start > 0);
        assert!(is_alive(&me));
        let reused = WorkerInfo {
            process_start: me.process_start + 1,
            ..me.clone()
        };
        assert!(!is_alive(&reused));
        let gone = WorkerInfo {
            pid: u32::MAX,
            ..me.clone()
        };
        assert!(!is_alive(&gone));
        // Another container of the same hostname: its pid means nothing
        // here (pid 1 is someone else), its heartbeat says.
        let elsewhere = WorkerInfo {
            pid: 1,
            pid_scope: "another-boot/pid:[1]".to_owned(),
            ..me.clone()
        };
        assert!(is_alive(&elsewhere), "its lease runs");
        let lapsed = WorkerInfo {
            heartbeat_at_ms: now_ms() - 60_000,
            ..elsewhere
        };
        assert!(!is_alive(&lapsed), "its lease ran out");
        // Registered before scopes were kept: by host, as before.
        let unscoped = WorkerInfo {
            pid_scope: String::new(),
            ..reused
        };
        assert!(!is_alive(&unscoped));
    }

    #[test]
    fn a_process_that_ended_but_is_not_reaped_is_not_alive() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Not waited for: once it exits it is a zombie, its pid still there.
        let stat = || std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !stat().contains(") Z ") {
            assert!(std::time::Instant::now() < deadline, "{}", stat());
            std::thread::yield_now();
        }
        assert_eq!(process_start(pid), None);
        child.wait().unwrap();
    }
}
