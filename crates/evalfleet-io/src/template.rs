//! `task.messages` templates (and those of `task.prompts`), compiled once
//! per run and rendered per item.

use std::collections::BTreeSet;
use std::sync::Arc;

use minijinja::Environment;
use serde::Serialize;
use serde_json::value::RawValue;

use crate::dataset::Row;
use evalfleet_config::{DEFAULT_PROMPT, MessageTemplate, Part, PromptRule, TaskConfig, path};

/// One rendered chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// The task's message templates, compiled: `task.messages` and the
/// message lists of `task.prompts`, one of which is chosen per item.
pub struct Templates {
    env: Environment<'static>,
    /// The message lists in the order they are tried: the rules of
    /// `task.prompts` whose model condition holds, then `task.messages`.
    prompts: Vec<Prompt>,
    /// Whether the task has rules (results then record the one chosen).
    has_rules: bool,
    variables: BTreeSet<String>,
    /// The item fields the rules' conditions name, each with where.
    conditions: Vec<(String, String)>,
}

/// One message list and what makes it chosen.
struct Prompt {
    name: Arc<str>,
    /// Its rule; `None` for `task.messages`, which takes every item.
    rule: Option<PromptRule>,
    /// Each message's role and compiled parts.
    messages: Vec<Compiled>,
}

/// An item's messages, and the prompt they came from.
pub struct Rendered {
    /// The rule of `task.prompts` chosen (`default`: `task.messages`);
    /// `None` when the task has no rules.
    pub prompt: Option<Arc<str>>,
    /// The messages, as a JSON array.
    pub messages: Box<RawValue>,
}

/// One message's templates: its role, and its content's parts (a text
/// content is one text part, sent as a string).
struct Compiled {
    role: String,
    parts: Vec<CompiledPart>,
    as_parts: bool,
}

/// A part's template, by the name it was added to the environment under.
enum CompiledPart {
    Text(String),
    /// With the expression of a template that is one (`{{ pages }}`), whose
    /// value may be a list of images.
    Image(String, Option<String>),
}

/// One message of an item, its images not yet read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedMessage {
    pub role: String,
    pub parts: Vec<RenderedPart>,
    /// `false`: the content is its one text part, sent as a string.
    pub as_parts: bool,
}

/// A rendered part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RenderedPart {
    Text(String),
    /// The image values a part gave (`at`: its place in the config).
    Images {
        at: String,
        values: Vec<String>,
    },
}

