//! `task.conversation:` a simulated three-person conversation with a
//! robot that may intervene (`kind: conversation`). The raw structs' doc
//! comments are the user documentation of these keys (`docs/config.md`);
//! `docs/conversation.md` states the rules of balance and reward.

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::Value;

use super::MessageTemplate;

mod original_prompts;

/// The topics proposed so far, as the original tells its topic generator
/// (`rules: original`'s built-in topic message; a converted config's).
pub(crate) const TOPIC_USED_JA: &str = original_prompts::TOPIC_USER;
use super::problems::Problems;
use super::read;
use super::request::{RawMessage, message_list};
use evalfleet_eval::balance::{Need, RewardSettings, Strategy, TargetRule};

/// `task.conversation:`.
#[derive(Debug, Clone, PartialEq)]
pub struct ConversationSettings {
    /// Whose rules the episode follows: the original system's, step for
    /// step (`docs/conversation.md`, "rules: original"), or evalfleet's
    /// corrections of them. Default `original`.
    pub rules: Rules,
    /// `rules: original`: a persona line without hiragana is replaced by
    /// the original's fallback line, as its human simulator does (it
    /// speaks Japanese). Default true with `rules: original`.
    pub require_hiragana: bool,
    /// Episodes to simulate when the config has no `dataset:` (each an
    /// item `{"episode": i}`); `evalfleet simulate --sessions N` overrides
    /// it. Default 10.
    pub sessions: u64,
    /// Rounds of three human utterances after which an episode ends
    /// (terminated). A step begun before then is played to its end.
    /// Default 6.
    pub max_rounds: u32,
    /// Decisions after which an episode ends (truncated); 0: no limit.
    /// `--max-steps` overrides it. Default 8 under `rules: original`
    /// (its environment's steps), 0 under `rules: corrected`.
    pub max_steps: u32,
    /// Seed of every random draw (needs, a random policy): an episode's
    /// draws depend only on it and the episode's id. Default 0.
    pub seed: u64,
    /// A, B and C, in that order.
    pub personas: Vec<Persona>,
    /// `persona_messages`: what each persona is sent for its next
    /// utterance (templates over the call's variables, its `name`,
    /// `persona`, `need`, `need_text` and `landmines` among them).
    pub persona_messages: Vec<MessageTemplate>,
    /// Fixed topics, episode i taking topic i mod their number (a dataset
    /// row's `topic` field overrides). Without them each episode's topic
    /// is asked of `topic`.
    pub topics: Vec<String>,
    /// The topic generator: told the topics the run used already.
    pub topic: CallSettings,
    /// How many of the last human utterances each call sees.
    pub history: HistoryWindows,
    pub scorer: ScorerSettings,
    pub policy: PolicySettings,
    /// The robot's utterance for the chosen strategy (none for
    /// no_intervention).
    pub robot: CallSettings,
    pub rewards: RewardSettings,
    /// Skip stable states (which can earn no reward) by letting the humans
    /// talk on, up to `max_auto_skip` utterances; then the conversation
    /// starts again on a new topic (before the first decision, as often as
    /// `topic_restarts`) or the episode ends. Default true.
    pub filter_zero_rewards: bool,
    /// Default 10.
    pub max_auto_skip: u32,
    /// Default 1.
    pub topic_restarts: u32,
    pub alarms: AlarmSettings,
    /// Episodes per line of `batch_summary.jsonl` and `metrics.jsonl` (a
    /// PPO batch; `evalfleet env --batch-size` overrides it). Default 16.
    pub batch_size: u32,
}

/// Whose rules an episode follows (`task.conversation.rules`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Rules {
    /// The original system's (yoshinari0312/policyRL_relation_robot at
    /// aa1a845), its quirks included.
    #[default]
    Original,
    /// evalfleet's: the original's bugs fixed.
    Corrected,
}

impl Rules {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Original => "original",
            Self::Corrected => "corrected",
        }
    }
}

/// One human persona.
#[derive(Debug, Clone, PartialEq)]
pub struct Persona {
    /// Default `A`, `B`, `C`.
    pub name: String,
    /// Who they are (the `persona` variable of its messages).
    pub prompt: String,
    /// Subjects that provoke them when others raise them.
    pub landmines: Vec<String>,
    /// Their emotional need in every episode (`recognition`, `mediation`,
    /// `solution` or `independence`); default drawn per episode from the
    /// four, seeded.
    pub need: Option<Need>,
    /// The endpoint (by name, `role: judge`) that speaks for them; default
    /// the endpoints that answer items.
    pub endpoint: Option<String>,
    /// The words that set the tone of their utterances for the rules
    /// scorer.
    pub words: ToneWords,
}

/// A persona's warm and cold words for the rules scorer (`scorer: {kind:
/// rules}`): the built-in English and Japanese lists, with the persona's
/// own added (or alone, without the built-ins).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToneWords {
    /// `warm_words`: added to the built-in warm words.
    pub warm: Vec<String>,
    /// `cold_words`: added to the built-in cold words.
    pub cold: Vec<String>,
    /// `builtin_words`: whether the built-in lists count too. Default true.
    pub builtin: bool,
}

