//! An endpoint's health parts together against scripted servers, on paused
//! time: the breaker (faults in a row, probes), the concurrency limit and
//! the retry budget, driven the way a session drives them (a free slot
//! takes the next item; a failed call is retried after its backoff once the
//! budget pays for it; a prober probes every interval, five times as often
//! while the breaker is open). W8's outage and W7's sporadic faults, in
//! miniature and deterministic.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use evalfleet_fleet::{Endpoint, Health, Phase, Sample, Signal, Transition};
use evalfleet_types::{BudgetSettings, RetryBudget, RetryPolicy};
use tokio::sync::Mutex;
use tokio::time::Instant;

/// What the scripted server does with a call at a time since the start.
#[derive(Clone, Copy)]
struct Server {
    latency: Duration,
    /// Every call and probe in this window is refused at once (503).
    outage: (Duration, Duration),
    /// Share of calls failing at once whatever the load: 500s (no signal
    /// to the controller)...
    faults: f64,
    /// ...and 503s (refusals: back pressure).
    refusals: f64,
}

impl Server {
    fn down(&self, since_start: Duration) -> bool {
        since_start >= self.outage.0 && since_start < self.outage.1
    }
}

/// What a scenario saw.
#[derive(Default)]
struct Seen {
    calls: AtomicU64,
    calls_in_outage: AtomicU64,
    probes_in_outage: AtomicU64,
    done: AtomicU64,
    opened: AtomicU64,
    suspected: AtomicU64,
    peak_limit: AtomicU64,
}

fn endpoint(concurrency: &str) -> Arc<Endpoint> {
    // The config names a dataset that exists; nothing reads it.
    let dataset = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let config = serde_json::json!({
        "name": "t",
        "dataset": {"path": dataset, "format": "jsonl"},
        "endpoints": [{
            "name": "e", "kind": "external", "base_url": "http://127.0.0.1:9/v1", "model": "m",
            "concurrency": concurrency.parse::<u64>().map_or(serde_json::json!(concurrency), serde_json::Value::from),
            "health": {"interval": "5s", "recover_after": 2},
        }],
        "task": {"messages": [{"role": "user", "content": "{{ q }}"}]},
    });
    let loaded = evalfleet_config::load_snapshot(&config, std::path::Path::new(".")).unwrap();
    let endpoint = Arc::new(Endpoint::new(
        &loaded.config.endpoints[0],
        Duration::from_secs(300),
    ));
    endpoint.set_phase(Phase::Ready);
    endpoint
}

