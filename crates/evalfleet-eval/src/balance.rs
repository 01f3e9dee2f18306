//! Structural balance of a three-person conversation (`kind:
//! conversation`), and the rewards of an intervention, exactly as
//! `docs/conversation.md` states them. Pure arithmetic: no calls, no clocks.
//!
//! - An edge (AB, BC, CA) holds a relation in [-1, 1]; it is **positive**
//!   when its value is at least 0, otherwise **negative** (0 counts as
//!   positive, as in the system evalfleet replaces: `>= 0` is `+`).
//! - A triangle is **stable** when all three edges are positive or exactly
//!   one is (+++, +--, -+-, --+); otherwise (++-, +-+, -++, ---) unstable.
//! - Its **instability** is the least total weight of sign flips that makes
//!   it stable, a flip of an edge weighing the edge's absolute value. One
//!   flip always suffices (from two positives, flip the negative or one of
//!   the positives; from none, flip any), so it is the smallest absolute
//!   value of the three, and 0 for a stable triangle.
//! - The **target edge** of an unstable triangle is, by default
//!   ([`TargetRule::ClosestToZero`]), its negative edge closest to 0 (the
//!   cheapest to turn positive); with [`TargetRule::MostNegative`], its
//!   negative edge of lowest value. Of equal values, the first in the order
//!   AB, BC, CA. A stable triangle has none.
//! - The **target speaker** is the one of the target edge's two people
//!   whose relation with the third person is the lower (the one worse off
//!   in the group); of equal values, the edge's first person (A of AB, B of
//!   BC, C of CA).

use std::fmt;

use serde::{Deserialize, Serialize};

/// One of the three human speakers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Person {
    A,
    B,
    C,
}

impl Person {
    pub const ALL: [Person; 3] = [Person::A, Person::B, Person::C];

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::A => "A",
            Self::B => "B",
            Self::C => "C",
        }
    }
}

impl fmt::Display for Person {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A relation between two of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Edge {
    AB,
    BC,
    CA,
}

impl Edge {
    /// In the order ties are broken in.
    pub const ALL: [Edge; 3] = [Edge::AB, Edge::BC, Edge::CA];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::AB => "AB",
            Self::BC => "BC",
            Self::CA => "CA",
        }
    }

    /// Its two people, in the order of its name.
    pub fn people(self) -> (Person, Person) {
        match self {
            Self::AB => (Person::A, Person::B),
            Self::BC => (Person::B, Person::C),
            Self::CA => (Person::C, Person::A),
        }
    }

    /// The person not on it.
    pub fn third(self) -> Person {
        match self {
            Self::AB => Person::C,
            Self::BC => Person::A,
            Self::CA => Person::B,
        }
    }

    /// The edge between two different people.
    pub fn between(x: Person, y: Person) -> Option<Edge> {
        Edge::ALL.into_iter().find(|e| {
            let (p, q) = e.people();
            (p, q) == (x, y) || (q, p) == (x, y)
        })
    }
}

impl fmt::Display for Edge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The three relations at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Triangle {
    #[serde(rename = "AB")]
    pub ab: f64,
    #[serde(rename = "BC")]
    pub bc: f64,
    #[serde(rename = "CA")]
    pub ca: f64,
}

impl Triangle {
    pub fn new(ab: f64, bc: f64, ca: f64) -> Self {
        Self { ab, bc, ca }
    }

    pub fn get(&self, edge: Edge) -> f64 {
        match edge {
            Edge::AB => self.ab,
            Edge::BC => self.bc,
            Edge::CA => self.ca,
        }
    }

    /// At least 0: 0 counts as positive.
    pub fn positive(&self, edge: Edge) -> bool {
        self.get(edge) >= 0.0
    }

    /// The signs, in the order AB, BC, CA (`+-+`).
    pub fn pattern(&self) -> String {
        Edge::ALL
            .iter()
            .map(|&e| if self.positive(e) { '+' } else { '-' })
            .collect()
    }

    pub fn stable(&self) -> bool {
        let positives = Edge::ALL.iter().filter(|&&e| self.positive(e)).count();
        positives == 3 || positives == 1
    }

    /// The least weight of sign flips to a stable triangle (0 when stable).
    pub fn instability(&self) -> f64 {
        if self.stable() {
            return 0.0;
        }
        Edge::ALL
            .iter()
            .map(|&e| self.get(e).abs())
            .fold(f64::INFINITY, f64::min)
    }

