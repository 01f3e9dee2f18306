//! Relations read from a scorer's reply, or counted by rules (`scorer:
//! {kind: rules}`).

use regex::Regex;
use std::sync::LazyLock;

use evalfleet_config::{Persona, ToneWords};
use evalfleet_eval::balance::{Edge, Person, Triangle};

/// A scorer's reply read as the three relations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scored {
    pub relations: Triangle,
    /// Values outside [-1, 1], clipped to it.
    pub clipped: u32,
}

/// A scorer's reply read as the three relations: `PAIR: value` (or `=`)
/// entries anywhere in it, as JSON (`{"AB": 0.2, "BC": -0.5, "CA": 0.1}`)
/// or written out, one a line, a comma or a space apart, Markdown
/// emphasis and full-width characters (`ＡＢ：－０．３`) allowed. A pair is
/// named by its two people in either order, by letter (A, B, C, any case)
/// or by name (`names`, A's, B's and C's), with or without a separator:
/// `AB`, `BA`, `A-C`, `C-A`, `A×B`, `A and B`, `AとB`, `Alex - Casey`,
/// and words after it (`A-B relationship`) or in brackets are ignored. The
/// first value of each pair counts; values outside [-1, 1] are clipped to
/// it and counted.
pub fn parse(reply: &str, names: [&str; 3]) -> Result<Scored, String> {
    #[allow(clippy::expect_used)] // a constant pattern
    static NUMBER: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(
            r#"^[\s*`_"'(\[]*([-+\u{2212}\u{2013}]?(?:\d+(?:[.,]\d+)?|\.\d+)(?:[eE][-+]?\d+)?)"#,
        )
        .expect("the number pattern compiles")
    });
    let reply = halfwidth(reply);
    let names = names.map(halfwidth);
    // Names of more than one letter, longest first (a letter is read as
    // one anyway): matched against every place a key may begin.
    let mut by_name: Vec<(Person, &str)> = Person::ALL
        .into_iter()
        .zip(names.iter().map(String::as_str))
        .filter(|(_, n)| n.chars().count() > 1)
        .collect();
    by_name.sort_by_key(|(_, n)| std::cmp::Reverse(n.chars().count()));
    let names = by_name.as_slice();
    let mut values: [Option<f64>; 3] = [None; 3];
    let mut clipped = 0;
    // Where the key of the next entry may begin.
    let mut from = 0;
    for (at, c) in reply.char_indices() {
        if at < from {
            continue;
        }
        if matches!(c, '\n' | ',' | '{' | '}' | ';' | '\u{3001}' | '\u{3002}') {
            from = at + c.len_utf8();
            continue;
        }
        if !matches!(c, ':' | '=') {
            continue;
        }
        let key = &reply[from..at];
        let after = at + c.len_utf8();
        from = after;
        let Some(number) = NUMBER.captures(&reply[after..]) else {
            continue;
        };
        from = after + number.get(0).map_or(0, |m| m.end());
        let Some(edge) = pair(key, names) else {
            continue;
        };
        let slot = &mut values[edge as usize];
        let text = number[1]
            .replace(['\u{2212}', '\u{2013}'], "-")
            .replace(',', ".");
        let Ok(v) = text.parse::<f64>() else {
            continue;
        };
        if slot.is_some() || !v.is_finite() {
            continue;
        }
        if !(-1.0..=1.0).contains(&v) {
            clipped += 1;
        }
        *slot = Some(v.clamp(-1.0, 1.0));
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
    Ok(Scored {
        relations: Triangle::new(ab, bc, ca),
        clipped,
    })
}

/// Full-width ASCII (`ＡＢ：０．３`, as Japanese text writes it) as ASCII,
/// and the ideographic space as a space.
fn halfwidth(text: &str) -> String {
    text.chars()
        .map(|c| match c {
            '\u{ff01}'..='\u{ff5e}' => char::from_u32(c as u32 - 0xfee0).unwrap_or(c),
            '\u{3000}' => ' ',
            _ => c,
        })
        .collect()
}

/// Words and signs that stand between the two people of a pair.
const JOINS: [&str; 6] = ["and", "vs.", "vs", "with", "\u{3068}", "\u{306e}"];

