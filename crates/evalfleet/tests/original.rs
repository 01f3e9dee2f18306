//! Japanese conversations and configs of the original Python system: the
//! Japanese example runs with its text intact in the store and the logs;
//! an original config converts and loads directly, every key without a
//! place named; a bad one is told which key and what.

use std::collections::BTreeSet;
use std::path::Path;

use evalfleet_mock::MockSettings;
use serde_json::{Value, json};

use crate::conversation::lines as jsonl;
use crate::util::{Env, Ran, mock};

fn examples() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_japanese_example_keeps_its_text_intact_in_the_store_and_the_logs() {
    let env = Env::new();
    let config = examples().join("conversation-ja.yaml");
    let ran = env
        .evalfleet(&["simulate", config.to_str().unwrap(), "--run-id", "ja", "-q"])
        .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert!(
        ran.stderr.contains("6 episodes (0 failed)"),
        "{}",
        ran.stderr
    );

    // Every line the mock could say, as written in its answers file.
    let answers = jsonl(&examples().join("conversation-ja-answers.jsonl"));
    let said: BTreeSet<String> = answers
        .iter()
        .flat_map(|a| a["samples"].as_array().unwrap().iter())
        .map(|s| s.as_str().unwrap().to_owned())
        .collect();
    let topics = [
        "週末の家族旅行の行き先",
        "シェアハウスの家事の分担",
        "新しいプロジェクトのリーダー決め",
    ];

    // The stored episodes: every utterance one of those lines, exactly.
    let rows = env.export("ja").await;
    assert_eq!(rows.len(), 6);
    let mut heard = BTreeSet::new();
    for row in &rows {
        let record: Value = serde_json::from_str(row["output"].as_str().unwrap()).unwrap();
        let text = record.to_string();
        assert!(topics.iter().any(|t| text.contains(t)), "{text}");
        for step in record["steps"].as_array().unwrap() {
            for u in step["utterances"].as_array().unwrap() {
                let line = u["text"].as_str().unwrap();
                assert!(said.contains(line), "{line:?} is not a line of the answers");
                heard.insert(line.to_owned());
            }
        }
    }
    // Each persona and the robot spoke.
    for (i, answer) in answers.iter().enumerate().filter(|(i, _)| *i != 3) {
        assert!(
            answer["samples"]
                .as_array()
                .unwrap()
                .iter()
                .any(|s| heard.contains(s.as_str().unwrap())),
            "nothing of answer line {i} was heard"
        );
    }

    // The log: the same text, written as it is (not escaped).
    let log = env.path("runs/ja/conversation_summary.jsonl");
    let raw = std::fs::read_to_string(&log).unwrap();
    let steps = jsonl(&log);
    assert!(!steps.is_empty());
    for step in &steps {
        assert!(topics.contains(&step["topic"].as_str().unwrap()), "{step}");
        if let Some(robot) = step["robot"].as_str() {
            assert!(said.contains(robot), "{robot:?}");
            assert!(raw.contains(robot));
        }
        for u in step["utterances"].as_array().unwrap() {
            assert!(said.contains(u["text"].as_str().unwrap()), "{u}");
        }
    }
    // The Japanese rules counted: some relation is neither 0 nor the
    // same for every pair.
    assert!(
        steps
            .iter()
            .any(|s| s["relations"]["AB"] != s["relations"]["BC"]),
        "{raw}"
    );
}

/// The realistic config of the original, copied into `env`.
fn realistic(env: &Env) {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/original/config.local.yaml"
    ))
    .unwrap();
    env.write("config.local.yaml", &text);
}

