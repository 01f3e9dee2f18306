//! Outlier detection: which endpoints fail clearly more often than their
//! peers, and for how long an ejected one stays out.
//!
//! Envoy ejects a host whose success rate is far below the mean of the
//! others (over a minimum request volume, with enough hosts to have a
//! mean). A fleet here has one endpoint or a few, so the test is against
//! the others pooled: an endpoint is an outlier when its share of failed
//! calls over the last [`WINDOW`] seconds is at least [`MARGIN`] above that
//! of the others that fail no more often than it does, and the difference is [`Z`] standard errors of a
//! two-proportion test, each side over at least [`MIN_CALLS`]. So an
//! endpoint that fails as often as the rest is never one (every server
//! answering 8% of calls with 500 is a workload, not an outlier), and a
//! single endpoint never is: it has no peers to be judged against (it is
//! taken out only when it is down, see [`super::breaker`]).
//!
//! An ejection lasts `health.ejection` times the number of recent
//! ejections (at most [`MAX_MULTIPLIER`] times), so an endpoint that is
//! ejected again and again stays out longer each time; each `ejection`
//! spent in the run takes one off the count.

use std::time::Duration;

use tokio::time::Instant;

/// Seconds of calls an endpoint is judged over.
pub const WINDOW: usize = 10;
/// Calls an endpoint, and its peers together, must have made in the window.
pub const MIN_CALLS: u64 = 50;
/// How much more often than its peers' calls an outlier's calls fail.
pub const MARGIN: f64 = 0.2;
/// Standard errors the difference must span.
pub const Z: f64 = 3.0;
/// The longest ejection, in multiples of `health.ejection`.
pub const MAX_MULTIPLIER: u32 = 10;

/// An endpoint's calls and failed calls, per second over the last
/// [`WINDOW`] seconds.
#[derive(Debug, Clone, Default)]
pub struct Outcomes {
    calls: [u32; WINDOW],
    faults: [u32; WINDOW],
    /// The second (since the endpoint's origin) of the first slot.
    second: u64,
}

impl Outcomes {
    fn roll(&mut self, second: u64) {
        if second <= self.second {
            return;
        }
        let shift = (second - self.second).min(WINDOW as u64) as usize;
        self.calls.rotate_right(shift);
        self.faults.rotate_right(shift);
        self.calls[..shift].fill(0);
        self.faults[..shift].fill(0);
        self.second = second;
    }

    /// A call ended in `second`; `fault` when it failed through the
    /// endpoint.
    pub fn record(&mut self, second: u64, fault: bool) {
        self.roll(second);
        self.calls[0] += 1;
        if fault {
            self.faults[0] += 1;
        }
    }

    /// Calls and failed calls over the window that ends in `second`.
    pub fn totals(&mut self, second: u64) -> Tally {
        self.roll(second);
        Tally {
            calls: self.calls.iter().map(|c| u64::from(*c)).sum(),
            faults: self.faults.iter().map(|c| u64::from(*c)).sum(),
        }
    }

    /// Forgets everything (an endpoint back from an ejection starts clean).
    pub fn clear(&mut self) {
        self.calls = [0; WINDOW];
        self.faults = [0; WINDOW];
    }
}

/// Calls and failed calls of one endpoint over the window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    pub calls: u64,
    pub faults: u64,
}

impl Tally {
    pub fn share(self) -> f64 {
        if self.calls == 0 {
            0.0
        } else {
            self.faults as f64 / self.calls as f64
        }
    }
}

/// An endpoint judged to be an outlier, with the figures that say so.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outlier {
    /// Its index among the peers given.
    pub index: usize,
    pub own: Tally,
    /// The others, pooled.
    pub others: Tally,
}

/// The outliers among `peers` (the endpoints that take items and are in
/// service), worst first. Each is judged against the peers that fail no
/// more often than it does, pooled: one endpoint failing everything does
/// not hide another failing half its calls.
pub fn outliers(peers: &[Tally]) -> Vec<Outlier> {
    let mut found: Vec<Outlier> = peers
        .iter()
        .enumerate()
        .filter(|(_, own)| own.calls >= MIN_CALLS)
        .filter_map(|(index, own)| {
            let others = peers
                .iter()
                .enumerate()
                .filter(|(j, peer)| *j != index && peer.share() <= own.share())
                .fold(Tally::default(), |sum, (_, t)| Tally {
                    calls: sum.calls + t.calls,
                    faults: sum.faults + t.faults,
                });
            (others.calls >= MIN_CALLS && clearly_worse(*own, others)).then_some(Outlier {
                index,
                own: *own,
                others,
            })
        })
        .collect();
    found.sort_by(|a, b| b.own.share().total_cmp(&a.own.share()));
    found
}

