//! What the CLI makes of the calls agents made through the gateway
//! (`kind: exec`): `export --format trajectories` and the report's
//! figures per item. The run and its calls are written through the store's
//! own commit path, as a run's writer does.

use std::time::Duration;

use evalfleet_config::{self as config, Overrides};
use evalfleet_io::template::Templates;
use evalfleet_store::prelude::*;
use evalfleet_store::{Batch, Claimed};
use evalfleet_types::{AgentCall, Assessment, ItemStatus, ResultRecord, Score, Telemetry};
use serde_json::{Value, json};

use crate::util::{Env, config};

/// Call `index` of item `seq`'s first attempt: a chat completion that sent
/// `messages` (with one tool offered) and got `answer`.
fn chat(seq: u64, index: u32, messages: Value, answer: Value) -> AgentCall {
    AgentCall {
        seq,
        attempt: 1,
        index,
        call_id: format!("{seq}.1.{index}"),
        api: "chat.completions".to_owned(),
        asked_model: "gpt-4o".to_owned(),
        sent_at_ms: 1_000 * i64::from(index),
        telemetry: Telemetry {
            endpoint: "e".to_owned(),
            model: "m".to_owned(),
            latency_ms: 50.0,
            prompt_tokens: Some(40),
            completion_tokens: Some(10),
            ..Telemetry::default()
        },
        http_status: 200,
        request: json!({
            "model": "gpt-4o",
            "messages": messages,
            "tools": [{"type": "function", "function": {"name": "whois", "parameters": {"type": "object"}}}],
        })
        .to_string(),
        response: Some(answer.to_string()),
        ..AgentCall::default()
    }
}

/// `evalfleet export RUN_ID --format trajectories` with `extra`, which
/// succeeds.
pub async fn export_trajectories(env: &Env, run_id: &str, extra: &[&str]) -> crate::util::Ran {
    let mut args = vec!["export", run_id, "--format", "trajectories"];
    args.extend(extra);
    let ran = env.evalfleet(&args).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    ran
}

