//! The dashboard in a real headless Chromium, against a real `evalfleet
//! serve`: a run started from its page goes on live there, a filter
//! narrows the results table, an item shows its attempts, and the
//! comparison page draws two runs with their intervals. Screenshots go to
//! `target/test-artifacts/dashboard/`.

use std::time::Duration;

use serde_json::json;

use crate::serve::{client, config, serve, wait_for_state};
use crate::util::Env;
use crate::webdriver::{Browser, artifacts};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_started_from_the_dashboard_is_followed_live_then_explored() {
    let Some(browser) = Browser::start().await else {
        return;
    };
    let env = Env::new();
    let (_server, base) = serve(&env, &[], None).await;
    let shots = artifacts();

    // Start a run from the page: about 4 s of work at 4 calls at a time.
    browser.open(&format!("{base}/new")).await;
    browser
        .find("#config")
        .await
        .type_text(&config(&env, 300, "50ms", 4, ""))
        .await;
    browser.find("#run-id").await.type_text("from-page").await;
    browser.find("#start").await.click().await;
    browser
        .wait_for(
            "the run's page",
            "return location.pathname === '/runs/from-page';",
            Duration::from_secs(20),
        )
        .await;
    // It goes on live: items done climb without a reload...
    browser
        .wait_for(
            "items done while the run is running",
            "const d = document.getElementById('stat-done'); const s = document.getElementById('state');
             return !!d && !!s && s.textContent === 'running' && Number(d.textContent.replace(/\\D/g, '')) > 0;",
            Duration::from_secs(30),
        )
        .await;
    browser.screenshot(&shots, "run-live").await;
    let loaded = browser
        .eval("return performance.getEntriesByType('navigation').length;")
        .await;
    // ...and it ends on the same page load, with its timeline drawn.
    browser
        .wait_for(
            "the run finished",
            "return document.getElementById('state').textContent === 'finished'
                 && document.getElementById('stat-done').textContent.replace(/\\D/g, '') === '300';",
            Duration::from_secs(60),
        )
        .await;
    assert_eq!(
        browser
            .eval("return performance.getEntriesByType('navigation').length;")
            .await,
        loaded,
        "the page was reloaded"
    );
    browser
        .wait_for(
            "a chart",
            "return document.querySelectorAll('#chart-items canvas').length > 0;",
            Duration::from_secs(10),
        )
        .await;
    browser.screenshot(&shots, "run-finished").await;

    // The results table, then narrowed by a filter.
    browser.open(&format!("{base}/runs/from-page/items")).await;
    browser.find("#items tbody tr").await;
    assert_eq!(browser.all("#items tbody tr").await.len(), 50);
    browser
        .find("#f-q")
        .await
        .type_text("question 123 of")
        .await;
    browser.find("#apply").await.click().await;
    browser
        .wait_for(
            "one row",
            "return document.querySelectorAll('#items tbody tr').length === 1;",
            Duration::from_secs(10),
        )
        .await;
    assert!(browser.url().await.contains("q=question+123+of"));
    let row = browser.find("#items tbody tr").await;
    assert!(row.text().await.contains("item-00123"));
    browser.screenshot(&shots, "results-filtered").await;

    // The item's page shows its attempts.
    browser.find("#items tbody tr a").await.click().await;
    browser.find("#attempts tbody tr").await;
    let attempt = browser.find("#attempts tbody tr").await.text().await;
    assert!(
        attempt.contains("m") && attempt.contains("200"),
        "{attempt}"
    );
    let conversation = browser.find("#conversation").await.text().await;
    assert!(
        conversation.contains("question 123 of 300"),
        "{conversation}"
    );
    browser.screenshot(&shots, "item").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_comparison_page_shows_two_runs_with_their_intervals() {
    let Some(browser) = Browser::start().await else {
        return;
    };
    let env = Env::new();
    let (_server, base) = serve(&env, &[], None).await;
    // Two runs of the same items: one answers every item right, the other
    // fails a share of them with requests the server found wrong (a 400,
    // with no retry: scored as the worst answer; a server's own failure
    // would leave the item out of the comparison).
    for (run_id, extra) in [("right", ""), ("flaky", "")] {
        let mut text = config(&env, 60, "1ms", 8, extra);
        if run_id == "flaky" {
            text = text.replace(
                "mock: { latency: 1ms }",
                "mock: { latency: 1ms, error_rate: 0.3, error_status: 400, seed: 4 }",
            ) + "retry: { max_attempts: 1 }\n";
        }
        let response = client()
            .post(format!("{base}/api/v1/runs"))
            .json(&json!({"config": text, "run_id": run_id}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201, "{}", response.text().await.unwrap());
        wait_for_state(&base, run_id, "finished").await;
    }
    browser
        .open(&format!("{base}/compare?runs=right,flaky"))
        .await;
    browser.find("[data-metric] svg").await;
    // Both runs' means with their intervals, and the difference.
    let intervals = browser
        .eval("return document.querySelectorAll('[data-metric] svg rect').length;")
        .await;
    assert!(intervals.as_u64().unwrap() >= 3, "{intervals}");
    let table = browser
        .find("[data-metric] table.comparisons")
        .await
        .text()
        .await;
    assert!(table.contains("flaky"), "{table}");
    let disagree = browser
        .find("[data-disagreements] table")
        .await
        .text()
        .await;
    assert!(disagree.contains("item-"), "{disagree}");
    assert!(
        browser
            .eval("return document.querySelectorAll('[data-coverage]').length;")
            .await
            == json!(0),
        "runs of the same items carry no warning"
    );
    // The run whose items partly failed is said to be incomplete, first.
    let marked = browser
        .find("[data-outcome-run='flaky']")
        .await
        .text()
        .await;
    assert!(marked.contains("Run flaky is incomplete"), "{marked}");
    assert!(
        browser
            .eval("return document.querySelectorAll('[data-outcome-run]').length;")
            .await
            == json!(1),
        "the complete run is not marked"
    );
    browser.screenshot(&artifacts(), "compare").await;
    // A run of half the items (a dataset of its own): the page says so
    // before any figure, with how many each has and how many were paired.
    let response = client()
        .post(format!("{base}/api/v1/runs"))
        .json(&json!({"config": config(&env, 30, "1ms", 8, ""), "run_id": "half"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201, "{}", response.text().await.unwrap());
    wait_for_state(&base, "half", "finished").await;
    browser
        .open(&format!("{base}/compare?runs=right,half"))
        .await;
    let warning = browser.find("[data-coverage]").await.text().await;
    assert!(
        warning.contains("right has 60 items, half has 30, and 30 were paired"),
        "{warning}"
    );
    browser
        .screenshot(&artifacts(), "compare-different-items")
        .await;
}

/// The examples' files, copied into `env`.
fn examples(env: &Env, names: &[&str]) {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples");
    for name in names {
        std::fs::copy(format!("{dir}/{name}"), env.path(name)).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_show_verdicts_tests_turns_and_failed_runs_as_they_are() {
    let Some(browser) = Browser::start().await else {
        return;
    };
    let env = Env::new();
    examples(
        &env,
        &[
            "code.yaml",
            "code-problems.jsonl",
            "code-answers.jsonl",
            "conversation.yaml",
            "conversation-answers.jsonl",
        ],
    );
    let mut cli_rate = 0.0;
    for (config, run_id) in [("code.yaml", "code"), ("conversation.yaml", "talk")] {
        let ran = env
            .evalfleet(&["run", config, "--run-id", run_id, "--quiet"])
            .await;
        assert!(ran.code.is_some_and(|c| c <= 1), "{}", ran.stderr);
        if run_id == "code" {
            // "... 4 items in 2.3s (1.8 items/s; 0 retries, ...)."
            let said = format!("{}{}", ran.stdout, ran.stderr);
            let (head, _) = said.split_once(" items/s;").expect("the run's rate");
            cli_rate = head.rsplit_once('(').unwrap().1.parse().unwrap();
        }
    }
    let every_call_fails = config(&env, 5, "1ms", 2, "").replace(
        "mock: { latency: 1ms }",
        "mock: { latency: 1ms, error_rate: 1.0 }",
    ) + "retry: { max_attempts: 1 }\n";
    env.write("fails.yaml", &every_call_fails);
    let ran = env
        .evalfleet(&["run", "fails.yaml", "--run-id", "fails", "--quiet"])
        .await;
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    let (_server, base) = serve(&env, &["--read-only"], None).await;

    // A short run's page says the rate the run had, as the CLI did.
    browser.open(&format!("{base}/runs/code")).await;
    browser
        .wait_for(
            "the run's rate",
            "const r = document.getElementById('stat-rate'); return !!r && r.textContent !== '';",
            Duration::from_secs(20),
        )
        .await;
    let rate: f64 = browser
        .find("#stat-rate")
        .await
        .text()
        .await
        .parse()
        .unwrap();
    assert!(
        rate > 0.0 && (rate - cli_rate).abs() <= 0.35 * cli_rate,
        "the page says {rate} items/s, the CLI {cli_rate}"
    );

    // A code run's results: a verdict and the tests passed on each row.
    browser.open(&format!("{base}/runs/code/items")).await;
    browser.find("#items tbody tr").await;
    let header = browser.find("#items thead").await.text().await;
    assert!(header.to_lowercase().contains("verdict"), "{header}");
    let verdicts = browser
        .eval("return [...document.querySelectorAll('#items td.verdict')].map((td) => td.textContent);")
        .await;
    let verdicts: Vec<&str> = verdicts
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(verdicts.len(), 4, "{verdicts:?}");
    assert!(
        verdicts.iter().any(|v| v.starts_with("success")),
        "{verdicts:?}"
    );
    assert!(
        verdicts.iter().any(|v| !v.starts_with("success")),
        "{verdicts:?}"
    );
    browser.screenshot(&artifacts(), "code-items").await;
    // A failing answer's page: its tests as a table, not JSON.
    let failing = browser
        .eval("return [...document.querySelectorAll('#items tbody tr')].find((tr) => !tr.querySelector('td.verdict').textContent.startsWith('success')).dataset.item;")
        .await;
    let failing = failing.as_str().unwrap();
    browser
        .open(&format!("{base}/runs/code/items/{failing}"))
        .await;
    browser.find("#judge").await;
    let tests = browser
        .eval("const t = document.querySelector('#judge-tests'); return t ? t.querySelectorAll('tbody tr').length : 0;")
        .await;
    assert!(tests.as_u64().unwrap() >= 1, "{tests}");
    assert_eq!(
        browser
            .eval("return document.querySelectorAll('#judge pre').length;")
            .await,
        json!(0),
        "the judgement is not shown as JSON"
    );
    browser.screenshot(&artifacts(), "code-item").await;

    // A conversation episode: its turns, not a JSON string.
    browser.open(&format!("{base}/runs/talk/items")).await;
    browser.find("#items tbody tr").await;
    let first = browser
        .eval("return document.querySelector('#items tbody tr').dataset.item;")
        .await;
    let answer = browser
        .eval("return document.querySelector('#items tbody tr td.clip').textContent;")
        .await;
    assert!(!answer.as_str().unwrap().starts_with('{'), "{answer}");
    browser
        .open(&format!(
            "{base}/runs/talk/items/{}",
            first.as_str().unwrap()
        ))
        .await;
    browser.find("#turns .msg").await;
    let turns = browser
        .eval("return document.querySelectorAll('#turns .msg').length;")
        .await;
    assert!(turns.as_u64().unwrap() >= 3, "{turns}");
    let text = browser.find("#conversation").await.text().await;
    assert!(!text.contains("{\"conversation\""), "{text}");
    assert!(!browser.all("#steps tbody tr").await.is_empty());
    browser.screenshot(&artifacts(), "conversation-item").await;

    // A finished run whose every item failed is not a green "finished".
    browser.open(&format!("{base}/runs/fails")).await;
    browser
        .wait_for(
            "the run's state",
            "return document.getElementById('state').textContent !== '';",
            Duration::from_secs(20),
        )
        .await;
    let state = browser
        .eval("return document.querySelector('#state .badge').textContent + ' ' + document.querySelector('#state .badge').className;")
        .await;
    assert_eq!(state, "failed badge failed");
    // Its report opens with its outcome and the cause, no score shown.
    let outcome = browser
        .find("#report .outcome[data-outcome='failed']")
        .await
        .text()
        .await;
    assert!(
        outcome.contains("Failed: 0 of 5 items answered (5 failed)")
            && outcome.contains("5 × failed: HTTP 500"),
        "{outcome}"
    );
    browser.open(&format!("{base}/")).await;
    browser.find("#runs tbody tr").await;
    let listed = browser.find("#runs").await.text().await;
    assert!(listed.to_lowercase().contains("failed"), "{listed}");
}

/// The page's live DOM nodes, event listeners and JS heap (bytes), after a
/// garbage collection, as Chrome counts them.
async fn footprint(browser: &Browser) -> (f64, f64, f64) {
    browser.cdp("HeapProfiler.collectGarbage", json!({})).await;
    let metrics = browser.cdp("Performance.getMetrics", json!({})).await;
    let get = |name: &str| {
        metrics["metrics"]
            .as_array()
            .and_then(|list| list.iter().find(|m| m["name"] == name))
            .and_then(|m| m["value"].as_f64())
            .unwrap_or_else(|| panic!("no {name} in {metrics}"))
    };
    (get("Nodes"), get("JSEventListeners"), get("JSHeapUsedSize"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_page_of_a_running_run_holds_its_memory_for_minutes() {
    let Some(browser) = Browser::start().await else {
        return;
    };
    let env = Env::new();
    let (_server, base) = serve(&env, &[], None).await;
    // About 200 s of work, so that it runs for the whole watch.
    let path = env.write("long.yaml", &config(&env, 2000, "200ms", 2, ""));
    let response = client()
        .post(format!("{base}/api/v1/runs"))
        .json(&json!({"config_path": path, "run_id": "long"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    browser.open(&format!("{base}/runs/long")).await;
    browser.cdp("Performance.enable", json!({})).await;
    browser
        .wait_for(
            "the run's charts",
            "return document.querySelectorAll('#chart-items canvas').length === 1
                 && document.getElementById('state').textContent === 'running';",
            Duration::from_secs(30),
        )
        .await;
    // Settled: a dozen updates in (about ten items a second).
    browser
        .wait_for(
            "a dozen seconds of the run",
            "return Number(document.getElementById('stat-done').textContent.replace(/\\D/g, '')) >= 120;",
            Duration::from_secs(60),
        )
        .await;
    let before = footprint(&browser).await;
    let mut seen = vec![before];
    // Two minutes of updates, a second apart.
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_secs(15)).await;
        seen.push(footprint(&browser).await);
    }
    let after = *seen.last().unwrap();
    eprintln!("footprints: {seen:?}");
    let state = browser
        .eval("return document.getElementById('state').textContent;")
        .await;
    assert_eq!(state, "running", "the run went on all along");
    let done = browser
        .eval(
            "return Number(document.getElementById('stat-done').textContent.replace(/\\D/g, ''));",
        )
        .await;
    assert!(
        done.as_f64().unwrap() > 500.0,
        "the page followed it: {done}"
    );
    // Before charts were fed instead of rebuilt, these 120 s added 16,800
    // nodes, 4,200 listeners and 9.5 MB.
    assert!(after.0 - before.0 < 150.0, "DOM nodes grew: {seen:?}");
    assert!(after.1 - before.1 < 30.0, "event listeners grew: {seen:?}");
    assert!(
        after.2 - before.2 < 2.0e6,
        "the JS heap grew by {} bytes: {seen:?}",
        after.2 - before.2
    );
    // Six charts: items, latency, TTFT, the limit, and the resources'
    // memory and share; each fed in place keeps its one canvas.
    assert_eq!(
        browser
            .eval(
                "return [document.querySelectorAll('canvas').length,
                         document.querySelectorAll('.chart').length,
                         document.querySelectorAll('.chart canvas').length];"
            )
            .await,
        json!([6, 6, 6]),
        "one canvas a chart"
    );
    let stopped = client()
        .post(format!("{base}/api/v1/runs/long/cancel"))
        .send()
        .await
        .unwrap();
    assert_eq!(stopped.status(), 202);
    wait_for_state(&base, "long", "interrupted").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_item_page_shows_its_calls_as_a_timeline_with_their_messages() {
    let Some(browser) = Browser::start().await else {
        return;
    };
    let Some(python) = crate::agents::agent_python("openai") else {
        return;
    };
    let env = Env::new();
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/agent");
    for name in ["agent.yaml", "agent.py", "countries.jsonl", "answers.jsonl"] {
        std::fs::copy(format!("{dir}/{name}"), env.path(name)).unwrap();
    }
    crate::agents::run_agents(
        &env,
        &["run", "agent.yaml", "--run-id", "agent", "--quiet"],
        &python,
    )
    .await;
    let (_server, base) = serve(&env, &["--read-only"], None).await;
    browser.open(&format!("{base}/runs/agent/items/c001")).await;
    browser.find("#calls tbody tr.call").await;
    let rows = browser
        .eval("return [...document.querySelectorAll('#calls tr.call')].map((tr) => [...tr.cells].map((td) => td.textContent));")
        .await;
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 3, "{rows:?}");
    let cell = |row: usize, col: usize| rows[row][col].as_str().unwrap().to_owned();
    assert!(cell(0, 0).ends_with(".1.1"), "{rows:?}");
    assert_eq!(cell(1, 2), "chat.completions · stream");
    assert_eq!(cell(0, 3), "mock");
    assert_eq!(cell(0, 4), "qwen3-4b");
    assert!(cell(2, 8).starts_with("200"), "{rows:?}");
    // Its messages on demand: the tool call, then the tool's result sent.
    browser.find("#calls tr.call button").await.click().await;
    let first = browser
        .eval("return document.querySelector('#calls tr.call-detail').hidden;")
        .await;
    assert_eq!(first, json!(false));
    let detail = browser
        .eval("return document.querySelector('#calls tr.call-detail').textContent;")
        .await;
    let detail = detail.as_str().unwrap();
    assert!(
        detail.contains("lookup({\"country\":\"France\"})"),
        "{detail}"
    );
    assert!(
        detail.contains("What is the capital of France?"),
        "{detail}"
    );
    browser.screenshot(&artifacts(), "agent-item").await;
}
