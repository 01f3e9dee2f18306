//! What a task does with an item, step by step: which request to send, and
//! what to do with the reply, until it finishes with an assessment. Each
//! kind of task (`task.kind`) is one module behind [`Task`]; the pipeline
//! drives the steps of every kind the same way and knows none of their
//! details: it answers requests from the cache or sends them through the
//! fleet's one call path, retries failures, and stores what an item ends
//! with.
//!
//! - [`chat`]: one call; the answer is parsed, checked (re-asked when it
//!   cannot be used) and scored, by LLM judges too.
//! - [`code`]: a chat whose answer is a program, judged against the item's
//!   tests in a sandbox.
//! - [`refine`]: ask, then ask the model to improve its answer, then check
//!   and score the last answer.
//! - [`conversation`]: an episode of a simulated three-person conversation
//!   with a robot that may intervene; many calls an item.

mod agent_server;
pub mod chat;
pub mod code;
pub mod conversation;
pub mod exec;
pub mod images;
mod judge;
pub mod refine;

use std::sync::Arc;

use evalfleet_types::{Assessment, ItemStatus};
use futures_util::future::BoxFuture;
use serde_json::value::RawValue;

use evalfleet_config::{Config, TaskKind};
use evalfleet_eval::Assessor;
use evalfleet_io::dataset::Row;
use evalfleet_io::template::Templates;

/// An item as a task sees it.
#[derive(Debug, Clone, Copy)]
pub struct ItemContext<'a> {
    pub item_id: &'a str,
    /// Its dataset row, read as JSON only when a step asks for it (most
    /// steps need none but the first).
    row: &'a std::cell::OnceCell<Row>,
    row_json: &'a str,
    /// Which of its row's `task.n` samples it is (0 when n is 1).
    pub sample: u32,
    /// The 1-based line of the dataset its row starts at, where known.
    pub line: Option<u64>,
    /// Its place in the run (`seq`).
    pub seq: u64,
    /// The number of its next attempt, over every session of the run.
    pub attempt: u32,
    /// Where its agent's calls are stored as they end (when it begins).
    pub keeper: Option<&'a CallSink>,
}

/// Where an item's agent calls go as each ends (`kind: exec`): the
/// gateway's sink, made by the pipeline for the item's claim.
#[derive(Clone)]
pub struct CallSink(pub evalfleet_gateway::Keep);

impl std::fmt::Debug for CallSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CallSink")
    }
}

impl<'a> ItemContext<'a> {
    /// An item whose row is `row_json`, parsed into `row` when asked for
    /// (already there, or not).
    pub fn new(
        item_id: &'a str,
        row: &'a std::cell::OnceCell<Row>,
        row_json: &'a str,
        sample: u32,
    ) -> Self {
        Self {
            item_id,
            row,
            row_json,
            sample,
            line: None,
            seq: 0,
            attempt: 1,
            keeper: None,
        }
    }

    /// The same item, whose agent's calls go to `keeper` as they end.
    pub fn keeping(self, keeper: &'a CallSink) -> Self {
        Self {
            keeper: Some(keeper),
            ..self
        }
    }

    /// The same item, `seq` of the run, whose next attempt is `attempt`.
    pub fn numbered(self, seq: u64, attempt: u32) -> Self {
        Self {
            seq,
            attempt,
            ..self
        }
    }

    /// The same item, whose row starts at `line` of the dataset.
    pub fn at_line(self, line: u64) -> Self {
        Self {
            line: Some(line),
            ..self
        }
    }

    /// The item's fields (none when its stored row is not a JSON object).
    pub fn row(&self) -> &'a Row {
        self.row
            .get_or_init(|| serde_json::from_str(self.row_json).unwrap_or_default())
    }
}

/// Who answers a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// The endpoints that answer items (whichever is free first).
    Items,
    /// One endpoint by name (a judge endpoint, `role: judge`).
    Endpoint(Arc<str>),
}

