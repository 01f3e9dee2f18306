//! The sandbox's system calls, and the only unsafe code of the judge.
//!
//! What runs in a child between `fork` and `exec` may make only
//! async-signal-safe calls and must not allocate (another thread of ours may
//! have held the allocator's lock when we forked): everything it needs is
//! prepared before, as C strings and plain numbers.

#![allow(unsafe_code)]

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::Stdio;

fn check(ret: libc::c_int) -> io::Result<()> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

pub fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a path holds a NUL byte"))
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// A network namespace with nothing in it (not even a loopback that is up)
/// and a mount namespace in which the whole tree is read-only, the shared
/// temporary directories are empty, and the sandbox's directory is seen,
/// writable, at `/mnt`. Made once; every execution enters them.
pub struct Namespaces {
    net: OwnedFd,
    mnt: OwnedFd,
    /// The tree outside `/mnt` is read-only (`mount_setattr`, Linux 5.12).
    pub read_only: bool,
}

/// What the namespaces' mount tree holds besides the read-only system.
pub struct MountPlan<'a> {
    /// Seen at `/mnt`, writable.
    pub root: &'a Path,
    /// Host directories bound read-only at places under `root` (mount
    /// points that exist): toolchains the sandbox's users could not reach.
    pub binds: &'a [(&'a Path, &'a Path)],
    /// Directories covered by an empty, read-only file system.
    pub covered: &'a [&'a Path],
}

impl Namespaces {
    /// Makes the namespaces with a helper process that sets them up before
    /// its `exec`, keeps handles on them, and ends the helper.
    pub fn create(plan: &MountPlan<'_>) -> io::Result<Self> {
        match Self::create_with(plan, true) {
            Ok(ns) => Ok(ns),
            // A kernel without mount_setattr: the covered directories still
            // keep programs from the places anyone may write.
            Err(_) => Self::create_with(plan, false),
        }
    }

    fn create_with(plan: &MountPlan<'_>, read_only: bool) -> io::Result<Self> {
        let root = c_path(plan.root)?;
        let mnt_point = c_path(Path::new("/mnt"))?;
        let slash = c_path(Path::new("/"))?;
        let binds = plan
            .binds
            .iter()
            .map(|(host, at)| Ok((c_path(host)?, c_path(at)?)))
            .collect::<io::Result<Vec<_>>>()?;
        let covered = plan
            .covered
            .iter()
            .map(|p| c_path(p))
            .collect::<io::Result<Vec<_>>>()?;
        let tmpfs = c"tmpfs";
        let tmpfs_options = c"size=4k,mode=755";
        let setup = move || -> io::Result<()> {
            // SAFETY: each call gets NUL-terminated strings that live in this
            // closure, or null where the call allows it; none allocates.
            unsafe {
                check(libc::unshare(libc::CLONE_NEWNET | libc::CLONE_NEWNS))?;
                check(libc::mount(
                    std::ptr::null(),
                    slash.as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ))?;
                check(libc::mount(
                    root.as_ptr(),
                    mnt_point.as_ptr(),
                    std::ptr::null(),
                    libc::MS_BIND | libc::MS_REC,
                    std::ptr::null(),
                ))?;
                for (host, at) in &binds {
                    check(libc::mount(
                        host.as_ptr(),
                        at.as_ptr(),
                        std::ptr::null(),
                        libc::MS_BIND | libc::MS_REC,
                        std::ptr::null(),
                    ))?;
                }
                if read_only {
                    let mut attr: libc::mount_attr = std::mem::zeroed();
                    attr.attr_set = libc::MOUNT_ATTR_RDONLY | libc::MOUNT_ATTR_NOSUID;
                    mount_setattr(&slash, libc::AT_RECURSIVE, &attr)?;
                    // Only /mnt itself is writable again; the toolchains
                    // bound under it stay read-only.
                    let mut attr: libc::mount_attr = std::mem::zeroed();
                    attr.attr_clr = libc::MOUNT_ATTR_RDONLY;
                    mount_setattr(&mnt_point, 0, &attr)?;
                }
                for dir in &covered {
                    check(libc::mount(
                        tmpfs.as_ptr(),
                        dir.as_ptr(),
                        tmpfs.as_ptr(),
                        libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                        tmpfs_options.as_ptr().cast(),
                    ))?;
                }
            }
            Ok(())
        };
        let mut helper = std::process::Command::new("/bin/cat");
        helper
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: `setup` makes only system calls, on data prepared above.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut helper, setup);
        }
        let mut child = helper.spawn()?;
        let open = |kind: &str| -> io::Result<OwnedFd> {
            let file = std::fs::File::open(format!("/proc/{}/ns/{kind}", child.id()))?;
            Ok(OwnedFd::from(file))
        };
        let fds = open("net").and_then(|net| Ok((net, open("mnt")?)));
        let _ = child.kill();
        let _ = child.wait();
        let (net, mnt) = fds?;
        Ok(Self {
            net,
            mnt,
            read_only,
        })
    }

    fn raw(&self) -> (RawFd, RawFd) {
        (self.net.as_raw_fd(), self.mnt.as_raw_fd())
    }
}

/// # Safety
/// `path` is NUL-terminated; `attr` is a valid `mount_attr`.
unsafe fn mount_setattr(
    path: &std::ffi::CStr,
    flags: libc::c_int,
    attr: &libc::mount_attr,
) -> io::Result<()> {
    // SAFETY: the arguments are what the system call takes: a directory fd
    // (the working directory), a path, flags, and the attribute's address
    // and size.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            path.as_ptr(),
            flags,
            std::ptr::from_ref(attr),
            std::mem::size_of::<libc::mount_attr>(),
        )
    };
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// A resource limit: soft and hard.
#[derive(Debug, Clone, Copy)]
pub struct Rlimits {
    pub cpu_seconds: (u64, u64),
    pub address_space: u64,
    pub file_size: u64,
    pub processes: u64,
}

