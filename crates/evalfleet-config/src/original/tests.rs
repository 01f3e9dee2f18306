use std::collections::{BTreeSet, HashMap};

use serde_json::{Value, json};

use super::*;
use crate::parse_yaml;

/// A config as the original's users write theirs (all sections, Japanese
/// comments and names, triggers): the one the binary's tests use too.
const REALISTIC: &str = include_str!("../../../evalfleet/tests/data/original/config.local.yaml");

/// Only the variables given are read (none from the process).
fn vars(given: &[(&str, &str)]) -> Vars {
    let map: HashMap<String, String> = given
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let names: BTreeSet<String> = map.keys().cloned().collect();
    Vars::from_map(map).only(names)
}

fn converted(text: &str, given: &[(&str, &str)]) -> Conversion {
    let doc = parse_yaml(text).unwrap();
    assert!(is_original(&doc.value));
    convert(&doc, "config.local.yaml", "config.local", &vars(given))
        .unwrap_or_else(|problems| panic!("{problems:?}"))
}

fn problems(text: &str) -> Vec<String> {
    let doc = parse_yaml(text).unwrap();
    match convert(&doc, "bad.yaml", "bad", &vars(&[])) {
        Ok(c) => panic!("converted: {}", c.yaml),
        Err(problems) => problems.into_iter().map(|(_, m)| m).collect(),
    }
}

fn endpoint<'a>(config: &'a Value, name: &str) -> &'a Value {
    config["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == name)
        .unwrap_or_else(|| panic!("no endpoint {name} in {config:#}"))
}

#[test]
fn each_key_of_a_realistic_config_lands_where_it_should() {
    let c = converted(REALISTIC, &[]);
    let v = &c.document.value;
    let conv = &v["task"]["conversation"];
    assert_eq!(v["name"], "config.local");
    assert_eq!(v["task"]["kind"], "conversation");
    // The original's rules; max_rounds, unused there, is named.
    assert_eq!(conv["rules"], "original");
    assert_eq!(conv["max_steps"], 8);
    assert_eq!(conv["max_rounds"], Value::Null);
    // Windows: the policy's own, the robot's from the deprecated fallback.
    assert_eq!(
        conv["history"],
        json!({"persona": 12, "scorer": 3, "policy": 9, "robot": 8})
    );
    // Personas, their triggers, each on its GPU's Ollama.
    let personas = conv["personas"].as_array().unwrap();
    let names: Vec<&str> = personas
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["花子", "太郎", "次郎"]);
    assert_eq!(personas[0]["landmines"], json!(["お金", "給料"]));
    assert_eq!(personas[2]["landmines"], json!(["締め切り"]));
    for (persona, host) in personas.iter().zip(["ollama_a", "ollama_b", "ollama_c"]) {
        let e = endpoint(v, persona["endpoint"].as_str().unwrap());
        assert_eq!(e["base_url"], format!("http://{host}:11434/v1"));
        assert_eq!(e["model"], "qwen3:8b");
        assert_eq!(e["role"], "judge");
        assert_eq!(e["params"], json!({"temperature": 0.8, "top_p": 0.9}));
    }
    // The scorer on its own Ollama, with the original's smoothing.
    let scorer = &conv["scorer"];
    assert_eq!(scorer["kind"], "llm");
    assert_eq!(scorer["use_ema"], true);
    assert_eq!(scorer["ema_formula"], "adaptive");
    assert_eq!(scorer["decay_factor"], 1.5);
    assert_eq!(scorer["start_relation_check_after_utterances"], 3);
    let e = endpoint(v, scorer["endpoint"].as_str().unwrap());
    assert_eq!(e["base_url"], "http://ollama_d:11434/v1");
    // Azure deployments, the key a reference only.
    let policy = endpoint(v, "policy");
    assert_eq!(
        policy["base_url"],
        "https://rl-convo.openai.azure.com/openai/v1"
    );
    assert_eq!(policy["model"], "gpt-5-chat");
    assert_eq!(policy["api_key"], "${AZURE_API_KEY}");
    assert!(policy.get("role").is_none(), "the policy answers the items");
    let topic = endpoint(v, conv["topic"]["endpoint"].as_str().unwrap());
    assert_eq!(topic["model"], "gpt-5-mini");
    assert_eq!(topic["role"], "judge");
    let robot = endpoint(v, conv["robot"]["endpoint"].as_str().unwrap());
    assert_eq!(robot["model"], "gpt-5-chat");
    assert_eq!(robot["role"], "judge");
    // Rewards and the training keys that are the environment's.
    assert_eq!(
        conv["rewards"],
        json!({"stable_bonus": 2.0, "preference_match_bonus": 0.5, "evaluation_horizon": 3,
               "terminal_bonus_duration": 2, "invalid_penalty": 1.0, "max_auto_skip": 10,
               "filter_zero_rewards": true})
    );
    // The original trainer's effective batch: 1 x grad_accum_steps 2 x 2.
    assert_eq!(conv["batch_size"], 4);
    assert_eq!(
        v["retry"],
        json!({"max_attempts": 5, "backoff_base": "1500ms"})
    );
    // The topic prompt, its placeholder the trigger drawn for the topic;
    // the topics proposed so far in a message of their own.
    let content = conv["topic"]["messages"][0]["content"].as_str().unwrap();
    assert_eq!(conv["topic"]["messages"][0]["role"], "system");
    assert!(
        content.contains("望ましいです: {{ trigger if trigger else \"様々なテーマ\" }}\n"),
        "{content}"
    );
    let render = |content: &str, trigger: Option<&str>| {
        minijinja::Environment::new()
            .render_str(
                content,
                minijinja::context! { used_topics => ["家事の分担"], trigger => trigger },
            )
            .unwrap()
    };
    assert!(
        render(content, Some("給料")).contains("望ましいです: 給料\n"),
        "{content}"
    );
    assert!(render(content, None).contains("望ましいです: 様々なテーマ\n"));
    let used = conv["topic"]["messages"][1]["content"].as_str().unwrap();
    assert_eq!(render(used, None), "[既に提案した話題]\n- 家事の分担\n");
    // A key written in the file is never copied.
    let c = converted(
        &REALISTIC.replace(r#"azure_api_key: """#, r#"azure_api_key: "sk-clear-123""#),
        &[],
    );
    assert!(!c.yaml.contains("sk-clear-123"));
    assert!(!c.document.value.to_string().contains("sk-clear-123"));
    assert!(c.notes.iter().any(|n| n.key == "llm.azure_api_key"));
}

