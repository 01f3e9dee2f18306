//! Claims items and starts them on their task: pages of items claimed from
//! the store, each row read back from the dataset by its offset, its task
//! begun, and its first call answered from the cache (looked up a page at a
//! time) or queued. Runs on a blocking thread; the bounded queue makes it
//! wait when the fleet is busy.

use std::sync::Arc;
use std::time::Duration;

use evalfleet_types::CacheEntry;
use tokio::runtime::Handle;
use tokio::sync::mpsc;

use super::dispatch::drive;
use super::item::{Claimed as ClaimedItem, Ended, Item};
use super::outcome::Carry;
use super::outcome::{Message, Outcome};
use super::{PipelineError, Shared};
use crate::task::{ItemContext, Step, Target};
use evalfleet_io::dataset::RowReader;
use evalfleet_store::{Claimed, PendingItem, Store};

/// The most items a claim takes.
const PAGE: usize = 512;
/// The fewest (a claim is a transaction: one per item would be slow).
const PAGE_MIN: usize = 16;

/// How many items a claim takes for a worker that can have `capacity`
/// items under way: enough to keep it busy until it claims again, and no
/// more, so that workers sharing a run each take what they can answer
/// (a fast one comes back sooner and takes more) instead of the first
/// taking a page that others then wait on.
pub fn claim_size(capacity: usize) -> usize {
    capacity.saturating_mul(2).clamp(PAGE_MIN, PAGE)
}

/// The most items a claim takes while the cache answers every item of the
/// pages before it: such items end as they are read, so the claim is not
/// work the worker holds but the reader's own cost (a transaction, and a
/// read of the cache whose pages every commit of the writer leaves to be
/// read again), paid once per page.
const CACHED_PAGE: usize = 4096;

/// Items the claim after a page of `page` takes: twice as many (up to
/// [`CACHED_PAGE`]) when the cache answered that page whole, else `base`.
fn next_page(page: usize, base: usize, answered_whole: bool) -> usize {
    if answered_whole {
        (page * 2).clamp(base, CACHED_PAGE.max(base))
    } else {
        base
    }
}

/// How often a worker with nothing to claim looks again while others hold
/// the run's last items.
const OTHERS_POLL: Duration = Duration::from_millis(500);

pub struct Reader {
    store: Box<dyn Store>,
    rows: RowReader,
    run_id: Arc<str>,
    /// The worker it claims items for, and for how long.
    worker: Arc<str>,
    lease: Duration,
    /// Items a claim takes unless the cache answers whole pages (see
    /// [`claim_size`]).
    base_page: usize,
    /// Items the next claim takes: `base_page`, doubled up to
    /// [`CACHED_PAGE`] after each page the cache answered whole.
    page: usize,
    /// Items that ended in this thread, without a call (counted to tell a
    /// page the cache answered whole).
    ended_here: usize,
    /// `task.n`: with more than 1, item ids carry their sample index.
    samples: u32,
    shared: Arc<Shared>,
    /// Fresh items for the endpoints that answer items.
    fresh: mpsc::Sender<Item>,
    /// Results of items that ended here (from the cache, or before any
    /// call), not yet handed to the writer.
    results: Vec<Outcome>,
    ended: Vec<Ended>,
}

