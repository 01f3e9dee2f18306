//! `evalfleet export --format trajectories`: each item's agent run as a
//! chat-format conversation, one JSON line an item, ready for fine-tuning
//! (OpenAI's chat format: `messages`, `tools`) or RL pipelines (the item's
//! status and scores beside it).
//!
//! An item's trajectory is its final attempt's (the last run of its agent
//! that made calls): the messages of that attempt's last answered chat
//! completion, as the agent sent them (so its earlier turns, tool calls and
//! tool results are there as the chat format has them), followed by the
//! assistant's answer. Items whose final attempt has no answered chat
//! completion, or whose request was cut when stored, are left out, and
//! counted.
//!
//! Results are read a page at a time in dataset order, each page with its
//! items' calls; an item's calls are read one at a time and only the one
//! that will be written is held, so memory does not grow with the run.

use serde::Serialize;
use serde_json::{Map, Value};

use evalfleet_types::{AgentCall, ItemStatus, Scores};

use evalfleet_store::{ExportError, ResultOrder, Results, StoreError};

/// The API whose calls make trajectories.
pub const CHAT: &str = "chat.completions";

/// Results read at a time.
const PAGE: usize = 256;

/// One line of the export.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Trajectory {
    pub item_id: String,
    pub status: ItemStatus,
    /// Metric key → the item's score (`null` where the metric could not
    /// score it).
    pub scores: Map<String, Value>,
    /// The attempt (run of the agent) the messages are from.
    pub attempt: u32,
    /// The conversation: the request's messages, then the answer.
    pub messages: Vec<Value>,
    /// The tools the request offered, when it offered any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools: Option<Value>,
    /// Calls the attempt made (every API).
    pub calls: u32,
}

/// What an export wrote, and what it left out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Written {
    pub items: u64,
    /// Ended items whose final attempt has no answered chat completion
    /// (items without calls included).
    pub no_chat: u64,
    /// Ended items whose last chat request was cut when stored (too long
    /// to keep whole) or is not JSON.
    pub unreadable: u64,
}

/// An ended item of a page, owned.
struct Ended {
    seq: u64,
    item_id: String,
    status: ItemStatus,
    scores: Option<String>,
}

/// The final attempt of the item being read.
#[derive(Default)]
struct Final {
    seq: u64,
    attempt: u32,
    calls: u32,
    /// Its last chat completion that got an answer.
    chat: Option<AgentCall>,
}

impl Final {
    fn add(&mut self, call: AgentCall) {
        if call.seq != self.seq || call.attempt != self.attempt {
            *self = Self {
                seq: call.seq,
                attempt: call.attempt,
                ..Self::default()
            };
        }
        self.calls += 1;
        if call.api == CHAT && call.response.is_some() && call.error.is_none() {
            self.chat = Some(call);
        }
    }
}

/// The trajectory of `call`, the last answered chat completion of an
/// item's final attempt; `None` when its request cannot be read.
pub fn trajectory(
    item_id: &str,
    status: ItemStatus,
    scores: Map<String, Value>,
    call: &AgentCall,
    calls: u32,
) -> Option<Trajectory> {
    if call.request_cut {
        return None;
    }
    let Ok(Value::Object(mut request)) = serde_json::from_str::<Value>(&call.request) else {
        return None;
    };
    let Some(Value::Array(mut messages)) = request.remove("messages") else {
        return None;
    };
    messages.push(answer(call.response.as_deref()?)?);
    let tools = request
        .remove("tools")
        .filter(|t| t.as_array().is_some_and(|a| !a.is_empty()));
    Some(Trajectory {
        item_id: item_id.to_owned(),
        status,
        scores,
        attempt: call.attempt,
        messages,
        tools,
        calls,
    })
}

/// The assistant's message as the chat format has it: its role, content
/// and tool calls (left out when there are none).
fn answer(response: &str) -> Option<Value> {
    let Ok(Value::Object(mut message)) = serde_json::from_str::<Value>(response) else {
        return None;
    };
    // A whole completion's body: its first choice's message.
    if let Some(Value::Object(inner)) = message
        .get_mut("choices")
        .and_then(|c| c.get_mut(0))
        .and_then(|c| c.get_mut("message"))
        .map(Value::take)
    {
        message = inner;
    }
    if message
        .get("tool_calls")
        .is_some_and(|t| t.is_null() || t.as_array().is_some_and(Vec::is_empty))
    {
        message.remove("tool_calls");
    }
    message
        .entry("role")
        .or_insert_with(|| Value::String("assistant".to_owned()));
    message.entry("content").or_insert(Value::Null);
    Some(Value::Object(message))
}

