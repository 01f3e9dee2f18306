//! `rules: original`: the original system's conversation environment and
//! the trainer loop around it (yoshinari0312/policyRL_relation_robot,
//! app/, aa1a845), restated step for step, its quirks included. The file
//! and line of the original each part restates is named beside it
//! (`convo_env.py` is app/env/convo_env.py). `docs/conversation.md` lists
//! where `rules: corrected` departs from it.
//!
//! The original is straight-line code that calls its models as it goes;
//! it is restated here the same way, as an async function whose calls are
//! the episode's [`Next::Ask`]s: [`Original`] polls it by hand (no runtime,
//! no thread), and each reply resumes it to its next call. What it has
//! decided so far ([`Env`]) is readable between calls.
//!
//! Known departures, none reachable with the three personas A, B and C:
//! a scorer line naming someone else than the three is skipped (the
//! original adds it to its graph); the topic's trigger is drawn over the
//! personas' distinct triggers in their order, the original over a
//! Python `set`'s (the draw consumed is the same, the trigger may differ).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};

use serde_json::{Map, Value, json};

use super::pyrandom::PyRandom;
use super::sim::{
    Ask, CallKind, Check, Decision, Draws, Ending, Next, Restart, Situation, StepRecord, Utterance,
    need_text, strategy_text,
};
use evalfleet_config::{ConversationSettings, ScorerKind};
use evalfleet_eval::balance::{Edge, Need, Person, Reward, Strategy, Triangle};

/// The robot's name in the original's logs and prompts.
pub const ROBOT: &str = "ロボット";
/// `humans_ollama.py:305`: what a persona says when its model gave no line
/// with hiragana.
pub const PERSONA_FALLBACK: &str = "すみません、落ち着いて話を続けましょう。";
/// `convo_env.py:1167`: the topic when the topic model gave nothing.
const TOPIC_FALLBACK: &str = "最近の出来事について";
/// `ppo_train.py` reward_fn: what an invalid policy output is sent to the
/// environment as.
const OUTPUT_ERROR: &str = "output_error";
/// `ppo_train.py:1230`: the trainer's action in a stable state.
const STABLE_ACTION: &str = "{\"intervene_now\": false}";
/// `config.local.yaml` `llm.max_attempts`: tries of a call whose reply is
/// empty.
const MAX_ATTEMPTS: u32 = 5;

/// The pairs of the three people in the original's order
/// (`relation_scorer.py:60`, sorted combinations): AB, AC, BC.
const PAIRS: [(Person, Person); 3] = [
    (Person::A, Person::B),
    (Person::A, Person::C),
    (Person::B, Person::C),
];

fn pair_index(x: Person, y: Person) -> Option<usize> {
    let (x, y) = if x.index() <= y.index() {
        (x, y)
    } else {
        (y, x)
    };
    PAIRS.iter().position(|&p| p == (x, y))
}

fn edge_pair(edge: Edge) -> usize {
    match edge {
        Edge::AB => 0,
        Edge::CA => 1,
        Edge::BC => 2,
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One line of the original's `logs`: a person's, or the robot's (`None`).
#[derive(Debug, Clone)]
struct Line {
    speaker: Option<Person>,
    text: String,
}

impl Line {
    fn label(&self) -> &'static str {
        self.speaker.map_or(ROBOT, Person::as_str)
    }
}

/// `utils/log_filtering.py`: the last `n` human lines and the robot's
/// among them (none with `humans_only`).
fn filter_logs(logs: &[Line], n: u32, humans_only: bool) -> Vec<Line> {
    let humans: Vec<usize> = (0..logs.len())
        .filter(|&i| logs[i].speaker.is_some())
        .collect();
    let from = if humans.len() <= n as usize {
        0
    } else {
        humans[humans.len() - n as usize]
    };
    logs[from..]
        .iter()
        .filter(|l| !humans_only || l.speaker.is_some())
        .cloned()
        .collect()
}

fn humans(logs: &[Line]) -> u32 {
    logs.iter().filter(|l| l.speaker.is_some()).count() as u32
}

/// `convo_env.py:1551`: who spoke, sorted.
fn participants(logs: &[Line]) -> Vec<Person> {
    let mut out: Vec<Person> = Person::ALL
        .into_iter()
        .filter(|p| logs.iter().any(|l| l.speaker == Some(*p)))
        .collect();
    out.sort_by_key(|p| p.index());
    out
}

/// The pairs among `people`, in the original's order.
fn pairs_of(people: &[Person]) -> Vec<usize> {
    (0..3)
        .filter(|&i| people.contains(&PAIRS[i].0) && people.contains(&PAIRS[i].1))
        .collect()
}

/// `[A] text` lines, the original's way of showing a conversation.
fn transcript(lines: &[Line]) -> String {
    lines
        .iter()
        .map(|l| format!("[{}] {}", l.label(), l.text))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Scores of the three pairs (AB, AC, BC); `None`: the pair is absent.
type Scores = [Option<f64>; 3];

/// What `network_metrics.py` makes of scores, as far as the episode uses
/// it.
#[derive(Debug, Clone, Copy)]
pub struct Metrics {
    pub unstable_triads: u32,
    scores: Scores,
}

impl Metrics {
    /// `analyze_relations_from_scores`: the triangle exists when all three
    /// pairs have a score; `>= 0` is `+`; an odd number of `-` is
    /// unbalanced.
    fn of(scores: Scores) -> Self {
        let unstable = match scores {
            [Some(ab), Some(ac), Some(bc)] => {
                let negatives = [ab, bc, ac].iter().filter(|&&s| s < 0.0).count();
                u32::from(negatives % 2 == 1)
            }
            _ => 0,
        };
        Self {
            unstable_triads: unstable,
            scores,
        }
    }

    fn has_edges(&self) -> bool {
        self.scores.iter().any(Option::is_some)
    }

    fn triangle(&self) -> Triangle {
        let get = |i: usize| self.scores[i].unwrap_or(0.0);
        Triangle::new(get(0), get(2), get(1))
    }
}

/// `relation_scorer.py:209` `_parse_score_lines`: per line, `X-Y: value`
/// (the key split at its first `-`, names stripped, `robot`-like names read
/// as the robot), the value the first number in it, clipped to [-1, 1]; the
/// last line of a pair wins; the participants' pairs it lacks read 0.0.
/// Also how many values were clipped.
pub fn parse_scores(text: &str, names: [&str; 3], people: &[Person]) -> (Scores, u32) {
    let mut out: Scores = [None; 3];
    let mut clipped = 0;
    let number = regex_number();
    for line in py_splitlines(text.trim()) {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let Some((a, b)) = key.split_once('-') else {
            continue;
        };
        let person = |name: &str| {
            let name = alias(name.trim());
            Person::ALL.into_iter().find(|p| names[p.index()] == name)
        };
        let Some(m) = number.find(value) else {
            continue;
        };
        let Some(x) = ascii_digits(m.as_str()).parse::<f64>().ok() else {
            continue;
        };
        let (Some(a), Some(b)) = (person(a), person(b)) else {
            continue;
        };
        let Some(i) = pair_index(a, b).filter(|_| a != b) else {
            continue;
        };
        let kept = x.clamp(-1.0, 1.0);
        if kept != x {
            clipped += 1;
        }
        out[i] = Some(kept);
    }
    for i in pairs_of(people) {
        out[i].get_or_insert(0.0);
    }
    (out, clipped)
}

fn regex_number() -> &'static regex::Regex {
    #[allow(clippy::expect_used)] // a constant pattern
    static NUMBER: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"-?\d+(\.\d+)?").expect("the number pattern compiles")
    });
    &NUMBER
}

/// Python's `float()` reads any decimal digit; Rust's ASCII ones.
fn ascii_digits(s: &str) -> String {
    s.chars()
        .map(|c| match c {
            '\u{ff10}'..='\u{ff19}' => char::from(b'0' + (c as u32 - 0xff10) as u8),
            _ => c,
        })
        .collect()
}

/// `relation_scorer.py:46` `_SPEAKER_ALIASES`.
fn alias(name: &str) -> &str {
    match name {
        "robot" | "Robot" | "ROBOT" | "pepper" | "Pepper" => ROBOT,
        "* A" => "A",
        "* B" => "B",
        _ => name,
    }
}

/// Python's `str.splitlines()`.
fn py_splitlines(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let cut = rest.char_indices().find(|&(_, c)| {
            matches!(
                c,
                '\n' | '\r'
                    | '\u{0b}'
                    | '\u{0c}'
                    | '\u{1c}'
                    | '\u{1d}'
                    | '\u{1e}'
                    | '\u{85}'
                    | '\u{2028}'
                    | '\u{2029}'
            )
        });
        match cut {
            None => {
                let line = rest;
                rest = "";
                Some(line)
            }
            Some((at, c)) => {
                let line = &rest[..at];
                let mut next = at + c.len_utf8();
                if c == '\r' && rest[next..].starts_with('\n') {
                    next += 1;
                }
                rest = &rest[next..];
                Some(line)
            }
        }
    })
}

