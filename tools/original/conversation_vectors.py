#!/usr/bin/env python3
"""Records how the original research system's conversation environment plays
scripted episodes, for evalfleet's differential test of `rules: original`.

The original is yoshinari0312/policyRL_relation_robot on GitHub, folder app/,
commit aa1a845 (aa1a845fe166cb863a320a63b955db779489120e). This script holds
none of its code: it imports it, at run time, from the folder given as --app,
and records what it does. The vectors in the repository were made with

    python3 -m venv /tmp/orig-venv
    /tmp/orig-venv/bin/pip install pyyaml requests networkx
    git -C <mirror> archive aa1a845 app | tar -x -C /tmp/orig   # or any export of app/
    /tmp/orig-venv/bin/python tools/original/conversation_vectors.py \
        --app /tmp/orig/app \
        --scenarios crates/evalfleet/tests/data/original/conversation_scenarios.json \
        --out crates/evalfleet/tests/data/original/conversation_vectors.json

with Python 3.11.7, networkx 3.6.1, PyYAML 6.0.4 and requests 2.34.2 (requests
is only imported, never used). openai, python-dotenv and torch are not
installed and not needed: the chat client is replaced (below), dotenv is
optional in the original's config.py (so no .env file is read), and torch is
only imported by ppo_train.py, which is not imported (below). The script
re-executes itself with PYTHONHASHSEED=0, because the original draws a topic
trigger with random.choice over list(set(triggers)), whose order depends on
string hashing. Nothing is fetched; no network is reached.

What runs is the original's own code: env/convo_env.py (ConversationEnv:
__init__, reset, step, _make_observation, _parse_plan, _bootstrap_humans,
relation_snapshot, planning_context, the auto-skip loops, the reward),
relation_scorer.py (RelationScorer.get_scores, the prompt of _scores_azure and
_parse_score_lines, the EMA when use_ema is on), network_metrics.py (signs,
triads, balance), humans_ollama.py (human_reply, build_human_prompt, the
speaker rotation, the hiragana check), azure_clients.py, config.py (the
config is the original's config.local.yaml with the scenario's overrides),
utils/log_filtering.py. From ppo_train.py (not importable without torch and
trl) these functions are compiled from its source, by name, and called as
they are: _strip_think_tags, _validate_plan_json, _extract_reward_components,
build_robot_messages and _extract_plan_candidate (nested in reward_fn).

What is replaced by scripted replies, and why:
- azure_clients._build_chat_client returns a scripted client instead of an
  openai.AzureOpenAI. Every LLM call of the environment goes through it with
  the original's config (llm.provider: azure, scorer.backend: azure), so the
  original's own prompt building and reply parsing run: persona utterances
  (humans_ollama.human_reply, deployment "scripted-human") answer the
  scenario's utterances in order; the relation scorer (_scores_azure,
  "scripted-relation") answers the scenario's raw `A-B: x` text for the
  current state of the conversation (keyed by the number of persona
  utterances spoken so far; the original's _parse_score_lines reads it);
  the robot's intervention line (_render_intervention, "scripted-robot")
  and the topic (_get_topic_suggestion, "scripted-topic") answer scripted
  lines. The llm section of the config gets dummy endpoint, key, version and
  those four deployment names (no credential exists here).
- The policy is not a model: each decision's raw output is the scenario's
  next action string.
- The trainer (ppo_train.py: FiniteOnlineDataset.__iter__ at lines 1168-1262,
  reward_fn at 2556-3017) needs torch and TRL, so its control flow is
  restated here with a batch of one decision: before each decision the
  driver takes env.relation_snapshot(); when it is stable it steps the env
  with '{"intervene_now": false}' (resetting when done); when it is
  unstable it builds the policy's prompt with build_robot_messages (which
  calls env._make_observation, drawing a target again), then, as reward_fn
  does, strips think tags, extracts the first 1-4 digit, validates it with
  _validate_plan_json (an invalid one becomes the action 'output_error'
  with output_error_penalty), calls env.planning_context(), env.step(),
  sums _extract_reward_components plus the penalty, and on done takes
  env.relation_snapshot() and resets. In TRL the real trainer fetched a
  batch of prompts before stepping any of them; a batch of one is the
  sequential reading of the same code.
- humans_ollama.human_reply and RelationScorer.get_scores are wrapped only
  to record what they return (the line as spoken, after the original's
  hiragana check; each scorer call's caller, logs and scores).
- Python's random is seeded per scenario (random.seed(seed) before the env is
  made) and every draw of random.random/random.choice is recorded, with the
  function of the original that drew it.
Debug prints of the original (env.debug is true in its config) are
discarded.

The output holds the scenarios' inputs as played and, per scenario, every
event in order (reset, driver snapshot, policy prompt, decision with
env.step's result and the trainer's reward, stable step), each with the
scorer calls it made, the utterances spoken, the random draws and the env's
counters after it.
"""

