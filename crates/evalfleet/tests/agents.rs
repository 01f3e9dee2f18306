//! Exec tasks: the user's agent run per item in the sandbox, its calls made
//! through the run's gateway and attributed to the item; the official
//! `openai` SDK and LangGraph against the gateway; kills, timeouts,
//! failures, failover and the sandbox's walls.

use std::path::{Path, PathBuf};
use std::time::Duration;

use evalfleet_mock::MockSettings;
use evalfleet_store::prelude::*;
use evalfleet_types::AgentCall;
use serde_json::Value;

use crate::util::{Env, by_id, external_with, mock, ms, signal, wait_until};

/// The Python with the `openai` SDK (and LangGraph) that `.ci/run` makes
/// (`$EVALFLEET_AGENT_PYTHON`, by default /opt/evalfleet-agent/bin/python),
/// when it imports `modules`; `None`, saying so, when it does not.
pub fn agent_python(modules: &str) -> Option<String> {
    let python = std::env::var("EVALFLEET_AGENT_PYTHON")
        .unwrap_or_else(|_| "/opt/evalfleet-agent/bin/python".to_owned());
    if crate::util::imports(&python, modules) {
        return Some(python);
    }
    evalfleet_testkit::skip!(
        "no Python with {modules} for the agents (set EVALFLEET_AGENT_PYTHON; .ci/run makes one)"
    );
    None
}

/// Runs `evalfleet ARGS` with the agents' Python, expecting every item
/// done; the run's id.
pub async fn run_agents(env: &Env, args: &[&str], python: &str) -> String {
    let ran = env
        .command(args)
        .env("EVALFLEET_AGENT_PYTHON", python)
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert_eq!(ran.status.code(), Some(0), "{stderr}");
    String::from_utf8_lossy(&ran.stdout)
        .lines()
        .next()
        .unwrap()
        .trim()
        .to_owned()
}

/// Runs the example config `name` of examples/agent into a store of its
/// own in `env`: the store and the run's id.
async fn run_example(env: &Env, name: &str, python: &str) -> (PathBuf, String) {
    let store = env.path("agents.db");
    let config = examples().join(name);
    let run_id = run_agents(
        env,
        &[
            "run",
            config.to_str().unwrap(),
            "--store",
            store.to_str().unwrap(),
            "-y",
        ],
        python,
    )
    .await;
    (store, run_id)
}

/// The sandbox's walls (its own users, namespaces) need root.
pub fn sandboxed() -> bool {
    if evalfleet_testkit::is_root() {
        return true;
    }
    evalfleet_testkit::skip!("the agents' sandbox needs root (own users, network namespace)");
    false
}

/// The examples' folder.
fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/agent")
}

/// Every call of `item_id`'s run, in the order stored.
fn calls_of(store: &Path, run_id: &str, item_id: &str) -> Vec<AgentCall> {
    let mut store = evalfleet_store::SqliteStore::open_existing(store).expect("the store");
    store
        .item(run_id, item_id)
        .expect("the item reads")
        .expect("the item exists")
        .calls
}

/// A plain agent (no SDK: urllib of /usr/bin/python3) that makes `CALLS`
/// calls for its item's question, then sleeps `SLEEP` seconds, and prints
/// the last answer; after its calls, a question with `hang` sleeps for
/// ever, one with `fail` writes to stderr and exits 3.
const PLAIN_AGENT: &str = r#"
import json, os, sys, time, urllib.request
item = json.load(sys.stdin)
q = item["question"]
base = os.environ["OPENAI_BASE_URL"]
answer = ""
for i in range(int(os.environ.get("CALLS", "2"))):
    body = {"model": "any-name", "messages": [{"role": "user", "content": q}], "user": "agent-" + item["id"]}
    req = urllib.request.Request(base + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "traceparent": "00-abc-def-01"})
    with urllib.request.urlopen(req, timeout=60) as r:
        answer = json.load(r)["choices"][0]["message"]["content"]
if "hang" in q:
    time.sleep(3600)
if "fail" in q:
    sys.stderr.write("the agent gave up: boom\n")
    sys.exit(3)
time.sleep(float(os.environ.get("SLEEP", "0")))
print(answer)
"#;

/// The agent's file name in `env`: unique, so that a test finds its own
/// agents among the processes of tests running beside it.
fn agent_name(env: &Env) -> String {
    format!(
        "agent-{}.py",
        env.dir.path().file_name().unwrap().to_string_lossy()
    )
}

/// A run `name` of `dataset` by an agent: its `endpoints`, then `top`
/// (top-level lines), then `task:` of `kind: exec` running `command`, with
/// the `task` lines (indented, each ending with a newline) after it.
fn exec_config(
    name: &str,
    dataset: &Path,
    endpoints: &str,
    top: &str,
    command: &str,
    task: &str,
) -> String {
    format!(
        "name: {name}\n\
         dataset: {{ path: {}, id_field: id }}\n\
         endpoints:\n{endpoints}\n\
         {top}task:\n  kind: exec\n  command: {command}\n{task}",
        dataset.display()
    )
}

fn plain_config(env: &Env, endpoints: &str, extra: &str, n: usize) -> PathBuf {
    let script = agent_name(env);
    env.write(&script, PLAIN_AGENT);
    let dataset = env.dataset("items.jsonl", n);
    env.write(
        "agent.yaml",
        &format!(
            "name: agents\n\
             dataset: {{ path: {}, id_field: id }}\n\
             endpoints:\n{endpoints}\n\
             task:\n  kind: exec\n  command: /usr/bin/python3 {script}\n{extra}\n",
            dataset.display()
        ),
    )
}

/// The pids of processes whose command line holds `marker`.
fn processes_with(marker: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        // A zombie's command line is empty: it is gone.
        if String::from_utf8_lossy(&cmdline).contains(marker) {
            pids.push(pid);
        }
    }
    pids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_openai_agent_runs_per_item_with_every_call_attributed_in_order() {
    let Some(python) = agent_python("openai") else {
        return;
    };
    let env = Env::new();
    let (store, run_id) = run_example(&env, "agent.yaml", &python).await;
    let rows = env
        .evalfleet(&[
            "export",
            &run_id,
            "--store",
            store.to_str().unwrap(),
            "--format",
            "jsonl",
        ])
        .await;
    let rows: Vec<Value> = rows
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let rows = by_id(&rows);
    assert_eq!(rows.len(), 12);
    // The script answers two of twelve wrong, as a model would.
    let right = rows
        .values()
        .filter(|r| r["scores"]["exact_match@1"]["value"] == 1.0)
        .count();
    assert_eq!(right, 10, "{rows:?}");
    assert_eq!(rows["c001"]["output"], "Paris");
    assert_eq!(rows["c001"]["judge"]["exit"], 0);
    for item in rows.keys() {
        let calls = calls_of(&store, &run_id, item);
        assert_eq!(calls.len(), 3, "{item}: {calls:?}");
        for (i, call) in calls.iter().enumerate() {
            let index = u32::try_from(i).unwrap() + 1;
            assert_eq!(call.index, index);
            assert_eq!(call.attempt, 1);
            assert_eq!(call.call_id, format!("{}.1.{index}", call.seq));
            assert_eq!(call.api, "chat.completions");
            assert_eq!(call.asked_model, "agent-model");
            assert_eq!(call.telemetry.endpoint, "mock");
            assert_eq!(call.telemetry.model, "qwen3-4b");
            assert_eq!(call.http_status, 200);
            assert!(
                call.telemetry.completion_tokens.unwrap_or(0) > 0,
                "{call:?}"
            );
        }
        // 1: the tool call; 2: streamed, with the tool's result sent; 3: the
        // answer alone.
        let first: Value = serde_json::from_str(calls[0].response.as_deref().unwrap()).unwrap();
        assert_eq!(
            first["tool_calls"][0]["function"]["name"], "lookup",
            "{item}"
        );
        assert_eq!(
            calls[0].telemetry.finish_reason.as_deref(),
            Some("tool_calls")
        );
        let second: Value = serde_json::from_str(&calls[1].request).unwrap();
        assert!(calls[1].stream);
        assert!(calls[1].telemetry.ttft_ms.is_some());
        let roles: Vec<&str> = second["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool"], "{item}");
        assert!(!calls[2].stream);
    }
    // The trajectories: the final call's messages and its answer.
    let lines = env
        .evalfleet(&[
            "export",
            &run_id,
            "--store",
            store.to_str().unwrap(),
            "--format",
            "trajectories",
        ])
        .await;
    let first: Value = serde_json::from_str(lines.stdout.lines().next().unwrap()).unwrap();
    let messages = first["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 7, "{first}");
    assert_eq!(messages[6]["content"], "Paris");
}