    /// The edge an intervention aims at, among the negative edges of an
    /// unstable triangle, by `rule` (ties: the first in AB, BC, CA).
    pub fn target_edge(&self, rule: TargetRule) -> Option<Edge> {
        if self.stable() {
            return None;
        }
        // How far an edge is from being chosen: the lower, the better.
        let rank = |edge: Edge| match rule {
            TargetRule::ClosestToZero => self.get(edge).abs(),
            TargetRule::MostNegative => self.get(edge),
        };
        let mut best: Option<Edge> = None;
        for edge in Edge::ALL {
            if self.positive(edge) {
                continue;
            }
            if best.is_none_or(|b| rank(edge) < rank(b)) {
                best = Some(edge);
            }
        }
        best
    }

    /// Of `edge`'s two people, the one whose relation with the third person
    /// is lower (ties: the edge's first person).
    pub fn target_speaker(&self, edge: Edge) -> Person {
        let (first, second) = edge.people();
        let third = edge.third();
        let with_third = |p: Person| Edge::between(p, third).map_or(0.0, |e| self.get(e));
        if with_third(second) < with_third(first) {
            second
        } else {
            first
        }
    }

    /// Each edge smoothed: `decay x previous + (1 - decay) x observed`.
    pub fn smoothed(&self, observed: &Triangle, decay: f64) -> Triangle {
        let mix = |old: f64, new: f64| decay * old + (1.0 - decay) * new;
        Triangle::new(
            mix(self.ab, observed.ab),
            mix(self.bc, observed.bc),
            mix(self.ca, observed.ca),
        )
    }
}

/// Which negative edge of an unstable triangle an intervention aims at
/// (`rewards.target_edge`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TargetRule {
    /// The one closest to 0, the cheapest flip (the original system's
    /// rule; the default).
    #[default]
    ClosestToZero,
    /// The one of lowest value.
    MostNegative,
}

impl TargetRule {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ClosestToZero => "closest_to_zero",
            Self::MostNegative => "most_negative",
        }
    }
}

/// What each person wants from the conversation, drawn per episode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Need {
    Recognition,
    Mediation,
    Solution,
    Independence,
}

impl Need {
    pub const ALL: [Need; 4] = [
        Need::Recognition,
        Need::Mediation,
        Need::Solution,
        Need::Independence,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Recognition => "recognition",
            Self::Mediation => "mediation",
            Self::Solution => "solution",
            Self::Independence => "independence",
        }
    }

    /// The strategy that answers it.
    pub fn strategy(self) -> Strategy {
        match self {
            Self::Recognition => Strategy::Validate,
            Self::Mediation => Strategy::Bridge,
            Self::Solution => Strategy::Plan,
            Self::Independence => Strategy::NoIntervention,
        }
    }
}

/// What the robot does at a decision: the policy's digit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    Validate = 1,
    Bridge = 2,
    Plan = 3,
    NoIntervention = 4,
}

impl Strategy {
    pub const ALL: [Strategy; 4] = [
        Strategy::Validate,
        Strategy::Bridge,
        Strategy::Plan,
        Strategy::NoIntervention,
    ];

    pub fn digit(self) -> u8 {
        self as u8
    }

    pub fn from_digit(digit: u8) -> Option<Strategy> {
        Strategy::ALL.into_iter().find(|s| s.digit() == digit)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Validate => "validate",
            Self::Bridge => "bridge",
            Self::Plan => "plan",
            Self::NoIntervention => "no_intervention",
        }
    }

    /// Whether the robot speaks.
    pub fn intervenes(self) -> bool {
        self != Strategy::NoIntervention
    }

    /// A policy's reply read as a strategy: one digit 1 to 4, alone (spaces,
    /// quotes, `*` and a final `.` around it are allowed).
    pub fn parse_reply(reply: &str) -> Option<Strategy> {
        let core = reply.trim().trim_end_matches('.').trim_matches(|c: char| {
            c == '"' || c == '\'' || c == '*' || c == '`' || c.is_whitespace()
        });
        match core.as_bytes() {
            [d @ b'1'..=b'4'] => Strategy::from_digit(d - b'0'),
            _ => None,
        }
    }
}

/// The reward settings (`task.conversation.rewards`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RewardSettings {
    pub stable_bonus: f64,
    pub preference_match_bonus: f64,
    /// Human utterances after the intervention at which the target edge and
    /// the triangle are first checked.
    pub evaluation_horizon: u32,
    /// Human utterances after that through which both must still hold,
    /// checked after each of them.
    pub terminal_bonus_duration: u32,
    /// Which negative edge a decision aims at.
    pub target_rule: TargetRule,
    /// A step ends at the first check that fails (the bonus can no longer
    /// be paid), rather than playing out its utterances.
    pub end_step_when_lost: bool,
    /// What an invalid decision costs: its reward is minus this.
    pub invalid_penalty: f64,
}

