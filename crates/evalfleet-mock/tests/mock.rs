//! The mock's failure modes, seen from a client over a real socket.

#![cfg(feature = "server")]
// Test helpers fail loudly; that is their job.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::time::Duration;

use evalfleet_mock::{Fault, MockServer, MockSettings, Outage, Quota, QuotaMode};
use reqwest::header::HeaderMap;
use serde_json::{Value, json};
use tokio::time::Instant;

async fn start(settings: MockSettings) -> MockServer {
    MockServer::start_local(settings).await.unwrap()
}

/// A client for plain HTTP (reqwest wants a TLS provider all the same).
fn client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Sends one chat request for `prompt`.
async fn chat(
    client: &reqwest::Client,
    server: &MockServer,
    prompt: &str,
    stream: bool,
) -> reqwest::Response {
    let mut body = json!({
        "model": "mock",
        "messages": [{"role": "user", "content": prompt}],
        "stream": stream,
    });
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    post(client, server, &body).await
}

async fn post(client: &reqwest::Client, server: &MockServer, body: &Value) -> reqwest::Response {
    client
        .post(format!("{}/chat/completions", server.base_url()))
        .header("content-type", "application/json")
        .body(serde_json::to_vec(body).unwrap())
        .send()
        .await
        .unwrap()
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).map(|v| v.to_str().unwrap())
}

/// The events of a server-sent stream, read as they come.
struct Events {
    response: reqwest::Response,
    buffer: String,
}

impl Events {
    fn new(response: reqwest::Response) -> Self {
        assert_eq!(response.status(), 200);
        Self {
            response,
            buffer: String::new(),
        }
    }

    /// The next event's data; `None` at the end of the stream.
    async fn next(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let event: String = self.buffer.drain(..end + 2).collect();
                return Some(event.trim_end().trim_start_matches("data: ").to_owned());
            }
            let chunk = self.response.chunk().await.unwrap()?;
            self.buffer.push_str(std::str::from_utf8(&chunk).unwrap());
        }
    }

    /// Every remaining event, each with when it arrived.
    async fn rest(&mut self) -> Vec<(Instant, String)> {
        let mut out = Vec::new();
        while let Some(event) = self.next().await {
            out.push((Instant::now(), event));
        }
        out
    }
}

/// What a stream's events add up to.
#[derive(Debug, Default)]
struct Streamed {
    /// Events carrying content, in order.
    contents: Vec<String>,
    finish_reasons: Vec<String>,
    usage_chunks: usize,
    ended_with_done: bool,
}

fn summarise<'a>(events: impl IntoIterator<Item = &'a String>) -> Streamed {
    let mut out = Streamed::default();
    for event in events {
        assert!(!out.ended_with_done, "an event after [DONE]");
        if event == "[DONE]" {
            out.ended_with_done = true;
            continue;
        }
        let chunk: Value = serde_json::from_str(event).unwrap();
        if chunk.get("usage").is_some_and(|u| !u.is_null()) {
            out.usage_chunks += 1;
        }
        for choice in chunk["choices"].as_array().unwrap() {
            if let Some(text) = choice["delta"]["content"]
                .as_str()
                .filter(|t| !t.is_empty())
            {
                out.contents.push(text.to_owned());
            }
            if let Some(reason) = choice["finish_reason"].as_str() {
                out.finish_reasons.push(reason.to_owned());
            }
        }
    }
    out
}

/// Reads OpenAI's `x-ratelimit-reset-*` format (`100ms`, `1s`, `1m30.5s`).
fn openai_duration(text: &str) -> Duration {
    if let Some(ms) = text.strip_suffix("ms") {
        return Duration::from_secs_f64(ms.parse::<f64>().unwrap() / 1000.0);
    }
    let mut total = 0.0;
    let mut number = String::new();
    for c in text.chars() {
        match c {
            'h' | 'm' | 's' => {
                let unit = match c {
                    'h' => 3600.0,
                    'm' => 60.0,
                    _ => 1.0,
                };
                total += number.parse::<f64>().unwrap() * unit;
                number.clear();
            }
            _ => number.push(c),
        }
    }
    assert!(number.is_empty(), "'{text}' does not end with a unit");
    Duration::from_secs_f64(total)
}

/// `(limit, remaining, reset)` from OpenAI's request quota headers.
fn quota_headers(headers: &HeaderMap) -> (u32, u32, Duration) {
    let number = |name| header(headers, name).unwrap().parse().unwrap();
    (
        number("x-ratelimit-limit-requests"),
        number("x-ratelimit-remaining-requests"),
        openai_duration(header(headers, "x-ratelimit-reset-requests").unwrap()),
    )
}

