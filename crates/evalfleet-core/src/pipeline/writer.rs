//! The one writer: it owns the store during a session and commits attempts
//! and results in batches, one transaction each, at a size or an interval,
//! whichever comes first. While one batch is being committed (on a blocking
//! thread) the next one fills.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until};

use super::Progress;
use crate::config::WriterSettings;
use crate::store::{AttemptRecord, Batch, ResultRecord, Store, StoreError};

/// What an attempt task hands to the writer.
#[derive(Debug)]
pub struct Outcome {
    pub attempt: Option<AttemptRecord>,
    pub result: Option<ResultRecord>,
}

type Flush = JoinHandle<(Box<dyn Store>, Result<u64, StoreError>)>;

struct Writer {
    run_id: Arc<str>,
    progress: Arc<Progress>,
    idle: Option<Box<dyn Store>>,
    flushing: Option<Flush>,
}

impl Writer {
    /// Waits for the batch being committed, if any, and takes the store back.
    async fn settle(&mut self) -> Result<(), StoreError> {
        if let Some(flush) = self.flushing.take() {
            let (store, result) = flush.await.map_err(|err| {
                StoreError::Invariant(format!("the writer's commit task failed: {err}"))
            })?;
            self.idle = Some(store);
            let committed = result?;
            self.progress
                .committed
                .fetch_add(committed, Ordering::Relaxed);
        }
        Ok(())
    }

    async fn flush(&mut self, batch: Batch) -> Result<(), StoreError> {
        if batch.is_empty() {
            return Ok(());
        }
        self.settle().await?;
        let Some(mut store) = self.idle.take() else {
            return Err(StoreError::Invariant(
                "the writer lost its store".to_owned(),
            ));
        };
        let run_id = self.run_id.clone();
        self.flushing = Some(tokio::task::spawn_blocking(move || {
            let result = store
                .commit(&run_id, &batch)
                .map(|()| batch.results.len() as u64);
            (store, result)
        }));
        Ok(())
    }
}

/// Runs until every sender is dropped, then commits what is left and gives
/// the store back.
pub async fn run(
    mut inbox: mpsc::Receiver<Outcome>,
    store: Box<dyn Store>,
    run_id: Arc<str>,
    settings: WriterSettings,
    progress: Arc<Progress>,
) -> Result<Box<dyn Store>, StoreError> {
    let mut writer = Writer {
        run_id,
        progress,
        idle: Some(store),
        flushing: None,
    };
    let mut batch = Batch::default();
    let mut deadline: Option<Instant> = None;
    loop {
        let next = match deadline {
            Some(at) => tokio::select! {
                outcome = inbox.recv() => outcome,
                () = sleep_until(at) => {
                    deadline = None;
                    writer.flush(std::mem::take(&mut batch)).await?;
                    continue;
                }
            },
            None => inbox.recv().await,
        };
        let Some(outcome) = next else { break };
        batch.attempts.extend(outcome.attempt);
        batch.results.extend(outcome.result);
        if batch.results.len() >= settings.batch_size || batch.attempts.len() >= settings.batch_size
        {
            deadline = None;
            writer.flush(std::mem::take(&mut batch)).await?;
        } else if deadline.is_none() {
            deadline = Some(Instant::now() + settings.flush_interval);
        }
    }
    writer.flush(batch).await?;
    writer.settle().await?;
    writer
        .idle
        .take()
        .ok_or_else(|| StoreError::Invariant("the writer lost its store".to_owned()))
}
