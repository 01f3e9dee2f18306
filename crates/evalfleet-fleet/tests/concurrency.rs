//! The adaptive concurrency limit against simulated backends, on paused time.
//! Each file in `tests/data/concurrency/` gives a backend and the ranges the
//! limit, throughput and latency must settle in over the run's second half.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use evalfleet_fleet::{AimdSettings, ConcurrencyLimit, LimitMode, Sample, Signal};
use serde::Deserialize;
use tokio::sync::{Mutex, Semaphore};
use tokio::time::Instant;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Scenario {
    name: String,
    #[serde(with = "duration")]
    duration: Duration,
    limiter: Limiter,
    backend: Backend,
    expect: Expect,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Limiter {
    initial: usize,
    min: usize,
    max: usize,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Backend {
    #[serde(with = "duration")]
    latency: Duration,
    capacity: Option<usize>,
    capacity_after_half: Option<usize>,
    rpm: Option<u32>,
    burst: Option<u32>,
    /// Share of calls refused (503, 408) whatever the load, after the
    /// latency.
    #[serde(default)]
    refusals: f64,
    /// Share of calls that fail (500) whatever the load: no signal.
    #[serde(default)]
    faults: f64,
    /// A batching engine: a call is slower by this share of `latency` for
    /// each other call in service when it begins (so latency grows with
    /// load while throughput grows too, up to `capacity`).
    #[serde(default)]
    slowdown: f64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Expect {
    /// When the limit's range starts to count (default: half the run).
    #[serde(default, with = "optional_duration")]
    after: Option<Duration>,
    limit: [usize; 2],
    throughput: Option<[f64; 2]>,
    latency_p50: Option<[f64; 2]>,
}

mod optional_duration {
    use serde::{Deserialize, Deserializer};
    use std::time::Duration;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let text = String::deserialize(d)?;
        humantime::parse_duration(&text)
            .map(Some)
            .map_err(serde::de::Error::custom)
    }
}

mod duration {
    use serde::{Deserialize, Deserializer};
    use std::time::Duration;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        humantime::parse_duration(&text).map_err(serde::de::Error::custom)
    }
}

/// A token bucket for the simulated quota.
struct Bucket {
    tokens: f64,
    per_second: f64,
    capacity: f64,
    last: Instant,
}

/// The simulated endpoint: a latency, maybe a capacity with a queue, maybe a
/// request quota answered with 429.
struct Sim {
    latency: Duration,
    slots: Option<Arc<Semaphore>>,
    /// The capacity from half time on (calls then in service keep theirs).
    slots_after_half: Option<(Instant, Arc<Semaphore>)>,
    quota: Option<Mutex<Bucket>>,
    slowdown: f64,
    /// Calls in service now.
    serving: AtomicU64,
    refusals: f64,
    faults: f64,
    /// Seeded: a scenario runs the same every time.
    draws: std::sync::Mutex<fastrand::Rng>,
}

impl Sim {
    async fn call(&self) -> (Signal, Duration) {
        let start = Instant::now();
        if let Some(quota) = &self.quota {
            let mut bucket = quota.lock().await;
            let now = Instant::now();
            let refill = now.duration_since(bucket.last).as_secs_f64() * bucket.per_second;
            bucket.tokens = (bucket.tokens + refill).min(bucket.capacity);
            bucket.last = now;
            if bucket.tokens < 1.0 {
                drop(bucket);
                tokio::time::sleep(Duration::from_millis(2)).await;
                return (Signal::BackPressure, start.elapsed());
            }
            bucket.tokens -= 1.0;
        }
        let slots = match &self.slots_after_half {
            Some((half, later)) if start >= *half => Some(later),
            _ => self.slots.as_ref(),
        };
        let _slot = match slots {
            Some(slots) => slots.clone().acquire_owned().await.ok(),
            None => None,
        };
        let beside = self.serving.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(self.latency.mul_f64(1.0 + self.slowdown * beside as f64)).await;
        self.serving.fetch_sub(1, Ordering::Relaxed);
        let rtt = start.elapsed();
        let draw = self.draws.lock().unwrap().f64();
        if draw < self.refusals {
            (Signal::BackPressure, rtt)
        } else if draw < self.refusals + self.faults {
            (Signal::Neutral, rtt)
        } else {
            (Signal::Success(Sample::of(rtt)), rtt)
        }
    }
}

struct Outcome {
    limits: Vec<usize>,
    completed: u64,
    latencies: Vec<Duration>,
}

async fn simulate(scenario: &Scenario) -> Outcome {
    let backend = &scenario.backend;
    let start = Instant::now();
    let half = start + scenario.duration / 2;
    let end = start + scenario.duration;
    let sim = Arc::new(Sim {
        latency: backend.latency,
        slots: backend.capacity.map(|k| Arc::new(Semaphore::new(k))),
        slots_after_half: backend
            .capacity_after_half
            .map(|k| (half, Arc::new(Semaphore::new(k)))),
        quota: backend.rpm.map(|rpm| {
            let burst = f64::from(backend.burst.unwrap_or(1));
            Mutex::new(Bucket {
                tokens: burst,
                per_second: f64::from(rpm) / 60.0,
                capacity: burst,
                last: Instant::now(),
            })
        }),
        slowdown: backend.slowdown,
        serving: AtomicU64::new(0),
        refusals: backend.refusals,
        faults: backend.faults,
        draws: std::sync::Mutex::new(fastrand::Rng::with_seed(7)),
    });
    let limit = ConcurrencyLimit::new(LimitMode::Adaptive(AimdSettings {
        initial: scenario.limiter.initial,
        min: scenario.limiter.min,
        max: scenario.limiter.max,
        ..AimdSettings::default()
    }));
    let completed = Arc::new(AtomicU64::new(0));
    let latencies = Arc::new(std::sync::Mutex::new(Vec::new()));

    let counted = start + scenario.expect.after.unwrap_or(scenario.duration / 2);
    let sampler = {
        let limit = limit.clone();
        tokio::spawn(async move {
            let mut limits = Vec::new();
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            while Instant::now() < end {
                tick.tick().await;
                if Instant::now() >= counted {
                    limits.push(limit.current());
                }
            }
            limits
        })
    };

    while Instant::now() < end {
        let permit = tokio::select! {
            permit = limit.acquire() => permit,
            () = tokio::time::sleep_until(end) => break,
        };
        let sim = sim.clone();
        let completed = completed.clone();
        let latencies = latencies.clone();
        tokio::spawn(async move {
            let (signal, rtt) = sim.call().await;
            let now = Instant::now();
            if now >= half && now < end && matches!(signal, Signal::Success(_)) {
                completed.fetch_add(1, Ordering::Relaxed);
                latencies.lock().unwrap().push(rtt);
            }
            permit.finish(signal);
        });
    }
    let limits = sampler.await.unwrap();
    let mut latencies = latencies.lock().unwrap().clone();
    latencies.sort();
    Outcome {
        limits,
        completed: completed.load(Ordering::Relaxed),
        latencies,
    }
}

fn scenarios() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/concurrency");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no scenarios in {}", dir.display());
    files
}