/// The SDK's side of errors, retries, models, embeddings, completions,
/// budgets and tags: the agent checks what it gets and prints it.
const SDK_AGENT: &str = r#"
import json, os, sys
import openai
from openai import OpenAI
item = json.load(sys.stdin)
out = {}
client = OpenAI(max_retries=3)
out["models"] = sorted(m.id for m in client.models.list())
r = client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hello"}],
                                   user="tester", extra_headers={"traceparent": "00-trace-span-01"})
out["chat"] = r.choices[0].message.content
text = ""
for chunk in client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "streamed"}], stream=True):
    if chunk.choices and chunk.choices[0].delta.content:
        text += chunk.choices[0].delta.content
out["stream"] = text
e = client.embeddings.create(model="m1", input=["a", "b"])
out["embeddings"] = [len(d.embedding) for d in e.data]
c = client.completions.create(model="m1", prompt="complete me", max_tokens=8)
out["completion"] = c.choices[0].text
# Two 503s, then an answer: the SDK retries.
out["after_503"] = client.chat.completions.create(model="m2", messages=[{"role": "user", "content": "flaky"}]).choices[0].message.content
# A 429 with Retry-After, then an answer.
out["after_429"] = client.chat.completions.create(model="m3", messages=[{"role": "user", "content": "limited"}]).choices[0].message.content
try:
    client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    out["unknown_model"] = "answered"
except openai.NotFoundError as err:
    out["unknown_model"] = [err.status_code, err.code]
token = os.environ["OPENAI_API_KEY"]
payload, tag = token[len("ef1_"):].split(".")
forged = "ef1_" + payload[:-2] + ("AA" if payload[-2:] != "AA" else "BB") + "." + tag
for name, key in [("unknown", "sk-not-ours"), ("forged", forged)]:
    other = OpenAI(api_key=key, base_url=os.environ["OPENAI_BASE_URL"].rsplit("/gw/", 1)[0] + "/v1", max_retries=0)
    try:
        other.chat.completions.create(model="m1", messages=[{"role": "user", "content": "x"}])
        out[name] = "answered"
    except openai.AuthenticationError as err:
        out[name] = err.status_code
# The token as the API key, at /v1 (no token in the path), works too.
keyed = OpenAI(api_key=token, base_url=os.environ["OPENAI_BASE_URL"].rsplit("/gw/", 1)[0] + "/v1")
out["keyed"] = keyed.chat.completions.create(model="m1", messages=[{"role": "user", "content": "keyed"}]).choices[0].message.content
# The budget is 12 calls: this is the 12th, the next is refused, once.
client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "last"}])
try:
    client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "over"}])
    out["budget"] = "answered"
except openai.RateLimitError as err:
    out["budget"] = [err.status_code, err.code]
print(json.dumps(out))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_gets_models_streams_errors_and_retries_from_the_gateway() {
    let Some(python) = agent_python("openai") else {
        return;
    };
    let env = Env::new();
    let main = mock(MockSettings::default()).await;
    let flaky = mock(MockSettings {
        fail_first: 2,
        error_status: 503,
        ..MockSettings::default()
    })
    .await;
    let limited = mock(MockSettings {
        fail_first: 1,
        error_status: 429,
        retry_after: ms(1000),
        ..MockSettings::default()
    })
    .await;
    env.write("agent.py", SDK_AGENT);
    let dataset = env.write("one.jsonl", "{\"id\": \"only\", \"question\": \"q\"}\n");
    let endpoints = [
        external_with("main", &main, 4, "").replace("model: m,", "model: m1,"),
        external_with("flaky", &flaky, 4, "health: { max_failures: 1000 }")
            .replace("model: m,", "model: m2,"),
        external_with("limited", &limited, 4, "").replace("model: m,", "model: m3,"),
    ]
    .concat();
    let config = env.write(
        "agent.yaml",
        &format!(
            "name: sdk\n\
             dataset: {{ path: {}, id_field: id }}\n\
             endpoints:\n{endpoints}\n\
             retry: {{ max_attempts: 1 }}\n\
             task:\n  kind: exec\n  command: [\"{python}\", agent.py]\n  timeout: 60s\n  \
             models: {{ m1: main, m2: flaky, m3: limited }}\n  budget: {{ calls: 12 }}\n",
            dataset.display()
        ),
    );
    let ran = env
        .evalfleet(&["run", config.to_str().unwrap(), "-y"])
        .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let run_id = ran.run_id();
    let rows = env.export(&run_id).await;
    let out: Value = serde_json::from_str(rows[0]["output"].as_str().unwrap()).unwrap();
    assert_eq!(out["models"], serde_json::json!(["m1", "m2", "m3"]));
    assert_eq!(out["chat"], "hello");
    assert_eq!(out["stream"], "streamed");
    assert_eq!(out["embeddings"], serde_json::json!([64, 64]));
    assert_eq!(out["completion"], "complete me");
    assert_eq!(out["after_503"], "flaky");
    assert_eq!(out["after_429"], "limited");
    assert_eq!(
        out["unknown_model"],
        serde_json::json!([404, "model_not_found"])
    );
    assert_eq!(out["unknown"], 401);
    assert_eq!(out["forged"], 401);
    assert_eq!(out["keyed"], "keyed");
    assert_eq!(out["budget"], serde_json::json!([429, "budget_exhausted"]));
    // Every call that reached the gateway's routing is the item's, in
    // order: 2 503s and an answer, a 429 and an answer, the 404, and the
    // budget's refusal, which the SDK did not retry.
    let calls = calls_of(&env.store_path(), &run_id, "only");
    let statuses: Vec<u16> = calls.iter().map(|c| c.http_status).collect();
    assert_eq!(
        statuses,
        [
            200, 200, 200, 200, 503, 503, 200, 429, 200, 404, 200, 200, 429
        ],
        "{calls:#?}"
    );
    let apis: Vec<&str> = calls.iter().map(|c| c.api.as_str()).collect();
    assert_eq!(apis[2], "embeddings");
    assert_eq!(apis[3], "completions");
    assert_eq!(flaky.stats().requests, 3);
    assert_eq!(
        calls[12].error_class.map(|c| c.as_str()),
        Some("back_pressure")
    );
    let tags: Value = serde_json::from_str(calls[0].tags.as_deref().unwrap()).unwrap();
    assert_eq!(tags["user"], "tester");
    assert_eq!(tags["traceparent"], "00-trace-span-01");
}

/// A folder of the test's own outside the config's folder, removed with it.
struct Outside(PathBuf);

