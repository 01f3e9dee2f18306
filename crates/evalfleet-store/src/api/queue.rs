//! The work queue: items claimed for a lease, renewed while worked on,
//! and committed with their results under the claim.

use evalfleet_types::{AgentCall, AttemptRecord, CacheEntry, ResultRecord};

use super::errors::StoreError;

/// An item a worker claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingItem {
    pub item_id: String,
    pub seq: u64,
    pub line: u64,
    pub offset: u64,
    /// Attempts made for it in earlier sessions: the highest attempt
    /// number stored (calls answered from the cache take a number and
    /// store no row), so that its next attempt's number is new.
    pub prior_attempts: u32,
}

/// A claim's id, unique in the store.
pub type ClaimId = i64;

/// Items a worker holds until its lease runs out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub id: ClaimId,
    /// In `seq` order.
    pub items: Vec<PendingItem>,
}

/// What a worker's request for items got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claimed {
    Items(Claim),
    /// Every pending item is held by another worker's live lease, or waits
    /// out a stored wait: ask again later (they finish, their lease runs
    /// out, the wait passes).
    HeldByOthers,
    /// No pending item is left outside this worker's own claims.
    Nothing,
}

/// What one transaction commits: attempts and results, each under the
/// claim it was made for, and answers for the cache.
#[derive(Debug, Clone, Default)]
pub struct Batch {
    pub attempts: Vec<(ClaimId, AttemptRecord)>,
    pub results: Vec<(ClaimId, ResultRecord)>,
    pub cache: Vec<CacheEntry>,
    /// Calls agents made through the gateway (`kind: exec`), stored with
    /// the attempts that made them and refused with them.
    pub calls: Vec<(ClaimId, AgentCall)>,
    /// Items to be sent again no sooner than a while from the commit (a
    /// server's `Retry-After`, a backoff): the wait is stored with the
    /// item, so that whichever worker takes it next (this one, or another
    /// after this one died) waits it out.
    pub waits: Vec<(ClaimId, NotBefore)>,
}

impl Batch {
    pub fn is_empty(&self) -> bool {
        self.attempts.is_empty()
            && self.results.is_empty()
            && self.cache.is_empty()
            && self.calls.is_empty()
            && self.waits.is_empty()
    }
}

/// An item that is not to be sent again before `wait` has passed, counted
/// from when its commit is stored (on the store's clock: a worker's clock
/// may be wrong).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotBefore {
    pub seq: u64,
    pub wait: std::time::Duration,
}

/// What a heartbeat learned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Renewal {
    /// Claims the worker holds.
    pub claims: u64,
    /// Those claims: a claim of the worker's that is not among them ran
    /// out (its items may be another's now).
    pub held: Vec<ClaimId>,
    /// Items (`seq`) the worker lost since its last heartbeat: what it
    /// makes of them will be refused (PostgreSQL says; SQLite, whose
    /// claims are ranges, does not).
    pub lost: Vec<u64>,
}

/// What a commit stored.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Committed {
    /// Results stored.
    pub results: u64,
    /// Items (`seq`) whose attempts and results were refused: their claim
    /// is no longer this worker's (its lease ran out). Another worker
    /// answers them.
    pub refused: Vec<u64>,
}

/// The work queue: items handed out by claims with a lease.
pub trait WorkQueue {
    /// Claims up to `limit` pending items that no live lease holds, in `seq`
    /// order from just after `after` (or from the start), for `lease`.
    /// Expired claims of any worker are dropped, so their items are claimed
    /// again, first (PostgreSQL looks for them before taking at most once
    /// a [`crate::POSTGRES_REAP_EVERY`] per connection and run, and
    /// whenever a claim finds nothing else). An item whose stored wait ([`NotBefore`]) has not
    /// passed is not claimed: it counts as held by others until it has.
    fn claim(
        &mut self,
        run_id: &str,
        worker: &str,
        after: Option<u64>,
        limit: usize,
        lease: std::time::Duration,
    ) -> Result<Claimed, StoreError>;

    /// Extends every live claim of `worker` (and its heartbeat) by `lease`
    /// from now; returns how many claims it holds, and the items it lost
    /// since it last asked (their lease ran out and another worker's claim
    /// returned them to pending) where the backend keeps track of them. A
    /// claim that already ran out stays lost.
    fn renew(
        &mut self,
        run_id: &str,
        worker: &str,
        lease: std::time::Duration,
    ) -> Result<Renewal, StoreError>;

    /// Commits attempts and results, and moves the results' items out of
    /// pending, in one transaction. What was made under a claim that is no
    /// longer `worker`'s and live is refused, not stored. A result for an
    /// item of a live claim that is not pending is an invariant error and
    /// nothing is committed. A claim whose items have all ended is dropped.
    fn commit(
        &mut self,
        run_id: &str,
        worker: &str,
        batch: &Batch,
    ) -> Result<Committed, StoreError>;

    /// Ends `worker`'s part: its claims are dropped (their pending items are
    /// free for others at once) and it is no longer registered.
    fn release(&mut self, run_id: &str, worker: &str) -> Result<(), StoreError>;
}
