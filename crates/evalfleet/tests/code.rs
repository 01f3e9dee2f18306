//! Code tasks end to end: model answers judged as programs in the sandbox,
//! as a stage of the run.

use std::io::Read;

use evalfleet_mock::MockServer;
use serde_json::{Value, json};

use crate::util::{Env, external, scripted, shared_data};

/// HumanEval's problems, or `None` (saying so) when the file is absent.
fn humaneval() -> Option<Vec<Value>> {
    let file = std::fs::File::open(shared_data("humaneval.jsonl.gz")?).unwrap();
    let mut text = String::new();
    flate2::read::GzDecoder::new(file)
        .read_to_string(&mut text)
        .unwrap();
    Some(
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect(),
    )
}

fn config(dataset: &std::path::Path, endpoints: &str) -> String {
    format!(
        "name: humaneval\n\
         dataset: {{ path: {}, id_field: task_id }}\n\
         endpoints:\n{endpoints}\n\
         task:\n\
         \x20 messages: [ {{ role: user, content: \"{{{{ prompt }}}}\" }} ]\n\
         \x20 params: {{ max_tokens: 1024 }}\n\
         \x20 code: {{ format: humaneval, timeout: 10s, wall_timeout: 60s }}\n",
        dataset.display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn humaneval_answers_are_judged_in_the_run() {
    let Some(problems) = humaneval() else { return };
    let env = Env::new();
    let dataset = env.write(
        "humaneval.jsonl",
        &problems
            .iter()
            .map(|p| format!("{p}\n"))
            .collect::<String>(),
    );
    let script = |solution: &dyn Fn(&Value) -> String| -> String {
        problems
            .iter()
            .map(|p| {
                format!(
                    "{}\n",
                    json!({"prompt": p["prompt"], "replies": [solution(p)]})
                )
            })
            .collect()
    };
    let right = env.write(
        "right.jsonl",
        &script(&|p| {
            format!(
                "Here it is:\n```python\n{}\n```",
                p["canonical_solution"].as_str().unwrap()
            )
        }),
    );
    let server = scripted(right).await;
    env.write("run.yaml", &config(&dataset, &external("m", &server, 8)));
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let summary = report_of(&env, &ran.run_id()).await;
    let accepted = &summary["metrics"][0];
    assert_eq!(accepted["metric"], "code_accepted@1");
    assert_eq!(accepted["mean"], 1.0, "{accepted}");
    assert_eq!(summary["code_verdicts"]["all"]["success"], 164);
    let rows = env.export(&ran.run_id()).await;
    assert_eq!(rows[0]["judge"]["extraction"], "fenced_python");
    assert_eq!(rows[0]["judge"]["passed"], 1);

    // Wrong programs: none accepted, each with its verdict.
    let wrong = env.write(
        "wrong.jsonl",
        &script(&|_| "```python\n    return None\n```".to_owned()),
    );
    let server = scripted(wrong).await;
    env.write("wrong.yaml", &config(&dataset, &external("m", &server, 8)));
    let ran = env.evalfleet(&["run", "wrong.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let summary = report_of(&env, &ran.run_id()).await;
    assert_eq!(summary["metrics"][0]["mean"], 0.0);
    let verdicts = summary["code_verdicts"]["all"].as_object().unwrap();
    assert_eq!(
        verdicts.values().map(|v| v.as_u64().unwrap()).sum::<u64>(),
        164
    );
    assert!(
        verdicts
            .keys()
            .all(|k| k == "wrong_answer" || k == "runtime_error"),
        "{verdicts:?}"
    );
    let rows = env.export(&ran.run_id()).await;
    let failing = &rows[0]["judge"]["test_case_errors"][0];
    assert!(
        failing["message"].as_str().unwrap().contains("Error"),
        "{failing}"
    );
}

/// Stdin/stdout problems: "print a third of N". Half the answers round to
/// 4 places where the tests want 6: wrong by exact text, right within a
/// tolerance of 1e-3.
fn thirds(
    env: &Env,
    language: &str,
    right: &str,
    rounded: &str,
) -> (std::path::PathBuf, std::path::PathBuf) {
    let mut problems = String::new();
    let mut answers = String::new();
    for i in 0..6 {
        let tests: Vec<Value> = (1..=5)
            .map(|n| json!({"input": format!("{n}\n"), "output": format!("{:.6}\n", n as f64 / 3.0)}))
            .collect();
        let question = format!("Problem {i}: print a third of N.");
        problems.push_str(&format!(
            "{}\n",
            json!({"id": format!("p{i}"), "question": question, "tests": tests})
        ));
        let program = if i % 2 == 0 { right } else { rounded };
        answers.push_str(&format!(
            "{}\n",
            json!({"prompt": question, "replies": [format!("```{language}\n{program}\n```")]})
        ));
    }
    (
        env.write("problems.jsonl", &problems),
        env.write("answers.jsonl", &answers),
    )
}

fn stdio_config(dataset: &std::path::Path, endpoints: &str, code: &str) -> String {
    format!(
        "name: thirds\n\
         dataset: {{ path: {}, id_field: id }}\n\
         endpoints:\n{endpoints}\n\
         task:\n\
         \x20 messages: [ {{ role: user, content: \"{{{{ question }}}}\" }} ]\n\
         \x20 code: {{ format: stdio, {code} }}\n",
        dataset.display()
    )
}

/// The Python thirds (half of them rounded too far) and a mock that answers
/// with them.
async fn python_thirds(env: &Env) -> (std::path::PathBuf, MockServer) {
    let (dataset, answers) = thirds(
        env,
        "python",
        "print(f'{int(input()) / 3:.6f}')",
        "print(f'{int(input()) / 3:.4f}')",
    );
    (dataset, scripted(answers).await)
}

/// `report --json` of a run.
async fn report_of(env: &Env, run_id: &str) -> Value {
    let report = env
        .evalfleet(&["report", run_id, "--json", "--out", "report"])
        .await;
    serde_json::from_str(&report.stdout).unwrap()
}

async fn accepted_mean(env: &Env, run_id: &str) -> f64 {
    report_of(env, run_id).await["metrics"][0]["mean"]
        .as_f64()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn score_keeps_judgements_and_rejudges_when_asked_or_when_task_code_changes() {
    let env = Env::new();
    let (dataset, server) = python_thirds(&env).await;
    let endpoints = external("m", &server, 4);
    env.write(
        "run.yaml",
        &stdio_config(&dataset, &endpoints, "timeout: 10s"),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let run_id = ran.run_id();
    assert_eq!(accepted_mean(&env, &run_id).await, 0.5);
    // The results table carries each answer's verdict and tests passed.
    let page = evalfleet_store::Explore::items(
        &mut env.store(),
        &run_id,
        &evalfleet_store::ItemQuery {
            limit: 10,
            ..Default::default()
        },
    )
    .unwrap();
    let judged: Vec<(String, u64, u64)> = page
        .rows
        .iter()
        .map(|r| {
            let j = r.judged.as_ref().expect("every answer was judged");
            (j.verdict.clone(), j.passed, j.total)
        })
        .collect();
    let expected: Vec<(String, u64, u64)> = (0..6)
        .map(|i| match i % 2 {
            0 => ("success".to_owned(), 5, 5),
            _ => ("wrong_answer".to_owned(), 0, 5),
        })
        .collect();
    assert_eq!(judged, expected);

    // Scoring again keeps the judgements: no program runs.
    let scored = env.evalfleet(&["score", &run_id]).await;
    assert_eq!(scored.code, Some(0), "{}", scored.stderr);
    assert!(!scored.stderr.contains("Judged"), "{}", scored.stderr);
    assert_eq!(accepted_mean(&env, &run_id).await, 0.5);

    // A tolerance in task.code: the answers are judged again.
    env.write(
        "tolerant.yaml",
        &stdio_config(&dataset, &endpoints, "timeout: 10s, float_tolerance: 0.001"),
    );
    let scored = env
        .evalfleet(&["score", &run_id, "--config", "tolerant.yaml"])
        .await;
    assert_eq!(scored.code, Some(0), "{}", scored.stderr);
    assert!(
        scored.stderr.contains("Judged 6 programs again"),
        "{}",
        scored.stderr
    );
    assert_eq!(accepted_mean(&env, &run_id).await, 1.0);
    assert_eq!(server.stats().completed, 6, "no model was called again");

    // --rejudge runs them again with the stored (now tolerant) settings.
    let scored = env.evalfleet(&["score", &run_id, "--rejudge"]).await;
    assert!(
        scored.stderr.contains("Judged 6 programs again"),
        "{}",
        scored.stderr
    );
    let rows = env.export(&run_id).await;
    assert!(
        rows.iter().all(|r| r["judge"]["accepted"] == true),
        "{rows:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_from_the_cache_are_judged_again_without_a_call() {
    let env = Env::new();
    let (dataset, server) = python_thirds(&env).await;
    let config = stdio_config(&dataset, &external("m", &server, 4), "timeout: 10s")
        + "cache: { mode: read_write }\n";
    env.write("run.yaml", &config);
    let first = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(first.code, Some(0), "{}", first.stderr);
    assert_eq!(server.stats().completed, 6);
    let again = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(again.code, Some(0), "{}", again.stderr);
    assert_eq!(
        server.stats().completed,
        6,
        "every answer came from the cache"
    );
    assert_eq!(accepted_mean(&env, &again.run_id()).await, 0.5);
    let rows = crate::util::by_id(&env.export(&again.run_id()).await);
    assert_eq!(rows.len(), 6);
    for (id, row) in &rows {
        let even = id.trim_start_matches('p').parse::<u32>().unwrap() % 2 == 0;
        assert_eq!(row["judge"]["accepted"], even, "{id}: {row}");
        assert_eq!(row["judge"]["total"], 5);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpp_answers_are_compiled_and_judged_in_the_run() {
    let found = std::process::Command::new("g++").arg("--version").output();
    if !found.is_ok_and(|o| o.status.success()) {
        evalfleet_testkit::skip!("g++ is absent");
        return;
    }
    let env = Env::new();
    let (dataset, answers) = thirds(
        &env,
        "cpp",
        "#include <cstdio>\nint main() { int n; std::scanf(\"%d\", &n); std::printf(\"%.6f\\n\", n / 3.0); }",
        "int main() { return missing; }",
    );
    let server = scripted(answers).await;
    env.write(
        "run.yaml",
        &stdio_config(&dataset, &external("m", &server, 4), "language: cpp"),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let summary = report_of(&env, &ran.run_id()).await;
    assert_eq!(summary["metrics"][0]["mean"], 0.5);
    assert_eq!(summary["code_verdicts"]["all"]["success"], 3);
    assert_eq!(summary["code_verdicts"]["all"]["compile_error"], 3);
    let rows = crate::util::by_id(&env.export(&ran.run_id()).await);
    assert_eq!(rows["p0"]["judge"]["extraction"], "fenced_cpp");
    assert_eq!(rows["p0"]["judge"]["compile"]["ok"], true);
    let message = rows["p1"]["judge"]["test_case_errors"][0]["message"]
        .as_str()
        .unwrap();
    assert!(message.contains("missing"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_starts_the_judge_and_run_refuses_a_missing_compiler() {
    let env = Env::new();
    let (dataset, _) = thirds(&env, "python", "print(1)", "print(1)");
    let endpoints = "  - { name: m, kind: mock }\n";
    env.write("ok.yaml", &stdio_config(&dataset, endpoints, "timeout: 5s"));
    let checked = env.evalfleet(&["check", "ok.yaml"]).await;
    assert_eq!(
        checked.code,
        Some(0),
        "{}{}",
        checked.stdout,
        checked.stderr
    );
    assert!(
        checked
            .stdout
            .contains("code judge   python programs run; sandbox:"),
        "{}",
        checked.stdout
    );

    env.write(
        "bad.yaml",
        &stdio_config(
            &dataset,
            endpoints,
            "language: cpp, compiler: /nonexistent/c++",
        ),
    );
    let checked = env.evalfleet(&["check", "bad.yaml"]).await;
    assert_eq!(checked.code, Some(1));
    assert!(
        checked
            .stdout
            .contains("code judge   NOT ready: a cpp program does not run")
            && checked.stdout.contains("/nonexistent/c++"),
        "{}",
        checked.stdout
    );
    // A run stops at its start, saying why, with the exit code of bad input.
    let ran = env.evalfleet(&["run", "bad.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(2), "{}", ran.stderr);
    assert!(ran.stderr.contains("/nonexistent/c++"), "{}", ran.stderr);
}

/// Answers the judge could not judge (its server down) leave the run
/// incomplete, saying so; `score --unjudged` judges those again, and only
/// those, and the run is complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn score_unjudged_judges_only_what_the_judge_could_not_judge() {
    use evalfleet_store::prelude::*;
    let env = Env::new();
    let (dataset, server) = python_thirds(&env).await;
    env.write(
        "run.yaml",
        &stdio_config(&dataset, &external("m", &server, 4), "timeout: 10s"),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let run_id = ran.run_id();
    // Two answers as a judge that could not be reached leaves them.
    let mut store = env.store();
    let mut assessments = Vec::new();
    let mut key = String::new();
    store
        .scan_results(&run_id, &mut |r| {
            let mut a = r.assessment.clone();
            if r.seq <= 2 {
                for (k, score) in a.scores.iter_mut() {
                    key.clone_from(k);
                    score.value = None;
                    score.error = Some("the code judge could not be reached".to_owned());
                }
                a.code = None;
                assessments.push((r.seq, a));
            }
        })
        .unwrap();
    let config = store.run(&run_id).unwrap().config;
    store
        .put_assessments(&run_id, &assessments, &config)
        .unwrap();
    drop(store);
    let status = env.evalfleet(&["status", &run_id]).await;
    assert!(
        status
            .stdout
            .contains("outcome      incomplete: 4 of 6 items scored (2 not scored)")
            && status.stdout.contains(&format!(
                "2 × not scored: {key}: the code judge could not be reached"
            )),
        "{}",
        status.stdout
    );
    let scored = env.evalfleet(&["score", &run_id, "--unjudged"]).await;
    assert_eq!(scored.code, Some(0), "{}", scored.stderr);
    assert!(
        scored.stderr.contains("Judged 2 programs again")
            && scored.stderr.contains("complete: 6 of 6 items scored"),
        "{}",
        scored.stderr
    );
    assert_eq!(accepted_mean(&env, &run_id).await, 0.5);
    assert_eq!(server.stats().completed, 6, "no model was called again");
}
