//! Runs that go well: several endpoints, both dataset formats, streaming and
//! not, sampling, status, the commands' help.

use evalfleet_mock::MockSettings;
use evalfleet_store::prelude::*;
use serde_json::Value;

use crate::util::{Env, by_id, config, external, mock, ms, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_endpoints_of_different_speeds_answer_every_item_and_the_faster_serves_more() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 300);
    let fast = mock(MockSettings {
        latency: ms(5),
        ..MockSettings::default()
    })
    .await;
    let slow = mock(MockSettings {
        latency: ms(60),
        ..MockSettings::default()
    })
    .await;
    let endpoints = external("fast", &fast, 4) + &external("slow", &slow, 4);
    env.write(
        "run.yaml",
        &config(&dataset, &endpoints, "")
            .replace("max_tokens: 64 }", "max_tokens: 64 }\n  stream: true"),
    );

    let ran = env.evalfleet(&["run", "run.yaml", "--quiet"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let run_id = ran.run_id();
    let rows = by_id(&env.export(&run_id).await);
    assert_eq!(rows.len(), 300);
    let mut served = std::collections::BTreeMap::<String, u64>::new();
    for (id, row) in &rows {
        assert_eq!(row["status"], "done", "{id}: {row}");
        assert_eq!(
            row["output"], row["item"]["question"],
            "{id}'s answer belongs to another item"
        );
        assert!(
            row["ttft_ms"].as_f64().is_some(),
            "streamed answers have a TTFT: {row}"
        );
        *served
            .entry(row["endpoint"].as_str().unwrap().to_owned())
            .or_default() += 1;
    }
    assert!(
        served["fast"] > 2 * served["slow"],
        "the faster endpoint should take most items: {served:?}"
    );
    assert_eq!(fast.stats().requests + slow.stats().requests, 300);
    // The store's directory holds the database and nothing a run leaves
    // behind (no lock files or directories).
    let store_dir = env.store_path().parent().unwrap().to_owned();
    let left: Vec<String> = std::fs::read_dir(&store_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| !name.starts_with("evalfleet.db"))
        .collect();
    assert!(left.is_empty(), "{} holds {left:?}", store_dir.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_csv_dataset_is_answered_without_streaming() {
    let env = Env::new();
    let mut text = "id,question,level\n".to_owned();
    for i in 0..40 {
        text.push_str(&format!("c{i},\"what, exactly, is {i}?\",easy\n"));
    }
    let dataset = env.write("items.csv", &text);
    let server = mock(MockSettings::default()).await;
    env.write(
        "run.yaml",
        &config(&dataset, &external("only", &server, 8), ""),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let rows = by_id(&env.export(&ran.run_id()).await);
    assert_eq!(rows.len(), 40);
    assert_eq!(rows["c7"]["output"], "what, exactly, is 7?");
    assert_eq!(rows["c7"]["item"]["level"], "easy");
    assert_eq!(
        rows["c7"]["ttft_ms"],
        Value::Null,
        "no TTFT without streaming"
    );

    let csv = env
        .evalfleet(&["export", &ran.run_id(), "--format", "csv"])
        .await;
    let header = csv.stdout.lines().next().unwrap();
    assert!(header.starts_with("item_id,status,output,error,endpoint,model,attempts,latency_ms"));
    assert!(
        header.ends_with("item.id,item.level,item.question,images"),
        "{header}"
    );
    assert_eq!(csv.stdout.lines().count(), 41);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_takes_its_format_from_the_output_s_name_unless_one_is_given() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 5);
    let server = mock(MockSettings::default()).await;
    env.write(
        "run.yaml",
        &config(&dataset, &external("only", &server, 4), ""),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let run_id = ran.run_id();
    async fn export_of(env: &Env, run_id: &str, args: &[&str]) -> crate::util::Ran {
        let mut all = vec!["export", run_id];
        all.extend_from_slice(args);
        env.evalfleet(&all).await
    }
    for (name, first) in [
        ("out.csv", b'i'),
        ("OUT.JSONL", b'{'),
        ("out.parquet", b'P'),
    ] {
        let file = env.path(name);
        let done = export_of(&env, &run_id, &["-o", file.to_str().unwrap()]).await;
        assert_eq!(done.code, Some(0), "{name}: {}", done.stderr);
        let bytes = std::fs::read(&file).unwrap();
        assert_eq!(bytes[0], first, "{name} starts with {:?}", bytes[0] as char);
    }
    let csv = std::fs::read_to_string(env.path("out.csv")).unwrap();
    assert!(csv.starts_with("item_id,status,output"), "{csv}");
    assert_eq!(csv.lines().count(), 6);
    let jsonl = std::fs::read_to_string(env.path("OUT.JSONL")).unwrap();
    assert_eq!(jsonl.lines().count(), 5);
    assert!(
        jsonl
            .lines()
            .all(|l| serde_json::from_str::<Value>(l).is_ok())
    );
    assert!(
        std::fs::read(env.path("out.parquet"))
            .unwrap()
            .starts_with(b"PAR1")
    );

    // An explicit --format wins over the name.
    let file = env.path("named.csv");
    let done = export_of(
        &env,
        &run_id,
        &["--format", "jsonl", "-o", file.to_str().unwrap()],
    )
    .await;
    assert_eq!(done.code, Some(0), "{}", done.stderr);
    assert!(std::fs::read_to_string(&file).unwrap().starts_with('{'));

    // A name that says no format, or no name and no --format, is bad usage
    // naming the formats; nothing is written.
    let file = env.path("out.txt");
    let refused = export_of(&env, &run_id, &["-o", file.to_str().unwrap()]).await;
    assert_eq!(refused.code, Some(2), "{}", refused.stderr);
    assert!(
        refused.stderr.contains("--format") && refused.stderr.contains("out.txt"),
        "{}",
        refused.stderr
    );
    assert!(!file.exists());
    let refused = export_of(&env, &run_id, &[]).await;
    assert_eq!(refused.code, Some(2), "{}", refused.stderr);
    assert!(
        refused.stderr.contains(".jsonl, .csv or .parquet"),
        "{}",
        refused.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sample_is_the_same_for_the_same_seed_and_differs_for_another() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 200);
    let server = mock(MockSettings::default()).await;
    env.write(
        "run.yaml",
        &config(&dataset, &external("only", &server, 8), ""),
    );
    let mut samples = Vec::new();
    for seed in ["1", "1", "2"] {
        let ran = env
            .evalfleet(&["run", "run.yaml", "-q", "--n-sample", "25", "--seed", seed])
            .await;
        assert_eq!(ran.code, Some(0), "{}", ran.stderr);
        let ids: Vec<String> = by_id(&env.export(&ran.run_id()).await)
            .into_keys()
            .collect();
        assert_eq!(ids.len(), 25);
        samples.push(ids);
    }
    assert_eq!(samples[0], samples[1]);
    assert_ne!(samples[0], samples[2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_summarises_a_run_while_it_runs_and_after() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 60);
    let server = mock(MockSettings {
        latency: ms(100),
        ..MockSettings::default()
    })
    .await;
    env.write(
        "run.yaml",
        &config(&dataset, &external("gpu", &server, 2), ""),
    );
    let mut child = env.spawn(&["run", "run.yaml", "-q", "--run-id", "watched"]);
    let store_path = env.store_path();
    wait_until(ms(10_000), "some results are committed", || {
        store_path.exists()
            && evalfleet_store::SqliteStore::open_existing(&store_path)
                .ok()
                .and_then(|mut s| evalfleet_store::Runs::counts(&mut s, "watched").ok())
                .is_some_and(|c| c.done > 0)
    })
    .await;
    let live = env.evalfleet(&["status", "watched", "--json"]).await;
    assert_eq!(live.code, Some(0), "{}", live.stderr);
    let live: Value = serde_json::from_str(&live.stdout).unwrap();
    assert_eq!(live["status"], "running");
    assert_eq!(live["active"], true);
    assert_eq!(live["total"], 60);

    let status = child.wait().await.unwrap();
    assert_eq!(status.code(), Some(0));
    let after = env.evalfleet(&["status", "watched"]).await;
    assert!(
        after.stdout.contains("status       finished"),
        "{}",
        after.stdout
    );
    assert!(
        after
            .stdout
            .contains("60 total: 60 done, 0 failed, 0 pending"),
        "{}",
        after.stdout
    );
    assert!(
        after
            .stdout
            .lines()
            .any(|l| l.starts_with("gpu ") && l.contains(" 60 ")),
        "{}",
        after.stdout
    );
    let runs = env.evalfleet(&["runs"]).await;
    assert!(
        runs.stdout
            .lines()
            .any(|l| l.starts_with("watched") && l.contains("finished")),
        "{}",
        runs.stdout
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_probes_every_endpoint_and_says_which_are_unreachable() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 3);
    let server = mock(MockSettings {
        model: "m".to_owned(),
        ..MockSettings::default()
    })
    .await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}/v1", closed.local_addr().unwrap());
    drop(closed);
    let endpoints = external("alive", &server, 2)
        + &format!("  - {{ name: dead, kind: external, base_url: \"{dead_url}\", model: m }}\n")
        + "  - { name: builtin, kind: mock }\n";
    env.write("run.yaml", &config(&dataset, &endpoints, ""));
    let ran = env.evalfleet(&["check", "run.yaml"]).await;
    assert_eq!(ran.code, Some(1), "{}\n{}", ran.stdout, ran.stderr);
    let line = |name: &str| {
        ran.stdout
            .lines()
            .find(|l| l.starts_with(&format!("endpoint     {name} ")))
            .unwrap_or_else(|| panic!("no line for {name}: {}", ran.stdout))
            .to_owned()
    };
    assert!(line("alive").contains("reachable in"), "{}", ran.stdout);
    assert!(line("alive").contains("serves m"), "{}", ran.stdout);
    assert!(
        line("dead").contains("unreachable: cannot connect"),
        "{}",
        ran.stdout
    );
    assert!(line("builtin").contains("reachable in"), "{}", ran.stdout);
    assert!(ran.stdout.contains("3 rows, 0 invalid"), "{}", ran.stdout);
    assert!(!env.store_path().exists(), "check must not write a store");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_explains_itself_with_an_example() {
    let env = Env::new();
    for command in ["run", "resume", "runs", "status", "export", "check", "mock"] {
        let ran = env.evalfleet(&[command, "--help"]).await;
        assert_eq!(ran.code, Some(0), "{command}: {}", ran.stderr);
        assert!(
            ran.stdout.contains("Example:"),
            "{command} --help has no example:\n{}",
            ran.stdout
        );
        assert!(
            ran.stdout.contains(&format!("evalfleet {command}")),
            "{command}: {}",
            ran.stdout
        );
    }
    let top = env.evalfleet(&["--help"]).await;
    assert!(top.stdout.contains("130 interrupted"), "{}", top.stdout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mock_command_prints_its_address_and_serves_models() {
    let env = Env::new();
    let mut child = env.spawn(&["mock", "--model", "tiny", "--latency", "10ms"]);
    let stdout = child.stdout.take().unwrap();
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let url = lines.next_line().await.unwrap().unwrap();
    assert!(
        url.starts_with("http://127.0.0.1:") && url.ends_with("/v1"),
        "{url}"
    );
    let client = evalfleet_fleet::client::http_client(1).unwrap();
    let body = client
        .get(format!("{url}/models"))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let models: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(models["data"][0]["id"], "tiny");
    crate::util::signal(&child, "TERM").await;
    assert_eq!(child.wait().await.unwrap().code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quickstart_ends_with_scores_and_two_runs_compare() {
    let env = Env::new();
    let examples = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples");
    let small = format!("{examples}/quickstart.yaml");
    let large = format!("{examples}/quickstart-large.yaml");
    // Its endpoints serve the model they are configured with.
    let check = env.evalfleet(&["check", &small]).await;
    assert_eq!(check.code, Some(0), "{}{}", check.stdout, check.stderr);

    let a = env.evalfleet(&["run", &small, "-q"]).await;
    assert_eq!(a.code, Some(0), "{}", a.stderr);
    // The scripted "small" model is right on 31 of the 50 questions.
    assert!(
        a.stderr.contains("exact_match@1: 0.6200 over 50 items"),
        "{}",
        a.stderr
    );
    let b = env.evalfleet(&["run", &large, "-q"]).await;
    assert_eq!(b.code, Some(0), "{}", b.stderr);
    assert!(
        b.stderr.contains("exact_match@1: 0.9000 over 50 items"),
        "{}",
        b.stderr
    );

    // The report has the score with its interval, by category too.
    let report = env
        .evalfleet(&["report", &a.run_id(), "--by", "category"])
        .await;
    assert_eq!(report.code, Some(0), "{}", report.stderr);
    let row = |group: &str| {
        report
            .stdout
            .lines()
            .find(|l| l.starts_with("exact_match@1") && l.split_whitespace().nth(1) == Some(group))
            .map(|l| l.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
            .unwrap_or_else(|| panic!("no {group} row: {}", report.stdout))
    };
    let all = row("all");
    assert_eq!(all[2..4], ["50", "0.6200"], "{all:?}");
    // Wilson's 95% interval of 31/50.
    assert_eq!(all[5..8], ["0.4815", "–", "0.7414"], "{all:?}");
    assert_eq!(row("spelling")[2..4], ["10", "0.4000"]);

    // The second run is better on the same items, and says by how much.
    let compare = env.evalfleet(&["compare", &a.run_id(), &b.run_id()]).await;
    assert_eq!(compare.code, Some(0), "{}", compare.stderr);
    // Each run's outcome first, then the table.
    assert!(
        compare
            .stdout
            .contains(&format!("{}: complete: ", b.run_id())),
        "{}",
        compare.stdout
    );
    let second = compare
        .stdout
        .lines()
        .find(|l| l.contains(&b.run_id()) && !l.contains("items scored"))
        .unwrap_or_else(|| panic!("{}", compare.stdout));
    assert!(
        second.contains("0.9000") && second.contains("+0.2800"),
        "{second}"
    );
}

/// lm-eval's and inspect's habits: `--limit N` answers the first N rows,
/// `--set KEY=VALUE` changes any key (a list's item by its name), and both
/// are recorded with the run, so that its resume and its report use them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limit_and_set_change_the_run_and_are_recorded_with_it() {
    let env = Env::new();
    let server = mock(MockSettings::default()).await;
    let dataset = env.dataset("items.jsonl", 20);
    env.write(
        "run.yaml",
        &config(&dataset, &external("fast", &server, 2), ""),
    );
    let ran = env
        .evalfleet(&[
            "run",
            "run.yaml",
            "-q",
            "--limit",
            "7",
            "--set",
            "task.params.temperature=0.25",
            "--set",
            "endpoints.fast.concurrency=3",
        ])
        .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert_eq!(env.export(&ran.run_id()).await.len(), 7);
    assert_eq!(server.stats().requests, 7);
    let stored = env.store().run(&ran.run_id()).unwrap().config;
    assert_eq!(stored["dataset"]["limit"], 7);
    assert_eq!(stored["task"]["params"]["temperature"], 0.25);
    assert_eq!(stored["endpoints"][0]["concurrency"], 3);

    // A key that names nothing is refused, naming it; nothing is stored.
    let bad = env
        .evalfleet(&["run", "run.yaml", "--set", "endpoints.slow.model=x"])
        .await;
    assert_eq!(bad.code, Some(2), "{}", bad.stderr);
    assert!(
        bad.stderr
            .contains("--set endpoints.slow.model=x: endpoints has no item 'slow'"),
        "{}",
        bad.stderr
    );
    assert_eq!(env.store().runs().unwrap().len(), 1);
}

/// A run may be named `latest` or by the beginning of its id, as long as
/// one run's id begins so; a prefix of several names them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latest_and_a_unique_prefix_name_a_run() {
    let env = Env::new();
    let server = mock(MockSettings::default()).await;
    let dataset = env.dataset("items.jsonl", 3);
    env.write(
        "run.yaml",
        &config(&dataset, &external("fast", &server, 2), ""),
    );
    for id in ["alpha-1", "alpha-2", "beta-1"] {
        let ran = env
            .evalfleet(&["run", "run.yaml", "-q", "--run-id", id])
            .await;
        assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    }
    let latest = env.evalfleet(&["status", "latest", "--json"]).await;
    assert_eq!(latest.code, Some(0), "{}", latest.stderr);
    let latest: Value = serde_json::from_str(&latest.stdout).unwrap();
    assert_eq!(latest["run_id"], "beta-1");
    let beta = env.evalfleet(&["status", "bet", "--json"]).await;
    let beta: Value = serde_json::from_str(&beta.stdout).unwrap();
    assert_eq!(beta["run_id"], "beta-1");
    let both = env.evalfleet(&["report", "alpha"]).await;
    assert_eq!(both.code, Some(2), "{}", both.stderr);
    assert!(
        both.stderr
            .contains("'alpha' begins the ids of 2 runs: alpha-1, alpha-2; give more of it"),
        "{}",
        both.stderr
    );
    let export = env
        .evalfleet(&["export", "alpha-2", "--format", "jsonl"])
        .await;
    assert_eq!(export.stdout.lines().count(), 3);
    let none = env.evalfleet(&["status", "gamma"]).await;
    assert_eq!(none.code, Some(2), "{}", none.stderr);
    assert!(none.stderr.contains("no run 'gamma'"), "{}", none.stderr);
}

/// `run --dry-run` shows the requests the first rows would send, as the
/// endpoint would get them, and stores nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_shows_the_first_rendered_requests_and_stores_nothing() {
    let env = Env::new();
    let server = mock(MockSettings::default()).await;
    let dataset = env.dataset("items.jsonl", 10);
    env.write(
        "run.yaml",
        &config(&dataset, &external("fast", &server, 2), ""),
    );
    let ran = env
        .evalfleet(&[
            "run",
            "run.yaml",
            "--dry-run",
            "--set",
            "task.params.temperature=0",
        ])
        .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert!(
        ran.stdout.contains("request for line 1 of ")
            && ran.stdout.contains("request for line 3 of ")
            && !ran.stdout.contains("request for line 4 of "),
        "{}",
        ran.stdout
    );
    let first: Value = serde_json::from_str(
        ran.stdout
            .split("request for line 1 of ")
            .nth(1)
            .and_then(|rest| rest.split_once('\n'))
            .map(|(_, json)| json.split("\nrequest for line").next().unwrap())
            .unwrap(),
    )
    .unwrap();
    assert_eq!(first["messages"][0]["content"], "question 0 of 10");
    assert_eq!(first["model"], "m");
    assert_eq!(first["temperature"], 0);
    assert_eq!(first["max_tokens"], 64);
    assert_eq!(server.stats().requests, 0);
    assert!(!env.path("runs").exists(), "nothing is stored");
}

/// A run's report needs nothing but the store: the `${VAR}`s its config
/// used (an endpoint's model, its key, its address) need not be set where
/// it is reported, nor compared, nor shown on the dashboard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_needs_none_of_the_variables_its_run_used() {
    let env = Env::new();
    let server = mock(MockSettings::default()).await;
    let dataset = env.dataset("items.jsonl", 4);
    let endpoint = "  - { name: fast, kind: external, base_url: \"${EF_TEST_BASE}\", model: \"${EF_TEST_MODEL}\", api_key: \"${EF_TEST_KEY}\" }\n";
    env.write(
        "run.yaml",
        &config(
            &dataset,
            endpoint,
            "  metrics: [{ name: exact_match, reference: \"{{ question }}\" }]",
        ),
    );
    let ran: crate::util::Ran = env
        .command(&["run", "run.yaml", "-q", "--run-id", "vars"])
        .env("EF_TEST_BASE", server.base_url())
        .env("EF_TEST_MODEL", "m")
        .env("EF_TEST_KEY", "sk-test")
        .output()
        .await
        .unwrap()
        .into();
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let report = env.evalfleet(&["report", "vars", "--json"]).await;
    assert_eq!(report.code, Some(0), "{}", report.stderr);
    let report: Value = serde_json::from_str(&report.stdout).unwrap();
    assert_eq!(report["outcome"]["outcome"], "complete");
    assert_eq!(report["metrics"][0]["mean"], 1.0);
    let status = env.evalfleet(&["status", "vars"]).await;
    assert!(
        status
            .stdout
            .contains("outcome      complete: 4 of 4 items scored"),
        "{}{}",
        status.stdout,
        status.stderr
    );
}
