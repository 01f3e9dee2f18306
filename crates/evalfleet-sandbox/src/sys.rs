//! The sandbox's system calls, and the only unsafe code of the judge.
//!
//! Children are made in two ways. The helper that makes the namespaces is a
//! `std::process::Command` whose `pre_exec` hook sets them up in the forked
//! child. Programs, and the short-lived child that kills what a program
//! left, are `clone(CLONE_VM | CLONE_VFORK)` children: they share our memory
//! (and our threads' C library state) until they `exec` or exit, while the
//! calling thread waits. Either way the child may make only
//! async-signal-safe calls and must not allocate (another thread of ours may
//! hold the allocator's lock): everything it needs is prepared before, as C
//! strings and plain numbers; and the shared-memory children change their
//! credentials with raw system calls only.
//!
//! Programs are cloned by one thread of ours that lives as long as the
//! process (see [`spawn`]): a program asks the kernel for SIGKILL when its
//! parent ends (`PR_SET_PDEATHSIG`), and the kernel's "parent" is the thread
//! that cloned it. Were that a tokio worker, a worker that becomes a
//! blocking thread (`block_in_place`) and later ends for idleness would
//! kill programs that still run; the spawner thread ends only with the
//! process, so a program dies when, and only when, evalfleet dies.

#![allow(unsafe_code)]

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::Stdio;

/// The open files a sandboxed program may keep (soft and hard).
const OPEN_FILES: u64 = 1024;

/// A system call's result: -1 is its errno.
fn check(ret: impl Into<libc::c_long>) -> io::Result<()> {
    if ret.into() == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a path holds a NUL byte"))
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// A network namespace with nothing in it (its loopback down, or up where
/// asked, with nothing listening on it but what [`listen_in`] makes), a
/// mount namespace in which the whole tree is read-only, the shared
/// temporary directories and the host's run-time directories (its unix
/// sockets) are empty, and the sandbox's directory is seen, writable, at
/// `/mnt`; and a PID namespace whose `/proc` shows each program only the
/// processes of its own uid. Made once; every execution enters them.
///
/// The PID namespace's first process is a tiny init of ours (see
/// [`init_main`]): it reaps what programs leave, and ends when the pipe
/// whose other end only we hold closes: when the sandbox is dropped, or
/// evalfleet ends however it ends (a SIGKILL included). When it ends the
/// kernel kills every process of the namespace: nothing a program started
/// outlives evalfleet, whatever session or process group it went to.
pub struct Namespaces {
    net: OwnedFd,
    mnt: OwnedFd,
    /// The PID namespace (`None` where the kernel refused one).
    pid: Option<OwnedFd>,
    /// Our end of the init's pipe: closed, the namespace ends.
    _alive: Option<OwnedFd>,
    /// The tree outside `/mnt` is read-only (`mount_setattr`, Linux 5.12).
    pub read_only: bool,
    /// The namespace's root directory, opened from here: a path under
    /// `/proc/self/fd/<it>` is resolved in the namespace's tree, its mounts
    /// included (the sized folders that exist only there).
    view: OwnedFd,
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
    /// Files (as the namespace sees them, under the binds) covered by an
    /// empty one: secrets beside a bound folder's programs (`.env`), a
    /// store.
    pub hidden: &'a [&'a Path],
    /// Directories under the binds (as the namespace sees them) covered by
    /// an empty, read-only file system: a store's folder.
    pub hidden_dirs: &'a [&'a Path],
    /// Directories under `/mnt` (as the namespace sees them) on which a
    /// file system in memory of `sized_bytes` is mounted, writable, seen
    /// only in the namespace: a slot's folders, all their files together
    /// held to that size.
    pub sized: &'a [&'a Path],
    pub sized_bytes: u64,
    /// This machine's listening unix sockets outside the covered
    /// directories, covered by `/dev/null` where the kernel lets us (one it
    /// refuses is left as it is).
    pub sockets: &'a [&'a Path],
    /// Whether the network namespace's loopback is up.
    pub loopback: bool,
}

