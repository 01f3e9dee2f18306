//! `kind: conversation` end to end: scripted episodes give exactly the
//! rewards and logs worked out by hand; a run killed mid-episode and
//! resumed gives what an uninterrupted one gives; episodes spread over
//! several endpoints.

use std::collections::BTreeMap;

use evalfleet_core::store::prelude::*;
use evalfleet_mock::MockSettings;
use serde_json::{Value, json};

use crate::util::{Env, by_id, mock, ms, scripted, wait_until};

/// The script of the scorer and the policy (by their first user message):
/// what `docs/conversation.md`'s rules make of it is worked out below.
fn script() -> String {
    let mut lines = Vec::new();
    let score = |episode: u32, turn: u32, t: [f64; 3]| {
        json!({"prompt": format!("score {episode} {turn}"),
               "replies": [format!("{{\"AB\": {}, \"BC\": {}, \"CA\": {}}}", t[0], t[1], t[2])]})
    };
    // Episode 0. Turn 4: ++- aimed at CA; of C and A, C is worse off with
    // B (BC 0.4 < AB 0.5): the target speaker is C (need: solution).
    for (turn, t) in [
        (4, [0.5, 0.4, -0.6]),
        (5, [0.5, 0.4, -0.6]),
        (6, [0.5, 0.4, 0.1]),
        (7, [0.5, 0.4, 0.2]), // horizon: +++ and CA positive
        (8, [0.5, 0.4, 0.3]), // still so after each utterance of the
        (9, [0.5, 0.4, 0.3]), // duration: the stable bonus
        // Stable at 9: skipped. Turn 10: +-+ aimed at BC; C is worse off
        // with A (CA 0.3 < AB 0.5): C again.
        (10, [0.5, -0.2, 0.3]),
        (11, [0.5, -0.2, 0.3]),
        (12, [0.5, 0.1, 0.3]),
        (13, [0.5, 0.0, 0.3]),  // horizon: BC at 0 is positive: holds
        (14, [0.5, -0.1, 0.3]), // a dip: lost, and the step ends here
        (15, [0.5, 0.2, 0.3]),  // never asked
    ] {
        lines.push(score(0, turn, t));
    }
    lines.push(json!({"prompt": "policy 0 0", "replies": ["3"]}));
    // Not a digit: asked again, then validate.
    lines.push(json!({"prompt": "policy 0 1", "replies": ["I would bridge", "1"]}));
    // Episode 1. Turn 4: --- aimed at BC, the edge closest to 0; of B and
    // C, B is worse off with A (AB -0.5 < CA -0.4): B (need: mediation).
    lines.push(score(1, 4, [-0.5, -0.3, -0.4]));
    // Unreadable, then the original scorer's way: pairs in any order.
    lines.push(json!({"prompt": "score 1 5",
        "replies": ["they get along fine", "B-A: -0.5\nC-B: -0.3\nA-C: -0.4"]}));
    // A value outside [-1, 1]: clipped, and counted.
    lines.push(
        json!({"prompt": "score 1 6", "replies": ["{\"AB\": -0.5, \"BC\": -1.6, \"CA\": -0.4}"]}),
    );
    for turn in 7..=12 {
        // +--: stable through AB while the target BC stays negative: the
        // step is lost at its horizon (7) and ends there.
        lines.push(score(1, turn, [0.2, -0.6, -0.3]));
    }
    lines.push(json!({"prompt": "policy 1 0", "replies": ["2"]}));
    lines
        .iter()
        .map(Value::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

const SCRIPTED: &str = r#"name: talk
endpoints:
  - { name: gpu, kind: external, base_url: "BASE", model: m, concurrency: 4 }
task:
  kind: conversation
  params: { max_tokens: 64 }
  conversation:
    max_rounds: 4
    topics: ["the shared flat"]
    personas:
      - { name: Ann, need: recognition, landmines: [money] }
      - { name: Ben, need: mediation }
      - { name: Cy, need: solution }
    persona_messages: [{ role: user, content: "{{ episode }} {{ speaker }} {{ turn }}" }]
    scorer: { messages: [{ role: user, content: "score {{ episode }} {{ turn }}" }] }
    policy: { messages: [{ role: user, content: "policy {{ episode }} {{ step }}" }] }
    robot: { messages: [{ role: user, content: "robot {{ episode }} {{ step }} {{ strategy }} {{ target_name }}" }] }
"#;

/// The JSON values of a JSONL file, a line each.
pub(crate) fn lines(path: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripted_episodes_earn_exactly_the_rewards_worked_out_by_hand() {
    let env = Env::new();
    let answers = env.write("answers.jsonl", &script());
    let server = scripted(answers).await;
    env.write("talk.yaml", &SCRIPTED.replace("BASE", &server.base_url()));
    let ran = env
        .evalfleet(&[
            "simulate",
            "talk.yaml",
            "--sessions",
            "2",
            "-q",
            "--run-id",
            "talk",
        ])
        .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert!(
        ran.stderr
            .contains("2 episodes (0 failed), 3 steps; reward 3.00 in all"),
        "{}",
        ran.stderr
    );

    let rows = by_id(&env.export("talk").await);
    let output =
        |id: &str| -> Value { serde_json::from_str(rows[id]["output"].as_str().unwrap()).unwrap() };
    let e0 = output("0");
    let steps = e0["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 2);
    let s = &steps[0];
    assert_eq!(
        (s["turn"].as_u64(), s["pattern"].as_str()),
        (Some(4), Some("++-"))
    );
    assert_eq!(s["target_edge"], "CA");
    assert_eq!(s["target_speaker"], "C");
    assert_eq!(s["target_need"], "solution");
    assert_eq!(s["strategy"], "plan");
    assert_eq!(s["robot"], "robot 0 0 plan Cy");
    assert_eq!(s["at_horizon"]["stable"], true);
    assert_eq!(s["at_horizon"]["target_positive"], true);
    assert_eq!(s["checks"].as_array().unwrap().len(), 3);
    assert_eq!(
        s["reward"],
        json!({"stable_bonus": 2.0, "preference_match_bonus": 0.5, "invalid_penalty": 0.0, "total": 2.5})
    );
    // Five human utterances and the robot's in the step.
    assert_eq!(s["utterances"].as_array().unwrap().len(), 6);
    let s = &steps[1];
    assert_eq!(
        (s["turn"].as_u64(), s["auto_skips"].as_u64()),
        (Some(10), Some(1))
    );
    assert_eq!(
        (s["pattern"].as_str(), s["target_edge"].as_str()),
        (Some("+-+"), Some("BC"))
    );
    assert_eq!(s["target_speaker"], "C");
    assert_eq!(s["strategy"], "validate");
    assert_eq!(s["policy_reply"], "1");
    assert_eq!(s["at_horizon"]["target_positive"], true);
    assert_eq!(s["at_end"]["target_positive"], false);
    assert_eq!(s["cut_short"], true);
    assert_eq!(s["checks"].as_array().unwrap().len(), 2);
    assert_eq!(s["reward"]["total"], 0.0);
    // A step begun before the last round runs past it, here to its dip.
    assert_eq!(e0["human_utterances"], 14);
    assert_eq!(e0["ending"], "terminated");
    let scores = &rows["0"]["scores"];
    assert_eq!(scores["reward"]["value"], 2.5);
    assert_eq!(scores["interventions"]["value"], 2.0);
    assert_eq!(scores["stabilised"]["value"], 1.0);
    assert_eq!(scores["preference_matches"]["value"], 1.0);
    assert_eq!(scores["invalid"]["value"], 0.0);

    let e1 = output("1");
    let steps = e1["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 1);
    let s = &steps[0];
    assert_eq!(
        (s["target_edge"].as_str(), s["target_speaker"].as_str()),
        (Some("BC"), Some("B"))
    );
    assert_eq!(s["strategy"], "bridge");
    // Stable at the horizon, but through AB: no stable bonus, and the step
    // ends at that check.
    assert_eq!(s["at_horizon"]["stable"], true);
    assert_eq!(s["at_horizon"]["target_positive"], false);
    assert_eq!(s["checks"].as_array().unwrap().len(), 1);
    assert_eq!(
        s["reward"],
        json!({"stable_bonus": 0.0, "preference_match_bonus": 0.5, "invalid_penalty": 0.0, "total": 0.5})
    );
    assert_eq!(e1["human_utterances"], 12);
    assert_eq!(e1["invalid_scores"], 1);
    assert_eq!(e1["clipped_scores"], 1);
    assert_eq!(rows["1"]["scores"]["clipped_scores"]["value"], 1.0);
    assert_eq!(rows["1"]["scores"]["reward"]["value"], 0.5);

    // The calls of an episode are its attempts: 14 utterances, 11
    // scores, 3 policy replies (one asked again), 2 robot lines.
    assert_eq!(rows["0"]["attempts"], 30);

    let dir = env.path("runs/talk");
    let summary = lines(&dir.join("conversation_summary.jsonl"));
    let brief: Vec<(String, u64, String, f64)> = summary
        .iter()
        .map(|l| {
            (
                l["episode"].as_str().unwrap().to_owned(),
                l["step"].as_u64().unwrap(),
                l["strategy"].as_str().unwrap().to_owned(),
                l["reward"]["total"].as_f64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        brief,
        [
            ("0".to_owned(), 0, "plan".to_owned(), 2.5),
            ("0".to_owned(), 1, "validate".to_owned(), 0.0),
            ("1".to_owned(), 0, "bridge".to_owned(), 0.5),
        ]
    );
    let batches = lines(&dir.join("batch_summary.jsonl"));
    assert_eq!(batches.len(), 1);
    let b = &batches[0];
    assert_eq!(
        (b["episodes"].as_u64(), b["steps"].as_u64()),
        (Some(2), Some(3))
    );
    assert_eq!(b["strategy_distribution"]["validate"], 1);
    assert_eq!(b["strategy_distribution"]["bridge"], 1);
    assert_eq!(b["strategy_distribution"]["plan"], 1);
    assert_eq!(b["total_reward"], 3.0);
    assert_eq!(b["interventions"], 3);
    let h = 3.0f64.log2();
    assert!(
        (b["entropy_bits"].as_f64().unwrap() - h).abs() < 1e-9,
        "{b}"
    );
    assert!(!lines(&dir.join("run_events.jsonl")).is_empty());
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["task"]["conversation"]["sessions"], 2);

    // Scoring again keeps an episode's scores: it was scored as it was played.
    let scored = env.evalfleet(&["score", "talk"]).await;
    assert_eq!(scored.code, Some(0), "{}", scored.stderr);
    let again = by_id(&env.export("talk").await);
    assert_eq!(again["0"]["scores"], rows["0"]["scores"]);
    assert_eq!(again["1"]["scores"]["reward"]["value"], 0.5);
}

const SPREAD: &str = r#"name: spread
endpoints:
  - { name: gpu, kind: external, base_url: "BASE1", model: m, concurrency: 3 }
  - { name: voices, kind: external, base_url: "BASE2", model: m, concurrency: 2, role: judge }
task:
  kind: conversation
  params: { max_tokens: 64 }
  conversation:
    max_rounds: 5
    seed: 7
    topics: ["a trip", "the budget", "a new job"]
    personas:
      - { name: Ann, landmines: [money], endpoint: voices }
      - { name: Ben, landmines: [mother] }
      - { name: Cy, endpoint: voices }
    persona_messages:
      - role: user
        content: "{{ speaker }} {{ turn }}: {% set k = (turn + episode|int) % 4 %}{% if k == 0 %}no, that is wrong{% elif k == 1 %}I agree, thanks{% elif k == 2 %}what about money and mother{% else %}fine{% endif %}"
    scorer: { kind: rules }
    policy: { kind: random }
    robot: { messages: [{ role: user, content: "robot {{ episode }} {{ step }} {{ strategy }}" }] }
    rewards: { filter_zero_rewards: false }
"#;

/// Two mocks answering after `latency_ms` (the items' endpoint and the
/// voices'), and `spread.yaml` over them without the line `drop`.
async fn spread(env: &Env, latency_ms: u64, drop: &str) -> [evalfleet_mock::MockServer; 2] {
    let start = || {
        mock(MockSettings {
            latency: ms(latency_ms),
            ..MockSettings::default()
        })
    };
    let (gpu, voices) = (start().await, start().await);
    let mut text = SPREAD
        .replace("BASE1", &gpu.base_url())
        .replace("BASE2", &voices.base_url());
    if !drop.is_empty() {
        text = text.replace(drop, "");
    }
    env.write("spread.yaml", &text);
    [gpu, voices]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn episodes_killed_mid_way_and_resumed_end_as_an_uninterrupted_run() {
    let env = Env::new();
    let mocks = spread(&env, 15, "").await;
    let calls = || mocks.iter().map(|m| m.stats().requests).sum::<u64>();
    let sessions = "24";
    let clean = env
        .evalfleet(&[
            "simulate",
            "spread.yaml",
            "--sessions",
            sessions,
            "-q",
            "--run-id",
            "clean",
        ])
        .await;
    assert_eq!(clean.code, Some(0), "{}", clean.stderr);
    let clean = by_id(&env.export("clean").await);
    assert_eq!(clean.len(), 24);
    let clean_calls = calls();

    let mut child = env.spawn(&[
        "simulate",
        "spread.yaml",
        "--sessions",
        sessions,
        "-q",
        "--run-id",
        "killed",
    ]);
    // Killed half-way through the calls a clean run makes: the episodes go
    // on side by side, so each is cut in its middle.
    wait_until(ms(60_000), "half the calls are made", || {
        calls() >= clean_calls + clean_calls / 2
    })
    .await;
    child.kill().await.unwrap();
    let first = env.counts("killed");
    assert!(first.pending > 0, "killed too late: {first:?}");
    let resumed = env.evalfleet(&["resume", "killed", "-q"]).await;
    assert_eq!(resumed.code, Some(0), "{}", resumed.stderr);
    let killed = by_id(&env.export("killed").await);
    assert_eq!(killed.len(), 24, "every episode exactly once");
    let mut rewards = BTreeMap::new();
    for (id, row) in &clean {
        assert_eq!(row["status"], "done", "{id}");
        assert_eq!(row["output"], killed[id]["output"], "episode {id}");
        assert_eq!(row["scores"], killed[id]["scores"], "episode {id}");
        rewards.insert(
            id.clone(),
            row["scores"]["reward"]["value"].as_f64().unwrap(),
        );
    }
    // The episodes are not all alike: the seed and the script vary them.
    let distinct: std::collections::BTreeSet<String> =
        clean.values().map(|r| r["output"].to_string()).collect();
    assert_eq!(distinct.len(), 24);
    // Both endpoints took calls: the voices of A and C went to theirs.
    let mut by_endpoint: BTreeMap<String, u64> = BTreeMap::new();
    env.store()
        .scan_attempts("clean", &mut |a| {
            *by_endpoint.entry(a.endpoint).or_default() += 1
        })
        .unwrap();
    assert!(
        by_endpoint["voices"] > 0 && by_endpoint["gpu"] > 0,
        "{by_endpoint:?}"
    );
    // Logs are written from committed episodes: one line a step, after
    // the resume as after a clean run.
    let steps =
        |run: &str| lines(&env.path(&format!("runs/{run}/conversation_summary.jsonl"))).len();
    assert_eq!(steps("clean"), steps("killed"));
    assert!(rewards.values().any(|r| *r > 0.0), "{rewards:?}");
}

/// The Python with gymnasium that `.ci/run` prepares
/// (`$EVALFLEET_GYM_PYTHON`), else `python3` when it has gymnasium; `None`,
/// saying so, when neither does.
fn gym_python() -> Option<String> {
    let candidates = std::env::var("EVALFLEET_GYM_PYTHON")
        .ok()
        .into_iter()
        .chain(["python3".to_owned()]);
    for python in candidates {
        let ok = std::process::Command::new(&python)
            .args(["-c", "import gymnasium, numpy"])
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Some(python);
        }
    }
    evalfleet_testkit::skip!(
        "no Python with gymnasium (set EVALFLEET_GYM_PYTHON; .ci/run makes one)"
    );
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gymnasium_trainer_takes_the_decisions_through_the_environment_server() {
    use tokio::io::AsyncBufReadExt;
    let Some(python) = gym_python() else {
        return;
    };
    let env = Env::new();
    let _mocks = spread(&env, 5, "    policy: { kind: random }\n").await;
    // All 16 episodes reach their first decision at once, and one that no
    // trainer takes within the action timeout goes on without it: the
    // trainer (check_env's resets, then 4 episodes) must take its episodes
    // within that time, however slowly Python starts on a busy machine.
    let mut server = env.spawn(&[
        "env",
        "spread.yaml",
        "--sessions",
        "16",
        "--max-steps",
        "2",
        "--bind",
        "127.0.0.1:0",
        "--action-timeout",
        "20s",
        "--run-id",
        "gym",
    ]);
    let stdout = server.stdout.take().unwrap();
    let mut out = tokio::io::BufReader::new(stdout).lines();
    let url = out
        .next_line()
        .await
        .unwrap()
        .expect("the server prints its address");
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");
    // A page whose name was rebound to the loopback cannot play.
    let rebound = crate::serve::client()
        .post(format!("{url}/v1/reset"))
        .header("host", "rebound.attacker.example")
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(rebound.status(), 421);

    let client = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/gym_client.py");
    let played = tokio::process::Command::new(&python)
        .args([client, &url, "--episodes", "4", "--check", "--seed", "3"])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&played.stdout);
    assert!(
        played.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&played.stderr)
    );
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0], json!({"check_env": "passed"}));
    assert_eq!(lines.last().unwrap(), &json!({"episodes": 4}));

    // Every episode ends (those no trainer took decide invalid after the
    // action timeout, twice), and so does the server.
    let status = tokio::time::timeout(ms(300_000), server.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
    let rows = by_id(&env.export("gym").await);
    assert_eq!(rows.len(), 16);
    // The episodes the trainer played hold its actions and gave it their
    // rewards, step by step.
    for played in &lines[1..lines.len() - 1] {
        let id = played["episode"].as_str().unwrap();
        let output: Value = serde_json::from_str(rows[id]["output"].as_str().unwrap()).unwrap();
        let steps = output["steps"].as_array().unwrap();
        let names = ["validate", "bridge", "plan", "no_intervention"];
        let actions: Vec<&str> = played["actions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| names[a.as_u64().unwrap() as usize - 1])
            .collect();
        let stored: Vec<&str> = steps
            .iter()
            .map(|s| s["strategy"].as_str().unwrap())
            .collect();
        assert_eq!(actions, stored, "episode {id}");
        let rewards: Vec<f64> = steps
            .iter()
            .map(|s| s["reward"]["total"].as_f64().unwrap())
            .collect();
        let given: Vec<f64> = played["rewards"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_f64().unwrap())
            .collect();
        assert_eq!(rewards, given, "episode {id}");
        assert!(steps.len() <= 2);
    }
}
