//! What a user installing evalfleet meets first: `--version` with its
//! commit, `init`'s starter configs, shell completions and man pages.

use serde_json::Value;

use crate::util::{BIN, Env};

/// The commands `evalfleet --help` lists (clap's own `help` aside).
fn commands_in_help() -> Vec<String> {
    let help = std::process::Command::new(BIN)
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8(help.stdout).unwrap();
    let listed: Vec<String> = help
        .lines()
        .skip_while(|line| !line.starts_with("Commands:"))
        .skip(1)
        .take_while(|line| line.starts_with("  "))
        // A command's line; its description's wrapped lines are indented further.
        .filter(|line| !line.starts_with("   "))
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_owned)
        .collect();
    assert!(
        listed.iter().any(|c| c == "run") && listed.iter().any(|c| c == "init"),
        "--help lists the commands: {help}"
    );
    listed
}

#[tokio::test]
async fn version_names_the_release_and_the_commit() {
    let env = Env::new();
    for args in [&["--version"][..], &["run", "--version"]] {
        let ran = env.evalfleet(args).await;
        assert_eq!(ran.code, Some(0), "{args:?}: {}", ran.stderr);
        let line = ran.stdout.trim();
        let rest = line
            .strip_prefix(if args.len() == 1 {
                "evalfleet "
            } else {
                "evalfleet-run "
            })
            .unwrap_or_else(|| panic!("{args:?} names the program: {line}"));
        let (release, commit) = rest.split_once(' ').unwrap();
        assert_eq!(release, env!("CARGO_PKG_VERSION"), "{line}");
        let commit = commit
            .strip_prefix('(')
            .and_then(|c| c.strip_suffix(')'))
            .unwrap_or_else(|| panic!("the commit in brackets: {line}"));
        let hash = commit.strip_suffix("-dirty").unwrap_or(commit);
        assert!(
            commit == "unknown" || (hash.len() >= 7 && hash.chars().all(|c| c.is_ascii_hexdigit())),
            "a short hash, with -dirty, or unknown: {line}"
        );
        // Built from a checkout (as the tests are, where git is installed),
        // it is HEAD's hash.
        let head = std::process::Command::new("git")
            .args([
                "-C",
                env!("CARGO_MANIFEST_DIR"),
                "rev-parse",
                "--short",
                "HEAD",
            ])
            .output()
            .ok()
            .filter(|h| h.status.success());
        if let Some(head) = head {
            assert_eq!(hash, String::from_utf8_lossy(&head.stdout).trim(), "{line}");
        }
    }
}

