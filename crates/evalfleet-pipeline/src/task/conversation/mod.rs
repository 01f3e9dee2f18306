//! `kind: conversation`: an item is an episode of a three-person
//! conversation (personas A, B and C played by models) in which a robot
//! may intervene when the relations between them are unbalanced. Each
//! human utterance, relation score, topic, policy choice and robot
//! utterance is a call of the item (an attempt like any other); the
//! episode's steps, rewards and conversation are its output, and its
//! totals its scores. [`sim`] holds the episode's logic, free of I/O, so
//! that the environment server can drive the same episodes step by step.

pub mod gym;
pub mod original;
mod pyrandom;
pub mod relations;
pub mod rules;
pub mod sim;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use evalfleet_types::{Assessment, Score, Scores};
use serde_json::Value;

use super::{Episode, Finish, ItemContext, Reply, Request, Step, Target, Task, TaskError};
use evalfleet_config::{ConversationSettings, PolicyKind};
use evalfleet_eval::balance::{Need, Strategy};
use evalfleet_io::template::{Message, Templates};
use gym::Gym;
use rules::Sim;
use sim::{Ask, CallKind, Next};

/// How many of the run's topics a topic request lists to avoid.
const AVOID_TOPICS: usize = 50;

/// The conversation task.
pub struct Conversation {
    inner: Arc<Inner>,
}

struct Inner {
    settings: Arc<ConversationSettings>,
    /// Compiled messages of each kind of call.
    templates: HashMap<&'static str, Templates>,
    /// Topics the run has used (those of earlier sessions too), newest
    /// last, so that episodes avoid them.
    topics: Mutex<Vec<String>>,
    /// Where decisions go when a trainer takes them (`kind: external`).
    gym: Option<Arc<Gym>>,
}

impl Conversation {
    /// The task of `settings`; `used_topics`: the topics the run's stored
    /// episodes used.
    pub fn new(
        settings: &ConversationSettings,
        used_topics: Vec<String>,
        gym: Option<Arc<Gym>>,
    ) -> Result<Self, TaskError> {
        if settings.policy.kind == PolicyKind::External && gym.is_none() {
            return Err(TaskError::Invalid(
                "task.conversation.policy: kind external takes its decisions from a trainer: run it with evalfleet env".to_owned(),
            ));
        }
        let mut templates = HashMap::new();
        let at = "task.conversation";
        for (kind, messages) in [
            ("persona", &settings.persona_messages),
            ("topic", &settings.topic.messages),
            ("scorer", &settings.scorer.call.messages),
            ("policy", &settings.policy.call.messages),
            ("robot", &settings.robot.messages),
        ] {
            let key = if kind == "persona" {
                format!("{at}.persona_messages")
            } else {
                format!("{at}.{kind}.messages")
            };
            let compiled = Templates::from_messages(messages, &key)
                .map_err(|err| TaskError::Invalid(err.to_string()))?;
            templates.insert(kind, compiled);
        }
        Ok(Self {
            inner: Arc::new(Inner {
                settings: Arc::new(settings.clone()),
                templates,
                topics: Mutex::new(used_topics),
                gym,
            }),
        })
    }
}

impl Task for Conversation {
    fn begin(&self, item: &ItemContext<'_>) -> (Box<dyn Episode>, Step) {
        let row = item.row();
        let settings = &self.inner.settings;
        let topic = match row.get("topic").and_then(Value::as_str) {
            Some(topic) if !topic.trim().is_empty() => Some(topic.trim().to_owned()),
            _ if !settings.topics.is_empty() => {
                let index = row
                    .get("episode")
                    .and_then(Value::as_u64)
                    .unwrap_or_else(|| sim::Draws::new(0, item.item_id).next_u64());
                Some(settings.topics[(index % settings.topics.len() as u64) as usize].clone())
            }
            _ => None,
        };
        let seed = row.get("seed").and_then(Value::as_u64);
        let topic_given = topic.clone();
        let mut sim = Sim::seeded(settings.clone(), item.item_id, topic, seed);
        let next = sim.start();
        let state = Arc::new(Mutex::new(EpisodeState {
            inner: self.inner.clone(),
            episode: item.item_id.to_owned(),
            topic: topic_given,
            seed,
            sim,
            sample: sample_of(item.item_id),
            last: None,
            last_reply: None,
            start: None,
            abandoned: false,
        }));
        let step = lock(&state).step(&state, next);
        let step = match &self.inner.gym {
            Some(gym) => begin_when_free(gym.clone(), &state, step),
            None => step,
        };
        (Box::new(ConversationEpisode { state }), step)
    }