#[tokio::test]
async fn trajectories_and_the_report_show_each_items_agent_calls() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 3);
    let config_path = env.write(
        "run.yaml",
        &config(
            &dataset,
            "  - { name: e, kind: external, base_url: \"http://127.0.0.1:9/v1\", model: m }",
            "",
        ),
    );
    let loaded = config::load_file(&config_path, Overrides::default()).unwrap();
    let templates = Templates::compile(&loaded.config.task).unwrap();
    let mut store = evalfleet_store::SqliteStore::open(&env.store_path()).unwrap();
    evalfleet_core::run::create(&mut store, &loaded, &templates, "agents").unwrap();
    let lease = Duration::from_secs(60);
    let mut worker = evalfleet_store::worker::this_process(lease);
    store.begin_session("agents", &mut worker, false).unwrap();
    let Claimed::Items(claim) = store
        .claim("agents", &worker.worker, None, 10, lease)
        .unwrap()
    else {
        panic!("the items are pending");
    };

    // Item 0's agent asks, calls its tool, and answers with the tool's
    // result; item 1's answers at once; item 2's made no call.
    let user = json!({"role": "user", "content": "Who runs example.org?"});
    let tool_call = json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "whois", "arguments": "{\"domain\":\"example.org\"}"}}
    ]});
    let tool_result = json!({"role": "tool", "tool_call_id": "call_1", "content": "IANA"});
    let answer = json!({"role": "assistant", "content": "IANA"});
    let seqs: Vec<u64> = claim.items.iter().map(|i| i.seq).collect();
    let mut batch = Batch {
        calls: vec![
            (claim.id, chat(seqs[0], 1, json!([user]), tool_call.clone())),
            (
                claim.id,
                chat(
                    seqs[0],
                    2,
                    json!([user, tool_call, tool_result]),
                    answer.clone(),
                ),
            ),
            (claim.id, chat(seqs[1], 1, json!([user]), answer)),
        ],
        ..Batch::default()
    };
    for (i, item) in claim.items.iter().enumerate() {
        let mut assessment = Assessment::default();
        assessment.scores.insert(
            "exact_match@1".to_owned(),
            Score::value(if i == 0 { 1.0 } else { 0.0 }),
        );
        batch.results.push((
            claim.id,
            ResultRecord {
                seq: item.seq,
                item_id: item.item_id.clone(),
                status: ItemStatus::Done,
                output: Some("IANA".to_owned()),
                error: None,
                telemetry: None,
                attempts: 1,
                cached: 0,
                item: Some(format!("{{\"id\": \"{}\"}}", item.item_id)),
                finished_at_ms: 1,
                assessment,
                prompt: None,
                images: Vec::new(),
            },
        ));
    }
    assert_eq!(
        store
            .commit("agents", &worker.worker, &batch)
            .unwrap()
            .results,
        3
    );
    store.release("agents", &worker.worker).unwrap();
    drop(store);

    let ran = env
        .evalfleet(&["export", "agents", "--format", "jsonl", "--attempts", "all"])
        .await;
    assert_ne!(ran.code, Some(0));
    assert!(
        ran.stderr
            .contains("--attempts is for --format trajectories"),
        "{}",
        ran.stderr
    );
    let ran = export_trajectories(&env, "agents", &[]).await;
    let lines: Vec<Value> = ran
        .stdout
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{}", ran.stdout);
    let first = &lines[0];
    assert_eq!(first["item_id"], "item-00000");
    assert_eq!(first["scores"], json!({"exact_match@1": 1.0}));
    assert_eq!(
        (first["attempt"].clone(), first["calls"].clone()),
        (json!(1), json!(2))
    );
    let roles: Vec<&str> = first["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["user", "assistant", "tool", "assistant"]);
    assert_eq!(
        first["messages"][1]["tool_calls"][0]["function"]["name"],
        "whois"
    );
    assert_eq!(first["messages"][2]["tool_call_id"], "call_1");
    assert_eq!(first["tools"][0]["function"]["name"], "whois");
    assert_eq!(
        first["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (s["message"].clone(), s["prompt_tokens"].clone()))
            .collect::<Vec<_>>(),
        vec![(json!(1), json!(40)), (json!(3), json!(40))]
    );
    assert_eq!(lines[1]["item_id"], "item-00001");
    assert!(
        ran.stderr.contains("1 item(s) left out"),
        "the item without calls is said to be left out: {}",
        ran.stderr
    );

    let ran = env.evalfleet(&["report", "agents", "--json"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let report: Value = serde_json::from_str(&ran.stdout).unwrap();
    let agents = &report["agents"];
    assert_eq!(
        (agents["items"].clone(), agents["calls"].clone()),
        (json!(2), json!(3))
    );
    assert_eq!(agents["calls_per_item"]["mean"], 1.5);
    assert_eq!(agents["tokens_per_item"]["mean"], 75.0);
    assert_eq!(agents["call_ms_per_item"]["mean"], 75.0);
    let ran = env.evalfleet(&["report", "agents"]).await;
    assert!(
        ran.stdout.contains("Agents: 3 calls for 2 items"),
        "{}",
        ran.stdout
    );
}

/// An agent (urllib of /usr/bin/python3) that holds two conversations: a
/// planner's one call, then a solver's two, whose history of `TURNS` tool
/// calls and results (unicode and quotes in them) runs past half a
/// megabyte.
const TWO_CONVERSATIONS: &str = r#"
import json, os, sys, urllib.request
item = json.load(sys.stdin)
base = os.environ["OPENAI_BASE_URL"]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}}}}]
def ask(messages, tools=None):
    body = {"model": "any-name", "messages": messages}
    if tools:
        body["tools"] = tools
    req = urllib.request.Request(base + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)["choices"][0]["message"]
ask([{"role": "system", "content": "Plan."}, {"role": "user", "content": item["question"]}])
history = [{"role": "user", "content": "Solve «" + item["question"] + "»"}]
for i in range(int(os.environ["TURNS"])):
    cid = "call_%d" % i
    history.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"q": "d%d" % i})}}]})
    history.append({"role": "tool", "tool_call_id": cid, "content": "result %d: «é» \"quoted\" %s" % (i, "x" * 200)})
