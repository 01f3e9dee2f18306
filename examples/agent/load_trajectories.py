"""Loads `evalfleet export RUN --format trajectories -o FILE` as SFT and RL
users load it: a Hugging Face `datasets` table, each row a conversation in
TRL's conversational format (`messages`, `tools`), rendered by a chat
template. Prints what it loaded as one JSON line.

    python load_trajectories.py trajectories.jsonl

The tokenizer is made here (a word-level vocabulary and a small chat
template that writes tool calls), so nothing is downloaded; with a real
model, load its tokenizer with AutoTokenizer.from_pretrained instead.
"""

import json
import sys

from datasets import load_dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from trl.data_utils import apply_chat_template, is_conversational

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "<call {{ c['function']['name'] }}>{{ c['function']['arguments'] }}</call>"
    "{% endfor %}{% endif %}<|end|>\n{% endfor %}"
)


def tokenizer():
    inner = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    made = PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="[UNK]")
    made.chat_template = TEMPLATE
    return made


def main(path):
    rows = load_dataset("json", data_files=path, split="train")
    tok = tokenizer()
    texts = []
    for row in rows:
        assert is_conversational(row), row["item_id"]
        texts.append(apply_chat_template({"messages": row["messages"]}, tok, tools=row.get("tools"))["text"])
    print(json.dumps({
        "rows": rows.num_rows,
        "columns": rows.column_names,
        "text_chars": [len(t) for t in texts],
        "texts": texts,
    }))


if __name__ == "__main__":
    main(sys.argv[1])
