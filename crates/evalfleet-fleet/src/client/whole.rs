//! A non-streamed answer, read whole.

use serde::Deserialize;

use super::error::CallError;
use super::{Completion, Usage};

pub(super) fn parse_completion(bytes: &[u8], status: u16) -> Result<Completion, CallError> {
    #[derive(Deserialize)]
    struct Response {
        choices: Vec<Choice>,
        usage: Option<Usage>,
    }
    #[derive(Deserialize)]
    struct Choice {
        message: ChoiceMessage,
        finish_reason: Option<String>,
    }
    #[derive(Deserialize)]
    struct ChoiceMessage {
        content: Option<String>,
    }
    let response: Response = serde_json::from_slice(bytes)
        .map_err(|err| CallError::BadResponse(format!("not a chat completion: {err}")))?;
    let choice = response
        .choices
        .into_iter()
        .next()
        .ok_or_else(|| CallError::BadResponse("the completion has no choices".to_owned()))?;
    if choice.finish_reason.is_none() {
        return Err(CallError::Unfinished);
    }
    Ok(Completion {
        content: choice.message.content.unwrap_or_default(),
        finish_reason: choice.finish_reason,
        prompt_tokens: response.usage.as_ref().and_then(|u| u.prompt_tokens),
        completion_tokens: response.usage.as_ref().and_then(|u| u.completion_tokens),
        tokens_estimated: false,
        http_status: status,
    })
}