impl Default for ToneWords {
    fn default() -> Self {
        Self {
            warm: Vec::new(),
            cold: Vec::new(),
            builtin: true,
        }
    }
}

/// The messages of one kind of call, and who answers it.
#[derive(Debug, Clone, PartialEq)]
pub struct CallSettings {
    /// Chat messages, minijinja templates over the call's variables
    /// (`docs/conversation.md` lists them).
    pub messages: Vec<MessageTemplate>,
    /// The endpoint (by name, `role: judge`) that answers; default the
    /// endpoints that answer items.
    pub endpoint: Option<String>,
}

/// `history:` a number for every call, or `{persona, scorer, policy,
/// robot}`. Default 6.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistoryWindows {
    /// The personas, the policy and the robot see the last N human
    /// utterances and the robot's among them; the scorer sees the human
    /// ones only.
    pub persona: u32,
    pub scorer: u32,
    pub policy: u32,
    pub robot: u32,
}

/// `scorer:` how relations are scored after each human utterance.
#[derive(Debug, Clone, PartialEq)]
pub struct ScorerSettings {
    /// `llm` (the default: `messages` sent to `endpoint`, the reply read as
    /// `{"AB": x, "BC": y, "CA": z}` or `A-B: x, ...` with the pairs in any
    /// order, values outside [-1, 1] clipped and counted, re-asked when a
    /// pair is missing) or `rules` (no call: words and landmines counted,
    /// `docs/conversation.md`).
    pub kind: ScorerKind,
    pub call: CallSettings,
    /// Smooth each edge with the last (`ema_formula`). Default false.
    pub use_ema: bool,
    pub ema_formula: EmaFormula,
    /// Default 0.5 (`fixed`), 1.5 (`adaptive`).
    pub decay_factor: f64,
    /// Nothing is scored (and no reward computed) during the first N human
    /// utterances. Default 3.
    pub start_after: u32,
    /// Re-asks of a reply that cannot be read; then the episode fails.
    /// Default 2.
    pub max_reasks: u32,
}

/// How `use_ema` smooths a relation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EmaFormula {
    /// `decay_factor x previous + (1 - decay_factor) x new`.
    Fixed,
    /// The original system's: per pair, `alpha = clamp(decay_factor x s /
    /// (s + past), 0.01, 1)` where `s` is the fewer of the two people's new
    /// utterances in the scorer's window since the last score and `past`
    /// the sum of the pair's last three `s`; `alpha x new + (1 - alpha) x
    /// previous`.
    Adaptive,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScorerKind {
    Llm,
    Rules,
}

/// `policy:` who chooses the strategy at a decision.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicySettings {
    pub kind: PolicyKind,
    /// For `kind: model`.
    pub call: CallSettings,
    /// Re-asks of a reply that is not one digit 1 to 4; then the decision
    /// is recorded as invalid (no intervention, no reward). Default 1.
    pub max_reasks: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// `model` (the default): a call, to `endpoint` or the endpoints that
    /// answer items (the model under evaluation).
    Model,
    /// `fixed` with `strategy: 1..4`: a baseline.
    Fixed(Strategy),
    /// `random`: uniform, seeded by `seed` and the episode.
    Random,
    /// `external`: a trainer takes each decision through `evalfleet env`'s
    /// `reset` and `step`.
    External,
}

/// `alarms:` policy collapse, over the last `window` decisions of the run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AlarmSettings {
    /// Default 100.
    pub window: u32,
    /// One strategy above this share of the window. Default 0.8.
    pub max_share: f64,
    /// The window's strategy entropy (bits) below this. Default 1.0.
    pub min_entropy: f64,
    /// One choice this many decisions in a row. Default 20.
    pub max_run: u32,
}

