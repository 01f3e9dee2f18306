//! The calls of a session: each endpoint's dispatcher pulls the next call
//! when it has a free slot, an attempt makes it on the fleet's call path
//! and hands the reply to the item's task, and [`drive`] follows the task's
//! steps until the item waits for its next call or ends. Failed calls are
//! retried here, with the one retry policy.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use evalfleet_types::{AttemptRecord, CacheEntry, ErrorClass};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use super::Shared;
use super::item::{FirstEnd, Hedge, Hedged, Item, Job};
use super::outcome::{Carry, Outcome};
use crate::task::{Finish, Reply, Request, Step, Target};
use evalfleet_fleet::call::{self, Call, Exchange};
use evalfleet_fleet::{Endpoint, Permit, Phase};
use evalfleet_store::Store;

/// A cache lookup for the lookup thread: a key, and where its entry goes.
pub struct Lookup {
    key: String,
    reply: oneshot::Sender<Option<CacheEntry>>,
}

/// The entry of `key`, from the lookup thread behind `lookups`.
pub async fn look_up(lookups: &mpsc::UnboundedSender<Lookup>, key: String) -> Option<CacheEntry> {
    let (reply, entry) = oneshot::channel();
    lookups.send(Lookup { key, reply }).ok()?;
    entry.await.ok().flatten()
}

/// Starts the thread that looks requests up in the cache for calls after an
/// item's first (its first is looked up by the reader, a page at a time),
/// with a store connection of its own; it ends with the session.
pub fn cache_lookups(
    mut store: Box<dyn Store>,
    since_ms: i64,
    tracker: &TaskTracker,
) -> mpsc::UnboundedSender<Lookup> {
    let (tx, mut rx) = mpsc::unbounded_channel::<Lookup>();
    tracker.spawn_blocking(move || {
        store.prepare_for_lookups();
        while let Some(Lookup { key, reply }) = rx.blocking_recv() {
            let entry = store.cache_get(&key, since_ms).unwrap_or_else(|err| {
                tracing::warn!("Cannot read the cache (the call is made): {err}.");
                None
            });
            let _ = reply.send(entry);
        }
    });
    tx
}

/// How often a dispatcher whose endpoint takes no calls counts a try
/// against the calls addressed to it.
const SWEEP: Duration = Duration::from_secs(1);

/// What a dispatcher's wait for a slot ended with.
enum Admitted {
    Permit(Permit),
    Halted,
    Excluded,
}

impl From<Option<Permit>> for Admitted {
    fn from(permit: Option<Permit>) -> Self {
        permit.map_or(Self::Halted, Self::Permit)
    }
}

/// A call addressed to `endpoint`, which takes no calls now: one of the
/// call's tries is spent; it is tried again after its backoff, and fails
/// once its tries are spent (as a call that failed would).
async fn unavailable(shared: Arc<Shared>, endpoint: Arc<Endpoint>, mut item: Item) {
    item.tries += 1;
    // The wait spaces the call's tries: a fault after it is the first in a
    // row.
    item.faulted_last = false;
    item.call_since.get_or_insert_with(Instant::now);
    let wait = shared.retry.backoff(item.tries, None);
    // An endpoint left out of the run (idle) is not coming back: its
    // calls have their tries; one that is down (unhealthy, restarting) is
    // waited for as long as a judge's call is retried.
    let coming_back = endpoint.state() != evalfleet_types::EndpointState::Idle;
    if !tries_left(&shared, &item, coming_back, wait) {
        item.reset_tries();
        let reason = format!(
            "endpoint {} is not taking calls ({})",
            endpoint.name,
            endpoint.state().as_str()
        );
        fail_call(shared, item, reason).await;
        return;
    }
    tokio::select! {
        () = tokio::time::sleep(wait) => requeue(&shared, item),
        () = shared.halt.cancelled() => {}
    }
}

