//! One episode of the conversation as a state machine with no I/O: it says
//! which call it needs next ([`Next::Ask`]) or that a decision is due
//! ([`Next::Decide`]), and is told the reply or the strategy. The task
//! drives it with the fleet's calls and a policy; the environment server
//! drives it with a trainer's actions. Everything it draws comes from its
//! seed, so the same replies give the same episode.

use std::sync::Arc;

use serde::Serialize;
use serde_json::{Map, Value, json};

use super::relations;
use evalfleet_config::{ConversationSettings, EmaFormula, ScorerKind};
use evalfleet_eval::balance::{self, Edge, Need, Person, Reward, Strategy, TargetRule, Triangle};

/// The kinds of call an episode makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallKind {
    Topic,
    Speak(Person),
    Score,
    Policy,
    Robot,
}

impl CallKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Topic => "topic",
            Self::Speak(_) => "persona",
            Self::Score => "scorer",
            Self::Policy => "policy",
            Self::Robot => "robot",
        }
    }
}

/// A call the episode needs: its kind and the variables of its templates.
#[derive(Debug, Clone)]
pub struct Ask {
    pub kind: CallKind,
    pub vars: Map<String, Value>,
    /// Set when this asks again after a reply that could not be used: why.
    pub rejected: Option<String>,
}

/// The relations at a decision, and what balance makes of them.
#[derive(Debug, Clone, Serialize)]
pub struct Situation {
    pub relations: Triangle,
    pub pattern: String,
    pub stable: bool,
    pub instability: f64,
    /// None for a stable triangle (with `filter_zero_rewards: false`).
    pub target_edge: Option<Edge>,
    pub target_speaker: Option<Person>,
}

impl Situation {
    pub fn of(relations: Triangle, rule: TargetRule) -> Self {
        let target_edge = relations.target_edge(rule);
        Self {
            relations,
            pattern: relations.pattern(),
            stable: relations.stable(),
            instability: relations.instability(),
            target_edge,
            target_speaker: target_edge.map(|e| relations.target_speaker(e)),
        }
    }
}

/// A decision point: what the policy sees.
#[derive(Debug, Clone, Serialize)]
pub struct Decision {
    pub step: u32,
    #[serde(flatten)]
    pub situation: Situation,
    /// The conversation window the policy sees (`history.policy`).
    pub window: Vec<Utterance>,
    pub topic: String,
}

/// What the episode needs next.
#[derive(Debug)]
pub enum Next {
    Ask(Ask),
    Decide(Decision),
    Over,
}

/// How an episode ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Ending {
    /// `max_rounds` reached, or no unstable state within `max_auto_skip`
    /// (after the opening's restarts).
    Terminated,
    /// `max_steps` decisions made.
    Truncated,
}

/// One utterance of the conversation.
#[derive(Debug, Clone, Serialize)]
pub struct Utterance {
    /// `A`, `B`, `C` or `robot`.
    pub speaker: String,
    pub text: String,
}

impl Utterance {
    fn human(&self) -> bool {
        self.speaker != ROBOT
    }
}

const ROBOT: &str = "robot";

/// A triangle at a check, with its stability.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Check {
    pub relations: Triangle,
    pub stable: bool,
    pub target_positive: Option<bool>,
}

/// One decision and what came of it: a line of `conversation_summary.jsonl`.
#[derive(Debug, Clone, Serialize)]
pub struct StepRecord {
    pub step: u32,
    pub topic: String,
    /// Human utterances before the decision.
    pub turn: u32,
    /// Stable states skipped before it.
    pub auto_skips: u32,
    #[serde(flatten)]
    pub situation: Situation,
    pub target_need: Option<Need>,
    /// None: the policy's reply was not a strategy (invalid).
    pub strategy: Option<Strategy>,
    pub valid: bool,
    /// Why an invalid decision is: `reply` (a model policy's reply could
    /// not be read), `trainer` (a trainer's `invalid` action) or `timeout`
    /// (no action came in time). (A decision the trainer closes is no
    /// decision: the episode starts over.)
    pub invalid_reason: Option<String>,
    pub policy_reply: Option<String>,
    pub robot: Option<String>,
    /// The check at the horizon (the first of `checks`).
    pub at_horizon: Option<Check>,
    /// The last check made: at the end of the bonus duration, or the one
    /// that failed when the step ended there.
    pub at_end: Option<Check>,
    /// Every check of the step, from the horizon through each utterance of
    /// the bonus duration.
    pub checks: Vec<Check>,
    /// The step ended at a failed check, before its last utterance.
    pub cut_short: bool,
    pub reward: Reward,
    /// The utterances from the decision to the end of the step.
    pub utterances: Vec<Utterance>,
}

