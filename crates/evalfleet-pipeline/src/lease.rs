//! What a session knows of its leases: until when its claims surely hold,
//! and which it lost. A call is sent for an item only while its claim
//! holds: a worker that stalled past its lease (stopped, frozen, cut from
//! the database) waits for its next renewal to learn which items are still
//! its own, and sends nothing for the others, which another worker may be
//! answering already.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use evalfleet_store::ClaimId;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub struct LeaseGate {
    /// Times are kept as ms since this instant.
    base: Instant,
    /// Until when every claim of the session surely holds: the last
    /// renewal's start (or the session's) plus the lease.
    holds_until_ms: AtomicU64,
    /// Claims handed out in this session, not known lost and with items
    /// that have not all ended here.
    issued: Mutex<HashMap<ClaimId, Issued>>,
    /// Claims and items known lost (another worker may hold them); an
    /// item with when the renewal that told of it began: it was lost
    /// under the claims the reader had by then, not under one that took
    /// it back since.
    lost_claims: Mutex<HashSet<ClaimId>>,
    lost_items: Mutex<HashMap<u64, Instant>>,
    any_lost: AtomicBool,
    renewed: Notify,
    /// Calls under way, by item: cancelled when their item is known lost.
    flights: Mutex<HashMap<u64, (ClaimId, CancellationToken)>>,
}

/// A claim the session holds items of.
struct Issued {
    /// When the reader had it (a renewal that began before then may not
    /// know it yet).
    had: Instant,
    /// Its items that have not ended here.
    left: u64,
}

/// A call under way for an item: its token is cancelled when the item is
/// known lost (or the session aborts); it is forgotten when dropped.
pub struct Flight {
    gate: Arc<LeaseGate>,
    seq: u64,
    token: CancellationToken,
}

impl Flight {
    pub fn token(&self) -> &CancellationToken {
        &self.token
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        if let Ok(mut flights) = self.gate.flights.lock() {
            flights.remove(&self.seq);
        }
    }
}

impl LeaseGate {
    /// A session whose claims last `lease`, starting now.
    pub fn new(lease: Duration) -> Self {
        let gate = Self {
            base: Instant::now(),
            holds_until_ms: AtomicU64::new(0),
            issued: Mutex::new(HashMap::new()),
            lost_claims: Mutex::new(HashSet::new()),
            lost_items: Mutex::new(HashMap::new()),
            any_lost: AtomicBool::new(false),
            renewed: Notify::new(),
            flights: Mutex::new(HashMap::new()),
        };
        gate.holds_until_ms
            .store(gate.ms(Instant::now() + lease), Ordering::Release);
        gate
    }

