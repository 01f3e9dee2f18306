//! The fleet's housekeeping, every second: its events and endpoints'
//! snapshots stored, `evalfleet fleet add|remove` applied, outliers
//! ejected, and whether any endpoint is left to take items.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use evalfleet_types::{Event, EventKind, FleetAction, FleetChange, RunSample, now_ms};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use evalfleet_store::Store;

use super::watch::eject_outliers;
use super::{FleetEvent, Shared, activate, deactivate};
use crate::{Endpoint, Phase, Reach};

/// Every second: fleet changes, snapshots, events, and whether any endpoint
/// is left.
#[allow(clippy::too_many_arguments)]
pub(super) async fn housekeep(
    shared: Arc<Shared>,
    endpoints: Vec<Arc<Endpoint>>,
    run_id: String,
    worker: String,
    store: Box<dyn Store>,
    mut events: mpsc::UnboundedReceiver<FleetEvent>,
    mut telemetry: Option<mpsc::Receiver<crate::watchdog::Tick>>,
    stop: CancellationToken,
    fleet_stop: CancellationToken,
    tracker: TaskTracker,
) {
    let mut store = Some(store);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut limits: HashMap<String, usize> = HashMap::new();
    let mut ticks: u64 = 0;
    let mut unavailable_since: Option<Instant> = None;
    // The last fleet change seen (`None` before the first look).
    let mut mailbox: Option<i64> = None;
    loop {
        let stopping = tokio::select! {
            _ = tick.tick() => false,
            () = stop.cancelled() => true,
        };
        ticks += 1;
        let mut pending: Vec<FleetEvent> = Vec::new();
        while let Ok(event) = events.try_recv() {
            pending.push(event);
        }
        let mut resources = Vec::new();
        let mut resource_events = Vec::new();
        while let Some(round) = telemetry.as_mut().and_then(|t| t.try_recv().ok()) {
            resources.extend(round.points);
            resource_events.extend(round.events);
        }
        // Limit changes, summarised every 5 seconds.
        if ticks.is_multiple_of(5) || stopping {
            for endpoint in &endpoints {
                let now = endpoint.limit.current();
                let before = limits.insert(endpoint.name.clone(), now);
                if endpoint.limit.is_adaptive() && before.is_some_and(|b| b != now) {
                    let verb = if before < Some(now) { "raised" } else { "cut" };
                    let message = format!(
                        "Concurrency limit of {} {verb} from {} to {now}.",
                        endpoint.name,
                        before.unwrap_or(now)
                    );
                    tracing::info!("{message}");
                    pending.push(FleetEvent {
                        at_ms: now_ms(),
                        endpoint: endpoint.name.clone(),
                        kind: EventKind::Limit,
                        message,
                    });
                }
            }
        }
        let snapshots: Vec<_> = endpoints.iter().map(|e| e.snapshot()).collect();
        // Endpoints out of the run are left out, unless calls ended on them
        // since the last sample (the last sample of a run comes after its
        // endpoints were stopped).
        let samples: Vec<_> = endpoints
            .iter()
            .map(|e| e.sample())
            .filter(|s| s.calls > 0 || s.state != evalfleet_types::EndpointState::Idle)
            .collect();
        let Some(mut owned) = store.take() else {
            return;
        };
        let id = run_id.clone();
        let me = worker.clone();
        let after = mailbox;
        let result = tracker
            .spawn_blocking(move || {
                let events: Vec<Event> = pending
                    .iter()
                    .map(|event| Event {
                        at_ms: event.at_ms,
                        kind: event.kind,
                        endpoint: Some(event.endpoint.clone()),
                        message: event.message.clone(),
                    })
                    .chain(resource_events)
                    .collect();
                // Telemetry lost is no reason to stop the rest.
                if let Err(err) = owned.add_resource_points(&id, &resources) {
                    tracing::warn!("Cannot store resource telemetry: {err}.");
                }
                let outcome = owned
                    .add_events(&id, &events)
                    .and_then(|()| owned.put_endpoint_states(&id, &me, &snapshots))
                    .and_then(|()| owned.counts(&id))
                    .and_then(|counts| {
                        owned.add_sample(
                            &id,
                            &RunSample {
                                at_ms: now_ms(),
                                worker: me,
                                counts,
                                endpoints: samples,
                            },
                        )
                    })
                    .and_then(|()| owned.fleet_changes(&id, after.unwrap_or(0)))
                    .map(|changes| {
                        let seen = changes.last().map_or(after.unwrap_or(0), |c| c.id);
                        // The first look only learns where the mailbox is:
                        // changes posted before this session are not for it.
                        (seen, if after.is_some() { changes } else { Vec::new() })
                    });
                (owned, outcome)
            })
            .await;
        let changes = match result {
            Ok((owned, outcome)) => {
                store = Some(owned);
                match outcome {
                    Ok((seen, changes)) => {
                        mailbox = Some(seen);
                        changes
                    }
                    Err(err) => {
                        tracing::warn!("Cannot store the fleet's state: {err}.");
                        Vec::new()
                    }
                }
            }
            Err(err) => {
                tracing::warn!("The fleet's housekeeping failed: {err}.");
                return;
            }
        };
        if stopping {
            return;
        }
        for change in changes {
            apply(&shared, &endpoints, &change, &fleet_stop);
        }
        eject_outliers(&shared, &endpoints);
        check_exhausted(&shared, &endpoints, &mut unavailable_since);
    }
}

