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
edge and speaker (0 none, else 1..3) and the conversation window as text,
in whatever language it is spoken (its space takes any character);
`info` has the raw observation (its `prompt`: the policy's chat messages)
and the step's analysis (reward parts, target need, preferred strategy).
An environment reset or closed mid-episode gives its episode up
(`/v1/close`): the server starts it over for a later reset. Needs gymnasium and numpy (pip install gymnasium).
"""
import argparse
import copy
import json
import os
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


class AnyText(spaces.Text):
    """Text of any characters, up to `max_length` of them.

    gymnasium's Text holds a fixed charset (by default letters and digits),
    and a conversation in Japanese or any other language would not be in
    it; this space holds every string of the right length, so the text
    reaches the trainer as it was spoken. Its samples are printable ASCII.
    """

    def __init__(self, max_length, min_length=1):
        super().__init__(max_length=max_length, min_length=min_length, charset=string.printable)

    def contains(self, x):
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def __repr__(self):
        return f"AnyText({self.min_length}, {self.max_length})"

    def __eq__(self, other):
        return isinstance(other, AnyText) and (self.min_length, self.max_length) == (other.min_length, other.max_length)


def _headers():
    """JSON, and the server's key when EVALFLEET_API_KEY is set (a server
    on any address but a loopback one asks for it)."""
    headers = {"Content-Type": "application/json"}
    key = os.environ.get("EVALFLEET_API_KEY", "").strip()
    if key:
        headers["X-API-Key"] = key
    return headers


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
                "window": AnyText(max_length=MAX_TEXT),
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
            data=json.dumps(body, ensure_ascii=False).encode("utf-8"),
            headers=_headers(),
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
        window = window[-MAX_TEXT:] or " "
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

    def close(self):
        """Gives up the episode under way, if any: the server stops it."""
        if self.env_id is not None:
            env_id, self.env_id = self.env_id, None
            try:
                self._post("/v1/close", {"env_id": env_id})
            except ServerError as err:
                # It ended meanwhile.
                if err.status != 404:
                    raise

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.close()
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
    parser.add_argument("--show-text", action="store_true", help="print each observation's window with the episode")
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
        windows, prompts = [env._last["window"]], [info["observation"]["prompt"]]
        while True:
            action = int(rng.integers(4))
            obs, reward, terminated, truncated, info = env.step(action)
            actions.append(action + 1)
            rewards.append(reward)
            if terminated or truncated:
                break
            windows.append(obs["window"])
            prompts.append(info["observation"]["prompt"])
        played += 1
        line = {"episode": episode, "actions": actions, "rewards": rewards,
                "terminated": terminated, "truncated": truncated}
        if args.show_text:
            line.update(windows=windows, prompts=prompts)
        print(json.dumps(line, ensure_ascii=False), flush=True)
    print(json.dumps({"episodes": played}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
