//! What happens to a model's text after the call: the answer is parsed,
//! checked against a JSON Schema, and scored by the task's metrics.
//! Nothing here calls a model, so `evalfleet score` can run it again on
//! stored outputs.

pub mod backend;
pub mod balance;
pub mod metric_backend;
pub mod metrics;
pub mod parse;
pub mod text;

use evalfleet_types::{Assessment, Score, Scores, Verdict};
use minijinja::Environment;
use serde_json::Value;

/// An item's fields (a dataset row).
type Row = serde_json::Map<String, Value>;

pub use metrics::Metric;
pub use parse::Parser;

/// One metric of `task.metrics`, with the template of its reference.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricSpec {
    pub metric: Metric,
    /// A template over the item's fields (`{{ answer }}`); when it renders
    /// a JSON list, each element is a reference.
    pub reference: Option<String>,
}

/// The checking and scoring part of a task (`task.parse`, `task.schema`,
/// `task.max_reasks`, `task.structured_output`, `task.metrics`).
/// Compared by their definitions (a regex by its pattern).
#[derive(Debug, Clone, PartialEq)]
pub struct EvalSpec {
    pub parser: Parser,
    pub schema: Option<Value>,
    pub max_reasks: u32,
    pub structured_output: bool,
    pub metrics: Vec<MetricSpec>,
    /// `task.metric_backends`: the programs that score the metrics named
    /// `name@backend`.
    pub backends: Vec<backend::BackendSpec>,
}

impl Default for EvalSpec {
    fn default() -> Self {
        Self {
            parser: Parser::Whole,
            schema: None,
            max_reasks: 0,
            structured_output: false,
            metrics: Vec::new(),
            backends: Vec::new(),
        }
    }
}

impl EvalSpec {
    /// Whether an answer can be found wanting (and then re-asked).
    pub fn checks(&self) -> bool {
        !matches!(self.parser, Parser::Whole) || self.schema.is_some()
    }
}

/// The outcome of checking one answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Checked {
    /// The extracted answer; `None` when it could not be parsed.
    pub parsed: Option<Value>,
    /// Parsed and, with a schema, valid.
    pub valid: bool,
    /// Why not, when not.
    pub error: Option<String>,
}

impl Checked {
    /// The error of an attempt whose answer was re-asked.
    pub fn reask_note(&self) -> String {
        format!("re-asked: {}", self.error.as_deref().unwrap_or_default())
    }

    pub fn verdict(&self) -> Verdict {
        match (&self.parsed, self.valid) {
            (_, true) => Verdict::Ok,
            (None, false) => Verdict::Unparsed,
            (Some(_), false) => Verdict::Invalid,
        }
    }

    /// The assessment of an answer so checked, with its scores.
    pub fn assessment(&self, scores: Scores, reasks: u32) -> Assessment {
        Assessment {
            parsed: self.parsed.clone(),
            verdict: Some(self.verdict()),
            check_error: self.error.clone(),
            scores,
            reasks,
            code: None,
        }
    }
}

/// One call a judge metric needs.
#[derive(Debug)]
pub struct LlmJudgeCall {
    /// The metric's key.
    pub key: String,
    /// The judge endpoint's name.
    pub endpoint: String,
    /// The messages, or why the rubric could not be rendered.
    pub messages: Result<Box<serde_json::value::RawValue>, String>,
}

/// One answer an outside backend's metric needs scored.
#[derive(Debug, Clone)]
pub struct BackendRequest {
    /// The metric's key.
    pub key: String,
    pub backend: String,
    /// The metric's name (without backend or version).
    pub metric: String,
    pub answer: Value,
    /// The references, or why the item has none.
    pub references: Result<Vec<Value>, String>,
    pub params: Row,
}

/// A compiled [`EvalSpec`].
pub struct Assessor {
    spec: EvalSpec,
    schema: Option<jsonschema::Validator>,
    env: Environment<'static>,
    /// Per metric: how its reference template gives references, when it
    /// has one.
    references: Vec<Option<ReferenceForm>>,
}