/// `ppo_train.py:619` `_strip_think_tags`.
pub fn strip_think_tags(text: &str) -> String {
    const CLOSE: &str = "</think>";
    if let Some(at) = text.to_ascii_lowercase().rfind(CLOSE) {
        return text[at + CLOSE.len()..].trim_start().to_owned();
    }
    #[allow(clippy::expect_used)] // a constant pattern
    static TAG: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        regex::Regex::new(r"(?i)<\s*/?\s*think\s*>").expect("the tag pattern compiles")
    });
    TAG.replace_all(text, "").trim().to_owned()
}

/// The first of `1234` in `text` (`_extract_plan_candidate`,
/// `_validate_plan_json`, `_parse_plan`).
fn first_digit(text: &str) -> Option<Strategy> {
    text.chars()
        .find(|c| ('1'..='4').contains(c))
        .and_then(|c| Strategy::from_digit(c as u8 - b'0'))
}

/// `convo_env.py:32` `_strip_quotes`.
fn strip_quotes(text: &str) -> String {
    text.trim()
        .trim_matches(|c| "\"'\u{300c}\u{300d}\u{300e}\u{300f}()[]（）【】".contains(c))
        .to_owned()
}

fn contains_hiragana(text: &str) -> bool {
    text.chars().any(|c| ('\u{3040}'..='\u{309f}').contains(&c))
}

/// `relation_scorer.py:228` `RelationScorer`: with `use_ema`, the smoothed
/// scores it keeps.
#[derive(Debug, Clone, Default)]
struct Scorer {
    scores: Scores,
    history: [std::collections::VecDeque<u32>; 3],
    last_totals: [u32; 3],
}

/// A relation snapshot the step starts from (`rel_before_snapshot`): from
/// `relation_snapshot()` (with `metrics`), a previous step's (without), or
/// none (`{}`).
#[derive(Debug, Clone, Copy)]
enum Before {
    Snapshot(Metrics),
    Previous(Metrics),
    Empty,
}

impl Before {
    fn metrics(&self) -> Option<Metrics> {
        match self {
            Self::Snapshot(m) | Self::Previous(m) => Some(*m),
            Self::Empty => None,
        }
    }
}

/// The plan `_parse_plan` reads of an action (`convo_env.py:1257`).
#[derive(Debug, Clone)]
struct Plan {
    intervene: bool,
    /// None: the plan has no `strategy` (no_intervention's), read as
    /// `plan` (`convo_env.py:835`).
    strategy: Option<&'static str>,
    edge: Edge,
    target: Person,
}

/// What the policy chose at a decision.
#[derive(Debug, Clone)]
pub enum Choice {
    /// A model's raw output, read as the trainer reads it.
    Reply(String),
    Strategy(Strategy),
    /// Invalid, for a reason (`trainer`, `timeout`).
    Invalid(String),
}

/// One draw of the episode's random source, as the original's vectors
/// record them.
#[derive(Debug, Clone, PartialEq)]
pub enum Draw {
    Random { value: f64 },
    Choice { among: usize, index: usize },
}

/// What the environment has done so far.
pub struct Env {
    settings: Arc<ConversationSettings>,
    episode_id: String,
    rng: PyRandom,
    pub draws: Vec<Draw>,
    logs: Vec<Line>,
    /// Episodes begun (`self.episode`).
    pub episode: u32,
    episode_step: u32,
    pub t: u32,
    previous_intervened: bool,
    previous_rel_after_horizon: Option<Metrics>,
    previous_rel_after_bonus: Option<Metrics>,
    aggressive: [bool; 3],
    needs: [Need; 3],
    used_topics: Vec<String>,
    used_triggers: Vec<String>,
    topic: String,
    trigger: Option<String>,
    fixed_topic: Option<String>,
    scorer: Scorer,
    /// The rule scorer's patterns of the pairs' names (compiled once).
    near: Option<[Option<regex::Regex>; 3]>,
    target: Option<(Edge, Person)>,
    /// The observation made last (`_last_observation`).
    pub observation: String,
    // --- the record ---
    steps: Vec<StepRecord>,
    conversation: Vec<Utterance>,
    restarts: Vec<Restart>,
    topics: Vec<String>,
    human_utterances: u32,
    scorer_calls: u32,
    clipped_scores: u32,
    stable_steps: u32,
    /// Stable steps since the last decision.
    skipped: u32,
    ending: Option<Ending>,
    /// The decision due and the variables of its policy call.
    due: Option<(Decision, Map<String, Value>)>,
    /// Where the step under way began in `conversation`.
    step_from: usize,
    /// The opening's human lines before any restart (`initial_conversation_log`).
    initial: Vec<Line>,
    /// What the original's trainer logs of each decision and of an episode
    /// a stable step ended (`conversation_summary.jsonl` records, without
    /// their interaction id, episode number and timestamp).
    log: Vec<Value>,
    /// The episode's totals as reward_fn counts them (`episode_stats`).
    stats: EpisodeStats,
    /// The step under way.
    current: Option<StepRecord>,
}

impl Env {
    fn new(
        settings: Arc<ConversationSettings>,
        episode: &str,
        seed: u64,
        topic: Option<String>,
    ) -> Self {
        Self {
            settings,
            episode_id: episode.to_owned(),
            rng: PyRandom::seed(seed),
            draws: Vec::new(),
            logs: Vec::new(),
            episode: 0,
            episode_step: 0,
            t: 0,
            previous_intervened: false,
            previous_rel_after_horizon: None,
            previous_rel_after_bonus: None,
            aggressive: [false; 3],
            needs: [Need::Recognition; 3],
            used_topics: Vec::new(),
            used_triggers: Vec::new(),
            topic: String::new(),
            trigger: None,
            fixed_topic: topic,
            scorer: Scorer::default(),
            near: None,
            target: None,
            observation: String::new(),
            steps: Vec::new(),
            conversation: Vec::new(),
            restarts: Vec::new(),
            topics: Vec::new(),
            human_utterances: 0,
            scorer_calls: 0,
            clipped_scores: 0,
            stable_steps: 0,
            skipped: 0,
            ending: None,
            due: None,
            step_from: 0,
            current: None,
            initial: Vec::new(),
            log: Vec::new(),
            stats: EpisodeStats::default(),
        }
    }

    fn random(&mut self) -> f64 {
        let value = self.rng.random();
        self.draws.push(Draw::Random { value });
        value
    }

    fn choice(&mut self, among: usize) -> usize {
        let index = self.rng.below(among);
        self.draws.push(Draw::Choice { among, index });
        index
    }

    fn name(&self, p: Person) -> &str {
        &self.settings.personas[p.index()].name
    }

    fn names(&self) -> [&str; 3] {
        [0, 1, 2].map(|i| self.settings.personas[i].name.as_str())
    }

    fn push(&mut self, line: Line) {
        if line.speaker.is_some() {
            self.human_utterances += 1;
        }
        self.conversation.push(Utterance {
            speaker: line.speaker.map_or("robot", Person::as_str).to_owned(),
            text: line.text.clone(),
        });
        self.logs.push(line);
    }