/// The edge a key names: two different people, each by letter or name,
/// with quotes, brackets, a list bullet, separators and joining words
/// between and around them, and any words after them, ignored (`Sure! AB`,
/// `- A and C`, `A-B relationship`, `A-C (Ann and Cy)` name a pair).
fn pair(key: &str, names: &[(Person, &str)]) -> Option<Edge> {
    // Bracketed asides are not part of it.
    let mut plain = String::with_capacity(key.len());
    let mut depth = 0u32;
    for c in key.chars() {
        match c {
            '(' | '[' | '\u{300c}' | '\u{3010}' if depth > 0 || !plain.trim().is_empty() => {
                depth += 1
            }
            ')' | ']' | '\u{300d}' | '\u{3011}' if depth > 0 => depth -= 1,
            _ if depth > 0 => {}
            _ => plain.push(c),
        }
    }
    let key = plain.trim();
    let mut previous: Option<char> = None;
    for (at, c) in key.char_indices() {
        // A pair begins after a space (or other script), not inside a
        // word or after a sign (the `B-C` of `A-B-C` is no pair).
        if previous.is_none_or(|p| p.is_whitespace() || !p.is_ascii())
            && let Some(edge) = pair_at(&key[at..], names)
        {
            return Some(edge);
        }
        previous = Some(c);
    }
    None
}

fn separator(c: char) -> bool {
    c.is_whitespace()
        || "\"'`*()[]<>-_/|&+~:\u{2022}\u{2013}\u{2014}\u{2212}\u{d7}\u{30fb}\u{300c}\u{300d}\u{3010}\u{3011}\u{2194}\u{2192}\u{21d4}"
            .contains(c)
}

/// `text` with separators and joining words at its start taken off.
fn skip_joins(mut text: &str) -> &str {
    loop {
        let trimmed = text.trim_start_matches(separator);
        let joined = JOINS.iter().find_map(|j| {
            let rest = trimmed.strip_prefix(j)?;
            // A Latin word ends there.
            let ascii = j.is_ascii();
            (!ascii
                || rest
                    .chars()
                    .next()
                    .is_none_or(|c| !c.is_ascii_alphanumeric()))
            .then_some(rest)
        });
        match joined {
            Some(rest) => text = rest,
            None => return trimmed,
        }
    }
}

/// The pair `text` begins with: two different people, and after them
/// nothing, or words that are not a third person.
fn pair_at(text: &str, names: &[(Person, &str)]) -> Option<Edge> {
    let text = text.trim_start_matches(separator);
    let (x, len) = person_at(text, names)?;
    let rest = skip_joins(&text[len..]);
    let (y, len) = person_at(rest, names)?;
    let rest = skip_joins(&rest[len..]);
    if person_at(rest, names).is_some() {
        return None;
    }
    (x != y).then(|| Edge::between(x, y)).flatten()
}

/// The person whose name (`names`: longest first) or letter `text` begins
/// with, and how many bytes name them. A letter stands alone, or beside
/// another letter (`AB`): not the first of a word (`Alex`).
fn person_at(text: &str, names: &[(Person, &str)]) -> Option<(Person, usize)> {
    for &(person, name) in names {
        let len = name.len();
        if text.len() >= len
            && text.is_char_boundary(len)
            && text[..len].to_lowercase() == name.to_lowercase()
        {
            return Some((person, len));
        }
    }
    let mut chars = text.chars();
    let person = match chars.next()?.to_ascii_uppercase() {
        'A' => Person::A,
        'B' => Person::B,
        'C' => Person::C,
        _ => return None,
    };
    match chars.next() {
        Some(next) if next.is_ascii_alphanumeric() && !"ABCabc".contains(next) => None,
        // `ab` reads as A then B, but not `abc` or `cab`'s letters in a
        // word: a run of person letters longer than two is a word.
        _ if text.chars().take_while(|c| "ABCabc".contains(*c)).count() > 2 => None,
        _ => Some((person, 1)),
    }
}

