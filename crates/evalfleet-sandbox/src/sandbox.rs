//! Runs untrusted programs (model-written code) on this machine, contained.
//!
//! Each execution runs in a fresh directory of its own, in its own process
//! group, with a wall-clock timeout, a CPU-time limit (`RLIMIT_CPU`), a
//! memory limit (`RLIMIT_AS`), caps on file size and processes, and a cap on
//! output (past it the program is killed). Where this machine allows it
//! (evalfleet runs as root):
//! - each slot of the sandbox has a uid of its own, unused by anyone else
//!   (claimed with a lock file, so that runs side by side do not share one):
//!   a program can write only in its own directory (mode 700), cannot touch
//!   another program or any of ours, its process limit is its own, and when
//!   it ends every process of its uid is killed, wherever it went;
//! - it enters a network namespace with no network at all, and a mount
//!   namespace in which the whole tree is read-only, the shared temporary
//!   directories are empty, and the sandbox's directory is seen at `/mnt`.
//!   Both are made once, when the sandbox is made: entering them is two
//!   system calls, where making them per execution cost milliseconds.
//!
//! The child enters all this with system calls before its `exec`, and it
//! shares our memory until then (as with `posix_spawn`; see `sys`), so an
//! execution costs one process, the program itself, and no copy of ours.
//! It is killed if evalfleet dies (`PR_SET_PDEATHSIG`), and what it leaves
//! behind is killed when its slot's uid is next claimed or used.
//! [`Sandbox::describe`] says what is and is not enforced.
//!
//! # Agents: a network with one door
//!
//! A sandbox made with [`Network::Loopback`] (for agents that call models
//! through evalfleet's gateway) has its network namespace's loopback up,
//! and nothing else: [`Sandbox::listen`] makes a TCP listener on
//! `127.0.0.1:0` *inside* that namespace, which our process accepts on.
//! Programs reach that port and nothing else: another port on 127.0.0.1 is
//! refused (`ECONNREFUSED`), any other address unreachable
//! (`ENETUNREACH`), and the host's own servers on its 127.0.0.1 are in
//! another namespace. The namespace is the sandbox's, shared by its slots:
//! a program that listens on the loopback itself can be reached by the
//! other programs of the same sandbox (the user's own agents), never from
//! outside it. Where namespaces are not available (not root), `listen`
//! binds the host's 127.0.0.1 and the network is NOT closed: programs reach
//! every port of this machine and every address it reaches, and
//! [`Sandbox::describe`] says so.

use std::ffi::CString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::{Semaphore, SemaphorePermit};

use crate::sys::{self, ChildSetup, MountPlan, Namespaces, Rlimits};

/// The first uid the sandbox gives its slots: far above the ranges that
/// systems give people, services and containers' subordinate ids.
pub const UID_BASE: u32 = 1_900_000_000;
/// How many uids it may choose from.
pub const UID_SPAN: u32 = 1 << 20;
/// Directories covered by an empty, read-only file system inside the mount
/// namespace: where anyone may write, and the host's run-time directories,
/// where its services' unix sockets are (a socket's file mode, not the
/// read-only mount, decides who connects: PostgreSQL's and MySQL's let
/// everyone). `/var/run` is most often a link to `/run`.
pub const COVERED: [&str; 6] = [
    "/tmp",
    "/var/tmp",
    "/dev/shm",
    "/dev/mqueue",
    "/run",
    "/var/run",
];

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

impl Limits {
    /// The CPU-time limit as the kernel takes it, in whole seconds (at
    /// least one): SIGXCPU at the first, SIGKILL at the second for a program
    /// that goes on. The same on every backend, so that a verdict means the
    /// same wherever the program ran.
    pub fn cpu_seconds(&self) -> (u64, u64) {
        let soft = self.cpu.as_secs().max(1);
        (soft, soft + 1)
    }
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

/// What network a sandbox's programs have (where namespaces are available).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Network {
    /// None at all: the loopback is down (the code judge's).
    #[default]
    None,
    /// The loopback, up, on which only the listeners that
    /// [`Sandbox::listen`] makes listen (agents and their gateway).
    Loopback,
}

/// What a sandbox is made with besides its slots and toolchains.
#[derive(Debug, Clone, Default)]
pub struct Options {
    pub network: Network,
    /// Files and folders under the toolchains (host paths) that programs
    /// see empty: a store and its folder, beside an agent's program.
    pub hide: Vec<PathBuf>,
    /// Bytes that the files of one slot's folders may hold together: each
    /// slot's folders are on a file system in memory of this size, seen
    /// only in the mount namespace (so not enforced without one). `None`:
    /// folders on this machine's disk, each file held to `file_bytes`.
    pub disk_bytes: Option<u64>,
}

/// What the sandbox enforces on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Isolation {
    /// An empty network namespace and the read-only mount namespace.
    pub namespaces: bool,
    /// The tree outside the program's directory is read-only (else only
    /// the shared temporary directories are covered).
    pub read_only: bool,
    /// Each slot runs programs as a uid of its own.
    pub own_uids: bool,
}

impl Isolation {
    /// Everything the sandbox can enforce.
    pub const ALL: Self = Self {
        namespaces: true,
        read_only: true,
        own_uids: true,
    };

    /// What is enforced, in words, for logs and `evalfleet check`.
    pub fn describe(&self) -> String {
        self.describe_network(Network::None)
    }