impl Default for RewardSettings {
    fn default() -> Self {
        Self {
            stable_bonus: 2.0,
            preference_match_bonus: 0.5,
            evaluation_horizon: 3,
            terminal_bonus_duration: 2,
            target_rule: TargetRule::ClosestToZero,
            end_step_when_lost: true,
            invalid_penalty: 1.0,
        }
    }
}

/// The parts of one decision's reward.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Reward {
    pub stable_bonus: f64,
    pub preference_match_bonus: f64,
    /// What an invalid decision cost (0 or negative).
    #[serde(default)]
    pub invalid_penalty: f64,
    pub total: f64,
}

impl Reward {
    /// The reward of an invalid decision: the penalty alone.
    pub fn invalid(settings: &RewardSettings) -> Reward {
        Reward {
            invalid_penalty: -settings.invalid_penalty,
            total: -settings.invalid_penalty,
            ..Reward::default()
        }
    }
}

/// Whether a triangle at a check keeps the bonus of an intervention aimed
/// at `target`: the target edge positive and the triangle stable. A
/// triangle made stable through another edge (the target still negative)
/// does not.
pub fn holds(target: Edge, triangle: &Triangle) -> bool {
    triangle.positive(target) && triangle.stable()
}

/// Whether an intervention aimed at `target` held: at every check, from
/// the horizon through each utterance of the bonus duration (`checks`, in
/// order, all of them: a step cut short at a failed check has fewer than
/// `1 + terminal_bonus_duration` and does not hold).
pub fn held(settings: &RewardSettings, target: Edge, checks: &[Triangle]) -> bool {
    checks.len() == 1 + settings.terminal_bonus_duration as usize
        && checks.iter().all(|t| holds(target, t))
}

/// The reward of choosing `strategy` against `target` (spoken by a person
/// whose need is `need`), given the triangle at each check.
pub fn reward(
    settings: &RewardSettings,
    strategy: Strategy,
    need: Need,
    target: Edge,
    checks: &[Triangle],
) -> Reward {
    let stable_bonus = if held(settings, target, checks) {
        settings.stable_bonus
    } else {
        0.0
    };
    let preference_match_bonus = if need.strategy() == strategy {
        settings.preference_match_bonus
    } else {
        0.0
    };
    Reward {
        stable_bonus,
        preference_match_bonus,
        invalid_penalty: 0.0,
        total: stable_bonus + preference_match_bonus,
    }
}

/// The scores of a conversation episode: their keys, and the metrics they
/// are stored as.
pub const EPISODE_SCORES: [(&str, &str); 7] = [
    ("reward", "episode_reward"),
    ("steps", "episode_steps"),
    ("interventions", "episode_interventions"),
    ("stabilised", "episode_stabilised"),
    ("preference_matches", "episode_preference_matches"),
    ("invalid", "episode_invalid"),
    ("clipped_scores", "episode_clipped_scores"),
];