#[tokio::test]
async fn a_fault_mix_answers_each_status_in_its_share() {
    let server = start(MockSettings {
        faults: vec![
            "500:0.08".parse().unwrap(),
            "503:0.05:1s".parse().unwrap(),
            "408:0.02".parse().unwrap(),
        ],
        ..MockSettings::default()
    })
    .await;
    let client = client();
    let mut by_status: BTreeMap<u16, u64> = BTreeMap::new();
    for i in 0..2000 {
        let response = chat(&client, &server, &format!("question {i}"), false).await;
        let status = response.status().as_u16();
        let retry_after = header(response.headers(), "retry-after").map(str::to_owned);
        if status == 503 {
            assert_eq!(retry_after.as_deref(), Some("1"));
        } else {
            assert_eq!(retry_after, None, "status {status}");
        }
        *by_status.entry(status).or_insert(0) += 1;
    }
    // Four standard deviations of a binomial count either way.
    for (status, rate) in [(500, 0.08_f64), (503, 0.05), (408, 0.02), (200, 0.85)] {
        let expected = 2000.0 * rate;
        let spread = 4.0 * (2000.0 * rate * (1.0 - rate)).sqrt();
        let got = by_status.get(&status).copied().unwrap_or(0) as f64;
        assert!(
            (got - expected).abs() <= spread,
            "{status}: {got} answers, expected about {expected}: {by_status:?}"
        );
    }
    let stats = server.stats();
    let faults: BTreeMap<u16, u64> = by_status.into_iter().filter(|(s, _)| *s != 200).collect();
    assert_eq!(stats.faults, faults.values().sum::<u64>());
    assert_eq!(stats.faults_by_status, faults);
    assert_eq!(stats.completed + stats.faults, 2000);
    assert_eq!(stats.injected_errors, 0);
}

#[tokio::test]
async fn the_same_seed_gives_the_same_fates_to_the_same_prompts_in_any_order() {
    let settings = |seed| MockSettings {
        seed,
        error_rate: 0.1,
        error_status: 502,
        faults: vec!["500:0.2".parse().unwrap(), "429:0.1:2s".parse().unwrap()],
        ..MockSettings::default()
    };
    let client = client();
    // The fate of each (prompt, how many times it was seen before).
    async fn fates(
        client: &reqwest::Client,
        server: &MockServer,
        order: impl Iterator<Item = usize>,
    ) -> BTreeMap<(usize, usize), u16> {
        let mut seen = BTreeMap::new();
        let mut out = BTreeMap::new();
        for prompt in order {
            let status = chat(client, server, &format!("item {prompt}"), false)
                .await
                .status()
                .as_u16();
            let times = seen.entry(prompt).or_insert(0);
            out.insert((prompt, *times), status);
            *times += 1;
        }
        out
    }
    let forwards = (0..60).map(|i| i % 20);
    let backwards = (0..60).map(|i| 19 - i % 20);
    let first = fates(&client, &start(settings(7)).await, forwards.clone()).await;
    let again = fates(&client, &start(settings(7)).await, backwards).await;
    let other = fates(&client, &start(settings(8)).await, forwards).await;
    assert_eq!(first, again);
    assert_ne!(first, other);
    let statuses: std::collections::BTreeSet<u16> = first.values().copied().collect();
    assert!(statuses.len() >= 3, "too few fates to compare: {first:?}");
}

#[tokio::test]
async fn a_stall_holds_back_the_second_half_of_an_answer() {
    // Long beside what a busy machine adds between two events, so that the
    // stall is the longest gap, and at least half its length, however late
    // the client reads the event before it.
    let stall = ms(1000);
    let server = start(MockSettings {
        stall_rate: 1.0,
        stall,
        output_tokens: Some(10),
        ..MockSettings::default()
    })
    .await;
    let client = client();

    let sent = Instant::now();
    let mut events = Events::new(chat(&client, &server, "a b", true).await);
    let events = events.rest().await;
    assert!(sent.elapsed() >= stall);
    let streamed = summarise(events.iter().map(|(_, e)| e));
    assert_eq!(streamed.contents.len(), 10, "it finishes normally");
    assert_eq!(streamed.finish_reasons, ["stop"]);
    // The pause is before the sixth token: events are role, then tokens.
    let gaps: Vec<Duration> = events.windows(2).map(|w| w[1].0 - w[0].0).collect();
    let longest = (0..gaps.len()).max_by_key(|&i| gaps[i]).unwrap();
    assert_eq!(longest, 5, "{gaps:?}");
    assert!(gaps[longest] >= stall / 2, "{gaps:?}");

    let sent = Instant::now();
    let response = chat(&client, &server, "a b", false).await;
    assert_eq!(response.status(), 200);
    response.bytes().await.unwrap();
    assert!(sent.elapsed() >= stall);

    let stats = server.stats();
    assert_eq!((stats.stalled, stats.completed), (2, 2));
}

