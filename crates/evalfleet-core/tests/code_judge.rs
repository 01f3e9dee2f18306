//! The code judge on real problems: HumanEval's and MBPP's canonical
//! solutions are accepted, wrong ones are not, with the right verdicts.

use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use evalfleet_core::code::{self, CodeSettings, Format, Verdict};
use evalfleet_core::sandbox::{Isolation, Limits};
use serde_json::Value;
use tokio::sync::Semaphore;

/// `../shared/data/NAME`, or `$EVALFLEET_TEST_DATA/NAME`.
pub fn shared_data(name: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("EVALFLEET_TEST_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/data"))
        });
    let path = dir.join(name);
    if path.is_file() {
        Some(path)
    } else {
        eprintln!("skipped: {} is absent", path.display());
        None
    }
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

fn settings(format: Format) -> CodeSettings {
    CodeSettings {
        format,
        limits: Limits {
            wall: Duration::from_secs(60),
            cpu: Duration::from_secs(20),
            memory_mb: 1024,
            ..Limits::default()
        },
        early_exit: false,
        concurrency: 2,
        float_tolerance: None,
        python: "/usr/bin/python3".to_owned(),
    }
}

fn parent() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("code-judge")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn humaneval_canonical_solutions_pass_and_wrong_ones_do_not() {
    let Some(problems) = humaneval() else { return };
    assert_eq!(problems.len(), 164);
    let isolation = Isolation::detect().await;
    let settings = settings(Format::HumanEval);
    let slots = Arc::new(Semaphore::new(4));
    let mut accepted = 0;
    let mut wrong_verdicts = std::collections::BTreeMap::new();
    for p in &problems {
        let answer = format!(
            "```python\n{}\n```",
            p["canonical_solution"].as_str().unwrap()
        );
        let j = code::judge(&settings, &isolation, &slots, &parent(), p, &answer)
            .await
            .unwrap();
        assert!(j.accepted, "{}: {:?}", p["task_id"], j.test_case_errors);
        accepted += 1;
        // The same function returning nothing useful.
        let wrong = code::judge(
            &settings,
            &isolation,
            &slots,
            &parent(),
            p,
            "    return None\n",
        )
        .await
        .unwrap();
        assert!(!wrong.accepted, "{} accepted a wrong answer", p["task_id"]);
        *wrong_verdicts.entry(wrong.verdict.as_str()).or_insert(0) += 1;
    }
    assert_eq!(accepted, 164);
    // A function returning None fails an assertion, or crashes on the None.
    let total: usize = wrong_verdicts.values().sum();
    assert_eq!(total, 164);
    assert!(
        wrong_verdicts
            .keys()
            .all(|v| *v == "wrong_answer" || *v == "runtime_error"),
        "{wrong_verdicts:?}"
    );
    assert!(wrong_verdicts["wrong_answer"] > 100, "{wrong_verdicts:?}");

    // Broken syntax is a syntax error, not a wrong answer.
    let p = &problems[0];
    let broken = code::judge(
        &settings,
        &isolation,
        &slots,
        &parent(),
        p,
        "    return (\n",
    )
    .await
    .unwrap();
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
    let isolation = Isolation::detect().await;
    let settings = settings(Format::Mbpp);
    let slots = Arc::new(Semaphore::new(4));
    // Every problem at once: the slots bound the executions.
    let mut all = tokio::task::JoinSet::new();
    for p in problems {
        let (settings, isolation, slots) = (settings.clone(), isolation.clone(), slots.clone());
        all.spawn(async move {
            let j = code::judge(
                &settings,
                &isolation,
                &slots,
                &parent(),
                &p,
                p["code"].as_str().unwrap(),
            )
            .await
            .unwrap();
            (p["task_id"].clone(), j)
        });
    }
    let mut tests = 0;
    while let Some(done) = all.join_next().await {
        let (id, j) = done.unwrap();
        assert!(j.accepted, "task {id}: {:?}", j.test_case_errors);
        tests += j.total;
    }
    assert!(tests >= 427 * 3, "{tests}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdio_tests_get_verdicts_and_the_worst_one_wins() {
    let isolation = Isolation::detect().await;
    let mut settings = settings(Format::Stdio);
    settings.limits.wall = Duration::from_secs(2);
    settings.limits.cpu = Duration::from_secs(1);
    let slots = Arc::new(Semaphore::new(4));
    // Doubles its input; input 7 loops forever; input 5 prints a wrong value.
    let program =
        "n = int(input())\nif n == 7:\n    while True: pass\nprint(n * 2 + (1 if n == 5 else 0))\n";
    let mut tests: Vec<Value> = (0..40)
        .map(|i| serde_json::json!({"input": format!("{i}\n"), "output": format!("{}\n", i * 2)}))
        .collect();
    tests.push(serde_json::json!({"input": "x\n", "output": "0\n"}));
    let item = serde_json::json!({ "tests": tests });
    let j = code::judge(&settings, &isolation, &slots, &parent(), &item, program)
        .await
        .unwrap();
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
    let slots = Arc::new(Semaphore::new(1));
    let j = code::judge(&settings, &isolation, &slots, &parent(), &item, program)
        .await
        .unwrap();
    assert!(
        !j.accepted && j.passed + j.test_case_errors.len() < 41,
        "{} + {}",
        j.passed,
        j.test_case_errors.len()
    );
}
