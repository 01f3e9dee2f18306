//! An item on its way through a session, and the queues endpoints pull
//! items from: the backlog (fresh items from the reader, bounded so that
//! the reader waits when the fleet is busy, and items back for a retry,
//! which go first) that every endpoint answering items shares, and one
//! queue per endpoint for calls addressed to it by name.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use evalfleet_types::{CacheEntry, ItemStatus, ResultRecord, Telemetry, Verdict, now_ms};
use tokio::sync::{Mutex, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::task::{Episode, Finish, ItemContext, Reply, Request, Step, Target};
use evalfleet_io::dataset::Row;
use evalfleet_store::ClaimId;

/// The session's count of items that have not ended: when it reaches
/// zero, the session is over. An item dropped before it ended (a bug, unless
/// the session is stopping) is counted as lost and logged, so that it
/// cannot hold the session open or go unnoticed.
pub struct Tally {
    /// Items claimed and not ended, and one for the reader until it has
    /// claimed its last.
    outstanding: AtomicU64,
    /// Told when an item ends that brings the items outstanding down to
    /// what the reader waits for ([`Tally::at_most`]): holding as many
    /// items as it may, it waits on it to claim again.
    ended: tokio::sync::Notify,
    /// The most items outstanding that the reader waits for: 0 before its
    /// first wait and after each that ended, the last limit after a wait
    /// given up (a `select!` that took another branch), which costs at
    /// most a wake-up it does not need. Told of every end instead, the
    /// reader's thread woke for each item, found it still held too many
    /// and slept again: two context switches an item (8,688 for 5,000
    /// calls at 1,024 in flight), on the core that makes the calls.
    wake_at: AtomicU64,
    /// Results made, and results the writer committed or refused, since
    /// the session began. Those made and not yet settled matter: a result
    /// refused at commit (this worker's lease on it ran out) leaves its
    /// item pending, so the reader claims again once they are settled
    /// before it says it has nothing left; and the writer hurries until
    /// the settled reach what was made when the reader asked.
    made_total: AtomicU64,
    settled_total: AtomicU64,
    /// Told each time the writer settles a batch's results.
    settled: tokio::sync::Notify,
    /// Tells the writer to commit what it holds now, not at its flush
    /// interval: the reader waits on it to end the session.
    flush: tokio::sync::Notify,
    lost: AtomicU64,
    halt: CancellationToken,
    /// The session's counters (its re-asks are counted where they are
    /// made, whether their answer comes from a call or the cache).
    progress: Arc<super::Progress>,
    /// Told of each item that ends, by its claim.
    leases: Arc<crate::lease::LeaseGate>,
}

impl Tally {
    pub fn new(
        halt: CancellationToken,
        progress: Arc<super::Progress>,
        leases: Arc<crate::lease::LeaseGate>,
    ) -> Arc<Self> {
        Arc::new(Self {
            outstanding: AtomicU64::new(1),
            ended: tokio::sync::Notify::new(),
            wake_at: AtomicU64::new(0),
            made_total: AtomicU64::new(0),
            settled_total: AtomicU64::new(0),
            settled: tokio::sync::Notify::new(),
            flush: tokio::sync::Notify::new(),
            lost: AtomicU64::new(0),
            halt,
            progress,
            leases,
        })
    }

    /// Items claimed (now outstanding).
    pub fn claimed(&self, n: u64) {
        self.outstanding.fetch_add(n, Ordering::AcqRel);
    }

    /// One item (or the reader's hold) is no longer outstanding; when none
    /// is, the session is over.
    pub fn release(&self) {
        // Sequentially consistent with `at_most`'s store and load: either
        // the reader sees this end in the count, or this end sees the
        // reader's limit and tells it.
        let left = self.outstanding.fetch_sub(1, Ordering::SeqCst) - 1;
        if left == 0 {
            self.halt.cancel();
        }
        if left <= self.wake_at.load(Ordering::SeqCst) {
            self.ended.notify_one();
        }
    }

    /// Waits until at most `limit` items are outstanding. One task waits
    /// at a time (the reader).
    pub async fn at_most(&self, limit: u64) {
        self.wake_at.store(limit, Ordering::SeqCst);
        // A `notify_one` between the check and the wait is kept as a
        // permit, so it is not missed.
        while self.outstanding.load(Ordering::SeqCst) > limit {
            self.ended.notified().await;
        }
        self.wake_at.store(0, Ordering::SeqCst);
    }

    pub fn outstanding(&self) -> u64 {
        self.outstanding.load(Ordering::Acquire)
    }

    /// A result is made, on its way to the writer.
    pub fn made(&self) {
        self.made_total.fetch_add(1, Ordering::AcqRel);
    }

    /// The writer has committed (or refused) `n` results.
    pub fn settled(&self, n: u64) {
        if n > 0 {
            self.settled_total.fetch_add(n, Ordering::AcqRel);
            self.settled.notify_one();
        }
    }

    /// What the writer settles before it stops hurrying, when the reader
    /// asks now: every result made so far (`None` once they all are).
    pub fn settle_target(&self) -> Option<u64> {
        let target = self.made_total.load(Ordering::Acquire);
        (self.settled_total.load(Ordering::Acquire) < target).then_some(target)
    }

    /// Whether every result made before the reader asked (`target`) is
    /// settled.
    pub fn reached(&self, target: u64) -> bool {
        self.settled_total.load(Ordering::Acquire) >= target
    }

    /// Waits until every result made so far is committed or refused,
    /// asking the writer to commit at once.
    pub async fn all_settled(&self) {
        self.flush.notify_one();
        while self.unsettled() {
            self.settled.notified().await;
        }
    }

    /// Waits until the reader asks for what the writer holds to be
    /// committed at once.
    pub async fn flush_asked(&self) {
        self.flush.notified().await;
    }

    /// Whether results are on their way to the store.
    pub fn unsettled(&self) -> bool {
        // The settled first: a result is settled only once it was made, so
        // the made read after can only be as many or more.
        let settled = self.settled_total.load(Ordering::Acquire);
        self.made_total.load(Ordering::Acquire) > settled
    }

    /// Items dropped before they ended while the session was not stopping.
    pub fn lost(&self) -> u64 {
        self.lost.load(Ordering::Acquire)
    }
}

/// Watches how a session's first items end: when the first
/// [`FirstFailures::SAME`] items it took (in the order it took them, not
/// the order they ended: refusals come back faster than answers) all
/// failed the same way and no item was answered (a wrong key, a mistyped
/// model, a request every call gets refused, an agent that fails at once),
/// the session gives up at once, naming the cause, instead of failing every
/// item of the run the same way. Once an item is answered, or one of the
/// first fails otherwise, it says nothing more.
///
/// While one of the first items has failed so and none was answered, later
/// items wait for the verdict before their first call ([`Self::hold`]), so
/// that a run given up has sent the first items' calls and the few already
/// in flight, not as many as its endpoints could send meanwhile.
#[derive(Default)]
pub struct FirstFailures {
    /// Items taken so far: each item's number in the session.
    taken: AtomicU64,
    /// The verdict is in: an item was answered, or the first failed in
    /// different ways (or it gave up).
    settled: std::sync::atomic::AtomicBool,
    watch: std::sync::Mutex<Watch>,
}

#[derive(Default)]
struct Watch {
    /// The first failure's words and how many of the first items failed
    /// with them.
    same: Option<(String, u32)>,
    gave_up: bool,
    /// The cause to give up for once a later item is taken: when the first
    /// items failed alike and no other was taken (yet), there is nothing
    /// to spare, and a session of no more items ends failed, not given up.
    deferred: Option<String>,
    /// Items held back from their first call until the verdict.
    held: Vec<Item>,
}

/// What an item's end means for the first items' verdict.
pub enum FirstEnd {
    /// Nothing to do.
    Nothing,
    /// Give the session up, for this cause.
    GiveUp(String),
    /// Some item was answered (or the first failed in different ways): the
    /// items held back go on.
    GoOn(Vec<Item>),
}

impl FirstFailures {
    /// Failures alike of the first items, and no answer, that give a
    /// session up.
    pub const SAME: u32 = 5;

    /// The next item's number in the session (0 for its first), and the
    /// cause to give the session up for, when it is to be given up now.
    pub fn number(&self) -> (u64, Option<String>) {
        let number = self.taken.fetch_add(1, Ordering::AcqRel);
        if number < u64::from(Self::SAME) || self.settled.load(Ordering::Acquire) {
            return (number, None);
        }
        (number, self.watch().deferred.take())
    }

    fn watch(&self) -> std::sync::MutexGuard<'_, Watch> {
        self.watch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The verdict is in: the items held back, to go on.
    fn settle(&self, watch: &mut Watch) -> FirstEnd {
        self.settled.store(true, Ordering::Release);
        FirstEnd::GoOn(std::mem::take(&mut watch.held))
    }

    /// Item `number` ended as `finish` says; `alike`: a failure that can be
    /// one of many alike (a call refused for good, an agent's run that
    /// failed, or work of the task's own that made no call), not a
    /// server's error retried to the end.
    pub fn ended(&self, number: u64, finish: &Finish, alike: bool) -> FirstEnd {
        if self.settled.load(Ordering::Acquire) {
            return FirstEnd::Nothing;
        }
        let mut watch = self.watch();
        if watch.gave_up || self.settled.load(Ordering::Acquire) {
            return FirstEnd::Nothing;
        }
        // A failed item with an output was played (an episode its trainer
        // closed): something answered.
        if finish.status != ItemStatus::Failed || finish.output.is_some() {
            return self.settle(&mut watch);
        }
        if number >= u64::from(Self::SAME) {
            return FirstEnd::Nothing;
        }
        if !alike {
            return self.settle(&mut watch);
        }
        let error = finish.error.as_deref().unwrap_or("no reason recorded");
        let words = error.lines().next().unwrap_or_default();
        let count = match &mut watch.same {
            Some((first, count)) if first == words => {
                *count += 1;
                *count
            }
            // Failures of different kinds: not one cause to name.
            Some(_) => return self.settle(&mut watch),
            None => {
                watch.same = Some((words.to_owned(), 1));
                1
            }
        };
        if count == Self::SAME {
            // The items held back stay held: the session stops, once it
            // has a later item to spare.
            watch.gave_up = true;
            if self.taken.load(Ordering::Acquire) > u64::from(Self::SAME) {
                return FirstEnd::GiveUp(words.to_owned());
            }
            watch.deferred = Some(words.to_owned());
        }
        FirstEnd::Nothing
    }

    /// `item`, about to be sent, when it may go on; `None` when it is held
    /// back until the verdict on the first items (then handed back by
    /// [`Self::ended`]). Only a later item's first call waits, and only
    /// once one of the first items failed alike with none answered.
    pub fn hold(&self, item: Item) -> Option<Item> {
        if item.calls > 0
            || item.number < u64::from(Self::SAME)
            || self.settled.load(Ordering::Acquire)
        {
            return Some(item);
        }
        let mut watch = self.watch();
        if watch.same.is_none() || self.settled.load(Ordering::Acquire) {
            return Some(item);
        }
        watch.held.push(item);
        None
    }
}

/// An item in a session.
pub struct Item {
    tally: Arc<Tally>,
    /// Set once its end is handed on: dropping it is then no loss.
    ended: bool,
    /// The claim it was handed out under: what it commits under.
    pub claim: ClaimId,
    pub item_id: String,
    pub seq: u64,
    /// The input row as JSON text, stored with the result.
    pub row_json: String,
    /// The row, parsed again only when a step asks for it: held by every
    /// item in flight, it would cost memory and cache most tasks do not
    /// use.
    row: std::cell::OnceCell<Row>,
    /// Which of its row's `task.n` samples it is (0 when n is 1).
    pub sample: u32,
    /// Attempts made in earlier sessions (the highest number stored).
    pub prior_attempts: u32,
    /// Its calls in this session, those answered from the cache included.
    pub calls: u32,
    /// Calls answered from the cache.
    pub cached: u32,
    /// Tries of the request it waits on: `retry.max_attempts` is each
    /// request's budget (a call moved to another endpoint, or an answer's
    /// call refused by a quota, is not one). It starts at the attempts
    /// stored by earlier sessions, so that a resume gives an item only the
    /// tries it has left (and always one).
    pub tries: u32,
    /// The last try of the call it waits on failed with a fault of that
    /// call alone (a sporadic 5xx other than a 503, a reset connection):
    /// a second such fault in a row backs off (the call itself may be
    /// what fails), where one after any other outcome is retried at once.
    pub faulted_last: bool,
    /// Its next call is a retry the session's retry budget paid for; any
    /// other call pays into the budget.
    pub retry_paid: bool,
    /// When its first call in this session was sent (its deadline counts
    /// from here).
    pub first_sent: Option<Instant>,
    /// When the first try of the call it waits on was made, for a call to
    /// a named endpoint (`retry.judge_for` counts from here).
    pub call_since: Option<Instant>,
    /// Its last call was refused with an answer no retry changes (a 4xx
    /// other than 408 and 429), or its last attempt (an agent's run)
    /// failed: a failure that may be one of many alike.
    pub refused: bool,
    /// Its number among the items the session took (see
    /// [`FirstFailures`]).
    pub number: u64,
    /// The call that gave its answer so far (or the last that failed).
    pub answer: Option<Telemetry>,
    pub episode: Box<dyn Episode>,
    /// The call it waits for.
    pub request: Option<Request>,
    /// The rule of `task.prompts` that made its messages.
    pub prompt: Option<std::sync::Arc<str>>,
    /// The images its first request with images sent: kept with its
    /// result.
    images: Vec<evalfleet_types::ImageRef>,
}

/// An item as it was claimed.
pub struct Claimed {
    pub claim: ClaimId,
    pub item_id: String,
    pub seq: u64,
    pub row_json: String,
    pub sample: u32,
    pub prior_attempts: u32,
}

impl Item {
    /// The call it waited on is over (answered, or failed for good): the
    /// next one has its own tries.
    pub fn reset_tries(&mut self) {
        self.tries = 0;
        self.faulted_last = false;
        self.call_since = None;
    }

    /// A claimed item, starting on its task.
    pub fn new(tally: Arc<Tally>, claimed: Claimed, episode: Box<dyn Episode>) -> Self {
        Self {
            tally,
            ended: false,
            claim: claimed.claim,
            item_id: claimed.item_id,
            seq: claimed.seq,
            row: std::cell::OnceCell::new(),
            row_json: claimed.row_json,
            sample: claimed.sample,
            prior_attempts: claimed.prior_attempts,
            calls: 0,
            cached: 0,
            // Tries made before a resume count: `retry.max_attempts` means
            // the same however often a run is resumed.
            tries: claimed.prior_attempts,
            faulted_last: false,
            retry_paid: false,
            first_sent: None,
            call_since: None,
            refused: false,
            number: u64::MAX,
            answer: None,
            episode,
            request: None,
            prompt: None,
            images: Vec::new(),
        }
    }

    /// The number of its next attempt, over every session.
    pub fn number(&self) -> u32 {
        self.prior_attempts + self.calls + 1
    }

    /// The step after `request`'s reply; a re-ask (a call after an answer
    /// that could not be used) is counted here, once.
    pub fn next(&mut self, request: Request, reply: Reply) -> Step {
        if self.images.is_empty() && !request.images.is_empty() {
            self.images = request.images.references();
        }
        let item = ItemContext::new(&self.item_id, &self.row, &self.row_json, self.sample)
            .numbered(self.seq, self.number());
        let step = self.episode.next(&item, request, reply);
        if let Step::Call(next) = &step
            && next.rejected.is_some()
        {
            self.tally.progress.reasks.fetch_add(1, Ordering::Relaxed);
        }
        step
    }

    /// The step after `request` was answered from the cache by `hit`.
    pub fn answered_from_cache(&mut self, request: Request, hit: CacheEntry) -> Step {
        self.calls += 1;
        self.cached += 1;
        if request.target == Target::Items {
            self.answer = Some(Telemetry {
                endpoint: hit.endpoint,
                model: hit.model,
                latency_ms: 0.0,
                ttft_ms: None,
                tpot_ms: None,
                prompt_tokens: hit.prompt_tokens,
                completion_tokens: hit.completion_tokens,
                tokens_estimated: false,
                finish_reason: hit.finish_reason,
            });
        }
        self.next(request, Reply::Answer(hit.content))
    }

    /// The item's result: it ends as `finish` says. The caller counts it
    /// as ended ([`Ended::count`]) once the result is handed on.
    pub fn finish(mut self, finish: Finish) -> (ResultRecord, Ended) {
        self.ended = true;
        // Counted before the writer can see it, so that its commit never
        // settles a result not yet counted.
        self.tally.made();
        let result = ResultRecord {
            seq: self.seq,
            item_id: std::mem::take(&mut self.item_id),
            status: finish.status,
            output: finish.output,
            error: finish.error,
            telemetry: self.answer.take(),
            attempts: self.prior_attempts + self.calls,
            cached: self.cached,
            item: Some(std::mem::take(&mut self.row_json)),
            finished_at_ms: now_ms(),
            assessment: finish.assessment,
            prompt: self.prompt.take().map(|p| p.to_string()),
            images: std::mem::take(&mut self.images),
        };
        let ended = Ended {
            tally: self.tally.clone(),
            status: finish.status,
            verdict: result.assessment.verdict,
        };
        (result, ended)
    }
}

impl Item {
    /// Its claim ran out and another worker may hold it now: this session
    /// lets it go (no result, no call more); it is not lost.
    pub fn let_go(mut self) {
        tracing::debug!(
            "Item {}: this worker's lease on it ran out; it is left to the worker that holds it now.",
            self.item_id
        );
        self.ended = true;
        self.tally.release();
    }
}

impl Drop for Item {
    fn drop(&mut self) {
        // However it ends, it makes no more calls under its claim.
        self.tally.leases.item_ended(self.claim);
        if self.ended {
            return;
        }
        if !self.tally.halt.is_cancelled() {
            self.tally.lost.fetch_add(1, Ordering::AcqRel);
            tracing::error!(
                "Item {} was dropped without a result (a bug): it stays pending for a resume.",
                self.item_id
            );
        }
        self.tally.release();
    }
}

/// An item whose result is on its way to the store.
pub struct Ended {
    tally: Arc<Tally>,
    pub status: ItemStatus,
    /// Whether its answer could be used, when the task checks answers.
    verdict: Option<Verdict>,
}

impl Ended {
    /// Counts the item as ended (after its result was handed to the writer:
    /// the session may end at once).
    pub fn count(self, progress: &super::Progress) {
        progress.ended(self.status, self.verdict);
        self.tally.release();
    }
}

/// A second call for an item whose call is late on an endpoint that was
/// taken out of service while it was in flight: made on another endpoint;
/// the first answer wins and the other call is cancelled (and recorded).
pub struct Hedge {
    pub claim: ClaimId,
    pub seq: u64,
    /// Its attempt number (taken from the item's when it was made).
    pub number: u32,
    pub messages: Box<serde_json::value::RawValue>,
    pub images: evalfleet_io::images::Images,
    /// The endpoint of the call it hedges, which is not to make it.
    pub from: String,
    /// The item's deadline.
    pub deadline: Instant,
    /// Cancelled when the call it hedges answered first.
    pub cancel: CancellationToken,
    /// Where its outcome goes, when it was made.
    pub reply: tokio::sync::oneshot::Sender<Hedged>,
}

/// What a hedge came to: its call's outcome, on which endpoint, and what
/// the store keeps of it.
pub struct Hedged {
    pub exchange: evalfleet_fleet::call::Exchange,
    pub endpoint: Arc<evalfleet_fleet::Endpoint>,
    pub record: Option<evalfleet_types::AttemptRecord>,
}

impl Hedge {
    /// What its call sends.
    pub fn outgoing(&self) -> evalfleet_fleet::call::Prompt<'_> {
        evalfleet_fleet::call::Prompt {
            messages: &self.messages,
            images: &self.images,
        }
    }
}