    /// Episodes waiting for a place to begin (a trainer's runs).
    fn work_limit(&self) -> usize {
        self.inner.gym.as_ref().map_or(1, |gym| gym.capacity)
    }
}

/// A trainer's episodes begin when one of its places is free: `step`, the
/// episode's first, once it has one.
fn begin_when_free(gym: Arc<Gym>, state: &Arc<Mutex<EpisodeState>>, step: Step) -> Step {
    let shared = state.clone();
    Step::Work(Box::pin(async move {
        match gym.starts.clone().acquire_owned().await {
            Ok(permit) => {
                let mut this = lock(&shared);
                this.start = Some(permit);
                gym.started(&this.episode);
            }
            Err(_) => {
                return Step::Finish(Finish::failed(
                    "the environment server stopped".to_owned(),
                    Assessment::default(),
                ));
            }
        }
        step
    }))
}

/// Keeps the cache's answers of one episode apart from another's (the same
/// opening line of two episodes is two calls), and the same for one
/// episode across resumes.
fn sample_of(episode: &str) -> u32 {
    (sim::Draws::new(0, episode).next_u64() & u64::from(u32::MAX)) as u32
}

/// One episode on its way.
struct ConversationEpisode {
    /// Shared with the work that waits for a trainer's action.
    state: Arc<Mutex<EpisodeState>>,
}

struct EpisodeState {
    inner: Arc<Inner>,
    episode: String,
    /// What it began with (to start over from).
    topic: Option<String>,
    seed: Option<u64>,
    sim: Sim,
    sample: u32,
    /// The kind and messages of the call asked last, and its reply (for a
    /// re-ask).
    last: Option<(CallKind, Vec<Message>)>,
    last_reply: Option<String>,
    /// Its place among the episodes under way (a trainer's runs only).
    start: Option<tokio::sync::OwnedSemaphorePermit>,
    /// A decision of it came to nothing: the rest are invalid at once.
    abandoned: bool,
}

fn lock(state: &Mutex<EpisodeState>) -> std::sync::MutexGuard<'_, EpisodeState> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Episode for ConversationEpisode {
    fn next(&mut self, _item: &ItemContext<'_>, _asked: Request, reply: Reply) -> Step {
        let state = self.state.clone();
        let mut this = lock(&state);
        let kind = this.last.as_ref().map(|(kind, _)| *kind);
        match reply {
            Reply::Answer(text) => match this.sim.reply(&text) {
                Ok(next) => {
                    if kind == Some(CallKind::Topic) && !this.sim.topic().is_empty() {
                        let topic = this.sim.topic().to_owned();
                        let mut topics = this
                            .inner
                            .topics
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner);
                        if !topics.contains(&topic) {
                            topics.push(topic);
                        }
                    }
                    this.last_reply = Some(text);
                    this.step(&state, next)
                }
                Err(why) => this.failed(why),
            },
            Reply::Failed(reason) => {
                let what = kind.map_or("a", CallKind::as_str);
                this.failed(format!("the {what} call failed: {reason}"))
            }
        }
    }
}

impl EpisodeState {
    /// The step for what the episode needs next; decisions of a policy
    /// that is no model are taken here, or handed to a trainer.
    fn step(&mut self, shared: &Arc<Mutex<EpisodeState>>, mut next: Next) -> Step {
        loop {
            next = match next {
                Next::Ask(ask) => return self.call(ask),
                Next::Decide(decision) => match self.inner.settings.policy.kind {
                    PolicyKind::Model => self.sim.ask_policy(),
                    PolicyKind::Fixed(strategy) => self.sim.act(Some(strategy)),
                    PolicyKind::Random => {
                        let strategy = self.sim.random_strategy();
                        self.sim.act(Some(strategy))
                    }
                    PolicyKind::External => {
                        if self.closed_by_trainer() {
                            return self.withdraw(shared);
                        }
                        if self.abandoned {
                            self.sim.act_invalid("timeout")
                        } else {
                            return self.hand_over(shared, &decision);
                        }
                    }
                },
                Next::Over => {
                    if self.closed_by_trainer() {
                        return self.withdraw(shared);
                    }
                    return self.finish();
                }
            };
        }
    }

