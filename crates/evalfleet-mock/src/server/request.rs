//! The requests the mock reads: chat completions, and legacy text
//! completions read as chat.

use serde::Deserialize;
use serde_json::Value;

#[derive(Deserialize)]
pub(super) struct ChatRequest {
    #[serde(default)]
    pub(super) messages: Vec<ChatMessage>,
    #[serde(default)]
    pub(super) stream: bool,
    #[serde(default)]
    pub(super) stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub(super) max_tokens: Option<u32>,
    #[serde(default)]
    pub(super) max_completion_tokens: Option<u32>,
    /// The tools offered: any, for scripted tool calls.
    #[serde(default)]
    pub(super) tools: Option<Vec<Value>>,
}

#[derive(Deserialize)]
pub(super) struct ChatMessage {
    pub(super) role: String,
    #[serde(default)]
    pub(super) content: Value,
    #[serde(default)]
    tool_calls: Option<Value>,
}

impl ChatMessage {
    /// An assistant's message that calls tools.
    pub(super) fn calls_tools(&self) -> bool {
        self.role == "assistant"
            && self
                .tool_calls
                .as_ref()
                .and_then(Value::as_array)
                .is_some_and(|calls| !calls.is_empty())
    }
}

/// A legacy text completion request: answered as a chat request whose one
/// user message is its prompt.
#[derive(Deserialize)]
pub(super) struct CompletionRequest {
    #[serde(default)]
    prompt: Value,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<u32>,
}

impl CompletionRequest {
    pub(super) fn into_chat(self) -> Result<ChatRequest, String> {
        let prompt = match self.prompt {
            Value::String(text) => text,
            Value::Array(mut prompts)
                if prompts.len() == 1 && prompts.first().is_some_and(Value::is_string) =>
            {
                match prompts.pop() {
                    Some(Value::String(text)) => text,
                    _ => String::new(),
                }
            }
            _ => {
                return Err(
                    "invalid completion request: the mock answers one prompt, a string, at a time"
                        .to_owned(),
                );
            }
        };
        Ok(ChatRequest {
            messages: vec![ChatMessage {
                role: "user".to_owned(),
                content: Value::String(prompt),
                tool_calls: None,
            }],
            stream: self.stream,
            stream_options: self.stream_options,
            max_tokens: self.max_tokens,
            max_completion_tokens: None,
            tools: None,
        })
    }
}

/// Which API a request came by: it decides the answer's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Chat,
    Completion,
}

#[derive(Deserialize)]
pub(super) struct StreamOptions {
    #[serde(default)]
    pub(super) include_usage: bool,
}

/// The text of a message: a string, or the text parts of a list of parts.
pub(super) fn message_text(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

pub(super) fn tokens_in(messages: &[ChatMessage]) -> usize {
    messages
        .iter()
        .map(|m| message_text(&m.content).split_whitespace().count())
        .sum()
}
