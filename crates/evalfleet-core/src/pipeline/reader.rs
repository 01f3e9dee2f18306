//! Feeds pending items to the work queue: pages of pending items from the
//! store, each row read back from the dataset by its offset and its messages
//! rendered. Runs on a blocking thread; the bounded queue makes it wait when
//! the fleet is busy.

use std::sync::Arc;

use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::queue::WorkItem;
use super::writer::{Message, Outcome};
use crate::dataset::{DatasetError, RowReader};
use crate::eval::Evaluator;
use crate::store::{ClaimId, Claimed, PendingItem, Store, StoreError};
use crate::template::Templates;
use evalfleet_types::{
    Assessment, AttemptRecord, CacheEntry, ErrorClass, ItemStatus, ResultRecord, Telemetry, now_ms,
};

const PAGE: usize = 512;

/// How often a worker with nothing to claim looks again while others hold
/// the run's last items.
const OTHERS_POLL: std::time::Duration = std::time::Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub enum ReaderError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Dataset(#[from] DatasetError),
}

pub struct Reader {
    pub store: Box<dyn Store>,
    /// The worker it claims items for, and for how long.
    pub worker: Arc<str>,
    pub lease: std::time::Duration,
    /// Counts claimed items as outstanding (before they are queued).
    pub on_claimed: Arc<dyn Fn(u64) + Send + Sync>,
    pub rows: RowReader,
    pub run_id: Arc<str>,
    pub templates: Arc<Templates>,
    pub queue: mpsc::Sender<WorkItem>,
    pub writer: mpsc::Sender<Message>,
    pub halt: CancellationToken,
    /// Called when an item ends here (its template could not be rendered,
    /// or the cache answered it).
    pub on_terminal: Arc<dyn Fn(ItemStatus) + Send + Sync>,
    /// Cache lookups, when the run reads the cache.
    pub cache: Option<Arc<CacheReads>>,
    pub session: u32,
    /// `task.n`: with more than 1, item ids carry their sample index.
    pub samples: u32,
    /// Outcomes of cache hits not yet handed to the writer, and how many
    /// items they end.
    pub hits: Vec<Outcome>,
    pub ended: u64,
    /// The session's tasks (cached code answers are judged in tasks of
    /// their own), and its abort (abandons them).
    pub tracker: TaskTracker,
    pub abort: CancellationToken,
}

/// What the reader needs to answer items from the cache.
pub struct CacheReads {
    pub identity: String,
    /// Entries stored before this are too old (`cache.ttl`).
    pub since_ms: i64,
    pub eval: Option<Arc<Evaluator>>,
    /// Cached answers of a code task are judged too, in tasks of their
    /// own, no more at once than the judge's backlog allows.
    pub code: Option<Arc<super::CodeJudge>>,
    /// Judge endpoints' cache identities, by name.
    pub judges: std::collections::HashMap<String, String>,
}

/// How far the cache took an item.
enum Cached {
    /// Not at all, or part of a re-ask conversation: the item goes on to
    /// the endpoints.
    Go(WorkItem),
    /// Answered: the item ended here (its outcome is buffered).
    Done,
    /// Answered, and being judged as a program: the judging task hands its
    /// outcome to the writer.
    Judging,
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

