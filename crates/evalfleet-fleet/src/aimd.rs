//! The adaptive concurrency controller: it looks for the fewest calls in
//! flight that get the most work out of an endpoint, and holds there.
//!
//! It sees what each call's outcome says: a successful call's round trip
//! (to its first token when streamed), its whole latency and the tokens it
//! brought; that the endpoint pushed back (429, 503, 408, a timeout, a
//! refused connection); or that a stream was cut when another call arrived.
//! At the end of each interval (one round trip long) it decides once.
//!
//! **Throughput, not latency, says when to stop.** Each call that started
//! with the limit reached counts towards that level of the limit; by
//! Little's law a level's throughput is `level x work / latency` over its
//! calls (work: completion tokens, or one answer where they are unknown).
//! On a server that batches (vLLM, SGLang, llama.cpp's slots), latency
//! grows with the calls in flight while throughput grows too, so a rule that
//! cut on rising round trips kept such servers far below what they can do.
//! Once a level has calls enough to be judged:
//!
//! - it is compared with the best level below it: the limit grows only
//!   while throughput grows by at least `gain` (0.2) of what the step would
//!   give if every added call were served as fast as the others. Where it
//!   does not (a queue: throughput flat; or falling), the limit goes back
//!   to the fewest calls that got within [`NEAR`] of the best throughput
//!   seen, and is held there, probing upward again only after a hold that
//!   doubles with each probe that found nothing ([`FLAT_HOLD`] first,
//!   [`FLAT_HOLD_MAX`] at most);
//! - the first level judged with nothing known below it is compared with
//!   half of it once (a server that queues from its first call is found
//!   from above as well as from below), unless its first calls, sent at
//!   once, took about as long each for their work (no queue: fewer calls
//!   could only do less);
//! - while the limit is reached and throughput grows it doubles (slow start,
//!   until the first cut), or quadruples where the calls it added were
//!   served about as fast as the others ([`FAST_GAIN`]), each such level
//!   after a fast step doubling the factor, to sixteen at most
//!   ([`FAST_FACTOR_MAX`]); then it grows by
//!   one, or along CUBIC's curve after a cut for back pressure; steps are a
//!   tenth of the limit at least, so that no step is judged on noise alone.
//!   In slow start a level is judged on the calls that filled it as well,
//!   as soon as they are back (the first level's on all its calls): a
//!   step a round trip (a W7 run goes 8, 32, 256, 1,024 calls in 0.17 s;
//!   by fours only, 0.31 s; by doublings, half a second; before levels
//!   were judged on the calls that filled them, 1.7 s after the first
//!   decision). A big step that did not pay leaves a gap below it: the
//!   limit goes where Little's law puts the knee (the work a second the
//!   step's calls did, times what a unit of work took at the level below,
//!   unqueued), or looks halfway down, and grows from there in small
//!   steps.
//!   A cut out of slow start goes back at most to where the last step came
//!   from, and the curve starts flat there.
//!
//! **Streams cut when another call arrives** (servers that serve one call
//! at a time and end the running stream for the next, as llama-cpp-python's)
//! are the clearest sign there is: when they are most of an interval's
//! back pressure, the limit goes to its least at once and stays there for
//! [`CUT_HOLD`], doubling with each probe that cuts again (up to
//! [`CUT_HOLD_MAX`]): one cut stream per several minutes at most.
//!
//! Such a server cuts the calls sent at once at the start as well: each of
//! the first eight ends the one before it after its prompt and a token, and
//! those already sent go on cutting each other after the limit is one (a
//! run of 24 items lost 4 s of 46 so). So a **streamed** endpoint whose
//! engine said nothing of its capacity opens at two calls: the second's
//! arrival cuts the first at once where the server serves one at a time
//! (one cut, and the limit is one, held as above), and where two streams
//! flow at once, two calls come back whole, or four fail, the limit goes on
//! from where it would have started (see [`Aimd::open_streamed`]). A cut
//! by chance before the second stream's first token is taken for such a
//! server too: the hold's probes find out.
//!
//! **Back pressure** beyond what comes whatever the load cuts the limit to
//! the share of calls that got through (by `decrease_ratio` at least, by
//! half at most); afterwards the limit grows back along CUBIC's curve:
//! quickly towards where it was cut, flattening as it gets there, then
//! probing past it faster and faster.
//!
//! Some endpoints refuse a share of calls at any load (a 503 or 408 now and
//! then, with no quota behind it). Cutting the limit for each would bring it
//! down to nothing. Overload shows as a share of refusals that grows with
//! the limit once it passes what the endpoint takes; sporadic refusals keep
//! their share whatever the limit. So the controller keeps the share of
//! back pressure seen at each level of the limit (recent intervals weigh
//! most), takes the share over the lowest levels, as many as it takes to
//! have seen a thousand calls, as the background, and counts an interval's
//! back pressure only when its share is clearly above it: by [`Z`]
//! standard errors of the difference of two shares, the interval's and the
//! background's (a background known from few calls is uncertain too; with
//! a test on the interval's share alone, one in a few intervals crossed the
//! line at 7% sporadic refusals, and each crossing cut the limit), in two
//! intervals in a row, or by [`Z_ALONE`] in one.
//!
//! **An engine that reports its own state** (llama.cpp's slots, vLLM's and
//! SGLang's queue) is believed over all of this: its capacity is where the
//! limit starts, and calls waiting in its queue while the limit is reached
//! bring the limit down by as many, held as for a flat throughput.
//!
//! The round trip that sets the interval follows the lower envelope of the
//! intervals' mean round trips: it falls at once and rises slowly.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