impl Drop for Outside {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A program the agents cannot reach is refused before the first item,
/// saying why and what to do: one under /tmp (each agent has a /tmp of its
/// own), one behind a folder closed to other users (the agents run as users
/// of their own), a program their PATH lacks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_program_the_agents_cannot_reach_is_refused_before_the_first_item() {
    use std::os::unix::fs::PermissionsExt;
    if !sandboxed() {
        return;
    }
    let env = Env::new();
    let unique = env
        .dir
        .path()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .to_string();
    let server = mock(MockSettings::default()).await;
    let endpoints = external_with("m", &server, 4, "");
    let dataset = env.dataset("items.jsonl", 3);
    let config = |command: &str| exec_config("unreachable", &dataset, &endpoints, "", command, "");
    let script = "#!/bin/sh\necho hi\n";
    let hidden = Outside(PathBuf::from(format!("/tmp/evalfleet-hidden-{unique}")));
    std::fs::create_dir_all(&hidden.0).unwrap();
    std::fs::write(hidden.0.join("agent.py"), "print('hi')\n").unwrap();
    let closed = Outside(PathBuf::from(format!("/opt/evalfleet-closed-{unique}")));
    std::fs::create_dir_all(closed.0.join("bin")).unwrap();
    let program = closed.0.join("bin/agent.sh");
    std::fs::write(&program, script).unwrap();
    std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&closed.0, std::fs::Permissions::from_mode(0o700)).unwrap();
    for (command, said) in [
        (
            format!("/usr/bin/python3 {}", hidden.0.join("agent.py").display()),
            "agent.py is under /tmp, which agents do not see".to_owned(),
        ),
        (
            program.display().to_string(),
            format!("{} is closed to other users (mode 700)", closed.0.display()),
        ),
        (
            "no-such-agent-program".to_owned(),
            "no 'no-such-agent-program' in /usr/local/bin, /usr/bin or /bin".to_owned(),
        ),
    ] {
        env.write("agent.yaml", &config(&command));
        let ran = env.evalfleet(&["run", "agent.yaml", "-q"]).await;
        assert_eq!(ran.code, Some(2), "{command}: {}", ran.stderr);
        assert!(
            ran.stderr.contains("task.command: ") && ran.stderr.contains(&said),
            "{command}: {}",
            ran.stderr
        );
        assert_eq!(server.stats().requests, 0);
    }
    // Opened to others, the same program runs.
    std::fs::set_permissions(&closed.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    env.write("agent.yaml", &config(&program.display().to_string()));
    let ran = env.evalfleet(&["run", "agent.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
}

/// One memory limit holds for all the processes of a run of an agent: three
/// children of 150 MiB each go past `task.memory_mb: 300` together (each
/// alone is well within it), the kernel kills one, and the attempt fails
/// saying why; with room for them, the same agent answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_processes_together_are_held_to_its_memory() {
    if !sandboxed() {
        return;
    }
    if !evalfleet_sandbox::cgroup::available() {
        evalfleet_testkit::skip!("no memory cgroup to make the agents' groups under");
        return;
    }
    let env = Env::new();
    env.write(
        "hungry.py",
        "import json, subprocess, sys\n\
         json.load(sys.stdin)\n\
         code = 'b = bytearray(150 << 20)\\nfor i in range(0, len(b), 4096): b[i] = 1\\nimport time; time.sleep(3)'\n\
         kids = [subprocess.Popen([sys.executable, '-c', code]) for _ in range(3)]\n\
         print([k.wait() for k in kids])\n",
    );
    let row = one_item(&env, "hungry.py", "  memory_mb: 300\n", Some(1)).await;
    let error = row["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("its processes together went past task.memory_mb"),
        "{row}"
    );
    let row = one_item(&env, "hungry.py", "  memory_mb: 2048\n", Some(0)).await;
    assert_eq!(row["output"], "[0, 0, 0]");
}

/// One item run once (no retry) by `/usr/bin/python3 script` with the
/// `task` lines added, the run ending with `code`: the item's row.
async fn one_item(env: &Env, script: &str, task: &str, code: Option<i32>) -> Value {
    let server = mock(MockSettings::default()).await;
    let endpoints = external_with("m", &server, 4, "");
    let dataset = env.dataset("items.jsonl", 1);
    env.write(
        "agent.yaml",
        &exec_config(
            "one-item",
            &dataset,
            &endpoints,
            "retry: { max_attempts: 1 }\n",
            &format!("/usr/bin/python3 {script}"),
            task,
        ),
    );
    let ran = env.evalfleet(&["run", "agent.yaml", "-q"]).await;
    assert_eq!(ran.code, code, "{}", ran.stderr);
    by_id(&env.export(&ran.run_id()).await)["item-00000"].clone()
}

/// The files of a run of an agent together are held to `task.disk_mb`: an
/// agent writing 384 MiB in files of 16 MiB (each within the per-file cap)
/// in its folder fails once 64 MiB are full, saying its folder was full;
/// given 512 MiB, it writes them all, and none of it lands on this disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_files_together_are_held_to_its_disk() {
    if !sandboxed() {
        return;
    }
    let env = Env::new();
    env.write(
        "writer.py",
        "import json, os, sys\n\
         json.load(sys.stdin)\n\
         block = b'x' * (16 << 20)\n\
         for i in range(24):\n\
         \x20   with open(os.path.join(os.environ['TMPDIR'], f'f{i}'), 'wb') as f:\n\
         \x20       f.write(block)\n\
         print(sum(os.path.getsize(f'f{i}') for i in range(24)) >> 20)\n",
    );
    let row = one_item(&env, "writer.py", "  disk_mb: 64\n", Some(1)).await;
    let error = row["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("its folder was full") && error.contains("No space left on device"),
        "{row}"
    );
    let row = one_item(&env, "writer.py", "  disk_mb: 512\n", Some(0)).await;
    assert_eq!(row["output"], "384");
    // The sandbox's folder (in the store's) holds none of it.
    let written: u64 = walk_sizes(&env.path("runs"));
    assert!(written < 64 << 20, "{written} bytes under runs/");
}

/// The bytes of the regular files under `dir`, links not followed.
fn walk_sizes(dir: &Path) -> u64 {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        match entry.file_type() {
            Ok(kind) if kind.is_dir() => total += walk_sizes(&entry.path()),
            Ok(kind) if kind.is_file() => {
                total += entry.metadata().map(|m| m.len()).unwrap_or(0);
            }
            _ => {}
        }
    }
    total
}