/// Whether a call that failed its `item.tries`-th try (in a way a retry
/// may fix) is tried again after `wait`: while its tries last; and a call
/// to a named endpoint (a judge's: `named`), for `retry.judge_for` from its
/// first try however many tries that takes, so that a judge restarting is
/// ridden out.
fn tries_left(shared: &Shared, item: &Item, named: bool, wait: Duration) -> bool {
    item.tries < shared.retry.max_attempts
        || (named
            && item
                .call_since
                .is_some_and(|since| since.elapsed() + wait < shared.judge_for))
}

/// One endpoint's dispatcher: while the endpoint takes calls, each free slot
/// takes the next call for it (addressed to it first, then any item's),
/// once its rate limits allow.
pub async fn dispatch(
    shared: Arc<Shared>,
    endpoint: Arc<Endpoint>,
    mut inbox: mpsc::UnboundedReceiver<Item>,
) {
    // Judge endpoints take no items, only calls addressed to them.
    let takes_items = endpoint.config.takes_items();
    let mut excluded = endpoint.exclusion();
    let mut sweep = tokio::time::interval(SWEEP);
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let admitted = {
            let admit = call::admit(&endpoint, &shared.halt);
            tokio::pin!(admit);
            loop {
                tokio::select! {
                    biased;
                    permit = &mut admit => break Admitted::from(permit),
                    () = excluded.cancelled() => break Admitted::Excluded,
                    _ = sweep.tick() => {
                        // Calls addressed here wait while it is down
                        // (unhealthy, stopped, not started), but not for
                        // ever: each sweep is one of their tries. While it
                        // is being started they wait, spending none: its
                        // start ends (it takes calls, or it is out of the
                        // run and they fail), however slow the machine.
                        if !endpoint.accepting()
                            && endpoint.state() != evalfleet_types::EndpointState::Starting
                        {
                            while let Ok(item) = inbox.try_recv() {
                                shared.tracker.spawn(unavailable(shared.clone(), endpoint.clone(), item));
                            }
                        }
                    }
                }
            }
        };
        let permit = match admitted {
            Admitted::Permit(permit) => permit,
            Admitted::Halted => return,
            // Calls waiting for an endpoint that is out of the run fail.
            Admitted::Excluded => {
                // Until it comes back (`fleet add`), calls for it fail.
                loop {
                    tokio::select! {
                        biased;
                        () = shared.halt.cancelled() => return,
                        Some(item) = inbox.recv() => {
                            let reason = format!("endpoint {} is out of the run", endpoint.name);
                            shared.tracker.spawn(fail_call(shared.clone(), item, reason));
                        }
                        back = endpoint.wait_accepting(&shared.halt) => {
                            if !back {
                                return;
                            }
                            break;
                        }
                    }
                }
                excluded = endpoint.exclusion();
                continue;
            }
        };
        let job = tokio::select! {
            biased;
            () = shared.halt.cancelled() => return,
            Some(item) = inbox.recv() => Job::Item(item),
            job = shared.backlog.next(&shared.halt), if takes_items => match job {
                Some(job) => job,
                None => return,
            },
        };
        let item = match job {
            Job::Item(item) => item,
            Job::Hedge(hedge) => {
                // Never on the endpoint of the call it hedges; and not at
                // all once that call has answered.
                if hedge.from != endpoint.name && !hedge.cancel.is_cancelled() {
                    let cost = call::cost(&hedge.messages, shared.max_tokens);
                    if !call::pace(&endpoint, cost, &shared.halt).await {
                        return;
                    }
                    if let Some(client) = endpoint.client().filter(|_| endpoint.accepting()) {
                        let call = Call {
                            endpoint: endpoint.clone(),
                            client,
                            permit,
                            cost,
                        };
                        shared
                            .tracker
                            .spawn(hedge_attempt(shared.clone(), call, hedge));
                    }
                }
                continue;
            }
        };
        let Some(item) = shared.first_failures.hold(item) else {
            // Held back until the verdict on the session's first items.
            continue;
        };
        let Some(request) = &item.request else {
            // An item in a queue always waits for a call.
            continue;
        };
        let cost = call::cost(&request.messages, shared.max_tokens);
        if !call::pace(&endpoint, cost, &shared.halt).await {
            // The item stays pending for a resume.
            return;
        }
        let client = match endpoint.client() {
            Some(client) if endpoint.accepting() => client,
            _ => {
                // It stopped taking calls while this one waited: the call
                // goes back to be made elsewhere (or here, later).
                requeue(&shared, item);
                continue;
            }
        };
        // A debug span costs nothing unless debug logging is on.
        let span = tracing::debug_span!("item", id = %item.item_id, attempt = item.number());
        let call = Call {
            endpoint: endpoint.clone(),
            client,
            permit,
            cost,
        };
        shared.tracker.spawn(tracing::Instrument::instrument(
            attempt(shared.clone(), call, item),
            span,
        ));
    }
}

