//! Agents in the sandbox: a program reaches the listener we make in its
//! network namespace and nothing else, gets its environment and its input
//! file, stays in its directory, and dies with us.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::time::Duration;

use evalfleet_sandbox::sandbox::{Ended, Execution, Isolation, Limits, Network, Options, Sandbox};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PYTHON: &str = "/usr/bin/python3";

fn parent(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name)
}

fn said(run: &Execution) -> String {
    format!(
        "{:?} out={} err={}",
        run.ended,
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    )
}

fn limits() -> Limits {
    Limits {
        wall: Duration::from_secs(60),
        ..Limits::default()
    }
}

/// Serves one connection on `listener` (ours, made by the sandbox): reads
/// a line and answers `pong` to `ping`.
fn gateway(listener: std::net::TcpListener) -> tokio::task::JoinHandle<String> {
    listener.set_nonblocking(true).unwrap();
    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut got = vec![0u8; 5];
        stream.read_exact(&mut got).await.unwrap();
        stream.write_all(b"pong\n").await.unwrap();
        String::from_utf8(got).unwrap()
    })
}

/// The agent: talks to the gateway at `GATEWAY_PORT`, then tries every
/// other way out, printing the errno's name of each refusal.
const AGENT: &str = r#"
import errno, os, socket
port = int(os.environ['GATEWAY_PORT'])
s = socket.create_connection(('127.0.0.1', port), timeout=10)
s.sendall(b'ping\n')
print('gateway', s.makefile().readline().strip())
for host, p in [('127.0.0.1', int(os.environ['OTHER_PORT'])), ('10.255.255.1', 80), ('1.1.1.1', 80)]:
    try:
        socket.create_connection((host, p), timeout=2)
        print(f'{host}:{p} connected')
    except OSError as e:
        print(f'{host}:{p}', errno.errorcode.get(e.errno, str(e)))
print('item', open('item.json').read())
print('env', os.environ['EVALFLEET_ITEM'])
for target in [os.environ['OUTSIDE'], '/etc/evalfleet-agent-escape', '/tmp/evalfleet-agent-escape']:
    try:
        open(target, 'w').write('x')
        print('wrote', target)
    except OSError:
        print('refused', target)
try:
    open(os.environ['SECRET']).read()
    print('read secret')
