//! The code judge: a program is taken out of a model's answer, assembled
//! with a problem's tests and run in the [`sandbox`](crate::sandbox), each
//! test to a verdict, the problem to one verdict.

use std::path::Path;
use std::sync::Arc;

use serde::Serialize;
use serde_json::Value;
use tokio::sync::Semaphore;

use crate::sandbox::{self, Ended, Execution, Isolation, Limits, Workdir};

/// How a problem's tests are given (`task.code.format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `prompt`, `entry_point`, `test`: the program is the prompt, the
    /// completion, the test and `check(entry_point)`; one test.
    HumanEval,
    /// `test_list` (asserts), `test_imports`, `test_setup_code`: the code,
    /// the setup, the imports and one assert per test.
    Mbpp,
    /// `tests`: a list of `{input, output}`; the program reads stdin.
    Stdio,
}

impl Format {
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "humaneval" => Some(Self::HumanEval),
            "mbpp" => Some(Self::Mbpp),
            "stdio" => Some(Self::Stdio),
            _ => None,
        }
    }
}

/// A test's (or a problem's) verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    // Declared in the order of precedence for a problem's verdict.
    SyntaxError,
    CompileError,
    Timeout,
    MemoryLimit,
    RuntimeError,
    WrongAnswer,
    Success,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SyntaxError => "syntax_error",
            Self::CompileError => "compile_error",
            Self::Timeout => "timeout",
            Self::MemoryLimit => "memory_limit",
            Self::RuntimeError => "runtime_error",
            Self::WrongAnswer => "wrong_answer",
            Self::Success => "success",
        }
    }
}

/// The judge's settings (`task.code`).
#[derive(Debug, Clone, PartialEq)]
pub struct CodeSettings {
    pub format: Format,
    /// Seconds of wall clock and CPU, memory and output per execution.
    pub limits: Limits,
    /// Stop a problem's remaining tests at its first failure.
    pub early_exit: bool,
    /// Executions at once over the whole run (default: the number of cores).
    pub concurrency: usize,
    /// Compare numbers in stdio output within this tolerance (absolute or
    /// relative); `None`: exact text.
    pub float_tolerance: Option<f64>,
    /// The Python interpreter.
    pub python: String,
}

/// Where the program came from in the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Extraction {
    /// A fenced block marked as Python.
    FencedPython,
    /// A fenced block with no language.
    FencedPlain,
    /// The whole answer.
    WholeAnswer,
}

/// The program in a model's answer: the first fenced block marked
/// `python`/`py`/`python3`, else the first unmarked fenced block, else the
/// whole answer.
pub fn extract(answer: &str) -> (String, Extraction) {
    let mut plain = None;
    let mut rest = answer;
    while let Some(start) = rest.find("```") {
        let after = &rest[start + 3..];
        let (info, body) = after.split_once('\n').unwrap_or((after, ""));
        let Some(end) = body.find("```") else { break };
        let code = body[..end].to_owned();
        match info.trim().to_ascii_lowercase().as_str() {
            "python" | "py" | "python3" => return (code, Extraction::FencedPython),
            "" if plain.is_none() => plain = Some(code),
            _ => {}
        }
        rest = &body[end + 3..];
    }
    match plain {
        Some(code) => (code, Extraction::FencedPlain),
        None => (answer.to_owned(), Extraction::WholeAnswer),
    }
}

/// One test to run: the program text and its stdin, and what is expected
/// on stdout (stdio problems).
#[derive(Debug, Clone)]
pub struct TestCase {
    pub program: String,
    pub stdin: String,
    pub expected: Option<String>,
}

fn field<'a>(item: &'a Value, key: &str) -> Result<&'a str, String> {
    item.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| format!("the item has no text field '{key}'"))
}

