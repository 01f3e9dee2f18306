//! The dashboard in a real headless Chromium, against a real `evalfleet
//! serve`: a run started from its page goes on live there, a filter
//! narrows the results table, an item shows its attempts, and the
//! comparison page draws two runs with their intervals. Screenshots go to
//! `target/test-artifacts/dashboard/`.

use std::time::Duration;

use serde_json::json;

use crate::serve::{client, config, serve, wait_for_state};
use crate::util::Env;
use crate::webdriver::{Browser, artifacts};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_started_from_the_dashboard_is_followed_live_then_explored() {
    let Some(browser) = Browser::start().await else {
        return;
    };
    let env = Env::new();
    let (_server, base) = serve(&env, &[], None).await;
    let shots = artifacts();

    // Start a run from the page: about 4 s of work at 4 calls at a time.
    browser.open(&format!("{base}/new")).await;
    browser
        .find("#config")
        .await
        .type_text(&config(&env, 300, "50ms", 4, ""))
        .await;
    browser.find("#run-id").await.type_text("from-page").await;
    browser.find("#start").await.click().await;
    browser
        .wait_for(
            "the run's page",
            "return location.pathname === '/runs/from-page';",
            Duration::from_secs(20),
        )
        .await;
    // It goes on live: items done climb without a reload...
    browser
        .wait_for(
            "items done while the run is running",
            "const d = document.getElementById('stat-done'); const s = document.getElementById('state');
             return !!d && !!s && s.textContent === 'running' && Number(d.textContent.replace(/\\D/g, '')) > 0;",
            Duration::from_secs(30),
        )
        .await;
    browser.screenshot(&shots, "run-live").await;
    let loaded = browser
        .eval("return performance.getEntriesByType('navigation').length;")
        .await;
    // ...and it ends on the same page load, with its timeline drawn.
    browser
        .wait_for(
            "the run finished",
            "return document.getElementById('state').textContent === 'finished'
                 && document.getElementById('stat-done').textContent.replace(/\\D/g, '') === '300';",
            Duration::from_secs(60),
        )
        .await;
    assert_eq!(
        browser
            .eval("return performance.getEntriesByType('navigation').length;")
            .await,
        loaded,
        "the page was reloaded"
    );
    browser
        .wait_for(
            "a chart",
            "return document.querySelectorAll('#chart-items canvas').length > 0;",
            Duration::from_secs(10),
        )
        .await;
    browser.screenshot(&shots, "run-finished").await;

    // The results table, then narrowed by a filter.
    browser.open(&format!("{base}/runs/from-page/items")).await;
    browser.find("#items tbody tr").await;
    assert_eq!(browser.all("#items tbody tr").await.len(), 50);
    browser
        .find("#f-q")
        .await
        .type_text("question 123 of")
        .await;
    browser.find("#apply").await.click().await;
    browser
        .wait_for(
            "one row",
            "return document.querySelectorAll('#items tbody tr').length === 1;",
            Duration::from_secs(10),
        )
        .await;
    assert!(browser.url().await.contains("q=question+123+of"));
    let row = browser.find("#items tbody tr").await;
    assert!(row.text().await.contains("item-00123"));
    browser.screenshot(&shots, "results-filtered").await;

    // The item's page shows its attempts.
    browser.find("#items tbody tr a").await.click().await;
    browser.find("#attempts tbody tr").await;
    let attempt = browser.find("#attempts tbody tr").await.text().await;
    assert!(
        attempt.contains("m") && attempt.contains("200"),
        "{attempt}"
    );
    let conversation = browser.find("#conversation").await.text().await;
    assert!(
        conversation.contains("question 123 of 300"),
        "{conversation}"
    );
    browser.screenshot(&shots, "item").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_comparison_page_shows_two_runs_with_their_intervals() {
    let Some(browser) = Browser::start().await else {
        return;
    };
    let env = Env::new();
    let (_server, base) = serve(&env, &[], None).await;
    // Two runs of the same items: one answers every item right, the other
    // fails a share of them (a mock that errors, with no retry).
    for (run_id, extra) in [("right", ""), ("flaky", "")] {
        let mut text = config(&env, 60, "1ms", 8, extra);
        if run_id == "flaky" {
            text = text.replace(
                "mock: { latency: 1ms }",
                "mock: { latency: 1ms, error_rate: 0.3, seed: 4 }",
            ) + "retry: { max_attempts: 1 }\n";
        }
        let response = client()
            .post(format!("{base}/api/v1/runs"))
            .json(&json!({"config": text, "run_id": run_id}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201, "{}", response.text().await.unwrap());
        wait_for_state(&base, run_id, "finished").await;
    }
    browser
        .open(&format!("{base}/compare?runs=right,flaky"))
        .await;
    browser.find("[data-metric] svg").await;
    // Both runs' means with their intervals, and the difference.
    let intervals = browser
        .eval("return document.querySelectorAll('[data-metric] svg rect').length;")
        .await;
    assert!(intervals.as_u64().unwrap() >= 3, "{intervals}");
    let table = browser
        .find("[data-metric] table.comparisons")
        .await
        .text()
        .await;
    assert!(table.contains("flaky"), "{table}");
    let disagree = browser
        .find("[data-disagreements] table")
        .await
        .text()
        .await;
    assert!(disagree.contains("item-"), "{disagree}");
    browser.screenshot(&artifacts(), "compare").await;
}