/// How a reference template gives references.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReferenceForm {
    /// One expression (`{{ answers }}`): its value, a list being a list of
    /// references.
    Value,
    /// Text: the rendered text, a JSON list in it being a list of
    /// references.
    Text,
}

impl Assessor {
    /// Compiles the schema and the reference templates.
    pub fn new(spec: &EvalSpec) -> Result<Self, String> {
        let schema = spec
            .schema
            .as_ref()
            .map(|s| {
                jsonschema::validator_for(s)
                    .map_err(|e| format!("task.schema is not a valid JSON Schema: {e}"))
            })
            .transpose()?;
        let mut env = evalfleet_jinja::environment();
        let mut references = Vec::with_capacity(spec.metrics.len());
        for (i, m) in spec.metrics.iter().enumerate() {
            references.push(m.reference.as_ref().map(|reference| {
                match evalfleet_jinja::as_value_template(reference) {
                    Some(value) => (ReferenceForm::Value, value),
                    None => (ReferenceForm::Text, reference.clone()),
                }
            }));
            if let Some((_, source)) = references[i].clone() {
                env.add_template_owned(format!("task.metrics[{i}].reference"), source)
                    .map_err(|e| {
                        format!(
                            "task.metrics[{i}].reference: {}",
                            evalfleet_jinja::describe(&e)
                        )
                    })?;
            }
            if let metrics::Kind::LlmJudge { rubric, .. } = &m.metric.kind {
                env.add_template_owned(format!("task.metrics[{i}].rubric"), rubric.clone())
                    .map_err(|e| format!("task.metrics[{i}].rubric: {e}"))?;
            }
        }
        Ok(Self {
            spec: spec.clone(),
            schema,
            env,
            references: references
                .into_iter()
                .map(|r| r.map(|(form, _)| form))
                .collect(),
        })
    }

    pub fn spec(&self) -> &EvalSpec {
        &self.spec
    }

    pub fn metrics(&self) -> impl Iterator<Item = &Metric> {
        self.spec.metrics.iter().map(|m| &m.metric)
    }

    /// Parses `text` and checks it against the schema.
    pub fn check(&self, text: &str) -> Checked {
        let parsed = match self.spec.parser.parse(text) {
            Ok(parsed) => parsed,
            Err(error) => {
                return Checked {
                    parsed: None,
                    valid: false,
                    error: Some(error),
                };
            }
        };
        if let Some(schema) = &self.schema {
            let errors: Vec<String> = schema
                .iter_errors(&parsed)
                .take(5)
                .map(|e| {
                    let at = e.instance_path().to_string();
                    if at.is_empty() {
                        e.to_string()
                    } else {
                        format!("at {at}: {e}")
                    }
                })
                .collect();
            if !errors.is_empty() {
                return Checked {
                    parsed: Some(parsed),
                    valid: false,
                    error: Some(format!("does not match the schema: {}", errors.join("; "))),
                };
            }
        }
        Checked {
            parsed: Some(parsed),
            valid: true,
            error: None,
        }
    }

    /// Scores a valid answer against the item (`item_json`: the input row):
    /// metric key → its item score. A metric whose reference cannot be
    /// rendered for this item scores `{"error": ...}`.
    pub fn score(&self, checked: &Checked, item: &Row) -> Scores {
        let mut out = Scores::new();
        let Some(answer) = checked.parsed.as_ref().filter(|_| checked.valid) else {
            return out;
        };
        // The item as templates see it, made once for all its metrics.
        let context = minijinja::Value::from(minijinja::value::Serde(item));
        for (i, m) in self.spec.metrics.iter().enumerate() {
            if !m.metric.scored_here() {
                continue;
            }
            let score = match self.references_in(i, &context, item) {
                Ok(references) => Score::from_json(m.metric.score(answer, &references)),
                Err(error) => Score::error(error),
            };
            out.insert(m.metric.key.clone(), score);
        }
        out
    }

    /// The item fields the metrics' reference templates read: an item's
    /// answer key, which a program under evaluation is not given.
    pub fn reference_fields(&self) -> std::collections::BTreeSet<String> {
        let mut fields = std::collections::BTreeSet::new();
        for (i, form) in self.references.iter().enumerate() {
            if form.is_none() {
                continue;
            }
            if let Ok(template) = self
                .env
                .get_template(&format!("task.metrics[{i}].reference"))
            {
                fields.extend(template.undeclared_variables(false));
            }
        }
        fields
    }