/// The tests of `item` for `code` (the extracted program).
pub fn tests(format: Format, item: &Value, code: &str) -> Result<Vec<TestCase>, String> {
    match format {
        Format::HumanEval => {
            let prompt = field(item, "prompt")?;
            let entry = field(item, "entry_point")?;
            let test = field(item, "test")?;
            // A completion is the function's body; an answer that defines
            // the function itself replaces the prompt (keeping its imports).
            let body = if code.contains(&format!("def {entry}(")) {
                let imports: String = prompt
                    .lines()
                    .filter(|l| l.starts_with("import ") || l.starts_with("from "))
                    .map(|l| format!("{l}\n"))
                    .collect();
                format!("{imports}{code}")
            } else {
                format!("{prompt}{code}")
            };
            Ok(vec![TestCase {
                program: format!("{body}\n\n{test}\n\ncheck({entry})\n"),
                stdin: String::new(),
                expected: None,
            }])
        }
        Format::Mbpp => {
            let list = item
                .get("test_list")
                .and_then(Value::as_array)
                .ok_or("the item has no test_list")?;
            let imports: String = item
                .get("test_imports")
                .and_then(Value::as_array)
                .map(|l| {
                    l.iter()
                        .filter_map(Value::as_str)
                        .map(|s| format!("{s}\n"))
                        .collect()
                })
                .unwrap_or_default();
            let setup = item
                .get("test_setup_code")
                .and_then(Value::as_str)
                .unwrap_or("");
            list.iter()
                .map(|t| {
                    let assertion = t.as_str().ok_or("test_list holds a non-string")?;
                    Ok(TestCase {
                        program: format!("{imports}{code}\n\n{setup}\n\n{assertion}\n"),
                        stdin: String::new(),
                        expected: None,
                    })
                })
                .collect()
        }
        Format::Stdio => {
            let list = item
                .get("tests")
                .and_then(Value::as_array)
                .ok_or("the item has no tests list")?;
            list.iter()
                .map(|t| {
                    let text = |k: &str| {
                        t.get(k)
                            .and_then(Value::as_str)
                            .map(str::to_owned)
                            .ok_or_else(|| format!("a test has no text '{k}'"))
                    };
                    Ok(TestCase {
                        program: code.to_owned(),
                        stdin: text("input")?,
                        expected: Some(text("output")?),
                    })
                })
                .collect()
        }
    }
}

/// Output equal after trimming trailing whitespace per line (and trailing
/// empty lines); with a tolerance, numeric tokens may differ within it.
pub fn same_output(got: &str, expected: &str, tolerance: Option<f64>) -> bool {
    let lines = |s: &str| -> Vec<String> {
        let mut v: Vec<String> = s.lines().map(|l| l.trim_end().to_owned()).collect();
        while v.last().is_some_and(String::is_empty) {
            v.pop();
        }
        v
    };
    let (g, e) = (lines(got), lines(expected));
    if g == e {
        return true;
    }
    let Some(tol) = tolerance else { return false };
    g.len() == e.len()
        && g.iter().zip(&e).all(|(a, b)| {
            let (ta, tb): (Vec<&str>, Vec<&str>) = (
                a.split_whitespace().collect(),
                b.split_whitespace().collect(),
            );
            ta.len() == tb.len()
                && ta.iter().zip(&tb).all(|(x, y)| {
                    x == y
                        || match (x.parse::<f64>(), y.parse::<f64>()) {
                            (Ok(p), Ok(q)) => (p - q).abs() <= tol.max(tol * q.abs()),
                            _ => false,
                        }
                })
        })
}

/// One test's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct TestResult {
    pub index: usize,
    pub verdict: Verdict,
    /// An excerpt of what went wrong (the error, or expected and got).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expected: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub got: Option<String>,
    pub seconds: f64,
}

const EXCERPT: usize = 300;

fn excerpt(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let text = text.trim_end();
    if text.chars().count() <= EXCERPT {
        return text.to_owned();
    }
    // The end of an error says most.
    let skip = text.chars().count() - EXCERPT;
    format!("…{}", text.chars().skip(skip).collect::<String>())
}

/// The verdict of one execution.
pub fn classify(
    run: &Execution,
    expected: Option<&str>,
    tolerance: Option<f64>,
) -> (Verdict, Option<String>) {
    let err = String::from_utf8_lossy(&run.stderr);
    match run.ended {
        Ended::TimedOut => return (Verdict::Timeout, None),
        Ended::OutputLimit => {
            return (
                Verdict::RuntimeError,
                Some("output limit exceeded".to_owned()),
            );
        }
        _ => {}
    }
    if run.cpu_exceeded() {
        return (Verdict::Timeout, Some("CPU time limit exceeded".to_owned()));
    }
    if run.out_of_memory() {
        return (Verdict::MemoryLimit, Some(excerpt(&run.stderr)));
    }
    if !run.success() {
        if err.contains("SyntaxError")
            || err.contains("IndentationError")
            || err.contains("TabError")
        {
            return (Verdict::SyntaxError, Some(excerpt(&run.stderr)));
        }
        if err.contains("AssertionError") {
            return (Verdict::WrongAnswer, Some(excerpt(&run.stderr)));
        }
        return (Verdict::RuntimeError, Some(excerpt(&run.stderr)));
    }
    match expected {
        Some(want) if !same_output(&String::from_utf8_lossy(&run.stdout), want, tolerance) => {
            (Verdict::WrongAnswer, None)
        }
        _ => (Verdict::Success, None),
    }
}

/// A problem's judgement.
#[derive(Debug, Clone, Serialize)]
pub struct Judgement {
    pub verdict: Verdict,
    pub accepted: bool,
    pub passed: usize,
    pub total: usize,
    pub extraction: Extraction,
    pub error_type_counts: std::collections::BTreeMap<&'static str, usize>,
    pub test_case_errors: Vec<TestResult>,
}

