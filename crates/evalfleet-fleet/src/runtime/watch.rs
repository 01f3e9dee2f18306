//! Watching an endpoint while it serves: its health probes (only when its
//! calls have shown nothing for a while), the transitions of its breaker
//! reported as events, and the ejection of endpoints whose calls fail more
//! than their peers' while the others can carry their load.

use std::sync::Arc;
use std::time::Duration;

use evalfleet_config::EndpointConfig;
use evalfleet_types::EventKind;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Shared;
use crate::client::http_client;
use crate::engine::Supervised;
use crate::{Endpoint, Phase, Transition};

/// Where an endpoint is probed.
pub fn health_url(config: &EndpointConfig, base_url: &str) -> String {
    let path = config
        .health
        .path
        .clone()
        .or_else(|| config.kind.engine().map(|e| e.health_path().to_owned()));
    match path {
        Some(path) => format!("{}{path}", crate::load::origin(base_url)),
        None => format!("{}/models", base_url.trim_end_matches('/')),
    }
}

/// One health probe: `GET` answered with 2xx within the timeout. Any
/// answer tells that the endpoint can be reached ([`Endpoint::tried`]).
pub(super) async fn probe(
    endpoint: &Endpoint,
    http: &reqwest::Client,
    url: &str,
    timeout: Duration,
) -> Result<(), String> {
    match tokio::time::timeout(timeout, http.get(url).send()).await {
        Err(_) => Err(format!(
            "no answer within {}",
            humantime::format_duration(timeout)
        )),
        Ok(Err(err)) => {
            let why = evalfleet_types::root_cause(&err);
            if err.is_connect() {
                let shown = err.url().map_or_else(String::new, crate::client::shown_url);
                endpoint.tried(Err(format!("GET {shown}: {why}")));
            }
            Err(why)
        }
        Ok(Ok(response)) => {
            endpoint.tried(Ok(()));
            if response.status().is_success() {
                Ok(())
            } else if crate::client::is_html(response.headers()) {
                Err(format!(
                    "HTTP {}: {}",
                    response.status().as_u16(),
                    crate::client::HTML_HINT
                ))
            } else {
                Err(format!("HTTP {}", response.status().as_u16()))
            }
        }
    }
}

/// What ended a stretch of serving.
pub(super) enum Ended {
    Stopped,
    /// The process ended (managed engines).
    Died(String),
    /// Unhealthy for longer than allowed (managed engines).
    StayedUnhealthy,
    /// Calls in flight, none showing a sign of life for this long, while
    /// it answers probes (managed engines).
    Hung(Duration),
}

