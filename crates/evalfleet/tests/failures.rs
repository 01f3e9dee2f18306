//! Endpoints that misbehave: 5xx bursts, 429 with Retry-After, hangs past
//! the attempt timeout, truncated streams, and errors that never stop.

use evalfleet_mock::MockSettings;
use evalfleet_store::prelude::*;
use evalfleet_types::EventKind;
use serde_json::Value;

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
    // Only the hanging endpoint has a short attempt timeout: elsewhere a
    // timeout (a slow call on a busy machine) would be back pressure or a
    // lost 5xx that no mock sent, and the counts below would not add up.
    let endpoints = external_with("bursts", &bursts, 4, NO_HEALTH)
        + &external_with("quota", &quota, 4, NO_HEALTH)
        + &external_with("hangs", &hangs, 4, &format!("timeout: 300ms, {NO_HEALTH}"))
        + &external_with("cut", &cut, 4, NO_HEALTH);
    let extra = "retry: { max_attempts: 20, backoff_base: 10ms, backoff_max: 100ms }\n\
                 timeouts: { attempt: 60s }";
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
    let summary = evalfleet_reports::endpoints(&mut env.store(), &ran.run_id()).unwrap();
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
    // The outcome first, then its one cause, counted once with an example.
    assert!(
        ran.stderr
            .contains("finished, failed: 0 of 30 items answered (30 failed)"),
        "{}",
        ran.stderr
    );
    assert!(
        ran.stderr
            .contains("30 × failed: HTTP 500: injected error (e.g. item item-"),
        "{}",
        ran.stderr
    );
}

/// A run of `n` items over an endpoint that answers every call `status`:
/// its dataset, the endpoint, and what the run said.
async fn run_refused(
    env: &Env,
    n: usize,
    status: u16,
) -> (
    std::path::PathBuf,
    evalfleet_mock::MockServer,
    crate::util::Ran,
) {
    let dataset = env.dataset("items.jsonl", n);
    let refusing = mock(MockSettings {
        error_rate: 1.0,
        error_status: status,
        ..MockSettings::default()
    })
    .await;
    env.write(
        "run.yaml",
        &config(&dataset, &external("refusing", &refusing, 4), ""),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    (dataset, refusing, ran)
}

/// A refusal is not retried. A run of no more items than the give-up
/// watches (5), all refused alike, ends failed, not given up: it has
/// nothing left to spare.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_status_fails_the_item_without_a_retry() {
    let env = Env::new();
    let (_, refusing, ran) = run_refused(&env, 5, 400).await;
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    let rows = by_id(&env.export(&ran.run_id()).await);
    assert!(
        rows.values()
            .all(|r| r["status"] == "failed" && r["attempts"] == 1)
    );
    assert_eq!(rows["item-00004"]["error"], "HTTP 400: injected error");
    assert_eq!(refusing.stats().requests, 5);
    assert!(
        ran.stderr
            .contains("finished, failed: 0 of 5 items answered")
            && ran.stderr.contains("5 × failed: HTTP 400: injected error")
            && !ran.stderr.contains("all failed the same way"),
        "{}",
        ran.stderr
    );
}

/// Refusals come back faster than answers: a run where some items are
/// refused (a prompt past the model's context) and the others answered
/// slowly is not given up, however the first to end were refusals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_refusals_among_slow_answers_do_not_give_a_run_up() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 40);
    let mixed = mock(MockSettings {
        error_rate: 0.3,
        error_status: 400,
        latency: ms(100),
        seed: 4,
        ..MockSettings::default()
    })
    .await;
    env.write(
        "run.yaml",
        &config(&dataset, &external("mixed", &mixed, 8), ""),
    );
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(1), "finished incomplete: {}", ran.stderr);
    assert!(
        ran.stderr.contains("finished, incomplete: "),
        "{}",
        ran.stderr
    );
    assert_eq!(env.counts(&ran.run_id()).pending, 0);
}