impl Namespaces {
    /// Makes the namespaces with a helper process that sets them up before
    /// its `exec`, keeps handles on them, and ends the helper.
    pub fn create(plan: &MountPlan<'_>) -> io::Result<Self> {
        Self::create_with(plan, true, true)
            .or_else(|err| {
                tracing::warn!(
                    "The sandbox cannot make a PID namespace of its own ({err}): its programs see this machine's processes, and what they start may outlive evalfleet."
                );
                Self::create_with(plan, true, false)
            })
            // A kernel without mount_setattr: the covered directories still
            // keep programs from the places anyone may write.
            .or_else(|_| Self::create_with(plan, false, false))
    }

    fn create_with(plan: &MountPlan<'_>, read_only: bool, pids: bool) -> io::Result<Self> {
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
        let hidden = plan
            .hidden
            .iter()
            .map(|p| c_path(p))
            .collect::<io::Result<Vec<_>>>()?;
        let hidden_dirs = plan
            .hidden_dirs
            .iter()
            .map(|p| c_path(p))
            .collect::<io::Result<Vec<_>>>()?;
        let sockets = plan
            .sockets
            .iter()
            .map(|p| c_path(p))
            .collect::<io::Result<Vec<_>>>()?;
        let sized = plan
            .sized
            .iter()
            .map(|p| c_path(p))
            .collect::<io::Result<Vec<_>>>()?;
        let sized_options = CString::new(format!("size={},mode=711", plan.sized_bytes.max(4096)))
            .map_err(|_| io::Error::other("a mount option holds a NUL byte"))?;
        let dev_null = c"/dev/null";
        let tmpfs = c"tmpfs";
        let tmpfs_options = c"size=4k,mode=755";
        let loopback = plan.loopback;
        // The init's pipes: its life (our end), its first word (its own).
        let (alive_init, alive_ours) = pipe()?;
        let (ready_ours, ready_init) = pipe()?;
        let (alive_fd, ready_fd, ready_read) = (
            alive_init.as_raw_fd(),
            ready_init.as_raw_fd(),
            ready_ours.as_raw_fd(),
        );
        let setup = move || -> io::Result<()> {
            // SAFETY: each call gets NUL-terminated strings that live in this
            // closure, or null where the call allows it; none allocates.
            unsafe {
                check(libc::unshare(libc::CLONE_NEWNET | libc::CLONE_NEWNS))?;
                if loopback {
                    loopback_up()?;
                }
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
                for file in &hidden {
                    check(libc::mount(
                        dev_null.as_ptr(),
                        file.as_ptr(),
                        std::ptr::null(),
                        libc::MS_BIND,
                        std::ptr::null(),
                    ))?;
                }
                for socket in &sockets {
                    libc::mount(
                        dev_null.as_ptr(),
                        socket.as_ptr(),
                        std::ptr::null(),
                        libc::MS_BIND,
                        std::ptr::null(),
                    );
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
                // Mounted after the tree was made read-only: they stay
                // writable.
                for dir in &sized {
                    check(libc::mount(
                        tmpfs.as_ptr(),
                        dir.as_ptr(),
                        tmpfs.as_ptr(),
                        libc::MS_NOSUID | libc::MS_NODEV,
                        sized_options.as_ptr().cast(),
                    ))?;
                }
                for dir in covered.iter().chain(&hidden_dirs) {
                    check(libc::mount(
                        tmpfs.as_ptr(),
                        dir.as_ptr(),
                        tmpfs.as_ptr(),
                        libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                        tmpfs_options.as_ptr().cast(),
                    ))?;
                }
                if pids {
                    // The first child from here is the namespace's init; it
                    // mounts its /proc and says how that went.
                    check(libc::unshare(libc::CLONE_NEWPID))?;
                    let init = libc::syscall(
                        libc::SYS_clone,
                        libc::c_long::from(libc::SIGCHLD),
                        0,
                        0,
                        0,
                        0,
                    );
                    if init == 0 {
                        init_main(alive_fd, ready_fd);
                    }
                    check(init)?;
                    libc::close(ready_fd);
                    let mut word = [0u8; 4];
                    if libc::read(ready_read, word.as_mut_ptr().cast(), word.len()) != 4 {
                        return Err(io::Error::other("the sandbox's init ended at once"));
                    }
                    let errno = i32::from_ne_bytes(word);
                    if errno != 0 {
                        return Err(io::Error::from_raw_os_error(errno));
                    }
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
        let fds = open("net").and_then(|net| {
            let pid = if pids {
                Some(open("pid_for_children")?)
            } else {
                None
            };
            // The helper's root is the mount namespace's.
            let root = std::fs::File::open(format!("/proc/{}/root", child.id()))?;
            Ok((net, open("mnt")?, pid, OwnedFd::from(root)))
        });
        let _ = child.kill();
        let _ = child.wait();
        drop((alive_init, ready_init, ready_ours));
        let (net, mnt, pid, view) = fds?;
        Ok(Self {
            net,
            mnt,
            _alive: pid.is_some().then_some(alive_ours),
            pid,
            read_only,
            view,
        })
    }

    /// The handles a child enters them with: network, mount, PID.
    pub fn raw(&self) -> Entry {
        Entry {
            net: self.net.as_raw_fd(),
            mnt: self.mnt.as_raw_fd(),
            pid: self.pid.as_ref().map(AsRawFd::as_raw_fd),
        }
    }

    /// Where this process reaches `inside`, an absolute path as the
    /// namespace sees it: through the namespace's root, so that what is
    /// mounted only there (the sized folders) is what it reaches.
    pub fn seen_from_here(&self, inside: &Path) -> std::path::PathBuf {
        let rest = inside.strip_prefix("/").unwrap_or(inside);
        Path::new(&format!("/proc/self/fd/{}", self.view.as_raw_fd())).join(rest)
    }

    /// Whether programs run in a PID namespace of their own.
    pub fn own_pids(&self) -> bool {
        self.pid.is_some()
    }

    /// A TCP listener on `127.0.0.1:0` inside the network namespace (whose
    /// loopback must be up): see [`listen_in`].
    pub fn listen(&self) -> io::Result<std::net::TcpListener> {
        listen_in(&self.net)
    }
}

/// The namespaces' handles, as a child enters them.
#[derive(Debug, Clone, Copy)]
pub struct Entry {
    pub net: RawFd,
    pub mnt: RawFd,
    /// Entered by the spawner thread for its children (a process cannot
    /// move itself into another PID namespace, only its children).
    pub pid: Option<RawFd>,
}

/// A no-op handler: SIGCHLD wakes the init's wait.
extern "C" fn on_child(_: libc::c_int) {}

/// The PID namespace's init: mounts the namespace's `/proc` (each program
/// sees the processes of its own uid only: `hidepid=2`), writes 0 (or the
/// errno that failed) to `ready`, keeps only `alive` open, then reaps
/// whatever ends in the namespace until `alive` reads its end (the other
/// end is ours alone, and closes when we end, however we end). Its end
/// ends the namespace: the kernel kills every process in it.
///
/// # Safety
/// Only in the forked child that is a new PID namespace's first process.
unsafe fn init_main(alive: RawFd, ready: RawFd) -> ! {
    // SAFETY: system calls on static strings and local structures only.
    unsafe {
        let tell = |errno: i32| {
            libc::write(ready, errno.to_ne_bytes().as_ptr().cast(), 4);
        };
        if libc::mount(
            c"proc".as_ptr(),
            c"/proc".as_ptr(),
            c"proc".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            c"hidepid=2".as_ptr().cast(),
        ) == -1
        {
            tell(*libc::__errno_location());
            libc::_exit(1);
        }
        if libc::dup2(alive, 0) == -1 {
            tell(*libc::__errno_location());
            libc::_exit(1);
        }
        tell(0);
        // Nothing of ours stays open in it: not our pipes, files, sockets.
        libc::syscall(libc::SYS_close_range, 1u32, u32::MAX, 0u32);
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_child as extern "C" fn(libc::c_int) as libc::sighandler_t;
        action.sa_flags = libc::SA_NOCLDSTOP;
        libc::sigaction(libc::SIGCHLD, &raw const action, std::ptr::null_mut());
        let mut chld: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&raw mut chld);
        libc::sigaddset(&raw mut chld, libc::SIGCHLD);
        libc::sigprocmask(libc::SIG_BLOCK, &raw const chld, std::ptr::null_mut());
        let mut open: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&raw mut open);
        loop {
            while libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG | libc::__WALL) > 0 {}
            let mut fd = libc::pollfd {
                fd: 0,
                events: libc::POLLIN,
                revents: 0,
            };
            // SIGCHLD is let through only here, so none is missed.
            if libc::ppoll(&raw mut fd, 1, std::ptr::null(), &raw const open) > 0 {
                libc::_exit(0);
            }
        }
    }
}

/// Brings the current network namespace's loopback (`lo`) up.
///
/// # Safety
/// Only system calls on a local `ifreq`: safe in a forked child before its
/// `exec`.
unsafe fn loopback_up() -> io::Result<()> {
    // SAFETY: a socket we close below, and ioctls that read and write the
    // local request, whose name is NUL-terminated.
    unsafe {
        let sock = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        check(sock)?;
        let mut request: libc::ifreq = std::mem::zeroed();
        for (to, from) in request.ifr_name.iter_mut().zip(b"lo\0") {
            *to = *from as libc::c_char;
        }
        let result =
            check(libc::ioctl(sock, libc::SIOCGIFFLAGS, &raw mut request)).and_then(|()| {
                request.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
                check(libc::ioctl(sock, libc::SIOCSIFFLAGS, &raw const request))
            });
        libc::close(sock);
        result
    }
}

/// Binds a TCP listener on `127.0.0.1:0` inside the network namespace
/// `net`: a thread of its own enters the namespace (a thread's network
/// namespace is its own), binds, and ends; the socket stays in the
/// namespace it was made in, and any thread of ours may accept on it.
pub fn listen_in(net: &OwnedFd) -> io::Result<std::net::TcpListener> {
    let net = net.try_clone()?;
    std::thread::Builder::new()
        .name("evalfleet-sandbox-listen".to_owned())
        .spawn(move || -> io::Result<std::net::TcpListener> {
            // SAFETY: setns on a namespace handle we own; it changes this
            // thread only, which ends after the bind.
            check(unsafe { libc::setns(net.as_raw_fd(), libc::CLONE_NEWNET) })?;
            std::net::TcpListener::bind(("127.0.0.1", 0))
        })?
        .join()
        .map_err(|_| io::Error::other("the sandbox's listening thread panicked"))?
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
    check(unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            path.as_ptr(),
            flags,
            std::ptr::from_ref(attr),
            std::mem::size_of::<libc::mount_attr>(),
        )
    })
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
#[derive(Clone)]
pub struct ChildSetup {
    /// A memory cgroup's `cgroup.procs` it enters first.
    pub cgroup: Option<RawFd>,
    pub namespaces: Option<Entry>,
    /// Its working directory, as seen from inside.
    pub cwd: CString,
    pub limits: Option<Rlimits>,
    /// The uid and gid it runs as (when we are root).
    pub ids: Option<(u32, u32)>,
}