pub use evalfleet_config::AimdSettings;

/// Weight of a shorter interval latency in the baseline (it falls fast).
const ALPHA_DOWN: f64 = 0.5;
/// Weight of a longer one (it climbs slowly).
const ALPHA_UP: f64 = 0.05;
/// The interval before any RTT is known.
const FIRST_INTERVAL: Duration = Duration::from_millis(100);
/// A share of back pressure that always counts, whatever the background.
const MOSTLY: f64 = 0.5;
/// Each interval, what is known of every level of the limit fades by this.
const LEVEL_FADE: f64 = 0.99;
/// Calls (faded) the background is taken over.
const LEVEL_KNOWN: f64 = 200.0;
/// Standard errors by which an interval's share of back pressure must
/// exceed the background's to count.
const Z: f64 = 3.5;
/// Standard errors beyond which one interval's back pressure counts
/// without the interval before beyond as well.
const Z_ALONE: f64 = 5.0;
/// CUBIC's constant, in limit units per round trip cubed.
const CUBIC_C: f64 = 0.4;
/// The most the curve may raise the limit in one round trip, as a share of
/// it (past where it was cut, the curve steepens; refusals show only at the
/// next decision).
const CUBIC_STEP: f64 = 0.25;
/// The background share assumed in the test of an interval, at least (so
/// that one refusal among a handful of calls is not proof of overload).
const BACKGROUND_FLOOR: f64 = 0.05;
/// The most a level's slowest call may take for a unit of work, as a
/// multiple of its fastest, for its calls to count as served without a
/// queue (a server that queues from its first call gives the last of a
/// level's calls several times the first's time; one that serves them
/// side by side, about the same, short answers' prefill aside).
const QUEUE_SPREAD: f64 = 2.0;
/// In slow start, a level whose added calls were served at least this
/// share as fast as the others (or a first level whose calls showed no
/// queue) is followed by [`FAST_FACTOR`] times as many calls, not twice:
/// an endpoint with room for every call is filled in half the round trips,
/// and one with a knee is passed by no more than where a doubling from
/// below the knee would have gone twice.
const FAST_GAIN: f64 = 0.8;
const FAST_FACTOR: usize = 4;
/// Each such level after a fast step makes the next step twice as big,
/// up to this factor: an endpoint with room for a thousand calls is
/// filled in three steps from eight, not four (each step waits for its
/// level's calls, and a client near its core's limit fills a level slowly).
const FAST_FACTOR_MAX: usize = 16;
/// Levels whose throughput is within this share of the best are as good:
/// the fewest calls among them is where the limit goes.
const NEAR: f64 = 0.97;
/// Calls a level needs before it is judged: at least this many...
const JUDGE_MIN: f64 = 8.0;
/// ...and this share of the level (a round trip's worth, at most
/// [`JUDGE_MAX`]).
const JUDGE_SHARE: f64 = 0.5;
const JUDGE_MAX: f64 = 32.0;
/// A level's throughput is that of about this many round trips' worth of
/// its latest calls...
const RATE_MEMORY: f64 = 2.0;
/// ...and of this many calls at least.
const RATE_MEMORY_MIN: f64 = 16.0;
/// The first hold below a level whose throughput was flat, and the most.
const FLAT_HOLD: Duration = Duration::from_secs(15);
const FLAT_HOLD_MAX: Duration = Duration::from_secs(300);
/// The first hold after streams were cut, and the most.
const CUT_HOLD: Duration = Duration::from_secs(300);
const CUT_HOLD_MAX: Duration = Duration::from_secs(1800);

/// A step up from `level`: a tenth of it, one at least (a step of one at a
/// large level would be judged on noise).
fn tenth(level: usize) -> usize {
    (level / 10).max(1)
}

/// Calls a level needs before it is judged.
fn needed(level: usize) -> f64 {
    (level as f64 * JUDGE_SHARE).clamp(JUDGE_MIN, JUDGE_MAX)
}

/// The share of a perfect step's gain that going from `reference` calls
/// (`below` work a second) to `level` calls (`now`) brought: 1 where every
/// added call was served as fast as the others.
fn gain(reference: usize, below: f64, level: usize, now: f64) -> f64 {
    (now / below - 1.0) / (level as f64 / reference as f64 - 1.0)
}

/// The furthest one step of growth goes from `level`.
fn step_past(level: usize) -> usize {
    ((level as f64 * (1.0 + CUBIC_STEP)) as usize).max(level + tenth(level))
}

/// What a successful call tells the controller.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// The whole call, to its last token: a decision waits that long, so
    /// that the calls of the level it judges are back (a first token comes
    /// long before what a level of the limit brings is known).
    pub latency: Duration,
    /// The work it brought: completion tokens, or 1 (an answer) where they
    /// are not known.
    pub work: f64,
}

impl Sample {
    /// A call of one unit of work that took `latency`.
    pub fn of(latency: Duration) -> Self {
        Self { latency, work: 1.0 }
    }
}

/// What a finished call tells the controller.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Signal {
    /// A successful call.
    Success(Sample),
    /// The endpoint pushed back: 429, 503, 408, a timeout, a refused connection.
    BackPressure,
    /// The stream was ended without a `finish_reason` after another call
    /// started: the server ends a running stream for the next call (or cut
    /// it by chance: only a share beyond the background counts).
    Cut,
    /// Neither (a 500, a malformed answer): no evidence about load.
    Neutral,
}

