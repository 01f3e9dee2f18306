//! The process is killed or interrupted at any moment; a resume finishes the
//! run with every item exactly once.

use evalfleet_mock::MockSettings;
use evalfleet_store::prelude::*;
use evalfleet_types::RunStatus;
use tokio::io::AsyncBufReadExt;

use crate::util::{Env, by_id, config, external, mock, ms, signal, wait_until};

const ITEMS: usize = 3000;

/// `run.yaml` in `env`: ITEMS items answered by a mock taking
/// `latency_ms` a call (24 at once), results committed in small batches;
/// the mock, to keep while the run goes on.
async fn write_run(env: &Env, latency_ms: u64) -> evalfleet_mock::MockServer {
    let dataset = env.dataset("items.jsonl", ITEMS);
    let server = mock(MockSettings {
        latency: ms(latency_ms),
        ..MockSettings::default()
    })
    .await;
    let extra = "writer: { batch_size: 64, flush_interval: 50ms }";
    env.write(
        "run.yaml",
        &config(&dataset, &external("gpu", &server, 24), extra),
    );
    server
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_several_points_then_resume_gives_the_export_of_a_clean_run() {
    let env = Env::new();
    let _server = write_run(&env, 15).await;

    let clean = env
        .evalfleet(&["run", "run.yaml", "-q", "--run-id", "clean"])
        .await;
    assert_eq!(clean.code, Some(0), "{}", clean.stderr);
    let clean = by_id(&env.export("clean").await);
    assert_eq!(clean.len(), ITEMS);

    // First session: killed once some results are committed.
    let mut child = env.spawn(&["run", "run.yaml", "-q", "--run-id", "killed"]);
    let counts = |env: &Env| env.store().counts("killed").map(|c| c.done).unwrap_or(0);
    wait_until(ms(30_000), "300 items are done", || counts(&env) >= 300).await;
    child.kill().await.unwrap();
    let after_first = env.counts("killed");
    assert!(
        after_first.pending > 0,
        "killed too late to test anything: {after_first:?}"
    );
    let stored = env.store().run("killed").unwrap();
    assert_eq!(
        stored.status,
        RunStatus::Running,
        "a killed run cannot have marked itself"
    );
    let status = env.evalfleet(&["status", "killed"]).await;
    assert!(
        status.stdout.contains("stopped (its process ended"),
        "{}",
        status.stdout
    );

    // Second session: resumed, killed again further on.
    let mut child = env.spawn(&["resume", "killed", "-q"]);
    wait_until(ms(30_000), "1800 items are done", || counts(&env) >= 1800).await;
    child.kill().await.unwrap();
    let after_second = env.counts("killed");
    assert!(after_second.done >= after_first.done);
    assert!(
        after_second.pending > 0,
        "killed too late: {after_second:?}"
    );

    // Third session: finishes.
    let done = env.evalfleet(&["resume", "killed", "-q"]).await;
    assert_eq!(done.code, Some(0), "{}", done.stderr);
    let resumed = by_id(&env.export("killed").await);
    assert_eq!(resumed.len(), ITEMS, "every item exactly once");
    for (id, row) in &clean {
        let other = &resumed[id];
        assert_eq!(row["status"], other["status"], "{id}");
        assert_eq!(row["output"], other["output"], "{id}");
        assert_eq!(row["item"], other["item"], "{id}");
    }
    let record = env.store().run("killed").unwrap();
    assert_eq!(record.status, RunStatus::Finished);
    assert_eq!(record.sessions, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_keeps_results_in_flight_marks_the_run_interrupted_and_resume_finishes_it() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 200);
    let server = mock(MockSettings {
        latency: ms(300),
        ..MockSettings::default()
    })
    .await;
    env.write(
        "run.yaml",
        &config(&dataset, &external("gpu", &server, 8), ""),
    );
    let mut child = env.spawn(&["run", "run.yaml", "-q", "--run-id", "stopped"]);
    wait_until(
        ms(20_000),
        "16 calls are answered and 8 more in flight",
        || {
            let stats = server.stats();
            stats.completed >= 16 && stats.in_flight == 8
        },
    )
    .await;
    signal(&child, "INT").await;
    let status = child.wait().await.unwrap();
    assert_eq!(status.code(), Some(130));

    let counts = env.counts("stopped");
    let answered = server.stats().completed;
    assert_eq!(
        counts.done, answered,
        "every answered call (in flight at Ctrl-C too) is stored"
    );
    assert!(counts.pending > 0);
    let record = env.store().run("stopped").unwrap();
    assert_eq!(record.status, RunStatus::Interrupted);
    assert!(record.message.unwrap().contains("interrupted by the user"));

    let resumed = env.evalfleet(&["resume", "stopped", "-q"]).await;
    assert_eq!(resumed.code, Some(0), "{}", resumed.stderr);
    let rows = by_id(&env.export("stopped").await);
    assert_eq!(rows.len(), 200);
    assert_eq!(server.stats().completed, 200, "no item was answered twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_ctrl_c_aborts_at_once_and_another_fleet_finishes_the_run() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 50);
    let stuck = mock(MockSettings {
        latency: ms(60_000),
        ..MockSettings::default()
    })
    .await;
    env.write(
        "run.yaml",
        &config(&dataset, &external("stuck", &stuck, 4), ""),
    );
    let mut child = env.spawn(&["run", "run.yaml", "-q", "--run-id", "aborted"]);
    let stderr = child.stderr.take().unwrap();
    let mut lines = tokio::io::BufReader::new(stderr).lines();
    wait_until(ms(20_000), "4 calls are in flight", || {
        stuck.stats().in_flight == 4
    })
    .await;
    signal(&child, "INT").await;
    loop {
        let line = lines
            .next_line()
            .await
            .unwrap()
            .expect("the run says it is stopping");
        if line.contains("Press Ctrl-C again") {
            break;
        }
    }
    signal(&child, "INT").await;
    let status = child.wait().await.unwrap();
    assert_eq!(status.code(), Some(130));
    // Aborted by the second Ctrl-C, not ended by the 30 s grace running
    // out (the calls hang for 60 s): the abort says so.
    let mut rest = String::new();
    while let Some(line) = lines.next_line().await.unwrap() {
        rest.push_str(&line);
        rest.push('\n');
    }
    assert!(
        rest.contains("Aborted. Committed results are safe"),
        "the second Ctrl-C did not abort: {rest}"
    );
    assert_eq!(stuck.stats().completed, 0);
    assert_eq!(env.counts("aborted").pending, 50);

    // The endpoint set may change between sessions: a new config with a
    // working endpoint finishes the run.
    let working = mock(MockSettings::default()).await;
    env.write(
        "fixed.yaml",
        &config(&dataset, &external("working", &working, 4), ""),
    );
    let resumed = env
        .evalfleet(&["resume", "aborted", "-q", "--config", "fixed.yaml"])
        .await;
    assert_eq!(resumed.code, Some(0), "{}", resumed.stderr);
    let rows = by_id(&env.export("aborted").await);
    assert_eq!(rows.len(), 50);
    assert!(rows.values().all(|r| r["endpoint"] == "working"));
}

/// A tmpfs of `size` mounted at `dir` for as long as it lives.
struct Disk(std::path::PathBuf);

impl Disk {
    fn mount(dir: std::path::PathBuf, size: &str) -> Self {
        std::fs::create_dir_all(&dir).unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .status()
            .expect("mount runs");
        assert!(
            mounted.success(),
            "cannot mount a tmpfs at {}",
            dir.display()
        );
        Self(dir)
    }
}

impl Drop for Disk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// The disk under the store fills up mid-run: the run stops at once,
/// naming the store and the full disk with what to do, keeps what it had
/// committed, and once there is room again `resume` finishes every item
/// exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_whose_disk_fills_stops_the_run_saying_so_and_resume_finishes_it() {
    if !evalfleet_testkit::is_root() {
        evalfleet_testkit::skip!("a disk that fills up is a tmpfs mounted as root");
        return;
    }
    let env = Env::new();
    // The store's folder is a disk of its own.
    let disk = Disk::mount(env.path("runs"), "16m");
    let _server = write_run(&env, 50).await;
    let child = env.spawn(&["run", "run.yaml", "-q", "--run-id", "full"]);
    // The store appears once the run has registered its items.
    let done = |env: &Env| {
        evalfleet_store::SqliteStore::open_existing(&env.store_path())
            .and_then(|mut s| s.counts("full"))
            .map_or(0, |c| c.done)
    };
    wait_until(ms(30_000), "300 items are done", || done(&env) >= 300).await;
    // Filled to the last byte.
    let filler = disk.0.join("filler");
    {
        use std::io::Write;
        let mut file = std::fs::File::create(&filler).unwrap();
        let block = vec![0u8; 64 * 1024];
        while file.write_all(&block).is_ok() {}
        let _ = file.flush();
    }
    let ran = crate::util::Ran::from(child.wait_with_output().await.unwrap());
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    assert!(
        ran.stderr
            .contains("run full stopped: its store cannot be written")
            && ran.stderr.contains("the disk holding it is full")
            && ran.stderr.contains("resume full"),
        "{}",
        ran.stderr
    );
    assert_eq!(
        ran.stderr.matches("cannot be written").count(),
        1,
        "said once: {}",
        ran.stderr
    );
    std::fs::remove_file(&filler).unwrap();
    let kept = env.counts("full");
    assert!(kept.done >= 300 && kept.pending > 0, "{kept:?}");

    let resumed = env.evalfleet(&["resume", "full", "-q"]).await;
    assert_eq!(resumed.code, Some(0), "{}", resumed.stderr);
    let rows = by_id(&env.export("full").await);
    assert_eq!(rows.len(), ITEMS, "every item exactly once");
    assert!(rows.values().all(|r| r["status"] == "done"));
    assert_eq!(env.store().run("full").unwrap().status, RunStatus::Finished);
}
