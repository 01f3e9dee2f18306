//! `evalfleet bench`: a matrix of models on local mock engines, each loaded
//! in turn (checked from the engines' own account of their lives), killed
//! mid-matrix and run again.

use std::collections::BTreeMap;

use evalfleet_store::SqliteStore;
use evalfleet_store::prelude::*;
use evalfleet_store::{ItemQuery, StoreError};

use crate::fleet::{alive, with_arg};
use crate::util::*;

/// One start of an engine, from its own life log: its pid, when it
/// listened and when it exited (ms since the epoch).
#[derive(Debug, Clone, Copy)]
struct Life {
    pid: u32,
    listening: i64,
    exited: Option<i64>,
}

fn lives(env: &Env, name: &str) -> Vec<Life> {
    let text = std::fs::read_to_string(env.path(name)).unwrap_or_default();
    let mut out: Vec<Life> = Vec::new();
    for line in text.lines() {
        let parts: Vec<&str> = line.split_whitespace().collect();
        let (at, pid): (i64, u32) = (parts[1].parse().unwrap(), parts[2].parse().unwrap());
        match parts[0] {
            "listening" => out.push(Life {
                pid,
                listening: at,
                exited: None,
            }),
            "exited" => {
                let life = out.iter_mut().rev().find(|l| l.pid == pid).unwrap();
                life.exited = Some(at);
            }
            other => panic!("unknown life line {other}"),
        }
    }
    out
}

fn bench_config(latency: &str) -> String {
    let model = |name: &str| {
        format!(
            "  - name: {name}\n    endpoint:\n      kind: local\n      model: {name}\n      \
             command: \"{BIN} mock --bind 127.0.0.1:{{port}} --model {{model}} --latency {latency} --life-log life-{name}.log\"\n      \
             stop_grace: 10s\n      concurrency: 4\n"
        )
    };
    let dataset = |name: &str| {
        format!(
            "  - name: {name}\n    dataset: {{path: {name}.jsonl, id_field: id}}\n    task:\n      \
             messages: [{{role: user, content: '{{{{ question }}}}'}}]\n      \
             metrics: [{{name: exact_match, reference: '{{{{ question }}}}'}}]\n"
        )
    };
    format!(
        "name: m\nmodels:\n{}{}datasets:\n{}{}",
        model("a"),
        model("b"),
        dataset("short"),
        dataset("long")
    )
}

/// The stored results of a run: item id → when it finished.
fn finished_at(store: &mut SqliteStore, run_id: &str) -> BTreeMap<String, i64> {
    let page = store
        .items(
            run_id,
            &ItemQuery {
                limit: 10_000,
                ..ItemQuery::default()
            },
        )
        .unwrap();
    page.rows
        .into_iter()
        .filter_map(|r| Some((r.item_id, r.finished_at_ms?)))
        .collect()
}