/// Why the limit moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    SlowStart,
    Increase,
    BackPressure,
    /// Throughput stopped growing (or fell) with more calls in flight.
    Flat,
    /// A look below the first level judged.
    ProbeDown,
    /// Streams were cut when other calls arrived.
    Cut,
    /// The engine said how many calls it serves at once.
    EngineCapacity,
    /// The engine's own queue held calls.
    EngineQueue,
    /// A streamed endpoint's first calls, two at once, until they show
    /// whether it serves more than one.
    StreamOpening,
    /// They were not cut (two flowed at once, two came back whole, or
    /// calls failed): the limit goes where it would have started.
    StreamOpened,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SlowStart => "slow start",
            Self::Increase => "throughput grew at the limit",
            Self::BackPressure => "back pressure",
            Self::Flat => "throughput stopped growing with more calls in flight",
            Self::ProbeDown => "measuring the throughput of fewer calls",
            Self::Cut => "streams were cut when another call arrived (one call at a time)",
            Self::EngineCapacity => "the engine's reported capacity",
            Self::EngineQueue => "calls waited in the engine's queue",
            Self::StreamOpening => {
                "two streams first, to see whether the server serves more than one at a time"
            }
            Self::StreamOpened => {
                "the first streams were not cut (two flowed at once, two came back whole, or calls failed)"
            }
        }
    }
}

/// A change of the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub from: usize,
    pub to: usize,
    pub reason: Reason,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Regain {
    /// The limit the cut came from (CUBIC's W_max).
    from: f64,
    /// Round trips until the curve is back there (CUBIC's K).
    k: f64,
    /// Round trips since the cut.
    intervals: u32,
}

impl Regain {
    fn new(from: usize, to: usize) -> Self {
        let from = from as f64;
        let k = ((from - to as f64).max(0.0) / CUBIC_C).cbrt();
        Self {
            from,
            k,
            intervals: 0,
        }
    }

    /// The limit on the curve one more round trip on.
    fn next(&mut self) -> f64 {
        self.intervals += 1;
        let t = f64::from(self.intervals) - self.k;
        self.from + CUBIC_C * t * t * t
    }
}

/// What the calls started at one level of the limit brought (the latest
/// weigh most).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Rate {
    /// Calls ever seen (judging needs enough of them; fading does not
    /// make a level unknown again, it makes its figure recent).
    seen: f64,
    calls: f64,
    work: f64,
    /// Seconds of latency.
    busy: f64,
}

/// Why the limit is held, and until when.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Hold {
    /// The limit may not pass this...
    at: usize,
    /// ...before then; after, one step past it is a probe.
    until: Instant,
    /// Probes past it that found nothing, in a row.
    strikes: u32,
    cut: bool,
}

impl Hold {
    fn length(cut: bool, strikes: u32) -> Duration {
        let (first, most) = if cut {
            (CUT_HOLD, CUT_HOLD_MAX)
        } else {
            (FLAT_HOLD, FLAT_HOLD_MAX)
        };
        first.saturating_mul(1 << strikes.min(10)).min(most)
    }
}

/// A streamed endpoint's first calls, two at once (see
/// [`Aimd::open_streamed`]).
#[derive(Debug, Clone, Copy, PartialEq)]
struct StreamOpening {
    /// Where the limit goes once two streams were served at once.
    target: usize,
    /// Streams whose first token came and that have not ended.
    flowing: usize,
    /// Calls that came back whole, and the others that ended.
    whole: u32,
    ended: u32,
}

/// Calls of the opening that ended neither whole nor cut (errors) after
/// which it is over: what they say is the controller's to judge.
const OPENING_ENDED: u32 = 4;

/// The controller's state. Time is passed in, so it runs on any clock.
#[derive(Debug, Clone)]
pub struct Aimd {
    settings: AimdSettings,
    limit: usize,
    slow_start: bool,
    interval_end: Instant,
    samples: u32,
    latency_sum: f64,
    /// Calls that ended in this interval, those that pushed back, and those
    /// of them that were cut streams.
    ended: u32,
    pushed_back: u32,
    cut: u32,
    /// Calls that started in this interval.
    started: u32,
    /// The factor of slow start's last step.
    step: usize,
    /// The last calls that ended at this limit (as many as the limit,
    /// three at least), whether each was a cut stream, whatever the
    /// intervals: a server that cuts every running stream may end calls
    /// farther apart than an interval lasts (no answer comes whole to
    /// time a round trip by), and its cuts must still add up.
    recent: std::collections::VecDeque<bool>,
    /// Until the limit first moves: the least and the most seconds a unit
    /// of work took in one call. Calls sent at once to a server that
    /// serves fewer at a time wait in its queue, the last several times as
    /// long as the first; served side by side, they take about as long.
    opening: Option<(f64, f64)>,
    /// Whether the last interval's back pressure was clearly beyond the
    /// background (see [`Aimd::excess`]).
    beyond_before: bool,
    /// Per level of the limit (eight a doubling): calls seen and those
    /// that pushed back, fading.
    levels: Vec<(i32, f64, f64)>,
    /// Per limit: the calls started there with the limit reached.
    rates: BTreeMap<usize, Rate>,
    reached: bool,
    /// Since the last cut for back pressure: the limit before it, and the
    /// round trips since (CUBIC's regain).
    regain: Option<Regain>,
    hold: Option<Hold>,
    /// Whether the last level judged paid for its step.
    growing: bool,
    /// The lowest level looked below (each is looked below once).
    looked_below: Option<usize>,
    /// What the engine said it runs at once: the limit never passes it.
    capacity: Option<usize>,
    /// A streamed endpoint's first calls, while they are two at once.
    stream_opening: Option<StreamOpening>,
    /// Whether they ever were (an endpoint opens so once).
    stream_opened: bool,
    /// The engine's queue at its last reading.
    engine_last: Option<f64>,
    /// Calls waiting in the engine's queue, as it last said.
    engine_waiting: Option<f64>,
    baseline: Option<f64>,
}

