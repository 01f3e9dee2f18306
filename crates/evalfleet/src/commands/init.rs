//! `evalfleet init`: a commented starter config for one endpoint kind and
//! one task kind, with a tiny dataset beside it (and, for the mock, the
//! scripted answers it replies with), so that `evalfleet run` works on it
//! at once with the mock and after naming a server or model with the rest.

use std::path::{Path, PathBuf};

use crate::UsageError;
use crate::cli::{InitArgs, InitEndpoint, InitTask};

/// A file `init` writes: its path and its text.
struct Written {
    path: PathBuf,
    text: String,
}

pub fn init(args: InitArgs) -> anyhow::Result<u8> {
    let stem = args
        .output
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .filter(|s| !s.is_empty())
        .ok_or_else(|| UsageError(format!("-o {}: not a file name", args.output.display())))?;
    let dir = args.output.parent().unwrap_or(Path::new("")).to_owned();
    let items = format!("{stem}-items.jsonl");
    let answers = format!("{stem}-answers.jsonl");
    let mock = matches!(args.endpoint, InitEndpoint::Mock);

    let mut files = vec![Written {
        path: args.output.clone(),
        text: config(&stem, args.endpoint, args.task, &items, &answers),
    }];
    if let Some(text) = dataset(args.task) {
        files.push(Written {
            path: dir.join(&items),
            text: text.to_owned(),
        });
    }
    if mock {
        files.push(Written {
            path: dir.join(&answers),
            text: mock_answers(args.task).to_owned(),
        });
    }
    if !args.force {
        let taken: Vec<String> = files
            .iter()
            .filter(|f| f.path.exists())
            .map(|f| f.path.display().to_string())
            .collect();
        if !taken.is_empty() {
            return Err(UsageError(format!(
                "{} already exist{}; --force overwrites",
                taken.join(", "),
                if taken.len() == 1 { "s" } else { "" }
            ))
            .into());
        }
    }
    if !dir.as_os_str().is_empty() {
        std::fs::create_dir_all(&dir)
            .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))?;
    }
    for file in &files {
        std::fs::write(&file.path, &file.text)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", file.path.display()))?;
        eprintln!("wrote {}", file.path.display());
    }
    let next = if mock {
        format!("evalfleet run {}", args.output.display())
    } else {
        format!(
            "edit the endpoint in {}, then `evalfleet check` and `evalfleet run` it",
            args.output.display()
        )
    };
    eprintln!("next: {next}");
    Ok(crate::EXIT_OK)
}

fn config(
    stem: &str,
    endpoint: InitEndpoint,
    task: InitTask,
    items: &str,
    answers: &str,
) -> String {
    let name: String = stem
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .collect();
    let ready = if matches!(endpoint, InitEndpoint::Mock) {
        "It runs as it is: `evalfleet run` on this file."
    } else {
        "Edit the endpoint below first (the lines marked EDIT), then\n# `evalfleet check` this file and `evalfleet run` it."
    };
    format!(
        "# A starter config written by `evalfleet init`.\n\
         # Task: {what}.\n\
         # Endpoint: {on}.\n\
         # {ready}\n\
         # Every key is in docs/config.md.\n\
         name: {name}\n\
         {dataset}\
         endpoints:\n{endpoint}\
         task:\n{task}",
        what = task_label(task),
        on = endpoint_label(endpoint),
        dataset = if dataset(task).is_some() {
            format!(
                "dataset:\n  \
                   path: {items}   # JSONL or CSV, relative to this file\n  \
                   id_field: id\n"
            )
        } else {
            String::new()
        },
        endpoint = endpoint_yaml(endpoint, task, answers),
        task = task_yaml(task),
    )
}

fn task_label(task: InitTask) -> &'static str {
    match task {
        InitTask::Chat => "chat task: one question, one short answer, exact match",
        InitTask::Json => "JSON task: answers checked against a schema, scored field by field",
        InitTask::Code => "code task: programs judged against tests in the sandbox",
        InitTask::Conversation => {
            "conversation: three personas talk, a policy chooses how a robot intervenes (docs/conversation.md)"
        }
    }
}

fn endpoint_label(endpoint: InitEndpoint) -> &'static str {
    match endpoint {
        InitEndpoint::Mock => "the built-in mock endpoint",
        InitEndpoint::External => "a server someone else runs",
        InitEndpoint::Local => "an engine started on this machine",
        InitEndpoint::Remote => "an engine started on another host over SSH",
    }
}

