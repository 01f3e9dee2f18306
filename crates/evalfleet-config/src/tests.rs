use std::io::Write;
use std::time::Duration;

use super::*;

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    let mut file = std::fs::File::create(&path).unwrap();
    file.write_all(text.as_bytes()).unwrap();
    path
}

const GOOD: &str = r#"
name: demo
dataset:
  path: items.jsonl
endpoints:
  - name: local
    kind: mock
    concurrency: 4
  - name: hosted
    kind: external
    base_url: https://api.example.invalid/v1
    model: gpt-x
    api_key: ${EF_CFG_TEST_KEY}
    headers: { X-Org: literal-org-token }
task:
  messages:
    - { role: user, content: "{{ question }}" }
  params: { max_tokens: 16 }
"#;

fn dir_with_dataset() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "items.jsonl", "{\"question\": \"q\"}\n");
    dir
}

#[test]
fn a_good_config_validates_with_defaults() {
    let dir = dir_with_dataset();
    write(dir.path(), ".env", "EF_CFG_TEST_KEY=sk-from-dotenv\n");
    let file = write(dir.path(), "run.yaml", GOOD);
    let loaded = load_file(&file, Overrides::default()).unwrap();
    let config = &loaded.config;
    assert_eq!(config.name, "demo");
    assert_eq!(config.dataset.format, DatasetFormat::Jsonl);
    assert!(config.dataset.path.is_absolute());
    assert_eq!(config.endpoints[0].model, "mock");
    assert_eq!(config.endpoints[0].concurrency, LimitMode::Fixed(4));
    assert_eq!(
        config.endpoints[1].concurrency,
        LimitMode::Adaptive(AimdSettings::default()),
        "adaptive is the default"
    );
    assert_eq!(config.endpoints[1].health, HealthSettings::default());
    assert_eq!(
        config.endpoints[1].api_key.as_ref().unwrap().expose(),
        "sk-from-dotenv"
    );
    assert_eq!(config.retry.max_attempts, 10);
    assert_eq!(config.writer.batch_size, 512);
    assert_eq!(config.telemetry, TelemetrySettings::default());
    assert_eq!(config.telemetry.interval, Duration::from_secs(1));
    assert!(config.telemetry.enabled);
    assert!(!config.task.stream);
    assert!(
        !format!("{config:?}").contains("sk-from-dotenv"),
        "Debug must mask secrets"
    );
}

#[test]
fn the_snapshot_keeps_references_and_masks_literal_secrets() {
    let dir = dir_with_dataset();
    write(dir.path(), ".env", "EF_CFG_TEST_KEY=sk-from-dotenv\n");
    let file = write(dir.path(), "run.yaml", GOOD);
    let loaded = load_file(&file, Overrides::default()).unwrap();
    let text = loaded.snapshot.to_string();
    assert!(!text.contains("sk-from-dotenv"));
    assert!(!text.contains("literal-org-token"));
    assert!(text.contains("${EF_CFG_TEST_KEY}"));

    // Resuming from the snapshot expands the reference again, and refuses the
    // masked literal with a message that says what to do.
    let err = load_snapshot(&loaded.snapshot, &loaded.dir)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("endpoints[1].headers.X-Org: was written literally"),
        "{err}"
    );
    assert!(!err.contains("api_key"), "{err}");
}

#[test]
fn every_problem_is_reported_at_once_with_its_line() {
    let dir = dir_with_dataset();
    let file = write(
        dir.path(),
        "bad.yaml",
        r#"name: demo
dataset:
  path: missing.jsonl
  colour: blue
endpoints:
  - name: a
    kind: mock
    concurrency: 4
  - name: b
    kind: external
    base_url: http://127.0.0.1:9/v1
    model: m
    concurrency: 0
    colour: red
task:
  messages:
    - { role: robot, content: "{{ question" }
retry:
  max_attempts: many
"#,
    );
    let err = load_file(&file, Overrides::default()).unwrap_err();
    let problems = err.problems();
    let find = |needle: &str| {
        problems
            .iter()
            .find(|p| p.message.contains(needle))
            .unwrap_or_else(|| panic!("no problem mentions {needle:?}: {problems:#?}"))
            .clone()
    };
    assert_eq!(find("dataset: unknown key 'colour'").line, Some(4));
    assert_eq!(find("dataset.path: no such file").line, Some(3));
    assert_eq!(
        find("endpoints[1].concurrency: must be at least 1, got 0").line,
        Some(13)
    );
    assert_eq!(find("endpoints[1]: unknown key 'colour'").line, Some(14));
    assert_eq!(find("task.messages[0].role: must be one of").line, Some(17));
    assert_eq!(
        find("task.messages[0].content: is not a valid template").line,
        Some(17)
    );
    assert_eq!(find("retry.max_attempts: invalid type").line, Some(19));
    assert_eq!(problems.len(), 7, "{problems:#?}");
    let text = err.to_string();
    assert!(
        text.starts_with(&format!("{} has 7 problems:", file.display())),
        "{text}"
    );
}

