use std::collections::VecDeque;

use super::*;

fn settings() -> AimdSettings {
    AimdSettings {
        initial: 4,
        min: 1,
        max: 64,
        decrease_ratio: 0.7,
        gain: 0.2,
    }
}

fn ok(ms: u64) -> Signal {
    Signal::Success(Sample::of(Duration::from_millis(ms)))
}

/// Runs one round trip: the limit's worth of calls started (reaching
/// it) and ended with `signal`; the decision it brought.
fn interval(c: &mut Aimd, now: &mut Instant, signal: Signal) -> Option<Decision> {
    let limit = c.limit();
    let round = c.baseline_latency().unwrap_or(FIRST_INTERVAL);
    let mut decision = None;
    for k in 0..limit {
        c.on_start(k + 1);
    }
    for k in 0..limit {
        let at = *now + round * (k as u32 + 1) / limit as u32;
        decision = decision.or(c.on_end(at, signal, Some(limit)));
    }
    *now += round;
    decision
}

#[test]
fn slow_start_quadruples_or_doubles_until_the_first_decrease_then_regains_along_a_cubic() {
    let mut now = Instant::now();
    let mut c = Aimd::new(settings(), now);
    // The first calls all took as long (no queue): four times as many at
    // once.
    // (A level is judged on 8 calls at least: at 4, two round trips.)
    let mut seen = Vec::new();
    while c.limit() == 4 {
        seen.extend(interval(&mut c, &mut now, ok(100)).map(|d| (d.to, d.reason)));
    }
    assert_eq!(seen, vec![(16, Reason::SlowStart)]);
    // Four times the calls, 1.5 x the time each: 2.7 x the throughput, a
    // gain of 0.56 of a perfect step: twice as many, not four times.
    seen.clear();
    while c.limit() == 16 {
        seen.extend(interval(&mut c, &mut now, ok(150)).map(|d| (d.to, d.reason)));
    }
    assert_eq!(seen, vec![(32, Reason::SlowStart)]);
    // Every call of the interval pushed back: half of 32 (where the last,
    // twofold, step came from), not 32 x 0.7.
    let cut = interval(&mut c, &mut now, Signal::BackPressure).unwrap();
    assert_eq!((cut.to, cut.reason), (16, Reason::BackPressure));
    // Out of slow start, the curve starts flat where the cut went (what
    // got through): a tenth a round trip, then faster and faster (by a
    // quarter a round trip at most).
    let mut limits = Vec::new();
    while limits.len() < 7 {
        if let Some(up) = interval(&mut c, &mut now, ok(150)) {
            assert_eq!(up.reason, Reason::Increase);
            limits.push(up.to);
        }
    }
    assert_eq!(limits, vec![17, 19, 23, 28, 35, 43, 53]);
}

#[test]
fn nothing_changes_below_the_limit_and_limits_hold() {
    let mut now = Instant::now();
    let mut c = Aimd::new(settings(), now);
    now += Duration::from_secs(1);
    assert_eq!(c.on_end(now, ok(10), None), None);
    for _ in 0..20 {
        interval(&mut c, &mut now, Signal::BackPressure);
    }
    assert_eq!(c.limit(), 1);
    for _ in 0..400 {
        interval(&mut c, &mut now, ok(10));
    }
    assert_eq!(c.limit(), 64);
}

#[test]
fn an_engine_that_says_its_capacity_starts_there_and_is_not_passed() {
    let mut now = Instant::now();
    let mut c = Aimd::new(
        AimdSettings {
            initial: 8,
            ..settings()
        },
        now,
    );
    let d = c.on_capacity(4).unwrap();
    assert_eq!((d.from, d.to, d.reason), (8, 4, Reason::EngineCapacity));
    for _ in 0..200 {
        interval(&mut c, &mut now, ok(100));
        assert!(c.limit() <= 4, "{}", c.limit());
    }
    assert_eq!(c.limit(), 4, "calls that all scale well keep it at 4");
    // Calls waiting in the engine's queue at the limit bring it down by
    // as many.
    // One reading is a moment (a batch's prefill); two in a row are a
    // queue.
    c.on_engine_queue(2.0);
    assert_eq!(interval(&mut c, &mut now, ok(100)), None);
    c.on_engine_queue(2.0);
    c.on_engine_queue(3.0);
    let d = interval(&mut c, &mut now, ok(100)).unwrap();
    assert_eq!((d.to, d.reason), (2, Reason::EngineQueue));
}