#[tokio::test]
async fn a_cut_stream_ends_with_done_and_no_finish_reason() {
    let server = start(MockSettings {
        cut_rate: 1.0,
        output_tokens: Some(10),
        ..MockSettings::default()
    })
    .await;
    let client = client();
    let mut events = Events::new(chat(&client, &server, "a b", true).await);
    let streamed = summarise(events.rest().await.iter().map(|(_, e)| e));
    assert!(streamed.ended_with_done);
    assert_eq!(streamed.contents.len(), 5, "half the tokens");
    assert!(streamed.finish_reasons.is_empty(), "{streamed:?}");
    assert_eq!(streamed.usage_chunks, 0);
    let stats = server.stats();
    assert_eq!((stats.cut, stats.completed, stats.truncated), (1, 0, 0));

    // An answer not streamed is whole.
    let response = chat(&client, &server, "a b", false).await;
    let body: Value = serde_json::from_slice(&response.bytes().await.unwrap()).unwrap();
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(server.stats().completed, 1);
}

#[tokio::test]
async fn a_new_request_interrupts_the_running_stream() {
    // 1000 tokens 50 ms apart: uninterrupted, the stream would run for 50 s,
    // far longer than any busy machine takes to send the second request.
    let server = start(MockSettings {
        interrupt_on_arrival: true,
        itl: ms(50),
        output_tokens: Some(1000),
        ..MockSettings::default()
    })
    .await;
    let client = client();
    let mut running = Events::new(chat(&client, &server, "a b", true).await);
    let mut before = Vec::new();
    while summarise(&before).contents.len() < 2 {
        before.push(running.next().await.unwrap());
    }
    let short = json!({"messages": [{"role": "user", "content": "next"}], "max_tokens": 1});
    let second = post(&client, &server, &short).await;
    assert_eq!(second.status(), 200);
    second.bytes().await.unwrap();
    let after = tokio::time::timeout(Duration::from_secs(120), running.rest())
        .await
        .expect("the running stream ends");
    let streamed = summarise(before.iter().chain(after.iter().map(|(_, e)| e)));
    assert!(streamed.ended_with_done);
    assert!(streamed.finish_reasons.is_empty(), "{streamed:?}");
    assert!(streamed.contents.len() < 1000, "it was not cut short");
    let stats = server.stats();
    assert_eq!((stats.interrupted, stats.completed), (1, 1));
}

