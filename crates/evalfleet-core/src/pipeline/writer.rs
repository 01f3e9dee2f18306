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

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::{Instant, sleep_until};

use super::Progress;
use crate::config::WriterSettings;
use crate::store::{Batch, Store, StoreError};
use evalfleet_types::{AttemptRecord, CacheEntry, ResultRecord};

/// How many batches' worth may wait while a commit is in flight.
const GROUP_LIMIT: usize = 16;

/// What an attempt task hands to the writer.
#[derive(Debug)]
pub struct Outcome {
    pub attempt: Option<AttemptRecord>,
    pub result: Option<ResultRecord>,
    /// A successful answer for the cache.
    pub cache: Option<CacheEntry>,
}

/// What the writer receives: one outcome (an attempt task), or many at
/// once (the reader's cache hits, a page at a time, so that the writer
/// wakes once per page rather than once per item).
// `One` is the hot path (every call); boxing it would cost an allocation
// per call, and channel slots were this size before `Many` existed.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Message {
    One(Outcome),
    Many(Vec<Outcome>),
}

fn add(batch: &mut Batch, outcome: Outcome) {
    batch.attempts.extend(outcome.attempt);
    batch.results.extend(outcome.result);
    batch.cache.extend(outcome.cache);
}

type Committed = (Box<dyn Store>, Result<u64, StoreError>);

fn size(batch: &Batch) -> usize {
    batch.results.len().max(batch.attempts.len())
}

/// Runs until every sender is dropped, then commits what is left and gives
/// the store back.
pub async fn run(
    mut inbox: mpsc::Receiver<Message>,
    store: Box<dyn Store>,
    run_id: Arc<str>,
    settings: WriterSettings,
    progress: Arc<Progress>,
) -> Result<Box<dyn Store>, StoreError> {
    let mut idle = Some(store);
    let mut committing: JoinSet<Committed> = JoinSet::new();
    let mut batch = Batch::default();
    // When the oldest uncommitted entry must be committed.
    let mut due: Option<Instant> = None;
    let mut open = true;
    loop {
        let ready = size(&batch) >= settings.batch_size
            || due.is_some_and(|at| at <= Instant::now())
            || !open;
        if !batch.is_empty()
            && ready
            && let Some(mut store) = idle.take()
        {
            let batch = std::mem::take(&mut batch);
            due = None;
            let run_id = run_id.clone();
            committing.spawn_blocking(move || {
                let result = store
                    .commit(&run_id, &batch)
                    .map(|()| batch.results.len() as u64);
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
        }
    }
    idle.ok_or_else(|| StoreError::Invariant("the writer lost its store".to_owned()))
}
