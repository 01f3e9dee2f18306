//! Decisions handed to a trainer (`policy: {kind: external}`, `evalfleet
//! env`): an episode at a decision offers its observation and waits for the
//! action; the environment server's `reset` takes an episode waiting at its
//! first decision, its `step` hands an action over and waits for the
//! episode's next decision or its end, and its `close` gives an episode up.
//! Episodes go on running their personas and scorer through the fleet
//! meanwhile.
//!
//! An episode's action timeout runs only while a trainer holds it (after
//! the reset that handed it out, or the step that brought its next
//! decision): one ready for a reset waits as long as it takes, since a
//! trainer busy with its update between batches resets none.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::sync::PoisonError;
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use tokio::sync::{Notify, Semaphore, mpsc, oneshot};

use evalfleet_eval::balance::Strategy;

/// The error a closed episode's item fails with (`/v1/close`).
pub const CLOSED: &str = "closed by the trainer";

/// What a trainer gets after a reset or a step.
#[derive(Debug, Clone, Serialize)]
pub struct Transition {
    /// The decision now due (none once the episode is over).
    pub observation: Option<Value>,
    /// The reward of the step the action began.
    pub reward: f64,
    pub terminated: bool,
    pub truncated: bool,
    pub info: Value,
}

/// What became of a decision handed to the trainer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// The trainer chose a strategy.
    Strategy(Strategy),
    /// The trainer's model's raw output, for the environment to read as
    /// its rules do (`rules: original`: as the original trainer did, think
    /// tags stripped and the first digit 1-4 taken; `corrected`: one digit
    /// alone).
    Output(String),
    /// The trainer's model gave nothing it could read (`"invalid"`).
    Invalid,
    /// The trainer closed the environment: the episode stops.
    Closed,
    /// No action came within the action timeout of a trainer holding it.
    TimedOut,
}

/// Why a reset, a step or a close got nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GymError {
    #[error(
        "no episode is left to hand out: every episode of the run has been handed out or has ended"
    )]
    NoEpisodes,
    #[error("no episode came to a decision within {0:?}")]
    ResetTimeout(Duration),
    #[error("environment '{0}' waits for no action (reset it, or it ended)")]
    UnknownEnv(String),
    #[error("environment '{0}' is no trainer's (it was never handed out, ended or was closed)")]
    NotHeld(String),
    #[error("the episode of environment '{0}' stopped before its next decision")]
    Dropped(String),
    #[error("the episode of environment '{0}' did not reach its next decision within {1:?}")]
    StepTimeout(String, Duration),
}

/// What the environment's log hears of its episodes.
#[derive(Debug, Clone)]
pub enum Happening {
    /// The episode got its place and began.
    Started { episode: String },
    /// The trainer closed it: it starts over, to be handed out again.
    Withdrawn { episode: String },
    /// It ended: its record (it is done), or why it failed.
    Ended {
        episode: String,
        outcome: Result<Value, String>,
    },
}

/// Live figures of the environment (`GET /v1/spec`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct GymCounts {
    /// Episodes at their first decision, waiting for a reset.
    pub ready: usize,
    /// Episodes a trainer holds, waiting for its action.
    pub held: usize,
    /// Episodes handed out in this session.
    pub handed_out: u64,
    /// Episodes closed by the trainer in this session.
    pub closed: u64,
}

/// An episode at a decision, waiting for what the trainer does with it.
pub struct Pending {
    episode: String,
    acted: oneshot::Receiver<Action>,
    /// Told when a trainer takes it (none: one holds it already).
    held: Option<oneshot::Receiver<()>>,
}

struct Ready {
    episode: String,
    transition: Transition,
    action: oneshot::Sender<Action>,
    held: oneshot::Sender<()>,
}

#[derive(Default)]
struct State {
    /// Episodes at their first decision, not yet handed to a trainer.
    ready: VecDeque<Ready>,
    /// Episodes a trainer holds, waiting for its action.
    waiting: HashMap<String, oneshot::Sender<Action>>,
    /// Steps a trainer waits on, by episode.
    replies: HashMap<String, oneshot::Sender<Transition>>,
    /// Episodes handed out in this session that have not ended (at most
    /// the episodes under way).
    live: HashSet<String>,
    /// Of those, the ones the trainer closed.
    closed: HashSet<String>,
    /// Episodes the session has to play (none known yet: resets wait).
    expected: Option<u64>,
    handed: u64,
    /// Episodes that ended before any trainer took them.
    ended_unhanded: u64,
    /// Episodes handed out, closed and started over (to be handed out
    /// again).
    withdrawn: u64,
    closed_total: u64,
    finished: bool,
    journal: Option<mpsc::UnboundedSender<Happening>>,
}

