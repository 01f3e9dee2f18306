//! `task:`, validated: its kind with the settings of that kind, the
//! messages or prompt rules that say what is sent, and the parameters sent;
//! what is done with the answer is `eval`'s.

use std::path::Path;

use serde_json::{Map, Value, json};

use crate::endpoint::EndpointConfig;
use crate::problems::Problems;
use crate::raw::{self, RawTask};
use crate::read;
use crate::request::{message_list, params};
use crate::{TaskConfig, TaskKind};

pub(super) fn task(
    mut raw: RawTask,
    dir: &Path,
    endpoints: Option<&[EndpointConfig]>,
    p: &mut Problems<'_>,
) -> Option<TaskConfig> {
    let conversation = raw.kind.as_deref() == Some("conversation") || raw.conversation.is_some();
    let exec_raw = crate::exec::RawExec {
        command: raw.command.take(),
        input: raw.input.take(),
        timeout: raw.timeout.take(),
        concurrency: raw.concurrency.take(),
        memory_mb: raw.memory_mb.take(),
        disk_mb: raw.disk_mb.take(),
        mode: raw.mode.take(),
        servers: raw.servers.take(),
        network: raw.network.take(),
        env: raw.env.take(),
        budget: raw.budget.take(),
        models: raw.models.take(),
    };
    let exec = raw.kind.as_deref() == Some("exec") || exec_raw.command.is_some();
    let has_messages = raw.messages.is_some();
    let has_prompts = raw.prompts.is_some();
    let prompts = match raw.prompts.take() {
        None => Some(Vec::new()),
        Some(_) if conversation => p.push(
            "task.prompts",
            "is not for a conversation (its calls have messages of their own)",
        ),
        Some(rules) => crate::prompts::prompts(rules, endpoints, has_messages, p),
    };
    let messages = match raw.messages.take() {
        // Without a rule that takes every item, `prompts` says so.
        None if conversation || exec || has_prompts => Some(Vec::new()),
        Some(_) if exec => p.push(
            "task.messages",
            "is not for kind: exec (the program makes its own calls)",
        ),
        None => p.push("task.messages", "is required (the chat messages to send)"),
        Some(list) => message_list(list, "task.messages", p),
    };
    let images = crate::images::settings(raw.images.take(), p);
    let params = params(raw.params.take(), "task.params", p);
    let eval = crate::eval::eval(&mut raw, dir, p);
    let mut params = params?;
    let mut eval = eval?;
    // A code task is scored by its judge: `code_accepted` is always there.
    if (raw.code.is_some() || raw.kind.as_deref() == Some("code"))
        && !eval
            .metrics
            .iter()
            .any(|m| matches!(m.metric.kind, evalfleet_eval::metrics::Kind::CodeAccepted))
        && let Ok(metric) = evalfleet_eval::Metric::build("code_accepted", &Map::new(), None)
    {
        eval.metrics.push(evalfleet_eval::MetricSpec {
            metric,
            reference: None,
        });
    }
    // A conversation's episodes are scored by their rewards and decisions.
    if raw.kind.as_deref() == Some("conversation") || raw.conversation.is_some() {
        for (key, name) in evalfleet_eval::balance::EPISODE_SCORES {
            if !eval.metrics.iter().any(|m| m.metric.key == key)
                && let Ok(metric) =
                    evalfleet_eval::Metric::build(name, &Map::new(), Some(key.to_owned()))
            {
                eval.metrics.push(evalfleet_eval::MetricSpec {
                    metric,
                    reference: None,
                });
            }
        }
    }
    if eval.structured_output
        && let Some(schema) = &eval.schema
    {
        if params.contains_key("response_format") {
            return p.push(
                "task.structured_output",
                "cannot be used with task.params.response_format (it sets that itself)",
            );
        }
        params.insert(
            "response_format".to_owned(),
            json!({"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": true}}),
        );
    }
    let samples = match raw.n {
        None => 1,
        Some(n) if (1..=10_000).contains(&n) => n,
        Some(n) => return p.push("task.n", format!("must be between 1 and 10000, got {n}")),
    };
    let mut reasks_ok = true;
    if exec && eval.max_reasks > 0 {
        if raw.max_reasks.is_some_and(|n| n > 0) {
            reasks_ok = p
                .push::<()>(
                    "task.max_reasks",
                    "is not for kind: exec (its program's answer cannot be asked for again; a failed run is retried as `retry` says)",
                )
                .is_some();
        }
        eval.max_reasks = 0;
    }
    let kind = task_kind(
        raw.kind.as_deref(),
        Kinds {
            code: raw.code,
            refine: raw.refine,
            conversation: raw.conversation,
            exec: exec_raw,
        },
        dir,
        p,
    )?;
    if !reasks_ok {
        return None;
    }
    Some(TaskConfig {
        kind,
        messages: messages?,
        prompts: prompts?,
        images: images?,
        params,
        stream: raw.stream.unwrap_or(false),
        samples,
        eval,
    })
}