#[tokio::test(start_paused = true)]
async fn the_limit_settles_where_each_scenario_says() {
    let mut failures = Vec::new();
    for file in scenarios() {
        let text = std::fs::read_to_string(&file).unwrap();
        let document = evalfleet_config::parse_yaml(&text).unwrap();
        let scenario: Scenario = serde_json::from_value(document.value).unwrap();
        let outcome = simulate(&scenario).await;
        let (lo, hi) = (
            *outcome.limits.iter().min().unwrap(),
            *outcome.limits.iter().max().unwrap(),
        );
        let [want_lo, want_hi] = scenario.expect.limit;
        let mut report = format!(
            "{} ({}): limit {lo}..{hi} (want {want_lo}..{want_hi})",
            scenario.name,
            file.file_name().unwrap().to_string_lossy()
        );
        let mut ok = lo >= want_lo && hi <= want_hi;
        let backend = &scenario.backend;
        let measured = scenario.duration.as_secs_f64() / 2.0;
        let slots = backend
            .capacity_after_half
            .or(backend.capacity)
            .unwrap_or(scenario.limiter.max);
        if let Some([min, max]) = scenario.expect.throughput {
            // A batching engine serves its slots, each slower by the
            // others beside it.
            let ideal = slots as f64
                / (backend.latency.as_secs_f64() * (1.0 + backend.slowdown * (slots as f64 - 1.0)));
            let share = outcome.completed as f64 / measured / ideal;
            report.push_str(&format!(
                ", throughput {share:.3} of ideal (want {min}..{max})"
            ));
            ok &= (min..=max).contains(&share);
        }
        if let Some([min, max]) = scenario.expect.latency_p50 {
            let p50 = outcome.latencies[outcome.latencies.len() / 2];
            let ratio = p50.as_secs_f64() / backend.latency.as_secs_f64();
            report.push_str(&format!(
                ", p50 latency {ratio:.2} x unloaded (want {min}..{max})"
            ));
            ok &= (min..=max).contains(&ratio);
        }
        println!("{report}");
        if !ok {
            failures.push(report);
        }
    }
    assert!(
        failures.is_empty(),
        "scenarios outside their ranges:\n{}",
        failures.join("\n")
    );
}