fn endpoint_yaml(endpoint: InitEndpoint, task: InitTask, answers: &str) -> String {
    let concurrency = match task {
        InitTask::Code => 4,
        InitTask::Conversation => 16,
        _ => 8,
    };
    match endpoint {
        InitEndpoint::Mock => format!(
            "  - name: mock\n    \
               kind: mock                 # the built-in mock, started inside the run\n    \
               concurrency: {concurrency}\n    \
               model: starter\n    \
               # Scripted replies (JSONL: {{prompt, replies}} or {{prompt, samples}}); other prompts get filler text.\n    \
               mock: {{ answers: {answers}, latency: 20ms }}\n"
        ),
        InitEndpoint::External => "  - name: server\n    \
               kind: external             # an OpenAI-compatible server someone else runs\n    \
               base_url: http://127.0.0.1:8000/v1   # EDIT: the server's OpenAI API\n    \
               model: my-model            # EDIT: a model the server serves\n    \
               # api_key: ${OPENAI_API_KEY}   # a hosted API's key, read from the environment\n    \
               concurrency: adaptive      # or a fixed number of calls in flight\n"
            .to_owned(),
        InitEndpoint::Local => "  - name: engine\n    \
               kind: local                # evalfleet starts the engine here and stops it at the end\n    \
               preset: vllm               # vllm, sglang, llama.cpp or ollama\n    \
               model: Qwen/Qwen2.5-0.5B-Instruct   # EDIT: the model it serves\n    \
               gpu: 0                     # EDIT: CUDA_VISIBLE_DEVICES for the engine\n    \
               # args: \"--max-model-len 4096\"   # extra arguments for the engine\n"
            .to_owned(),
        InitEndpoint::Remote => "  - name: gpu-box\n    \
               kind: remote               # started over SSH in tmux, reached through a forwarded port\n    \
               host: user@gpu-box         # EDIT: the SSH destination\n    \
               preset: vllm               # vllm, sglang, llama.cpp or ollama\n    \
               model: Qwen/Qwen2.5-0.5B-Instruct   # EDIT: the model it serves\n    \
               gpu: 0                     # EDIT: CUDA_VISIBLE_DEVICES on that host\n"
            .to_owned(),
    }
}

fn task_yaml(task: InitTask) -> &'static str {
    match task {
        InitTask::Chat => {
            "  messages:                    # templates over each item's fields\n    \
               - { role: system, content: \"Answer with the answer alone: no sentence, no explanation.\" }\n    \
               - { role: user, content: \"{{ question }}\" }\n  \
               params: { max_tokens: 64, temperature: 0 }\n  \
               metrics:\n    \
               - { name: exact_match, reference: \"{{ answer }}\" }\n"
        }
        InitTask::Json => {
            "  messages:\n    \
               - { role: system, content: \"Reply with a JSON object {\\\"name\\\": string, \\\"age\\\": integer} and nothing else.\" }\n    \
               - { role: user, content: \"{{ text }}\" }\n  \
               params: { max_tokens: 128, temperature: 0 }\n  \
               # The answer is parsed as JSON and checked; one that fails is asked again.\n  \
               schema:\n    \
               type: object\n    \
               required: [name, age]\n    \
               properties:\n      \
               name: { type: string }\n      \
               age: { type: integer }\n  \
               metrics:\n    \
               - { name: json_field_match, reference: \"{{ fields }}\" }\n"
        }
        InitTask::Code => {
            "  kind: code\n  \
               messages:\n    \
               - { role: system, content: \"Write a Python program that reads stdin and writes stdout, in a ```python block.\" }\n    \
               - { role: user, content: \"{{ question }}\" }\n  \
               params: { max_tokens: 1024, temperature: 0 }\n  \
               code:\n    \
               format: stdio              # each item's `tests`: [{input, output}, ...]\n    \
               timeout: 2s                # CPU time per test\n"
        }
        // Every call (personas, scorer, policy) goes to the endpoint above;
        // `endpoint: NAME` on each sends it to one with `role: judge`.
        InitTask::Conversation => {
            "  kind: conversation\n  \
               params: { max_tokens: 96, temperature: 0.7 }\n  \
               conversation:\n    \
               rules: corrected           # evalfleet's rules (the default, original, plays the original system's episodes in Japanese)\n    \
               sessions: 4                # episodes; `evalfleet simulate --sessions N` overrides\n    \
               max_rounds: 4\n    \
               seed: 1\n    \
               topics: [\"sharing the flat's chores\", \"where to go on holiday\"]\n    \
               personas:\n      \
               - { name: Alex, prompt: \"You are direct and impatient.\", landmines: [money] }\n      \
               - { name: Blair, prompt: \"You avoid conflict.\", landmines: [mother] }\n      \
               - { name: Casey, prompt: \"You like plans and lists.\", landmines: [deadline] }\n    \
               # Short prompts, which the mock's script answers; drop persona_messages and\n    \
               # the scorer's and policy's messages to use the default prompts.\n    \
               persona_messages:\n      \
               - { role: system, content: \"You are {{ name }}. {{ persona }} Topic: {{ topic }}. What you need: {{ need_text }}.\\n{{ history_text }}\" }\n      \
               - { role: user, content: \"Speak as {{ name }}.\" }\n    \
               scorer:\n      \
               messages:\n        \
               - { role: system, content: \"{{ history_text }}\" }\n        \
               - { role: user, content: \"Rate the relations.\" }\n    \
               policy:\n      \
               messages:\n        \
               - { role: system, content: \"{{ history_text }}\\nStrained: {{ target_edge }}; address {{ target_name }}.\" }\n        \
               - { role: user, content: \"Choose a strategy.\" }\n"
        }
    }
}

