//! Endpoints that misbehave: 5xx bursts, 429 with Retry-After, hangs past
//! the attempt timeout, truncated streams, and errors that never stop.

use evalfleet_core::store::prelude::*;
use evalfleet_mock::MockSettings;

use crate::util::{Env, NO_HEALTH, by_id, config, external, external_with, mock, ms};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_errors_are_retried_until_every_item_is_done() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 120);
    // Each endpoint has one kind of trouble; every item meets some of it.
    let bursts = mock(MockSettings {
        fail_first: 2,
        error_status: 502,
        ..MockSettings::default()
    })
    .await;
    let quota = mock(MockSettings {
        max_concurrency: Some(1),
        retry_after: ms(50),
        latency: ms(20),
        ..MockSettings::default()
    })
    .await;
    let hangs = mock(MockSettings {
        hang_rate: 0.3,
        seed: 7,
        ..MockSettings::default()
    })
    .await;
    let cut = mock(MockSettings {
        truncate_rate: 0.4,
        output_tokens: Some(8),
        seed: 3,
        ..MockSettings::default()
    })
    .await;
    // Health is out of the way: each call's failure must be on record with
    // its class, which moving calls off an unhealthy endpoint would blur.
    let endpoints = external_with("bursts", &bursts, 4, NO_HEALTH)
        + &external_with("quota", &quota, 4, NO_HEALTH)
        + &external_with("hangs", &hangs, 4, NO_HEALTH)
        + &external_with("cut", &cut, 4, NO_HEALTH);
    let extra = "retry: { max_attempts: 20, backoff_base: 10ms, backoff_max: 100ms }\n\
                 timeouts: { attempt: 300ms }";
    let text = config(&dataset, &endpoints, extra)
        .replace("max_tokens: 64 }", "max_tokens: 64 }\n  stream: true");
    env.write("run.yaml", &text);

    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let rows = by_id(&env.export(&ran.run_id()).await);
    assert_eq!(rows.len(), 120);
    assert!(
        rows.values().all(|r| r["status"] == "done"),
        "every item ends done"
    );
    for row in rows.values().filter(|r| r["endpoint"] != "cut") {
        assert_eq!(row["output"], row["item"]["question"]);
    }
    assert!(
        bursts.stats().injected_errors > 0,
        "the 5xx endpoint was never hit"
    );
    assert!(quota.stats().rate_limited > 0, "no 429 was ever sent");
    assert!(hangs.stats().hung > 0, "no call ever hung");
    assert!(cut.stats().truncated > 0, "no stream was ever cut");

    // Every failed attempt is on record with its class.
    let summary = evalfleet_core::report::endpoints(&mut env.store(), &ran.run_id()).unwrap();
    let errors = |name: &str, class: &str| {
        summary
            .iter()
            .find(|e| e.endpoint == name)
            .and_then(|e| e.errors.get(class).copied())
            .unwrap_or(0)
    };
    assert_eq!(
        errors("bursts", "retryable"),
        bursts.stats().injected_errors
    );
    assert_eq!(errors("quota", "back_pressure"), quota.stats().rate_limited);
    assert!(errors("hangs", "back_pressure") >= 1, "{summary:?}");
    assert!(errors("cut", "bad_response") >= 1, "{summary:?}");
    let retried = rows
        .values()
        .filter(|r| r["attempts"].as_u64().unwrap() > 1)
        .count();
    assert!(retried > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_fails_with_its_reason_once_its_attempts_run_out() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 30);
    let broken = mock(MockSettings {
        error_rate: 1.0,
        ..MockSettings::default()
    })
    .await;
    let extra = "retry: { max_attempts: 3, backoff_base: 5ms, backoff_max: 20ms }";
    env.write(
        "run.yaml",
        &config(
            &dataset,
            &external_with("broken", &broken, 4, NO_HEALTH),
            extra,
        ),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(
        ran.code,
        Some(1),
        "failed items give exit code 1: {}",
        ran.stderr
    );
    let rows = by_id(&env.export(&ran.run_id()).await);
    assert_eq!(rows.len(), 30);
    for row in rows.values() {
        assert_eq!(row["status"], "failed");
        assert_eq!(row["attempts"], 3);
        assert_eq!(
            row["error"], "gave up after 3 attempts: HTTP 500: injected error",
            "{row}"
        );
    }
    assert_eq!(
        broken.stats().requests,
        90,
        "exactly max_attempts calls per item"
    );
    assert!(ran.stderr.contains("0 done, 30 failed"), "{}", ran.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_status_fails_the_item_without_a_retry() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 10);
    let refusing = mock(MockSettings {
        error_rate: 1.0,
        error_status: 400,
        ..MockSettings::default()
    })
    .await;
    env.write(
        "run.yaml",
        &config(&dataset, &external("refusing", &refusing, 4), ""),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    let rows = by_id(&env.export(&ran.run_id()).await);
    assert!(
        rows.values()
            .all(|r| r["status"] == "failed" && r["attempts"] == 1)
    );
    assert_eq!(rows["item-00003"]["error"], "HTTP 400: injected error");
    assert_eq!(refusing.stats().requests, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_item_deadline_bounds_retries() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 4);
    let hanging = mock(MockSettings {
        hang_rate: 1.0,
        ..MockSettings::default()
    })
    .await;
    let extra = "retry: { max_attempts: 100, backoff_base: 10ms, backoff_max: 10ms }\n\
                 timeouts: { attempt: 100ms, item: 450ms }";
    env.write(
        "run.yaml",
        &config(
            &dataset,
            &external_with("hanging", &hanging, 4, NO_HEALTH),
            extra,
        ),
    );
    let started = std::time::Instant::now();
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "the deadline did not stop the retries"
    );
    let mut store = env.store();
    let rows = by_id(&env.export(&ran.run_id()).await);
    for row in rows.values() {
        assert_eq!(row["status"], "failed");
        let attempts = row["attempts"].as_u64().unwrap();
        assert!(
            (3..=5).contains(&attempts),
            "about 450ms / 110ms attempts, got {attempts}"
        );
        assert!(row["error"].as_str().unwrap().contains("deadline"), "{row}");
    }
    assert_eq!(store.counts(&ran.run_id()).unwrap().failed, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_a_server_cuts_short_are_never_results_and_it_is_sent_fewer() {
    // As llama-cpp-python's server: one stream at a time, a running stream
    // ended with `[DONE]` and no finish_reason when another request
    // arrives, and no usage in streams.
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 24);
    let server = mock(MockSettings {
        interrupt_on_arrival: true,
        stream_usage: false,
        latency: ms(10),
        itl: ms(2),
        ..MockSettings::default()
    })
    .await;
    let endpoints = format!(
        "  - {{ name: llama, kind: external, base_url: \"{}\", model: m, concurrency: {{ initial: 8 }}, {NO_HEALTH} }}\n",
        server.base_url()
    );
    let extra = "retry: { max_attempts: 30, backoff_base: 10ms, backoff_max: 100ms }";
    let text = config(&dataset, &endpoints, extra)
        .replace("max_tokens: 64 }", "max_tokens: 64 }\n  stream: true");
    env.write("run.yaml", &text);

    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert!(server.stats().interrupted > 0, "no stream was ever cut");
    let rows = by_id(&env.export(&ran.run_id()).await);
    assert_eq!(rows.len(), 24);
    for (id, row) in &rows {
        // Whole answers only: a cut one would be a prefix of the question.
        assert_eq!(row["status"], "done", "{id}: {row}");
        assert_eq!(row["output"], row["item"]["question"], "{id}");
        // No usage in the stream: the chunks were counted, and said so.
        let words = row["item"]["question"].as_str().unwrap().split(' ').count();
        assert_eq!(row["completion_tokens"], words as u64, "{id}: {row}");
        assert_eq!(row["tokens_estimated"], true, "{id}: {row}");
    }
    // Each cut answer is on record as a failed attempt of its own.
    let summary = evalfleet_core::report::endpoints(&mut env.store(), &ran.run_id()).unwrap();
    let bad = summary[0].errors.get("bad_response").copied().unwrap_or(0);
    assert!(bad > 0, "{summary:?}");
    // Cut answers that followed another call's arrival are back pressure:
    // the controller comes down to what the server takes, one at a time.
    let state = env.evalfleet(&["status", &ran.run_id(), "--json"]).await;
    assert_eq!(state.code, Some(0), "{}", state.stderr);
    let state: serde_json::Value = serde_json::from_str(&state.stdout).unwrap();
    let limit = state["endpoint_states"]["endpoints"][0]["limit"]
        .as_u64()
        .unwrap();
    assert!(limit < 8, "the limit stayed at {limit}: {state}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_is_waited_out_with_probes_not_a_storm_of_calls() {
    // A server that answers every call (and probe) with 503 for 1.5 s,
    // then recovers. Calls sent into it are back pressure and refusals; a
    // string of them makes it suspect, a failed probe takes it out, and
    // only probes go until it answers again.
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 400);
    let server = mock(MockSettings {
        latency: ms(5),
        outage: Some(evalfleet_mock::Outage {
            after: ms(200),
            duration: ms(1500),
            status: 503,
        }),
        ..MockSettings::default()
    })
    .await;
    let endpoints = external_with(
        "flaky",
        &server,
        8,
        "health: { interval: 500ms, recover_after: 1 }",
    );
    env.write("run.yaml", &config(&dataset, &endpoints, ""));

    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let rows = by_id(&env.export(&ran.run_id()).await);
    assert_eq!(rows.len(), 400);
    assert!(rows.values().all(|r| r["status"] == "done"));
    let stats = server.stats();
    // Calls sent before the breaker opened (20 in a row, those in flight,
    // their retries while the probe was on its way), not one a few ms for
    // 1.5 s (which was hundreds).
    assert!(stats.outage_refused > 0, "the outage was never met");
    assert!(
        stats.outage_refused <= 100,
        "{} calls were sent into the outage",
        stats.outage_refused
    );
}
