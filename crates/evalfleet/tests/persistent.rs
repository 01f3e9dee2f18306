//! Persistent agents (`task.mode: server`): one process serves many items
//! over evalfleet's agent protocol, each item with its own address at the
//! gateway; a crash retries the items it held and starts it again; a hung
//! item is cancelled without ending the others.

use std::collections::{BTreeMap, BTreeSet};

use evalfleet_mock::MockSettings;
use serde_json::Value;

use crate::util::{Env, by_id, external_with, mock};

/// An agent served by the helper (`from evalfleet_agent import serve`): it
/// calls the model once through its item's own address (plain urllib: the
/// client's `base_url` and `api_key`), and answers with its pid and the
/// count of items its process saw. With `TRY=crash`, item 3 on its first
/// attempt ends the process; with `TRY=hang`, item 5 on its first attempt
/// hangs.
const SERVED: &str = r#"
import json, os, threading, time, urllib.request
from evalfleet_agent import serve

SEEN = [0]
LOCK = threading.Lock()

def solve(item, client):
    with LOCK:
        SEEN[0] += 1
    attempt = client.attempt
    if os.environ["TRY"] == "crash" and item["id"] == "item-00003" and attempt == 1:
        os._exit(3)
    if os.environ["TRY"] == "hang" and item["id"] == "item-00005" and attempt == 1:
        time.sleep(3600)
    body = {"model": "m", "messages": [{"role": "user", "content": item["question"]}]}
    req = urllib.request.Request(str(client.base_url).rstrip("/") + "/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": "Bearer " + client.api_key})
    with urllib.request.urlopen(req, timeout=60) as r:
        json.load(r)
    print("a stray print goes to stderr, not the protocol")
    return {"pid": os.getpid(), "seen": SEEN[0], "id": item["id"]}

serve(solve)
"#;