impl Aimd {
    pub fn new(settings: AimdSettings, now: Instant) -> Self {
        let limit = settings
            .initial
            .clamp(settings.min.max(1), settings.max.max(1));
        Self {
            settings,
            limit,
            slow_start: limit < settings.max,
            interval_end: now + FIRST_INTERVAL,
            samples: 0,
            latency_sum: 0.0,
            ended: 0,
            started: 0,
            step: 2,
            pushed_back: 0,
            cut: 0,
            recent: std::collections::VecDeque::new(),
            beyond_before: false,
            opening: Some((f64::INFINITY, 0.0)),
            levels: Vec::new(),
            rates: BTreeMap::new(),
            reached: false,
            regain: None,
            hold: None,
            looked_below: None,
            growing: false,
            capacity: None,
            stream_opening: None,
            stream_opened: false,
            engine_waiting: None,
            engine_last: None,
            baseline: None,
        }
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Whether streams cut as other calls arrived brought the limit to
    /// its least (and hold it there).
    pub fn serves_one_at_a_time(&self) -> bool {
        self.hold.is_some_and(|hold| hold.cut)
    }

    /// The baseline latency of a whole call (the decision interval), once
    /// known.
    pub fn baseline_latency(&self) -> Option<Duration> {
        self.baseline.map(Duration::from_secs_f64)
    }

    /// Called when a call starts, with the calls in flight counting it;
    /// the level of the limit the call will teach about, if any. A call
    /// counts towards the limit when it starts with the limit reached
    /// (the calls that fill a limit just raised run beside fewer, and
    /// where the knee is, a few calls make the difference); in slow start,
    /// also when it starts above the level before: the calls that fill a
    /// doubled limit run beside about as many as it allows, whether a
    /// doubling pays shows in them as well, and waiting for the calls
    /// that replace them costs a round trip each doubling.
    pub fn on_start(&mut self, in_flight: usize) -> Option<usize> {
        self.started += 1;
        if in_flight >= self.limit {
            self.reached = true;
        }
        // (The first level's calls all go out at once, and run beside
        // each other: all of them count, and the first level is judged as
        // soon as they are back, not a round trip or two later.)
        let filling = self.slow_start && (2 * in_flight > self.limit || self.opening.is_some());
        (in_flight >= self.limit || filling).then_some(self.limit)
    }

    /// The endpoint's calls are streamed and nothing has been sent yet: two
    /// calls first. A server that serves one stream at a time cuts the
    /// first as the second arrives (one cut: the limit goes to its least
    /// and is held, as for cuts); one where two streams flow at once, or
    /// two calls come back whole, takes the limit where it would have
    /// started. Not where the engine said its capacity.
    pub fn open_streamed(&mut self) -> Option<Decision> {
        // Two calls, or the least the settings allow.
        let two = self.settings.min.max(2);
        if self.capacity.is_some()
            || std::mem::replace(&mut self.stream_opened, true)
            || self.ended > 0
            || !self.rates.is_empty()
            || self.limit <= two
        {
            return None;
        }
        self.stream_opening = Some(StreamOpening {
            target: self.limit,
            flowing: 0,
            whole: 0,
            ended: 0,
        });
        let decision = self.set(two, Reason::StreamOpening);
        // The first level is still to come.
        self.opening = Some((f64::INFINITY, 0.0));
        decision
    }

    /// Whether the first calls of a streamed endpoint are watched (their
    /// first tokens are told with [`Aimd::on_first_token`]).
    pub fn stream_opening(&self) -> bool {
        self.stream_opening.is_some()
    }

    /// A streamed call's first token came, while the first calls are
    /// watched.
    pub fn on_first_token(&mut self, now: Instant) -> Option<Decision> {
        let opening = self.stream_opening.as_mut()?;
        opening.flowing += 1;
        // Two streams flow at once: the server serves more than one.
        (opening.flowing >= 2).then(|| self.opened(now)).flatten()
    }

    /// The opening is over without a cut: the limit goes where it would
    /// have started, and slow start judges it as a first level.
    fn opened(&mut self, now: Instant) -> Option<Decision> {
        let opening = self.stream_opening.take()?;
        self.new_interval(now + FIRST_INTERVAL);
        let decision = self.set(opening.target, Reason::StreamOpened);
        self.opening = Some((f64::INFINITY, 0.0));
        decision
    }

    /// A call of the opening was dropped before it ended (moved to another
    /// endpoint, a hedge that lost, abandoned): it no longer flows, and
    /// counts as a call that ended without an answer.
    pub fn on_dropped(&mut self, now: Instant, flowed: bool) -> Option<Decision> {
        self.opening_end(now, Signal::Neutral, flowed)
    }

    /// A call of the opening ended other than cut (`flowed`: its first
    /// token had come); a cut is decided on as any other (see
    /// [`Aimd::one_at_a_time`]).
    fn opening_end(&mut self, now: Instant, signal: Signal, flowed: bool) -> Option<Decision> {
        let opening = self.stream_opening.as_mut()?;
        if flowed {
            opening.flowing = opening.flowing.saturating_sub(1);
        }
        match signal {
            Signal::Success(_) => {
                opening.whole += 1;
                (opening.whole >= 2).then(|| self.opened(now)).flatten()
            }
            // (Not passed: a cut is decided on by the rule for cuts.)
            Signal::Cut => None,
            Signal::BackPressure | Signal::Neutral => {
                opening.ended += 1;
                (opening.ended >= OPENING_ENDED)
                    .then(|| self.opened(now))
                    .flatten()
            }
        }
    }

    /// The engine said it serves `capacity` calls at once: the limit starts
    /// there (within its bounds) and does not pass it; the search goes on
    /// below it.
    pub fn on_capacity(&mut self, capacity: usize) -> Option<Decision> {
        let floor = self.settings.min.max(1);
        let to = capacity.clamp(floor, self.settings.max.max(floor));
        self.slow_start = false;
        self.capacity = Some(to);
        self.stream_opening = None;
        self.set(to, Reason::EngineCapacity)
    }

    /// The engine said how many calls wait in its queue (all clients'); the
    /// next decision takes it into account.
    pub fn on_engine_queue(&mut self, waiting: f64) {
        // Counted as the least of the last two readings: a queue that
        // lasts, not a batch's prefill that waits a few steps.
        self.engine_waiting = Some(self.engine_last.map_or(0.0, |last| last.min(waiting)));
        self.engine_last = Some(waiting);
    }

    /// Called when a call ends; decides when an interval is over. `level`
    /// is the limit when the call started, if the start reached it.
    pub fn on_end(
        &mut self,
        now: Instant,
        signal: Signal,
        level: Option<usize>,
    ) -> Option<Decision> {
        self.on_stream_end(now, signal, level, false)
    }

    /// [`Aimd::on_end`] for a call whose first token had come (`flowed`)
    /// or not.
    pub fn on_stream_end(
        &mut self,
        now: Instant,
        signal: Signal,
        level: Option<usize>,
        flowed: bool,
    ) -> Option<Decision> {
        self.ended += 1;
        self.recent.push_back(signal == Signal::Cut);
        while self.recent.len() > self.limit.max(3) {
            self.recent.pop_front();
        }
        match signal {
            Signal::Success(sample) => {
                // (The first level's calls only: those of a streamed
                // opening, at two, may end after it.)
                if let Some(opening) = self.opening.as_mut()
                    && level == Some(self.limit)
                {
                    let per_work = sample.latency.as_secs_f64() / sample.work.max(1e-9);
                    opening.0 = opening.0.min(per_work);
                    opening.1 = opening.1.max(per_work);
                }
                self.samples += 1;
                self.latency_sum += sample.latency.as_secs_f64();
                // A call teaches about its level only if the limit stayed
                // there while it ran: one that outlived its level ran
                // beside more calls, or fewer, than the level says.
                if let Some(level) = level.filter(|level| *level == self.limit) {
                    // Each level's figure is that of its last calls: the
                    // endpoint may change (another job takes the GPU).
                    let rate = self.rates.entry(level).or_default();
                    let keep = 1.0 - 1.0 / (level as f64 * RATE_MEMORY).max(RATE_MEMORY_MIN);
                    rate.seen += 1.0;
                    rate.calls = rate.calls * keep + 1.0;
                    rate.work = rate.work * keep + sample.work.max(0.0);
                    rate.busy = rate.busy * keep + sample.latency.as_secs_f64().max(1e-6);
                }
            }
            Signal::BackPressure => self.pushed_back += 1,
            Signal::Cut => {
                self.pushed_back += 1;
                self.cut += 1;
            }
            Signal::Neutral => {}
        }
        if self.stream_opening.is_some() && signal != Signal::Cut {
            return self.opening_end(now, signal, flowed);
        }
        // Cut streams are decided on at once: at a probe past a hold for
        // cuts, the first; else as soon as they are most of half a round
        // trip's calls (a few cut by chance at the start of an interval
        // are not).
        let cuts_now = signal == Signal::Cut && self.one_at_a_time();
        // In slow start, a level is judged as soon as its calls are back:
        // waiting for the interval's end too would cost up to a round trip
        // each doubling.
        // (With the interval's calls as many as the level needs: the
        // test of its back pressure is not made on a handful.)
        let judged_now = self.slow_start
            && self.reached
            && level.is_some_and(|level| level == self.limit)
            && f64::from(self.ended) >= needed(self.limit)
            && self.throughput(self.limit).is_some();
        // The first level is judged on all its calls, once they are back,
        // however late: the first interval counts from the controller's
        // start (the run may register its items for a while before its
        // first call), and a decision at its end would start a new one
        // with the calls already back forgotten, so that the level waited
        // for the next round trip's calls (a round trip lost: 50 ms in
        // W7's fault-free run, 2 s in a run against a mock answering in 2 s).
        let first_level_out = self.opening.is_some()
            && self.stream_opening.is_none()
            && self.reached
            && f64::from(self.ended) < needed(self.limit);
        if (now < self.interval_end || first_level_out) && !cuts_now && !judged_now {
            return None;
        }
        self.decide(now)
    }

    /// Whether this interval's cut streams say the server serves one call
    /// at a time: at a probe past a hold for cuts, or among a streamed
    /// endpoint's first two calls, the first; else when they are most of
    /// half a round trip's calls, three at least (a few cut by chance,
    /// however the interval falls, are not).
    fn one_at_a_time(&self) -> bool {
        let probing_cuts = self
            .hold
            .is_some_and(|hold| hold.cut && self.limit > hold.at);
        let in_interval =
            self.cut >= 3 && 2 * self.cut > self.ended && 2 * self.ended as usize >= self.limit;
        // The same over the last calls, however the intervals fell.
        let cuts = self.recent.iter().filter(|cut| **cut).count();
        let lately =
            cuts >= 3 && 2 * cuts > self.recent.len() && 2 * self.recent.len() >= self.limit;
        self.cut > 0 && (self.stream_opening.is_some() || probing_cuts || in_interval || lately)
    }

    /// The share of back pressure at the lowest levels of the limit seen
    /// lately, over at least [`LEVEL_KNOWN`] calls where there were as
    /// many, and the calls it is taken over.
    fn background(&self) -> (f64, f64) {
        let (mut calls, mut pushed) = (0.0, 0.0);
        for (_, c, p) in &self.levels {
            if calls >= LEVEL_KNOWN {
                break;
            }
            calls += c;
            pushed += p;
        }
        if calls > 0.0 {
            (pushed / calls, calls)
        } else {
            (0.0, 0.0)
        }
    }

    /// Adds the interval's calls to what is known of the limit's level
    /// `limit` (unless `overloaded`: refusals that counted as overload are
    /// not background, and learning them as such would make overload look
    /// like the norm), and fades the rest.
    fn learn_level(&mut self, limit: usize, overloaded: bool) {
        let level = (8.0 * (limit.max(1) as f64).log2()).round() as i32;
        for entry in &mut self.levels {
            entry.1 *= LEVEL_FADE;
            entry.2 *= LEVEL_FADE;
        }
        self.levels.retain(|(_, calls, _)| *calls >= 1.0);
        if overloaded {
            return;
        }
        let (ended, pushed) = (f64::from(self.ended), f64::from(self.pushed_back));
        match self.levels.iter_mut().find(|(l, _, _)| *l == level) {
            Some(entry) => {
                entry.1 += ended;
                entry.2 += pushed;
            }
            None if ended > 0.0 => {
                self.levels.push((level, ended, pushed));
                self.levels.sort_by_key(|(level, _, _)| *level);
            }
            None => {}
        }
    }

    /// The share of this interval's calls pushed back beyond the
    /// background, when it is clearly beyond in this interval and the one
    /// before (or most calls were: that is never background); and whether
    /// this interval's share alone was clearly beyond.
    ///
    /// One interval beyond the line is not enough: at a 7% background,
    /// an interval of a few dozen calls crosses it by chance now and then
    /// (the tail of such a share is wider than the normal test assumes;
    /// in the minute of the scenario of sporadic faults on a 64-slot
    /// queue, 12 refusals of 61 did), and a run of a minute has a
    /// thousand intervals. Overload lasts;
    /// chance seldom crosses twice in a row. A share beyond by
    /// [`Z_ALONE`] standard errors counts at once (a step of a quarter
    /// past what the endpoint takes is that far beyond).
    fn excess(&self) -> (Option<f64>, bool) {
        let (background, known) = self.background();
        // Whether it is beyond is tested over the calls that ended, or in
        // slow start those sent when more: a refusal comes back at once,
        // an answer after the model's time, so as the limit doubles or
        // quadruples, a burst's sporadic refusals are back before any of
        // its answers (three 503s of 96 calls just sent, alone in a short
        // interval, were "most of its calls", and cut the limit from 128
        // to 85). Past slow start, steps are a quarter at most. How far
        // beyond is the share of the calls that ended.
        let sent = if self.slow_start { self.started } else { 0 };
        let n = f64::from(self.ended.max(sent).max(1));
        let tested = f64::from(self.pushed_back) / n;
        let share = f64::from(self.pushed_back) / f64::from(self.ended.max(1));
        let p = background.max(BACKGROUND_FLOOR);
        let error = (p * (1.0 - p) * (1.0 / n + 1.0 / known)).sqrt();
        let beyond = self.pushed_back > 0 && known > 0.0 && tested > background + Z * error;
        let far_beyond = beyond && tested > background + Z_ALONE * error;
        // Most of a handful of calls is proof only where the handful is
        // the limit's worth (a short interval may see one call end).
        let mostly = tested > MOSTLY && self.ended as usize >= self.limit.min(3);
        let excess = (self.pushed_back > 0
            && (beyond && self.beyond_before || far_beyond || mostly))
            .then_some((share - background).max(0.0));
        (excess, beyond)
    }

    /// A level's throughput (work a second), once it has calls enough to
    /// be judged.
    fn throughput(&self, level: usize) -> Option<f64> {
        let rate = self.rates.get(&level)?;
        (rate.seen >= needed(level) && rate.busy > 0.0)
            .then(|| level as f64 * rate.work / rate.busy)
    }

    /// What the throughput of the level now says: `Some(to)` where the
    /// limit should go down to (or stay at: `to == from`) for want of
    /// growth, `None` where it may grow; `Err(())` where it is not known
    /// yet.
    fn judge(&self, from: usize) -> Result<Option<(usize, Reason)>, ()> {
        let Some(now) = self.throughput(from) else {
            return Err(());
        };
        let below = self
            .known()
            .take_while(|(level, _)| *level < from)
            .max_by(|a, b| a.1.total_cmp(&b.1));
        let floor = self.settings.min.max(1);
        let lowest = self.known().next().map_or(from, |(level, _)| level);
        // Nothing is known below the lowest level that serves as well as
        // any: look at half of it, once.
        let look_down = |at: usize| {
            (at == lowest && at > floor && self.looked_below.is_none_or(|l| at < l))
                .then_some(((at / 2).max(floor), Reason::ProbeDown))
        };
        let Some((reference, best_below)) = below else {
            // (Not where the first calls showed no queue: at fewer calls
            // the server could only do less, and the look would cost
            // every run two levels' round trips.)
            let best = self.known().map(|(_, x)| x).fold(now, f64::max);
            return Ok(if now >= NEAR * best && !self.unqueued() {
                look_down(from)
            } else {
                None
            });
        };
        if gain(reference, best_below, from, now) >= self.settings.gain {
            return Ok(None);
        }
        // The step did not pay: back to the fewest calls that did as well
        // as the best level below.
        let to = self
            .known()
            .find(|(level, x)| *level <= reference && *x >= NEAR * best_below)
            .map_or(reference, |(level, _)| level);
        // A big step up from it did not pay: the knee lies between, maybe
        // far above it. The calls the server serves at once are about the
        // work a second it did at `from` times what a unit of work took at
        // `to`, unqueued (Little's law): look there, and grow from there
        // in small steps.
        if from > 2 * to
            && let Some(knee) = self.calls_served(to, now)
            && 10 * knee > 11 * to
        {
            return Ok(Some((knee.min(from / 2), Reason::ProbeDown)));
        }
        // A big step of slow start left nothing known between it and
        // the level it came from: where that step did not scale, the knee
        // lies somewhere between, and the fewest calls that serve as well
        // may be far fewer. Look halfway down, and grow from there in
        // small steps.
        let under = self.known().take_while(|(level, _)| *level < to).last();
        let to_rate = self.throughput(to).unwrap_or(0.0);
        if let Some((under, under_rate)) = under
            && to > 2 * under
            && gain(under, under_rate, to, to_rate) < FAST_GAIN
        {
            return Ok(Some((to / 2, Reason::ProbeDown)));
        }
        Ok(Some(look_down(to).unwrap_or((to.max(floor), Reason::Flat))))
    }

    /// The calls a server that does `rate` work a second keeps busy at once
    /// when each takes as long for its work as at `level` (Little's law).
    fn calls_served(&self, level: usize, rate: f64) -> Option<usize> {
        let at = self.rates.get(&level)?;
        (at.work > 0.0).then(|| (rate * at.busy / at.work).round() as usize)
    }

    /// Whether the level `from` got about as much more work out of the
    /// endpoint as it added calls: by [`FAST_GAIN`] of a perfect step at
    /// least over the best level below, or, with none below, its first
    /// calls showed no queue.
    fn scales(&self, from: usize) -> bool {
        let Some(now) = self.throughput(from) else {
            return false;
        };
        let below = self
            .known()
            .take_while(|(level, _)| *level < from)
            .max_by(|a, b| a.1.total_cmp(&b.1));
        match below {
            Some((reference, best_below)) => gain(reference, best_below, from, now) >= FAST_GAIN,
            None => self.unqueued(),
        }
    }

    /// Whether the calls before the limit first moved, sent at once, took
    /// about as long each for their work: no queue.
    fn unqueued(&self) -> bool {
        self.opening
            .is_some_and(|(fastest, slowest)| slowest <= QUEUE_SPREAD * fastest)
    }

    /// The levels whose throughput is known, fewest calls first.
    fn known(&self) -> impl Iterator<Item = (usize, f64)> + '_ {
        self.rates
            .keys()
            .filter_map(|level| Some((*level, self.throughput(*level)?)))
    }