const PERSONA_SYSTEM: &str = "You are {{ name }}, one of three people ({{ name_a }}, {{ name_b }} and {{ name_c }}) talking about: {{ topic }}.\n{{ persona }}\nWhat you need from this conversation: {{ need_text }}.\n{% if landmines %}Subjects that upset you when others raise them: {{ landmines | join(', ') }}.\n{% endif %}A robot mediator may speak too. Reply with your next utterance only: one or two sentences, in character.";
const PERSONA_USER: &str = "The conversation so far:\n{{ history_text }}\n\nYour turn, {{ name }}.";
const TOPIC_SYSTEM: &str = "You suggest topics for a conversation among three people that can lead to disagreement: a shared flat, a family trip, a project at work.";
const TOPIC_USER: &str = "Suggest one new topic in under ten words{% if used_topics %}, different from these: {{ used_topics | join('; ') }}{% endif %}. Reply with the topic only.";
const SCORER_SYSTEM: &str = "You rate the relations between three people in a conversation: A ({{ name_a }}), B ({{ name_b }}) and C ({{ name_c }}).";
const SCORER_USER: &str = "{{ history_text }}\n\nRate each pair's relation from -1 (hostile) to 1 (warm). Reply with JSON only: {\"AB\": number, \"BC\": number, \"CA\": number}";
const POLICY_SYSTEM: &str = "You are a robot mediator in a conversation among {{ name_a }} (A), {{ name_b }} (B) and {{ name_c }} (C). Choose how to intervene: 1 validate (acknowledge the feelings of the person addressed), 2 bridge (point out common ground between the two in conflict), 3 plan (propose a concrete next step), 4 no_intervention (stay silent).\nEach person has an emotional need; infer the addressed person's from what they say, and choose the strategy that answers it:\n- recognition (wants their feelings and views acknowledged): 1 validate\n- mediation (wants the conflict softened and the two brought together): 2 bridge\n- solution (wants a concrete direction or action): 3 plan\n- independence (wants to settle it themselves, without interference): 4 no_intervention\nReply with the digit only.";
const POLICY_USER: &str = "Conversation:\n{{ history_text }}\n\nRelations: AB {{ relations.AB }}, BC {{ relations.BC }}, CA {{ relations.CA }}. The strained relation is {{ target_edge }}; the person to address is {{ target_name }} ({{ target_speaker }}). Your choice (1-4):";
const ROBOT_SYSTEM: &str = "You are a robot mediator in a conversation among {{ name_a }} (A), {{ name_b }} (B) and {{ name_c }} (C). Speak briefly: one or two sentences.";
const ROBOT_USER: &str = "Conversation:\n{{ history_text }}\n\nYour strategy: {{ strategy }} ({{ strategy_text }}). Address {{ target_name }}. Reply with your utterance only.";

fn default_messages(system: &str, user: &str) -> Vec<MessageTemplate> {
    vec![
        MessageTemplate::text("system", system),
        MessageTemplate::text("user", user),
    ]
}

impl ConversationSettings {
    /// The endpoints its calls are addressed to by name, each with the key
    /// that names it.
    pub fn named_endpoints(&self) -> Vec<(String, &str)> {
        let mut out = Vec::new();
        for (i, persona) in self.personas.iter().enumerate() {
            if let Some(name) = &persona.endpoint {
                out.push((format!("personas[{i}].endpoint"), name.as_str()));
            }
        }
        for (key, call) in [
            ("topic", &self.topic),
            ("scorer", &self.scorer.call),
            ("policy", &self.policy.call),
            ("robot", &self.robot),
        ] {
            if let Some(name) = &call.endpoint {
                out.push((format!("{key}.endpoint"), name.as_str()));
            }
        }
        out
    }
}

/// `kind: conversation`: a simulated three-person conversation with a robot
/// that may intervene; an item is an episode (`docs/conversation.md` states
/// the rules of balance and reward). Default: every key's default.
#[derive(Debug, Default, Deserialize, JsonSchema)]
pub(super) struct RawConversation {
    /// `original`: every rule as the original system's code plays it,
    /// step for step, its quirks included (`docs/conversation.md`);
    /// `corrected`: evalfleet's rules, the original's bugs fixed (each
    /// difference listed there). Default `original`.
    rules: Option<String>,
    /// `rules: original`: replace a persona line without hiragana by the
    /// original's fallback line (its human simulator speaks Japanese).
    /// Default `true` with `rules: original` (whose built-in messages are
    /// Japanese).
    require_hiragana: Option<bool>,
    /// Episodes to simulate when the config has no `dataset:` (each an item
    /// `{"episode": i}`); `evalfleet simulate --sessions N` overrides it.
    /// Default 10.
    sessions: Option<u64>,
    /// Rounds of three human utterances after which an episode ends
    /// (terminated), 1 to 1000; a step begun before then is played to its
    /// end. Default 6.
    max_rounds: Option<u32>,
    /// Decisions after which an episode ends (truncated); 0: no limit.
    /// With `rules: original`, the environment's steps (decisions and the
    /// trainer's steps in stable states) after which it ends, at least 1
    /// (`max_rounds` is unused there, as in the original). `--max-steps`
    /// overrides it. Default 8 under `rules: original` (the default), 0
    /// under `rules: corrected`.
    max_steps: Option<u32>,
    /// Seed of every random draw (needs, a random policy): an episode's
    /// draws depend only on it and the episode's id. Default 0.
    seed: Option<u64>,
    /// The three human personas, A, B and C in that order (exactly three).
    /// Default: `A`, `B` and `C`, each with every key's default.
    personas: Option<Vec<RawPersona>>,
    /// What each persona is sent for its next utterance: templates over the
    /// call's variables, its `name`, `persona`, `need`, `need_text` and
    /// `landmines` among them (`docs/conversation.md` lists them). Default:
    /// built-in messages.
    persona_messages: Option<Vec<RawMessage>>,
    /// Fixed topics, episode i taking topic i mod their number (a dataset
    /// row's `topic` field overrides). Default: none (each episode's topic
    /// is asked of `topic`).
    topics: Option<Vec<String>>,
    /// The topic generator's call: it is told the topics the run used
    /// already. Default: built-in messages (Japanese with `rules: original`), answered by the endpoints that
    /// answer items.
    topic: Option<RawCall>,
    /// How many of the last human utterances each call sees: one number
    /// for every call, or a mapping with one for each. The personas, the
    /// policy and the robot see the robot's utterances among them; the
    /// scorer sees the human ones only. Default: under `rules: original`
    /// (the default) the original's, 12 for the personas, 3 for the scorer,
    /// 6 for the policy and the robot; under `rules: corrected`, 6 each.
    history: Option<RawHistory>,
    scorer: Option<RawScorer>,
    policy: Option<RawPolicy>,
    /// The robot's utterance for the chosen strategy (none for
    /// `no_intervention`). Default: built-in messages (Japanese with `rules: original`), answered by the
    /// endpoints that answer items.
    robot: Option<RawCall>,
    rewards: Option<RawRewards>,
    alarms: Option<RawAlarms>,
    /// Episodes per line of `batch_summary.jsonl` and `metrics.jsonl` (a
    /// PPO batch; `evalfleet env --batch-size` overrides it); with `rules:
    /// original`, `batch_summary.jsonl` is the original trainer's, a record
    /// per `batch_size` decisions. Default 16.
    batch_size: Option<u32>,
}

