//! The work queue that endpoint slots pull from: fresh items from the reader
//! (a bounded channel, so the reader waits when the fleet is busy) and items
//! coming back for a retry, which go first.

use serde_json::value::RawValue;
use tokio::sync::{Mutex, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::store::ClaimId;

/// An item on its way through the pipeline.
#[derive(Debug)]
pub struct WorkItem {
    /// The claim the item was handed out under: what it commits under.
    pub claim: ClaimId,
    pub item_id: String,
    pub seq: u64,
    /// The rendered chat messages, as JSON.
    pub messages: Box<RawValue>,
    /// The input row, as JSON, stored with the result.
    pub item_json: String,
    /// Attempts made in earlier sessions.
    pub prior_attempts: u32,
    /// Attempts made in this session (the ones that count against
    /// `retry.max_attempts`).
    pub attempts: u32,
    /// Calls that do not count against `retry.max_attempts`: moved to
    /// another endpoint because theirs stopped taking items, or refused by a
    /// rate limit (bounded by the item's deadline instead).
    pub excused: u32,
    /// Which of the row's `task.n` samples this item is (0 when n is 1).
    pub sample: u32,
    /// Times the model was asked again after an answer that could not be
    /// used.
    pub reasks: u32,
    /// When its first attempt in this session was sent (the item deadline
    /// counts from here).
    pub first_sent: Option<Instant>,
}

impl WorkItem {
    /// The number of the next attempt, over every session.
    pub fn number(&self) -> u32 {
        self.prior_attempts + self.attempts + self.excused + 1
    }
}

struct Receivers {
    fresh: mpsc::Receiver<WorkItem>,
    fresh_open: bool,
    retry: mpsc::UnboundedReceiver<WorkItem>,
}

pub struct WorkQueue {
    receivers: Mutex<Receivers>,
    retry_tx: mpsc::UnboundedSender<WorkItem>,
}

impl WorkQueue {
    /// A queue fed by `fresh`.
    pub fn new(fresh: mpsc::Receiver<WorkItem>) -> Self {
        let (retry_tx, retry) = mpsc::unbounded_channel();
        Self {
            receivers: Mutex::new(Receivers {
                fresh,
                fresh_open: true,
                retry,
            }),
            retry_tx,
        }
    }

    /// Puts an item back for another attempt. The retry channel holds at most
    /// the items in flight, so it needs no bound of its own.
    pub fn retry(&self, item: WorkItem) {
        // The receiver lives as long as the queue, so this cannot fail.
        let _ = self.retry_tx.send(item);
    }

    /// The next item, retries first; `None` once `halt` is cancelled. Waiters
    /// are served in the order they came (the mutex is fair), so every free
    /// slot of every endpoint gets its turn.
    pub async fn next(&self, halt: &CancellationToken) -> Option<WorkItem> {
        let mut guard = tokio::select! {
            biased;
            () = halt.cancelled() => return None,
            guard = self.receivers.lock() => guard,
        };
        let receivers = &mut *guard;
        loop {
            tokio::select! {
                biased;
                () = halt.cancelled() => return None,
                Some(item) = receivers.retry.recv() => return Some(item),
                item = receivers.fresh.recv(), if receivers.fresh_open => match item {
                    Some(item) => return Some(item),
                    None => receivers.fresh_open = false,
                },
            }
        }
    }
}