/// How a simulated server serves calls.
#[derive(Clone, Copy)]
enum Server {
    /// One call at a time; a call that arrives ends the running
    /// stream (llama-cpp-python's server).
    CutsOnArrival,
    /// Up to `slots` at once, each slower by `slowdown` for every other
    /// call beside it (continuous batching); the rest wait in a queue.
    Batching { slots: usize, slowdown: f64 },
}

struct Job {
    started: Instant,
    level: Option<usize>,
    /// Seconds of service left at full speed.
    left: f64,
    tokens: f64,
    /// Whether its first token came (streamed runs: after a step served).
    flowed: bool,
}

/// What a simulation came to.
struct Outcome {
    /// Tokens of whole answers a second, over the second half.
    throughput: f64,
    cuts: u32,
    /// Seconds spent at each limit over the second half.
    time_at: BTreeMap<usize, f64>,
    /// When the limit first came to its maximum, from the start.
    at_max: Option<Duration>,
    /// The limits it went through, in order, from the first.
    path: Vec<usize>,
}

impl Outcome {
    fn share_within(&self, low: usize, high: usize) -> f64 {
        let total: f64 = self.time_at.values().sum();
        let within: f64 = self.time_at.range(low..=high).map(|(_, t)| t).sum();
        within / total
    }
}

/// Runs `server` for `seconds` (in steps of 10 ms) with as many calls
/// waiting as the limit lets through, each of 50 to 300 tokens at
/// `per_token` seconds each when served alone.
fn simulate_server(
    server: Server,
    per_token: f64,
    seconds: u64,
    settings: AimdSettings,
    capacity: Option<usize>,
) -> Outcome {
    simulate_calls(server, per_token, seconds, settings, capacity, false)
}

/// [`simulate_server`] with calls streamed or not: streamed, the
/// controller opens at two calls and hears of each first token.
fn simulate_calls(
    server: Server,
    per_token: f64,
    seconds: u64,
    settings: AimdSettings,
    capacity: Option<usize>,
    streamed: bool,
) -> Outcome {
    let step = Duration::from_millis(10);
    let start = Instant::now();
    let mut now = start;
    let mut c = Aimd::new(settings, now);
    if let Some(capacity) = capacity {
        c.on_capacity(capacity);
    }
    if streamed {
        c.open_streamed();
    }
    let mut rng = fastrand::Rng::with_seed(11);
    let (mut serving, mut queue) = (Vec::<Job>::new(), VecDeque::<Job>::new());
    // Streams cut, which the client sees end at the next step.
    let mut cut = Vec::<Job>::new();
    let (mut tokens, mut cuts) = (0.0, 0);
    let mut time_at = BTreeMap::new();
    let mut at_max = None;
    let mut path = vec![c.limit()];
    let half = start + Duration::from_secs(seconds / 2);
    while now < start + Duration::from_secs(seconds) {
        // Calls start while the limit lets them.
        while serving.len() + queue.len() + cut.len() < c.limit() {
            let in_flight = serving.len() + queue.len() + cut.len() + 1;
            let level = c.on_start(in_flight);
            let n = rng.u32(50..=300);
            let job = Job {
                started: now,
                level,
                left: f64::from(n) * per_token,
                tokens: f64::from(n),
                flowed: false,
            };
            match server {
                Server::CutsOnArrival => {
                    cuts += serving.len() as u32;
                    cut.append(&mut serving);
                    serving.push(job);
                }
                Server::Batching { .. } => queue.push_back(job),
            }
        }
        if let Server::Batching { slots, .. } = server {
            while serving.len() < slots
                && let Some(job) = queue.pop_front()
            {
                serving.push(job);
            }
        }
        let speed = match server {
            Server::CutsOnArrival => 1.0,
            Server::Batching { slowdown, .. } => {
                1.0 / (1.0 + slowdown * serving.len().saturating_sub(1) as f64)
            }
        };
        now += step;
        for job in cut.drain(..) {
            c.on_stream_end(now, Signal::Cut, job.level, job.flowed);
        }
        for job in &mut serving {
            job.left -= step.as_secs_f64() * speed;
            if streamed && !job.flowed {
                job.flowed = true;
                c.on_first_token(now);
            }
        }
        let (done, rest): (Vec<Job>, Vec<Job>) = serving.drain(..).partition(|job| job.left <= 0.0);
        serving = rest;
        for job in done {
            if now >= half {
                tokens += job.tokens;
            }
            let latency = now - job.started;
            let sample = Sample {
                latency,
                work: job.tokens,
            };
            c.on_stream_end(now, Signal::Success(sample), job.level, job.flowed);
        }
        if now >= half {
            *time_at.entry(c.limit()).or_insert(0.0) += step.as_secs_f64();
        }
        if path.last() != Some(&c.limit()) {
            path.push(c.limit());
        }
        if c.limit() >= settings.max && at_max.is_none() {
            at_max = Some(now - start);
        }
    }
    Outcome {
        throughput: tokens / (seconds as f64 / 2.0),
        cuts,
        time_at,
        at_max,
        path,
    }
}