    /// The same, for programs given `network`.
    pub fn describe_network(&self, network: Network) -> String {
        let mut on = vec![
            "own directory",
            "process group",
            "wall-clock timeout",
            "output cap",
            "CPU, memory, file-size and process limits",
        ];
        let mut off = Vec::new();
        if self.own_uids {
            on.push(
                "a uid of its own per slot (its directory only, no signals to others; every process it starts is killed when it ends)",
            );
        } else {
            off.push(
                "a separate user (not root: programs run as this user, may write where it can, and a process that leaves its group outlives it)",
            );
        }
        if self.namespaces {
            on.push(match network {
                Network::None => "no network (empty network namespace)",
                Network::Loopback => {
                    "no network but the gateway's port (a network namespace whose loopback only the gateway listens on)"
                }
            });
            on.push(if self.read_only {
                "read-only file system but for its directory, empty /tmp and /run (no unix socket of this machine's services) (mount namespace)"
            } else {
                "empty read-only /tmp, /var/tmp, /dev/shm and /run (mount namespace; the kernel cannot make the rest read-only)"
            });
        } else {
            off.push(match network {
                Network::None => {
                    "network isolation and a private file system view (namespaces need root)"
                }
                Network::Loopback => {
                    "network isolation (programs reach the gateway on this machine's 127.0.0.1, and with it every port of this machine and every address it reaches) and a private file system view (namespaces need root)"
                }
            });
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
    /// Killed by a signal (a crash, an abort).
    Signaled(i32),
    /// Past its CPU-time limit.
    CpuLimit,
    /// Past the wall-clock limit.
    TimedOut,
    /// Its processes together went past the memory of their slot's group
    /// ([`Sandbox::limit_memory`]): the kernel killed one of them.
    MemoryLimit,
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
    /// failed allocation reported by the C++ or Rust runtime.
    pub fn out_of_memory(&self) -> bool {
        let err = String::from_utf8_lossy(&self.stderr);
        err.contains("MemoryError")
            || err.contains("std::bad_alloc")
            || err.contains("memory allocation of")
    }
}

/// A sandbox: its directory, its namespaces, and its slots.
pub struct Sandbox {
    root: PathBuf,
    namespaces: Option<Namespaces>,
    network: Network,
    /// Free uids (with the lock files that claim them), one per slot.
    uids: Option<Mutex<Vec<(u32, File)>>>,
    slots: Semaphore,
    /// Toolchain directories bound into the mount namespace: host path and
    /// the path programs see.
    binds: Vec<(PathBuf, PathBuf)>,
    /// A memory cgroup per slot's uid, when one limit holds for all the
    /// processes of an execution together ([`Sandbox::limit_memory`]).
    memory: Option<std::collections::HashMap<u32, crate::cgroup::Group>>,
    /// The sized folders that slots make their directories in (when
    /// `Options::disk_bytes` holds in the mount namespace): free ones.
    disks: Option<Mutex<Vec<Disk>>>,
    /// The size asked for, enforced or not.
    disk_bytes: Option<u64>,
    /// The sized folders' mount points on this machine (removed with the
    /// sandbox, whether they were used or not).
    disk_points: Vec<PathBuf>,
}

/// A slot's sized folder: where it is reached from here and seen inside.
struct Disk {
    here: PathBuf,
    inside: PathBuf,
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        // Its working directories are gone with their executions; the
        // mount points and the directory itself go now (when empty).
        for (_, point) in &self.binds {
            let _ = std::fs::remove_dir(point);
        }
        // A mount point of another namespace may be removed here: the
        // kernel then takes the mount off it there.
        for point in &self.disk_points {
            let _ = std::fs::remove_dir(point);
        }
        let _ = std::fs::remove_dir(&self.root);
    }
}

/// A slot of the sandbox: one execution at a time, with its uid.
pub struct Slot<'a> {
    sandbox: &'a Sandbox,
    uid: Option<(u32, File)>,
    disk: Option<Disk>,
    _permit: Option<SemaphorePermit<'a>>,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if let (Some(disk), Some(pool)) = (self.disk.take(), &self.sandbox.disks)
            && let Ok(mut pool) = pool.lock()
        {
            pool.push(disk);
        }
        if let (Some(uid), Some(pool)) = (self.uid.take(), &self.sandbox.uids)
            && let Ok(mut pool) = pool.lock()
        {
            pool.push(uid);
        }
    }
}

/// A fresh directory for one execution, removed when dropped.
pub struct Workdir {
    path: PathBuf,
    inside: PathBuf,
    /// The slot's uid, which owns it (where the sandbox has uids).
    owner: Option<u32>,
}

impl Workdir {
    /// Its path on this machine.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its path as programs in the sandbox see it.
    pub fn inside(&self) -> &Path {
        &self.inside
    }

