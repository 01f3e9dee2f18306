//! The SandboxFusion backend against a stand-in server: the same verdicts
//! as the local sandbox, retries of the server's own failures, compile
//! errors, and an unreachable server stopping the judge at its start.
//!
//! SandboxFusion itself is a Python service shipped as a container image
//! and a source tree; neither a Docker engine nor its sources can be had on
//! the machines that run these tests. The stand-in answers its `/run_code`
//! as its source does with `isolation: none`: the code runs as a plain
//! process (compiled first for C++), with the request's time limit;
//! `status` is `Success`, `Failed` (a non-zero exit or a time-out) or
//! `SandboxError`; `compile_result` and `run_result` carry `status`
//! (`Finished` or `TimeLimitExceeded`), `execution_time`, `return_code`,
//! `stdout` and `stderr`.

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
    let code = request["code"].as_str().unwrap();
    let stdin = request["stdin"].as_str().unwrap_or("");
    let run_timeout = request["run_timeout"].as_f64().unwrap();
    let compile_timeout = request["compile_timeout"].as_f64().unwrap();
    let (compile, run) = match request["language"].as_str().unwrap() {
        "python" => {
            std::fs::write(dir.join("main.py"), code).unwrap();
            (
                None,
                Some(run_command(&["/usr/bin/python3", "main.py"], &dir, stdin, run_timeout).await),
            )
        }
        "cpp" => {
            std::fs::write(dir.join("main.cpp"), code).unwrap();
            let compile = run_command(
                &["g++", "-O2", "-o", "main", "main.cpp"],
                &dir,
                "",
                compile_timeout,
            )
            .await;
            let run = if compile["return_code"] == 0 {
                Some(run_command(&["./main"], &dir, stdin, run_timeout).await)
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
    // The stand-in's limit is on the wall clock, which a loaded machine
    // (other tests run beside this one) stretches: room for a slow start.
    settings.limits.cpu = Duration::from_secs(3);
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
    let message = j.test_case_errors[0].message.as_deref().unwrap_or("");
    assert!(message.contains("undefined_name"), "{message}");
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
