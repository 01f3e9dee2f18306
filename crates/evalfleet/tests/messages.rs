//! What the user is told when something is wrong: each message names the
//! place and the problem, says what to do, and comes with the exit code
//! its kind of failure has.

use std::os::unix::fs::PermissionsExt;
use std::process::Stdio;

use evalfleet_mock::MockSettings;
use tokio::io::AsyncReadExt;

use crate::util::{BIN, Env, config, external, mock};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_dataset_is_refused_and_nothing_is_stored() {
    let env = Env::new();
    let dataset = env.write("empty.jsonl", "\n\n");
    let server = mock(MockSettings::default()).await;
    env.write(
        "run.yaml",
        &config(&dataset, &external("m", &server, 2), ""),
    );

    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(2), "{}", ran.stderr);
    assert!(
        ran.stderr.contains("empty.jsonl: the dataset has no items"),
        "{}",
        ran.stderr
    );
    assert_eq!(server.stats().requests, 0);
    assert!(!env.store_path().exists(), "a store was left behind");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_that_is_not_a_store_is_named_with_its_path() {
    let env = Env::new();
    // Not SQLite at all.
    env.write("notes.db", "these are my notes\n");
    // A few bytes: SQLite alone would take it for an empty database.
    env.write("tiny.db", "x");
    // SQLite, but another program's.
    let other = rusqlite::Connection::open(env.path("other.db")).unwrap();
    other
        .execute_batch("CREATE TABLE people (name TEXT); INSERT INTO people VALUES ('ada');")
        .unwrap();
    drop(other);
    for (file, why) in [
        ("notes.db", "the file is not a SQLite database"),
        ("tiny.db", "the file is not a SQLite database"),
        ("other.db", "a SQLite database of another program"),
    ] {
        for args in [
            vec!["runs", "--store", file],
            vec!["status", "some-run", "--store", file],
            vec!["run", "run.yaml", "--store", file],
        ] {
            if args[0] == "run" {
                let dataset = env.dataset("items.jsonl", 2);
                env.write(
                    "run.yaml",
                    &config(&dataset, "  - { name: m, kind: mock }\n", ""),
                );
            }
            let ran = env.evalfleet(&args).await;
            assert_eq!(ran.code, Some(2), "{args:?}: {}", ran.stderr);
            let said = format!("error: {file} is not an evalfleet store ({why}");
            assert!(ran.stderr.contains(&said), "{args:?}: {}", ran.stderr);
        }
    }
    // The other program's database is as it was: nothing was added.
    let other = rusqlite::Connection::open(env.path("other.db")).unwrap();
    let tables: i64 = other
        .query_row("SELECT count(*) FROM sqlite_master", [], |row| row.get(0))
        .unwrap();
    assert_eq!(tables, 1);
    assert_eq!(std::fs::read(env.path("tiny.db")).unwrap(), b"x");

    // A store of a newer evalfleet: named, with what to do.
    let dataset = env.dataset("items.jsonl", 2);
    env.write(
        "run.yaml",
        &config(&dataset, "  - { name: m, kind: mock }\n", ""),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let newer = rusqlite::Connection::open(env.store_path()).unwrap();
    newer.pragma_update(None, "user_version", 99).unwrap();
    drop(newer);
    for args in [vec!["runs"], vec!["run", "run.yaml"]] {
        let ran = env.evalfleet(&args).await;
        assert_eq!(ran.code, Some(2), "{args:?}: {}", ran.stderr);
        assert!(
            ran.stderr.contains(
                "runs/evalfleet.db was written by a newer evalfleet (store version 99; this one reads up to"
            ) && ran.stderr.contains("upgrade evalfleet"),
            "{args:?}: {}",
            ran.stderr
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_is_not_there_is_looked_for_in_a_named_store() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 2);
    env.write(
        "run.yaml",
        &config(&dataset, "  - { name: m, kind: mock }\n", ""),
    );
    let ran = env
        .evalfleet(&["run", "run.yaml", "-q", "--store", "mine.db"])
        .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    for command in [
        &["status"][..],
        &["report"],
        &["export", "--format", "jsonl"],
    ] {
        let args = [command, &["no-such-run", "--store", "mine.db"]].concat();
        let ran = env.evalfleet(&args).await;
        assert_eq!(ran.code, Some(2), "{command:?}: {}", ran.stderr);
        let said = format!(
            "error: no run 'no-such-run' in this store (mine.db); `{BIN} runs --store mine.db` lists its runs"
        );
        assert_eq!(ran.stderr.trim(), said, "{command:?}");
    }
}

/// Writes `run.yaml`: `n` items answered by the echo mock and scored by
/// exact match against their question.
fn scored_echoes(env: &Env, n: usize) {
    let dataset = env.dataset("items.jsonl", n);
    env.write(
        "run.yaml",
        &config(
            &dataset,
            "  - { name: m, kind: mock, concurrency: 64 }\n",
            "  metrics:\n    - { name: exact_match, reference: \"{{ question }}\" }",
        ),
    );
}

/// Gives `dir`, and everything under it, these modes.
fn set_modes(dir: &std::path::Path, dirs: u32, files: u32) {
    for entry in walk(dir) {
        let mode = if entry.is_dir() { dirs } else { files };
        std::fs::set_permissions(&entry, std::fs::Permissions::from_mode(mode)).unwrap();
    }
}

/// Makes `path` (a directory) and what it holds readable and not writable
/// by whoever runs `command`: as root, the command runs as `nobody` (root
/// may write anything); otherwise the files lose their write permission.
fn as_a_reader(command: &mut tokio::process::Command, dir: &std::path::Path) {
    if evalfleet_testkit::is_root() {
        set_modes(dir, 0o755, 0o644);
        command.uid(65534).gid(65534);
    } else {
        set_modes(dir, 0o555, 0o444);
    }
}

/// `dir` and everything under it.
fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = vec![dir.to_owned()];
    let mut i = 0;
    while i < out.len() {
        if out[i].is_dir() {
            for entry in std::fs::read_dir(&out[i]).unwrap() {
                out.push(entry.unwrap().path());
            }
        }
        i += 1;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_that_only_read_work_on_a_store_the_user_cannot_write() {
    let env = Env::new();
    scored_echoes(&env, 6);
    let first = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(first.code, Some(0), "{}", first.stderr);
    let second = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(second.code, Some(0), "{}", second.stderr);
    let (a, b) = (first.run_id(), second.run_id());
    // The store closed cleanly: no -wal or -shm file is left to read
    // through, and the directory cannot be written to make one.
    let store_dir = env.path("runs");
    // Everything above the store must be reachable by the reader.
    std::fs::set_permissions(env.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    for args in [
        vec!["runs"],
        vec!["status", &a],
        vec!["report", &a],
        vec!["export", &a, "--format", "jsonl"],
        vec!["compare", &a, &b],
    ] {
        let mut command = env.command(&args);
        as_a_reader(&mut command, &store_dir);
        let ran: crate::util::Ran = command.output().await.unwrap().into();
        assert_eq!(ran.code, Some(0), "{args:?}: {}", ran.stderr);
        assert!(!ran.stdout.is_empty(), "{args:?} printed nothing");
    }
    // The report says where its files could not go instead of failing.
    let mut command = env.command(&["report", &a]);
    as_a_reader(&mut command, &store_dir);
    let ran: crate::util::Ran = command.output().await.unwrap().into();
    assert!(
        ran.stderr.contains("the report's files are not written")
            && ran.stdout.contains("exact_match"),
        "{}\n{}",
        ran.stdout,
        ran.stderr
    );
    set_modes(&store_dir, 0o755, 0o644);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_that_never_answered_stops_the_run_with_its_address_and_error() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 5);
    // A port nothing listens on: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let base_url = format!("http://127.0.0.1:{port}/v1");
    let endpoints =
        format!("  - {{ name: vllm, kind: external, base_url: \"{base_url}\", model: m }}\n");
    // The wait for a first answer is timeouts.first_answer; the long wait
    // for endpoints that answered before is not what stops it.
    env.write(
        "run.yaml",
        &config(
            &dataset,
            &endpoints,
            "timeouts: { first_answer: 2s, no_endpoint: 1h }",
        ),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(130), "{}", ran.stderr);
    let said = format!("No endpoint answered in the 2s since the run started: vllm ({base_url}): ");
    assert!(ran.stderr.contains(&said), "{}", ran.stderr);
    assert!(ran.stderr.contains("Connection refused"), "{}", ran.stderr);
    // The hint to resume names the program as it was run.
    let resume = format!("Resume: {BIN} resume {}", ran.run_id());
    assert!(ran.stderr.contains(&resume), "{}", ran.stderr);
    assert_eq!(env.counts(&ran.run_id()).pending, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_stops_early_ends_the_output_quietly() {
    let env = Env::new();
    scored_echoes(&env, 2000);
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let run_id = ran.run_id();
    // Each prints far more than a pipe holds, so that the writer meets the
    // closed end: the export, and a report with a row per item (whose
    // table is followed by more lines).
    for args in [
        vec!["export", &run_id, "--format", "jsonl"],
        vec!["report", &run_id, "--by", "question", "--out", "report"],
    ] {
        let mut child = env
            .command(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdout = child.stdout.take().unwrap();
        let mut first = [0u8; 64];
        stdout.read_exact(&mut first).await.unwrap();
        drop(stdout);
        let mut stderr = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .await
            .unwrap();
        let status = child.wait().await.unwrap();
        assert!(stderr.is_empty(), "{args:?} said: {stderr}");
        // Ended by SIGPIPE, as `cat` or `grep` would be, or done.
        let quiet = status.success()
            || std::os::unix::process::ExitStatusExt::signal(&status) == Some(libc::SIGPIPE);
        assert!(quiet, "{args:?}: {status:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_answers_mostly_fail_to_parse_says_so_and_where_to_look() {
    // The echo mock never writes "#### N": every answer is unparsed, each
    // after one re-ask.
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 8);
    env.write(
        "run.yaml",
        &config(
            &dataset,
            "  - { name: m, kind: mock }\n",
            "  parse: { regex: \"#### (\\\\d+)\" }\n  max_reasks: 1",
        ),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    // Some answers are not scored: the run is incomplete, and says so.
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    assert!(
        ran.stderr.contains("finished, incomplete: "),
        "{}",
        ran.stderr
    );
    assert!(
        ran.stderr.contains("0 retries, 8 re-asks, 8 unparsed"),
        "{}",
        ran.stderr
    );
    let warning = format!(
        "warning: 8 of 8 answers could not be used (task.parse or task.schema did not accept them, re-asks included): compare an answer with the parse rule ({BIN} export {} --format jsonl | head -1)",
        ran.run_id()
    );
    assert!(ran.stderr.contains(&warning), "{}", ran.stderr);
    // The export says why each answer could not be used.
    for row in env.export(&ran.run_id()).await {
        let why = row["check_error"].as_str().unwrap_or_default();
        assert!(why.contains("#### "), "{row}");
    }
}