#[test]
fn every_key_with_no_place_is_named_with_its_line_and_why() {
    let c = converted(REALISTIC, &[]);
    let keys: BTreeSet<&str> = c.notes.iter().map(|n| n.key.as_str()).collect();
    let mut expected: BTreeSet<&str> = [
        "env.max_rounds",
        "env.debug",
        "env.reward_backend",
        "env.time_penalty",
        "env.terminal_bonus",
        "env.intervention_cost",
        "env.min_robot_intervention_lookback",
        "ollama.model_rl",
        "ollama.reward_base",
        "ollama.gen_options.num_ctx",
        "llm.azure_api_key",
        "llm.azure_api_version",
        "llm.azure_model",
        "llm.azure_embedding_deployment",
        "llm.azure_embedding_api_version",
        "llm.reasoning_effort",
        "llm.human_model",
        "llm.relation_model",
    ]
    .into();
    for key in [
        "lr",
        "batch_size",
        "kl_coef",
        "kl_estimator",
        "target_kl",
        "num_mini_batches",
        "temperature",
        "top_p",
        "entropy_floor",
        "entropy_patience",
        "vf_coef",
        "gamma",
        "whiten_rewards",
        "device_map_strategy",
    ] {
        expected.insert(Box::leak(format!("ppo.{key}").into_boxed_str()));
    }
    for key in ["enabled", "project", "entity", "table_log_frequency"] {
        expected.insert(Box::leak(format!("wandb.{key}").into_boxed_str()));
    }
    assert_eq!(keys, expected);
    let by_key = |key: &str| c.notes.iter().find(|n| n.key == key).unwrap();
    let lr = by_key("ppo.lr");
    assert_eq!(lr.line, Some(73));
    assert_eq!(
        lr.render("config.local.yaml"),
        "config.local.yaml:73: ppo.lr: not converted: training setting, not the environment's (a trainer takes decisions through `evalfleet env`)"
    );
    assert!(
        by_key("wandb.project")
            .why
            .starts_with("wandb is not used; the logs are in RUN_ID/")
    );
    assert!(
        by_key("env.time_penalty")
            .why
            .starts_with("obsolete reward (time_penalty)")
    );
    assert_eq!(by_key("env.time_penalty").line, Some(17));
    assert!(by_key("ollama.model_rl").why.contains("qwen3-rl:4b"));
    // In the file's order, and listed at the end of the YAML too.
    let lines: Vec<usize> = c.notes.iter().map(|n| n.line.unwrap()).collect();
    assert!(lines.windows(2).all(|w| w[0] <= w[1]), "{lines:?}");
    assert!(
        c.yaml
            .contains("# config.local.yaml:73: ppo.lr: not converted:")
    );
}