/// Puts an item back in the queue of its call's target; when the target
/// cannot take it, the call fails (in a task of its own).
pub fn requeue(shared: &Arc<Shared>, item: Item) {
    if let Err(refused) = route(shared, item) {
        let (item, reason) = *refused;
        shared
            .tracker
            .spawn(fail_call(shared.clone(), item, reason));
    }
}

/// The call an item waits for cannot be made, for `reason`.
async fn fail_call(shared: Arc<Shared>, mut item: Item, reason: String) {
    if shared.halt.is_cancelled() {
        // Stopping: the item stays pending for a resume.
        return;
    }
    item.retry_paid = false;
    // The call is over: the next one has its own tries.
    item.reset_tries();
    if let Some(request) = item.request.take() {
        let step = item.next(request, Reply::Failed(reason));
        drive(&shared, item, step, Carry::default()).await;
    }
}

/// Queues an item (which waits for `item.request`) for its target; gives it
/// back, with why, when the target cannot take it (no such endpoint, or one
/// out of the run).
pub fn route(shared: &Shared, item: Item) -> Result<(), Box<(Item, String)>> {
    let target = match &item.request {
        Some(request) => request.target.clone(),
        None => return Err(Box::new((item, "the item waits for no call".to_owned()))),
    };
    match target {
        Target::Items => {
            shared.backlog.retry(item);
            Ok(())
        }
        Target::Endpoint(name) => {
            let Some(queue) = shared.direct.get(&*name) else {
                return Err(Box::new((
                    item,
                    format!("no endpoint '{name}' in this run"),
                )));
            };
            if shared
                .endpoints
                .get(&*name)
                .is_some_and(|e| e.phase() == Phase::Excluded)
            {
                return Err(Box::new((
                    item,
                    format!("endpoint {name} is out of the run"),
                )));
            }
            queue
                .send(item)
                .map_err(|e| Box::new((e.0, format!("endpoint {name} takes no more calls"))))
        }
    }
}

