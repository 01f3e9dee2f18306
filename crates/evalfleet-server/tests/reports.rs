//! Reports and comparisons: a stopped run's are computed once, kept in the
//! store and served from it until its results change; comparisons say how
//! much of the runs they paired; a run's interval is the same wherever it
//! is shown.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use evalfleet_reports as report;
use evalfleet_store::KeptReport;
use evalfleet_types::{Assessment, Score};
use serde_json::Value;
use tower::ServiceExt;

use crate::fixture::Fixture;

/// A GET's status, its body as JSON and text, and whether it was kept.
async fn get(app: &axum::Router, uri: &str) -> (StatusCode, Value, String, bool) {
    let response = app
        .clone()
        .oneshot(Request::get(uri).body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let kept = response
        .headers()
        .get("x-evalfleet-kept")
        .is_some_and(|v| v == "true");
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 24)
        .await
        .unwrap();
    let text = String::from_utf8(bytes.to_vec()).unwrap();
    (status, serde_json::from_str(&text).unwrap(), text, kept)
}

#[tokio::test]
async fn a_read_only_server_keeps_its_reports_in_memory_and_writes_nothing() {
    let fixture = Fixture::new();
    fixture.run("a", |i| i % 2 == 0);
    fixture.run("b", |_| true);
    fixture.finish("a");
    fixture.finish("b");
    let app = evalfleet_server::app(fixture.state_with(None, true));
    for uri in ["/api/v1/runs/a/report", "/api/v1/compare?runs=a,b"] {
        let (status, first, text, kept) = get(&app, uri).await;
        assert_eq!(status, StatusCode::OK, "{first}");
        assert!(!kept, "{uri}: the first is computed");
        let (_, _, again, kept) = get(&app, uri).await;
        assert!(kept, "{uri}: the second is kept, in memory");
        assert_eq!(again, text);
    }
    let report_key = report::kept::report_key(&[]);
    let compare_key = report::kept::compare_key(&["a".to_owned(), "b".to_owned()], &[], None, 100);
    let mut store = fixture.store();
    assert_eq!(store.kept_report("a", &report_key).unwrap(), None);
    assert!(
        store.kept_report("a", &compare_key).unwrap().is_none(),
        "nothing is written to the store"
    );
    // What a writing server kept in the store is served by a read-only one;
    // and it is kept under the keys looked for above.
    let writer = evalfleet_server::app(fixture.state(None));
    get(&writer, "/api/v1/runs/b/report").await;
    let (_, _, _, kept) = get(&app, "/api/v1/runs/b/report").await;
    assert!(kept);
    get(&writer, "/api/v1/runs/a/report").await;
    get(&writer, "/api/v1/compare?runs=a,b").await;
    assert!(store.kept_report("a", &report_key).unwrap().is_some());
    assert!(store.kept_report("a", &compare_key).unwrap().is_some());
}