fn adaptive() -> AimdSettings {
    AimdSettings {
        initial: 8,
        max: 1024,
        ..settings()
    }
}

/// Tokens a second of a server with `slots` slots served `n` at a time.
fn served(n: usize, slowdown: f64, per_token: f64) -> f64 {
    n as f64 / (1.0 + slowdown * (n - 1) as f64) / per_token
}

#[test]
fn a_server_that_cuts_streams_on_arrival_is_held_at_one_and_probed_rarely() {
    // 175 tokens of 20 ms: 3.5 s a call, 40 minutes.
    let out = simulate_server(Server::CutsOnArrival, 0.02, 2400, adaptive(), None);
    // The first 8 calls cut 7; then one probe at 5 minutes, one at 15,
    // one at 35 (the hold doubles).
    assert!(out.cuts <= 10, "{} cuts", out.cuts);
    assert!(out.share_within(1, 1) > 0.97, "{:?}", out.time_at);
    let serial = 1.0 / 0.02;
    assert!(
        out.throughput > 0.9 * serial,
        "{} vs {serial}",
        out.throughput
    );
}

#[test]
fn a_server_that_queues_without_batching_is_held_at_one() {
    let server = Server::Batching {
        slots: 1,
        slowdown: 0.0,
    };
    let out = simulate_server(server, 0.02, 1200, adaptive(), None);
    assert!(out.share_within(1, 2) > 0.9, "{:?}", out.time_at);
    assert!(out.share_within(1, 1) > 0.7, "{:?}", out.time_at);
    let serial = 1.0 / 0.02;
    assert!(
        out.throughput > 0.95 * serial,
        "{} vs {serial}",
        out.throughput
    );
}

#[test]
fn a_batching_server_is_driven_to_its_knee_though_latency_grows() {
    // Eight slots; each call 15% slower for each other beside it:
    // throughput grows 3.9-fold from one call to eight, latency 2-fold.
    let server = Server::Batching {
        slots: 8,
        slowdown: 0.15,
    };
    let out = simulate_server(server, 0.02, 1200, adaptive(), None);
    assert!(out.share_within(7, 12) > 0.8, "{:?}", out.time_at);
    let best = served(8, 0.15, 0.02);
    assert!(out.throughput > 0.9 * best, "{} vs {best}", out.throughput);
}