/// Runs a problem's tests concurrently (within `slots`, shared by the whole
/// run) and judges it.
pub async fn judge(
    settings: &CodeSettings,
    isolation: &Isolation,
    slots: &Arc<Semaphore>,
    parent: &Path,
    item: &Value,
    answer: &str,
) -> Result<Judgement, String> {
    let (code, extraction) = extract(answer);
    let cases = tests(settings.format, item, &code)?;
    let total = cases.len();
    let stop = tokio_util::sync::CancellationToken::new();
    let mut tasks = tokio::task::JoinSet::new();
    for (index, case) in cases.into_iter().enumerate() {
        let (settings, isolation, slots, parent, stop) = (
            settings.clone(),
            isolation.clone(),
            slots.clone(),
            parent.to_owned(),
            stop.clone(),
        );
        tasks.spawn(async move {
            let _slot = tokio::select! {
                slot = slots.acquire_owned() => slot.ok()?,
                () = stop.cancelled() => return None,
            };
            if stop.is_cancelled() {
                return None;
            }
            Some(run_case(&settings, &isolation, &parent, index, case).await)
        });
    }
    let mut results: Vec<TestResult> = Vec::with_capacity(total);
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Some(Ok(result))) => {
                if result.verdict != Verdict::Success && settings.early_exit {
                    stop.cancel();
                }
                results.push(result);
            }
            Ok(Some(Err(err))) => return Err(err),
            Ok(None) => {}
            Err(err) => return Err(format!("a test task failed: {err}")),
        }
    }
    results.sort_by_key(|r| r.index);
    let passed = results
        .iter()
        .filter(|r| r.verdict == Verdict::Success)
        .count();
    let verdict = results
        .iter()
        .map(|r| r.verdict)
        .min()
        .unwrap_or(Verdict::Success);
    let mut counts = std::collections::BTreeMap::new();
    for r in &results {
        *counts.entry(r.verdict.as_str()).or_insert(0) += 1;
    }
    let accepted = passed == total && total > 0;
    Ok(Judgement {
        verdict: if accepted { Verdict::Success } else { verdict },
        accepted,
        passed,
        total,
        extraction,
        error_type_counts: counts,
        test_case_errors: results
            .into_iter()
            .filter(|r| r.verdict != Verdict::Success)
            .collect(),
    })
}

async fn run_case(
    settings: &CodeSettings,
    isolation: &Isolation,
    parent: &Path,
    index: usize,
    case: TestCase,
) -> Result<TestResult, String> {
    let dir = Workdir::new(parent, isolation)
        .map_err(|e| format!("cannot make a sandbox directory: {e}"))?;
    std::fs::write(dir.path().join("main.py"), &case.program)
        .map_err(|e| format!("cannot write the program: {e}"))?;
    let argv = vec![settings.python.clone(), "main.py".to_owned()];
    let run = sandbox::run(
        &argv,
        dir.path(),
        case.stdin.as_bytes(),
        &settings.limits,
        isolation,
    )
    .await
    .map_err(|e| format!("cannot run the sandbox: {e}"))?;
    let (verdict, message) = classify(&run, case.expected.as_deref(), settings.float_tolerance);
    let wrong_output = verdict == Verdict::WrongAnswer && case.expected.is_some();
    Ok(TestResult {
        index,
        verdict,
        message,
        expected: wrong_output.then(|| excerpt(case.expected.as_deref().unwrap_or("").as_bytes())),
        got: wrong_output.then(|| excerpt(&run.stdout)),
        seconds: run.elapsed.as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_come_out_of_fences_or_the_whole_answer() {
        let (code, how) = extract("Here:\n```python\nprint(1)\n```\nand ```\nx\n```");
        assert_eq!(
            (code.as_str(), how),
            ("print(1)\n", Extraction::FencedPython)
        );
        let (code, how) = extract("```\nprint(2)\n```");
        assert_eq!(
            (code.as_str(), how),
            ("print(2)\n", Extraction::FencedPlain)
        );
        let (code, how) = extract("```js\nx\n```\nprint(3)");
        assert_eq!(how, Extraction::WholeAnswer);
        assert!(code.contains("print(3)"));
    }

    #[test]
    fn outputs_compare_by_line_with_trailing_space_and_numbers() {
        assert!(same_output("1 2  \n3\n\n", "1 2\n3", None));
        assert!(!same_output("1 2\n3", "1 2\n4", None));
        assert!(same_output("0.3333333\n", "0.333333333", Some(1e-6)));
        assert!(!same_output("0.34\n", "0.333", Some(1e-6)));
    }

    #[test]
    fn a_problem_takes_its_worst_verdict_by_precedence() {
        let mut v = [
            Verdict::WrongAnswer,
            Verdict::RuntimeError,
            Verdict::Timeout,
            Verdict::Success,
        ];
        v.sort();
        assert_eq!(v[0], Verdict::Timeout);
        assert!(
            Verdict::SyntaxError < Verdict::Timeout && Verdict::RuntimeError < Verdict::WrongAnswer
        );
    }
}
