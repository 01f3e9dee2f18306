//! The code judge on real problems: HumanEval's and MBPP's canonical
//! solutions are accepted, wrong ones are not, with the right verdicts; C++
//! and Rust programs are compiled once and run for every test.

use std::io::Read;
use std::path::PathBuf;
use std::time::Duration;

use evalfleet_sandbox::code::Extraction;
use evalfleet_sandbox::sandbox::Limits;
use evalfleet_sandbox::{
    Backend, CodeJudge, CodeJudgeError, CodeSettings, Format, Language, Verdict,
};
use futures_util::future::join_all;
use serde_json::Value;

/// `../shared/data/NAME`, or `$EVALFLEET_TEST_DATA/NAME`; `None` (the test
/// skips) when it is absent.
pub fn shared_data(name: &str) -> Option<PathBuf> {
    evalfleet_testkit::shared_data!(name)
}

fn humaneval() -> Option<Vec<Value>> {
    let path = shared_data("humaneval.jsonl.gz")?;
    let mut text = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(path).unwrap())
        .read_to_string(&mut text)
        .unwrap();
    Some(
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect(),
    )
}

/// The HTTP client a remote sandbox needs.
pub fn http() -> Option<reqwest::Client> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    Some(reqwest::Client::builder().build().unwrap())
}

pub fn settings(format: Format, language: Language) -> CodeSettings {
    CodeSettings {
        format,
        language,
        tool: (language == Language::Python).then(|| "/usr/bin/python3".to_owned()),
        limits: Limits {
            wall: Duration::from_secs(60),
            cpu: Duration::from_secs(20),
            memory_mb: 1024,
            ..Limits::default()
        },
        compile_timeout: Duration::from_secs(60),
        early_exit: false,
        concurrency: 4,
        float_tolerance: None,
        stdio_fields: vec!["tests".to_owned()],
        backend: Backend::Local,
    }
}

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name)
}

/// A judge on this machine's sandbox, under the test directory `name`.
async fn local(settings: CodeSettings, name: &str) -> CodeJudge {
    CodeJudge::new(settings, &dir(name), None).await.unwrap()
}