    /// The references of metric `i` for `item`: what its template gives,
    /// or why it gives none.
    pub fn references(&self, i: usize, item: &Row) -> Result<Vec<Value>, String> {
        self.references_in(
            i,
            &minijinja::Value::from(minijinja::value::Serde(item)),
            item,
        )
    }

    /// [`Self::references`] with the item made a template context already.
    fn references_in(
        &self,
        i: usize,
        context: &minijinja::Value,
        item: &Row,
    ) -> Result<Vec<Value>, String> {
        let (Some(m), Some(Some(form))) = (self.spec.metrics.get(i), self.references.get(i)) else {
            return Ok(Vec::new());
        };
        let name = format!("task.metrics[{i}].reference");
        let template = self
            .env
            .get_template(&name)
            .map_err(|e| format!("{name}: {}", evalfleet_jinja::describe(&e)))?;
        let rendered = evalfleet_jinja::render(&template, context)
            .map_err(|e| format!("{name}: {}", evalfleet_jinja::explain(&e, &template, item)))?;
        let json = m.metric.wants_json_reference();
        let references = match form {
            ReferenceForm::Text => from_text(rendered, json),
            ReferenceForm::Value => match serde_json::from_str::<Value>(&rendered) {
                Ok(Value::String(text)) => from_text(text, json),
                Ok(Value::Null) => Err("the reference is null (none)".to_owned()),
                Ok(Value::Array(list)) if !json => Ok(list),
                Ok(other) => Ok(vec![other]),
                Err(err) => Err(format!("the reference's value cannot be read: {err}")),
            },
        }
        .map_err(|e| format!("{name}: {e}"))?;
        // An empty list is an item with no reference (SQuAD 2.0's questions
        // with no answer): the metric does not score it, and says so.
        Ok(references)
    }

    /// Checks and scores a stored output again (`evalfleet score`). Judge
    /// metrics take their judge's reply from `lookup` (the cache); without
    /// one, a stored score is kept. With `only`, the other metrics keep their
    /// stored scores (`keep`).
    pub fn rescore(
        &self,
        output: &str,
        item: &Row,
        reasks: u32,
        only: Option<&[String]>,
        keep: &Scores,
        lookup: &mut dyn FnMut(&LlmJudgeCall) -> Option<String>,
    ) -> Assessment {
        let checked = self.check(output);
        let mut scores = self.score(&checked, item);
        for request in self.llm_judge_calls(&checked, item) {
            let score = match lookup(&request) {
                Some(reply) => self.llm_judge_score(&request.key, &reply),
                None => match keep.get(&request.key) {
                    Some(stored) => stored.clone(),
                    None => Score::error(
                        "not judged: no cached reply of its judge (judge metrics are scored during a run)",
                    ),
                },
            };
            scores.insert(request.key, score);
        }
        // The code judge's score stays as it was stored (it is judged
        // again only on request: that runs every program again), and so do
        // a conversation's (its episode was scored as it was played).
        for m in self.metrics() {
            if matches!(m.kind, metrics::Kind::CodeAccepted | metrics::Kind::Episode)
                && let Some(stored) = keep.get(&m.key)
            {
                scores.insert(m.key.clone(), stored.clone());
            }
        }
        if let Some(only) = only {
            scores.retain(|k, _| only.contains(k));
            for (k, v) in keep {
                if !only.contains(k) {
                    scores.entry(k.clone()).or_insert_with(|| v.clone());
                }
            }
        }
        checked.assessment(scores, reasks)
    }