    /// Answers `item` from the cache as far as it can: a stored answer is
    /// checked like a fresh one, and a re-ask is looked up in turn.
    fn answer_from_cache(
        &mut self,
        mut item: WorkItem,
        runtime: &Handle,
    ) -> Result<Cached, ReaderError> {
        let Some(cache) = &self.cache else {
            return Ok(Cached::Go(item));
        };
        loop {
            let key = crate::cache::key(&cache.identity, item.sample, &item.messages);
            let Some(hit) = self.store.cache_get(&key, cache.since_ms)? else {
                return Ok(Cached::Go(item));
            };
            let checked = cache
                .eval
                .as_ref()
                .map(|eval| (eval, eval.check(&hit.content)));
            let reask = checked
                .as_ref()
                .is_some_and(|(eval, c)| !c.valid && item.reasks < eval.spec().max_reasks);
            let attempt = AttemptRecord {
                seq: item.seq,
                attempt: item.number(),
                session: self.session,
                sent_at_ms: now_ms(),
                telemetry: cached_telemetry(&hit),
                http_status: None,
                error_class: reask.then_some(ErrorClass::InvalidAnswer),
                error: checked
                    .as_ref()
                    .filter(|_| reask)
                    .map(|(_, c)| c.reask_note()),
                cached: true,
            };
            // Cached attempts do not count against the item's budget.
            item.excused += 1;
            if let Some((eval, checked)) = checked.as_ref().filter(|_| reask) {
                match eval.reask_messages(&item.messages, &hit.content, checked) {
                    Some(raw) => item.messages = raw,
                    None => return Ok(Cached::Go(item)),
                }
                item.reasks += 1;
                self.hits.push(Outcome {
                    claim: item.claim,
                    attempt: Some(attempt),
                    result: None,
                    cache: None,
                });
                continue;
            }
            let judged = match &checked {
                Some((eval, checked)) => {
                    let row: serde_json::Value =
                        serde_json::from_str(&item.item_json).unwrap_or_default();
                    let mut scores = eval.score(checked, &row);
                    for request in eval.judge_requests(checked, &row) {
                        let reply = match (&request.messages, cache.judges.get(&request.endpoint)) {
                            (Ok(messages), Some(identity)) => self.store.cache_get(
                                &crate::cache::key(identity, 0, messages),
                                cache.since_ms,
                            )?,
                            _ => None,
                        };
                        match reply {
                            Some(reply) => {
                                scores.insert(
                                    request.key.clone(),
                                    eval.judge_score(&request.key, &reply.content),
                                );
                            }
                            // The judge's reply is not cached: the item goes
                            // to the endpoints (its answer is asked again, then
                            // judged).
                            None => {
                                self.hits.push(Outcome {
                                    claim: item.claim,
                                    attempt: Some(attempt),
                                    result: None,
                                    cache: None,
                                });
                                return Ok(Cached::Go(item));
                            }
                        }
                    }
                    if let Some(code) = cache.code.as_ref().filter(|_| checked.valid) {
                        let judging = JudgeLater {
                            code: code.clone(),
                            eval: (*eval).clone(),
                            checked: checked.clone(),
                            row,
                            scores,
                        };
                        return Ok(self.judge_later(judging, item, hit, attempt, runtime));
                    }
                    checked.assessment(scores, item.reasks)
                }
                None => Assessment {
                    reasks: item.reasks,
                    ..Assessment::default()
                },
            };
            let claim = item.claim;
            let result = cached_result(item, hit, judged);
            self.hits.push(Outcome {
                claim,
                attempt: Some(attempt),
                result: Some(result),
                cache: None,
            });
            self.ended += 1;
            return Ok(Cached::Done);
        }
    }

    /// Judges a cached answer in a task of its own, which hands the item's
    /// outcome to the writer and counts it as ended. Waits while too many
    /// are being judged.
    fn judge_later(
        &self,
        judging: JudgeLater,
        item: WorkItem,
        hit: CacheEntry,
        attempt: AttemptRecord,
        runtime: &Handle,
    ) -> Cached {
        let permit = runtime.block_on(async {
            tokio::select! {
                permit = judging.code.backlog.clone().acquire_owned() => permit.ok(),
                () = self.halt.cancelled() => None,
            }
        });
        let Some(permit) = permit else {
            // Stopping: the item stays pending.
            return Cached::Judging;
        };
        let (writer, on_terminal, abort) = (
            self.writer.clone(),
            self.on_terminal.clone(),
            self.abort.clone(),
        );
        let task = async move {
            let JudgeLater {
                code,
                eval,
                checked,
                row,
                scores,
            } = judging;
            let reasks = item.reasks;
            let answer = hit.content.clone();
            let judged = tokio::select! {
                judged = code.judged(&eval, &checked, &row, &answer, scores, reasks) => judged,
                // Abandoned at shutdown: the item stays pending.
                () = abort.cancelled() => return,
            };
            let outcome = Outcome {
                claim: item.claim,
                attempt: Some(attempt),
                result: Some(cached_result(item, hit, judged)),
                cache: None,
            };
            if writer.send(Message::One(outcome)).await.is_ok() {
                on_terminal(ItemStatus::Done);
            }
            drop(permit);
        };
        self.tracker.spawn_on(task, runtime);
        Cached::Judging
    }

    /// Hands the buffered cache hits to the writer, then counts their items
    /// as ended (in that order: the run may end as soon as they are).
    fn flush_hits(&mut self) -> bool {
        if self.hits.is_empty() {
            return true;
        }
        let hits = std::mem::take(&mut self.hits);
        if self.writer.blocking_send(Message::Many(hits)).is_err() {
            return false;
        }
        for _ in 0..std::mem::take(&mut self.ended) {
            (self.on_terminal)(ItemStatus::Done);
        }
        true
    }

