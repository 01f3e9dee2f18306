//! `kind: refine`: the item's messages are sent, then the model is asked to
//! improve its answer (`task.refine.prompt`, `rounds` times), each a call of
//! its own that continues the conversation; the last answer is checked,
//! re-asked and scored as a chat answer is. Every call is an attempt of the
//! item and a request of its own in the cache, so a run killed between two
//! calls resumes from the cache where it stopped.

use std::sync::Arc;

use evalfleet_types::Assessment;

use super::chat::{Chat, ChatEpisode};
use super::{Episode, Finish, ItemContext, Reply, Request, Step, Target, Task};
use evalfleet_config::RefineSettings;
use evalfleet_eval::continue_conversation;
use evalfleet_jinja::AnswerTemplate;

const PROMPT: &str = "task.refine.prompt";

/// The refine task.
pub struct Refine {
    chat: Chat,
    inner: Arc<Inner>,
}

struct Inner {
    prompt: AnswerTemplate,
    rounds: u32,
}

impl Refine {
    pub fn new(chat: Chat, settings: &RefineSettings) -> Result<Self, String> {
        Ok(Self {
            chat,
            inner: Arc::new(Inner {
                prompt: AnswerTemplate::new(PROMPT, &settings.prompt)?,
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

    /// Answers waiting on the outside metric backends, and items whose
    /// images are being read, are work.
    fn work_limit(&self) -> usize {
        self.chat.backend_queue() + self.chat.image_readers().unwrap_or(0)
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
        let messages = self
            .inner
            .prompt
            .render(item.row(), &answer)
            .map_err(|err| format!("{PROMPT}: {err}"))
            .and_then(|prompt| continue_conversation(&asked.messages, &answer, &prompt));
        match messages {
            Ok(messages) => {
                self.improved += 1;
                Step::Call(Request {
                    target: Target::Items,
                    messages,
                    sample: asked.sample,
                    rejected: None,
                    prompt: None,
                    images: asked.images,
                })
            }
            Err(err) => Step::Finish(Finish::failed(err, Assessment::default())),
        }
    }
}