from __future__ import annotations

import __future__ as _future
import argparse
import ast
import contextlib
import copy
import hashlib
import io
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

COMMIT = "aa1a845fe166cb863a320a63b955db779489120e"
ROBOT = "ロボット"
ORIGINAL_FILES = [
    "env/convo_env.py",
    "relation_scorer.py",
    "network_metrics.py",
    "humans_ollama.py",
    "azure_clients.py",
    "config.py",
    "context_reward.py",
    "utils/__init__.py",
    "utils/log_filtering.py",
    "ppo_train.py",
    "config.local.yaml",
]
PPO_FUNCTIONS = [
    "_strip_think_tags",
    "_validate_plan_json",
    "_extract_reward_components",
    "build_robot_messages",
    "_extract_plan_candidate",
]


class ScriptExhausted(BaseException):
    """A scenario ran out of scripted replies (BaseException so that the
    original's `except Exception` retry loops do not swallow it)."""


def pair_key(key) -> str:
    if isinstance(key, tuple):
        return "-".join(str(k) for k in key)
    return str(key)


def scores_json(scores) -> dict:
    return {pair_key(k): v for k, v in (scores or {}).items()}


def metrics_json(metrics) -> dict | None:
    if not isinstance(metrics, dict):
        return None
    out = {}
    if "edges" in metrics:
        out["edges"] = scores_json(metrics.get("edges"))
    for name in ("unstable_triads", "balanced_triads", "iso_nodes"):
        if name in metrics:
            out[name] = metrics[name]
    if "triangles" in metrics and isinstance(metrics["triangles"], list):
        out["triangles"] = [t.get("struct") for t in metrics["triangles"]]
    return out


class Script:
    """The scripted replies of one scenario and the record of their use."""

    def __init__(self, scenario: dict):
        self.utterances = list(scenario["utterances"])
        self.scorer = scenario["scorer_replies"]
        self.robot_lines = list(scenario.get("robot_lines") or [])
        self.topics = list(scenario.get("topics") or [])
        self.spoken: list[dict] = []  # persona utterances as produced
        self.scorer_llm_calls = 0
        self.scorer_calls_at: dict[int, int] = {}
        self.robot_calls = 0
        self.topic_calls = 0
        self.events_llm: list[dict] = []

    # -- persona -------------------------------------------------------
    def human(self, messages) -> str:
        if len(self.spoken) >= len(self.utterances):
            raise ScriptExhausted("persona utterances")
        prompt = messages[-1]["content"]
        speaker = None
        for line in prompt.splitlines():
            if line.startswith("出力："):
                speaker = line[len("出力："):].split(" の次発話のみ")[0].strip()
        text = self.utterances[len(self.spoken)]
        self.spoken.append({
            "index": len(self.spoken) + 1,
            "speaker": speaker,
            "scripted": text,
            "recovery_prompt": "【回復の方針】" in prompt,
            "aggressive_prompt": "攻撃的" in prompt,
            "need_line": next((need for need, mark in NEED_MARKS.items() if mark in prompt), None),
        })
        return text

    # -- scorer --------------------------------------------------------
    def relation(self, messages) -> str:
        self.scorer_llm_calls += 1
        k = len(self.spoken)
        keys = sorted((int(i) for i in self.scorer), reverse=True)
        at = next((i for i in keys if i <= k), None)
        if at is None:
            raise ScriptExhausted(f"no scorer reply for utterance {k}")
        reply = self.scorer[str(at)]
        if isinstance(reply, list):
            nth = self.scorer_calls_at.get(k, 0)
            self.scorer_calls_at[k] = nth + 1
            reply = reply[min(nth, len(reply) - 1)]
        return reply

    def robot(self, messages) -> str:
        self.robot_calls += 1
        if self.robot_calls <= len(self.robot_lines):
            return self.robot_lines[self.robot_calls - 1]
        return f"ロボットの介入その{self.robot_calls}です。"

    def topic(self, messages) -> str:
        self.topic_calls += 1
        if self.topic_calls <= len(self.topics):
            return self.topics[self.topic_calls - 1]
        return f"話題その{self.topic_calls}"


