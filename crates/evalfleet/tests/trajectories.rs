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
        .evalfleet(&["export", "agents", "--format", "trajectories"])
        .await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
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