    /// The limit one step up from `from`, within the hold.
    fn grow(&mut self, from: usize, now: Instant) -> Option<(usize, Reason)> {
        let settings = self.settings;
        if from >= settings.max {
            return None;
        }
        let (to, reason) = if self.slow_start {
            self.step = match self.scales(from) {
                true if self.step >= FAST_FACTOR => (self.step * 2).min(FAST_FACTOR_MAX),
                true => FAST_FACTOR,
                false => 2,
            };
            ((from * self.step).min(settings.max), Reason::SlowStart)
        } else {
            let curve = self.regain.as_mut().map_or(0.0, Regain::next);
            let step = (from as f64 * (1.0 + CUBIC_STEP)) as usize;
            (
                (from + tenth(from))
                    .max((curve as usize).min(step))
                    .min(settings.max),
                Reason::Increase,
            )
        };
        let to = match self.hold {
            Some(hold) if now < hold.until => to.min(hold.at),
            // The hold is over: one step past it, to see.
            Some(hold) => to.min(hold.at + tenth(hold.at)),
            None => to,
        };
        Some((to.min(self.capacity.unwrap_or(usize::MAX)), reason))
    }

    /// Holds the limit at `at` after a probe past `from` found nothing.
    fn hold_at(&mut self, at: usize, cut: bool, now: Instant) {
        let strikes = match self.hold {
            Some(hold) if hold.cut == cut && at <= hold.at => hold.strikes + 1,
            _ => 0,
        };
        self.hold = Some(Hold {
            at,
            until: now + Hold::length(cut, strikes),
            strikes,
            cut,
        });
    }

