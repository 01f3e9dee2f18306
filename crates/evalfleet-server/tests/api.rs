//! The JSON API: what each route answers, what it refuses and how, who may
//! ask, and the OpenAPI document that describes it all.

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use serde_json::Value;
use tower::ServiceExt;

use crate::fixture::Fixture;

/// A request to the service, its status and its body as JSON.
async fn call(app: &axum::Router, request: Request<Body>) -> (StatusCode, Value) {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 24)
        .await
        .unwrap();
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
    };
    (status, body)
}

fn get(uri: &str) -> Request<Body> {
    Request::get(uri).body(Body::empty()).unwrap()
}

/// A run answered right on the even items, and one right on every item.
fn two_runs() -> (Fixture, axum::Router) {
    let fixture = Fixture::new();
    fixture.run("a", |i| i % 2 == 0);
    fixture.run("b", |_| true);
    let app = evalfleet_server::app(fixture.state(None));
    (fixture, app)
}

#[tokio::test]
async fn runs_are_listed_and_each_is_shown_with_its_state_and_counts() {
    let (_fixture, app) = two_runs();
    let (status, runs) = call(&app, get("/api/v1/runs")).await;
    assert_eq!(status, StatusCode::OK, "{runs}");
    let ids: Vec<&str> = runs
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["run_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), 2);
    assert!(ids.contains(&"a") && ids.contains(&"b"));
    // Left running by a process that is gone: stopped.
    assert_eq!(runs[0]["state"], "stopped");
    assert_eq!(
        runs[0]["counts"],
        serde_json::json!({"pending": 1, "done": 6, "failed": 1})
    );

    let (status, run) = call(&app, get("/api/v1/runs/a")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(run["total"], 8);
    assert!(
        run["dataset"]["path"]
            .as_str()
            .unwrap()
            .ends_with("items.jsonl")
    );
    // The stored config never shows a secret.
    let config = run["config"].to_string();
    assert!(!config.contains("sk-very-secret"), "{config}");

    let (status, body) = call(&app, get("/api/v1/runs/nope")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body["error"]["message"], "no run 'nope' in this store");
    let (status, body) = call(&app, get("/api/v1/runs?state=sleeping")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("state:")
    );
}

#[tokio::test]
async fn items_are_paged_filtered_and_shown_whole() {
    let (_fixture, app) = two_runs();
    // Two pages of five and three, joined by the cursor.
    let (status, first) = call(&app, get("/api/v1/runs/a/items?limit=5")).await;
    assert_eq!(status, StatusCode::OK, "{first}");
    assert_eq!(first["rows"].as_array().unwrap().len(), 5);
    let next = first["next"].as_str().unwrap().to_owned();
    let (_, second) = call(
        &app,
        get(&format!("/api/v1/runs/a/items?limit=5&after={next}")),
    )
    .await;
    assert_eq!(second["rows"].as_array().unwrap().len(), 3);
    assert!(second["next"].is_null());
    // Filters: a dataset field, a score range, a state, an error class.
    let (_, rows) = call(
        &app,
        get("/api/v1/runs/a/items?field=region:europe&score=exact_match@1:1:"),
    )
    .await;
    let ids: Vec<&str> = rows["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["item_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["fr", "it"]);
    let (_, rows) = call(&app, get("/api/v1/runs/a/items?error_class=retryable")).await;
    assert_eq!(rows["rows"][0]["item_id"], "pe");
    assert_eq!(rows["rows"][0]["state"], "failed");
    let (_, rows) = call(&app, get("/api/v1/runs/a/items?state=pending")).await;
    assert_eq!(rows["rows"][0]["item_id"], "no");
    // Sorted by latency, slowest first.
    let (_, rows) = call(
        &app,
        get("/api/v1/runs/a/items?sort=latency&order=desc&limit=2"),
    )
    .await;
    assert_eq!(rows["rows"][0]["item_id"], "pe");
    assert_eq!(rows["rows"][1]["item_id"], "ke");
    // A wrong parameter is named.
    for (query, param) in [
        ("state=asleep", "state"),
        ("field=region", "field"),
        ("score=em:x:1", "score"),
        ("sort=colour", "sort"),
        ("after=garbage", "after"),
        ("limit=0", "limit"),
        ("error_class=oops", "error_class"),
        ("colour=red", "colour"),
    ] {
        let (status, body) = call(&app, get(&format!("/api/v1/runs/a/items?{query}"))).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{query}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.starts_with(&format!("{param}:")),
            "{query}: {message}"
        );
    }
    // One item whole: its attempts and the messages its template made.
    let (status, item) = call(&app, get("/api/v1/runs/a/items/pe")).await;
    assert_eq!(status, StatusCode::OK, "{item}");
    assert_eq!(item["attempt_records"][0]["http_status"], 500);
    assert_eq!(item["messages"][0]["content"], "Capital of Peru?");
    let (status, item) = call(&app, get("/api/v1/runs/a/items/fr")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(item["scores"]["exact_match@1"]["value"], 1.0);
    let (status, _) = call(&app, get("/api/v1/runs/a/items/xx")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn reports_and_comparisons_come_from_the_core_with_their_intervals() {
    let (_fixture, app) = two_runs();
    let (status, report) = call(&app, get("/api/v1/runs/a/report?by=region")).await;
    assert_eq!(status, StatusCode::OK, "{report}");
    let overall = report["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["group"] == "all")
        .unwrap();
    // 3 of the 6 answered right; the failed item counts as wrong.
    assert_eq!(overall["n"], 7);
    let (status, body) = call(&app, get("/api/v1/compare?runs=a,b&by=region")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let all = body["comparisons"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["group"] == "all")
        .unwrap();
    assert!(
        all["estimate_b"]["mean"].as_f64().unwrap() > all["estimate_a"]["mean"].as_f64().unwrap(),
        "{all}"
    );
    assert!(all["paired"]["ci_low"].as_f64().is_some());
    let disagree = &body["disagreements"][0];
    assert_eq!(disagree["total"], 3, "{disagree}");
    let ids: Vec<&str> = disagree["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["item_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["de", "es", "ke"]);
    assert_eq!(disagree["items"][0]["output_a"], "London");
    assert_eq!(disagree["items"][0]["output_b"], "Berlin");
    let (status, _) = call(&app, get("/api/v1/compare?runs=a")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = call(&app, get("/api/v1/compare?runs=a,zz")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn with_a_key_every_request_must_carry_it() {
    let fixture = Fixture::new();
    fixture.run("a", |_| true);
    let app = evalfleet_server::app(fixture.state(Some("k-123")));
    let (status, body) = call(&app, get("/api/v1/runs")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("API key")
    );
    let wrong = Request::get("/api/v1/runs")
        .header("x-api-key", "k-12")
        .body(Body::empty())
        .unwrap();
    assert_eq!(call(&app, wrong).await.0, StatusCode::UNAUTHORIZED);
    let header = Request::get("/api/v1/runs")
        .header("x-api-key", "k-123")
        .body(Body::empty())
        .unwrap();
    assert_eq!(call(&app, header).await.0, StatusCode::OK);
    let bearer = Request::get("/api/v1/runs")
        .header(header::AUTHORIZATION, "Bearer k-123")
        .body(Body::empty())
        .unwrap();
    assert_eq!(call(&app, bearer).await.0, StatusCode::OK);
    // The OpenAPI document too.
    assert_eq!(
        call(&app, get("/api/openapi.json")).await.0,
        StatusCode::UNAUTHORIZED
    );
}

#[tokio::test]
async fn changes_from_another_sites_page_and_oversized_bodies_are_refused() {
    let (_fixture, app) = two_runs();
    let cross = Request::post("/api/v1/runs/a/fleet")
        .header(header::HOST, "127.0.0.1:8080")
        .header(header::ORIGIN, "https://elsewhere.example")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(r#"{"action": "remove", "endpoint": "e"}"#))
        .unwrap();
    assert_eq!(call(&app, cross).await.0, StatusCode::FORBIDDEN);
    let same = Request::post("/api/v1/runs/a/fleet")
        .header(header::HOST, "127.0.0.1:8080")
        .header(header::ORIGIN, "http://127.0.0.1:8080")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(r#"{"action": "remove", "endpoint": "e"}"#))
        .unwrap();
    let (status, change) = call(&app, same).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{change}");
    assert_eq!(change["action"], "remove");
    let unknown = Request::post("/api/v1/runs/a/fleet")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(r#"{"action": "remove", "endpoint": "nope"}"#))
        .unwrap();
    assert_eq!(call(&app, unknown).await.0, StatusCode::NOT_FOUND);
    // A form post (no JSON): refused before anything is done.
    let form = Request::post("/api/v1/runs")
        .header(header::CONTENT_TYPE, "text/plain")
        .body(Body::from("config=x"))
        .unwrap();
    assert_eq!(call(&app, form).await.0, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let huge = Request::post("/api/v1/runs")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(format!(
            "{{\"config\": \"{}\"}}",
            "x".repeat(1 << 17)
        )))
        .unwrap();
    assert_eq!(call(&app, huge).await.0, StatusCode::PAYLOAD_TOO_LARGE);
    // This server runs nothing: starting a run is not done here.
    let start = Request::post("/api/v1/runs")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(r#"{"config": "name: x"}"#))
        .unwrap();
    let (status, body) = call(&app, start).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("read-only")
    );
    // Refusals of the request's form are the API's JSON errors too.
    let garbage = Request::post("/api/v1/runs/a/fleet")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from("{not json"))
        .unwrap();
    let (status, body) = call(&app, garbage).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"]["status"], 400);
}

/// Every `$ref` in `value`.
fn refs<'a>(value: &'a Value, out: &mut Vec<&'a str>) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                if key == "$ref" {
                    out.extend(v.as_str());
                }
                refs(v, out);
            }
        }
        Value::Array(list) => list.iter().for_each(|v| refs(v, out)),
        _ => {}
    }
}

#[tokio::test]
async fn the_openapi_document_describes_every_route_and_resolves_every_reference() {
    let (_fixture, app) = two_runs();
    let (status, doc) = call(&app, get("/api/openapi.json")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(doc["openapi"], "3.1.0");
    assert_eq!(doc["info"]["license"]["name"], "Apache-2.0");
    let paths = doc["paths"].as_object().unwrap();
    for path in [
        "/runs",
        "/runs/{run_id}",
        "/runs/{run_id}/items",
        "/runs/{run_id}/items/{item_id}",
        "/runs/{run_id}/report",
        "/runs/{run_id}/events",
        "/runs/{run_id}/resume",
        "/runs/{run_id}/cancel",
        "/runs/{run_id}/fleet",
        "/compare",
        "/server",
        "/runs/{run_id}/timeline",
        "/runs/{run_id}/resources",
        "/runs/{run_id}/stream",
        "/benches",
        "/benches/{name}",
    ] {
        assert!(paths.contains_key(path), "{path} is not documented");
    }
    // The key's two places are declared, and asked for (or nothing, on a
    // server without a key).
    let schemes = &doc["components"]["securitySchemes"];
    assert_eq!(schemes["api_key"]["type"], "apiKey", "{schemes}");
    assert_eq!(schemes["api_key"]["name"], "X-API-Key");
    assert_eq!(schemes["bearer"]["scheme"], "bearer");
    assert_eq!(doc["security"].as_array().map(Vec::len), Some(3));
    for operation in paths.values().flat_map(|p| p.as_object().unwrap().values()) {
        assert!(
            operation["responses"].get("421").is_some(),
            "a foreign Host may reach any route: {operation}"
        );
    }
    let schemas = doc["components"]["schemas"].as_object().unwrap();
    let mut found = Vec::new();
    refs(&doc, &mut found);
    assert!(!found.is_empty());
    for r in found {
        let name = r
            .strip_prefix("#/components/schemas/")
            .unwrap_or_else(|| panic!("{r}"));
        assert!(schemas.contains_key(name), "{r} does not resolve");
    }
}

#[tokio::test]
async fn the_server_answers_over_a_real_socket_and_stops_when_told() {
    let (fixture, _app) = two_runs();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let server = tokio::spawn(evalfleet_server::serve(
        listener,
        fixture.state(None),
        shutdown.clone(),
    ));
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::new();
    let runs: Value = client
        .get(format!("http://{addr}/api/v1/runs"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(runs.as_array().unwrap().len(), 2);
    shutdown.cancel();
    server.await.unwrap().unwrap();
    assert!(fixture.path("store.db").exists());
}

#[tokio::test]
async fn a_runs_timeline_and_stream_begin_with_everything_and_end_when_it_stops() {
    let (_fixture, app) = two_runs();
    let (status, points) = call(&app, get("/api/v1/runs/a/timeline")).await;
    assert_eq!(status, StatusCode::OK, "{points}");
    let points = points.as_array().unwrap();
    assert_eq!(points.len(), 3);
    assert_eq!(points[1]["items_per_s"], 2.0);
    assert_eq!(points[2]["endpoints"][0]["latency_ms"]["p99"], 107.0);
    let (_, spans) = call(&app, get("/api/v1/runs/a/timeline?points=2")).await;
    assert_eq!(spans.as_array().unwrap().len(), 2);
    let (_, late) = call(&app, get("/api/v1/runs/a/timeline?after=1002500")).await;
    assert_eq!(late.as_array().unwrap().len(), 1);
    let (status, _) = call(&app, get("/api/v1/runs/a/timeline?points=0")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    // The run is not running: a snapshot, one update, and the end.
    let response = app
        .clone()
        .oneshot(get("/api/v1/runs/a/stream"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.headers()[header::CONTENT_TYPE],
        "text/event-stream"
    );
    let body = axum::body::to_bytes(response.into_body(), 1 << 24)
        .await
        .unwrap();
    let text = String::from_utf8(body.to_vec()).unwrap();
    let kinds: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(kinds, vec!["snapshot", "update"], "{text}");
    let snapshot: Value =
        serde_json::from_str(text.lines().find_map(|l| l.strip_prefix("data: ")).unwrap()).unwrap();
    assert_eq!(snapshot["run"]["run_id"], "a");
    assert_eq!(snapshot["timeline"].as_array().unwrap().len(), 3);
    assert!(text.contains("id: 1003000"), "{text}");
    let (status, _) = call(&app, get("/api/v1/runs/zz/stream")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn an_items_agent_calls_come_with_it_in_order_and_the_report_counts_them() {
    use evalfleet_store::{Batch, Claimed};
    use evalfleet_types::{AgentCall, Telemetry};

    let fixture = Fixture::new();
    fixture.run("a", |_| true);
    // The item left pending ("no") is answered by an agent that called the
    // gateway twice: a tool call, then the answer after the tool's result.
    let mut store = fixture.store();
    let lease = std::time::Duration::from_secs(60);
    let mut worker = evalfleet_store::worker::this_process(lease);
    store.begin_session("a", &mut worker, false).unwrap();
    let Claimed::Items(claim) = store.claim("a", &worker.worker, None, 10, lease).unwrap() else {
        panic!("item 'no' is pending");
    };
    let seq = claim.items[0].seq;
    let agent_call = |index: u32, request: Value, response: Value| AgentCall {
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
            latency_ms: 40.0,
            prompt_tokens: Some(30),
            completion_tokens: Some(10),
            ..Telemetry::default()
        },
        http_status: 200,
        request: request.to_string(),
        response: Some(response.to_string()),
        ..AgentCall::default()
    };
    let ask = serde_json::json!({"role": "user", "content": "<script>alert(1)</script>"});
    let tool_call = serde_json::json!({"role": "assistant", "content": null,
        "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]});
    let batch = Batch {
        calls: vec![
            (
                claim.id,
                agent_call(
                    2,
                    serde_json::json!({"messages": [ask, tool_call,
                    {"role": "tool", "tool_call_id": "t1", "content": "Oslo"}]}),
                    serde_json::json!({"role": "assistant", "content": "Oslo"}),
                ),
            ),
            (
                claim.id,
                agent_call(1, serde_json::json!({"messages": [ask]}), tool_call.clone()),
            ),
        ],
        ..Batch::default()
    };
    store.commit("a", &worker.worker, &batch).unwrap();
    drop(store);

    let app = evalfleet_server::app(fixture.state(None));
    let (status, item) = call(&app, get("/api/v1/runs/a/items/no")).await;
    assert_eq!(status, StatusCode::OK, "{item}");
    let calls = item["calls"].as_array().unwrap();
    let ids: Vec<&str> = calls
        .iter()
        .map(|c| c["call_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec![format!("{seq}.1.1"), format!("{seq}.1.2")]);
    assert_eq!(calls[0]["endpoint"], "e");
    assert_eq!(calls[0]["latency_ms"], 40.0);
    let sent: Value = serde_json::from_str(calls[1]["request"].as_str().unwrap()).unwrap();
    assert_eq!(sent["messages"][2]["role"], "tool");
    // An item without calls has no such field.
    let (_, other) = call(&app, get("/api/v1/runs/a/items/fr")).await;
    assert!(other.get("calls").is_none(), "{other}");

    let (status, report) = call(&app, get("/api/v1/runs/a/report")).await;
    assert_eq!(status, StatusCode::OK, "{report}");
    assert_eq!(report["agents"]["calls"], 2, "{report}");
    assert_eq!(report["agents"]["items"], 1);
    assert_eq!(report["agents"]["tokens_per_item"]["mean"], 80.0);
    assert_eq!(report["agents"]["call_ms_per_item"]["mean"], 80.0);
}