impl StepRecord {
    /// A decision's record as it begins: what was decided on, nothing yet
    /// of what came of it.
    pub fn begun(
        step: u32,
        topic: String,
        turn: u32,
        auto_skips: u32,
        situation: Situation,
        target_need: Option<Need>,
    ) -> Self {
        Self {
            step,
            topic,
            turn,
            auto_skips,
            situation,
            target_need,
            strategy: None,
            valid: false,
            invalid_reason: None,
            policy_reply: None,
            robot: None,
            at_horizon: None,
            at_end: None,
            checks: Vec::new(),
            cut_short: false,
            reward: Reward::default(),
            utterances: Vec::new(),
        }
    }
}

/// Where the episode is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Before the first decision: talk until an unstable state (skipping
    /// stable ones).
    Opening {
        skips: u32,
    },
    /// After a step: talk on until an unstable state.
    Between {
        skips: u32,
    },
    /// Waiting for a decision (or the policy's reply, or the robot's).
    Deciding,
    /// Human utterances after the intervention: to the horizon, then to
    /// the end of the bonus duration.
    Horizon {
        left: u32,
    },
    Duration {
        left: u32,
    },
    Over(Ending),
}

/// The call whose reply is awaited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiting {
    Nothing,
    Call(CallKind),
}

/// A tiny deterministic generator (SplitMix64): the episode's draws.
#[derive(Debug, Clone)]
pub struct Draws(u64);

