//! `kind: conversation` end to end: scripted episodes give exactly the
//! rewards and logs worked out by hand; a run killed mid-episode and
//! resumed gives what an uninterrupted one gives; episodes spread over
//! several endpoints.

use std::collections::BTreeMap;

use evalfleet_mock::MockSettings;
use evalfleet_store::prelude::*;
use serde_json::{Value, json};

use crate::util::{Env, by_id, mock, ms, scripted, signal, wait_until};

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
    rules: corrected
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
        (
            b["batch_id"].as_u64(),
            b["batch_size"].as_u64(),
            b["steps"].as_u64()
        ),
        (Some(1), Some(2), Some(3))
    );
    let strategies = &b["choice_distributions"]["strategy"];
    assert_eq!(
        strategies,
        &json!({"validate": 1, "bridge": 1, "plan": 1, "no_intervention": 0})
    );
    assert_eq!(b["total_reward"], 3.0);
    assert_eq!(b["total_interventions"], 3);
    let h = 3.0f64.log2();
    assert!(
        (b["choice_entropy"]["strategy"].as_f64().unwrap() - h).abs() < 1e-9,
        "{b}"
    );
    let metrics = lines(&dir.join("metrics.jsonl"));
    assert_eq!(metrics.len(), 1);
    assert_eq!(metrics[0]["reward_mean"], 1.5);
    assert_eq!(metrics[0]["stabilised_share"].as_f64(), Some(1.0 / 3.0));
    assert_eq!(metrics[0]["strategy/plan_ratio"].as_f64(), Some(1.0 / 3.0));
    // Written as Python's json.dumps writes: the original's grep works.
    let text = std::fs::read_to_string(dir.join("conversation_summary.jsonl")).unwrap();
    assert_eq!(
        text.matches(r#""strategy": "validate""#).count(),
        1,
        "{text}"
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
    rules: corrected
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
    alarms: { window: 4 }
"#;

/// Two mocks answering after `latency_ms` (the items' endpoint and the
/// voices'), and `spread.yaml` over them without the line `drop`.
pub(crate) async fn spread(
    env: &Env,
    latency_ms: u64,
    drop: &str,
) -> [evalfleet_mock::MockServer; 2] {
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
    let killed = by_id(&env.export("killed").await);
    let errors: Vec<&Value> = killed
        .values()
        .map(|r| &r["error"])
        .filter(|e| !e.is_null())
        .collect();
    assert_eq!(resumed.code, Some(0), "{}\n{errors:?}", resumed.stderr);
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

/// The Python with gymnasium that `.ci/run` prepares.
fn gym_python() -> Option<String> {
    crate::util::python_with("EVALFLEET_GYM_PYTHON", "gymnasium, numpy", "gymnasium")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gymnasium_trainer_takes_the_decisions_through_the_environment_server() {
    use tokio::io::AsyncBufReadExt;
    let Some(python) = gym_python() else {
        return;
    };
    let env = Env::new();
    let _mocks = spread(&env, 5, TRAINER).await;
    // Episodes wait at their first decision as long as it takes Python to
    // start; check_env's resets give up the episode before (closed: it
    // starts over), and the trainer plays them all until none is left.
    let mut server = env.spawn(&[
        "env",
        "spread.yaml",
        "--sessions",
        "16",
        "--max-steps",
        "2",
        "--bind",
        "127.0.0.1:0",
        "--run-id",
        "gym",
        "--exit-when-done",
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
        .args([client, &url, "--episodes", "100", "--check", "--seed", "3"])
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
    let played = lines.len() as u64 - 2;
    assert_eq!(lines.last().unwrap(), &json!({"episodes": played}));

    // Every episode ends, and with --exit-when-done so does the server.
    let status = tokio::time::timeout(ms(120_000), server.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
    let rows = by_id(&env.export("gym").await);
    assert_eq!(rows.len(), 16);
    // Every episode was played to its end, by the trainer or by check_env's
    // steps: those check_env's resets closed mid-episode were withdrawn and
    // played again from their start.
    assert!(rows.values().all(|r| r["status"] == "done"), "{rows:?}");
    let events = crate::conversation::lines(&env.path("runs/gym").join("run_events.jsonl"));
    let withdrawn = events
        .iter()
        .filter(|e| e["kind"] == "episode_withdrawn")
        .count();
    assert!(withdrawn >= 1, "check_env's resets closed none: {events:?}");
    let ended: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"] == "episode_ended")
        .collect();
    assert_eq!(ended.len(), 16, "{events:?}");
    assert!((1..=16).contains(&played), "{played}");
    // The episodes the trainer played hold its actions and gave it their
    // rewards, step by step.
    for played in &lines[1..lines.len() - 1] {
        let (steps, _) = stored_as_played(&rows, played);
        assert!(steps <= 2);
    }
}

/// Checks that the stored episode a client played (its line: `episode`,
/// the `actions` it sent, digits or "invalid", and the `rewards` it got)
/// is done, holds those actions and gave those rewards: its steps, and
/// how many of them were invalid.
fn stored_as_played(rows: &BTreeMap<String, Value>, played: &Value) -> (usize, usize) {
    let id = played["episode"].as_str().unwrap();
    assert_eq!(rows[id]["status"], "done", "{id}");
    let output: Value = serde_json::from_str(rows[id]["output"].as_str().unwrap()).unwrap();
    let steps = output["steps"].as_array().unwrap();
    let actions = played["actions"].as_array().unwrap();
    assert_eq!(steps.len(), actions.len(), "episode {id}");
    let mut invalid = 0;
    for (step, action) in steps.iter().zip(actions) {
        match action.as_u64() {
            Some(digit) => assert_eq!(step["strategy"], NAMES[digit as usize - 1], "{id}"),
            None => {
                assert_eq!(action, "invalid");
                assert_eq!(step["strategy"], Value::Null, "{id}");
                assert_eq!(step["invalid_reason"], "trainer", "{id}");
                invalid += 1;
            }
        }
    }
    let stored: Vec<f64> = steps
        .iter()
        .map(|s| s["reward"]["total"].as_f64().unwrap())
        .collect();
    let given: Vec<f64> = played["rewards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_f64().unwrap())
        .collect();
    assert_eq!(stored, given, "episode {id}");
    let sum: f64 = given.iter().sum();
    assert_eq!(rows[id]["scores"]["reward"]["value"].as_f64(), Some(sum));
    (steps.len(), invalid)
}

/// The line of `spread.yaml` that `env` runs without (its policy is the
/// trainer's).
pub(crate) const TRAINER: &str = "    policy: { kind: random }\n";

/// `evalfleet env ARGS` on a free port, and its address.
pub(crate) async fn env_server(env: &Env, args: &[&str]) -> (tokio::process::Child, String) {
    use tokio::io::AsyncBufReadExt;
    let mut all = vec!["env"];
    all.extend(args);
    all.extend(["--bind", "127.0.0.1:0"]);
    let mut server = env.spawn(&all);
    let stdout = server.stdout.take().unwrap();
    let url = tokio::io::BufReader::new(stdout)
        .lines()
        .next_line()
        .await
        .unwrap()
        .expect("the server prints its address");
    (server, url)
}

/// POSTs `body` to the server's `path`: the status and the JSON answer
/// (within 20 s: no request waits longer than it asks).
pub(crate) async fn post(url: &str, path: &str, body: Value) -> (u16, Value) {
    let answer = tokio::time::timeout(
        ms(20_000),
        crate::serve::client()
            .post(format!("{url}{path}"))
            .json(&body)
            .send(),
    )
    .await
    .unwrap_or_else(|_| panic!("{path} {body} waited past 20 s"))
    .unwrap();
    let status = answer.status().as_u16();
    (status, answer.json().await.unwrap())
}

/// A reset that hands out an episode: its answer.
pub(crate) async fn reset(url: &str) -> Value {
    let (status, answer) = post(url, "/v1/reset", json!({})).await;
    assert_eq!(status, 200, "{answer}");
    answer
}

/// Steps the environment's episode `env_id` with `action` until it ends:
/// the steps' answers.
async fn play(url: &str, env_id: &str, action: Value) -> Vec<Value> {
    let mut answers = Vec::new();
    loop {
        let (status, answer) =
            post(url, "/v1/step", json!({"env_id": env_id, "action": action})).await;
        assert_eq!(status, 200, "{answer}");
        let over = answer["terminated"] == true || answer["truncated"] == true;
        answers.push(answer);
        if over {
            return answers;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resets_answer_at_once_and_closed_episodes_start_over_and_count_once() {
    let env = Env::new();
    let _mocks = spread(&env, 2, TRAINER).await;
    // Two episodes under way at once (--envs 1), three in all; an episode a
    // trainer holds has 4 s to get its action.
    let (server, url) = env_server(
        &env,
        &[
            "spread.yaml",
            "--sessions",
            "3",
            "--envs",
            "1",
            "--max-steps",
            "1",
            "--action-timeout",
            "4s",
            "--run-id",
            "life",
        ],
    )
    .await;
    let a = reset(&url).await;
    let b = reset(&url).await;
    // The third cannot begin while both hold their places: the wait asked
    // for passes (504), however long the server's --reset-wait.
    let (status, waited) = post(&url, "/v1/reset", json!({"wait_s": 0.2})).await;
    assert_eq!(status, 504, "{waited}");
    let (status, bad) = post(&url, "/v1/reset", json!({"wait_s": "long"})).await;
    assert_eq!(status, 400, "{bad}");
    // The observation carries the policy's prompt.
    let prompt = a["observation"]["prompt"].as_array().unwrap();
    assert!(
        prompt
            .iter()
            .all(|m| m["role"].is_string() && m["content"].is_string()),
        "{prompt:?}"
    );
    // A is given up: it stops at once, and is withdrawn: it starts over, to
    // be handed out again.
    let a_id = a["env_id"].as_str().unwrap().to_owned();
    let (status, closed) = post(&url, "/v1/close", json!({"env_id": a_id})).await;
    assert_eq!(status, 200, "{closed}");
    let (status, again) = post(&url, "/v1/close", json!({"env_id": a_id})).await;
    assert_eq!(status, 404, "{again}");
    // B's model gave nothing readable.
    let b_id = b["env_id"].as_str().unwrap().to_owned();
    let steps = play(&url, &b_id, json!("invalid")).await;
    let info = &steps[0]["info"];
    assert_eq!(info["invalid_reason"], "trainer", "{info}");
    assert_eq!(info["strategy"], Value::Null);
    assert_eq!(info["preference_match"], false);
    // An invalid decision costs rewards.invalid_penalty (1.0).
    assert_eq!(steps[0]["reward"], -1.0, "{}", steps[0]);
    assert_eq!(info["reward_parts"]["invalid_penalty"], -1.0, "{info}");
    // C and A (from its start) begin in the places A and B left and wait
    // for a reset past the action timeout: they are no trainer's yet, so
    // their decisions are still due.
    let deadline = tokio::time::Instant::now() + ms(20_000);
    loop {
        let spec = crate::serve::get(&format!("{url}/v1/spec")).await;
        if spec["now"]["ready"] == 2 {
            assert_eq!(spec["now"]["closed"], 1, "{spec}");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{spec}");
        tokio::time::sleep(ms(20)).await;
    }
    // Longer than the action timeout: time passing, not a wait for it.
    tokio::time::sleep(ms(4_500)).await;
    let mut c_id = String::new();
    for _ in 0..2 {
        let (status, next) = post(&url, "/v1/reset", json!({"wait_s": 1})).await;
        assert_eq!(status, 200, "{next}");
        let id = next["env_id"].as_str().unwrap().to_owned();
        // A plays plan this time, C bridge.
        let digit = if id == a_id { 3 } else { 2 };
        let steps = play(&url, &id, json!(digit)).await;
        let info = &steps[0]["info"];
        assert_eq!(info["strategy"], NAMES[digit - 1], "{info}");
        assert_eq!(info["invalid_reason"], Value::Null);
        assert_eq!(
            info["preference_match"],
            info["preferred_strategy"] == NAMES[digit - 1],
            "{info}"
        );
        if id == a_id {
            continue;
        }
        c_id = id;
        // What the step is analysed by (a target is null when the state
        // decided was stable).
        for key in [
            "target_edge",
            "target_speaker",
            "target_need",
            "preferred_strategy",
            "reward_parts",
            "at_horizon",
            "at_end",
            "checks",
        ] {
            assert!(info.get(key).is_some(), "{key}: {info}");
        }
        assert!(info["reward_parts"]["total"].is_number(), "{info}");
        assert!(info["at_end"]["stable"].is_boolean(), "{info}");
    }
    assert!(!c_id.is_empty() && c_id != a_id && c_id != b_id);
    // Every episode handed out or ended: 410 at once, and the server
    // stays up after the last has ended.
    let (status, gone) = post(&url, "/v1/reset", json!({})).await;
    assert_eq!(status, 410, "{gone}");
    let dir = env.path("runs/life");
    wait_until(ms(20_000), "the session has ended", || {
        dir.join("config.json").exists()
    })
    .await;
    let (status, gone) = post(&url, "/v1/reset", json!({})).await;
    assert_eq!(status, 410, "{gone}");

    // A closed episode is no failure: A was played again, to its end.
    let rows = by_id(&env.export("life").await);
    for row in rows.values() {
        assert_eq!(row["status"], "done", "{row}");
    }
    let a_output: Value = serde_json::from_str(rows[&a_id]["output"].as_str().unwrap()).unwrap();
    assert_eq!(a_output["steps"][0]["strategy"], "plan");
    let b_output: Value = serde_json::from_str(rows[&b_id]["output"].as_str().unwrap()).unwrap();
    assert_eq!(b_output["steps"][0]["invalid_reason"], "trainer");
    let c_output: Value = serde_json::from_str(rows[&c_id]["output"].as_str().unwrap()).unwrap();
    assert_eq!(c_output["steps"][0]["strategy"], "bridge");
    assert_eq!(c_output["steps"][0]["valid"], true);

    // The logs hold the played episodes only (A once, as played to its
    // end), written as Python writes JSON, so the original's grep works.
    let text = std::fs::read_to_string(dir.join("conversation_summary.jsonl")).unwrap();
    assert!(text.contains(r#""strategy": "bridge""#), "{text}");
    assert_eq!(
        text.matches(&format!(r#""episode": "{a_id}""#)).count(),
        1,
        "{text}"
    );
    let batches = lines(&dir.join("batch_summary.jsonl"));
    assert_eq!(batches.len(), 1, "{batches:?}");
    assert_eq!(batches[0]["batch_size"], 3);
    assert_eq!(batches[0]["choice_distributions"]["strategy"]["bridge"], 1);
    assert_eq!(batches[0]["choice_distributions"]["strategy"]["plan"], 1);
    assert_eq!(batches[0]["invalid"], 1);
    let metrics = lines(&dir.join("metrics.jsonl"));
    assert_eq!(metrics[0]["strategy/bridge_ratio"], 1.0 / 3.0);
    assert_eq!(metrics[0]["invalid"], 1);
    let events = lines(&dir.join("run_events.jsonl"));
    let of = |kind: &str| -> Vec<&Value> { events.iter().filter(|e| e["kind"] == kind).collect() };
    // A began twice, was withdrawn once and ended once.
    assert_eq!(of("episode_started").len(), 4, "{events:?}");
    let withdrawn = of("episode_withdrawn");
    assert_eq!(withdrawn.len(), 1, "{events:?}");
    assert_eq!(withdrawn[0]["episode"], a_id.as_str());
    let ended = of("episode_ended");
    assert_eq!(ended.len(), 3, "{events:?}");
    assert!(ended.iter().all(|e| e["status"] == "done"), "{events:?}");
    signal(&server, "INT").await;
    let out = tokio::time::timeout(ms(20_000), server.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(out.status.success(), "{:?}", out.status);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("3 episodes (0 failed), 3 steps"),
        "{stderr}"
    );
}

const NAMES: [&str; 4] = ["validate", "bridge", "plan", "no_intervention"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ppo_rollout_loop_gets_prompts_sends_digits_and_unreadable_outputs_and_the_stored_rewards()
 {
    let env = Env::new();
    let _mocks = spread(&env, 2, TRAINER).await;
    let (mut server, url) = env_server(
        &env,
        &[
            "spread.yaml",
            "--sessions",
            "6",
            "--max-steps",
            "2",
            "--batch-size",
            "4",
            "--run-id",
            "trl",
            "--exit-when-done",
        ],
    )
    .await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/trl_rollout.py");
    let ran = tokio::process::Command::new("python3")
        .args([script, &url, "--batch-size", "4", "--garble", "3"])
        .env("PYTHONIOENCODING", "utf-8")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&ran.stdout);
    assert!(
        ran.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&ran.stderr)
    );
    let out: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(out.last().unwrap(), &json!({"episodes": 6, "batches": 2}));
    let status = tokio::time::timeout(ms(60_000), server.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");

    let rows = by_id(&env.export("trl").await);
    assert_eq!(rows.len(), 6);
    let (mut invalid, mut total) = (0, 0.0);
    for played in out.iter().filter(|l| l.get("episode").is_some()) {
        invalid += stored_as_played(&rows, played).1;
        total += played["rewards"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_f64().unwrap())
            .sum::<f64>();
    }
    assert!(invalid > 0, "every third reply was unreadable");
    // A line per batch of four episodes, in the order they ended.
    let dir = env.path("runs/trl");
    let batches = lines(&dir.join("batch_summary.jsonl"));
    let sizes: Vec<u64> = batches
        .iter()
        .map(|b| b["batch_size"].as_u64().unwrap())
        .collect();
    assert_eq!(sizes, [4, 2]);
    let logged: f64 = batches
        .iter()
        .map(|b| b["total_reward"].as_f64().unwrap())
        .sum();
    assert!((logged - total).abs() < 1e-9, "{logged} {total}");
    assert_eq!(lines(&dir.join("metrics.jsonl")).len(), 2);
    // Every window of four decisions holds an unreadable reply, so a
    // strategy is never chosen in it: the alarm is raised as soon as the
    // window is full, while episodes are still being played, and stored.
    let events = lines(&dir.join("run_events.jsonl"));
    let first_alarm = events.iter().position(|e| e["kind"] == "alarm");
    let last_end = events.iter().rposition(|e| e["kind"] == "episode_ended");
    assert!(
        first_alarm < last_end && first_alarm.is_some(),
        "{events:?}"
    );
    assert!(
        events[first_alarm.unwrap()]["message"]
            .as_str()
            .unwrap()
            .contains("never chosen in the last 4 decisions"),
        "{events:?}"
    );
    let stored = env.store().events("trl").unwrap();
    assert!(
        stored
            .iter()
            .any(|e| e.kind == evalfleet_types::EventKind::Alarm),
        "{stored:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_environment_run_resumes_with_its_done_episodes_kept() {
    let env = Env::new();
    let _mocks = spread(&env, 2, TRAINER).await;
    let (server, url) = env_server(
        &env,
        &[
            "spread.yaml",
            "--sessions",
            "3",
            "--envs",
            "1",
            "--max-steps",
            "1",
            "--run-id",
            "res",
        ],
    )
    .await;
    let first = reset(&url).await;
    let first_id = first["env_id"].as_str().unwrap().to_owned();
    play(&url, &first_id, json!(1)).await;
    wait_until(ms(20_000), "the first episode is stored", || {
        env.counts("res").done == 1
    })
    .await;
    let before = by_id(&env.export("res").await)[&first_id].clone();
    signal(&server, "INT").await;
    let out = tokio::time::timeout(ms(20_000), server.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(130),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(env.counts("res").pending, 2);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("env --resume res"), "{said}");

    let (mut server, url) = env_server(&env, &["--resume", "res", "--exit-when-done"]).await;
    // The two left, and then (--exit-when-done) the server ends.
    let mut served = Vec::new();
    for _ in 0..2 {
        let answer = reset(&url).await;
        let id = answer["env_id"].as_str().unwrap().to_owned();
        play(&url, &id, json!(3)).await;
        served.push(id);
    }
    assert!(!served.contains(&first_id));
    let status = tokio::time::timeout(ms(20_000), server.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
    let rows = by_id(&env.export("res").await);
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[&first_id]["output"], before["output"]);
    for id in &served {
        let output: Value = serde_json::from_str(rows[id]["output"].as_str().unwrap()).unwrap();
        assert_eq!(output["steps"][0]["strategy"], "plan", "{id}");
    }
    // Nothing is left to serve.
    let again = env
        .evalfleet(&["env", "--resume", "res", "--bind", "127.0.0.1:0"])
        .await;
    assert_eq!(again.code, Some(0), "{}", again.stderr);
    assert!(
        again.stderr.contains("no episode left to serve"),
        "{}",
        again.stderr
    );
}

const JAPANESE: &str = r#"name: kaiwa
endpoints:
  - { name: gpu, kind: external, base_url: "BASE", model: m, concurrency: 4 }
task:
  kind: conversation
  params: { max_tokens: 64 }
  conversation:
    rules: corrected
    max_rounds: 3
    max_steps: 1
    topics: ["引っ越しの費用"]
    personas:
      - { name: はるか }
      - { name: けんた }
      - { name: ゆい, landmines: [お金] }
    persona_messages: [{ role: user, content: "{{ speaker }} {{ turn }}" }]
    scorer: { kind: rules }
    policy:
      messages:
        - { role: system, content: "あなたは会話を見守るロボットです。" }
        - { role: user, content: "{{ target_name }}さんに向けて、1〜4の数字で答えてください。\n{{ history_text }}" }
    robot: { messages: [{ role: user, content: "robot {{ step }}" }] }
    rewards: { filter_zero_rewards: false }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_japanese_episode_round_trips_through_the_gymnasium_client_intact() {
    let Some(python) = gym_python() else {
        return;
    };
    let env = Env::new();
    // A speaks of money, ゆい's landmine: CA turns negative and the first
    // decision aims at it (at ゆい, C, the edge's first person).
    let lines_said = [
        "正直、お金の話はもうしたくない。",
        "でも、前の家よりずっと広いよね 🏠",
        "私はどちらでもいいけど、早く決めたい。",
    ];
    let mut answers = Vec::new();
    for turn in 0..20 {
        let speaker = ["A", "B", "C"][turn % 3];
        answers.push(
            json!({"prompt": format!("{speaker} {turn}"),
            "replies": [format!("{}（{turn}）", lines_said[turn % 3])]})
            .to_string(),
        );
    }
    answers.push(
        json!({"prompt": "robot 0", "replies": ["みなさん、少し落ち着いて話しましょう。"]})
            .to_string(),
    );
    let answers = env.write("answers.jsonl", &answers.join("\n"));
    let server = scripted(answers).await;
    env.write("kaiwa.yaml", &JAPANESE.replace("BASE", &server.base_url()));
    let (mut env_server, url) = env_server(
        &env,
        &[
            "kaiwa.yaml",
            "--sessions",
            "12",
            "--run-id",
            "kaiwa",
            "--exit-when-done",
        ],
    )
    .await;
    let client = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/gym_client.py");
    let played = tokio::process::Command::new(&python)
        .args([client, &url, "--episodes", "100", "--check", "--show-text"])
        .env("PYTHONIOENCODING", "utf-8")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8(played.stdout).unwrap();
    assert!(
        played.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&played.stderr)
    );
    let status = tokio::time::timeout(ms(60_000), env_server.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
    let rows = by_id(&env.export("kaiwa").await);
    let names = ["はるか", "けんた", "ゆい"];
    let episodes: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|l| l.get("windows").is_some())
        .collect();
    assert!(!episodes.is_empty(), "{stdout}");
    for played in &episodes {
        let id = played["episode"].as_str().unwrap();
        let output: Value = serde_json::from_str(rows[id]["output"].as_str().unwrap()).unwrap();
        let step = &output["steps"][0];
        let turn = step["turn"].as_u64().unwrap() as usize;
        let said = &output["conversation"].as_array().unwrap()[..turn];
        // The window the trainer saw is the stored conversation, character
        // for character.
        let window: Vec<String> = said
            .iter()
            .map(|u| {
                format!(
                    "{}: {}",
                    u["speaker"].as_str().unwrap(),
                    u["text"].as_str().unwrap()
                )
            })
            .collect();
        assert_eq!(played["windows"][0], window.join("\n"), "{id}");
        assert!(window[1].contains("🏠"), "{window:?}");
        // The prompt is what the policy's messages make of the decision.
        let target = step["target_speaker"].as_str().unwrap();
        assert_eq!(target, "C", "{step}");
        let target_name = names[["A", "B", "C"].iter().position(|p| *p == target).unwrap()];
        let history: Vec<String> = said
            .iter()
            .map(|u| {
                let p = ["A", "B", "C"]
                    .iter()
                    .position(|p| *p == u["speaker"])
                    .unwrap();
                format!("{}: {}", names[p], u["text"].as_str().unwrap())
            })
            .collect();
        assert_eq!(
            played["prompts"][0],
            json!([
                {"role": "system", "content": "あなたは会話を見守るロボットです。"},
                {"role": "user", "content": format!("{target_name}さんに向けて、1〜4の数字で答えてください。\n{}", history.join("\n"))},
            ]),
            "{id}"
        );
    }
    // The logs keep the text as it was spoken.
    let text = std::fs::read_to_string(env.path("runs/kaiwa/conversation_summary.jsonl")).unwrap();
    assert!(text.contains("前の家よりずっと広いよね 🏠"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_while_episodes_wait_for_their_calls_leaves_them_pending() {
    let env = Env::new();
    // Every call takes 300 ms: when the trainer's actions are in, the
    // episodes' robot, persona and scorer calls are under way.
    let _mocks = spread(&env, 300, TRAINER).await;
    let (server, url) = env_server(
        &env,
        &[
            "spread.yaml",
            "--sessions",
            "12",
            "--envs",
            "4",
            "--run-id",
            "int",
        ],
    )
    .await;
    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.push(reset(&url).await["env_id"].as_str().unwrap().to_owned());
    }
    let steps: Vec<_> = ids
        .iter()
        .map(|id| {
            let (url, id) = (url.clone(), id.clone());
            tokio::spawn(async move {
                crate::serve::client()
                    .post(format!("{url}/v1/step"))
                    .json(&json!({"env_id": id, "action": 2}))
                    .send()
                    .await
            })
        })
        .collect();
    // The steps are in once the mock has their calls.
    wait_until(ms(20_000), "the steps' calls are under way", || {
        _mocks
            .iter()
            .map(|m| {
                let s = m.stats();
                s.requests - s.completed
            })
            .sum::<u64>()
            >= 2
    })
    .await;
    signal(&server, "INT").await;
    let out = tokio::time::timeout(ms(30_000), server.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(130),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for step in steps {
        let _ = step.await;
    }
    let counts = env.counts("int");
    let failed: Vec<Value> = env
        .export("int")
        .await
        .into_iter()
        .filter(|r| r["status"] == "failed")
        .map(|r| r["error"].clone())
        .collect();
    assert_eq!(counts.failed, 0, "{counts:?}: {failed:?}");
    assert_eq!(counts.pending + counts.done, 12, "{counts:?}");
}