NEED_MARKS = {
    "recognition": "自分の意見や感情を認めてほしい",
    "mediation": "仲裁を求めており",
    "solution": "今後の道筋を示してほしい",
    "independence": "放っておいてほしい",
}

CURRENT: dict = {"script": None, "recorder": None}


class _Completions:
    def create(self, model=None, messages=None, **_kw):
        script: Script = CURRENT["script"]
        kind = (model or "").removeprefix("scripted-")
        if kind == "human":
            text = script.human(messages)
        elif kind == "relation":
            text = script.relation(messages)
        elif kind == "robot":
            text = script.robot(messages)
        elif kind == "topic":
            text = script.topic(messages)
        else:
            raise RuntimeError(f"unexpected LLM call of kind {kind!r}")
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=text))])


FAKE_CLIENT = SimpleNamespace(chat=SimpleNamespace(completions=_Completions()))


class Recorder:
    """Collects what happens during one event of the driver."""

    def __init__(self, app: Path):
        self.app = str(app)
        self.reset_event()

    def reset_event(self):
        self.scorer_calls: list[dict] = []
        self.draws: list[dict] = []

    def site(self, depth_from):
        """The chain of the original's frames (env/convo_env.py and
        ppo_train functions) that led here, outermost first."""
        chain = []
        frame = depth_from
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(self.app) and not name.endswith("relation_scorer.py"):
                chain.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
            elif name == "<ppo_train.py>":
                chain.append(f"ppo_train.{frame.f_code.co_name}:{frame.f_lineno}")
            frame = frame.f_back
        return " > ".join(reversed(chain))


