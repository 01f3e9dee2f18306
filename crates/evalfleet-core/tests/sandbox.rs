//! Hostile programs against the sandbox: each is contained and ends the
//! way the verdicts need, and the machine and this process are unharmed.

use std::path::PathBuf;
use std::time::Duration;

use evalfleet_core::sandbox::{self, Ended, Isolation, Limits, Workdir};

const PYTHON: &str = "/usr/bin/python3";

fn parent() -> PathBuf {
    // Not under /tmp, which the sandbox replaces with its own.
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("sandbox-tests")
}

async fn python(code: &str, limits: &Limits, isolation: &Isolation) -> sandbox::Execution {
    let dir = Workdir::new(&parent(), isolation).unwrap();
    std::fs::write(dir.path().join("main.py"), code).unwrap();
    let argv = vec![PYTHON.to_owned(), "main.py".to_owned()];
    sandbox::run(&argv, dir.path(), b"", limits, isolation)
        .await
        .unwrap()
}

fn nobody_processes() -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .chars()
                .all(|c| c.is_ascii_digit())
        })
        .filter(|e| {
            std::fs::read_to_string(e.path().join("status"))
                .ok()
                .and_then(|s| {
                    s.lines()
                        .find(|l| l.starts_with("Uid:"))
                        .map(|l| l.split_whitespace().nth(1) == Some("65534"))
                })
                .unwrap_or(false)
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_programs_are_contained() {
    if !std::path::Path::new(PYTHON).exists() {
        eprintln!("skipped: {PYTHON} is absent");
        return;
    }
    let isolation = Isolation::detect().await;
    eprintln!("{}", isolation.describe());
    let limits = Limits {
        wall: Duration::from_secs(4),
        cpu: Duration::from_secs(1),
        memory_mb: 256,
        output_bytes: 64 * 1024,
        ..Limits::default()
    };

    let ok = python("print(input() if False else 'hi')", &limits, &isolation).await;
    assert_eq!(
        ok.ended,
        Ended::Exited(0),
        "{:?}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert_eq!(ok.stdout, b"hi\n");

    // A working directory under /tmp stays visible, though /tmp is replaced.
    let under_tmp = Workdir::new(
        &std::env::temp_dir().join("evalfleet-sandbox-tests"),
        &isolation,
    )
    .unwrap();
    std::fs::write(
        under_tmp.path().join("main.py"),
        "print(open('main.py').read()[:5])",
    )
    .unwrap();
    let argv = vec![PYTHON.to_owned(), "main.py".to_owned()];
    let there = sandbox::run(&argv, under_tmp.path(), b"", &limits, &isolation)
        .await
        .unwrap();
    assert_eq!(
        there.stdout,
        b"print\n",
        "{}",
        String::from_utf8_lossy(&there.stderr)
    );

    // An infinite loop: the CPU limit ends it, well before the wall clock.
    let spin = python("while True:\n    pass\n", &limits, &isolation).await;
    if isolation.rlimits {
        assert!(spin.cpu_exceeded(), "{:?}", spin.ended);
        assert!(spin.elapsed < Duration::from_secs(4), "{:?}", spin.elapsed);
    } else {
        assert_eq!(spin.ended, Ended::TimedOut);
    }

    // Sleeping forever: the wall clock ends it.
    let sleeper = python("import time\ntime.sleep(60)\n", &limits, &isolation).await;
    assert_eq!(sleeper.ended, Ended::TimedOut);

    // Gigabytes of output: cut at the cap, the program killed.
    let flood = python(
        "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
        &limits,
        &isolation,
    )
    .await;
    assert_eq!(flood.ended, Ended::OutputLimit);
    assert!(flood.stdout.len() + flood.stderr.len() <= limits.output_bytes);

    // A memory bomb: refused by the memory limit.
    if isolation.rlimits {
        let hog = python(
            "x = bytearray(2 * 1024 ** 3)\nprint(len(x))\n",
            &limits,
            &isolation,
        )
        .await;
        assert!(
            !hog.success() && hog.out_of_memory(),
            "{:?} {}",
            hog.ended,
            String::from_utf8_lossy(&hog.stderr)
        );
    }

    // A network connection to a server on this machine: no network at all.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let net = python(
        &format!("import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')\n"),
        &limits,
        &isolation,
    )
    .await;
    if isolation.namespaces {
        assert!(!net.success(), "{}", String::from_utf8_lossy(&net.stdout));
        assert!(!String::from_utf8_lossy(&net.stdout).contains("connected"));
    } else {
        eprintln!("network isolation not available here: not checked");
    }

    // Writes outside its directory fail; inside it they work.
    let outside = parent().join("escaped.txt");
    let _ = std::fs::remove_file(&outside);
    let writes = python(
        &format!(
            "open('mine.txt', 'w').write('ok')\nprint('own dir ok')\nfor p in ['{}', '/etc/evalfleet-escape', '/tmp/evalfleet-escape']:\n    try:\n        open(p, 'w').write('x')\n        print('wrote', p)\n    except OSError as e:\n        print('refused', p)\n",
            outside.display()
        ),
        &limits,
        &isolation,
    )
    .await;
    let said = String::from_utf8_lossy(&writes.stdout).to_string();
    assert!(said.contains("own dir ok"), "{said}");
    if isolation.nobody.is_some() {
        assert!(
            !outside.exists() && !said.contains(&format!("wrote {}", outside.display())),
            "{said}"
        );
        assert!(said.contains("refused /etc/evalfleet-escape"), "{said}");
        assert!(!std::path::Path::new("/etc/evalfleet-escape").exists());
    }
    if isolation.namespaces {
        assert!(
            !std::path::Path::new("/tmp/evalfleet-escape").exists(),
            "its /tmp was its own"
        );
    }

    // Killing its parent, or this test: not allowed, and nothing dies here.
    let me = std::process::id();
    let killer = python(
        &format!("import os, signal\nfor pid in [os.getppid(), {me}]:\n    try:\n        os.kill(pid, signal.SIGKILL)\n        print('killed', pid)\n    except OSError as e:\n        print('refused', pid)\n"),
        &limits,
        &isolation,
    )
    .await;
    let said = String::from_utf8_lossy(&killer.stdout).to_string();
    assert!(!said.contains(&format!("killed {me}")), "{said}");

    // A fork bomb: held by the process limit, and all of it gone after.
    let bomb = python(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        &limits,
        &isolation,
    )
    .await;
    assert!(!bomb.success());
    assert!(bomb.elapsed < Duration::from_secs(8), "{:?}", bomb.elapsed);
    if isolation.nobody.is_some() {
        // The kernel may take a moment to reap a killed namespace.
        let mut left = nobody_processes();
        for _ in 0..50 {
            if left == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            left = nobody_processes();
        }
        assert_eq!(left, 0, "every process it started is gone");
    }
}
