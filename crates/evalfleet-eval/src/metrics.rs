//! The metric registry: named, versioned metrics with declared parameters.
//! `docs/metrics.md` gives each one's exact definition; a change of
//! definition is a new version, so stored scores keep their meaning.

use super::text::Pattern;
use serde_json::{Map, Value, json};

use super::backend::{BackendSpec, NATIVE};
use super::text::{self, Normalize};

/// What the registry knows of a metric.
pub struct MetricInfo {
    pub name: &'static str,
    pub version: u32,
    pub params: &'static [&'static str],
    pub higher_is_better: bool,
    pub summary: &'static str,
}

/// Every built-in metric.
pub const REGISTRY: &[MetricInfo] = &[
    MetricInfo {
        name: "exact_match",
        version: 1,
        params: &["normalize", "ignore_case"],
        higher_is_better: true,
        summary: "1 when the answer equals a reference after normalisation",
    },
    MetricInfo {
        name: "contains",
        version: 1,
        params: &["normalize", "ignore_case"],
        higher_is_better: true,
        summary: "1 when a reference occurs in the answer after normalisation",
    },
    MetricInfo {
        name: "regex_match",
        version: 1,
        params: &["pattern"],
        higher_is_better: true,
        summary: "1 when the answer matches the pattern",
    },
    MetricInfo {
        name: "f1",
        version: 1,
        params: &[],
        higher_is_better: true,
        summary: "SQuAD token F1, the best over the references",
    },
    MetricInfo {
        name: "numeric_match",
        version: 1,
        params: &["tolerance", "relative_tolerance"],
        higher_is_better: true,
        summary: "1 when the answer's last number is within tolerance of the reference's",
    },
    MetricInfo {
        name: "choice_accuracy",
        version: 1,
        params: &[],
        higher_is_better: true,
        summary: "1 when the chosen letter is the reference letter (or index)",
    },
    MetricInfo {
        name: "cer",
        version: 1,
        params: &[],
        higher_is_better: false,
        summary: "character edits over reference characters (jiwer's definition)",
    },
    MetricInfo {
        name: "wer",
        version: 1,
        params: &[],
        higher_is_better: false,
        summary: "word edits over reference words (jiwer's definition)",
    },
    MetricInfo {
        name: "anls",
        version: 1,
        params: &["threshold"],
        higher_is_better: true,
        summary: "1 - normalised Levenshtein distance when below the threshold, else 0; the best over the references",
    },
    MetricInfo {
        name: "json_field_match",
        version: 1,
        params: &["fields"],
        higher_is_better: true,
        summary: "the share of the reference's fields the answer has equal; precision and recall over keys",
    },
    MetricInfo {
        name: "classification",
        version: 1,
        params: &["labels", "ignore_case"],
        higher_is_better: true,
        summary: "1 when the label equals the reference's; per-class and macro/micro P/R/F1 in aggregates",
    },
    MetricInfo {
        name: "code_accepted",
        version: 1,
        params: &[],
        higher_is_better: true,
        summary: "1 when the code judge accepts the program (every test passes); with task.n samples, pass@k",
    },
    MetricInfo {
        name: "episode_reward",
        version: 2,
        params: &[],
        higher_is_better: true,
        summary: "a conversation episode's total reward (kind: conversation)",
    },
    MetricInfo {
        name: "episode_steps",
        version: 2,
        params: &[],
        higher_is_better: true,
        summary: "a conversation episode's decisions",
    },
    MetricInfo {
        name: "episode_interventions",
        version: 2,
        params: &[],
        higher_is_better: true,
        summary: "decisions on which the robot spoke",
    },
    MetricInfo {
        name: "episode_stabilised",
        version: 2,
        params: &[],
        higher_is_better: true,
        summary: "decisions that earned the stable bonus",
    },
    MetricInfo {
        name: "episode_preference_matches",
        version: 2,
        params: &[],
        higher_is_better: true,
        summary: "decisions whose strategy answered the target speaker's need",
    },
    MetricInfo {
        name: "episode_invalid",
        version: 2,
        params: &[],
        higher_is_better: false,
        summary: "decisions with no usable policy reply",
    },
    MetricInfo {
        name: "episode_clipped_scores",
        version: 1,
        params: &[],
        higher_is_better: false,
        summary: "relation scores outside [-1, 1] the scorer gave, clipped",
    },
    MetricInfo {
        name: "llm_judge",
        version: 1,
        params: &["endpoint", "rubric", "score_regex", "scale"],
        higher_is_better: true,
        summary: "a judge endpoint's score for the answer, from a rubric, scaled to 0..1",
    },
];