/// The settings of each kind of task, as given.
struct Kinds {
    code: Option<Value>,
    refine: Option<Value>,
    conversation: Option<Value>,
    exec: crate::exec::RawExec,
}

/// `task.kind` with the settings of its kind (`task.code`, `task.refine`).
fn task_kind(
    kind: Option<&str>,
    kinds: Kinds,
    dir: &Path,
    p: &mut Problems<'_>,
) -> Option<TaskKind> {
    const KINDS: &str = "chat, code, refine, conversation or exec";
    let Kinds {
        code,
        refine,
        conversation,
        exec,
    } = kinds;
    let kind = match kind {
        Some(kind) => kind,
        None if code.is_some() => "code",
        None if refine.is_some() => "refine",
        None if conversation.is_some() => "conversation",
        None if exec.command.is_some() => "exec",
        None => "chat",
    };
    if kind != "exec" {
        for key in exec.given() {
            p.push::<()>(
                &format!("task.{key}"),
                format!("belongs to kind: exec, not kind: {kind}"),
            );
        }
    }
    let misplaced = |key: &str, p: &mut Problems<'_>| {
        p.push::<()>(
            &format!("task.{key}"),
            format!("belongs to kind: {key}, not kind: {kind}"),
        )
    };
    if kind != "code" && code.is_some() {
        misplaced("code", p);
    }
    if kind != "refine" && refine.is_some() {
        misplaced("refine", p);
    }
    if kind != "conversation" && conversation.is_some() {
        misplaced("conversation", p);
    }
    match kind {
        "chat" => Some(TaskKind::Chat),
        "code" => match code {
            Some(value) => Some(TaskKind::Code(self::code(&value, p)?)),
            None => p.push(
                "task.code",
                "is required with kind: code (how answers are judged as programs)",
            ),
        },
        "refine" => {
            let raw = match &refine {
                Some(value) => read::section::<raw::RawRefine>(value, "task.refine", p.0)?,
                None => raw::RawRefine::default(),
            };
            let prompt = raw
                .prompt
                .unwrap_or_else(|| crate::REFINE_PROMPT.to_owned());
            if let Err(err) = evalfleet_jinja::check(&evalfleet_jinja::environment(), &prompt) {
                return p.push("task.refine.prompt", err);
            }
            let rounds = match raw.rounds {
                None => 1,
                Some(n) if (1..=20).contains(&n) => n,
                Some(n) => {
                    return p.push(
                        "task.refine.rounds",
                        format!("must be between 1 and 20, got {n}"),
                    );
                }
            };
            Some(TaskKind::Refine(crate::RefineSettings { prompt, rounds }))
        }
        "conversation" => crate::conversation::conversation(conversation.as_ref(), p)
            .map(|settings| TaskKind::Conversation(Box::new(settings))),
        "exec" => {
            crate::exec::exec(exec, dir, p).map(|settings| TaskKind::Exec(Box::new(settings)))
        }
        other => p.push("task.kind", format!("must be {KINDS}, got '{other}'")),
    }
}

