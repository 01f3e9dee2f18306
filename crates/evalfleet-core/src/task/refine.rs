//! `kind: refine`: the item's messages are sent, then the model is asked to
//! improve its answer (`task.refine.prompt`, `rounds` times), each a call of
//! its own that continues the conversation; the last answer is checked,
//! re-asked and scored as a chat answer is. Every call is an attempt of the
//! item and a request of its own in the cache, so a run killed between two
//! calls resumes from the cache where it stopped.

use std::sync::Arc;

use evalfleet_types::Assessment;
use minijinja::Environment;
use serde_json::Value;

use super::chat::{Chat, ChatEpisode};
use super::{Episode, Finish, ItemContext, Reply, Request, Step, Target, Task};
use crate::config::RefineSettings;

const PROMPT: &str = "task.refine.prompt";

/// The refine task.
pub struct Refine {
    chat: Chat,
    inner: Arc<Inner>,
}

struct Inner {
    /// The prompt, compiled.
    env: Environment<'static>,
    rounds: u32,
}

impl Refine {
    pub fn new(chat: Chat, settings: &RefineSettings) -> Result<Self, String> {
        let mut env = crate::jinja::environment();
        env.add_template_owned(PROMPT, settings.prompt.clone())
            .map_err(|e| format!("{PROMPT}: {e}"))?;
        Ok(Self {
            chat,
            inner: Arc::new(Inner {
                env,
                rounds: settings.rounds,
            }),
        })
    }
}

impl Task for Refine {
    fn begin(&self, item: &ItemContext<'_>) -> (Box<dyn Episode>, Step) {
        let episode = Box::new(RefineEpisode {
            inner: self.inner.clone(),
            improved: 0,
            chat: self.chat.episode(),
        });
        (episode, self.chat.first_step(item))
    }
}

/// One item of a refine task.
struct RefineEpisode {
    inner: Arc<Inner>,
    /// Improvements asked for so far.
    improved: u32,
    /// Takes the last answer.
    chat: ChatEpisode,
}

impl Episode for RefineEpisode {
    fn next(&mut self, item: &ItemContext<'_>, asked: Request, reply: Reply) -> Step {
        if self.improved == self.inner.rounds {
            return self.chat.next(item, asked, reply);
        }
        let answer = match reply {
            Reply::Answer(answer) => answer,
            Reply::Failed(reason) => {
                return Step::Finish(Finish::failed(reason, Assessment::default()));
            }
        };
        let mut context = item.row().clone();
        context.insert("answer".to_owned(), Value::String(answer.clone()));
        let prompt = self
            .inner
            .env
            .get_template(PROMPT)
            .and_then(|t| t.render(minijinja::Value::from(minijinja::value::Serde(&context))));
        let prompt = match prompt {
            Ok(prompt) => prompt,
            Err(err) => {
                return Step::Finish(Finish::failed(
                    format!("{PROMPT}: {err}"),
                    Assessment::default(),
                ));
            }
        };
        let mut conversation: Vec<Value> = match serde_json::from_str(asked.messages.get()) {
            Ok(list) => list,
            Err(err) => {
                return Step::Finish(Finish::failed(
                    format!("the conversation is not a list of messages: {err}"),
                    Assessment::default(),
                ));
            }
        };
        conversation.push(serde_json::json!({"role": "assistant", "content": answer}));
        conversation.push(serde_json::json!({"role": "user", "content": prompt}));
        match serde_json::value::to_raw_value(&conversation) {
            Ok(messages) => {
                self.improved += 1;
                Step::Call(Request {
                    target: Target::Items,
                    messages,
                    sample: asked.sample,
                    rejected: None,
                })
            }
            Err(err) => Step::Finish(Finish::failed(err.to_string(), Assessment::default())),
        }
    }
}
