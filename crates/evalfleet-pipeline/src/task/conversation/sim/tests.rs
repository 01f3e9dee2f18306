use super::*;
use evalfleet_config::{
    AlarmSettings, CallSettings, HistoryWindows, Persona, PolicyKind, PolicySettings, Rules,
    ScorerSettings,
};
use evalfleet_eval::balance::RewardSettings;

fn call() -> CallSettings {
    CallSettings {
        messages: Vec::new(),
        endpoint: None,
    }
}

fn settings(edit: impl FnOnce(&mut ConversationSettings)) -> Arc<ConversationSettings> {
    let mut s = ConversationSettings {
        rules: Rules::Corrected,
        require_hiragana: false,
        sessions: 1,
        max_rounds: 6,
        max_steps: 0,
        seed: 0,
        personas: ["A", "B", "C"]
            .iter()
            .map(|n| Persona {
                name: (*n).to_owned(),
                prompt: String::new(),
                landmines: Vec::new(),
                need: Some(Need::Mediation),
                endpoint: None,
                words: Default::default(),
            })
            .collect(),
        persona_messages: Vec::new(),
        topics: vec!["t".to_owned()],
        topic: call(),
        history: HistoryWindows {
            persona: 6,
            scorer: 6,
            policy: 6,
            robot: 6,
        },
        scorer: ScorerSettings {
            kind: ScorerKind::Llm,
            call: call(),
            use_ema: false,
            ema_formula: EmaFormula::Fixed,
            decay_factor: 0.5,
            start_after: 3,
            max_reasks: 1,
        },
        policy: PolicySettings {
            kind: PolicyKind::Model,
            call: call(),
            max_reasks: 1,
        },
        robot: call(),
        rewards: RewardSettings::default(),
        filter_zero_rewards: true,
        max_auto_skip: 2,
        topic_restarts: 1,
        alarms: AlarmSettings {
            window: 10,
            max_share: 0.8,
            min_entropy: 1.0,
            max_run: 20,
        },
        batch_size: 10,
    };
    edit(&mut s);
    Arc::new(s)
}

const STABLE: &str = r#"{"AB": 0.5, "BC": 0.5, "CA": 0.5}"#;
const UNSTABLE: &str = r#"{"AB": 0.5, "BC": 0.5, "CA": -0.5}"#;

/// Plays an episode: persona and robot calls get a line, scorer calls
/// the next of `scores` (the last again when they run out), decisions
/// bridge. Returns the calls made, by kind.
fn play(sim: &mut Corrected, scores: &[&str]) -> Vec<&'static str> {
    let mut calls = Vec::new();
    let mut next = sim.start();
    let mut scored = 0;
    for _ in 0..1000 {
        next = match next {
            Next::Over => return calls,
            Next::Decide(_) => {
                calls.push("decide");
                sim.act(Some(Strategy::Bridge))
            }
            Next::Ask(ask) => {
                calls.push(ask.kind.as_str());
                let reply = match ask.kind {
                    CallKind::Score => {
                        scored += 1;
                        scores[(scored - 1).min(scores.len() - 1)].to_owned()
                    }
                    CallKind::Topic => format!("topic {}", calls.len()),
                    _ => "words".to_owned(),
                };
                sim.reply(&reply).unwrap()
            }
        };
    }
    panic!("the episode did not end: {calls:?}");
}

#[test]
fn nothing_is_scored_in_the_first_utterances() {
    let mut sim = Corrected::new(settings(|_| {}), "e", None);
    let calls = play(&mut sim, &[UNSTABLE]);
    // The topic, three utterances unscored, then scores follow each.
    assert_eq!(
        &calls[..7],
        [
            "topic", "persona", "persona", "persona", "persona", "scorer", "decide"
        ]
    );
}