impl ChildSetup {
    /// Runs in the child, before its `exec`. Raw system calls for the
    /// credentials: the C library's wrappers would change those of every
    /// thread it knows of, and the child shares our memory, threads' list
    /// included.
    ///
    /// # Safety
    /// Only in the child of [`spawn`].
    unsafe fn enter(&self) -> Result<(), Stage> {
        let step = |stage: Stage, ret: libc::c_long| if ret == -1 { Err(stage) } else { Ok(()) };
        // SAFETY: system calls on strings and numbers prepared before the
        // clone; the namespace handles are open until the exec.
        unsafe {
            if let Some(fd) = self.cgroup
                && !enter_cgroup(fd)
            {
                return Err(Stage::Cgroup);
            }
            if let Some(ns) = self.namespaces {
                step(
                    Stage::Namespaces,
                    libc::setns(ns.net, libc::CLONE_NEWNET).into(),
                )?;
                // Entering a mount namespace moves the working directory to
                // its root: the chdir comes after.
                step(
                    Stage::Namespaces,
                    libc::setns(ns.mnt, libc::CLONE_NEWNS).into(),
                )?;
            }
            step(Stage::Directory, libc::chdir(self.cwd.as_ptr()).into())?;
            if let Some(l) = self.limits {
                let set = |resource, soft: u64, hard: u64| {
                    let limit = libc::rlimit {
                        rlim_cur: soft,
                        rlim_max: hard,
                    };
                    step(Stage::Limits, libc::setrlimit(resource, &limit).into())
                };
                set(libc::RLIMIT_CPU, l.cpu_seconds.0, l.cpu_seconds.1)?;
                set(libc::RLIMIT_AS, l.address_space, l.address_space)?;
                set(libc::RLIMIT_FSIZE, l.file_size, l.file_size)?;
                set(libc::RLIMIT_NPROC, l.processes, l.processes)?;
                // The open files a process gets by default: not the many
                // evalfleet raised its own limit to for its calls.
                set(libc::RLIMIT_NOFILE, OPEN_FILES, OPEN_FILES)?;
                set(libc::RLIMIT_CORE, 0, 0)?;
            }
            if let Some((uid, gid)) = self.ids {
                let none: *const libc::gid_t = std::ptr::null();
                step(Stage::User, libc::syscall(libc::SYS_setgroups, 0, none))?;
                step(
                    Stage::User,
                    libc::syscall(libc::SYS_setresgid, gid, gid, gid),
                )?;
                step(
                    Stage::User,
                    libc::syscall(libc::SYS_setresuid, uid, uid, uid),
                )?;
            }
            // No set-user-ID program can give it back what it gave up.
            step(
                Stage::User,
                libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0).into(),
            )?;
        }
        Ok(())
    }
}

