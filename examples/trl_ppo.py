#!/usr/bin/env python3
"""PPO training with TRL 0.23 (the version the original system trains with)
over `evalfleet env`: the policy model is trained by TRL's own
`PPOTrainer.train()`, the environment's rewards standing in for a reward
model.

    pip install "trl==0.23.0" transformers accelerate torch
    evalfleet env examples/conversation.yaml --sessions 64 --bind 127.0.0.1:8765 &
    python3 examples/trl_ppo.py http://127.0.0.1:8765 --model Qwen/Qwen3-0.6B --updates 8

How it plugs in, as the original's `app/ppo_train.py` does it:

- The training set is an iterable dataset of the environments'
  observations: each item is an episode's decision prompt (the chat
  messages `task.conversation.policy.messages` renders) through the
  tokenizer's chat template. An episode has one decision open at a time;
  the dataset takes the next prompt from an episode that has none open,
  and resets a new one where none is free (`/v1/reset`), so the data
  loader may read ahead as it likes.
- TRL 0.23's trainer scores a batch with `get_reward(reward_model, ...)`:
  this script replaces that function in `trl.trainer.ppo_trainer`. For the
  stand-in reward model it decodes each response, reads the action (one
  digit 1-4 alone, else "invalid"), plays it (`/v1/step`) on the episode
  the prompt came from (the batch's rows come in the order the dataset
  gave them) and returns the environment's reward at the response's last
  token. The value model's calls go to TRL's own function.
- An episode that ends frees its place; the next prompt from it is a new
  episode's.

`--tiny` trains a model built here with random weights and a tokenizer
learnt from the environment's own prompts (two layers, a few hundred
tokens): nothing is downloaded, and the run shows the whole loop (rollouts,
rewards, PPO updates) on a CPU in a minute or two. Such a model starts out
answering noise, nearly every reply "invalid"; the share of valid replies
per update is printed as it learns.

Prints a JSON line per update (its replies, the valid share, the mean
reward, TRL's logged statistics) and one at the end.
"""
import argparse
import json
import os
import sys
import tempfile
from collections import deque

# The server's protocol, as the rollout example speaks it (this folder is
# on the path when the script runs).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl_rollout import ServerError, action_of, post  # noqa: E402


class Episodes:
    """The environment's episodes as the trainer sees them: prompts out, in
    order; rewards back for the same prompts, in the same order."""

    def __init__(self, url, wait_s):
        self.url = url
        self.wait_s = wait_s
        self.free = deque()  # (env_id, observation): a decision not yet handed out
        self.open = deque()  # env_ids whose prompt was handed out, oldest first
        self.log = []  # (env_id, reply, action, reward) since the last take
        self.episodes = 0
        self.ended = 0

    def next_prompt(self):
        """The next decision's prompt (chat messages), or None when the
        server has no more episodes."""
        if not self.free:
            try:
                answer = post(self.url, "/v1/reset", {"wait_s": self.wait_s})
            except ServerError as err:
                if err.status == 410:
                    return None
                raise
            self.episodes += 1
            self.free.append((answer["env_id"], answer["observation"]))
        env_id, observation = self.free.popleft()
        self.open.append(env_id)
        return observation["prompt"]

    def play(self, replies):
        """Plays each reply on the oldest open decision; their rewards."""
        rewards = []
        for reply in replies:
            if not self.open:
                raise RuntimeError("a reply came for no open decision: the trainer read rows out of order")
            env_id = self.open.popleft()
            action = action_of(reply)
            answer = post(self.url, "/v1/step", {"env_id": env_id, "action": action})
            rewards.append(float(answer["reward"]))
            self.log.append((env_id, reply, action, answer["reward"]))
            if answer["terminated"] or answer["truncated"]:
                self.ended += 1
            else:
                self.free.append((env_id, answer["observation"]))
        return rewards

    def take_log(self):
        log, self.log = self.log, []
        return log