    fn ms(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.base).as_millis()).unwrap_or(u64::MAX)
    }

    /// The reader took `claim`, of `items` items. An id the store gives
    /// again names a new claim (the one it named before is gone), which is
    /// not lost with it.
    pub fn claimed(&self, claim: ClaimId, items: u64) {
        if let Ok(mut issued) = self.issued.lock() {
            issued.insert(
                claim,
                Issued {
                    had: Instant::now(),
                    left: items,
                },
            );
        }
        if let Ok(mut lost_claims) = self.lost_claims.lock()
            && lost_claims.remove(&claim)
        {
            tracing::warn!(
                "The store gave claim id {claim} again (a bug of its own): the new claim is not taken for lost."
            );
        }
    }

    /// An item of `claim` ended here (answered, failed, let go, or dropped
    /// as the session stopped): it makes no more calls. A claim whose
    /// items have all ended is forgotten: the store drops it, and the
    /// renewals that no longer find it must not take it for lost (every
    /// call would then look up what was lost, for nothing).
    pub fn item_ended(&self, claim: ClaimId) {
        if let Ok(mut issued) = self.issued.lock()
            && let Some(entry) = issued.get_mut(&claim)
        {
            entry.left = entry.left.saturating_sub(1);
            if entry.left == 0 {
                issued.remove(&claim);
            }
        }
    }

    /// A renewal that began at `started` renewed `held` (the worker's
    /// claims that still hold) and says `lost` items were taken from it. A
    /// claim the reader had before the renewal began and that it did not
    /// renew ran out; one it took since may not be known to it yet.
    ///
    /// Returns how many items it newly knows lost. A store that names the
    /// items taken from the worker (PostgreSQL) names those of a claim that
    /// ran out with them; one that does not (SQLite) only lets the claim
    /// run out, whose items not yet ended here are then lost. The larger
    /// of the two counts, not their sum, which would count PostgreSQL's
    /// items twice.
    pub fn renewed(
        &self,
        started: Instant,
        lease: Duration,
        held: &[ClaimId],
        lost: &[u64],
    ) -> u64 {
        let held: HashSet<ClaimId> = held.iter().copied().collect();
        let mut of_claims = 0;
        let gone: Vec<ClaimId> = match self.issued.lock() {
            Ok(mut issued) => {
                let mut gone = Vec::new();
                issued.retain(|claim, issued| {
                    let ran_out = issued.had < started && !held.contains(claim);
                    if ran_out {
                        gone.push(*claim);
                        of_claims += issued.left;
                    }
                    !ran_out
                });
                gone
            }
            Err(_) => Vec::new(),
        };
        if !gone.is_empty()
            && let Ok(mut lost_claims) = self.lost_claims.lock()
        {
            lost_claims.extend(gone);
            self.any_lost.store(true, Ordering::Release);
        }
        if !lost.is_empty()
            && let Ok(mut lost_items) = self.lost_items.lock()
        {
            lost_items.extend(lost.iter().map(|seq| (*seq, started)));
            self.any_lost.store(true, Ordering::Release);
        }
        self.holds_until_ms
            .store(self.ms(started + lease), Ordering::Release);
        if self.any_lost.load(Ordering::Acquire)
            && let Ok(flights) = self.flights.lock()
        {
            // Calls under way for items lost: another worker may be
            // answering them; this one stops paying for them.
            for (seq, (claim, token)) in flights.iter() {
                if self.lost(*claim, *seq) {
                    token.cancel();
                }
            }
        }
        self.renewed.notify_waiters();
        of_claims.max(lost.len() as u64)
    }

    /// A call for item `seq` of `claim` begins: its token, a child of
    /// `parent`, is cancelled once the item is known lost.
    pub fn flight(
        gate: &Arc<Self>,
        claim: ClaimId,
        seq: u64,
        parent: &CancellationToken,
    ) -> Flight {
        let token = parent.child_token();
        if gate.lost(claim, seq) {
            token.cancel();
        }
        if let Ok(mut flights) = gate.flights.lock() {
            flights.insert(seq, (claim, token.clone()));
        }
        Flight {
            gate: gate.clone(),
            seq,
            token,
        }
    }

    /// Whether item `seq` of `claim` is known lost.
    pub fn lost(&self, claim: ClaimId, seq: u64) -> bool {
        if !self.any_lost.load(Ordering::Acquire) {
            return false;
        }
        if self
            .lost_claims
            .lock()
            .is_ok_and(|claims| claims.contains(&claim))
        {
            return true;
        }
        let Some(told) = self
            .lost_items
            .lock()
            .ok()
            .and_then(|items| items.get(&seq).copied())
        else {
            return false;
        };
        // Lost under a claim the reader had when the renewal that told of
        // it began (a claim it took since may have taken the item back; a
        // claim no longer issued is lost, or has no item making calls).
        self.issued
            .lock()
            .is_ok_and(|issued| issued.get(&claim).is_none_or(|issued| issued.had < told))
    }

    /// Waits until item `seq` of `claim` surely holds (a renewal after a
    /// stall says so); `false` when it was lost.
    pub async fn admit(&self, claim: ClaimId, seq: u64) -> bool {
        // The common case, on every call: nothing lost, the lease holds.
        if !self.any_lost.load(Ordering::Acquire)
            && self.ms(Instant::now()) < self.holds_until_ms.load(Ordering::Acquire)
        {
            return true;
        }
        loop {
            let renewed = self.renewed.notified();
            if self.lost(claim, seq) {
                return false;
            }
            if self.ms(Instant::now()) < self.holds_until_ms.load(Ordering::Acquire) {
                return true;
            }
            renewed.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_call_under_way_is_cancelled_when_its_item_or_claim_is_known_lost() {
        let lease = Duration::from_secs(3);
        let gate = Arc::new(LeaseGate::new(lease));
        let abort = CancellationToken::new();
        gate.claimed(1, 10);
        gate.claimed(2, 10);
        let a = LeaseGate::flight(&gate, 1, 10, &abort);
        let b = LeaseGate::flight(&gate, 2, 20, &abort);
        let c = LeaseGate::flight(&gate, 2, 21, &abort);
        tokio::time::advance(Duration::from_millis(10)).await;
        // Claim 1 ran out; item 21 of claim 2 was taken by another worker:
        // claim 1's ten items are known lost (a store that names item 21
        // would name claim 1's items too).
        assert_eq!(gate.renewed(Instant::now(), lease, &[2], &[21]), 10);
        assert!(a.token().is_cancelled());
        assert!(!b.token().is_cancelled());
        assert!(c.token().is_cancelled());
        // A call begun for a lost item is cancelled at once; a dropped
        // flight is forgotten.
        assert!(
            LeaseGate::flight(&gate, 1, 11, &abort)
                .token()
                .is_cancelled()
        );
        drop(b);
        assert!(!gate.flights.lock().unwrap().contains_key(&20));
        // The session's abort reaches every call.
        let d = LeaseGate::flight(&gate, 2, 22, &abort);
        abort.cancel();
        assert!(d.token().is_cancelled());
    }

    #[tokio::test(start_paused = true)]
    async fn an_item_taken_back_under_a_later_claim_is_not_lost_with_the_first() {
        // Item 10 of claim 1 was lost while the store was down; this
        // worker's own claim 2 took it back after the renewal that told
        // of it began. Its calls under claim 2 go on; those under claim 1
        // do not.
        let lease = Duration::from_secs(3);
        let gate = Arc::new(LeaseGate::new(lease));
        let abort = CancellationToken::new();
        gate.claimed(1, 10);
        tokio::time::advance(Duration::from_millis(10)).await;
        let told = Instant::now();
        tokio::time::advance(Duration::from_millis(10)).await;
        gate.claimed(2, 10);
        gate.renewed(told, lease, &[1, 2], &[10]);
        assert!(gate.lost(1, 10));
        assert!(!gate.lost(2, 10));
        assert!(
            !LeaseGate::flight(&gate, 2, 10, &abort)
                .token()
                .is_cancelled()
        );
        assert!(gate.admit(2, 10).await);
        assert!(!gate.admit(1, 10).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_id_given_again_names_a_claim_that_is_not_lost() {
        // Claim 1 ran out; a store that gives its id to a new claim gives
        // a claim that holds (a SQLite store did, and the new claim's
        // items were let go while the store held them for this worker).
        let lease = Duration::from_secs(3);
        let gate = Arc::new(LeaseGate::new(lease));
        gate.claimed(1, 10);
        tokio::time::advance(Duration::from_millis(10)).await;
        gate.renewed(Instant::now(), lease, &[], &[]);
        assert!(!gate.admit(1, 10).await);
        gate.claimed(1, 10);
        assert!(!gate.lost(1, 11));
        assert!(gate.admit(1, 11).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_whose_items_all_ended_is_not_taken_for_lost_when_the_store_drops_it() {
        // The store drops a claim once its items have all ended; the
        // renewals after no longer find it. Nothing was lost: calls stay
        // on the fast path, and the next claim's calls go out.
        let lease = Duration::from_secs(3);
        let gate = Arc::new(LeaseGate::new(lease));
        gate.claimed(1, 2);
        gate.claimed(2, 1);
        gate.item_ended(1);
        gate.item_ended(1);
        tokio::time::advance(Duration::from_millis(10)).await;
        assert_eq!(gate.renewed(Instant::now(), lease, &[2], &[]), 0);
        assert!(!gate.any_lost.load(Ordering::Acquire));
        assert!(gate.admit(2, 20).await);
        // A claim with an item still under way that the renewal does not
        // find ran out, with its one item, once.
        tokio::time::advance(Duration::from_millis(10)).await;
        assert_eq!(gate.renewed(Instant::now(), lease, &[], &[]), 1);
        assert_eq!(gate.renewed(Instant::now(), lease, &[], &[]), 0);
        assert!(!gate.admit(2, 20).await);
    }

    #[tokio::test(start_paused = true)]
    async fn the_items_a_renewal_says_lost_are_counted_once_whether_the_store_names_them_or_not() {
        let lease = Duration::from_secs(3);
        // PostgreSQL: claim 1's two items not ended here were taken, and
        // the renewal names them as its claim runs out: two, not four.
        let gate = LeaseGate::new(lease);
        gate.claimed(1, 3);
        gate.item_ended(1);
        tokio::time::advance(Duration::from_millis(10)).await;
        assert_eq!(gate.renewed(Instant::now(), lease, &[], &[11, 12]), 2);
        // SQLite: the claim runs out and names nothing.
        let gate = LeaseGate::new(lease);
        gate.claimed(1, 3);
        gate.item_ended(1);
        tokio::time::advance(Duration::from_millis(10)).await;
        assert_eq!(gate.renewed(Instant::now(), lease, &[], &[]), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_past_the_lease_waits_for_the_renewal_that_says_whether_its_claim_holds() {
        let lease = Duration::from_secs(3);
        let gate = std::sync::Arc::new(LeaseGate::new(lease));
        gate.claimed(1, 10);
        gate.claimed(2, 10);
        assert!(gate.admit(1, 10).await, "within the lease");
        // A stall past the lease: calls wait for the next renewal.
        tokio::time::advance(Duration::from_secs(4)).await;
        let tracker = tokio_util::task::TaskTracker::new();
        let waiting = {
            let gate = gate.clone();
            tracker.spawn(async move { (gate.admit(1, 10).await, gate.admit(2, 20).await) })
        };
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        // A claim taken while the renewal runs is not among those it
        // renewed, and is not lost for that.
        let renewal = Instant::now();
        tokio::time::advance(Duration::from_millis(5)).await;
        gate.claimed(3, 10);
        // It renews claim 2 only: claim 1 ran out, and item 21 was taken.
        gate.renewed(renewal, lease, &[2], &[21]);
        assert_eq!(waiting.await.unwrap(), (false, true));
        assert!(!gate.admit(2, 21).await);
        assert!(gate.admit(2, 22).await);
        assert!(
            gate.admit(3, 30).await,
            "a claim newer than the renewal holds"
        );
    }
}