#[test]
fn the_yaml_written_reads_back_as_the_config_and_says_where_parts_came_from() {
    let c = converted(REALISTIC, &[]);
    let back = parse_yaml(&c.yaml).unwrap_or_else(|e| panic!("{e:?}\n{}", c.yaml));
    assert_eq!(back.value, c.document.value, "{}", c.yaml);
    assert!(c.yaml.contains("# env.max_steps\n"), "{}", c.yaml);
    assert!(
        c.yaml.contains("# decisions per record of batch_summary.jsonl: ppo.per_device_train_batch_size x ppo.grad_accum_steps x 2"),
        "{}",
        c.yaml
    );
    assert!(
        c.yaml.contains("robot: env.max_history (deprecated;"),
        "{}",
        c.yaml
    );
    // The converted config's keys carry the lines of the keys they came
    // from, so that its problems point into the original.
    assert_eq!(c.document.lines["task.conversation.max_steps"], 5);
    assert_eq!(
        c.document.lines["task.conversation.rewards.invalid_penalty"],
        20
    );
}

#[test]
fn environment_variables_override_the_file_as_the_original_does() {
    let c = converted(
        REALISTIC,
        &[
            ("OLLAMA_BASES", "http://gpu1:11434, http://gpu2:11434/"),
            ("OLLAMA_SCORER_BASE", "http://scorer:11434"),
            ("AZURE_ENDPOINT", "https://other.openai.azure.com"),
            ("TOPIC_MODEL", "gpt-5-nano"),
            ("INTERVENTION_MODEL", "o4-mini"),
            ("AZURE_API_KEY", "sk-never-written"),
        ],
    );
    let v = &c.document.value;
    let conv = &v["task"]["conversation"];
    let base = |i: usize| {
        endpoint(v, conv["personas"][i]["endpoint"].as_str().unwrap())["base_url"].clone()
    };
    // Two GPUs for three personas: the third shares the first's.
    assert_eq!(base(0), "http://gpu1:11434/v1");
    assert_eq!(base(1), "http://gpu2:11434/v1");
    assert_eq!(base(2), "http://gpu1:11434/v1");
    let scorer = endpoint(v, conv["scorer"]["endpoint"].as_str().unwrap());
    assert_eq!(scorer["base_url"], "http://scorer:11434/v1");
    let policy = endpoint(v, "policy");
    assert_eq!(
        policy["base_url"],
        "https://other.openai.azure.com/openai/v1"
    );
    assert_eq!(policy["model"], "o4-mini");
    assert_eq!(
        endpoint(v, conv["topic"]["endpoint"].as_str().unwrap())["model"],
        "gpt-5-nano"
    );
    assert!(
        c.yaml.contains("from INTERVENTION_MODEL (environment)"),
        "{}",
        c.yaml
    );
    assert!(!c.yaml.contains("sk-never-written"));
    // The file's Ollama bases are not called any more.
    assert!(c.notes.iter().any(|n| n.key == "ollama.scorer_base"));
}

