//! A process tree's memory and CPU as `/proc` tells them, on real
//! processes of known use.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use evalfleet_fleet::procs::{self, CpuMeter};

/// A python3 parent whose child holds 100 MiB it wrote to (so that every
/// page is resident) and spins, then says `ready`.
const PARENT: &str = r#"
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", '''
import sys, time
held = b"x" * (100 << 20)
print("ready", flush=True)
end = time.time() + 60
while time.time() < end and sys.stdin.readable():
    pass
'''], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
print(child.pid, child.stdout.readline().strip(), flush=True)
sys.stdin.read()
child.kill()
child.wait()
"#;

#[test]
fn a_child_holding_100_mib_is_seen_in_its_parent_s_tree() {
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("skipped: no python3 here");
        return;
    }
    let mut parent = Command::new("python3")
        .args(["-c", PARENT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(parent.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let (child, said) = line.trim().split_once(' ').unwrap();
    assert_eq!(said, "ready");
    let child: u32 = child.parse().unwrap();

    let tree = procs::trees(&[parent.id()]).remove(0);
    assert_eq!(tree[0], parent.id());
    assert!(tree.contains(&child), "{tree:?} lacks the child {child}");
    let mut meter = CpuMeter::default();
    let first = meter.read(&procs::read_all(&tree), std::time::Instant::now());
    // The 100 MiB, and two interpreters (a few MiB each).
    assert!(
        (100.0..160.0).contains(&first.rss_mb),
        "the tree's RSS is {} MiB",
        first.rss_mb
    );
    assert_eq!(first.cpu_pct, None);
    // The child spins: once it has run a clock tick or more, the tree
    // shows CPU time (how much depends on the machine's load).
    let start = procs::process(child).unwrap().ticks;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while procs::process(child).unwrap().ticks < start + 5 {
        assert!(std::time::Instant::now() < deadline, "the child never ran");
        std::thread::yield_now();
    }
    let second = meter.read(&procs::read_all(&tree), std::time::Instant::now());
    assert!(second.cpu_pct.unwrap() > 0.0, "{second:?}");

    drop(parent.stdin.take());
    parent.wait().unwrap();
    // Gone with its parent, which waited for it.
    assert_eq!(procs::process(child), None);
}