/// Metric key → score value, from stored scores (JSON).
fn score_values(scores: Option<&str>) -> Result<Map<String, Value>, StoreError> {
    let Some(text) = scores else {
        return Ok(Map::new());
    };
    let scores: Scores = serde_json::from_str(text).map_err(|err| StoreError::Backend {
        message: "stored scores cannot be read".to_owned(),
        source: Some(Box::new(err)),
    })?;
    Ok(scores
        .into_iter()
        .map(|(key, score)| (key, score.value.map_or(Value::Null, Value::from)))
        .collect())
}

/// Writes the trajectory of every ended item of `run_id` that has one, in
/// dataset order, to `each`.
pub fn export_trajectories(
    store: &mut dyn Results,
    run_id: &str,
    each: &mut dyn FnMut(&Trajectory) -> std::io::Result<()>,
) -> Result<Written, ExportError> {
    let mut written = Written::default();
    let mut after: Option<(String, u64)> = None;
    loop {
        let mut page: Vec<Ended> = Vec::new();
        store.results_page(
            run_id,
            ResultOrder::Seq,
            after.as_ref().map(|(id, seq)| (id.as_str(), *seq)),
            PAGE,
            false,
            &mut |r| {
                page.push(Ended {
                    seq: r.seq,
                    item_id: r.item_id.to_owned(),
                    status: r.status,
                    scores: r.scores.map(str::to_owned),
                });
                Ok(())
            },
        )?;
        let (Some(first), Some(last)) = (page.first(), page.last()) else {
            return Ok(written);
        };
        let seqs = first.seq..=last.seq;
        after = Some((last.item_id.clone(), last.seq));
        // Calls come in item order; the page's items are written as the
        // calls move past them (an item of no result, still pending, has
        // its calls skipped).
        let mut next = 0;
        let mut current = Final::default();
        let mut failed: Option<ExportError> = None;
        let mut write = |item: &Ended, current: &Final| -> Result<(), ExportError> {
            let Some(call) = current.chat.as_ref().filter(|_| current.seq == item.seq) else {
                written.no_chat += 1;
                return Ok(());
            };
            let scores = score_values(item.scores.as_deref())?;
            match trajectory(&item.item_id, item.status, scores, call, current.calls) {
                Some(t) => {
                    each(&t)?;
                    written.items += 1;
                }
                None => written.unreadable += 1,
            }
            Ok(())
        };
        store.scan_calls_of(run_id, seqs, &mut |call| {
            if failed.is_some() {
                return;
            }
            while next < page.len() && page[next].seq < call.seq {
                if let Err(err) = write(&page[next], &current) {
                    failed = Some(err);
                    return;
                }
                next += 1;
            }
            if page.get(next).is_some_and(|item| item.seq == call.seq) {
                current.add(call);
            }
        })?;
        if let Some(err) = failed {
            return Err(err);
        }
        for item in &page[next..] {
            write(item, &current)?;
        }
        if page.len() < PAGE {
            return Ok(written);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_answer_keeps_its_tool_calls_and_drops_empty_ones() {
        let with = answer(r#"{"role":"assistant","content":null,"tool_calls":[{"id":"t"}]}"#);
        assert_eq!(
            with,
            Some(serde_json::json!({"role":"assistant","content":null,"tool_calls":[{"id":"t"}]}))
        );
        let without = answer(r#"{"content":"hi","tool_calls":[]}"#);
        assert_eq!(
            without,
            Some(serde_json::json!({"role":"assistant","content":"hi"}))
        );
        let body = answer(r#"{"choices":[{"message":{"role":"assistant","content":"x"}}]}"#);
        assert_eq!(
            body,
            Some(serde_json::json!({"role":"assistant","content":"x"}))
        );
        assert_eq!(answer("cut{"), None);
    }
}
