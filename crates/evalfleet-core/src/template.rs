//! `task.messages` templates, compiled once per run and rendered per item.

use std::collections::BTreeSet;

use minijinja::Environment;
use serde::Serialize;
use serde_json::value::RawValue;

use crate::config::{MessageTemplate, Part, TaskConfig, path};
use crate::dataset::Row;

/// One rendered chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// The task's message templates, compiled.
pub struct Templates {
    env: Environment<'static>,
    messages: Vec<Compiled>,
    variables: BTreeSet<String>,
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
    /// Compiles every message template of `task`.
    pub fn compile(task: &TaskConfig) -> Result<Self, TemplateError> {
        Self::from_messages(&task.messages, "task.messages")
    }

    /// Compiles `messages`, the list at `at` in the config.
    pub fn from_messages(messages: &[MessageTemplate], at: &str) -> Result<Self, TemplateError> {
        let mut env = crate::jinja::environment();
        let mut compiled = Vec::with_capacity(messages.len());
        let mut variables = BTreeSet::new();
        for (i, message) in messages.iter().enumerate() {
            let content_at = path::key(&path::index(at, i), "content");
            let sources: Vec<(String, &Part)> = if message.parts.is_empty() {
                Vec::new()
            } else {
                message
                    .parts
                    .iter()
                    .enumerate()
                    .map(|(j, part)| (path::index(&content_at, j), part))
                    .collect()
            };
            let text = Part::Text(message.content.clone());
            let sources = if sources.is_empty() {
                vec![(content_at, &text)]
            } else {
                sources
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
        Ok(Self {
            env,
            messages: compiled,
            variables,
        })
    }

    /// The item fields the templates refer to.
    pub fn variables(&self) -> &BTreeSet<String> {
        &self.variables
    }

    /// Checks the templates against the fields a dataset has, so that a typo
    /// is found before the first call rather than once per item. `source`
    /// completes "which ..." in the message (`no row of the dataset has`).
    pub fn check_fields(
        &self,
        fields: &BTreeSet<String>,
        source: &str,
    ) -> Result<(), TemplateError> {
        let missing: Vec<&str> = self
            .variables
            .iter()
            .filter(|v| !fields.contains(*v))
            .map(String::as_str)
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let known: Vec<&str> = fields.iter().map(String::as_str).collect();
        Err(TemplateError {
            path: "task.messages".to_owned(),
            message: format!(
                "the templates refer to {}, which {source} (fields: {})",
                quoted(&missing),
                known.join(", ")
            ),
        })
    }

    /// Whether any message has image parts.
    pub fn has_images(&self) -> bool {
        self.messages
            .iter()
            .any(|m| m.parts.iter().any(|p| matches!(p, CompiledPart::Image(..))))
    }

    /// The messages for one item, as text: an image part is shown as
    /// `[image: SOURCE]` (see [`Self::render_parts`] for what is sent).
    pub fn render(&self, row: &Row) -> Result<Vec<Message>, String> {
        let rendered = self.render_parts(row)?;
        let mut out = Vec::with_capacity(rendered.len());
        for message in rendered {
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
            out.push(Message {
                role: message.role,
                content,
            });
        }
        Ok(out)
    }

    /// The messages for one item, each image part with the values it gives
    /// (paths, URLs, ...), not yet read.
    pub fn render_parts(&self, row: &Row) -> Result<Vec<RenderedMessage>, String> {
        let context = minijinja::Value::from(minijinja::value::Serde(row));
        let mut out = Vec::with_capacity(self.messages.len());
        for message in &self.messages {
            let mut parts = Vec::with_capacity(message.parts.len());
            for part in &message.parts {
                let (CompiledPart::Text(name) | CompiledPart::Image(name, _)) = part;
                let template = self.env.get_template(name).map_err(|err| err.to_string())?;
                let explain = |err: minijinja::Error| {
                    format!("{name}: {}", crate::jinja::explain(&err, &template, row))
                };
                parts.push(match part {
                    CompiledPart::Text(_) => {
                        RenderedPart::Text(template.render(&context).map_err(explain)?)
                    }
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
                        values: vec![template.render(&context).map_err(explain)?],
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

    /// The messages for one item as a JSON array, ready to embed in requests.
    pub fn render_json(&self, row: &Row) -> Result<Box<RawValue>, String> {
        let messages = self.render(row)?;
        serde_json::value::to_raw_value(&messages).map_err(|err| err.to_string())
    }
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
    use crate::config::MessageTemplate;

    fn task(contents: &[&str]) -> TaskConfig {
        TaskConfig {
            messages: contents
                .iter()
                .map(|c| MessageTemplate::text("user", c))
                .collect(),
            images: Default::default(),
            params: Default::default(),
            stream: false,
            samples: 1,
            kind: crate::config::TaskKind::Chat,
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
        let json = t.render_json(&row(r#"{"q": "say \"hi\"\n"}"#)).unwrap();
        assert_eq!(json.get(), r#"[{"role":"user","content":"say \"hi\"\n"}]"#);
    }
}
