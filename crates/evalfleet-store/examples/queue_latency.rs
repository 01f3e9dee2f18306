//! Claim-and-commit latency of the store's work queue under load (issue
//! 25's P1): a benchmark, not product code.
//!
//! For each store (PostgreSQL at `--postgres URL`, SQLite in a fresh file
//! under `--sqlite-dir DIR`), each thread count T and each claim size K, it
//! registers a run of `--items N` items through [`Runs::create_run`], then
//! starts T threads, each with its own connection, that loop claim(K) →
//! commit(an attempt and a result for each claimed item) until nothing is
//! left, as a worker's reader and writer do with no model call between
//! them. Each claim that got items and each commit is timed; a claim that
//! found everything held by the other threads is counted, not timed (the
//! thread waits 1 ms and asks again).
//!
//! ```sh
//! cargo run --release -p evalfleet-store --example queue_latency -- \
//!     --postgres postgres://root@127.0.0.1:5432/qlat --sqlite-dir /tmp/qlat \
//!     [--items 10000] [--threads 1,2,4] [--limits 16,64]
//! ```
//!
//! The PostgreSQL database must exist (each configuration is a run of its
//! own in it). One JSON object per configuration is printed on stdout:
//! latencies in microseconds (p50, p99, max) of claims and commits, and
//! the items a second of the whole loop.

use std::error::Error;
use std::path::PathBuf;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use evalfleet_store::{Batch, Claimed, CreateRunError, ItemSource, NewItem, NewRun, RunIdentity};
use evalfleet_store::{Location, OpenOptions};
use evalfleet_types::{AttemptRecord, ItemStatus, ResultRecord, Telemetry, now_ms};
use hdrhistogram::Histogram;

type Fallible<T> = Result<T, Box<dyn Error + Send + Sync>>;

/// A lease long enough that none runs out during a configuration.
const LEASE: Duration = Duration::from_secs(600);

/// The run's items, made up: ids `q0`, `q1`, ...
struct Items {
    next: u64,
    total: u64,
}

impl ItemSource for Items {
    fn next_item(&mut self) -> Result<Option<NewItem>, CreateRunError> {
        if self.next == self.total {
            return Ok(None);
        }
        let i = self.next;
        self.next += 1;
        let id = format!("q{i}");
        Ok(Some(NewItem {
            sample_key: evalfleet_io::dataset::sample_key(1, &id),
            item_id: id,
            seq: i + 1,
            line: i + 1,
            offset: i * 64,
            invalid: None,
        }))
    }

    fn finish(&mut self) -> Result<RunIdentity, CreateRunError> {
        Ok(RunIdentity::of_no_file(&self.path(), None))
    }

    fn path(&self) -> String {
        "queue-latency.jsonl".to_owned()
    }
}

/// What the mock's answers look like to the store: an endpoint, a model,
/// token counts, a latency.
fn telemetry() -> Telemetry {
    Telemetry {
        endpoint: "mock".to_owned(),
        model: "m".to_owned(),
        latency_ms: 0.4,
        prompt_tokens: Some(12),
        completion_tokens: Some(9),
        finish_reason: Some("stop".to_owned()),
        ..Telemetry::default()
    }
}

/// One attempt and one result per claimed item, as the writer commits an
/// item answered at the first call.
fn batch_for(claim: &evalfleet_store::Claim) -> Batch {
    let mut batch = Batch::default();
    for item in &claim.items {
        batch.attempts.push((
            claim.id,
            AttemptRecord {
                seq: item.seq,
                attempt: item.prior_attempts + 1,
                session: 1,
                sent_at_ms: now_ms(),
                telemetry: telemetry(),
                http_status: Some(200),
                error_class: None,
                error: None,
            },
        ));
        batch.results.push((
            claim.id,
            ResultRecord {
                seq: item.seq,
                item_id: item.item_id.clone(),
                status: ItemStatus::Done,
                output: Some(format!("The answer to question {} is short.", item.seq)),
                error: None,
                telemetry: Some(telemetry()),
                attempts: 1,
                cached: 0,
                item: Some(format!(
                    "{{\"id\": \"{}\", \"question\": \"What is {} plus {}?\"}}",
                    item.item_id, item.seq, item.seq
                )),
                finished_at_ms: now_ms(),
                assessment: Default::default(),
                prompt: None,
                images: Vec::new(),
            },
        ));
    }
    batch
}

/// Latencies of one thread, in microseconds.
struct Timings {
    claims: Histogram<u64>,
    commits: Histogram<u64>,
    /// Claims that found every pending item held by the other threads.
    held: u64,
    items: u64,
}

fn histogram() -> Fallible<Histogram<u64>> {
    Ok(Histogram::new_with_bounds(1, 600_000_000, 3)?)
}