except OSError:
    print('refused secret')
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_reaches_the_gateway_and_nothing_else() {
    if !Path::new(PYTHON).exists() {
        evalfleet_testkit::skip!("{PYTHON} is absent");
        return;
    }
    let sandbox = Sandbox::with_network(
        &parent("agent-sandbox"),
        2,
        &[],
        Isolation::ALL,
        Network::Loopback,
    )
    .await
    .unwrap();
    let isolation = sandbox.isolation();
    let text = sandbox.describe();
    eprintln!("{text}");
    let listener = sandbox.listen().unwrap();
    let port = listener.local_addr().unwrap().port();
    let served = gateway(listener);
    // A server of this machine's own, on its 127.0.0.1.
    let host_server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let other_port = host_server.local_addr().unwrap().port();

    // Another execution's directory, its slot held meanwhile.
    let victim_slot = sandbox.slot().await;
    let victim = victim_slot.workdir().unwrap();
    let secret = victim.write_file("secret.txt", b"secret").unwrap();
    assert_eq!(std::fs::read(&secret).unwrap(), b"secret");
    let outside = parent("agent-sandbox-escape.txt");
    let _ = std::fs::remove_file(&outside);

    let slot = sandbox.slot().await;
    let dir = slot.workdir().unwrap();
    dir.write_file("item.json", br#"{"id": 7}"#).unwrap();
    assert!(
        dir.write_file("item.json", b"again").is_err(),
        "never overwritten"
    );
    assert!(dir.write_file("../up.json", b"x").is_err());
    let env = [
        ("GATEWAY_PORT", port.to_string()),
        ("OTHER_PORT", other_port.to_string()),
        ("EVALFLEET_ITEM", "item-7".to_owned()),
        ("OUTSIDE", outside.display().to_string()),
        (
            "SECRET",
            victim.inside().join("secret.txt").display().to_string(),
        ),
    ]
    .map(|(k, v)| (k.to_owned(), v));
    let argv = [PYTHON, "-c", AGENT].map(String::from);
    let run = slot
        .run_with(&argv, &dir, b"", &limits(), &env)
        .await
        .unwrap();
    drop(victim_slot);
    assert_eq!(run.ended, Ended::Exited(0), "{}", said(&run));
    assert_eq!(served.await.unwrap(), "ping\n");
    let out = String::from_utf8_lossy(&run.stdout).to_string();
    assert!(out.contains("gateway pong\n"), "{out}");
    assert!(out.contains("item {\"id\": 7}\n"), "{out}");
    assert!(out.contains("env item-7\n"), "{out}");
    if isolation.namespaces {
        assert!(text.contains("no network but the gateway's port"), "{text}");
        assert!(
            out.contains(&format!("127.0.0.1:{other_port} ECONNREFUSED\n")),
            "{out}"
        );
        assert!(out.contains("10.255.255.1:80 ENETUNREACH\n"), "{out}");
        assert!(out.contains("1.1.1.1:80 ENETUNREACH\n"), "{out}");
        assert!(out.contains("refused /etc/evalfleet-agent-escape"), "{out}");
        assert!(out.contains("refused /tmp/evalfleet-agent-escape"), "{out}");
    } else {
        assert!(text.contains("NOT enforced: network isolation"), "{text}");
        eprintln!("network isolation not available here: not checked");
    }
    if isolation.own_uids {
        assert!(
            out.contains(&format!("refused {}", outside.display())),
            "{out}"
        );
        assert!(!outside.exists());
        assert!(out.contains("refused secret"), "{out}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_namespaces_the_listener_is_the_hosts_and_the_sandbox_says_so() {
    if !Path::new(PYTHON).exists() {
        evalfleet_testkit::skip!("{PYTHON} is absent");
        return;
    }
    let none = Isolation {
        namespaces: false,
        read_only: false,
        own_uids: false,
    };
    let sandbox = Sandbox::with_network(&parent("agent-bare"), 1, &[], none, Network::Loopback)
        .await
        .unwrap();
    let text = sandbox.describe();
    assert!(text.contains("NOT enforced"), "{text}");
    assert!(
        text.contains("network isolation (programs reach the gateway on this machine's 127.0.0.1"),
        "{text}"
    );
    let listener = sandbox.listen().unwrap();
    let port = listener.local_addr().unwrap().port();
    let served = gateway(listener);
    let slot = sandbox.slot().await;
    let dir = slot.workdir().unwrap();
    let code = format!(
        "import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=10)\ns.sendall(b'ping\\n')\nprint(s.makefile().readline().strip())\n"
    );
    let argv = [PYTHON.to_owned(), "-c".to_owned(), code];
    let run = slot.run(&argv, &dir, b"", &limits()).await.unwrap();
    assert_eq!(run.stdout, b"pong\n", "{}", said(&run));
    assert_eq!(served.await.unwrap(), "ping\n");

    // The code judge's sandbox has no network to listen on.
    let judge = Sandbox::with(&parent("agent-judge"), 1, &[], none)
        .await
        .unwrap();
    assert!(judge.listen().is_err());
    assert_eq!(judge.network(), Network::None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn environment_names_are_checked() {
    let sandbox = Sandbox::new(&parent("agent-env"), 1, &[]).await.unwrap();
    let slot = sandbox.slot().await;
    let dir = slot.workdir().unwrap();
    let argv = ["/bin/sh", "-c", "echo \"$A $PATH\""].map(String::from);
    let env = [
        ("A".to_owned(), "1".to_owned()),
        ("PATH".to_owned(), "/bin".to_owned()),
    ];
    let run = slot
        .run_with(&argv, &dir, b"", &limits(), &env)
        .await
        .unwrap();
    assert_eq!(run.stdout, b"1 /bin\n", "{}", said(&run));
    let bad = [("A=B".to_owned(), "1".to_owned())];
    assert!(
        slot.run_with(&argv, &dir, b"", &limits(), &bad)
            .await
            .is_err()
    );
}

/// Set in the process that [`no_agent_outlives_a_killed_evalfleet`] starts.
const ORPHAN_DIR: &str = "EVALFLEET_SANDBOX_TEST_ORPHAN_DIR";

/// Not a test by itself: run by [`no_agent_outlives_a_killed_evalfleet`]
/// in a process of its own (with [`ORPHAN_DIR`] set), it starts a program
/// that sleeps and leaves a grandchild, says their pids and its uid, and
/// waits to be killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphan_helper() {
    let Some(root) = std::env::var_os(ORPHAN_DIR) else {
        return;
    };
    use std::os::unix::fs::MetadataExt;
    let sandbox = Sandbox::new(Path::new(&root), 1, &[]).await.unwrap();
    let slot = sandbox.slot().await;
    let dir = slot.workdir().unwrap();
    let uid = std::fs::metadata(dir.path()).unwrap().uid();
    let argv = [
        "/bin/sh",
        "-c",
        "sleep 1000 & echo $! > grandchild.tmp && mv grandchild.tmp grandchild; echo $$ > pid.tmp && mv pid.tmp pid; exec sleep 1000",
    ]
    .map(String::from);
    let limits = Limits {
        wall: Duration::from_secs(600),
        ..Limits::default()
    };
    let run = slot.run(&argv, &dir, b"", &limits);
    let report = async {
        let read = |name: &str| std::fs::read_to_string(dir.path().join(name)).ok();
        loop {
            if let (Some(pid), Some(grandchild)) = (read("pid"), read("grandchild")) {
                // As the program saw them (in its PID namespace, if any):
                // here, as this machine sees them.
                let pid = host_pid(pid.trim().parse().unwrap(), uid);
                let grandchild = host_pid(grandchild.trim().parse().unwrap(), uid);
                let own_pids = u32::from(sandbox.own_pids());
                println!("PIDS {pid} {grandchild} {uid} {own_pids}");
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        std::future::pending::<()>().await;
    };
    tokio::select! {
        _ = run => panic!("the program ended before it was killed"),
        () = report => {}
    }
}

/// The pid on this machine of the process of `uid` whose pid in its own
/// PID namespace is `inside` (the last of its status's `NSpid`).
fn host_pid(inside: u32, uid: u32) -> u32 {
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(status) = std::fs::read_to_string(entry.path().join("status")) else {
            continue;
        };
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
                .unwrap_or_default()
        };
        let (ns_pids, uids) = (field("NSpid:"), field("Uid:"));
        if uids.first().map(String::as_str) == Some(&uid.to_string())
            && ns_pids.last().map(String::as_str) == Some(&inside.to_string())
            && let Some(host) = ns_pids.first()
        {
            return host.parse().unwrap();
        }
    }
    panic!("no process of uid {uid} is pid {inside} in its namespace");
}

/// Whether process `pid` is gone (or a zombie: dead, not yet reaped).
fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

/// Polls until `pid` is gone, for up to 30 s.
async fn wait_gone(pid: u32) -> bool {
    for _ in 0..300 {
        if gone(pid) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    gone(pid)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_agent_outlives_a_killed_evalfleet() {
    let mut helper = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "agent::orphan_helper", "--nocapture"])
        .env(ORPHAN_DIR, parent("agent-orphans"))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = helper.stdout.take().unwrap();
    let line = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find(|l| l.starts_with("PIDS "))
    })
    .await
    .unwrap()
    .expect("the helper says its program's pids");
    let numbers: Vec<u32> = line
        .split_whitespace()
        .skip(1)
        .map(|n| n.parse().unwrap())
        .collect();
    let (child, grandchild, uid, own_pids) = (numbers[0], numbers[1], numbers[2], numbers[3]);
    assert!(!gone(child) && !gone(grandchild));
    // As SIGKILL by the kernel or a user's kill -9: nothing of ours runs.
    helper.kill().unwrap();
    helper.wait().unwrap();
    assert!(wait_gone(child).await, "the program {child} outlived us");
    if own_pids == 1 {
        // The sandbox's PID namespace ended with us, and all in it.
        assert!(
            wait_gone(grandchild).await,
            "the grandchild {grandchild} outlived us"
        );
        return;
    }

    // Its grandchild (PR_SET_PDEATHSIG is not inherited) is ended when its
    // uid is next claimed (or used: the new sandbox's probe may run as
    // it): a sandbox that needs every free uid up to it claims it.
    if evalfleet_testkit::is_root() && uid >= evalfleet_sandbox::sandbox::UID_BASE {
        let slots = (uid - evalfleet_sandbox::sandbox::UID_BASE + 1) as usize;
        let uids_only = Isolation {
            namespaces: false,
            read_only: false,
            own_uids: true,
        };
        let _again = Sandbox::with(&parent("agent-orphans-again"), slots, &[], uids_only)
            .await
            .unwrap();
        assert!(
            wait_gone(grandchild).await,
            "the grandchild {grandchild} outlived its uid's next claim"
        );
    } else {
        // Not root: no uid tells its processes apart; it is ended here.
        let _ = std::process::Command::new("kill")
            .args(["-9", &grandchild.to_string()])
            .status();
    }
}

/// With `disk_bytes`, the files an execution writes in its directory are
/// held to that size together (many files, each under `file_bytes`), the
/// space is whole again for the slot's next execution, and what the host
/// wrote there is what the program reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executions_files_together_are_held_to_its_disk() {
    let sandbox = Sandbox::with_options(
        &parent("disk-sandbox"),
        1,
        &[],
        Isolation::ALL,
        Options {
            network: Network::Loopback,
            hide: Vec::new(),
            disk_bytes: Some(32 << 20),
        },
    )
    .await
    .unwrap();
    eprintln!("{}", sandbox.describe());
    if !sandbox.disk_limited() {
        assert!(sandbox.describe().contains("NOT enforced"));
        evalfleet_testkit::skip!("the sandbox has no mount namespace here (not root)");
        return;
    }
    assert!(sandbox.describe().contains("at most 32 MiB"));
    // 8 MiB files until a write fails: 32 MiB hold at most 4.
    let fill = "echo \"$(cat given)\"; i=0; while head -c 8388608 /dev/zero > f$i; do i=$((i+1)); done; echo $i";
    for round in 0..2 {
        let slot = sandbox.slot().await;
        let dir = slot.workdir().unwrap();
        dir.write_file("given", format!("round {round}").as_bytes())
            .unwrap();
        let argv = ["/bin/sh", "-c", fill].map(String::from);
        let run = slot.run(&argv, &dir, b"", &limits()).await.unwrap();
        let out = String::from_utf8_lossy(&run.stdout).into_owned();
        let mut lines = out.lines();
        assert_eq!(
            lines.next(),
            Some(format!("round {round}").as_str()),
            "{}",
            said(&run)
        );
        let whole: u32 = lines
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{}", said(&run)));
        assert!(
            (3..=4).contains(&whole),
            "round {round}: {whole} files of 8 MiB: {}",
            said(&run)
        );
        assert!(
            String::from_utf8_lossy(&run.stderr).contains("No space left on device"),
            "{}",
            said(&run)
        );
        // The files are in the namespace's file system, not on this disk.
        let point = parent("disk-sandbox").join(".slot-0");
        assert_eq!(std::fs::read_dir(&point).unwrap().count(), 0);
    }
}