/// How a child enters the sandbox before it runs its program.
pub struct ChildSetup {
    pub namespaces: Option<(RawFd, RawFd)>,
    /// Its working directory, as seen from inside.
    pub cwd: CString,
    pub limits: Option<Rlimits>,
    /// The uid and gid it runs as (when we are root).
    pub ids: Option<(u32, u32)>,
}

impl ChildSetup {
    pub fn namespaces(ns: &Namespaces) -> Option<(RawFd, RawFd)> {
        Some(ns.raw())
    }

    /// Runs in the child, between fork and exec.
    fn enter(&self) -> io::Result<()> {
        // SAFETY: system calls only, on strings and numbers prepared before
        // the fork; the namespace handles are open (they are closed on exec,
        // not before).
        unsafe {
            if let Some((net, mnt)) = self.namespaces {
                check(libc::setns(net, libc::CLONE_NEWNET))?;
                // Entering a mount namespace moves the working directory to
                // its root: the chdir comes after.
                check(libc::setns(mnt, libc::CLONE_NEWNS))?;
            }
            check(libc::chdir(self.cwd.as_ptr()))?;
            if let Some(l) = self.limits {
                let set = |resource, soft: u64, hard: u64| {
                    let limit = libc::rlimit {
                        rlim_cur: soft,
                        rlim_max: hard,
                    };
                    check(libc::setrlimit(resource, &limit))
                };
                set(libc::RLIMIT_CPU, l.cpu_seconds.0, l.cpu_seconds.1)?;
                set(libc::RLIMIT_AS, l.address_space, l.address_space)?;
                set(libc::RLIMIT_FSIZE, l.file_size, l.file_size)?;
                set(libc::RLIMIT_NPROC, l.processes, l.processes)?;
                set(libc::RLIMIT_CORE, 0, 0)?;
            }
            if let Some((uid, gid)) = self.ids {
                check(libc::setgroups(0, std::ptr::null()))?;
                check(libc::setresgid(gid, gid, gid))?;
                check(libc::setresuid(uid, uid, uid))?;
            }
            // No set-user-ID program can give it back what it gave up.
            check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
        }
        Ok(())
    }

    /// Makes `command`'s child enter the sandbox before its `exec`.
    pub fn install(self, command: &mut tokio::process::Command) {
        // SAFETY: `enter` makes only async-signal-safe system calls on data
        // prepared before the fork, and does not allocate.
        unsafe {
            command.pre_exec(move || self.enter());
        }
    }
}

/// Kills every process of `uid` (a sandbox's own uid): whatever a program
/// left behind, wherever it went (a new session, a new process group).
/// Only a process of that uid may signal them all at once (atomically with
/// respect to their forks), so a short-lived child takes the uid and
/// signals every process it may. The child shares our memory and we wait
/// while it runs (as `vfork`): nothing of our address space is copied.
pub fn kill_all_of(uid: u32) -> io::Result<()> {
    if uid == 0 {
        return Err(io::Error::other("refusing to kill root's processes"));
    }
    extern "C" fn sweep(arg: *mut libc::c_void) -> libc::c_int {
        let uid = arg as usize as libc::uid_t;
        // SAFETY: raw system calls only: they change this task's own
        // credentials (the C library's setresuid would change those of
        // every thread it knows, which are the parent's).
        unsafe {
            if libc::syscall(libc::SYS_setresuid, uid, uid, uid) != 0 {
                return 1;
            }
            if libc::syscall(libc::SYS_kill, -1, libc::SIGKILL) == 0 {
                return 0;
            }
            // ESRCH: nothing was left, the usual case.
            i32::from(*libc::__errno_location() != libc::ESRCH)
        }
    }
    let mut stack = vec![0u8; 64 * 1024];
    // SAFETY: the child runs `sweep` on its own stack (which outlives it:
    // with CLONE_VFORK this thread waits until the child has exited) and
    // touches nothing else of ours; `uid` travels in the argument pointer.
    unsafe {
        let top = stack.as_mut_ptr().add(stack.len());
        let pid = libc::clone(
            sweep,
            top.cast(),
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            uid as usize as *mut libc::c_void,
        );
        if pid == -1 {
            return Err(io::Error::last_os_error());
        }
        let mut status = 0;
        while libc::waitpid(pid, &raw mut status, 0) == -1 {
            if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                return Err(io::Error::last_os_error());
            }
        }
        if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
            Ok(())
        } else {
            Err(io::Error::other("could not signal the sandbox's processes"))
        }
    }
}

/// Kills a process group.
pub fn kill_group(pgid: u32) {
    let Ok(pgid) = libc::pid_t::try_from(pgid) else {
        return;
    };
    if pgid <= 1 {
        return;
    }
    // SAFETY: kill has no memory-safety preconditions; a negative pid names
    // a process group, here one made for one execution.
    unsafe {
        libc::kill(-pgid, libc::SIGKILL);
    }
}

/// Takes an exclusive lock on an open file without waiting: `false` when
/// another open file holds it.
pub fn try_lock(fd: RawFd) -> io::Result<bool> {
    // SAFETY: flock has no memory-safety preconditions.
    let ret = unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) };
    if ret == 0 {
        return Ok(true);
    }
    let err = io::Error::last_os_error();
    if err.kind() == io::ErrorKind::WouldBlock {
        Ok(false)
    } else {
        Err(err)
    }
}