/// A run of `n` items by an agent served as `task` says (its `command`,
/// `mode` and the rest), each item tried at most `attempts` times, which
/// must end with `code`: its rows by item id.
async fn served(
    env: &Env,
    endpoints: &str,
    n: usize,
    attempts: u32,
    task: &str,
    code: Option<i32>,
) -> BTreeMap<String, Value> {
    let dataset = env.dataset("items.jsonl", n);
    let config = env.write(
        "agent.yaml",
        &format!(
            "name: served\n\
             dataset: {{ path: {}, id_field: id }}\n\
             endpoints:\n{endpoints}\n\
             retry: {{ max_attempts: {attempts}, backoff_base: 10ms, backoff_max: 50ms }}\n\
             task:\n  kind: exec\n{task}",
            dataset.display()
        ),
    );
    let ran = env
        .evalfleet(&["run", config.to_str().unwrap(), "-q"])
        .await;
    assert_eq!(ran.code, code, "{task}: {}", ran.stderr);
    by_id(&env.export(&ran.run_id()).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_process_serves_the_items_a_crash_is_retried_and_a_hung_item_cancelled() {
    if !crate::agents::sandboxed() {
        return;
    }
    let env = Env::new();
    env.write("served.py", SERVED);
    let server = mock(MockSettings::default()).await;
    let endpoints = external_with("m", &server, 8, "");
    let mut answered = 0;
    for try_ in ["crash", "hang"] {
        let task = format!(
            "  command: /usr/bin/python3 served.py\n  mode: server\n  concurrency: 4\n  timeout: 3s\n  env: {{ TRY: {try_} }}\n"
        );
        let rows = served(&env, &endpoints, 12, 3, &task, Some(0)).await;
        assert_eq!(rows.len(), 12);
        let mut outputs = BTreeMap::new();
        for (id, row) in &rows {
            let output: Value = serde_json::from_str(row["output"].as_str().unwrap_or("null"))
                .unwrap_or_else(|_| panic!("{id}: {row}"));
            assert_eq!(output["id"], id.as_str(), "{row}");
            // Each item's answering attempt made its one call through its
            // own address (attempts the crash failed may have made theirs).
            assert_eq!(row["judge"]["calls"], 1, "{row}");
            outputs.insert(id.clone(), output);
        }
        answered += 12;
        if try_ == "crash" {
            // Item 3 ended the process on its first attempt: it (and the
            // items the process held with it) were answered by the process
            // started again.
            assert_eq!(rows["item-00003"]["attempts"], 2, "{}", rows["item-00003"]);
        } else {
            // Item 5 hung on its first attempt: cancelled at its timeout,
            // answered on its second by the same process, which had served
            // every other item meanwhile (its set-up paid once for them).
            assert_eq!(rows["item-00005"]["attempts"], 2, "{}", rows["item-00005"]);
            assert_eq!(outputs["item-00005"]["seen"], 13, "{}", rows["item-00005"]);
            let pids: BTreeSet<u64> = outputs
                .values()
                .map(|o| o["pid"].as_u64().unwrap())
                .collect();
            assert_eq!(pids.len(), 1, "{pids:?}");
        }
    }
    assert!(server.stats().requests >= answered);
}

/// `python3 -m evalfleet_agent FILE solve --fork`: each item in a child
/// forked from the loaded agent (its globals as they were at the fork),
/// and the same function served on threads shares one process's globals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_helper_serves_a_plain_function_on_threads_or_a_child_per_item() {
    if !crate::agents::sandboxed() {
        return;
    }
    let env = Env::new();
    env.write(
        "plain.py",
        "import os\nCOUNT = [0]\n\
         def solve(item, client):\n\
         \x20   COUNT[0] += 1\n\
         \x20   assert client.api_key and str(client.base_url).rstrip('/').endswith('/v1')\n\
         \x20   return '%d %d %s' % (os.getpid(), COUNT[0], item['question'])\n",
    );
    let server = mock(MockSettings::default()).await;
    let endpoints = external_with("m", &server, 8, "");
    for (fork, processes) in [("", 1), (" --fork", 8)] {
        let task = format!(
            "  command: /usr/bin/python3 -m evalfleet_agent plain.py solve{fork}\n  mode: server\n  concurrency: 2\n"
        );
        let rows = served(&env, &endpoints, 8, 3, &task, Some(0)).await;
        let mut pids = BTreeSet::new();
        let mut counts = BTreeSet::new();
        for row in rows.values() {
            let output = row["output"].as_str().unwrap().to_owned();
            let words: Vec<&str> = output.splitn(3, ' ').collect();
            assert!(words[2].starts_with("question "), "{output}");
            pids.insert(words[0].to_owned());
            counts.insert(words[1].to_owned());
        }
        assert_eq!(pids.len(), processes, "{fork}: {pids:?}");
        if fork.is_empty() {
            // One process's globals: every count from 1 to 8 once.
            assert_eq!(counts.len(), 8, "{counts:?}");
        } else {
            // Each child starts from the loaded agent's globals.
            assert_eq!(counts, BTreeSet::from(["1".to_owned()]));
        }
    }
}

/// A server that cannot serve (it exits at once, every time) fails its
/// items with what it wrote, after its tries, and the run ends failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_ends_at_once_fails_its_items_saying_why() {
    if !crate::agents::sandboxed() {
        return;
    }
    let env = Env::new();
    env.write(
        "broken.py",
        "import sys\nsys.stderr.write('cannot load the model weights\\n')\nsys.exit(5)\n",
    );
    let server = mock(MockSettings::default()).await;
    let endpoints = external_with("m", &server, 8, "");
    let task = "  command: /usr/bin/python3 broken.py\n  mode: server\n";
    let rows = served(&env, &endpoints, 3, 3, task, Some(1)).await;
    for row in rows.values() {
        let error = row["error"].as_str().unwrap_or_default();
        assert!(
            error.contains("exited with status 5")
                && error.contains("cannot load the model weights"),
            "{row}"
        );
        assert!(row["output"].is_null(), "{row}");
    }
    assert_eq!(server.stats().requests, 0);
}

/// The helper keeps the protocol's streams from the agent's code: an
/// answer that JSON cannot carry fails its item at once (not at its
/// timeout), and a tool the agent starts reads an empty input rather than
/// the items' lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_helpers_streams_are_its_own_and_an_unsendable_answer_fails_at_once() {
    if !crate::agents::sandboxed() {
        return;
    }
    let env = Env::new();
    env.write(
        "odd.py",
        "import subprocess\n\
         def solve(item, client):\n\
         \x20   if item['id'] == 'item-00000':\n\
         \x20       return object()\n\
         \x20   if item['id'] == 'item-00001':\n\
         \x20       return 'cat read %d bytes' % len(subprocess.run(['cat'], capture_output=True).stdout)\n\
         \x20   return 'fine'\n",
    );
    let server = mock(MockSettings::default()).await;
    let endpoints = external_with("m", &server, 8, "");
    // One attempt each: a retry would hide what the first one did.
    let task = "  command: /usr/bin/python3 -m evalfleet_agent odd.py solve\n  mode: server\n  concurrency: 4\n  timeout: 60s\n";
    let rows = served(&env, &endpoints, 8, 1, task, Some(1)).await;
    let error = rows["item-00000"]["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("cannot be sent as JSON"),
        "{}",
        rows["item-00000"]
    );
    assert_eq!(rows["item-00001"]["output"], "cat read 0 bytes");
    for i in 2..8 {
        assert_eq!(rows[&format!("item-{i:05}")]["output"], "fine");
    }
}
