//! Feeds pending items to the work queue: pages of pending items from the
//! store, each row read back from the dataset by its offset and its messages
//! rendered. Runs on a blocking thread; the bounded queue makes it wait when
//! the fleet is busy.

use std::sync::Arc;

use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::queue::WorkItem;
use super::writer::Outcome;
use crate::dataset::{DatasetError, RowReader};
use crate::store::{Judged, ItemStatus, ResultRecord, Store, StoreError, now_ms};
use crate::template::Templates;

const PAGE: usize = 512;

#[derive(Debug, thiserror::Error)]
pub enum ReaderError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Dataset(#[from] DatasetError),
}

pub struct Reader {
    pub store: Box<dyn Store>,
    pub rows: RowReader,
    pub run_id: Arc<str>,
    pub templates: Arc<Templates>,
    pub queue: mpsc::Sender<WorkItem>,
    pub writer: mpsc::Sender<Outcome>,
    pub halt: CancellationToken,
    /// Called when an item ends here (its template could not be rendered).
    pub on_terminal: Arc<dyn Fn(ItemStatus) + Send + Sync>,
}

impl Reader {
    /// Queues one item. When the queue is full, waits until half of it is
    /// free, so that this thread wakes once per many items, not once per item.
    fn deliver(&self, item: WorkItem, runtime: &Handle) -> bool {
        let item = match self.queue.try_send(item) {
            Ok(()) => return true,
            Err(mpsc::error::TrySendError::Closed(_)) => return false,
            Err(mpsc::error::TrySendError::Full(item)) => item,
        };
        let room = (self.queue.max_capacity() / 2).max(1);
        let freed = runtime.block_on(async {
            tokio::select! {
                // The permits are dropped at once: only this thread sends
                // fresh items, so the room they held stays free for it.
                permits = self.queue.reserve_many(room) => permits.is_ok(),
                () = self.halt.cancelled() => false,
            }
        });
        freed && self.queue.try_send(item).is_ok()
    }

    /// Reads until every pending item was queued or `halt` is cancelled.
    pub fn run(mut self, runtime: Handle) -> Result<(), ReaderError> {
        let mut after = None;
        loop {
            if self.halt.is_cancelled() {
                return Ok(());
            }
            let page = self.store.pending_items(&self.run_id, after, PAGE)?;
            let Some(last) = page.last() else {
                return Ok(());
            };
            after = Some(last.seq);
            for pending in page {
                let (row, item_json) =
                    self.rows
                        .read_with_json(pending.offset, pending.line, &pending.item_id)?;
                let delivered = match self.templates.render_json(&row) {
                    Ok(messages) => {
                        let item = WorkItem {
                            item_id: pending.item_id,
                            seq: pending.seq,
                            messages,
                            item_json,
                            prior_attempts: pending.prior_attempts,
                            attempts: 0,
                            excused: 0,
                            reasks: 0,
                            first_sent: None,
                        };
                        self.deliver(item, &runtime)
                    }
                    Err(message) => {
                        let result = ResultRecord {
                            seq: pending.seq,
                            item_id: pending.item_id,
                            status: ItemStatus::Failed,
                            output: None,
                            error: Some(format!("template: {message}")),
                            endpoint: None,
                            model: None,
                            attempts: pending.prior_attempts,
                            latency_ms: None,
                            ttft_ms: None,
                            tpot_ms: None,
                            prompt_tokens: None,
                            completion_tokens: None,
                            finish_reason: None,
                            item: Some(item_json),
                            finished_at_ms: now_ms(),
                            judged: Judged::default(),
                        };
                        let sent = runtime.block_on(self.writer.send(Outcome {
                            attempt: None,
                            result: Some(result),
                        }));
                        if sent.is_ok() {
                            (self.on_terminal)(ItemStatus::Failed);
                        }
                        sent.is_ok()
                    }
                };
                if !delivered {
                    return Ok(());
                }
            }
        }
    }
}
