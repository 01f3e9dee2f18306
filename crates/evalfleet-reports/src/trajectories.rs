//! `evalfleet export --format trajectories`: the conversations agents held
//! through the gateway (`kind: exec`), one JSON line a conversation, in a
//! shape fine-tuning and RL pipelines load as they are: OpenAI chat
//! `messages` (tool calls and tool results as the chat format has them)
//! and `tools`, as TRL's conversational datasets have them, with the
//! item's status and scores, and each step's figures (tokens, latency,
//! endpoint, finish reason) beside them.
//!
//! An attempt (one run of an item's agent) may hold several
//! conversations (a planner, then a solver; sub-agents side by side). Its
//! chat completions are taken in the order they were made; a call whose
//! messages begin with the messages of an earlier call of the attempt
//! (compared as the chat format means them: a tool call's arguments as
//! JSON, an empty content as none) goes on that conversation (the longest
//! such), any other begins one. A conversation's messages are those of its
//! last answered call, then that call's answer; each step says where its
//! answer sits in them. A conversation an agent rewrote (its history cut
//! or summarised) shows as a new one from there.
//!
//! By default only each item's final attempt (its last run of the agent
//! that made calls) is written; with every attempt, each line says how its
//! attempt ended: `answered`, `failed` (with why), or `unfinished` (cut
//! short by a stop or a crash of evalfleet: its calls are kept as they
//! ended, so that none of the tokens spent goes unaccounted for).
//!
//! Results are read a page at a time in dataset order, each page with its
//! items' calls and attempts; only the attempt being read is held, so
//! memory does not grow with the run.

use std::collections::HashMap;

use serde::Serialize;
use serde_json::{Map, Value};

use evalfleet_types::{AgentCall, ItemStatus, Scores};

use evalfleet_store::{AttemptEnd, ExportError, ResultOrder, Results, StoreError};

/// The API whose calls make trajectories.
pub const CHAT: &str = "chat.completions";

/// Results read at a time.
const PAGE: usize = 256;

/// Which attempts of an item are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Attempts {
    /// Its final attempt's (the last run of its agent that made calls).
    #[default]
    Final,
    /// Every attempt's, killed and failed ones included.
    All,
}

/// One line of the export: a conversation an attempt held.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Trajectory {
    pub item_id: String,
    pub status: ItemStatus,
    /// Metric key → the item's score (`null` where the metric could not
    /// score it).
    pub scores: Map<String, Value>,
    /// The attempt (run of the agent) the conversation is from.
    pub attempt: u32,
    /// `answered`, `failed` or `unfinished` (see the module's words).
    pub attempt_status: &'static str,
    /// Why the attempt failed.
    pub attempt_error: Option<String>,
    /// The attempt is the item's final one (the one its result is from).
    #[serde(rename = "final")]
    pub is_final: bool,
    /// Its place among the attempt's conversations (0-based, in the order
    /// they began), and how many the attempt held.
    pub conversation: u32,
    pub conversations: u32,
    /// The conversation: its last answered call's messages, then the
    /// answer.
    pub messages: Vec<Value>,
    /// The tools that call offered, when it offered any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools: Option<Value>,
    /// Its calls, in order.
    pub steps: Vec<Step>,
    /// Calls the attempt made (every API, every conversation).
    pub calls: u32,
}

/// A chat completion of a conversation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Step {
    pub call_id: String,
    /// Where its answer is in the conversation's `messages` (`null`: it
    /// got none, or the conversation's messages stop before it).
    pub message: Option<u32>,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub latency_ms: f64,
    pub ttft_ms: Option<f64>,
    pub endpoint: String,
    pub model: String,
    pub finish_reason: Option<String>,
    /// Answered from the response cache.
    pub cached: bool,
    pub http_status: u16,
    pub error: Option<String>,
}

/// What an export wrote, and what it left out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Written {
    /// Conversations written.
    pub lines: u64,
    /// Items with at least one written.
    pub items: u64,
    /// Ended items whose final attempt made no chat completion that could
    /// be read (items without calls included).
    pub no_chat: u64,
    /// Chat completions whose request cannot be read (cut when stored by
    /// an evalfleet before bodies were kept whole, or not JSON): left out
    /// of their conversations.
    pub unreadable: u64,
}