#[test]
fn a_stable_opening_starts_again_on_a_new_topic_with_its_budget_restored() {
    // Scores stay stable: stable at 4, 5 and 6 (past max_auto_skip, 2):
    // the conversation starts again on a new topic, from its first
    // utterance, with fresh relations and all of max_rounds (3) ahead;
    // stable again through 6: the episode ends (one restart).
    let s = settings(|s| {
        s.topics.clear();
        s.max_rounds = 3;
    });
    let mut sim = Corrected::new(s, "e", None);
    let calls = play(&mut sim, &[STABLE]);
    let count = |kind: &str| calls.iter().filter(|c| **c == kind).count();
    assert_eq!(count("topic"), 2, "{calls:?}");
    assert_eq!(count("persona"), 12);
    // Nothing is scored in the new conversation's first 3 utterances.
    assert_eq!(count("scorer"), 6);
    assert!(!calls.contains(&"decide"));
    assert_eq!(sim.ending(), Some(Ending::Terminated));
    let summary = sim.summary();
    assert_eq!(summary["human_utterances"], 6);
    assert_eq!(summary["conversation"].as_array().unwrap().len(), 6);
    let restarts = summary["restarts"].as_array().unwrap();
    assert_eq!(restarts.len(), 1);
    assert_eq!(restarts[0]["conversation"].as_array().unwrap().len(), 6);
    assert_eq!(summary["topics"].as_array().unwrap().len(), 2);
    assert_ne!(restarts[0]["topic"], summary["topics"][1]);
    // A restart's new conversation can reach a decision.
    let s = settings(|s| {
        s.topics.clear();
        s.max_rounds = 3;
        s.max_steps = 1;
    });
    let mut sim = Corrected::new(s, "e", None);
    let calls = play(&mut sim, &[STABLE, STABLE, STABLE, UNSTABLE]);
    let decided = calls.iter().position(|c| *c == "decide").unwrap();
    // topic, 6 utterances and 3 scores, topic, 4 utterances and a score.
    assert_eq!(decided, 1 + 6 + 3 + 1 + 4 + 1, "{calls:?}");
    assert_eq!(sim.steps()[0].turn, 4);
    // With no restarts left (or none allowed), the opening ends.
    let s = settings(|s| {
        s.topic_restarts = 0;
        s.max_rounds = 3;
    });
    let mut sim = Corrected::new(s, "e", None);
    let calls = play(&mut sim, &[STABLE]);
    assert_eq!(calls.iter().filter(|c| **c == "persona").count(), 6);
    assert_eq!(sim.ending(), Some(Ending::Terminated));
    // A dataset row's own topic is kept when the conversation starts
    // again; a fixed list's next one is taken.
    let s = settings(|s| s.max_rounds = 3);
    let mut sim = Corrected::new(s, "e", Some("chores".to_owned()));
    let calls = play(&mut sim, &[STABLE]);
    assert!(!calls.contains(&"topic"));
    assert_eq!(calls.iter().filter(|c| **c == "persona").count(), 12);
    assert_eq!(sim.summary()["restarts"][0]["topic"], "chores");
    assert_eq!(sim.topic(), "chores");
    let s = settings(|s| {
        s.max_rounds = 3;
        s.topics = vec!["t1".to_owned(), "t2".to_owned()];
    });
    let mut sim = Corrected::new(s.clone(), "e", Some("t2".to_owned()));
    play(&mut sim, &[STABLE]);
    assert_eq!(sim.summary()["restarts"][0]["topic"], "t2");
    assert_eq!(sim.topic(), "t1");
    assert_eq!(sim.summary()["topics"], json!(["t2", "t1"]));
    // An opening that reaches max_rounds undecided (the skips not yet
    // spent) starts again too.
    let s = settings(|s| {
        s.max_rounds = 2;
        s.max_auto_skip = 10;
    });
    let mut sim = Corrected::new(s, "e", None);
    let calls = play(&mut sim, &[STABLE]);
    assert_eq!(calls.iter().filter(|c| **c == "persona").count(), 12);
    assert_eq!(
        sim.summary()["restarts"][0]["conversation"]
            .as_array()
            .unwrap()
            .len(),
        6
    );
}