fn micros(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// One thread's loop: claim, commit, until nothing is left.
fn work(
    location: &Location,
    run_id: &str,
    name: &str,
    limit: usize,
    start: &Barrier,
) -> Fallible<Timings> {
    let mut store = evalfleet_store::open(location, &OpenOptions::default())
        .map_err(|e| format!("thread {name} cannot open the store: {e}"))?;
    let mut me = evalfleet_store::worker::this_process(LEASE);
    me.worker = name.to_owned();
    store
        .begin_session(run_id, &mut me, false)
        .map_err(|e| format!("thread {name} cannot join run {run_id}: {e}"))?;
    let mut timings = Timings {
        claims: histogram()?,
        commits: histogram()?,
        held: 0,
        items: 0,
    };
    let mut after = None;
    start.wait();
    loop {
        let asked = Instant::now();
        let claim = match store.claim(run_id, name, after, limit, LEASE)? {
            Claimed::Items(claim) => claim,
            Claimed::HeldByOthers => {
                timings.held += 1;
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            Claimed::Nothing => break,
        };
        timings.claims.record(micros(asked))?;
        after = claim.items.last().map(|item| item.seq);
        let batch = batch_for(&claim);
        let sent = Instant::now();
        let committed = store.commit(run_id, name, &batch)?;
        timings.commits.record(micros(sent))?;
        if !committed.refused.is_empty() {
            return Err(format!("thread {name}: a commit was refused: {committed:?}").into());
        }
        timings.items += committed.results;
    }
    Ok(timings)
}

/// Registers a run of `items` and works it with `threads` threads claiming
/// `limit` at a time; prints the figures as one JSON object.
fn measure(
    label: &str,
    location: &Location,
    run_id: &str,
    items: u64,
    threads: usize,
    limit: usize,
) -> Fallible<()> {
    let mut store = evalfleet_store::open(
        location,
        &OpenOptions {
            create: true,
            ..OpenOptions::default()
        },
    )
    .map_err(|e| format!("cannot open the {label} store: {e}"))?;
    let registered = Instant::now();
    store
        .create_run(
            &NewRun {
                run_id: run_id.to_owned(),
                name: "queue-latency".to_owned(),
                config: serde_json::json!({"name": "queue-latency"}),
                config_dir: ".".to_owned(),
                created_at_ms: now_ms(),
            },
            &mut Items {
                next: 0,
                total: items,
            },
        )
        .map_err(|e| format!("cannot register run {run_id}: {e}"))?;
    let registration_s = registered.elapsed().as_secs_f64();
    drop(store);

    // Scoped threads: each a worker with its own connection, no runtime
    // between it and the store; all start at once.
    let start = Barrier::new(threads + 1);
    let (outcomes, seconds) = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let start = &start;
                scope.spawn(move || work(location, run_id, &format!("t{t}"), limit, start))
            })
            .collect();
        start.wait();
        let began = Instant::now();
        let outcomes: Vec<_> = handles.into_iter().map(|handle| handle.join()).collect();
        (outcomes, began.elapsed().as_secs_f64())
    });
    let mut claims = histogram()?;
    let mut commits = histogram()?;
    let (mut held, mut done) = (0, 0);
    for outcome in outcomes {
        let timings = outcome.map_err(|_| format!("a thread of run {run_id} panicked"))??;
        claims.add(&timings.claims)?;
        commits.add(&timings.commits)?;
        held += timings.held;
        done += timings.items;
    }
    if done != items {
        return Err(format!("run {run_id}: {done} results committed for {items} items").into());
    }
    let figures = |h: &Histogram<u64>| {
        serde_json::json!({
            "count": h.len(),
            "p50_us": h.value_at_quantile(0.5),
            "p99_us": h.value_at_quantile(0.99),
            "max_us": h.max(),
            "mean_us": h.mean(),
        })
    };
    println!(
        "{}",
        serde_json::json!({
            "store": label,
            "threads": threads,
            "limit": limit,
            "items": items,
            "registration_s": registration_s,
            "seconds": seconds,
            "items_per_s": items as f64 / seconds,
            "claim": figures(&claims),
            "commit": figures(&commits),
            "claims_held_by_others": held,
        })
    );
    Ok(())
}

/// A comma-separated list of numbers.
fn list(text: &str) -> Fallible<Vec<usize>> {
    text.split(',')
        .map(|n| {
            n.trim()
                .parse()
                .map_err(|e| format!("'{n}' is not a number: {e}").into())
        })
        .collect()
}

fn main() -> Fallible<()> {
    let mut postgres = None;
    let mut sqlite_dir = None;
    let mut items: u64 = 10_000;
    let mut threads = vec![1, 2, 4];
    let mut limits = vec![16, 64];
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--postgres" => postgres = Some(value),
            "--sqlite-dir" => sqlite_dir = Some(PathBuf::from(value)),
            "--items" => items = value.parse()?,
            "--threads" => threads = list(&value)?,
            "--limits" => limits = list(&value)?,
            other => return Err(format!("unknown flag {other}").into()),
        }
    }
    if postgres.is_none() && sqlite_dir.is_none() {
        return Err("name a store: --postgres URL and/or --sqlite-dir DIR".into());
    }
    let tag = std::process::id();
    for &t in &threads {
        for &k in &limits {
            if let Some(url) = &postgres {
                let location = Location::Postgres(url.clone());
                measure(
                    "postgres",
                    &location,
                    &format!("ql-{tag}-t{t}-k{k}"),
                    items,
                    t,
                    k,
                )?;
            }
            if let Some(dir) = &sqlite_dir {
                let location = Location::Sqlite(dir.join(format!("ql-{tag}-t{t}-k{k}.db")));
                measure("sqlite", &location, "ql", items, t, k)?;
            }
        }
    }
    Ok(())
}