/// What an endpoint's free slot takes next. Nearly every job is an item,
/// moved once from a queue to its call: boxing items to even out the sizes
/// would cost an allocation per call.
#[allow(clippy::large_enum_variant)]
pub enum Job {
    Item(Item),
    Hedge(Hedge),
}

struct Receivers {
    fresh: mpsc::Receiver<Item>,
    fresh_open: bool,
    retry: mpsc::UnboundedReceiver<Item>,
    hedges: mpsc::UnboundedReceiver<Hedge>,
}

/// The items waiting for any endpoint that answers items, and hedges of
/// late calls.
pub struct Backlog {
    receivers: Mutex<Receivers>,
    retry_tx: mpsc::UnboundedSender<Item>,
    hedge_tx: mpsc::UnboundedSender<Hedge>,
}

impl Backlog {
    /// A backlog fed by `fresh`.
    pub fn new(fresh: mpsc::Receiver<Item>) -> Self {
        let (retry_tx, retry) = mpsc::unbounded_channel();
        let (hedge_tx, hedges) = mpsc::unbounded_channel();
        Self {
            receivers: Mutex::new(Receivers {
                fresh,
                fresh_open: true,
                retry,
                hedges,
            }),
            retry_tx,
            hedge_tx,
        }
    }

    /// Puts an item back for another call. The retry channel holds at most
    /// the items in flight, so it needs no bound of its own.
    pub fn retry(&self, item: Item) {
        // The receiver lives as long as the backlog, so this cannot fail.
        let _ = self.retry_tx.send(item);
    }