/// Every endpoint kind and task kind `init` offers.
const ENDPOINTS: [&str; 4] = ["mock", "external", "local", "remote"];
const TASKS: [&str; 4] = ["chat", "json", "code", "conversation"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_starter_config_loads_and_the_mock_ones_run() {
    let env = Env::new();
    for endpoint in ENDPOINTS {
        for task in TASKS {
            let file = format!("{endpoint}/{task}.yaml");
            let ran = env
                .evalfleet(&["init", "--endpoint", endpoint, "--task", task, "-o", &file])
                .await;
            assert_eq!(ran.code, Some(0), "init {endpoint} {task}: {}", ran.stderr);
            let text = std::fs::read_to_string(env.path(&file)).unwrap();
            assert!(text.starts_with("# A starter config"), "commented: {text}");
            // A conversation's episodes are made up: it has no dataset.
            let items = env.path(&format!("{endpoint}/{task}-items.jsonl"));
            assert_eq!(
                items.exists(),
                task != "conversation",
                "{}",
                items.display()
            );
            // Loaded and resolved (every endpoint's command shown), no
            // server needed.
            let dry = env.evalfleet(&["run", "--dry-run", &file]).await;
            assert_eq!(dry.code, Some(0), "{file} loads: {}\n{text}", dry.stderr);
            if endpoint != "mock" {
                assert!(text.contains("# EDIT"), "{file} says what to edit: {text}");
                continue;
            }
            let run = env.evalfleet(&["run", &file]).await;
            assert_eq!(run.code, Some(0), "{file} runs: {}", run.stderr);
            if task == "conversation" {
                // Every episode ends, each decision read from the script.
                assert!(
                    run.stderr.contains("Conversation: 4 episodes (0 failed)")
                        && run.stderr.contains("invalid 0 (0%)"),
                    "{}",
                    run.stderr
                );
                continue;
            }
            let reasks = if task == "json" { 1 } else { 0 };
            assert!(
                run.stderr.contains(&format!(" {reasks} re-asks")),
                "{}",
                run.stderr
            );
            let report = env
                .evalfleet(&["report", &run.run_id(), "--json", "--out", "report"])
                .await;
            let report: Value = serde_json::from_str(&report.stdout).unwrap();
            let metric = &report["metrics"][0];
            // The mock's script: one wrong answer of three (chat), one
            // re-asked and then right (json), one wrong program of two (code).
            let (name, mean) = match task {
                "chat" => ("exact_match@1", 2.0 / 3.0),
                "json" => ("json_field_match@1", 1.0),
                _ => ("code_accepted@1", 0.5),
            };
            assert_eq!(metric["metric"], name, "{file}: {report}");
            let got = metric["mean"].as_f64().unwrap();
            assert!(
                (got - mean).abs() < 1e-9,
                "{file}: mean {got}, not {mean}: {report}"
            );
        }
    }
}

#[tokio::test]
async fn init_leaves_existing_files_alone_unless_forced() {
    let env = Env::new();
    let ran = env.evalfleet(&["init"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let items = env.write("evalfleet-items.jsonl", "mine\n");
    let again = env.evalfleet(&["init", "--task", "json"]).await;
    assert_eq!(again.code, Some(2), "{}", again.stderr);
    assert!(
        again.stderr.contains("evalfleet.yaml") && again.stderr.contains("--force"),
        "{}",
        again.stderr
    );
    assert_eq!(std::fs::read_to_string(&items).unwrap(), "mine\n");
    assert!(
        !std::fs::read_to_string(env.path("evalfleet.yaml"))
            .unwrap()
            .contains("schema")
    );
    let forced = env.evalfleet(&["init", "--task", "json", "--force"]).await;
    assert_eq!(forced.code, Some(0), "{}", forced.stderr);
    assert!(
        std::fs::read_to_string(env.path("evalfleet.yaml"))
            .unwrap()
            .contains("schema")
    );
    assert_ne!(std::fs::read_to_string(&items).unwrap(), "mine\n");
}

#[tokio::test]
async fn bash_completion_names_every_command() {
    let env = Env::new();
    let ran = env.evalfleet(&["completions", "bash"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert!(
        ran.stdout.contains("complete -F _evalfleet"),
        "{}",
        ran.stdout
    );
    for command in commands_in_help() {
        assert!(
            ran.stdout.contains(&format!("evalfleet__{command})"))
                || ran.stdout.contains(&format!("evalfleet,{command})")),
            "bash completion names {command}"
        );
    }
    let bad = env.evalfleet(&["completions", "tcsh"]).await;
    assert_eq!(bad.code, Some(2), "{}", bad.stderr);
}

#[tokio::test]
async fn man_pages_name_every_command() {
    let env = Env::new();
    let ran = env.evalfleet(&["man", "-o", "man"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let main = std::fs::read_to_string(env.path("man/evalfleet.1")).unwrap();
    assert!(main.contains(".TH evalfleet 1"), "{main}");
    for command in commands_in_help() {
        // The main page lists each command; each has a page of its own.
        assert!(
            main.contains(&format!("evalfleet\\-{command}(1)")),
            "evalfleet.1 names {command}"
        );
        let page = std::fs::read_to_string(env.path(&format!("man/evalfleet-{command}.1")))
            .unwrap_or_else(|e| panic!("evalfleet-{command}.1: {e}"));
        assert!(
            page.contains(&format!(".TH evalfleet-{command} 1")),
            "{page}"
        );
    }
    assert!(env.path("man/evalfleet-bench-report.1").exists());
    assert!(
        !env.path("man/evalfleet-supervise.1").exists(),
        "hidden commands have no page"
    );
}