/// Words that warm a relation when said by either of its two people
/// (English, matched as whole words).
const WARM_EN: [&str; 18] = [
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
/// Words that cool it (English).
const COLD_EN: [&str; 18] = [
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
/// Japanese warm words, matched wherever they appear (Japanese is written
/// without spaces). Stems rather than inflected forms where a word bends
/// (`助か` for 助かる, 助かった), and none that a cold word holds.
const WARM_JA: [&str; 22] = [
    "ありがとう",
    "感謝",
    "賛成",
    "同意",
    "いいね",
    "いいと思",
    "素晴らし",
    "すばらし",
    "嬉し",
    "うれし",
    "楽し",
    "好き",
    "助か",
    "なるほど",
    "確かに",
    "その通り",
    "分かる",
    "わかる",
    "ごめん",
    "すみません",
    "一緒に",
    "協力",
];
/// Japanese cold words.
const COLD_JA: [&str; 24] = [
    "嫌い",
    "嫌だ",
    "いやだ",
    "むかつ",
    "ムカつ",
    "うざ",
    "最悪",
    "ひどい",
    "酷い",
    "ふざけ",
    "腹が立",
    "怒",
    "反対",
    "違う",
    "間違",
    "無理",
    "おかしい",
    "勝手",
    "わがまま",
    "のせい",
    "いいえ",
    "うるさい",
    "関係ない",
    "不公平",
];
/// What each warm or cold word is worth.
const WORD: f64 = 0.2;
/// What one person raising another's landmine costs their relation.
const LANDMINE: f64 = 0.5;

/// Whether `c` belongs to a script written without spaces between words
/// (Japanese kana, CJK ideographs): a word of such letters is matched
/// wherever it appears.
fn spaceless(c: char) -> bool {
    matches!(c,
        '\u{3005}'                      // 々
        | '\u{3040}'..='\u{30FF}'       // hiragana, katakana
        | '\u{31F0}'..='\u{31FF}'       // katakana extensions
        | '\u{3400}'..='\u{4DBF}'       // CJK extension A
        | '\u{4E00}'..='\u{9FFF}'       // CJK ideographs
        | '\u{F900}'..='\u{FAFF}'       // CJK compatibility ideographs
        | '\u{FF66}'..='\u{FF9F}'       // half-width katakana
    )
}

/// A letter of a word written with spaces (Latin and the like): such a
/// word matches only where no such letter touches it.
fn spaced_letter(c: char) -> bool {
    (c.is_alphanumeric() && !spaceless(c)) || c == '\''
}

/// Whether `word` (lower case) occurs in `text` (lower case) at byte
/// `at`: a word with a letter of a spaceless script anywhere, a Latin one
/// only as a whole word.
fn occurs_at(text: &str, at: usize, word: &str) -> bool {
    if word.is_empty() || !text[at..].starts_with(word) {
        return false;
    }
    if word.chars().any(spaceless) {
        return true;
    }
    let before = text[..at].chars().next_back();
    let after = text[at + word.len()..].chars().next();
    !before.is_some_and(spaced_letter) && !after.is_some_and(spaced_letter)
}

/// Whether `text` names `word` (both lower case), matched as
/// [`occurs_at`] says.
fn mentions(text: &str, word: &str) -> bool {
    text.match_indices(word)
        .any(|(at, _)| occurs_at(text, at, word))
}

/// One speaker's warm and cold words, lower case, each with its weight.
struct Lexicon(Vec<(String, f64)>);

impl Lexicon {
    fn of(words: &ToneWords) -> Self {
        let builtin = |list: &[&[&str]]| -> Vec<String> {
            if words.builtin {
                list.iter()
                    .flat_map(|l| l.iter().map(|w| (*w).to_owned()))
                    .collect()
            } else {
                Vec::new()
            }
        };
        let warm = builtin(&[&WARM_EN, &WARM_JA])
            .into_iter()
            .chain(words.warm.iter().cloned());
        let cold = builtin(&[&COLD_EN, &COLD_JA])
            .into_iter()
            .chain(words.cold.iter().cloned());
        let mut entries: Vec<(String, f64)> = warm
            .map(|w| (w, WORD))
            .chain(cold.map(|w| (w, -WORD)))
            .map(|(w, v)| (w.trim().to_lowercase(), v))
            .filter(|(w, _)| !w.is_empty())
            .collect();
        // The longest word first, so that the first one found where the
        // scan stands is the longest there.
        entries.sort_by_key(|(word, _)| std::cmp::Reverse(word.len()));
        Self(entries)
    }

    /// The tone of `text` (lower case): scanning it from the start, at
    /// each place the longest listed word found there counts once and the
    /// scan goes on after it (so いいえ counts as いいえ, not as いい).
    fn tone(&self, text: &str) -> f64 {
        let mut tone = 0.0;
        let mut at = 0;
        while at < text.len() {
            match self.0.iter().find(|(word, _)| occurs_at(text, at, word)) {
                Some((word, value)) => {
                    tone += value;
                    at += word.len();
                }
                None => at += text[at..].chars().next().map_or(1, char::len_utf8),
            }
        }
        tone
    }
}

/// Relations counted from human utterances (`(speaker, text)`, the
/// scorer's window) of `personas` (A, B and C): each edge starts at 0,
/// gains 0.2 for each warm word and loses 0.2 for each cold word either of
/// its two people says (each speaker's words: [`ToneWords`]), and loses 0.5
/// for each landmine of the other that one of them names in an utterance;
/// then it is clamped to [-1, 1]. A word or landmine with a Japanese
/// letter in it counts wherever it appears; a Latin one as a whole word.
pub fn by_rules(utterances: &[(Person, &str)], personas: &[Persona]) -> Triangle {
    let lexicons: Vec<Lexicon> = personas.iter().map(|p| Lexicon::of(&p.words)).collect();
    let landmines: Vec<Vec<String>> = personas
        .iter()
        .map(|p| {
            p.landmines
                .iter()
                .map(|m| m.trim().to_lowercase())
                .collect()
        })
        .collect();
    let mut value = [0.0f64; 3];
    for &(speaker, text) in utterances {
        let lower = text.to_lowercase();
        let tone = lexicons
            .get(speaker.index())
            .map_or(0.0, |lexicon| lexicon.tone(&lower));
        for (i, edge) in Edge::ALL.iter().enumerate() {
            let (x, y) = edge.people();
            if speaker != x && speaker != y {
                continue;
            }
            value[i] += tone;
            let other = if speaker == x { y } else { x };
            for mine in landmines.get(other.index()).into_iter().flatten() {
                if mentions(&lower, mine) {
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

    const LETTERS: [&str; 3] = ["A", "B", "C"];

    fn read(reply: &str) -> Result<(Triangle, u32), String> {
        parse(reply, LETTERS).map(|s| (s.relations, s.clipped))
    }

    #[test]
    fn replies_are_read_as_json_or_written_out() {
        assert_eq!(
            read(r#"{"AB": 0.5, "BC": -0.25, "CA": 1}"#).unwrap(),
            (Triangle::new(0.5, -0.25, 1.0), 0)
        );
        assert_eq!(
            read("Sure! AB: -0.3, bc = 0.2\nCA: 0").unwrap(),
            (Triangle::new(-0.3, 0.2, 0.0), 0)
        );
        assert!(
            read(r#"{"AB": 0.5, "BC": -0.25}"#)
                .unwrap_err()
                .contains("CA")
        );
        assert!(read("they get along").is_err());
        assert!(read("AB: none, BC: 0, CA: 0").unwrap_err().contains("AB"));
    }

    #[test]
    fn pairs_are_named_in_either_order_with_or_without_a_separator() {
        // The original scorer's lines: sorted pairs with a hyphen.
        let lines = "A-B: 0.3\nA-C: -0.4\nB-C: 0.1";
        assert_eq!(read(lines).unwrap().0, Triangle::new(0.3, 0.1, -0.4));
        for reply in [
            r#"{"BA": 0.3, "CB": 0.1, "AC": -0.4}"#,
            "- C-A: -0.4\n- B - A: 0.3\n- C\u{d7}B: 0.1",
            "A_B = 0.3; B/C = 0.1; C-A = -0.4",
            "\u{300c}A\u{30fb}B\u{300d}\u{ff1a}0.3\u{3001}B-C\u{ff1a}0.1\u{3001}C-A\u{ff1a}\u{2212}0.4",
        ] {
            assert_eq!(
                read(reply).unwrap().0,
                Triangle::new(0.3, 0.1, -0.4),
                "{reply}"
            );
        }
        // By name, Japanese names included, and a letter beside a name.
        let names = ["Alex", "\u{82b1}\u{5b50}", "Casey"];
        let reply = "Alex - \u{82b1}\u{5b50}: 0.2\nCasey-\u{82b1}\u{5b50}: -0.6\nA-Casey: 0.9";
        let got = parse(reply, names).unwrap().relations;
        assert_eq!(got, Triangle::new(0.2, -0.6, 0.9));
        // Not a pair: one person, the same twice, three, or someone else.
        for key in ["A", "AA", "ABC", "AD", "X-Y", "total"] {
            let reply = format!("{key}: 0.5, AB: 0.1, BC: 0.1, CA: 0.1");
            assert_eq!(
                read(&reply).unwrap().0,
                Triangle::new(0.1, 0.1, 0.1),
                "{key}"
            );
        }
    }

    #[test]
    fn replies_as_models_write_them_are_read() {
        let want = Triangle::new(0.3, -0.1, 0.2);
        for reply in [
            // One line, a space apart.
            "AB: 0.3 BC: -0.1 CA: 0.2",
            // Markdown.
            "**AB:** 0.3\n**BC:** -0.1\n**CA:** **0.2**",
            "- `A-B`: 0.3\n- `B-C`: -.1\n- `C-A`: +0.2",
            // Full-width, as Japanese text writes it, and a decimal comma.
            "\u{ff21}\u{ff22}\u{ff1a}\u{ff10}\u{ff0e}\u{ff13}\u{ff0c}\u{ff22}\u{ff23}\u{ff1a}\u{ff0d}\u{ff10}\u{ff0e}\u{ff11}\u{3002}\u{ff23}\u{ff21}\u{ff1a}0,2",
            // Words between, around and after the people.
            "Relations between A and B: 0.3; B vs C = \u{2013}0.1; C with A: 0.2",
            "A\u{3068}B\u{ff1a}0.3\u{3001}B\u{3068}C\u{ff1a}-0.1\u{3001}C\u{3068}A\u{ff1a}0.2",
            "A-B relationship: 0.3\nB-C (Ben and Cy): -0.1\nC\u{2194}A score: 0.2",
        ] {
            assert_eq!(read(reply).unwrap().0, want, "{reply}");
        }
        // A decimal comma is not a list comma.
        assert_eq!(
            read("AB: 0,3, BC: 0, CA: 1").unwrap().0,
            Triangle::new(0.3, 0.0, 1.0)
        );
        // Words that begin with a person's letter are no person.
        assert!(read("Alex: 0.3, Bob: 0.1, Cy: 0.2").is_err());
        assert!(
            read("ABC: 0.3, cab: 0.1, CA: 0.2")
                .unwrap_err()
                .contains("AB, BC")
        );
        // Three people are no pair.
        assert!(
            read("A-B-C: 0.3, B and C and A: 0.1, CA: 0.2")
                .unwrap_err()
                .contains("AB, BC")
        );
    }

    #[test]
    fn values_outside_the_range_are_clipped_and_counted() {
        let (t, clipped) = read(r#"{"AB": 1.5, "BC": -3, "CA": 0.2}"#).unwrap();
        assert_eq!((t, clipped), (Triangle::new(1.0, -1.0, 0.2), 2));
        // The first value of a pair counts; a repeat is not clipped again.
        let (t, clipped) = read("AB: 2, BA: 5, BC: 0, CA: 1").unwrap();
        assert_eq!((t, clipped), (Triangle::new(1.0, 0.0, 1.0), 1));
    }

    fn persona(landmines: &[&str], words: ToneWords) -> Persona {
        Persona {
            name: String::new(),
            prompt: String::new(),
            landmines: landmines.iter().map(|w| (*w).to_owned()).collect(),
            need: None,
            endpoint: None,
            words,
        }
    }

    fn close(t: Triangle, [ab, bc, ca]: [f64; 3]) -> bool {
        (t.ab - ab).abs() < 1e-9 && (t.bc - bc).abs() < 1e-9 && (t.ca - ca).abs() < 1e-9
    }

    #[test]
    fn rules_count_tone_and_landmines_per_pair() {
        let personas = [
            persona(&["money"], ToneWords::default()),
            persona(&[], ToneWords::default()),
            persona(&["Mother"], ToneWords::default()),
        ];
        let said = [
            (Person::A, "I agree, thanks."),            // AB, CA +0.4
            (Person::B, "That is wrong. Your mother!"), // AB, BC -0.2; BC -0.5 (C's landmine)
            (Person::C, "Money, money."),               // BC, CA; CA -0.5 (A's landmine, once)
            (Person::C, "Moneybags know nothing."),     // no whole word: nothing
        ];
        let t = by_rules(&said, &personas);
        assert!(close(t, [0.2, -0.7, -0.1]), "{t:?}");
        // Clamped.
        let angry = [(Person::A, "no no no no no no no")];
        assert_eq!(by_rules(&angry, &personas).ab, -1.0);
    }

    #[test]
    fn japanese_words_count_wherever_they_appear_latin_ones_as_whole_words() {
        let personas = [
            persona(&["お金"], ToneWords::default()),
            persona(
                &[],
                ToneWords {
                    warm: vec!["まあね".to_owned()],
                    ..ToneWords::default()
                },
            ),
            persona(
                &["母親", "deadline"],
                ToneWords {
                    cold: vec!["はぁ".to_owned()],
                    builtin: false,
                    ..ToneWords::default()
                },
            ),
        ];
        let said = [
            // ありがとう twice and 賛成: +0.6 to AB and CA.
            (Person::A, "ありがとう！それ、賛成です。本当にありがとう。"),
            // いいえ and 間違 (間違い: not 違う as well): -0.4 to AB and
            // BC; 母親 is C's landmine: BC -0.5.
            (Person::B, "いいえ、それは間違いだと思う。母親に聞いたら？"),
            // C counts only their own words: はぁ -0.2 (怒 and 嫌い are
            // built-in, left out) to BC and CA; お金 is A's: CA -0.5.
            (Person::C, "はぁ、怒ってないけど、お金の話は嫌い。"),
            // まあね (B's own) and 一緒に +0.4, the whole word no -0.2:
            // +0.2 to AB and BC.
            (Person::B, "まあね、一緒にやろう。OKだよ、no problem"),
            // wrong -0.2 (no and not are not whole words in nothing) to
            // AB and CA; deadline is C's: CA -0.5.
            (Person::A, "Nothing is wrong with the deadline."),
        ];
        let t = by_rules(&said, &personas);
        assert!(close(t, [0.2, -0.9, -0.8]), "{t:?}");
    }

    #[test]
    fn the_longest_word_at_a_place_counts_and_repeats_count_each_time() {
        let own = |warm: &[&str]| ToneWords {
            warm: warm.iter().map(|w| (*w).to_owned()).collect(),
            ..ToneWords::default()
        };
        let personas = [
            persona(&[], own(&["いい"])),
            persona(&[], ToneWords::default()),
            persona(&[], ToneWords::default()),
        ];
        // いいえ (cold) is longer than いい (warm): -0.2, not -0.2 + 0.2.
        let t = by_rules(&[(Person::A, "いいえ")], &personas);
        assert!(close(t, [-0.2, 0.0, -0.2]), "{t:?}");
        // No spaces: each ありがとう counts; いい alone is A's warm word.
        let t = by_rules(&[(Person::A, "ありがとうありがとう、いい")], &personas);
        assert!(close(t, [0.6, 0.0, 0.6]), "{t:?}");
        // お金持ち names お金.
        let personas = [
            persona(&[], ToneWords::default()),
            persona(&["お金"], ToneWords::default()),
            persona(&[], ToneWords::default()),
        ];
        let t = by_rules(&[(Person::A, "お金持ちの話")], &personas);
        assert!(close(t, [-0.5, 0.0, 0.0]), "{t:?}");
    }
}
