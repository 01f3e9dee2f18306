//! What the code judge knows of problems and programs: a program is taken
//! out of a model's answer and assembled with a problem's tests; each
//! test's execution gets a verdict, and the problem one verdict.

use serde::Serialize;
use serde_json::Value;

use crate::lang::Language;
use crate::sandbox::{Ended, Execution};

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

/// Where the program came from in the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Extraction {
    /// A fenced block marked with the task's language (`fenced_python`,
    /// `fenced_cpp`, `fenced_rust`).
    FencedPython,
    FencedCpp,
    FencedRust,
    /// A fenced block with no language.
    FencedPlain,
    /// The whole answer.
    WholeAnswer,
}

impl Extraction {
    fn fenced(language: Language) -> Self {
        match language {
            Language::Python => Self::FencedPython,
            Language::Cpp => Self::FencedCpp,
            Language::Rust => Self::FencedRust,
        }
    }
}

/// The program in a model's answer: the first fenced block marked with the
/// language (for Python `python`, `py` or `python3`), else the first
/// unmarked fenced block, else the whole answer.
pub fn extract(answer: &str, language: Language) -> (String, Extraction) {
    let mut plain = None;
    let mut rest = answer;
    while let Some(start) = rest.find("```") {
        let after = &rest[start + 3..];
        let (info, body) = after.split_once('\n').unwrap_or((after, ""));
        let Some(end) = body.find("```") else { break };
        let code = body[..end].to_owned();
        let tag = info.trim().to_ascii_lowercase();
        if language.fence_tags().contains(&tag.as_str()) {
            return (code, Extraction::fenced(language));
        }
        if tag.is_empty() && plain.is_none() {
            plain = Some(code);
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

/// The tests of `item` for `code` (the extracted program); a stdio
/// problem's tests are in the fields `stdio_fields`, taken in that order.
pub fn tests(
    format: Format,
    item: &Value,
    code: &str,
    stdio_fields: &[String],
) -> Result<Vec<TestCase>, String> {
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
            let mut cases = Vec::new();
            let mut found = false;
            for name in stdio_fields {
                let Some(value) = item.get(name) else {
                    continue;
                };
                found = true;
                for (stdin, expected) in stdio_pairs(value).map_err(|e| format!("'{name}': {e}"))? {
                    cases.push(TestCase {
                        program: code.to_owned(),
                        stdin,
                        expected: Some(expected),
                    });
                }
            }
            if !found {
                return Err(format!(
                    "the item has no tests field ({})",
                    stdio_fields.join(", ")
                ));
            }
            Ok(cases)
        }
    }
}

/// The `(input, output)` pairs of a stdin/stdout tests field, in any of the
/// shapes datasets store them: a list of `{input, output}` (the values text,
/// or `{stdin}` / `{stdout}` objects as in SandboxFusion's datasets), an
/// object of two parallel lists `{input: [...], output: [...]}` (as in
/// CodeContests), or either of these as JSON text.
fn stdio_pairs(value: &Value) -> Result<Vec<(String, String)>, String> {
    if let Value::String(text) = value {
        let parsed: Value =
            serde_json::from_str(text).map_err(|e| format!("text that is not JSON: {e}"))?;
        return stdio_pairs(&parsed);
    }
    let text = |v: Option<&Value>, inner: &str, what: &str, index: usize| {
        let v = v.ok_or_else(|| format!("test {index} has no {what}"))?;
        v.as_str()
            .or_else(|| v.get(inner).and_then(Value::as_str))
            .map(str::to_owned)
            .ok_or_else(|| format!("test {index}'s {what} is not text"))
    };
    match value {
        Value::Array(list) => list
            .iter()
            .enumerate()
            .map(|(i, t)| {
                Ok((
                    text(t.get("input"), "stdin", "input", i)?,
                    text(t.get("output"), "stdout", "output", i)?,
                ))
            })
            .collect(),
        Value::Object(columns) => {
            let column = |key: &str| {
                columns
                    .get(key)
                    .and_then(Value::as_array)
                    .ok_or_else(|| format!("no list '{key}'"))
            };
            let (inputs, outputs) = (column("input")?, column("output")?);
            if inputs.len() != outputs.len() {
                return Err(format!(
                    "{} inputs but {} outputs",
                    inputs.len(),
                    outputs.len()
                ));
            }
            inputs
                .iter()
                .zip(outputs)
                .enumerate()
                .map(|(i, (input, output))| {
                    Ok((
                        text(Some(input), "stdin", "input", i)?,
                        text(Some(output), "stdout", "output", i)?,
                    ))
                })
                .collect()
        }
        _ => Err("neither a list of tests nor an object of input and output lists".to_owned()),
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

/// The beginning of a compiler's complaint (where its first error is), at
/// most 600 characters.
pub fn compiler_excerpt(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let text = text.trim();
    match text.char_indices().nth(2 * EXCERPT) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

/// The end of a long text (where errors say most), at most 300 characters.
pub fn excerpt(bytes: &[u8]) -> String {
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
        Ended::CpuLimit => {
            return (Verdict::Timeout, Some("CPU time limit exceeded".to_owned()));
        }
        Ended::OutputLimit => {
            return (
                Verdict::RuntimeError,
                Some("output limit exceeded".to_owned()),
            );
        }
        Ended::Signaled(signal) if !run.out_of_memory() => {
            return (
                Verdict::RuntimeError,
                Some(format!(
                    "killed by signal {signal}{}",
                    if run.stderr.is_empty() {
                        String::new()
                    } else {
                        format!(": {}", excerpt(&run.stderr))
                    }
                )),
            );
        }
        _ => {}
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
    /// The compilation, for a compiled language judged here.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compile: Option<Compilation>,
    pub error_type_counts: std::collections::BTreeMap<&'static str, usize>,
    pub test_case_errors: Vec<TestResult>,
}

/// A program's compilation (once per answer, before its tests).
#[derive(Debug, Clone, Serialize)]
pub struct Compilation {
    pub ok: bool,
    pub seconds: f64,
    /// What the compiler said when it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl Judgement {
    /// The judgement of `total` tests' results (those run; with an early
    /// exit, fewer): accepted when every test passed, else the verdict
    /// that comes first by precedence.
    pub fn of(
        mut results: Vec<TestResult>,
        total: usize,
        extraction: Extraction,
        compile: Option<Compilation>,
    ) -> Self {
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
        Self {
            verdict: if accepted { Verdict::Success } else { verdict },
            accepted,
            passed,
            total,
            extraction,
            compile,
            error_type_counts: counts,
            test_case_errors: results
                .into_iter()
                .filter(|r| r.verdict != Verdict::Success)
                .collect(),
        }
    }

    /// The judgement of a program that did not compile: every test gets
    /// the compile error and is listed, none is run. The compiler's
    /// complaint is the first test's message (and `compile`'s); the others
    /// point to it rather than repeat it.
    pub fn not_compiled(total: usize, extraction: Extraction, compile: Compilation) -> Self {
        let failed = (0..total)
            .map(|index| TestResult {
                index,
                verdict: Verdict::CompileError,
                message: if index == 0 {
                    compile.message.clone()
                } else {
                    Some("did not compile (the compiler's message: test 0, compile)".to_owned())
                },
                expected: None,
                got: None,
                seconds: 0.0,
            })
            .collect();
        Self {
            verdict: Verdict::CompileError,
            accepted: false,
            passed: 0,
            total,
            extraction,
            compile: Some(compile),
            error_type_counts: [(Verdict::CompileError.as_str(), total)].into(),
            test_case_errors: failed,
        }
    }
}

/// A test's result from its execution.
pub fn test_result(
    index: usize,
    run: &Execution,
    expected: Option<&str>,
    tolerance: Option<f64>,
) -> TestResult {
    let (verdict, message) = classify(run, expected, tolerance);
    let wrong_output = verdict == Verdict::WrongAnswer && expected.is_some();
    TestResult {
        index,
        verdict,
        message,
        expected: wrong_output.then(|| excerpt(expected.unwrap_or("").as_bytes())),
        got: wrong_output.then(|| excerpt(&run.stdout)),
        seconds: run.elapsed.as_secs_f64(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_come_out_of_fences_or_the_whole_answer() {
        let (code, how) = extract(
            "Here:\n```python\nprint(1)\n```\nand ```\nx\n```",
            Language::Python,
        );
        assert_eq!(
            (code.as_str(), how),
            ("print(1)\n", Extraction::FencedPython)
        );
        let (code, how) = extract("```\nprint(2)\n```", Language::Python);
        assert_eq!(
            (code.as_str(), how),
            ("print(2)\n", Extraction::FencedPlain)
        );
        let (code, how) = extract("```js\nx\n```\nprint(3)", Language::Python);
        assert_eq!(how, Extraction::WholeAnswer);
        assert!(code.contains("print(3)"));
        let (code, how) = extract(
            "```python\nno\n```\n```c++\nint main() {}\n```",
            Language::Cpp,
        );
        assert_eq!(
            (code.as_str(), how),
            ("int main() {}\n", Extraction::FencedCpp)
        );
        let (_, how) = extract("```rs\nfn main() {}\n```", Language::Rust);
        assert_eq!(how, Extraction::FencedRust);
    }

    #[test]
    fn stdio_tests_come_in_every_shape_datasets_use() {
        let fields = ["tests".to_owned(), "private_tests".to_owned()];
        let item = serde_json::json!({
            "tests": [{"input": "1\n", "output": "2\n"}, {"input": {"stdin": "3"}, "output": {"stdout": "6"}}],
            "private_tests": {"input": ["5"], "output": ["10"]},
        });
        let cases = tests(Format::Stdio, &item, "code", &fields).unwrap();
        let pairs: Vec<(&str, &str)> = cases
            .iter()
            .map(|c| (c.stdin.as_str(), c.expected.as_deref().unwrap()))
            .collect();
        assert_eq!(pairs, [("1\n", "2\n"), ("3", "6"), ("5", "10")]);
        let as_text = serde_json::json!({"tests": "[{\"input\": \"a\", \"output\": \"b\"}]"});
        assert_eq!(
            tests(Format::Stdio, &as_text, "c", &fields).unwrap().len(),
            1
        );
        let uneven = serde_json::json!({"tests": {"input": ["1", "2"], "output": ["1"]}});
        let err = tests(Format::Stdio, &uneven, "c", &fields).unwrap_err();
        assert!(err.contains("2 inputs but 1 outputs"), "{err}");
        let err = tests(Format::Stdio, &serde_json::json!({"x": 1}), "c", &fields).unwrap_err();
        assert!(
            err.contains("no tests field (tests, private_tests)"),
            "{err}"
        );
        let err = tests(
            Format::Stdio,
            &serde_json::json!({"tests": [{"input": "1"}]}),
            "c",
            &fields,
        )
        .unwrap_err();
        assert!(err.contains("test 0 has no output"), "{err}");
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
