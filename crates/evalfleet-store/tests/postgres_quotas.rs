//! Shared quotas on PostgreSQL: workers taking from one quota at once
//! together stay within its rate and burst, a cool-down stops every worker,
//! refunds and charges move what is left; and the workers' shared rate
//! limiters, calling as fast as they may, keep together to the quota. Each
//! test has a database of its own on the machine's server, and skips when
//! none answers.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use evalfleet_config::Secret;
use evalfleet_fleet::{Endpoint, call, shared_rate};
use evalfleet_store::PgStore;
use evalfleet_store::{QuotaKind, Quotas, SharedQuota};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

fn quota(kind: QuotaKind, per_minute: u64) -> SharedQuota {
    SharedQuota {
        key: "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08".to_owned(),
        model: "gpt-test".to_owned(),
        kind,
        per_minute,
    }
}

/// `threads` workers, each with a connection of its own, take `chunk` units
/// of `quota` at a time for `span` (waiting what a refusal says, at most
/// `nap`); what they were granted together, and over how long.
fn race(
    url: &str,
    quota: &SharedQuota,
    threads: usize,
    chunk: u64,
    span: Duration,
    nap: Duration,
) -> (u64, Duration) {
    let start = Barrier::new(threads + 1);
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                let start = &start;
                scope.spawn(move || {
                    let mut store = PgStore::open(url, false).unwrap();
                    start.wait();
                    let began = Instant::now();
                    let mut granted = 0;
                    while began.elapsed() < span {
                        let got = store.take_quota(quota, chunk).unwrap();
                        assert!(got.units <= chunk);
                        granted += got.units;
                        if got.units == 0 {
                            assert!(!got.wait.is_zero(), "a refusal says how long to wait");
                            std::thread::sleep(got.wait.min(nap));
                        }
                    }
                    granted
                })
            })
            .collect();
        start.wait();
        let began = Instant::now();
        let granted = workers.into_iter().map(|w| w.join().unwrap()).sum();
        (granted, began.elapsed())
    })
}

#[test]
fn workers_taking_at_once_stay_within_the_rate_and_the_burst() {
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    // 600 a minute: 10 a second, a burst of 10. Six workers want far more.
    let requests = quota(QuotaKind::Requests, 600);
    let (granted, elapsed) = race(
        &db.url,
        &requests,
        6,
        2,
        Duration::from_secs(2),
        Duration::from_millis(20),
    );
    let most = 10.0 * elapsed.as_secs_f64() + 10.0;
    assert!(
        granted as f64 <= most,
        "{granted} granted in {elapsed:?}: more than {most}"
    );
    assert!(
        granted as f64 >= 0.8 * most - 1.0,
        "{granted} granted in {elapsed:?}: far below {most}"
    );
}

#[test]
fn a_busy_quota_is_never_overdrawn() {
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    // 10,000 tokens a second, eight workers taking 250 at a time without
    // pause: the row lock serialises them.
    let tokens = quota(QuotaKind::Tokens, 600_000);
    let (granted, elapsed) = race(
        &db.url,
        &tokens,
        8,
        250,
        Duration::from_millis(1500),
        Duration::from_millis(1),
    );
    let most = 10_000.0 * elapsed.as_secs_f64() + 10_000.0;
    assert!(
        granted as f64 <= most,
        "{granted} granted in {elapsed:?}: more than {most}"
    );
    assert!(
        granted as f64 >= 0.8 * most,
        "{granted} granted in {elapsed:?}: far below {most}"
    );
}

#[test]
fn a_cool_down_stops_every_worker_until_it_passes() {
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    let requests = quota(QuotaKind::Requests, 6000);
    let mut one = PgStore::open(&db.url, false).unwrap();
    let mut other = PgStore::open(&db.url, false).unwrap();
    assert_eq!(one.take_quota(&requests, 5).unwrap().units, 5);
    // A 429 seen by one worker: 600 ms of nothing for either.
    one.cool_quota(&requests, Duration::from_millis(600))
        .unwrap();
    // A shorter one later changes nothing.
    other
        .cool_quota(&requests, Duration::from_millis(100))
        .unwrap();
    for store in [&mut one, &mut other] {
        let got = store.take_quota(&requests, 1).unwrap();
        assert_eq!(got.units, 0);
        assert!(
            got.wait > Duration::from_millis(400) && got.wait <= Duration::from_millis(600),
            "{:?}",
            got.wait
        );
    }
    // Another kind of the same key is another quota.
    let tokens = quota(QuotaKind::Tokens, 6000);
    assert_eq!(other.take_quota(&tokens, 1).unwrap().units, 1);
    let wait = other.take_quota(&requests, 1).unwrap().wait;
    std::thread::sleep(wait + Duration::from_millis(20));
    assert_eq!(other.take_quota(&requests, 3).unwrap().units, 3);
    assert_eq!(one.take_quota(&requests, 3).unwrap().units, 3);
}