def load_ppo_functions(app: Path) -> dict:
    """Compiles the named functions of ppo_train.py from its source (the
    module itself needs torch and TRL), with the module's constants and
    imports they use."""
    source = (app / "ppo_train.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    wanted: dict[str, ast.AST] = {}
    consts: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in PPO_FUNCTIONS and node.name not in wanted:
            wanted[node.name] = node
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_THINK_CLOSE_TAG" for t in node.targets
        ):
            consts.append(node)
    missing = [n for n in PPO_FUNCTIONS if n not in wanted]
    if missing:
        raise SystemExit(f"ppo_train.py lacks {missing}")
    module = ast.Module(body=consts + [wanted[n] for n in PPO_FUNCTIONS], type_ignores=[])
    code = compile(module, "<ppo_train.py>", "exec", flags=_future.annotations.compiler_flag, dont_inherit=True)
    import re
    import typing

    namespace = {"re": re, "Optional": typing.Optional, "List": typing.List, "Dict": typing.Dict, "Any": typing.Any}
    exec(code, namespace)
    return namespace


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in (over or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "personas":
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


SCRIPTED_LLM = {
    "provider": "azure",
    "azure_endpoint": "scripted://no-network",
    "azure_api_key": "scripted",
    "azure_api_version": "scripted",
    "azure_model": "scripted-default",
    "azure_embedding_deployment": "scripted-embedding",
    "azure_embedding_api_version": "scripted",
    "human_model": "scripted-human",
    "relation_model": "scripted-relation",
    "robot_model": "scripted-robot",
    "topic_model": "scripted-topic",
    "intervention_model": "scripted-intervention",
    "max_attempts": 5,
    "base_backoff": 0.5,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--app", required=True, type=Path, help="the original's app/ folder at aa1a845")
    parser.add_argument("--scenarios", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--only", help="play only this scenario")
    args = parser.parse_args()

    if os.environ.get("PYTHONHASHSEED") != "0":
        env = dict(os.environ, PYTHONHASHSEED="0")
        return subprocess.call([sys.executable, *sys.argv], env=env)

    app = args.app.resolve()
    sys.dont_write_bytecode = True
    sys.path.insert(0, str(app))

    import yaml

    original_config = yaml.safe_load((app / "config.local.yaml").read_text(encoding="utf-8"))
    config_dir = Path(tempfile.mkdtemp(prefix="orig-config-"))
    config_path = config_dir / "config.local.yaml"

    def write_config(overrides: dict) -> dict:
        cfg = deep_merge(original_config, overrides)
        cfg["llm"] = dict(SCRIPTED_LLM)
        config_path.write_text(yaml.safe_dump(cfg, allow_unicode=True, sort_keys=False), encoding="utf-8")
        return cfg

    write_config({})
    import config as orig_config

    real_load = orig_config.load_config
    orig_config.load_config = lambda yaml_path=None: real_load(str(config_path))

    import azure_clients

    azure_clients._build_chat_client = lambda endpoint, api_key, api_version: FAKE_CLIENT
    with contextlib.redirect_stdout(io.StringIO()):
        from env import convo_env
        import relation_scorer
    ppo = load_ppo_functions(app)

    recorder = Recorder(app)
    real_get_scores = relation_scorer.RelationScorer.get_scores

    def get_scores(self, logs, participants, return_trace=False, update_state=True):
        script: Script = CURRENT["script"]
        before = script.scorer_llm_calls
        result = real_get_scores(self, logs, participants, return_trace=return_trace, update_state=update_state)
        scores = result[0] if return_trace else result
        humans = sum(1 for entry in logs if entry.get("speaker") != ROBOT)
        record = {
            "site": recorder.site(sys._getframe(1)),
            "update_state": bool(update_state),
            "logs_human": humans,
            "logs_robot": len(logs) - humans,
            "spoken": len(script.spoken),
            "llm_calls": script.scorer_llm_calls - before,
            "scores": scores_json(scores),
        }
        if self.use_ema and update_state:
            record["ema_update"] = True
        recorder.scorer_calls.append(record)
        return result

    relation_scorer.RelationScorer.get_scores = get_scores

    real_human_reply = convo_env.human_reply

    def human_reply(*a, **kw):
        replies = real_human_reply(*a, **kw)
        script: Script = CURRENT["script"]
        for reply in replies:
            for record in reversed(script.spoken):
                if "spoken" not in record:
                    record["spoken"] = reply.get("utterance")
                    record["speaker"] = reply.get("speaker")
                    break
        return replies

    convo_env.human_reply = human_reply

    real_random, real_choice = random.random, random.choice

    def rec_random():
        value = real_random()
        recorder.draws.append({"fn": "random", "site": recorder.site(sys._getframe(1)), "value": value})
        return value

    def rec_choice(seq):
        value = real_choice(seq)
        recorder.draws.append({
            "fn": "choice",
            "site": recorder.site(sys._getframe(1)),
            "among": len(seq) if len(seq) > 8 else list(seq),
            "value": value,
        })
        return value

    random.random = rec_random
    random.choice = rec_choice

    doc = json.loads(args.scenarios.read_text(encoding="utf-8"))
    results = []
    for scenario in doc["scenarios"]:
        if args.only and scenario["name"] != args.only:
            continue
        cfg = write_config(scenario.get("config") or {})
        with contextlib.redirect_stdout(io.StringIO()):
            results.append(play(scenario, cfg, convo_env, ppo, recorder))

    hashes = {}
    for name in ORIGINAL_FILES:
        data = (app / name).read_bytes()
        hashes[name] = hashlib.sha256(data).hexdigest()
    out = {
        "generated_by": "tools/original/conversation_vectors.py",
        "original": {
            "repository": "yoshinari0312/policyRL_relation_robot",
            "folder": "app",
            "commit": COMMIT,
            "sha256": hashes,
        },
        "python": platform.python_version(),
        "packages": package_versions(),
        "pythonhashseed": "0",
        "scenarios_file": "crates/evalfleet/tests/data/original/conversation_scenarios.json",
        "scenarios": results,
    }
    args.out.write_text(dump(out) + "\n", encoding="utf-8")
    print(f"{len(results)} scenarios, {sum(len(r['events']) for r in results)} events -> {args.out}", file=sys.stderr)
    return 0


def dump(value, level: int = 0) -> str:
    """JSON with one line per record of an event's lists (scorer calls,
    draws, utterances) and one key per line above them."""
    pad = " " * level
    if isinstance(value, dict) and value and level < 8:
        items = []
        for key, item in value.items():
            if key in ("scorer_calls", "draws", "utterances") and isinstance(item, list) and item:
                inner = ",\n".join(pad + "  " + json.dumps(x, ensure_ascii=False) for x in item)
                items.append(f'{pad} {json.dumps(key)}: [\n{inner}\n{pad} ]')
            elif key in ("info", "needs", "aggressive", "env_after", "edges", "components", "sha256", "packages", "original"):
                items.append(f"{pad} {json.dumps(key)}: {json.dumps(item, ensure_ascii=False)}")
            else:
                items.append(f"{pad} {json.dumps(key)}: {dump(item, level + 1)}")
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, list) and value and level < 8 and all(isinstance(x, dict) for x in value):
        return "[\n" + ",\n".join(pad + " " + dump(x, level + 1) for x in value) + "\n" + pad + "]"
    return json.dumps(value, ensure_ascii=False)


def package_versions() -> dict:
    from importlib import metadata

    out = {}
    for name in ("networkx", "PyYAML", "requests"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def env_state(env) -> dict:
    logs = env.logs
    humans = sum(1 for entry in logs if entry.get("speaker") != ROBOT)
    return {
        "episode": env.episode,
        "t": env.t,
        "episode_step": env._episode_step,
        "unstable_step": env._unstable_step,
        "logs_human": humans,
        "logs_robot": len(logs) - humans,
        "steps_since_last_intervention": env.steps_since_last_intervention,
        "previous_intervened": env.previous_intervened,
        "target_edge": getattr(env, "_current_target_edge", None),
        "target_speaker": getattr(env, "_current_target_speaker", None),
        "topic": env.current_topic,
        "topic_trigger": env.current_topic_trigger,
        "ema_scores": scores_json(dict(env.scorer.scores)) if env.scorer.use_ema else None,
    }


def step_info(info: dict) -> dict:
    keep = {}
    for name in (
        "plan_error", "intervened", "balanced", "robot_utterance", "reward_breakdown",
        "reward_notes", "target_speaker", "chosen_strategy", "preferred_strategy",
        "preference_match", "edge_to_change", "target_edge_score_after",
        "target_edge_positive_after", "stable_after_horizon", "emotional_needs",
    ):
        if name in info:
            keep[name] = info[name]
    plan = info.get("plan")
    keep["plan"] = {k: v for k, v in plan.items() if k != "_llm_raw_output"} if isinstance(plan, dict) else plan
    for name in ("rel", "rel_before", "rel_after_horizon", "rel_after_bonus"):
        if name in info:
            keep[name] = metrics_json(info[name])
    if "status" in info:
        keep["status"] = {"is_stable": info["status"].get("is_stable"), "edges": scores_json(info["status"].get("edges"))}
    replies = info.get("replies") or []
    keep["replies"] = [f"{r.get('speaker')}: {r.get('utterance')}" for r in replies]
    keep["human_utterance_before_relation"] = len(info.get("human_utterance_before_relation") or [])
    return keep


def play(scenario: dict, cfg: dict, convo_env, ppo: dict, recorder: Recorder) -> dict:
    script = Script(scenario)
    CURRENT["script"] = script
    seed = int(scenario["seed"])
    random.seed(seed)
    events: list[dict] = []
    spoken_mark = [0]

    def begin():
        recorder.reset_event()
        spoken_mark[0] = len(script.spoken)

    def finish(event: dict, env=None) -> dict:
        event["utterances"] = script.spoken[spoken_mark[0]:]
        event["scorer_calls"] = recorder.scorer_calls
        event["draws"] = recorder.draws
        if env is not None:
            event["env_after"] = env_state(env)
        events.append(event)
        return event

    env_cfg = cfg["env"]
    ctor = dict(
        max_steps=env_cfg["max_steps"],
        personas=None,
        include_robot=env_cfg["include_robot"],
        max_history=env_cfg.get("max_history", 6),
        backend=cfg["scorer"]["backend"],
        decay_factor=cfg["scorer"]["decay_factor"],
        debug=env_cfg["debug"],
        reward_backend=env_cfg.get("reward_backend", "rule"),
        evaluation_horizon=env_cfg["evaluation_horizon"],
        time_penalty=env_cfg["time_penalty"],
        terminal_bonus=env_cfg["terminal_bonus"],
        intervention_cost=env_cfg.get("intervention_cost", 0.02),
    )
    actions = list(scenario["actions"])
    outcome = "actions played"
    env = None
    try:
        begin()
        env = convo_env.ConversationEnv(**ctor)
        finish({"event": "reset", "why": "ConversationEnv.__init__", "observation": env._last_observation,
                "needs": dict(env.persona_emotional_needs), "aggressive": dict(env.speaker_aggressiveness)}, env)
        decisions = 0
        guard = 0
        while decisions < len(actions):
            guard += 1
            if guard > 200:
                outcome = "guard: 200 driver iterations"
                break
            begin()
            snapshot = env.relation_snapshot()
            metrics = snapshot.get("metrics", snapshot)
            unstable = metrics.get("unstable_triads", 0)
            finish({"event": "driver_snapshot", "unstable_triads": unstable, "edges": scores_json(metrics.get("edges"))})
            if unstable > 0:
                begin()
                persona_list = list(getattr(env, "persona_pool", []))
                messages = ppo["build_robot_messages"](env.logs, persona_list, env=env)
                finish({"event": "policy_prompt", "observation": messages[-1]["content"],
                        "target_edge": env._current_target_edge, "target_speaker": env._current_target_speaker}, env)
                raw = actions[decisions]
                decisions += 1
                begin()
                event = decide(env, raw, ppo, cfg, decisions)
                finish(event, env)
                if event["done"]:
                    begin()
                    env.relation_snapshot()
                    env.reset()
                    finish({"event": "reset", "why": "done after a decision (reward_fn)", "observation": env._last_observation,
                            "needs": dict(env.persona_emotional_needs), "aggressive": dict(env.speaker_aggressiveness)}, env)
            else:
                begin()
                action = '{"intervene_now": false}'
                obs, reward, done, info = env.step(action)
                finish({"event": "stable_step", "action": action, "env_reward": reward, "done": done,
                        "info": step_info(info), "observation": obs}, env)
                if done:
                    begin()
                    env.reset()
                    finish({"event": "reset", "why": "done after a stable step (FiniteOnlineDataset)",
                            "observation": env._last_observation,
                            "needs": dict(env.persona_emotional_needs), "aggressive": dict(env.speaker_aggressiveness)}, env)
    except ScriptExhausted as exc:
        outcome = f"script exhausted: {exc}"
        finish({"event": "stopped", "why": outcome}, env)
    CURRENT["script"] = None
    return {
        "name": scenario["name"],
        "seed": seed,
        "outcome": outcome,
        "decisions": sum(1 for e in events if e["event"] == "decision"),
        "env_steps": sum(1 for e in events if e["event"] in ("decision", "stable_step")),
        "persona_utterances": len(script.spoken),
        "scorer_llm_calls": script.scorer_llm_calls,
        "events": events,
    }


def decide(env, raw: str, ppo: dict, cfg: dict, number: int) -> dict:
    """One decision as reward_fn makes it (ppo_train.py:2587-2666)."""
    visible = ppo["_strip_think_tags"](raw or "")
    candidate = ppo["_extract_plan_candidate"](visible)
    plan_obj, valid = ppo["_validate_plan_json"](candidate, env)
    penalty = 0.0
    if valid and plan_obj is not None:
        plan_text = candidate
    else:
        plan_text = "output_error"
        penalty = float(cfg["env"].get("output_error_penalty", 1.0))
    env.planning_context()  # reward_fn's state_before
    obs, reward, done, info = env.step(plan_text)
    components = ppo["_extract_reward_components"](info.get("reward_breakdown", {}) or {})
    total = float(reward)
    if penalty > 0:
        total -= penalty
        components["output_errorペナルティ"] = -penalty
    if components:
        total = sum(components.values())
    return {
        "event": "decision",
        "number": number,
        "raw_action": raw,
        "candidate": candidate,
        "valid": bool(valid),
        "plan_text": plan_text,
        "output_error_penalty": penalty,
        "env_reward": reward,
        "components": components,
        "total_reward": total,
        "done": done,
        "info": step_info(info),
        "observation": obs,
    }


if __name__ == "__main__":
    sys.exit(main())