/// Whether `own`'s share of failures is above `others'` by [`MARGIN`] and
/// by [`Z`] standard errors (two-proportion z-test with a pooled share).
fn clearly_worse(own: Tally, others: Tally) -> bool {
    let difference = own.share() - others.share();
    if difference < MARGIN {
        return false;
    }
    let pooled = (own.faults + others.faults) as f64 / (own.calls + others.calls) as f64;
    let error =
        (pooled * (1.0 - pooled) * (1.0 / own.calls as f64 + 1.0 / others.calls as f64)).sqrt();
    error == 0.0 || difference / error >= Z
}

/// How long an endpoint's ejections last: longer for one ejected again and
/// again.
#[derive(Debug, Clone, Default)]
pub struct Ejections {
    multiplier: u32,
    /// When the last ejection was decided, and how long it was.
    last: Option<(Instant, Duration)>,
}

impl Ejections {
    /// An ejection at `now`: how long it lasts, with `base` its unit.
    pub fn eject(&mut self, now: Instant, base: Duration) -> Duration {
        if let Some((at, length)) = self.last {
            // Each `base` spent in service since it came back takes one off.
            let back = at + length;
            let served = now.saturating_duration_since(back);
            let spent = if base.is_zero() {
                u32::MAX
            } else {
                (served.as_secs_f64() / base.as_secs_f64()) as u32
            };
            self.multiplier = self.multiplier.saturating_sub(spent);
        }
        self.multiplier = (self.multiplier + 1).min(MAX_MULTIPLIER);
        let length = base * self.multiplier;
        self.last = Some((now, length));
        length
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tally(calls: u64, faults: u64) -> Tally {
        Tally { calls, faults }
    }

    #[test]
    fn an_endpoint_failing_like_its_peers_is_no_outlier() {
        // Everyone fails 15% of calls: a workload, not an outlier.
        assert!(outliers(&[tally(400, 60), tally(380, 57), tally(420, 63)]).is_empty());
        // Everyone fails everything: nobody is better, nobody is ejected.
        assert!(outliers(&[tally(100, 100), tally(100, 100)]).is_empty());
    }

    #[test]
    fn a_single_endpoint_is_never_an_outlier() {
        assert!(outliers(&[tally(10_000, 10_000)]).is_empty());
    }

    #[test]
    fn an_endpoint_failing_far_more_than_the_others_is_one_worst_first() {
        let found = outliers(&[tally(300, 9), tally(200, 100), tally(300, 240)]);
        let indices: Vec<usize> = found.iter().map(|o| o.index).collect();
        assert_eq!(indices, vec![2, 1]);
        assert_eq!(found[0].others, tally(500, 109));
    }

    #[test]
    fn too_few_calls_on_either_side_prove_nothing() {
        // 10 of 10 failed, but that is too few to judge by.
        assert!(outliers(&[tally(10, 10), tally(500, 5)]).is_empty());
        // Its peers made too few calls to compare with.
        assert!(outliers(&[tally(500, 400), tally(20, 0)]).is_empty());
        // Enough on both sides.
        assert_eq!(outliers(&[tally(60, 40), tally(500, 5)]).len(), 1);
    }

    #[test]
    fn a_small_difference_is_not_enough_however_many_calls() {
        // 10 points worse, over many calls: significant, but not worth an
        // ejection.
        assert!(outliers(&[tally(100_000, 20_000), tally(100_000, 10_000)]).is_empty());
        // 25 points worse over few calls: within the noise of 60 calls?
        // 0.45 vs 0.2 over 60 and 60 calls is 2.9 standard errors: no.
        assert!(outliers(&[tally(60, 27), tally(60, 12)]).is_empty());
    }

    #[test]
    fn the_window_forgets_what_is_older_than_ten_seconds() {
        let mut o = Outcomes::default();
        for _ in 0..30 {
            o.record(100, true);
        }
        o.record(105, false);
        assert_eq!(o.totals(105), tally(31, 30));
        assert_eq!(o.totals(109), tally(31, 30));
        assert_eq!(o.totals(110), tally(1, 0), "second 100 fell out");
        assert_eq!(o.totals(200), tally(0, 0));
        o.record(200, true);
        o.clear();
        assert_eq!(o.totals(200), tally(0, 0));
    }

    #[test]
    fn ejections_grow_while_they_follow_each_other_and_shrink_in_service() {
        let base = Duration::from_secs(30);
        let mut e = Ejections::default();
        let t0 = Instant::now();
        assert_eq!(e.eject(t0, base), base);
        // Ejected again as soon as it came back: twice as long.
        let t1 = t0 + base + Duration::from_secs(5);
        assert_eq!(e.eject(t1, base), base * 2);
        let t2 = t1 + base * 2 + Duration::from_secs(1);
        assert_eq!(e.eject(t2, base), base * 3);
        // It then served well for two units: back down by two, then up one.
        let t3 = t2 + base * 3 + base * 2;
        assert_eq!(e.eject(t3, base), base * 2);
        // Ejected again each time it comes back: never past the cap.
        let mut now = t3;
        let mut length = base * 2;
        for _ in 0..20 {
            now += length;
            length = e.eject(now, base);
        }
        assert_eq!(length, base * MAX_MULTIPLIER);
    }
}