/// A run whose first calls are all refused alike (a wrong key, a mistyped
/// model) stops within its first items, naming the answer, instead of
/// failing every item; fixed, `resume --retry-failed` answers every item.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_first_calls_are_all_refused_alike_stops_naming_it_and_resumes() {
    let env = Env::new();
    let (dataset, refusing, ran) = run_refused(&env, 200, 404).await;
    assert_eq!(ran.code, Some(130), "stopped, resumable: {}", ran.stderr);
    assert!(
        ran.stderr.contains(
            "The first 5 items all failed the same way, and none was answered: HTTP 404: injected error"
        ),
        "{}",
        ran.stderr
    );
    // Calls in flight when it gave up may finish; no more are sent.
    let sent = refusing.stats().requests;
    assert!((5..=12).contains(&sent), "{sent} calls");
    let status = env.evalfleet(&["status", &ran.run_id(), "--json"]).await;
    let status: Value = serde_json::from_str(&status.stdout).unwrap();
    assert_eq!(status["status"], "interrupted");
    assert!(
        status["message"]
            .as_str()
            .unwrap()
            .contains("HTTP 404: injected error"),
        "{status}"
    );
    assert_eq!(status["outcome"]["outcome"], "failed");
    assert_eq!(status["outcome"]["causes"][0]["cause"], "failed");
    assert!(status["outcome"]["pending"].as_u64().unwrap() >= 188);

    // The endpoint fixed, the failed items and the pending ones are answered.
    let fixed = mock(MockSettings::default()).await;
    env.write(
        "run.yaml",
        &config(&dataset, &external("refusing", &fixed, 4), ""),
    );
    let resumed = env
        .evalfleet(&[
            "resume",
            &ran.run_id(),
            "--retry-failed",
            "--config",
            "run.yaml",
            "-q",
        ])
        .await;
    assert_eq!(resumed.code, Some(0), "{}", resumed.stderr);
    assert!(
        resumed
            .stderr
            .contains("finished, complete: 200 of 200 items scored"),
        "{}",
        resumed.stderr
    );
    assert_eq!(fixed.stats().completed, 200);
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
    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    let mut store = env.store();
    let rows = by_id(&env.export(&ran.run_id()).await);
    for row in rows.values() {
        assert_eq!(row["status"], "failed");
        // Each attempt lasts its 100 ms at least, so no more than 5 begin
        // in 450 ms (of the 100 allowed); a busy machine may begin fewer.
        let attempts = row["attempts"].as_u64().unwrap();
        assert!(
            (1..=5).contains(&attempts),
            "at most 450ms / 100ms attempts, got {attempts}"
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
    let summary = evalfleet_reports::endpoints(&mut env.store(), &ran.run_id()).unwrap();
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

/// Names of the endpoints with an event of `kind` in `run_id`.
fn with_event(env: &Env, run_id: &str, kind: EventKind) -> Vec<String> {
    env.store()
        .events(run_id)
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == kind)
        .filter_map(|e| e.endpoint)
        .collect()
}

fn faults(status: u16, rate: f64) -> Vec<evalfleet_mock::Fault> {
    vec![evalfleet_mock::Fault {
        status,
        rate,
        retry_after: None,
    }]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_failing_far_more_than_its_peer_is_ejected_one_failing_like_it_is_not() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 3000);
    // Both fail now and then; one fails most of its calls.
    let bad = mock(MockSettings {
        latency: ms(10),
        faults: faults(500, 0.6),
        seed: 1,
        ..MockSettings::default()
    })
    .await;
    let good = mock(MockSettings {
        latency: ms(10),
        faults: faults(500, 0.05),
        seed: 2,
        ..MockSettings::default()
    })
    .await;
    let endpoints = external("bad", &bad, 8) + &external("good", &good, 8);
    let extra = "retry: { max_attempts: 20, backoff_base: 10ms, backoff_max: 100ms }";
    env.write("run.yaml", &config(&dataset, &endpoints, extra));

    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let run_id = ran.run_id();
    let rows = by_id(&env.export(&run_id).await);
    assert!(rows.values().all(|r| r["status"] == "done"));
    assert_eq!(
        with_event(&env, &run_id, EventKind::Ejected),
        vec!["bad".to_owned()],
        "only the endpoint failing far more than its peer is ejected"
    );
    // Once out, it is sent nothing (for the 30 s it is out) while the
    // other takes the items.
    let ejected_at = env
        .store()
        .events(&run_id)
        .unwrap()
        .into_iter()
        .find(|e| e.kind == EventKind::Ejected)
        .unwrap()
        .at_ms;
    let conn = rusqlite::Connection::open(env.store_path()).unwrap();
    let sent_after = |name: &str| -> i64 {
        conn.query_row(
            "SELECT COUNT(*) FROM attempts WHERE endpoint = ?1 AND sent_at > ?2",
            rusqlite::params![name, ejected_at + 50],
            |row| row.get(0),
        )
        .unwrap()
    };
    assert_eq!(sent_after("bad"), 0);
    assert!(sent_after("good") > 0, "the run ended before the ejection");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_endpoint_with_sporadic_faults_is_never_taken_out_nor_are_its_calls_cut() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 1500);
    // 15% of calls fail, whatever the load: a fact of this server, and
    // there is no other to send them to.
    let server = mock(MockSettings {
        latency: ms(5),
        faults: vec![
            evalfleet_mock::Fault {
                status: 500,
                rate: 0.08,
                retry_after: None,
            },
            evalfleet_mock::Fault {
                status: 503,
                rate: 0.05,
                retry_after: Some(ms(100)),
            },
            evalfleet_mock::Fault {
                status: 408,
                rate: 0.02,
                retry_after: None,
            },
        ],
        seed: 5,
        ..MockSettings::default()
    })
    .await;
    let endpoints = external("only", &server, 16);
    let extra = "retry: { backoff_base: 10ms, backoff_max: 100ms }";
    env.write("run.yaml", &config(&dataset, &endpoints, extra));

    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let run_id = ran.run_id();
    let rows = by_id(&env.export(&run_id).await);
    assert_eq!(rows.len(), 1500);
    assert!(rows.values().all(|r| r["status"] == "done"));
    assert!(server.stats().faults > 100, "the faults were never met");
    for kind in [EventKind::Ejected, EventKind::Unhealthy] {
        assert!(
            with_event(&env, &run_id, kind).is_empty(),
            "{kind:?} for sporadic faults"
        );
    }
    let conn = rusqlite::Connection::open(env.store_path()).unwrap();
    let cut: i64 = conn
        .query_row(
            "SELECT COUNT(*) FROM attempts WHERE error LIKE 'moved%' OR error LIKE 'cancelled%'",
            [],
            |row| row.get(0),
        )
        .unwrap();
    assert_eq!(cut, 0, "calls were cut off");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_late_on_an_ejected_endpoint_are_hedged_and_the_first_answer_wins() {
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 1500);
    // `bad` fails most calls and leaves some unanswered; once it is
    // ejected, the calls it sits on are made again on `good`, whose
    // answers win, instead of waiting out the attempt timeout.
    let bad = mock(MockSettings {
        latency: ms(5),
        faults: faults(500, 0.6),
        hang_rate: 0.1,
        seed: 3,
        ..MockSettings::default()
    })
    .await;
    let good = mock(MockSettings {
        latency: ms(5),
        ..MockSettings::default()
    })
    .await;
    let endpoints = external("bad", &bad, 16) + &external("good", &good, 8);
    let extra = "retry: { max_attempts: 20, backoff_base: 10ms, backoff_max: 100ms }\n\
                 timeouts: { attempt: 120s }";
    env.write("run.yaml", &config(&dataset, &endpoints, extra));

    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let run_id = ran.run_id();
    let rows = by_id(&env.export(&run_id).await);
    assert!(rows.values().all(|r| r["status"] == "done"));
    assert!(bad.stats().hung > 0, "no call ever hung");
    assert_eq!(
        with_event(&env, &run_id, EventKind::Ejected),
        vec!["bad".to_owned()]
    );
    let conn = rusqlite::Connection::open(env.store_path()).unwrap();
    let lost: Vec<(String, String)> = conn
        .prepare("SELECT endpoint, error FROM attempts WHERE error LIKE 'cancelled%'")
        .unwrap()
        .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert!(!lost.is_empty(), "no call was hedged");
    for (endpoint, error) in &lost {
        assert_eq!(endpoint, "bad", "{error}");
        assert_eq!(error, "cancelled: a hedged call on good answered first");
    }
    // No call was waited for until the attempt timeout.
    let timed_out: i64 = conn
        .query_row(
            "SELECT COUNT(*) FROM attempts WHERE latency_ms >= 100000",
            [],
            |row| row.get(0),
        )
        .unwrap();
    assert_eq!(timed_out, 0, "hung calls were waited out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_closes_after_its_finish_reason_without_done_is_retried() {
    // The finish_reason chunk comes, then the connection closes cleanly: no
    // usage chunk, no `[DONE]`. Such a stream never ended, so it is no
    // answer, however whole its text looks.
    let env = Env::new();
    let dataset = env.dataset("items.jsonl", 40);
    let server = mock(MockSettings {
        unended_rate: 0.3,
        seed: 5,
        ..MockSettings::default()
    })
    .await;
    let extra = "retry: { max_attempts: 20, backoff_base: 10ms, backoff_max: 50ms }";
    let text = config(&dataset, &external_with("e", &server, 4, NO_HEALTH), extra)
        .replace("max_tokens: 64 }", "max_tokens: 64 }\n  stream: true");
    env.write("run.yaml", &text);

    let ran = env.evalfleet(&["run", "run.yaml", "-q"]).await;
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let unended = server.stats().unended;
    assert!(unended > 0, "no stream was ever left unended");
    let rows = by_id(&env.export(&ran.run_id()).await);
    assert_eq!(rows.len(), 40);
    for (id, row) in &rows {
        assert_eq!(row["status"], "done", "{id}: {row}");
        assert_eq!(row["output"], row["item"]["question"], "{id}");
        // Stored answers came with their usage chunk: none was taken from
        // a stream that stopped before it.
        assert_ne!(row["tokens_estimated"], true, "{id}: {row}");
        assert!(row["completion_tokens"].as_u64().is_some(), "{id}: {row}");
    }
    // Unended streams are on record as failed attempts (each one the mock
    // left unended, unless the client gave it up as stalled before its
    // close on a busy machine).
    let summary = evalfleet_reports::endpoints(&mut env.store(), &ran.run_id()).unwrap();
    let bad = summary[0].errors.get("bad_response").copied().unwrap_or(0);
    assert!(bad > 0 && bad <= unended, "{bad} of {unended}: {summary:?}");
}