/// One human persona.
#[derive(Debug, Default, Deserialize, JsonSchema)]
struct RawPersona {
    /// Their name. Default `A`, `B` or `C`, by their place.
    name: Option<String>,
    /// Who they are (the `persona` variable of their messages). Default:
    /// none.
    prompt: Option<String>,
    /// Subjects that provoke them when others raise them. Default: none.
    landmines: Option<Vec<String>>,
    /// Their emotional need in every episode: `recognition`, `mediation`,
    /// `solution` or `independence`. Default: drawn for each episode from
    /// the four, seeded.
    need: Option<String>,
    /// The endpoint (by name, with `role: judge`) that speaks for them.
    /// Default: the endpoints that answer items.
    endpoint: Option<String>,
    /// The rules scorer: words that warm their relations when they say
    /// them, added to the built-in English and Japanese ones (a Japanese
    /// word counts wherever it appears, a Latin one as a whole word).
    /// Default: none.
    warm_words: Option<Vec<String>>,
    /// The rules scorer: words that cool their relations when they say
    /// them, added to the built-in ones. Default: none.
    cold_words: Option<Vec<String>>,
    /// The rules scorer: whether the built-in warm and cold words count
    /// for them too; `false` leaves their own `warm_words` and `cold_words`
    /// alone. Default `true`.
    builtin_words: Option<bool>,
}

/// The messages of one kind of call, and who answers it.
#[derive(Debug, Default, Deserialize, JsonSchema)]
struct RawCall {
    /// Chat messages, minijinja templates over the call's variables
    /// (`docs/conversation.md` lists them). Default: built-in messages (Japanese with `rules: original`).
    messages: Option<Vec<RawMessage>>,
    /// The endpoint (by name, with `role: judge`) that answers. Default: the
    /// endpoints that answer items.
    endpoint: Option<String>,
}

// An untagged enum reads its value whole, so no unknown key of it reaches
// serde_ignored: the schema's closed mapping has them taken out and
// reported instead (`read::section`).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(untagged, deny_unknown_fields)]
enum RawHistory {
    All(u32),
    Each {
        /// Utterances a persona's call sees. Default 6.
        persona: Option<u32>,
        /// Utterances the scorer's call sees. Default 6.
        scorer: Option<u32>,
        /// Utterances the policy's call sees. Default 6.
        policy: Option<u32>,
        /// Utterances the robot's call sees. Default 6.
        robot: Option<u32>,
    },
}

/// How the relations between the three are scored after each human
/// utterance. Default: every key's default.
#[derive(Debug, Default, Deserialize, JsonSchema)]
struct RawScorer {
    /// `llm` (`messages` sent to `endpoint`, the reply read as `{"AB": x,
    /// "BC": y, "CA": z}` or `A-B: x, ...` with the pairs in any order,
    /// values outside [-1, 1] clipped and counted, re-asked when a pair is
    /// missing) or `rules` (no call: words and landmines counted,
    /// `docs/conversation.md`). Default `llm`.
    kind: Option<String>,
    /// `llm`: the scorer's messages (`docs/conversation.md` lists their
    /// variables). Default: built-in messages (Japanese with `rules: original`).
    messages: Option<Vec<RawMessage>>,
    /// `llm`: the endpoint (by name, with `role: judge`) that scores.
    /// Default: the endpoints that answer items.
    endpoint: Option<String>,
    /// Smooth each relation with the previous score, by `ema_formula`.
    /// Default `false`.
    use_ema: Option<bool>,
    /// `fixed`: `decay_factor` × previous + (1 − `decay_factor`) × new.
    /// `adaptive` (the original system's): per pair, alpha =
    /// clamp(`decay_factor` × s / (s + past), 0.01, 1), where s is the fewer
    /// of the two people's new utterances in the scorer's window since the
    /// last score and past the sum of the pair's last three s; then alpha ×
    /// new + (1 − alpha) × previous. A pair's first score is taken as is.
    /// Default `fixed`, or `adaptive` when `decay_factor` is 1 or more (as
    /// the original system's configs set it).
    ema_formula: Option<String>,
    /// `fixed`: the weight of the previous score, at least 0 and below 1.
    /// `adaptive`: the factor of alpha, above 0. Default 0.5 (`fixed`), 1.5
    /// (`adaptive`).
    decay_factor: Option<f64>,
    /// Nothing is scored (and no reward computed) during the first N human
    /// utterances. Default 3.
    start_relation_check_after_utterances: Option<u32>,
    /// Re-asks of a reply that cannot be read; then the episode fails.
    /// Default 2.
    max_reasks: Option<u32>,
}

