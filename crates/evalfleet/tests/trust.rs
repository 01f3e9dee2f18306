//! Results users can trust: answers parsed, checked, re-asked when
//! malformed, scored, reported and rescored without calling a model.

use std::collections::BTreeMap;
use std::path::Path;

use evalfleet_mock::MockSettings;
use serde_json::{Value, json};

use crate::util::{Env, cache_stats, external, mock, scripted, shared_data};

/// The first `n` GSM8K questions with their final answers, or `None` (and a
/// note saying so) when the dataset is absent (`../shared/data`, or
/// `$EVALFLEET_TEST_DATA`).
fn gsm8k(n: usize) -> Option<Vec<(Value, String)>> {
    let text = std::fs::read_to_string(shared_data("gsm8k-test.jsonl")?).unwrap();
    Some(
        text.lines()
            .take(n)
            .map(|line| {
                let row: Value = serde_json::from_str(line).unwrap();
                let answer = row["answer"].as_str().unwrap();
                let last = answer.rsplit("#### ").next().unwrap().trim().to_owned();
                (row, last)
            })
            .collect(),
    )
}

fn gsm8k_config(dataset: &Path, endpoints: &str, metrics: &str) -> String {
    format!(
        "name: gsm8k\n\
         dataset: {{ path: {} }}\n\
         endpoints:\n{endpoints}\n\
         task:\n\
         \x20 messages:\n\
         \x20   - {{ role: system, content: \"Solve it. End with #### and the number.\" }}\n\
         \x20   - {{ role: user, content: \"{{{{ question }}}}\" }}\n\
         \x20 params: {{ max_tokens: 512 }}\n\
         \x20 parse: {{ regex: \"#### (-?[\\\\d,.]+)\" }}\n\
         \x20 max_reasks: 2\n\
         \x20 metrics:\n{metrics}\n\
         cache: {{ mode: read_write }}\n",
        dataset.display()
    )
}