/// One metric as `evalfleet metrics` lists it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Listed {
    pub name: String,
    /// `native`, or a declared backend's name.
    pub backend: String,
    pub version: u32,
    /// The key its scores are stored under.
    pub key: String,
    /// The parameters it takes; `None` for a backend's (its program
    /// decides).
    pub params: Option<Vec<String>>,
    pub higher_is_better: bool,
    pub summary: String,
    /// A backend's program and arguments.
    pub command: Option<Vec<String>>,
}

/// The registry: every built-in metric, then each metric of `backends`.
pub fn listing(backends: &[BackendSpec]) -> Vec<Listed> {
    let native = REGISTRY.iter().map(|m| Listed {
        name: m.name.to_owned(),
        backend: NATIVE.to_owned(),
        version: m.version,
        key: format!("{}@{}", m.name, m.version),
        params: Some(m.params.iter().map(|p| (*p).to_owned()).collect()),
        higher_is_better: m.higher_is_better,
        summary: m.summary.to_owned(),
        command: None,
    });
    let outside = backends.iter().flat_map(|b| {
        b.metrics.iter().map(|m| Listed {
            name: m.name.clone(),
            backend: b.name.clone(),
            version: b.version,
            key: format!("{}@{}@{}", m.name, b.name, b.version),
            params: None,
            higher_is_better: m.higher_is_better,
            summary: m.summary.clone(),
            command: Some(b.command.clone()),
        })
    });
    native.chain(outside).collect()
}

/// How a metric is computed, with its parameters.
#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    ExactMatch {
        normalize: Normalize,
        ignore_case: bool,
    },
    Contains {
        normalize: Normalize,
        ignore_case: bool,
    },
    RegexMatch {
        pattern: Pattern,
    },
    F1,
    Numeric {
        tolerance: f64,
        relative: f64,
    },
    Choice,
    Cer,
    Wer,
    Anls {
        threshold: f64,
    },
    JsonFields {
        fields: Option<Vec<String>>,
    },
    Classification {
        labels: Option<Vec<String>>,
        ignore_case: bool,
    },
    /// Set by the code judge (`task.code`).
    CodeAccepted,
    /// Set by the conversation task, for each episode.
    Episode,
    /// Scored by an outside program (`task.metric_backends`), which is
    /// given the parameters as they are.
    Backend {
        backend: String,
        params: Map<String, Value>,
    },
    /// Scored by a call to a judge endpoint (see `Assessor::llm_judge_calls`).
    LlmJudge {
        endpoint: String,
        rubric: String,
        pattern: Pattern,
        low: f64,
        high: f64,
    },
}

/// The default `score_regex` of `llm_judge`: `Score: 7`, `score = **0.5**`.
pub const JUDGE_SCORE: &str = r"(?i)score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)";

/// A metric as a task configures it.
#[derive(Debug, Clone, PartialEq)]
pub struct Metric {
    /// The key its scores are stored under: `as`, else `name@version` for
    /// a built-in metric (the key stored runs have) and
    /// `name@backend@version` for a backend's.
    pub key: String,
    pub name: String,
    pub version: u32,
    pub kind: Kind,
    pub higher_is_better: bool,
}

fn param<'a>(params: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    params.get(key)
}

fn bool_param(params: &Map<String, Value>, key: &str, default: bool) -> Result<bool, String> {
    match param(params, key) {
        None => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(format!("{key} must be true or false, got {other}")),
    }
}

fn number_param(params: &Map<String, Value>, key: &str, default: f64) -> Result<f64, String> {
    match param(params, key) {
        None => Ok(default),
        Some(Value::Number(n)) => n
            .as_f64()
            .filter(|v| *v >= 0.0)
            .ok_or_else(|| format!("{key} must be a number of at least 0, got {n}")),
        Some(other) => Err(format!("{key} must be a number, got {other}")),
    }
}

