#!/usr/bin/env python3
"""A Gymnasium environment over `evalfleet env`: each reset takes an episode
of a conversation run at its first decision, each step hands the robot's
strategy to it and returns its next decision, the step's reward and whether
the episode ended. evalfleet runs the personas and the relation scorer on
its fleet meanwhile, so many of these environments (one per trainer worker,
or a gymnasium vector of them) can run at once.

    evalfleet env examples/conversation.yaml --sessions 200 --bind 127.0.0.1:8765 &
    python3 examples/gym_client.py http://127.0.0.1:8765 --episodes 5 --check

Actions are 0..3 (validate, bridge, plan, no_intervention; the server's
1..4). An observation holds the three relations (AB, BC, CA), the target
edge and speaker (0 none, else 1..3) and the conversation window as text;
`info` has the raw observation and the reward's parts. Needs gymnasium and
numpy (pip install gymnasium).
"""
import argparse
import copy
import json
import string
import sys
import urllib.error
import urllib.request

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.envs.registration import EnvSpec

EDGES = ["AB", "BC", "CA"]
SPEAKERS = ["A", "B", "C"]
MAX_TEXT = 8192
CHARSET = frozenset(string.printable)


class ServerError(RuntimeError):
    """The environment server refused a request (the status and its message)."""

    def __init__(self, status, message):
        super().__init__(f"{status}: {message}")
        self.status = status


class ConversationEnv(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self, url, timeout=900.0):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.action_space = spaces.Discrete(4)
        self.observation_space = spaces.Dict(
            {
                "relations": spaces.Box(-1.0, 1.0, shape=(3,), dtype=np.float32),
                "target_edge": spaces.Discrete(4),
                "target_speaker": spaces.Discrete(4),
                "window": spaces.Text(max_length=MAX_TEXT, charset="".join(sorted(CHARSET))),
            }
        )
        # Each reset takes another episode: resets with one seed do not
        # give one episode.
        self.spec = EnvSpec(
            "EvalfleetConversation-v0",
            entry_point=ConversationEnv,
            nondeterministic=True,
            kwargs={"url": url, "timeout": timeout},
        )
        self.env_id = None
        self._last = None

    def _post(self, path, body):
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.load(response)
        except urllib.error.HTTPError as err:
            try:
                message = json.load(err).get("error", "")
            except ValueError:
                message = ""
            raise ServerError(err.code, message) from None

    def _observation(self, raw):
        if raw is None:
            # The episode is over: its last observation again, as new data.
            return copy.deepcopy(self._last)
        relations = raw.get("relations") or {}
        window = "\n".join(f"{u['speaker']}: {u['text']}" for u in raw.get("window", []))
        window = "".join(c if c in CHARSET else "?" for c in window)[-MAX_TEXT:] or " "
        edge = raw.get("target_edge")
        speaker = raw.get("target_speaker")
        obs = {
            "relations": np.array([relations.get(e, 0.0) for e in EDGES], dtype=np.float32).clip(-1.0, 1.0),
            "target_edge": EDGES.index(edge) + 1 if edge in EDGES else 0,
            "target_speaker": SPEAKERS.index(speaker) + 1 if speaker in SPEAKERS else 0,
            "window": window,
        }
        self._last = obs
        return obs

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        answer = self._post("/v1/reset", {})
        self.env_id = answer["env_id"]
        info = dict(answer.get("info") or {}, observation=answer["observation"])
        return self._observation(answer["observation"]), info

    def step(self, action):
        if self.env_id is None:
            raise RuntimeError("step before reset")
        answer = self._post("/v1/step", {"env_id": self.env_id, "action": int(action) + 1})
        info = dict(answer.get("info") or {}, observation=answer["observation"])
        obs = self._observation(answer["observation"])
        terminated, truncated = bool(answer["terminated"]), bool(answer["truncated"])
        if terminated or truncated:
            self.env_id = None
        return obs, float(answer["reward"]), terminated, truncated, info


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="the server's address, as `evalfleet env` prints it")
    parser.add_argument("--episodes", type=int, default=3, help="episodes to play with random actions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="run gymnasium's check_env first")
    args = parser.parse_args()
    env = ConversationEnv(args.url)
    if args.check:
        from gymnasium.utils.env_checker import check_env

        check_env(env, skip_render_check=True)
        print(json.dumps({"check_env": "passed"}), flush=True)
    rng = np.random.default_rng(args.seed)
    played = 0
    for _ in range(args.episodes):
        try:
            _, info = env.reset()
        except ServerError as err:
            if err.status == 410:
                break
            raise
        episode, actions, rewards = env.env_id, [], []
        while True:
            action = int(rng.integers(4))
            _, reward, terminated, truncated, info = env.step(action)
            actions.append(action + 1)
            rewards.append(reward)
            if terminated or truncated:
                break
        played += 1
        print(json.dumps({"episode": episode, "actions": actions, "rewards": rewards,
                          "terminated": terminated, "truncated": truncated}), flush=True)
    print(json.dumps({"episodes": played}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