/// One call for one item, and what follows from its outcome.
async fn attempt(shared: Arc<Shared>, call: Call, mut item: Item) {
    let Some(request) = item.request.take() else {
        return;
    };
    // Sent only while its claim surely holds: after a stall past the lease
    // (a stopped process, a frozen machine), the next renewal says whether
    // it is still this worker's; one lost is let go, not called for.
    let admitted = tokio::select! {
        admitted = shared.leases.admit(item.claim, item.seq) => admitted,
        () = shared.abort.cancelled() => return,
    };
    if !admitted {
        item.let_go();
        return;
    }
    let endpoint = call.endpoint.clone();
    let answers_item = request.target == Target::Items;
    let number = item.number();
    let now = Instant::now();
    // An item's answer is bounded by its deadline too.
    let limit = if answers_item {
        let first = *item.first_sent.get_or_insert(now);
        endpoint
            .timeout
            .min(shared.item_timeout.saturating_sub(now - first))
            .max(Duration::from_millis(1))
    } else {
        endpoint.timeout
    };
    item.calls += 1;
    item.tries += 1;
    if !answers_item {
        item.call_since.get_or_insert(now);
    }
    if !std::mem::take(&mut item.retry_paid) {
        // Not a retry: it pays into the budget (the tries a resumed item
        // brings with it do not make its first call here a retry).
        shared.budget.first_try(now);
    }
    let claim = item.claim;
    // Cancelled when the item is known lost while the call runs (its hedge
    // with it).
    let flight = crate::lease::LeaseGate::flight(&shared.leases, claim, item.seq, &shared.abort);
    let (exchange, endpoint, number) = if answers_item && shared.hedging {
        // (Boxed, as the call below and the steps after it: the task
        // spawned for each attempt holds one of them at a time, not room
        // for all (4.9 KB, not 7.8); spawning it copied and allocated that
        // much, 5% of the client's CPU in W7.)
        let made = Box::pin(race(
            &shared,
            call,
            &mut item,
            &request,
            limit,
            number,
            flight.token(),
        ))
        .await;
        for lost in made.lost {
            if !shared.send(Outcome::attempt(claim, lost)).await {
                return;
            }
        }
        (made.exchange, made.endpoint, made.number)
    } else {
        let exchange = Box::pin(call::send(
            call,
            request.outgoing(),
            limit,
            flight.token(),
            &shared.fleet,
        ))
        .await;
        (exchange, endpoint, number)
    };
    if matches!(exchange, Exchange::Abandoned)
        && !shared.abort.is_cancelled()
        && shared.leases.lost(claim, item.seq)
    {
        // Another worker may be answering it: this one lets it go.
        item.let_go();
        return;
    }
    drop(flight);
    let Some(mut record) = exchange.record(&endpoint, item.seq, number, shared.session) else {
        // Abandoned at shutdown: nothing is recorded and the item stays
        // pending.
        return;
    };
    match exchange {
        // A call that lost to its hedge never comes out of a race.
        Exchange::Abandoned | Exchange::Cancelled { .. } => {}
        Exchange::Moved { .. } => {
            // Not the item's fault: the attempt is recorded but is not one
            // of the call's tries, and another endpoint takes the call
            // after a backoff (all calls moved at once would land together).
            item.tries -= 1;
            item.faulted_last = false;
            item.request = Some(request);
            let wait = shared.retry.backoff(item.tries + 1, None);
            if shared.send(Outcome::retried(claim, record, wait)).await
                && !shared.halt.is_cancelled()
            {
                retry_later(&shared, item, wait);
            }
        }
        Exchange::Done {
            result: Ok(completion),
            ..
        } => {
            if answers_item {
                item.answer = Some(record.telemetry.clone());
            }
            item.reset_tries();
            let cache = shared
                .cache
                .entry(&request, &completion.content, &record.telemetry);
            let step = item.next(request, Reply::Answer(completion.content));
            if let Step::Call(next) = &step
                && let Some(note) = &next.rejected
            {
                // A re-ask: the answer could not be used.
                record.error_class = Some(ErrorClass::InvalidAnswer);
                record.error = Some(note.clone());
            }
            let carry = Carry {
                attempt: Some(record),
                cache,
                calls: Vec::new(),
            };
            // (Boxed: see the call above.)
            Box::pin(go_on(&shared, item, step, carry)).await;
        }
        Exchange::Done {
            result: Err(err),
            rate_limited,
            ..
        } => {
            if answers_item {
                item.answer = Some(record.telemetry.clone());
            }
            if rate_limited && answers_item {
                // The endpoint paces the run; the item did nothing wrong.
                // Its deadline bounds how long it may wait. (A call to a
                // named endpoint has no deadline: its 429s count.)
                item.tries -= 1;
            }
            let class = err.class();
            let tries = item.tries;
            let said = evalfleet_types::error_text(&err);
            item.refused = !class.is_retryable();
            // A fault of the call alone (a 5xx other than a 503, a reset
            // connection, a broken or stalled stream), where the endpoint
            // answers most calls: the call is sent again at once (with no
            // Retry-After; the retry budget bounds how many are), unless
            // its last try failed so too: a second fault in a row waits as
            // a first retry would (the call itself may be what fails). A
            // fault after a 503's wait is the first in a row: that wait
            // spaced the tries already (W7: a 500, a 503, a 500 and a 503
            // lost 51 and 97 ms to a backoff in two traced runs).
            // The backoff doubles with each try where faults are broad,
            // and for back pressure (the endpoint asks for less) whatever
            // the share.
            let sporadic =
                class.is_retryable() && !class.is_back_pressure() && endpoint.fails_sporadically();
            let wait = match err.retry_after() {
                None if sporadic && !item.faulted_last => Duration::ZERO,
                retry_after => shared
                    .retry
                    .backoff(if sporadic { 1 } else { tries.max(1) }, retry_after),
            };
            item.faulted_last = sporadic;
            let reason = if !class.is_retryable() {
                said
            } else if !tries_left(&shared, &item, !answers_item, wait) {
                if answers_item {
                    format!("gave up after {tries} attempts: {said}")
                } else {
                    said
                }
            } else {
                let past_deadline = answers_item
                    && item
                        .first_sent
                        .is_some_and(|first| first.elapsed() + wait >= shared.item_timeout);
                if past_deadline {
                    format!(
                        "the item's deadline ({}) would pass before the next attempt: {said}",
                        humantime::format_duration(shared.item_timeout)
                    )
                } else {
                    tracing::debug!(error = %err, "Retrying in {wait:?}.");
                    item.request = Some(request);
                    let sent = shared.send(Outcome::retried(claim, record, wait)).await;
                    if !sent || shared.halt.is_cancelled() {
                        // Stopping: the item stays pending for a resume.
                        return;
                    }
                    shared.progress.retries.fetch_add(1, Ordering::Relaxed);
                    retry_later(&shared, item, wait);
                    return;
                }
            };
            item.reset_tries();
            let step = item.next(request, Reply::Failed(reason));
            let carry = Carry {
                attempt: Some(record),
                cache: None,
                calls: Vec::new(),
            };
            // (Boxed: see the call above.)
            Box::pin(go_on(&shared, item, step, carry)).await;
        }
    }
}

