//! What agents cost per item (`kind: exec`): calls, tokens and the time
//! of their calls, each item's summed over every run of its agent, as
//! means with their 95% interval. Read as a stream of the calls' figures
//! (never their bodies) in item order: one item's sums are held at a time.

use std::collections::BTreeMap;

use serde::Serialize;

use super::stats::{Estimate, Moments, estimate};
use evalfleet_store::{CallSample, Store, StoreError};

/// A run's agents' calls, per item.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct AgentFigures {
    /// Items whose agent made at least one call: the means are over them.
    pub items: u64,
    /// Calls made, over every attempt.
    pub calls: u64,
    /// Calls that got an error (an error class, or a status other than
    /// 2xx).
    pub failed_calls: u64,
    /// Calls answered from the response cache.
    pub cached_calls: u64,
    /// Calls by API (`chat.completions`, `embeddings`, ...).
    pub apis: BTreeMap<String, u64>,
    /// Calls per item.
    pub calls_per_item: Estimate,
    /// Prompt and completion tokens per item (a call that reported none
    /// counts none).
    pub tokens_per_item: Estimate,
    /// The time of an item's calls: the sum of their latencies, in ms
    /// (calls made at once count each).
    pub call_ms_per_item: Estimate,
    /// Attempts (runs of the agent) per item, counting those that made
    /// calls.
    pub attempts_per_item: Estimate,
}

/// One item's sums, while its calls are read.
#[derive(Debug, Default)]
struct ItemSums {
    seq: u64,
    calls: u64,
    tokens: u64,
    call_ms: f64,
    attempts: u64,
    last_attempt: Option<u32>,
}

/// Running sums over a run's calls, in item order.
#[derive(Debug)]
pub struct AgentSums {
    current: Option<ItemSums>,
    items: u64,
    calls: u64,
    failed_calls: u64,
    cached_calls: u64,
    apis: BTreeMap<String, u64>,
    calls_per_item: Moments,
    tokens_per_item: Moments,
    call_ms_per_item: Moments,
    attempts_per_item: Moments,
}

impl Default for AgentSums {
    fn default() -> Self {
        Self {
            current: None,
            items: 0,
            calls: 0,
            failed_calls: 0,
            cached_calls: 0,
            apis: BTreeMap::new(),
            calls_per_item: Moments::quantities(),
            tokens_per_item: Moments::quantities(),
            call_ms_per_item: Moments::quantities(),
            attempts_per_item: Moments::quantities(),
        }
    }
}

impl AgentSums {
    /// Adds a call; calls come in item order.
    pub fn add(&mut self, call: &CallSample) {
        self.calls += 1;
        self.failed_calls += u64::from(call.failed);
        self.cached_calls += u64::from(call.cached);
        match self.apis.get_mut(&call.api) {
            Some(count) => *count += 1,
            None => {
                self.apis.insert(call.api.clone(), 1);
            }
        }
        if self.current.as_ref().is_some_and(|c| c.seq != call.seq) {
            self.end_item();
        }
        let item = self.current.get_or_insert_with(|| ItemSums {
            seq: call.seq,
            ..ItemSums::default()
        });
        item.calls += 1;
        item.tokens += call.prompt_tokens.unwrap_or(0) + call.completion_tokens.unwrap_or(0);
        item.call_ms += call.latency_ms;
        if item.last_attempt != Some(call.attempt) {
            item.attempts += 1;
            item.last_attempt = Some(call.attempt);
        }
    }

    fn end_item(&mut self) {
        if let Some(item) = self.current.take() {
            self.items += 1;
            self.calls_per_item.add(item.calls as f64);
            self.tokens_per_item.add(item.tokens as f64);
            self.call_ms_per_item.add(item.call_ms);
            self.attempts_per_item.add(item.attempts as f64);
        }
    }

    /// The figures; `None` when no call was added.
    pub fn finish(mut self) -> Option<AgentFigures> {
        self.end_item();
        (self.items > 0).then(|| AgentFigures {
            items: self.items,
            calls: self.calls,
            failed_calls: self.failed_calls,
            cached_calls: self.cached_calls,
            apis: self.apis,
            calls_per_item: estimate(&self.calls_per_item),
            tokens_per_item: estimate(&self.tokens_per_item),
            call_ms_per_item: estimate(&self.call_ms_per_item),
            attempts_per_item: estimate(&self.attempts_per_item),
        })
    }
}

/// The agents' figures of run `run_id`; `None` when its items' agents
/// made no call (a run with no `kind: exec` task).
pub fn agents(store: &mut dyn Store, run_id: &str) -> Result<Option<AgentFigures>, StoreError> {
    let mut sums = AgentSums::default();
    store.scan_call_samples(run_id, &mut |call| sums.add(&call))?;
    Ok(sums.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(seq: u64, attempt: u32, latency_ms: f64, tokens: u64) -> CallSample {
        CallSample {
            seq,
            attempt,
            api: "chat.completions".to_owned(),
            latency_ms,
            prompt_tokens: Some(tokens),
            completion_tokens: None,
            cached: false,
            failed: false,
            ..CallSample::default()
        }
    }

    #[test]
    fn each_items_calls_are_summed_then_averaged_with_an_interval() {
        let mut sums = AgentSums::default();
        // Item 1: two runs of its agent, three calls; item 2: one call.
        for c in [
            call(1, 1, 100.0, 10),
            call(1, 2, 50.0, 20),
            call(1, 2, 50.0, 30),
            call(2, 1, 40.0, 40),
        ] {
            sums.add(&c);
        }
        let figures = sums.finish().unwrap();
        assert_eq!((figures.items, figures.calls), (2, 4));
        assert_eq!(figures.apis["chat.completions"], 4);
        assert_eq!(figures.calls_per_item.mean, 2.0);
        assert_eq!(figures.tokens_per_item.mean, 50.0);
        assert_eq!(figures.call_ms_per_item.mean, 120.0);
        assert_eq!(figures.attempts_per_item.mean, 1.5);
        // calls 3 and 1: sd √2, stderr 1, so 2 ± 1.96.
        let ci = figures.calls_per_item;
        assert!((ci.ci_low - 0.04).abs() < 0.01 && (ci.ci_high - 3.96).abs() < 0.01);
    }

    #[test]
    fn one_call_per_item_is_a_count_not_a_share() {
        let mut sums = AgentSums::default();
        sums.add(&call(1, 1, 1.0, 1));
        sums.add(&call(2, 1, 1.0, 1));
        let figures = sums.finish().unwrap();
        // Every item made exactly one call: no spread, no interval around 1
        // (a share's interval would reach below it).
        assert_eq!(
            (
                figures.calls_per_item.ci_low,
                figures.calls_per_item.ci_high
            ),
            (1.0, 1.0)
        );
    }

    #[test]
    fn no_calls_no_figures() {
        assert_eq!(AgentSums::default().finish(), None);
    }
}