    /// Asks for a hedge of a late call (at most one per call in flight).
    pub fn hedge(&self, hedge: Hedge) {
        let _ = self.hedge_tx.send(hedge);
    }

    /// The next job: hedges (a call is late), then retries, then fresh
    /// items; `None` once `halt` is cancelled. Waiters are served in the
    /// order they came (the mutex is fair), so every free slot of every
    /// endpoint gets its turn.
    pub async fn next(&self, halt: &CancellationToken) -> Option<Job> {
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
                Some(hedge) = receivers.hedges.recv() => return Some(Job::Hedge(hedge)),
                Some(item) = receivers.retry.recv() => return Some(Job::Item(item)),
                item = receivers.fresh.recv(), if receivers.fresh_open => match item {
                    Some(item) => return Some(Job::Item(item)),
                    None => receivers.fresh_open = false,
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::pin::pin;
    use std::sync::atomic::AtomicUsize;
    use std::task::{Context, Wake, Waker};
    use std::time::Duration;

    /// A waker that counts its wakes.
    struct Counted(AtomicUsize);

    impl Wake for Counted {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn tally() -> Arc<Tally> {
        Tally::new(
            CancellationToken::new(),
            Arc::new(super::super::Progress::new(0, 0, 0, &[])),
            Arc::new(crate::lease::LeaseGate::new(Duration::from_secs(60))),
        )
    }

    #[test]
    fn the_reader_waiting_for_room_is_woken_once_there_is_room_not_at_every_end() {
        let tally = tally();
        // The reader's hold (1) and 10 items claimed: 11 outstanding.
        tally.claimed(10);
        let counted = Arc::new(Counted(AtomicUsize::new(0)));
        let waker = Waker::from(counted.clone());
        let mut cx = Context::from_waker(&waker);
        let mut wait = pin!(tally.at_most(4));
        assert!(wait.as_mut().poll(&mut cx).is_pending());
        // Six ends leave 5 outstanding: more than it waits for, and it is
        // not woken for any of them.
        for _ in 0..6 {
            tally.release();
        }
        assert_eq!(counted.0.load(Ordering::SeqCst), 0);
        assert!(wait.as_mut().poll(&mut cx).is_pending());
        // The seventh brings it to 4: woken once, and done.
        tally.release();
        assert_eq!(counted.0.load(Ordering::SeqCst), 1);
        assert!(wait.as_mut().poll(&mut cx).is_ready());
        // A later wait, after an end with no one waiting (3 left), is
        // woken by the end that brings the count to its limit.
        tally.release();
        let mut again = pin!(tally.at_most(2));
        assert!(again.as_mut().poll(&mut cx).is_pending());
        tally.release();
        assert_eq!(counted.0.load(Ordering::SeqCst), 2);
        assert!(again.as_mut().poll(&mut cx).is_ready());
    }
}
