//! The open files a process may keep, and the calls in flight they allow.
//!
//! Every call in flight holds a socket, and a socket is an open file. Most
//! Linux systems give a process a soft limit of 1,024 open files (its hard
//! limit is often far higher), and an adaptive limit climbs to 1,024 calls
//! on a fast endpoint: past the soft limit, connects fail with "Too many
//! open files", which says nothing of the endpoint, yet would count against
//! it (a run of 5,000 items at 50 ms took 9.7 s instead of 0.6, its endpoint
//! marked unhealthy for 9 s). So the process raises its soft limit to its
//! hard one at start ([`raise`]), and the endpoints' limits are kept within
//! what is left after a reserve for everything else ([`bound`]).
//!
//! A connect that still finds no file left (EMFILE, ENFILE: see
//! [`crate::client::Unanswered::out_of_files`]) is retried and cuts the
//! endpoint's limit, but says nothing of the endpoint's health. A process
//! that runs several sessions at once (`serve`) shares the allowance: each
//! fleet takes its calls' files from what the fleets alive before it left
//! ([`Taken`]), and gives them back when it ends.

use std::borrow::Cow;
use std::sync::{Mutex, PoisonError};

use evalfleet_config::{EndpointConfig, LimitMode};
use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

/// Files kept for everything but calls: the store and its log and shared
/// memory files, the dataset, logs, the dashboard's and the gateway's
/// sockets, agents' pipes.
pub const RESERVE: u64 = 128;

/// The most the soft limit is raised to, however high the hard one.
const MOST: u64 = 1 << 20;

/// What it is raised to where the system refuses more (macOS's
/// `OPEN_MAX`, under an unlimited hard limit).
const FALLBACK: u64 = 10_240;

/// Open files a call in flight may hold: its socket, and the other end's
/// where the endpoint is served in this process (`kind: mock`) or the
/// call comes through the gateway from an agent.
const PER_CALL: u64 = 2;

/// Raises the soft limit on open files to the hard one (at most
/// [`MOST`]; where the system refuses that, [`FALLBACK`]; where it
/// refuses both, it stays). Engines and agents this process starts inherit
/// it; sandboxed programs get 1,024.
pub fn raise() {
    let limit = getrlimit(Resource::Nofile);
    let Some(current) = limit.current else {
        return;
    };
    let wanted = limit.maximum.unwrap_or(MOST).min(MOST);
    let mut last = None;
    for to in [wanted, wanted.min(FALLBACK)] {
        if to <= current {
            break;
        }
        let raised = Rlimit {
            current: Some(to),
            maximum: limit.maximum,
        };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => return,
            Err(err) => last = Some(err),
        }
    }
    if let Some(err) = last {
        tracing::debug!("The open files limit stays at {current}: {err}.");
    }
}

/// The open files that the fleets alive in a process have taken for their
/// calls.
#[derive(Debug)]
struct Ledger(Mutex<u64>);

impl Ledger {
    const fn new() -> Self {
        Self(Mutex::new(0))
    }

    fn taken(&self) -> std::sync::MutexGuard<'_, u64> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// This process's ledger.
static LEDGER: Ledger = Ledger::new();

/// The open files one fleet's endpoints took for their calls, given back
/// to its ledger when it is dropped (the fleet ends).
#[derive(Debug)]
pub struct Taken<'l> {
    ledger: &'l Ledger,
    files: u64,
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        let mut taken = self.ledger.taken();
        *taken = taken.saturating_sub(self.files);
    }
}

/// `endpoints`, each with its concurrency within its share of the calls
/// the soft limit on open files allows (see [`calls_allowed`]), less what
/// the other fleets alive in this process took; those within it already,
/// as they are. The files the endpoints' calls may hold are taken until
/// the [`Taken`] is dropped.
pub fn bound(endpoints: &[EndpointConfig]) -> (Vec<Cow<'_, EndpointConfig>>, Taken<'static>) {
    bound_within(&LEDGER, getrlimit(Resource::Nofile).current, endpoints)
}