#[test]
fn a_rule_scorer_and_ollama_alone_need_no_azure() {
    let text = "env:\n  personas: [A, B, C]\nscorer:\n  backend: rule\nollama:\n  base_url: http://localhost:11434\n  model: qwen3:4b\n  model_rl: qwen3-rl\nllm:\n  human_model: gpt-5-chat\n";
    let c = converted(text, &[]);
    let v = &c.document.value;
    let conv = &v["task"]["conversation"];
    assert_eq!(conv["scorer"]["kind"], "rules");
    assert!(conv["scorer"].get("endpoint").is_none());
    // The policy is the trained model, on the Ollama server.
    let policy = endpoint(v, "policy");
    assert_eq!(policy["model"], "qwen3-rl");
    assert_eq!(policy["base_url"], "http://localhost:11434/v1");
    let notes: Vec<&str> = c.notes.iter().map(|n| n.key.as_str()).collect();
    assert_eq!(notes, ["llm.human_model"], "{:?}", c.notes);
    assert!(c.notes[0].why.contains("no call goes to Azure OpenAI"));
    // Names as a list; a legacy top-level list too, named as replaced.
    let text = "personas: [X, Y, Z]\n".to_owned() + text;
    let c = converted(&text, &[]);
    assert!(
        c.notes
            .iter()
            .any(|n| n.key == "personas" && n.line == Some(1))
    );
}

#[test]
fn unknown_keys_are_named_not_dropped() {
    let text = "env:\n  personas: {A: {triggers: [x], mood: calm}, B: null, C: {}}\n  max_rounds: 3\n  colour: blue\nlogging: {level: debug}\nscorer: {backend: rule}\nollama: {base_url: 'http://h:1', model: m}\n";
    let c = converted(text, &[]);
    let named: Vec<(&str, Option<usize>)> =
        c.notes.iter().map(|n| (n.key.as_str(), n.line)).collect();
    assert_eq!(
        named,
        [
            ("env.personas.A.mood", Some(2)),
            ("env.max_rounds", Some(3)),
            ("env.colour", Some(4)),
            ("logging", Some(5))
        ],
    );
    assert!(c.notes[1].why.starts_with("unused by the original"));
    assert!(
        c.notes[3]
            .why
            .starts_with("not a section of the original's config")
    );
}

#[test]
fn a_bad_original_config_is_told_which_key_and_what() {
    let found = problems(
        "env:\n  max_rounds: six\n  personas: [A, B]\n  stable_bonus: true\nscorer:\n  backend: gpt\n  decay_factor: -1\nllm:\n  provider: bedrock\n  azure_endpoint: https://x.openai.azure.com\n  max_attempts: -2\n",
    );
    for expected in [
        "env.personas: must name three personas (A, B and C, in that order), got 2",
        "env.stable_bonus: must be a number, got true",
        "scorer.backend: must be rule, ollama, azure or openai, got 'gpt'",
        "scorer.decay_factor: must be above 0, got -1",
        "llm.provider: must be azure (Azure OpenAI), got 'bedrock'",
        "llm.max_attempts: must be a whole number at least 0, got -2",
    ] {
        assert!(
            found.iter().any(|m| m == expected),
            "{expected}\nin {found:#?}"
        );
    }
    let found = problems("env: {max_rounds: 2}\n");
    assert!(found[0].contains("names no model server"), "{found:?}");
    let found =
        problems("env: {}\nscorer: {backend: ollama}\nllm: {azure_endpoint: 'https://x'}\n");
    assert!(
        found
            .iter()
            .any(|m| m
                .starts_with("scorer.backend: is ollama, but the config names no Ollama server")),
        "{found:?}"
    );
}

#[test]
fn only_a_top_level_env_without_task_is_the_original_shape() {
    assert!(is_original(&json!({"env": {}, "scorer": {}})));
    assert!(!is_original(&json!({"env": {}, "task": {}})));
    assert!(!is_original(&json!({"env": "x"})));
    assert!(!is_original(&json!({"name": "x"})));
}