    /// The calls the judge metrics need for a valid answer: the rubric
    /// rendered over the item's fields, `answer` and `reference`, as one
    /// user message.
    pub fn llm_judge_calls(&self, checked: &Checked, item: &Row) -> Vec<LlmJudgeCall> {
        let Some(answer) = checked.parsed.as_ref().filter(|_| checked.valid) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (i, m) in self.spec.metrics.iter().enumerate() {
            let metrics::Kind::LlmJudge { endpoint, .. } = &m.metric.kind else {
                continue;
            };
            let mut context = item.clone();
            context.insert("answer".to_owned(), Value::String(metrics::as_text(answer)));
            let reference = self
                .references(i, item)
                .ok()
                .and_then(|r| r.first().map(metrics::as_text));
            if let Some(reference) = reference {
                context.insert("reference".to_owned(), Value::String(reference));
            }
            let name = format!("task.metrics[{i}].rubric");
            let request = self
                .env
                .get_template(&name)
                .and_then(|t| {
                    let context = minijinja::Value::from(minijinja::value::Serde(&context));
                    evalfleet_jinja::render(&t, &context)
                })
                .map_err(|e| format!("{name}: {}", evalfleet_jinja::describe(&e)))
                .and_then(|text| {
                    serde_json::value::to_raw_value(
                        &serde_json::json!([{"role": "user", "content": text}]),
                    )
                    .map_err(|e| e.to_string())
                });
            out.push(LlmJudgeCall {
                key: m.metric.key.clone(),
                endpoint: endpoint.clone(),
                messages: request,
            });
        }
        out
    }

    /// What the outside backends' metrics need of a valid answer (none for
    /// one that is not): the answer and its references, one request per
    /// metric. With `only`, just those metric keys.
    pub fn backend_requests(
        &self,
        checked: &Checked,
        item: &Row,
        only: Option<&[String]>,
    ) -> Vec<BackendRequest> {
        let Some(answer) = checked.parsed.as_ref().filter(|_| checked.valid) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (i, m) in self.spec.metrics.iter().enumerate() {
            let metrics::Kind::Backend { backend, params } = &m.metric.kind else {
                continue;
            };
            if only.is_some_and(|only| !only.contains(&m.metric.key)) {
                continue;
            }
            out.push(BackendRequest {
                key: m.metric.key.clone(),
                backend: backend.clone(),
                metric: m.metric.name.clone(),
                answer: answer.clone(),
                references: self.references(i, item),
                params: params.clone(),
            });
        }
        out
    }

    /// The score of judge metric `key` from its judge's reply.
    pub fn llm_judge_score(&self, key: &str, reply: &str) -> Score {
        self.metrics().find(|m| m.key == key).map_or_else(
            || Score::error("no such metric"),
            |m| Score::from_json(m.llm_judge_score(reply)),
        )
    }

    /// The conversation of a re-ask: `messages`, the answer, and what was
    /// wrong with it.
    pub fn reask_messages(
        &self,
        messages: &serde_json::value::RawValue,
        answer: &str,
        checked: &Checked,
    ) -> Option<Box<serde_json::value::RawValue>> {
        continue_conversation(messages, answer, &self.reask_message(checked)).ok()
    }

    /// The user message of a re-ask: what was wrong with the answer.
    pub fn reask_message(&self, checked: &Checked) -> String {
        let why = checked.error.as_deref().unwrap_or("it is not valid");
        let mut message = format!("Your answer could not be used: {why}.");
        if self.spec.parser.is_json() {
            message.push_str(" Reply again with only the corrected JSON.");
            if let Some(schema) = &self.spec.schema {
                message.push_str(" It must match this JSON Schema: ");
                message.push_str(&schema.to_string());
            }
        } else {
            message.push_str(" Reply again in the required format.");
        }
        message
    }
}

/// References from text: a JSON value when the metric compares JSON, a
/// JSON list as its elements, anything else as one reference.
/// `messages` with the model's `answer` and then the user's next message
/// (`user`) added: a re-ask, a request to improve the answer.
pub fn continue_conversation(
    messages: &serde_json::value::RawValue,
    answer: &str,
    user: &str,
) -> Result<Box<serde_json::value::RawValue>, String> {
    let mut list: Vec<Value> = serde_json::from_str(messages.get())
        .map_err(|err| format!("the conversation is not a list of messages: {err}"))?;
    list.push(serde_json::json!({"role": "assistant", "content": answer}));
    list.push(serde_json::json!({"role": "user", "content": user}));
    serde_json::value::to_raw_value(&list).map_err(|err| err.to_string())
}