#[test]
fn an_engine_with_hundreds_of_slots_is_held_where_more_calls_stop_paying() {
    // vLLM-like: 256 slots, no queue to speak of, each call 15% slower
    // for each other beside it; the first token comes at once. Past
    // about 25 calls a step brings less than a fifth of its share, so
    // the limit must stop there, not run up to its maximum.
    let server = Server::Batching {
        slots: 256,
        slowdown: 0.15,
    };
    let out = simulate_server(server, 0.02, 600, adaptive(), None);
    assert!(out.share_within(10, 60) > 0.9, "{:?}", out.time_at);
    let best = served(256, 0.15, 0.02);
    assert!(out.throughput > 0.8 * best, "{} vs {best}", out.throughput);
}

#[test]
fn a_server_with_many_slots_and_a_queue_is_held_near_its_slots() {
    // W4's backend: 32 slots, a call's time whatever the load.
    let server = Server::Batching {
        slots: 32,
        slowdown: 0.0,
    };
    let out = simulate_server(server, 0.001, 300, adaptive(), None);
    assert!(out.share_within(29, 40) > 0.9, "{:?}", out.time_at);
    let best = served(32, 0.0, 0.001);
    assert!(out.throughput > 0.9 * best, "{} vs {best}", out.throughput);
}

#[test]
fn an_engine_that_said_its_slots_is_kept_at_them() {
    let server = Server::Batching {
        slots: 4,
        slowdown: 0.3,
    };
    let out = simulate_server(server, 0.02, 600, adaptive(), Some(4));
    assert!(out.share_within(3, 4) > 0.9, "{:?}", out.time_at);
    let best = served(4, 0.3, 0.02);
    assert!(out.throughput > 0.9 * best, "{} vs {best}", out.throughput);
}

/// Runs `intervals` round trips of 100 ms with the limit's worth of
/// calls each; `refused(i, limit, draw)` says whether call `i` of an
/// interval pushed back. Returns the limits seen over the last half.
fn simulate(intervals: usize, refused: impl Fn(usize, usize, f64) -> bool) -> (usize, usize) {
    let mut now = Instant::now();
    let mut c = Aimd::new(
        AimdSettings {
            initial: 8,
            max: 128,
            decrease_ratio: 0.9,
            ..settings()
        },
        now,
    );
    let mut rng = fastrand::Rng::with_seed(7);
    let mut seen = Vec::new();
    for round in 0..intervals {
        let limit = c.limit();
        for _ in 0..limit {
            c.on_start(limit);
        }
        // Their ends spread over the round trip, in a random order.
        let start = now;
        let mut order: Vec<usize> = (0..limit).collect();
        rng.shuffle(&mut order);
        for (k, i) in order.into_iter().enumerate() {
            now = start + Duration::from_millis(100) * (k as u32 + 1) / limit as u32;
            let signal = if refused(i, limit, rng.f64()) {
                Signal::BackPressure
            } else {
                ok(100)
            };
            c.on_end(now, signal, Some(limit));
        }
        if round >= intervals / 2 {
            seen.push(c.limit());
        }
    }
    (*seen.iter().min().unwrap(), *seen.iter().max().unwrap())
}

#[test]
fn refusals_that_come_at_any_load_do_not_hold_the_limit_down() {
    // 7% of calls refused (503, 408) whatever the load.
    let (low, _) = simulate(400, |_, _, draw| draw < 0.07);
    assert!(low >= 100, "the limit fell to {low}");
}

#[test]
fn refusals_that_come_with_load_still_cut_the_limit() {
    // An endpoint that takes 40 at once and refuses the rest, with 7%
    // refused at any load besides.
    let (low, high) = simulate(400, |i, _, draw| i >= 40 || draw < 0.07);
    // (Past where it was last cut, CUBIC's curve probes by a quarter a
    // round trip, and refusals count when beyond in two intervals in a
    // row: the limit may reach 1.7 x what the endpoint takes.)
    assert!(high <= 68, "the limit rose to {high}");
    assert!(low >= 25, "the limit fell to {low}");
}