#[tokio::test]
async fn a_model_listing_interrupts_the_running_stream_a_health_check_does_not() {
    // As llama-cpp-python's server, whose model list waits for the model;
    // `/health` stands for a path that takes no lock.
    let server = start(MockSettings {
        interrupt_on_arrival: true,
        itl: ms(50),
        output_tokens: Some(1000),
        ..MockSettings::default()
    })
    .await;
    let client = client();
    let mut running = Events::new(chat(&client, &server, "a b", true).await);
    let mut seen = Vec::new();
    while summarise(&seen).contents.len() < 2 {
        seen.push(running.next().await.unwrap());
    }
    let origin = server.base_url().trim_end_matches("/v1").to_owned();
    let health = client.get(format!("{origin}/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    // Tokens keep coming after the health check.
    let before = summarise(&seen).contents.len();
    while summarise(&seen).contents.len() < before + 2 {
        seen.push(running.next().await.unwrap());
    }
    assert_eq!(server.stats().interrupted, 0);
    let models = client
        .get(format!("{}/models", server.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), 200);
    let after = tokio::time::timeout(Duration::from_secs(120), running.rest())
        .await
        .expect("the running stream ends");
    let streamed = summarise(seen.iter().chain(after.iter().map(|(_, e)| e)));
    assert!(streamed.ended_with_done && streamed.finish_reasons.is_empty());
    let stats = server.stats();
    assert_eq!(
        (stats.interrupted, stats.health_checks, stats.model_listings),
        (1, 1, 1)
    );
}

#[tokio::test]
async fn without_stream_usage_no_usage_chunk_is_sent_even_when_asked() {
    let client = client();
    for (stream_usage, chunks) in [(true, 1), (false, 0)] {
        let server = start(MockSettings {
            stream_usage,
            ..MockSettings::default()
        })
        .await;
        let mut events = Events::new(chat(&client, &server, "a b c", true).await);
        let streamed = summarise(events.rest().await.iter().map(|(_, e)| e));
        assert_eq!(
            streamed.usage_chunks, chunks,
            "stream_usage: {stream_usage}"
        );
        assert_eq!(streamed.finish_reasons, ["stop"]);
        assert!(streamed.ended_with_done);
    }
}

#[tokio::test]
async fn a_refilling_quota_counts_down_in_openai_headers_and_refuses_when_empty() {
    // 5 a minute: a request comes back every 12 s, so none does while the
    // test runs, however slow the machine (the refill itself is tested on
    // explicit instants beside the server's code).
    let server = start(MockSettings {
        quota: Some(Quota {
            limit: 5,
            window: Duration::from_secs(60),
            mode: QuotaMode::Refill,
        }),
        ..MockSettings::default()
    })
    .await;
    let client = client();
    let asked = Instant::now();
    let first = chat(&client, &server, "a", false).await;
    assert_eq!(first.status(), 200);
    assert_eq!(
        header(first.headers(), "x-ratelimit-reset-requests"),
        Some("12s")
    );
    assert_eq!(quota_headers(first.headers()).0, 5);
    let mut remaining = vec![quota_headers(first.headers()).1];
    let refused = loop {
        let response = chat(&client, &server, "a", false).await;
        if response.status() == 429 {
            break response;
        }
        remaining.push(quota_headers(response.headers()).1);
        assert!(remaining.len() <= 6, "never refused: {remaining:?}");
    };
    // What refilled since the first request is no more than this much time
    // gives back, however slow the machine was.
    let took = asked.elapsed();
    assert_eq!(remaining, [4, 3, 2, 1, 0]);

    let headers = refused.headers();
    let (limit, left, reset) = quota_headers(headers);
    assert_eq!((limit, left), (5, 0));
    // Empty: whole again after five requests' time, less what refilled since.
    assert!(
        reset <= ms(60_000) && reset + took >= ms(60_000),
        "{reset:?} after {took:?}"
    );
    assert_eq!(header(headers, "retry-after"), Some("12"));
    let wait: u64 = header(headers, "retry-after-ms").unwrap().parse().unwrap();
    assert!(
        wait <= 12_000 && u128::from(wait) + took.as_millis() + 1 >= 12_000,
        "one request's time at most, less what refilled in {took:?}: {wait}"
    );
    assert_eq!(server.stats().rate_limited, 1);
}

#[tokio::test]
async fn a_fixed_quota_is_whole_again_when_its_window_ends() {
    let server = start(MockSettings {
        // Windows long enough that the first three requests share one on
        // a slow machine.
        quota: Some("3/2s:fixed".parse().unwrap()),
        ..MockSettings::default()
    })
    .await;
    let client = client();
    let mut seen = Vec::new();
    for _ in 0..4 {
        let response = chat(&client, &server, "a", false).await;
        let (_, remaining, reset) = quota_headers(response.headers());
        seen.push((response.status().as_u16(), remaining));
        assert!(reset <= ms(2000), "{reset:?}");
        if response.status() == 429 {
            let wait: u64 = header(response.headers(), "retry-after-ms")
                .unwrap()
                .parse()
                .unwrap();
            assert!(wait <= 2000 && wait.abs_diff(reset.as_millis() as u64) <= 1);
            // Into the next window (the wait is the window's end).
            tokio::time::sleep(reset + ms(50)).await;
        }
    }
    assert_eq!(seen, [(200, 2), (200, 1), (200, 0), (429, 0)]);
    let next = chat(&client, &server, "a", false).await;
    assert_eq!(next.status(), 200);
    assert_eq!(quota_headers(next.headers()).1, 2, "back to the limit");
}

#[tokio::test]
async fn an_outage_refuses_chat_models_and_health_for_its_length() {
    let server = start(MockSettings {
        // Wide margins: each check lands well inside its phase on a slow
        // machine (before 500 ms, 500-1500 ms, after 1500 ms).
        outage: Some(Outage {
            after: ms(500),
            duration: ms(1000),
            status: 503,
        }),
        ..MockSettings::default()
    })
    .await;
    let client = client();
    let get = |path: &str| client.get(format!("http://{}{path}", server.addr())).send();
    let statuses = || async {
        [
            chat(&client, &server, "a", false).await.status().as_u16(),
            get("/v1/models").await.unwrap().status().as_u16(),
            get("/health").await.unwrap().status().as_u16(),
        ]
    };

    // The outage counts from the first chat request: none before it.
    assert_eq!(get("/health").await.unwrap().status(), 200);
    let start = Instant::now();
    assert_eq!(statuses().await, [200, 200, 200]);
    tokio::time::sleep_until(start + ms(900)).await;
    let during = chat(&client, &server, "a", false).await;
    assert_eq!(during.status(), 503);
    assert_eq!(header(during.headers(), "retry-after"), None);
    assert_eq!(statuses().await, [503, 503, 503]);
    tokio::time::sleep_until(start + ms(1900)).await;
    assert_eq!(statuses().await, [200, 200, 200]);

    let stats = server.stats();
    assert_eq!((stats.outage_refused, stats.completed), (2, 2));
}

#[tokio::test]
async fn faults_are_counted_apart_from_errors_and_unset_settings_change_nothing() {
    let server = start(MockSettings::default()).await;
    let client = client();
    let response = chat(&client, &server, "a b", false).await;
    assert_eq!(response.status(), 200);
    assert!(
        header(response.headers(), "x-ratelimit-limit-requests").is_none(),
        "no quota, no quota headers"
    );
    let stats = server.stats();
    assert_eq!(stats.faults, 0);
    assert!(stats.faults_by_status.is_empty());
    let snapshot: Value = serde_json::to_value(&stats).unwrap();
    for field in [
        "faults",
        "faults_by_status",
        "stalled",
        "cut",
        "interrupted",
        "outage_refused",
    ] {
        assert!(snapshot.get(field).is_some(), "{field} in {snapshot}");
    }
    let unused = Fault {
        status: 500,
        rate: 0.0,
        retry_after: None,
    };
    let server = start(MockSettings {
        faults: vec![unused],
        ..MockSettings::default()
    })
    .await;
    for i in 0..20 {
        let status = chat(&client, &server, &format!("{i}"), false)
            .await
            .status();
        assert_eq!(status, 200);
    }
    // `error_rate`'s errors are injected errors, not faults, and the
    // other way round.
    let errors = start(MockSettings {
        error_rate: 1.0,
        ..MockSettings::default()
    })
    .await;
    let faults = start(MockSettings {
        faults: vec![Fault {
            status: 502,
            rate: 1.0,
            retry_after: None,
        }],
        ..MockSettings::default()
    })
    .await;
    for i in 0..5 {
        let prompt = format!("{i}");
        assert_eq!(chat(&client, &errors, &prompt, false).await.status(), 500);
        assert_eq!(chat(&client, &faults, &prompt, false).await.status(), 502);
    }
    let (e, f) = (errors.stats(), faults.stats());
    assert_eq!((e.injected_errors, e.faults), (5, 0));
    assert_eq!((f.injected_errors, f.faults), (0, 5));
    assert_eq!(f.faults_by_status.get(&502), Some(&5));
}

/// The value of the sample of `name` (with or without labels) in a
/// Prometheus answer.
fn gauge(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(['{', ' ']))
        })
        .and_then(|line| line.rsplit(' ').next()?.parse().ok())
}

