//! Hostile programs against the sandbox: each is contained and ends the
//! way the verdicts need, and the machine and this process are unharmed.

use std::path::{Path, PathBuf};
use std::time::Duration;

use evalfleet_sandbox::sandbox::{
    Ended, Execution, Isolation, Limits, Sandbox, UID_BASE, UID_SPAN,
};

const PYTHON: &str = "/usr/bin/python3";

fn parent(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name)
}

async fn python(sandbox: &Sandbox, code: &str, limits: &Limits) -> Execution {
    let slot = sandbox.slot().await;
    let dir = slot.workdir().unwrap();
    std::fs::write(dir.path().join("main.py"), code).unwrap();
    let argv = [PYTHON, "main.py"].map(String::from);
    slot.run(&argv, &dir, b"", limits).await.unwrap()
}

fn said(run: &Execution) -> String {
    format!(
        "{:?} out={} err={}",
        run.ended,
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    )
}

/// The uids of a sandbox's slots (all of them free when called).
async fn uids_of(sandbox: &Sandbox, slots: usize) -> Vec<u32> {
    use std::os::unix::fs::MetadataExt;
    let mut taken = Vec::new();
    for _ in 0..slots {
        taken.push(sandbox.slot().await);
    }
    taken
        .iter()
        .map(|slot| {
            std::fs::metadata(slot.workdir().unwrap().path())
                .unwrap()
                .uid()
        })
        .collect()
}

/// Processes whose uid is one of `uids`.
fn sandbox_processes(uids: &[u32]) -> Vec<String> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .chars()
                .all(|c| c.is_ascii_digit())
        })
        .filter_map(|e| std::fs::read_to_string(e.path().join("status")).ok())
        .filter(|status| {
            status
                .lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|uid| uid.parse::<u32>().ok())
                .is_some_and(|uid| uids.contains(&uid))
        })
        .map(|status| status.lines().take(1).collect())
        .collect()
}