    /// Writes a new file `name` (one component: no `/`, not `.` or `..`)
    /// with `bytes`, owned by the slot's uid (mode 600): its programs may
    /// read, change and remove it, the other slots' may not. A `name` that
    /// exists already (a file, or a link a program left) is refused, never
    /// followed.
    pub fn write_file(&self, name: &str, bytes: &[u8]) -> std::io::Result<PathBuf> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        if name.is_empty() || name == "." || name == ".." || name.contains(['/', '\0']) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("'{name}' is not a file name of the program's directory"),
            ));
        }
        let path = self.path.join(name);
        let mut file = std::fs::File::options()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)?;
        if let Some(uid) = self.owner {
            std::os::unix::fs::fchown(&file, Some(uid), Some(uid))?;
        }
        file.write_all(bytes)?;
        Ok(path)
    }

    /// Hands the directory and its regular files to root, readable and
    /// executable by all, writable by none: a compiled program that every
    /// test of a problem runs, and none may change. Anything else in it is
    /// removed.
    pub fn seal(&self) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        for entry in std::fs::read_dir(&self.path)? {
            let entry = entry?;
            let path = entry.path();
            let kind = entry.file_type()?;
            if kind.is_file() {
                std::os::unix::fs::lchown(&path, Some(0), Some(0))?;
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o555))?;
            } else if kind.is_dir() {
                std::fs::remove_dir_all(&path)?;
            } else {
                std::fs::remove_file(&path)?;
            }
        }
        std::os::unix::fs::lchown(&self.path, Some(0), Some(0))?;
        std::fs::set_permissions(&self.path, std::fs::Permissions::from_mode(0o755))
    }
}

impl Drop for Workdir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

fn random_dir(parent: &Path, prefix: &str) -> std::io::Result<PathBuf> {
    for _ in 0..16 {
        let path = parent.join(format!("{prefix}-{:016x}", fastrand::u64(..)));
        match std::fs::create_dir(&path) {
            Ok(()) => return Ok(path),
            Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(err) => return Err(err),
        }
    }
    Err(std::io::Error::other("cannot create a sandbox directory"))
}

/// The unix sockets this machine's services listen on (bound to a path,
/// in our network namespace: `/proc/net/unix`): a socket's file mode, not
/// the read-only mount, decides who may connect, and many let everyone.
fn host_sockets() -> Vec<PathBuf> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(table) = std::fs::read_to_string("/proc/net/unix") else {
        return Vec::new();
    };
    let mut sockets: Vec<PathBuf> = table
        .lines()
        .skip(1)
        .filter_map(|line| line.split_whitespace().nth(7))
        .filter(|path| path.starts_with('/'))
        .map(PathBuf::from)
        .filter(|path| std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()))
        .collect();
    sockets.sort();
    sockets.dedup();
    sockets
}

/// Whether everyone may pass through every directory above `path`.
fn open_to_others(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.ancestors()
        .skip(1)
        .all(|dir| std::fs::metadata(dir).is_ok_and(|m| m.permissions().mode() & 0o001 != 0))
}

/// Claims `count` uids no other sandbox on this machine holds: each is
/// claimed by an exclusive lock on a file of its own, which the kernel lets
/// go when the holder ends, however it ends.
fn claim_uids(count: usize) -> std::io::Result<Vec<(u32, File)>> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join("evalfleet-sandbox-uids");
    std::fs::create_dir_all(&dir)?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
    let mut claimed = Vec::with_capacity(count);
    // The lowest free ones: the lock files are as many as the most slots
    // ever held at once on this machine.
    for step in 0..UID_SPAN {
        if claimed.len() == count {
            break;
        }
        let uid = UID_BASE + step;
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(uid.to_string()))?;
        if sys::try_lock(file.as_raw_fd())? {
            // What a program of an earlier holder left (its holder killed
            // before it could end them) must not outlive into new runs.
            sys::kill_all_of(uid)?;
            claimed.push((uid, file));
        }
    }
    if claimed.len() < count {
        return Err(std::io::Error::other("no free sandbox uids"));
    }
    Ok(claimed)
}

impl Sandbox {
    /// Makes a sandbox with `slots` executions at once, its directories
    /// under `root` (created), and `toolchains` (host directories) readable
    /// by its programs. It uses whatever isolation this machine allows and
    /// checks, by running a program, that it works.
    pub async fn new(root: &Path, slots: usize, toolchains: &[PathBuf]) -> std::io::Result<Self> {
        Self::with(root, slots, toolchains, Isolation::ALL).await
    }

    /// The same, enforcing at most `wanted` (what this machine allows of
    /// it): the degraded sandboxes of machines that allow less.
    pub async fn with(
        root: &Path,
        slots: usize,
        toolchains: &[PathBuf],
        wanted: Isolation,
    ) -> std::io::Result<Self> {
        Self::with_network(root, slots, toolchains, wanted, Network::None).await
    }

    /// The same, its programs given `network` (see the module's docs):
    /// [`Network::Loopback`] for agents that reach us through
    /// [`Sandbox::listen`].
    pub async fn with_network(
        root: &Path,
        slots: usize,
        toolchains: &[PathBuf],
        wanted: Isolation,
        network: Network,
    ) -> std::io::Result<Self> {
        let options = Options {
            network,
            ..Options::default()
        };
        Self::with_options(root, slots, toolchains, wanted, options).await
    }