/// Sends `item`'s call again after `wait`, once the session's retry
/// budget allows (until then it waits on, backing off further, but not
/// past the item's deadline: then the call fails).
fn retry_later(shared: &Arc<Shared>, mut item: Item, wait: Duration) {
    let retrier = shared.clone();
    shared.tracker.spawn(async move {
        let mut wait = wait;
        let mut denied = 0;
        loop {
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = retrier.halt.cancelled() => return,
            }
            if retrier.budget.try_retry(Instant::now()) {
                break;
            }
            denied += 1;
            wait = retrier
                .retry
                .backoff(denied, None)
                .max(Duration::from_millis(10));
            let answers_item = item
                .request
                .as_ref()
                .is_some_and(|r| r.target == Target::Items);
            if answers_item
                && item
                    .first_sent
                    .is_some_and(|first| first.elapsed() + wait >= retrier.item_timeout)
            {
                item.reset_tries();
                let reason = format!(
                    "the item's deadline ({}) would pass while its retry waits for the retry budget (retry.budget)",
                    humantime::format_duration(retrier.item_timeout)
                );
                fail_call(retrier, item, reason).await;
                return;
            }
        }
        item.retry_paid = true;
        requeue(&retrier, item);
    });
}

/// What a call made with a hedge came to: the outcome that stands (the
/// first answer, or the call's own failure), on which endpoint and as
/// which attempt, and the records of the call that lost.
struct Raced {
    exchange: Exchange,
    endpoint: Arc<Endpoint>,
    number: u32,
    lost: Vec<AttemptRecord>,
}