/// Where starting a program failed, reported by the child with its errno.
#[derive(Debug, Clone, Copy)]
#[repr(u8)]
enum Stage {
    Streams = 1,
    Namespaces,
    Directory,
    Limits,
    User,
    Exec,
    Cgroup,
}

impl Stage {
    fn describe(code: u8) -> &'static str {
        match code {
            1 => "cannot set up its standard streams",
            2 => "cannot enter the sandbox's namespaces",
            3 => "cannot enter its directory",
            4 => "cannot set its limits",
            5 => "cannot take the sandbox's uid",
            7 => "cannot enter its slot's memory cgroup",
            _ => "cannot run it",
        }
    }
}

/// A started program: its pid, a pidfd to await its end, and our ends of
/// its standard streams (non-blocking).
pub struct Started {
    pub pid: libc::pid_t,
    pub pidfd: OwnedFd,
    pub stdin: OwnedFd,
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
}

/// What the child reads: every pointer prepared, nothing to allocate.
struct ChildArgs<'a> {
    setup: &'a ChildSetup,
    path: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    /// The child's ends: stdin, stdout, stderr; and the report pipe.
    fds: [RawFd; 3],
    report: RawFd,
    /// Our pid: the child's parent, unless we died while it started.
    parent: libc::pid_t,
}

extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the ChildArgs the parent keeps alive while it waits
    // for this child's exec or exit (CLONE_VFORK); only system calls
    // follow, and nothing allocates.
    unsafe {
        let args = &*arg.cast::<ChildArgs<'_>>();
        let fail = |stage: Stage| -> libc::c_int {
            let errno = *libc::__errno_location();
            let mut message = [0u8; 5];
            message[0] = stage as u8;
            message[1..].copy_from_slice(&errno.to_ne_bytes());
            libc::write(args.report, message.as_ptr().cast(), message.len());
            libc::_exit(127)
        };
        for (target, fd) in args.fds.iter().enumerate() {
            if libc::dup2(*fd, target as RawFd) == -1 {
                return fail(Stage::Streams);
            }
        }
        // Its own process group, which it leads: killed as one.
        if libc::setpgid(0, 0) == -1 {
            return fail(Stage::Streams);
        }
        // Our signal handlers must not run in it, nor our ignoring of
        // SIGPIPE pass to it; then it may receive signals again.
        for signal in 1..=64 {
            if signal == libc::SIGKILL || signal == libc::SIGSTOP {
                continue;
            }
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(signal, std::ptr::null(), &raw mut old) == 0
                && (old.sa_sigaction != libc::SIG_IGN || signal == libc::SIGPIPE)
                && old.sa_sigaction != libc::SIG_DFL
            {
                let mut default: libc::sigaction = std::mem::zeroed();
                default.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(signal, &raw const default, std::ptr::null_mut());
            }
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&raw mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &raw const none, std::ptr::null_mut());
        if let Err(stage) = args.setup.enter() {
            return fail(stage);
        }
        // Killed when its parent, the spawner thread, ends: when we do,
        // however (see the module's docs). Set after the credentials
        // change, which clears it; and a parent already gone by then sent
        // nothing, so the child looks.
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) == -1 {
            return fail(Stage::User);
        }
        if libc::getppid() != args.parent {
            libc::_exit(127);
        }
        libc::execve(args.path, args.argv, args.envp);
        fail(Stage::Exec)
    }
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array, which we own
    // from here.
    unsafe {
        check(libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC))?;
        Ok((OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])))
    }
}

