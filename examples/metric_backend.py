#!/usr/bin/env python3
"""A metric backend for evalfleet (docs/metrics.md, "Metric backends"):
reads one JSON line per answer on stdin, writes one JSON line per score on
stdout. It computes ANLS as evalfleet's built-in `anls@1` does, so that
examples/metric-backend.yaml shows the two side by side; put the call of
your own library (evalscope, VLMEvalKit, ...) in `score` instead.
"""
import json
import math
import sys


def distance(a, b):
    """Levenshtein distance between two strings, by characters."""
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        diagonal, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (x != y))
    return row[-1]


def text(value):
    return value if isinstance(value, str) else ("" if value is None else json.dumps(value))


def score(metric, answer, references, params):
    if metric != "anls":
        raise ValueError(f"this backend has no metric {metric}")
    if not references:
        raise ValueError("no reference")
    threshold = params.get("threshold", 0.5)
    norm = lambda s: " ".join(text(s).lower().split())
    a = norm(answer)
    best = 0.0
    for reference in references:
        r = norm(reference)
        longest = max(len(a), len(r))
        nl = distance(a, r) / longest if longest else 0.0
        best = max(best, 1.0 - nl if nl < threshold else 0.0)
    return best


for line in sys.stdin:
    request = json.loads(line)
    try:
        value = score(request["metric"], request["answer"], request["references"], request["params"])
        reply = {"id": request["id"], "score": value} if math.isfinite(value) else {"id": request["id"], "error": "not a finite score"}
    except Exception as error:  # the answer is not scored, with why
        reply = {"id": request["id"], "error": str(error)}
    print(json.dumps(reply), flush=True)
