//! The few lines of a Prometheus text answer (`GET /metrics`) that
//! evalfleet reads: the samples of named metrics, with their labels.
//!
//! The answer comes from a server, so it is hostile until proven
//! otherwise: a line that is not a sample of a wanted metric is skipped
//! whatever it holds, and a wanted sample whose value cannot be read is
//! kept with a NaN value, so that a reader can tell a metric that is
//! absent from one whose value is unusable. Comments (`# HELP`, `# TYPE`,
//! OpenMetrics' `# EOF`), timestamps and exemplars after the value are
//! ignored.

/// One sample: `name{label="value",...} value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub labels: Vec<(String, String)>,
    /// NaN when the value could not be read.
    pub value: f64,
}

impl Sample {
    /// The value of label `name`, if the sample has it.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The samples of metric `name` in `text`, in order. Empty when the
/// metric is absent.
pub fn samples(text: &str, name: &str) -> Vec<Sample> {
    text.lines()
        .filter_map(|line| sample_of(line.trim_start(), name))
        .collect()
}

/// Whether `text` has at least one sample of a metric whose name starts
/// with `prefix` (an engine's metrics all do: `vllm:`).
pub fn has_prefix(text: &str, prefix: &str) -> bool {
    text.lines()
        .map(str::trim_start)
        .any(|line| !line.starts_with('#') && line.starts_with(prefix))
}

/// The sample on `line` if it is one of metric `name`.
fn sample_of(line: &str, name: &str) -> Option<Sample> {
    let rest = line.strip_prefix(name)?;
    // `name` must be the whole metric name, not the start of a longer one.
    let (labels, rest) = match rest.chars().next()? {
        '{' => {
            let (labels, after) = labels(&rest[1..]);
            match labels {
                Some(labels) => (labels, after),
                // A sample of the wanted metric whose labels cannot be
                // read: present, but unusable.
                None => (Vec::new(), ""),
            }
        }
        ' ' | '\t' => (Vec::new(), rest),
        _ => return None,
    };
    let value = rest
        .split_whitespace()
        .next()
        .and_then(value)
        .unwrap_or(f64::NAN);
    Some(Sample { labels, value })
}

/// A sample's value: a float, or `NaN`, `+Inf`, `-Inf` as Prometheus
/// writes them.
fn value(text: &str) -> Option<f64> {
    match text {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        // Rust also reads `inf`, `infinity` and `nan` in any case, which
        // Prometheus never writes; and a value is never hexadecimal.
        other
            if other
                .bytes()
                .all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'+' | b'-')) =>
        {
            other.parse().ok()
        }
        _ => None,
    }
}

/// The labels after `{`, up to its `}`, and what follows it; `None` when
/// they are malformed.
fn labels(text: &str) -> (Option<Vec<(String, String)>>, &str) {
    let mut out = Vec::new();
    let mut rest = text;
    loop {
        rest = rest.trim_start_matches([' ', '\t']);
        if let Some(after) = rest.strip_prefix('}') {
            return (Some(out), after);
        }
        let Some(eq) = rest.find('=') else {
            return (None, "");
        };
        let name = rest[..eq].trim();
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            return (None, "");
        }
        let Some(quoted) = rest[eq + 1..].trim_start().strip_prefix('"') else {
            return (None, "");
        };
        let Some((value, after)) = quoted_value(quoted) else {
            return (None, "");
        };
        out.push((name.to_owned(), value));
        rest = after.trim_start_matches([' ', '\t']);
        if let Some(after) = rest.strip_prefix(',') {
            rest = after;
        } else if !rest.starts_with('}') {
            return (None, "");
        }
    }
}

/// A label value up to its closing quote, unescaped (`\\`, `\"`, `\n`),
/// and what follows the quote.
fn quoted_value(text: &str) -> Option<(String, &str)> {
    let mut value = String::new();
    let mut chars = text.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((value, &text[i + 1..])),
            '\\' => match chars.next()?.1 {
                'n' => value.push('\n'),
                other => value.push(other),
            },
            other => value.push(other),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_read_with_their_labels_and_other_metrics_skipped() {
        let text = "# HELP m a gauge\n# TYPE m gauge\nm{a=\"1\",b=\"x\"} 2.5\nm_total 9\nmm 3\nm 4 1700000000000\n";
        let found = samples(text, "m");
        assert_eq!(found.len(), 2);
        assert_eq!(found[0].label("a"), Some("1"));
        assert_eq!(found[0].label("b"), Some("x"));
        assert!((found[0].value - 2.5).abs() < 1e-12);
        assert!(found[1].labels.is_empty());
        assert!((found[1].value - 4.0).abs() < 1e-12);
    }

    #[test]
    fn label_values_may_hold_quotes_braces_commas_and_escapes() {
        let text = "m{model_name=\"a \\\"b\\\" {c}, d\\\\e\\nf\",engine=\"0\",} 7\n";
        let found = samples(text, "m");
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].label("model_name"), Some("a \"b\" {c}, d\\e\nf"));
        assert_eq!(found[0].label("engine"), Some("0"));
        assert!((found[0].value - 7.0).abs() < 1e-12);
    }

    #[test]
    fn unreadable_values_and_labels_are_kept_as_nan() {
        let text = "m{a=\"1} 3\nm{a=1} 3\nm abc\nm 0x10\nm inf\nm NaN\nm +Inf\nm\t-Inf\nm 1e3 # {trace=\"x\"} 1\n";
        let values: Vec<f64> = samples(text, "m").iter().map(|s| s.value).collect();
        assert_eq!(values.len(), 9);
        assert!(values[..6].iter().all(|v| v.is_nan()), "{values:?}");
        assert_eq!(values[6], f64::INFINITY);
        assert_eq!(values[7], f64::NEG_INFINITY);
        assert!((values[8] - 1000.0).abs() < 1e-9);
    }

    #[test]
    fn a_metric_name_is_matched_whole() {
        assert!(samples("m_total 1\nm: 1\nmx{a=\"b\"} 1\n", "m").is_empty());
        assert!(has_prefix("# vllm:x\nvllm:y 1\n", "vllm:"));
        assert!(!has_prefix("# vllm:x 1\nsglang:y 1\n", "vllm:"));
    }
}
