//! Task kinds other than chat, end to end: each call of an item is an
//! attempt of its own, cached, and a run killed between two calls resumes
//! where it stopped.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Value, json};

use evalfleet_mock::MockSettings;

use crate::util::{
    Env, NO_HEALTH, by_id, cache_stats, external, external_with, mock, ms, scripted, wait_until,
};

const ITEMS: usize = 20;

/// Items whose first answer is a draft, and whose improved answers are
/// `#### A{i}` (the reference), then `#### B{i}`.
fn refine_items(env: &Env, hang_from: Option<usize>) -> (std::path::PathBuf, std::path::PathBuf) {
    let mut rows = String::new();
    let mut script = String::new();
    for i in 0..ITEMS {
        let question = format!("question {i}");
        rows.push_str(&format!(
            "{}\n",
            json!({"id": format!("r{i:02}"), "question": question, "answer": format!("A{i}")})
        ));
        let mut line = json!({
            "prompt": question,
            "replies": [format!("draft {i}"), format!("#### A{i}"), format!("#### B{i}")],
        });
        if let Some(from) = hang_from {
            line["hang_from"] = json!(from);
        }
        script.push_str(&format!("{line}\n"));
    }
    let name = format!("answers-{}.jsonl", hang_from.map_or(-1, |f| f as i64));
    (env.write("items.jsonl", &rows), env.write(&name, &script))
}

fn refine_config(dataset: &Path, endpoints: &str, rounds: u32) -> String {
    crate::util::config(
        dataset,
        endpoints,
        &format!(
            "  kind: refine\n\
             \x20 refine: {{ rounds: {rounds}, prompt: \"Improve your answer to: {{{{ question }}}}. It was: {{{{ answer }}}}\" }}\n\
             \x20 parse: {{ regex: \"#### (\\\\S+)\" }}\n\
             \x20 metrics:\n\
             \x20   - {{ name: exact_match, reference: \"{{{{ answer }}}}\" }}\n\
             cache: {{ mode: read_write }}"
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refine_task_scores_the_improved_answer_and_resumes_from_the_cache_after_a_kill_between_its_calls()
 {
    let env = Env::new();
    // The first server answers first calls and never the second (slots
    // for all of them, so that hanging calls block no first call).
    let (dataset, stalls) = refine_items(&env, Some(1));
    let stalling = scripted(stalls).await;
    env.write(
        "run.yaml",
        &refine_config(&dataset, &external("m", &stalling, 2 * ITEMS as u32), 1),
    );
    let mut child = env.spawn(&["run", "run.yaml", "-q", "--run-id", "refined"]);
    wait_until(ms(30_000), "every first answer is stored", || {
        env.store_path().is_file()
            && env.attempts_by_session("refined").get(&1) == Some(&(ITEMS as i64))
    })
    .await;
    wait_until(ms(30_000), "every second call is in flight", || {
        stalling.stats().requests == 2 * ITEMS as u64
    })
    .await;
    child.kill().await.unwrap();
    assert_eq!(env.counts("refined").pending, ITEMS as u64);

    // Resumed against a server that answers: the first answers come from
    // the cache, only the second calls are made.
    let (_, answers) = refine_items(&env, None);
    let answering = scripted(answers).await;
    env.write(
        "fixed.yaml",
        &refine_config(&dataset, &external("m", &answering, 8), 1),
    );
    let resumed = env
        .evalfleet(&["resume", "refined", "-q", "--config", "fixed.yaml"])
        .await;
    assert_eq!(resumed.code, Some(0), "{}", resumed.stderr);
    assert_eq!(
        answering.stats().requests,
        ITEMS as u64,
        "only the second calls reached the endpoint"
    );
    let rows = by_id(&env.export("refined").await);
    assert_eq!(rows.len(), ITEMS);
    for (i, row) in rows.values().enumerate() {
        assert_eq!(row["status"], "done", "{row}");
        assert_eq!(row["output"], format!("#### A{i}"), "the improved answer");
        assert_eq!(row["parsed"], format!("A{i}"));
        assert_eq!(row["scores"]["exact_match@1"]["value"], 1.0, "{row}");
        // A call in the first session, the same answered from the cache,
        // and the second call.
        assert_eq!(row["attempts"], 3, "{row}");
    }
    assert_eq!(
        env.attempts_by_session("refined"),
        BTreeMap::from([(1, ITEMS as i64), (2, ITEMS as i64)]),
        "each call is an attempt of its item"
    );
    let stats = cache_stats(&env, &env.store_path()).await;
    assert_eq!(
        stats["entries"],
        2 * ITEMS,
        "both calls of every item are cached"
    );
    assert_eq!(stats["hits"], ITEMS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_call_of_a_refine_task_has_retries_of_its_own() {
    let env = Env::new();
    let (dataset, answers) = refine_items(&env, None);
    // Every call fails once, then is answered.
    let server = mock(MockSettings {
        answers: Some(answers),
        fail_first: 1,
        ..MockSettings::default()
    })
    .await;
    let config = refine_config(&dataset, &external_with("m", &server, 8, NO_HEALTH), 2);
    env.write(
        "run.yaml",
        &format!("{config}\nretry: {{ max_attempts: 2, backoff_base: 10ms, backoff_max: 20ms }}\n"),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert_eq!(server.stats().injected_errors, 3 * ITEMS as u64);
    let rows = by_id(&env.export(&ran.run_id()).await);
    for (i, row) in rows.values().enumerate() {
        assert_eq!(row["status"], "done", "{row}");
        assert_eq!(row["output"], format!("#### B{i}"));
        assert_eq!(row["attempts"], 6, "three calls, each tried twice");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_round_of_a_refine_task_continues_the_conversation() {
    let env = Env::new();
    let (dataset, answers) = refine_items(&env, None);
    let server = scripted(answers).await;
    env.write(
        "run.yaml",
        &refine_config(&dataset, &external("m", &server, 8), 2),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert_eq!(server.stats().completed, 3 * ITEMS as u64);
    let rows = by_id(&env.export(&ran.run_id()).await);
    for (i, row) in rows.values().enumerate() {
        // The third reply of the conversation (two assistant turns before
        // it), parsed and scored against the reference.
        assert_eq!(row["output"], format!("#### B{i}"));
        assert_eq!(row["scores"]["exact_match@1"]["value"], 0.0);
        assert_eq!(row["attempts"], 3);
    }
    let value: Value = serde_json::from_str(
        &env.evalfleet(&["report", &ran.run_id(), "--json", "--out", "r"])
            .await
            .stdout,
    )
    .unwrap();
    assert_eq!(value["metrics"][0]["n"], ITEMS);
}