    /// `convo_env.py:1611`.
    fn preferred(&self, p: Person) -> &'static str {
        self.needs[p.index()].strategy().as_str()
    }

    fn base_vars(&self) -> Map<String, Value> {
        let mut vars = Map::new();
        vars.insert("rules".to_owned(), json!("original"));
        vars.insert("episode".to_owned(), json!(self.episode_id));
        vars.insert("topic".to_owned(), json!(self.topic));
        vars.insert("turn".to_owned(), json!(humans(&self.logs)));
        vars.insert("step".to_owned(), json!(self.steps.len()));
        // Human utterances spoken in the episode so far (restarts too).
        vars.insert("spoken".to_owned(), json!(self.human_utterances));
        for (key, p) in [("name_a", 0), ("name_b", 1), ("name_c", 2)] {
            vars.insert(key.to_owned(), json!(self.settings.personas[p].name));
        }
        vars
    }

    fn history_vars(&self, lines: &[Line], vars: &mut Map<String, Value>) {
        let list: Vec<Value> = lines
            .iter()
            .map(|l| {
                json!({
                    "speaker": l.speaker.map_or("robot", Person::as_str),
                    "name": l.speaker.map_or(ROBOT, |p| self.name(p)),
                    "text": l.text,
                })
            })
            .collect();
        vars.insert("history".to_owned(), Value::Array(list));
        vars.insert("history_text".to_owned(), json!(transcript(lines)));
    }

    /// The variables of a persona's call (`humans_ollama.py:82`
    /// `build_human_prompt`): who speaks, whether they are aggressive,
    /// the topic's trigger when they hold it, their need when the step
    /// passes it, and the recovery line when the strategy matched it and
    /// the robot spoke lately.
    fn persona_vars(
        &self,
        speaker: Person,
        pass_needs: bool,
        flags: [bool; 3],
    ) -> Map<String, Value> {
        let s = &self.settings;
        let persona = &s.personas[speaker.index()];
        let need = self.needs[speaker.index()];
        let mut vars = self.base_vars();
        vars.insert("speaker".to_owned(), json!(speaker.as_str()));
        vars.insert("name".to_owned(), json!(persona.name));
        vars.insert("persona".to_owned(), json!(persona.prompt));
        vars.insert("need".to_owned(), json!(need.as_str()));
        vars.insert("need_text".to_owned(), json!(need_text(need)));
        vars.insert("need_now".to_owned(), json!(pass_needs));
        vars.insert("landmines".to_owned(), json!(persona.landmines));
        vars.insert(
            "aggressive".to_owned(),
            json!(self.aggressive[speaker.index()]),
        );
        let holders: Vec<&str> = match &self.trigger {
            Some(t) => Person::ALL
                .into_iter()
                .filter(|p| s.personas[p.index()].landmines.contains(t))
                .map(|p| self.name(p))
                .collect(),
            None => Vec::new(),
        };
        let own = self
            .trigger
            .as_ref()
            .filter(|t| persona.landmines.contains(t));
        vars.insert("trigger".to_owned(), json!(self.trigger));
        vars.insert("own_trigger".to_owned(), json!(own));
        vars.insert("trigger_holders".to_owned(), json!(holders));
        let window = filter_logs(&self.logs, s.history.persona, false);
        let robot_lately = window.iter().rev().take(5).any(|l| l.speaker.is_none());
        vars.insert(
            "recovery".to_owned(),
            json!(flags[speaker.index()] && robot_lately),
        );
        self.history_vars(&window, &mut vars);
        vars
    }

    fn scorer_vars(&self, lines: &[Line], people: &[Person]) -> Map<String, Value> {
        let mut vars = self.base_vars();
        let pairs = pairs_of(people);
        let show = |i: usize, sep: &str| {
            let (x, y) = PAIRS[i];
            format!("{}{sep}{}", self.name(x), self.name(y))
        };
        vars.insert(
            "pairs_text".to_owned(),
            json!(
                pairs
                    .iter()
                    .map(|&i| format!("- {}", show(i, " × ")))
                    .collect::<Vec<_>>()
                    .join("\n")
            ),
        );
        vars.insert(
            "outlines".to_owned(),
            json!(
                pairs
                    .iter()
                    .map(|&i| format!("{}:", show(i, "-")))
                    .collect::<Vec<_>>()
                    .join("\n")
            ),
        );
        vars.insert(
            "participants".to_owned(),
            json!(people.iter().map(|p| self.name(*p)).collect::<Vec<_>>()),
        );
        vars.insert("logs_human".to_owned(), json!(humans(lines)));
        vars.insert(
            "logs_robot".to_owned(),
            json!(lines.len() as u32 - humans(lines)),
        );
        self.history_vars(lines, &mut vars);
        vars
    }

    fn policy_vars(&self) -> Map<String, Value> {
        let mut vars = self.base_vars();
        let window = filter_logs(&self.logs, self.settings.history.policy, false);
        self.history_vars(&window, &mut vars);
        vars.insert("observation".to_owned(), json!(self.observation));
        if let Some((decision, _)) = &self.due {
            let r = decision.situation.relations;
            vars.insert(
                "relations".to_owned(),
                json!({"AB": r.ab, "BC": r.bc, "CA": r.ca}),
            );
            vars.insert("pattern".to_owned(), json!(decision.situation.pattern));
            vars.insert(
                "target_edge".to_owned(),
                json!(decision.situation.target_edge),
            );
            vars.insert(
                "target_speaker".to_owned(),
                json!(decision.situation.target_speaker),
            );
            vars.insert(
                "target_name".to_owned(),
                json!(decision.situation.target_speaker.map(|p| self.name(p))),
            );
        }
        vars
    }

    /// `convo_env.py:1349`'s target and partner, and the directive of the
    /// robot's call (`convo_env.py:1386`).
    fn robot_vars(&self, plan: &Plan) -> Map<String, Value> {
        let mut vars = self.base_vars();
        let target = plan.target;
        let partner = edge_people(plan.edge)
            .into_iter()
            .find(|&p| p != target)
            .unwrap_or(Person::B);
        let strategy = plan.strategy.unwrap_or("plan");
        vars.insert("target_speaker".to_owned(), json!(target.as_str()));
        vars.insert("target_name".to_owned(), json!(self.name(target)));
        vars.insert("partner_name".to_owned(), json!(self.name(partner)));
        vars.insert("target_edge".to_owned(), json!(plan.edge.as_str()));
        vars.insert("strategy".to_owned(), json!(strategy));
        if let Some(s) = Strategy::ALL.into_iter().find(|s| s.as_str() == strategy) {
            vars.insert("strategy_text".to_owned(), json!(strategy_text(s)));
        }
        let window = filter_logs(&self.logs, self.settings.history.robot, false);
        self.history_vars(&window, &mut vars);
        vars
    }

    /// `convo_env.py:1449` `_fallback_intervention_text`.
    fn robot_fallback(&self, plan: &Plan) -> String {
        let target = self.name(plan.target).to_owned();
        let partner = edge_people(plan.edge)
            .into_iter()
            .find(|&p| p != plan.target)
            .map_or("B".to_owned(), |p| self.name(p).to_owned());
        match plan.strategy.unwrap_or("plan") {
            "validate" => {
                format!("{target}さん、あなたの意見はとても大切です。もっと聞かせてください。")
            }
            "bridge" => {
                format!("{target}さん、{partner}さん、お二人には共通の目標があると思います。")
            }
            _ => format!("{target}さん、次の一歩として、まず小さなことから始めてみませんか？"),
        }
    }

    /// `convo_env.py:1257` `_parse_plan`: a digit reuses the target the
    /// observation drew; JSON (the trainer's stable action) defaults to
    /// AB, A and plan; anything else is spoken by the robot as it is.
    fn parse_plan(&self, action: &str) -> (Option<Plan>, Option<String>) {
        let text = action.trim();
        if text.is_empty() {
            return (None, None);
        }
        let (edge, target) = self.target.unwrap_or((Edge::AB, Person::A));
        if let Some(strategy) = first_digit(text) {
            return (
                Some(Plan {
                    intervene: strategy.intervenes(),
                    strategy: strategy.intervenes().then(|| strategy.as_str()),
                    edge,
                    target,
                }),
                None,
            );
        }
        match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(payload)) => {
                let intervene = match payload.get("intervene_now") {
                    Some(Value::Bool(b)) => *b,
                    Some(Value::String(s)) => {
                        matches!(s.trim().to_lowercase().as_str(), "true" | "yes" | "1" | "y")
                    }
                    Some(Value::Number(n)) => n.as_f64().is_some_and(|n| n != 0.0),
                    Some(Value::Null) | None => false,
                    Some(_) => true,
                };
                let field = |key: &str, default: &str| {
                    payload.get(key).map_or(default.to_owned(), |v| match v {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    })
                };
                let edge = match field("edge_to_change", "AB").trim().to_uppercase().as_str() {
                    "BC" => Edge::BC,
                    "CA" => Edge::CA,
                    _ => Edge::AB,
                };
                let strategy = match field("strategy", "plan").trim() {
                    "validate" => "validate",
                    "bridge" => "bridge",
                    _ => "plan",
                };
                let target = match field("target_speaker", "A").trim().to_uppercase().as_str() {
                    "B" => Person::B,
                    "C" => Person::C,
                    _ => Person::A,
                };
                (
                    Some(Plan {
                        intervene,
                        strategy: Some(strategy),
                        edge,
                        target,
                    }),
                    None,
                )
            }
            _ => (None, Some(text.to_owned())),
        }
    }

    /// `convo_env.py:58` `select_target_edge_and_speaker`: the negative
    /// edge closest to 0 (a stable sort over AB, AC, BC), else the smallest
    /// (the first of equals); AC is CA; the speaker drawn of the edge's
    /// two.
    fn select_target(&mut self, scores: &Scores) -> (Edge, Person) {
        let mut negatives: Vec<(usize, f64)> = (0..3)
            .filter_map(|i| scores[i].filter(|s| *s < 0.0).map(|s| (i, s)))
            .collect();
        negatives.sort_by(|a, b| a.1.abs().total_cmp(&b.1.abs()));
        let pair = match negatives.first() {
            Some(&(i, _)) => i,
            None => {
                let mut best: Option<(usize, f64)> = None;
                for (i, score) in scores.iter().enumerate() {
                    if let Some(s) = *score
                        && best.is_none_or(|(_, b)| s < b)
                    {
                        best = Some((i, s));
                    }
                }
                best.map_or(0, |(i, _)| i)
            }
        };
        let edge = [Edge::AB, Edge::CA, Edge::BC][pair];
        let people = edge_people(edge);
        let speaker = people[self.choice(2)];
        (edge, speaker)
    }

    /// `relation_scorer.py:83` `_scores_rule`: per pair, 0.1 per place the
    /// two names occur in one line, 0.05 per warm word less cold words in
    /// the whole text, and a uniform draw in [-0.1, 0.1], clipped.
    fn rule_scores(&mut self, lines: &[Line], people: &[Person]) -> Scores {
        const WARM: [&str; 7] = [
            "そうだね",
            "なるほど",
            "いいね",
            "ありがとう",
            "同意",
            "共感",
            "助かる",
        ];
        const COLD: [&str; 7] = ["違う", "いや", "無理", "嫌", "おかしい", "間違い", "怒る"];
        let text = lines
            .iter()
            .map(|l| {
                let speaker = l.speaker.map_or(ROBOT, |p| self.name(p));
                format!("[{speaker}] {}", l.text)
            })
            .collect::<Vec<_>>()
            .join("\n");
        let count =
            |words: &[&str]| -> i64 { words.iter().map(|w| text.matches(w).count() as i64).sum() };
        let tone = count(&WARM) - count(&COLD);
        if self.near.is_none() {
            self.near = Some(PAIRS.map(|(a, b)| {
                let (a, b) = (regex::escape(self.name(a)), regex::escape(self.name(b)));
                regex::Regex::new(&format!("{a}.*?{b}|{b}.*?{a}")).ok()
            }));
        }
        let mut out: Scores = [None; 3];
        for i in pairs_of(people) {
            let near = self.near.as_ref().and_then(|n| n[i].as_ref());
            let near = near.map_or(0, |r| r.find_iter(&text).count());
            let base = 0.1 * near as f64 + 0.05 * tone as f64;
            let noise = -0.1 + 0.2 * self.random();
            out[i] = Some((base + noise).clamp(-1.0, 1.0));
        }
        out
    }

    /// `{speaker, utterance}` of each human line.
    fn utterances_json(&self, lines: &[Line]) -> Value {
        Value::Array(
            lines
                .iter()
                .filter_map(|l| {
                    l.speaker
                        .map(|p| json!({"speaker": self.name(p), "utterance": l.text}))
                })
                .collect(),
        )
    }

    /// A metrics' edges as the trainer writes them: `"A,B": score`.
    fn edges_json(&self, metrics: Option<&Metrics>) -> Value {
        let mut edges = Map::new();
        if let Some(m) = metrics {
            for (i, (x, y)) in PAIRS.iter().enumerate() {
                if let Some(score) = m.scores[i] {
                    edges.insert(format!("{},{}", self.name(*x), self.name(*y)), json!(score));
                }
            }
        }
        Value::Object(edges)
    }

    /// `{is_stable, edges}` of relations (`{}` for none).
    fn relation_json(&self, metrics: Option<&Metrics>) -> Value {
        json!({
            "is_stable": metrics.is_none_or(|m| m.unstable_triads == 0),
            "edges": self.edges_json(metrics),
        })
    }

    /// reward_fn's `log_payload` of a decision (`ppo_train.py:2726-2955`),
    /// without its interaction id and episode number.
    fn decision_log(
        &mut self,
        out: &StepOut,
        total: f64,
        strategy: Option<Strategy>,
        raw: &str,
    ) -> Value {
        let info = &out.info;
        let mut log = Map::new();
        // What the trainer's batch collector counts (not written).
        let decision = match strategy {
            None => "output_error",
            Some(s) => s.as_str(),
        };
        log.insert("decision".to_owned(), json!(decision));
        log.insert("turn".to_owned(), json!(self.t));
        log.insert("done".to_owned(), json!(out.done));
        if self.t == 1 {
            let mut episode_info = Map::new();
            episode_info.insert("topic".to_owned(), json!(self.topic));
            if let Some(trigger) = &self.trigger {
                episode_info.insert("selected_trigger".to_owned(), json!(trigger));
                let holders: Vec<&str> = Person::ALL
                    .into_iter()
                    .filter(|p| {
                        self.settings.personas[p.index()]
                            .landmines
                            .contains(trigger)
                    })
                    .map(|p| self.name(p))
                    .collect();
                if !holders.is_empty() {
                    episode_info.insert("personas_with_trigger".to_owned(), json!(holders));
                }
            }
            let mood: Map<String, Value> = Person::ALL
                .into_iter()
                .map(|p| {
                    let word = if self.aggressive[p.index()] {
                        "過激"
                    } else {
                        "マイルド"
                    };
                    (self.name(p).to_owned(), json!(word))
                })
                .collect();
            episode_info.insert("speaker_aggressiveness".to_owned(), Value::Object(mood));
            log.insert("episode_info".to_owned(), Value::Object(episode_info));
            if info.judged.is_some() {
                let needs: Map<String, Value> = Person::ALL
                    .into_iter()
                    .map(|p| {
                        (
                            self.name(p).to_owned(),
                            json!(self.needs[p.index()].as_str()),
                        )
                    })
                    .collect();
                log.insert("emotional_needs".to_owned(), Value::Object(needs));
            }
            let initial = self.utterances_json(&self.initial);
            if initial.as_array().is_some_and(|a| !a.is_empty()) {
                log.insert("initial_conversation".to_owned(), initial);
            }
        } else if !info.before.is_empty() {
            log.insert(
                "human_utterances".to_owned(),
                self.utterances_json(&info.before),
            );
        }
        let mut relation = self.relation_json(info.status.as_ref());
        if info.status.is_none_or(|m| !m.has_edges()) {
            relation["debug_note"] = json!("edges_empty_at_step_start");
        }
        let stable_before = info.status.is_none_or(|m| m.unstable_triads == 0);
        log.insert("relation".to_owned(), relation);
        // The plan the trainer logs: the environment's, with what the
        // trainer read of the output (reward_fn merges them).
        let (edge, target) = self.target.unwrap_or((Edge::AB, Person::A));
        let plan_strategy = match strategy {
            None => Some("output_error"),
            Some(s) if s.intervenes() => Some(s.as_str()),
            Some(_) => None,
        };
        if !stable_before {
            let mut intervention = Map::new();
            if info.intervened {
                intervention.insert("intervened".to_owned(), json!(true));
                intervention.insert("robot_utterance".to_owned(), json!(out.robot));
                if let Some(s) = plan_strategy {
                    intervention.insert("strategy".to_owned(), json!(s));
                }
                intervention.insert("edge_to_change".to_owned(), json!(edge.as_str()));
                intervention.insert("target_speaker".to_owned(), json!(target.as_str()));
                intervention.insert("llm_raw_output".to_owned(), json!(raw));
                let after = self.utterances_json(&info.replies);
                if after.as_array().is_some_and(|a| !a.is_empty()) {
                    intervention.insert("utterances_after_intervention".to_owned(), after);
                }
                log.insert("intervention".to_owned(), Value::Object(intervention));
                if let Some(m) = &out.after_horizon {
                    log.insert(
                        "relations_after_horizon".to_owned(),
                        self.relation_json(Some(m)),
                    );
                }
            } else {
                intervention.insert("intervened".to_owned(), json!(false));
                let intervene = strategy.is_some_and(Strategy::intervenes);
                intervention.insert("intervene_now".to_owned(), json!(intervene));
                intervention.insert("edge_to_change".to_owned(), json!(edge.as_str()));
                intervention.insert("target_speaker".to_owned(), json!(target.as_str()));
                intervention.insert("llm_raw_output".to_owned(), json!(raw));
                let heard = self.utterances_json(&info.replies);
                if heard.as_array().is_some_and(|a| !a.is_empty()) {
                    intervention.insert("human_utterances".to_owned(), heard);
                }
                log.insert("intervention".to_owned(), Value::Object(intervention));
            }
        }
        let mut breakdown = Map::new();
        if strategy.is_none() {
            breakdown.insert("output_errorペナルティ".to_owned(), json!(total));
        }
        log.insert(
            "reward".to_owned(),
            json!({"total": total, "breakdown": Value::Object(breakdown)}),
        );
        if let Some(j) = &info.judged {
            log.insert("target_speaker".to_owned(), json!(j.target.as_str()));
            log.insert("chosen_strategy".to_owned(), json!(j.strategy));
            log.insert("preferred_strategy".to_owned(), json!(j.preferred));
            log.insert(
                "preference_match".to_owned(),
                json!(j.strategy == j.preferred),
            );
            log.insert("edge_to_change".to_owned(), json!(j.edge.as_str()));
            log.insert("target_edge_score_after".to_owned(), json!(j.score_after));
            log.insert(
                "target_edge_positive_after".to_owned(),
                json!(j.score_after > 0.0),
            );
        }
        self.stats.total_reward += total;
        if info.intervened {
            self.stats.interventions += 1;
        }
        if !stable_before && !info.intervened {
            self.stats.unstable_no_intervention += 1;
        }
        if info.plan_error {
            self.stats.plan_errors += 1;
        }
        if out.done {
            log.insert(
                "episode_summary".to_owned(),
                json!({
                    "total_reward": self.stats.total_reward,
                    "total_interventions": self.stats.interventions,
                    "unstable_no_intervention": self.stats.unstable_no_intervention,
                    "plan_errors": self.stats.plan_errors,
                }),
            );
        }
        Value::Object(log)
    }

    /// The trainer's record of an episode a stable step ended
    /// (`ppo_train.py:1236-1257`).
    fn stable_end_log(&self, out: &StepOut) -> Value {
        let mut log = Map::new();
        log.insert("turn".to_owned(), json!(self.t));
        log.insert("skipped".to_owned(), json!(true));
        log.insert(
            "reason".to_owned(),
            json!("stable_state_max_auto_skip_reached"),
        );
        log.insert("done".to_owned(), json!(true));
        if !out.info.before.is_empty() {
            log.insert(
                "human_utterances".to_owned(),
                self.utterances_json(&out.info.before),
            );
        }
        if let Some(m) = &out.info.rel {
            log.insert("relation".to_owned(), self.relation_json(Some(m)));
        }
        Value::Object(log)
    }

    fn record_step(&mut self, record: StepRecord) {
        self.steps.push(record);
        self.skipped = 0;
    }
}

