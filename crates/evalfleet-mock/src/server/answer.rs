//! What an answer says: the prompt's tokens echoed (or repeated to
//! `output_tokens`) and cut at `max_tokens`, and a scripted reply followed
//! past the tool results the request holds.

use super::request::{ChatMessage, message_text};
use crate::settings::{Answer, MockSettings};

/// What a scripted reply comes to for a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Resolved {
    Text(String),
    Call { name: String, arguments: String },
}

/// Follows a scripted reply past the tool results the request holds since
/// its last user message: a call not yet answered is made where the
/// request offers tools (and skipped where it does not); a text gets
/// `{result}` replaced by the last tool result.
pub(super) fn resolve(script: &Answer, messages: &[ChatMessage], offers_tools: bool) -> Resolved {
    let since_user = messages
        .iter()
        .rposition(|m| m.role == "user")
        .map_or(messages, |i| &messages[i + 1..]);
    let mut results = since_user.iter().filter(|m| m.role == "tool");
    let mut last_result = String::new();
    let mut at = script;
    loop {
        match at {
            Answer::Text(text) => return Resolved::Text(text.replace("{result}", &last_result)),
            Answer::Tool {
                name,
                arguments,
                then,
            } => {
                match results.next() {
                    Some(result) => last_result = message_text(&result.content),
                    None if offers_tools => {
                        return Resolved::Call {
                            name: name.clone(),
                            arguments: arguments.clone(),
                        };
                    }
                    None => {}
                }
                at = then;
            }
        }
    }
}

/// A tool call's arguments in the pieces a stream sends: 8 characters each.
pub(super) fn pieces(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    chars.chunks(8).map(|c| c.iter().collect()).collect()
}

/// Splits text into tokens: each token is a run of non-space characters with
/// the whitespace that follows it, so the tokens concatenate back to the text.
fn tokens(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut after_space = false;
    for (i, c) in text.char_indices() {
        if c.is_whitespace() {
            after_space = true;
        } else if after_space {
            out.push(&text[start..i]);
            start = i;
            after_space = false;
        }
    }
    if start < text.len() {
        out.push(&text[start..]);
    }
    out
}

/// The answer's tokens for a prompt, and its finish reason.
pub(super) fn answer(
    settings: &MockSettings,
    prompt: &str,
    max_tokens: Option<u32>,
) -> (Vec<String>, &'static str) {
    let source = tokens(prompt);
    let mut out: Vec<String> = match settings.output_tokens {
        None => source.iter().map(|t| (*t).to_owned()).collect(),
        Some(n) => {
            let n = n as usize;
            (0..n)
                .map(|i| {
                    let token = source
                        .get(i % source.len().max(1))
                        .copied()
                        .unwrap_or("token");
                    if i + 1 == n {
                        token.trim_end().to_owned()
                    } else if !token.ends_with(char::is_whitespace) {
                        format!("{token} ")
                    } else {
                        token.to_owned()
                    }
                })
                .collect()
        }
    };
    match max_tokens {
        Some(max) if out.len() > max as usize => {
            out.truncate(max as usize);
            if let Some(last) = out.last_mut() {
                last.truncate(last.trim_end().len());
            }
            (out, "length")
        }
        _ => (out, "stop"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_concatenate_back_to_the_text() {
        for text in ["", "one", "  lead", "a b  c\nd ", "tab\tsep"] {
            assert_eq!(tokens(text).concat(), text);
        }
        assert_eq!(tokens("a b  c"), vec!["a ", "b  ", "c"]);
    }

    #[test]
    fn output_tokens_repeat_the_prompt_and_max_tokens_cuts() {
        let settings = MockSettings {
            output_tokens: Some(5),
            ..MockSettings::default()
        };
        let (out, reason) = answer(&settings, "x y", None);
        assert_eq!(out.concat(), "x y x y x");
        assert_eq!(reason, "stop");
        let (out, reason) = answer(&settings, "x y", Some(2));
        assert_eq!(out.concat(), "x y");
        assert_eq!(reason, "length");
    }
}