fn strings_param(params: &Map<String, Value>, key: &str) -> Result<Option<Vec<String>>, String> {
    match param(params, key) {
        None => Ok(None),
        Some(Value::Array(list)) if !list.is_empty() => list
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| format!("{key} must be a list of strings, got {v}"))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(other) => Err(format!(
            "{key} must be a non-empty list of strings, got {other}"
        )),
    }
}

fn normalize_param(params: &Map<String, Value>) -> Result<Normalize, String> {
    match param(params, "normalize") {
        None => Ok(Normalize::Strip),
        Some(Value::String(s)) => Normalize::parse(s)
            .ok_or_else(|| format!("normalize must be none, strip or squad, got '{s}'")),
        Some(other) => Err(format!(
            "normalize must be none, strip or squad, got {other}"
        )),
    }
}

impl Metric {
    /// Looks `name` (`exact_match`, `exact_match@1`, `exact_match@native`
    /// or `exact_match@native@1`) up in the registry and checks its
    /// parameters.
    pub fn build(
        name: &str,
        params: &Map<String, Value>,
        key: Option<String>,
    ) -> Result<Self, String> {
        Self::build_with(name, params, key, &[])
    }

    /// [`Metric::build`], where `name@backend` and `name@backend@version`
    /// name a metric of one of `backends`.
    pub fn build_with(
        name: &str,
        params: &Map<String, Value>,
        key: Option<String>,
        backends: &[BackendSpec],
    ) -> Result<Self, String> {
        let (base, backend, version) = split_name(name)?;
        if let Some(backend) = backend.filter(|b| *b != NATIVE) {
            return Self::of_backend(base, backend, version, params, key, backends);
        }
        let known: Vec<&str> = REGISTRY.iter().map(|m| m.name).collect();
        let info = REGISTRY.iter().find(|m| m.name == base).ok_or_else(|| {
            match super::text::nearest(base, &known) {
                Some(meant) => format!("unknown metric '{base}' (did you mean '{meant}'?)"),
                None => format!("unknown metric '{base}' (known: {})", known.join(", ")),
            }
        })?;
        if let Some(v) = version
            && v != info.version
        {
            return Err(format!(
                "{base} has no version {v} (this evalfleet has version {})",
                info.version
            ));
        }
        if let Some(unknown) = params.keys().find(|k| !info.params.contains(&k.as_str())) {
            return Err(if info.params.is_empty() {
                format!("{base} takes no parameters, got '{unknown}'")
            } else {
                format!(
                    "{base} has no parameter '{unknown}' (it takes: {})",
                    info.params.join(", ")
                )
            });
        }
        let kind = match base {
            "exact_match" => Kind::ExactMatch {
                normalize: normalize_param(params)?,
                ignore_case: bool_param(params, "ignore_case", false)?,
            },
            "contains" => Kind::Contains {
                normalize: normalize_param(params)?,
                ignore_case: bool_param(params, "ignore_case", false)?,
            },
            "regex_match" => {
                let pattern = match param(params, "pattern") {
                    Some(Value::String(p)) => {
                        Pattern::new(p).map_err(|e| format!("pattern is not a valid regex: {e}"))?
                    }
                    _ => return Err("regex_match needs a pattern".to_owned()),
                };
                Kind::RegexMatch { pattern }
            }
            "f1" => Kind::F1,
            "numeric_match" => Kind::Numeric {
                tolerance: number_param(params, "tolerance", 1e-6)?,
                relative: number_param(params, "relative_tolerance", 0.0)?,
            },
            "choice_accuracy" => Kind::Choice,
            "cer" => Kind::Cer,
            "wer" => Kind::Wer,
            "anls" => {
                let threshold = number_param(params, "threshold", 0.5)?;
                if threshold > 1.0 {
                    return Err(format!(
                        "threshold must be between 0 and 1, got {threshold}"
                    ));
                }
                Kind::Anls { threshold }
            }
            "json_field_match" => Kind::JsonFields {
                fields: strings_param(params, "fields")?,
            },
            "code_accepted" => Kind::CodeAccepted,
            "episode_reward"
            | "episode_steps"
            | "episode_interventions"
            | "episode_stabilised"
            | "episode_preference_matches"
            | "episode_invalid"
            | "episode_clipped_scores" => Kind::Episode,
            "llm_judge" => {
                let text = |key: &str| match param(params, key) {
                    Some(Value::String(s)) if !s.trim().is_empty() => Ok(s.clone()),
                    _ => Err(format!("llm_judge needs {key} (a string)")),
                };
                let endpoint = text("endpoint")?;
                let rubric = text("rubric")?;
                let pattern = match param(params, "score_regex") {
                    None => Pattern::new(JUDGE_SCORE).map_err(|e| e.to_string())?,
                    Some(Value::String(p)) => Pattern::new(p)
                        .map_err(|e| format!("score_regex is not a valid regex: {e}"))?,
                    Some(other) => {
                        return Err(format!("score_regex must be a string, got {other}"));
                    }
                };
                if pattern.captures_len() < 2 {
                    return Err("score_regex needs a capture group around the number".to_owned());
                }
                let (low, high) = match param(params, "scale") {
                    None => (0.0, 10.0),
                    Some(Value::Array(pair)) if pair.len() == 2 => {
                        match (pair[0].as_f64(), pair[1].as_f64()) {
                            (Some(l), Some(h)) if h > l => (l, h),
                            _ => {
                                return Err(
                                    "scale must be [lowest, highest] with highest > lowest"
                                        .to_owned(),
                                );
                            }
                        }
                    }
                    Some(other) => {
                        return Err(format!("scale must be [lowest, highest], got {other}"));
                    }
                };
                Kind::LlmJudge {
                    endpoint,
                    rubric,
                    pattern,
                    low,
                    high,
                }
            }
            "classification" => Kind::Classification {
                labels: strings_param(params, "labels")?,
                ignore_case: bool_param(params, "ignore_case", true)?,
            },
            _ => return Err(format!("unknown metric '{base}'")),
        };
        Ok(Self {
            key: key.unwrap_or_else(|| format!("{}@{}", info.name, info.version)),
            name: info.name.to_owned(),
            version: info.version,
            kind,
            higher_is_better: info.higher_is_better,
        })
    }