/// Whether the tool a language needs is here; when not, the test skips.
pub fn have(program: &str) -> bool {
    let found = std::process::Command::new(program)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        evalfleet_testkit::skip!("{program} is absent");
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn humaneval_canonical_solutions_pass_and_wrong_ones_do_not() {
    let Some(problems) = humaneval() else { return };
    assert_eq!(problems.len(), 164);
    let judge = local(settings(Format::HumanEval, Language::Python), "humaneval").await;
    // Every problem at once: the judge's slots bound the executions.
    let right = join_all(problems.iter().map(|p| {
        let answer = format!(
            "```python\n{}\n```",
            p["canonical_solution"].as_str().unwrap()
        );
        let judge = &judge;
        async move { judge.judge(p, &answer).await.unwrap() }
    }))
    .await;
    for (p, j) in problems.iter().zip(&right) {
        assert!(j.accepted, "{}: {:?}", p["task_id"], j.test_case_errors);
        assert_eq!(j.extraction, Extraction::FencedPython);
    }
    // The same functions returning nothing useful.
    let wrong = join_all(problems.iter().map(|p| judge.judge(p, "    return None\n"))).await;
    let mut verdicts = std::collections::BTreeMap::new();
    for (p, j) in problems.iter().zip(wrong) {
        let j = j.unwrap();
        assert!(!j.accepted, "{} accepted a wrong answer", p["task_id"]);
        *verdicts.entry(j.verdict.as_str()).or_insert(0) += 1;
    }
    // A function returning None fails an assertion, or crashes on the None.
    assert_eq!(verdicts.values().sum::<usize>(), 164);
    assert!(
        verdicts
            .keys()
            .all(|v| *v == "wrong_answer" || *v == "runtime_error"),
        "{verdicts:?}"
    );
    assert!(verdicts["wrong_answer"] > 100, "{verdicts:?}");

    // Broken syntax is a syntax error, not a wrong answer.
    let broken = judge.judge(&problems[0], "    return (\n").await.unwrap();
    assert_eq!(broken.verdict, Verdict::SyntaxError);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mbpp_canonical_solutions_pass_each_assert() {
    let Some(path) = shared_data("mbpp-sanitized.json") else {
        return;
    };
    let problems: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(problems.len(), 427);
    let judge = local(settings(Format::Mbpp, Language::Python), "mbpp").await;
    let judged = join_all(
        problems
            .iter()
            .map(|p| judge.judge(p, p["code"].as_str().unwrap())),
    )
    .await;
    let mut tests = 0;
    for (p, j) in problems.iter().zip(judged) {
        let j = j.unwrap();
        assert!(
            j.accepted,
            "task {}: {:?}",
            p["task_id"], j.test_case_errors
        );
        tests += j.total;
    }
    assert!(tests >= 427 * 3, "{tests}");
    // Half the asserts of every problem fail for a function that returns
    // its first argument.
    let wrong = judge
        .judge(&problems[0], "def similar_elements(a, b):\n    return a\n")
        .await
        .unwrap();
    assert_eq!(wrong.verdict, Verdict::WrongAnswer, "{wrong:?}");
    assert_eq!(wrong.passed, 0);
}

/// A stdin/stdout problem: doubles its input; `bad` are inputs the wrong
/// programs below mishandle.
pub fn doubling_problem(count: usize) -> Value {
    let mut tests: Vec<Value> = (0..count)
        .map(|i| serde_json::json!({"input": format!("{i}\n"), "output": format!("{}\n", i * 2)}))
        .collect();
    tests.push(serde_json::json!({"input": "x\n", "output": "0\n"}));
    serde_json::json!({ "tests": tests })
}

/// Doubles its input; input 7 loops forever; input 5 prints a wrong value;
/// `x` is not a number (a crash).
pub const FLAWED_PYTHON: &str =
    "n = int(input())\nif n == 7:\n    while True: pass\nprint(n * 2 + (1 if n == 5 else 0))\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdio_tests_get_verdicts_and_the_worst_one_wins() {
    let mut settings = settings(Format::Stdio, Language::Python);
    // The loop ends at its CPU limit; the wall clock has room for a
    // machine loaded by the tests beside this one.
    settings.limits.wall = Duration::from_secs(8);
    settings.limits.cpu = Duration::from_secs(1);
    let judge = local(settings.clone(), "stdio").await;
    let item = doubling_problem(40);
    let j = judge.judge(&item, FLAWED_PYTHON).await.unwrap();
    assert!(!j.accepted);
    assert_eq!((j.total, j.passed), (41, 38));
    assert_eq!(j.error_type_counts.get("timeout"), Some(&1));
    assert_eq!(j.error_type_counts.get("wrong_answer"), Some(&1));
    assert_eq!(
        j.error_type_counts.get("runtime_error"),
        Some(&1),
        "int('x') raises"
    );
    assert_eq!(
        j.verdict,
        Verdict::Timeout,
        "timeout outranks runtime error and wrong answer"
    );
    let wrong = j
        .test_case_errors
        .iter()
        .find(|t| t.verdict == Verdict::WrongAnswer)
        .unwrap();
    assert_eq!(
        (wrong.index, wrong.expected.as_deref(), wrong.got.as_deref()),
        (5, Some("10"), Some("11"))
    );

    // With early exit, a failure stops the problem's remaining tests.
    settings.early_exit = true;
    settings.concurrency = 1;
    let judge = local(settings, "stdio-early").await;
    let j = judge.judge(&item, FLAWED_PYTHON).await.unwrap();
    assert!(
        !j.accepted && j.passed + j.test_case_errors.len() < 41,
        "{} + {}",
        j.passed,
        j.test_case_errors.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpp_programs_are_compiled_once_and_run_for_every_test() {
    if !have("g++") {
        return;
    }
    let mut settings = settings(Format::Stdio, Language::Cpp);
    settings.limits.wall = Duration::from_secs(8);
    settings.limits.cpu = Duration::from_secs(1);
    let judge = local(settings, "cpp").await;
    let item = doubling_problem(60);
    let right = "Here it is:\n```cpp\n#include <iostream>\n#include <string>\nint main() { std::string s; std::cin >> s; if (s == \"x\") { std::cout << 0 << std::endl; return 0; } long n = std::stol(s); std::cout << n * 2 << std::endl; }\n```\n";
    let j = judge.judge(&item, right).await.unwrap();
    assert!(j.accepted, "{:?} {:?}", j.compile, j.test_case_errors);
    assert_eq!((j.passed, j.total), (61, 61));
    assert_eq!(j.extraction, Extraction::FencedCpp);
    assert!(j.compile.as_ref().is_some_and(|c| c.ok));

    // Input 7 loops, 5 is off by one, 9 dereferences null, x throws.
    let flawed = "#include <iostream>\n#include <string>\nint main() { std::string s; std::cin >> s; long n = std::stol(s); if (n == 7) { volatile long k = 0; while (true) { k++; } } if (n == 9) { int *p = nullptr; *p = 1; } std::cout << n * 2 + (n == 5) << std::endl; }\n";
    let j = judge.judge(&item, flawed).await.unwrap();
    assert_eq!(j.verdict, Verdict::Timeout, "{:?}", j.test_case_errors);
    assert_eq!(j.passed, 57);
    assert_eq!(j.error_type_counts.get("timeout"), Some(&1));
    assert_eq!(j.error_type_counts.get("wrong_answer"), Some(&1));
    assert_eq!(
        j.error_type_counts.get("runtime_error"),
        Some(&2),
        "a null dereference and an uncaught exception: {:?}",
        j.test_case_errors
    );

    let broken = "int main() { return undefined_name; }";
    let j = judge.judge(&item, broken).await.unwrap();
    assert_eq!(j.verdict, Verdict::CompileError);
    assert_eq!(j.error_type_counts.get("compile_error"), Some(&61));
    let message = j.test_case_errors[0].message.as_deref().unwrap_or("");
    assert!(message.contains("undefined_name"), "{message}");
    assert!(j.compile.is_some_and(|c| !c.ok));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_programs_are_compiled_once_and_run_for_every_test() {
    if !have("rustc") {
        return;
    }
    let judge = local(settings(Format::Stdio, Language::Rust), "rust").await;
    let item = serde_json::json!({
        "tests": (0..20).map(|i| serde_json::json!({"input": format!("{i}\n"), "output": format!("{}\n", i * 2)})).collect::<Vec<_>>(),
    });
    let right = "```rust\nuse std::io::Read;\nfn main() { let mut s = String::new(); std::io::stdin().read_to_string(&mut s).unwrap(); let n: i64 = s.trim().parse().unwrap(); println!(\"{}\", n * 2); }\n```";
    let j = judge.judge(&item, right).await.unwrap();
    assert!(j.accepted, "{:?} {:?}", j.compile, j.test_case_errors);
    assert_eq!(j.extraction, Extraction::FencedRust);

    // A panic is a runtime error.
    let panics = "fn main() { let v: Vec<i64> = Vec::new(); println!(\"{}\", v[3]); }";
    let j = judge.judge(&item, panics).await.unwrap();
    assert_eq!(j.verdict, Verdict::RuntimeError);
    assert_eq!(j.error_type_counts.get("runtime_error"), Some(&20));

    let broken = "fn main() { let x: i64 = \"text\"; }";
    let j = judge.judge(&item, broken).await.unwrap();
    assert_eq!(j.verdict, Verdict::CompileError);
    let message = j.test_case_errors[0].message.as_deref().unwrap_or("");
    assert!(message.contains("mismatched types"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_toolchain_stops_the_judge_at_its_start() {
    let mut settings = settings(Format::Stdio, Language::Cpp);
    settings.tool = Some("/nonexistent/g++".to_owned());
    let err = CodeJudge::new(settings, &dir("missing"), None)
        .await
        .err()
        .unwrap();
    assert!(matches!(err, CodeJudgeError::Setup(_)), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("cpp program does not run") && text.contains("/nonexistent/g++"),
        "{text}"
    );
}