fn apply(
    shared: &Arc<Shared>,
    endpoints: &[Arc<Endpoint>],
    change: &FleetChange,
    stop: &CancellationToken,
) {
    let Some(endpoint) = endpoints.iter().find(|e| e.name == change.endpoint) else {
        tracing::warn!(
            "Fleet change for unknown endpoint '{}' ignored.",
            change.endpoint
        );
        return;
    };
    match change.action {
        FleetAction::Add => {
            if endpoint.phase() == Phase::Excluded {
                endpoint.set_phase(Phase::Idle);
            }
            activate(shared, endpoint, stop);
            shared.event(
                endpoint,
                EventKind::Added,
                format!("Endpoint {} joined the run.", endpoint.name),
            );
        }
        FleetAction::Remove => {
            if deactivate(shared, endpoint) {
                endpoint.set_phase(Phase::Idle);
                shared.event(
                    endpoint,
                    EventKind::Removed,
                    format!(
                        "Endpoint {} left the run; its calls in flight move to others.",
                        endpoint.name
                    ),
                );
            }
        }
    }
}

/// Why the run should stop when no endpoint that takes items has answered
/// anything in the `wait` (`timeouts.first_answer`) since they were made,
/// every one could not be reached when tried and none has a call in
/// flight: each one's address and last error. An address that is wrong,
/// or a server that is not up, is told within seconds rather than after
/// `timeouts.no_endpoint` (which is for endpoints that answered before).
fn never_reached(endpoints: &[&Arc<Endpoint>], wait: Duration) -> Option<String> {
    let mut why = Vec::new();
    for endpoint in endpoints {
        let in_flight = endpoint
            .counters
            .in_flight
            .load(std::sync::atomic::Ordering::Relaxed);
        if endpoint.age() < wait || in_flight > 0 {
            return None;
        }
        match endpoint.reached() {
            Reach::Never(error) => why.push(format!(
                "{} ({}): {error}",
                endpoint.name,
                endpoint
                    .base_url()
                    .and_then(|u| reqwest::Url::parse(&u).ok())
                    .map_or_else(String::new, |u| crate::client::shown_url(&u))
            )),
            Reach::Answered | Reach::Untried => return None,
        }
    }
    (!why.is_empty()).then(|| {
        format!(
            "No endpoint answered in the {} since the run started: {}. Check that the server is up and its base_url, then resume the run.",
            humantime::format_duration(wait),
            why.join("; ")
        )
    })
}

fn check_exhausted(shared: &Shared, endpoints: &[Arc<Endpoint>], since: &mut Option<Instant>) {
    // Judge endpoints take no items: only the others keep a run going.
    let endpoints: Vec<&Arc<Endpoint>> = endpoints
        .iter()
        .filter(|e| e.config.takes_items())
        .collect();
    let phases: Vec<Phase> = endpoints.iter().map(|e| e.phase()).collect();
    let coming = phases
        .iter()
        .any(|p| matches!(p, Phase::Starting | Phase::Restarting | Phase::Ready));
    if !coming && phases.contains(&Phase::Excluded) && !phases.contains(&Phase::Idle) {
        let why = shared
            .excluded
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let left: Vec<String> = endpoints
            .iter()
            .map(|e| match why.get(&e.name) {
                Some(why) => format!("{} is left out of the run: {why}", e.name),
                None => format!("{} is left out of the run", e.name),
            })
            .collect();
        shared.exhaust(format!("No endpoint is left: {}.", left.join("; ")));
        return;
    }
    let serving = endpoints.iter().any(|e| e.accepting());
    let starting = phases
        .iter()
        .any(|p| matches!(p, Phase::Starting | Phase::Restarting));
    // Nothing answered yet: told after timeouts.first_answer, naming each
    // address and its error.
    let first_wait = shared.options.first_answer_timeout;
    if !starting && let Some(reason) = never_reached(&endpoints, first_wait) {
        shared.exhaust(reason);
        return;
    }
    if serving || starting {
        *since = None;
        return;
    }
    let since = *since.get_or_insert_with(Instant::now);
    let timeout = shared.options.no_endpoint_timeout;
    if since.elapsed() >= timeout {
        shared.exhaust(format!(
            "No endpoint could take items for {}.",
            humantime::format_duration(timeout)
        ));
    }
}