/// Makes an item's call (attempt `number`); should its endpoint be taken
/// out of service while the call is in flight and the call run longer than
/// the endpoint normally takes, a hedge of it goes to another endpoint, as
/// a retry the budget pays for. The first answer wins; the other call is
/// cancelled and recorded. A failure of either waits for the other.
async fn race(
    shared: &Arc<Shared>,
    call: Call,
    item: &mut Item,
    request: &Request,
    limit: Duration,
    number: u32,
    flight: &tokio_util::sync::CancellationToken,
) -> Raced {
    let endpoint = call.endpoint.clone();
    let started = Instant::now();
    let sent_at = std::time::SystemTime::now();
    let send = call::send(call, request.outgoing(), limit, flight, &shared.fleet);
    tokio::pin!(send);
    let alone = |exchange| Raced {
        exchange,
        endpoint: endpoint.clone(),
        number,
        lost: Vec::new(),
    };
    tokio::select! {
        biased;
        exchange = &mut send => return alone(exchange),
        () = hedge_due(shared, &endpoint, started) => {}
    }
    if !shared.budget.try_retry(Instant::now()) {
        return alone(send.await);
    }
    let hedge_number = item.number();
    item.calls += 1;
    // (Cancelled with the call when the item is lost.)
    let cancel = flight.child_token();
    let (reply, mut hedged) = oneshot::channel::<Hedged>();
    shared.backlog.hedge(Hedge {
        claim: item.claim,
        seq: item.seq,
        number: hedge_number,
        messages: request.messages.clone(),
        images: request.images.clone(),
        from: endpoint.name.clone(),
        deadline: started + limit,
        cancel: cancel.clone(),
        reply,
    });
    tracing::debug!(
        "Hedged a call late on {} (attempt {hedge_number}).",
        endpoint.name
    );
    let mut lost = Vec::new();
    let own = tokio::select! {
        exchange = &mut send => exchange,
        outcome = &mut hedged => match outcome {
            Ok(outcome) if outcome.exchange.answered() => {
                // The hedge answered first: this call is cut off (dropped
                // here) and recorded as such.
                let cancelled = Exchange::Cancelled {
                    sent_at,
                    why: format!("a hedged call on {} answered first", outcome.endpoint.name),
                };
                lost.extend(cancelled.record(&endpoint, item.seq, number, shared.session));
                return Raced {
                    exchange: outcome.exchange,
                    endpoint: outcome.endpoint,
                    number: hedge_number,
                    lost,
                };
            }
            Ok(outcome) => {
                // The hedge failed: this call may still answer.
                lost.extend(outcome.record);
                let exchange = send.await;
                return Raced { exchange, endpoint: endpoint.clone(), number, lost };
            }
            // Not made (no other endpoint took it): this call stands.
            Err(_) => return Raced { exchange: send.await, endpoint: endpoint.clone(), number, lost },
        },
    };
    if own.answered() || flight.is_cancelled() {
        // Answered: the hedge is cut off. Or the item was lost (or the
        // session aborts): the hedge was cut with the call, and is not
        // waited for (it may sit in the queue with no endpoint free).
        cancel.cancel();
        return Raced {
            exchange: own,
            endpoint,
            number,
            lost,
        };
    }
    // This call failed: the hedge's outcome stands when there is one (in
    // time: it may wait in the queue while no other endpoint is free).
    match tokio::time::timeout_at(started + limit, hedged).await {
        Ok(Ok(outcome)) => {
            lost.extend(own.record(&endpoint, item.seq, number, shared.session));
            Raced {
                exchange: outcome.exchange,
                endpoint: outcome.endpoint,
                number: hedge_number,
                lost,
            }
        }
        Ok(Err(_)) | Err(_) => {
            cancel.cancel();
            Raced {
                exchange: own,
                endpoint,
                number,
                lost,
            }
        }
    }
}