/// The edge's two people as the original spells it ("CA": C, A).
fn edge_people(edge: Edge) -> [Person; 2] {
    match edge {
        Edge::AB => [Person::A, Person::B],
        Edge::BC => [Person::B, Person::C],
        Edge::CA => [Person::C, Person::A],
    }
}

/// What the episode hands out while it waits.
enum Yielded {
    Ask(Ask),
    Decide(Decision),
}

/// What resumes it.
enum Input {
    Text(String),
    Choice(Choice),
}

#[derive(Default)]
struct Port {
    out: Option<Yielded>,
    input: Option<Input>,
}

/// Resolves when the episode's driver has put an input in.
struct Exchange(Arc<Mutex<Port>>);

impl Future for Exchange {
    type Output = Input;

    fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Input> {
        match lock(&self.0).input.take() {
            Some(input) => Poll::Ready(input),
            None => Poll::Pending,
        }
    }
}

/// The original's code, restated.
struct Runner {
    env: Arc<Mutex<Env>>,
    port: Arc<Mutex<Port>>,
    /// Episodes to play (1 in a run; the differential test plays the
    /// original's resets after `done`).
    episodes: u32,
}

impl Runner {
    fn env(&self) -> std::sync::MutexGuard<'_, Env> {
        lock(&self.env)
    }

    async fn exchange(&self, out: Yielded) -> Input {
        lock(&self.port).out = Some(out);
        Exchange(self.port.clone()).await
    }

    async fn ask(&self, kind: CallKind, vars: Map<String, Value>) -> String {
        let ask = Ask {
            kind,
            vars,
            rejected: None,
        };
        match self.exchange(Yielded::Ask(ask)).await {
            Input::Text(text) => text,
            Input::Choice(_) => String::new(),
        }
    }

    /// A call asked again while its reply is empty (the original's
    /// `max_attempts` loops); None after the last.
    async fn ask_nonempty(
        &self,
        kind: CallKind,
        vars: Map<String, Value>,
        clean: fn(&str) -> String,
    ) -> Option<String> {
        for _ in 0..MAX_ATTEMPTS {
            let text = clean(&self.ask(kind, vars.clone()).await);
            if !text.is_empty() {
                return Some(text);
            }
        }
        None
    }

    /// The whole run: `__init__`'s reset, then the trainer's loop
    /// (`ppo_train.py:1173` `FiniteOnlineDataset.__iter__` and reward_fn)
    /// until `done`.
    async fn run(self) -> Ending {
        let mut played = 0;
        self.reset().await;
        loop {
            // ppo_train.py:1175
            let snapshot = self.relation_snapshot().await;
            let decided = snapshot.unstable_triads > 0;
            let ending = if decided {
                self.decision(snapshot).await
            } else {
                self.stable_step().await
            };
            if let Some(ending) = ending {
                played += 1;
                if played >= self.episodes {
                    return ending;
                }
                if decided {
                    // reward_fn logs the relations of an episode that a
                    // decision ended, then resets.
                    self.relation_snapshot().await;
                }
                self.reset().await;
            }
        }
    }

    /// One decision: the prompt (`build_robot_messages` makes an
    /// observation, drawing the target again), the policy's choice read as
    /// reward_fn reads it, `planning_context()`, the step, the reward.
    async fn decision(&self, snapshot: Metrics) -> Option<Ending> {
        self.make_observation().await;
        let decision = {
            let mut env = self.env();
            let (edge, speaker) = env.target.unwrap_or((Edge::AB, Person::A));
            let relations = snapshot.triangle();
            let situation = Situation {
                relations,
                pattern: relations.pattern(),
                stable: false,
                instability: relations.instability(),
                target_edge: Some(edge),
                target_speaker: Some(speaker),
            };
            let step = env.steps.len() as u32;
            let window = filter_logs(&env.logs, env.settings.history.policy, false);
            let decision = Decision {
                step,
                situation: situation.clone(),
                window: window
                    .iter()
                    .map(|l| Utterance {
                        speaker: l.speaker.map_or("robot", Person::as_str).to_owned(),
                        text: l.text.clone(),
                    })
                    .collect(),
                topic: env.topic.clone(),
            };
            let need = env.needs[speaker.index()];
            env.current = Some(StepRecord::begun(
                step,
                env.topic.clone(),
                humans(&env.logs),
                env.skipped,
                situation,
                Some(need),
            ));
            env.due = Some((decision.clone(), Map::new()));
            let vars = env.policy_vars();
            if let Some(due) = &mut env.due {
                due.1 = vars;
            }
            decision
        };
        let choice = match self.exchange(Yielded::Decide(decision)).await {
            Input::Choice(choice) => choice,
            Input::Text(text) => Choice::Reply(text),
        };
        // reward_fn (ppo_train.py:2620-2666): think tags stripped, the
        // first digit 1-4 taken, else the action is "output_error" and
        // costs the penalty.
        let raw = match &choice {
            Choice::Reply(raw) => raw.clone(),
            Choice::Strategy(s) => s.digit().to_string(),
            Choice::Invalid(_) => String::new(),
        };
        let (action, strategy, reply, reason) = match choice {
            Choice::Reply(raw) => {
                let visible = strip_think_tags(&raw);
                match first_digit(&visible) {
                    Some(s) => (s.digit().to_string(), Some(s), Some(raw), None),
                    None => (
                        OUTPUT_ERROR.to_owned(),
                        None,
                        Some(raw),
                        Some("reply".to_owned()),
                    ),
                }
            }
            Choice::Strategy(s) => (s.digit().to_string(), Some(s), None, None),
            Choice::Invalid(reason) => (OUTPUT_ERROR.to_owned(), None, None, Some(reason)),
        };
        {
            let mut env = self.env();
            env.due = None;
            env.step_from = env.conversation.len();
            if let Some(current) = &mut env.current {
                current.strategy = strategy;
                current.valid = strategy.is_some();
                current.invalid_reason = reason;
                current.policy_reply = reply;
            }
        }
        // reward_fn's state_before.
        self.planning_context().await;
        let out = self.step(&action).await;
        let mut env = self.env();
        let penalty = env.settings.rewards.invalid_penalty;
        let total = if strategy.is_some() {
            out.reward
        } else {
            -penalty
        };
        let payload = env.decision_log(&out, total, strategy, &raw);
        env.log.push(payload);
        let step_from = env.step_from;
        let utterances = env.conversation[step_from..].to_vec();
        if let Some(mut record) = env.current.take() {
            record.robot = out.robot.clone();
            record.utterances = utterances;
            let target = record.situation.target_edge;
            let check = |m: &Metrics| Check {
                relations: m.triangle(),
                stable: m.unstable_triads == 0,
                target_positive: target.map(|e| m.scores[edge_pair(e)].unwrap_or(0.0) > 0.0),
            };
            record.at_horizon = out.after_horizon.as_ref().map(check);
            record.at_end = out.after_bonus.as_ref().map(check);
            record.checks = [out.after_horizon, out.after_bonus]
                .iter()
                .flatten()
                .map(check)
                .collect();
            // The trainer's total: the environment's bonuses, or minus the
            // penalty alone (ppo_train.py:2665).
            record.reward = if record.valid {
                Reward {
                    stable_bonus: out.stable_bonus,
                    preference_match_bonus: out.preference_bonus,
                    invalid_penalty: 0.0,
                    total: out.reward,
                }
            } else {
                Reward {
                    stable_bonus: 0.0,
                    preference_match_bonus: 0.0,
                    invalid_penalty: -penalty,
                    total: -penalty,
                }
            };
            env.record_step(record);
        }
        out.done.then_some(Ending::Truncated)
    }

    /// The trainer's step in a stable state (`ppo_train.py:1230`).
    async fn stable_step(&self) -> Option<Ending> {
        let out = self.step(STABLE_ACTION).await;
        let mut env = self.env();
        env.stable_steps += 1;
        env.skipped += 1;
        if !out.done {
            return None;
        }
        // ppo_train.py:1233: the trainer logs the episode a stable step
        // ended.
        let payload = env.stable_end_log(&out);
        env.log.push(payload);
        Some(if out.stable_end {
            Ending::Terminated
        } else {
            Ending::Truncated
        })
    }

    /// `convo_env.py:302` `reset`.
    async fn reset(&self) {
        {
            let mut env = self.env();
            env.episode += 1;
            env.episode_step = 0;
            env.t = 0;
            if env.episode > 1 {
                // The conversation of an episode before (the differential
                // test's resets): kept in the record as a restart.
                let conversation = std::mem::take(&mut env.conversation);
                let topic = env.topic.clone();
                env.restarts.push(Restart {
                    topic,
                    conversation,
                });
            }
            env.logs.clear();
            env.scorer = Scorer::default();
            env.previous_intervened = false;
            env.previous_rel_after_horizon = None;
            env.previous_rel_after_bonus = None;
            for i in 0..3 {
                env.aggressive[i] = env.random() < 0.5;
            }
            for i in 0..3 {
                let settings = env.settings.clone();
                let drawn = Need::ALL[env.choice(Need::ALL.len())];
                env.needs[i] = settings.personas[i].need.unwrap_or(drawn);
            }
        }
        self.new_topic().await;
        let horizon = self.env().settings.rewards.evaluation_horizon;
        self.bootstrap(horizon, false, [false; 3]).await;
        // convo_env.py:367: the opening's auto-skip.
        let (max_auto_skip, start, window) = {
            let env = self.env();
            (
                env.settings.max_auto_skip,
                env.settings.scorer.start_after,
                env.settings.history.scorer,
            )
        };
        let mut count = 0;
        while count < max_auto_skip {
            let filtered = {
                let env = self.env();
                if humans(&env.logs) < start {
                    break;
                }
                filter_logs(&env.logs, window, true)
            };
            let scores = self.get_scores(filtered, true).await;
            if Metrics::of(scores).unstable_triads > 0 {
                break;
            }
            count += 1;
            self.human_reply(false, [false; 3]).await;
        }
        {
            let mut env = self.env();
            env.initial = env
                .logs
                .iter()
                .filter(|l| l.speaker.is_some())
                .cloned()
                .collect();
            env.stats = EpisodeStats::default();
        }
        if count >= max_auto_skip {
            // convo_env.py:419: a new topic, the log and scorer cleared.
            {
                let mut env = self.env();
                let conversation = std::mem::take(&mut env.conversation);
                let topic = env.topic.clone();
                env.restarts.push(Restart {
                    topic,
                    conversation,
                });
            }
            self.new_topic().await;
            {
                let mut env = self.env();
                env.logs.clear();
                env.scorer = Scorer::default();
            }
            self.bootstrap(horizon, false, [false; 3]).await;
        }
        self.make_observation().await;
    }

    /// `convo_env.py:1078` `_get_topic_suggestion` and the append after it.
    async fn new_topic(&self) {
        let vars = {
            let mut env = self.env();
            if let Some(topic) = env.fixed_topic.clone() {
                env.trigger = None;
                env.topic = topic.clone();
                env.used_topics.push(topic.clone());
                if !env.topics.contains(&topic) {
                    env.topics.push(topic);
                }
                return;
            }
            let mut all: Vec<String> = Vec::new();
            for p in &env.settings.personas {
                for t in &p.landmines {
                    if !all.contains(t) {
                        all.push(t.clone());
                    }
                }
            }
            let trigger = if all.is_empty() {
                None
            } else {
                let mut available: Vec<String> = all
                    .iter()
                    .filter(|t| !env.used_triggers.contains(t))
                    .cloned()
                    .collect();
                if available.is_empty() {
                    env.used_triggers.clear();
                    available = all;
                }
                let pick = available[env.choice(available.len())].clone();
                env.used_triggers.push(pick.clone());
                Some(pick)
            };
            env.trigger = trigger.clone();
            let mut vars = env.base_vars();
            vars.insert("used_topics".to_owned(), json!(env.used_topics));
            vars.insert("trigger".to_owned(), json!(trigger));
            vars
        };
        let topic = self
            .ask_nonempty(CallKind::Topic, vars, |t| t.trim().to_owned())
            .await
            .unwrap_or_else(|| TOPIC_FALLBACK.to_owned());
        let mut env = self.env();
        env.topic = topic.clone();
        env.used_topics.push(topic.clone());
        env.topics.push(topic);
    }

    /// `humans_ollama.py:278` `human_reply` for one speaker: the one after
    /// the last human speaker; asked while the reply is empty; a line
    /// without hiragana replaced (`require_hiragana`).
    async fn human_reply(&self, pass_needs: bool, flags: [bool; 3]) {
        let (speaker, vars) = {
            let env = self.env();
            let last = env.logs.iter().rev().find_map(|l| l.speaker);
            let speaker = last.map_or(Person::A, |p| Person::ALL[(p.index() + 1) % 3]);
            (speaker, env.persona_vars(speaker, pass_needs, flags))
        };
        let text = self
            .ask_nonempty(CallKind::Speak(speaker), vars, |t| t.trim().to_owned())
            .await;
        let mut env = self.env();
        let require = env.settings.require_hiragana;
        let text = match text {
            Some(t) if !require || contains_hiragana(&t) => t,
            _ => PERSONA_FALLBACK.to_owned(),
        };
        env.push(Line {
            speaker: Some(speaker),
            text,
        });
    }

    /// `convo_env.py:1458` `_bootstrap_humans`: `turns` utterances, each
    /// scored (an update) once the check has started.
    async fn bootstrap(&self, turns: u32, pass_needs: bool, flags: [bool; 3]) {
        let limit = {
            let env = self.env();
            (env.settings.max_steps.max(1) * 9).max(1)
        };
        for _ in 0..turns.min(limit) {
            self.human_reply(pass_needs, flags).await;
            let filtered = {
                let env = self.env();
                if humans(&env.logs) < env.settings.scorer.start_after {
                    continue;
                }
                filter_logs(&env.logs, env.settings.history.scorer, true)
            };
            self.get_scores(filtered, true).await;
        }
    }

    /// One reading of the scorer (`_instant`): a call, its reply parsed;
    /// with `scorer.kind: rules` (the original's `backend: rule`), its rule.
    async fn instant(&self, lines: &[Line], people: &[Person]) -> Scores {
        if self.env().settings.scorer.kind == ScorerKind::Rules {
            return self.env().rule_scores(lines, people);
        }
        let vars = self.env().scorer_vars(lines, people);
        let reply = self.ask(CallKind::Score, vars).await;
        let mut env = self.env();
        env.scorer_calls += 1;
        let (scores, clipped) = parse_scores(&reply, env.names(), people);
        if clipped > 0 {
            env.clipped_scores += clipped;
            tracing::warn!(
                "episode {}: the relation scorer gave {clipped} value(s) outside [-1, 1], clipped",
                env.episode_id
            );
        }
        scores
    }

    /// `relation_scorer.py:256` `get_scores`. Without `update`: the kept
    /// scores (with EMA, no call) or one call per pair, each pair read of
    /// its own call; with it, one call, smoothed with EMA.
    async fn get_scores(&self, lines: Vec<Line>, update: bool) -> Scores {
        let people = participants(&lines);
        let pairs = pairs_of(&people);
        let use_ema = self.env().settings.scorer.use_ema;
        let mut out: Scores = [None; 3];
        if !update {
            for &i in &pairs {
                // The guard is gone before the call below (an `if` arm's
                // temporaries are dropped at its end).
                let value = if use_ema {
                    self.env().scorer.scores[i]
                } else {
                    self.instant(&lines, &people).await[i]
                };
                out[i] = Some(value.unwrap_or(0.0));
            }
            return out;
        }
        let inst = self.instant(&lines, &people).await;
        if !use_ema {
            return inst;
        }
        let mut env = self.env();
        let decay = env.settings.scorer.decay_factor;
        let mut counts = [0u32; 3];
        for l in &lines {
            if let Some(p) = l.speaker {
                counts[p.index()] += 1;
            }
        }
        for i in 0..3 {
            let Some(x) = inst[i] else { continue };
            let (a, b) = PAIRS[i];
            let da = counts[a.index()].saturating_sub(env.scorer.last_totals[a.index()]);
            let db = counts[b.index()].saturating_sub(env.scorer.last_totals[b.index()]);
            let session = da.min(db);
            let past: u32 = env.scorer.history[i].iter().sum();
            let value = match env.scorer.scores[i] {
                None => x,
                Some(prev) => {
                    let denom = session + past;
                    let ratio = if denom > 0 {
                        f64::from(session) / f64::from(denom)
                    } else {
                        0.0
                    };
                    let alpha = (decay * ratio).clamp(0.01, 1.0);
                    alpha * x + (1.0 - alpha) * prev
                }
            };
            env.scorer.scores[i] = Some(value);
            out[i] = Some(value);
            let history = &mut env.scorer.history[i];
            history.push_back(session);
            if history.len() > 3 {
                history.pop_front();
            }
        }
        env.scorer.last_totals = counts;
        out
    }

    /// `convo_env.py:1656` `relation_snapshot`: over the whole log, robot
    /// lines included, without an update.
    async fn relation_snapshot(&self) -> Metrics {
        let logs = self.env().logs.clone();
        Metrics::of(self.get_scores(logs, false).await)
    }

    /// `convo_env.py:1170` `planning_context`: `_edge_weights` and
    /// `_is_balanced`, each a snapshot's calls; their values go into the
    /// observation only.
    async fn planning_context(&self) -> Scores {
        let logs = self.env().logs.clone();
        let weights = self.get_scores(logs, false).await;
        self.relation_snapshot().await;
        weights
    }

    /// `convo_env.py:1189` `_make_observation`: the context, a snapshot,
    /// the target drawn, the policy's observation text.
    async fn make_observation(&self) {
        let weights = self.planning_context().await;
        let snapshot = self.relation_snapshot().await;
        let mut env = self.env();
        let (edge, speaker, score) = if snapshot.has_edges() {
            let (edge, speaker) = env.select_target(&snapshot.scores);
            let score = snapshot.scores[edge_pair(edge)].unwrap_or(0.0);
            (edge, speaker, score)
        } else {
            (Edge::AB, Person::A, 0.0)
        };
        env.target = Some((edge, speaker));
        let filtered = filter_logs(&env.logs, env.settings.history.policy, false);
        let history = if filtered.is_empty() {
            "(履歴なし)".to_owned()
        } else {
            filtered
                .iter()
                .map(|l| format!("[{}] {}", l.label(), l.text.trim()))
                .collect::<Vec<_>>()
                .join("\n")
        };
        // _edge_weights_from_scores: AB, BC, CA (CA is the pair A, C).
        let w = |i: usize| weights[i].unwrap_or(0.0);
        env.observation = format!(
            "履歴:\n{history}\n\n現在の関係スコア（-1..1）: w_AB={}, w_BC={}, w_CA={}\n\n改善すべきエッジ: {} (現在: {})\n発話対象（ターゲット）: {}",
            signed(w(0)),
            signed(w(2)),
            signed(w(1)),
            edge.as_str(),
            signed(score),
            speaker.as_str(),
        );
    }

    /// `convo_env.py:436` `step`.
    async fn step(&self, action: &str) -> StepOut {
        let began = self.env().logs.len();
        let (skip_generation, previous) = {
            let env = self.env();
            let previous = if env.previous_intervened {
                env.previous_rel_after_bonus
                    .or(env.previous_rel_after_horizon)
                    .map_or(Before::Empty, Before::Previous)
            } else {
                Before::Empty
            };
            (env.previous_intervened || env.episode_step == 0, previous)
        };
        let mut before = if skip_generation {
            if self.env().previous_intervened {
                previous
            } else {
                Before::Snapshot(self.relation_snapshot().await)
            }
        } else {
            self.human_reply(false, [false; 3]).await;
            Before::Snapshot(self.relation_snapshot().await)
        };
        let (skip_stable, start, window) = {
            let env = self.env();
            (
                env.settings.filter_zero_rewards,
                env.settings.scorer.start_after,
                env.settings.history.scorer,
            )
        };
        let max_auto_skip = if skip_stable {
            self.env().settings.max_auto_skip
        } else {
            0
        };
        // convo_env.py:519: a snapshot without metrics is evaluated again.
        if skip_stable && !matches!(before, Before::Snapshot(_)) {
            let filtered = {
                let env = self.env();
                (humans(&env.logs) >= start).then(|| filter_logs(&env.logs, window, true))
            };
            if let Some(filtered) = filtered {
                before = Before::Snapshot(Metrics::of(self.get_scores(filtered, false).await));
            }
        }
        let mut count = 0;
        let mut fresh: Option<Metrics> = None;
        while skip_stable && count < max_auto_skip {
            if before.metrics().is_some_and(|m| m.unstable_triads > 0) {
                break;
            }
            count += 1;
            self.human_reply(false, [false; 3]).await;
            // convo_env.py:574: the whole log, robot lines included.
            let logs = self.env().logs.clone();
            let metrics = Metrics::of(self.get_scores(logs, true).await);
            before = Before::Snapshot(metrics);
            fresh = Some(metrics);
        }
        let reached_max_auto_skip = count >= max_auto_skip;
        let mut info = Info {
            before: self.env().logs[began..]
                .iter()
                .filter(|l| l.speaker.is_some())
                .cloned()
                .collect(),
            status: before.metrics(),
            ..Info::default()
        };
        let unstable = before.metrics().map_or(0, |m| m.unstable_triads);
        let incomplete = !before.metrics().is_some_and(|m| m.has_edges());
        if unstable == 0 && !incomplete {
            // convo_env.py:627: stable, no reward.
            self.make_observation().await;
            let mut env = self.env();
            env.episode_step += 1;
            env.t += 1;
            let max_steps = env.settings.max_steps;
            let at_max = max_steps > 0 && env.t >= max_steps;
            let stable_end = reached_max_auto_skip || (skip_stable && max_auto_skip > 0);
            env.previous_intervened = false;
            env.previous_rel_after_horizon = None;
            env.previous_rel_after_bonus = None;
            info.rel = match before {
                Before::Snapshot(m) => Some(m),
                _ => None,
            };
            return StepOut {
                done: stable_end || at_max,
                stable_end,
                info,
                ..StepOut::default()
            };
        }
        // convo_env.py:722: scored again unless the auto-skip did.
        let counted = humans(&self.env().logs);
        if counted >= start {
            let metrics = match fresh {
                Some(metrics) => metrics,
                None => {
                    let filtered = filter_logs(&self.env().logs, window, true);
                    Metrics::of(self.get_scores(filtered, true).await)
                }
            };
            let empty = self.env().logs.is_empty();
            if metrics.unstable_triads == 0 && !empty {
                // convo_env.py:742: stable after all: no reward, not done.
                {
                    let mut env = self.env();
                    env.episode_step += 1;
                    env.t += 1;
                }
                self.make_observation().await;
                info.rel = Some(metrics);
                return StepOut {
                    info,
                    ..StepOut::default()
                };
            }
        }
        let snapshot_len = self.env().logs.len();
        let (plan, direct) = self.env().parse_plan(action);
        info.plan_error = plan.is_none();
        let mut robot: Option<String> = None;
        let mut intervened = false;
        if let Some(plan) = plan.as_ref().filter(|p| p.intervene) {
            // convo_env.py:1344 `_render_intervention`.
            let (vars, fallback) = {
                let env = self.env();
                (env.robot_vars(plan), env.robot_fallback(plan))
            };
            let line = self
                .ask_nonempty(CallKind::Robot, vars, strip_quotes)
                .await
                .unwrap_or(fallback);
            robot = Some(line);
            intervened = true;
        } else if let Some(direct) = direct {
            robot = Some(strip_quotes(&direct));
            intervened = true;
        }
        let edge = plan.as_ref().map_or(Edge::AB, |p| p.edge);
        let target = plan.as_ref().map_or(Person::A, |p| p.target);
        let strategy = plan.as_ref().and_then(|p| p.strategy).unwrap_or("plan");
        let flags = {
            let mut env = self.env();
            if let Some(line) = &robot {
                env.push(Line {
                    speaker: None,
                    text: line.clone(),
                });
            }
            Person::ALL.map(|p| p == target && strategy == env.preferred(p))
        };
        let (horizon, duration, stable_bonus, preference_bonus) = {
            let env = self.env();
            let r = &env.settings.rewards;
            (
                r.evaluation_horizon,
                r.terminal_bonus_duration,
                r.stable_bonus,
                r.preference_match_bonus,
            )
        };
        self.bootstrap(horizon, true, flags).await;
        let after = self.rescore(start, window).await;
        let metrics_after = Metrics::of(after);
        let score_after = after[edge_pair(edge)].unwrap_or(0.0);
        let mut out = StepOut {
            robot: robot.clone(),
            after_horizon: Some(metrics_after),
            ..StepOut::default()
        };
        info.plan = plan.clone();
        info.intervened = intervened;
        if metrics_after.unstable_triads == 0 && score_after > 0.0 {
            // convo_env.py:910: the duration, then one check.
            self.bootstrap(duration, true, flags).await;
            let counted = humans(&self.env().logs);
            if counted >= start {
                let filtered = filter_logs(&self.env().logs, window, true);
                let check = Metrics::of(self.get_scores(filtered, true).await);
                let positive = check.scores[edge_pair(edge)].unwrap_or(0.0) > 0.0;
                out.after_bonus = Some(check);
                if check.unstable_triads == 0 && positive {
                    out.stable_bonus = stable_bonus;
                }
            }
        }
        let preferred = self.env().preferred(target);
        if strategy == preferred {
            out.preference_bonus = preference_bonus;
        }
        info.judged = Some(Judged {
            target,
            strategy,
            preferred,
            edge,
            score_after,
        });
        info.replies = self.env().logs[snapshot_len..].to_vec();
        out.info = info;
        out.reward = out.stable_bonus + out.preference_bonus;
        {
            let mut env = self.env();
            env.episode_step += 1;
            env.t += 1;
            let max_steps = env.settings.max_steps;
            out.done = max_steps > 0 && env.t >= max_steps;
        }
        // convo_env.py:993: the final relations, an update.
        let last = self.rescore(start, window).await;
        out.info.rel = Some(Metrics::of(last));
        self.make_observation().await;
        let mut env = self.env();
        env.previous_intervened = intervened;
        env.previous_rel_after_horizon = intervened.then_some(metrics_after);
        env.previous_rel_after_bonus = if intervened && out.stable_bonus > 0.0 {
            out.after_bonus
        } else {
            None
        };
        out
    }

    /// The scorer's update over its window, once the check has started
    /// (`{}` before).
    async fn rescore(&self, start: u32, window: u32) -> Scores {
        let filtered = {
            let env = self.env();
            (humans(&env.logs) >= start).then(|| filter_logs(&env.logs, window, true))
        };
        match filtered {
            Some(filtered) => self.get_scores(filtered, true).await,
            None => [None; 3],
        }
    }
}