/// A call a task wants made.
#[derive(Debug)]
pub struct Request {
    pub target: Target,
    /// The chat messages, as a JSON array.
    pub messages: Box<RawValue>,
    /// Keeps requests of different samples of one row apart (in the cache
    /// too).
    pub sample: u32,
    /// Set when the reply just given could not be used and this request
    /// asks again: the attempt that gave it is recorded as an
    /// `invalid_answer` with this note, and does not count against the
    /// item's attempts.
    pub rejected: Option<String>,
    /// The rule of `task.prompts` that made an item's first messages (set
    /// on its first request only; `None` without rules): recorded with
    /// its result.
    pub prompt: Option<Arc<str>>,
    /// The images its messages name by hash (none, mostly).
    pub images: evalfleet_io::images::Images,
}

impl Request {
    /// What its call sends.
    pub fn outgoing(&self) -> evalfleet_fleet::call::Prompt<'_> {
        evalfleet_fleet::call::Prompt {
            messages: &self.messages,
            images: &self.images,
        }
    }
}

/// What became of a request.
#[derive(Debug)]
pub enum Reply {
    /// The model's answer (from the cache, or a call).
    Answer(String),
    /// No answer: the calls failed for good; why.
    Failed(String),
}

/// How an item ends.
#[derive(Debug)]
pub struct Finish {
    pub status: ItemStatus,
    /// The answer that stands for the item (`Done`).
    pub output: Option<String>,
    /// Why it failed (`Failed`).
    pub error: Option<String>,
    pub assessment: Assessment,
}

impl Finish {
    pub fn done(output: String, assessment: Assessment) -> Self {
        Self {
            status: ItemStatus::Done,
            output: Some(output),
            error: None,
            assessment,
        }
    }

    pub fn failed(error: String, assessment: Assessment) -> Self {
        Self {
            status: ItemStatus::Failed,
            output: None,
            error: Some(error),
            assessment,
        }
    }
}

