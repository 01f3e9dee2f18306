//! The SandboxFusion backend against a stand-in server: the same verdicts
//! as the local sandbox (the same CPU-time limit, C++ built alike, every
//! failing test listed), retries of the server's own failures, compile
//! errors, and an unreachable server stopping the judge at its start.
//!
//! SandboxFusion itself is a Python service that CI cannot fetch. The
//! stand-in answers its `/run_code` as its source does (at 469de08, with
//! `isolation: none`): the request's `files` (base64) are put in a fresh
//! directory; the code is written there under a name of the server's own
//! (`tmpXXXX.py`, `.cpp`) and run as `python /that/path` or compiled with
//! `g++ -std=c++17 /that/path -o test -lpthread` (no optimisation; the
//! server adds `-lcrypto -lssl` where they link) and run as `./test`; the
//! time limit, `run_timeout`, is on the wall clock; a signal's death is its
//! negative return code; `status` is `Success`, `Failed` (a non-zero exit
//! or a time-out) or `SandboxError`; `compile_result` and `run_result`
//! carry `status` (`Finished` or `TimeLimitExceeded`), `execution_time`,
//! `return_code`, `stdout` and `stderr`. Its memory limit is not kept.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::routing::post;
use evalfleet_sandbox::{Backend, CodeJudge, CodeJudgeError, Format, Language, Verdict};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;

use crate::code_judge::{FLAWED_PYTHON, doubling_problem, have, http, settings};

#[derive(Default)]
struct Server {
    calls: AtomicUsize,
    /// The first this many calls answer `SandboxError`.
    failing: AtomicUsize,
}

async fn run_command(argv: &[&str], dir: &std::path::Path, stdin: &str, timeout: f64) -> Value {
    let started = Instant::now();
    let mut child = tokio::process::Command::new(argv[0])
        .args(&argv[1..])
        .current_dir(dir)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    let _ = input.write_all(stdin.as_bytes()).await;
    drop(input);
    match tokio::time::timeout(Duration::from_secs_f64(timeout), child.wait_with_output()).await {
        Ok(Ok(out)) => {
            use std::os::unix::process::ExitStatusExt;
            let code = out
                .status
                .code()
                .unwrap_or_else(|| -out.status.signal().unwrap_or(0));
            json!({
                "status": "Finished",
                "execution_time": started.elapsed().as_secs_f64(),
                "return_code": code,
                "stdout": String::from_utf8_lossy(&out.stdout),
                "stderr": String::from_utf8_lossy(&out.stderr),
            })
        }
        _ => json!({
            "status": "TimeLimitExceeded",
            "execution_time": started.elapsed().as_secs_f64(),
            "return_code": null,
            "stdout": "",
            "stderr": "",
        }),
    }
}