/// [`bound`] under a soft limit of `soft` open files (`None`: no bound),
/// sharing it through `ledger`.
fn bound_within<'e, 'l>(
    ledger: &'l Ledger,
    soft: Option<u64>,
    endpoints: &'e [EndpointConfig],
) -> (Vec<Cow<'e, EndpointConfig>>, Taken<'l>) {
    let wants: Vec<usize> = endpoints.iter().map(wanted).collect();
    let mut taken = ledger.taken();
    let others = *taken;
    let left = soft.map(|soft| soft.saturating_sub(others));
    let (Some(soft), Some(allowed)) = (soft, calls_allowed(left, &wants)) else {
        return (
            endpoints.iter().map(Cow::Borrowed).collect(),
            Taken { ledger, files: 0 },
        );
    };
    let bounded: Vec<_> = endpoints
        .iter()
        .zip(&allowed)
        .map(|(endpoint, most)| within(endpoint, *most, soft, others))
        .collect();
    let files = bounded
        .iter()
        .map(|e| wanted(e) as u64 * PER_CALL)
        .sum::<u64>();
    *taken = taken.saturating_add(files);
    (bounded, Taken { ledger, files })
}

/// The most calls each endpoint may keep in flight, given the most each
/// asks for (`wants`: its fixed concurrency, or its adaptive limit's
/// maximum), within a soft limit of `soft` open files (`None`: no bound).
/// What is left after [`RESERVE`], at [`PER_CALL`] files a call, is shared
/// by the endpoints: one that asks for less than an even share keeps what
/// it asks, and leaves the rest to the others; one call each at least.
fn calls_allowed(soft: Option<u64>, wants: &[usize]) -> Option<Vec<usize>> {
    let mut left = usize::try_from(soft?.saturating_sub(RESERVE) / PER_CALL).unwrap_or(usize::MAX);
    let mut order: Vec<usize> = (0..wants.len()).collect();
    order.sort_by_key(|&i| wants[i]);
    let mut allowed = vec![0; wants.len()];
    for (k, i) in order.into_iter().enumerate() {
        let share = left / (wants.len() - k);
        allowed[i] = wants[i].min(share).max(1);
        left = left.saturating_sub(allowed[i]);
    }
    Some(allowed)
}

/// The most calls `endpoint` asks to keep in flight.
fn wanted(endpoint: &EndpointConfig) -> usize {
    match endpoint.concurrency {
        LimitMode::Fixed(n) => n,
        LimitMode::Adaptive(settings) => settings.max,
    }
}