#[test]
fn a_realistic_config_loads_directly_as_its_conversion_does() {
    use crate::{EmaFormula, Overrides, ScorerKind, load_file, load_text};
    let dir = tempfile::tempdir().unwrap();
    // The key where the original keeps it: the .env beside the config.
    std::fs::write(dir.path().join(".env"), "AZURE_API_KEY=sk-from-dotenv\n").unwrap();
    let file = dir.path().join("config.local.yaml");
    std::fs::write(&file, REALISTIC).unwrap();
    let direct = load_file(&file, Overrides::default()).unwrap_or_else(|e| panic!("{e}"));
    let c = converted(REALISTIC, &[]);
    let via_yaml = load_text(
        &c.yaml,
        dir.path(),
        Overrides::default(),
        "converted.yaml",
        None,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    for loaded in [&direct, &via_yaml] {
        let settings = loaded.config.task.kind.conversation().unwrap();
        assert_eq!(settings.scorer.kind, ScorerKind::Llm);
        assert!(settings.scorer.use_ema);
        assert_eq!(settings.scorer.ema_formula, EmaFormula::Adaptive);
        assert_eq!(settings.scorer.decay_factor, 1.5);
        assert_eq!(settings.rewards.invalid_penalty, 1.0);
        assert_eq!(settings.max_auto_skip, 10);
        assert_eq!(settings.batch_size, 4);
        assert_eq!(settings.history.policy, 9);
        assert_eq!(settings.personas[1].landmines, ["母親", "実家"]);
        let policy = loaded
            .config
            .endpoints
            .iter()
            .find(|e| e.name == "policy")
            .unwrap();
        assert_eq!(
            policy.api_key.as_ref().map(|k| k.expose()),
            Some("sk-from-dotenv")
        );
        // Stored with the reference, not the key.
        assert!(!loaded.snapshot.to_string().contains("sk-from-dotenv"));
    }
    assert_eq!(direct.notes.len(), c.notes.len());
    assert!(direct.notes[0].ends_with("env.max_rounds: not converted: unused by the original (its environment ends at env.max_steps only), and so by rules: original"), "{:?}", direct.notes);
    assert!(direct.notes[1].ends_with("env.debug: not converted: evalfleet's logging is set with -v or EVALFLEET_LOG; every call is stored with its run"), "{:?}", direct.notes);
    // A problem found after the conversion points at the original's line.
    std::fs::write(&file, REALISTIC.replace("max_steps: 8 ", "max_steps: 0 ")).unwrap();
    let err = load_file(&file, Overrides::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(
            "config.local.yaml:5: task.conversation.max_steps: must be at least 1 with rules: original"
        ),
        "{err}"
    );
}

#[test]
fn awkward_texts_survive_the_yaml_and_stay_literal_in_templates() {
    let text = r##"env:
  personas:
    "yes": { triggers: ["a: b", "# not a comment"] }
    "123": { triggers: ["${HOME}"] }
    "名前 with space": null
scorer: { backend: rule }
ollama: { base_url: "http://h:1", model: m }
topic_manager:
  generation_prompt: "Topics like {trigger_examples}.\n  indented: {{ not a tag }}\n# hash\n"
"##;
    let c = converted(text, &[]);
    let back = parse_yaml(&c.yaml).unwrap_or_else(|e| panic!("{e:?}\n{}", c.yaml));
    assert_eq!(back.value, c.document.value, "{}", c.yaml);
    let conv = &c.document.value["task"]["conversation"];
    let names: Vec<&str> = conv["personas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["yes", "123", "名前 with space"]);
    // `${` stays literal when the config's variables are expanded.
    assert_eq!(conv["personas"][1]["landmines"], json!(["$${HOME}"]));
    let content = conv["topic"]["messages"][0]["content"].as_str().unwrap();
    let rendered = minijinja::Environment::new()
        .render_str(content, minijinja::context! { trigger => "a: b" })
        .unwrap();
    assert_eq!(
        rendered,
        "Topics like a: b.\n  indented: {{ not a tag }}\n# hash\n"
    );
}

#[test]
fn without_personas_the_original_three_speak_each_on_a_server_in_turn() {
    let c = converted(
        "env: {}\nscorer: {backend: rule}\nollama: {bases: ['http://g1:1', 'http://g2:1'], model: m}\n",
        &[],
    );
    let personas = &c.document.value["task"]["conversation"]["personas"];
    let names: Vec<&str> = (0..3)
        .map(|i| personas[i]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["A", "B", "C"]);
    let on: Vec<&str> = (0..3)
        .map(|i| personas[i]["endpoint"].as_str().unwrap())
        .collect();
    assert_eq!(on, ["ollama-g1", "ollama-g2", "ollama-g1"]);
}