/// What an item does next.
pub enum Step {
    /// A call; its reply goes to [`Episode::next`].
    Call(Request),
    /// Work that is no call (running programs), done outside any endpoint's
    /// slot; its outcome is the next step. At most [`Task::work_limit`] run
    /// at once.
    Work(BoxFuture<'static, Step>),
    /// A wait for something outside the run (a trainer's action), holding
    /// no slot and no place of [`Task::work_limit`]; its outcome is the next
    /// step. A task that waits so bounds its own waiters. It is abandoned
    /// as soon as the session stops (the item stays pending).
    Wait(BoxFuture<'static, Step>),
    /// The item is over.
    Finish(Finish),
    /// Work that was one of the item's attempts (a run of its agent): its
    /// record and the calls it made go to the store with what the item
    /// sends next (its result, or the record of its next attempt); then
    /// `then`.
    Attempted(Box<Attempted>),
}

/// An attempt made as work ([`Step::Attempted`]).
pub struct Attempted {
    /// Its record (the pipeline sets its session).
    pub record: evalfleet_types::AttemptRecord,
    /// The calls it made through the gateway, in order.
    pub calls: Vec<evalfleet_types::AgentCall>,
    pub then: Step,
}

/// One item's way through a task.
pub trait Episode: Send {
    /// The step after `reply`, the outcome of `asked` (the last request).
    fn next(&mut self, item: &ItemContext<'_>, asked: Request, reply: Reply) -> Step;
}

/// A kind of task.
pub trait Task: Send + Sync {
    /// The episode that takes `item` through the task, and its first step.
    fn begin(&self, item: &ItemContext<'_>) -> (Box<dyn Episode>, Step);

    /// How many [`Step::Work`] may run at once.
    fn work_limit(&self) -> usize {
        1
    }

    /// Whether its items' calls go through the gateway, to be stored as
    /// each ends ([`ItemContext::keeper`]).
    fn keeps_calls(&self) -> bool {
        false
    }
}

/// Why a task cannot start.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    /// The task's checking or scoring cannot be compiled.
    #[error("{0}")]
    Invalid(String),
    #[error("the code judge cannot start")]
    CodeJudge(#[source] evalfleet_sandbox::CodeJudgeError),
    /// An outside metric backend's setup failed, or its program cannot
    /// start.
    #[error(transparent)]
    MetricBackend(#[from] evalfleet_eval::metric_backend::BackendError),
    /// The agents' sandbox or gateway cannot be had (`kind: exec`).
    #[error(transparent)]
    Exec(#[from] exec::ExecError),
    /// The run was stopped while the task started.
    #[error("stopped while the task started (a metric backend's setup, or the code judge)")]
    Stopped,
}

impl TaskError {
    pub fn fault(&self) -> evalfleet_types::Fault {
        match self {
            Self::Invalid(_) => evalfleet_types::Fault::BadInput,
            Self::CodeJudge(err) => err.fault(),
            Self::MetricBackend(err) => err.fault(),
            Self::Exec(exec::ExecError::Unreachable(_)) => evalfleet_types::Fault::BadInput,
            Self::Exec(_) => evalfleet_types::Fault::Failure,
            Self::Stopped => evalfleet_types::Fault::Interrupted,
        }
    }
}

/// Makes the task of `config`: compiles its checking and scoring and starts
/// what it needs (the code judge, with its sandbox under `sandbox_dir`); a
/// conversation is told the topics its run used (`used_topics`), and where
/// a trainer takes its decisions (`gym`, for `policy: {kind: external}`).
pub async fn start(
    config: &Config,
    templates: Arc<Templates>,
    sandbox_dir: &std::path::Path,
    hidden: &[std::path::PathBuf],
    used_topics: Vec<String>,
    gym: Option<Arc<conversation::gym::Gym>>,
    gateway: Option<Agents>,
) -> Result<Arc<dyn Task>, TaskError> {
    let task = &config.task;
    let assessor = if task.eval.checks() || !task.eval.metrics.is_empty() {
        Some(Arc::new(
            Assessor::new(&task.eval).map_err(TaskError::Invalid)?,
        ))
    } else {
        None
    };
    let backends = evalfleet_eval::metric_backend::Backends::start(
        &task.eval.backends,
        &task
            .eval
            .metrics
            .iter()
            .map(|m| m.metric.backend())
            .collect::<Vec<_>>(),
    )
    .await?;
    let mut chat = chat::Chat::new(templates.clone(), assessor).scoring_with(backends);
    if templates.has_images() {
        let base = config
            .dataset
            .path
            .parent()
            .map(std::path::Path::to_path_buf)
            .unwrap_or_default();
        let loader = images::Loader::new(&task.images, base).map_err(TaskError::Invalid)?;
        chat = chat.reading_images(Arc::new(loader));
    }
    Ok(match &task.kind {
        TaskKind::Chat => Arc::new(chat),
        TaskKind::Code(settings) => {
            let judge = code::start(settings, sandbox_dir)
                .await
                .map_err(TaskError::CodeJudge)?;
            Arc::new(code::Code::new(chat, Arc::new(judge)))
        }
        TaskKind::Refine(settings) => {
            Arc::new(refine::Refine::new(chat, settings).map_err(TaskError::Invalid)?)
        }
        TaskKind::Conversation(settings) => {
            Arc::new(conversation::Conversation::new(settings, used_topics, gym)?)
        }
        TaskKind::Exec(settings) => {
            let Some(agents) = gateway else {
                return Err(TaskError::Invalid(
                    "kind: exec needs the gateway, which this command does not serve".to_owned(),
                ));
            };
            Arc::new(
                exec::Exec::start(
                    settings,
                    config.retry,
                    chat,
                    agents.gateway,
                    &*agents.host,
                    sandbox_dir,
                    hidden,
                )
                .await?,
            )
        }
    })
}

/// What an exec task's agents call: the run's gateway, and what serves it.
pub struct Agents {
    pub gateway: Arc<evalfleet_gateway::Gateway>,
    pub host: Arc<dyn exec::GatewayHost>,
}