fn from_text(text: String, json: bool) -> Result<Vec<Value>, String> {
    let trimmed = text.trim();
    if json {
        return serde_json::from_str::<Value>(trimmed)
            .map(|v| vec![v])
            .map_err(|e| format!("the reference is not JSON: {e}"));
    }
    if trimmed.starts_with('[')
        && let Ok(Value::Array(list)) = serde_json::from_str::<Value>(trimmed)
    {
        return Ok(list);
    }
    Ok(vec![Value::String(text)])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The references `template` gives for `row` under metric `name`.
    fn references(name: &str, template: &str, row: Value) -> Result<Vec<Value>, String> {
        let metric = Metric::build(name, &serde_json::Map::new(), None).unwrap();
        let spec = EvalSpec {
            metrics: vec![MetricSpec {
                metric,
                reference: Some(template.to_owned()),
            }],
            ..EvalSpec::default()
        };
        let Value::Object(row) = row else { panic!() };
        Assessor::new(&spec).unwrap().references(0, &row)
    }

    #[test]
    fn a_reference_is_a_value_a_rendered_json_list_or_text() {
        let row = json!({"answers": ["it's", "Denver \"Broncos\""], "a": "x", "b": "y",
                         "listed": "[\"p\", \"q\"]", "empty": [], "obj": {"k": 1}});
        // One expression: its value, the list itself (quotes kept).
        assert_eq!(
            references("exact_match", "{{ answers }}", row.clone()),
            Ok(vec![json!("it's"), json!("Denver \"Broncos\"")])
        );
        assert_eq!(
            references("exact_match", "{{ answers | tojson }}", row.clone()),
            Ok(vec![json!("it's"), json!("Denver \"Broncos\"")])
        );
        // Text around expressions: a rendered JSON list is a list.
        assert_eq!(
            references("exact_match", r#"["{{ a }}", "{{ b }}"]"#, row.clone()),
            Ok(vec![json!("x"), json!("y")])
        );
        // A string field whose text is a JSON list is read as the list.
        assert_eq!(
            references("exact_match", "{{ listed }}", row.clone()),
            Ok(vec![json!("p"), json!("q")])
        );
        // Other text is one reference.
        assert_eq!(
            references("exact_match", "answer: {{ a }}", row.clone()),
            Ok(vec![json!("answer: x")])
        );
        // An empty list gives no reference; `or` gives it one.
        assert_eq!(
            references("exact_match", "{{ empty }}", row.clone()),
            Ok(vec![])
        );
        assert_eq!(
            references("exact_match", "{{ empty or [''] }}", row.clone()),
            Ok(vec![json!("")])
        );
        // An object is one reference; for json_field_match a list is too.
        assert_eq!(
            references("json_field_match", "{{ obj }}", row.clone()),
            Ok(vec![json!({"k": 1})])
        );
        assert_eq!(
            references("json_field_match", "{{ answers }}", row.clone()),
            Ok(vec![json!(["it's", "Denver \"Broncos\""])])
        );
        // A value that is none says so.
        let err = references("exact_match", "{{ missing | default(none) }}", row).unwrap_err();
        assert!(err.contains("null"), "{err}");
    }

    #[test]
    fn a_metric_never_scores_a_reference_it_cannot_use_as_zero() {
        let m = Metric::build("exact_match", &serde_json::Map::new(), None).unwrap();
        let answer = json!("Denver");
        // No reference at all: not scored, and why.
        let none = m.score(&answer, &[]);
        assert_eq!(none["error"], "the reference is an empty list");
        // A null among references is passed over while another is usable.
        assert_eq!(
            m.score(&answer, &[Value::Null, json!("Denver")])["value"],
            1.0
        );
        let null = m.score(&answer, &[Value::Null]);
        assert!(null["error"].as_str().unwrap().contains("null"), "{null}");
        let contains = Metric::build("contains", &serde_json::Map::new(), None).unwrap();
        let empty = contains.score(&answer, &[json!("  ")]);
        assert!(
            empty["error"].as_str().unwrap().contains("empty"),
            "{empty}"
        );
    }
}