fn done_in(env: &Env, run_id: &str) -> u64 {
    let Ok(mut store) = SqliteStore::open_existing(&env.store_path()) else {
        return 0;
    };
    match store.counts(run_id) {
        Ok(counts) => counts.done,
        Err(StoreError::NoSuchRun(_)) => 0,
        Err(err) => panic!("{err}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bench_loads_one_engine_at_a_time_and_after_a_kill_reruns_only_unfinished_cells() {
    let env = Env::new();
    env.dataset("short.jsonl", 20);
    env.dataset("long.jsonl", 400);
    env.write("bench.yaml", &bench_config("10ms"));
    let claims = env.path("runs/.engines");
    let claims = claims.to_str().unwrap().to_owned();

    // Killed while model a answers its second cell.
    let mut first = env.spawn(&["bench", "bench.yaml"]);
    wait_until(ms(60_000), "cell m-a-long has answers", || {
        done_in(&env, "m-a-long") >= 20
    })
    .await;
    signal(&first, "KILL").await;
    first.wait().await.unwrap();
    let killed = lives(&env, "life-a.log");
    assert_eq!(killed.len(), 1, "{killed:?}");
    wait_until(
        ms(30_000),
        "the killed bench's engine and its supervisor are gone",
        || !alive(killed[0].pid) && with_arg(&claims).is_empty(),
    )
    .await;
    assert!(lives(&env, "life-b.log").is_empty(), "b never started");
    let mut store = env.store();
    let short_before = finished_at(&mut store, "m-a-short");
    assert_eq!(short_before.len(), 20);
    let long_before = finished_at(&mut store, "m-a-long");
    assert!(long_before.len() < 400, "killed before the cell ended");
    drop(store);

    let status = env.evalfleet(&["bench", "status", "bench.yaml"]).await;
    assert_eq!(status.code, Some(0), "{}", status.stderr);
    let rows: Vec<&str> = status.stdout.lines().collect();
    assert!(
        rows[1].starts_with("done") && rows[1].contains("m-a-short"),
        "{}",
        status.stdout
    );
    assert!(
        rows[2].starts_with("interrupted") && rows[2].contains("m-a-long"),
        "{}",
        status.stdout
    );
    assert!(
        rows[3].starts_with("pending") && rows[3].contains("m-b-short"),
        "{}",
        status.stdout
    );

    // The same command again finishes the matrix.
    let again = env.evalfleet(&["bench", "bench.yaml"]).await;
    assert_eq!(again.code, Some(0), "{}\n{}", again.stdout, again.stderr);
    assert!(
        again.stderr.contains("Cell m-a-long: resuming"),
        "{}",
        again.stderr
    );
    assert!(!again.stderr.contains("Cell m-a-short"), "{}", again.stderr);

    // Each engine's own life: a started twice (killed, then again), b
    // once for both its cells; never two at once; none left running.
    let a = lives(&env, "life-a.log");
    let b = lives(&env, "life-b.log");
    assert_eq!(a.len(), 2, "{a:?}");
    assert_eq!(b.len(), 1, "one start for both of b's cells: {b:?}");
    let mut all: Vec<Life> = a.iter().chain(&b).copied().collect();
    all.sort_by_key(|l| l.listening);
    for pair in all.windows(2) {
        let exited = pair[0]
            .exited
            .unwrap_or_else(|| panic!("engine {} has no exit: {all:?}", pair[0].pid));
        assert!(exited <= pair[1].listening, "two engines at once: {all:?}");
    }
    assert!(
        all.iter().all(|l| l.exited.is_some() && !alive(l.pid)),
        "{all:?}"
    );
    assert!(with_arg(&claims).is_empty(), "no supervisor is left");

    // Finished cells untouched; every item once.
    let mut store = env.store();
    // The engine the bench loaded is sampled in its cells' runs, as a
    // run's own engine is (its memory, so that engine limits apply).
    let engine_rss = store
        .resource_points("m-b-long", i64::MIN)
        .unwrap()
        .into_iter()
        .filter(|p| {
            p.series.source == evalfleet_types::ResourceSource::Endpoint
                && p.series.name == "b"
                && p.series.metric == evalfleet_types::ResourceMetric::RssMb
        })
        .count();
    assert!(engine_rss > 0, "the cell's run sampled its engine");
    assert_eq!(finished_at(&mut store, "m-a-short"), short_before);
    assert_eq!(store.run("m-a-short").unwrap().sessions, 1);
    let long_after = finished_at(&mut store, "m-a-long");
    for (item, at) in &long_before {
        assert_eq!(long_after.get(item), Some(at), "{item} answered again");
    }
    drop(store);
    for run_id in ["m-a-short", "m-a-long", "m-b-short", "m-b-long"] {
        let rows = by_id(&env.export(run_id).await);
        assert!(rows.values().all(|r| r["status"] == "done"), "{run_id}");
        let calls: i64 = env.attempts_by_session(run_id).values().sum();
        assert_eq!(calls as usize, rows.len(), "{run_id}: one call per item");
    }

    let report = env
        .evalfleet(&["bench", "report", "m", "--format", "json"])
        .await;
    assert_eq!(report.code, Some(0), "{}", report.stderr);
    let report: serde_json::Value = serde_json::from_str(&report.stdout).unwrap();
    let cells = report["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 4);
    for cell in cells {
        assert_eq!(cell["state"], "done");
        assert!(cell["headline"]["mean"].is_f64(), "{cell}");
        assert!(cell["engine_start_ms"].as_i64().unwrap() >= 0, "{cell}");
        // Read from the run's GPU telemetry: none where nvidia-smi is not.
        let gpu = &cell["peak_gpu_memory_mb"];
        assert!(gpu.is_null() || gpu.is_u64(), "{cell}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_does_not_start_fails_its_model_s_cells_and_the_bench_goes_on() {
    let env = Env::new();
    env.dataset("short.jsonl", 5);
    env.dataset("long.jsonl", 5);
    let config = bench_config("0ms").replacen(
        &format!("{BIN} mock --bind 127.0.0.1:{{port}} --model {{model}} --latency 0ms --life-log life-a.log"),
        "echo no GPU for me >&2; exit 3",
        1,
    );
    env.write("bench.yaml", &config);
    let ran = env.evalfleet(&["bench", "bench.yaml"]).await;
    assert_eq!(ran.code, Some(1), "{}\n{}", ran.stdout, ran.stderr);
    assert!(
        ran.stderr
            .contains("the engine of model a did not start: it exited before it was ready"),
        "{}",
        ran.stderr
    );
    let status = env.evalfleet(&["bench", "status", "m", "--json"]).await;
    let cells: serde_json::Value = serde_json::from_str(&status.stdout).unwrap();
    let states: Vec<&str> = cells
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["state"].as_str().unwrap())
        .collect();
    assert_eq!(states, ["failed", "failed", "done", "done"]);
    let message = cells[0]["message"].as_str().unwrap();
    assert!(message.contains("no GPU for me"), "{message}");

    // The dashboard shows the matrix, each cell linking to its run; a
    // name that is not a bench's is not found, whatever it holds.
    let (_server, base) = crate::serve::serve(&env, &["--read-only"], None).await;
    let names = crate::serve::get(&format!("{base}/api/v1/benches")).await;
    assert_eq!(names, serde_json::json!(["m"]));
    let report = crate::serve::get(&format!("{base}/api/v1/benches/m")).await;
    assert_eq!(report["cells"][2]["state"], "done", "{report}");
    assert_eq!(report["cells"][0]["state"], "failed", "{report}");
    let page = crate::serve::client()
        .get(format!("{base}/benches/m"))
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    let page = page.text().await.unwrap();
    assert!(
        page.contains("<a href=\"/runs/m-b-short\">m-b-short</a>"),
        "{page}"
    );
    assert!(page.contains("no GPU for me"), "{page}");

    // Another store in the same folder has no bench: the plans beside it
    // are the first store's.
    let (_other, other) = crate::serve::serve(&env, &["--store", "runs/other.db"], None).await;
    let names = crate::serve::get(&format!("{other}/api/v1/benches")).await;
    assert_eq!(names, serde_json::json!([]));
    let missing = crate::serve::client()
        .get(format!("{other}/api/v1/benches/m"))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    let elsewhere = env
        .evalfleet(&["bench", "report", "m", "--store", "runs/other.db"])
        .await;
    assert_eq!(elsewhere.code, Some(2), "{}", elsewhere.stderr);
    assert!(
        elsewhere
            .stderr
            .contains("bench m's runs are in the store evalfleet.db beside runs/other.db"),
        "{}",
        elsewhere.stderr
    );
    for bad in ["..%2Fevalfleet", "m%3Cscript%3E", "nothing"] {
        let answer = crate::serve::client()
            .get(format!("{base}/api/v1/benches/{bad}"))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 404, "{bad}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_dies_mid_turn_fails_its_cells_at_once_and_leaves_nothing() {
    let env = Env::new();
    env.dataset("short.jsonl", 5);
    env.dataset("long.jsonl", 2000);
    env.write("bench.yaml", &bench_config("10ms"));
    let claims = env.path("runs/.engines");
    let claims = claims.to_str().unwrap().to_owned();
    let mut bench = env.spawn(&["bench", "bench.yaml"]);
    wait_until(ms(60_000), "cell m-a-long has answers", || {
        done_in(&env, "m-a-long") >= 20
    })
    .await;
    let engine = lives(&env, "life-a.log")[0].pid;
    crate::util::signal_pid(engine, "KILL").await;
    // Without a watch on the engine the cell would wait for
    // `timeouts.no_endpoint` (10 minutes).
    let code = tokio::time::timeout(ms(120_000), bench.wait())
        .await
        .expect("the bench ends soon after its engine died")
        .unwrap();
    assert_eq!(code.code(), Some(1));
    let status = env.evalfleet(&["bench", "status", "m", "--json"]).await;
    let cells: serde_json::Value = serde_json::from_str(&status.stdout).unwrap();
    assert_eq!(cells[0]["state"], "done");
    assert_eq!(cells[1]["state"], "failed", "{cells}");
    let message = cells[1]["message"].as_str().unwrap();
    assert!(message.contains("exited during its turn"), "{message}");
    assert_eq!(cells[2]["state"], "done", "the next model goes on: {cells}");
    assert!(with_arg(&claims).is_empty(), "no supervisor is left");
    assert!(lives(&env, "life-b.log").iter().all(|l| !alive(l.pid)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_holds_a_cell_s_id_but_is_not_that_cell_is_refused_and_left_alone() {
    let env = Env::new();
    env.dataset("short.jsonl", 3);
    env.dataset("long.jsonl", 3);
    env.write("bench.yaml", &bench_config("0ms"));
    let first = env.evalfleet(&["bench", "bench.yaml"]).await;
    assert_eq!(first.code, Some(0), "{}\n{}", first.stdout, first.stderr);
    let before = finished_at(&mut env.store(), "m-a-short");

    // Another bench file of the same name whose model a is served
    // otherwise: its cells have the same run ids, not the same runs.
    env.write("other.yaml", &bench_config("1ms"));
    let other = env.evalfleet(&["bench", "other.yaml"]).await;
    assert_eq!(other.code, Some(2), "{}\n{}", other.stdout, other.stderr);
    assert!(
        other.stderr.contains(
            "run m-a-short in the store holds the run id of cell models[0] x datasets[0]"
        ) && other
            .stderr
            .contains("its endpoint differs from model a's in the bench file"),
        "{}",
        other.stderr
    );
    assert!(lives(&env, "life-a.log").len() == 1, "no engine was loaded");

    // The bench's dataset edited since: its finished cells are not reused.
    env.dataset("short.jsonl", 4);
    let edited = env.evalfleet(&["bench", "bench.yaml"]).await;
    assert_eq!(edited.code, Some(2), "{}\n{}", edited.stdout, edited.stderr);
    assert!(
        edited.stderr.contains("run m-a-short in the store")
            && edited.stderr.contains("the dataset's content changed"),
        "{}",
        edited.stderr
    );
    let mut store = env.store();
    assert_eq!(finished_at(&mut store, "m-a-short"), before, "left alone");
    assert_eq!(store.run("m-a-short").unwrap().sessions, 1);
}

/// A cell whose answers are not all usable ends incomplete: the bench
/// exits 1 naming it, and its report marks it wherever it is shown, with
/// its scored and failed counts, beside a complete one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incomplete_cell_is_marked_on_every_surface_and_fails_the_bench() {
    let env = Env::new();
    // The engine echoes the question: the parse rule reads a number from
    // 3 of the 4 rows of `some`, from every row of `all`.
    env.write(
        "some.jsonl",
        "{\"id\": \"s1\", \"question\": \"#### 1\"}\n{\"id\": \"s2\", \"question\": \"#### 2\"}\n\
         {\"id\": \"s3\", \"question\": \"#### 3\"}\n{\"id\": \"s4\", \"question\": \"no number\"}\n",
    );
    env.write(
        "all.jsonl",
        "{\"id\": \"a1\", \"question\": \"#### 1\"}\n{\"id\": \"a2\", \"question\": \"#### 2\"}\n",
    );
    let dataset = |name: &str| {
        format!(
            "  - name: {name}\n    dataset: {{path: {name}.jsonl, id_field: id}}\n    task:\n      \
             messages: [{{role: user, content: '{{{{ question }}}}'}}]\n      \
             parse: {{regex: '#### (\\d+)'}}\n      max_reasks: 0\n      \
             metrics: [{{name: exact_match, reference: '{{{{ question[5:] }}}}'}}]\n"
        )
    };
    env.write(
        "bench.yaml",
        &format!(
            "name: inc\nmodels:\n  - name: a\n    endpoint:\n      kind: local\n      model: a\n      \
             command: \"{BIN} mock --bind 127.0.0.1:{{port}} --model {{model}}\"\n      concurrency: 2\n\
             datasets:\n{}{}",
            dataset("some"),
            dataset("all")
        ),
    );
    let ran = env.evalfleet(&["bench", "bench.yaml"]).await;
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    assert!(
        ran.stderr.contains("1 cell(s) incomplete")
            && ran
                .stderr
                .contains("a on some: incomplete: 3 of 4 items scored (1 unusable); 1 × unparsed"),
        "{}",
        ran.stderr
    );
    let table = env.evalfleet(&["bench", "report", "inc"]).await;
    assert_eq!(table.code, Some(0), "{}", table.stderr);
    let row = |dataset: &str| {
        table
            .stdout
            .lines()
            .find(|l| l.starts_with("a ") && l.contains(dataset))
            .unwrap_or_else(|| panic!("{}", table.stdout))
            .to_owned()
    };
    assert!(
        row("some").contains("incomplete") && row("some").contains("3/0"),
        "{}",
        table.stdout
    );
    assert!(row("some").contains("]*"), "marked: {}", table.stdout);
    assert!(
        row("all").contains("complete") && !row("all").contains("]*"),
        "{}",
        table.stdout
    );
    let csv = env
        .evalfleet(&["bench", "report", "inc", "--format", "csv"])
        .await;
    let header: Vec<&str> = csv.stdout.lines().next().unwrap().split(',').collect();
    let line = csv.stdout.lines().find(|l| l.contains(",some,")).unwrap();
    let cells: Vec<&str> = line.split(',').collect();
    let at = |name: &str| cells[header.iter().position(|h| *h == name).unwrap()];
    assert_eq!(
        (at("state"), at("scored"), at("failed")),
        ("incomplete", "3", "0")
    );
    let json = env
        .evalfleet(&["bench", "report", "inc", "--format", "json"])
        .await;
    let report: serde_json::Value = serde_json::from_str(&json.stdout).unwrap();
    assert_eq!(report["cells"][0]["outcome"]["outcome"], "incomplete");
    assert_eq!(
        report["cells"][0]["outcome"]["causes"][0]["cause"],
        "unparsed"
    );
    assert_eq!(report["cells"][1]["outcome"]["outcome"], "complete");
    let html = env.path("inc.html");
    env.evalfleet(&["bench", "report", "inc", "--html", html.to_str().unwrap()])
        .await;
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(page.contains("<tr class=\"incomplete\">"), "{page}");
    assert!(page.contains("1 × unparsed"), "{page}");
}