fn overall(report: &Value) -> &Value {
    report["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["group"] == "all")
        .unwrap()
}

#[tokio::test]
async fn a_finished_runs_report_is_kept_in_the_store_and_served_from_it() {
    let fixture = Fixture::new();
    fixture.run("a", |i| i % 2 == 0);
    fixture.finish("a");
    let app = evalfleet_server::app(fixture.state(None));
    let (status, first, text, kept) = get(&app, "/api/v1/runs/a/report").await;
    assert_eq!(status, StatusCode::OK, "{first}");
    assert!(!kept, "the first report is computed");
    let row = fixture
        .store()
        .kept_report("a", evalfleet_reports::kept::report_key(&[]).as_str())
        .unwrap()
        .expect("the report is kept in the store");
    assert_eq!(row.body, text);
    let (_, _, again, kept) = get(&app, "/api/v1/runs/a/report").await;
    assert!(kept, "the second is the kept one");
    assert_eq!(again, text);
    // What is served is the kept row itself, not the results read again.
    fixture
        .store()
        .keep_report(
            "a",
            evalfleet_reports::kept::report_key(&[]).as_str(),
            &KeptReport {
                fingerprint: row.fingerprint.clone(),
                body: "{\"kept\": \"this very row\"}".to_owned(),
            },
        )
        .unwrap();
    let (_, served, _, kept) = get(&app, "/api/v1/runs/a/report").await;
    assert!(kept);
    assert_eq!(served["kept"], "this very row");
    // Another grouping is another report.
    let (_, by_region, _, kept) = get(&app, "/api/v1/runs/a/report?by=region").await;
    assert!(!kept);
    assert_eq!(by_region["group_by"][0], "region");
}

#[tokio::test]
async fn a_rescore_or_a_new_session_makes_the_kept_report_stale() {
    let fixture = Fixture::new();
    fixture.run("a", |i| i % 2 == 0);
    fixture.finish("a");
    let app = evalfleet_server::app(fixture.state(None));
    let (_, before, _, _) = get(&app, "/api/v1/runs/a/report").await;
    let (_, _, _, kept) = get(&app, "/api/v1/runs/a/report").await;
    assert!(kept);
    // 3 of the 6 answered right (the one that failed with the server's
    // 500 says nothing of the model: in no mean).
    assert!((overall(&before)["mean"].as_f64().unwrap() - 3.0 / 6.0).abs() < 1e-12);
    assert_eq!(
        (
            overall(&before)["failed"].as_u64(),
            overall(&before)["lost"].as_u64()
        ),
        (Some(1), Some(1))
    );
    // A rescore that finds every answer right.
    let mut store = fixture.store();
    let mut assessments = Vec::new();
    store
        .scan_results("a", &mut |r| {
            let mut a = Assessment::default();
            a.scores
                .insert("exact_match@1".to_owned(), Score::value(1.0));
            assessments.push((r.seq, a));
        })
        .unwrap();
    let config = store.run("a").unwrap().config;
    store.put_assessments("a", &assessments, &config).unwrap();
    let (_, after, _, kept) = get(&app, "/api/v1/runs/a/report").await;
    assert!(!kept, "a rescore changes the run's results");
    // Six right of six: the failed item has no answer to rescore, and is
    // in no mean.
    assert!(
        (overall(&after)["mean"].as_f64().unwrap() - 1.0).abs() < 1e-12,
        "{after}"
    );
    let (_, _, _, kept) = get(&app, "/api/v1/runs/a/report").await;
    assert!(kept, "and the new report is kept in turn");
    // A resume: the run is running again, its report is computed each time
    // and never kept while it runs.
    let mut worker = evalfleet_store::worker::this_process(std::time::Duration::from_secs(60));
    store.begin_session("a", &mut worker, false).unwrap();
    for _ in 0..2 {
        let (status, _, _, kept) = get(&app, "/api/v1/runs/a/report").await;
        assert_eq!(status, StatusCode::OK);
        assert!(!kept, "a running run's report is computed each time");
    }
}

#[tokio::test]
async fn comparing_runs_of_different_datasets_says_how_many_items_were_paired() {
    let fixture = Fixture::new();
    fixture.run("a", |i| i % 2 == 0);
    // Five of the eight countries: four answered, the fifth pending.
    fixture.run_on("few", "few.jsonl", 5, |_| true);
    fixture.run("b", |_| true);
    let app = evalfleet_server::app(fixture.state(None));
    let (status, body, _, _) = get(&app, "/api/v1/compare?runs=a,few").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let coverage = &body["coverage"][0];
    assert_eq!(
        (
            coverage["a"].as_str(),
            coverage["b"].as_str(),
            coverage["items_a"].as_u64(),
            coverage["items_b"].as_u64(),
            coverage["paired"].as_u64(),
            coverage["same_dataset"].as_bool()
        ),
        (
            Some("a"),
            Some("few"),
            Some(7),
            Some(4),
            Some(4),
            Some(false)
        ),
        "{coverage}"
    );
    let all = body["comparisons"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["group"] == "all")
        .unwrap();
    // The paired items both runs could judge: few's fourth failed with the
    // server's 500.
    assert_eq!(all["n"], 3, "the paired items only: {all}");
    // The same items in another order: paired by id all the same.
    let lines: Vec<String> = std::fs::read_to_string(fixture.path("items.jsonl"))
        .unwrap()
        .lines()
        .rev()
        .map(|line| format!("{line}\n"))
        .collect();
    std::fs::write(fixture.path("reversed.jsonl"), lines.concat()).unwrap();
    fixture.run_on("reversed", "reversed.jsonl", 8, |_| true);
    let (status, body, _, _) = get(&app, "/api/v1/compare?runs=a,reversed").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let coverage = &body["coverage"][0];
    // Each run left its last item pending: 'no' in a, 'fr' in reversed.
    assert_eq!(
        (
            coverage["items_a"].as_u64(),
            coverage["items_b"].as_u64(),
            coverage["paired"].as_u64(),
        ),
        (Some(7), Some(7), Some(6)),
        "{coverage}"
    );
    let all = body["comparisons"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["group"] == "all")
        .unwrap();
    // Less the two that failed with the server's 500, one in each run.
    assert_eq!(all["n"], 4, "{all}");
    // The same dataset: every item paired.
    let (_, body, _, _) = get(&app, "/api/v1/compare?runs=a,b").await;
    let coverage = &body["coverage"][0];
    assert_eq!(
        (
            coverage["items_a"].as_u64(),
            coverage["items_b"].as_u64(),
            coverage["paired"].as_u64(),
            coverage["same_dataset"].as_bool()
        ),
        (Some(7), Some(7), Some(7), Some(true)),
    );
}

#[tokio::test]
async fn a_runs_interval_is_the_same_in_its_report_and_in_a_comparison() {
    let fixture = Fixture::new();
    fixture.run("a", |i| i % 2 == 0);
    fixture.run("b", |i| i % 3 != 0);
    fixture.finish("a");
    fixture.finish("b");
    let app = evalfleet_server::app(fixture.state(None));
    let (status, body, _, kept) = get(&app, "/api/v1/compare?runs=a,b&by=region").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(!kept);
    let comparisons = body["comparisons"].as_array().unwrap();
    assert_eq!(comparisons.len(), 3, "all, europe, elsewhere: {body}");
    for (run, side) in [("a", "estimate_a"), ("b", "estimate_b")] {
        let (_, report, _, _) = get(&app, &format!("/api/v1/runs/{run}/report?by=region")).await;
        for c in comparisons {
            let summary = report["metrics"]
                .as_array()
                .unwrap()
                .iter()
                .find(|s| s["metric"] == c["metric"] && s["group"] == c["group"])
                .unwrap();
            for figure in ["mean", "stderr", "ci_low", "ci_high"] {
                assert_eq!(
                    c[side][figure], summary[figure],
                    "{run} {} {figure}: {c} against {summary}",
                    c["group"]
                );
            }
        }
    }
    let (_, again, _, kept) = get(&app, "/api/v1/compare?runs=a,b&by=region").await;
    assert!(kept, "a comparison of finished runs is kept too");
    assert_eq!(again, body);
}