impl Draws {
    /// Seeded by the run's seed and the episode's id.
    pub fn new(seed: u64, episode: &str) -> Self {
        // FNV-1a of the id, mixed with the seed.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in episode.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        Self(h ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in 0..n.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// The original system's smoothing (`scorer.ema_formula: adaptive`): per
/// pair, how many utterances each speaker had in the last window, and the
/// pair's last three counts of new utterances.
#[derive(Debug, Clone, Default)]
struct Adaptive {
    seen: [u32; 3],
    recent: [std::collections::VecDeque<u32>; 3],
}

/// A conversation the opening gave up on (stable through `max_auto_skip`),
/// kept in the record.
#[derive(Debug, Clone, Serialize)]
pub struct Restart {
    pub topic: String,
    pub conversation: Vec<Utterance>,
}

/// One episode under `rules: corrected`.
pub struct Corrected {
    settings: Arc<ConversationSettings>,
    episode: String,
    needs: [Need; 3],
    draws: Draws,
    topic: String,
    topics: Vec<String>,
    history: Vec<Utterance>,
    /// Human utterances so far.
    humans: u32,
    relations: Option<Triangle>,
    stage: Stage,
    waiting: Waiting,
    reasks: u32,
    steps: Vec<StepRecord>,
    /// The step being played.
    pub(super) current: Option<StepRecord>,
    /// Where the current step's utterances begin in `history`.
    step_from: usize,
    /// Stable states skipped before the coming decision.
    skipped: u32,
    scorer_calls: u32,
    invalid_scores: u32,
    /// Scores outside [-1, 1], clipped.
    clipped_scores: u32,
    /// The topic was given (fixed topics, or the item's): it is kept.
    fixed_topic: bool,
    adaptive: Adaptive,
    /// Conversations started again on a new topic.
    restarts: Vec<Restart>,
}

impl Corrected {
    /// Episode `episode`; `topic` when it is given (fixed topics, or the
    /// dataset's row), else it is asked for.
    pub fn new(settings: Arc<ConversationSettings>, episode: &str, topic: Option<String>) -> Self {
        let mut draws = Draws::new(settings.seed, episode);
        let drawn = [0, 1, 2].map(|_| Need::ALL[draws.below(Need::ALL.len())]);
        let needs = [0, 1, 2].map(|i| settings.personas[i].need.unwrap_or(drawn[i]));
        Self {
            settings,
            episode: episode.to_owned(),
            needs,
            draws,
            fixed_topic: topic.is_some(),
            topics: topic.iter().cloned().collect(),
            topic: topic.unwrap_or_default(),
            history: Vec::new(),
            humans: 0,
            relations: None,
            stage: Stage::Opening { skips: 0 },
            waiting: Waiting::Nothing,
            reasks: 0,
            steps: Vec::new(),
            current: None,
            step_from: 0,
            skipped: 0,
            scorer_calls: 0,
            invalid_scores: 0,
            clipped_scores: 0,
            adaptive: Adaptive::default(),
            restarts: Vec::new(),
        }
    }

    /// The topic talked about now (empty before the first is set).
    pub fn topic(&self) -> &str {
        &self.topic
    }

    pub fn needs(&self) -> [Need; 3] {
        self.needs
    }

    pub fn steps(&self) -> &[StepRecord] {
        &self.steps
    }

    /// How often the conversation started again.
    pub fn restarts(&self) -> u32 {
        self.restarts.len() as u32
    }

    /// Scores outside [-1, 1] the scorer gave, clipped.
    pub fn clipped_scores(&self) -> u32 {
        self.clipped_scores
    }

    pub fn ending(&self) -> Option<Ending> {
        match self.stage {
            Stage::Over(ending) => Some(ending),
            _ => None,
        }
    }

    /// A uniform draw of a strategy (the random policy's), from the
    /// episode's generator.
    pub fn random_strategy(&mut self) -> Strategy {
        Strategy::ALL[self.draws.below(Strategy::ALL.len())]
    }

    /// The first need.
    pub fn start(&mut self) -> Next {
        if self.topic.is_empty() {
            return self.ask(CallKind::Topic, None);
        }
        self.talk()
    }

    /// `reply` to the call asked last. An error ends the episode: a reply
    /// that could not be used after every re-ask.
    pub fn reply(&mut self, reply: &str) -> Result<Next, String> {
        let Waiting::Call(kind) = self.waiting else {
            return Err("a reply came when no call was asked".to_owned());
        };
        self.waiting = Waiting::Nothing;
        match kind {
            CallKind::Topic => {
                let topic = first_line(reply);
                if topic.is_empty() && self.reasks < self.settings.scorer.max_reasks {
                    self.reasks += 1;
                    return Ok(
                        self.ask(CallKind::Topic, Some("the reply held no topic".to_owned()))
                    );
                }
                self.reasks = 0;
                self.topic = if topic.is_empty() {
                    format!("topic {}", self.topics.len() + 1)
                } else {
                    topic
                };
                self.topics.push(self.topic.clone());
                Ok(self.talk())
            }
            CallKind::Speak(person) => {
                self.history.push(Utterance {
                    speaker: person.as_str().to_owned(),
                    text: reply.trim().to_owned(),
                });
                self.humans += 1;
                if self.humans > self.settings.scorer.start_after {
                    match self.settings.scorer.kind {
                        ScorerKind::Llm => return Ok(self.ask(CallKind::Score, None)),
                        ScorerKind::Rules => {
                            let window = self.human_window(self.settings.history.scorer);
                            let said: Vec<(Person, &str)> = window
                                .iter()
                                .filter_map(|u| person_of(&u.speaker).map(|p| (p, u.text.as_str())))
                                .collect();
                            let observed = relations::by_rules(&said, &self.settings.personas);
                            self.observe(observed, &window);
                        }
                    }
                }
                Ok(self.after_utterance())
            }
            CallKind::Score => {
                self.scorer_calls += 1;
                let names = [0, 1, 2].map(|i| self.settings.personas[i].name.as_str());
                match relations::parse(reply, names) {
                    Ok(scored) => {
                        self.reasks = 0;
                        if scored.clipped > 0 {
                            self.clipped_scores += scored.clipped;
                            tracing::warn!(
                                "episode {}: the relation scorer gave {} value(s) outside [-1, 1] at utterance {}, clipped (reply: {})",
                                self.episode,
                                scored.clipped,
                                self.humans,
                                excerpt(reply)
                            );
                        }
                        let window = self.human_window(self.settings.history.scorer);
                        self.observe(scored.relations, &window);
                        Ok(self.after_utterance())
                    }
                    Err(why) => {
                        self.invalid_scores += 1;
                        if self.reasks < self.settings.scorer.max_reasks {
                            self.reasks += 1;
                            Ok(self.ask(CallKind::Score, Some(why)))
                        } else {
                            Err(format!(
                                "the relation scorer's reply could not be used after {} re-ask(s): {why}",
                                self.reasks
                            ))
                        }
                    }
                }
            }
            CallKind::Policy => {
                let strategy = Strategy::parse_reply(reply);
                if let Some(current) = &mut self.current {
                    current.policy_reply = Some(reply.to_owned());
                }
                if strategy.is_none() && self.reasks < self.settings.policy.max_reasks {
                    self.reasks += 1;
                    return Ok(self.ask(
                        CallKind::Policy,
                        Some("the reply must be one digit: 1, 2, 3 or 4".to_owned()),
                    ));
                }
                self.reasks = 0;
                Ok(self.act(strategy))
            }
            CallKind::Robot => {
                self.history.push(Utterance {
                    speaker: ROBOT.to_owned(),
                    text: reply.trim().to_owned(),
                });
                if let Some(current) = &mut self.current {
                    current.robot = Some(reply.trim().to_owned());
                }
                Ok(self.talk())
            }
        }
    }

    /// The variables of the policy's messages at the decision due: what
    /// its call would be rendered with (a trainer's prompt).
    pub fn policy_vars(&self) -> Map<String, Value> {
        self.vars(CallKind::Policy)
    }

    /// The decision due is invalid for `reason` (see
    /// [`StepRecord::invalid_reason`]).
    pub fn act_invalid(&mut self, reason: &str) -> Next {
        if let Some(current) = &mut self.current {
            current.invalid_reason = Some(reason.to_owned());
        }
        self.act(None)
    }

    /// The policy's call for the decision due (when the policy is a model).
    pub fn ask_policy(&mut self) -> Next {
        self.ask(CallKind::Policy, None)
    }

    /// The strategy chosen at the decision due; `None`: the policy gave no
    /// valid one (recorded as invalid: no intervention, and its reward is
    /// the penalty, `rewards.invalid_penalty`).
    pub fn act(&mut self, strategy: Option<Strategy>) -> Next {
        let Some(current) = &mut self.current else {
            return Next::Over;
        };
        current.strategy = strategy;
        current.valid = strategy.is_some();
        current.invalid_reason = match strategy {
            Some(_) => None,
            None => current.invalid_reason.take().or(Some("reply".to_owned())),
        };
        self.step_from = self.history.len();
        self.stage = Stage::Horizon {
            left: self.settings.rewards.evaluation_horizon,
        };
        match strategy {
            Some(s) if s.intervenes() => self.ask(CallKind::Robot, None),
            _ => self.talk(),
        }
    }

    /// The episode's record: what `output` stores and the logs are made of.
    pub fn summary(&self) -> Value {
        let total: f64 = self.steps.iter().map(|s| s.reward.total).sum();
        json!({
            "episode": self.episode,
            "needs": {"A": self.needs[0], "B": self.needs[1], "C": self.needs[2]},
            "topics": self.topics,
            "ending": self.ending(),
            "human_utterances": self.humans,
            "scorer_calls": self.scorer_calls,
            "invalid_scores": self.invalid_scores,
            "clipped_scores": self.clipped_scores,
            "restarts": self.restarts,
            "total_reward": total,
            "steps": self.steps,
            "conversation": self.history,
        })
    }

    // --- the flow ---

    fn ask(&mut self, kind: CallKind, rejected: Option<String>) -> Next {
        self.waiting = Waiting::Call(kind);
        Next::Ask(Ask {
            kind,
            vars: self.vars(kind),
            rejected,
        })
    }

    /// The next human utterance, unless the episode is over.
    fn talk(&mut self) -> Next {
        let limit = self.settings.max_rounds * 3;
        let mid_step = matches!(self.stage, Stage::Horizon { .. } | Stage::Duration { .. });
        if !mid_step && self.humans >= limit {
            return self.end(Ending::Terminated);
        }
        let speaker = Person::ALL[(self.humans % 3) as usize];
        self.ask(CallKind::Speak(speaker), None)
    }

    fn end(&mut self, ending: Ending) -> Next {
        self.stage = Stage::Over(ending);
        self.waiting = Waiting::Nothing;
        Next::Over
    }

    /// A new score of the relations, seen over the scorer's `window`,
    /// smoothed with the last when `scorer.use_ema`.
    fn observe(&mut self, observed: Triangle, window: &[Utterance]) {
        let scorer = &self.settings.scorer;
        let mut seen = [0u32; 3];
        for u in window {
            if let Some(p) = person_of(&u.speaker) {
                seen[p.index()] += 1;
            }
        }
        // Per pair, the fewer of its two people's utterances new in the
        // window since the last score (the adaptive formula's `s`).
        let fresh = Edge::ALL.map(|edge| {
            let (x, y) = edge.people();
            let new = |p: Person| seen[p.index()].saturating_sub(self.adaptive.seen[p.index()]);
            new(x).min(new(y))
        });
        let previous = self.relations.filter(|_| scorer.use_ema);
        self.relations = Some(match (previous, scorer.ema_formula) {
            (None, _) => observed,
            (Some(previous), EmaFormula::Fixed) => {
                previous.smoothed(&observed, scorer.decay_factor)
            }
            (Some(previous), EmaFormula::Adaptive) => {
                let mix = |edge: Edge| {
                    let s = fresh[edge as usize];
                    let past: u32 = self.adaptive.recent[edge as usize].iter().sum();
                    let ratio = if s + past == 0 {
                        0.0
                    } else {
                        f64::from(s) / f64::from(s + past)
                    };
                    let a = (scorer.decay_factor * ratio).clamp(0.01, 1.0);
                    a * observed.get(edge) + (1.0 - a) * previous.get(edge)
                };
                Triangle::new(mix(Edge::AB), mix(Edge::BC), mix(Edge::CA))
            }
        });
        if scorer.use_ema && scorer.ema_formula == EmaFormula::Adaptive {
            for (recent, s) in self.adaptive.recent.iter_mut().zip(fresh) {
                recent.push_back(s);
                if recent.len() > 3 {
                    recent.pop_front();
                }
            }
            self.adaptive.seen = seen;
        }
    }

    /// After a human utterance (and its scoring).
    fn after_utterance(&mut self) -> Next {
        let scored = self.humans > self.settings.scorer.start_after;
        match self.stage {
            Stage::Opening { skips } | Stage::Between { skips } => {
                let opening = matches!(self.stage, Stage::Opening { .. });
                let may_restart = opening && self.restarts() < self.settings.topic_restarts;
                // max_rounds ends the episode: no decision begins at its
                // end (an opening that reached it undecided starts again).
                if self.humans >= self.settings.max_rounds * 3 {
                    if may_restart {
                        return self.restart();
                    }
                    return self.end(Ending::Terminated);
                }
                let Some(relations) = self.relations.filter(|_| scored) else {
                    return self.talk();
                };
                if !relations.stable() || !self.settings.filter_zero_rewards {
                    self.skipped = skips;
                    return self.decide(relations);
                }
                let skips = skips + 1;
                if skips > self.settings.max_auto_skip {
                    // Stable through max_auto_skip utterances: the opening
                    // starts again on a new topic (as often as
                    // topic_restarts); otherwise the episode ends.
                    if may_restart {
                        return self.restart();
                    }
                    return self.end(Ending::Terminated);
                }
                self.stage = if opening {
                    Stage::Opening { skips }
                } else {
                    Stage::Between { skips }
                };
                self.talk()
            }
            Stage::Horizon { left } if left > 1 => {
                self.stage = Stage::Horizon { left: left - 1 };
                self.talk()
            }
            Stage::Horizon { .. } => self.checkpoint(self.settings.rewards.terminal_bonus_duration),
            Stage::Duration { left } => self.checkpoint(left.saturating_sub(1)),
            Stage::Deciding | Stage::Over(_) => Next::Over,
        }
    }

    /// The conversation starts again on a new topic: asked for, or the
    /// next of the fixed `topics` (a dataset row's own topic is kept);
    /// fresh history and relations, and the round budget restored.
    fn restart(&mut self) -> Next {
        let conversation = std::mem::take(&mut self.history);
        self.restarts.push(Restart {
            topic: self.topic.clone(),
            conversation,
        });
        self.humans = 0;
        self.relations = None;
        self.adaptive = Adaptive::default();
        self.stage = Stage::Opening { skips: 0 };
        if !self.fixed_topic {
            return self.ask(CallKind::Topic, None);
        }
        let list = &self.settings.topics;
        if let Some(at) = list.iter().position(|t| *t == self.topic) {
            self.topic = list[(at + 1) % list.len()].clone();
            if !self.topics.contains(&self.topic) {
                self.topics.push(self.topic.clone());
            }
        }
        self.talk()
    }

    /// A check of the step under way, at the horizon or after an utterance
    /// of the bonus duration; `left`: the duration's utterances after it.
    /// The step ends after the last, or (with `end_step_when_lost`) at the
    /// first check that loses the bonus.
    fn checkpoint(&mut self, left: u32) -> Next {
        let check = self.check();
        let rewards = self.settings.rewards;
        let Some(current) = &mut self.current else {
            return Next::Over;
        };
        // The bonus can still be paid: a valid decision aimed at a target
        // that holds now.
        let payable = current.strategy.is_some()
            && current
                .situation
                .target_edge
                .is_some_and(|e| balance::holds(e, &check.relations));
        current.checks.push(check);
        current.at_horizon.get_or_insert(check);
        if left == 0 || (!payable && rewards.end_step_when_lost) {
            current.cut_short = left > 0;
            return self.finish_step();
        }
        self.stage = Stage::Duration { left };
        self.talk()
    }

    fn check(&self) -> Check {
        let relations = self.relations.unwrap_or(Triangle::new(0.0, 0.0, 0.0));
        let target = self.current.as_ref().and_then(|c| c.situation.target_edge);
        Check {
            relations,
            stable: relations.stable(),
            target_positive: target.map(|e| relations.positive(e)),
        }
    }

    fn decide(&mut self, relations: Triangle) -> Next {
        let situation = Situation::of(relations, self.settings.rewards.target_rule);
        let step = self.steps.len() as u32;
        self.current = Some(StepRecord::begun(
            step,
            self.topic.clone(),
            self.humans,
            self.skipped,
            situation.clone(),
            situation.target_speaker.map(|p| self.needs[p.index()]),
        ));
        self.stage = Stage::Deciding;
        Next::Decide(Decision {
            step,
            situation,
            window: self.window(self.settings.history.policy),
            topic: self.topic.clone(),
        })
    }

    fn finish_step(&mut self) -> Next {
        let Some(mut current) = self.current.take() else {
            return Next::Over;
        };
        current.at_end = current.checks.last().copied();
        current.utterances = self.history[self.step_from..].to_vec();
        let rewards = &self.settings.rewards;
        current.reward = match (
            current.strategy,
            current.situation.target_edge,
            current.target_need,
        ) {
            (None, _, _) => Reward::invalid(rewards),
            (Some(strategy), Some(edge), Some(need)) => {
                let triangles: Vec<Triangle> = current.checks.iter().map(|c| c.relations).collect();
                balance::reward(rewards, strategy, need, edge, &triangles)
            }
            // A stable triangle (unfiltered): no target, nothing to earn.
            (Some(_), _, _) => Reward::default(),
        };
        self.steps.push(current);
        let max_steps = self.settings.max_steps;
        if max_steps > 0 && self.steps.len() as u32 >= max_steps {
            return self.end(Ending::Truncated);
        }
        self.stage = Stage::Between { skips: 0 };
        // The state after the step may be the next decision already.
        if self.humans >= self.settings.max_rounds * 3 {
            return self.end(Ending::Terminated);
        }
        self.after_utterance()
    }

    // --- what calls see ---

    /// The last `n` human utterances and the robot's among them.
    fn window(&self, n: u32) -> Vec<Utterance> {
        let humans: Vec<usize> = (0..self.history.len())
            .filter(|&i| self.history[i].human())
            .collect();
        let from = humans
            .len()
            .checked_sub(n as usize)
            .map_or(0, |first| humans[first]);
        self.history[from..].to_vec()
    }

    /// The last `n` human utterances only.
    fn human_window(&self, n: u32) -> Vec<Utterance> {
        let mut out: Vec<Utterance> = self
            .history
            .iter()
            .rev()
            .filter(|u| u.human())
            .take(n as usize)
            .cloned()
            .collect();
        out.reverse();
        out
    }

    fn name(&self, speaker: &str) -> String {
        match person_of(speaker) {
            Some(p) => self.settings.personas[p.index()].name.clone(),
            None => "Robot".to_owned(),
        }
    }

    fn history_vars(&self, window: &[Utterance], vars: &mut Map<String, Value>) {
        let text = if window.is_empty() {
            "(nobody has spoken yet)".to_owned()
        } else {
            window
                .iter()
                .map(|u| format!("{}: {}", self.name(&u.speaker), u.text))
                .collect::<Vec<_>>()
                .join("\n")
        };
        let list: Vec<Value> = window
            .iter()
            .map(|u| json!({"speaker": u.speaker, "name": self.name(&u.speaker), "text": u.text}))
            .collect();
        vars.insert("history".to_owned(), Value::Array(list));
        vars.insert("history_text".to_owned(), Value::String(text));
    }

    fn vars(&self, kind: CallKind) -> Map<String, Value> {
        let s = &self.settings;
        let mut vars = Map::new();
        vars.insert("episode".to_owned(), json!(self.episode));
        vars.insert("topic".to_owned(), json!(self.topic));
        vars.insert("turn".to_owned(), json!(self.humans));
        vars.insert("step".to_owned(), json!(self.steps.len()));
        for (key, p) in [("name_a", 0), ("name_b", 1), ("name_c", 2)] {
            vars.insert(key.to_owned(), json!(s.personas[p].name));
        }
        match kind {
            CallKind::Topic => {
                vars.insert("used_topics".to_owned(), json!(self.topics));
            }
            CallKind::Speak(person) => {
                let persona = &s.personas[person.index()];
                let need = self.needs[person.index()];
                vars.insert("speaker".to_owned(), json!(person.as_str()));
                vars.insert("name".to_owned(), json!(persona.name));
                vars.insert("persona".to_owned(), json!(persona.prompt));
                vars.insert("need".to_owned(), json!(need.as_str()));
                vars.insert("need_text".to_owned(), json!(need_text(need)));
                vars.insert("landmines".to_owned(), json!(persona.landmines));
                self.history_vars(&self.window(s.history.persona), &mut vars);
            }
            CallKind::Score => {
                self.history_vars(&self.human_window(s.history.scorer), &mut vars);
            }
            CallKind::Policy | CallKind::Robot => {
                let window = if kind == CallKind::Policy {
                    s.history.policy
                } else {
                    s.history.robot
                };
                self.history_vars(&self.window(window), &mut vars);
                if let Some(current) = &self.current {
                    let situation = &current.situation;
                    let r = situation.relations;
                    vars.insert(
                        "relations".to_owned(),
                        json!({"AB": round2(r.ab), "BC": round2(r.bc), "CA": round2(r.ca)}),
                    );
                    vars.insert("pattern".to_owned(), json!(situation.pattern));
                    vars.insert("target_edge".to_owned(), json!(situation.target_edge));
                    vars.insert("target_speaker".to_owned(), json!(situation.target_speaker));
                    vars.insert(
                        "target_name".to_owned(),
                        json!(
                            current
                                .situation
                                .target_speaker
                                .map(|p| s.personas[p.index()].name.clone())
                        ),
                    );
                    if let Some(strategy) = current.strategy {
                        vars.insert("strategy".to_owned(), json!(strategy.as_str()));
                        vars.insert("strategy_text".to_owned(), json!(strategy_text(strategy)));
                    }
                }
            }
        }
        vars
    }
}

/// The start of a reply, for a message.
fn excerpt(reply: &str) -> String {
    const MAX: usize = 160;
    let flat = reply.split_whitespace().collect::<Vec<_>>().join(" ");
    match flat.char_indices().nth(MAX) {
        Some((at, _)) => format!("{}...", &flat[..at]),
        None => flat,
    }
}

fn person_of(speaker: &str) -> Option<Person> {
    Person::ALL.into_iter().find(|p| p.as_str() == speaker)
}

fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

fn first_line(reply: &str) -> String {
    reply
        .lines()
        .map(|l| l.trim().trim_matches('"').trim())
        .find(|l| !l.is_empty())
        .unwrap_or_default()
        .to_owned()
}

/// What a need means, as a persona is told.
pub fn need_text(need: Need) -> &'static str {
    match need {
        Need::Recognition => "you want your feelings and what you do to be acknowledged",
        Need::Mediation => "you want someone neutral to help the others understand each other",
        Need::Solution => "you want a concrete plan that settles the matter",
        Need::Independence => "you want to be left to work it out yourselves, without outside help",
    }
}

/// What a strategy asks of the robot.
pub fn strategy_text(strategy: Strategy) -> &'static str {
    match strategy {
        Strategy::Validate => "acknowledge the feelings and point of view of the person addressed",
        Strategy::Bridge => "point out common ground between the two people in conflict",
        Strategy::Plan => "propose a concrete next step everyone can agree to",
        Strategy::NoIntervention => "say nothing",
    }
}

#[cfg(test)]
mod tests;