    /// The same, with `options`.
    pub async fn with_options(
        root: &Path,
        slots: usize,
        toolchains: &[PathBuf],
        wanted: Isolation,
        options: Options,
    ) -> std::io::Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        let network = options.network;
        std::fs::create_dir_all(root)?;
        let root = root.canonicalize()?;
        // Programs may pass through to their own directory, not list it.
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o711))?;
        let root_user = sys::is_root();
        let mut binds = Vec::new();
        for (index, host) in toolchains.iter().enumerate() {
            let point = root.join(format!(".toolchain-{index}"));
            std::fs::create_dir_all(&point)?;
            binds.push((host.clone(), point));
        }
        // The slots' sized folders' mount points (seen inside at /mnt/...).
        let mut disk_points = Vec::new();
        if options.disk_bytes.is_some() && root_user && wanted.namespaces {
            for index in 0..slots {
                let point = root.join(format!(".slot-{index}"));
                std::fs::create_dir_all(&point)?;
                disk_points.push(point);
            }
        }
        let namespaces = if root_user && wanted.namespaces && Path::new("/mnt").is_dir() {
            // Bound where programs see them: under /mnt.
            let at: Vec<PathBuf> = binds
                .iter()
                .map(|(_, point)| {
                    Path::new("/mnt").join(point.strip_prefix(&root).unwrap_or(point))
                })
                .collect();
            let bind_refs: Vec<(&Path, &Path)> = binds
                .iter()
                .zip(&at)
                .map(|((host, _), at)| (host.as_path(), at.as_path()))
                .collect();
            let covered: Vec<&Path> = COVERED
                .iter()
                .map(Path::new)
                .filter(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir()))
                .collect();
            // A bound folder's `.env` (where evalfleet's configs keep their
            // secrets) is seen empty.
            let mut hidden: Vec<PathBuf> = binds
                .iter()
                .zip(&at)
                .filter(|((host, _), _)| host.join(".env").is_file())
                .map(|(_, at)| at.join(".env"))
                .collect();
            // What `options.hide` names, where programs would see it.
            let mut hidden_dirs = Vec::new();
            for path in &options.hide {
                let Some(seen) = binds.iter().zip(&at).find_map(|((host, _), at)| {
                    path.strip_prefix(host).ok().map(|rest| at.join(rest))
                }) else {
                    continue;
                };
                match std::fs::symlink_metadata(path) {
                    Ok(meta) if meta.is_dir() => hidden_dirs.push(seen),
                    Ok(meta) if meta.is_file() => hidden.push(seen),
                    _ => {}
                }
            }
            let hidden: Vec<&Path> = hidden.iter().map(PathBuf::as_path).collect();
            let hidden_dirs: Vec<&Path> = hidden_dirs.iter().map(PathBuf::as_path).collect();
            let sized: Vec<PathBuf> = disk_points
                .iter()
                .map(|point| Path::new("/mnt").join(point.strip_prefix(&root).unwrap_or(point)))
                .collect();
            let sized: Vec<&Path> = sized.iter().map(PathBuf::as_path).collect();
            // Each where programs reach it: at its own path, and under a
            // bound folder (a socket in the agent's folder).
            let listening = host_sockets();
            let under_binds: Vec<PathBuf> = listening
                .iter()
                .flat_map(|socket| {
                    binds.iter().zip(&at).filter_map(move |((host, _), at)| {
                        socket.strip_prefix(host).ok().map(|rest| at.join(rest))
                    })
                })
                .collect();
            let covered_real: Vec<PathBuf> = covered
                .iter()
                .filter_map(|dir| dir.canonicalize().ok())
                .collect();
            let mut sockets: Vec<PathBuf> = listening
                .into_iter()
                .filter(|socket| {
                    !socket
                        .canonicalize()
                        .is_ok_and(|real| covered_real.iter().any(|dir| real.starts_with(dir)))
                })
                .collect();
            sockets.extend(under_binds);
            let sockets: Vec<&Path> = sockets.iter().map(PathBuf::as_path).collect();
            match Namespaces::create(&MountPlan {
                root: &root,
                binds: &bind_refs,
                covered: &covered,
                hidden: &hidden,
                hidden_dirs: &hidden_dirs,
                sized: &sized,
                sized_bytes: options.disk_bytes.unwrap_or(0),
                sockets: &sockets,
                loopback: network == Network::Loopback,
            }) {
                Ok(ns) => Some(ns),
                Err(err) => {
                    tracing::warn!(
                        "The sandbox cannot make namespaces here ({err}): programs will see the network and the file system."
                    );
                    None
                }
            }
        } else {
            None
        };
        let uids = if root_user && wanted.own_uids {
            match claim_uids(slots) {
                Ok(uids) => Some(Mutex::new(uids)),
                Err(err) => {
                    tracing::warn!("The sandbox cannot claim uids of its own ({err}).");
                    None
                }
            }
        } else {
            None
        };
        // Without a mount namespace, programs reach their directories
        // through the directories above: where those are closed to others,
        // the sandbox moves to the shared temporary directory.
        let root = if namespaces.is_none() && uids.is_some() && !open_to_others(&root) {
            let moved = std::env::temp_dir()
                .join("evalfleet-sandbox")
                .join(format!("{:016x}", fastrand::u64(..)));
            std::fs::create_dir_all(&moved)?;
            std::fs::set_permissions(&moved, std::fs::Permissions::from_mode(0o711))?;
            std::fs::set_permissions(
                std::env::temp_dir().join("evalfleet-sandbox"),
                std::fs::Permissions::from_mode(0o711),
            )?;
            tracing::info!(
                "The sandbox's programs cannot pass through the directories above {}: their directories go under {} instead.",
                root.display(),
                moved.display()
            );
            moved
        } else {
            root
        };
        let points = disk_points.clone();
        let disks = namespaces.as_ref().and_then(|ns| {
            let disks: Vec<Disk> = disk_points
                .into_iter()
                .map(|point| {
                    let inside =
                        Path::new("/mnt").join(point.strip_prefix(&root).unwrap_or(&point));
                    Disk {
                        here: ns.seen_from_here(&inside),
                        inside,
                    }
                })
                .collect();
            (!disks.is_empty()).then(|| Mutex::new(disks))
        });
        let mut sandbox = Self {
            root,
            namespaces,
            network,
            uids,
            slots: Semaphore::new(slots),
            binds,
            memory: None,
            disks,
            disk_bytes: options.disk_bytes,
            disk_points: points,
        };
        // What the kernel refused only shows when a program runs: drop the
        // parts that keep a trivial one from running, saying so.
        loop {
            let probe = sandbox.probe().await;
            match probe {
                Ok(()) => return Ok(sandbox),
                Err(err) if sandbox.namespaces.is_some() => {
                    tracing::warn!(
                        "A program cannot run in the sandbox's namespaces ({err}); going on without them."
                    );
                    sandbox.namespaces = None;
                    sandbox.disks = None;
                }
                Err(err) if sandbox.uids.is_some() => {
                    tracing::warn!(
                        "A program cannot run as the sandbox's own uid ({err}); going on as this user."
                    );
                    sandbox.uids = None;
                }
                Err(err) => return Err(err),
            }
        }
    }

    async fn probe(&self) -> std::io::Result<()> {
        let slot = self.slot().await;
        let dir = slot.workdir()?;
        // By its absolute path, as interpreters open their programs: every
        // directory above it must let the program through.
        let file = dir.inside().join("probe");
        let script = format!("echo ok > '{0}' && cat '{0}'", file.display());
        let argv = ["/bin/sh".to_owned(), "-c".to_owned(), script];
        let run = slot.run(&argv, &dir, b"", &Limits::default()).await?;
        if run.success() && run.stdout == b"ok\n" {
            Ok(())
        } else {
            Err(std::io::Error::other(format!(
                "{:?}: {}",
                run.ended,
                String::from_utf8_lossy(&run.stderr).trim()
            )))
        }
    }

    pub fn isolation(&self) -> Isolation {
        Isolation {
            namespaces: self.namespaces.is_some(),
            read_only: self.namespaces.as_ref().is_some_and(|ns| ns.read_only),
            own_uids: self.uids.is_some(),
        }
    }

    /// What is enforced, in words, the network included.
    /// One limit of `bytes` for all the processes of an execution together
    /// (its children, daemons and new sessions included), with a memory
    /// cgroup per slot. Why not, where groups cannot be made (not root, no
    /// memory controller evalfleet may use): each process then has only
    /// its own `RLIMIT_AS`.
    pub fn limit_memory(&mut self, bytes: u64) -> Result<(), String> {
        let Some(pool) = &self.uids else {
            return Err("the sandbox has no users of its own (evalfleet is not root)".to_owned());
        };
        let uids: Vec<u32> = pool
            .lock()
            .map_err(|_| "the sandbox's users are poisoned".to_owned())?
            .iter()
            .map(|(uid, _)| *uid)
            .collect();
        self.memory = Some(crate::cgroup::groups(&uids, bytes)?.into_iter().collect());
        Ok(())
    }

    /// Whether one slot's folders are held to `Options::disk_bytes`.
    pub fn disk_limited(&self) -> bool {
        self.disks.is_some()
    }

    pub fn describe(&self) -> String {
        let mut text = self.isolation().describe_network(self.network);
        match (self.disk_bytes, self.disks.is_some()) {
            (Some(bytes), true) => text = text.replacen(
                "own directory",
                &format!(
                    "own directory (its files together at most {} MiB: a file system in memory)",
                    bytes >> 20
                ),
                1,
            ),
            (Some(_), false) => {
                let sep = if text.contains("; NOT enforced: ") {
                    "; "
                } else {
                    "; NOT enforced: "
                };
                text.push_str(sep);
                text.push_str("a size for its directory's files together (needs the mount namespace: each file alone is held to its size)");
            }
            (None, _) => {}
        }
        if self.own_pids() {
            text = text.replacen(
                "sandbox: ",
                "sandbox: its own processes only, each ending with evalfleet (PID namespace), ",
                1,
            );
        }
        text
    }

    /// Whether programs run in a PID namespace of the sandbox's: they see
    /// the processes of their own uid only, and every process they start
    /// ends when evalfleet does, however it ends.
    pub fn own_pids(&self) -> bool {
        self.namespaces.as_ref().is_some_and(Namespaces::own_pids)
    }

    /// The network its programs were given.
    pub fn network(&self) -> Network {
        self.network
    }

    /// A TCP listener on `127.0.0.1:0` that the programs of a
    /// [`Network::Loopback`] sandbox reach, at the same address, and
    /// (where namespaces are available) the only thing they reach. It is
    /// blocking: for tokio, `set_nonblocking(true)` then
    /// `tokio::net::TcpListener::from_std`. Without namespaces it is on the
    /// host's 127.0.0.1, where the programs reach everything else too
    /// ([`Sandbox::describe`] says so). A sandbox made with
    /// [`Network::None`] has no network to listen on: an error.
    pub fn listen(&self) -> std::io::Result<std::net::TcpListener> {
        if self.network != Network::Loopback {
            return Err(std::io::Error::other(
                "this sandbox's programs have no network: make it with Network::Loopback to listen for them",
            ));
        }
        match &self.namespaces {
            Some(ns) => ns.listen(),
            None => std::net::TcpListener::bind(("127.0.0.1", 0)),
        }
    }

    /// Where programs see `path`, a path under the sandbox's directory.
    fn inside(&self, path: &Path) -> PathBuf {
        match (&self.namespaces, path.strip_prefix(&self.root)) {
            (Some(_), Ok(rest)) => Path::new("/mnt").join(rest),
            _ => path.to_owned(),
        }
    }

    /// Where programs see the `index`th toolchain given to [`Sandbox::new`].
    pub fn toolchain(&self, index: usize) -> Option<PathBuf> {
        let (host, point) = self.binds.get(index)?;
        Some(if self.namespaces.is_some() {
            self.inside(point)
        } else {
            host.clone()
        })
    }

    /// Waits for a free slot.
    pub async fn slot(&self) -> Slot<'_> {
        // The semaphore is never closed: a permit always comes.
        let permit = self.slots.acquire().await.ok();
        let uid = self
            .uids
            .as_ref()
            .and_then(|pool| pool.lock().ok().and_then(|mut pool| pool.pop()));
        let disk = self
            .disks
            .as_ref()
            .and_then(|pool| pool.lock().ok().and_then(|mut pool| pool.pop()));
        Slot {
            sandbox: self,
            uid,
            disk,
            _permit: permit,
        }
    }
}