#[test]
fn streams_cut_now_and_then_at_any_load_are_not_taken_for_a_one_call_server() {
    // W7's streaming faults: 5% of streams cut, whatever the load.
    let mut now = Instant::now();
    let mut c = Aimd::new(
        AimdSettings {
            max: 128,
            ..adaptive()
        },
        now,
    );
    let mut rng = fastrand::Rng::with_seed(3);
    for _ in 0..300 {
        let limit = c.limit();
        for k in 0..limit {
            c.on_start(k + 1);
        }
        for k in 0..limit {
            let at = now + Duration::from_millis(100) * (k as u32 + 1) / limit as u32;
            // Streamed, the first token long before the end: decisions
            // still wait for whole calls.
            let signal = if rng.f64() < 0.05 {
                Signal::Cut
            } else {
                Signal::Success(Sample {
                    latency: Duration::from_millis(100),
                    work: 1.0,
                })
            };
            c.on_end(at, signal, Some(limit));
        }
        now += Duration::from_millis(100);
    }
    assert!(c.limit() >= 100, "the limit fell to {}", c.limit());
}

#[test]
fn a_decrease_ratio_below_one_half_is_kept_to() {
    let mut now = Instant::now();
    let mut c = Aimd::new(
        AimdSettings {
            initial: 20,
            decrease_ratio: 0.3,
            ..settings()
        },
        now,
    );
    // An interval of refusals: the cut is by the ratio (x 0.3), which
    // is deeper than the half a cut keeps otherwise.
    let cut = interval(&mut c, &mut now, Signal::BackPressure).unwrap();
    assert_eq!((cut.to, cut.reason), (6, Reason::BackPressure));
}

#[test]
fn cut_streams_ending_farther_apart_than_an_interval_still_take_the_limit_to_one() {
    // As llama-cpp-python's server at the start of a run: eight calls sent
    // at once, each new arrival cutting the stream running, so calls end
    // one every 300 ms with no answer whole yet (no round trip known: the
    // interval is the first one, 100 ms). Counted per interval, each end
    // would be an interval's only call and never most of half a round
    // trip's; counted over the last calls, the cuts add up.
    let mut now = Instant::now();
    let mut c = Aimd::new(
        AimdSettings {
            initial: 8,
            ..settings()
        },
        now,
    );
    for k in 0..8 {
        c.on_start(k + 1);
    }
    let mut decision = None;
    for _ in 0..8 {
        now += Duration::from_millis(300);
        decision = decision.or(c.on_end(now, Signal::Cut, Some(8)));
    }
    let decision = decision.expect("the cuts brought a decision");
    assert_eq!((decision.from, decision.to), (8, 1));
    assert_eq!(decision.reason, Reason::Cut);
    assert_eq!(c.limit(), 1);
}

#[test]
fn a_server_with_room_for_every_call_is_filled_a_doubling_a_round_trip() {
    // W7's mock: every call 15 to 90 ms (52 on average), whatever the
    // load. From 8 to 1,024 is 7 doublings: about a round trip each, the
    // first level's own round trip and the 10 ms steps of the simulation
    // besides, is under 0.7 s (2.7 s when each level waited for the calls
    // that replaced those that filled it, and the first level looked
    // below itself first).
    let server = Server::Batching {
        slots: 1 << 20,
        slowdown: 0.0,
    };
    let out = simulate_server(server, 0.0003, 10, adaptive(), None);
    assert!(
        out.at_max.is_some_and(|t| t < Duration::from_millis(700)),
        "the limit came to 1,024 after {:?}",
        out.at_max
    );
    // Each level that scaled after a fast step makes the next step twice
    // as big: three steps from 8, not four.
    assert_eq!(out.path[..4], [8, 32, 256, 1024], "{:?}", out.path);
}