first = ask(history, TOOLS)
history.append({"role": "assistant", "content": first.get("content")})
history.append({"role": "user", "content": "And then?"})
print(ask(history, TOOLS).get("content") or "")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_conversations_are_exported_whole_and_load_as_a_trl_dataset() {
    if !crate::agents::sandboxed() {
        return;
    }
    const TURNS: usize = 1_500;
    let env = Env::new();
    let server = crate::util::mock(evalfleet_mock::MockSettings::default()).await;
    env.write("agent.py", TWO_CONVERSATIONS);
    let dataset = env.dataset("items.jsonl", 3);
    let config_path = env.write(
        "run.yaml",
        &format!(
            "name: agents\n\
             dataset: {{ path: {}, id_field: id }}\n\
             endpoints:\n{}\n\
             task:\n  kind: exec\n  command: /usr/bin/python3 agent.py\n  env: {{ TURNS: \"{TURNS}\" }}\n",
            dataset.display(),
            crate::util::external_with("m", &server, 8, ""),
        ),
    );
    let ran = env
        .evalfleet(&["run", config_path.to_str().unwrap(), "-y"])
        .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let run_id = ran.stdout.lines().next().unwrap().trim().to_owned();

    let out = env.path("trajectories.jsonl");
    export_trajectories(&env, &run_id, &["-o", out.to_str().unwrap()]).await;
    let text = std::fs::read_to_string(&out).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(lines.len(), 6, "two conversations an item");
    let long = |i: usize| format!("result {i}: «é» \"quoted\" {}", "x".repeat(200));
    for pair in lines.chunks(2) {
        let (planner, solver) = (&pair[0], &pair[1]);
        assert_eq!(planner["item_id"], solver["item_id"]);
        assert_eq!(
            (&planner["conversation"], &solver["conversation"]),
            (&json!(0), &json!(1))
        );
        assert_eq!(
            (&planner["calls"], &solver["calls"]),
            (&json!(3), &json!(3))
        );
        let roles: Vec<&str> = planner["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["system", "user", "assistant"]);
        // The solver's history whole, byte for byte, its two steps where
        // their answers are.
        let messages = solver["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 1 + 2 * TURNS + 3);
        assert_eq!(messages[2 * TURNS]["content"], long(TURNS - 1));
        assert_eq!(
            messages[2 * TURNS - 1]["tool_calls"][0]["function"]["arguments"],
            format!("{{\"q\": \"d{}\"}}", TURNS - 1)
        );
        assert_eq!(messages[2 * TURNS + 2]["content"], "And then?");
        let at: Vec<&Value> = solver["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| &s["message"])
            .collect();
        assert_eq!(at, [&json!(1 + 2 * TURNS), &json!(3 + 2 * TURNS)]);
        for step in solver["steps"].as_array().unwrap() {
            assert_eq!(step["endpoint"], "m");
            assert!(step["prompt_tokens"].as_u64().unwrap() > 0, "{step}");
            assert!(step["latency_ms"].as_f64().unwrap() > 0.0, "{step}");
        }
        assert_eq!(solver["tools"][0]["function"]["name"], "lookup");
    }
    // Stored whole: past the 256 KiB that were once kept.
    let calls = {
        let mut store = env.store();
        store.item(&run_id, "item-00000").unwrap().unwrap().calls
    };
    assert!(calls[2].request.len() > 455_000 && !calls[2].request_cut);

    // Loaded as SFT users load it: a `datasets` table in TRL's
    // conversational format, rendered by a chat template.
    let Some(python) = crate::util::python_with(
        "EVALFLEET_PYARROW_PYTHON",
        "datasets, transformers, trl.data_utils",
        "datasets, transformers and trl",
    ) else {
        return;
    };
    let loader = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/agent/load_trajectories.py");
    let loaded = tokio::process::Command::new(&python)
        .arg(&loader)
        .arg(&out)
        .env("HF_DATASETS_CACHE", env.path("hf-cache"))
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .await
        .unwrap();
    assert!(
        loaded.status.success(),
        "{}",
        String::from_utf8_lossy(&loaded.stderr)
    );
    let loaded: Value = serde_json::from_slice(&loaded.stdout).unwrap();
    assert_eq!(loaded["rows"], 6);
    for key in ["messages", "tools", "steps", "scores", "attempt_status"] {
        assert!(
            loaded["columns"].as_array().unwrap().contains(&json!(key)),
            "{key}: {}",
            loaded["columns"]
        );
    }
    let solver_text = loaded["texts"][1].as_str().unwrap();
    assert!(solver_text.contains(&long(TURNS - 1)));
    assert!(solver_text.contains(&format!(
        "<call lookup>{{\"q\": \"d{}\"}}</call>",
        TURNS - 1
    )));
}