    /// The decision goes to the trainer; the episode goes on with its
    /// action (invalid when none comes in time).
    fn hand_over(&mut self, shared: &Arc<Mutex<EpisodeState>>, decision: &sim::Decision) -> Step {
        let Some(gym) = self.inner.gym.clone() else {
            return self.failed("no trainer takes this run's decisions".to_owned());
        };
        let pending = gym.offer(&self.episode, self.transition(Some(decision)));
        let shared = shared.clone();
        Step::Wait(Box::pin(async move {
            let action = gym.decision(pending).await;
            let mut this = lock(&shared);
            let next = match action {
                gym::Action::Strategy(strategy) => this.sim.act(Some(strategy)),
                gym::Action::Output(output) => this.sim.act_output(&output),
                gym::Action::Invalid => this.sim.act_invalid("trainer"),
                gym::Action::TimedOut => {
                    this.abandoned = true;
                    this.sim.act_invalid("timeout")
                }
                gym::Action::Closed => return this.withdraw(&shared),
            };
            this.step(&shared, next)
        }))
    }

    fn closed_by_trainer(&self) -> bool {
        self.inner
            .gym
            .as_ref()
            .is_some_and(|gym| gym.is_closed(&self.episode))
    }

    /// The trainer closed the episode: it is withdrawn and starts over
    /// from its beginning (the same seed, so the same draws), to be handed
    /// to a later reset; what it played so far stays among its calls and
    /// counts nowhere else.
    fn withdraw(&mut self, shared: &Arc<Mutex<EpisodeState>>) -> Step {
        let Some(gym) = self.inner.gym.clone() else {
            return self.failed("no trainer takes this run's decisions".to_owned());
        };
        gym.withdraw(&self.episode);
        // Its place goes to the next episode waiting for one.
        self.start = None;
        self.sim = Sim::seeded(
            self.inner.settings.clone(),
            &self.episode,
            self.topic.clone(),
            self.seed,
        );
        self.last = None;
        self.last_reply = None;
        self.abandoned = false;
        let next = self.sim.start();
        let step = self.step(shared, next);
        begin_when_free(gym, shared, step)
    }

    /// Tells the trainer stepping the episode (if any) that it ended: with
    /// its record, or failed for a reason.
    fn tell_end(&self, outcome: Result<Value, String>) {
        let Some(gym) = &self.inner.gym else {
            return;
        };
        let mut transition = self.transition(None);
        if let Err(why) = &outcome {
            // The step under way earned nothing.
            transition.reward = 0.0;
            transition.truncated = true;
            transition.info["reward_parts"] = Value::Null;
            transition.info["error"] = Value::from(why.as_str());
        }
        gym.end(&self.episode, transition, outcome);
    }

    /// What the trainer is told now: the decision due (none at the end),
    /// with the prompt a model policy would be sent for it, and the reward
    /// of the step just played with what the analysis of it needs.
    fn transition(&self, decision: Option<&sim::Decision>) -> gym::Transition {
        let first = decision.is_some_and(|d| d.step == 0);
        // The step the trainer's last action began (none before the first).
        let steps = self.sim.steps();
        let last = steps.last().filter(|_| !first);
        let ending = self.sim.ending();
        let observation = decision.map(|d| {
            let mut observation = serde_json::to_value(d).unwrap_or_default();
            let vars = self.sim.policy_vars();
            let prompt = self.inner.templates["policy"]
                .render(&vars)
                .ok()
                .and_then(|messages| serde_json::to_value(messages).ok());
            if let Some(o) = observation.as_object_mut() {
                o.insert("episode".to_owned(), Value::from(self.episode.as_str()));
                o.insert(
                    "turn".to_owned(),
                    vars.get("turn").cloned().unwrap_or_default(),
                );
                o.insert("prompt".to_owned(), prompt.unwrap_or_default());
            }
            observation
        });
        let mut info = serde_json::json!({"episode": self.episode});
        if let (Some(step), Some(o)) = (last, info.as_object_mut()) {
            let preferred = step.target_need.map(Need::strategy);
            o.insert(
                "preferred_strategy".to_owned(),
                serde_json::json!(preferred),
            );
            o.insert(
                "preference_match".to_owned(),
                Value::Bool(step.strategy.is_some() && step.strategy == preferred),
            );
            if let Ok(Value::Object(record)) = serde_json::to_value(step) {
                for (key, value) in record {
                    let key = match key.as_str() {
                        "reward" => "reward_parts".to_owned(),
                        "utterances" | "topic" | "policy_reply" | "robot" => continue,
                        _ => key,
                    };
                    o.insert(key, value);
                }
            }
        }
        gym::Transition {
            observation,
            reward: last.map_or(0.0, |s| s.reward.total),
            terminated: ending == Some(sim::Ending::Terminated),
            truncated: ending == Some(sim::Ending::Truncated),
            info,
        }
    }

