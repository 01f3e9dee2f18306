//! `task.messages` templates, compiled once per run and rendered per item.

use std::collections::BTreeSet;

use minijinja::Environment;
use serde::Serialize;
use serde_json::value::RawValue;

use crate::config::{MessageTemplate, TaskConfig, path};
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
    messages: Vec<(String, String)>,
    variables: BTreeSet<String>,
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
            let name = path::key(&path::index(at, i), "content");
            env.add_template_owned(name.clone(), message.content.clone())
                .map_err(|err| TemplateError {
                    path: name.clone(),
                    message: err.to_string(),
                })?;
            let template = env.get_template(&name).map_err(|err| TemplateError {
                path: name.clone(),
                message: err.to_string(),
            })?;
            variables.extend(template.undeclared_variables(false));
            compiled.push((message.role.clone(), name));
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

    /// The messages for one item.
    pub fn render(&self, row: &Row) -> Result<Vec<Message>, String> {
        let context = minijinja::Value::from(minijinja::value::Serde(row));
        let mut out = Vec::with_capacity(self.messages.len());
        for (role, name) in &self.messages {
            let template = self.env.get_template(name).map_err(|err| err.to_string())?;
            let content = template.render(&context).map_err(|err| {
                format!("{name}: {}", crate::jinja::explain(&err, &template, row))
            })?;
            out.push(Message {
                role: role.clone(),
                content,
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
                .map(|c| MessageTemplate {
                    role: "user".to_owned(),
                    content: (*c).to_owned(),
                })
                .collect(),
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
    fn json_output_escapes_content() {
        let t = Templates::compile(&task(&["{{ q }}"])).unwrap();
        let json = t.render_json(&row(r#"{"q": "say \"hi\"\n"}"#)).unwrap();
        assert_eq!(json.get(), r#"[{"role":"user","content":"say \"hi\"\n"}]"#);
    }
}