impl Slot<'_> {
    fn uid(&self) -> Option<u32> {
        self.uid.as_ref().map(|(uid, _)| *uid)
    }

    /// A fresh directory that this slot's programs may write.
    pub fn workdir(&self) -> std::io::Result<Workdir> {
        use std::os::unix::fs::PermissionsExt;
        let dir = match &self.disk {
            Some(disk) => {
                let path = random_dir(&disk.here, "sbx")?;
                let name = path.file_name().unwrap_or_default();
                Workdir {
                    inside: disk.inside.join(name),
                    path,
                    owner: self.uid(),
                }
            }
            None => {
                let path = random_dir(&self.sandbox.root, "sbx")?;
                Workdir {
                    inside: self.sandbox.inside(&path),
                    path,
                    owner: self.uid(),
                }
            }
        };
        if let Some(uid) = self.uid() {
            std::os::unix::fs::chown(&dir.path, Some(uid), Some(uid))?;
        }
        std::fs::set_permissions(&dir.path, std::fs::Permissions::from_mode(0o700))?;
        Ok(dir)
    }

    /// Runs `argv` in `dir` with `stdin`, within `limits`.
    pub async fn run(
        &self,
        argv: &[String],
        dir: &Workdir,
        stdin: &[u8],
        limits: &Limits,
    ) -> std::io::Result<Execution> {
        self.run_with(argv, dir, stdin, limits, &[]).await
    }

    /// The same, with `env` added to the program's environment (`PATH`,
    /// `LANG`, `HOME`, `TMPDIR` and `PYTHONDONTWRITEBYTECODE`, which `env`
    /// may replace). A name that is empty or holds `=`, or a NUL byte
    /// anywhere, is an error.
    pub async fn run_with(
        &self,
        argv: &[String],
        dir: &Workdir,
        stdin: &[u8],
        limits: &Limits,
        env: &[(String, String)],
    ) -> std::io::Result<Execution> {
        let Spawned {
            child,
            mut process,
            mut reaper,
            group,
            kills_before,
            started,
        } = self.spawn(argv, dir, limits, env)?;
        let exit = sys::exit_watcher(child.pidfd)?;
        let mut input = pipe::Sender::from_owned_fd_unchecked(child.stdin)?;
        let out = pipe::Receiver::from_owned_fd_unchecked(child.stdout)?;
        let err = pipe::Receiver::from_owned_fd_unchecked(child.stderr)?;
        let data = stdin.to_vec();
        let feed = async move {
            // A program that does not read its input is not an error.
            let _ = input.write_all(&data).await;
            drop(input);
        };
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        let outcome = tokio::time::timeout(limits.wall, async {
            let io = async {
                tokio::join!(
                    collect(out, err, &mut stdout, &mut stderr, limits.output_bytes),
                    feed
                )
                .0
            };
            tokio::pin!(io);
            let status = tokio::select! {
                over = &mut io => {
                    if over {
                        return None;
                    }
                    process.wait(&exit).await.ok()
                }
                status = process.wait(&exit) => {
                    // It ended: so does what it left behind, which may hold
                    // its output open. What is left in the pipes is read.
                    reaper.reap();
                    match tokio::time::timeout(DRAIN, &mut io).await {
                        Ok(true) => return None,
                        _ => status.ok(),
                    }
                }
            };
            Some(status)
        })
        .await;
        let ended = match outcome {
            Ok(None) => {
                stdout.truncate(limits.output_bytes);
                stderr.truncate(limits.output_bytes.saturating_sub(stdout.len()));
                Ended::OutputLimit
            }
            Ok(Some(Some(status))) => match status {
                (Some(code), _) => Ended::Exited(code),
                (None, Some(libc::SIGXCPU)) => Ended::CpuLimit,
                // The hard CPU limit sends SIGKILL to a program that
                // ignores SIGXCPU; a program that kills itself early
                // cannot have used its CPU time yet.
                (None, Some(libc::SIGKILL)) if started.elapsed().mul_f64(cores()) >= limits.cpu => {
                    Ended::CpuLimit
                }
                (None, Some(signal)) => Ended::Signaled(signal),
                (None, None) => Ended::Signaled(0),
            },
            Ok(Some(None)) => Ended::Signaled(0),
            Err(_) => Ended::TimedOut,
        };
        reaper.reap();
        process.reap(&exit).await;
        // A process of the execution killed for the group's memory: the
        // execution went past it, however it ended.
        let ended = past_memory(ended, group, kills_before);
        Ok(Execution {
            ended,
            stdout,
            stderr,
            elapsed: started.elapsed(),
        })
    }

    /// Starts `argv` in `dir` as [`Slot::run_with`] does, and hands back
    /// the running program with its standard streams, for a program that
    /// serves many requests (a persistent agent) rather than one input. No
    /// wall-clock limit holds; `limits`' others do. Dropped, or
    /// [`Running::end`]ed, it is killed with every process it started.
    pub fn start(
        &self,
        argv: &[String],
        dir: &Workdir,
        limits: &Limits,
        env: &[(String, String)],
    ) -> std::io::Result<Running<'_>> {
        let Spawned {
            child,
            process,
            reaper,
            group,
            kills_before,
            ..
        } = self.spawn(argv, dir, limits, env)?;
        Ok(Running {
            exit: sys::exit_watcher(child.pidfd)?,
            stdin: Some(pipe::Sender::from_owned_fd_unchecked(child.stdin)?),
            stdout: Some(pipe::Receiver::from_owned_fd_unchecked(child.stdout)?),
            stderr: Some(pipe::Receiver::from_owned_fd_unchecked(child.stderr)?),
            process,
            reaper,
            group,
            kills_before,
            ended: None,
        })
    }

    /// Starts `argv` in `dir`, within `limits`, with `env` added: the
    /// program, and what ends it and everything it starts.
    fn spawn(
        &self,
        argv: &[String],
        dir: &Workdir,
        limits: &Limits,
        env: &[(String, String)],
    ) -> std::io::Result<Spawned<'_>> {
        let Some(program) = argv.first() else {
            return Err(std::io::Error::other("nothing to run"));
        };
        let cstring = |text: &[u8]| {
            CString::new(text).map_err(|_| std::io::Error::other("an argument holds a NUL byte"))
        };
        let path = cstring(resolve(program)?.as_os_str().as_encoded_bytes())?;
        let args = argv
            .iter()
            .map(|a| cstring(a.as_bytes()))
            .collect::<std::io::Result<Vec<_>>>()?;
        let inside = dir.inside().as_os_str().as_encoded_bytes();
        let mut environment = vec![
            cstring(b"PATH=/usr/local/bin:/usr/bin:/bin")?,
            cstring(b"LANG=C.UTF-8")?,
            cstring(b"PYTHONDONTWRITEBYTECODE=1")?,
        ];
        for key in ["HOME", "TMPDIR"] {
            environment.push(cstring(&[key.as_bytes(), b"=", inside].concat())?);
        }
        for (name, value) in env {
            if name.is_empty() || name.contains('=') {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("'{name}' is not an environment variable's name"),
                ));
            }
            let prefix = format!("{name}=");
            environment.retain(|e| !e.as_bytes().starts_with(prefix.as_bytes()));
            environment.push(cstring(format!("{prefix}{value}").as_bytes())?);
        }
        // Its slot's memory group, and the kills the kernel made in it so
        // far: one more by the end is this execution's.
        let group = self
            .uid()
            .and_then(|uid| self.sandbox.memory.as_ref()?.get(&uid));
        let kills_before = group.map(crate::cgroup::Group::oom_kills);
        let setup = ChildSetup {
            cgroup: group.map(crate::cgroup::Group::procs_fd),
            namespaces: self.sandbox.namespaces.as_ref().map(Namespaces::raw),
            cwd: cstring(inside)?,
            limits: Some(Rlimits {
                cpu_seconds: limits.cpu_seconds(),
                address_space: limits.memory_mb.saturating_mul(1024 * 1024),
                file_size: limits.file_bytes,
                processes: u64::from(limits.processes),
            }),
            ids: self.uid().map(|uid| (uid, uid)),
        };
        let started = Instant::now();
        let child = sys::spawn(sys::Spawn {
            path,
            argv: args,
            env: environment,
            setup,
        })
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot start '{program}': {e}")))?;
        let process = Process {
            pid: child.pid,
            reaped: false,
        };
        // Whatever happens to this future from here, what the program
        // started is ended.
        let reaper = Reaper {
            pgid: u32::try_from(child.pid).ok(),
            uid: self.uid(),
        };
        Ok(Spawned {
            child,
            process,
            reaper,
            group,
            kills_before,
            started,
        })
    }
}