/// The same descriptor at a number above the standard streams' (which the
/// child's `dup2` onto 0, 1 and 2 would otherwise overwrite).
fn above_stdio(fd: OwnedFd) -> io::Result<OwnedFd> {
    if fd.as_raw_fd() > 2 {
        return Ok(fd);
    }
    // SAFETY: fcntl duplicates a descriptor we own into a new one.
    unsafe {
        let new = libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 3);
        check(new)?;
        Ok(OwnedFd::from_raw_fd(new))
    }
}

fn nonblocking(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we own.
    unsafe {
        let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        check(flags)?;
        check(libc::fcntl(
            fd.as_raw_fd(),
            libc::F_SETFL,
            flags | libc::O_NONBLOCK,
        ))
    }
}

/// A program to start: what [`spawn`] hands the spawner thread.
pub struct Spawn {
    pub path: CString,
    pub argv: Vec<CString>,
    pub env: Vec<CString>,
    pub setup: ChildSetup,
}

type Request = (Spawn, std::sync::mpsc::SyncSender<io::Result<Started>>);

/// Starts a program, as [`spawn_here`] does, on the spawner thread (which
/// lives as long as the process; see the module's docs), and waits for it
/// to have started: about as long as starting it here.
pub fn spawn(request: Spawn) -> io::Result<Started> {
    static SPAWNER: std::sync::OnceLock<std::sync::mpsc::Sender<Request>> =
        std::sync::OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (sender, requests) = std::sync::mpsc::channel::<Request>();
        let started = std::thread::Builder::new()
            .name("evalfleet-sandbox-spawner".to_owned())
            .spawn(move || {
                for (spawn, reply) in requests {
                    let started = spawn_here(&spawn.path, &spawn.argv, &spawn.env, &spawn.setup);
                    // The asker waits for the answer; if it is gone, what
                    // started is dropped and its descriptors closed.
                    let _ = reply.send(started);
                }
            });
        if let Err(err) = started {
            tracing::error!("The sandbox cannot start its spawner thread: {err}.");
        }
        sender
    });
    let (reply, answer) = std::sync::mpsc::sync_channel(1);
    spawner
        .send((request, reply))
        .map_err(|_| io::Error::other("the sandbox's spawner thread is gone"))?;
    answer
        .recv()
        .map_err(|_| io::Error::other("the sandbox's spawner thread is gone"))?
}