    fn decide(&mut self, now: Instant) -> Option<Decision> {
        let current = (self.samples > 0).then(|| self.latency_sum / f64::from(self.samples));
        let from = self.limit;
        let settings = self.settings;
        let floor = settings.min.max(1);
        let (excess, beyond) = self.excess();
        self.beyond_before = beyond;
        self.learn_level(from, excess.is_some() || beyond);
        let waiting = self
            .engine_waiting
            .take()
            .filter(|w| *w >= tenth(from) as f64);
        let decision = if self.one_at_a_time() {
            // Most streams cut as other calls arrived: the server serves
            // one at a time.
            self.stream_opening = None;
            self.slow_start = false;
            self.regain = None;
            self.hold_at(floor, true, now);
            Some((floor, Reason::Cut))
        } else if let Some(excess) = excess {
            let was_slow = std::mem::replace(&mut self.slow_start, false);
            // Back to what the endpoint took: the calls beyond it were
            // the excess; by `decrease_ratio` at least, by half at most
            // (out of slow start, as far as the level its last step came
            // from: the step may have been up to sixteenfold).
            let deepest = if was_slow {
                1.0 / self.step as f64
            } else {
                0.5
            };
            let factor = (1.0 - excess).max(deepest).min(settings.decrease_ratio);
            let to = ((from as f64 * factor) as usize).max(floor);
            // Cut again below where the last cut came from: the
            // endpoint takes less than it did, so aim lower (CUBIC's
            // fast convergence). Out of slow start, what got through is
            // where the endpoint's room ended: the curve starts flat
            // there, not bent back towards an overshoot.
            let peak = match self.regain {
                _ if was_slow => to,
                Some(regain) if (from as f64) < regain.from => {
                    (from as f64 * (1.0 + factor) / 2.0) as usize
                }
                _ => from,
            };
            self.regain = Some(Regain::new(peak, to));
            Some((to, Reason::BackPressure))
        } else if let Some(waiting) = waiting.filter(|_| self.reached) {
            self.slow_start = false;
            self.regain = None;
            let to = (from.saturating_sub(waiting.ceil() as usize)).max(floor);
            self.hold_at(to, false, now);
            Some((to, Reason::EngineQueue))
        } else if self.reached {
            // Past slow start, steps are small and the limit moves on
            // before its level's calls are back: while growing, the highest
            // level known stands for it.
            let own = self.judge(from);
            let judged = match own {
                // (Not at a probe past a hold: that is judged on its own.)
                Err(()) if !self.slow_start && self.growing && self.hold.is_none() => {
                    let below: Vec<(usize, f64)> = self
                        .known()
                        .take_while(|(level, _)| *level < from)
                        .collect();
                    match below.last() {
                        // One step past the last level judged against
                        // another, no further.
                        Some(&(level, _)) if below.len() >= 2 && from <= step_past(level) => {
                            self.judge(level)
                        }
                        _ => Err(()),
                    }
                }
                judged => judged,
            };
            match judged {
                Err(()) => None,
                Ok(Some((to, Reason::ProbeDown))) => {
                    let lowest = self.known().next().map(|(level, _)| level);
                    if lowest.is_some_and(|lowest| to < lowest) {
                        self.looked_below = lowest;
                    } else {
                        // Between two levels known: slow start is over.
                        self.growing = false;
                        self.slow_start = false;
                        self.regain = None;
                    }
                    Some((to, Reason::ProbeDown))
                }
                Ok(Some((to, reason))) => {
                    self.growing = false;
                    self.slow_start = false;
                    self.regain = None;
                    self.hold_at(to, false, now);
                    Some((to, reason))
                }
                Ok(None) => {
                    self.growing = true;
                    // A probe past a hold that found growth ends the hold.
                    if own.is_ok() && self.hold.is_some_and(|hold| from > hold.at) {
                        self.hold = None;
                    }
                    self.grow(from, now)
                }
            }
        } else {
            None
        };

        if let Some(current) = current {
            self.baseline = Some(match self.baseline {
                None => current,
                Some(base) => {
                    let alpha = if current < base { ALPHA_DOWN } else { ALPHA_UP };
                    base + alpha * (current - base)
                }
            });
        }
        // One decision per round trip as it is now: after a cut, the calls
        // that queued before it must come back before the next decision.
        let interval = self
            .baseline
            .map_or(FIRST_INTERVAL, |b| {
                Duration::from_secs_f64(b.max(current.unwrap_or(0.0)))
            })
            .clamp(Duration::from_millis(1), Duration::from_secs(30));
        self.new_interval(now + interval);

        let (to, reason) = decision?;
        self.set(to, reason)
    }

    /// A new interval, until `end`: what the last one counted is forgotten.
    fn new_interval(&mut self, end: Instant) {
        self.interval_end = end;
        self.samples = 0;
        self.latency_sum = 0.0;
        self.ended = 0;
        self.started = 0;
        self.pushed_back = 0;
        self.cut = 0;
        self.reached = false;
    }

    fn set(&mut self, to: usize, reason: Reason) -> Option<Decision> {
        let from = self.limit;
        if to == from {
            return None;
        }
        // A level is judged on calls made since the limit came to it: what
        // it did before may be stale (another job has left the GPU, or
        // come).
        self.rates.remove(&to);
        // What ended at the old limit says nothing of the new one.
        self.recent.clear();
        self.opening = None;
        if to >= self.settings.max {
            self.slow_start = false;
        }
        self.limit = to;
        Some(Decision { from, to, reason })
    }
}

#[cfg(test)]
mod tests;