/// A program just started, and what ends it and what it started.
struct Spawned<'a> {
    child: sys::Started,
    process: Process,
    reaper: Reaper,
    /// Its slot's memory group, and the kills the kernel had made in it.
    group: Option<&'a crate::cgroup::Group>,
    kills_before: Option<u64>,
    started: Instant,
}

/// A program that runs until it ends or is ended ([`Slot::start`]): its
/// standard streams are taken once each.
pub struct Running<'a> {
    exit: AsyncFd<std::os::fd::OwnedFd>,
    stdin: Option<pipe::Sender>,
    stdout: Option<pipe::Receiver>,
    stderr: Option<pipe::Receiver>,
    process: Process,
    reaper: Reaper,
    group: Option<&'a crate::cgroup::Group>,
    kills_before: Option<u64>,
    /// How it ended, once it has.
    ended: Option<Ended>,
}

impl Running<'_> {
    /// Its standard input, output and error (each `None` once taken).
    pub fn streams(
        &mut self,
    ) -> (
        Option<pipe::Sender>,
        Option<pipe::Receiver>,
        Option<pipe::Receiver>,
    ) {
        (self.stdin.take(), self.stdout.take(), self.stderr.take())
    }

    /// Waits for it to end by itself (what it started is then ended), and
    /// says how.
    pub async fn wait(&mut self) -> Ended {
        if let Some(ended) = self.ended {
            return ended;
        }
        let status = self.process.wait(&self.exit).await.ok();
        self.finish(status).await
    }

    /// Ends it, and every process it started, now (if it has not ended).
    pub async fn end(mut self) -> Ended {
        if let Some(ended) = self.ended {
            return ended;
        }
        self.finish(None).await
    }

    async fn finish(&mut self, status: Option<(Option<i32>, Option<i32>)>) -> Ended {
        self.reaper.reap();
        self.process.reap(&self.exit).await;
        let ended = match status {
            Some((Some(code), _)) => Ended::Exited(code),
            Some((None, Some(libc::SIGXCPU))) => Ended::CpuLimit,
            Some((None, Some(signal))) => Ended::Signaled(signal),
            _ => Ended::Signaled(libc::SIGKILL),
        };
        let ended = past_memory(ended, self.group, self.kills_before);
        self.ended = Some(ended);
        ended
    }
}