impl Reader {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        store: Box<dyn Store>,
        rows: RowReader,
        run_id: Arc<str>,
        worker: Arc<str>,
        lease: Duration,
        page: usize,
        samples: u32,
        shared: Arc<Shared>,
        fresh: mpsc::Sender<Item>,
    ) -> Self {
        Self {
            store,
            rows,
            run_id,
            worker,
            lease,
            base_page: page,
            page,
            ended_here: 0,
            samples,
            shared,
            fresh,
            results: Vec::new(),
            ended: Vec::new(),
        }
    }

    /// Waits before claiming again while others hold the run's last items
    /// (or, `own`, this worker does: it looks again as soon as its own are
    /// done); `false` when the session is stopping.
    fn look_again(&self, runtime: &Handle, own: bool) -> bool {
        let tally = &self.shared.tally;
        runtime.block_on(async {
            tokio::select! {
                () = tally.at_most(1), if own => true,
                () = tokio::time::sleep(OTHERS_POLL) => true,
                () = self.shared.halt.cancelled() => false,
            }
        })
    }

    /// Claims and starts items until no pending item is left to claim or
    /// `halt` is cancelled. While other workers hold every pending item it
    /// waits for them, claiming what their leases leave behind.
    pub fn run(mut self, runtime: &Handle) -> Result<(), PipelineError> {
        let mut after = None;
        loop {
            if !self.flush() || self.shared.halt.is_cancelled() {
                tracing::debug!("Reader: the session stops.");
                return Ok(());
            }
            // A worker holds no more items than two claims' worth: it
            // claims again once it has worked some off, so that workers
            // sharing a run each hold what they work on (a worker whose
            // calls are answered at once but whose judge is slow would
            // otherwise claim on and hold most of the run).
            let hold = (self.page as u64).saturating_mul(2);
            if self.shared.tally.outstanding() > hold {
                let waited = runtime.block_on(async {
                    tokio::select! {
                        () = self.shared.tally.at_most(hold) => true,
                        () = self.shared.halt.cancelled() => false,
                    }
                });
                if !waited {
                    return Ok(());
                }
            }
            let claim =
                match self
                    .store
                    .claim(&self.run_id, &self.worker, after, self.page, self.lease)?
                {
                    Claimed::Items(claim) => claim,
                    // Nothing left but this worker's own items: they may
                    // still be lost to another worker (a lease that ran
                    // out while the store was down), and then this worker
                    // waits for that one's end as for any other's. It
                    // looks again as soon as its own are done.
                    Claimed::Nothing if self.shared.tally.outstanding() > 1 => {
                        if !self.look_again(runtime, true) {
                            return Ok(());
                        }
                        after = None;
                        continue;
                    }
                    // Results still on their way to the store may be
                    // refused there (this worker's lease on them ran out
                    // while it was busy): their items would stay pending
                    // with no one to answer them. It looks again once
                    // every result is committed or refused.
                    Claimed::Nothing if self.shared.tally.unsettled() => {
                        let settled = runtime.block_on(async {
                            tokio::select! {
                                () = self.shared.tally.all_settled() => true,
                                () = self.shared.halt.cancelled() => false,
                            }
                        });
                        if !settled {
                            return Ok(());
                        }
                        after = None;
                        continue;
                    }
                    Claimed::Nothing => {
                        tracing::debug!("Reader: no item is left to claim.");
                        return Ok(());
                    }
                    Claimed::HeldByOthers => {
                        // Workers whose process is gone free their items now.
                        evalfleet_store::worker::release_dead(&mut *self.store, &self.run_id)?;
                        if !self.look_again(runtime, false) {
                            return Ok(());
                        }
                        after = None;
                        continue;
                    }
                };
            after = claim.items.last().map(|p| p.seq);
            self.shared
                .leases
                .claimed(claim.id, claim.items.len() as u64);
            self.shared.tally.claimed(claim.items.len() as u64);
            if !self.shared.cache.reads {
                // Each item goes on as soon as it is read.
                for pending in claim.items {
                    let (item, step) = self.start(claim.id, pending)?;
                    if !self.drive(item, step, None, runtime)? {
                        self.flush();
                        return Ok(());
                    }
                }
                continue;
            }
            // The page's first calls are looked up in the cache at once.
            let mut started = Vec::with_capacity(claim.items.len());
            for pending in claim.items {
                started.push(self.start(claim.id, pending)?);
            }
            let hits = self.prefetch(&started)?;
            let (claimed, ended_before) = (started.len(), self.ended_here);
            for ((item, step), hit) in started.into_iter().zip(hits) {
                if !self.drive(item, step, hit, runtime)? {
                    self.flush();
                    return Ok(());
                }
            }
            self.page = next_page(
                self.page,
                self.base_page,
                self.ended_here - ended_before == claimed,
            );
        }
    }

    /// Reads a claimed item's row and begins its task.
    fn start(
        &mut self,
        claim: evalfleet_store::ClaimId,
        pending: PendingItem,
    ) -> Result<(Item, Step), PipelineError> {
        // With `task.n` > 1 an item is `ROW#k`: sample k of row ROW.
        let (row_id, sample) = match evalfleet_io::dataset::split_sample_id(&pending.item_id) {
            Some((row, k)) if self.samples > 1 => (row, k),
            _ => (pending.item_id.as_str(), 0),
        };
        let (row, row_json) = self
            .rows
            .read_with_json(pending.offset, pending.line, row_id)?;
        let parsed = std::cell::OnceCell::from(row);
        // Agents' calls are stored as each ends (a sink for the item's
        // claim); other tasks make none.
        let keeper =
            self.shared.task.keeps_calls().then(|| {
                crate::task::CallSink(crate::outcome::call_sink(claim, &self.shared.writer))
            });
        let context = ItemContext::new(&pending.item_id, &parsed, &row_json, sample)
            .at_line(pending.line)
            .numbered(pending.seq, pending.prior_attempts + 1);
        let (episode, step) = self.shared.task.begin(&match &keeper {
            Some(keeper) => context.keeping(keeper),
            None => context,
        });
        drop(parsed);
        let mut item = Item::new(
            self.shared.tally.clone(),
            ClaimedItem {
                claim,
                item_id: pending.item_id,
                seq: pending.seq,
                row_json,
                sample,
                prior_attempts: pending.prior_attempts,
            },
            episode,
        );
        let (number, give_up) = self.shared.first_failures.number();
        item.number = number;
        if let Some(cause) = give_up {
            crate::dispatch::give_up(&self.shared, &cause);
        }
        if let Step::Call(request) = &step {
            item.prompt = request.prompt.clone();
        }
        Ok((item, step))
    }

    /// The cached answers of a page's first calls (one per item: `None`
    /// when it is not cached, or begins with no call), in one read.
    fn prefetch(
        &mut self,
        started: &[(Item, Step)],
    ) -> Result<Vec<Option<CacheEntry>>, PipelineError> {
        let keys: Vec<Option<String>> = started
            .iter()
            .map(|(_, step)| match step {
                Step::Call(request) => self.shared.cache.lookup_key(request),
                _ => None,
            })
            .collect();
        let wanted: Vec<&str> = keys.iter().flatten().map(String::as_str).collect();
        if wanted.is_empty() {
            return Ok(vec![None; started.len()]);
        }
        let mut found = self
            .store
            .cache_get_many(&wanted, self.shared.cache.since_ms)?
            .into_iter();
        Ok(keys
            .iter()
            .map(|key| key.as_ref().and_then(|_| found.next().flatten()))
            .collect())
    }

    /// Follows an item's steps as far as this thread can: answers its calls
    /// from the cache, keeps its result, queues it for a call, or hands its
    /// work to a task of its own. `false`: stop reading.
    fn drive(
        &mut self,
        mut item: Item,
        mut step: Step,
        mut first: Option<CacheEntry>,
        runtime: &Handle,
    ) -> Result<bool, PipelineError> {
        loop {
            step = match step {
                Step::Finish(finish) => {
                    let claim = item.claim;
                    {
                        // Items it held back may be queued again.
                        let _runtime = runtime.enter();
                        let alike = item.refused || item.calls == 0;
                        crate::dispatch::first_ended(&self.shared, item.number, &finish, alike);
                    }
                    let (result, ended) = item.finish(finish);
                    self.ended_here += 1;
                    self.results.push(Outcome {
                        claim,
                        attempt: None,
                        result: Some(result),
                        cache: None,
                        calls: Vec::new(),
                        wait: None,
                    });
                    self.ended.push(ended);
                    return Ok(true);
                }
                Step::Call(request) => {
                    // The first call's answer was looked up with its page;
                    // the next ones are looked up one by one.
                    let hit = match first.take() {
                        Some(hit) => Some(hit),
                        None if item.cached == 0 => None,
                        None => match self.shared.cache.lookup_key(&request) {
                            Some(key) => self.store.cache_get(&key, self.shared.cache.since_ms)?,
                            None => None,
                        },
                    };
                    if let Some(hit) = hit {
                        item.answered_from_cache(request, hit)
                    } else {
                        let for_items = request.target == Target::Items;
                        item.request = Some(request);
                        if for_items {
                            return Ok(self.flush() && self.deliver(item, runtime));
                        }
                        super::dispatch::requeue(&self.shared, item);
                        return Ok(true);
                    }
                }
                step @ Step::Attempted(_) => {
                    let shared = self.shared.clone();
                    self.shared.tracker.spawn_on(
                        async move { drive(&shared, item, step, Carry::default()).await },
                        runtime,
                    );
                    return Ok(true);
                }
                Step::Wait(wait) => {
                    let shared = self.shared.clone();
                    self.shared.tracker.spawn_on(
                        async move {
                            let step = tokio::select! {
                                step = wait => step,
                                // It holds no call: abandoned as soon as the
                                // session stops; the item stays pending.
                                () = shared.halt.cancelled() => return,
                            };
                            drive(&shared, item, step, Carry::default()).await;
                        },
                        runtime,
                    );
                    return Ok(true);
                }
                Step::Work(work) => {
                    let permit = runtime.block_on(async {
                        tokio::select! {
                            permit = self.shared.work.clone().acquire_owned() => permit.ok(),
                            () = self.shared.halt.cancelled() => None,
                        }
                    });
                    let Some(permit) = permit else {
                        // Stopping: the item stays pending.
                        return Ok(false);
                    };
                    let shared = self.shared.clone();
                    self.shared.tracker.spawn_on(
                        async move {
                            let step = tokio::select! {
                                step = work => step,
                                // Abandoned at shutdown: the item stays pending.
                                () = shared.abort.cancelled() => return,
                            };
                            drop(permit);
                            drive(&shared, item, step, Carry::default()).await;
                        },
                        runtime,
                    );
                    return Ok(true);
                }
            };
        }
    }

    /// Queues one item for the endpoints that answer items. When the queue
    /// is full, waits until half of it is free, so that this thread wakes
    /// once per many items, not once per item.
    fn deliver(&self, item: Item, runtime: &Handle) -> bool {
        let item = match self.fresh.try_send(item) {
            Ok(()) => return true,
            Err(mpsc::error::TrySendError::Closed(_)) => return false,
            Err(mpsc::error::TrySendError::Full(item)) => item,
        };
        let room = (self.fresh.max_capacity() / 2).max(1);
        let freed = runtime.block_on(async {
            tokio::select! {
                // The permits are dropped at once: only this thread sends
                // fresh items, so the room they held stays free for it.
                permits = self.fresh.reserve_many(room) => permits.is_ok(),
                () = self.shared.halt.cancelled() => false,
            }
        });
        freed && self.fresh.try_send(item).is_ok()
    }

    /// Hands the results of items that ended here to the writer, then counts
    /// them as ended (in that order: the session may end as soon as they
    /// are).
    fn flush(&mut self) -> bool {
        if self.results.is_empty() {
            return true;
        }
        let results = std::mem::take(&mut self.results);
        if self
            .shared
            .writer
            .blocking_send(Message::Many(results))
            .is_err()
        {
            return false;
        }
        for ended in std::mem::take(&mut self.ended) {
            ended.count(&self.shared.progress);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::{CACHED_PAGE, next_page};

    #[test]
    fn a_claim_doubles_while_the_cache_answers_its_pages_and_comes_back_after_a_call() {
        let path: Vec<usize> =
            std::iter::successors(Some(128), |&page| Some(next_page(page, 128, true)))
                .take(7)
                .collect();
        assert_eq!(path, [128, 256, 512, 1024, 2048, CACHED_PAGE, CACHED_PAGE]);
        assert_eq!(
            next_page(CACHED_PAGE, 128, false),
            128,
            "a page with a call"
        );
        // A claim already bigger than the cap keeps its own size.
        assert_eq!(next_page(8192, 8192, true), 8192);
    }
}