/// One message as it is sent with images: content parts in OpenAI's form.
#[derive(Serialize)]
struct PartsMessage<'a> {
    role: &'a str,
    content: PartsContent<'a>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum PartsContent<'a> {
    Text(&'a str),
    Parts(Vec<OutPart<'a>>),
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum OutPart<'a> {
    Text { text: &'a str },
    ImageUrl { image_url: ImageUrl },
}

#[derive(Serialize)]
struct ImageUrl {
    url: String,
}

/// The expression of a template that is one lone `{{ expression }}`.
fn lone_expression(source: &str) -> Option<String> {
    let inner = source.trim().strip_prefix("{{")?.strip_suffix("}}")?;
    let inner = inner.trim_start_matches('-').trim_end_matches('-').trim();
    (!inner.contains("{{") && !inner.contains("}}") && !inner.contains("{%"))
        .then(|| inner.to_owned())
}

/// A template that cannot be used with this dataset.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{path}: {message}")]
pub struct TemplateError {
    pub path: String,
    pub message: String,
}

impl TemplateError {
    pub fn fault(&self) -> evalfleet_types::Fault {
        evalfleet_types::Fault::BadInput
    }
}

impl Templates {
    /// Compiles every message template of `task`: `task.messages` and
    /// each rule's.
    pub fn compile(task: &TaskConfig) -> Result<Self, TemplateError> {
        let mut env = evalfleet_jinja::environment();
        let mut variables = BTreeSet::new();
        let mut prompts = Vec::with_capacity(task.prompts.len() + 1);
        let mut conditions = Vec::new();
        for (i, rule) in task.prompts.iter().enumerate() {
            let at = path::index("task.prompts", i);
            for (field, _) in &rule.when {
                conditions.push((field.clone(), path::key(&path::key(&at, "when"), field)));
            }
            // A rule whose model condition fails is never chosen in this
            // run; its templates are still checked.
            let messages = compile_list(
                &mut env,
                &mut variables,
                &rule.messages,
                &path::key(&at, "messages"),
            )?;
            if rule.model_matches {
                prompts.push(Prompt {
                    name: Arc::from(rule.name.as_str()),
                    rule: Some(rule.clone()),
                    messages,
                });
            }
        }
        // Without rules, `task.messages` is the prompt even when empty (a
        // conversation's: its calls have messages of their own).
        if !task.messages.is_empty() || task.prompts.is_empty() {
            let messages = compile_list(&mut env, &mut variables, &task.messages, "task.messages")?;
            prompts.push(Prompt {
                name: Arc::from(DEFAULT_PROMPT),
                rule: None,
                messages,
            });
        }
        Ok(Self {
            env,
            prompts,
            has_rules: !task.prompts.is_empty(),
            variables,
            conditions,
        })
    }

    /// Compiles `messages`, the list at `at` in the config.
    pub fn from_messages(messages: &[MessageTemplate], at: &str) -> Result<Self, TemplateError> {
        let mut env = evalfleet_jinja::environment();
        let mut variables = BTreeSet::new();
        let messages = compile_list(&mut env, &mut variables, messages, at)?;
        Ok(Self {
            env,
            prompts: vec![Prompt {
                name: Arc::from(DEFAULT_PROMPT),
                rule: None,
                messages,
            }],
            has_rules: false,
            variables,
            conditions: Vec::new(),
        })
    }

    /// The item fields the templates refer to.
    pub fn variables(&self) -> &BTreeSet<String> {
        &self.variables
    }

    /// Checks the templates, and the fields the rules of `task.prompts`
    /// name, against the fields a dataset has, so that a typo is found
    /// before the first call rather than once per item. `source` completes
    /// "which ..." in the message (`no row of the dataset has`).
    pub fn check_fields(
        &self,
        fields: &BTreeSet<String>,
        source: &str,
    ) -> Result<(), TemplateError> {
        let known = || {
            fields
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let missing: Vec<&str> = self
            .variables
            .iter()
            .filter(|v| !fields.contains(*v))
            .map(String::as_str)
            .collect();
        if !missing.is_empty() {
            return Err(TemplateError {
                path: "task.messages".to_owned(),
                message: format!(
                    "the templates refer to {}, which {source} (fields: {})",
                    quoted(&missing),
                    known()
                ),
            });
        }
        match self.conditions.iter().find(|(f, _)| !fields.contains(f)) {
            Some((field, at)) => Err(TemplateError {
                path: at.clone(),
                message: format!(
                    "the rule's condition names '{field}', which {source} (fields: {})",
                    known()
                ),
            }),
            None => Ok(()),
        }
    }

    /// Whether the task has rules (`task.prompts`).
    pub fn has_rules(&self) -> bool {
        self.has_rules
    }

    /// The prompt for `row`: the first rule that takes it, else
    /// `task.messages`.
    fn choose(&self, row: &Row) -> Result<&Prompt, String> {
        self.prompts
            .iter()
            .find(|p| p.rule.as_ref().is_none_or(|rule| rule.accepts(row)))
            .ok_or_else(|| {
                "task.prompts: no rule takes this item, and task.messages is not given".to_owned()
            })
    }

    /// Whether any message has image parts.
    pub fn has_images(&self) -> bool {
        self.prompts
            .iter()
            .flat_map(|p| &p.messages)
            .any(|m| m.parts.iter().any(|p| matches!(p, CompiledPart::Image(..))))
    }

    /// The messages for one item, as text: an image part is shown as
    /// `[image: SOURCE]` (see [`Self::render_parts`] for what is sent).
    pub fn render(&self, row: &Row) -> Result<Vec<Message>, String> {
        Ok(as_text(self.render_parts(row)?))
    }

    /// The messages for one item, each image part with the values it gives
    /// (paths, URLs, ...), not yet read.
    pub fn render_parts(&self, row: &Row) -> Result<Vec<RenderedMessage>, String> {
        self.render_list(self.choose(row)?, row)
    }

    /// The messages for one item as [`Self::render_parts`] gives them, with
    /// the rule of `task.prompts` chosen (`None` when the task has none).
    pub fn render_parts_prompt(
        &self,
        row: &Row,
    ) -> Result<(Option<Arc<str>>, Vec<RenderedMessage>), String> {
        let prompt = self.choose(row)?;
        let messages = self.render_list(prompt, row)?;
        Ok((self.has_rules.then(|| prompt.name.clone()), messages))
    }

    fn render_list(&self, prompt: &Prompt, row: &Row) -> Result<Vec<RenderedMessage>, String> {
        let context = minijinja::Value::from(minijinja::value::Serde(row));
        let mut out = Vec::with_capacity(prompt.messages.len());
        for message in &prompt.messages {
            let mut parts = Vec::with_capacity(message.parts.len());
            for part in &message.parts {
                let (CompiledPart::Text(name) | CompiledPart::Image(name, _)) = part;
                let template = self.env.get_template(name).map_err(|err| err.to_string())?;
                let explain = |err: minijinja::Error| {
                    format!("{name}: {}", evalfleet_jinja::explain(&err, &template, row))
                };
                parts.push(match part {
                    CompiledPart::Text(_) => RenderedPart::Text(
                        evalfleet_jinja::render(&template, &context).map_err(explain)?,
                    ),
                    CompiledPart::Image(_, Some(expression)) => {
                        let value = self
                            .env
                            .compile_expression(expression)
                            .and_then(|e| e.eval(&context))
                            .map_err(explain)?;
                        RenderedPart::Images {
                            at: name.clone(),
                            values: image_values(&value, name)?,
                        }
                    }
                    CompiledPart::Image(_, None) => RenderedPart::Images {
                        at: name.clone(),
                        values: vec![
                            evalfleet_jinja::render(&template, &context).map_err(explain)?,
                        ],
                    },
                });
            }
            out.push(RenderedMessage {
                role: message.role.clone(),
                parts,
                as_parts: message.as_parts,
            });
        }
        Ok(out)
    }

    /// The messages for one item as a JSON array of text messages (a task
    /// without images), with the prompt chosen.
    pub fn render_prompt(&self, row: &Row) -> Result<Rendered, String> {
        let (prompt, messages) = self.render_parts_prompt(row)?;
        Ok(Rendered {
            prompt,
            messages: serde_json::value::to_raw_value(&as_text(messages))
                .map_err(|err| err.to_string())?,
        })
    }
}

/// Rendered messages as text, an image part shown as `[image: SOURCE]`.
fn as_text(rendered: Vec<RenderedMessage>) -> Vec<Message> {
    rendered
        .into_iter()
        .map(|message| {
            let mut content = String::new();
            for part in message.parts {
                match part {
                    RenderedPart::Text(text) => content.push_str(&text),
                    RenderedPart::Images { values, .. } => {
                        for value in values {
                            let shown =
                                crate::images::Source::of(&value, std::path::Path::new("")).shown();
                            content.push_str(&format!("[image: {shown}]"));
                        }
                    }
                }
            }
            Message {
                role: message.role,
                content,
            }
        })
        .collect()
}

/// Compiles the message list at `at` into `env`, adding the fields its
/// templates read to `variables`.
fn compile_list(
    env: &mut Environment<'static>,
    variables: &mut BTreeSet<String>,
    messages: &[MessageTemplate],
    at: &str,
) -> Result<Vec<Compiled>, TemplateError> {
    let mut compiled = Vec::with_capacity(messages.len());
    for (i, message) in messages.iter().enumerate() {
        let content_at = path::key(&path::index(at, i), "content");
        let text = Part::Text(message.content.clone());
        // A text content is one text part, named as the content itself.
        let sources: Vec<(String, &Part)> = if message.parts.is_empty() {
            vec![(content_at, &text)]
        } else {
            message
                .parts
                .iter()
                .enumerate()
                .map(|(j, part)| (path::index(&content_at, j), part))
                .collect()
        };
        let mut parts = Vec::with_capacity(sources.len());
        for (name, part) in sources {
            let (Part::Text(source) | Part::Image(source)) = part;
            env.add_template_owned(name.clone(), source.clone())
                .map_err(|err| TemplateError {
                    path: name.clone(),
                    message: err.to_string(),
                })?;
            let template = env.get_template(&name).map_err(|err| TemplateError {
                path: name.clone(),
                message: err.to_string(),
            })?;
            variables.extend(template.undeclared_variables(false));
            parts.push(match part {
                Part::Text(_) => CompiledPart::Text(name),
                Part::Image(source) => CompiledPart::Image(name, lone_expression(source)),
            });
        }
        compiled.push(Compiled {
            role: message.role.clone(),
            parts,
            as_parts: !message.parts.is_empty(),
        });
    }
    Ok(compiled)
}

/// The image values of an image part's expression: a list gives one each.
fn image_values(value: &minijinja::Value, at: &str) -> Result<Vec<String>, String> {
    use minijinja::value::ValueKind;
    let one = |v: &minijinja::Value| match v.kind() {
        ValueKind::String => Ok(v.to_string()),
        ValueKind::Undefined | ValueKind::None => Err(format!(
            "{at}: the item has no image here (the value is empty)"
        )),
        kind => Err(format!("{at}: an image value must be a text, got {kind}")),
    };
    match value.kind() {
        ValueKind::Seq => {
            let values = value
                .try_iter()
                .map_err(|err| format!("{at}: {err}"))?
                .map(|v| one(&v))
                .collect::<Result<Vec<_>, _>>()?;
            if values.is_empty() {
                return Err(format!("{at}: the list of images is empty"));
            }
            Ok(values)
        }
        _ => Ok(vec![one(value)?]),
    }
}

/// `messages` as sent, each image part's values replaced by `images` (one
/// list per image part, in order: what each part's values gave), as a JSON
/// array whose image URLs hold the images' hashes (see
/// [`crate::images::write_body`]).
pub fn messages_with_images(
    messages: &[RenderedMessage],
    images: &[Vec<crate::images::Image>],
) -> Result<Box<RawValue>, String> {
    let mut images = images.iter();
    let mut out = Vec::with_capacity(messages.len());
    for message in messages {
        if !message.as_parts {
            let text = match message.parts.first() {
                Some(RenderedPart::Text(text)) => text.as_str(),
                _ => "",
            };
            out.push(PartsMessage {
                role: &message.role,
                content: PartsContent::Text(text),
            });
            continue;
        }
        let mut parts = Vec::with_capacity(message.parts.len());
        for part in &message.parts {
            match part {
                RenderedPart::Text(text) => parts.push(OutPart::Text { text }),
                RenderedPart::Images { at, .. } => {
                    let loaded = images
                        .next()
                        .ok_or_else(|| format!("{at}: its images were not read"))?;
                    parts.extend(loaded.iter().map(|image| OutPart::ImageUrl {
                        image_url: ImageUrl {
                            url: image.url_in_messages(),
                        },
                    }));
                }
            }
        }
        out.push(PartsMessage {
            role: &message.role,
            content: PartsContent::Parts(parts),
        });
    }
    serde_json::value::to_raw_value(&out).map_err(|err| err.to_string())
}

fn quoted(names: &[&str]) -> String {
    names
        .iter()
        .map(|n| format!("'{n}'"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use evalfleet_config::MessageTemplate;

    pub(super) fn task(contents: &[&str]) -> TaskConfig {
        TaskConfig {
            prompts: Vec::new(),
            messages: contents
                .iter()
                .map(|c| MessageTemplate::text("user", c))
                .collect(),
            images: Default::default(),
            params: Default::default(),
            stream: false,
            samples: 1,
            kind: evalfleet_config::TaskKind::Chat,
            eval: Default::default(),
        }
    }

    fn row(json: &str) -> Row {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn renders_fields_and_reports_a_missing_one() {
        let t = Templates::compile(&task(&[
            "Q: {{ question }}{% if hint %} ({{ hint }}){% endif %}",
        ]))
        .unwrap();
        assert_eq!(
            t.render(&row(r#"{"question": "2+2?"}"#)).unwrap()[0].content,
            "Q: 2+2?"
        );
        assert_eq!(
            t.render(&row(r#"{"question": "x", "hint": "y"}"#)).unwrap()[0].content,
            "Q: x (y)"
        );
        let err = t.render(&row(r#"{"answer": 4}"#)).unwrap_err();
        assert!(
            err.contains("task.messages[0].content: this item has no field 'question'"),
            "{err}"
        );
    }

    #[test]
    fn fields_are_checked_up_front() {
        let t = Templates::compile(&task(&["{{ questoin }}"])).unwrap();
        let fields = BTreeSet::from(["question".to_owned()]);
        let err = t
            .check_fields(&fields, "no row of the dataset has")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "task.messages: the templates refer to 'questoin', which no row of the dataset has \
             (fields: question)"
        );
    }

    #[test]
    fn image_parts_give_their_values_and_a_list_gives_one_each() {
        let mut t = task(&["unused"]);
        t.messages[0].parts = vec![
            Part::Text("Read {{ title }}".into()),
            Part::Image("{{ pages }}".into()),
            Part::Image("scans/{{ title }}.png".into()),
        ];
        let t = Templates::compile(&t).unwrap();
        assert!(t.has_images());
        let item = row(r#"{"title": "a", "pages": ["p1.png", "p2.pdf"]}"#);
        let parts = &t.render_parts(&item).unwrap()[0].parts;
        assert_eq!(
            parts[1],
            RenderedPart::Images {
                at: "task.messages[0].content[1]".into(),
                values: vec!["p1.png".into(), "p2.pdf".into()]
            }
        );
        assert_eq!(
            parts[2],
            RenderedPart::Images {
                at: "task.messages[0].content[2]".into(),
                values: vec!["scans/a.png".into()]
            }
        );
        assert_eq!(
            t.render(&item).unwrap()[0].content,
            "Read a[image: p1.png][image: p2.pdf][image: scans/a.png]"
        );
        let err = t
            .render_parts(&row(r#"{"title": "a", "pages": 3}"#))
            .unwrap_err();
        assert!(
            err.contains("an image value must be a text, got number"),
            "{err}"
        );
    }

    #[test]
    fn json_output_escapes_content() {
        let t = Templates::compile(&task(&["{{ q }}"])).unwrap();
        let json = t
            .render_prompt(&row(r#"{"q": "say \"hi\"\n"}"#))
            .unwrap()
            .messages;
        assert_eq!(json.get(), r#"[{"role":"user","content":"say \"hi\"\n"}]"#);
    }
}

#[cfg(test)]
mod rule_tests {
    use super::*;
    use serde_json::Value;

    fn rule(name: &str, doc_type: Option<&str>, model_matches: bool, content: &str) -> PromptRule {
        PromptRule {
            name: name.to_owned(),
            when: doc_type
                .map(|t| vec![("doc_type".to_owned(), vec![Value::from(t)])])
                .unwrap_or_default(),
            model: (!model_matches).then(|| "other-*".to_owned()),
            model_matches,
            messages: vec![MessageTemplate::text("user", content)],
        }
    }

    fn first_content(rendered: &Rendered) -> String {
        let messages: Vec<Value> = serde_json::from_str(rendered.messages.get()).unwrap();
        messages[0]["content"].as_str().unwrap().to_owned()
    }

    #[test]
    fn the_first_rule_that_takes_an_item_gives_its_messages_and_its_name() {
        let task = TaskConfig {
            prompts: vec![
                rule("elsewhere", Some("invoice"), false, "NEVER {{ q }}"),
                rule("invoices", Some("invoice"), true, "INVOICE {{ q }}"),
                rule("forms", Some("form"), true, "FORM {{ q }} {{ box }}"),
            ],
            ..super::tests::task(&["DEFAULT {{ q }}"])
        };
        let t = Templates::compile(&task).unwrap();
        let row = |json: &str| serde_json::from_str::<Row>(json).unwrap();
        for (item, content, name) in [
            (
                r#"{"doc_type": "invoice", "q": "a"}"#,
                "INVOICE a",
                "invoices",
            ),
            (
                r#"{"doc_type": "form", "q": "b", "box": 1}"#,
                "FORM b 1",
                "forms",
            ),
            (r#"{"doc_type": "memo", "q": "c"}"#, "DEFAULT c", "default"),
            (r#"{"q": "d"}"#, "DEFAULT d", "default"),
        ] {
            let rendered = t.render_prompt(&row(item)).unwrap();
            assert_eq!(first_content(&rendered), content);
            assert_eq!(rendered.prompt.as_deref(), Some(name));
        }
        // A rule whose model condition fails is still checked: its fields
        // count, and so do the conditions'.
        let fields: BTreeSet<String> = ["q", "box"].map(str::to_owned).into();
        let err = t.check_fields(&fields, "no row has").unwrap_err();
        assert_eq!(err.path, "task.prompts[0].when.doc_type");
        // Without rules, results name no prompt.
        let plain = Templates::compile(&TaskConfig {
            prompts: Vec::new(),
            ..task
        })
        .unwrap();
        assert_eq!(
            plain.render_prompt(&row(r#"{"q": "e"}"#)).unwrap().prompt,
            None
        );
    }
}