/// `ended`, unless the kernel killed a process in its memory `group` since
/// it held `kills_before` kills: then the execution went past its memory,
/// however it ended.
fn past_memory(
    ended: Ended,
    group: Option<&crate::cgroup::Group>,
    kills_before: Option<u64>,
) -> Ended {
    match (group, kills_before) {
        (Some(group), Some(before)) if group.oom_kills() > before => Ended::MemoryLimit,
        _ => ended,
    }
}

/// Finds a program named without a directory on the sandbox's PATH (the
/// same directories inside the sandbox as here).
pub fn resolve(program: &str) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    if program.contains('/') {
        return Ok(PathBuf::from(program));
    }
    ["/usr/local/bin", "/usr/bin", "/bin"]
        .iter()
        .map(|dir| Path::new(dir).join(program))
        .find(|path| {
            std::fs::metadata(path)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("no '{program}' in /usr/local/bin, /usr/bin or /bin"),
            )
        })
}

/// A started program: killed (with its group) and reaped when dropped.
/// Until then it is not reaped, even once it has ended, so that its pid
/// and process group cannot be anyone else's when they are signalled.
struct Process {
    pid: libc::pid_t,
    reaped: bool,
}

impl Process {
    /// Waits for its end: its exit code, or the signal that ended it.
    async fn wait(
        &self,
        exit: &AsyncFd<std::os::fd::OwnedFd>,
    ) -> std::io::Result<(Option<i32>, Option<i32>)> {
        loop {
            let mut ready = exit.readable().await?;
            if let Some(status) = sys::peek_exit(self.pid)? {
                return Ok(status);
            }
            ready.clear_ready();
        }
    }

