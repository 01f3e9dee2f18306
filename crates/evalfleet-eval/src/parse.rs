//! `task.parse`: how the answer is taken out of a model's text. A failure
//! is a reason, stored with the result; it is never scored as a valid
//! answer.

use super::text::Pattern;
use serde_json::Value;

/// One way of extracting the answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Parser {
    /// The whole text, trimmed.
    Whole,
    /// A regular expression; the answer is its capture `group` (1 when the
    /// pattern has a group, else the whole match) of the `first` or last
    /// match.
    Regex {
        pattern: Pattern,
        group: usize,
        first: bool,
    },
    /// JSON: the whole text, else the first fenced code block that parses,
    /// else the first `{...}` or `[...]` in the text that parses.
    Json,
    /// A choice letter among `choices` (`ABCD` by default).
    Choice { choices: Vec<char> },
}

impl Parser {
    /// Takes the answer out of `text`, or says why it cannot.
    pub fn parse(&self, text: &str) -> Result<Value, String> {
        match self {
            Self::Whole => Ok(Value::String(text.trim().to_owned())),
            Self::Regex {
                pattern,
                group,
                first,
            } => {
                let captures = if *first {
                    pattern.captures(text)
                } else {
                    pattern.captures_iter(text).last()
                };
                captures
                    .and_then(|c| c.get(*group))
                    .map(|m| Value::String(m.as_str().trim().to_owned()))
                    .ok_or_else(|| format!("no match for /{}/", pattern.as_str()))
            }
            Self::Json => json(text),
            Self::Choice { choices } => choice(text, choices).map(|c| Value::String(c.to_string())),
        }
    }

    pub fn is_json(&self) -> bool {
        matches!(self, Self::Json)
    }
}

fn json(text: &str) -> Result<Value, String> {
    let trimmed = text.trim();
    if let Ok(value) = serde_json::from_str::<Value>(trimmed) {
        return Ok(value);
    }
    // Fenced code blocks, ```json or plain ```.
    let mut rest = text;
    while let Some(start) = rest.find("```") {
        let after = &rest[start + 3..];
        let body_start = after.find('\n').map_or(after.len(), |n| n + 1);
        let body = &after[body_start..];
        let Some(end) = body.find("```") else { break };
        if let Ok(value) = serde_json::from_str::<Value>(body[..end].trim()) {
            return Ok(value);
        }
        rest = &body[end + 3..];
    }
    // The first object or array that parses, from each opening bracket.
    for (at, c) in text.char_indices() {
        if c == '{' || c == '[' {
            let mut stream = serde_json::Deserializer::from_str(&text[at..]).into_iter::<Value>();
            if let Some(Ok(value)) = stream.next()
                && (value.is_object() || value.is_array())
            {
                return Ok(value);
            }
        }
    }
    Err(if text.contains('{') || text.contains('[') {
        "no valid JSON in the answer (a bracket was found, but nothing from it parses)".to_owned()
    } else {
        "no JSON in the answer".to_owned()
    })
}

fn choice(text: &str, choices: &[char]) -> Result<char, String> {
    let is_choice = |c: char| choices.contains(&c.to_ascii_uppercase());
    let trimmed = text.trim();
    // The whole answer is a letter: "B", "(B)", "B.", "b)".
    let bare: Vec<char> = trimmed
        .chars()
        .filter(|c| !matches!(c, '(' | ')' | '.' | ':' | '[' | ']' | '*'))
        .collect();
    if bare.len() == 1 && is_choice(bare[0]) {
        return Ok(bare[0].to_ascii_uppercase());
    }
    // "answer is (C)", "Answer: C": the letter after the last "answer".
    let lower = trimmed.to_lowercase();
    if let Some(at) = lower.rfind("answer") {
        let tail = &trimmed[at + "answer".len()..];
        if let Some(c) = standalone(tail, &is_choice) {
            return Ok(c);
        }
    }
    // Else the first standalone letter among the choices.
    standalone(trimmed, &is_choice).ok_or_else(|| {
        format!(
            "no choice letter ({}) in the answer",
            choices.iter().collect::<String>()
        )
    })
}

/// The first upper-case choice letter standing alone as a word.
fn standalone(text: &str, is_choice: &dyn Fn(char) -> bool) -> Option<char> {
    let chars: Vec<char> = text.chars().collect();
    (0..chars.len()).find_map(|i| {
        let c = chars[i];
        let alone = |j: Option<&char>| j.is_none_or(|n| !n.is_alphanumeric());
        (c.is_ascii_uppercase()
            && is_choice(c)
            && alone(i.checked_sub(1).and_then(|j| chars.get(j)))
            && alone(chars.get(i + 1)))
        .then_some(c)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn regex(pattern: &str) -> Parser {
        Parser::Regex {
            pattern: Pattern::new(pattern).unwrap(),
            group: 1,
            first: true,
        }
    }

    #[test]
    fn gsm8k_answers_come_from_the_capture() {
        let p = regex(r"#### (-?[\d,]+)");
        assert_eq!(p.parse("so 3+4 = 7\n#### 7").unwrap(), json!("7"));
        assert_eq!(p.parse("#### -1,200").unwrap(), json!("-1,200"));
        assert_eq!(
            p.parse("The answer is 7").unwrap_err(),
            "no match for /#### (-?[\\d,]+)/"
        );
    }

    #[test]
    fn json_is_found_whole_fenced_or_inline() {
        assert_eq!(Parser::Json.parse(" {\"a\": 1} ").unwrap(), json!({"a": 1}));
        let fenced = "Here:\n```json\n{\"a\": [1, 2]}\n```\nDone.";
        assert_eq!(Parser::Json.parse(fenced).unwrap(), json!({"a": [1, 2]}));
        let inline = "The result is {\"name\": \"x\", \"n\": 2} as asked.";
        assert_eq!(
            Parser::Json.parse(inline).unwrap(),
            json!({"name": "x", "n": 2})
        );
        let broken = "{\"a\": 1,";
        assert!(
            Parser::Json
                .parse(broken)
                .unwrap_err()
                .contains("nothing from it parses")
        );
        assert_eq!(
            Parser::Json.parse("plain text").unwrap_err(),
            "no JSON in the answer"
        );
    }

    #[test]
    fn choice_letters_are_found_where_people_write_them() {
        let p = Parser::Choice {
            choices: vec!['A', 'B', 'C', 'D'],
        };
        assert_eq!(p.parse("(b)").unwrap(), json!("B"));
        assert_eq!(p.parse("C.").unwrap(), json!("C"));
        assert_eq!(
            p.parse("A is tempting, but the answer is (D).").unwrap(),
            json!("D")
        );
        assert_eq!(p.parse("I pick B because...").unwrap(), json!("B"));
        assert!(p.parse("I am not sure").is_err());
        assert!(p.parse("E").is_err());
    }
}