/// Ends when a call sent at `started` to `endpoint` is to be hedged: the
/// endpoint's breaker opened (it was ejected, or is down) and the call has
/// run longer than the endpoint normally takes, while another endpoint
/// takes items. Never, for an endpoint that has not made enough calls to
/// know what is normal for it (the attempt timeout bounds such calls).
async fn hedge_due(shared: &Shared, endpoint: &Endpoint, started: Instant) {
    endpoint.opened().cancelled().await;
    let Some(normal) = endpoint.normal_latency() else {
        return std::future::pending().await;
    };
    tokio::time::sleep_until(started + normal).await;
    let another = shared
        .endpoints
        .values()
        .any(|e| e.name != endpoint.name && e.config.takes_items() && e.accepting());
    if !another {
        std::future::pending::<()>().await;
    }
}

/// Makes a hedge's call on the endpoint whose slot it took, and hands its
/// outcome to the call it hedges; cut off (and recorded as such) when that
/// call answers first.
async fn hedge_attempt(shared: Arc<Shared>, call: Call, hedge: Hedge) {
    let endpoint = call.endpoint.clone();
    let limit = endpoint
        .timeout
        .min(hedge.deadline.saturating_duration_since(Instant::now()))
        .max(Duration::from_millis(1));
    let sent_at = std::time::SystemTime::now();
    let exchange = tokio::select! {
        exchange = call::send(call, hedge.outgoing(), limit, &shared.abort, &shared.fleet) => exchange,
        () = hedge.cancel.cancelled() => Exchange::Cancelled {
            sent_at,
            why: if shared.leases.lost(hedge.claim, hedge.seq) {
                "another worker took its item".to_owned()
            } else {
                format!("the call it hedged on {} answered first", hedge.from)
            },
        },
    };
    let record = exchange.record(&endpoint, hedge.seq, hedge.number, shared.session);
    if matches!(exchange, Exchange::Cancelled { .. } | Exchange::Abandoned) {
        if let Some(record) = record {
            shared.send(Outcome::attempt(hedge.claim, record)).await;
        }
        return;
    }
    let outcome = Hedged {
        exchange,
        endpoint,
        record,
    };
    if let Err(late) = hedge.reply.send(outcome) {
        // The call it hedged ended first after all: this one is recorded
        // on its own.
        if let Some(record) = late.record {
            shared.send(Outcome::attempt(hedge.claim, record)).await;
        }
    }
}