/// Starts `path` with `argv` and `env` in the sandbox `setup` describes, as
/// `posix_spawn` does: the child shares our memory until its `exec`, and
/// this thread waits for that, so nothing of our address space is copied
/// (a fork of this process costs about a millisecond per program). The
/// child is this thread's: it is killed when this thread ends.
fn spawn_here(
    path: &CString,
    argv: &[CString],
    env: &[CString],
    setup: &ChildSetup,
) -> io::Result<Started> {
    let mut argv_ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    argv_ptrs.push(std::ptr::null());
    let mut envp_ptrs: Vec<*const libc::c_char> = env.iter().map(|e| e.as_ptr()).collect();
    envp_ptrs.push(std::ptr::null());
    let (stdin_child, stdin_ours) = pipe()?;
    let (stdout_ours, stdout_child) = pipe()?;
    let (stderr_ours, stderr_child) = pipe()?;
    let (report_ours, report_child) = pipe()?;
    let (stdin_child, stdout_child, stderr_child, report_child) = (
        above_stdio(stdin_child)?,
        above_stdio(stdout_child)?,
        above_stdio(stderr_child)?,
        above_stdio(report_child)?,
    );
    // Its PID namespace is chosen here: the kernel puts a thread's children
    // in the namespace it last entered. Chosen before each program, so
    // that none lands in another sandbox's.
    let own_pids = setup.namespaces.and_then(|ns| ns.pid);
    if let Some(pid_ns) = own_pids.or_else(host_pid_namespace) {
        // SAFETY: setns on an open namespace handle; it changes which PID
        // namespace this thread's next children are made in.
        check(unsafe { libc::setns(pid_ns, libc::CLONE_NEWPID) })?;
    }
    let args = ChildArgs {
        setup,
        path: path.as_ptr(),
        argv: argv_ptrs.as_ptr(),
        envp: envp_ptrs.as_ptr(),
        fds: [
            stdin_child.as_raw_fd(),
            stdout_child.as_raw_fd(),
            stderr_child.as_raw_fd(),
        ],
        report: report_child.as_raw_fd(),
        // In a PID namespace of its own, its parent (outside) is pid 0 to
        // it; one that died would leave it the namespace's init's (1).
        // SAFETY: getpid has no preconditions and cannot fail.
        parent: if own_pids.is_some() {
            0
        } else {
            unsafe { libc::getpid() }
        },
    };
    // SAFETY: `child_main` reads only `args`, which lives until the child
    // has called exec or exited.
    let pid = unsafe { clone_vfork(child_main, std::ptr::from_ref(&args).cast_mut().cast())? };
    drop((stdin_child, stdout_child, stderr_child, report_child));
    let mut message = [0u8; 5];
    // SAFETY: read into a buffer we own, from a descriptor we own.
    let read = unsafe {
        libc::read(
            report_ours.as_raw_fd(),
            message.as_mut_ptr().cast(),
            message.len(),
        )
    };
    if read == message.len() as isize {
        reap(pid);
        let errno = i32::from_ne_bytes([message[1], message[2], message[3], message[4]]);
        let err = io::Error::from_raw_os_error(errno);
        return Err(io::Error::new(
            err.kind(),
            format!("{}: {err}", Stage::describe(message[0])),
        ));
    }
    // SAFETY: pidfd_open on our own child, not yet reaped (so its pid
    // cannot have been reused).
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd == -1 {
        let err = io::Error::last_os_error();
        kill_group(u32::try_from(pid).unwrap_or(0));
        reap(pid);
        return Err(err);
    }
    // SAFETY: pidfd_open returned a new descriptor, ours from here.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as RawFd) };
    for fd in [&stdin_ours, &stdout_ours, &stderr_ours] {
        nonblocking(fd)?;
    }
    Ok(Started {
        pid,
        pidfd,
        stdin: stdin_ours,
        stdout: stdout_ours,
        stderr: stderr_ours,
    })
}

/// A handle on our own PID namespace, where programs without one of their
/// own are made (`None` where it cannot be opened: then no sandbox could
/// have made one either).
fn host_pid_namespace() -> Option<RawFd> {
    static HOST: std::sync::OnceLock<Option<OwnedFd>> = std::sync::OnceLock::new();
    HOST.get_or_init(|| {
        std::fs::File::open("/proc/self/ns/pid")
            .ok()
            .map(OwnedFd::from)
    })
    .as_ref()
    .map(AsRawFd::as_raw_fd)
}