#[test]
fn the_original_adaptive_smoothing_barely_moves_once_one_person_speaks_at_a_time() {
    // Scored after each utterance, only the speaker is new: for every
    // pair the fewer new utterances is 0, so alpha is 0.01 after the
    // first score (the original system's behaviour, with its keys).
    let s = settings(|s| {
        s.scorer.use_ema = true;
        s.scorer.ema_formula = EmaFormula::Adaptive;
        s.scorer.decay_factor = 1.5;
        s.max_steps = 1;
    });
    let mut sim = Corrected::new(s, "e", None);
    // Unstable at 4 (CA -0.5), then +++ scores: CA after n of them is
    // 0.01 x 0.5 + 0.99 x previous.
    play(
        &mut sim,
        &[UNSTABLE, STABLE, STABLE, STABLE, STABLE, STABLE],
    );
    let step = &sim.steps()[0];
    let mut ca = -0.5;
    for _ in 0..3 {
        ca = 0.01 * 0.5 + 0.99 * ca;
    }
    let at = step.at_horizon.unwrap().relations.ca;
    assert!((at - ca).abs() < 1e-12, "{at} {ca}");
    assert_eq!(step.reward.stable_bonus, 0.0);
    assert!(step.cut_short);
}

/// The scripted replies of a step: unstable at the decision (the 4th
/// utterance), then `after` for the 5th on.
fn step_with(edit: impl FnOnce(&mut ConversationSettings), after: &[&'static str]) -> Corrected {
    let s = settings(|s| {
        s.max_steps = 1;
        s.max_rounds = 100;
        edit(s);
    });
    let mut sim = Corrected::new(s, "e", None);
    let mut scores = vec![UNSTABLE];
    scores.extend_from_slice(after);
    play(&mut sim, &scores);
    sim
}

#[test]
fn the_bonus_needs_stability_after_every_utterance_of_the_duration() {
    // Horizon at the 7th utterance, duration the 8th and 9th.
    let held = step_with(|_| {}, &[UNSTABLE, UNSTABLE, STABLE, STABLE, STABLE]);
    let step = &held.steps()[0];
    assert_eq!(step.checks.len(), 3);
    assert!(!step.cut_short);
    assert_eq!(step.reward.stable_bonus, 2.0);
    assert_eq!(step.utterances.len(), 1 + 5, "the robot and five humans");
    // A dip at the 8th: nothing, and the step ends there.
    let dip = step_with(|_| {}, &[UNSTABLE, UNSTABLE, STABLE, UNSTABLE, STABLE]);
    let step = &dip.steps()[0];
    assert_eq!(step.checks.len(), 2);
    assert!(step.cut_short);
    assert_eq!(step.reward.stable_bonus, 0.0);
    assert_eq!(step.reward.preference_match_bonus, 0.5);
    assert!(!step.at_end.unwrap().stable);
    assert_eq!(step.utterances.len(), 1 + 4);
    // Played out on request: stable again at the 9th, still nothing.
    let played = step_with(
        |s| s.rewards.end_step_when_lost = false,
        &[UNSTABLE, UNSTABLE, STABLE, UNSTABLE, STABLE],
    );
    let step = &played.steps()[0];
    assert_eq!(step.checks.len(), 3);
    assert!(step.at_end.unwrap().stable);
    assert_eq!(step.reward.stable_bonus, 0.0);
}

#[test]
fn a_failed_horizon_check_ends_the_step_there() {
    let lost = step_with(|_| {}, &[STABLE, STABLE, UNSTABLE, STABLE, STABLE]);
    let step = &lost.steps()[0];
    assert_eq!(step.checks.len(), 1);
    assert!(step.cut_short);
    assert_eq!(step.at_horizon.unwrap().target_positive, Some(false));
    assert_eq!(step.reward.total, 0.5);
    // No duration utterance was played: the robot and three humans.
    assert_eq!(step.utterances.len(), 1 + 3);
    assert_eq!(lost.summary()["human_utterances"], 7);
    let played = step_with(
        |s| s.rewards.end_step_when_lost = false,
        &[STABLE, STABLE, UNSTABLE, STABLE, STABLE],
    );
    assert_eq!(played.steps()[0].checks.len(), 3);
    assert_eq!(played.summary()["human_utterances"], 9);
}

#[test]
fn zero_is_positive_at_the_decision_and_at_the_checks() {
    // AB = 0 beside BC + and CA -: "++-", aimed at CA; all zeros at the
    // checks are "+++", the target positive: the bonus.
    let zeros = r#"{"AB": 0, "BC": 0, "CA": 0}"#;
    let s = settings(|s| {
        s.max_steps = 1;
        s.max_rounds = 100;
    });
    let mut sim = Corrected::new(s, "e", None);
    play(
        &mut sim,
        &[
            r#"{"AB": 0, "BC": 0.5, "CA": -0.5}"#,
            zeros,
            zeros,
            zeros,
            zeros,
            zeros,
        ],
    );
    let step = &sim.steps()[0];
    assert_eq!(step.situation.pattern, "++-");
    assert_eq!(step.situation.target_edge, Some(Edge::CA));
    assert_eq!(step.reward.stable_bonus, 2.0);
}

#[test]
fn an_all_negative_triangle_is_aimed_at_the_edge_closest_to_zero() {
    let all_negative = r#"{"AB": -0.7, "BC": -0.2, "CA": -0.5}"#;
    let aim = |rule: TargetRule| {
        let s = settings(|s| {
            s.max_steps = 1;
            s.rewards.target_rule = rule;
            for p in &mut s.personas {
                p.need = None;
            }
            s.personas[0].need = Some(Need::Recognition);
            s.personas[1].need = Some(Need::Mediation);
            s.personas[2].need = Some(Need::Solution);
        });
        let mut sim = Corrected::new(s, "e", None);
        play(&mut sim, &[all_negative]);
        let step = sim.steps()[0].clone();
        (
            step.situation.target_edge,
            step.situation.target_speaker,
            step.target_need,
            step.reward.preference_match_bonus,
        )
    };
    // BC (-0.2) is closest to 0; of B and C, B is worse off with A
    // (AB -0.7 < CA -0.5): B, whose need (mediation) bridge answers.
    assert_eq!(
        aim(TargetRule::ClosestToZero),
        (Some(Edge::BC), Some(Person::B), Some(Need::Mediation), 0.5)
    );
    // The other rule: AB (-0.7); A is worse off with C (CA -0.5 < BC
    // -0.2): A, recognition, which bridge does not answer.
    assert_eq!(
        aim(TargetRule::MostNegative),
        (
            Some(Edge::AB),
            Some(Person::A),
            Some(Need::Recognition),
            0.0
        )
    );
}

#[test]
fn a_step_begun_before_the_last_round_runs_at_most_horizon_and_duration_past_it() {
    // max_rounds 2: 6 utterances. Stable at 4, unstable at 5: the
    // decision at 5, its step to 5 + 3 + 2 = 10 (the bound, 3 x
    // max_rounds - 1 + evaluation_horizon + terminal_bonus_duration),
    // then the end: no decision begins past the rounds.
    let s = settings(|s| {
        s.max_rounds = 2;
        s.max_auto_skip = 10;
    });
    let mut sim = Corrected::new(s, "e", None);
    let calls = play(&mut sim, &[STABLE, UNSTABLE, STABLE]);
    assert_eq!(calls.iter().filter(|c| **c == "decide").count(), 1);
    assert_eq!(sim.summary()["human_utterances"], 3 * 2 - 1 + 3 + 2);
    assert_eq!(sim.steps()[0].turn, 5);
    assert_eq!(sim.steps()[0].reward.stable_bonus, 2.0);
    assert_eq!(sim.ending(), Some(Ending::Terminated));
}

#[test]
fn an_invalid_decision_costs_the_penalty_and_its_step_ends_at_the_horizon() {
    let s = settings(|s| {
        s.max_steps = 1;
        s.rewards.invalid_penalty = 0.75;
    });
    let mut sim = Corrected::new(s, "e", None);
    let mut next = sim.start();
    let mut scores = 0;
    loop {
        next = match next {
            Next::Over => break,
            Next::Decide(_) => sim.act(None),
            Next::Ask(ask) if ask.kind == CallKind::Score => {
                scores += 1;
                sim.reply(if scores == 1 { UNSTABLE } else { STABLE })
                    .unwrap()
            }
            Next::Ask(ask) => {
                assert_ne!(
                    ask.kind,
                    CallKind::Robot,
                    "no robot for an invalid decision"
                );
                sim.reply("words").unwrap()
            }
        };
    }
    let step = &sim.steps()[0];
    assert!(!step.valid);
    assert_eq!(step.checks.len(), 1);
    assert_eq!(
        (step.reward.invalid_penalty, step.reward.total),
        (-0.75, -0.75)
    );
}

#[test]
fn the_adaptive_smoothing_weighs_a_pair_by_its_new_utterances() {
    let s = settings(|s| {
        s.scorer.use_ema = true;
        s.scorer.ema_formula = EmaFormula::Adaptive;
        s.scorer.decay_factor = 1.5;
    });
    let mut sim = Corrected::new(s, "e", None);
    let said = |who: &[&str]| -> Vec<Utterance> {
        who.iter()
            .map(|w| Utterance {
                speaker: (*w).to_owned(),
                text: String::new(),
            })
            .collect()
    };
    // The first score is taken as is; each pair had one new utterance.
    sim.observe(Triangle::new(0.4, 0.4, 0.4), &said(&["A", "B", "C"]));
    assert_eq!(sim.relations, Some(Triangle::new(0.4, 0.4, 0.4)));
    // A and B speak again: AB had 1 new (past 1): alpha = 1.5 x 1/2 =
    // 0.75; BC and CA had none of C's: alpha = 0.01.
    sim.observe(
        Triangle::new(-0.4, 0.8, 0.0),
        &said(&["A", "B", "C", "A", "B"]),
    );
    let t = sim.relations.unwrap();
    assert!((t.ab - (0.75 * -0.4 + 0.25 * 0.4)).abs() < 1e-12, "{t:?}");
    assert!((t.bc - (0.01 * 0.8 + 0.99 * 0.4)).abs() < 1e-12, "{t:?}");
    assert!((t.ca - 0.99 * 0.4).abs() < 1e-12, "{t:?}");
    // All three speak: every pair 1 new; AB's past is 1 + 1: alpha =
    // 1.5 x 1/3 = 0.5; BC's and CA's past 1 + 0: 0.75.
    let before = sim.relations.unwrap();
    sim.observe(
        Triangle::new(1.0, 1.0, 1.0),
        &said(&["A", "B", "C", "A", "B", "C", "A", "B", "C"]),
    );
    let t = sim.relations.unwrap();
    assert!((t.ab - (0.5 + 0.5 * before.ab)).abs() < 1e-12, "{t:?}");
    assert!((t.bc - (0.75 + 0.25 * before.bc)).abs() < 1e-12, "{t:?}");
    assert!((t.ca - (0.75 + 0.25 * before.ca)).abs() < 1e-12, "{t:?}");
}

#[test]
fn scores_outside_the_range_are_clipped_and_counted() {
    let s = settings(|s| s.max_steps = 1);
    let mut sim = Corrected::new(s, "e", None);
    play(&mut sim, &[r#"{"AB": 1.5, "BC": 0.5, "CA": -2}"#, STABLE]);
    assert_eq!(sim.clipped_scores(), 2);
    assert_eq!(sim.summary()["clipped_scores"], 2);
    assert_eq!(
        sim.steps()[0].situation.relations,
        Triangle::new(1.0, 0.5, -1.0)
    );
}

#[test]
fn after_a_step_stable_states_are_skipped_at_most_max_auto_skip_times() {
    // Unstable at the first check, stable ever after.
    let s = settings(|s| s.max_rounds = 100);
    let mut sim = Corrected::new(s, "e", None);
    let mut scores = vec![UNSTABLE];
    scores.extend([STABLE; 50]);
    let calls = play(&mut sim, &scores);
    assert_eq!(sim.steps().len(), 1);
    assert_eq!(sim.ending(), Some(Ending::Terminated));
    // 4 to the decision, the robot, 5 in the step, then 2 more
    // (the state at the step's end is the first skip).
    assert_eq!(calls.iter().filter(|c| **c == "persona").count(), 4 + 5 + 2);
    // Aimed at CA; C and A tie with B, so C, whose need (mediation)
    // bridge answers.
    let step = &sim.steps()[0];
    assert_eq!(step.situation.target_speaker, Some(Person::C));
    assert_eq!(step.reward.stable_bonus, 2.0);
    assert_eq!(step.reward.preference_match_bonus, 0.5);
}

#[test]
fn no_decision_begins_once_the_rounds_are_over() {
    let s = settings(|s| {
        s.max_rounds = 2;
        s.max_auto_skip = 10;
        s.topic_restarts = 0;
    });
    let mut sim = Corrected::new(s, "e", None);
    // Stable at 4 and 5; unstable only at 6, the last utterance.
    let calls = play(&mut sim, &[STABLE, STABLE, UNSTABLE]);
    assert!(!calls.contains(&"decide"), "{calls:?}");
    assert_eq!(calls.iter().filter(|c| **c == "persona").count(), 6);
    assert_eq!(sim.ending(), Some(Ending::Terminated));
}

#[test]
fn max_steps_truncates_and_unfiltered_stable_states_are_decided() {
    let s = settings(|s| {
        s.max_steps = 2;
        s.filter_zero_rewards = false;
    });
    let mut sim = Corrected::new(s, "e", None);
    let calls = play(&mut sim, &[STABLE]);
    assert_eq!(calls.iter().filter(|c| **c == "decide").count(), 2);
    assert_eq!(sim.ending(), Some(Ending::Truncated));
    // A stable triangle has no target: nothing to earn.
    for step in sim.steps() {
        assert_eq!(step.situation.target_edge, None);
        assert_eq!(step.reward.total, 0.0);
    }
}

#[test]
fn smoothing_mixes_each_score_with_the_last() {
    let s = settings(|s| {
        s.scorer.use_ema = true;
        s.scorer.decay_factor = 0.75;
        s.max_steps = 1;
    });
    let mut sim = Corrected::new(s, "e", None);
    play(
        &mut sim,
        &[
            UNSTABLE,
            r#"{"AB": 0.5, "BC": 0.5, "CA": 0.5}"#,
            r#"{"AB": 0.5, "BC": 0.5, "CA": 0.5}"#,
            r#"{"AB": 0.5, "BC": 0.5, "CA": 0.5}"#,
        ],
    );
    // CA: -0.5, then 0.75 x -0.5 + 0.25 x 0.5 = -0.25, then -0.0625,
    // then 0.078125 at the horizon (three scores after the decision).
    let step = &sim.steps()[0];
    let at = step.at_horizon.unwrap().relations.ca;
    assert!((at - 0.078125).abs() < 1e-12, "{at}");
    assert_eq!(step.reward.stable_bonus, 2.0);
}

#[test]
fn windows_hold_the_last_human_utterances_and_the_robots_among_them() {
    let s = settings(|s| s.history.persona = 2);
    let mut sim = Corrected::new(s, "e", None);
    for (speaker, text) in [
        ("A", "a1"),
        ("robot", "r0"),
        ("B", "b1"),
        ("robot", "r1"),
        ("C", "c1"),
        ("robot", "r2"),
    ] {
        sim.history.push(Utterance {
            speaker: speaker.to_owned(),
            text: text.to_owned(),
        });
    }
    let texts = |w: Vec<Utterance>| w.into_iter().map(|u| u.text).collect::<Vec<_>>();
    assert_eq!(texts(sim.window(2)), ["b1", "r1", "c1", "r2"]);
    assert_eq!(texts(sim.window(5)), ["a1", "r0", "b1", "r1", "c1", "r2"]);
    assert_eq!(texts(sim.human_window(2)), ["b1", "c1"]);
}

#[test]
fn a_scorer_reply_that_cannot_be_read_is_asked_again_then_fails_the_episode() {
    let mut sim = Corrected::new(settings(|_| {}), "e", None);
    let mut next = sim.start();
    loop {
        match next {
            Next::Ask(ask) if ask.kind == CallKind::Score => break,
            Next::Ask(_) => next = sim.reply("words").unwrap(),
            other => panic!("{other:?}"),
        }
    }
    match sim.reply("fine").unwrap() {
        Next::Ask(ask) => {
            assert_eq!(ask.kind, CallKind::Score);
            assert!(ask.rejected.unwrap().contains("no value for AB, BC, CA"));
        }
        other => panic!("{other:?}"),
    }
    let err = sim.reply("still fine").unwrap_err();
    assert!(err.contains("after 1 re-ask"), "{err}");
}

#[test]
fn the_same_seed_and_episode_draw_the_same_needs() {
    let s = settings(|s| {
        for p in &mut s.personas {
            p.need = None;
        }
    });
    let needs = |id: &str| Corrected::new(s.clone(), id, None).needs();
    assert_eq!(needs("7"), needs("7"));
    let all: std::collections::HashSet<_> = (0..40).flat_map(|i| needs(&i.to_string())).collect();
    assert_eq!(all.len(), 4, "every need is drawn: {all:?}");
}