    /// A metric of a declared backend; its parameters are the program's
    /// business.
    fn of_backend(
        base: &str,
        backend: &str,
        version: Option<u32>,
        params: &Map<String, Value>,
        key: Option<String>,
        backends: &[BackendSpec],
    ) -> Result<Self, String> {
        let spec = backends.iter().find(|b| b.name == backend).ok_or_else(|| {
            let declared: Vec<&str> = backends.iter().map(|b| b.name.as_str()).collect();
            if declared.is_empty() {
                format!(
                    "unknown metric backend '{backend}' (task.metric_backends declares none; the built-in one is '{NATIVE}')"
                )
            } else {
                format!(
                    "unknown metric backend '{backend}' (declared: {}; built in: {NATIVE})",
                    declared.join(", ")
                )
            }
        })?;
        let metric = spec.metric(base).ok_or_else(|| {
            let names: Vec<&str> = spec.metrics.iter().map(|m| m.name.as_str()).collect();
            format!(
                "metric backend '{backend}' gives no metric '{base}' (it gives: {})",
                names.join(", ")
            )
        })?;
        if let Some(v) = version
            && v != spec.version
        {
            return Err(format!(
                "metric backend '{backend}' is at version {} (task.metric_backends), not {v}",
                spec.version
            ));
        }
        Ok(Self {
            key: key.unwrap_or_else(|| format!("{base}@{backend}@{}", spec.version)),
            name: base.to_owned(),
            version: spec.version,
            kind: Kind::Backend {
                backend: backend.to_owned(),
                params: params.clone(),
            },
            higher_is_better: metric.higher_is_better,
        })
    }

    /// The backend that scores it: [`NATIVE`] for a built-in metric.
    pub fn backend(&self) -> &str {
        match &self.kind {
            Kind::Backend { backend, .. } => backend,
            _ => NATIVE,
        }
    }