/// Watches the endpoint while it serves, until stopped, the process dies,
/// or (when `restart_after` is set) it stays unhealthy. Its calls are the
/// health signal while they go well: it is probed only once it has shown
/// no sign of life for `interval` ([`probe_due`]), at once when its calls
/// fail one after another or it stops taking items, and five times as
/// often while unhealthy.
pub(super) async fn watch(
    shared: &Shared,
    endpoint: &Endpoint,
    base_url: &str,
    stop: &CancellationToken,
    mut process: Option<&mut Supervised>,
    restart_after: Option<Duration>,
) -> Ended {
    let health = &endpoint.config.health;
    let url = health_url(&endpoint.config, base_url);
    let Ok(http) = http_client(1) else {
        return Ended::Died("cannot build an HTTP client for probes".to_owned());
    };
    // While unhealthy it is probed five times as often, so that it comes
    // back soon after it recovers; a change of state probes at once.
    let recovering = (health.interval / 5).max(Duration::from_millis(100));
    let mut changes = endpoint.changes();
    // When the next probe is due, the last one made at `probed`.
    let due = |probed| {
        // On a server found to serve one request at a time, a probe cuts
        // the running stream (llama-cpp-python's ends it for any request,
        // and a call on a loaded machine may show nothing for longer than
        // an interval before its first token): with a call in flight
        // there, a probe comes only once it is silent long enough to be
        // called hung.
        let quiet = if endpoint.limit.in_flight() > 0 && endpoint.limit.serves_one_at_a_time() {
            health.interval.max(hang_limit(endpoint))
        } else {
            health.interval
        };
        probe_due(
            endpoint.breaker_state(),
            probed,
            endpoint.last_sign_of_life(),
            quiet,
            recovering,
        )
    };
    let mut probed = Instant::now();
    // Since when calls have been in flight without a pause.
    let mut busy_since: Option<Instant> = None;
    loop {
        let exited = async {
            match process.as_mut() {
                Some(process) => process.wait().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = stop.cancelled() => return Ended::Stopped,
            status = exited => {
                let how = match status {
                    Ok(status) => format!("exited ({status})"),
                    Err(err) => format!("could not be watched ({err})"),
                };
                return Ended::Died(how);
            }
            () = tokio::time::sleep_until(due(probed)) => {
                // Its calls may have shown it works meanwhile.
                if due(probed) > Instant::now() {
                    continue;
                }
            }
            _ = changes.changed() => {}
            () = endpoint.probe_now.notified() => {}
        }
        let result = probe(endpoint, &http, &url, health.timeout).await;
        probed = Instant::now();
        match endpoint.on_probe(result.is_ok()) {
            Some(Transition::Faulty) => judge_faulty(shared, endpoint),
            transition => report_transition(shared, endpoint, transition, result.err()),
        }
        if let (Some(after), Some(for_how_long)) =
            (restart_after, endpoint.unhealthy_for(Instant::now()))
            && for_how_long >= after
        {
            return Ended::StayedUnhealthy;
        }
        if restart_after.is_some()
            && let Some(silent) = hung(endpoint, &mut busy_since, Instant::now())
        {
            return Ended::Hung(silent);
        }
    }
}

/// How long calls in flight may show nothing before they are hung: the
/// endpoint's `health.hang_after`, or four times what its calls normally
/// take when more (five times `hang_after` until that is known).
fn hang_limit(endpoint: &Endpoint) -> Duration {
    let hang_after = endpoint.config.health.hang_after;
    match endpoint.normal_latency() {
        Some(normal) => hang_after.max(normal * 4),
        None => hang_after * 5,
    }
}

/// Whether `endpoint`'s calls are hung: calls are in flight, and none has
/// shown a sign of life (nor has it been idle) for its `health.hang_after`
/// (see [`evalfleet_config::HealthSettings::hang_after`]); how long, when
/// they are. `busy_since` keeps when calls were last seen in flight
/// without a pause.
fn hung(endpoint: &Endpoint, busy_since: &mut Option<Instant>, now: Instant) -> Option<Duration> {
    if endpoint.limit.in_flight() == 0 {
        *busy_since = None;
        return None;
    }
    let busy = *busy_since.get_or_insert(now);
    let limit = hang_limit(endpoint);
    let last = endpoint
        .last_sign_of_life()
        .map_or(busy, |life| life.max(busy));
    let silent = now.saturating_duration_since(last);
    (silent >= limit).then_some(silent)
}

/// When an endpoint whose breaker is in `state`, last probed at `probed`,
/// is due for its next probe. While it takes items, `quiet` after it
/// last showed a sign of life, its last probe's or its calls' (`life`): an
/// endpoint whose calls go well is never probed, one that is idle, or whose
/// calls fail or hang, once a `quiet` (its health interval; with calls in
/// flight, the time they may show nothing before they are hung); no probe
/// competes with calls that go well (on a server that serves one request
/// at a time, a probe that waits cuts the running stream). While
/// unhealthy, `recovering` after its last probe.
fn probe_due(
    state: crate::BreakerState,
    probed: Instant,
    life: Option<Instant>,
    quiet: Duration,
    recovering: Duration,
) -> Instant {
    if state == crate::BreakerState::Closed {
        life.map_or(probed, |life| life.max(probed)) + quiet
    } else {
        probed + recovering
    }
}

/// Ejection caps: at most this share of the endpoints that take items is
/// ejected for faults (endpoints that are down do not count against it).
const MAX_EJECTION: f64 = 0.5;

/// Whether the others can carry `endpoint`'s load: another endpoint takes
/// items, and at most [`MAX_EJECTION`] of them would be out with it. When
/// they cannot, a faulty endpoint keeps its calls (panic mode: better a
/// faulty endpoint than none).
fn may_eject(shared: &Shared, endpoint: &Endpoint) -> bool {
    if !endpoint.config.takes_items() {
        // A judge endpoint's calls can go nowhere else.
        return false;
    }
    let takers: Vec<_> = shared
        .peers
        .iter()
        .filter(|p| p.config.takes_items() && p.phase() == Phase::Ready)
        .collect();
    let out = takers.iter().filter(|p| !p.accepting()).count();
    let others = takers
        .iter()
        .filter(|p| p.name != endpoint.name && p.accepting())
        .count();
    others > 0 && (out + 1) as f64 <= MAX_EJECTION * takers.len() as f64
}

/// Takes a faulty endpoint out for a while ([`Endpoint::eject`]), saying
/// why.
fn eject(shared: &Shared, endpoint: &Endpoint, why: &str) {
    let (transition, length) = endpoint.eject(endpoint.config.health.ejection);
    if transition == Some(Transition::Opened) {
        shared.event(
            endpoint,
            EventKind::Ejected,
            format!(
                "Endpoint {} is ejected for {}: {why}; the others take its items, and its calls in flight go on.",
                endpoint.name,
                humantime::format_duration(length)
            ),
        );
    }
}

/// An endpoint whose calls fail one after another while its probe
/// answers: ejected when the others can carry the load; otherwise it keeps
/// its calls.
fn judge_faulty(shared: &Shared, endpoint: &Endpoint) {
    let why = format!(
        "{} calls in a row failed while it answers probes",
        crate::breaker::FAULTS_IN_A_ROW
    );
    if may_eject(shared, endpoint) {
        eject(shared, endpoint, &why);
    } else if endpoint.config.takes_items() {
        shared.event(
            endpoint,
            EventKind::Unhealthy,
            format!(
                "Endpoint {}: {why}; it keeps its calls, as the others cannot carry its load.",
                endpoint.name
            ),
        );
    }
}

/// Ejects the endpoints whose calls fail clearly more often than their
/// peers' ([`crate::outlier`]), worst first, while the others can carry
/// the load.
pub(super) fn eject_outliers(shared: &Shared, endpoints: &[Arc<Endpoint>]) {
    let peers: Vec<&Arc<Endpoint>> = endpoints
        .iter()
        .filter(|e| e.config.takes_items() && e.accepting())
        .collect();
    if peers.len() < 2 {
        return;
    }
    let tallies: Vec<_> = peers.iter().map(|e| e.outcomes()).collect();
    for found in crate::outlier::outliers(&tallies) {
        let endpoint = peers[found.index];
        let why = format!(
            "{:.0}% of its last {} calls failed, against {:.0}% of {} on the others",
            100.0 * found.own.share(),
            found.own.calls,
            100.0 * found.others.share(),
            found.others.calls
        );
        if may_eject(shared, endpoint) {
            eject(shared, endpoint, &why);
        } else {
            tracing::debug!(
                "Endpoint {} is an outlier ({why}) but the others cannot carry its load.",
                endpoint.name
            );
        }
    }
}

pub(super) fn report_transition(
    shared: &Shared,
    endpoint: &Endpoint,
    transition: Option<Transition>,
    why: Option<String>,
) {
    match transition {
        Some(Transition::Opened) => shared.event(
            endpoint,
            EventKind::Unhealthy,
            format!(
                "Endpoint {} is unhealthy ({}); it takes no new calls until it recovers.",
                endpoint.name,
                why.unwrap_or_else(|| "calls failed".to_owned())
            ),
        ),
        Some(Transition::HalfOpened) => shared.event(
            endpoint,
            EventKind::Recovering,
            format!(
                "Endpoint {} answers probes again; waiting for it to stay up.",
                endpoint.name
            ),
        ),
        Some(Transition::Closed) => shared.event(
            endpoint,
            EventKind::Recovered,
            format!(
                "Endpoint {} is healthy again and takes items.",
                endpoint.name
            ),
        ),
        Some(Transition::Suspected) => endpoint.probe_now.notify_one(),
        Some(Transition::Faulty) | None => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BreakerState;
    use serde_json::Value;

    /// The endpoints of a config whose `endpoints:` are `endpoints`.
    fn endpoints(endpoints: Value) -> Vec<EndpointConfig> {
        // The config names a dataset that exists; nothing reads it.
        let dataset = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
        let config = serde_json::json!({
            "name": "t",
            "dataset": {"path": dataset, "format": "jsonl"},
            "endpoints": endpoints,
            "task": {"messages": [{"role": "user", "content": "{{ q }}"}]},
        });
        evalfleet_config::load_snapshot(&config, std::path::Path::new("."))
            .unwrap()
            .config
            .endpoints
    }

    #[test]
    fn each_engine_is_probed_on_a_path_that_costs_it_nothing() {
        let local = |name: &str, preset: &str| serde_json::json!({"name": name, "kind": "local", "preset": preset, "model": "m"});
        let configs = endpoints(serde_json::json!([
            local("l", "llama.cpp"),
            local("v", "vllm"),
            local("s", "sglang"),
            local("o", "ollama"),
            {"name": "c", "kind": "local", "command": "serve --port {port}", "model": "m"},
            {"name": "e", "kind": "external", "base_url": "http://h:1/api/v1/", "model": "m"},
            {"name": "p", "kind": "external", "base_url": "http://h:1/v1", "model": "m",
             "health": {"path": "/ping"}},
        ]));
        let urls: Vec<String> = configs
            .iter()
            .map(|c| health_url(c, "http://127.0.0.1:9/v1"))
            .collect();
        assert_eq!(
            urls,
            [
                "http://127.0.0.1:9/health",
                "http://127.0.0.1:9/health",
                "http://127.0.0.1:9/health",
                "http://127.0.0.1:9/api/version",
                "http://127.0.0.1:9/v1/models",
                "http://127.0.0.1:9/v1/models",
                "http://127.0.0.1:9/ping",
            ]
        );
    }

    #[test]
    fn a_probe_is_due_only_an_interval_after_the_last_sign_of_life() {
        let interval = Duration::from_secs(5);
        let recovering = Duration::from_secs(1);
        let probed = Instant::now();
        let due = |state, life| probe_due(state, probed, life, interval, recovering);
        // Idle since its last probe: an interval after it.
        assert_eq!(due(BreakerState::Closed, None), probed + interval);
        // A call answered or streamed since: an interval after that, so
        // an endpoint whose calls go on showing life is never probed.
        let life = probed + Duration::from_secs(3);
        assert_eq!(due(BreakerState::Closed, Some(life)), life + interval);
        // Life before the last probe counts from the probe.
        let earlier = probed.checked_sub(Duration::from_secs(3));
        assert_eq!(due(BreakerState::Closed, earlier), probed + interval);
        // Unhealthy: five times as often, whatever its calls in flight say.
        for state in [BreakerState::Open, BreakerState::HalfOpen] {
            assert_eq!(due(state, Some(life)), probed + recovering);
        }
    }
}
