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
                    leases.renewed(started, lease, &renewal.held, &renewal.lost);
                    if !renewal.lost.is_empty() {
                        tracing::warn!(
                            "{} items were taken over by other workers after this worker's lease on them ran out; what it makes of them will be refused.",
                            renewal.lost.len()
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
                    due.get_or_insert_with(|| Instant::now() + settings.flush_interval);
                }
                None => open = false,
            },
            Some(joined) = committing.join_next() => {
                let (store, result) = joined
                    .map_err(|err| StoreError::Invariant(format!("the writer's commit task failed: {err}")))?;
                idle = Some(store);
                progress.committed.fetch_add(result?, Ordering::Relaxed);
            }
            () = sleep_until(due.unwrap_or_else(Instant::now)), if due.is_some() && idle.is_some() => {}
            () = sleep_until(renew_at), if idle.is_some() => {}
            // The session waits on its last results: commit them now.
            () = tally.flush_asked() => {
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