    /// Whether [`Metric::score`] computes it (not a judge endpoint, the
    /// code judge or an outside backend).
    pub fn scored_here(&self) -> bool {
        !matches!(
            self.kind,
            Kind::LlmJudge { .. } | Kind::CodeAccepted | Kind::Episode | Kind::Backend { .. }
        )
    }

    /// Whether the task must give it a reference.
    pub fn needs_reference(&self) -> bool {
        self.scored_here() && !matches!(self.kind, Kind::RegexMatch { .. })
    }

    /// Whether the reference is JSON (an object to compare fields with).
    pub fn wants_json_reference(&self) -> bool {
        matches!(self.kind, Kind::JsonFields { .. })
    }

    /// The value an item with no usable answer (failed, unparsed, invalid)
    /// counts as in a mean: the worst score.
    pub fn missing(&self) -> f64 {
        if self.higher_is_better { 0.0 } else { 1.0 }
    }

    /// Why this metric cannot score against `reference` (a numeric match
    /// against text with no number, a choice that is no letter, a label
    /// that is not among the labels, JSON fields against what is not a
    /// JSON object); `None` when it can.
    pub fn unusable(&self, reference: &Value) -> Option<String> {
        if reference.is_null() {
            return Some(
                "the reference is null (a field missing from a list of references?)".to_owned(),
            );
        }
        let checks = matches!(
            self.kind,
            Kind::Numeric { .. }
                | Kind::Choice
                | Kind::Classification {
                    labels: Some(_),
                    ..
                }
                | Kind::Contains { .. }
                | Kind::JsonFields { .. }
        );
        if !checks {
            return None;
        }
        let text = as_text(reference);
        let shown = || {
            let short: String = text.chars().take(60).collect();
            let more = if short.len() < text.len() { "…" } else { "" };
            format!("'{short}{more}'")
        };
        match &self.kind {
            Kind::Numeric { .. } if text::last_number(&text).is_none() => {
                Some(format!("the reference {} has no number", shown()))
            }
            Kind::Choice => {
                let letter = choice_letter(&text);
                let is_letter = letter.len() == 1 && letter.bytes().all(|b| b.is_ascii_uppercase());
                (!is_letter).then(|| {
                    format!(
                        "the reference {} is not a choice (a letter, or an index from 0)",
                        shown()
                    )
                })
            }
            Kind::Classification {
                labels: Some(labels),
                ignore_case,
            } => {
                let norm = |s: &str| label_norm(s, *ignore_case);
                (!labels.iter().any(|l| norm(l) == norm(&text))).then(|| {
                    format!(
                        "the reference {} is not one of the labels ({})",
                        shown(),
                        labels.join(", ")
                    )
                })
            }
            Kind::Contains { .. } if text.trim().is_empty() => {
                Some("the reference is empty (every answer would contain it)".to_owned())
            }
            Kind::JsonFields { .. } if !matches!(reference, Value::Object(_) | Value::Array(_)) => {
                Some(format!("the reference {} is not a JSON object", shown()))
            }
            _ => None,
        }
    }