/// Runs `items` items against `server` for at most `horizon`.
async fn scenario(server: Server, concurrency: &str, items: u64, horizon: Duration) -> Arc<Seen> {
    let start = Instant::now();
    let endpoint = endpoint(concurrency);
    let seen = Arc::new(Seen::default());
    let budget = Arc::new(RetryBudget::new(BudgetSettings::default(), start));
    let policy = RetryPolicy {
        max_attempts: 1000,
        backoff_base: Duration::from_millis(100),
        backoff_max: Duration::from_secs(30),
    };
    let draws = Arc::new(std::sync::Mutex::new(fastrand::Rng::with_seed(7)));
    // Items waiting for a slot, retries first; each with its tries.
    let queue = Arc::new(Mutex::new((0..items).map(|_| 0u32).collect::<Vec<u32>>()));
    let retries = Arc::new(Mutex::new(Vec::<u32>::new()));
    let tasks = tokio_util::task::TaskTracker::new();

    // The prober.
    {
        let (endpoint, seen) = (endpoint.clone(), seen.clone());
        tasks.spawn(async move {
            while start.elapsed() < horizon && seen.done.load(Ordering::Relaxed) < items {
                let every = if endpoint.accepting() {
                    Duration::from_secs(5)
                } else {
                    Duration::from_secs(1)
                };
                tokio::select! {
                    () = tokio::time::sleep(every) => {}
                    () = endpoint.probe_now.notified() => {}
                }
                let down = server.down(start.elapsed());
                if down {
                    seen.probes_in_outage.fetch_add(1, Ordering::Relaxed);
                }
                if endpoint.on_probe(!down) == Some(Transition::Opened) {
                    seen.opened.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
    }

    while start.elapsed() < horizon && seen.done.load(Ordering::Relaxed) < items {
        if !endpoint.accepting() {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        let permit = tokio::select! {
            permit = endpoint.limit.acquire() => permit,
            () = tokio::time::sleep(Duration::from_millis(10)) => continue,
        };
        let next = match retries.lock().await.pop() {
            Some(tries) => Some(tries),
            None => queue.lock().await.pop(),
        };
        let Some(tries) = next else {
            drop(permit);
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        if tries == 0 {
            budget.first_try(Instant::now());
        }
        seen.peak_limit
            .fetch_max(endpoint.limit.current() as u64, Ordering::Relaxed);
        let (endpoint, seen, budget, retries, draws) = (
            endpoint.clone(),
            seen.clone(),
            budget.clone(),
            retries.clone(),
            draws.clone(),
        );
        tasks.spawn(async move {
            seen.calls.fetch_add(1, Ordering::Relaxed);
            let at = start.elapsed();
            let (failed, signal) = if server.down(at) {
                seen.calls_in_outage.fetch_add(1, Ordering::Relaxed);
                (true, Signal::BackPressure)
            } else {
                let draw = draws.lock().unwrap().f64();
                if draw < server.refusals {
                    (true, Signal::BackPressure)
                } else if draw < server.refusals + server.faults {
                    (true, Signal::Neutral)
                } else {
                    let sent = Instant::now();
                    tokio::time::sleep(server.latency).await;
                    (false, Signal::Success(Sample::of(sent.elapsed())))
                }
            };
            let health = if failed { Health::Fault } else { Health::Up };
            let transition = endpoint.on_call(health, server.latency);
            if transition == Some(Transition::Suspected) {
                seen.suspected.fetch_add(1, Ordering::Relaxed);
                endpoint.probe_now.notify_one();
            }
            permit.finish(signal);
            if !failed {
                seen.done.fetch_add(1, Ordering::Relaxed);
                return;
            }
            // Backoff, then the budget, as the session's retries wait.
            let mut wait = policy.backoff(tries + 1, None);
            let mut denied = 0;
            loop {
                tokio::time::sleep(wait).await;
                if budget.try_retry(Instant::now()) {
                    break;
                }
                denied += 1;
                wait = policy.backoff(denied, None).max(Duration::from_millis(10));
            }
            retries.lock().await.push(tries + 1);
        });
    }
    tasks.close();
    tasks.wait().await;
    seen
}

#[tokio::test(start_paused = true)]
async fn an_outage_is_waited_out_with_probes_not_a_storm_of_calls() {
    // W8 in miniature: 50 ms calls at up to 32 at once (about 640 a
    // second), then 30 s of 503s for everything, calls and probes alike.
    let server = Server {
        latency: Duration::from_millis(50),
        outage: (Duration::from_secs(10), Duration::from_secs(40)),
        faults: 0.0,
        refusals: 0.0,
    };
    let seen = scenario(server, "32", 35_000, Duration::from_secs(120)).await;
    let (calls, probes) = (
        seen.calls_in_outage.load(Ordering::Relaxed),
        seen.probes_in_outage.load(Ordering::Relaxed),
    );
    // W8's allowance: twice the probes plus 10% of the rate over 30 s.
    let allowed = 2 * probes + 1_920;
    println!("outage: {calls} calls, {probes} probes (allowed {allowed})");
    assert!(calls <= allowed, "{calls} calls into the outage");
    assert!(
        calls <= 200,
        "{calls} calls into the outage: the breaker was late"
    );
    assert!(
        seen.opened.load(Ordering::Relaxed) >= 1,
        "it was never taken out"
    );
    assert_eq!(
        seen.done.load(Ordering::Relaxed),
        35_000,
        "not every item ended"
    );
}

#[tokio::test(start_paused = true)]
async fn sporadic_faults_never_take_a_single_endpoint_out() {
    // W7's mix in miniature: 15% of calls fail at once, at any load (8%
    // 500, 7% 503), with adaptive concurrency reaching hundreds in flight:
    // bursts of fast failures come back before the answers of their burst.
    let server = Server {
        latency: Duration::from_millis(50),
        outage: (Duration::MAX, Duration::MAX),
        faults: 0.08,
        refusals: 0.07,
    };
    let seen = scenario(server, "adaptive", 20_000, Duration::from_secs(120)).await;
    assert_eq!(seen.done.load(Ordering::Relaxed), 20_000);
    assert_eq!(seen.suspected.load(Ordering::Relaxed), 0, "suspected");
    assert_eq!(seen.opened.load(Ordering::Relaxed), 0, "taken out");
    let calls = seen.calls.load(Ordering::Relaxed);
    assert!(
        calls as f64 <= 20_000.0 * 1.25,
        "{calls} calls for 20,000 items"
    );
    // The refusals did not hold the limit down: 20,000 items at up to
    // 1,024 in flight of 50 ms take about 2 s; at the initial 8, 125 s.
    let limit = seen.peak_limit.load(Ordering::Relaxed);
    assert!(limit >= 256, "the limit peaked at {limit}");
}