#[test]
fn a_big_step_that_did_not_pay_looks_where_little_s_law_puts_the_knee() {
    // 60 slots, a queue beyond, 100 ms a call: 8 and 32 calls are served
    // at once, then 256 take 427 ms each (the queue), 1.9 times 32's
    // throughput: a gain of 0.125 of a perfect step (the bar is 0.2).
    // The knee is not taken for 32: 256 calls did 600 calls' work a
    // second, each at 32's 100 ms: 60 calls at once.
    let mut now = Instant::now();
    let mut c = Aimd::new(adaptive(), now);
    let mut path = vec![c.limit()];
    let decision = loop {
        let latency = if c.limit() > 60 {
            (c.limit() as u64 * 100).div_ceil(60)
        } else {
            100
        };
        if let Some(d) = interval(&mut c, &mut now, ok(latency)) {
            path.push(d.to);
            if d.reason != Reason::SlowStart {
                break d;
            }
        }
        assert!(path.len() < 6, "{path:?}");
    };
    assert_eq!(path, [8, 32, 256, 60], "{decision:?}");
    assert_eq!(decision.reason, Reason::ProbeDown);
}

#[test]
fn a_server_whose_knee_lies_inside_a_big_step_is_brought_back_near_it() {
    // 100 slots, a call's time whatever the load, a queue beyond: the
    // step from 32 (which scaled) goes eightfold, past the knee.
    let server = Server::Batching {
        slots: 100,
        slowdown: 0.0,
    };
    let out = simulate_server(server, 0.001, 300, adaptive(), None);
    assert!(out.path.starts_with(&[8, 32, 256]), "{:?}", out.path);
    assert!(out.share_within(90, 130) > 0.9, "{:?}", out.time_at);
    let best = served(100, 0.0, 0.001);
    assert!(out.throughput > 0.9 * best, "{} vs {best}", out.throughput);
}

#[test]
fn a_server_that_queues_from_its_first_call_is_still_looked_below() {
    // The first calls sent at once wait in the queue, the last several
    // times as long as the first: the first level judged is compared
    // with half of it before any doubling.
    let mut now = Instant::now();
    let mut c = Aimd::new(adaptive(), now);
    let limit = c.limit();
    let levels: Vec<_> = (0..limit).map(|k| c.on_start(k + 1)).collect();
    let mut decision = None;
    for (k, level) in levels.into_iter().enumerate() {
        now += Duration::from_millis(100);
        decision = decision.or(c.on_end(now, ok(100 * (k as u64 + 1)), level));
    }
    // Then the calls that replaced them, each behind the other seven.
    while decision.is_none() {
        let level = c.on_start(limit);
        now += Duration::from_millis(100);
        decision = c.on_end(now, ok(800), level);
    }
    let decision = decision.unwrap();
    assert_eq!((decision.to, decision.reason), (4, Reason::ProbeDown));
}

#[test]
fn a_streamed_endpoint_opens_at_two_calls_and_one_cut_takes_it_to_one() {
    let mut now = Instant::now();
    let mut c = Aimd::new(adaptive(), now);
    let opened = c.open_streamed().unwrap();
    assert_eq!(
        (opened.from, opened.to, opened.reason),
        (8, 2, Reason::StreamOpening)
    );
    let first = c.on_start(1);
    let second = c.on_start(2);
    // The first streams; the second's arrival ends it after a token.
    assert_eq!(c.on_first_token(now), None);
    now += Duration::from_millis(300);
    let cut = c.on_stream_end(now, Signal::Cut, first, true).unwrap();
    assert_eq!((cut.to, cut.reason), (1, Reason::Cut));
    assert!(c.serves_one_at_a_time());
    // The second is served alone and comes back whole; so do the calls
    // after it, one at a time, for the length of the hold.
    assert_eq!(c.on_first_token(now), None, "the opening is over");
    now += Duration::from_secs(2);
    c.on_stream_end(now, ok(2000), second, true);
    for _ in 0..100 {
        assert_eq!(c.limit(), 1);
        interval(&mut c, &mut now, ok(2000));
    }
}

#[test]
fn two_streams_flowing_at_once_take_the_limit_where_it_would_have_started() {
    let now = Instant::now();
    let mut c = Aimd::new(adaptive(), now);
    c.open_streamed();
    c.on_start(1);
    c.on_start(2);
    assert_eq!(c.on_first_token(now), None);
    let opened = c.on_first_token(now + Duration::from_millis(40)).unwrap();
    assert_eq!(
        (opened.from, opened.to, opened.reason),
        (2, 8, Reason::StreamOpened)
    );
    assert!(!c.stream_opening() && !c.serves_one_at_a_time());
}