/// Waits (up to 30 s, polling) until no process of `uids` is left: the
/// kernel may take a moment to end what was killed, longer on a busy
/// machine.
async fn none_left(uids: &[u32]) -> Vec<String> {
    let mut left = sandbox_processes(uids);
    for _ in 0..300 {
        if left.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        left = sandbox_processes(uids);
    }
    left
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_programs_are_contained() {
    if !Path::new(PYTHON).exists() {
        evalfleet_testkit::skip!("{PYTHON} is absent");
        return;
    }
    let sandbox = Sandbox::new(&parent("sandbox-tests"), 2, &[])
        .await
        .unwrap();
    let isolation = sandbox.isolation();
    eprintln!("{}", sandbox.describe());
    let uids = uids_of(&sandbox, 2).await;
    // The wall clock is far above the CPU limit, so that only what a
    // program does decides how it ends, however busy the machine: a spin
    // that gets a tenth of a core still reaches its CPU limit first. The
    // programs meant to meet the wall clock are given a short one.
    let limits = Limits {
        wall: Duration::from_secs(60),
        cpu: Duration::from_secs(1),
        memory_mb: 256,
        output_bytes: 64 * 1024,
        ..Limits::default()
    };

    let ok = python(&sandbox, "print(input() if False else 'hi')", &limits).await;
    assert_eq!(ok.ended, Ended::Exited(0), "{}", said(&ok));
    assert_eq!(ok.stdout, b"hi\n");

    // The open files a program may keep: 1,024, whatever evalfleet raised
    // its own limit to.
    let files = python(
        &sandbox,
        "import resource\nprint(resource.getrlimit(resource.RLIMIT_NOFILE))",
        &limits,
    )
    .await;
    assert_eq!(files.stdout, b"(1024, 1024)\n", "{}", said(&files));

    // A sandbox whose directory is under /tmp: still reachable, though /tmp
    // is covered inside.
    let under_tmp = Sandbox::new(
        &std::env::temp_dir().join("evalfleet-sandbox-tests"),
        1,
        &[],
    )
    .await
    .unwrap();
    let there = python(&under_tmp, "print(open('main.py').read()[:5])", &limits).await;
    assert_eq!(there.stdout, b"print\n", "{}", said(&there));

    // An infinite loop: the CPU limit ends it, not the wall clock.
    let spin = python(&sandbox, "while True:\n    pass\n", &limits).await;
    assert_eq!(spin.ended, Ended::CpuLimit, "{}", said(&spin));

    // Sleeping forever: the wall clock ends it.
    let short_wall = Limits {
        wall: Duration::from_secs(2),
        ..limits
    };
    let sleeper = python(&sandbox, "import time\ntime.sleep(600)\n", &short_wall).await;
    assert_eq!(sleeper.ended, Ended::TimedOut, "{}", said(&sleeper));

    // Gigabytes of output: cut at the cap, the program killed.
    let flood = python(
        &sandbox,
        "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
        &limits,
    )
    .await;
    assert_eq!(flood.ended, Ended::OutputLimit);
    assert!(flood.stdout.len() + flood.stderr.len() <= limits.output_bytes);

    // A memory bomb: refused by the memory limit.
    let hog = python(
        &sandbox,
        "x = bytearray(2 * 1024 ** 3)\nprint(len(x))\n",
        &limits,
    )
    .await;
    assert!(!hog.success() && hog.out_of_memory(), "{}", said(&hog));

    // A network connection to a server on this machine: no network at all.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let net = python(
        &sandbox,
        &format!("import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')\n"),
        &limits,
    )
    .await;
    if isolation.namespaces {
        assert!(!net.success(), "{}", said(&net));
        assert!(!String::from_utf8_lossy(&net.stdout).contains("connected"));
    } else {
        eprintln!("network isolation not available here: not checked");
    }

    // Writes outside its directory fail; inside it they work.
    let outside = parent("sandbox-tests").join("escaped.txt");
    let _ = std::fs::remove_file(&outside);
    let targets = [
        outside.display().to_string(),
        "/etc/evalfleet-escape".to_owned(),
        "/tmp/evalfleet-escape".to_owned(),
        "/var/tmp/evalfleet-escape".to_owned(),
        "/dev/shm/evalfleet-escape".to_owned(),
    ];
    let writes = python(
        &sandbox,
        &format!(
            "import tempfile\nopen('mine.txt', 'w').write('ok')\ntempfile.NamedTemporaryFile(delete=False).write(b'x')\nprint('own dir ok')\nfor p in {targets:?}:\n    try:\n        open(p, 'w').write('x')\n        print('wrote', p)\n    except OSError as e:\n        print('refused', p)\n",
        ),
        &limits,
    )
    .await;
    let text = String::from_utf8_lossy(&writes.stdout).to_string();
    assert!(text.contains("own dir ok"), "{}", said(&writes));
    if isolation.own_uids {
        for target in &targets {
            assert!(text.contains(&format!("refused {target}")), "{text}");
            assert!(!Path::new(target).exists(), "{target}");
        }
    }

    // Another execution's directory: neither readable nor writable.
    let slot = sandbox.slot().await;
    let victim = slot.workdir().unwrap();
    std::fs::write(victim.path().join("secret.txt"), "secret").unwrap();
    // The victim's slot stays taken: the snoop runs with the other uid.
    let snoop = python(
        &sandbox,
        &format!(
            "for op in ['r', 'w']:\n    try:\n        open('{}/secret.txt', op)\n        print('opened', op)\n    except OSError:\n        print('refused', op)\n",
            victim.inside().display()
        ),
        &limits,
    )
    .await;
    drop(slot);
    if isolation.own_uids {
        assert_eq!(
            String::from_utf8_lossy(&snoop.stdout),
            "refused r\nrefused w\n",
            "{}",
            said(&snoop)
        );
    }

    // Killing its parent (this test), or anything of ours: not allowed.
    let me = std::process::id();
    let killer = python(
        &sandbox,
        &format!("import os, signal\nfor pid in [os.getppid(), {me}, 1]:\n    try:\n        os.kill(pid, signal.SIGKILL)\n        print('killed', pid)\n    except OSError as e:\n        print('refused', pid)\n"),
        &limits,
    )
    .await;
    let text = String::from_utf8_lossy(&killer.stdout).to_string();
    assert!(!text.contains("killed"), "{text}");

    // A daemon that leaves its process group and session, holding the
    // output open: the program's end ends it too. Were the output waited
    // for, the daemon's sleep would outlast the wall clock (TimedOut).
    let daemon = python(
        &sandbox,
        "import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(600)\n    os._exit(0)\nprint('parent done')\nsys.stdout.flush()\n",
        &limits,
    )
    .await;
    assert_eq!(daemon.ended, Ended::Exited(0), "{}", said(&daemon));
    assert_eq!(daemon.stdout, b"parent done\n");
    if isolation.own_uids {
        assert_eq!(none_left(&uids).await, Vec::<String>::new());
    }

    // A fork bomb: held by the process limit, and all of it gone after.
    let bomb = python(
        &sandbox,
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        &short_wall,
    )
    .await;
    assert!(!bomb.success(), "{}", said(&bomb));
    if isolation.own_uids {
        assert_eq!(
            none_left(&uids).await,
            Vec::<String>::new(),
            "every process it started is gone"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_side_by_side_never_share_a_uid() {
    let a = Sandbox::new(&parent("uids-a"), 4, &[]).await.unwrap();
    let b = Sandbox::new(&parent("uids-b"), 4, &[]).await.unwrap();
    if !a.isolation().own_uids {
        evalfleet_testkit::skip!("not root, the sandbox has no uids of its own");
        return;
    }
    let mut seen = std::collections::HashSet::new();
    let (mut slots_a, mut slots_b) = (Vec::new(), Vec::new());
    for _ in 0..4 {
        slots_a.push(a.slot().await);
        slots_b.push(b.slot().await);
    }
    for slot in slots_a.iter().chain(&slots_b) {
        let dir = slot.workdir().unwrap();
        use std::os::unix::fs::MetadataExt;
        let uid = std::fs::metadata(dir.path()).unwrap().uid();
        assert!((UID_BASE..UID_BASE + UID_SPAN).contains(&uid));
        assert!(seen.insert(uid), "uid {uid} given twice");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn degraded_sandboxes_say_what_they_do_not_enforce_and_still_run() {
    if !Path::new(PYTHON).exists() {
        evalfleet_testkit::skip!("{PYTHON} is absent");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    // Its directory under one that others may not pass through.
    let closed = parent("closed");
    std::fs::create_dir_all(&closed).unwrap();
    std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o700)).unwrap();
    // As in hostile_programs_are_contained: a wall clock no busy machine
    // reaches before the CPU limit.
    let limits = Limits {
        wall: Duration::from_secs(60),
        cpu: Duration::from_secs(1),
        ..Limits::default()
    };
    let no_namespaces = Isolation {
        namespaces: false,
        read_only: false,
        own_uids: true,
    };
    let sandbox = Sandbox::with(&closed.join("sbx"), 1, &[], no_namespaces)
        .await
        .unwrap();
    let text = sandbox.describe();
    assert!(text.contains("NOT enforced: network isolation"), "{text}");
    // The program opens itself by its absolute path (Python does).
    let run = python(
        &sandbox,
        "import os\nprint(open(os.path.abspath('main.py')).read()[:6])",
        &limits,
    )
    .await;
    assert_eq!(run.stdout, b"import\n", "{}", said(&run));
    let root = evalfleet_testkit::is_root();
    assert_eq!(
        sandbox.isolation().own_uids,
        root,
        "as root, the sandbox keeps its uids by moving out of the closed directory"
    );
    if root {
        let daemon = python(
            &sandbox,
            "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\nprint('parent done')\n",
            &limits,
        )
        .await;
        assert_eq!(daemon.ended, Ended::Exited(0), "{}", said(&daemon));
        let uids = uids_of(&sandbox, 1).await;
        assert_eq!(none_left(&uids).await, Vec::<String>::new());
    }

    let nothing = Isolation {
        namespaces: false,
        read_only: false,
        own_uids: false,
    };
    let sandbox = Sandbox::with(&parent("bare"), 1, &[], nothing)
        .await
        .unwrap();
    let text = sandbox.describe();
    assert!(text.contains("NOT enforced: a separate user"), "{text}");
    let run = python(&sandbox, "print('still judged')", &limits).await;
    assert_eq!(run.stdout, b"still judged\n", "{}", said(&run));
    let spin = python(&sandbox, "while True:\n    pass\n", &limits).await;
    assert_eq!(spin.ended, Ended::CpuLimit, "{}", said(&spin));
}