    /// Claims and queues items until no pending item is left to claim or
    /// `halt` is cancelled. While other workers hold every pending item it
    /// waits for them, claiming what their leases leave behind.
    pub fn run(mut self, runtime: Handle) -> Result<(), ReaderError> {
        let mut after = None;
        loop {
            if !self.flush_hits() || self.halt.is_cancelled() {
                return Ok(());
            }
            let claim =
                match self
                    .store
                    .claim(&self.run_id, &self.worker, after, PAGE, self.lease)?
                {
                    Claimed::Items(claim) => claim,
                    Claimed::Nothing => return Ok(()),
                    Claimed::HeldByOthers => {
                        // Workers whose process is gone free their items now.
                        crate::worker::release_dead(&mut *self.store, &self.run_id)?;
                        let waited = runtime.block_on(async {
                            tokio::select! {
                                () = tokio::time::sleep(OTHERS_POLL) => true,
                                () = self.halt.cancelled() => false,
                            }
                        });
                        if !waited {
                            return Ok(());
                        }
                        after = None;
                        continue;
                    }
                };
            after = claim.items.last().map(|p| p.seq);
            (self.on_claimed)(claim.items.len() as u64);
            for pending in claim.items {
                if !self.take(claim.id, pending, &runtime)? {
                    self.flush_hits();
                    return Ok(());
                }
            }
        }
    }

    /// Reads one claimed item's row, renders its messages, and answers it
    /// from the cache or queues it. `false`: stop reading.
    fn take(
        &mut self,
        claim: ClaimId,
        pending: PendingItem,
        runtime: &Handle,
    ) -> Result<bool, ReaderError> {
        // With `task.n` > 1 an item is `ROW#k`: sample k of row ROW.
        let (row_id, sample) = match crate::dataset::split_sample_id(&pending.item_id) {
            Some((row, k)) if self.samples > 1 => (row, k),
            _ => (pending.item_id.as_str(), 0),
        };
        let (row, item_json) = self
            .rows
            .read_with_json(pending.offset, pending.line, row_id)?;
        match self.templates.render_json(&row) {
            Ok(messages) => {
                let item = WorkItem {
                    claim,
                    sample,
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
                Ok(match self.answer_from_cache(item, runtime)? {
                    // The attempts of a partly cached conversation are
                    // stored before the item goes on.
                    Cached::Go(item) => self.flush_hits() && self.deliver(item, runtime),
                    Cached::Done | Cached::Judging => true,
                })
            }
            Err(message) => {
                let result = ResultRecord {
                    seq: pending.seq,
                    item_id: pending.item_id,
                    status: ItemStatus::Failed,
                    output: None,
                    error: Some(format!("template: {message}")),
                    telemetry: None,
                    attempts: pending.prior_attempts,
                    item: Some(item_json),
                    finished_at_ms: now_ms(),
                    assessment: Assessment::default(),
                };
                let sent = runtime.block_on(self.writer.send(Message::One(Outcome {
                    claim,
                    attempt: None,
                    result: Some(result),
                    cache: None,
                })));
                if sent.is_ok() {
                    (self.on_terminal)(ItemStatus::Failed);
                }
                Ok(sent.is_ok())
            }
        }
    }
}

/// A cached answer to judge as a program.
struct JudgeLater {
    code: Arc<super::CodeJudge>,
    eval: Arc<Evaluator>,
    checked: crate::eval::Checked,
    row: serde_json::Value,
    scores: evalfleet_types::Scores,
}

/// What is recorded of a call answered from the cache: no time passed.
fn cached_telemetry(hit: &CacheEntry) -> Telemetry {
    Telemetry {
        endpoint: hit.endpoint.clone(),
        model: hit.model.clone(),
        latency_ms: 0.0,
        ttft_ms: None,
        tpot_ms: None,
        prompt_tokens: hit.prompt_tokens,
        completion_tokens: hit.completion_tokens,
        finish_reason: hit.finish_reason.clone(),
    }
}

/// The result of an item answered from the cache.
fn cached_result(item: WorkItem, hit: CacheEntry, assessment: Assessment) -> ResultRecord {
    ResultRecord {
        seq: item.seq,
        item_id: item.item_id,
        status: ItemStatus::Done,
        telemetry: Some(cached_telemetry(&hit)),
        output: Some(hit.content),
        error: None,
        attempts: item.prior_attempts + item.attempts + item.excused,
        item: Some(item.item_json),
        finished_at_ms: now_ms(),
        assessment,
    }
}
