//! Which rules an episode follows: [`Sim`] is an episode under the
//! config's `rules`, [`Corrected`] (evalfleet's, [`super::sim`]) or
//! [`Original`] (the original system's, [`super::original`]), behind one
//! interface for the task and the environment server.

use std::borrow::Cow;
use std::sync::Arc;

use serde_json::{Map, Value};

use super::original::Original;
use super::sim::{Corrected, Ending, Next, StepRecord};
use evalfleet_config::{ConversationSettings, Rules};
use evalfleet_eval::balance::{Need, Strategy};

/// One episode, under the config's `rules`.
pub enum Sim {
    Corrected(Box<Corrected>),
    Original(Box<Original>),
}

macro_rules! both {
    ($self:ident, $sim:ident => $e:expr) => {
        match $self {
            Sim::Corrected($sim) => $e,
            Sim::Original($sim) => $e,
        }
    };
}

impl Sim {
    /// Episode `episode`; `topic` when it is given (fixed topics, or the
    /// dataset's row), else it is asked for.
    pub fn new(settings: Arc<ConversationSettings>, episode: &str, topic: Option<String>) -> Self {
        Self::seeded(settings, episode, topic, None)
    }

    /// The same, with the episode's own seed (a dataset row's `seed`):
    /// under `rules: original`, what Python's `random.seed` is given
    /// before the environment is made.
    pub fn seeded(
        settings: Arc<ConversationSettings>,
        episode: &str,
        topic: Option<String>,
        seed: Option<u64>,
    ) -> Self {
        match settings.rules {
            Rules::Original => Self::Original(Box::new(match seed {
                Some(seed) => Original::seeded(settings, episode, topic, seed, 1),
                None => Original::new(settings, episode, topic),
            })),
            Rules::Corrected => Self::Corrected(Box::new(Corrected::new(settings, episode, topic))),
        }
    }

    /// The topic talked about now (empty before the first is set).
    pub fn topic(&self) -> String {
        both!(self, sim => sim.topic().to_owned())
    }

    pub fn needs(&self) -> [Need; 3] {
        both!(self, sim => sim.needs())
    }

    /// The decisions so far (borrowed under `corrected`; the original's
    /// episode keeps them behind its lock, and gives a copy).
    pub fn steps(&self) -> Cow<'_, [StepRecord]> {
        match self {
            Sim::Corrected(sim) => Cow::Borrowed(sim.steps()),
            Sim::Original(sim) => Cow::Owned(sim.steps()),
        }
    }

    /// How often the conversation started again.
    pub fn restarts(&self) -> u32 {
        both!(self, sim => sim.restarts())
    }

    /// Scores outside [-1, 1] the scorer gave, clipped.
    pub fn clipped_scores(&self) -> u32 {
        both!(self, sim => sim.clipped_scores())
    }

    pub fn ending(&self) -> Option<Ending> {
        both!(self, sim => sim.ending())
    }

    /// A uniform draw of a strategy (the random policy's), from the
    /// episode's generator.
    pub fn random_strategy(&mut self) -> Strategy {
        both!(self, sim => sim.random_strategy())
    }

    /// The first need.
    pub fn start(&mut self) -> Next {
        both!(self, sim => sim.start())
    }

    /// `reply` to the call asked last. An error ends the episode: a reply
    /// that could not be used after every re-ask.
    pub fn reply(&mut self, reply: &str) -> Result<Next, String> {
        both!(self, sim => sim.reply(reply))
    }

    /// The variables of the policy's messages at the decision due.
    pub fn policy_vars(&self) -> Map<String, Value> {
        both!(self, sim => sim.policy_vars())
    }

    /// The decision due is invalid for `reason`.
    pub fn act_invalid(&mut self, reason: &str) -> Next {
        both!(self, sim => sim.act_invalid(reason))
    }

    /// The policy's call for the decision due (when the policy is a model).
    pub fn ask_policy(&mut self) -> Next {
        both!(self, sim => sim.ask_policy())
    }

    /// The decision due, from a model's raw `output` read by the episode's
    /// rules (a trainer's `output`).
    pub fn act_output(&mut self, output: &str) -> Next {
        match self {
            Sim::Corrected(sim) => {
                let strategy = Strategy::parse_reply(output);
                if let Some(current) = &mut sim.current {
                    current.policy_reply = Some(output.to_owned());
                }
                sim.act(strategy)
            }
            Sim::Original(sim) => sim.act_output(output),
        }
    }

    /// The strategy chosen at the decision due; `None`: invalid.
    pub fn act(&mut self, strategy: Option<Strategy>) -> Next {
        both!(self, sim => sim.act(strategy))
    }

    /// The episode's record: what `output` stores and the logs are made of.
    pub fn summary(&self) -> Value {
        both!(self, sim => sim.summary())
    }
}
