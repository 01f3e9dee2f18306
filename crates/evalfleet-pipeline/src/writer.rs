//! The one writer: it owns the store during a session and commits attempts
//! and results in batches, one transaction each, when a batch reaches its
//! size or its oldest entry has waited the flush interval.
//!
//! Commits run on a blocking thread, and the writer keeps receiving while one
//! is in flight: what arrives meanwhile goes into the next transaction (group
//! commit), so a slow `fsync` makes batches larger instead of stalling every
//! call. Only past [`GROUP_LIMIT`] batches' worth do senders wait.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::{Instant, sleep_until};

use super::Progress;
use evalfleet_config::WriterSettings;
use evalfleet_store::{Batch, NotBefore, Store, StoreError};
use evalfleet_types::ResultRecord;

use super::outcome::{Message, Outcome};

/// What is told of each result once it is committed (a Google Sheet's
/// sink): called on the commit's thread, so it must be quick.
pub type ResultTap = Arc<dyn Fn(&ResultRecord) + Send + Sync>;

/// How many batches' worth may wait while a commit is in flight.
const GROUP_LIMIT: usize = 16;

fn add(batch: &mut Batch, outcome: Outcome) {
    let claim = outcome.claim;
    if let (Some(wait), Some(attempt)) = (outcome.wait, &outcome.attempt) {
        let seq = attempt.seq;
        batch.waits.push((claim, NotBefore { seq, wait }));
    }
    batch.attempts.extend(outcome.attempt.map(|a| (claim, a)));
    batch.results.extend(outcome.result.map(|r| (claim, r)));
    batch.cache.extend(outcome.cache);
    batch
        .calls
        .extend(outcome.calls.into_iter().map(|c| (claim, c)));
}

/// What a blocking store task gives back: the store, and how many results
/// it committed.
type Returned = (Box<dyn Store>, Result<u64, StoreError>);

fn size(batch: &Batch) -> usize {
    batch.results.len().max(batch.attempts.len())
}

/// Whose work the writer commits, and how long its claims last.
pub struct Worker {
    pub run_id: Arc<str>,
    pub worker: Arc<str>,
    pub lease: Duration,
}

/// Who the writer tells of what it committed and renewed.
pub struct Told {
    /// The session's counters (results committed).
    pub progress: Arc<Progress>,
    /// Each result once committed.
    pub tap: Option<ResultTap>,
    /// Which claims still hold, after each renewal.
    pub leases: Arc<crate::lease::LeaseGate>,
    /// How many results are settled (committed or refused).
    pub tally: Arc<crate::item::Tally>,
}