#[test]
fn a_server_that_queues_streams_is_opened_by_two_whole_answers() {
    // One at a time, the next waiting (no cut): the second flows only
    // once the first is back.
    let mut now = Instant::now();
    let mut c = Aimd::new(adaptive(), now);
    c.open_streamed();
    let (first, second) = (c.on_start(1), c.on_start(2));
    c.on_first_token(now);
    now += Duration::from_secs(1);
    assert_eq!(c.on_stream_end(now, ok(1000), first, true), None);
    assert_eq!(c.on_first_token(now), None);
    now += Duration::from_secs(1);
    let opened = c.on_stream_end(now, ok(2000), second, true).unwrap();
    assert_eq!((opened.to, opened.reason), (8, Reason::StreamOpened));
}

#[test]
fn calls_that_fail_end_the_opening_and_an_engine_s_capacity_skips_it() {
    let now = Instant::now();
    let mut c = Aimd::new(adaptive(), now);
    c.open_streamed();
    for _ in 1..OPENING_ENDED {
        let level = c.on_start(1);
        assert_eq!(c.on_stream_end(now, Signal::Neutral, level, false), None);
    }
    let level = c.on_start(1);
    let opened = c.on_stream_end(now, Signal::BackPressure, level, false);
    assert_eq!(opened.map(|d| d.to), Some(8));
    let mut c = Aimd::new(adaptive(), now);
    c.on_capacity(4);
    assert_eq!(c.open_streamed(), None);
    assert_eq!(c.limit(), 4);
}

#[test]
fn streamed_calls_to_a_server_that_cuts_on_arrival_cut_one_stream_at_the_start() {
    // 175 tokens of 20 ms: 3.5 s a call, 40 minutes; the calls streamed.
    let out = simulate_calls(Server::CutsOnArrival, 0.02, 2400, adaptive(), None, true);
    // One cut at the start (two calls; eight sent at once cut seven),
    // then a probe at 5 minutes, one at 15, one at 35.
    assert!(out.cuts <= 4, "{} cuts", out.cuts);
    assert!(out.share_within(1, 1) > 0.97, "{:?}", out.time_at);
}

#[test]
fn streamed_calls_to_a_batching_server_reach_its_knee_as_fast() {
    let server = Server::Batching {
        slots: 8,
        slowdown: 0.15,
    };
    let plain = simulate_calls(server, 0.02, 1200, adaptive(), None, false);
    let streamed = simulate_calls(server, 0.02, 1200, adaptive(), None, true);
    assert!(
        streamed.throughput > 0.97 * plain.throughput,
        "{} against {}",
        streamed.throughput,
        plain.throughput
    );
    assert!(streamed.share_within(7, 12) > 0.8, "{:?}", streamed.time_at);
}

#[test]
fn the_first_level_is_judged_on_all_its_calls_when_they_come_after_the_first_interval() {
    // The controller starts before the run's first call (the endpoint is
    // set up while the run registers its items): its first interval is
    // over before the first level's calls are back. The first of them to
    // end must not start a new interval that forgets it and its level.
    let start = Instant::now();
    let settings = AimdSettings {
        initial: 8,
        min: 1,
        max: 1024,
        ..settings()
    };
    let mut c = Aimd::new(settings, start);
    let sent = start + FIRST_INTERVAL * 2;
    let levels: Vec<_> = (0..8).map(|k| c.on_start(k + 1)).collect();
    let mut decisions = Vec::new();
    for (k, level) in levels.into_iter().enumerate() {
        let at = sent + Duration::from_millis(50 + k as u64);
        decisions.push(c.on_end(at, ok(50), level).map(|d| (d.to, d.reason)));
    }
    // Judged at the last of its calls: four times as many (no queue).
    let mut expected = vec![None; 7];
    expected.push(Some((32, Reason::SlowStart)));
    assert_eq!(decisions, expected);
}