/// The keys of the realistic config that have no place, with their lines.
const NOT_CONVERTED: [(&str, usize); 36] = [
    ("env.max_rounds", 6),
    ("env.debug", 12),
    ("env.reward_backend", 13),
    ("env.time_penalty", 17),
    ("env.terminal_bonus", 18),
    ("env.intervention_cost", 19),
    ("env.min_robot_intervention_lookback", 21),
    ("ollama.model_rl", 41),
    ("ollama.reward_base", 47),
    ("ollama.gen_options.num_ctx", 51),
    ("llm.azure_api_key", 56),
    ("llm.azure_api_version", 57),
    ("llm.azure_model", 58),
    ("llm.azure_embedding_deployment", 59),
    ("llm.azure_embedding_api_version", 60),
    ("llm.reasoning_effort", 61),
    ("llm.human_model", 65),
    ("llm.relation_model", 66),
    ("ppo.lr", 73),
    ("ppo.batch_size", 74),
    ("ppo.kl_coef", 76),
    ("ppo.kl_estimator", 77),
    ("ppo.target_kl", 78),
    ("ppo.num_mini_batches", 79),
    ("ppo.temperature", 81),
    ("ppo.top_p", 82),
    ("ppo.entropy_floor", 83),
    ("ppo.entropy_patience", 84),
    ("ppo.vf_coef", 85),
    ("ppo.gamma", 86),
    ("ppo.whiten_rewards", 88),
    ("ppo.device_map_strategy", 89),
    ("wandb.enabled", 99),
    ("wandb.project", 100),
    ("wandb.entity", 101),
    ("wandb.table_log_frequency", 102),
];