    /// Kills it (and its group), waits for its end, and reaps it.
    async fn reap(&mut self, exit: &AsyncFd<std::os::fd::OwnedFd>) {
        sys::kill_group(u32::try_from(self.pid).unwrap_or(0));
        // Killed, it ends at once; the bound only keeps a process stuck in
        // the kernel from holding us.
        let _ = tokio::time::timeout(Duration::from_secs(5), self.wait(exit)).await;
        sys::reap(self.pid);
        self.reaped = true;
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if !self.reaped {
            sys::kill_group(u32::try_from(self.pid).unwrap_or(0));
            // Reaped now if it has ended, else by a later start.
            sys::reap(self.pid);
        }
    }
}

/// How long output is still read after a program has ended and its
/// processes were killed (only processes that left its group and uid, where
/// the sandbox has no uid of its own, can hold the pipes longer).
const DRAIN: Duration = Duration::from_secs(1);

/// Reads both pipes to their end into `stdout` and `stderr`; `true` when
/// they passed `cap` bytes together (and reading stopped).
async fn collect(
    mut out: impl AsyncRead + Unpin,
    mut err: impl AsyncRead + Unpin,
    stdout: &mut Vec<u8>,
    stderr: &mut Vec<u8>,
    cap: usize,
) -> bool {
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
            return true;
        }
    }
    false
}

fn cores() -> f64 {
    std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64)
}

/// Ends an execution's process group and every process of its uid.
struct Reaper {
    pgid: Option<u32>,
    uid: Option<u32>,
}

impl Reaper {
    /// Kills them now (once).
    fn reap(&mut self) {
        if let Some(pgid) = self.pgid.take() {
            sys::kill_group(pgid);
        }
        if let Some(uid) = self.uid.take()
            && let Err(err) = sys::kill_all_of(uid)
        {
            tracing::warn!("Could not end the processes of sandbox uid {uid}: {err}.");
        }
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        self.reap();
    }
}