/// Python's `f"{value:+.2f}"`.
fn signed(value: f64) -> String {
    format!("{value:+.2}")
}

/// What a step gave.
#[derive(Debug, Clone, Default)]
struct StepOut {
    reward: f64,
    stable_bonus: f64,
    preference_bonus: f64,
    done: bool,
    /// Done because the state stayed stable (not `max_steps`).
    stable_end: bool,
    robot: Option<String>,
    after_horizon: Option<Metrics>,
    after_bonus: Option<Metrics>,
    info: Info,
}

/// What the original's `info` holds of a step, as far as its trainer logs
/// it.
#[derive(Debug, Clone, Default)]
struct Info {
    /// `human_utterance_before_relation`.
    before: Vec<Line>,
    /// `status`: the relations the step began from (None: `{}`).
    status: Option<Metrics>,
    /// `rel` of a step that returned stable.
    rel: Option<Metrics>,
    plan: Option<Plan>,
    /// `plan_error` (an action that is neither a digit nor JSON).
    plan_error: bool,
    intervened: bool,
    /// `replies`: the lines after the step's snapshot of the log.
    replies: Vec<Line>,
    /// Of a step that judged an intervention.
    judged: Option<Judged>,
}

#[derive(Debug, Clone)]
struct Judged {
    target: Person,
    strategy: &'static str,
    preferred: &'static str,
    edge: Edge,
    score_after: f64,
}