/// Who chooses the robot's strategy at a decision. Default: every key's
/// default.
#[derive(Debug, Default, Deserialize, JsonSchema)]
struct RawPolicy {
    /// `model` (a call, to `endpoint` or the endpoints that answer items:
    /// the model under evaluation), `fixed` (always `strategy`, a
    /// baseline), `random` (uniform, seeded by `seed` and the episode) or
    /// `external` (a trainer takes each decision through `evalfleet env`'s
    /// `reset` and `step`). Default `model`.
    kind: Option<String>,
    /// `fixed`: 1 (validate), 2 (bridge), 3 (plan) or 4 (no_intervention).
    /// Required with `kind: fixed`.
    strategy: Option<u8>,
    /// `model`: the policy's messages (`docs/conversation.md` lists their
    /// variables); `external`: rendered the same, they are the `prompt` of
    /// a trainer's observations. Default: built-in messages (Japanese with `rules: original`).
    messages: Option<Vec<RawMessage>>,
    /// `model`: the endpoint (by name, with `role: judge`) that decides.
    /// Default: the endpoints that answer items.
    endpoint: Option<String>,
    /// Re-asks of a reply that is not one digit 1 to 4; then the decision
    /// is recorded as invalid (no intervention, no reward). Default 1.
    max_reasks: Option<u32>,
}

/// What an intervention earns (`docs/conversation.md`). Default: every
/// key's default.
#[derive(Debug, Default, Deserialize, JsonSchema)]
struct RawRewards {
    /// Earned when, `evaluation_horizon` human utterances after the
    /// decision, the target relation is positive and the triangle is
    /// stable, and both still hold after each of the next
    /// `terminal_bonus_duration` utterances. Default 2.0.
    stable_bonus: Option<f64>,
    /// Earned when the strategy answers the need of the target speaker (the
    /// person addressed). Default 0.5.
    preference_match_bonus: Option<f64>,
    /// Human utterances after a decision at which the target relation and
    /// the triangle are first checked, at least 1. Default 3.
    evaluation_horizon: Option<u32>,
    /// Human utterances after that through which both must still hold
    /// (checked after each). Default 2.
    terminal_bonus_duration: Option<u32>,
    /// The negative relation a decision aims at in an unstable triangle:
    /// `closest_to_zero` (the cheapest to turn positive, as the original
    /// system) or `most_negative`. Default `closest_to_zero`.
    target_edge: Option<String>,
    /// End a step at the first check that loses the stable bonus (at the
    /// horizon or inside the duration), rather than playing its remaining
    /// utterances for a bonus that can no longer be paid. Default `true`.
    end_step_when_lost: Option<bool>,
    /// What an invalid decision (a policy reply that is not a strategy, a
    /// trainer's `invalid` action, or no action in time) costs: its reward
    /// is minus this, at least 0. Default 1.0.
    invalid_penalty: Option<f64>,
    /// Skip stable states (which can earn no reward) by letting the humans
    /// talk on, up to `max_auto_skip` utterances; then the conversation
    /// starts again on a new topic (before the first decision, as often as
    /// `topic_restarts`) or the episode ends. Default `true`.
    filter_zero_rewards: Option<bool>,
    /// The most utterances skipped that way. Default 10.
    max_auto_skip: Option<u32>,
    /// How often an opening that stays stable through `max_auto_skip`
    /// utterances starts again on a new topic (fresh history and
    /// relations, the round budget restored); then the episode ends.
    /// Default 1.
    topic_restarts: Option<u32>,
}

/// Alarms of policy collapse, over the last `window` decisions of the run.
/// Default: every key's default.
#[derive(Debug, Default, Deserialize, JsonSchema)]
struct RawAlarms {
    /// Decisions the alarms look at. Default 100.
    window: Option<u32>,
    /// Alarm when one strategy takes more than this share of the window.
    /// Default 0.8.
    max_share: Option<f64>,
    /// Alarm when the window's strategy entropy (bits) falls below this.
    /// Default 1.0.
    min_entropy: Option<f64>,
    /// Alarm when one strategy (or `invalid`) is chosen this many decisions
    /// in a row, whether or not the window is full. Default 20.
    max_run: Option<u32>,
}

const AT: &str = "task.conversation";