#[test]
fn telemetry_keys_validate_and_name_their_problems_with_their_lines() {
    let dir = dir_with_dataset();
    let good = format!(
        "{GOOD}telemetry:\n  interval: 250ms\n  gpus: \"0, 2\"\n  limits: {{ gpu_memory_mb: 70000, engine_rss_mb: 8000 }}\n"
    );
    write(dir.path(), ".env", "EF_CFG_TEST_KEY=k\n");
    let file = write(dir.path(), "good.yaml", &good);
    let telemetry = load_file(&file, Overrides::default())
        .unwrap()
        .config
        .telemetry;
    assert_eq!(telemetry.interval, Duration::from_millis(250));
    assert_eq!(telemetry.gpus, GpuSelection::Listed(vec![0, 2]));
    assert_eq!(telemetry.limits.gpu_memory_mb, Some(70_000));
    assert_eq!(telemetry.limits.engine_rss_mb, Some(8000));
    assert_eq!(telemetry.limits.evalfleet_rss_mb, None);
    let bad = format!(
        "{GOOD}telemetry:\n  interval: 10ms\n  gpus: some\n  limits:\n    gpu_memory_mb: 0\n    vram_mb: 5\n"
    );
    let file = write(dir.path(), "bad.yaml", &bad);
    let err = load_file(&file, Overrides::default()).unwrap_err();
    let problems = err.problems();
    let line = |needle: &str| {
        problems
            .iter()
            .find(|p| p.message.contains(needle))
            .unwrap_or_else(|| panic!("no problem mentions {needle:?}: {problems:#?}"))
            .line
    };
    // The line of `telemetry:`.
    let first = GOOD.lines().count() + 1;
    assert_eq!(
        line("telemetry.interval: must be at least 100ms, got 10ms"),
        Some(first + 1)
    );
    assert_eq!(
        line("telemetry.gpus: must be auto, all, none or GPU indices"),
        Some(first + 2)
    );
    assert_eq!(
        line("telemetry.limits.gpu_memory_mb: must be at least 1, got 0"),
        Some(first + 4)
    );
    assert_eq!(
        line("telemetry.limits: unknown key 'vram_mb'"),
        Some(first + 5)
    );
    assert_eq!(problems.len(), 4, "{problems:#?}");
}

#[test]
fn a_missing_variable_is_named() {
    let dir = dir_with_dataset();
    let file = write(
        dir.path(),
        "run.yaml",
        &GOOD.replace("EF_CFG_TEST_KEY", "EF_CFG_TEST_UNSET_VAR"),
    );
    let err = load_file(&file, Overrides::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("endpoints[1].api_key: environment variable EF_CFG_TEST_UNSET_VAR is not set"),
        "{err}"
    );
}

#[test]
fn yaml_syntax_errors_name_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "broken.yaml", "name: x\ndataset: [1, 2\n");
    let err = load_file(&file, Overrides::default()).unwrap_err();
    assert!(matches!(err, ConfigError::Yaml { .. }), "{err:?}");
    assert!(
        err.to_string().starts_with(&format!("{}:", file.display())),
        "{err}"
    );
}

#[test]
fn overrides_pick_a_sample_and_are_kept_in_the_snapshot() {
    let dir = dir_with_dataset();
    write(dir.path(), ".env", "EF_CFG_TEST_KEY=k\n");
    let file = write(dir.path(), "run.yaml", GOOD);
    let loaded = load_file(
        &file,
        Overrides {
            sample_n: Some(10),
            sample_seed: Some(7),
            ..Overrides::default()
        },
    )
    .unwrap();
    assert_eq!(
        loaded.config.dataset.sample,
        Some(Sample { n: 10, seed: 7 })
    );
    assert_eq!(loaded.snapshot["dataset"]["sample"]["n"], 10);
}

const ENGINES: &str = r#"
name: fleet
dataset:
  path: items.jsonl
endpoints:
  - name: gpu0
    kind: local
    preset: vllm
    model: Qwen/Qwen3-4B
    args: "--max-model-len 8192"
    gpu: 0
    env: { HF_TOKEN: literal-hf-token }
    concurrency: { min: 2, max: 128, initial: 16 }
    health: { interval: 2s, max_failures: 2 }
  - name: box2
    kind: remote
    host: me@box2
    command: "python3 -m mymodel --port {port}"
    model: m
    port: 9000
  - name: hosted
    kind: external
    base_url: https://api.example.invalid/v1
    model: m
    rpm: 600
    tpm: 100000
    concurrency: 32
task:
  messages:
    - { role: user, content: "{{ question }}" }
"#;

#[test]
fn engines_presets_limits_and_health_validate() {
    let dir = dir_with_dataset();
    let file = write(dir.path(), "run.yaml", ENGINES);
    let loaded = load_file(&file, Overrides::default()).unwrap();
    let [gpu0, box2, hosted] = &loaded.config.endpoints[..] else {
        panic!("three endpoints")
    };
    let EndpointKind::Local(engine) = &gpu0.kind else {
        panic!("local")
    };
    assert_eq!(engine.preset, Some(Preset::Vllm));
    assert_eq!(
        engine.render(&gpu0.model, 8001),
        "vllm serve Qwen/Qwen3-4B --host 127.0.0.1 --port 8001 --max-model-len 8192"
    );
    assert_eq!(engine.gpu.as_deref(), Some("0"));
    assert_eq!(engine.restarts, 3);
    assert_eq!(gpu0.health.interval, Duration::from_secs(2));
    assert_eq!(gpu0.health.max_failures, 2);
    assert_eq!(
        gpu0.concurrency,
        LimitMode::Adaptive(AimdSettings {
            initial: 16,
            min: 2,
            max: 128,
            ..AimdSettings::default()
        })
    );
    let EndpointKind::Remote(remote) = &box2.kind else {
        panic!("remote")
    };
    assert_eq!(remote.session, "evalfleet-box2");
    assert_eq!(
        remote.engine.render(&box2.model, 9000),
        "python3 -m mymodel --port 9000"
    );
    assert_eq!((hosted.rpm, hosted.tpm), (Some(600), Some(100_000)));
    assert!(
        !loaded.snapshot.to_string().contains("literal-hf-token"),
        "env values are secrets"
    );
}

