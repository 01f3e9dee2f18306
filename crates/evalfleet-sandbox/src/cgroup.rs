//! A memory cgroup per slot of a sandbox: every process a program starts
//! (its children, daemons, new sessions) is in its slot's group, so that
//! one limit holds for all of them together, an attempt's, where
//! `RLIMIT_AS` holds for each process alone. Made under evalfleet's own
//! memory cgroup (cgroup v1's `memory` hierarchy, or v2 where its parent
//! delegates the memory controller), when evalfleet may make groups there
//! (as root); else there is none, and the sandbox
//! says so.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};

/// One slot's group.
#[derive(Debug)]
pub struct Group {
    dir: PathBuf,
    /// Its `cgroup.procs`, open to write: a child writes its pid there
    /// before its `exec`.
    procs: File,
    /// v2 (`memory.events`) or v1 (`memory.oom_control`).
    v2: bool,
    /// The limit, in bytes.
    pub limit: u64,
}

impl Group {
    /// Makes group `name` under `parent` with `limit` bytes for all its
    /// processes together.
    fn make(parent: &Path, name: &str, limit: u64, v2: bool) -> io::Result<Self> {
        let dir = parent.join(name);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(err) if err.kind() == io::ErrorKind::AlreadyExists => {}
            Err(err) => return Err(err),
        }
        let made = || -> io::Result<File> {
            if v2 {
                std::fs::write(dir.join("memory.max"), limit.to_string())?;
                // No swap past the limit either.
                let _ = std::fs::write(dir.join("memory.swap.max"), "0");
            } else {
                std::fs::write(dir.join("memory.limit_in_bytes"), limit.to_string())?;
                let _ = std::fs::write(dir.join("memory.memsw.limit_in_bytes"), limit.to_string());
            }
            std::fs::OpenOptions::new()
                .write(true)
                .open(dir.join("cgroup.procs"))
        };
        match made() {
            Ok(procs) => Ok(Self {
                dir,
                procs,
                v2,
                limit,
            }),
            Err(err) => {
                let _ = std::fs::remove_dir(&dir);
                Err(err)
            }
        }
    }

    /// The descriptor a child writes its pid to.
    pub fn procs_fd(&self) -> RawFd {
        self.procs.as_raw_fd()
    }

    /// How many of its processes the kernel killed for going past the
    /// limit, so far.
    pub fn oom_kills(&self) -> u64 {
        let file = if self.v2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        std::fs::read_to_string(self.dir.join(file))
            .ok()
            .and_then(|text| {
                text.lines()
                    .find_map(|line| line.strip_prefix("oom_kill "))
                    .and_then(|n| n.trim().parse().ok())
            })
            .unwrap_or(0)
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // Empty by now: its slot's processes are killed when their run
        // ends. A group still holding one stays (the kernel refuses).
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Where evalfleet's own memory cgroup is, and which version it is.
fn own_memory_cgroup() -> Option<(PathBuf, bool)> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    // v1: `N:memory:/path` (the controller may share its line).
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        if controllers.split(',').any(|c| c == "memory") {
            let dir = Path::new("/sys/fs/cgroup/memory").join(path.trim_start_matches('/'));
            if dir.join("memory.limit_in_bytes").exists() {
                return Some((dir, false));
            }
        }
    }
    // v2: `0::/path`, whose subtree has the memory controller.
    let path = text.lines().find_map(|line| line.strip_prefix("0::"))?;
    let dir = Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    let delegated = std::fs::read_to_string(dir.join("cgroup.subtree_control")).ok()?;
    delegated
        .split_whitespace()
        .any(|c| c == "memory")
        .then_some((dir, true))
}

/// Removes the groups under `parent` that an evalfleet whose process is
/// gone left behind (a crash, a SIGKILL): their processes are gone with
/// their sandbox's PID namespace, so they are empty.
fn remove_orphans(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("evalfleet-"))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir(entry.path());
        }
    }
}

/// Whether evalfleet has a memory cgroup it could make groups under (as
/// root).
pub fn available() -> bool {
    own_memory_cgroup().is_some()
}

/// A group for each of `slots` (named by them), `limit` bytes each, under
/// evalfleet's own memory cgroup; `None` where groups cannot be made (no
/// memory controller, or not allowed), said in `why`.
pub fn groups(slots: &[u32], limit: u64) -> Result<Vec<(u32, Group)>, String> {
    let Some((parent, v2)) = own_memory_cgroup() else {
        return Err("no memory cgroup evalfleet may make groups under".to_owned());
    };
    remove_orphans(&parent);
    let mut out = Vec::with_capacity(slots.len());
    for &slot in slots {
        let name = format!("evalfleet-{}-{slot}", std::process::id());
        match Group::make(&parent, &name, limit, v2) {
            Ok(group) => out.push((slot, group)),
            Err(err) => {
                return Err(format!(
                    "cannot make a memory cgroup under {}: {err}",
                    parent.display()
                ));
            }
        }
    }
    Ok(out)
}