impl State {
    /// No episode is left that a reset could still hand out.
    fn exhausted(&self) -> bool {
        self.ready.is_empty()
            && (self.finished
                || self.expected.is_some_and(|n| {
                    self.handed.saturating_sub(self.withdrawn) + self.ended_unhanded >= n
                }))
    }

    fn tell(&self, happening: Happening) {
        if let Some(journal) = &self.journal {
            let _ = journal.send(happening);
        }
    }
}

/// The meeting point of a session's episodes and the trainers.
pub struct Gym {
    state: Mutex<State>,
    /// Woken at every change a reset may wait for.
    changed: Notify,
    /// How long an episode a trainer holds waits for an action before its
    /// decision is recorded invalid.
    pub action_timeout: Duration,
    /// Episodes under way at once (held by trainers, ready for a reset, or
    /// on their way to a decision); the others wait to begin.
    pub capacity: usize,
    /// A place each for the episodes under way.
    pub starts: std::sync::Arc<Semaphore>,
}

impl Gym {
    pub fn new(action_timeout: Duration, capacity: usize) -> Self {
        Self {
            state: Mutex::new(State::default()),
            changed: Notify::new(),
            action_timeout,
            capacity: capacity.max(1),
            starts: std::sync::Arc::new(Semaphore::new(capacity.max(1))),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What happens to the episodes from now on, for the environment's log.
    pub fn journal(&self) -> mpsc::UnboundedReceiver<Happening> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.lock().journal = Some(tx);
        rx
    }

    /// The session has `episodes` to play: once each has been handed out
    /// or has ended, resets answer [`GymError::NoEpisodes`] at once.
    pub fn expect(&self, episodes: u64) {
        self.lock().expected = Some(episodes);
        self.changed.notify_waiters();
    }

    /// An episode got its place and begins.
    pub fn started(&self, episode: &str) {
        self.lock().tell(Happening::Started {
            episode: episode.to_owned(),
        });
    }

    pub fn counts(&self) -> GymCounts {
        let state = self.lock();
        GymCounts {
            ready: state.ready.len(),
            held: state.waiting.len(),
            handed_out: state.handed,
            closed: state.closed_total,
        }
    }

    /// Whether the trainer closed `episode`.
    pub fn is_closed(&self, episode: &str) -> bool {
        self.lock().closed.contains(episode)
    }

    /// An episode at a decision: to the trainer that holds it, or (its
    /// first) to the queue `reset` takes from. [`Gym::decision`] waits for
    /// what comes of it.
    pub fn offer(&self, episode: &str, transition: Transition) -> Pending {
        let (action, acted) = oneshot::channel();
        let mut state = self.lock();
        if state.closed.contains(episode) {
            let _ = action.send(Action::Closed);
            return Pending {
                episode: episode.to_owned(),
                acted,
                held: None,
            };
        }
        if let Some(reply) = state.replies.remove(episode) {
            // A trainer that gave up on this step still holds the episode.
            let _ = reply.send(transition);
            state.waiting.insert(episode.to_owned(), action);
            return Pending {
                episode: episode.to_owned(),
                acted,
                held: None,
            };
        }
        if state.live.contains(episode) {
            state.waiting.insert(episode.to_owned(), action);
            return Pending {
                episode: episode.to_owned(),
                acted,
                held: None,
            };
        }
        let (held_tx, held) = oneshot::channel();
        state.ready.push_back(Ready {
            episode: episode.to_owned(),
            transition,
            action,
            held: held_tx,
        });
        drop(state);
        self.changed.notify_waiters();
        Pending {
            episode: episode.to_owned(),
            acted,
            held: Some(held),
        }
    }

    /// What the trainer does with a decision offered: its action, or
    /// [`Action::TimedOut`] once it has held the episode for
    /// `action_timeout` without one (the episode is then no trainer's).
    pub async fn decision(&self, pending: Pending) -> Action {
        let Pending {
            episode,
            acted,
            held,
        } = pending;
        if let Some(held) = held
            && held.await.is_err()
        {
            // Dropped from the queue without being handed out.
            return Action::TimedOut;
        }
        match tokio::time::timeout(self.action_timeout, acted).await {
            Ok(Ok(action)) => action,
            Ok(Err(_)) | Err(_) => {
                self.forget(&episode);
                Action::TimedOut
            }
        }
    }

    /// An episode's decision came to nothing: it is no trainer's any more.
    fn forget(&self, episode: &str) {
        let mut state = self.lock();
        state.waiting.remove(episode);
        state.ready.retain(|r| r.episode != episode);
        state.replies.remove(episode);
    }

    /// An episode is over: `outcome` is its record (done) or why it
    /// failed. The trainer stepping it is told `transition`.
    pub fn end(&self, episode: &str, transition: Transition, outcome: Result<Value, String>) {
        let mut state = self.lock();
        state.waiting.remove(episode);
        state.ready.retain(|r| r.episode != episode);
        state.closed.remove(episode);
        if !state.live.remove(episode) {
            state.ended_unhanded += 1;
        }
        if let Some(reply) = state.replies.remove(episode) {
            let _ = reply.send(transition);
        }
        state.tell(Happening::Ended {
            episode: episode.to_owned(),
            outcome,
        });
        drop(state);
        self.changed.notify_waiters();
    }

    /// No more episodes will come: resets get [`GymError::NoEpisodes`],
    /// and the journal ends.
    pub fn finish(&self) {
        let mut state = self.lock();
        state.finished = true;
        state.journal = None;
        drop(state);
        self.changed.notify_waiters();
    }

    /// The next episode at its first decision: its id (the environment's)
    /// and observation. Waits up to `wait` for one; answers at once when
    /// none is left to come.
    pub async fn reset(&self, wait: Duration) -> Result<(String, Transition), GymError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut state = self.lock();
                while let Some(ready) = state.ready.pop_front() {
                    // One whose episode stopped waiting is passed over.
                    if ready.action.is_closed() || ready.held.send(()).is_err() {
                        continue;
                    }
                    let episode = ready.episode;
                    state.waiting.insert(episode.clone(), ready.action);
                    if state.live.insert(episode.clone()) {
                        state.handed += 1;
                    }
                    return Ok((episode, ready.transition));
                }
                if state.exhausted() {
                    return Err(GymError::NoEpisodes);
                }
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Err(GymError::ResetTimeout(wait));
            }
            let _ = tokio::time::timeout(deadline - now, changed).await;
        }
    }

    /// Hands `action` to environment `episode` and waits for its next
    /// decision or its end.
    pub async fn step(
        &self,
        episode: &str,
        action: Action,
        wait: Duration,
    ) -> Result<Transition, GymError> {
        let (reply, replied) = oneshot::channel();
        {
            let mut state = self.lock();
            let Some(to) = state.waiting.remove(episode) else {
                return Err(GymError::UnknownEnv(episode.to_owned()));
            };
            state.replies.insert(episode.to_owned(), reply);
            if to.send(action).is_err() {
                state.replies.remove(episode);
                return Err(GymError::Dropped(episode.to_owned()));
            }
        }
        match tokio::time::timeout(wait, replied).await {
            Ok(Ok(transition)) => Ok(transition),
            Ok(Err(_)) => Err(GymError::Dropped(episode.to_owned())),
            Err(_) => Err(GymError::StepTimeout(episode.to_owned(), wait)),
        }
    }

    /// The trainer closed `episode` and it has stopped: it is no trainer's
    /// and starts over from its beginning, to be handed out again.
    pub fn withdraw(&self, episode: &str) {
        let mut state = self.lock();
        state.waiting.remove(episode);
        state.ready.retain(|r| r.episode != episode);
        state.replies.remove(episode);
        state.closed.remove(episode);
        if state.live.remove(episode) {
            state.withdrawn += 1;
        }
        state.tell(Happening::Withdrawn {
            episode: episode.to_owned(),
        });
        drop(state);
        self.changed.notify_waiters();
    }

    /// The trainer gives environment `episode` up: the episode makes no
    /// call after its next decision (at once when it is at one), is
    /// withdrawn ([`Gym::withdraw`]) and starts over for a later reset.
    pub fn close(&self, episode: &str) -> Result<(), GymError> {
        let mut state = self.lock();
        if !state.live.contains(episode) || state.closed.contains(episode) {
            return Err(GymError::NotHeld(episode.to_owned()));
        }
        state.closed.insert(episode.to_owned());
        state.closed_total += 1;
        if let Some(to) = state.waiting.remove(episode) {
            let _ = to.send(Action::Closed);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(step: u64) -> Transition {
        Transition {
            observation: Some(serde_json::json!({"step": step})),
            reward: 0.0,
            terminated: false,
            truncated: false,
            info: Value::Null,
        }
    }

    #[tokio::test]
    async fn resets_pass_over_episodes_that_stopped_waiting_and_steps_reach_the_episode() {
        let gym = Gym::new(Duration::from_secs(1), 4);
        // An episode that stopped waiting (its receiver gone), then one
        // waiting.
        drop(gym.offer("a", at(0)));
        let pending = gym.offer("b", at(0));
        let (id, _) = gym.reset(Duration::from_millis(10)).await.unwrap();
        assert_eq!(id, "b");
        assert_eq!(
            gym.reset(Duration::from_millis(10)).await.unwrap_err(),
            GymError::ResetTimeout(Duration::from_millis(10))
        );
        // The trainer's step hands the action over; the episode's next
        // decision answers it.
        let episode = async {
            assert_eq!(
                gym.decision(pending).await,
                Action::Strategy(Strategy::Plan)
            );
            gym.offer("b", at(1))
        };
        let (stepped, _next) = tokio::join!(
            gym.step(
                "b",
                Action::Strategy(Strategy::Plan),
                Duration::from_secs(5)
            ),
            episode
        );
        assert_eq!(stepped.unwrap().observation.unwrap()["step"], 1);
        assert_eq!(
            gym.step("c", Action::Invalid, Duration::from_secs(1))
                .await
                .unwrap_err(),
            GymError::UnknownEnv("c".to_owned())
        );
        gym.finish();
        assert_eq!(
            gym.reset(Duration::from_secs(5)).await.unwrap_err(),
            GymError::NoEpisodes
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_action_timeout_runs_only_while_a_trainer_holds_the_episode() {
        let gym = Gym::new(Duration::from_secs(60), 4);
        let pending = gym.offer("a", at(0));
        let waiting = gym.decision(pending);
        tokio::pin!(waiting);
        // Ready for an hour (a trainer's update between batches): nothing
        // comes of it.
        let idle = tokio::time::timeout(Duration::from_secs(3600), waiting.as_mut()).await;
        assert!(idle.is_err(), "a ready episode timed out");
        let (id, _) = gym.reset(Duration::ZERO).await.unwrap();
        assert_eq!(id, "a");
        // Held: within the timeout the action arrives.
        let (action, ()) = tokio::join!(waiting, async {
            tokio::time::sleep(Duration::from_secs(59)).await;
            gym.step("a", Action::Invalid, Duration::ZERO)
                .await
                .unwrap_err();
        });
        assert_eq!(action, Action::Invalid);
        // Its next decision, held at once by the trainer stepping it: the
        // timeout runs from there.
        let next = gym.offer("a", at(1));
        let started = tokio::time::Instant::now();
        assert_eq!(gym.decision(next).await, Action::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(60));
        // It is no trainer's any more.
        assert_eq!(
            gym.step("a", Action::Invalid, Duration::ZERO)
                .await
                .unwrap_err(),
            GymError::UnknownEnv("a".to_owned())
        );
    }

    #[tokio::test(start_paused = true)]
    async fn resets_answer_at_once_when_no_episode_is_left_to_hand_out() {
        let gym = Gym::new(Duration::from_secs(60), 4);
        gym.expect(3);
        // One ends before any decision; one is handed out and held; one is
        // on its way: a reset waits for it, up to what it asked.
        gym.end("x", at(0), Ok(Value::Null));
        let _a = gym.offer("a", at(0));
        gym.reset(Duration::ZERO).await.unwrap();
        let started = tokio::time::Instant::now();
        assert_eq!(
            gym.reset(Duration::from_secs(5)).await.unwrap_err(),
            GymError::ResetTimeout(Duration::from_secs(5))
        );
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        // A reset waiting when the last one ends before its decision is
        // answered then, not at its deadline.
        let (reset, ()) = tokio::join!(gym.reset(Duration::from_secs(600)), async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            gym.end("b", at(0), Err("failed".to_owned()));
        });
        assert_eq!(reset.unwrap_err(), GymError::NoEpisodes);
        assert_eq!(started.elapsed(), Duration::from_secs(6));
    }

    #[tokio::test]
    async fn a_closed_episode_stops_at_its_next_decision() {
        let gym = Gym::new(Duration::from_secs(60), 4);
        assert_eq!(
            gym.close("a").unwrap_err(),
            GymError::NotHeld("a".to_owned())
        );
        let pending = gym.offer("a", at(0));
        gym.reset(Duration::ZERO).await.unwrap();
        // Held at a decision: it stops at once.
        gym.close("a").unwrap();
        assert_eq!(gym.decision(pending).await, Action::Closed);
        assert!(gym.is_closed("a"));
        // Closed twice: no trainer's.
        assert!(gym.close("a").is_err());
        gym.end("a", at(0), Err(CLOSED.to_owned()));
        assert!(!gym.is_closed("a"));
        assert_eq!(gym.counts().closed, 1);
    }
}
