//! Claims: how a supervisor marks what it started, so that what a dead
//! supervisor left behind is found and ended by the next one.
//!
//! A claim is a file in the store's `.engines/` directory that its
//! supervisor holds locked (`flock`) for as long as it lives; every process
//! it starts carries the file's path in [`CLAIM_VAR`]. The kernel drops the
//! lock however the supervisor ends, SIGKILL included, so a claim that can
//! be locked has no keeper: the processes that still carry its path were
//! left by a supervisor that could not end them, and are ended before a
//! new engine takes their place (on their port, their GPU, their tunnel).

use std::fs::{File, OpenOptions, TryLockError};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The variable that carries the claim's path into every process started
/// under it.
pub const CLAIM_VAR: &str = "EVALFLEET_CLAIM";

/// A claim file held locked.
pub struct Claim {
    file: File,
    path: PathBuf,
}

/// Whether `file`'s lock was free (and is now ours).
fn try_lock(file: &File) -> std::io::Result<bool> {
    match file.try_lock() {
        Ok(()) => Ok(true),
        Err(TryLockError::WouldBlock) => Ok(false),
        Err(TryLockError::Error(err)) => Err(err),
    }
}

impl Claim {
    /// Takes the claim at `path`: waits up to `wait` while a live
    /// supervisor holds it (one that is still stopping its engine lets go
    /// soon), then ends what a dead holder left (`grace` between SIGTERM
    /// and SIGKILL). The error says who holds it.
    pub async fn take(path: &Path, wait: Duration, grace: Duration) -> Result<Self, String> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(path)
            .map_err(|err| format!("cannot open the claim {}: {err}", path.display()))?;
        let deadline = tokio::time::Instant::now() + wait;
        let mut told = false;
        loop {
            match try_lock(&file) {
                Ok(true) => break,
                Ok(false) => {}
                Err(err) => return Err(format!("cannot lock {}: {err}", path.display())),
            }
            let holder = holder(path);
            if tokio::time::Instant::now() >= deadline {
                return Err(format!(
                    "another live run of this store keeps this engine ({holder}; claim {}); stop that run, or give this endpoint another name or session",
                    path.display()
                ));
            }
            if !told {
                eprintln!(
                    "evalfleet supervise: waiting up to {} for {holder} to let go of {}",
                    humantime::format_duration(wait),
                    path.display()
                );
                told = true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut claim = Self {
            file,
            path: path.to_owned(),
        };
        end_carriers(path, grace, "left by a supervisor that died").await;
        claim.note();
        Ok(claim)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Says who holds the claim, for a supervisor that waits for it.
    fn note(&mut self) {
        let _ = self.file.set_len(0);
        let _ = writeln!(self.file, "pid {}", std::process::id());
    }

    /// Lets go of the claim; a claim of this supervisor's own (a local
    /// engine's) is removed too.
    pub fn release(self, remove: bool) {
        if remove {
            let _ = std::fs::remove_file(&self.path);
        }
        drop(self.file);
    }
}

/// What the claim file says of its holder.
fn holder(path: &Path) -> String {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix("pid "))
                .map(|pid| format!("supervisor pid {}", pid.trim()))
        })
        .unwrap_or_else(|| "a supervisor".to_owned())
}

/// Ends what dead supervisors left under the claims whose path starts with
/// `prefix` (other than `own`), and removes those claims. A claim still
/// empty is being made by a live supervisor that has not locked it yet.
pub async fn end_leftovers(prefix: &Path, own: &Path, grace: Duration) {
    let (Some(dir), Some(start)) = (prefix.parent(), prefix.file_name()) else {
        return;
    };
    let start = start.to_string_lossy();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path == own || !entry.file_name().to_string_lossy().starts_with(&*start) {
            continue;
        }
        let Ok(file) = File::open(&path) else {
            continue;
        };
        if !matches!(try_lock(&file), Ok(true)) {
            continue;
        }
        if std::fs::metadata(&path).is_ok_and(|m| m.len() == 0) {
            continue;
        }
        end_carriers(&path, grace, "left by a supervisor that died").await;
        let _ = std::fs::remove_file(&path);
    }
}

/// The processes whose environment carries `CLAIM_VAR=path` (zombies have
/// none: they run nothing).
pub fn carriers(path: &Path) -> Vec<u32> {
    let mut marker = format!("{CLAIM_VAR}=").into_bytes();
    marker.extend_from_slice(path.as_os_str().as_encoded_bytes());
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|var| var == marker.as_slice()))
        })
        .collect()
}

/// Sends `signal` to process `pid`.
#[allow(unsafe_code)]
fn signal(pid: u32, signal: libc::c_int) {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    if pid <= 1 {
        return;
    }
    // SAFETY: kill(2) takes plain integers and touches no memory of ours;
    // the pid is positive, one process found carrying our claim.
    unsafe {
        libc::kill(pid, signal);
    }
}

/// Ends the processes that carry the claim at `path` (`what` they are, for
/// the log): SIGTERM, then SIGKILL to those left after `grace`.
pub async fn end_carriers(path: &Path, grace: Duration, what: &str) {
    let found = carriers(path);
    if found.is_empty() {
        return;
    }
    eprintln!(
        "evalfleet supervise: ending {} process(es) {what} (pids {found:?})",
        found.len()
    );
    for &pid in &found {
        signal(pid, libc::SIGTERM);
    }
    let deadline = tokio::time::Instant::now() + grace;
    while tokio::time::Instant::now() < deadline && !carriers(path).is_empty() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for pid in carriers(path) {
        signal(pid, libc::SIGKILL);
    }
}
