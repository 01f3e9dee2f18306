//! Code tasks end to end: model answers judged as programs in the sandbox,
//! as a stage of the run.

use std::io::Read;

use evalfleet_mock::MockSettings;
use serde_json::{Value, json};

use crate::util::{Env, external, mock, shared_data};

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
    let server = mock(MockSettings {
        answers: Some(right),
        ..MockSettings::default()
    })
    .await;
    env.write("run.yaml", &config(&dataset, &external("m", &server, 8)));
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let report = env
        .evalfleet(&["report", &ran.run_id(), "--json", "--out", "r"])
        .await;
    let summary: Value = serde_json::from_str(&report.stdout).unwrap();
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
    let server = mock(MockSettings {
        answers: Some(wrong),
        ..MockSettings::default()
    })
    .await;
    env.write("wrong.yaml", &config(&dataset, &external("m", &server, 8)));
    let ran = env.evalfleet(&["run", "wrong.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let report = env
        .evalfleet(&["report", &ran.run_id(), "--json", "--out", "w"])
        .await;
    let summary: Value = serde_json::from_str(&report.stdout).unwrap();
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