async fn get_text(client: &reqwest::Client, server: &MockServer, path: &str) -> (u16, String) {
    let response = client
        .get(format!("http://{}{path}", server.addr()))
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

#[tokio::test]
async fn a_mock_with_capacity_tells_its_running_and_queued_requests_as_engines_do() {
    let client = client();
    let server = start(MockSettings {
        capacity: Some(2),
        // Long enough that the requests are still there when looked at;
        // the shutdown ends them.
        latency: Duration::from_secs(300),
        ..MockSettings::default()
    })
    .await;
    let (status, idle) = get_text(&client, &server, "/metrics").await;
    assert_eq!(status, 200);
    assert_eq!(gauge(&idle, "llamacpp:requests_processing"), Some(0));
    assert_eq!(gauge(&idle, "vllm:num_requests_waiting"), Some(0));

    let mut requests = tokio::task::JoinSet::new();
    for i in 0..5 {
        let (client, url) = (client.clone(), server.base_url());
        requests.spawn(async move {
            let body =
                json!({"model": "mock", "messages": [{"role": "user", "content": format!("{i}")}]});
            client
                .post(format!("{url}/chat/completions"))
                .header("content-type", "application/json")
                .body(serde_json::to_vec(&body).unwrap())
                .send()
                .await
        });
    }
    // Two are answered and three wait for a slot, once all five arrived.
    let deadline = Instant::now() + Duration::from_secs(10);
    let busy = loop {
        let (_, text) = get_text(&client, &server, "/metrics").await;
        if gauge(&text, "llamacpp:requests_deferred") == Some(3) {
            break text;
        }
        assert!(Instant::now() < deadline, "the queue never held 3: {text}");
        tokio::time::sleep(ms(10)).await;
    };
    for (name, value) in [
        ("llamacpp:requests_processing", 2),
        ("llamacpp:requests_deferred", 3),
        ("vllm:num_requests_running", 2),
        ("vllm:num_requests_waiting", 3),
        ("sglang:num_running_reqs", 2),
        ("sglang:num_queue_reqs", 3),
    ] {
        assert_eq!(gauge(&busy, name), Some(value), "{name} in {busy}");
    }
    let (status, slots) = get_text(&client, &server, "/slots").await;
    assert_eq!(status, 200);
    let slots: Vec<Value> = serde_json::from_str(&slots).unwrap();
    assert_eq!(slots.len(), 2);
    assert!(slots.iter().all(|s| s["is_processing"] == json!(true)));
    let (_, props) = get_text(&client, &server, "/props").await;
    let props: Value = serde_json::from_str(&props).unwrap();
    assert_eq!(props["total_slots"], json!(2));

    server.shutdown().await.unwrap();
    while let Some(ended) = requests.join_next().await {
        ended.unwrap().ok();
    }
}

#[tokio::test]
async fn a_mock_without_capacity_has_no_slots_and_runs_every_request() {
    let client = client();
    let server = start(MockSettings {
        latency: Duration::from_secs(300),
        ..MockSettings::default()
    })
    .await;
    let (status, slots) = get_text(&client, &server, "/slots").await;
    assert_eq!(status, 501, "{slots}");
    let (_, props) = get_text(&client, &server, "/props").await;
    let props: Value = serde_json::from_str(&props).unwrap();
    assert!(props.get("total_slots").is_none(), "{props}");

    let mut requests = tokio::task::JoinSet::new();
    for i in 0..3 {
        let (client, url) = (client.clone(), server.base_url());
        requests.spawn(async move {
            let body =
                json!({"model": "mock", "messages": [{"role": "user", "content": format!("{i}")}]});
            client
                .post(format!("{url}/chat/completions"))
                .header("content-type", "application/json")
                .body(serde_json::to_vec(&body).unwrap())
                .send()
                .await
        });
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, text) = get_text(&client, &server, "/metrics").await;
        if gauge(&text, "vllm:num_requests_running") == Some(3) {
            assert_eq!(gauge(&text, "vllm:num_requests_waiting"), Some(0));
            break;
        }
        assert!(Instant::now() < deadline, "never 3 running: {text}");
        tokio::time::sleep(ms(10)).await;
    }
    server.shutdown().await.unwrap();
    while let Some(ended) = requests.join_next().await {
        ended.unwrap().ok();
    }
}

