//! `task.messages` templates (and those of `task.prompts`), compiled once
//! per run and rendered per item.

use std::collections::BTreeSet;
use std::sync::Arc;

use minijinja::Environment;
use serde::Serialize;
use serde_json::value::RawValue;

use crate::config::{DEFAULT_PROMPT, MessageTemplate, PromptRule, TaskConfig, path};
use crate::dataset::Row;

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
    /// Each message's role and compiled template's name.
    messages: Vec<(String, String)>,
}

/// An item's messages, and the prompt they came from.
pub struct Rendered {
    /// The rule of `task.prompts` chosen (`default`: `task.messages`);
    /// `None` when the task has no rules.
    pub prompt: Option<Arc<str>>,
    /// The messages, as a JSON array.
    pub messages: Box<RawValue>,
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
        let mut env = crate::jinja::environment();
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
        let mut env = crate::jinja::environment();
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

    /// The messages for one item.
    pub fn render(&self, row: &Row) -> Result<Vec<Message>, String> {
        self.render_list(self.choose(row)?, row)
    }

    fn render_list(&self, prompt: &Prompt, row: &Row) -> Result<Vec<Message>, String> {
        let context = minijinja::Value::from(minijinja::value::Serde(row));
        let mut out = Vec::with_capacity(prompt.messages.len());
        for (role, name) in &prompt.messages {
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
        self.render_prompt(row).map(|r| r.messages)
    }

    /// The messages for one item as a JSON array, with the prompt chosen.
    pub fn render_prompt(&self, row: &Row) -> Result<Rendered, String> {
        let prompt = self.choose(row)?;
        let messages = self.render_list(prompt, row)?;
        Ok(Rendered {
            prompt: self.has_rules.then(|| prompt.name.clone()),
            messages: serde_json::value::to_raw_value(&messages).map_err(|err| err.to_string())?,
        })
    }
}

/// Compiles the message list at `at` into `env`, adding the fields its
/// templates read to `variables`.
fn compile_list(
    env: &mut Environment<'static>,
    variables: &mut BTreeSet<String>,
    messages: &[MessageTemplate],
    at: &str,
) -> Result<Vec<(String, String)>, TemplateError> {
    let mut compiled = Vec::with_capacity(messages.len());
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
    Ok(compiled)
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
            prompts: Vec::new(),
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
            messages: vec![MessageTemplate {
                role: "user".to_owned(),
                content: content.to_owned(),
            }],
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
            messages: vec![MessageTemplate {
                role: "user".to_owned(),
                content: "DEFAULT {{ q }}".to_owned(),
            }],
            params: Default::default(),
            stream: false,
            samples: 1,
            kind: crate::config::TaskKind::Chat,
            eval: Default::default(),
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
