//! What becomes of a request, drawn from the seed: an answer and what goes
//! wrong with it, an injected error or fault, or a hang.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::atomic::Ordering;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;

use super::response::error_response;
use super::state::MockState;
use crate::settings::Fault;

/// What the mock decided to do with one request.
enum Fate {
    Answer(Mishaps),
    Fail,
    Fault(Fault),
    Hang,
}

/// What goes wrong with an answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Mishaps {
    /// The connection drops half-way (`truncate_rate`).
    pub(super) truncate: bool,
    /// Nothing is sent for `stall` half-way (`stall_rate`).
    pub(super) stall: bool,
    /// A stream ends half-way with `data: [DONE]` (`cut_rate`).
    pub(super) cut: bool,
    /// A stream closes after its finish_reason, never ended (`unended_rate`).
    pub(super) unended: bool,
}

impl MockState {
    fn fate(&self, prompt_key: u64) -> Fate {
        let settings = &self.settings;
        if !settings.needs_prompt_counts() {
            return Fate::Answer(Mishaps::default());
        }
        let seen = {
            let mut counts = self
                .prompt_counts
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let entry = counts.entry(prompt_key).or_insert(0);
            let seen = *entry;
            *entry += 1;
            seen
        };
        if seen < settings.fail_first {
            return Fate::Fail;
        }
        let mut hasher = DefaultHasher::new();
        (settings.seed, prompt_key, seen).hash(&mut hasher);
        let mut rng = fastrand::Rng::with_seed(hasher.finish());
        if rng.f64() < settings.hang_rate {
            return Fate::Hang;
        }
        if rng.f64() < settings.error_rate {
            return Fate::Fail;
        }
        let truncate = rng.f64() < settings.truncate_rate;
        // Later decisions draw from a generator of their own, so that a seed
        // keeps the fates it gave before they existed.
        let mut hasher = DefaultHasher::new();
        (settings.seed, prompt_key, seen, "faults, stalls, cuts").hash(&mut hasher);
        let mut rng = fastrand::Rng::with_seed(hasher.finish());
        let fault = pick_fault(&settings.faults, rng.f64());
        let stall = rng.f64() < settings.stall_rate;
        let cut = rng.f64() < settings.cut_rate;
        let unended = rng.f64() < settings.unended_rate;
        match fault {
            Some(fault) => Fate::Fault(fault),
            None => Fate::Answer(Mishaps {
                truncate,
                stall,
                cut: cut && !truncate,
                unended: unended && !truncate && !cut,
            }),
        }
    }
}

/// The fault whose share of `[0, 1)` holds `draw`: each takes the next
/// `rate` of it, so at most one is picked.
fn pick_fault(faults: &[Fault], draw: f64) -> Option<Fault> {
    let mut upto = 0.0;
    faults.iter().copied().find(|fault| {
        upto += fault.rate;
        draw < upto
    })
}

/// What the mock's fate for a request (keyed by `key`) comes to: the
/// mishaps of its answer, or the error it gets instead (after hanging, for
/// a hang, until the mock stops).
pub(super) async fn decide(state: &MockState, key: u64) -> Result<Mishaps, Response> {
    match state.fate(key) {
        Fate::Fail => {
            state.stats.injected_errors.fetch_add(1, Ordering::Relaxed);
            let status = StatusCode::from_u16(state.settings.error_status)
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            Err(error_response(status, "injected error"))
        }
        Fate::Fault(fault) => {
            state.stats.fault(fault.status);
            let status =
                StatusCode::from_u16(fault.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let mut response = error_response(status, "injected fault");
            if let Some(after) = fault.retry_after {
                let seconds = after.as_secs_f64().ceil() as u64;
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
            }
            Err(response)
        }
        Fate::Hang => {
            state.stats.hung.fetch_add(1, Ordering::Relaxed);
            state.shutdown.cancelled().await;
            Err(error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "mock shutting down",
            ))
        }
        Fate::Answer(mishaps) => Ok(mishaps),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_take_consecutive_shares_of_one_draw() {
        let fault = |status, rate| Fault {
            status,
            rate,
            retry_after: None,
        };
        let faults = [fault(500, 0.1), fault(503, 0.2)];
        let picked = |draw| pick_fault(&faults, draw).map(|f| f.status);
        assert_eq!(picked(0.05), Some(500));
        assert_eq!(picked(0.1), Some(503));
        assert_eq!(picked(0.29), Some(503));
        assert_eq!(picked(0.31), None);
    }
}
