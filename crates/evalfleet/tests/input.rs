//! Bad input: configs, datasets, templates, changed runs and secrets. Each
//! gets its message with its place, exit code 2, and writes nothing.

use evalfleet_core::preflight;
use evalfleet_mock::MockSettings;

use crate::util::{Env, NO_HEALTH, by_id, config, external, external_with, mock};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_config_reports_every_problem_with_its_line_and_writes_nothing() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 3);
    env.write(
        "bad.yaml",
        &format!(
            "name: demo\n\
             dataset:\n  path: {}\n\
             endpoints:\n\
             \x20 - name: a\n    kind: mock\n    concurrency: 0\n\
             \x20 - name: b\n    kind: external\n    model: m\n    colour: red\n\
             task:\n  messages:\n    - {{ role: user, content: \"{{{{ question }}}}\" }}\n\
             retry: {{ max_attempts: 0 }}\n",
            dataset.display()
        ),
    );
    let ran = env.evalfleet(&["run", "bad.yaml"]).await;
    assert_eq!(ran.code, Some(2), "{}", ran.stderr);
    for expected in [
        "bad.yaml:7: endpoints[0].concurrency: must be at least 1, got 0",
        "bad.yaml:8: endpoints[1].base_url: is required",
        "bad.yaml:11: endpoints[1]: unknown key 'colour'",
        "bad.yaml:15: retry.max_attempts: must be at least 1, got 0",
    ] {
        assert!(
            ran.stderr.contains(expected),
            "missing {expected:?} in:\n{}",
            ran.stderr
        );
    }
    assert!(ran.stderr.contains("has 4 problems"), "{}", ran.stderr);
    assert!(
        !env.path("runs").exists(),
        "a bad config must write nothing"
    );

    let check = env.evalfleet(&["check", "bad.yaml"]).await;
    assert_eq!(check.code, Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_dataset_line_is_named_and_nothing_is_written() {
    let env = Env::new();
    let server = mock(MockSettings::default()).await;
    let dataset = env.write(
        "items.jsonl",
        "{\"id\": 1, \"question\": \"a\"}\n{\"id\": 2, \"question\": \"b\"}\n{\"id\": 3, \"question\": \n",
    );
    env.write(
        "run.yaml",
        &config(&dataset, &external("only", &server, 2), ""),
    );
    let ran = env.evalfleet(&["run", "run.yaml"]).await;
    assert_eq!(ran.code, Some(2), "{}", ran.stderr);
    assert!(
        ran.stderr.contains("items.jsonl:3: invalid JSON"),
        "{}",
        ran.stderr
    );
    assert!(
        ran.stderr.contains("skip_invalid"),
        "the message says how to go on: {}",
        ran.stderr
    );
    assert!(
        !env.path("runs").exists(),
        "a bad dataset must write nothing"
    );
    assert_eq!(server.stats().requests, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_id_names_both_lines() {
    let env = Env::new();
    let server = mock(MockSettings::default()).await;
    let dataset = env.write(
        "items.jsonl",
        "{\"id\": \"x\", \"question\": \"a\"}\n{\"id\": \"y\", \"question\": \"b\"}\n\n{\"id\": \"x\", \"question\": \"c\"}\n",
    );
    env.write(
        "run.yaml",
        &config(&dataset, &external("only", &server, 2), ""),
    );
    let ran = env.evalfleet(&["run", "run.yaml"]).await;
    assert_eq!(ran.code, Some(2), "{}", ran.stderr);
    assert!(
        ran.stderr
            .contains("items.jsonl:4: duplicate item id 'x' (first on line 1)"),
        "{}",
        ran.stderr
    );
    assert!(!env.path("runs").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_csv_row_with_the_wrong_number_of_fields_is_named() {
    let env = Env::new();
    let server = mock(MockSettings::default()).await;
    let dataset = env.write("items.csv", "id,question\n1,a\n2,b,extra\n");
    env.write(
        "run.yaml",
        &config(&dataset, &external("only", &server, 2), ""),
    );
    let ran = env.evalfleet(&["run", "run.yaml"]).await;
    assert_eq!(ran.code, Some(2), "{}", ran.stderr);
    assert!(
        ran.stderr
            .contains("items.csv:3: expected 2 fields like the header row, found 3"),
        "{}",
        ran.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_skip_invalid_bad_rows_become_failed_items_and_the_run_goes_on() {
    let env = Env::new();
    let server = mock(MockSettings::default()).await;
    let dataset = env.write(
        "items.jsonl",
        "{\"id\": \"a\", \"question\": \"q1\"}\nnot json\n[1, 2]\n{\"id\": \"b\", \"question\": \"q2\"}\n",
    );
    let text = config(&dataset, &external("only", &server, 2), "")
        .replace("id_field: id", "id_field: id\n  skip_invalid: true");
    env.write("run.yaml", &text);
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(
        ran.code,
        Some(1),
        "a run with failed items exits 1: {}",
        ran.stderr
    );
    let rows = by_id(&env.export(&ran.run_id()).await);
    assert_eq!(rows.len(), 4);
    assert_eq!(rows["a"]["status"], "done");
    assert_eq!(rows["b"]["status"], "done");
    let bad = &rows["line:2"];
    assert_eq!(bad["status"], "failed");
    assert!(
        bad["error"]
            .as_str()
            .unwrap()
            .starts_with("invalid dataset row (line 2): invalid JSON"),
        "{bad}"
    );
    assert_eq!(
        rows["line:3"]["error"],
        "invalid dataset row (line 3): expected a JSON object, got an array"
    );
    assert_eq!(server.stats().requests, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_field_no_row_has_is_refused_before_any_call() {
    let env = Env::new();
    let server = mock(MockSettings::default()).await;
    let dataset = env.dataset("items.jsonl", 5);
    let text = config(&dataset, &external("only", &server, 2), "")
        .replace("{{ question }}", "{{ questoin }}");
    env.write("run.yaml", &text);
    let ran = env.evalfleet(&["run", "run.yaml"]).await;
    assert_eq!(ran.code, Some(2), "{}", ran.stderr);
    assert!(
        ran.stderr.contains(
            "run.yaml:10: task.messages[0].content: for row 1 (line 1 of items.jsonl): this item has no field 'questoin'"
        ),
        "{}",
        ran.stderr
    );
    assert_eq!(server.stats().requests, 0);
    assert!(!env.path("runs").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_past_the_first_that_lacks_a_field_refuses_the_run_naming_its_line() {
    let env = Env::new();
    let server = mock(MockSettings::default()).await;
    // The first rows are rendered before the run (the next test); every
    // row is checked as the run is registered, so a later row that lacks a
    // field refuses the run before any call, rather than scoring as a
    // wrong answer.
    let mut rows = String::new();
    for i in 0..14 {
        rows.push_str(&format!("{{\"id\": \"a{i}\", \"question\": \"q{i}\"}}\n"));
    }
    rows.push_str("{\"id\": \"b\", \"prompt\": \"q2\"}\n");
    const { assert!(preflight::ROWS < 15) };
    let dataset = env.write("items.jsonl", &rows);
    env.write(
        "run.yaml",
        &config(&dataset, &external("only", &server, 2), ""),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(2), "{}", ran.stderr);
    assert!(
        ran.stderr.contains("1 row(s) of ")
            && ran.stderr.contains(
                "items.jsonl cannot be rendered, the first at line(s) 15: task.messages[0].content: this item has no field 'question'"
            ),
        "{}",
        ran.stderr
    );
    assert_eq!(server.stats().requests, 0);
    assert!(!env.path("runs").exists(), "nothing is stored");

    // A field used only under `{% if %}` may be absent.
    let text = config(&dataset, &external("only", &server, 2), "").replace(
        "content: \"{{ question }}\"",
        "content: \"{% if question %}{{ question }}{% else %}{{ prompt }}{% endif %}\"",
    );
    env.write("run.yaml", &text);
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert_eq!(server.stats().requests, 15);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_rows_are_rendered_before_the_run_and_a_problem_names_its_row() {
    let env = Env::new();
    let server = mock(MockSettings::default()).await;
    let dataset = env.write(
        "items.jsonl",
        "{\"id\": \"a\", \"question\": \"q1\", \"answer\": \"4\"}\n\
         {\"id\": \"b\", \"prompt\": \"q2\", \"answer\": \"four\"}\n",
    );
    let text = config(
        &dataset,
        &external("only", &server, 2),
        "  metrics:\n\
         \x20   - { name: numeric_match, reference: \"{{ answer }}\" }\n\
         \x20   - { name: json_field_match, reference: \"{{ answer }}\" }\n\
         \x20   - { name: exact_match, reference: \"{{ answer | tojsn }}\" }",
    );
    env.write("run.yaml", &text);
    let ran = env.evalfleet(&["run", "run.yaml"]).await;
    assert_eq!(ran.code, Some(2), "{}", ran.stderr);
    // The unknown filter is the config's own problem, found without the
    // dataset; the rest once the first rows are read (the next run).
    assert!(
        ran.stderr
            .contains("task.metrics[2].reference: uses an unknown filter 'tojsn'"),
        "{}",
        ran.stderr
    );
    let fixed = text.replace("tojsn", "tojson");
    env.write("run.yaml", &fixed);
    let ran = env.evalfleet(&["run", "run.yaml"]).await;
    assert_eq!(ran.code, Some(2), "{}", ran.stderr);
    for expected in [
        "task.messages[0].content: for row 2 (line 2 of items.jsonl): this item has no field 'question'",
        "task.metrics[0].reference: for row 2 (line 2 of items.jsonl): numeric_match cannot use it: the reference 'four' has no number",
        "task.metrics[1].reference: for row 1 (line 1 of items.jsonl): json_field_match cannot use it: the reference '4' is not a JSON object",
    ] {
        assert!(ran.stderr.contains(expected), "{expected}\n{}", ran.stderr);
    }
    assert!(
        ran.stderr.contains("run.yaml has 3 problems"),
        "{}",
        ran.stderr
    );
    assert_eq!(server.stats().requests, 0);
    assert!(!env.path("runs").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_refuses_a_changed_dataset_or_task_and_says_what_changed() {
    let env = Env::new();
    let stuck = mock(MockSettings {
        error_rate: 1.0,
        error_status: 503,
        ..MockSettings::default()
    })
    .await;
    let dataset = env.dataset("items.jsonl", 5);
    let extra = "retry: { max_attempts: 1 }";
    env.write(
        "run.yaml",
        &config(&dataset, &external("only", &stuck, 2), extra),
    );
    let ran = env
        .evalfleet(&["run", "run.yaml", "-q", "--run-id", "r1"])
        .await;
    assert_eq!(ran.code, Some(1));

    let changed_task = config(&dataset, &external("only", &stuck, 2), extra)
        .replace("{{ question }}", "Q: {{ question }}");
    env.write("changed.yaml", &changed_task);
    let refused = env
        .evalfleet(&["resume", "r1", "--retry-failed", "--config", "changed.yaml"])
        .await;
    assert_eq!(refused.code, Some(2), "{}", refused.stderr);
    assert!(
        refused.stderr.contains("task.messages changed"),
        "{}",
        refused.stderr
    );

    std::fs::write(&dataset, "{\"id\": \"z\", \"question\": \"new\"}\n").unwrap();
    let refused = env.evalfleet(&["resume", "r1", "--retry-failed"]).await;
    assert_eq!(refused.code, Some(2), "{}", refused.stderr);
    assert!(
        refused.stderr.contains("the dataset's content changed"),
        "{}",
        refused.stderr
    );
    assert_eq!(
        env.counts("r1").failed,
        5,
        "a refused resume changes nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_failed_answers_failed_items_again() {
    let env = Env::new();
    let flaky = mock(MockSettings {
        fail_first: 1,
        ..MockSettings::default()
    })
    .await;
    let dataset = env.dataset("items.jsonl", 8);
    env.write(
        "run.yaml",
        &config(
            &dataset,
            &external_with("only", &flaky, 2, NO_HEALTH),
            "retry: { max_attempts: 1 }",
        ),
    );
    let ran = env
        .evalfleet(&["run", "run.yaml", "-q", "--run-id", "r"])
        .await;
    assert_eq!(ran.code, Some(1));
    assert_eq!(env.counts("r").failed, 8);
    let nothing = env.evalfleet(&["resume", "r"]).await;
    assert_eq!(nothing.code, Some(1));
    assert!(
        nothing.stderr.contains("nothing to resume"),
        "{}",
        nothing.stderr
    );
    let again = env
        .evalfleet(&["resume", "r", "-q", "--retry-failed"])
        .await;
    assert_eq!(again.code, Some(0), "{}", again.stderr);
    let rows = by_id(&env.export("r").await);
    assert!(
        rows.values()
            .all(|r| r["status"] == "done" && r["attempts"] == 2),
        "{rows:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_reach_neither_the_store_nor_the_export_nor_the_logs() {
    let env = Env::new();
    let server = mock(MockSettings {
        fail_first: 1,
        ..MockSettings::default()
    })
    .await;
    let dataset = env.dataset("items.jsonl", 5);
    let endpoint = format!(
        "  - name: hosted\n    kind: external\n    base_url: \"{}\"\n    model: m\n    api_key: ${{EF_TEST_API_KEY}}\n    headers: {{ X-Org-Token: literal-header-secret-42 }}\n",
        server.base_url()
    );
    env.write(
        "run.yaml",
        &config(&dataset, &endpoint, "retry: { backoff_base: 5ms }"),
    );
    let ran = env
        .command(&["run", "run.yaml", "-v", "--run-id", "s"])
        .env("EF_TEST_API_KEY", "sk-env-secret-1234567")
        .output()
        .await
        .unwrap();
    let ran: crate::util::Ran = ran.into();
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let mut stored = Vec::new();
    for suffix in ["", "-wal"] {
        let mut name = env.store_path().into_os_string();
        name.push(suffix);
        if let Ok(bytes) = std::fs::read(&name) {
            stored.extend(bytes);
        }
    }
    let stored = String::from_utf8_lossy(&stored);
    let export = env
        .evalfleet(&["export", "s", "--format", "jsonl"])
        .await
        .stdout;
    let status = env.evalfleet(&["status", "s", "--json"]).await.stdout;
    for secret in ["sk-env-secret-1234567", "literal-header-secret-42"] {
        assert!(!stored.contains(secret), "{secret} is in the store");
        assert!(!export.contains(secret), "{secret} is in the export");
        assert!(!status.contains(secret), "{secret} is in the status");
        assert!(!ran.stderr.contains(secret), "{secret} is in the logs");
        assert!(!ran.stdout.contains(secret), "{secret} is on stdout");
    }
    assert!(
        stored.contains("${EF_TEST_API_KEY}"),
        "the reference is kept for resume"
    );

    // The literal header was not stored, so resuming from the stored config
    // asks for it again.
    let resumed = env.evalfleet(&["resume", "s"]).await;
    assert_eq!(resumed.code, Some(2), "{}", resumed.stderr);
    assert!(
        resumed
            .stderr
            .contains("endpoints[0].headers.X-Org-Token: was written literally in the config"),
        "{}",
        resumed.stderr
    );
}

/// An address that answers web pages (a site's root, not the API's: a
/// `base_url` without `/v1`) is named as such, from a real HTTP server
/// (Python's own) that answers HTML.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_that_answers_html_says_so_and_suggests_v1() {
    let env = Env::new();
    let (site, port) = env
        .python_server(&[
            "-c",
            "import http.server\n\
             s = http.server.HTTPServer(('127.0.0.1', 0), http.server.SimpleHTTPRequestHandler)\n\
             print(s.server_address[1], flush=True)\n\
             s.serve_forever()",
        ])
        .await;
    let dataset = env.dataset("items.jsonl", 3);
    let endpoint = format!(
        "  - {{ name: site, kind: external, base_url: \"http://127.0.0.1:{port}\", model: m, concurrency: 2, {NO_HEALTH} }}\n"
    );
    // Its health probe (GET /models) is answered 404 with a page: the
    // endpoint is unhealthy, and says why; the run stops once no endpoint
    // could take items for `timeouts.no_endpoint`.
    env.write(
        "run.yaml",
        &config(&dataset, &endpoint, "timeouts: { no_endpoint: 2s }"),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(130), "{}", ran.stderr);
    assert!(
        ran.stderr.contains(
            "Endpoint site is unhealthy (HTTP 404: answered HTML, not JSON: does base_url end in /v1?)"
        ),
        "{}",
        ran.stderr
    );
    // Its calls (POST, answered 501 with a page) say the same.
    let endpoint = endpoint.replace(NO_HEALTH, "health: { path: /, max_failures: 1000000 }");
    env.write(
        "run.yaml",
        &config(
            &dataset,
            &endpoint,
            "retry: { max_attempts: 2, backoff_base: 5ms, backoff_max: 20ms }",
        ),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    drop(site);
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    assert!(
        ran.stderr
            .contains("finished, failed: 0 of 3 items answered")
            && ran.stderr.contains(
                "3 × failed: HTTP 501: answered HTML, not JSON: does base_url end in /v1?"
            ),
        "{}",
        ran.stderr
    );
}

/// `report --by` a field no item has is an error naming the fields there
/// are, not a table of one group `(none)`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_by_a_field_no_item_has_names_the_fields_there_are() {
    let env = Env::new();
    let server = mock(MockSettings::default()).await;
    let dataset = env.dataset("items.jsonl", 3);
    env.write(
        "run.yaml",
        &config(&dataset, &external("only", &server, 2), ""),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let report = env
        .evalfleet(&["report", &ran.run_id(), "--by", "catgeory"])
        .await;
    assert_eq!(report.code, Some(2), "{}", report.stderr);
    assert!(
        report.stderr.contains(
            "--by catgeory: no item has the field 'catgeory' (the items have: id, question"
        ),
        "{}",
        report.stderr
    );
}