#[test]
fn keys_of_another_kind_and_missing_engine_parts_are_reported() {
    let dir = dir_with_dataset();
    let file = write(
        dir.path(),
        "bad.yaml",
        r#"name: fleet
dataset:
  path: items.jsonl
endpoints:
  - name: a
    kind: external
    base_url: http://127.0.0.1:9/v1
    model: m
    preset: vllm
  - name: b
    kind: local
    model: m
  - name: c
    kind: remote
    model: m
    command: "serve {modle}"
  - name: d
    kind: mock
    concurrency: { min: 4, max: 2 }
    health: { path: models }
  - name: e
    kind: remote
    host: me@box
    model: m
    command: "serve --port {port}"
    session: "box.1"
task:
  messages:
    - { role: user, content: "{{ question }}" }
"#,
    );
    let err = load_file(&file, Overrides::default()).unwrap_err();
    let text = err.to_string();
    for expected in [
        "bad.yaml:9: endpoints[0].preset: is only for endpoints of kind local or remote",
        "bad.yaml:10: endpoints[1].preset: is required without a command",
        "bad.yaml:13: endpoints[2].host: is required for a remote endpoint",
        "endpoints[2].command: has unknown placeholder {modle}",
        "endpoints[3].concurrency.max: must be between min (4)",
        "endpoints[3].health.path: must start with '/'",
        "endpoints[4].session: 'box.1' may hold only letters, digits, '-' and '_'",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
}

#[test]
fn a_code_task_is_checked_key_by_key() {
    let dir = dir_with_dataset();
    write(dir.path(), ".env", "EF_CFG_TEST_KEY=sk-from-dotenv\n");
    let with_code = |code: &str| {
        let file = write(
            dir.path(),
            "code.yaml",
            &format!("{GOOD}  code: {{ {code} }}\n"),
        );
        load_file(&file, Overrides::default())
    };
    let mentions = |said: &[String], needle: &str| {
        assert!(
            said.iter().any(|m| m.contains(needle)),
            "{needle}: {said:?}"
        );
    };
    let messages = |code: &str| -> Vec<String> {
        with_code(code)
            .unwrap_err()
            .problems()
            .iter()
            .map(|p| p.message.clone())
            .collect()
    };
    let said = messages("format: humaneval, language: cpp, compiler: g++, python: python3");
    mentions(
        &said,
        "task.code.language: cpp programs are judged on stdin/stdout tests",
    );
    mentions(&said, "give python or compiler, not both");
    let said = messages("format: stdio, language: cobol");
    mentions(
        &said,
        "task.code.language: must be python, cpp or rust, got 'cobol'",
    );
    let said = messages("format: stdio, backend: sandboxfusion");
    mentions(
        &said,
        "task.code.sandbox_url: is required with backend: sandboxfusion",
    );
    let said = messages("format: stdio, backend: sandboxfusion, sandbox_url: ftp://x");
    mentions(&said, "must be an http(s) URL");
    let said = messages("format: stdio, sandbox_url: http://x:8080");
    mentions(&said, "is for backend: sandboxfusion");
    let said = messages("format: stdio, tests_field: [], compile_timeout: soon");
    mentions(&said, "task.code.tests_field: must name at least one field");
    mentions(&said, "task.code.compile_timeout: expected a duration");

    let config = with_code(
        "format: stdio, language: rust, tests_field: [public_tests, private_tests], backend: sandboxfusion, sandbox_url: http://sandbox:8080, sandbox_retries: 5",
    )
    .unwrap()
    .config;
    let code = config.task.kind.code().cloned().unwrap();
    assert_eq!(code.language, evalfleet_sandbox::Language::Rust);
    assert_eq!(code.stdio_fields, ["public_tests", "private_tests"]);
    assert_eq!(
        code.backend,
        evalfleet_sandbox::Backend::SandboxFusion {
            url: "http://sandbox:8080".to_owned(),
            retries: Some(5),
            retry_for: Duration::from_secs(120),
        }
    );
    assert_eq!(
        code.concurrency, 20,
        "a remote sandbox's own default (seed 003's)"
    );
    assert_eq!(code.compile_timeout, Duration::from_secs(30));
}

#[test]
fn a_mock_answers_file_is_found_beside_the_config() {
    let dir = dir_with_dataset();
    write(
        dir.path(),
        "answers.jsonl",
        "{\"prompt\": \"q\", \"replies\": [\"a\"]}\n",
    );
    let file = write(
        dir.path(),
        "run.yaml",
        "name: demo\ndataset: { path: items.jsonl }\nendpoints:\n  - { name: m, kind: mock, mock: { answers: answers.jsonl } }\ntask:\n  messages: [ { role: user, content: \"{{ question }}\" } ]\n",
    );
    let config = load_file(&file, Overrides::default()).unwrap().config;
    let EndpointKind::Mock(settings) = &config.endpoints[0].kind else {
        panic!("a mock endpoint");
    };
    assert_eq!(
        settings.answers.as_deref(),
        Some(dir.path().join("answers.jsonl").as_path())
    );
}

/// The messages of a config's problems, each with its line.
fn problems_of(dir: &Path, text: &str) -> Vec<(Option<usize>, String)> {
    let file = write(dir, "run.yaml", text);
    load_file(&file, Overrides::default())
        .unwrap_err()
        .problems()
        .into_iter()
        .map(|p| (p.line, p.message))
        .collect()
}

#[test]
fn an_unknown_key_is_reported_with_the_known_key_it_was_meant_to_be() {
    let dir = dir_with_dataset();
    let problems = problems_of(
        dir.path(),
        r#"
name: demo
timeout: { attempt: 5s }
dataset:
  path: items.jsonl
  id_feild: id
endpoints:
  - name: local
    kind: mock
    concurency: 4
    mock:
      latencyy: 200ms
      quota: { limit: 5, window: 1s, windw: 2s }
  - name: judge
    kind: mock
    role: judge
task:
  messages:
    - { role: user, content: "{{ question }}" }
  metrics:
    - { name: exact_match, reference: "{{ question }}", ignoreCase: true }
retry:
  max_atempts: 3
"#,
    );
    let expected = [
        (
            3,
            "config: unknown key 'timeout' (did you mean 'timeouts'?)",
        ),
        (
            6,
            "dataset: unknown key 'id_feild' (did you mean 'id_field'?)",
        ),
        (
            10,
            "endpoints[0]: unknown key 'concurency' (did you mean 'concurrency'?)",
        ),
        (
            12,
            "endpoints[0].mock: unknown key 'latencyy' (did you mean 'latency'?)",
        ),
        (
            13,
            "endpoints[0].mock.quota: unknown key 'windw' (did you mean 'window'?)",
        ),
        (
            21,
            "task.metrics[0]: unknown key 'ignoreCase' (did you mean 'ignore_case'?)",
        ),
        (
            23,
            "retry: unknown key 'max_atempts' (did you mean 'max_attempts'?)",
        ),
    ];
    let expected: Vec<(Option<usize>, String)> = expected
        .into_iter()
        .map(|(line, message)| (Some(line), message.to_owned()))
        .collect();
    assert_eq!(problems, expected);
}

#[test]
fn an_unknown_key_like_no_known_one_is_told_the_known_keys() {
    let dir = dir_with_dataset();
    let problems = problems_of(
        dir.path(),
        r#"
name: demo
colour: red
dataset:
  path: items.jsonl
  colour: red
endpoints:
  - name: local
    kind: mock
    colour: red
    mock: { colour: red }
task:
  messages:
    - { role: user, content: "{{ question }}" }
"#,
    );
    let messages: Vec<&str> = problems.iter().map(|(_, m)| m.as_str()).collect();
    assert_eq!(messages.len(), 4, "{messages:#?}");
    assert_eq!(
        messages[..2],
        [
            "config: unknown key 'colour' (known: cache, dataset, endpoints, name, report, retry, shutdown_grace, store, task, telemetry, timeouts, writer)",
            "dataset: unknown key 'colour' (known: format, id_field, limit, path, sample, sheet, skip_invalid, split)",
        ]
    );
    // Places with many keys send the reader to the reference.
    for (message, place) in messages[2..]
        .iter()
        .zip(["endpoints[]", "endpoints[].mock"])
    {
        let at = place.replace("[]", "[0]");
        assert!(
            message.starts_with(&format!(
                "{at}: unknown key 'colour' (docs/config.md lists the "
            )) && message.ends_with(&format!(" keys of {place})")),
            "{message}"
        );
    }
}

#[test]
fn unknown_keys_of_the_task_kinds_are_matched_to_theirs() {
    let dir = dir_with_dataset();
    let task = |rest: &str| {
        let text = format!(
            "name: demo\n\
             dataset: {{ path: items.jsonl }}\n\
             endpoints: [{{ name: local, kind: mock }}]\n\
             task:\n  messages: [{{ role: user, content: \"{{{{ question }}}}\" }}]\n{rest}"
        );
        let problems = problems_of(dir.path(), &text);
        problems.into_iter().map(|(_, m)| m).collect::<Vec<_>>()
    };
    assert_eq!(
        task("  parse: { regex: \"(\\\\d+)\", grup: 1 }\n"),
        ["task.parse: unknown key 'grup' (did you mean 'group'?)"]
    );
    assert_eq!(
        task("  code: { format: stdio, tiemout: 5s }\n"),
        ["task.code: unknown key 'tiemout' (did you mean 'timeout'?)"]
    );
    let conversation = problems_of(
        dir.path(),
        r#"
name: demo
endpoints: [{ name: local, kind: mock }]
task:
  conversation:
    sesions: 3
    scorer: { use_emma: true }
    personas: [{ name: Ann, landmine: [money] }, {}, {}]
    history: { persona: 4, polcy: 2 }
"#,
    );
    let messages: Vec<&str> = conversation.iter().map(|(_, m)| m.as_str()).collect();
    assert_eq!(
        messages,
        [
            "task.conversation: unknown key 'sesions' (did you mean 'sessions'?)",
            "task.conversation.scorer: unknown key 'use_emma' (did you mean 'use_ema'?)",
            "task.conversation.personas[0]: unknown key 'landmine' (did you mean 'landmines'?)",
            "task.conversation.history: unknown key 'polcy' (did you mean 'policy'?)",
        ]
    );
}

const PROMPTS: &str = r#"
name: docs
dataset:
  path: items.jsonl
endpoints:
  - name: a
    kind: mock
    model: qwen2-vl-7b
  - name: b
    kind: mock
    model: MODEL_B
task:
  messages:
    - { role: user, content: "{{ question }}" }
  prompts:
    - name: invoices
      when: { doc_type: [invoice, receipt] }
      messages:
        - { role: user, content: "Invoice: {{ question }}" }
    - when: { doc_type: form }
      model: "qwen2-vl*"
      messages:
        - { role: user, content: "Form: {{ question }}" }
"#;

#[test]
fn prompt_rules_validate_with_names_and_model_conditions() {
    let dir = dir_with_dataset();
    let file = write(
        dir.path(),
        "run.yaml",
        &PROMPTS.replace("MODEL_B", "qwen2-vl-2b"),
    );
    let config = load_file(&file, Overrides::default()).unwrap().config;
    let rules = &config.task.prompts;
    assert_eq!(rules.len(), 2);
    assert_eq!(rules[0].name, "invoices");
    assert_eq!(rules[1].name, "doc_type=form model=qwen2-vl*");
    assert!(rules[1].model_matches, "both endpoints serve a qwen2-vl");
    assert_eq!(
        rules[0].when,
        vec![(
            "doc_type".to_owned(),
            vec![serde_json::json!("invoice"), serde_json::json!("receipt")]
        )]
    );

    let file = write(dir.path(), "run.yaml", &PROMPTS.replace("MODEL_B", "llava"));
    let err = load_file(&file, Overrides::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(
            "run.yaml:21: task.prompts[1].model: 'qwen2-vl*' matches the model of endpoints a (qwen2-vl-7b) but not of b (llava)"
        ),
        "{err}"
    );
}

/// The problems `text` has as a config, in one message.
fn error_of(dir: &Path, text: &str) -> String {
    let file = write(dir, "run.yaml", text);
    load_file(&file, Overrides::default())
        .unwrap_err()
        .to_string()
}

fn assert_all(err: &str, expected: &[&str]) {
    for expected in expected {
        assert!(err.contains(expected), "{expected}\n{err}");
    }
}

#[test]
fn bad_prompt_rules_are_reported_with_their_lines() {
    let dir = dir_with_dataset();
    let good = PROMPTS.replace("MODEL_B", "qwen2-vl-2b");
    let text = good.replace(
        "    - when: { doc_type: form }\n",
        "    - when: { doc_type: { nested: 1 } }\n      colour: red\n",
    ) + r#"    - messages:
        - { role: user, content: "{{ question }}" }
    - name: invoices
      messages:
        - { role: robot, content: "x" }
"#;
    assert_all(
        &error_of(dir.path(), &text),
        &[
            "run.yaml:21: task.prompts[1]: unknown key 'colour'",
            "run.yaml:20: task.prompts[1].when.doc_type: accepts a value (text, number, boolean or null) or a list of them",
            "run.yaml:29: task.prompts[3].messages[0].role: must be one of",
        ],
    );
    // The rules that parse are checked against each other.
    let text = good.clone()
        + r#"    - messages:
        - { role: user, content: "{{ question }}" }
    - name: invoices
      messages:
        - { role: user, content: "x" }
"#;
    assert_all(
        &error_of(dir.path(), &text),
        &[
            "run.yaml:26: task.prompts[3]: can never be chosen: task.prompts[2] before it has no condition",
            "run.yaml:26: task.prompts[3].name: 'invoices' is also the name of task.prompts[0]",
        ],
    );
    // Without task.messages, some rule must take every item.
    let text = good.replace(
        "  messages:\n    - { role: user, content: \"{{ question }}\" }\n  prompts:",
        "  prompts:",
    );
    assert_all(
        &error_of(dir.path(), &text),
        &["task.messages: is required unless a rule of task.prompts has no condition"],
    );
}

#[test]
fn metric_backends_are_checked_with_their_places() {
    let dir = dir_with_dataset();
    let problems = problems_of(
        dir.path(),
        &format!(
            "{GOOD}  metrics:\n\
             \x20   - {{ name: anls@scorer, reference: \"{{{{ q }}}}\", anything: [1] }}\n\
             \x20   - {{ name: cer@nowhere, reference: \"{{{{ q }}}}\" }}\n\
             \x20   - {{ name: wer@scorer@2, reference: \"{{{{ q }}}}\" }}\n\
             \x20 metric_backends:\n\
             \x20   - {{ name: scorer, command: [python3, s.py], metrics: [anls, wer], colour: red }}\n\
             \x20   - {{ name: native, command: [x], metrics: [a] }}\n\
             \x20   - {{ name: other, command: [], metrics: [], queue: 0, timeout: soon, setup_timeout: 0s }}\n"
        ),
    );
    let messages: Vec<&str> = problems.iter().map(|(_, m)| m.as_str()).collect();
    let has = |needle: &str| {
        assert!(
            messages.iter().any(|m| m.contains(needle)),
            "no problem mentions {needle:?}: {messages:#?}"
        );
    };
    has("task.metric_backends[0]: unknown key 'colour'");
    has("task.metric_backends[1].name: 'native' is the built-in metrics' backend");
    has("task.metric_backends[2].command: must be a program and its arguments");
    has("task.metric_backends[2].metrics: is required");
    has("task.metric_backends[2].queue: must be between 1 and 10000, got 0");
    has("task.metric_backends[2].timeout: expected a duration");
    has("task.metric_backends[2].setup_timeout: must be longer than zero");
    // A problem in the backends leaves the metrics unchecked against them;
    // the anything: parameter is the program's, never an unknown key.
    assert!(
        !messages
            .iter()
            .any(|m| m.contains("anything") || m.starts_with("task.metrics")),
        "{messages:#?}"
    );
}

#[test]
fn metrics_name_a_declared_backend_at_its_version() {
    let dir = dir_with_dataset();
    write(dir.path(), ".env", "EF_CFG_TEST_KEY=sk\n");
    let problems = problems_of(
        dir.path(),
        &format!(
            "{GOOD}  metrics:\n\
             \x20   - {{ name: cer@nowhere, reference: \"{{{{ q }}}}\" }}\n\
             \x20   - {{ name: wer@scorer@2, reference: \"{{{{ q }}}}\" }}\n\
             \x20 metric_backends:\n\
             \x20   - {{ name: scorer, command: [python3, s.py], metrics: [anls, wer] }}\n"
        ),
    );
    let messages: Vec<&str> = problems.iter().map(|(_, m)| m.as_str()).collect();
    assert!(
        messages.iter().any(|m| m.starts_with(
            "task.metrics[0]: unknown metric backend 'nowhere' (declared: scorer; built in: native)"
        )),
        "{messages:#?}"
    );
    assert!(
        messages
            .iter()
            .any(|m| m.starts_with("task.metrics[1]: metric backend 'scorer' is at version 1")),
        "{messages:#?}"
    );
    let file = write(
        dir.path(),
        "ok.yaml",
        &format!(
            "{GOOD}  metrics:\n\
             \x20   - {{ name: wer@scorer, reference: \"{{{{ q }}}}\", lang: en }}\n\
             \x20   - {{ name: wer@native@1, reference: \"{{{{ q }}}}\" }}\n\
             \x20 metric_backends:\n\
             \x20   - {{ name: scorer, command: [./s.py], metrics: [{{ name: wer, higher_is_better: false }}], timeout: 5s }}\n"
        ),
    );
    let loaded = load_file(&file, Overrides::default()).unwrap();
    let eval = &loaded.config.task.eval;
    let keys: Vec<&str> = eval.metrics.iter().map(|m| m.metric.key.as_str()).collect();
    assert_eq!(keys, ["wer@scorer@1", "wer@1"]);
    assert!(!eval.metrics[0].metric.higher_is_better);
    let backend = &eval.backends[0];
    assert_eq!(
        (backend.timeout, backend.queue, backend.dir.as_path()),
        (Duration::from_secs(5), 64, dir.path())
    );
}

#[test]
fn image_parts_and_the_images_shorthand_are_read_and_checked_with_their_lines() {
    let dir = dir_with_dataset();
    write(dir.path(), ".env", "EF_CFG_TEST_KEY=sk\n");
    let good = GOOD.replace(
        "    - { role: user, content: \"{{ question }}\" }\n",
        "    - role: user\n      content:\n        - text: \"Read {{ question }}\"\n        - image: \"{{ pages }}\"\n    - { role: user, content: \"Again\", images: \"{{ page }}\", images_at: after }\n  images: { max_side: 1024, format: jpeg, quality: 80, pdf_pages: all, max_bytes: 1000000 }\n",
    );
    let file = write(dir.path(), "run.yaml", &good);
    let config = load_file(&file, Overrides::default()).unwrap().config;
    let messages = &config.task.messages;
    assert_eq!(
        messages[0].parts,
        vec![
            Part::Text("Read {{ question }}".into()),
            Part::Image("{{ pages }}".into())
        ]
    );
    assert_eq!(
        messages[1].parts,
        vec![Part::Text("Again".into()), Part::Image("{{ page }}".into())]
    );
    let images = &config.task.images;
    assert_eq!(
        (
            images.max_side,
            images.format,
            images.quality,
            images.pdf_pages,
            images.max_bytes
        ),
        (
            Some(1024),
            Some(ImageFormat::Jpeg),
            80,
            PdfPages::All,
            1_000_000
        )
    );

    let bad = GOOD.replace(
        "    - { role: user, content: \"{{ question }}\" }\n",
        "    - role: user\n      content:\n        - picture: \"{{ page }}\"\n    - { role: user, content: \"x\", images: \"{{ page }}\", images_at: middle }\n  images: { format: gif, pdf_pages: none, in_memory: 0, max_bytes: 10 }\n",
    );
    let file = write(dir.path(), "bad.yaml", &bad);
    let err = load_file(&file, Overrides::default()).unwrap_err();
    let problems = err.problems();
    let line = |needle: &str| {
        problems
            .iter()
            .find(|p| p.message.contains(needle))
            .unwrap_or_else(|| panic!("no problem mentions {needle:?}: {problems:#?}"))
            .line
    };
    assert_eq!(
        line("task.messages[0].content[0]: unknown key 'picture'"),
        Some(19)
    );
    assert_eq!(
        line("task.messages[1].images_at: must be before or after, got 'middle'"),
        Some(20)
    );
    assert_eq!(
        line("task.images.format: must be png, jpeg or webp, got 'gif'"),
        Some(21)
    );
    assert_eq!(
        line("task.images.pdf_pages: must be first, all or a page number"),
        Some(21)
    );
    assert_eq!(
        line("task.images.in_memory: must be between 1 and 100000, got 0"),
        Some(21)
    );
    assert_eq!(
        line("task.images.max_bytes: must be between 1000 and 10000000000, got 10"),
        Some(21)
    );
}

const EXEC: &str = r#"
name: agents
dataset:
  path: items.jsonl
endpoints:
  - { name: gpu0, kind: mock, model: qwen3-4b, concurrency: 4 }
task:
  kind: exec
"#;

#[test]
fn an_exec_task_is_checked_key_by_key() {
    let dir = dir_with_dataset();
    write(dir.path(), "agent.py", "print(1)\n");
    let file = write(
        dir.path(),
        "exec.yaml",
        &format!(
            "{EXEC}  command: python3 agent.py --name \"a b\"\n  input: file\n  timeout: 90s\n  \
             concurrency: 32\n  network: open\n  env: {{ MODE: fast, N: 3 }}\n  \
             budget: {{ calls: 20, tokens: 5000, time: 2m }}\n  models: {{ \"*\": qwen3-4b, gpt-4o: gpu0 }}\n"
        ),
    );
    let config = load_file(&file, Overrides::default()).unwrap().config;
    let exec = config.task.kind.exec().cloned().unwrap();
    assert_eq!(exec.command, ["python3", "agent.py", "--name", "a b"]);
    assert_eq!(exec.input, ExecInput::File);
    assert_eq!(exec.timeout, Duration::from_secs(90));
    assert_eq!(exec.concurrency, 32);
    assert_eq!(exec.network, AgentNetwork::Open);
    assert_eq!(
        exec.env,
        [
            ("MODE".to_owned(), "fast".to_owned()),
            ("N".to_owned(), "3".to_owned())
        ]
    );
    assert_eq!(exec.budget.calls, Some(20));
    assert_eq!(exec.budget.tokens, Some(5000));
    assert_eq!(exec.budget.time, Some(Duration::from_secs(120)));
    assert_eq!(exec.models.len(), 2);
    // No messages, and no re-asks: an agent's answer is not asked for again.
    assert!(config.task.messages.is_empty());
    assert_eq!(config.task.eval.max_reasks, 0);

    let defaults = write(
        dir.path(),
        "d.yaml",
        &format!("{EXEC}  command: [./agent.py]\n"),
    );
    let exec = load_file(&defaults, Overrides::default())
        .unwrap()
        .config
        .task
        .kind
        .exec()
        .cloned()
        .unwrap();
    assert_eq!(exec.input, ExecInput::Stdin);
    assert_eq!(exec.timeout, Duration::from_secs(600));
    assert_eq!(exec.concurrency, 16);
    assert_eq!(exec.disk_mb, 2048);
    assert_eq!(exec.network, AgentNetwork::Gateway);

    let err = error_of(
        dir.path(),
        &format!(
            "{EXEC}  input: pipe\n  timeout: soon\n  concurrency: 0\n  disk_mb: 0\n  network: lan\n  \
             env: {{ OPENAI_API_KEY: x }}\n  budget: {{ calls: 3, cost: 1 }}\n  max_reasks: 2\n  \
             messages: [{{ role: user, content: hi }}]\n"
        ),
    );
    assert_all(
        &err,
        &[
            "task.command: is required with kind: exec",
            "task.input: must be stdin, file or args, got 'pipe'",
            "task.timeout: expected a duration",
            "task.concurrency: must be between 1 and 4096, got 0",
            "task.disk_mb: must be between 1 and 1048576 (MiB), got 0",
            "task.network: must be gateway or open, got 'lan'",
            "task.env.OPENAI_API_KEY: is set by evalfleet",
            "task.budget: unknown key 'cost'",
            "task.messages: is not for kind: exec",
        ],
    );
    let err = error_of(
        dir.path(),
        &format!("{EXEC}  command: \"python3 'agent.py\"\n"),
    );
    assert_all(&err, &["task.command: has an unclosed single quote"]);
    // Its keys belong to it alone.
    let err = error_of(
        dir.path(),
        &GOOD.replace("  params:", "  command: x\n  kind: chat\n  params:"),
    );
    assert_all(
        &err,
        &["task.command: belongs to kind: exec, not kind: chat"],
    );
}

#[test]
fn a_conversation_s_rule_keys_are_read_and_checked() {
    use evalfleet_eval::balance::TargetRule;
    let dir = dir_with_dataset();
    let load = |conversation: &str| {
        let text = format!(
            "name: demo\nendpoints: [{{ name: local, kind: mock }}]\ntask:\n  conversation:\n{conversation}"
        );
        load_file(&write(dir.path(), "run.yaml", &text), Overrides::default())
    };
    let config = load(
        "    rewards: { target_edge: most_negative, end_step_when_lost: false, invalid_penalty: 0.25, topic_restarts: 3 }\n    scorer: { use_ema: true, decay_factor: 0.8 }\n",
    )
    .unwrap();
    let c = config.config.task.kind.conversation().unwrap();
    assert_eq!(c.rewards.target_rule, TargetRule::MostNegative);
    assert!(!c.rewards.end_step_when_lost);
    assert_eq!(c.rewards.invalid_penalty, 0.25);
    assert_eq!(c.topic_restarts, 3);
    assert_eq!(c.scorer.ema_formula, EmaFormula::Fixed);
    // The defaults: the original system's rules.
    let config = load("    sessions: 2\n").unwrap();
    let c = config.config.task.kind.conversation().unwrap();
    assert_eq!(c.rewards.target_rule, TargetRule::ClosestToZero);
    assert!(c.rewards.end_step_when_lost);
    assert_eq!(c.rewards.invalid_penalty, 1.0);
    assert_eq!(c.topic_restarts, 1);
    // The original's keys (decay 1.5) mean its formula; named, either.
    for scorer in [
        "{ use_ema: true, decay_factor: 1.5 }",
        "{ use_ema: true, ema_formula: adaptive }",
    ] {
        let config = load(&format!("    scorer: {scorer}\n")).unwrap();
        let c = config.config.task.kind.conversation().unwrap();
        assert_eq!(c.scorer.ema_formula, EmaFormula::Adaptive, "{scorer}");
        assert_eq!(c.scorer.decay_factor, 1.5);
    }
    let problems = |conversation: &str| -> Vec<String> {
        load(conversation)
            .unwrap_err()
            .problems()
            .into_iter()
            .map(|p| p.message)
            .collect()
    };
    assert_eq!(
        problems(
            "    rewards: { target_edge: lowest, invalid_penalty: -1 }\n    scorer: { ema_formula: smooth }\n"
        ),
        [
            "task.conversation.rewards.target_edge: must be closest_to_zero or most_negative, got 'lowest'",
            "task.conversation.rewards.invalid_penalty: must be a number at least 0, got -1",
            "task.conversation.scorer.ema_formula: must be fixed or adaptive, got 'smooth'",
        ]
    );
    // rules: original ends episodes at max_steps only: 8 by default, and
    // never 0.
    let config = load("    rules: original\n").unwrap();
    let c = config.config.task.kind.conversation().unwrap();
    assert_eq!(c.rules, crate::Rules::Original);
    assert_eq!(c.max_steps, 8);
    // The default is the original's rules.
    let config = load("    sessions: 2\n").unwrap();
    let c = config.config.task.kind.conversation().unwrap();
    assert_eq!((c.rules, c.max_steps), (crate::Rules::Original, 8));
    let config = load("    rules: corrected\n").unwrap();
    let c = config.config.task.kind.conversation().unwrap();
    assert_eq!((c.rules, c.max_steps), (crate::Rules::Corrected, 0));
    assert_eq!(
        problems("    rules: originel\n"),
        ["task.conversation.rules: must be original or corrected, got 'originel'"]
    );
    assert_eq!(
        problems("    rules: original\n    max_steps: 0\n"),
        [
            "task.conversation.max_steps: must be at least 1 with rules: original, which ends an episode only there (the original's config has 8)"
        ]
    );
    assert_eq!(
        problems("    scorer: { ema_formula: fixed, decay_factor: 1.5 }\n"),
        [
            "task.conversation.scorer.decay_factor: must be at least 0 and below 1 (ema_formula: fixed), got 1.5"
        ]
    );
    assert_eq!(
        problems("    scorer: { ema_formula: adaptive, decay_factor: 0 }\n"),
        ["task.conversation.scorer.decay_factor: must be above 0 (ema_formula: adaptive), got 0"]
    );
}

#[test]
fn a_folder_is_a_parquet_dataset_and_split_is_only_for_one() {
    let dir = dir_with_dataset();
    write(dir.path(), ".env", "EF_CFG_TEST_KEY=sk-from-dotenv\n");
    std::fs::create_dir(dir.path().join("hub")).unwrap();
    write(dir.path(), "one.parquet", "");
    let config = |dataset: &str| GOOD.replace("  path: items.jsonl\n", dataset);
    let file = write(
        dir.path(),
        "run.yaml",
        &config("  path: hub\n  split: test\n"),
    );
    let loaded = load_file(&file, Overrides::default()).unwrap();
    assert_eq!(loaded.config.dataset.format, DatasetFormat::Parquet);
    assert_eq!(loaded.config.dataset.split.as_deref(), Some("test"));
    let file = write(dir.path(), "run.yaml", &config("  path: one.parquet\n"));
    let loaded = load_file(&file, Overrides::default()).unwrap();
    assert_eq!(loaded.config.dataset.format, DatasetFormat::Parquet);
    assert_eq!(loaded.config.dataset.split, None);

    let problems = |dataset: &str| {
        let file = write(dir.path(), "bad.yaml", &config(dataset));
        let err = load_file(&file, Overrides::default()).unwrap_err();
        err.problems()
            .iter()
            .map(|p| p.message.clone())
            .collect::<Vec<_>>()
    };
    let said = problems("  path: one.parquet\n  split: train\n");
    assert!(
        said[0].starts_with("dataset.split: only a folder of Parquet shards has splits"),
        "{said:?}"
    );
    let said = problems("  path: hub\n  format: csv\n");
    assert!(
        said[0].starts_with("dataset.path: ")
            && said[0].ends_with("only a Parquet dataset may be a folder of shards"),
        "{said:?}"
    );
    let said = problems("  path: items.jsonl\n  split: \" \"\n");
    assert_eq!(said, ["dataset.split: must not be empty"]);
}

#[test]
fn a_sheet_dataset_validates_and_names_its_problems() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), ".env", "EF_CFG_TEST_KEY=sk-from-dotenv\n");
    let good = GOOD.replace(
        "  path: items.jsonl\n",
        "  sheet:\n    spreadsheet: https://docs.google.com/spreadsheets/d/1Abc-_x/edit#gid=0\n    columns: { text: B, category: C }\n    blocks: { count: 3, stride: 3, fields: [category] }\n    write: { D: score.exact_match, e: answer }\n",
    );
    let file = write(dir.path(), "run.yaml", &good);
    let loaded = load_file(&file, Overrides::default()).unwrap();
    let dataset = &loaded.config.dataset;
    let sheet = dataset.sheet.as_ref().unwrap();
    assert_eq!(sheet.spreadsheet_id, "1Abc-_x");
    assert_eq!(sheet.tab, "Sheet1");
    assert_eq!((sheet.header_row, sheet.first_row), (1, 2));
    assert_eq!(
        sheet.write,
        vec![
            (3, WriteValue::Score("exact_match".to_owned())),
            (4, WriteValue::Answer)
        ]
    );
    assert_eq!(sheet.key_env, DEFAULT_KEY_ENV);
    assert_eq!(sheet.flush_rows, 50);
    assert_eq!(sheet.flush_interval, Duration::from_secs(2));
    assert_eq!(sheet.retries, 5);
    assert_eq!(sheet.min_write_interval, Duration::from_secs(1));
    assert_eq!(sheet.writes_per_minute, 60);
    assert_eq!(dataset.format, DatasetFormat::Jsonl);
    assert_eq!(dataset.id_field.as_deref(), Some(SHEET_ID_FIELD));
    assert!(dataset.path.starts_with(snapshot_dir()));

    // Blocks whose columns run into each other's, or into a field's.
    let overlapping = good.replace("stride: 3", "stride: 1");
    let err = error_of(dir.path(), &overlapping);
    assert_all(
        &err,
        &[
            "column D is both field 'category' of block 2 and write.D of block 1",
            "column E is both field 'category' of block 3 and write.D of block 2",
        ],
    );

    let bad = GOOD.replace(
        "  path: items.jsonl\n",
        "  path: items.jsonl\n  sheet:\n    spreadsheet: \"not an id\"\n    columns: { text: B1 }\n    blocks: { count: 2, stride: 0, fields: [missing] }\n    write: { B: answer, F: scores.x }\n    key_env: \"BAD-NAME\"\n    flush_rows: 0\n    writes_per_minute: 0\n",
    );
    let err = error_of(dir.path(), &bad);
    assert_all(
        &err,
        &[
            "dataset.path: a dataset read from a sheet",
            "dataset.sheet.spreadsheet: 'not an id' is neither a spreadsheet id",
            "dataset.sheet.columns.text: 'B1' is not a column",
            "dataset.sheet.blocks.stride: must be at least 1",
            "dataset.sheet.blocks.fields: missing not in dataset.sheet.columns",
            "dataset.sheet.write.F: 'scores.x' is not a value to write",
            "dataset.sheet.key_env: 'BAD-NAME' is not a variable name",
            "dataset.sheet.flush_rows: must be 1 to 1000, got 0",
            "dataset.sheet.writes_per_minute: must be 1 to 100000, got 0",
        ],
    );
    let clash = GOOD.replace(
        "  path: items.jsonl\n",
        "  sheet:\n    spreadsheet: abc\n    columns: { text: B }\n    write: { B: answer }\n",
    );
    let err = error_of(dir.path(), &clash);
    assert!(
        err.contains("dataset.sheet: column B is both field 'text' and write.B"),
        "{err}"
    );
}