/// A 2 x 2 PNG, as base64.
const PNG: &str = "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAEUlEQVR4nGPgEpHTMLJhgFAACiwBpXBsUlAAAAAASUVORK5CYII=";

#[tokio::test]
async fn images_are_decoded_answered_by_their_hash_and_a_bad_one_is_refused() {
    use base64::Engine as _;
    use sha2::Digest as _;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(PNG)
        .unwrap();
    let sha = hex::encode(sha2::Sha256::digest(&bytes));
    let dir = tempfile::tempdir().unwrap();
    let answers = dir.path().join("answers.jsonl");
    std::fs::write(
        &answers,
        format!("{{\"image\": \"{sha}\", \"replies\": [\"two by two\"]}}\n"),
    )
    .unwrap();
    let server = start(MockSettings {
        answers: Some(answers),
        ..MockSettings::default()
    })
    .await;
    let client = client();
    let with = |url: String| {
        json!({"model": "mock", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": url}},
        ]}]})
    };
    for url in [format!("data:image/png;base64,{PNG}"), PNG.to_owned()] {
        let response = post(&client, &server, &with(url)).await;
        assert_eq!(response.status(), 200);
        let body: Value = serde_json::from_slice(&response.bytes().await.unwrap()).unwrap();
        assert_eq!(body["choices"][0]["message"]["content"], "two by two");
    }
    let mut broken = bytes.clone();
    broken.truncate(bytes.len() - 20);
    let url = format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(&broken)
    );
    let response = post(&client, &server, &with(url)).await;
    assert_eq!(response.status(), 400);
    let body: Value = serde_json::from_slice(&response.bytes().await.unwrap()).unwrap();
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("messages[0].content[1]: the image cannot be decoded"),
        "{message}"
    );
    let stats = server.stats();
    assert_eq!((stats.images, stats.bad_images), (2, 1), "{stats:?}");
    assert_eq!(stats.image_bytes, 2 * bytes.len() as u64);
}

/// A response's body as JSON (reqwest is built without its `json`).
trait JsonBody {
    async fn json_body(self) -> Result<Value, serde_json::Error>;
}

impl JsonBody for reqwest::Response {
    async fn json_body(self) -> Result<Value, serde_json::Error> {
        serde_json::from_slice(&self.bytes().await.unwrap())
    }
}

/// A mock whose answers file holds `lines`.
async fn scripted(lines: &[Value]) -> (MockServer, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let answers = dir.path().join("answers.jsonl");
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(&answers, text).unwrap();
    let server = start(MockSettings {
        answers: Some(answers),
        ..MockSettings::default()
    })
    .await;
    (server, dir)
}