    /// Scores one parsed answer against its references: an object with
    /// `value` and, for some metrics, what aggregates need; or with
    /// `error` when the metric cannot score it (no usable reference).
    /// References the metric cannot use are passed over while one is left.
    pub fn score(&self, answer: &Value, references: &[Value]) -> Value {
        let references: Vec<&Value> = if self.needs_reference() {
            let mut why = None;
            let usable: Vec<&Value> = references
                .iter()
                .filter(|r| match self.unusable(r) {
                    Some(reason) => {
                        why.get_or_insert(reason);
                        false
                    }
                    None => true,
                })
                .collect();
            if usable.is_empty() {
                return json!({"error": why.unwrap_or_else(|| "the reference is an empty list".to_owned())});
            }
            usable
        } else {
            references.iter().collect()
        };
        let text = as_text(answer);
        let refs: Vec<String> = references.iter().map(|r| as_text(r)).collect();
        let best = |f: &dyn Fn(&str) -> f64| refs.iter().map(|r| f(r)).fold(0.0, f64::max);
        match &self.kind {
            Kind::ExactMatch {
                normalize,
                ignore_case,
            } => {
                let a = normalize.apply(&text, *ignore_case);
                json!({"value": best(&|r| f64::from(u8::from(normalize.apply(r, *ignore_case) == a)))})
            }
            Kind::Contains {
                normalize,
                ignore_case,
            } => {
                let a = normalize.apply(&text, *ignore_case);
                json!({"value": best(&|r| f64::from(u8::from(a.contains(&normalize.apply(r, *ignore_case)))))})
            }
            Kind::RegexMatch { pattern } => {
                json!({"value": f64::from(u8::from(pattern.is_match(&text)))})
            }
            Kind::F1 => json!({"value": best(&|r| text::token_f1(&text, r))}),
            Kind::Numeric {
                tolerance,
                relative,
            } => {
                let value = text::last_number(&text).map_or(0.0, |a| {
                    best(&|r| {
                        text::last_number(r).map_or(0.0, |b| {
                            let allowed = tolerance.max(relative * b.abs());
                            f64::from(u8::from((a - b).abs() <= allowed))
                        })
                    })
                });
                json!({"value": value})
            }
            Kind::Choice => {
                let chosen = text.trim().to_ascii_uppercase();
                json!({"value": best(&|r| f64::from(u8::from(choice_letter(r) == chosen)))})
            }
            Kind::Cer | Kind::Wer => {
                // One reference: the first.
                let reference = refs.first().map_or("", String::as_str);
                let (edits, length) = if matches!(self.kind, Kind::Cer) {
                    text::char_edits(reference, &text)
                } else {
                    text::word_edits(reference, &text)
                };
                let value = if length == 0 {
                    f64::from(u8::from(edits > 0))
                } else {
                    edits as f64 / length as f64
                };
                json!({"value": value, "edits": edits, "length": length})
            }
            Kind::Anls { threshold } => {
                let a = text::anls_normalize(&text);
                json!({"value": best(&|r| {
                    let nl = text::normalized_levenshtein(&a, &text::anls_normalize(r));
                    if nl < *threshold { 1.0 - nl } else { 0.0 }
                })})
            }
            Kind::JsonFields { fields } => {
                json_fields(answer, references.first().copied(), fields.as_deref())
            }
            Kind::LlmJudge { .. } => json!({"error": "scored by its judge endpoint"}),
            Kind::CodeAccepted => json!({"error": "scored by the code judge"}),
            Kind::Episode => json!({"error": "scored by the conversation"}),
            Kind::Backend { backend, .. } => {
                json!({"error": format!("scored by metric backend '{backend}'")})
            }
            Kind::Classification {
                labels,
                ignore_case,
            } => {
                let norm = |s: &str| label_norm(s, *ignore_case);
                let predicted = norm(&text);
                let reference = norm(refs.first().map_or("", String::as_str));
                let predicted = match labels {
                    Some(labels) if !labels.iter().any(|l| norm(l) == predicted) => {
                        "(other)".to_owned()
                    }
                    _ => predicted,
                };
                json!({"value": f64::from(u8::from(predicted == reference)), "predicted": predicted, "reference": reference})
            }
        }
    }
}

impl Metric {
    /// A judge's reply as a score: the last match of `score_regex`, scaled
    /// from `scale` to 0..1 (clamped), or why there is none.
    pub fn llm_judge_score(&self, reply: &str) -> Value {
        let Kind::LlmJudge {
            pattern, low, high, ..
        } = &self.kind
        else {
            return json!({"error": "not a judge metric"});
        };
        let raw = pattern
            .captures_iter(reply)
            .last()
            .and_then(|c| c.get(1))
            .and_then(|m| m.as_str().parse::<f64>().ok());
        match raw {
            Some(raw) => json!({"value": ((raw - low) / (high - low)).clamp(0.0, 1.0), "raw": raw}),
            None => {
                // Quoted, so that replies without a score group as one
                // reason wherever reasons are counted.
                let excerpt: String = reply.chars().take(200).collect();
                json!({"error": format!("the judge's reply has no score matching /{}/: '{excerpt}'", pattern.as_str())})
            }
        }
    }
}

