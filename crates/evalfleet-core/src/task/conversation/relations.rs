//! Relations read from a scorer's reply, or counted by rules (`scorer:
//! {kind: rules}`).

use regex::Regex;
use std::sync::LazyLock;

use crate::eval::balance::{Edge, Person, Triangle};

/// A scorer's reply read as the three relations: a JSON object `{"AB": x,
/// "BC": y, "CA": z}` (alone, or the first `{...}` in the reply), or
/// `AB: x, BC: y, CA: z` written out; each a number in [-1, 1].
pub fn parse(reply: &str) -> Result<Triangle, String> {
    #[allow(clippy::expect_used)] // a constant pattern
    static PAIR: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(r#"(?i)["']?\b(AB|BC|CA)\b["']?\s*[:=]\s*(-?\d+(?:\.\d+)?(?:[eE]-?\d+)?)"#)
            .expect("the pair pattern compiles")
    });
    let mut values: [Option<f64>; 3] = [None; 3];
    for caps in PAIR.captures_iter(reply) {
        let edge = match caps[1].to_ascii_uppercase().as_str() {
            "AB" => 0,
            "BC" => 1,
            _ => 2,
        };
        if values[edge].is_none() {
            values[edge] = caps[2].parse().ok();
        }
    }
    let missing: Vec<&str> = Edge::ALL
        .iter()
        .zip(values)
        .filter(|(_, v)| v.is_none())
        .map(|(e, _)| e.as_str())
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "no value for {} (expected JSON like {{\"AB\": 0.2, \"BC\": -0.5, \"CA\": 0.1}})",
            missing.join(", ")
        ));
    }
    let [ab, bc, ca] = values.map(|v| v.unwrap_or_default());
    for (edge, v) in Edge::ALL.iter().zip([ab, bc, ca]) {
        if !(-1.0..=1.0).contains(&v) {
            return Err(format!("{edge} is {v}, outside [-1, 1]"));
        }
    }
    Ok(Triangle::new(ab, bc, ca))
}

/// Words that warm a relation when said by either of its two people.
const WARM: [&str; 18] = [
    "agree",
    "thanks",
    "thank",
    "good",
    "great",
    "right",
    "yes",
    "love",
    "like",
    "appreciate",
    "fair",
    "sorry",
    "together",
    "understand",
    "happy",
    "glad",
    "sure",
    "help",
];
/// Words that cool it.
const COLD: [&str; 18] = [
    "no",
    "not",
    "never",
    "wrong",
    "hate",
    "stupid",
    "annoying",
    "unfair",
    "angry",
    "ridiculous",
    "blame",
    "fault",
    "whatever",
    "disagree",
    "stop",
    "bad",
    "terrible",
    "selfish",
];
/// What each warm or cold word is worth.
const WORD: f64 = 0.2;
/// What one person raising another's landmine costs their relation.
const LANDMINE: f64 = 0.5;

/// Relations counted from human utterances (`(speaker, text)`, the
/// scorer's window): each edge starts at 0, gains 0.2 for each warm word
/// and loses 0.2 for each cold word either of its two people says, and
/// loses 0.5 each time one of them names a landmine of the other; then it
/// is clamped to [-1, 1].
pub fn by_rules(utterances: &[(Person, &str)], landmines: [&[String]; 3]) -> Triangle {
    let mut value = [0.0f64; 3];
    for &(speaker, text) in utterances {
        let lower = text.to_lowercase();
        let words: Vec<&str> = lower
            .split(|c: char| !c.is_alphanumeric() && c != '\'')
            .filter(|w| !w.is_empty())
            .collect();
        let tone: f64 = words
            .iter()
            .map(|w| {
                if WARM.contains(w) {
                    WORD
                } else if COLD.contains(w) {
                    -WORD
                } else {
                    0.0
                }
            })
            .sum();
        for (i, edge) in Edge::ALL.iter().enumerate() {
            let (x, y) = edge.people();
            if speaker != x && speaker != y {
                continue;
            }
            value[i] += tone;
            let other = if speaker == x { y } else { x };
            for mine in landmines[other.index()] {
                if lower.contains(&mine.to_lowercase()) {
                    value[i] -= LANDMINE;
                }
            }
        }
    }
    let [ab, bc, ca] = value.map(|v| v.clamp(-1.0, 1.0));
    Triangle::new(ab, bc, ca)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_read_as_json_or_written_out() {
        assert_eq!(
            parse(r#"{"AB": 0.5, "BC": -0.25, "CA": 1}"#).unwrap(),
            Triangle::new(0.5, -0.25, 1.0)
        );
        assert_eq!(
            parse("Sure! AB: -0.3, bc = 0.2\nCA: 0").unwrap(),
            Triangle::new(-0.3, 0.2, 0.0)
        );
        assert!(
            parse(r#"{"AB": 0.5, "BC": -0.25}"#)
                .unwrap_err()
                .contains("CA")
        );
        assert!(
            parse(r#"{"AB": 1.5, "BC": 0, "CA": 0}"#)
                .unwrap_err()
                .contains("outside")
        );
        assert!(parse("they get along").is_err());
    }

    #[test]
    fn rules_count_tone_and_landmines_per_pair() {
        let (a, c) = (["money".to_owned()], ["Mother".to_owned()]);
        let landmines: [&[String]; 3] = [&a, &[], &c];
        let said = [
            (Person::A, "I agree, thanks."),            // AB, CA +0.4
            (Person::B, "That is wrong. Your mother!"), // AB, BC -0.2; BC -0.5 (C's landmine)
            (Person::C, "Money, money."),               // BC, CA; CA -0.5 (A's landmine, once)
        ];
        let t = by_rules(&said, landmines);
        assert!((t.ab - 0.2).abs() < 1e-9, "{t:?}");
        assert!((t.bc - -0.7).abs() < 1e-9, "{t:?}");
        assert!((t.ca - -0.1).abs() < 1e-9, "{t:?}");
        // Clamped.
        let angry = [(Person::A, "no no no no no no no")];
        assert_eq!(by_rules(&angry, landmines).ab, -1.0);
    }
}
