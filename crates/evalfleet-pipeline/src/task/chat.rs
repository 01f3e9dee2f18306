//! `kind: chat`: the item's messages are sent once; the answer is parsed and
//! checked, re-asked (with what was wrong) while it cannot be used and
//! re-asks are left, then scored by the task's metrics, one call to its
//! judge endpoint per LLM-judge metric.

use std::collections::VecDeque;
use std::sync::Arc;

use evalfleet_types::{Assessment, Score, Scores};
use serde_json::Value;

use super::images::Loader;
use super::{Episode, Finish, ItemContext, Reply, Request, Step, Target, Task};
use evalfleet_eval::metric_backend::Backends;
use evalfleet_eval::{Assessor, Checked, LlmJudgeCall};
use evalfleet_io::template::Templates;
use evalfleet_sandbox::CodeJudge;

/// The chat task.
#[derive(Clone)]
pub struct Chat {
    inner: Arc<Inner>,
}

struct Inner {
    templates: Arc<Templates>,
    /// Parsing, checking and scoring; `None` when the task has none (the
    /// answer is stored as it is).
    assessor: Option<Arc<Assessor>>,
    /// Judges a usable answer as a program (`kind: code`).
    code: Option<Arc<CodeJudge>>,
    /// Score the metrics of outside backends (`task.metric_backends`).
    backends: Option<Arc<Backends>>,
    /// Reads the images of the messages (when they have any).
    images: Option<Arc<Loader>>,
}

impl Chat {
    pub fn new(templates: Arc<Templates>, assessor: Option<Arc<Assessor>>) -> Self {
        Self {
            inner: Arc::new(Inner {
                templates,
                assessor,
                code: None,
                backends: None,
                images: None,
            }),
        }
    }

    /// The item fields its metrics' references read (see
    /// [`Assessor::reference_fields`]).
    pub fn reference_fields(&self) -> std::collections::BTreeSet<String> {
        self.inner
            .assessor
            .as_ref()
            .map(|a| a.reference_fields())
            .unwrap_or_default()
    }

    /// The same task, whose usable answers `backends` score too.
    pub(super) fn scoring_with(self, backends: Option<Arc<Backends>>) -> Self {
        Self {
            inner: Arc::new(Inner {
                templates: self.inner.templates.clone(),
                assessor: self.inner.assessor.clone(),
                code: self.inner.code.clone(),
                backends,
                images: self.inner.images.clone(),
            }),
        }
    }

    /// How many answers may wait on the outside backends at once (1 with
    /// none).
    pub(super) fn backend_queue(&self) -> usize {
        self.inner.backends.as_ref().map_or(1, |b| b.queue().max(1))
    }

    /// The same task, whose messages' images `loader` reads.
    pub(super) fn reading_images(self, loader: Arc<Loader>) -> Self {
        Self {
            inner: Arc::new(Inner {
                templates: self.inner.templates.clone(),
                assessor: self.inner.assessor.clone(),
                code: self.inner.code.clone(),
                backends: self.inner.backends.clone(),
                images: Some(loader),
            }),
        }
    }

    /// How many items' images may be read at once.
    pub(super) fn image_readers(&self) -> Option<usize> {
        self.inner.images.as_ref().map(|loader| loader.readers())
    }

    /// The same task, whose usable answers `code` judges as programs.
    pub(super) fn judging_code(self, code: Arc<CodeJudge>) -> Self {
        Self {
            inner: Arc::new(Inner {
                templates: self.inner.templates.clone(),
                assessor: self.inner.assessor.clone(),
                code: Some(code),
                backends: self.inner.backends.clone(),
                images: self.inner.images.clone(),
            }),
        }
    }

    /// The first step of `item`: its messages, or the item's end when
    /// they cannot be rendered.
    pub(super) fn first_step(&self, item: &ItemContext<'_>) -> Step {
        if let Some(loader) = &self.inner.images {
            return match self.inner.templates.render_parts_prompt(item.row()) {
                Ok((prompt, messages)) => loader.clone().first_call(messages, prompt, item),
                Err(message) => Step::Finish(Finish::failed(
                    format!("template: {message}"),
                    Assessment::default(),
                )),
            };
        }
        match self.inner.templates.render_prompt(item.row()) {
            Ok(rendered) => Step::Call(Request {
                target: Target::Items,
                messages: rendered.messages,
                sample: item.sample,
                rejected: None,
                prompt: rendered.prompt,
                images: Default::default(),
            }),
            Err(message) => Step::Finish(Finish::failed(
                format!("template: {message}"),
                Assessment::default(),
            )),
        }
    }

    /// The episode that takes an answer from here: checks, re-asks and
    /// scores it.
    pub(super) fn episode(&self) -> ChatEpisode {
        ChatEpisode {
            chat: self.inner.clone(),
            reasks: 0,
            judging: None,
        }
    }
}

impl Task for Chat {
    fn begin(&self, item: &ItemContext<'_>) -> (Box<dyn Episode>, Step) {
        (Box::new(self.episode()), self.first_step(item))
    }

    /// Answers waiting on the outside metric backends, and items whose
    /// images are being read, are work.
    fn work_limit(&self) -> usize {
        self.backend_queue() + self.image_readers().unwrap_or(0)
    }
}