/// A metric's name as written: its base name, the backend (`native` or a
/// declared one) and the version, each after an `@`. One part after the
/// base is a version when it is a number (`anls@1`), else a backend.
fn split_name(name: &str) -> Result<(&str, Option<&str>, Option<u32>), String> {
    let version = |v: &str| {
        v.parse::<u32>()
            .map_err(|_| format!("'{name}': the version after @ must be a number"))
    };
    let mut parts = name.split('@');
    let base = parts.next().unwrap_or_default();
    match (parts.next(), parts.next(), parts.next()) {
        (None, _, _) => Ok((base, None, None)),
        (Some(one), None, _) => match one.parse::<u32>() {
            Ok(v) => Ok((base, None, Some(v))),
            Err(_) if one.is_empty() => Err(format!("'{name}': nothing after @")),
            Err(_) if one.bytes().all(|b| b.is_ascii_digit()) => {
                version(one).map(|_| (base, None, None))
            }
            Err(_) => Ok((base, Some(one), None)),
        },
        (Some(backend), Some(v), None) if !backend.is_empty() => {
            Ok((base, Some(backend), Some(version(v)?)))
        }
        _ => Err(format!(
            "'{name}': a metric is NAME, NAME@VERSION, NAME@BACKEND or NAME@BACKEND@VERSION"
        )),
    }
}

/// A JSON value as text: strings as they are, anything else as JSON.
pub fn as_text(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// A class label as compared: trimmed, and lowercased with `ignore_case`.
fn label_norm(label: &str, ignore_case: bool) -> String {
    if ignore_case {
        label.trim().to_lowercase()
    } else {
        label.trim().to_owned()
    }
}

/// A reference letter: itself, or a 0-based index turned into a letter.
fn choice_letter(reference: &str) -> String {
    let r = reference.trim();
    match r.parse::<u32>() {
        Ok(i) if i < 26 => char::from(b'A' + i as u8).to_string(),
        _ => r
            .trim_matches(|c| matches!(c, '(' | ')' | '.'))
            .to_ascii_uppercase(),
    }
}

/// Leaves of a JSON value by path: `a.b`, `list[0].c`.
pub fn flatten(value: &Value, prefix: &str, out: &mut Vec<(String, Value)>) {
    match value {
        Value::Object(map) if !map.is_empty() => {
            for (k, v) in map {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(v, &path, out);
            }
        }
        Value::Array(list) if !list.is_empty() => {
            for (i, v) in list.iter().enumerate() {
                flatten(v, &format!("{prefix}[{i}]"), out);
            }
        }
        leaf => out.push((prefix.to_owned(), leaf.clone())),
    }
}

fn same_leaf(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::String(x), Value::String(y)) => x.trim() == y.trim(),
        _ => a == b,
    }
}

fn json_fields(answer: &Value, reference: Option<&Value>, fields: Option<&[String]>) -> Value {
    let mut got = Vec::new();
    flatten(answer, "", &mut got);
    let mut want = Vec::new();
    if let Some(reference) = reference {
        flatten(reference, "", &mut want);
    }
    let keep = |path: &str| {
        fields.is_none_or(|f| {
            f.iter().any(|p| {
                path == p
                    || path.starts_with(&format!("{p}."))
                    || path.starts_with(&format!("{p}["))
            })
        })
    };
    got.retain(|(p, _)| keep(p));
    want.retain(|(p, _)| keep(p));
    let lookup = |list: &[(String, Value)], path: &str| {
        list.iter().find(|(p, _)| p == path).map(|(_, v)| v.clone())
    };
    let tp = want
        .iter()
        .filter(|(p, v)| lookup(&got, p).is_some_and(|g| same_leaf(&g, v)))
        .count();
    let fp = got.len() - tp;
    let fn_ = want.len() - tp;
    let value = if want.is_empty() {
        f64::from(u8::from(got.is_empty()))
    } else {
        tp as f64 / want.len() as f64
    };
    json!({"value": value, "tp": tp, "fp": fp, "fn": fn_})
}

#[cfg(test)]
mod tests;
