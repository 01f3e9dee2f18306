use std::io::Write;

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
    assert_eq!(config.endpoints[0].concurrency, 4);
    assert_eq!(config.endpoints[1].concurrency, 16);
    assert_eq!(
        config.endpoints[1].api_key.as_ref().unwrap().expose(),
        "sk-from-dotenv"
    );
    assert_eq!(config.retry.max_attempts, 5);
    assert_eq!(config.writer.batch_size, 512);
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
        },
    )
    .unwrap();
    assert_eq!(
        loaded.config.dataset.sample,
        Some(Sample { n: 10, seed: 7 })
    );
    assert_eq!(loaded.snapshot["dataset"]["sample"]["n"], 10);
}