/// Runs until every sender is dropped, then commits what is left, releases
/// the worker's claims and gives the store back. Meanwhile it renews the
/// worker's lease every third of it.
pub async fn run(
    mut inbox: mpsc::Receiver<Message>,
    store: Box<dyn Store>,
    worker: Worker,
    settings: WriterSettings,
    told: Told,
) -> Result<Box<dyn Store>, StoreError> {
    let Worker {
        run_id,
        worker,
        lease,
    } = worker;
    let Told {
        progress,
        tap,
        leases,
        tally,
    } = told;
    let mut idle = Some(store);
    let mut committing: JoinSet<Returned> = JoinSet::new();
    let mut batch = Batch::default();
    // When the oldest uncommitted entry must be committed.
    let mut due: Option<Instant> = None;
    let renew_every = lease / 3;
    let mut renew_at = Instant::now() + renew_every;
    let mut open = true;
    // The reader waits for every result made so far to be committed (it
    // asked once): until the results made before it asked are settled,
    // what arrives is committed at once, not after the flush interval. A
    // result that was on its way when the reader asked would otherwise
    // wait the whole interval, and the session's end with it.
    let mut hurry: Option<u64> = None;
    loop {
        if renew_at <= Instant::now()
            && let Some(mut store) = idle.take()
        {
            renew_at = Instant::now() + renew_every;
            let (run_id, worker) = (run_id.clone(), worker.clone());
            let leases = leases.clone();
            committing.spawn_blocking(move || {
                let started = tokio::time::Instant::now();
                let result = store.renew(&run_id, &worker, lease).map(|renewal| {
                    // Items of claims that ran out are lost as surely as
                    // items taken singly: the user is told of both (a
                    // worker that woke from a stall may learn of its loss
                    // here, before any result of those items is refused).
                    let lost = leases.renewed(started, lease, &renewal.held, &renewal.lost);
                    if lost > 0 {
                        tracing::warn!(
                            "{lost} items were taken over by other workers after this worker's lease on them ran out; it makes no more calls for them, and what it has made of them will be refused."
                        );
                    }
                    0
                });
                (store, result)
            });
            continue;
        }
        let ready = size(&batch) >= settings.batch_size
            || due.is_some_and(|at| at <= Instant::now())
            || !open;
        if !batch.is_empty()
            && ready
            && let Some(mut store) = idle.take()
        {
            let batch = std::mem::take(&mut batch);
            due = None;
            let (run_id, worker) = (run_id.clone(), worker.clone());
            let tap = tap.clone();
            let tally = tally.clone();
            committing.spawn_blocking(move || {
                let result = store.commit(&run_id, &worker, &batch).map(|committed| {
                    if !committed.refused.is_empty() {
                        tracing::warn!(
                            "{} results were refused: this worker's lease on them ran out; their items are answered again under a new claim.",
                            committed.refused.len()
                        );
                    }
                    if let Some(tap) = &tap {
                        batch
                            .results
                            .iter()
                            .filter(|(_, r)| !committed.refused.contains(&r.seq))
                            .for_each(|(_, r)| tap(r));
                    }
                    tally.settled(batch.results.len() as u64);
                    committed.results
                });
                (store, result)
            });
            continue;
        }
        if !open && batch.is_empty() && committing.is_empty() {
            break;
        }
        let room = size(&batch) < settings.batch_size * GROUP_LIMIT;
        tokio::select! {
            outcome = inbox.recv(), if open && room => match outcome {
                Some(message) => {
                    match message {
                        Message::One(outcome) => add(&mut batch, outcome),
                        Message::Many(outcomes) => outcomes.into_iter().for_each(|o| add(&mut batch, o)),
                    }
                    if hurry.is_some() {
                        due = Some(Instant::now());
                    } else {
                        due.get_or_insert_with(|| Instant::now() + settings.flush_interval);
                    }
                }
                None => open = false,
            },
            Some(joined) = committing.join_next() => {
                let (store, result) = joined
                    .map_err(|err| StoreError::Invariant(format!("the writer's commit task failed: {err}")))?;
                idle = Some(store);
                progress.committed.fetch_add(result?, Ordering::Relaxed);
                hurry = hurry.filter(|target| !tally.reached(*target));
            }
            () = sleep_until(due.unwrap_or_else(Instant::now)), if due.is_some() && idle.is_some() => {}
            () = sleep_until(renew_at), if idle.is_some() => {}
            // The session waits on its last results: commit them now.
            () = tally.flush_asked() => {
                hurry = tally.settle_target();
                if due.is_some() {
                    due = Some(Instant::now());
                }
            }
        }
    }
    let mut store =
        idle.ok_or_else(|| StoreError::Invariant("the writer lost its store".to_owned()))?;
    committing.spawn_blocking(move || {
        let result = store.release(&run_id, &worker).map(|()| 0);
        (store, result)
    });
    let joined = committing.join_next().await;
    let (store, released) = joined
        .ok_or_else(|| StoreError::Invariant("the writer lost its store".to_owned()))?
        .map_err(|err| StoreError::Invariant(format!("the writer's release failed: {err}")))?;
    released?;
    Ok(store)
}

