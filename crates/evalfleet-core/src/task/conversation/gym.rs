//! Decisions handed to a trainer (`policy: {kind: external}`, `evalfleet
//! env`): an episode at a decision offers its observation and waits for the
//! action; the environment server's `reset` takes an episode waiting at its
//! first decision, and its `step` hands an action over and waits for the
//! episode's next decision or its end. Episodes go on running their
//! personas and scorer through the fleet meanwhile.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::PoisonError;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use tokio::sync::{Notify, Semaphore, oneshot};

use crate::eval::balance::Strategy;

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

/// The action: a strategy, or none (the trainer's answer was not one).
pub type Action = Option<Strategy>;

/// Why a reset or a step got nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GymError {
    #[error("no episode is left: every episode of the run has been handed out")]
    NoEpisodes,
    #[error("no episode came to a decision within {0:?}")]
    ResetTimeout(Duration),
    #[error("environment '{0}' waits for no action (reset it, or it ended)")]
    UnknownEnv(String),
    #[error("the episode of environment '{0}' stopped before its next decision")]
    Dropped(String),
    #[error("the episode of environment '{0}' did not reach its next decision within {1:?}")]
    StepTimeout(String, Duration),
}

#[derive(Default)]
struct State {
    /// Episodes at their first decision, not yet handed to a trainer.
    ready: VecDeque<(String, Transition, oneshot::Sender<Action>)>,
    /// Episodes a trainer holds, waiting for its action.
    waiting: HashMap<String, oneshot::Sender<Action>>,
    /// Steps a trainer waits on, by episode.
    replies: HashMap<String, oneshot::Sender<Transition>>,
}

/// The meeting point of a session's episodes and the trainers.
pub struct Gym {
    state: Mutex<State>,
    ready: Notify,
    finished: AtomicBool,
    /// How long an episode waits for an action before its decision is
    /// recorded invalid.
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
            ready: Notify::new(),
            finished: AtomicBool::new(false),
            action_timeout,
            capacity: capacity.max(1),
            starts: std::sync::Arc::new(Semaphore::new(capacity.max(1))),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An episode at a decision: to the trainer stepping it, or (its first)
    /// to the queue `reset` takes from.
    pub fn offer(&self, episode: &str, transition: Transition, action: oneshot::Sender<Action>) {
        let mut state = self.lock();
        if let Some(reply) = state.replies.remove(episode) {
            if let Err(unsent) = reply.send(transition) {
                // The trainer gave up on this step: the episode stays with
                // it, waiting for an action.
                drop(unsent);
            }
            state.waiting.insert(episode.to_owned(), action);
        } else {
            state
                .ready
                .push_back((episode.to_owned(), transition, action));
            drop(state);
            self.ready.notify_one();
        }
    }

    /// An episode's decision came to nothing (its action did not come in
    /// time): it is no trainer's any more, nor ready for a reset.
    pub fn forget(&self, episode: &str) {
        let mut state = self.lock();
        state.waiting.remove(episode);
        state.ready.retain(|(e, ..)| e != episode);
        state.replies.remove(episode);
    }

    /// An episode is over (or failed): the trainer stepping it is told.
    pub fn end(&self, episode: &str, transition: Transition) {
        let mut state = self.lock();
        state.waiting.remove(episode);
        state.ready.retain(|(e, ..)| e != episode);
        if let Some(reply) = state.replies.remove(episode) {
            let _ = reply.send(transition);
        }
    }

    /// No more episodes will come: resets waiting get
    /// [`GymError::NoEpisodes`].
    pub fn finish(&self) {
        self.finished.store(true, Ordering::Release);
        self.ready.notify_waiters();
    }

    /// The next episode at its first decision: its id (the environment's)
    /// and observation.
    pub async fn reset(&self, wait: Duration) -> Result<(String, Transition), GymError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            {
                let mut state = self.lock();
                while let Some((episode, transition, action)) = state.ready.pop_front() {
                    // One whose decision came to nothing is passed over.
                    if action.is_closed() {
                        continue;
                    }
                    state.waiting.insert(episode.clone(), action);
                    return Ok((episode, transition));
                }
            }
            if self.finished.load(Ordering::Acquire) {
                return Err(GymError::NoEpisodes);
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Err(GymError::ResetTimeout(wait));
            }
            // Woken by an offer (a stored permit if it came first) or
            // the end; looked at again each second whatever.
            let _ = tokio::time::timeout(
                (deadline - now).min(Duration::from_secs(1)),
                self.ready.notified(),
            )
            .await;
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
    async fn resets_pass_over_decisions_that_came_to_nothing_and_steps_reach_the_episode() {
        let gym = Gym::new(Duration::from_secs(1), 4);
        // An episode whose decision timed out (its receiver gone), then one
        // waiting.
        let (gone, dropped) = oneshot::channel();
        drop(dropped);
        gym.offer("a", at(0), gone);
        let (action, acted) = oneshot::channel();
        gym.offer("b", at(0), action);
        let (id, _) = gym.reset(Duration::from_millis(10)).await.unwrap();
        assert_eq!(id, "b");
        assert_eq!(
            gym.reset(Duration::from_millis(10)).await.unwrap_err(),
            GymError::ResetTimeout(Duration::from_millis(10))
        );
        // The trainer's step hands the action over; the episode's next
        // decision answers it.
        let episode = async {
            assert_eq!(acted.await.unwrap(), Some(Strategy::Plan));
            let (next, _) = oneshot::channel();
            gym.offer("b", at(1), next);
        };
        let (stepped, ()) = tokio::join!(
            gym.step("b", Some(Strategy::Plan), Duration::from_secs(5)),
            episode
        );
        assert_eq!(stepped.unwrap().observation.unwrap()["step"], 1);
        assert_eq!(
            gym.step("c", None, Duration::from_secs(1))
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
}