/// Follows an item's steps: answers its calls from the cache while it
/// can, runs its work, and queues it for its next call or hands on its
/// result. `carry` goes to the writer with what the item sends next.
pub async fn drive(shared: &Arc<Shared>, mut item: Item, mut step: Step, mut carry: Carry) {
    loop {
        step = match step {
            Step::Finish(finish) => {
                end(shared, item, finish, carry).await;
                return;
            }
            Step::Call(request) => {
                // The rule of task.prompts that made its messages, when
                // they came after work (its images read).
                if item.prompt.is_none() {
                    item.prompt.clone_from(&request.prompt);
                }
                if !carry.is_empty() {
                    let sent = std::mem::take(&mut carry);
                    if !shared.send(Outcome::carried(item.claim, sent)).await {
                        return;
                    }
                }
                if let Some(hit) = lookup(shared, &request).await {
                    item.answered_from_cache(request, hit)
                } else {
                    item.request = Some(request);
                    match route(shared, item) {
                        Ok(()) => return,
                        Err(_) if shared.halt.is_cancelled() => {
                            // Stopping: the endpoints take no more calls,
                            // and the item stays pending for a resume.
                            return;
                        }
                        Err(refused) => {
                            let (back, reason) = *refused;
                            item = back;
                            let Some(request) = item.request.take() else {
                                return;
                            };
                            item.reset_tries();
                            item.next(request, Reply::Failed(reason))
                        }
                    }
                }
            }
            Step::Work(work) => {
                if !carry.is_empty() {
                    let sent = std::mem::take(&mut carry);
                    if !shared.send(Outcome::carried(item.claim, sent)).await {
                        return;
                    }
                }
                let Ok(permit) = shared.work.clone().acquire_owned().await else {
                    return;
                };
                let step = tokio::select! {
                    step = work => step,
                    // Abandoned at shutdown: the item stays pending.
                    () = shared.abort.cancelled() => return,
                };
                drop(permit);
                step
            }
            Step::Attempted(attempted) => {
                let crate::task::Attempted {
                    mut record,
                    calls,
                    then,
                } = *attempted;
                if carry.attempt.is_some() {
                    let sent = std::mem::take(&mut carry);
                    if !shared.send(Outcome::carried(item.claim, sent)).await {
                        return;
                    }
                }
                record.session = shared.session;
                item.calls += 1;
                // An attempt that failed (an agent's run) is a failure that
                // may be one of many alike; tried again, it is a retry.
                let failed = record.error_class.is_some();
                item.refused = failed;
                if failed && !matches!(then, Step::Finish(_)) {
                    shared.progress.retries.fetch_add(1, Ordering::Relaxed);
                }
                item.answer = Some(record.telemetry.clone());
                carry.attempt = Some(record);
                carry.calls.extend(calls);
                then
            }
            Step::Wait(wait) => {
                if !carry.is_empty() {
                    let sent = std::mem::take(&mut carry);
                    if !shared.send(Outcome::carried(item.claim, sent)).await {
                        return;
                    }
                }
                tokio::select! {
                    step = wait => step,
                    // It holds no call: abandoned as soon as the session
                    // stops (no grace to wait out); the item stays pending.
                    () = shared.halt.cancelled() => return,
                }
            }
        };
    }
}

/// Hands an item's result (and what it carries) to the writer, and counts
/// the item as ended.
async fn end(shared: &Arc<Shared>, item: Item, finish: Finish, carry: Carry) {
    let alike = item.refused || item.calls == 0;
    first_ended(shared, item.number, &finish, alike);
    let claim = item.claim;
    let (result, ended) = item.finish(finish);
    let outcome = Outcome {
        claim,
        attempt: carry.attempt,
        result: Some(result),
        cache: carry.cache,
        calls: carry.calls,
        wait: None,
    };
    if shared.send(outcome).await {
        ended.count(&shared.progress);
    }
}

/// Tells the watch on the session's first items that item `number` ended
/// (see [`crate::item::FirstFailures`]): gives the session up, or lets the
/// items it held back go on.
pub fn first_ended(shared: &Arc<Shared>, number: u64, finish: &Finish, alike: bool) {
    match shared.first_failures.ended(number, finish, alike) {
        FirstEnd::Nothing => {}
        FirstEnd::GiveUp(cause) => give_up(shared, &cause),
        FirstEnd::GoOn(held) => {
            for item in held {
                requeue(shared, item);
            }
        }
    }
}

/// Gives the session up: its first items all failed alike, for `cause`.
pub fn give_up(shared: &Shared, cause: &str) {
    shared.fleet.give_up(format!(
        "The first {} items all failed the same way, and none was answered: {cause}. \
         Fix the cause, then resume with --retry-failed to answer them again.",
        crate::item::FirstFailures::SAME
    ));
}

/// Follows `step` as [`drive`] does; an item that ends at once (the common
/// case) is ended here, without the boxed future a longer way needs.
async fn go_on(shared: &Arc<Shared>, item: Item, step: Step, carry: Carry) {
    match step {
        Step::Finish(finish) => end(shared, item, finish, carry).await,
        step => Box::pin(drive(shared, item, step, carry)).await,
    }
}

/// The cached answer to `request`, when the session reads the cache.
async fn lookup(shared: &Shared, request: &Request) -> Option<CacheEntry> {
    let key = shared.cache.lookup_key(request)?;
    look_up(shared.lookups.as_ref()?, key).await
}