/// An answer being scored by its LLM judges, one call each.
struct Judging {
    answer: String,
    checked: Checked,
    scores: Scores,
    /// The judge calls still to make.
    calls: VecDeque<LlmJudgeCall>,
    /// The metric whose judge was asked last.
    asked: String,
}

/// One item of a chat task.
pub struct ChatEpisode {
    chat: Arc<Inner>,
    reasks: u32,
    judging: Option<Judging>,
}

impl Episode for ChatEpisode {
    fn next(&mut self, item: &ItemContext<'_>, asked: Request, reply: Reply) -> Step {
        match (self.judging.take(), reply) {
            (None, Reply::Answer(answer)) => self.answered(item, asked, answer),
            (None, Reply::Failed(reason)) => Step::Finish(Finish::failed(
                reason,
                Assessment {
                    reasks: self.reasks,
                    ..Assessment::default()
                },
            )),
            (Some(mut judging), reply) => {
                let score = match (&self.chat.assessor, reply) {
                    (Some(assessor), Reply::Answer(text)) => {
                        assessor.llm_judge_score(&judging.asked, &text)
                    }
                    (_, Reply::Failed(reason)) => {
                        Score::error(format!("the judge failed: {reason}"))
                    }
                    (None, Reply::Answer(_)) => Score::error("no metric asked for this judge"),
                };
                judging.scores.insert(judging.asked.clone(), score);
                self.judge_next(item, judging)
            }
        }
    }
}

impl ChatEpisode {
    /// An answer to the item's messages (or to a re-ask).
    fn answered(&mut self, item: &ItemContext<'_>, asked: Request, answer: String) -> Step {
        let Some(assessor) = self.chat.assessor.clone() else {
            return Step::Finish(Finish::done(
                answer,
                Assessment {
                    reasks: self.reasks,
                    ..Assessment::default()
                },
            ));
        };
        let checked = assessor.check(&answer);
        if !checked.valid
            && self.reasks < assessor.spec().max_reasks
            && let Some(messages) = assessor.reask_messages(&asked.messages, &answer, &checked)
        {
            self.reasks += 1;
            return Step::Call(Request {
                target: Target::Items,
                messages,
                sample: asked.sample,
                rejected: Some(checked.reask_note()),
                prompt: None,
                images: asked.images,
            });
        }
        let scores = assessor.score(&checked, item.row());
        let calls = assessor.llm_judge_calls(&checked, item.row()).into();
        self.judge_next(
            item,
            Judging {
                answer,
                checked,
                scores,
                calls,
                asked: String::new(),
            },
        )
    }

    /// The next LLM-judge call, or the end of scoring.
    fn judge_next(&mut self, item: &ItemContext<'_>, mut judging: Judging) -> Step {
        while let Some(call) = judging.calls.pop_front() {
            match call.messages {
                Ok(messages) => {
                    judging.asked = call.key;
                    self.judging = Some(judging);
                    return Step::Call(Request {
                        target: Target::Endpoint(Arc::from(call.endpoint.as_str())),
                        messages,
                        sample: 0,
                        rejected: None,
                        prompt: None,
                        images: Default::default(),
                    });
                }
                Err(error) => {
                    judging.scores.insert(call.key, Score::error(error));
                }
            }
        }
        self.scored(item, judging)
    }

    /// The scores of this process are in: the outside backends score the
    /// answer (as work: no slot is held meanwhile), then the item
    /// finishes, once a code task's program is judged.
    fn scored(&mut self, item: &ItemContext<'_>, judging: Judging) -> Step {
        let Judging {
            answer,
            checked,
            scores,
            ..
        } = judging;
        let reasks = self.reasks;
        let requests = match (&self.chat.backends, &self.chat.assessor) {
            (Some(_), Some(assessor)) => assessor.backend_requests(&checked, item.row(), None),
            _ => Vec::new(),
        };
        // A code task's judge needs the row as JSON; no other does.
        let row = self
            .chat
            .code
            .is_some()
            .then(|| Value::Object(item.row().clone()));
        match self.chat.backends.clone() {
            Some(backends) if !requests.is_empty() => {
                let chat = self.chat.clone();
                let item_id = item.item_id.to_owned();
                Step::Work(Box::pin(async move {
                    let mut scores = scores;
                    scores.extend(backends.score(&item_id, requests).await);
                    finish(&chat, checked, row, answer, scores, reasks)
                }))
            }
            _ => finish(&self.chat, checked, row, answer, scores, reasks),
        }
    }
}

/// Every score is in: the item finishes, once a code task's program is
/// judged.
fn finish(
    chat: &Inner,
    checked: Checked,
    row: Option<Value>,
    answer: String,
    scores: Scores,
    reasks: u32,
) -> Step {
    match (&chat.code, &chat.assessor) {
        (Some(code), Some(assessor)) if checked.valid => super::judge::judge_then_finish(
            code.clone(),
            assessor.clone(),
            checked,
            row.unwrap_or_default(),
            answer,
            scores,
            reasks,
        ),
        _ => Step::Finish(Finish::done(answer, checked.assessment(scores, reasks))),
    }
}