/// The starter's dataset; a conversation's episodes are made up.
fn dataset(task: InitTask) -> Option<&'static str> {
    Some(match task {
        InitTask::Conversation => return None,
        InitTask::Chat => concat!(
            "{\"id\": \"q1\", \"category\": \"geography\", \"question\": \"What is the capital of Italy?\", \"answer\": \"Rome\"}\n",
            "{\"id\": \"q2\", \"category\": \"arithmetic\", \"question\": \"What is 7 times 6?\", \"answer\": \"42\"}\n",
            "{\"id\": \"q3\", \"category\": \"arithmetic\", \"question\": \"What is 15 minus 9?\", \"answer\": \"6\"}\n",
        ),
        InitTask::Json => concat!(
            "{\"id\": \"p1\", \"text\": \"Ada, aged 36, wrote the first program.\", \"fields\": {\"name\": \"Ada\", \"age\": 36}}\n",
            "{\"id\": \"p2\", \"text\": \"At 41 Alan designed a stored-program computer.\", \"fields\": {\"name\": \"Alan\", \"age\": 41}}\n",
        ),
        InitTask::Code => concat!(
            "{\"id\": \"add\", \"question\": \"Read two integers on one line and print their sum.\", \"tests\": [{\"input\": \"1 2\\n\", \"output\": \"3\\n\"}, {\"input\": \"-4 4\\n\", \"output\": \"0\\n\"}]}\n",
            "{\"id\": \"upper\", \"question\": \"Read a line and print it in upper case.\", \"tests\": [{\"input\": \"abc\\n\", \"output\": \"ABC\\n\"}]}\n",
        ),
    })
}

/// What the mock replies to each item's prompt: mostly right, one wrong, as
/// a real model would be.
fn mock_answers(task: InitTask) -> &'static str {
    match task {
        InitTask::Chat => concat!(
            "{\"prompt\": \"What is the capital of Italy?\", \"replies\": [\"Rome\"]}\n",
            "{\"prompt\": \"What is 7 times 6?\", \"replies\": [\"42\"]}\n",
            "{\"prompt\": \"What is 15 minus 9?\", \"replies\": [\"5\"]}\n",
        ),
        InitTask::Json => concat!(
            "{\"prompt\": \"Ada, aged 36, wrote the first program.\", \"replies\": [\"{\\\"name\\\": \\\"Ada\\\", \\\"age\\\": 36}\"]}\n",
            "{\"prompt\": \"At 41 Alan designed a stored-program computer.\", \"replies\": [\"{\\\"name\\\": \\\"Alan\\\"}\", \"{\\\"name\\\": \\\"Alan\\\", \\\"age\\\": 41}\"]}\n",
        ),
        InitTask::Code => concat!(
            "{\"prompt\": \"Read two integers on one line and print their sum.\", \"replies\": [\"```python\\na, b = map(int, input().split())\\nprint(a + b)\\n```\"]}\n",
            "{\"prompt\": \"Read a line and print it in upper case.\", \"replies\": [\"```python\\nprint(input().lower())\\n```\"]}\n",
        ),
        InitTask::Conversation => concat!(
            "{\"prompt\": \"Speak as Alex.\", \"samples\": [\"No, that is wrong, and it is about money again.\", \"Fine, I agree with Blair on that.\", \"Thanks, that helps.\"]}\n",
            "{\"prompt\": \"Speak as Blair.\", \"samples\": [\"I understand, let us keep it calm.\", \"Please do not bring up my mother.\", \"I am glad we agree.\"]}\n",
            "{\"prompt\": \"Speak as Casey.\", \"samples\": [\"We need a plan before the deadline.\", \"That is ridiculous, Alex.\", \"I like that idea.\"]}\n",
            "{\"prompt\": \"Rate the relations.\", \"samples\": [\"{\\\"AB\\\": 0.4, \\\"BC\\\": 0.3, \\\"CA\\\": -0.5}\", \"{\\\"AB\\\": 0.5, \\\"BC\\\": 0.2, \\\"CA\\\": 0.3}\", \"{\\\"AB\\\": -0.4, \\\"BC\\\": 0.5, \\\"CA\\\": -0.2}\"]}\n",
            "{\"prompt\": \"Choose a strategy.\", \"samples\": [\"2\", \"1\", \"3\", \"4\"]}\n",
        ),
    }
}