#[cfg(test)]
// The writer under test runs outside any session's task tracker.
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use evalfleet_store::{
        Claimed, ListedItems, Location, NewItem, NewRun, OpenOptions, WorkerInfo,
    };
    use evalfleet_types::{Assessment, ItemStatus};

    #[tokio::test(start_paused = true)]
    async fn a_result_on_its_way_when_the_reader_asks_for_the_last_commit_is_committed_at_once() {
        // The reader asks for what is made to be committed (it has nothing
        // left to claim and waits for the results in flight) while the
        // last result is still on its way to the writer: that result is
        // committed as soon as it arrives, not after the flush interval
        // (the session's end waited on it: 200 ms by default).
        const FLUSH: Duration = Duration::from_secs(3_600);
        let dir = tempfile::tempdir().unwrap();
        let location = Location::Sqlite(dir.path().join("store.db"));
        let options = OpenOptions {
            create: true,
            ..OpenOptions::default()
        };
        let mut store = evalfleet_store::open(&location, &options).unwrap();
        let new_run = NewRun {
            run_id: "r".to_owned(),
            name: "test".to_owned(),
            config: serde_json::json!({"name": "test"}),
            config_dir: ".".to_owned(),
            created_at_ms: 1,
        };
        let item = NewItem {
            item_id: "a".to_owned(),
            seq: 1,
            line: 1,
            offset: 0,
            sample_key: 0,
            invalid: None,
        };
        store
            .create_run(&new_run, &mut ListedItems::new(vec![item], None))
            .unwrap();
        let lease = 10 * FLUSH;
        let mut me = WorkerInfo {
            worker: "w".to_owned(),
            ..evalfleet_store::worker::this_process(lease)
        };
        store.begin_session("r", &mut me, false).unwrap();
        let claim = match store.claim("r", "w", None, 10, lease).unwrap() {
            Claimed::Items(claim) => claim.id,
            other => panic!("the item is pending: {other:?}"),
        };
        let halt = tokio_util::sync::CancellationToken::new();
        let progress = Arc::new(Progress::new(1, 0, 0, &[]));
        let leases = Arc::new(crate::lease::LeaseGate::new(lease));
        let tally = crate::item::Tally::new(halt, progress.clone(), leases.clone());
        let (results, inbox) = mpsc::channel(8);
        let writer = tokio::spawn(run(
            inbox,
            store,
            Worker {
                run_id: "r".into(),
                worker: "w".into(),
                lease,
            },
            WriterSettings {
                batch_size: 512,
                flush_interval: FLUSH,
            },
            Told {
                progress: progress.clone(),
                tap: None,
                leases,
                tally: tally.clone(),
            },
        ));
        // The item ends; then, before its result reaches the writer, the
        // reader asks (this runtime has one thread: each yield lets the
        // writer take what it was told).
        tally.made();
        tokio::task::yield_now().await;
        let asked = Instant::now();
        let waiting = tokio::spawn({
            let tally = tally.clone();
            async move { tally.all_settled().await }
        });
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        let result = evalfleet_types::ResultRecord {
            seq: 1,
            item_id: "a".to_owned(),
            status: ItemStatus::Done,
            output: Some("x".to_owned()),
            error: None,
            telemetry: None,
            attempts: 1,
            cached: 0,
            item: Some("{}".to_owned()),
            finished_at_ms: 1,
            assessment: Assessment::default(),
            prompt: None,
            images: Vec::new(),
        };
        let mut outcome = Outcome::empty(claim);
        outcome.result = Some(result);
        results.send(Message::One(outcome)).await.unwrap();
        waiting.await.unwrap();
        // (The clock is paused: it moves on only to timers that fire, so
        // a commit that waited for the flush interval shows here in full.)
        assert!(
            asked.elapsed() < FLUSH,
            "the last result waited {:?} for the flush interval",
            asked.elapsed()
        );
        drop(results);
        writer.await.unwrap().unwrap();
        assert_eq!(progress.committed.load(Ordering::Relaxed), 1);
    }
}