/// `endpoint` with its concurrency within `most` calls at once, under a
/// soft limit of `soft` open files (its settings, unchanged, where they
/// are within already). A fixed concurrency lowered is warned of; an
/// adaptive limit's maximum lowered is said once, as information.
fn within(
    endpoint: &EndpointConfig,
    most: usize,
    soft: u64,
    others: u64,
) -> Cow<'_, EndpointConfig> {
    // Other runs of this process (`serve`) hold files of their own.
    let shared = if others > 0 {
        format!(", {others} more taken by the other runs of this process")
    } else {
        String::new()
    };
    let concurrency = match endpoint.concurrency {
        LimitMode::Fixed(n) if n > most => {
            tracing::warn!(
                "Endpoint {}: concurrency {n} lowered to {most}: this process may keep {soft} \
                 files open (`ulimit -n`), {RESERVE} of them kept for the store, logs and \
                 agents{shared}, the rest shared by the endpoints' calls ({PER_CALL} files a \
                 call); raise the limit for more.",
                endpoint.name
            );
            LimitMode::Fixed(most)
        }
        LimitMode::Adaptive(mut settings) if settings.max > most => {
            tracing::info!(
                "Endpoint {}: at most {most} calls at once (adaptive): this process may keep \
                 {soft} files open (`ulimit -n`), {RESERVE} of them kept for the store, logs \
                 and agents{shared}, the rest shared by the endpoints' calls ({PER_CALL} files a \
                 call).",
                endpoint.name
            );
            settings.max = most;
            settings.initial = settings.initial.min(most);
            settings.min = settings.min.min(most);
            LimitMode::Adaptive(settings)
        }
        _ => return Cow::Borrowed(endpoint),
    };
    Cow::Owned(EndpointConfig {
        concurrency,
        ..endpoint.clone()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_files_left_after_the_reserve_are_shared_by_the_endpoints() {
        assert_eq!(calls_allowed(None, &[1024, 8]), None);
        // (1,024 - 128) / 2 = 448 calls.
        assert_eq!(calls_allowed(Some(1024), &[1024]), Some(vec![448]));
        assert_eq!(calls_allowed(Some(1024), &[1024; 4]), Some(vec![112; 4]));
        // A judge at 4 calls leaves the rest to the others.
        assert_eq!(
            calls_allowed(Some(1024), &[1024, 4, 1024]),
            Some(vec![222, 4, 222])
        );
        // What every endpoint asks for, where there is room.
        assert_eq!(
            calls_allowed(Some(1 << 20), &[1024, 64]),
            Some(vec![1024, 64])
        );
        // Never none at all.
        assert_eq!(calls_allowed(Some(100), &[8, 8]), Some(vec![1, 1]));
    }

    /// An endpoint with an adaptive limit of at most `max` calls.
    fn adaptive(name: &str, max: usize) -> EndpointConfig {
        // The config names a dataset that exists; nothing reads it.
        let dataset = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
        let config = serde_json::json!({
            "name": "t",
            "dataset": {"path": dataset, "format": "jsonl"},
            "endpoints": [{"name": name, "kind": "external", "base_url": "http://127.0.0.1:9/v1",
                           "model": "m", "concurrency": "adaptive"}],
            "task": {"messages": [{"role": "user", "content": "{{ q }}"}]},
        });
        let mut endpoint = evalfleet_config::load_snapshot(&config, std::path::Path::new("."))
            .unwrap_or_else(|err| panic!("{err}"))
            .config
            .endpoints
            .remove(0);
        match &mut endpoint.concurrency {
            LimitMode::Adaptive(settings) => settings.max = max,
            LimitMode::Fixed(_) => panic!("the endpoint's limit is not adaptive"),
        }
        endpoint
    }

    /// Runs of one process (`serve`) share its open files: a second fleet
    /// gets what the first left, and all of it again once the first ends.
    #[test]
    fn fleets_alive_at_once_share_the_open_files() {
        let ledger = Ledger::new();
        let one = [adaptive("a", 1024)];
        let (first, taken) = bound_within(&ledger, Some(2048), &one);
        // (2,048 - 128) / 2 = 960 calls, 1,920 files.
        assert_eq!(wanted(&first[0]), 960);
        assert_eq!(taken.files, 1920);
        // 2,048 - 1,920 taken leaves 128, all of it the reserve: one call.
        let (second, also) = bound_within(&ledger, Some(2048), &one);
        assert_eq!(wanted(&second[0]), 1);
        assert_eq!(also.files, 2);
        drop(taken);
        let (third, _) = bound_within(&ledger, Some(2048), &one);
        assert_eq!(wanted(&third[0]), (2048 - 2 - 128) / 2);
        drop(also);
        // Where the limit leaves room for every call, each takes what it
        // asks for.
        let (other, few) = (Ledger::new(), [adaptive("b", 64)]);
        let (wide, _) = bound_within(&other, Some(1 << 20), &few);
        assert_eq!(wanted(&wide[0]), 64);
        // No limit: nothing is bound or taken.
        let unbounded = Ledger::new();
        let (free, none) = bound_within(&unbounded, None, &one);
        assert_eq!(wanted(&free[0]), 1024);
        assert_eq!(none.files, 0);
    }
}