const ACCURACY: &str = "    - { name: numeric_match, as: accuracy, reference: \"{{ answer | split('#### ') | last }}\" }";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gsm8k_accuracy_is_the_known_fraction_and_malformed_answers_are_reasked() {
    let Some(items) = gsm8k(200) else { return };
    let env = Env::new();
    let dataset = env.path("gsm8k.jsonl");
    let mut script = String::new();
    let mut lines = String::new();
    // By position: 0 wrong, 1 malformed then right, 2 always malformed, 3
    // and 4 right. So 3/5 are right, 1/5 recovered by a re-ask and 1/5
    // unparsed after two re-asks.
    for (i, (row, answer)) in items.iter().enumerate() {
        lines.push_str(&format!("{row}\n"));
        let number: f64 = answer.replace(',', "").parse().unwrap();
        let right = format!("Let me think. The total is {answer}.\n#### {answer}");
        let replies = match i % 5 {
            0 => vec![format!("It is {}.\n#### {}", number + 1.0, number + 1.0)],
            1 => vec![format!("I believe it is about {answer}."), right],
            2 => vec!["I cannot tell.".to_owned()],
            _ => vec![right],
        };
        script.push_str(&format!(
            "{}\n",
            json!({"prompt": row["question"], "replies": replies})
        ));
    }
    std::fs::write(&dataset, lines).unwrap();
    let answers = env.write("answers.jsonl", &script);
    let server = scripted(answers).await;
    env.write(
        "run.yaml",
        &gsm8k_config(&dataset, &external("m", &server, 16), ACCURACY),
    );

    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    // Some answers are not scored: the run is incomplete, and says so.
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    assert!(
        ran.stderr.contains("finished, incomplete: "),
        "{}",
        ran.stderr
    );
    let run_id = ran.run_id();
    let n = items.len() as u64;
    let fifth = n / 5;
    // One call each, one re-ask for the recovered, two for the hopeless.
    assert_eq!(server.stats().completed, n + fifth + 2 * fifth);
    // The run's summary counts re-asks and unparsed answers apart from
    // transport retries (there were none).
    let counted = format!("0 retries, {} re-asks, {fifth} unparsed", 3 * fifth);
    assert!(ran.stderr.contains(&counted), "{counted}: {}", ran.stderr);
    // A fifth unparsed is a model's trouble, not a parse rule's: no warning.
    assert!(!ran.stderr.contains("could not be used"), "{}", ran.stderr);

    let report = env
        .evalfleet(&[
            "report",
            &run_id,
            "--json",
            "--out",
            "report",
            "--html",
            "report.html",
        ])
        .await;
    assert_eq!(report.code, Some(0), "{}", report.stderr);
    let summary: Value = serde_json::from_str(&report.stdout).unwrap();
    // The page carries the same report and needs nothing from elsewhere.
    let page = std::fs::read_to_string(env.path("report.html")).unwrap();
    let data = page
        .split("<script type=\"application/json\" id=\"data\">")
        .nth(1)
        .and_then(|rest| rest.split("</script>").next())
        .unwrap();
    let embedded: Value = serde_json::from_str(&data.replace("<\\/", "</")).unwrap();
    assert_eq!(embedded["metrics"], summary["metrics"]);
    // (The SVG namespace is a name, not a place.)
    for outside in ["src=\"", "href=\"", "https://", "@import", "url("] {
        assert!(!page.contains(outside), "the page refers to {outside}...");
    }
    let overall = &summary["metrics"][0];
    assert_eq!(overall["metric"], "accuracy");
    assert_eq!(overall["group"], "all");
    assert_eq!(overall["n"], n);
    assert!(
        (overall["mean"].as_f64().unwrap() - 0.6).abs() < 1e-12,
        "{overall}"
    );
    assert_eq!(overall["unparsed"], fifth);
    assert_eq!(overall["scored"], n - fifth);
    let ci = (
        overall["ci_low"].as_f64().unwrap(),
        overall["ci_high"].as_f64().unwrap(),
    );
    assert!(
        ci.0 < 0.6 && 0.6 < ci.1,
        "the interval holds the mean: {ci:?}"
    );
    let fidelity = &summary["fidelity"];
    assert_eq!(fidelity["valid_first_try"], 3 * fifth);
    assert_eq!(fidelity["valid_after_reasks"], fifth);
    assert_eq!(fidelity["unparsed"], fifth);
    for file in [
        "metrics_summary.csv",
        "metrics_detailed.csv",
        "summary.json",
    ] {
        assert!(env.path("report").join(file).is_file(), "{file} is written");
    }
    let detailed = std::fs::read_to_string(env.path("report/metrics_detailed.csv")).unwrap();
    assert_eq!(detailed.lines().count() as u64, n + 1);

    // The export row carries what was parsed, whether it was valid and the
    // scores; the unparsed keep their reason.
    let rows = env.export(&run_id).await;
    let recovered = &rows[1];
    assert_eq!(recovered["valid"], true);
    assert_eq!(recovered["scores"]["accuracy"]["value"], 1.0);
    assert_eq!(recovered["attempts"], 2);
    let hopeless = &rows[2];
    assert_eq!(hopeless["valid"], false);
    assert_eq!(hopeless["parsed"], Value::Null);
    assert_eq!(hopeless["status"], "done");
    let status = env.evalfleet(&["status", &run_id, "--json"]).await;
    let status: Value = serde_json::from_str(&status.stdout).unwrap();
    assert_eq!(
        status["endpoints"][0]["errors"]["invalid_answer"],
        3 * fifth
    );

    // The same run again is answered entirely from the cache, re-asks
    // included, with the same figures.
    let calls = server.stats().requests;
    let again = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(
        again.code,
        Some(1),
        "incomplete as before: {}",
        again.stderr
    );
    assert_eq!(
        server.stats().requests,
        calls,
        "no call reached the endpoint"
    );
    let report = env
        .evalfleet(&["report", &again.run_id(), "--json", "--out", "report2"])
        .await;
    let cached: Value = serde_json::from_str(&report.stdout).unwrap();
    assert_eq!(cached["metrics"][0]["mean"], summary["metrics"][0]["mean"]);
    assert_eq!(cached["fidelity"], summary["fidelity"]);
    let stats = cache_stats(&env, &env.store_path()).await;
    assert_eq!(
        stats["entries"],
        n + fifth + 2 * fifth,
        "one entry per distinct request"
    );
    assert_eq!(stats["hits"], n + fifth + 2 * fifth);

    // A metric added after the run: rescoring changes the report and calls
    // no model.
    let calls = server.stats().requests;
    let more = format!(
        "{ACCURACY}\n    - {{ name: exact_match, reference: \"{{{{ answer | split('#### ') | last }}}}\" }}"
    );
    env.write(
        "more.yaml",
        &gsm8k_config(&dataset, &external("m", &server, 16), &more),
    );
    let scored = env
        .evalfleet(&["score", &run_id, "--config", "more.yaml"])
        .await;
    // Still 40 unparsed answers: the run stays incomplete, and `score` says so.
    assert_eq!(scored.code, Some(1), "{}", scored.stderr);
    assert!(
        scored
            .stderr
            .contains("incomplete: 160 of 200 items scored (40 unusable)"),
        "{}",
        scored.stderr
    );
    let report = env
        .evalfleet(&["report", &run_id, "--json", "--out", "report"])
        .await;
    let summary: Value = serde_json::from_str(&report.stdout).unwrap();
    let keys: Vec<&str> = summary["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["metric"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["accuracy", "exact_match@1"]);
    // Answers with a comma ("1,200") are numerically right but not exactly
    // equal to the reference ("1200"), so exact match is at most accuracy.
    let em = summary["metrics"][1]["mean"].as_f64().unwrap();
    assert!(em <= 0.6 && em > 0.3, "{em}");
    assert_eq!(server.stats().requests, calls, "rescoring calls no model");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_answers_are_checked_against_the_schema_and_reasked() {
    let env = Env::new();
    let dataset = env.write(
        "people.jsonl",
        &(0..6)
            .map(|i| format!("{}\n", json!({"id": format!("p{i}"), "question": format!("Person {i}?"), "age": 20 + i})))
            .collect::<String>(),
    );
    // Even items answer valid JSON at once; odd ones first give an age as
    // a string (the schema refuses it), then fix it.
    let script: String = (0..6)
        .map(|i| {
            let good = format!("```json\n{{\"name\": \"P{i}\", \"age\": {}}}\n```", 20 + i);
            let replies = if i % 2 == 0 {
                vec![good]
            } else {
                vec![format!("{{\"name\": \"P{i}\", \"age\": \"old\"}}"), good]
            };
            format!(
                "{}\n",
                json!({"prompt": format!("Person {i}?"), "replies": replies})
            )
        })
        .collect();
    let answers = env.write("answers.jsonl", &script);
    let server = scripted(answers).await;
    let text = crate::util::config(
        &dataset,
        &external("m", &server, 4),
        "  schema: { type: object, required: [name, age], properties: { age: { type: integer } } }\n\
         \x20 metrics:\n\
         \x20   - { name: json_field_match, reference: '{\"age\": {{ age }}}' }",
    );
    env.write("run.yaml", &text);
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let rows = crate::util::by_id(&env.export(&ran.run_id()).await);
    for i in 0..6 {
        let row = &rows[&format!("p{i}")];
        assert_eq!(row["valid"], true, "{row}");
        assert_eq!(row["parsed"]["age"], 20 + i);
        assert_eq!(row["scores"]["json_field_match@1"]["value"], 1.0);
        assert_eq!(row["attempts"], if i % 2 == 0 { 1 } else { 2 });
    }
    assert_eq!(server.stats().completed, 9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_file_of_its_own_serves_runs_of_another_store() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 30);
    let server = mock(MockSettings::default()).await;
    let cache = env.path("shared-cache.db");
    let text = crate::util::config(
        &dataset,
        &external("m", &server, 4),
        &format!("cache: {{ path: \"{}\" }}", cache.display()),
    );
    env.write("run.yaml", &text);
    let first = env
        .evalfleet(&["run", "run.yaml", "-q", "--store", "a.db"])
        .await;
    assert_eq!(first.code, Some(0), "{}", first.stderr);
    assert_eq!(server.stats().completed, 30);
    let second = env
        .evalfleet(&["run", "run.yaml", "-q", "--store", "b.db"])
        .await;
    assert_eq!(second.code, Some(0), "{}", second.stderr);
    assert_eq!(
        server.stats().requests,
        30,
        "the second store's run made no call"
    );
    let stats = cache_stats(&env, &cache).await;
    assert_eq!(stats["entries"], 30);
    let a = cache_stats(&env, std::path::Path::new("a.db")).await;
    assert_eq!(a["entries"], 0, "the run's own store holds no cache entry");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_llm_judge_scores_answers_through_its_own_endpoint_and_cache() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 6);
    let rows: Vec<Value> = std::fs::read_to_string(&dataset)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // The answering mock echoes the question; the judge gives item k the
    // score 2k out of 10, and the last item a reply with no score (an error
    // of that item's score, counted as such).
    let script: String = rows
        .iter()
        .enumerate()
        .map(|(k, row)| {
            let q = row["question"].as_str().unwrap();
            let prompt = format!("Question: {q}\nAnswer: {q}\nRate it.");
            let reply = if k == 5 {
                "No idea.".to_owned()
            } else {
                format!("Reasonable.\nScore: {}", 2 * k)
            };
            format!("{}\n", json!({"prompt": prompt, "replies": [reply]}))
        })
        .collect();
    let answers = env.write("judge.jsonl", &script);
    let answering = mock(MockSettings::default()).await;
    let judging = scripted(answers).await;
    let endpoints = external("m", &answering, 4)
        + &format!(
            "  - {{ name: judge, kind: external, role: judge, base_url: \"{}\", model: m, concurrency: 2 }}\n",
            judging.base_url()
        );
    let text = crate::util::config(
        &dataset,
        &endpoints,
        "  metrics:\n\
         \x20   - { name: llm_judge, as: quality, endpoint: judge, rubric: \"Question: {{ question }}\\nAnswer: {{ answer }}\\nRate it.\" }\n\
         cache: { mode: read_write }",
    );
    env.write("run.yaml", &text);
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    // Some answers are not scored: the run is incomplete, and says so.
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    assert!(
        ran.stderr.contains("finished, incomplete: "),
        "{}",
        ran.stderr
    );
    assert_eq!(answering.stats().completed, 6, "the judge takes no items");
    assert_eq!(judging.stats().completed, 6, "one judge call per item");
    let rows = crate::util::by_id(&env.export(&ran.run_id()).await);
    let quality = |row: &Value| row["scores"]["quality"].clone();
    for (k, row) in rows.values().enumerate() {
        if k < 5 {
            assert_eq!(
                quality(row)["value"].as_f64().unwrap(),
                2.0 * k as f64 / 10.0,
                "{row}"
            );
            assert_eq!(row["attempts"], 2, "the answer and its judge call");
        } else {
            assert!(
                quality(row)["error"].as_str().unwrap().contains("no score"),
                "{row}"
            );
        }
    }
    let report = env
        .evalfleet(&["report", &ran.run_id(), "--json", "--out", "r1"])
        .await;
    let summary: Value = serde_json::from_str(&report.stdout).unwrap();
    let q = &summary["metrics"][0];
    assert_eq!(
        (q["n"].as_u64(), q["scored"].as_u64(), q["errors"].as_u64()),
        (Some(6), Some(5), Some(1))
    );
    // The reply with no score is no score of 0: it is in no mean, and the
    // report says why.
    assert!(
        (q["mean"].as_f64().unwrap() - 2.0 / 5.0).abs() < 1e-12,
        "{q}"
    );
    assert_eq!(q["status"], "partly scored");
    assert_eq!(q["reasons"][0]["count"], 1);
    assert!(
        q["reasons"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("no score"),
        "{q}"
    );
    assert_eq!(summary["problems"], json!([]));

    // Again: the answers and the judge's replies come from the cache.
    let again = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(
        again.code,
        Some(1),
        "incomplete as before: {}",
        again.stderr
    );
    assert_eq!(
        (answering.stats().requests, judging.stats().requests),
        (6, 6)
    );
    let cached = crate::util::by_id(&env.export(&again.run_id()).await);
    for (id, row) in &rows {
        assert_eq!(quality(&cached[id]), quality(row));
    }
    // Rescoring reads the judge's replies from the cache too.
    let scored = env.evalfleet(&["score", &ran.run_id()]).await;
    // The judge's reply that has no score still has none.
    assert_eq!(scored.code, Some(1), "{}", scored.stderr);
    assert!(
        scored
            .stderr
            .contains("1 × not scored: quality: the judge's reply has no score"),
        "{}",
        scored.stderr
    );
    let rescored = crate::util::by_id(&env.export(&ran.run_id()).await);
    for (id, row) in &rows {
        assert_eq!(quality(&rescored[id]), quality(row));
    }
    assert_eq!(judging.stats().requests, 6);
}

/// A run of `dataset` answered by `answering`, whose `quality` metric is
/// asked of the judge endpoint `judging` (with `judge_keys` added to it),
/// its calls tried twice (`retry_keys` added to `retry`). A judge that
/// echoes its prompt (the default mock) scores every answer 7.
fn judged(
    dataset: &std::path::Path,
    answering: &evalfleet_mock::MockServer,
    judging: &evalfleet_mock::MockServer,
    judge_keys: &str,
    retry_keys: &str,
) -> String {
    let endpoints = external("m", answering, 4)
        + &format!(
            "  - {{ name: judge, kind: external, role: judge, base_url: \"{}\", model: m{judge_keys} }}\n",
            judging.base_url()
        );
    crate::util::config(
        dataset,
        &endpoints,
        &format!(
            "  metrics:\n\
             \x20   - {{ name: llm_judge, as: quality, endpoint: judge, rubric: \"Rate {{{{ answer }}}}. Score: 7\" }}\n\
             retry: {{ max_attempts: 2, backoff_base: 10ms, backoff_max: 20ms{retry_keys} }}"
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn judge_calls_to_an_endpoint_that_is_not_running_fail_and_the_run_ends() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 4);
    let answering = mock(MockSettings::default()).await;
    let judging = mock(MockSettings::default()).await;
    env.write("run.yaml", &judged(&dataset, &answering, &judging, "", ""));
    // The judge is configured but left out of the run: its calls wait for
    // it a few tries, then fail; the items are done and the run ends, and
    // says the judge's metric could score nothing (exit 1).
    let ran = tokio::time::timeout(
        std::time::Duration::from_secs(120),
        env.evalfleet(&["run", "run.yaml", "-q", "--endpoints", "m"]),
    )
    .await
    .expect("the run ends although its judge never runs");
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    assert!(
        ran.stderr.contains(
            "error: metric quality could not score any of the 4 answers it was given: 4 × the judge failed"
        ),
        "{}",
        ran.stderr
    );
    assert_eq!(judging.stats().requests, 0);
    // The report shows it as not scored, and exits 1 too.
    let report = env.evalfleet(&["report", &ran.run_id()]).await;
    assert_eq!(report.code, Some(1), "{}", report.stderr);
    assert!(
        report
            .stdout
            .contains("quality not scored: 4 of 4 items could not be scored"),
        "{}",
        report.stdout
    );
    for error in quality_errors(&env, &ran.run_id()).await {
        assert!(
            error.contains("the judge failed")
                && error.contains("endpoint judge is not taking calls"),
            "{error}"
        );
    }
}

/// A judge whose server restarts (it answers 503 to every call and to its
/// health probe for a while) is waited for, however few `max_attempts`
/// say: every answer is judged once it is back. One down for longer than
/// `retry.judge_for` leaves its answers not scored, the run incomplete
/// with the judge's answer as the cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn judge_calls_ride_out_a_judge_down_for_a_while_and_no_longer_than_judge_for() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 4);
    let answering = mock(MockSettings::default()).await;
    let down_for = |duration| {
        mock(MockSettings {
            outage: Some(evalfleet_mock::Outage {
                after: std::time::Duration::ZERO,
                duration,
                status: 503,
            }),
            ..MockSettings::default()
        })
    };
    let judging = down_for(std::time::Duration::from_secs(2)).await;
    let keys = ", health: { interval: 200ms }";
    env.write(
        "run.yaml",
        &judged(&dataset, &answering, &judging, keys, ", judge_for: 30s"),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert!(
        judging.stats().outage_refused > 0,
        "the outage was never met"
    );
    assert!(
        quality_errors(&env, &ran.run_id())
            .await
            .iter()
            .all(String::is_empty),
        "every answer judged"
    );

    // Down for longer than the calls are tried for.
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 4);
    let judging = down_for(std::time::Duration::from_secs(5)).await;
    env.write(
        "run.yaml",
        &judged(&dataset, &answering, &judging, keys, ", judge_for: 1s"),
    );
    let ran = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        env.evalfleet(&["run", "run.yaml", "-q"]),
    )
    .await
    .expect("the run ends once judge_for has passed");
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    assert!(
        ran.stderr.contains("finished, incomplete: ")
            && ran
                .stderr
                .contains("× not scored: quality: the judge failed")
            && ran.stderr.contains("score test-")
            && ran.stderr.contains("--unjudged"),
        "{}",
        ran.stderr
    );
    for error in quality_errors(&env, &ran.run_id()).await {
        assert!(error.contains("the judge failed"), "{error}");
    }
    // Once it is back, `score --unjudged` asks it again for those answers.
    let health = format!("http://{}/health", judging.addr());
    let client = crate::serve::client();
    let mut back = false;
    for _ in 0..600 {
        if client
            .get(&health)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            back = true;
            break;
        }
        tokio::task::yield_now().await;
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(back, "the judge never came back");
    let asked = judging.stats().completed;
    let scored = env.evalfleet(&["score", &ran.run_id(), "--unjudged"]).await;
    assert_eq!(scored.code, Some(0), "{}", scored.stderr);
    assert!(
        scored
            .stderr
            .contains("Asked the LLM judges again for 4 answers they could not judge in the run.")
            && scored.stderr.contains("complete: 4 of 4 items scored"),
        "{}",
        scored.stderr
    );
    assert_eq!(judging.stats().completed, asked + 4);
    assert!(
        quality_errors(&env, &ran.run_id())
            .await
            .iter()
            .all(String::is_empty),
        "every answer judged"
    );
    // Nothing is left to ask: a second time calls no judge.
    let again = env.evalfleet(&["score", &ran.run_id(), "--unjudged"]).await;
    assert_eq!(again.code, Some(0), "{}", again.stderr);
    assert_eq!(judging.stats().completed, asked + 4);
}

/// Each of the run's 4 items, done, with why its `quality` could not be
/// scored (empty when it was).
async fn quality_errors(env: &Env, run_id: &str) -> Vec<String> {
    let rows = crate::util::by_id(&env.export(run_id).await);
    assert_eq!(rows.len(), 4);
    rows.values()
        .map(|row| {
            assert_eq!(row["status"], "done", "{row}");
            row["scores"]["quality"]["error"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn items_a_metric_cannot_score_are_in_no_mean_and_past_the_limit_fail_the_run() {
    let env = Env::new();
    // The first rows are fine (they are checked before the run); two later
    // ones have references with no number.
    let mut rows = String::new();
    for i in 0..10 {
        rows.push_str(&format!(
            "{}\n",
            json!({"id": format!("q{i:02}"), "question": format!("{i}"), "answer": format!("{i}")})
        ));
    }
    for (i, answer) in [(10, "n/a"), (11, "unknown")] {
        rows.push_str(&format!(
            "{}\n",
            json!({"id": format!("q{i:02}"), "question": format!("{i}"), "answer": answer})
        ));
    }
    let dataset = env.write("items.jsonl", &rows);
    let server = mock(MockSettings::default()).await;
    let text = crate::util::config(
        &dataset,
        &external("m", &server, 4),
        "  metrics:\n\
         \x20   - { name: numeric_match, as: accuracy, reference: \"{{ answer }}\" }\n\
         report: { max_unscored: 0.1 }",
    );
    env.write("run.yaml", &text);
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    assert!(
        ran.stderr.contains(
            "accuracy: 1.0000 over 10 items; 2 not scored: 2 × the reference 'n/a' has no number"
        ),
        "{}",
        ran.stderr
    );
    assert!(
        ran.stderr.contains(
            "error: metric accuracy could not score 2 of the 12 answers it was given (16.7%, at or above report.max_unscored: 10.0%)"
        ),
        "{}",
        ran.stderr
    );
    let run_id = ran.run_id();
    let report = env.evalfleet(&["report", &run_id, "--json"]).await;
    assert_eq!(report.code, Some(1), "{}", report.stderr);
    let summary: Value = serde_json::from_str(&report.stdout).unwrap();
    let m = &summary["metrics"][0];
    assert_eq!(
        (
            m["n"].as_u64(),
            m["scored"].as_u64(),
            m["errors"].as_u64(),
            m["status"].as_str()
        ),
        (Some(12), Some(10), Some(2), Some("partly scored"))
    );
    // In no mean: the ten it could score, all right.
    assert_eq!(m["mean"].as_f64(), Some(1.0));
    assert_eq!(
        m["reasons"],
        json!([{"reason": "the reference 'n/a' has no number", "count": 2}])
    );
    assert_eq!(summary["max_unscored"], 0.1);
    assert_eq!(summary["problems"].as_array().map(Vec::len), Some(1));
    let written: Value = serde_json::from_str(
        &std::fs::read_to_string(env.path("runs/reports").join(&run_id).join("summary.json"))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(written["problems"], summary["problems"]);
    // A looser limit on the command line.
    let loose = env
        .evalfleet(&["report", &run_id, "--max-unscored", "0.5"])
        .await;
    assert_eq!(loose.code, Some(0), "{}", loose.stderr);
    assert!(
        loose
            .stdout
            .contains("accuracy partly scored: 2 of 12 items could not be scored"),
        "{}",
        loose.stdout
    );
}

/// The sample of real multi-reference questions `tools/multiref_vectors.py`
/// made, and what the official tools computed for its predictions.
fn multi_reference_sample() -> (Vec<Value>, Value) {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    let read =
        |name: &str| std::fs::read_to_string(data.join(name)).expect("the test data is there");
    let sample = read("squad2-dev-sample.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let expected = serde_json::from_str(&read("squad2-dev-sample.expected.json")).unwrap();
    (sample, expected)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_reference_answers_score_as_the_official_tools_do_from_dataset_to_report() {
    let env = Env::new();
    let (sample, expected) = multi_reference_sample();
    // Each question with every answer its annotators gave (a list field);
    // the mock answers it with a strong reader's published prediction.
    let mut rows = String::new();
    let mut script = String::new();
    for q in &sample {
        rows.push_str(&format!(
            "{}\n",
            json!({"id": q["id"], "title": q["title"], "question": q["question"], "answers": q["answers"]})
        ));
        let prompt = format!(
            "{}: {}",
            q["id"].as_str().unwrap(),
            q["question"].as_str().unwrap()
        );
        script.push_str(&format!(
            "{}\n",
            json!({"prompt": prompt, "replies": [q["prediction"]]})
        ));
    }
    let dataset = env.write("squad.jsonl", &rows);
    let reader = scripted(env.write("predictions.jsonl", &script)).await;
    // The list as a value (`{{ answers }}`) and as JSON text (`tojson`).
    let text = crate::util::config(
        &dataset,
        &external("reader", &reader, 16),
        "  metrics:\n\
         \x20   - { name: exact_match, as: em, normalize: squad, reference: \"{{ answers }}\" }\n\
         \x20   - { name: f1, as: f1, reference: \"{{ answers | tojson }}\" }\n\
         \x20   - { name: anls, as: anls, reference: \"{{ answers }}\" }",
    )
    .replace("{{ question }}", "{{ id }}: {{ question }}");
    env.write("run.yaml", &text);
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let run_id = ran.run_id();

    let report = env.evalfleet(&["report", &run_id, "--json"]).await;
    assert_eq!(report.code, Some(0), "{}", report.stderr);
    let summary: Value = serde_json::from_str(&report.stdout).unwrap();
    let questions = expected["questions"].as_u64().unwrap();
    let mean = |key: &str| {
        let m = summary["metrics"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["metric"] == key && m["group"] == "all")
            .unwrap();
        assert_eq!(
            (m["n"].as_u64(), m["scored"].as_u64()),
            (Some(questions), Some(questions)),
            "{m}"
        );
        m["mean"].as_f64().unwrap()
    };
    let official = &expected["official_v1_1"];
    for (key, want) in [
        ("em", official["exact_match"].as_f64().unwrap() / 100.0),
        ("f1", official["f1"].as_f64().unwrap() / 100.0),
        ("anls", expected["anls"].as_f64().unwrap()),
    ] {
        let got = mean(key);
        assert!((got - want).abs() < 1e-9, "{key}: {got} against {want}");
    }
    // And question by question.
    let items = &expected["items"];
    for row in env.export(&run_id).await {
        let want = &items[row["item_id"].as_str().unwrap()];
        for (key, theirs) in [("em", "exact_match"), ("f1", "f1"), ("anls", "anls")] {
            let got = row["scores"][key]["value"].as_f64().unwrap();
            assert!(
                (got - want[theirs].as_f64().unwrap()).abs() < 1e-9,
                "{key} of {}: {got} against {}",
                row["item_id"],
                want[theirs]
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn samples_per_row_give_pass_at_k_and_a_majority_vote() {
    let env = Env::new();
    // Row r: its 4 samples are right c = r mod 5 times (first), then wrong.
    let mut rows = String::new();
    let mut script = String::new();
    for r in 0..6 {
        rows.push_str(&format!(
            "{}\n",
            json!({"id": format!("q{r}"), "question": format!("Q{r}?"), "answer": format!("A{r}")})
        ));
        let c = r % 5;
        let samples: Vec<String> = (0..4)
            .map(|k| {
                if k < c {
                    format!("A{r}")
                } else {
                    "W".to_owned()
                }
            })
            .collect();
        script.push_str(&format!(
            "{}\n",
            json!({"prompt": format!("Q{r}?"), "samples": samples})
        ));
    }
    let dataset = env.write("rows.jsonl", &rows);
    let answers = env.write("samples.jsonl", &script);
    let server = scripted(answers).await;
    // One call at a time, so sample k of a row gets the mock's k-th reply.
    let text = crate::util::config(
        &dataset,
        &external("m", &server, 1),
        "  n: 4\n\
         \x20 metrics: [ { name: exact_match, reference: \"{{ answer }}\" } ]\n\
         cache: { mode: read_write }",
    );
    env.write("run.yaml", &text);
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert_eq!(server.stats().completed, 24, "4 distinct requests per row");
    let exported = crate::util::by_id(&env.export(&ran.run_id()).await);
    assert_eq!(exported.len(), 24);
    assert_eq!(exported["q2#1"]["output"], "A2");
    assert_eq!(exported["q2#2"]["output"], "W");

    let report = env
        .evalfleet(&["report", &ran.run_id(), "--json", "--out", "r"])
        .await;
    assert_eq!(report.code, Some(0), "{}", report.stderr);
    let summary: Value = serde_json::from_str(&report.stdout).unwrap();
    let samples = &summary["samples"];
    assert_eq!(
        (samples["n"].as_u64(), samples["rows"].as_u64()),
        (Some(4), Some(6))
    );
    let em = &samples["metrics"][0];
    let pass1 = em["pass_at"]["1"].as_f64().unwrap();
    let pass4 = em["pass_at"]["4"].as_f64().unwrap();
    assert!((pass1 - 10.0 / 24.0).abs() < 1e-12, "{em}");
    assert!((pass4 - 4.0 / 6.0).abs() < 1e-12, "{em}");
    // Majorities: W, W, tie A/W (A came first), A, A, W.
    assert!(
        (em["majority"].as_f64().unwrap() - 0.5).abs() < 1e-12,
        "{em}"
    );
    // Each sample is its own cache entry: a second run makes no call and
    // gets every sample's own answer back.
    let again = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(again.code, Some(0), "{}", again.stderr);
    assert_eq!(server.stats().requests, 24);
    let cached = crate::util::by_id(&env.export(&again.run_id()).await);
    for (id, row) in &exported {
        assert_eq!(cached[id]["output"], row["output"], "{id}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_pairs_runs_on_the_items_they_share_by_category() {
    let env = Env::new();
    let mut rows = String::new();
    let mut script = String::new();
    for i in 0..20 {
        let question = format!("question {i}");
        let kind = if i < 10 { "easy" } else { "hard" };
        rows.push_str(&format!(
            "{}\n",
            json!({"id": format!("q{i:02}"), "question": question, "kind": kind})
        ));
        // The second model gets every odd hard item wrong.
        let reply = if i >= 10 && i % 2 == 1 {
            "wrong".to_owned()
        } else {
            question.clone()
        };
        script.push_str(&format!(
            "{}\n",
            json!({"prompt": question, "replies": [reply]})
        ));
    }
    let dataset = env.write("items.jsonl", &rows);
    let metrics = "  metrics:\n    - { name: exact_match, reference: \"{{ question }}\" }";
    let first = mock(MockSettings::default()).await;
    env.write(
        "a.yaml",
        &crate::util::config(&dataset, &external("m", &first, 4), metrics),
    );
    let second = scripted(env.write("answers.jsonl", &script)).await;
    env.write(
        "b.yaml",
        &crate::util::config(&dataset, &external("m", &second, 4), metrics),
    );
    for (config, id) in [("a.yaml", "a"), ("b.yaml", "b")] {
        let ran = env.evalfleet(&["run", config, "-q", "--run-id", id]).await;
        assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    }
    let compared = env
        .evalfleet(&["compare", "a", "b", "--by", "kind", "--json"])
        .await;
    assert_eq!(compared.code, Some(0), "{}", compared.stderr);
    let rows: Vec<Value> = serde_json::from_str(&compared.stdout).unwrap();
    let by_group: BTreeMap<&str, &Value> = rows
        .iter()
        .map(|r| (r["group"].as_str().unwrap(), r))
        .collect();
    assert_eq!(by_group.len(), 3, "all, easy, hard: {rows:?}");
    let all = by_group["all"];
    assert_eq!(
        (all["a"].as_str(), all["b"].as_str()),
        (Some("a"), Some("b"))
    );
    assert_eq!(all["n"], 20);
    assert_eq!(
        (all["mean_a"].as_f64(), all["mean_b"].as_f64()),
        (Some(1.0), Some(0.75))
    );
    assert!((all["paired"]["diff"].as_f64().unwrap() + 0.25).abs() < 1e-12);
    assert_eq!(
        (
            all["paired"]["a_only"].as_u64(),
            all["paired"]["b_only"].as_u64()
        ),
        (Some(5), Some(0))
    );
    // McNemar's exact test for 5 discordant pairs all one way: 2 / 2^5.
    assert!((all["paired"]["p_mcnemar"].as_f64().unwrap() - 0.0625).abs() < 1e-12);
    assert_eq!(by_group["easy"]["mean_b"], 1.0);
    assert_eq!(by_group["hard"]["mean_b"], 0.5);
    // The table says the same.
    let table = env.evalfleet(&["compare", "a", "b"]).await;
    assert_eq!(table.code, Some(0), "{}", table.stderr);
    assert!(table.stdout.contains("-0.2500"), "{}", table.stdout);
    // A run that shares no metric cannot be compared.
    let alone = env.evalfleet(&["compare", "a"]).await;
    assert_eq!(alone.code, Some(2), "{}", alone.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn judge_calls_wait_for_an_endpoint_still_starting_without_spending_their_tries() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 4);
    let answering = mock(MockSettings::default()).await;
    let judging = mock(MockSettings::default()).await;
    // The judge's start takes 4 s: longer than its calls' two tries of a
    // down endpoint (a second each) would wait.
    let judge = judged(
        &dataset,
        &answering,
        &judging,
        ", start_cmd: \"sleep 4\"",
        "",
    );
    env.write("run.yaml", &judge);
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    // Every item was judged: the judge (an echo) was asked each time, and
    // no call gave up on it (its echo holds no score: the metric says so).
    assert_eq!(judging.stats().requests, 4, "{}", ran.stderr);
    for error in quality_errors(&env, &ran.run_id()).await {
        assert!(!error.contains("not taking calls"), "{error}");
    }
}