/// A list of words as given, less the empty ones.
fn words(list: Option<Vec<String>>) -> Vec<String> {
    list.unwrap_or_default()
        .into_iter()
        .filter(|w| !w.trim().is_empty())
        .collect()
}

/// `task.conversation` validated (`value` absent: every default).
pub(super) fn conversation(
    value: Option<&Value>,
    p: &mut Problems<'_>,
) -> Option<ConversationSettings> {
    let raw = match value {
        Some(value) => read::section::<RawConversation>(value, AT, p.0)?,
        None => RawConversation::default(),
    };
    let mut ok = true;
    let mut bad = |p: &mut Problems<'_>, at: &str, message: String| {
        ok = false;
        p.push::<()>(&format!("{AT}.{at}"), message);
    };
    let sessions = raw.sessions.unwrap_or(10);
    if sessions == 0 {
        bad(p, "sessions", "must be at least 1, got 0".to_owned());
    }
    let rules = match raw.rules.as_deref() {
        None => Rules::default(),
        Some(name) => match [Rules::Original, Rules::Corrected]
            .into_iter()
            .find(|r| r.as_str() == name)
        {
            Some(rules) => rules,
            None => {
                bad(
                    p,
                    "rules",
                    format!("must be original or corrected, got '{name}'"),
                );
                Rules::default()
            }
        },
    };
    let max_rounds = raw.max_rounds.unwrap_or(6);
    if !(1..=1000).contains(&max_rounds) {
        bad(
            p,
            "max_rounds",
            format!("must be between 1 and 1000, got {max_rounds}"),
        );
    }
    let personas = match raw.personas {
        None => ["A", "B", "C"]
            .iter()
            .map(|name| Persona {
                name: (*name).to_owned(),
                prompt: String::new(),
                landmines: Vec::new(),
                need: None,
                endpoint: None,
                words: ToneWords::default(),
            })
            .collect(),
        Some(list) if list.len() != 3 => {
            bad(
                p,
                "personas",
                format!("must list exactly three personas (A, B and C), got {}", list.len()),
            );
            Vec::new()
        }
        Some(list) => list
            .into_iter()
            .zip(["A", "B", "C"])
            .enumerate()
            .map(|(i, (raw, letter))| Persona {
                need: raw.need.as_deref().and_then(|need| {
                    let found = Need::ALL.into_iter().find(|n| n.as_str() == need);
                    if found.is_none() {
                        bad(
                            p,
                            &format!("personas[{i}].need"),
                            format!("must be recognition, mediation, solution or independence, got '{need}'"),
                        );
                    }
                    found
                }),
                name: raw
                    .name
                    .filter(|n| !n.trim().is_empty())
                    .unwrap_or_else(|| letter.to_owned()),
                prompt: raw.prompt.unwrap_or_default(),
                landmines: words(raw.landmines),
                endpoint: raw.endpoint,
                words: ToneWords {
                    warm: words(raw.warm_words),
                    cold: words(raw.cold_words),
                    builtin: raw.builtin_words.unwrap_or(true),
                },
            })
            .collect(),
    };
    let topics: Vec<String> = raw.topics.unwrap_or_default();
    if topics.iter().any(|t| t.trim().is_empty()) {
        bad(p, "topics", "must not hold an empty topic".to_owned());
    }
    // The built-in messages: English, or under rules: original Japanese
    // as the original speaks (the scorer's one user message).
    let defaults = |english: (&str, &str), original: (&str, &str)| -> Vec<MessageTemplate> {
        let (system, user) = match rules {
            Rules::Original => original,
            Rules::Corrected => english,
        };
        if system.is_empty() {
            vec![MessageTemplate::text("user", user)]
        } else {
            default_messages(system, user)
        }
    };
    let call =
        |raw: Option<RawCall>, at: &str, defaults: Vec<MessageTemplate>, p: &mut Problems<'_>| {
            let raw = raw.unwrap_or_default();
            let messages = match raw.messages {
                None => Some(defaults),
                Some(list) => message_list(list, &format!("{AT}.{at}"), p).and_then(|messages| {
                    // A conversation's calls carry text only.
                    match messages.iter().position(|m| !m.parts.is_empty()) {
                        Some(i) => p.push(
                            &format!("{AT}.{at}[{i}]"),
                            "a conversation's messages are text only (no parts or images)",
                        ),
                        None => Some(messages),
                    }
                }),
            };
            messages.map(|messages| CallSettings {
                messages,
                endpoint: raw.endpoint,
            })
        };
    use original_prompts as ja;
    let topic = call(
        raw.topic,
        "topic.messages",
        defaults(
            (TOPIC_SYSTEM, TOPIC_USER),
            (ja::TOPIC_SYSTEM, ja::TOPIC_USER),
        ),
        p,
    );
    let robot = call(
        raw.robot,
        "robot.messages",
        defaults(
            (ROBOT_SYSTEM, ROBOT_USER),
            (ja::ROBOT_SYSTEM, ja::ROBOT_USER),
        ),
        p,
    );
    let persona_call = call(
        Some(RawCall {
            messages: raw.persona_messages,
            endpoint: None,
        }),
        "persona_messages",
        defaults(
            (PERSONA_SYSTEM, PERSONA_USER),
            (ja::PERSONA_SYSTEM, ja::PERSONA_USER),
        ),
        p,
    );
    // The original's windows (max_history_human 12, max_history_relation
    // 3, max_history 6) under rules: original; 6 each otherwise.
    let window = |original: u32| match rules {
        Rules::Original => original,
        Rules::Corrected => 6,
    };
    let history = match raw.history {
        None => HistoryWindows {
            persona: window(12),
            scorer: window(3),
            policy: window(6),
            robot: window(6),
        },
        Some(RawHistory::All(n)) => HistoryWindows {
            persona: n,
            scorer: n,
            policy: n,
            robot: n,
        },
        Some(RawHistory::Each {
            persona,
            scorer,
            policy,
            robot,
        }) => HistoryWindows {
            persona: persona.unwrap_or(window(12)),
            scorer: scorer.unwrap_or(window(3)),
            policy: policy.unwrap_or(window(6)),
            robot: robot.unwrap_or(window(6)),
        },
    };
    if [
        history.persona,
        history.scorer,
        history.policy,
        history.robot,
    ]
    .contains(&0)
    {
        bad(
            p,
            "history",
            "every window must be at least 1 utterance".to_owned(),
        );
    }
    let scorer = {
        let raw = raw.scorer.unwrap_or_default();
        let kind = match raw.kind.as_deref() {
            None | Some("llm") => ScorerKind::Llm,
            Some("rules") => ScorerKind::Rules,
            Some(other) => {
                bad(
                    p,
                    "scorer.kind",
                    format!("must be llm or rules, got '{other}'"),
                );
                ScorerKind::Llm
            }
        };
        let ema_formula = match raw.ema_formula.as_deref() {
            // The original system's keys (a decay factor of 1 or more,
            // 1.5 in its configs) mean its formula.
            None if raw.decay_factor.is_some_and(|d| d >= 1.0) => EmaFormula::Adaptive,
            None | Some("fixed") => EmaFormula::Fixed,
            Some("adaptive") => EmaFormula::Adaptive,
            Some(other) => {
                bad(
                    p,
                    "scorer.ema_formula",
                    format!("must be fixed or adaptive, got '{other}'"),
                );
                EmaFormula::Fixed
            }
        };
        let decay_factor = match ema_formula {
            EmaFormula::Fixed => {
                let d = raw.decay_factor.unwrap_or(0.5);
                if !(0.0..1.0).contains(&d) {
                    bad(
                        p,
                        "scorer.decay_factor",
                        format!("must be at least 0 and below 1 (ema_formula: fixed), got {d}"),
                    );
                }
                d
            }
            EmaFormula::Adaptive => {
                let d = raw.decay_factor.unwrap_or(1.5);
                if !(d.is_finite() && d > 0.0) {
                    bad(
                        p,
                        "scorer.decay_factor",
                        format!("must be above 0 (ema_formula: adaptive), got {d}"),
                    );
                }
                d
            }
        };
        call(
            Some(RawCall {
                messages: raw.messages,
                endpoint: raw.endpoint,
            }),
            "scorer.messages",
            defaults((SCORER_SYSTEM, SCORER_USER), ("", ja::SCORER_USER)),
            p,
        )
        .map(|call| ScorerSettings {
            kind,
            call,
            use_ema: raw.use_ema.unwrap_or(false),
            ema_formula,
            decay_factor,
            start_after: raw.start_relation_check_after_utterances.unwrap_or(3),
            max_reasks: raw.max_reasks.unwrap_or(2),
        })
    };
    let policy = {
        let raw = raw.policy.unwrap_or_default();
        let kind = match (raw.kind.as_deref(), raw.strategy) {
            (None | Some("model"), None) => Some(PolicyKind::Model),
            (Some("random"), None) => Some(PolicyKind::Random),
            (Some("external"), None) => Some(PolicyKind::External),
            (Some("fixed"), Some(digit)) => match Strategy::from_digit(digit) {
                Some(s) => Some(PolicyKind::Fixed(s)),
                None => {
                    bad(
                        p,
                        "policy.strategy",
                        format!(
                            "must be 1 (validate), 2 (bridge), 3 (plan) or 4 (no_intervention), got {digit}"
                        ),
                    );
                    None
                }
            },
            (Some("fixed"), None) => {
                bad(
                    p,
                    "policy.strategy",
                    "is required with kind: fixed (1 to 4)".to_owned(),
                );
                None
            }
            (_, Some(_)) => {
                bad(p, "policy.strategy", "belongs to kind: fixed".to_owned());
                None
            }
            (Some(other), None) => {
                bad(
                    p,
                    "policy.kind",
                    format!("must be model, fixed, random or external, got '{other}'"),
                );
                None
            }
        };
        let call = call(
            Some(RawCall {
                messages: raw.messages,
                endpoint: raw.endpoint,
            }),
            "policy.messages",
            defaults(
                (POLICY_SYSTEM, POLICY_USER),
                (ja::POLICY_SYSTEM, ja::POLICY_USER),
            ),
            p,
        );
        match (kind, call) {
            (Some(kind), Some(call)) => Some(PolicySettings {
                kind,
                call,
                max_reasks: raw.max_reasks.unwrap_or(1),
            }),
            _ => None,
        }
    };
    let raw_rewards = raw.rewards.unwrap_or_default();
    let defaults = RewardSettings::default();
    let rewards = RewardSettings {
        stable_bonus: raw_rewards.stable_bonus.unwrap_or(defaults.stable_bonus),
        preference_match_bonus: raw_rewards
            .preference_match_bonus
            .unwrap_or(defaults.preference_match_bonus),
        evaluation_horizon: raw_rewards
            .evaluation_horizon
            .unwrap_or(defaults.evaluation_horizon),
        terminal_bonus_duration: raw_rewards
            .terminal_bonus_duration
            .unwrap_or(defaults.terminal_bonus_duration),
        target_rule: match raw_rewards.target_edge.as_deref() {
            None => defaults.target_rule,
            Some(name) => match [TargetRule::ClosestToZero, TargetRule::MostNegative]
                .into_iter()
                .find(|r| r.as_str() == name)
            {
                Some(rule) => rule,
                None => {
                    bad(
                        p,
                        "rewards.target_edge",
                        format!("must be closest_to_zero or most_negative, got '{name}'"),
                    );
                    defaults.target_rule
                }
            },
        },
        end_step_when_lost: raw_rewards
            .end_step_when_lost
            .unwrap_or(defaults.end_step_when_lost),
        invalid_penalty: raw_rewards
            .invalid_penalty
            .unwrap_or(defaults.invalid_penalty),
    };
    if !(rewards.invalid_penalty.is_finite() && rewards.invalid_penalty >= 0.0) {
        bad(
            p,
            "rewards.invalid_penalty",
            format!(
                "must be a number at least 0, got {}",
                rewards.invalid_penalty
            ),
        );
    }
    for (key, value) in [
        ("stable_bonus", rewards.stable_bonus),
        ("preference_match_bonus", rewards.preference_match_bonus),
    ] {
        if !value.is_finite() {
            bad(
                p,
                &format!("rewards.{key}"),
                format!("must be a number, got {value}"),
            );
        }
    }
    if rewards.evaluation_horizon == 0 {
        bad(
            p,
            "rewards.evaluation_horizon",
            "must be at least 1 utterance, got 0".to_owned(),
        );
    }
    let raw_alarms = raw.alarms.unwrap_or_default();
    let alarms = AlarmSettings {
        window: raw_alarms.window.unwrap_or(100),
        max_share: raw_alarms.max_share.unwrap_or(0.8),
        min_entropy: raw_alarms.min_entropy.unwrap_or(1.0),
        max_run: raw_alarms.max_run.unwrap_or(20),
    };
    if alarms.max_run < 2 {
        bad(
            p,
            "alarms.max_run",
            format!("must be at least 2, got {}", alarms.max_run),
        );
    }
    if alarms.window == 0 {
        bad(p, "alarms.window", "must be at least 1, got 0".to_owned());
    }
    if !(0.0..=1.0).contains(&alarms.max_share) {
        bad(
            p,
            "alarms.max_share",
            format!("must be a share between 0 and 1, got {}", alarms.max_share),
        );
    }
    let batch_size = raw.batch_size.unwrap_or(16);
    if batch_size == 0 {
        bad(p, "batch_size", "must be at least 1, got 0".to_owned());
    }
    let max_steps = raw
        .max_steps
        .unwrap_or(if rules == Rules::Original { 8 } else { 0 });
    if rules == Rules::Original && max_steps == 0 {
        bad(
            p,
            "max_steps",
            "must be at least 1 with rules: original, which ends an episode only there (the original's config has 8)".to_owned(),
        );
    }
    let settings = ConversationSettings {
        rules,
        require_hiragana: raw.require_hiragana.unwrap_or(rules == Rules::Original),
        persona_messages: persona_call?.messages,
        sessions,
        max_rounds,
        max_steps,
        seed: raw.seed.unwrap_or(0),
        personas,
        topics,
        topic: topic?,
        history,
        scorer: scorer?,
        policy: policy?,
        robot: robot?,
        rewards,
        filter_zero_rewards: raw_rewards.filter_zero_rewards.unwrap_or(true),
        max_auto_skip: raw_rewards.max_auto_skip.unwrap_or(10),
        topic_restarts: raw_rewards.topic_restarts.unwrap_or(1),
        alarms,
        batch_size,
    };
    ok.then_some(settings)
}

/// Where the file of `n` made-up episodes (`{"episode": i}` a line) is:
/// the system's temporary folder. The dataset layer writes it when it is
/// read (`dataset::materialize`); its content is all a resume
/// checks, so a new copy after a reboot is the same dataset.
pub(super) fn episodes_path(n: u64) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("evalfleet-episodes-{n}.jsonl"))
}