fn lookup_tool() -> Value {
    json!([{"type": "function", "function": {
        "name": "lookup",
        "description": "Finds a city's country.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }}])
}

/// A streamed tool call put back together: id, type, name, arguments.
fn streamed_call(events: &[(Instant, String)]) -> (String, String, String, String) {
    let (mut id, mut kind, mut name, mut arguments) =
        (String::new(), String::new(), String::new(), String::new());
    for (_, event) in events {
        if event == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(event).unwrap();
        for choice in chunk["choices"].as_array().unwrap() {
            for call in choice["delta"]["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
            {
                assert_eq!(call["index"], 0);
                if let Some(text) = call["id"].as_str() {
                    id.push_str(text);
                }
                if let Some(text) = call["type"].as_str() {
                    kind.push_str(text);
                }
                if let Some(text) = call["function"]["name"].as_str() {
                    name.push_str(text);
                }
                if let Some(text) = call["function"]["arguments"].as_str() {
                    arguments.push_str(text);
                }
            }
        }
    }
    (id, kind, name, arguments)
}

#[tokio::test]
async fn a_scripted_tool_call_is_made_then_its_result_answered_streamed_or_not() {
    let (server, _dir) = scripted(&[json!({
        "prompt": "Where is Paris?",
        "replies": [{
            "tool": "lookup",
            "arguments": {"city": "Paris", "note": "a long argument, sent in pieces"},
            "then": "Paris is in {result}.",
        }],
    })])
    .await;
    let client = client();
    let question = json!({"role": "user", "content": "Where is Paris?"});
    let ask = |stream: bool| {
        json!({"model": "mock", "messages": [question], "tools": lookup_tool(),
               "stream": stream, "stream_options": {"include_usage": true}})
    };

    // Not streamed: the call, then the answer to its result.
    let first: Value = post(&client, &server, &ask(false))
        .await
        .json_body()
        .await
        .unwrap();
    let choice = &first["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{first}");
    let message = &choice["message"];
    assert!(message["content"].is_null(), "{first}");
    let call = &message["tool_calls"][0];
    assert!(call["id"].as_str().unwrap().starts_with("call_"), "{first}");
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "lookup");
    let arguments: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments["city"], "Paris");
    assert!(first["usage"]["completion_tokens"].as_u64().unwrap() > 0);

    let answered = |stream: bool| {
        json!({"model": "mock", "tools": lookup_tool(), "stream": stream,
               "stream_options": {"include_usage": true}, "messages": [
            question,
            {"role": "assistant", "content": null, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "France"},
        ]})
    };
    let second: Value = post(&client, &server, &answered(false))
        .await
        .json_body()
        .await
        .unwrap();
    assert_eq!(second["choices"][0]["finish_reason"], "stop", "{second}");
    assert_eq!(
        second["choices"][0]["message"]["content"],
        "Paris is in France."
    );

    // Streamed: the call's id, type and name first, then its arguments in
    // pieces; usage in the last chunk.
    let events = Events::new(post(&client, &server, &ask(true)).await)
        .rest()
        .await;
    let summary = summarise(events.iter().map(|(_, e)| e));
    assert_eq!(summary.finish_reasons, ["tool_calls"]);
    assert_eq!(summary.usage_chunks, 1);
    assert!(summary.ended_with_done);
    assert!(summary.contents.is_empty(), "{:?}", summary.contents);
    let (id, kind, name, streamed_arguments) = streamed_call(&events);
    assert!(id.starts_with("call_"));
    assert_eq!((kind.as_str(), name.as_str()), ("function", "lookup"));
    let argument_chunks = events
        .iter()
        .filter(|(_, e)| e.contains("\"arguments\"") && !e.contains("\"arguments\":\"\""))
        .count();
    assert!(argument_chunks > 1, "the arguments come in pieces");
    assert_eq!(
        serde_json::from_str::<Value>(&streamed_arguments).unwrap(),
        arguments
    );
    let events = Events::new(post(&client, &server, &answered(true)).await)
        .rest()
        .await;
    let summary = summarise(events.iter().map(|(_, e)| e));
    assert_eq!(summary.contents.concat(), "Paris is in France.");
    assert_eq!(summary.finish_reasons, ["stop"]);
    assert_eq!(summary.usage_chunks, 1);

    // Without tools offered, the answer the chain ends with.
    let plain = json!({"model": "mock", "messages": [question]});
    let text: Value = post(&client, &server, &plain)
        .await
        .json_body()
        .await
        .unwrap();
    assert_eq!(text["choices"][0]["message"]["content"], "Paris is in .");
    assert_eq!(text["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn scripted_tool_calls_chain_and_a_bad_script_is_refused() {
    let (server, _dir) = scripted(&[json!({
        "prompt": "Two steps",
        "replies": [{"tool": "search", "arguments": {"q": "a"},
                     "then": {"tool": "fetch", "arguments": "{\"url\": \"u\"}",
                              "then": "found {result}"}}],
    })])
    .await;
    let client = client();
    let tools = json!([
        {"type": "function", "function": {"name": "search"}},
        {"type": "function", "function": {"name": "fetch"}},
    ]);
    let mut messages = vec![json!({"role": "user", "content": "Two steps"})];
    let mut names = Vec::new();
    let last = loop {
        let body = json!({"model": "mock", "messages": messages, "tools": tools});
        let reply: Value = post(&client, &server, &body)
            .await
            .json_body()
            .await
            .unwrap();
        let message = reply["choices"][0]["message"].clone();
        let Some(call) = message["tool_calls"].get(0).cloned() else {
            break message["content"].as_str().unwrap().to_owned();
        };
        let name = call["function"]["name"].as_str().unwrap().to_owned();
        messages.push(message);
        messages.push(json!({"role": "tool", "tool_call_id": call["id"],
                             "content": format!("{name}-result")}));
        names.push(name);
        assert!(names.len() <= 2, "{names:?}");
    };
    assert_eq!(names, ["search", "fetch"]);
    assert_eq!(last, "found fetch-result");

    // A reply that is neither text nor a tool call stops the mock's
    // requests with the file's line.
    let (server, _dir) =
        scripted(&[json!({"prompt": "x", "replies": [{"tool": "t", "args": {}}]})]).await;
    let response = chat(&client, &server, "x", false).await;
    assert_eq!(response.status(), 500);
    let text = response.text().await.unwrap();
    assert!(text.contains("unknown key 'args'"), "{text}");
}

async fn post_to(
    client: &reqwest::Client,
    server: &MockServer,
    path: &str,
    body: &Value,
) -> reqwest::Response {
    client
        .post(format!("{}/{path}", server.base_url()))
        .header("content-type", "application/json")
        .body(serde_json::to_vec(body).unwrap())
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn text_completions_answer_their_prompt_streamed_or_not() {
    let server = start(MockSettings::default()).await;
    let client = client();
    let whole: Value = post_to(
        &client,
        &server,
        "completions",
        &json!({"model": "mock", "prompt": "the quick brown fox"}),
    )
    .await
    .json_body()
    .await
    .unwrap();
    assert_eq!(whole["object"], "text_completion");
    assert_eq!(whole["choices"][0]["text"], "the quick brown fox");
    assert_eq!(whole["choices"][0]["finish_reason"], "stop");
    assert_eq!(whole["usage"]["completion_tokens"], 4);

    let response = post_to(
        &client,
        &server,
        "completions",
        &json!({"model": "mock", "prompt": ["the quick brown fox"], "max_tokens": 3,
                "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    let events = Events::new(response).rest().await;
    let mut text = String::new();
    let mut finish = Vec::new();
    let mut usage = 0;
    for (_, event) in &events {
        if event == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(event).unwrap();
        assert_eq!(chunk["object"], "text_completion", "{chunk}");
        if chunk["usage"].is_object() {
            usage += 1;
        }
        for choice in chunk["choices"].as_array().unwrap() {
            assert!(choice.get("delta").is_none());
            text.push_str(choice["text"].as_str().unwrap());
            if let Some(reason) = choice["finish_reason"].as_str() {
                finish.push(reason.to_owned());
            }
        }
    }
    assert_eq!(text, "the quick brown");
    assert_eq!(finish, ["length"]);
    assert_eq!(usage, 1);
    assert_eq!(events.last().unwrap().1, "[DONE]");

    let two = post_to(
        &client,
        &server,
        "completions",
        &json!({"model": "mock", "prompt": ["a", "b"]}),
    )
    .await;
    assert_eq!(two.status(), 400);
}

fn norm(vector: &[f32]) -> f32 {
    vector.iter().map(|x| x * x).sum::<f32>().sqrt()
}

fn floats(value: &Value) -> Vec<f32> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

#[tokio::test]
async fn embeddings_are_unit_vectors_the_same_for_the_same_input() {
    use base64::Engine as _;
    let server = start(MockSettings::default()).await;
    let client = client();
    let embed = |body: Value| {
        let client = client.clone();
        let server = &server;
        async move { post_to(&client, server, "embeddings", &body).await }
    };
    let reply: Value =
        embed(json!({"model": "mock", "input": ["a b", "c", "a b"], "dimensions": 16}))
            .await
            .json_body()
            .await
            .unwrap();
    assert_eq!(reply["object"], "list");
    assert_eq!(reply["usage"]["prompt_tokens"], 5);
    let data = reply["data"].as_array().unwrap();
    assert_eq!(data.len(), 3);
    let vectors: Vec<Vec<f32>> = data
        .iter()
        .enumerate()
        .map(|(i, d)| {
            assert_eq!(d["object"], "embedding");
            assert_eq!(d["index"], i);
            floats(&d["embedding"])
        })
        .collect();
    for vector in &vectors {
        assert_eq!(vector.len(), 16);
        assert!((norm(vector) - 1.0).abs() < 1e-4, "{vector:?}");
    }
    assert_eq!(vectors[0], vectors[2]);
    assert_ne!(vectors[0], vectors[1]);

    // The default size; base64 as the openai SDKs ask for it: the same
    // floats, little-endian.
    let single: Value = embed(json!({"input": "a b"}))
        .await
        .json_body()
        .await
        .unwrap();
    assert_eq!(single["data"][0]["embedding"].as_array().unwrap().len(), 64);
    let encoded: Value = embed(json!({"input": "a b", "encoding_format": "base64"}))
        .await
        .json_body()
        .await
        .unwrap();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(encoded["data"][0]["embedding"].as_str().unwrap())
        .unwrap();
    let decoded: Vec<f32> = bytes
        .chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(decoded, floats(&single["data"][0]["embedding"]));
    let tokens: Value = embed(json!({"input": [[1, 2, 3], [4]], "dimensions": 4}))
        .await
        .json_body()
        .await
        .unwrap();
    assert_eq!(tokens["usage"]["prompt_tokens"], 4);

    for bad in [
        json!({"input": []}),
        json!({"input": "a", "dimensions": 0}),
        json!({"input": "a", "encoding_format": "int8"}),
        json!({"input": [1, "a"]}),
    ] {
        assert_eq!(embed(bad.clone()).await.status(), 400, "{bad}");
    }

    // Injected errors reach embeddings too.
    let failing = start(MockSettings {
        error_rate: 1.0,
        ..MockSettings::default()
    })
    .await;
    let response = post_to(&client, &failing, "embeddings", &json!({"input": "a"})).await;
    assert_eq!(response.status(), 500);
}