    fn call(&mut self, ask: Ask) -> Step {
        let Ask {
            kind,
            mut vars,
            rejected,
        } = ask;
        let settings = &self.inner.settings;
        let messages = match (&rejected, &self.last, &self.last_reply) {
            (Some(why), Some((_, previous)), Some(reply)) => {
                let mut messages = previous.clone();
                messages.push(Message {
                    role: "assistant".to_owned(),
                    content: reply.clone(),
                });
                messages.push(Message {
                    role: "user".to_owned(),
                    content: format!(
                        "Your reply could not be used: {why}. Answer again, exactly in the format asked."
                    ),
                });
                messages
            }
            _ => {
                if kind == CallKind::Topic {
                    let topics = self
                        .inner
                        .topics
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner);
                    let mut used: Vec<Value> = topics
                        .iter()
                        .rev()
                        .take(AVOID_TOPICS)
                        .rev()
                        .map(|t| Value::from(t.as_str()))
                        .collect();
                    if let Some(Value::Array(own)) = vars.get("used_topics") {
                        for topic in own {
                            if !used.contains(topic) {
                                used.push(topic.clone());
                            }
                        }
                    }
                    vars.insert("used_topics".to_owned(), Value::Array(used));
                }
                let templates = &self.inner.templates[kind.as_str()];
                match templates.render(&vars) {
                    Ok(messages) => messages,
                    Err(err) => return self.failed(format!("task.conversation: {err}")),
                }
            }
        };
        let endpoint = match kind {
            CallKind::Speak(person) => &settings.personas[person.index()].endpoint,
            CallKind::Topic => &settings.topic.endpoint,
            CallKind::Score => &settings.scorer.call.endpoint,
            CallKind::Policy => &settings.policy.call.endpoint,
            CallKind::Robot => &settings.robot.endpoint,
        };
        let target = target(endpoint);
        let raw = match serde_json::value::to_raw_value(&messages) {
            Ok(raw) => raw,
            Err(err) => {
                return self.failed(format!("the {} call's messages: {err}", kind.as_str()));
            }
        };
        self.last = Some((kind, messages));
        Step::Call(Request {
            target,
            messages: raw,
            // A conversation started again is asked anew, not answered
            // from the cache with its first opening's lines.
            sample: self.sample.wrapping_add(self.sim.restarts()),
            rejected,
            prompt: None,
            images: Default::default(),
        })
    }

    fn failed(&self, why: String) -> Step {
        self.tell_end(Err(why.clone()));
        Step::Finish(Finish::failed(why, Assessment::default()))
    }

    /// The episode is over: its record and its totals.
    fn finish(&self) -> Step {
        let summary = self.sim.summary();
        self.tell_end(Ok(summary.clone()));
        let steps = self.sim.steps();
        let count = |keep: &dyn Fn(&sim::StepRecord) -> bool| {
            Score::value(steps.iter().filter(|s| keep(s)).count() as f64)
        };
        let total: f64 = steps.iter().map(|s| s.reward.total).sum();
        let scores: Scores = [
            ("reward", Score::value(total)),
            ("steps", Score::value(steps.len() as f64)),
            (
                "interventions",
                count(&|s| s.strategy.is_some_and(Strategy::intervenes)),
            ),
            ("stabilised", count(&|s| s.reward.stable_bonus > 0.0)),
            (
                "preference_matches",
                count(&|s| s.reward.preference_match_bonus > 0.0),
            ),
            ("invalid", count(&|s| !s.valid)),
            (
                "clipped_scores",
                Score::value(f64::from(self.sim.clipped_scores())),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        Step::Finish(Finish::done(
            summary.to_string(),
            Assessment {
                scores,
                ..Assessment::default()
            },
        ))
    }
}

fn target(endpoint: &Option<String>) -> Target {
    match endpoint {
        Some(name) => Target::Endpoint(Arc::from(name.as_str())),
        None => Target::Items,
    }
}

/// The topics of a run's stored episodes (their outputs), oldest first.
pub fn topics_of(outputs: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut topics: Vec<String> = Vec::new();
    for output in outputs {
        let Ok(summary) = serde_json::from_str::<Value>(&output) else {
            continue;
        };
        if let Some(list) = summary.get("topics").and_then(Value::as_array) {
            for topic in list.iter().filter_map(Value::as_str) {
                if !topics.iter().any(|t| t == topic) {
                    topics.push(topic.to_owned());
                }
            }
        }
    }
    topics
}
