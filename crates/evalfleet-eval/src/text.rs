//! Text normalisation and edit distances shared by the metrics. Each
//! definition is the one `docs/metrics.md` documents; where a reference tool
//! fixes it (SQuAD's normaliser, jiwer's default transforms), it follows that
//! tool and `tests/data/metric_vectors.json` holds the tool's own numbers.

use std::collections::HashMap;
use std::sync::LazyLock;

use regex::Regex;

#[allow(clippy::unwrap_used)] // a constant pattern
static ARTICLES: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\b(a|an|the)\b").unwrap());

/// SQuAD v1.1's normaliser: lower case, drop ASCII punctuation, drop the
/// articles a/an/the as whole words, collapse whitespace.
pub fn squad_normalize(text: &str) -> String {
    let lower = text.to_lowercase();
    let no_punct: String = lower
        .chars()
        .filter(|c| !c.is_ascii_punctuation())
        .collect();
    let no_articles = ARTICLES.replace_all(&no_punct, " ");
    no_articles.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// How `exact_match` and `contains` compare text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Normalize {
    /// As it is.
    None,
    /// Leading and trailing whitespace removed (the default).
    Strip,
    /// SQuAD's normaliser ([`squad_normalize`]).
    Squad,
}

impl Normalize {
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "none" => Some(Self::None),
            "strip" => Some(Self::Strip),
            "squad" => Some(Self::Squad),
            _ => None,
        }
    }

    pub fn apply(self, text: &str, ignore_case: bool) -> String {
        let out = match self {
            Self::None => text.to_owned(),
            Self::Strip => text.trim().to_owned(),
            Self::Squad => squad_normalize(text),
        };
        if ignore_case { out.to_lowercase() } else { out }
    }
}

/// SQuAD's token F1 of a prediction against one reference: both are
/// normalised and split on whitespace; F1 of the multiset overlap; 0 when
/// nothing overlaps (so also when either side is empty).
pub fn token_f1(prediction: &str, reference: &str) -> f64 {
    let pred = squad_normalize(prediction);
    let gold = squad_normalize(reference);
    let pred: Vec<&str> = pred.split_whitespace().collect();
    let gold: Vec<&str> = gold.split_whitespace().collect();
    let mut counts: HashMap<&str, i64> = HashMap::new();
    for token in &gold {
        *counts.entry(token).or_default() += 1;
    }
    let mut same = 0usize;
    for token in &pred {
        if let Some(count) = counts.get_mut(token)
            && *count > 0
        {
            *count -= 1;
            same += 1;
        }
    }
    if same == 0 {
        return 0.0;
    }
    let precision = same as f64 / pred.len() as f64;
    let recall = same as f64 / gold.len() as f64;
    2.0 * precision * recall / (precision + recall)
}

/// Edits and reference length of a word error rate: words split on any
/// run of whitespace (jiwer's default transform splits on spaces only, so
/// a tab or a newline inside a word run differs; docs/metrics.md says so).
pub fn word_edits(reference: &str, hypothesis: &str) -> (usize, usize) {
    let reference: Vec<&str> = reference.split_whitespace().collect();
    let hypothesis: Vec<&str> = hypothesis.split_whitespace().collect();
    (
        strsim::generic_levenshtein(&reference, &hypothesis),
        reference.len(),
    )
}

/// Edits and reference length of a character error rate, with jiwer's
/// default transform: surrounding whitespace removed, every other character
/// (inner spaces included) kept.
pub fn char_edits(reference: &str, hypothesis: &str) -> (usize, usize) {
    let reference: Vec<char> = reference.trim().chars().collect();
    let hypothesis: Vec<char> = hypothesis.trim().chars().collect();
    (
        strsim::generic_levenshtein(&reference, &hypothesis),
        reference.len(),
    )
}

/// The normalised Levenshtein distance of ANLS: edits over the longer
/// string's length, in characters; 0 for two empty strings.
pub fn normalized_levenshtein(a: &str, b: &str) -> f64 {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let longest = a.len().max(b.len());
    if longest == 0 {
        return 0.0;
    }
    strsim::generic_levenshtein(&a, &b) as f64 / longest as f64
}

/// The ANLS normaliser (as in the DocVQA and ST-VQA evaluations): lower
/// case, whitespace collapsed and trimmed.
pub fn anls_normalize(text: &str) -> String {
    text.to_lowercase()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

#[allow(clippy::unwrap_used)] // a constant pattern
static NUMBER: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?").unwrap());

/// The last number in a text, with thousands separators, currency signs and
/// units ignored: `"$1,234.50 dollars"` is 1234.5; `None` when there is none.
pub fn last_number(text: &str) -> Option<f64> {
    NUMBER
        .find_iter(text)
        .filter_map(|m| m.as_str().replace(',', "").parse::<f64>().ok())
        .last()
}

/// A compiled regular expression that compares (and prints) as its
/// source text, so that definitions holding one can be compared.
#[derive(Clone)]
pub struct Pattern(Regex);

impl Pattern {
    pub fn new(source: &str) -> Result<Self, regex::Error> {
        Regex::new(source).map(Self)
    }
}

impl std::ops::Deref for Pattern {
    type Target = Regex;

    fn deref(&self) -> &Regex {
        &self.0
    }
}

impl PartialEq for Pattern {
    fn eq(&self, other: &Self) -> bool {
        self.0.as_str() == other.0.as_str()
    }
}

impl std::fmt::Debug for Pattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.0.as_str(), f)
    }
}

/// How alike two names are, from 0 to 1, case, `_` and `-` aside
/// (`idField` is `id_field`).
fn likeness(a: &str, b: &str) -> f64 {
    let plain = |s: &str| {
        s.chars()
            .filter(|c| !matches!(c, '_' | '-'))
            .flat_map(char::to_lowercase)
            .collect::<String>()
    };
    strsim::jaro_winkler(&plain(a), &plain(b))
}

/// Below this a known name is too unlike the unknown one to be suggested.
const CLOSE_ENOUGH: f64 = 0.85;

/// The known name nearest `name` (a config key, a metric), if one is close
/// enough to be meant.
pub fn nearest<'k, S: AsRef<str>>(name: &str, known: &'k [S]) -> Option<&'k str> {
    known
        .iter()
        .map(|k| (likeness(name, k.as_ref()), k.as_ref()))
        .filter(|(score, _)| *score >= CLOSE_ENOUGH)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn squad_normalizer_drops_articles_punctuation_and_space() {
        assert_eq!(
            squad_normalize("  The  Denver, Broncos! "),
            "denver broncos"
        );
        assert_eq!(squad_normalize("Thearticle"), "thearticle");
        assert_eq!(squad_normalize("l'Odéon"), "lodéon");
    }

    #[test]
    fn numbers_are_found_last_and_without_separators() {
        assert_eq!(last_number("#### 1,234"), Some(1234.0));
        assert_eq!(last_number("costs $3.50 then 18 dollars"), Some(18.0));
        assert_eq!(last_number("-7"), Some(-7.0));
        assert_eq!(last_number(".5"), Some(0.5));
        assert_eq!(last_number("none"), None);
    }

    #[test]
    fn anls_distance_is_over_the_longer_string() {
        assert!((normalized_levenshtein("abcd", "abce") - 0.25).abs() < 1e-12);
        assert_eq!(normalized_levenshtein("", ""), 0.0);
        assert_eq!(anls_normalize("  Hello   World "), "hello world");
    }
}