/// An ended item of a page, owned.
struct Ended {
    seq: u64,
    item_id: String,
    status: ItemStatus,
    scores: Map<String, Value>,
}

/// A message as the chat format means it, to tell whether one call's
/// messages go on from another's: agents and their frameworks send back
/// what they got in their own spelling (a tool call's arguments
/// re-serialised, `null` content as `""`, fields added).
#[derive(Debug, Clone, PartialEq)]
struct Said {
    role: String,
    content: Value,
    tool_calls: Vec<(String, String, Value)>,
    tool_call_id: String,
}

fn said(message: &Value) -> Said {
    let text = |v: Option<&Value>| v.and_then(Value::as_str).unwrap_or_default().to_owned();
    let content = match message.get("content") {
        None | Some(Value::Null) => Value::String(String::new()),
        // Parts with one text: the text.
        Some(Value::Array(parts))
            if parts.len() == 1 && parts[0].get("type").and_then(Value::as_str) == Some("text") =>
        {
            Value::String(text(parts[0].get("text")))
        }
        Some(other) => other.clone(),
    };
    let tool_calls = message
        .get("tool_calls")
        .and_then(Value::as_array)
        .map(|calls| {
            calls
                .iter()
                .map(|call| {
                    let function = call.get("function");
                    let arguments = text(function.and_then(|f| f.get("arguments")));
                    (
                        text(call.get("id")),
                        text(function.and_then(|f| f.get("name"))),
                        serde_json::from_str(&arguments).unwrap_or(Value::String(arguments)),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    Said {
        role: text(message.get("role")),
        content,
        tool_calls,
        tool_call_id: text(message.get("tool_call_id")),
    }
}

/// A conversation being read.
#[derive(Default)]
struct Conversation {
    /// Its last call's messages, as meant.
    said: Vec<Said>,
    /// Its last answered call's messages, then the answer.
    messages: Vec<Value>,
    tools: Option<Value>,
    steps: Vec<Step>,
}

/// The attempt being read: its conversations so far.
#[derive(Default)]
struct Attempt {
    seq: u64,
    attempt: u32,
    calls: u32,
    conversations: Vec<Conversation>,
    unreadable: u64,
}

impl Attempt {
    fn new(seq: u64, attempt: u32) -> Self {
        Self {
            seq,
            attempt,
            ..Self::default()
        }
    }

    /// Takes the attempt's next call.
    fn add(&mut self, call: &AgentCall) {
        self.calls += 1;
        if call.api != CHAT {
            return;
        }
        let request = (!call.request_cut)
            .then(|| serde_json::from_str::<Value>(&call.request).ok())
            .flatten();
        let Some(Value::Object(mut request)) = request else {
            self.unreadable += 1;
            return;
        };
        let Some(Value::Array(mut messages)) = request.remove("messages") else {
            self.unreadable += 1;
            return;
        };
        let meant: Vec<Said> = messages.iter().map(said).collect();
        // The conversation it goes on: the one whose last messages its own
        // begin with, the longest.
        let on = self
            .conversations
            .iter()
            .enumerate()
            .filter(|(_, c)| c.said.len() <= meant.len() && meant[..c.said.len()] == c.said[..])
            .max_by_key(|(_, c)| c.said.len())
            .map(|(i, _)| i);
        let index = on.unwrap_or_else(|| {
            self.conversations.push(Conversation::default());
            self.conversations.len() - 1
        });
        let conversation = &mut self.conversations[index];
        let answer = call
            .response
            .as_deref()
            .filter(|_| call.error.is_none() && call.http_status == 200)
            .and_then(answer);
        let at = u32::try_from(messages.len()).unwrap_or(u32::MAX);
        conversation.said = meant;
        conversation
            .steps
            .push(step(call, answer.is_some().then_some(at)));
        if let Some(answer) = answer {
            messages.push(answer);
            conversation.messages = messages;
            conversation.tools = request
                .remove("tools")
                .filter(|t| t.as_array().is_some_and(|a| !a.is_empty()));
        } else if conversation.messages.is_empty() {
            // No answer yet: what it asked, until one comes.
            conversation.messages = messages;
        }
    }

    /// Its lines, for `item`.
    fn lines(self, item: &Ended, end: Option<&AttemptEnd>, is_final: bool) -> Vec<Trajectory> {
        let (attempt_status, attempt_error) = match end {
            None => ("unfinished", None),
            Some(AttemptEnd { error: None, .. }) => ("answered", None),
            Some(AttemptEnd {
                error: Some(error), ..
            }) => ("failed", Some(error.clone())),
        };
        let conversations = u32::try_from(self.conversations.len()).unwrap_or(u32::MAX);
        self.conversations
            .into_iter()
            .enumerate()
            .map(|(i, c)| Trajectory {
                item_id: item.item_id.clone(),
                status: item.status,
                scores: item.scores.clone(),
                attempt: self.attempt,
                attempt_status,
                attempt_error: attempt_error.clone(),
                is_final,
                conversation: u32::try_from(i).unwrap_or(u32::MAX),
                conversations,
                messages: c.messages,
                tools: c.tools,
                steps: c.steps,
                calls: self.calls,
            })
            .collect()
    }
}

fn step(call: &AgentCall, message: Option<u32>) -> Step {
    let t = &call.telemetry;
    Step {
        call_id: call.call_id.clone(),
        message,
        prompt_tokens: t.prompt_tokens,
        completion_tokens: t.completion_tokens,
        latency_ms: t.latency_ms,
        ttft_ms: t.ttft_ms,
        endpoint: t.endpoint.clone(),
        model: t.model.clone(),
        finish_reason: t.finish_reason.clone(),
        cached: call.cached,
        http_status: call.http_status,
        error: call.error.clone(),
    }
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

/// The item being written: its attempt being read, and whether a line of
/// it was written.
struct Writing<'a> {
    attempts: Attempts,
    ends: &'a HashMap<(u64, u32), AttemptEnd>,
    each: &'a mut dyn FnMut(&Trajectory) -> std::io::Result<()>,
    written: &'a mut Written,
    any: bool,
}

impl Writing<'_> {
    /// Writes `attempt` of `item` (`is_final`: no later one made calls).
    fn attempt(&mut self, item: &Ended, attempt: Attempt, is_final: bool) -> std::io::Result<()> {
        self.written.unreadable += attempt.unreadable;
        if !is_final && self.attempts == Attempts::Final {
            return Ok(());
        }
        let end = self.ends.get(&(attempt.seq, attempt.attempt));
        for line in attempt.lines(item, end, is_final) {
            (self.each)(&line)?;
            self.written.lines += 1;
            self.any |= is_final || self.attempts == Attempts::All;
        }
        Ok(())
    }

    /// The item is over: counted.
    fn item_done(&mut self, final_chats: bool) {
        if self.any {
            self.written.items += 1;
        }
        if !final_chats {
            self.written.no_chat += 1;
        }
        self.any = false;
    }
}

/// Writes the conversations of every ended item of `run_id` (those of
/// `attempts`), in dataset order, to `each`.
pub fn export_trajectories(
    store: &mut dyn Results,
    run_id: &str,
    attempts: Attempts,
    each: &mut dyn FnMut(&Trajectory) -> std::io::Result<()>,
) -> Result<Written, ExportError> {
    let mut written = Written::default();
    let mut after: Option<(String, u64)> = None;
    loop {
        let mut page: Vec<Ended> = Vec::new();
        let mut bad_scores: Option<StoreError> = None;
        store.results_page(
            run_id,
            ResultOrder::Seq,
            after.as_ref().map(|(id, seq)| (id.as_str(), *seq)),
            PAGE,
            false,
            &mut |r| {
                let scores = score_values(r.scores).unwrap_or_else(|err| {
                    bad_scores.get_or_insert(err);
                    Map::new()
                });
                page.push(Ended {
                    seq: r.seq,
                    item_id: r.item_id.to_owned(),
                    status: r.status,
                    scores,
                });
                Ok(())
            },
        )?;
        if let Some(err) = bad_scores {
            return Err(err.into());
        }
        let (Some(first), Some(last)) = (page.first(), page.last()) else {
            return Ok(written);
        };
        let seqs = first.seq..=last.seq;
        after = Some((last.item_id.clone(), last.seq));
        let mut ends = HashMap::new();
        if attempts == Attempts::All {
            store.attempt_ends_of(run_id, seqs.clone(), &mut |end| {
                ends.insert((end.seq, end.attempt), end);
            })?;
        }
        let by_seq: HashMap<u64, usize> =
            page.iter().enumerate().map(|(i, e)| (e.seq, i)).collect();
        let mut writing = Writing {
            attempts,
            ends: &ends,
            each: &mut *each,
            written: &mut written,
            any: false,
        };
        // Calls come in (seq, attempt, index) order: an attempt is written
        // when the next one begins, an item when the calls move past it (an
        // item of no result, still pending, has its calls skipped).
        let mut current: Option<Attempt> = None;
        let mut done = 0;
        let mut failed: Option<std::io::Error> = None;
        store.scan_calls_of(run_id, seqs, &mut |call| {
            if failed.is_some() || !by_seq.contains_key(&call.seq) {
                return;
            }
            let result = (|| -> std::io::Result<()> {
                if let Some(open) =
                    current.take_if(|a| (a.seq, a.attempt) != (call.seq, call.attempt))
                {
                    let item = &page[by_seq[&open.seq]];
                    let same_item = open.seq == call.seq;
                    let has_chats = !open.conversations.is_empty();
                    writing.attempt(item, open, !same_item)?;
                    if !same_item {
                        writing.item_done(has_chats);
                        done += 1;
                    }
                }
                current
                    .get_or_insert_with(|| Attempt::new(call.seq, call.attempt))
                    .add(&call);
                Ok(())
            })();
            if let Err(err) = result {
                failed = Some(err);
            }
        })?;
        if let Some(err) = failed {
            return Err(err.into());
        }
        if let Some(open) = current.take() {
            let item = &page[by_seq[&open.seq]];
            let has_chats = !open.conversations.is_empty();
            writing.attempt(item, open, true)?;
            writing.item_done(has_chats);
            done += 1;
        }
        // Items of the page none of whose calls were seen: no chat.
        writing.written.no_chat += (page.len() - done) as u64;
        if page.len() < PAGE {
            return Ok(written);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_answer_keeps_its_tool_calls_and_drops_empty_ones() {
        let with = answer(r#"{"role":"assistant","content":null,"tool_calls":[{"id":"t"}]}"#);
        assert_eq!(
            with,
            Some(json!({"role":"assistant","content":null,"tool_calls":[{"id":"t"}]}))
        );
        let without = answer(r#"{"content":"hi","tool_calls":[]}"#);
        assert_eq!(without, Some(json!({"role":"assistant","content":"hi"})));
        let body = answer(r#"{"choices":[{"message":{"role":"assistant","content":"x"}}]}"#);
        assert_eq!(body, Some(json!({"role":"assistant","content":"x"})));
        assert_eq!(answer("cut{"), None);
    }

    #[test]
    fn a_message_sent_back_in_another_spelling_means_the_same() {
        let got = json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1,\"b\":\"«x»\"}"}}
        ]});
        // As LangChain sends it back: content "", arguments re-serialised
        // with spaces and keys in another order, a field added.
        let sent_back = json!({"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"b\": \"«x»\", \"a\": 1}"}}
        ], "name": "agent"});
        assert_eq!(said(&got), said(&sent_back));
        let other_args = json!({"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 2}"}}
        ]});
        assert_ne!(said(&got), said(&other_args));
        let parts = json!({"role": "user", "content": [{"type": "text", "text": "hi"}]});
        assert_eq!(
            said(&parts),
            said(&json!({"role": "user", "content": "hi"}))
        );
    }
}