fn names_every_key_not_converted(stderr: &str, prefix: &str) {
    for (key, line) in NOT_CONVERTED {
        let named = format!("{prefix}config.local.yaml:{line}: {key}: not converted: ");
        assert!(stderr.contains(&named), "{named}\nnot in\n{stderr}");
    }
    assert!(stderr.contains(
        "config.local.yaml:73: ppo.lr: not converted: training setting, not the environment's"
    ));
    assert!(stderr.contains(
        "config.local.yaml:100: wandb.project: not converted: wandb is not used; the logs are in RUN_ID/"
    ));
    assert!(stderr.contains(
        "config.local.yaml:17: env.time_penalty: not converted: obsolete reward (time_penalty)"
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_original_config_converts_with_every_key_without_a_place_named() {
    let env = Env::new();
    realistic(&env);
    let ran = env
        .evalfleet(&["convert", "config.local.yaml", "-o", "converted.yaml"])
        .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    names_every_key_not_converted(&ran.stderr, "");
    assert!(
        ran.stderr
            .contains("Wrote converted.yaml from config.local.yaml (36 of its keys not converted"),
        "{}",
        ran.stderr
    );
    let written = std::fs::read_to_string(env.path("converted.yaml")).unwrap();
    // Where each part came from, the key a reference, the names as written.
    assert!(
        written.contains(
            "# decisions per record of batch_summary.jsonl: ppo.per_device_train_batch_size x ppo.grad_accum_steps x 2, the original's effective batch\n    batch_size: 4\n"
        ),
        "{written}"
    );
    assert!(
        written.contains("      # env.output_error_penalty\n      invalid_penalty: 1.0\n"),
        "{written}"
    );
    assert!(
        written.contains("api_key: \"${AZURE_API_KEY}\""),
        "{written}"
    );
    assert!(
        written.contains("- name: 花子\n        landmines: [\"お金\",\"給料\"]\n"),
        "{written}"
    );
    // Without -o, the YAML goes to stdout and the keys to stderr.
    let ran = env.evalfleet(&["convert", "config.local.yaml"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert_eq!(ran.stdout, written);
    names_every_key_not_converted(&ran.stderr, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_original_config_and_its_conversion_load_as_the_same_run() {
    let env = Env::new();
    realistic(&env);
    let converted = env
        .evalfleet(&["convert", "config.local.yaml", "-o", "converted.yaml"])
        .await;
    assert_eq!(converted.code, Some(0), "{}", converted.stderr);
    let dry = |config: &'static str| {
        let mut command = env.command(&["simulate", config, "--dry-run"]);
        command.env("AZURE_API_KEY", "sk-test");
        async move { Ran::from(command.output().await.unwrap()) }
    };
    let direct = dry("config.local.yaml").await;
    assert_eq!(direct.code, Some(0), "{}", direct.stderr);
    names_every_key_not_converted(&direct.stderr, "  ");
    assert!(
        direct
            .stderr
            .contains("config.local.yaml: a config of the original system, converted"),
        "{}",
        direct.stderr
    );
    let via_file = dry("converted.yaml").await;
    assert_eq!(via_file.code, Some(0), "{}", via_file.stderr);
    assert_eq!(direct.stdout, via_file.stdout);
    for endpoint in [
        "endpoint policy (external):\n  base_url: https://rl-convo.openai.azure.com/openai/v1",
        "endpoint ollama-ollama_a (external):\n  base_url: http://ollama_a:11434/v1",
        "endpoint ollama-ollama_d (external):",
        "endpoint azure-gpt-5-mini (external):",
    ] {
        assert!(
            direct.stdout.contains(endpoint),
            "{endpoint}\nnot in\n{}",
            direct.stdout
        );
    }
}

/// An original config of the kind that runs on Ollama alone: its servers
/// are not reachable, and the environment points the run at mocks.
const ON_OLLAMA: &str = "\
# Ollama だけで動かす設定
env:
  max_rounds: 2
  max_steps: 1
  personas: [さくら, ゆうと, はるか]
scorer:
  backend: rule
ollama:
  base_url: http://ollama_unreachable:11434
  model: qwen3:4b
  gen_options: { temperature: 0.7 }
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_original_config_runs_on_the_servers_its_environment_variables_name() {
    let env = Env::new();
    env.write("ollama.yaml", ON_OLLAMA);
    let voices = mock(MockSettings::default()).await;
    let others = mock(MockSettings::default()).await;
    let base = |m: &evalfleet_mock::MockServer| m.base_url().trim_end_matches("/v1").to_owned();
    let mut command = env.command(&[
        "simulate",
        "ollama.yaml",
        "--sessions",
        "2",
        "--run-id",
        "o",
        "-q",
    ]);
    command
        .env("OLLAMA_BASES", base(&voices))
        .env("OLLAMA_BASE", base(&others))
        .env_remove("AZURE_ENDPOINT");
    let ran = Ran::from(command.output().await.unwrap());
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert!(
        ran.stderr.contains("2 episodes (0 failed)"),
        "{}",
        ran.stderr
    );
    // The personas spoke on OLLAMA_BASES, the policy, topics and robot
    // went to OLLAMA_BASE; the file's server was never called.
    assert!(voices.stats().requests >= 2 * 6, "{:?}", voices.stats());
    assert!(others.stats().requests >= 2, "{:?}", others.stats());
    let rows = env.export("o").await;
    assert_eq!(rows.len(), 2);
    assert!(rows.iter().all(|r| r["status"] == "done"), "{rows:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_original_config_is_told_which_key_and_what() {
    let env = Env::new();
    env.write(
        "bad.yaml",
        "env:\n  personas: [A, B, C]\n  max_steps: six\nscorer:\n  backend: gpt4\nllm:\n  azure_endpoint: https://x.openai.azure.com\n",
    );
    for command in ["simulate", "convert"] {
        let ran = env.evalfleet(&[command, "bad.yaml"]).await;
        assert_eq!(ran.code, Some(2), "{command}: {}", ran.stderr);
        assert!(
            ran.stderr.contains(
                "bad.yaml:3: env.max_steps: must be a whole number at least 0, got \"six\""
            ),
            "{command}: {}",
            ran.stderr
        );
        assert!(
            ran.stderr.contains(
                "bad.yaml:5: scorer.backend: must be rule, ollama, azure or openai, got 'gpt4'"
            ),
            "{command}: {}",
            ran.stderr
        );
    }
    // An evalfleet config is not converted.
    env.write(
        "ours.yaml",
        "name: x\ntask: {kind: conversation}\nenv: {}\n",
    );
    let ran = env.evalfleet(&["convert", "ours.yaml"]).await;
    assert_eq!(ran.code, Some(2), "{}", ran.stderr);
    assert!(
        ran.stderr.contains("not a config of the original system"),
        "{}",
        ran.stderr
    );
}

/// The original config's triggers (triggers.json beside the vectors).
fn original_triggers() -> [Vec<String>; 3] {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/original/triggers.json"
    );
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    ["A", "B", "C"].map(|p| {
        doc[p]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().to_owned())
            .collect()
    })
}

/// A scenario's config under `rules: original`: every call's message says
/// what the scripted mock answers (the scorer's and the personas' by the
/// utterances spoken so far, as the vectors' script keys them).
fn scenario_config(scenario: &Value, base_url: &str, dataset: &Path) -> String {
    let env = &scenario["config"]["env"];
    let num = |key: &str, default: u64| env[key].as_u64().unwrap_or(default);
    let personas: Vec<String> = ["A", "B", "C"]
        .iter()
        .zip(original_triggers())
        .map(|(name, t)| {
            format!(
                "      - {{ name: {name}, landmines: {} }}",
                serde_json::to_string(&t).unwrap()
            )
        })
        .collect();
    format!(
        r#"name: original
dataset: {{ path: "{}", id_field: id }}
endpoints:
  - {{ name: gpu, kind: external, base_url: "{base_url}", model: m, concurrency: 1 }}
task:
  kind: conversation
  params: {{ max_tokens: 64 }}
  conversation:
    rules: original
    require_hiragana: true
    max_steps: {}
    personas:
{}
    history: {{ persona: 12, scorer: 3, policy: 3, robot: 6 }}
    persona_messages: [{{ role: user, content: "say {{{{ spoken }}}}" }}]
    topic: {{ messages: [{{ role: user, content: "topic" }}] }}
    scorer:
      messages: [{{ role: user, content: "score {{{{ spoken }}}}" }}]
      use_ema: {}
      ema_formula: adaptive
      decay_factor: 1.5
      start_relation_check_after_utterances: {}
    policy: {{ kind: external, messages: [{{ role: user, content: "{{{{ observation }}}}" }}] }}
    robot: {{ messages: [{{ role: user, content: "robot" }}] }}
    rewards:
      stable_bonus: 2.0
      preference_match_bonus: 0.5
      evaluation_horizon: 3
      terminal_bonus_duration: 2
      invalid_penalty: 1.0
      filter_zero_rewards: true
      max_auto_skip: {}
"#,
        dataset.display(),
        num("max_steps", 8),
        personas.join("\n"),
        scenario["config"]["scorer"]["use_ema"]
            .as_bool()
            .unwrap_or(false),
        num("start_relation_check_after_utterances", 3),
        num("max_auto_skip", 10),
    )
}

/// The mock's script of a scenario: the persona line and the scorer's
/// reply for each number of utterances spoken, the robot's and the
/// topic's lines in turn (the vectors script's defaults).
fn scenario_answers(scenario: &Value) -> String {
    let utterances = scenario["utterances"].as_array().unwrap();
    let replies = scenario["scorer_replies"].as_object().unwrap();
    let mut lines = Vec::new();
    for (n, line) in utterances.iter().enumerate() {
        lines.push(serde_json::json!({"prompt": format!("say {n}"), "replies": [line]}));
    }
    for n in 0..=utterances.len() {
        let at = replies
            .keys()
            .filter_map(|k| k.parse::<usize>().ok())
            .filter(|&k| k <= n)
            .max();
        if let Some(at) = at {
            lines.push(serde_json::json!({"prompt": format!("score {n}"), "replies": [replies[&at.to_string()]]}));
        }
    }
    let robot: Vec<String> = (1..=40)
        .map(|i| format!("ロボットの介入その{i}です。"))
        .collect();
    let topics: Vec<String> = (1..=10).map(|i| format!("話題その{i}")).collect();
    lines.push(serde_json::json!({"prompt": "robot", "samples": robot}));
    lines.push(serde_json::json!({"prompt": "topic", "samples": topics}));
    lines
        .iter()
        .map(Value::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_originals_scenarios_play_through_the_environment_server_as_its_code_played_them() {
    use crate::conversation::{env_server, post, reset};
    use serde_json::json;
    let data = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/original"));
    let read = |name: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(data.join(name)).unwrap()).unwrap()
    };
    let scenarios = read("conversation_scenarios.json");
    let vectors = read("conversation_vectors.json");
    let mut played = 0;
    for (scenario, vector) in scenarios["scenarios"]
        .as_array()
        .unwrap()
        .iter()
        .zip(vectors["scenarios"].as_array().unwrap())
    {
        let name = scenario["name"].as_str().unwrap();
        // The original's first episode: its events to the first `done`.
        let events = vector["events"].as_array().unwrap();
        let end = events
            .iter()
            .position(|e| e["done"] == true)
            .map_or(events.len(), |i| i + 1);
        let first = &events[..end];
        let prompts: Vec<&str> = first
            .iter()
            .filter(|e| e["event"] == "policy_prompt")
            .map(|e| e["observation"].as_str().unwrap())
            .collect();
        if prompts.is_empty() {
            // An episode that ends before any decision has nothing to
            // hand a trainer (stable_step_to_done: played by the unit
            // test).
            continue;
        }
        let rewards: Vec<f64> = first
            .iter()
            .filter(|e| e["event"] == "decision")
            .map(|e| e["total_reward"].as_f64().unwrap())
            .collect();
        let spoken: Vec<&str> = first
            .iter()
            .flat_map(|e| e["utterances"].as_array().into_iter().flatten())
            .map(|u| u["spoken"].as_str().unwrap())
            .collect();
        let scorer_calls: u64 = first
            .iter()
            .flat_map(|e| e["scorer_calls"].as_array().into_iter().flatten())
            .map(|c| c["llm_calls"].as_u64().unwrap())
            .sum();

        let env = Env::new();
        let answers = env.write("answers.jsonl", &scenario_answers(scenario));
        let mock = crate::util::scripted(answers).await;
        let dataset = env.write(
            "episodes.jsonl",
            &format!("{}\n", json!({"id": "e0", "seed": scenario["seed"]})),
        );
        env.write(
            "original.yaml",
            &scenario_config(scenario, &mock.base_url(), &dataset),
        );
        let (mut server, url) = env_server(
            &env,
            &["original.yaml", "--run-id", "orig", "--exit-when-done"],
        )
        .await;
        let mut answer = reset(&url).await;
        let env_id = answer["env_id"].as_str().unwrap().to_owned();
        let actions = scenario["actions"].as_array().unwrap();
        let mut got_prompts = Vec::new();
        let mut got_rewards = Vec::new();
        for action in actions {
            let prompt = answer["observation"]["prompt"][0]["content"]
                .as_str()
                .unwrap_or_else(|| panic!("{name}: no prompt in {answer}"))
                .to_owned();
            got_prompts.push(prompt);
            let (status, next) = post(
                &url,
                "/v1/step",
                json!({"env_id": env_id, "output": action}),
            )
            .await;
            assert_eq!(status, 200, "{name}: {next}");
            got_rewards.push(next["reward"].as_f64().unwrap());
            answer = next;
            if answer["terminated"] == true || answer["truncated"] == true {
                break;
            }
        }
        assert_eq!(got_prompts, prompts, "{name}: the policy's prompts");
        assert_eq!(got_rewards, rewards, "{name}: the rewards");
        let status = tokio::time::timeout(crate::util::ms(30_000), server.wait())
            .await
            .unwrap()
            .unwrap();
        assert!(status.success(), "{name}: {status:?}");
        let rows = env.export("orig").await;
        assert_eq!(rows.len(), 1, "{name}");
        assert_eq!(rows[0]["status"], "done", "{name}: {}", rows[0]);
        let output: Value = serde_json::from_str(rows[0]["output"].as_str().unwrap()).unwrap();
        let mut stored: Vec<&str> = Vec::new();
        for restart in output["restarts"].as_array().unwrap() {
            stored.extend(
                restart["conversation"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter(|u| u["speaker"] != "robot")
                    .map(|u| u["text"].as_str().unwrap()),
            );
        }
        stored.extend(
            output["conversation"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|u| u["speaker"] != "robot")
                .map(|u| u["text"].as_str().unwrap()),
        );
        assert_eq!(stored, spoken, "{name}: the persona lines");
        assert_eq!(output["scorer_calls"], scorer_calls, "{name}: scorer calls");
        assert_eq!(output["rules"], "original", "{name}");
        played += 1;
    }
    assert!(played >= 18, "{played} scenarios played");
}

/// An original config of three personas A, B and C on Ollama, whose
/// servers the environment names.
const ORIGINAL_JA: &str = "\
env:
  max_steps: 2
  max_rounds: 6
  personas:
    A: { triggers: [お金, 家族] }
    B: { triggers: [お金, 仕事] }
    C: { triggers: [家族, 仕事] }
  evaluation_horizon: 3
  terminal_bonus_duration: 2
  start_relation_check_after_utterances: 3
scorer:
  backend: ollama
  use_ema: false
  decay_factor: 1.5
topic_manager:
  enable: true
  generation_prompt: |
    三人で話す話題を一つ提案してください。カテゴリー：{trigger_examples}
ollama:
  base_url: http://ollama_unreachable:11434
  model: qwen3:4b
ppo:
  filter_zero_rewards: true
  per_device_train_batch_size: 1
  grad_accum_steps: 1
";

/// A chat server that answers each kind of call of an original episode in
/// Japanese (by what its messages ask) and keeps every request's
/// messages.
async fn japanese_server() -> (String, std::sync::Arc<std::sync::Mutex<Vec<Value>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            let kept = kept.clone();
            tokio::spawn(async move {
                let mut data = Vec::new();
                let mut buf = [0u8; 8192];
                let (head, body) = loop {
                    let n = socket.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    data.extend_from_slice(&buf[..n]);
                    if let Some(at) = data.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&data[..at]).to_string();
                        let length = head
                            .lines()
                            .find_map(|l| {
                                let (k, v) = l.split_once(':')?;
                                k.eq_ignore_ascii_case("content-length")
                                    .then(|| v.trim().parse::<usize>().ok())?
                            })
                            .unwrap_or(0);
                        while data.len() < at + 4 + length {
                            let n = socket.read(&mut buf).await.unwrap_or(0);
                            if n == 0 {
                                return;
                            }
                            data.extend_from_slice(&buf[..n]);
                        }
                        break (head, data[at + 4..at + 4 + length].to_vec());
                    }
                };
                let answer = if head.starts_with("GET") {
                    serde_json::json!({"object": "list", "data": [{"id": "qwen3:4b", "object": "model"}]})
                } else {
                    let request: Value = serde_json::from_slice(&body).unwrap_or_default();
                    let messages = request["messages"].clone();
                    let all: String = messages
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|m| m["content"].as_str())
                        .collect::<Vec<_>>()
                        .join("\n");
                    kept.lock().unwrap().push(messages);
                    let text = if all.contains("[あなたの返答]") {
                        "そうですね、わたしはもう少し話し合いたいです。".to_owned()
                    } else if all.contains("答えの形式") {
                        // AB negative, the others positive: ++- unstable.
                        "A-B: -0.4\nA-C: 0.5\nB-C: 0.6".to_owned()
                    } else if all.contains("[既に提案した話題]") {
                        "家族旅行の計画について".to_owned()
                    } else if all.contains("数字1桁") {
                        "2".to_owned()
                    } else {
                        "AさんとBさん、お二人には同じ願いがありますね。".to_owned()
                    };
                    serde_json::json!({
                        "id": "c", "object": "chat.completion", "model": "qwen3:4b",
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": text}}],
                        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
                    })
                };
                let body = answer.to_string();
                let reply = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = socket.write_all(reply.as_bytes()).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    (url, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_converted_original_config_plays_its_episodes_in_japanese() {
    let env = Env::new();
    env.write("original.yaml", ORIGINAL_JA);
    let (url, seen) = japanese_server().await;
    // The servers its environment names, as the original reads them.
    let mut command = env.command(&["convert", "original.yaml", "-o", "converted.yaml"]);
    command
        .env("OLLAMA_BASES", &url)
        .env("OLLAMA_BASE", &url)
        .env_remove("AZURE_ENDPOINT");
    let converted = Ran::from(command.output().await.unwrap());
    assert_eq!(converted.code, Some(0), "{}", converted.stderr);
    assert!(
        converted
            .stderr
            .contains("env.max_rounds: not converted: unused by the original"),
        "{}",
        converted.stderr
    );
    let written = std::fs::read_to_string(env.path("converted.yaml")).unwrap();
    assert!(written.contains("rules: original"), "{written}");
    assert!(!written.contains("    max_rounds:"), "{written}");
    let mut command = env.command(&[
        "simulate",
        "converted.yaml",
        "--sessions",
        "2",
        "--run-id",
        "ja",
        "-q",
    ]);
    command.env_remove("AZURE_ENDPOINT");
    let ran = Ran::from(command.output().await.unwrap());
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let rows = env.export("ja").await;
    assert_eq!(rows.len(), 2);
    for row in &rows {
        assert_eq!(row["status"], "done", "{row}");
        let output: Value = serde_json::from_str(row["output"].as_str().unwrap()).unwrap();
        assert_eq!(output["rules"], "original");
        assert_eq!(output["topics"][0], "家族旅行の計画について");
        // Two steps of the environment, each a decision of 2 (bridge) on
        // AB, the only negative edge.
        let steps = output["steps"].as_array().unwrap();
        assert_eq!(steps.len(), 2, "{output}");
        for step in steps {
            assert_eq!(step["strategy"], "bridge");
            assert_eq!(step["target_edge"], "AB");
            assert_eq!(
                step["robot"],
                "AさんとBさん、お二人には同じ願いがありますね。"
            );
        }
        // Every persona line is the model's (it has hiragana).
        for line in output["conversation"].as_array().unwrap() {
            if line["speaker"] != "robot" {
                assert_eq!(
                    line["text"],
                    "そうですね、わたしはもう少し話し合いたいです。"
                );
            }
        }
    }
    // What the calls were told: the original's prompts in Japanese.
    let seen = seen.lock().unwrap();
    let contents = |m: &Value| -> String {
        m.as_array()
            .unwrap()
            .iter()
            .map(|x| x["content"].as_str().unwrap_or_default().to_owned())
            .collect::<Vec<_>>()
            .join("\n")
    };
    let texts: Vec<String> = seen.iter().map(contents).collect();
    let persona: Vec<&String> = texts
        .iter()
        .filter(|t| t.contains("[あなたの返答]"))
        .collect();
    assert!(
        persona
            .iter()
            .all(|t| t.contains("テーマ：家族旅行の計画について"))
    );
    assert!(
        persona
            .iter()
            .any(|t| t.contains("[ロボット] AさんとBさん")),
        "the robot's line in the history"
    );
    assert!(
        persona.iter().any(|t| t.contains("心の中で")),
        "a need told after a decision"
    );
    let topic: Vec<&String> = texts
        .iter()
        .filter(|t| t.contains("[既に提案した話題]"))
        .collect();
    assert_eq!(topic.len(), 2);
    assert!(
        topic.iter().all(|t| ["お金", "家族", "仕事"]
            .iter()
            .any(|w| t.contains(&format!("カテゴリー：{w}")))),
        "{topic:?}"
    );
    let scorer: Vec<&String> = texts.iter().filter(|t| t.contains("答えの形式")).collect();
    assert!(
        scorer.iter().all(|t| t.ends_with("A-B:\nA-C:\nB-C:")),
        "{scorer:?}"
    );
    let policy: Vec<&String> = texts.iter().filter(|t| t.contains("数字1桁")).collect();
    assert_eq!(policy.len(), 4);
    assert!(
        policy
            .iter()
            .all(|t| t.contains("改善すべきエッジ: AB (現在: -0.40)")),
        "{policy:?}"
    );

    // The logs are the original trainer's: records read as its analysis
    // scripts read them (split at the lines of 80 `=`, each a JSON object).
    let records = |name: &str| -> Vec<Value> {
        let text = std::fs::read_to_string(env.path("runs/ja").join(name)).unwrap();
        assert!(text.ends_with(&format!("\n{}\n", "=".repeat(80))), "{text}");
        text.split(&"=".repeat(80))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(|t| serde_json::from_str(t).unwrap_or_else(|e| panic!("{e}: {t}")))
            .collect()
    };
    let decisions = records("conversation_summary.jsonl");
    assert_eq!(decisions.len(), 4, "{decisions:?}");
    for (i, d) in decisions.iter().enumerate() {
        assert_eq!(d["interaction_id"], i as u64 + 1);
        assert_eq!(d["episode"], i as u64 / 2 + 1);
        assert_eq!(d["turn"], i as u64 % 2 + 1);
        assert_eq!(d["intervention"]["intervened"], true, "{d}");
        assert_eq!(d["intervention"]["strategy"], "bridge", "{d}");
        assert_eq!(d["intervention"]["llm_raw_output"], "2", "{d}");
        assert_eq!(d["relation"]["is_stable"], false, "{d}");
        assert_eq!(d["relation"]["edges"]["A,B"], -0.4, "{d}");
        assert_eq!(d["relations_after_horizon"]["is_stable"], false, "{d}");
        assert_eq!(d["chosen_strategy"], "bridge");
        assert!(d["reward"]["total"].is_number(), "{d}");
        assert_eq!(d.get("episode_summary").is_some(), i % 2 == 1, "{d}");
        assert!(d["timestamp"].as_str().unwrap().ends_with('Z'));
    }
    // The first decision of an episode has its opening and its moods.
    assert_eq!(
        decisions[0]["initial_conversation"]
            .as_array()
            .unwrap()
            .len(),
        3
    );
    assert_eq!(
        decisions[0]["episode_info"]["topic"],
        "家族旅行の計画について"
    );
    // A batch per two decisions (1 x 1 x 2), written before the decision
    // that fills it, all four strategies counted as the original does.
    let batches = records("batch_summary.jsonl");
    assert_eq!(batches.len(), 2, "{batches:?}");
    for (i, b) in batches.iter().enumerate() {
        assert_eq!(b["batch_summary"]["batch_id"], i as u64 + 1);
        assert_eq!(b["batch_summary"]["batch_size"], 2);
        assert_eq!(b["batch_summary"]["strategy_counts"], json!({"bridge": 2}));
        assert_eq!(b["batch_summary"]["total_interventions"], 2);
        assert_eq!(b["batch_summary"]["choice_entropy"]["strategy"], 0.0);
        assert_eq!(b["step"], i as u64 * 2 + 2);
    }
}