type JsonReply = ([(axum::http::header::HeaderName, &'static str); 1], String);

fn reply(value: &Value) -> JsonReply {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        value.to_string(),
    )
}

async fn run_code(State(server): State<Arc<Server>>, body: String) -> JsonReply {
    let request: Value = serde_json::from_str(&body).unwrap();
    server.calls.fetch_add(1, Ordering::SeqCst);
    let failed = server
        .failing
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok();
    if failed {
        return reply(
            &json!({"status": "SandboxError", "message": "executor pod lost", "run_result": null}),
        );
    }
    let dir = tempdir();
    if let Some(files) = request["files"].as_object() {
        use base64::Engine as _;
        for (name, content) in files {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(content.as_str().unwrap())
                .unwrap();
            std::fs::write(dir.join(name), bytes).unwrap();
        }
    }
    let named = dir.join(format!("tmp{:08x}", fastrand::u32(..)));
    let named = named.to_str().unwrap();
    let code = request["code"].as_str().unwrap();
    let stdin = request["stdin"].as_str().unwrap_or("");
    let run_timeout = request["run_timeout"].as_f64().unwrap();
    let compile_timeout = request["compile_timeout"].as_f64().unwrap();
    let (compile, run) = match request["language"].as_str().unwrap() {
        "python" => {
            let source = format!("{named}.py");
            std::fs::write(&source, code).unwrap();
            (
                None,
                Some(run_command(&["/usr/bin/python3", &source], &dir, stdin, run_timeout).await),
            )
        }
        "cpp" => {
            let source = format!("{named}.cpp");
            std::fs::write(&source, code).unwrap();
            let compile = run_command(
                &["g++", "-std=c++17", &source, "-o", "test", "-lpthread"],
                &dir,
                "",
                compile_timeout,
            )
            .await;
            let run = if compile["return_code"] == 0 {
                Some(run_command(&["./test"], &dir, stdin, run_timeout).await)
            } else {
                None
            };
            (Some(compile), run)
        }
        other => panic!("the stand-in does not run {other}"),
    };
    let _ = std::fs::remove_dir_all(&dir);
    let failed = [&compile, &run]
        .into_iter()
        .flatten()
        .any(|r| r["status"] == "TimeLimitExceeded" || r["return_code"] != 0);
    reply(&json!({
        "status": if failed { "Failed" } else { "Success" },
        "message": "",
        "compile_result": compile,
        "run_result": run,
        "executor_pod_name": null,
        "files": {},
    }))
}

fn tempdir() -> std::path::PathBuf {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("fusion-standin")
        .join(format!("{:016x}", fastrand::u64(..)));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn serve(server: Arc<Server>) -> String {
    let app = axum::Router::new()
        .route("/run_code", post(run_code))
        .with_state(server);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{address}")
}

fn remote(url: &str, format: Format, language: Language) -> evalfleet_sandbox::CodeSettings {
    let mut s = settings(format, language);
    s.tool = None;
    s.backend = Backend::SandboxFusion {
        url: url.to_owned(),
        retries: Some(3),
        retry_for: std::time::Duration::from_secs(120),
    };
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxfusion_gives_the_verdicts_the_local_sandbox_gives() {
    let server = Arc::new(Server::default());
    let url = serve(server.clone()).await;
    let mut settings = remote(&url, Format::Stdio, Language::Python);
    settings.limits.cpu = Duration::from_secs(1);
    settings.limits.wall = Duration::from_secs(20);
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fusion");
    let judge = CodeJudge::new(settings.clone(), &dir, http())
        .await
        .unwrap();
    assert!(judge.describe().contains(&url), "{}", judge.describe());
    let item = doubling_problem(20);
    let j = judge.judge(&item, FLAWED_PYTHON).await.unwrap();
    assert_eq!((j.total, j.passed), (21, 18), "{:?}", j.test_case_errors);
    assert_eq!(j.verdict, Verdict::Timeout);
    for verdict in ["timeout", "wrong_answer", "runtime_error"] {
        assert_eq!(j.error_type_counts.get(verdict), Some(&1), "{verdict}");
    }

    // The same problem judged here: the same verdicts.
    settings.backend = Backend::Local;
    settings.tool = Some("/usr/bin/python3".to_owned());
    let local = CodeJudge::new(settings, &dir, None).await.unwrap();
    let here = local.judge(&item, FLAWED_PYTHON).await.unwrap();
    assert_eq!(here.error_type_counts, j.error_type_counts);
    let indices = |j: &evalfleet_sandbox::Judgement| {
        j.test_case_errors
            .iter()
            .map(|t| (t.index, t.verdict))
            .collect::<Vec<_>>()
    };
    assert_eq!(indices(&here), indices(&j));

    // The server's own failures are retried: the verdicts do not change.
    server.failing.store(2, Ordering::SeqCst);
    let before = server.calls.load(Ordering::SeqCst);
    let again = judge.judge(&item, FLAWED_PYTHON).await.unwrap();
    assert_eq!(again.error_type_counts, j.error_type_counts);
    assert_eq!(server.calls.load(Ordering::SeqCst) - before, 21 + 2);

    // Past its retries, the failure is the judge's, not a verdict.
    server.failing.store(100, Ordering::SeqCst);
    let err = judge
        .judge(
            &json!({"tests": [{"input": "1", "output": "2"}]}),
            "print(2)",
        )
        .await
        .err()
        .unwrap();
    assert!(err.to_string().contains("executor pod lost"), "{err}");
    server.failing.store(0, Ordering::SeqCst);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compile_error_on_sandboxfusion_stops_the_problem() {
    if !have("g++") {
        return;
    }
    let server = Arc::new(Server::default());
    let url = serve(server.clone()).await;
    let mut settings = remote(&url, Format::Stdio, Language::Cpp);
    settings.concurrency = 1;
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fusion-cpp");
    let judge = CodeJudge::new(settings, &dir, http()).await.unwrap();
    let before = server.calls.load(Ordering::SeqCst);
    let j = judge
        .judge(
            &doubling_problem(30),
            "int main() { return undefined_name; }",
        )
        .await
        .unwrap();
    assert_eq!(j.verdict, Verdict::CompileError);
    assert_eq!(
        server.calls.load(Ordering::SeqCst) - before,
        1,
        "one compile error is enough"
    );
    // Every test is listed with it, as when the program is compiled here.
    assert_eq!(j.error_type_counts.get("compile_error"), Some(&31));
    let listed: Vec<usize> = j.test_case_errors.iter().map(|t| t.index).collect();
    assert_eq!(listed, (0..31).collect::<Vec<_>>());
    let message = j.test_case_errors[0].message.as_deref().unwrap_or("");
    assert!(message.contains("undefined_name"), "{message}");
    assert!(
        j.compile
            .as_ref()
            .is_some_and(|c| !c.ok && c.message.as_deref() == Some(message))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_sandboxfusion_stops_the_judge_at_its_start() {
    // A port that was just free: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut settings = remote(
        &format!("http://127.0.0.1:{port}"),
        Format::Stdio,
        Language::Python,
    );
    settings.backend = Backend::SandboxFusion {
        url: format!("http://127.0.0.1:{port}"),
        retries: Some(0),
        retry_for: std::time::Duration::from_secs(120),
    };
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fusion-none");
    let err = CodeJudge::new(settings, &dir, http()).await.err().unwrap();
    assert!(matches!(err, CodeJudgeError::Setup(_)), "{err:?}");
    assert!(
        err.to_string().contains(&format!("127.0.0.1:{port}")),
        "{err}"
    );
}

/// The judgements of `answer` on `item` here and on the stand-in at `url`.
async fn both(
    url: &str,
    mut settings: evalfleet_sandbox::CodeSettings,
    name: &str,
    item: &Value,
    answers: &[&str],
) -> Vec<(evalfleet_sandbox::Judgement, evalfleet_sandbox::Judgement)> {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let remote_settings = settings.clone();
    settings.backend = Backend::Local;
    if settings.language == Language::Python {
        settings.tool = Some("/usr/bin/python3".to_owned());
    }
    let here = CodeJudge::new(settings, &dir, None).await.unwrap();
    let there = CodeJudge::new(
        evalfleet_sandbox::CodeSettings {
            backend: Backend::SandboxFusion {
                url: url.to_owned(),
                retries: Some(0),
                retry_for: Duration::from_secs(10),
            },
            ..remote_settings
        },
        &dir,
        http(),
    )
    .await
    .unwrap();
    let mut judged = Vec::new();
    for answer in answers {
        judged.push((
            here.judge(item, answer).await.unwrap(),
            there.judge(item, answer).await.unwrap(),
        ));
    }
    judged
}

fn verdicts(j: &evalfleet_sandbox::Judgement) -> Vec<(usize, Verdict)> {
    j.test_case_errors
        .iter()
        .map(|t| (t.index, t.verdict))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxfusion_limits_cpu_time_not_the_wall_clock_as_here() {
    let server = Arc::new(Server::default());
    let url = serve(server).await;
    let mut settings = remote(&url, Format::Stdio, Language::Python);
    settings.limits.cpu = Duration::from_secs(1);
    settings.limits.wall = Duration::from_secs(20);
    let item = json!({"tests": [
        {"input": "spin\n", "output": "-\n"},
        {"input": "sleep\n", "output": "slept\n"},
        {"input": "x\n", "output": "-\n"},
        {"input": "2\n", "output": "4\n"},
    ]});
    // Spins past its CPU limit; sleeps past it on the wall clock, using
    // no CPU; raises on line 7.
    let program = "import time\nword = input()\nif word == 'spin':\n    while True: pass\nif word == 'sleep':\n    time.sleep(1.5); print('slept'); raise SystemExit\nprint(int(word) * 2)\n";
    let judged = both(&url, settings, "fusion-cpu", &item, &[program]).await;
    let (here, there) = &judged[0];
    assert_eq!(
        verdicts(here),
        [(0, Verdict::Timeout), (2, Verdict::RuntimeError)]
    );
    assert_eq!(verdicts(there), verdicts(here));
    for j in [here, there] {
        let spun = &j.test_case_errors[0];
        assert_eq!(spun.message.as_deref(), Some("CPU time limit exceeded"));
        assert!(spun.seconds < 10.0, "stopped at its CPU limit: {spun:?}");
        // The traceback names the program's file and line, not a driver's.
        let raised = j.test_case_errors[1].message.as_deref().unwrap_or("");
        assert!(raised.contains("main.py\", line 7"), "{raised}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpp_on_sandboxfusion_is_built_and_limited_as_here() {
    if !have("g++") {
        return;
    }
    let server = Arc::new(Server::default());
    let url = serve(server).await;
    let mut settings = remote(&url, Format::Stdio, Language::Cpp);
    settings.limits.cpu = Duration::from_secs(1);
    settings.limits.wall = Duration::from_secs(20);
    let item = json!({"tests": [
        {"input": "flags\n", "output": "O0 strict line 15\n"},
        {"input": "spin\n", "output": "-\n"},
        {"input": "3\n", "output": "6\n"},
        {"input": "4\n", "output": "8\n"},
    ]});
    // Says how it was built (line 15 prints its own line number); spins
    // past its CPU limit; 4 is doubled wrong.
    let program = "#include <cstdio>\n#include <cstdlib>\n#include <cstring>\nint main() {\n  char word[16] = {0};\n  if (std::scanf(\"%15s\", word) != 1) return 1;\n  if (!std::strcmp(word, \"flags\")) {\n    bool optimised = false, strict = false;\n#ifdef __OPTIMIZE__\n    optimised = true;\n#endif\n#ifdef __STRICT_ANSI__\n    strict = true;\n#endif\n    std::printf(\"%s %s line %d\\n\", optimised ? \"O2\" : \"O0\", strict ? \"strict\" : \"gnu\", __LINE__);\n    return 0;\n  }\n  if (!std::strcmp(word, \"spin\")) { volatile long k = 0; for (;;) k++; }\n  std::printf(\"%d\\n\", std::atoi(word) * 2 + (word[0] == '4'));\n}\n";
    let broken = "int main() {\n  return undefined_name;\n}\n";
    let judged = both(
        &url,
        settings,
        "fusion-cpp-alike",
        &item,
        &[program, broken],
    )
    .await;
    let (here, there) = &judged[0];
    assert_eq!(
        verdicts(here),
        [(1, Verdict::Timeout), (3, Verdict::WrongAnswer)],
        "built with -std=c++17 and no -O, the line unmoved: {:?}",
        here.test_case_errors
    );
    assert_eq!(
        verdicts(there),
        verdicts(here),
        "{:?}",
        there.test_case_errors
    );
    assert_eq!(
        there.test_case_errors[0].message.as_deref(),
        Some("CPU time limit exceeded")
    );
    // A compile error names the program's line on either backend.
    let (here, there) = &judged[1];
    for j in [here, there] {
        assert_eq!(j.error_type_counts.get("compile_error"), Some(&4));
        assert_eq!(j.test_case_errors.len(), 4);
        let message = j.test_case_errors[0].message.as_deref().unwrap_or("");
        assert!(message.contains("main.cpp:2:"), "{message}");
    }
}

/// The same answers judged here and on a real SandboxFusion server, given
/// by `EVALFLEET_SANDBOXFUSION_URL` (run by hand: CI cannot install it), each set
/// at once at `judge_concurrency: 20` with the task's default limits (10 s
/// of CPU, 30 s on the wall clock) or a one-second CPU limit: verdicts and
/// failing tests must agree. Prints a table of both.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "by hand, against a real SandboxFusion server: EVALFLEET_SANDBOXFUSION_URL=http://HOST:PORT cargo test -p evalfleet-sandbox --test tests -- --ignored fusion"]
async fn a_real_sandboxfusion_judges_as_the_local_sandbox() {
    let url = std::env::var("EVALFLEET_SANDBOXFUSION_URL")
        .expect("EVALFLEET_SANDBOXFUSION_URL names the SandboxFusion server to compare with");
    let Some(path) = crate::code_judge::shared_data("mbpp-sanitized.json") else {
        return;
    };
    let mbpp: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mbpp_123 = mbpp.iter().find(|p| p["task_id"] == 123).unwrap().clone();
    let sleepy = json!({"tests": (0..20).map(|i| json!({"input": format!("{i}\n"), "output": format!("{}\n", i * 2)})).collect::<Vec<_>>()});
    let one = json!({"tests": [{"input": "1\n", "output": "1\n"}]});
    // At -O0 about 2 s of CPU on this machine, at -O2 a quarter of one.
    let o2_bound = "#include <cstdio>\n#include <vector>\nint main() {\n  std::vector<long> v(1 << 16, 1);\n  long s = 0;\n  for (int r = 0; r < 9000; r++)\n    for (std::size_t i = 0; i < v.size(); i++) s += v[i] ^ r;\n  std::printf(\"%d\\n\", s > 0);\n}\n";
    let rust_spin = "fn main() { let mut k: u64 = 0; loop { k = k.wrapping_add(1); if k == 3 { std::hint::black_box(k); } } }";
    struct Case {
        name: &'static str,
        format: Format,
        language: Language,
        cpu_secs: u64,
        item: Value,
        answer: String,
        copies: usize,
    }
    let case = |name, format, language, cpu_secs, item: &Value, answer: &str, copies| Case {
        name,
        format,
        language,
        cpu_secs,
        item: item.clone(),
        answer: answer.to_owned(),
        copies,
    };
    let cases = [
        case(
            "MBPP 123 canonical, 10 at once",
            Format::Mbpp,
            Language::Python,
            10,
            &mbpp_123,
            mbpp_123["code"].as_str().unwrap(),
            10,
        ),
        case(
            "Python busy loop",
            Format::Stdio,
            Language::Python,
            10,
            &one,
            "while True: pass\n",
            1,
        ),
        case(
            "Python sleeps 12 s, 20 tests",
            Format::Stdio,
            Language::Python,
            10,
            &sleepy,
            "import time\ntime.sleep(12)\nprint(int(input()) * 2)\n",
            1,
        ),
        case(
            "Python failing several tests",
            Format::Stdio,
            Language::Python,
            1,
            &doubling_problem(20),
            FLAWED_PYTHON,
            1,
        ),
        case(
            "Python syntax error, 21 tests",
            Format::Stdio,
            Language::Python,
            1,
            &doubling_problem(20),
            "print(int(input() * 2)\n",
            1,
        ),
        case(
            "C++ needing -O2, 1 s",
            Format::Stdio,
            Language::Cpp,
            1,
            &one,
            o2_bound,
            1,
        ),
        case(
            "C++ busy loop, 1 s",
            Format::Stdio,
            Language::Cpp,
            1,
            &one,
            "int main() { volatile long k = 0; for (;;) k++; }\n",
            1,
        ),
        case(
            "C++ compile error, 21 tests",
            Format::Stdio,
            Language::Cpp,
            1,
            &doubling_problem(20),
            "int main() {\n  return undefined_name;\n}\n",
            1,
        ),
        case(
            "Rust busy loop, 1 s",
            Format::Stdio,
            Language::Rust,
            1,
            &one,
            rust_spin,
            1,
        ),
    ];
    let summary = |j: &evalfleet_sandbox::Judgement| {
        format!(
            "{} {}/{} {:?}",
            j.verdict.as_str(),
            j.passed,
            j.total,
            j.error_type_counts
        )
    };
    println!("| case | local | SandboxFusion | same |\n|---|---|---|---|");
    let mut differ = Vec::new();
    for case in &cases {
        let mut settings = settings(case.format, case.language);
        settings.limits.cpu = Duration::from_secs(case.cpu_secs);
        settings.limits.wall = settings.limits.cpu * 3;
        settings.limits.memory_mb = 1024;
        settings.concurrency = 20;
        settings.compile_timeout = Duration::from_secs(30);
        if case.language == Language::Rust && !have("rustc") {
            continue;
        }
        let mut seen = Vec::new();
        for remote in [false, true] {
            let mut settings = settings.clone();
            let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fusion-real");
            let judge = if remote {
                settings.tool = None;
                settings.backend = Backend::SandboxFusion {
                    url: url.clone(),
                    retries: Some(0),
                    retry_for: Duration::from_secs(10),
                };
                CodeJudge::new(settings, &dir, http()).await.unwrap()
            } else {
                CodeJudge::new(settings, &dir, None).await.unwrap()
            };
            let started = Instant::now();
            let judged = futures_util::future::join_all(
                (0..case.copies).map(|_| judge.judge(&case.item, &case.answer)),
            )
            .await;
            let judged: Vec<_> = judged.into_iter().map(Result::unwrap).collect();
            let mut all: Vec<String> = judged.iter().map(summary).collect();
            all.dedup();
            let first = &judged[0].test_case_errors;
            let message = first
                .first()
                .and_then(|t| t.message.clone())
                .unwrap_or_default()
                .replace('\n', " ⏎ ");
            seen.push((
                all.clone(),
                judged.iter().map(verdicts).collect::<Vec<_>>(),
                format!(
                    "{} ({} listed; first: {:.70}; {:.1} s)",
                    all.join(" / "),
                    first.len(),
                    message,
                    started.elapsed().as_secs_f64()
                ),
            ));
        }
        let same = seen[0].0 == seen[1].0 && seen[0].1 == seen[1].1;
        println!(
            "| {} | {} | {} | {} |",
            case.name,
            seen[0].2,
            seen[1].2,
            if same { "yes" } else { "NO" }
        );
        if !same {
            differ.push(case.name);
        }
    }
    assert!(differ.is_empty(), "the backends differ on {differ:?}");
}