fn code(value: &Value, p: &mut Problems<'_>) -> Option<evalfleet_sandbox::CodeSettings> {
    use evalfleet_sandbox::sandbox::Limits;
    use evalfleet_sandbox::{Backend, CodeSettings, Format, Language};
    let raw = read::section::<raw::RawCode>(value, "task.code", p.0)?;
    let format = match raw.format.as_deref() {
        None => p.push("task.code.format", "is required: humaneval, mbpp or stdio"),
        Some(f) => Format::parse(f).or_else(|| {
            p.push(
                "task.code.format",
                format!("must be humaneval, mbpp or stdio, got '{f}'"),
            )
        }),
    };
    let language = match raw.language.as_deref() {
        None => Some(Language::Python),
        Some(text) => Language::parse(text).or_else(|| {
            p.push(
                "task.code.language",
                format!("must be python, cpp or rust, got '{text}'"),
            )
        }),
    };
    if let (Some(language), Some(format)) = (language, format)
        && language != Language::Python
        && format != Format::Stdio
    {
        p.push::<()>(
            "task.code.language",
            format!(
                "{} programs are judged on stdin/stdout tests (format: stdio); humaneval and mbpp tests are Python",
                language.as_str()
            ),
        );
    }
    let tool = match (language, raw.python, raw.compiler) {
        (_, Some(_), Some(_)) => p.push("task.code", "give python or compiler, not both"),
        (Some(Language::Python), None, Some(_)) => p.push(
            "task.code.compiler",
            "python is interpreted: give the interpreter as python",
        ),
        (Some(l), Some(_), None) if l != Language::Python => p.push(
            "task.code.python",
            format!("{} is compiled: give the compiler as compiler", l.as_str()),
        ),
        (_, python, compiler) => Some(python.or(compiler)),
    };
    let cpu = p.duration("task.code.timeout", raw.timeout.as_deref(), "10s");
    let wall = match (&raw.wall_timeout, cpu) {
        (Some(text), _) => p.duration("task.code.wall_timeout", Some(text), "30s"),
        (None, Some(cpu)) => Some(cpu * 3),
        (None, None) => None,
    };
    let compile_timeout = p.duration(
        "task.code.compile_timeout",
        raw.compile_timeout.as_deref(),
        "30s",
    );
    let retry_for = p.duration(
        "task.code.sandbox_retry_for",
        raw.sandbox_retry_for.as_deref(),
        "2m",
    );
    let backend = match (raw.backend.as_deref(), raw.sandbox_url) {
        (None | Some("local"), None) => Some(Backend::Local),
        (None | Some("local"), Some(_)) => p.push(
            "task.code.sandbox_url",
            "is for backend: sandboxfusion (the backend is local)",
        ),
        (Some("sandboxfusion"), Some(url)) => match reqwest::Url::parse(&url) {
            Ok(u) if matches!(u.scheme(), "http" | "https") => Some(Backend::SandboxFusion {
                url,
                retries: raw.sandbox_retries,
                retry_for: retry_for?,
            }),
            _ => p.push(
                "task.code.sandbox_url",
                format!("must be an http(s) URL like http://host:8080, got '{url}'"),
            ),
        },
        (Some("sandboxfusion"), None) => p.push(
            "task.code.sandbox_url",
            "is required with backend: sandboxfusion (the server's address, like http://host:8080)",
        ),
        (Some(other), _) => p.push(
            "task.code.backend",
            format!("must be local or sandboxfusion, got '{other}'"),
        ),
    };
    let cores = std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get);
    let concurrency = match (raw.judge_concurrency, &backend) {
        (Some(0), _) => p.push("task.code.judge_concurrency", "must be at least 1, got 0"),
        (Some(n), _) => Some(n),
        // A remote sandbox has cores of its own: the seed's default.
        (None, Some(Backend::SandboxFusion { .. })) => Some(20),
        (None, _) => Some(cores),
    };
    let float_tolerance = match raw.float_tolerance {
        Some(t) if t.is_nan() || t < 0.0 => p.push(
            "task.code.float_tolerance",
            format!("must be 0 or more, got {t}"),
        ),
        other => Some(other),
    };
    let stdio_fields = match raw.tests_field {
        None => Some(vec!["tests".to_owned()]),
        Some(raw::OneOrMany::One(field)) => Some(vec![field]),
        Some(raw::OneOrMany::Many(fields)) if fields.is_empty() => {
            p.push("task.code.tests_field", "must name at least one field")
        }
        Some(raw::OneOrMany::Many(fields)) => Some(fields),
    };
    let defaults = Limits::default();
    Some(CodeSettings {
        format: format?,
        language: language?,
        tool: tool?,
        limits: Limits {
            wall: wall?,
            cpu: cpu?,
            memory_mb: raw.memory_mb.unwrap_or(defaults.memory_mb),
            output_bytes: raw.output_bytes.unwrap_or(defaults.output_bytes),
            ..defaults
        },
        compile_timeout: compile_timeout?,
        early_exit: raw.early_exit.unwrap_or(false),
        concurrency: concurrency?,
        float_tolerance: float_tolerance?,
        stdio_fields: stdio_fields?,
        backend: backend?,
    })
}