/// An agent is not handed its answer key: the fields the metrics'
/// references read are withheld from the item it gets (an agent printing
/// one scores 0), unless `task.input.fields` names them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_gets_its_item_without_the_fields_its_references_read() {
    if !sandboxed() {
        return;
    }
    let env = Env::new();
    let mut rows = String::new();
    for i in 0..4 {
        rows.push_str(&format!(
            "{{\"id\": \"q{i}\", \"question\": \"capital {i}\", \"answer\": \"city {i}\"}}\n"
        ));
    }
    let dataset = env.write("items.jsonl", &rows);
    env.write(
        "cheat.py",
        "import json, sys\nitem = json.load(sys.stdin)\n\
         print(item.get('answer', 'withheld:' + ','.join(sorted(item))))\n",
    );
    let server = mock(MockSettings::default()).await;
    let endpoints = external_with("m", &server, 4, "");
    let config = |input: &str| {
        exec_config(
            "cheat",
            &dataset,
            &endpoints,
            "",
            "/usr/bin/python3 cheat.py",
            &format!(
                "{input}  metrics:\n    - {{ name: exact_match, reference: \"{{{{ answer }}}}\" }}\n"
            ),
        )
    };
    env.write("withheld.yaml", &config(""));
    let ran = env.evalfleet(&["run", "withheld.yaml", "-q"]).await;
    let rows = by_id(&env.export(&ran.run_id()).await);
    assert_eq!(rows.len(), 4);
    for row in rows.values() {
        assert_eq!(row["output"], "withheld:id,question", "{row}");
        assert_eq!(row["scores"]["exact_match@1"]["value"], 0.0, "{row}");
    }
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);

    // Named, the field is given.
    env.write(
        "given.yaml",
        &config("  input: { via: stdin, fields: [question, answer] }\n"),
    );
    let ran = env.evalfleet(&["run", "given.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let rows = by_id(&env.export(&ran.run_id()).await);
    for row in rows.values() {
        assert_eq!(row["scores"]["exact_match@1"]["value"], 1.0, "{row}");
    }
}

/// In a run of agents, an endpoint's figures are those of the calls it was
/// sent: one that refused half of them shows each refusal (the gateway
/// made those calls again on its peer, and keeps the refused tries with
/// them), and latencies are the calls', not the agents' runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_refusing_agents_calls_shows_its_errors_and_the_calls_latencies() {
    if !sandboxed() {
        return;
    }
    let env = Env::new();
    let steady = mock(MockSettings::default()).await;
    let flaky = mock(MockSettings {
        error_rate: 0.5,
        error_status: 503,
        seed: 7,
        ..MockSettings::default()
    })
    .await;
    let endpoints = [
        external_with("steady", &steady, 4, ""),
        external_with("flaky", &flaky, 4, "health: { max_failures: 1000 }"),
    ]
    .concat();
    // 16 agents: each one's first call goes to the less loaded endpoint
    // (ties drawn), and its next calls follow it while it has room; with
    // 6, all six first calls went to the steady one once under CI's load.
    let config = plain_config(
        &env,
        &endpoints,
        "  env: { CALLS: \"4\", SLEEP: \"1\" }",
        16,
    );
    let ran = env
        .evalfleet(&["run", config.to_str().unwrap(), "-y", "-q"])
        .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let run_id = ran.run_id();
    let refused = flaky.stats().injected_errors;
    assert!(refused > 0, "the flaky endpoint was sent no call");

    let status = env.evalfleet(&["status", &run_id, "--json"]).await;
    let status: Value = serde_json::from_str(&status.stdout).unwrap();
    let summary = |name: &str| {
        status["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["endpoint"] == name)
            .unwrap_or_else(|| panic!("no endpoint {name}: {status}"))
            .clone()
    };
    let (flaky_seen, steady_seen) = (summary("flaky"), summary("steady"));
    let errors: u64 = flaky_seen["errors"]
        .as_object()
        .unwrap()
        .values()
        .map(|n| n.as_u64().unwrap())
        .sum();
    assert_eq!(errors, refused, "{flaky_seen}");
    assert_eq!(
        flaky_seen["successes"].as_u64(),
        Some(flaky.stats().completed)
    );
    assert_eq!(
        flaky_seen["successes"].as_u64().unwrap() + steady_seen["successes"].as_u64().unwrap(),
        16 * 4,
        "every call of every agent, once"
    );
    // Each agent ran for a second and more; its calls took far less.
    for seen in [&flaky_seen, &steady_seen] {
        assert!(
            seen["latency_ms"]["p50"].as_f64().unwrap() < 1000.0,
            "{seen}"
        );
    }
    // The refused tries are kept with the calls the peer answered.
    let mut store = evalfleet_store::SqliteStore::open_existing(&env.store_path()).unwrap();
    let mut failovers = Vec::new();
    store
        .scan_calls(&run_id, &mut |call| failovers.extend(call.failovers))
        .unwrap();
    assert_eq!(failovers.len() as u64, refused);
    assert!(
        failovers
            .iter()
            .all(|f| f.endpoint == "flaky" && f.http_status == Some(503)),
        "{failovers:?}"
    );
}

/// The stored calls (item, attempt, place) of the first run in `store`
/// whose attempt has no record: still running, or cut short by a kill.
fn calls_of_open_attempts(store: &Path) -> std::collections::BTreeSet<(u64, u32, u32)> {
    let mut open = std::collections::BTreeSet::new();
    let Ok(mut s) = evalfleet_store::SqliteStore::open_existing(store) else {
        return open;
    };
    let Some(run_id) = s
        .runs()
        .ok()
        .and_then(|r| r.first().map(|r| r.run_id.clone()))
    else {
        return open;
    };
    // The calls first: an attempt that ends after they were read has its
    // record read after them.
    let mut calls = Vec::new();
    let _ = s.scan_calls(&run_id, &mut |c| calls.push((c.seq, c.attempt, c.index)));
    let mut ended = std::collections::HashSet::new();
    let _ = s.attempt_ends_of(&run_id, 0..=u64::MAX, &mut |e| {
        ended.insert((e.seq, e.attempt));
    });
    open.extend(
        calls
            .into_iter()
            .filter(|(seq, attempt, _)| !ended.contains(&(*seq, *attempt))),
    );
    open
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_run_leaves_no_agent_and_its_resume_finishes_every_item_once() {
    if !sandboxed() {
        return;
    }
    let env = Env::new();
    let server = mock(MockSettings {
        latency: ms(5),
        ..MockSettings::default()
    })
    .await;
    let endpoints = external_with("m", &server, 16, "");
    let config = plain_config(
        &env,
        &endpoints,
        "  concurrency: 6\n  env: { SLEEP: \"0.4\" }",
        60,
    );
    let marker = agent_name(&env);
    let mut child = env.spawn(&["run", config.to_str().unwrap(), "-y"]);
    let store = env.store_path();
    let done = |store: &Path| {
        evalfleet_store::SqliteStore::open_existing(store)
            .ok()
            .and_then(|mut s| {
                let runs = s.runs().ok()?;
                let run = runs.first()?;
                s.counts(&run.run_id).ok()
            })
            .map_or(0, |c| c.done)
    };
    wait_until(ms(60_000), "a few items are done", || done(&store) >= 6).await;
    // The agents are the sandbox's: their command line names the script
    // as it is bound inside (the config's folder), so look for its name.
    wait_until(ms(20_000), "agents are running", || {
        !processes_with(&marker).is_empty()
    })
    .await;
    // An agent's calls are stored as each ends, not with its attempt's end:
    // those of agents still running are in the store (each agent sleeps
    // after its calls).
    wait_until(ms(30_000), "calls of running agents are stored", || {
        !calls_of_open_attempts(&store).is_empty()
    })
    .await;
    signal(&child, "KILL").await;
    let _ = child.wait().await;
    let cut_short = calls_of_open_attempts(&store);
    wait_until(ms(10_000), "no agent is left", || {
        processes_with(&marker).is_empty()
    })
    .await;
    let runs = env.store().runs().unwrap();
    let run_id = runs[0].run_id.clone();
    let before = env.counts(&run_id);
    assert!(before.pending > 0, "{before:?}");
    let ran = env.evalfleet(&["resume", &run_id]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let counts = env.counts(&run_id);
    assert_eq!((counts.done, counts.pending, counts.failed), (60, 0, 0));
    let rows = env.export(&run_id).await;
    let rows = by_id(&rows);
    assert_eq!(rows.len(), 60);
    for (id, row) in &rows {
        let i: usize = id.trim_start_matches("item-").parse().unwrap();
        assert_eq!(row["output"], format!("question {i} of 60"));
        // The calls of the attempt that gave the answer: two, in order.
        let calls = calls_of(&env.store_path(), &run_id, id);
        let last = calls.iter().map(|c| c.attempt).max().unwrap();
        let final_calls: Vec<u32> = calls
            .iter()
            .filter(|c| c.attempt == last)
            .map(|c| c.index)
            .collect();
        assert_eq!(final_calls, [1, 2], "{id}");
    }
    // Every item was asked at least twice (once per call of its agent).
    assert!(server.stats().requests >= 120);
    assert!(processes_with(&marker).is_empty());

    // The calls of the attempts the kill cut short are kept (the resume's
    // attempts took new numbers), and the trajectories of every attempt
    // say those attempts are unfinished.
    let mut kept = std::collections::BTreeSet::new();
    env.store()
        .scan_calls(&run_id, &mut |c| {
            kept.insert((c.seq, c.attempt, c.index));
        })
        .unwrap();
    assert!(
        cut_short.is_subset(&kept),
        "{cut_short:?} kept after the resume"
    );
    let ran = crate::trajectories::export_trajectories(&env, &run_id, &["--attempts", "all"]).await;
    let mut unfinished = std::collections::BTreeSet::new();
    for line in ran.stdout.lines() {
        let line: Value = serde_json::from_str(line).unwrap();
        if line["attempt_status"] == "unfinished" {
            let id = line["item_id"].as_str().unwrap();
            let seq = calls_of(&env.store_path(), &run_id, id)[0].seq;
            unfinished.insert((seq, line["attempt"].as_u64().unwrap() as u32));
        } else {
            assert_eq!(line["attempt_status"], "answered", "{line}");
        }
    }
    let cut_attempts: std::collections::BTreeSet<(u64, u32)> = cut_short
        .iter()
        .map(|(seq, attempt, _)| (*seq, *attempt))
        .collect();
    assert!(!cut_attempts.is_empty());
    assert_eq!(unfinished, cut_attempts);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_hangs_is_killed_at_its_timeout_and_one_that_fails_keeps_its_stderr() {
    let env = Env::new();
    let server = mock(MockSettings::default()).await;
    let endpoints = external_with("m", &server, 4, "");
    let script = agent_name(&env);
    env.write(&script, PLAIN_AGENT);
    let dataset = env.write(
        "items.jsonl",
        "{\"id\": \"ok\", \"question\": \"fine\"}\n\
         {\"id\": \"hangs\", \"question\": \"hang here\"}\n\
         {\"id\": \"fails\", \"question\": \"fail now\"}\n",
    );
    let config = env.write(
        "agent.yaml",
        &format!(
            "name: agents\n\
             dataset: {{ path: {}, id_field: id }}\n\
             endpoints:\n{endpoints}\n\
             retry: {{ max_attempts: 2, backoff_base: 10ms, backoff_max: 10ms }}\n\
             task:\n  kind: exec\n  command: /usr/bin/python3 {script}\n  timeout: 2s\n",
            dataset.display()
        ),
    );
    let started = std::time::Instant::now();
    let ran = env
        .evalfleet(&["run", config.to_str().unwrap(), "-y"])
        .await;
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    // Two attempts of 2 s for the one that hangs, not an hour.
    assert!(started.elapsed() < Duration::from_secs(60));
    // The second attempts of the one that hangs and the one that fails
    // are retries, and are counted so.
    assert!(ran.stderr.contains("; 2 retries,"), "{}", ran.stderr);
    let rows = by_id(&env.export(&ran.run_id()).await);
    assert_eq!(rows["ok"]["status"], "done");
    assert_eq!(rows["ok"]["output"], "fine");
    assert_eq!(rows["hangs"]["status"], "failed");
    let hung = rows["hangs"]["error"].as_str().unwrap();
    assert!(hung.contains("task.timeout"), "{hung}");
    assert_eq!(rows["hangs"]["attempts"], 2);
    assert_eq!(rows["fails"]["status"], "failed");
    let failed = rows["fails"]["error"].as_str().unwrap();
    assert!(failed.contains("exited with status 3"), "{failed}");
    assert!(failed.contains("boom"), "{failed}");
    assert_eq!(rows["fails"]["judge"]["exit"], 3);
    assert!(
        rows["fails"]["judge"]["stderr"]
            .as_str()
            .unwrap()
            .contains("the agent gave up")
    );
    // Each failed attempt is stored with its reason, and with the calls it
    // made.
    let attempts = env.attempts_by_session(&ran.run_id());
    assert_eq!(attempts.values().sum::<i64>(), 5, "{attempts:?}");
    for id in ["hangs", "fails"] {
        let calls = calls_of(&env.store_path(), &ran.run_id(), id);
        let made: Vec<(u32, u32)> = calls.iter().map(|c| (c.attempt, c.index)).collect();
        assert_eq!(made, [(1, 1), (1, 2), (2, 1), (2, 2)], "{id}");
    }
    // The one that hung was killed with its attempts.
    assert!(processes_with(&script).is_empty());
}

/// What an agent tries besides the gateway.
const ESCAPE_AGENT: &str = r#"
import errno, json, os, socket, sys, urllib.request
item = json.load(sys.stdin)
out = {}
def connect(host, port):
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect((host, port))
        return "connected"
    except OSError as err:
        return errno.errorcode.get(err.errno, str(err))
    finally:
        s.close()
out["mock_port"] = connect("127.0.0.1", int(os.environ["MOCK_PORT"]))
out["outside"] = connect("10.255.255.1", 80)
out["public"] = connect("1.1.1.1", 443)
def write(path):
    try:
        with open(path, "w") as f:
            f.write("x")
        return "written"
    except OSError as err:
        return errno.errorcode.get(err.errno, str(err))
out["config_folder"] = write(os.path.join(os.path.dirname(os.path.abspath(__file__)), "planted.txt"))
out["etc"] = write("/etc/planted")
out["own_folder"] = write("mine.txt")
try:
    out["dotenv"] = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".env")).read()
except OSError as err:
    out["dotenv"] = errno.errorcode.get(err.errno, str(err))
try:
    open(os.environ["STORE"], "rb").read(16)
    out["store"] = "read"
except OSError as err:
    out["store"] = errno.errorcode.get(err.errno, str(err))
body = {"model": "m", "messages": [{"role": "user", "content": item["question"]}]}
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=30) as r:
    out["gateway"] = json.load(r)["choices"][0]["message"]["content"]
print(json.dumps(out))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_reaches_the_gateway_and_nothing_else() {
    if !sandboxed() {
        return;
    }
    let env = Env::new();
    let server = mock(MockSettings::default()).await;
    let endpoints = external_with("m", &server, 4, "");
    env.write("agent.py", ESCAPE_AGENT);
    // The config's secrets, beside the agent's script.
    env.write(".env", "EF_AGENT_TEST_SECRET=sk-beside-the-config\n");
    let dataset = env.write(
        "one.jsonl",
        "{\"id\": \"x\", \"question\": \"reach out\"}\n",
    );
    let store = env.store_path();
    let config = env.write(
        "agent.yaml",
        &format!(
            "name: walls\n\
             dataset: {{ path: {}, id_field: id }}\n\
             endpoints:\n{endpoints}\n\
             task:\n  kind: exec\n  command: /usr/bin/python3 agent.py\n  \
             env: {{ MOCK_PORT: \"{}\", STORE: \"{}\" }}\n",
            dataset.display(),
            server.addr().port(),
            store.display()
        ),
    );
    let ran = env
        .evalfleet(&["run", config.to_str().unwrap(), "-y"])
        .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let rows = env.export(&ran.run_id()).await;
    let out: Value = serde_json::from_str(rows[0]["output"].as_str().unwrap()).unwrap();
    assert_eq!(out["gateway"], "reach out", "{out}");
    assert_eq!(out["mock_port"], "ECONNREFUSED", "{out}");
    assert_eq!(out["outside"], "ENETUNREACH", "{out}");
    assert_eq!(out["public"], "ENETUNREACH", "{out}");
    assert_eq!(out["config_folder"], "EROFS", "{out}");
    assert_eq!(out["etc"], "EROFS", "{out}");
    assert_eq!(out["own_folder"], "written", "{out}");
    assert_eq!(out["dotenv"], "", "the config's .env is seen empty: {out}");
    // The store is under /tmp, which the sandbox covers.
    assert_eq!(out["store"], "ENOENT", "{out}");
    assert!(!env.path("planted.txt").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_go_on_elsewhere_when_an_endpoint_is_killed_while_agents_run() {
    let env = Env::new();
    let steady = mock(MockSettings {
        latency: ms(20),
        ..MockSettings::default()
    })
    .await;
    // The endpoint that dies: a real process, killed for real.
    let mut doomed = env
        .command(&["mock", "--bind", "127.0.0.1:0", "--latency", "20ms"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let address = {
        use tokio::io::AsyncBufReadExt;
        let stdout = doomed.stdout.take().unwrap();
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        lines.next_line().await.unwrap().unwrap()
    };
    let address = address
        .split_whitespace()
        .find(|w| w.starts_with("http://") || w.contains("127.0.0.1:"))
        .unwrap_or(&address)
        .trim_end_matches('/')
        .to_owned();
    let base = if address.starts_with("http") {
        address.trim_end_matches("/v1").to_owned()
    } else {
        format!("http://{address}")
    };
    let endpoints = format!(
        "{}  - {{ name: doomed, kind: external, base_url: \"{base}/v1\", model: m, concurrency: 8 }}\n",
        external_with("steady", &steady, 8, "")
    );
    let config = plain_config(
        &env,
        &endpoints,
        "  concurrency: 8\n  env: { CALLS: \"3\", SLEEP: \"0.05\" }",
        80,
    );
    let mut child = env.spawn(&["run", config.to_str().unwrap(), "-y"]);
    let store = env.store_path();
    wait_until(ms(60_000), "20 items are done", || {
        evalfleet_store::SqliteStore::open_existing(&store)
            .ok()
            .and_then(|mut s| {
                let run = s.runs().ok()?.into_iter().next()?;
                s.counts(&run.run_id).ok()
            })
            .is_some_and(|c| c.done >= 20)
    })
    .await;
    signal(&doomed, "KILL").await;
    let _ = doomed.wait().await;
    let status = child.wait().await.unwrap();
    let run_id = env.store().runs().unwrap()[0].run_id.clone();
    assert_eq!(status.code(), Some(0));
    let counts = env.counts(&run_id);
    assert_eq!((counts.done, counts.failed), (80, 0));
    // Both took calls; after the kill, the steady one took them all.
    let mut by_endpoint = std::collections::BTreeMap::<String, u32>::new();
    let rows = env.export(&run_id).await;
    for row in &rows {
        let id = row["item_id"].as_str().unwrap();
        for call in calls_of(&store, &run_id, id) {
            assert_eq!(call.http_status, 200, "{call:?}");
            *by_endpoint.entry(call.telemetry.endpoint).or_default() += 1;
        }
    }
    assert!(
        by_endpoint.get("doomed").copied().unwrap_or(0) > 0,
        "{by_endpoint:?}"
    );
    assert!(by_endpoint["steady"] > 0, "{by_endpoint:?}");
    assert_eq!(by_endpoint.values().sum::<u32>(), 240);
}

/// An item's turns stay on the endpoint that served its first call while
/// it has room (an engine's prefix cache serves the next turn): two healthy
/// endpoints, 64 items of two calls each, every item's calls on one of them,
/// both endpoints used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_items_turns_stay_on_the_endpoint_of_its_first_call() {
    if !sandboxed() {
        return;
    }
    let env = Env::new();
    let a = mock(MockSettings::default()).await;
    let b = mock(MockSettings::default()).await;
    let endpoints = format!(
        "{}{}",
        external_with("a", &a, 16, ""),
        external_with("b", &b, 16, "")
    );
    let config = plain_config(
        &env,
        &endpoints,
        "  concurrency: 8\n  env: { CALLS: \"2\" }",
        64,
    );
    let ran = env
        .evalfleet(&["run", config.to_str().unwrap(), "-q"])
        .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let store = env.store_path();
    let run_id = ran.run_id();
    let mut used = std::collections::BTreeSet::new();
    let mut scattered = Vec::new();
    for row in env.export(&run_id).await {
        let id = row["item_id"].as_str().unwrap().to_owned();
        let calls = calls_of(&store, &run_id, &id);
        assert_eq!(calls.len(), 2, "{id}");
        used.extend(calls.iter().map(|c| c.telemetry.endpoint.clone()));
        if calls[0].telemetry.endpoint != calls[1].telemetry.endpoint {
            scattered.push(id);
        }
    }
    assert_eq!(scattered, Vec::<String>::new());
    assert_eq!(used.len(), 2, "{used:?}");
}

/// The LangGraph example, run once per item and served (one process for
/// every item, `task.mode: server`): the same answers and calls either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_langgraph_agent_runs_per_item_or_served_through_the_gateway() {
    let Some(python) = agent_python("langgraph, langchain_openai") else {
        return;
    };
    for example in ["langgraph.yaml", "langgraph-server.yaml"] {
        let env = Env::new();
        let (store, run_id) = run_example(&env, example, &python).await;
        let counts = evalfleet_store::SqliteStore::open_existing(&store)
            .unwrap()
            .counts(&run_id)
            .unwrap();
        assert_eq!((counts.done, counts.failed), (12, 0), "{example}");
        let calls = calls_of(&store, &run_id, "c001");
        // The ReAct loop: the model calls the tool, then answers with its
        // result.
        assert_eq!(calls.len(), 2, "{example}: {calls:#?}");
        let first: Value = serde_json::from_str(calls[0].response.as_deref().unwrap()).unwrap();
        assert_eq!(first["tool_calls"][0]["function"]["name"], "lookup");
        let second: Value = serde_json::from_str(&calls[1].request).unwrap();
        let last = second["messages"]
            .as_array()
            .unwrap()
            .last()
            .unwrap()
            .clone();
        assert_eq!(last["role"], "tool");
        assert_eq!(last["content"], "Paris");
    }
}

/// An agent that hands its token to the test (through a folder it may
/// write: `task.network: open` has no mount namespace), waits for the
/// test's word, then makes one call.
const WAITING_AGENT: &str = r#"
import json, os, sys, time, urllib.request
item = json.load(sys.stdin)
shared = os.environ["SHARED"]
with open(os.path.join(shared, "token.tmp"), "w") as f:
    f.write(os.environ["OPENAI_API_KEY"])
os.rename(os.path.join(shared, "token.tmp"), os.path.join(shared, "token"))
deadline = time.time() + 60
while not os.path.exists(os.path.join(shared, "go")) and time.time() < deadline:
    time.sleep(0.02)
body = {"model": "m", "messages": [{"role": "user", "content": item["question"]}]}
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=30) as r:
    print(json.load(r)["choices"][0]["message"]["content"])
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evalfleet_serve_answers_an_items_address_while_its_attempt_lives_and_refuses_it_after() {
    use std::os::unix::fs::PermissionsExt;
    if !sandboxed() {
        return;
    }
    let env = Env::new();
    // The agent runs as a user of its own, without the mount namespace.
    std::fs::set_permissions(env.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let shared = env.path("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    env.write("agent.py", WAITING_AGENT);
    let dataset = env.write(
        "one.jsonl",
        "{\"id\": \"x\", \"question\": \"wait for it\"}\n",
    );
    std::fs::set_permissions(&dataset, std::fs::Permissions::from_mode(0o644)).unwrap();
    let config = format!(
        "name: served-agent\n\
         dataset: {{ path: {}, id_field: id }}\n\
         endpoints:\n  - {{ name: m, kind: mock, concurrency: 4 }}\n\
         task:\n  kind: exec\n  command: /usr/bin/python3 {}\n  network: open\n  \
         env: {{ SHARED: \"{}\" }}\n",
        dataset.display(),
        env.path("agent.py").display(),
        shared.display()
    );
    // A config sent over HTTP runs no command unless the server allows it.
    let (_refusing, refusing_base) = crate::serve::serve(&env, &[], None).await;
    let refused = crate::serve::client()
        .post(format!("{refusing_base}/api/v1/runs"))
        .json(&serde_json::json!({"config": config}))
        .send()
        .await
        .unwrap();
    let status = refused.status();
    let body = refused.text().await.unwrap();
    assert!(status.is_client_error(), "{status}: {body}");
    assert!(
        body.contains("--allow-commands") && body.contains("task.command"),
        "{body}"
    );

    let (_server, base) = crate::serve::serve(&env, &["--allow-commands"], None).await;
    let client = crate::serve::client();
    let created = client
        .post(format!("{base}/api/v1/runs"))
        .json(&serde_json::json!({"config": config}))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201);
    let run_id = created.json::<Value>().await.unwrap()["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let token_file = shared.join("token");
    wait_until(ms(30_000), "the agent hands its token", || {
        token_file.exists()
    })
    .await;
    let token = std::fs::read_to_string(&token_file).unwrap();
    // The item's address on the server's own port: its models, a call.
    let models = client
        .get(format!("{base}/gw/{token}/v1/models"))
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), 200);
    let models: Value = models.json().await.unwrap();
    assert_eq!(models["data"][0]["id"], "mock");
    // Sent to a name the server does not answer to (a rebound one): refused
    // before the token is looked at.
    let rebound = client
        .get(format!("{base}/gw/{token}/v1/models"))
        .header("host", "rebound.example")
        .send()
        .await
        .unwrap();
    assert_eq!(rebound.status(), 421);
    let answered = client
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(&token)
        .json(&serde_json::json!({"model": "mock", "messages": [{"role": "user", "content": "from the test"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(answered.status(), 200);
    let unauthorized = |response: reqwest::Response| async move {
        let status = response.status();
        let body: Value = response.json().await.unwrap();
        assert_eq!(status, 401, "{body}");
        assert_eq!(body["error"]["code"], "invalid_api_key", "{body}");
    };
    // No token, a stranger's, a forged one.
    unauthorized(
        client
            .get(format!("{base}/v1/models"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    unauthorized(
        client
            .get(format!("{base}/gw/sk-nothing/v1/models"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    let (payload, tag) = token.split_once('.').unwrap();
    let forged = format!("{}A.{tag}", &payload[..payload.len() - 1]);
    let forged = if forged == token {
        format!("{}B.{tag}", &payload[..payload.len() - 1])
    } else {
        forged
    };
    unauthorized(
        client
            .get(format!("{base}/gw/{forged}/v1/models"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    std::fs::write(shared.join("go"), "").unwrap();
    crate::serve::wait_for_state(&base, &run_id, "finished").await;
    // The attempt has ended: its token is dead.
    unauthorized(
        client
            .get(format!("{base}/gw/{token}/v1/models"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    let item = crate::serve::get(&format!("{base}/api/v1/runs/{run_id}/items/x")).await;
    let calls = item["calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2, "{item}");
    assert_eq!(calls[0]["index"], 1);
    assert_eq!(item["output"], "wait for it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_run_again_gets_its_calls_from_the_response_cache_streamed_or_not() {
    let Some(python) = agent_python("openai") else {
        return;
    };
    let env = Env::new();
    for file in ["agent.py", "countries.jsonl", "answers.jsonl"] {
        std::fs::copy(examples().join(file), env.path(file)).unwrap();
    }
    let example = std::fs::read_to_string(examples().join("agent.yaml")).unwrap();
    let config = env.write(
        "agent.yaml",
        &format!("{example}cache: {{ mode: read_write }}\n"),
    );
    let mut runs = Vec::new();
    for _ in 0..2 {
        runs.push(run_agents(&env, &["run", config.to_str().unwrap(), "-y"], &python).await);
    }
    let store = env.store_path();
    let first = by_id(&env.export(&runs[0]).await);
    let second = by_id(&env.export(&runs[1]).await);
    assert_eq!(second.len(), 12);
    for (id, row) in &second {
        assert_eq!(row["output"], first[id]["output"], "{id}");
        let calls = calls_of(&store, &runs[1], id);
        assert_eq!(calls.len(), 3, "{id}");
        // Every call, the streamed one included, came from the cache.
        assert!(
            calls.iter().all(|c| c.cached && c.http_status == 200),
            "{id}: {calls:#?}"
        );
        assert_eq!(calls[0].telemetry.endpoint, "mock");
        let message: Value = serde_json::from_str(calls[0].response.as_deref().unwrap()).unwrap();
        assert_eq!(message["tool_calls"][0]["function"]["name"], "lookup");
        assert!(calls_of(&store, &runs[0], id).iter().all(|c| !c.cached));
    }
}

/// Prints how its item came: as the last argument, or in a file named by
/// it and by `$EVALFLEET_ITEM_FILE`.
const INPUT_AGENT: &str = r#"
import json, os, sys
if os.environ.get("EVALFLEET_ITEM_FILE"):
    assert sys.argv[-1] == os.environ["EVALFLEET_ITEM_FILE"], sys.argv
    item = json.load(open(sys.argv[-1]))
    how = "file"
else:
    item = json.loads(sys.argv[-1])
    how = "args"
print(how, sys.argv[1], item["question"], os.environ["EVALFLEET_ITEM_ID"], os.environ["EVALFLEET_ATTEMPT"])
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_reaches_its_agent_as_a_file_or_as_an_argument() {
    let env = Env::new();
    env.write("input.py", INPUT_AGENT);
    let dataset = env.dataset("items.jsonl", 3);
    for input in ["file", "args"] {
        let config = env.write(
            &format!("{input}.yaml"),
            &format!(
                "name: input-{input}\n\
                 dataset: {{ path: {}, id_field: id }}\n\
                 endpoints:\n  - {{ name: m, kind: mock, concurrency: 2 }}\n\
                 task:\n  kind: exec\n  command: [/usr/bin/python3, input.py, \"first arg\"]\n  \
                 input: {input}\n",
                dataset.display()
            ),
        );
        let ran = env
            .evalfleet(&["run", config.to_str().unwrap(), "-y"])
            .await;
        assert_eq!(ran.code, Some(0), "{}", ran.stderr);
        let rows = by_id(&env.export(&ran.run_id()).await);
        assert_eq!(
            rows["item-00001"]["output"],
            format!("{input} first arg question 1 of 3 item-00001 1")
        );
    }
}

/// Agents that all fail the same way (a module missing where they run)
/// stop the run once its first items have, naming the failure, instead of
/// failing every item; their attempts tried again count as retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_that_all_fail_alike_stop_the_run_naming_it() {
    let env = Env::new();
    let server = mock(MockSettings::default()).await;
    let endpoints = external_with("m", &server, 4, "");
    let script = agent_name(&env);
    env.write(
        &script,
        "import sys\nsys.stderr.write(\"ModuleNotFoundError: No module named 'openai'\\n\")\nsys.exit(1)\n",
    );
    let dataset = env.dataset("items.jsonl", 40);
    let config = env.write(
        "agent.yaml",
        &format!(
            "name: agents\n\
             dataset: {{ path: {}, id_field: id }}\n\
             endpoints:\n{endpoints}\n\
             retry: {{ max_attempts: 2, backoff_base: 10ms, backoff_max: 10ms }}\n\
             task:\n  kind: exec\n  command: /usr/bin/python3 {script}\n  timeout: 20s\n",
            dataset.display()
        ),
    );
    let ran = env
        .evalfleet(&["run", config.to_str().unwrap(), "-y"])
        .await;
    assert_eq!(ran.code, Some(130), "{}", ran.stderr);
    assert!(
        ran.stderr
            .contains("The first 5 items all failed the same way, and none was answered: the agent failed (2 attempts)"),
        "{}",
        ran.stderr
    );
    let counts = env.counts(&ran.run_id());
    assert!(
        counts.pending > 0,
        "it stopped before failing every item: {counts:?}"
    );
}

/// An agent that tries one wall (`WALL`) and prints what it found as JSON
/// (issue 38): the host's unix sockets, its /proc, a store under the
/// config's folder, children that outlive it, the gateway's cap.
const WALLS_AGENT: &str = r#"
import errno, json, os, socket, subprocess, sys, time, urllib.error, urllib.request
item = json.load(sys.stdin)
out = {}
here = os.path.dirname(os.path.abspath(__file__))
def err(e):
    return errno.errorcode.get(e.errno, str(e))
def unix(path, say):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    try:
        s.connect(path)
        s.sendall(say)
        return "talked: " + s.recv(64).decode(errors="replace")
    except OSError as e:
        return err(e)
    finally:
        s.close()
wall = os.environ["WALL"]
if wall == "sockets":
    # PostgreSQL's SSLRequest: it answers one byte, S or N.
    out["postgres"] = unix("/var/run/postgresql/.s.PGSQL.5432", b"\0\0\0\x08\x04\xd2\x16\x2f")
    out["planted"] = unix(os.environ["PLANTED"], b"ping")
    out["elsewhere"] = unix(os.environ["ELSEWHERE"], b"ping")
    out["in_folder"] = unix(os.path.join(here, "service.sock"), b"ping")
    out["run"] = sorted(os.listdir("/run"))
elif wall == "proc":
    mine, seen = os.getuid(), []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                cmd = open("/proc/%s/cmdline" % p, "rb").read().replace(b"\0", b" ").decode(errors="replace")
                seen.append((os.stat("/proc/" + p).st_uid, cmd))
            except OSError:
                pass
    out["others"] = [c for (u, c) in seen if u != mine]
    out["mine"] = len(seen)
    out["marker"] = any(os.environ["MARKER"] in c for (_, c) in seen)
elif wall == "store":
    for name in ["evalfleet.db", "evalfleet.db-wal"]:
        try:
            data = open(os.path.join(here, "runs", name), "rb").read(16)
            out[name] = "read %d bytes" % len(data)
        except OSError as e:
            out[name] = err(e)
    try:
        out["listing"] = os.listdir(os.path.join(here, "runs"))
    except OSError as e:
        out["listing"] = err(e)
elif wall == "children":
    marker = os.environ["MARKER"]
    sleeper = lambda how: [sys.executable, "-c", "import time; time.sleep(600)", marker + "-" + how]
    subprocess.Popen(sleeper("plain"))
    subprocess.Popen(sleeper("setsid"), start_new_session=True)
    if os.fork() == 0:
        if os.fork() == 0:
            os.setsid()
            os.execv(sys.executable, sleeper("daemon"))
        os._exit(0)
    time.sleep(600)
elif wall == "body":
    base = os.environ["OPENAI_BASE_URL"]
    size = int(os.environ["BODY_MIB"]) << 20
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * size + b'"}]}'
    req = urllib.request.Request(base + "/chat/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            out["status"] = r.status
    except urllib.error.HTTPError as e:
        out["status"] = e.code
        out["error"] = json.load(e).get("error", {}).get("message", "")
print(json.dumps(out))
"#;

/// Runs the walls agent once with `WALL=wall` and `env` (YAML pairs); the
/// finished run.
async fn try_wall(env: &Env, wall: &str, extra_env: &str) -> crate::util::Ran {
    let server = mock(MockSettings::default()).await;
    let endpoints = external_with("m", &server, 4, "");
    env.write("walls.py", WALLS_AGENT);
    let dataset = env.write("one.jsonl", "{\"id\": \"x\", \"question\": \"walls\"}\n");
    let config = env.write(
        "walls.yaml",
        &exec_config(
            "walls",
            &dataset,
            &endpoints,
            "retry: { max_attempts: 1 }\n",
            "/usr/bin/python3 walls.py",
            &format!("  timeout: 60s\n  env: {{ WALL: {wall}{extra_env} }}\n"),
        ),
    );
    env.evalfleet(&["run", config.to_str().unwrap(), "-y"])
        .await
}

/// The walls agent's report: its output, as JSON.
async fn wall_report(env: &Env, ran: &crate::util::Ran) -> Value {
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let rows = env.export(&ran.run_id()).await;
    serde_json::from_str(rows[0]["output"].as_str().unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_reaches_no_unix_socket_of_the_host() {
    if !sandboxed() {
        return;
    }
    let env = Env::new();
    let name = env
        .dir
        .path()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    // Listeners of the host's that answer whoever connects: one under
    // /run, one in a folder anyone may pass through outside the covered
    // ones (listening before the run starts, as a service's would).
    let planted = PathBuf::from(format!("/run/evalfleet-walls-{name}.sock"));
    let folder = PathBuf::from(format!("/var/lib/evalfleet-walls-{name}"));
    std::fs::create_dir_all(&folder).unwrap();
    let elsewhere = folder.join("service.sock");
    // And one in the agent's own folder (a dev server's, an editor's),
    // which the agent reaches through its folder's place in the sandbox.
    let in_folder = env.path("service.sock");
    for path in [&planted, &elsewhere, &in_folder] {
        plant_listener(path);
    }
    let ran = try_wall(
        &env,
        "sockets",
        &format!(
            ", PLANTED: \"{}\", ELSEWHERE: \"{}\"",
            planted.display(),
            elsewhere.display()
        ),
    )
    .await;
    // This machine still reaches its own service.
    let mut here = std::os::unix::net::UnixStream::connect(&elsewhere).unwrap();
    {
        use std::io::{Read, Write};
        here.write_all(b"ping").unwrap();
        let mut answer = [0u8; 4];
        here.read_exact(&mut answer).unwrap();
        assert_eq!(&answer, b"pong");
    }
    let _ = std::fs::remove_file(&planted);
    let _ = std::fs::remove_dir_all(&folder);
    let out = wall_report(&env, &ran).await;
    assert_eq!(out["planted"], "ENOENT", "{out}");
    // Covered by an empty file: no socket to connect to.
    assert_eq!(out["elsewhere"], "ECONNREFUSED", "{out}");
    assert_eq!(out["in_folder"], "ECONNREFUSED", "{out}");
    assert_eq!(out["run"], serde_json::json!([]), "{out}");
    // The machine's PostgreSQL, where it runs (its socket trusts local
    // users), is as far out of reach.
    if Path::new("/var/run/postgresql/.s.PGSQL.5432").exists() {
        assert_eq!(out["postgres"], "ENOENT", "{out}");
    }
}

/// A unix socket at `path` that anyone may connect to, answering `pong`.
fn plant_listener(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::remove_file(path);
    let listener = std::os::unix::net::UnixListener::bind(path).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for mut conn in listener.incoming().flatten() {
            let mut buf = [0u8; 4];
            let _ = conn.read(&mut buf);
            let _ = conn.write_all(b"pong");
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_sees_only_its_own_processes() {
    if !sandboxed() {
        return;
    }
    let env = Env::new();
    // A process of the host's whose command line holds a secret.
    let marker = format!("--api-key=sk-{}", agent_name(&env));
    let mut host = std::process::Command::new("/bin/sh")
        .args(["-c", "sleep 600; :", &marker])
        .spawn()
        .unwrap();
    let ran = try_wall(&env, "proc", &format!(", MARKER: \"{marker}\"")).await;
    let _ = host.kill();
    let _ = host.wait();
    let out = wall_report(&env, &ran).await;
    assert_eq!(out["marker"], false, "{out}");
    assert_eq!(out["others"], serde_json::json!([]), "{out}");
    // Itself, at least.
    assert!(out["mine"].as_u64().unwrap() >= 1, "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_an_agent_started_outlives_a_killed_run() {
    if !sandboxed() {
        return;
    }
    let env = Env::new();
    let server = mock(MockSettings::default()).await;
    let endpoints = external_with("m", &server, 4, "");
    env.write("walls.py", WALLS_AGENT);
    let dataset = env.write("one.jsonl", "{\"id\": \"x\", \"question\": \"walls\"}\n");
    let marker = format!("walls-{}", agent_name(&env));
    let config = env.write(
        "walls.yaml",
        &exec_config(
            "walls",
            &dataset,
            &endpoints,
            "",
            "/usr/bin/python3 walls.py",
            &format!("  timeout: 600s\n  env: {{ WALL: children, MARKER: {marker} }}\n"),
        ),
    );
    let mut child = env.spawn(&["run", config.to_str().unwrap(), "-y"]);
    // A plain child, one in a session of its own, and a daemon (double
    // fork, setsid): their command lines end in the marker and how.
    wait_until(ms(60_000), "the agent's three children run", || {
        ["plain", "setsid", "daemon"]
            .iter()
            .all(|how| !processes_with(&format!("{marker}-{how}")).is_empty())
    })
    .await;
    signal(&child, "KILL").await;
    let _ = child.wait().await;
    wait_until(ms(10_000), "no process of the agent's is left", || {
        processes_with(&marker).is_empty()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_cannot_open_a_store_under_its_config_folder() {
    if !sandboxed() {
        return;
    }
    // The default store, runs/evalfleet.db, run from the agent's folder:
    // inside the folder bound into every agent.
    let env = Env::new();
    let ran = try_wall(&env, "store", "").await;
    assert!(env.store_path().is_file());
    let out = wall_report(&env, &ran).await;
    assert_eq!(out["evalfleet.db"], "ENOENT", "{out}");
    assert_eq!(out["evalfleet.db-wal"], "ENOENT", "{out}");
    assert_eq!(out["listing"], serde_json::json!([]), "{out}");
    // A store of its own name right in the config's folder: its file is
    // seen empty.
    let env = Env::new();
    let server = mock(MockSettings::default()).await;
    let endpoints = external_with("m", &server, 4, "");
    env.write("walls.py", &WALLS_AGENT.replace("\"runs\", name", "name"));
    let dataset = env.write("one.jsonl", "{\"id\": \"x\", \"question\": \"walls\"}\n");
    let config = env.write(
        "walls.yaml",
        &exec_config(
            "walls",
            &dataset,
            &endpoints,
            "",
            "/usr/bin/python3 walls.py",
            "  env: { WALL: store }\n",
        ),
    );
    let ran = env
        .evalfleet(&[
            "run",
            config.to_str().unwrap(),
            "--store",
            "evalfleet.db",
            "-y",
        ])
        .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let store = env.path("evalfleet.db");
    let mut opened = evalfleet_store::SqliteStore::open_existing(&store).unwrap();
    let item = opened.item(&ran.run_id(), "x").unwrap().unwrap();
    let out: Value = serde_json::from_str(item.row.output.as_deref().unwrap()).unwrap();
    // Opened, it reads nothing: /dev/null is bound over it.
    assert_eq!(out["evalfleet.db"], "read 0 bytes", "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_body_past_the_gateways_cap_is_refused_with_413() {
    let env = Env::new();
    let ran = try_wall(&env, "body", ", BODY_MIB: \"17\"").await;
    let out = wall_report(&env, &ran).await;
    assert_eq!(out["status"], 413, "{out}");
    assert!(
        out["error"].as_str().unwrap().contains("at most 16 MiB"),
        "{out}"
    );
    // Just under it, the call is made.
    let env = Env::new();
    let ran = try_wall(&env, "body", ", BODY_MIB: \"15\"").await;
    let out = wall_report(&env, &ran).await;
    assert_eq!(out["status"], 200, "{out}");
}