/// reward_fn's `episode_stats` of one episode.
#[derive(Debug, Clone, Copy, Default)]
struct EpisodeStats {
    total_reward: f64,
    interventions: u32,
    unstable_no_intervention: u32,
    plan_errors: u32,
}

type Play = Pin<Box<dyn Future<Output = Ending> + Send>>;

/// Where the episode waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiting {
    Nothing,
    Call,
    Decision,
    /// The policy model's call for the decision due.
    Policy,
}

/// One episode under `rules: original`.
pub struct Original {
    env: Arc<Mutex<Env>>,
    port: Arc<Mutex<Port>>,
    play: Option<Play>,
    waiting: Waiting,
    /// The random policy's draws (not the original's source).
    draws: Draws,
}

impl Original {
    /// Episode `episode`, its draws seeded by the run's seed and its id.
    pub fn new(settings: Arc<ConversationSettings>, episode: &str, topic: Option<String>) -> Self {
        let seed = Draws::new(settings.seed, episode).next_u64();
        Self::seeded(settings, episode, topic, seed, 1)
    }

    /// Python's `random.seed(seed)` before the environment is made, and
    /// `episodes` episodes played (the original's resets after `done`).
    pub fn seeded(
        settings: Arc<ConversationSettings>,
        episode: &str,
        topic: Option<String>,
        seed: u64,
        episodes: u32,
    ) -> Self {
        let draws = Draws::new(settings.seed, episode);
        let env = Arc::new(Mutex::new(Env::new(settings, episode, seed, topic)));
        let port = Arc::new(Mutex::new(Port::default()));
        let runner = Runner {
            env: env.clone(),
            port: port.clone(),
            episodes: episodes.max(1),
        };
        Self {
            env,
            port,
            play: Some(Box::pin(runner.run())),
            waiting: Waiting::Nothing,
            draws,
        }
    }