def tiny_model(episodes, workdir):
    """A two-layer Qwen2 with random weights and a byte-level BPE learnt from
    a few of the environment's prompts (digits are tokens of their own)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    prompt = episodes.next_prompt()
    if prompt is None:
        raise SystemExit("the server has no episode to learn a tokenizer from")
    # The decision read stays the trainer's first.
    episodes.free.appendleft((episodes.open.pop(), {"prompt": prompt}))
    texts = [message["content"] for message in prompt] + ["1", "2", "3", "4"]
    special = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        texts,
        trainers.BpeTrainer(vocab_size=512, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<|pad|>", eos_token="<|end|>", padding_side="left"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    path = os.path.join(workdir, "tiny-policy")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="the server's address, as `evalfleet env` prints it")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="the policy: a Hugging Face model name or directory")
    what.add_argument("--tiny", action="store_true", help="a tiny random model built here (no download)")
    parser.add_argument("--updates", type=int, default=8, help="PPO updates (each a batch of decisions)")
    parser.add_argument("--batch-size", type=int, default=8, help="decisions per PPO update")
    parser.add_argument("--response-length", type=int, default=4, help="most tokens a reply may have")
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--reset-wait", type=float, default=60.0, help="seconds a reset waits for an episode")
    parser.add_argument("--output-dir", default=None, help="where TRL writes (a temporary folder if not given)")
    args = parser.parse_args()

    import torch
    import trl
    from torch.utils.data import IterableDataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl import PPOConfig, PPOTrainer
    from trl.trainer import ppo_trainer

    if not trl.__version__.startswith("0.23"):
        print(f"note: written for TRL 0.23 (the original's); this is {trl.__version__}", file=sys.stderr)

    url = args.url.rstrip("/")
    workdir = args.output_dir or tempfile.mkdtemp(prefix="evalfleet-trl-")
    episodes = Episodes(url, args.reset_wait)
    model_path = tiny_model(episodes, workdir) if args.tiny else args.model

    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    policy = AutoModelForCausalLM.from_pretrained(model_path)
    ref_policy = AutoModelForCausalLM.from_pretrained(model_path)
    value_model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1)
    value_model.config.pad_token_id = tokenizer.pad_token_id

    class EnvReward(torch.nn.Module):
        """Stands where TRL expects a reward model; never run (the
        replaced `get_reward` plays the environment instead)."""

    reward_model = EnvReward()
    samples = args.updates * args.batch_size

    class Prompts(IterableDataset):
        def __init__(self, count):
            self.count = count

        def __iter__(self):
            for _ in range(self.count):
                prompt = episodes.next_prompt()
                if prompt is None:
                    return
                ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
                yield {"input_ids": ids}

        def __len__(self):
            return self.count

    # TRL 0.23 asks its data loader to shuffle, which an iterable dataset
    # refuses (the original patches it the same way): decisions go in the
    # order the episodes give them.
    trl_data_loader = ppo_trainer.DataLoader

    def data_loader(dataset, *args, **kwargs):
        if isinstance(dataset, IterableDataset):
            kwargs.pop("shuffle", None)
        return trl_data_loader(dataset, *args, **kwargs)

    ppo_trainer.DataLoader = data_loader

    def collate(rows):
        return tokenizer.pad({"input_ids": [row["input_ids"] for row in rows]}, return_tensors="pt")

    trl_get_reward = ppo_trainer.get_reward

    def get_reward(model, query_responses, pad_token_id, context_length):
        if model is not reward_model:
            return trl_get_reward(model, query_responses, pad_token_id, context_length)
        responses = query_responses[:, context_length:]
        texts = [
            tokenizer.decode([t for t in row.tolist() if t != pad_token_id], skip_special_tokens=True)
            for row in responses
        ]
        scores = torch.tensor(episodes.play(texts), dtype=torch.float32, device=query_responses.device)
        # The reward sits at each response's last token, as TRL's own.
        padding = responses == pad_token_id
        lengths = torch.where(padding.any(dim=1), padding.int().argmax(dim=1), responses.size(1)) - 1
        last = (lengths.clamp(min=0) + context_length).clamp(max=query_responses.size(1) - 1)
        logits = torch.zeros(query_responses.shape[:2], dtype=torch.float32, device=query_responses.device)
        logits[torch.arange(len(scores)), last] = scores
        return logits, scores, last

    ppo_trainer.get_reward = get_reward

    class Report(TrainerCallback):
        def on_log(self, _args, state, _control, logs=None, **_):
            log = episodes.take_log()
            valid = [entry for entry in log if entry[2] != "invalid"]
            line = {
                "update": state.global_step,
                "decisions": len(log),
                "valid_share": len(valid) / len(log) if log else None,
                "mean_reward": sum(entry[3] for entry in log) / len(log) if log else None,
                "replies": [entry[1] for entry in log[:4]],
                "trl": {k: v for k, v in (logs or {}).items() if k.startswith(("objective/", "loss/", "val/"))},
            }
            print(json.dumps(line, ensure_ascii=False), flush=True)

    config = PPOConfig(
        output_dir=workdir,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        num_ppo_epochs=1,
        total_episodes=samples,
        response_length=args.response_length,
        stop_token_id=tokenizer.eos_token_id,
        learning_rate=args.learning_rate,
        temperature=1.0,
        local_rollout_forward_batch_size=args.batch_size,
        num_sample_generations=0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        seed=0,
    )
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_policy,
        reward_model=reward_model,
        value_model=value_model,
        train_dataset=Prompts(samples),
        # (Read only for sample generations, which are off.)
        eval_dataset=Prompts(0),
        data_collator=collate,
        callbacks=[Report()],
    )
    trainer.train()
    print(
        json.dumps({"updates": args.updates, "episodes_started": episodes.episodes, "episodes_ended": episodes.ended}),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