/// Shannon entropy, in bits, of counts.
pub fn entropy_bits(counts: &[u64]) -> f64 {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return 0.0;
    }
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / total as f64;
            -p * p.log2()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ab: f64, bc: f64, ca: f64) -> Triangle {
        Triangle::new(ab, bc, ca)
    }

    #[test]
    fn every_sign_pattern_is_stable_or_not_as_balance_theory_says() {
        let cases = [
            ("+++", true),
            ("+--", true),
            ("-+-", true),
            ("--+", true),
            ("++-", false),
            ("+-+", false),
            ("-++", false),
            ("---", false),
        ];
        for (pattern, stable) in cases {
            let v: Vec<f64> = pattern
                .chars()
                .map(|c| if c == '+' { 0.5 } else { -0.5 })
                .collect();
            let tri = t(v[0], v[1], v[2]);
            assert_eq!(tri.pattern(), pattern);
            assert_eq!(tri.stable(), stable, "{pattern}");
            assert_eq!(
                tri.target_edge(TargetRule::ClosestToZero).is_none(),
                stable,
                "{pattern}"
            );
        }
    }

    #[test]
    fn zero_is_positive() {
        // +, +, 0 is "+++": stable, nothing to aim at.
        let tri = t(0.4, 0.3, 0.0);
        assert_eq!(tri.pattern(), "+++");
        assert!(tri.stable());
        assert_eq!(tri.target_edge(TargetRule::ClosestToZero), None);
        assert_eq!(tri.instability(), 0.0);
        // 0, 0, 0 is "+++" too.
        assert!(t(0.0, 0.0, 0.0).stable());
        // 0 beside two negatives is the one positive of "+--": stable.
        assert_eq!(t(0.0, -0.2, -0.3).pattern(), "+--");
        assert!(t(0.0, -0.2, -0.3).stable());
        // 0 beside one positive and one negative: "++-", unstable, aimed at
        // the negative one.
        let tri = t(0.0, 0.5, -0.1);
        assert_eq!(tri.pattern(), "++-");
        assert_eq!(tri.target_edge(TargetRule::ClosestToZero), Some(Edge::CA));
        // A hair below 0 is negative.
        assert_eq!(t(-1e-9, 0.5, 0.5).pattern(), "-++");
    }

    #[test]
    fn instability_is_the_cheapest_flip() {
        // ++-: flipping CA (0.2) is cheapest.
        assert!((t(0.6, 0.5, -0.2).instability() - 0.2).abs() < 1e-12);
        // ++-: flipping the weak positive BC (0.1) is cheaper than CA (0.9).
        assert!((t(0.6, 0.1, -0.9).instability() - 0.1).abs() < 1e-12);
        // ---: any one flip; the weakest.
        assert!((t(-0.7, -0.3, -0.5).instability() - 0.3).abs() < 1e-12);
        assert_eq!(t(0.5, -0.5, -0.5).instability(), 0.0);
    }

    #[test]
    fn the_target_edge_is_the_negative_closest_to_zero_in_every_all_negative_order() {
        let rule = TargetRule::ClosestToZero;
        // Every ordering of three distinct negative values: the one closest
        // to 0 (-0.1) wins wherever it stands, and the cheapest flip
        // (instability) is its absolute value.
        let values = [-0.1, -0.4, -0.8];
        let orders = [
            [0, 1, 2],
            [0, 2, 1],
            [1, 0, 2],
            [1, 2, 0],
            [2, 0, 1],
            [2, 1, 0],
        ];
        for order in orders {
            let v = order.map(|i| values[i]);
            let tri = t(v[0], v[1], v[2]);
            assert_eq!(tri.pattern(), "---");
            let at = order.iter().position(|&i| i == 0).unwrap();
            assert_eq!(tri.target_edge(rule), Some(Edge::ALL[at]), "{v:?}");
            assert!((tri.instability() - 0.1).abs() < 1e-12);
            // The other rule takes the lowest (-0.8).
            let lowest = order.iter().position(|&i| i == 2).unwrap();
            assert_eq!(
                tri.target_edge(TargetRule::MostNegative),
                Some(Edge::ALL[lowest]),
                "{v:?}"
            );
        }
        // Ties: the first of AB, BC, CA, under both rules.
        assert_eq!(t(-0.5, -0.5, -0.5).target_edge(rule), Some(Edge::AB));
        assert_eq!(t(-0.5, -0.2, -0.2).target_edge(rule), Some(Edge::BC));
        assert_eq!(t(-0.2, -0.5, -0.2).target_edge(rule), Some(Edge::AB));
        assert_eq!(t(-0.3, -0.3, -0.1).target_edge(rule), Some(Edge::CA));
        assert_eq!(
            t(-0.2, -0.5, -0.5).target_edge(TargetRule::MostNegative),
            Some(Edge::BC)
        );
        // One negative: both rules take it.
        for rule in [TargetRule::ClosestToZero, TargetRule::MostNegative] {
            assert_eq!(t(0.5, 0.2, -0.1).target_edge(rule), Some(Edge::CA));
            assert_eq!(t(-0.1, 0.3, 0.2).target_edge(rule), Some(Edge::AB));
            assert_eq!(t(0.3, -0.4, -0.4).target_edge(rule), None); // +-- is stable
        }
    }

    #[test]
    fn the_target_speaker_is_the_one_worse_off_with_the_third() {
        // Edge BC; B's relation with A is AB = 0.5, C's is CA = -0.4: C.
        let tri = t(0.5, -0.6, -0.4);
        assert_eq!(tri.target_speaker(Edge::BC), Person::C);
        // Edge AB; A with C is CA = 0.2, B with C is BC = 0.6: A.
        let tri = t(-0.3, 0.6, 0.2);
        assert_eq!(tri.target_speaker(Edge::AB), Person::A);
        // Edge CA; C with B is BC = 0.1, A with B is AB = -0.2: A.
        let tri = t(-0.2, 0.1, -0.5);
        assert_eq!(tri.target_speaker(Edge::CA), Person::A);
        // A tie: the edge's first person.
        let tri = t(0.3, -0.5, 0.3);
        assert_eq!(tri.target_speaker(Edge::BC), Person::B);
        let tri = t(0.3, 0.3, -0.5);
        assert_eq!(tri.target_speaker(Edge::CA), Person::C);
    }

    #[test]
    fn rewards_need_the_target_edge_and_stability_at_every_check() {
        let s = RewardSettings::default();
        let target = Edge::CA;
        let good = t(0.5, 0.4, 0.3);
        let bad = t(0.5, 0.4, -0.3);
        let r = |checks: &[Triangle]| reward(&s, Strategy::Plan, Need::Mediation, target, checks);
        // Held at the horizon and after each of the two utterances after it.
        let got = r(&[good, good, good]);
        assert_eq!(
            (got.stable_bonus, got.preference_match_bonus, got.total),
            (2.0, 0.0, 2.0)
        );
        // A dip in between pays nothing, though it holds at both ends.
        assert_eq!(r(&[good, bad, good]).total, 0.0);
        // Lost at the end, or reached only after the horizon.
        assert_eq!(r(&[good, good, bad]).total, 0.0);
        assert_eq!(r(&[bad, good, good]).total, 0.0);
        // A step cut short at its failed horizon check.
        assert_eq!(r(&[bad]).total, 0.0);
        // Stable through another edge (+--, target CA still negative).
        let other = t(0.5, -0.4, -0.3);
        assert!(other.stable());
        assert_eq!(r(&[other, other, other]).total, 0.0);
        // The target positive but the triangle unstable (++- elsewhere).
        let unstable = t(0.5, -0.4, 0.3);
        assert_eq!(r(&[unstable, unstable, unstable]).total, 0.0);
        // The target exactly 0 counts as positive.
        let zero = t(0.5, 0.4, 0.0);
        assert_eq!(r(&[zero, zero, zero]).total, 2.0);
        // With no duration, the horizon alone.
        let short = RewardSettings {
            terminal_bonus_duration: 0,
            ..s
        };
        let got = reward(&short, Strategy::Plan, Need::Mediation, target, &[good]);
        assert_eq!(got.total, 2.0);
        // An invalid decision costs the penalty.
        let invalid = Reward::invalid(&s);
        assert_eq!((invalid.invalid_penalty, invalid.total), (-1.0, -1.0));
    }

    #[test]
    fn the_preference_bonus_matches_needs_to_strategies() {
        let s = RewardSettings::default();
        let bad = t(0.5, 0.4, -0.3);
        for need in Need::ALL {
            for strategy in Strategy::ALL {
                let r = reward(&s, strategy, need, Edge::CA, &[bad, bad, bad]);
                let expected = match (need, strategy) {
                    (Need::Recognition, Strategy::Validate)
                    | (Need::Mediation, Strategy::Bridge)
                    | (Need::Solution, Strategy::Plan)
                    | (Need::Independence, Strategy::NoIntervention) => 0.5,
                    _ => 0.0,
                };
                assert_eq!(r.preference_match_bonus, expected, "{need:?} {strategy:?}");
                assert_eq!(r.total, expected);
            }
        }
        let good = t(0.5, 0.4, 0.3);
        let r = reward(
            &s,
            Strategy::Validate,
            Need::Recognition,
            Edge::CA,
            &[good, good, good],
        );
        assert_eq!(r.total, 2.5);
    }

    #[test]
    fn policy_replies_are_one_digit_or_nothing() {
        assert_eq!(Strategy::parse_reply("2"), Some(Strategy::Bridge));
        assert_eq!(
            Strategy::parse_reply(" 4.\n"),
            Some(Strategy::NoIntervention)
        );
        assert_eq!(Strategy::parse_reply("**1**"), Some(Strategy::Validate));
        assert_eq!(Strategy::parse_reply("\"3\""), Some(Strategy::Plan));
        for bad in ["5", "0", "12", "bridge", "Strategy: 2", "", "2 because"] {
            assert_eq!(Strategy::parse_reply(bad), None, "{bad}");
        }
    }

    #[test]
    fn smoothing_and_entropy() {
        let old = t(1.0, 0.0, -1.0);
        let new = t(0.0, 1.0, 1.0);
        assert_eq!(old.smoothed(&new, 0.75), t(0.75, 0.25, -0.5));
        assert_eq!(entropy_bits(&[5, 5, 5, 5]), 2.0);
        assert_eq!(entropy_bits(&[7, 0, 0, 0]), 0.0);
        assert_eq!(entropy_bits(&[1, 1, 0, 0]), 1.0);
        assert_eq!(entropy_bits(&[0, 0, 0, 0]), 0.0);
    }
}