    pub fn env(&self) -> std::sync::MutexGuard<'_, Env> {
        lock(&self.env)
    }

    /// Runs the episode to what it needs next.
    fn resume(&mut self, input: Option<Input>) -> Next {
        if let Some(input) = input {
            lock(&self.port).input = Some(input);
        }
        let Some(play) = &mut self.play else {
            return Next::Over;
        };
        let mut cx = Context::from_waker(Waker::noop());
        match play.as_mut().poll(&mut cx) {
            Poll::Ready(ending) => {
                self.play = None;
                self.waiting = Waiting::Nothing;
                self.env().ending = Some(ending);
                Next::Over
            }
            Poll::Pending => match lock(&self.port).out.take() {
                Some(Yielded::Ask(ask)) => {
                    self.waiting = Waiting::Call;
                    Next::Ask(ask)
                }
                Some(Yielded::Decide(decision)) => {
                    self.waiting = Waiting::Decision;
                    Next::Decide(decision)
                }
                None => {
                    self.play = None;
                    Next::Over
                }
            },
        }
    }

    pub fn start(&mut self) -> Next {
        self.resume(None)
    }

    pub fn reply(&mut self, reply: &str) -> Result<Next, String> {
        match self.waiting {
            Waiting::Call => Ok(self.resume(Some(Input::Text(reply.to_owned())))),
            Waiting::Policy => {
                Ok(self.resume(Some(Input::Choice(Choice::Reply(reply.to_owned())))))
            }
            Waiting::Nothing | Waiting::Decision => {
                Err("a reply came when no call was asked".to_owned())
            }
        }
    }

    pub fn ask_policy(&mut self) -> Next {
        let vars = self.policy_vars();
        self.waiting = Waiting::Policy;
        Next::Ask(Ask {
            kind: CallKind::Policy,
            vars,
            rejected: None,
        })
    }

    pub fn act(&mut self, strategy: Option<Strategy>) -> Next {
        let choice = match strategy {
            Some(s) => Choice::Strategy(s),
            None => Choice::Invalid("reply".to_owned()),
        };
        self.resume(Some(Input::Choice(choice)))
    }

    /// The decision due from a model's raw output, read as reward_fn reads
    /// it.
    pub fn act_output(&mut self, output: &str) -> Next {
        self.resume(Some(Input::Choice(Choice::Reply(output.to_owned()))))
    }

    pub fn act_invalid(&mut self, reason: &str) -> Next {
        self.resume(Some(Input::Choice(Choice::Invalid(reason.to_owned()))))
    }

    pub fn policy_vars(&self) -> Map<String, Value> {
        let env = self.env();
        match &env.due {
            Some((_, vars)) => vars.clone(),
            None => env.policy_vars(),
        }
    }

    pub fn random_strategy(&mut self) -> Strategy {
        Strategy::ALL[self.draws.below(Strategy::ALL.len())]
    }

    pub fn topic(&self) -> String {
        self.env().topic.clone()
    }

    pub fn needs(&self) -> [Need; 3] {
        self.env().needs
    }

    pub fn steps(&self) -> Vec<StepRecord> {
        self.env().steps.clone()
    }

    pub fn restarts(&self) -> u32 {
        self.env().restarts.len() as u32
    }

    pub fn clipped_scores(&self) -> u32 {
        self.env().clipped_scores
    }

    pub fn ending(&self) -> Option<Ending> {
        self.env().ending
    }

    pub fn summary(&self) -> Value {
        let env = self.env();
        let total: f64 = env.steps.iter().map(|s| s.reward.total).sum();
        json!({
            "episode": env.episode_id,
            "rules": "original",
            "needs": {"A": env.needs[0], "B": env.needs[1], "C": env.needs[2]},
            "aggressive": {"A": env.aggressive[0], "B": env.aggressive[1], "C": env.aggressive[2]},
            "topics": env.topics,
            "triggers": env.used_triggers,
            "ending": env.ending,
            "human_utterances": env.human_utterances,
            "scorer_calls": env.scorer_calls,
            "invalid_scores": 0,
            "clipped_scores": env.clipped_scores,
            "restarts": env.restarts,
            "env_steps": env.t,
            "stable_steps": env.stable_steps,
            "total_reward": total,
            "steps": env.steps,
            "conversation": env.conversation,
            // What the original's trainer logs (conversation_summary.jsonl
            // and batch_summary.jsonl in its shape).
            "original_log": env.log,
        })
    }
}

#[cfg(test)]
mod tests;