#[test]
fn refunds_give_units_back_and_charges_take_more() {
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    // 10 a second, a burst of 10, a unit every 100 ms.
    let requests = quota(QuotaKind::Requests, 600);
    let mut store = PgStore::open(&db.url, false).unwrap();
    // A new quota is full: a burst's worth at most.
    assert_eq!(store.take_quota(&requests, 25).unwrap().units, 10);
    let spent = store.take_quota(&requests, 1).unwrap();
    assert_eq!(spent.units, 0);
    assert!(spent.wait <= Duration::from_millis(100), "{:?}", spent.wait);
    // Four unused come back.
    store.refund_quota(&requests, 4).unwrap();
    let back = store.take_quota(&requests, 10).unwrap().units;
    assert!((4..=5).contains(&back), "{back}");
    // Giving back more than was taken fills it no further than full.
    store.refund_quota(&requests, 1000).unwrap();
    let full = store.take_quota(&requests, 1000).unwrap().units;
    assert!((10..=11).contains(&full), "{full}");
    // A call that used 20 more than it took: two seconds of nothing more.
    store.refund_quota(&requests, -20).unwrap();
    let owed = store.take_quota(&requests, 1).unwrap();
    assert_eq!(owed.units, 0);
    assert!(
        owed.wait > Duration::from_millis(1800) && owed.wait <= Duration::from_millis(2100),
        "{:?}",
        owed.wait
    );
}

/// A hosted endpoint with API key `key`, at `rpm` calls a minute.
fn endpoint(key: &str, rpm: u32) -> Arc<Endpoint> {
    // The config names a dataset that exists; nothing reads it.
    let dataset = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let config = serde_json::json!({
        "name": "t",
        "dataset": {"path": dataset, "format": "jsonl"},
        "endpoints": [{"name": "hosted", "kind": "external",
                       "base_url": "https://api.example.invalid/v1", "model": "gpt-test"}],
        "task": {"messages": [{"role": "user", "content": "{{ q }}"}]},
    });
    let mut config = evalfleet_config::load_snapshot(&config, std::path::Path::new("."))
        .unwrap()
        .config
        .endpoints
        .remove(0);
    config.api_key = Some(Secret::new(key));
    config.rpm = Some(rpm);
    Arc::new(Endpoint::new(&config, Duration::from_secs(10)))
}

#[test]
fn workers_sharing_a_key_keep_together_to_its_rpm() {
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    // A PostgreSQL connection blocks: opened here, used and closed on the
    // blocking pool.
    let stores: Vec<_> = (0..3)
        .map(|_| PgStore::open(&db.url, false).unwrap())
        .collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(shared_limiters_keep_to_the_quota(stores));
}

async fn shared_limiters_keep_to_the_quota(stores: Vec<PgStore>) {
    // Three workers of one key at 600 a minute (10 a second, a burst of
    // 10), each calling as fast as its limiters let it, from four tasks:
    // each alone would send 10 a second.
    let tracker = TaskTracker::new();
    let stop = CancellationToken::new();
    let workers: Vec<Arc<Endpoint>> = stores
        .into_iter()
        .map(|store| {
            let endpoint = endpoint("sk-shared", 600);
            let sharing = shared_rate::share(
                std::slice::from_ref(&endpoint),
                Box::new(store),
                &tracker,
                stop.clone(),
            );
            assert_eq!(sharing, 1);
            endpoint
        })
        .collect();
    let sent = Arc::new(AtomicU64::new(0));
    let span = Duration::from_secs(2);
    let began = Instant::now();
    let halt = CancellationToken::new();
    for endpoint in &workers {
        for _ in 0..4 {
            let (endpoint, sent, halt) = (endpoint.clone(), sent.clone(), halt.clone());
            tracker.spawn(async move {
                while call::pace(&endpoint, 1, &halt).await {
                    if began.elapsed() >= span {
                        return;
                    }
                    sent.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
    }
    tokio::time::sleep(span).await;
    let elapsed = began.elapsed();
    halt.cancel();
    stop.cancel();
    tracker.close();
    tracker.wait().await;
    let sent = sent.load(Ordering::Relaxed);
    let most = 10.0 * elapsed.as_secs_f64() + 10.0;
    assert!(
        sent as f64 <= most,
        "{sent} calls in {elapsed:?}: more than {most}"
    );
    assert!(
        sent as f64 >= 0.7 * most,
        "{sent} calls in {elapsed:?}: far below {most}"
    );
}

#[test]
fn a_store_made_before_shared_quotas_gets_them_when_opened() {
    let Some(db) = evalfleet_testkit::scratch_db!() else {
        return;
    };
    drop(PgStore::open(&db.url, false).unwrap());
    // The store as the first schema left it.
    db.connect()
        .batch_execute(
            "DROP TABLE evalfleet.quotas; ALTER TABLE evalfleet.agent_calls DROP COLUMN failovers;
             UPDATE evalfleet.schema_version SET version = 1",
        )
        .unwrap();
    let mut store = PgStore::open(&db.url, false).unwrap();
    let requests = quota(QuotaKind::Requests, 60);
    assert_eq!(store.take_quota(&requests, 5).unwrap().units, 1);
    let version: i32 = db
        .connect()
        .query_one("SELECT version FROM evalfleet.schema_version", &[])
        .unwrap()
        .get(0);
    assert_eq!(version, evalfleet_store::POSTGRES_SCHEMA_VERSION);
}
