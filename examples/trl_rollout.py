#!/usr/bin/env python3
"""A PPO rollout loop over `evalfleet env`, in the shape TRL's PPO trainers
use: a batch of prompts from the environment, one generated reply each, the
rewards back, again until the batch's episodes end; then the next batch.

    evalfleet env examples/conversation.yaml --sessions 64 --batch-size 16 --bind 127.0.0.1:8765 &
    python3 examples/trl_rollout.py http://127.0.0.1:8765 --batch-size 16

Each of `--batch-size` environments is reset; an observation's `prompt` is
the chat messages the policy model gets (rendered by the server from
`task.conversation.policy.messages`, exactly what `policy: {kind: model}`
would send). `generate(prompts) -> list[str]` answers each with one digit
(1 validate, 2 bridge, 3 plan, 4 no_intervention); a reply that is not one
digit alone is sent as the action "invalid", and the server records the
decision invalid. Each step's reward comes back; the episodes that go on
give the next round's prompts.

The model here is a scripted stand-in (`--model scripted`): a digit drawn
from the prompt's hash, and every `--garble`-th reply unreadable. A real
policy is a `generate` of the same shape, and it is the only change: with
transformers,

    from transformers import pipeline
    generator = pipeline("text-generation", model="Qwen/Qwen3-4B", device_map="auto")

    def generate(prompts):
        outputs = generator(prompts, max_new_tokens=2, do_sample=True,
                            temperature=2.0, top_p=0.85, return_full_text=False)
        return [out[0]["generated_text"] for out in outputs]

and a PPO trainer takes each round's (prompts, replies, rewards) where the
loop below says so (TRL's `PPOTrainer.step(queries, responses, scores)`,
up to TRL 0.11: the prompts through the tokenizer's chat template as
query tensors, the replies' tokens as response tensors, a tensor per
reward). From TRL 0.12 on, `PPOTrainer.train()` runs the loop itself:
examples/trl_ppo.py trains with TRL 0.23 that way.

Prints a JSON line per episode (its actions, the model's replies and the
rewards) and one per batch; needs no package outside the standard library.
"""
import argparse
import hashlib
import json
import os
import re
import sys
import urllib.error
import urllib.request

ACTION = re.compile(r"\s*([1-4])\s*")


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


def post(url, path, body, timeout=900.0):
    request = urllib.request.Request(
        url + path,
        data=json.dumps(body, ensure_ascii=False).encode("utf-8"),
        headers=_headers(),
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as err:
        try:
            message = json.load(err).get("error", "")
        except ValueError:
            message = ""
        raise ServerError(err.code, message) from None


def scripted(garble):
    """The stand-in model: a digit from the prompt's hash; every `garble`-th
    reply (0: none) is text no digit can be read from."""
    count = 0

    def generate(prompts):
        nonlocal count
        replies = []
        for messages in prompts:
            count += 1
            if garble and count % garble == 0:
                replies.append("I would rather bridge them, I think")
                continue
            text = json.dumps(messages, ensure_ascii=False, sort_keys=True)
            digest = hashlib.sha256(text.encode("utf-8")).digest()
            replies.append(str(digest[0] % 4 + 1))
        return replies

    return generate


def action_of(reply):
    """The action for a model's reply: its digit, or "invalid"."""
    match = ACTION.fullmatch(reply)
    return int(match.group(1)) if match else "invalid"


def reset_batch(url, size, wait_s):
    """Up to `size` environments at their first decision; fewer once the
    server has no more episodes to hand out."""
    batch = []
    while len(batch) < size:
        try:
            answer = post(url, "/v1/reset", {"wait_s": wait_s})
        except ServerError as err:
            if err.status == 410:
                break
            raise
        batch.append(answer)
    return batch


def rollout(url, generate, batch_size, wait_s, out):
    """Plays batches until the server has no episode left; returns the
    number of episodes and of batches."""
    episodes = batches = 0
    while True:
        batch = reset_batch(url, batch_size, wait_s)
        if not batch:
            return episodes, batches
        batches += 1
        records = {a["env_id"]: {"episode": a["env_id"], "actions": [], "replies": [], "rewards": []} for a in batch}
        live = [(a["env_id"], a["observation"]) for a in batch]
        batch_reward = 0.0
        while live:
            prompts = [observation["prompt"] for _, observation in live]
            replies = generate(prompts)
            rewards = []
            going_on = []
            for (env_id, _), reply in zip(live, replies):
                action = action_of(reply)
                answer = post(url, "/v1/step", {"env_id": env_id, "action": action})
                record = records[env_id]
                record["actions"].append(action)
                record["replies"].append(reply)
                record["rewards"].append(answer["reward"])
                rewards.append(answer["reward"])
                if answer["terminated"] or answer["truncated"]:
                    record["ended"] = "terminated" if answer["terminated"] else "truncated"
                else:
                    going_on.append((env_id, answer["observation"]))
            # A PPO trainer steps here, with this round's prompts, replies
            # and rewards: ppo_trainer.step(queries, responses,
            # [torch.tensor(r) for r in rewards]).
            batch_reward += sum(rewards)
            live = going_on
        for record in records.values():
            print(json.dumps(record, ensure_ascii=False), file=out, flush=True)
        episodes += len(records)
        print(json.dumps({"batch": batches, "episodes": len(records), "total_reward": batch_reward}), file=out, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="the server's address, as `evalfleet env` prints it")
    parser.add_argument("--batch-size", type=int, default=16, help="environments per batch (PPO's batch size)")
    parser.add_argument("--model", choices=["scripted"], default="scripted",
                        help="the policy that generates the digits (a real model: see the top of this file)")
    parser.add_argument("--garble", type=int, default=0, help="scripted: every N-th reply is unreadable (0: none)")
    parser.add_argument("--reset-wait", type=float, default=60.0, help="seconds a reset waits for an episode")
    args = parser.parse_args()
    generate = scripted(args.garble)
    episodes, batches = rollout(args.url.rstrip("/"), generate, args.batch_size, args.reset_wait, sys.stdout)
    print(json.dumps({"episodes": episodes, "batches": batches}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