/// How a child ended (its exit code, or the signal that ended it), once
/// it has (`None` while it runs). It is not reaped: it stays a zombie, its
/// pid and process group ours to signal, until [`reap`].
pub fn peek_exit(pid: libc::pid_t) -> io::Result<Option<(Option<i32>, Option<i32>)>> {
    let Ok(id) = libc::id_t::try_from(pid) else {
        return Err(io::Error::other("not a child's pid"));
    };
    // SAFETY: waitid on our own child, writing into a zeroed local.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        check(libc::waitid(
            libc::P_PID,
            id,
            &raw mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        ))?;
        if info.si_pid() == 0 {
            return Ok(None);
        }
        let status = info.si_status();
        Ok(Some(match info.si_code {
            libc::CLD_EXITED => (Some(status), None),
            libc::CLD_KILLED | libc::CLD_DUMPED => (None, Some(status)),
            _ => (None, None),
        }))
    }
}

/// Watches a pidfd: readable once its process has ended.
pub fn exit_watcher(pidfd: OwnedFd) -> io::Result<tokio::io::unix::AsyncFd<OwnedFd>> {
    // SAFETY: the descriptor is owned, open, and stays so (and the same)
    // for as long as the AsyncFd owns it.
    unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE)
            .map_err(|e| e.into_parts().1)
    }
}

fn try_wait(pid: libc::pid_t) -> io::Result<Option<libc::c_int>> {
    let mut status = 0;
    // SAFETY: waitpid on our own child, writing into a local.
    let ret = unsafe { libc::waitpid(pid, &raw mut status, libc::WNOHANG) };
    match ret {
        -1 => Err(io::Error::last_os_error()),
        0 => Ok(None),
        _ => Ok(Some(status)),
    }
}

/// Children that were killed but not yet reaped: each later spawn reaps
/// those that have ended, so none stays a zombie for long.
static ORPHANS: std::sync::Mutex<Vec<libc::pid_t>> = std::sync::Mutex::new(Vec::new());

/// Reaps a child that is ending (it was killed, or failed to start), now
/// if it has ended, else later.
pub fn reap(pid: libc::pid_t) {
    let mut orphans = ORPHANS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    orphans.push(pid);
    orphans.retain(|&pid| matches!(try_wait(pid), Ok(None)));
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
    // SAFETY: `sweep` reads only its argument, the uid itself.
    let pid = unsafe { clone_vfork(sweep, uid as usize as *mut libc::c_void)? };
    let mut status = 0;
    // SAFETY: waitpid on our own child, writing into a local.
    while unsafe { libc::waitpid(pid, &raw mut status, 0) } == -1 {
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

/// Runs `child(arg)` in a child that shares our memory, on a stack of its
/// own, as `vfork` does: this thread waits until the child has called
/// exec or exited, so nothing of our address space is copied. Our signals
/// are blocked meanwhile, so that no handler of ours runs in the child
/// (which resets them before it unblocks them).
///
/// # Safety
/// `child` may make only async-signal-safe calls, must not allocate, must
/// change credentials only with raw system calls, and may read only what
/// `arg` points to, which must live until this returns.
unsafe fn clone_vfork(
    child: extern "C" fn(*mut libc::c_void) -> libc::c_int,
    arg: *mut libc::c_void,
) -> io::Result<libc::pid_t> {
    let mut stack = vec![0u8; 128 * 1024];
    // SAFETY: the stack outlives the child's use of it (CLONE_VFORK), and
    // the signal masks are local sets.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&raw mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &raw const all, &raw mut old);
        let top = stack.as_mut_ptr().add(stack.len());
        let pid = libc::clone(
            child,
            top.cast(),
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            arg,
        );
        let err = io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &raw const old, std::ptr::null_mut());
        if pid == -1 { Err(err) } else { Ok(pid) }
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

/// Writes the calling process's pid to `fd` (a group's `cgroup.procs`),
/// with no allocation: for a child between its fork and its `exec`.
///
/// # Safety
/// `fd` is open.
unsafe fn enter_cgroup(fd: RawFd) -> bool {
    let mut digits = [0u8; 20];
    // SAFETY: getpid cannot fail.
    let mut pid = unsafe { libc::getpid() } as u64;
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (pid % 10) as u8;
        pid /= 10;
        if pid == 0 {
            break;
        }
    }
    let text = &digits[at..];
    // SAFETY: a write of a buffer of ours to an open descriptor.
    unsafe { libc::write(fd, text.as_ptr().cast(), text.len()) == text.len() as isize }
}
