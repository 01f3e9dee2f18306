#!/usr/bin/env python3
"""A metric backend for the tests: exact_match and anls as evalfleet's
built-in metrics define them (docs/metrics.md), over the JSON-lines protocol.

Misbehaviour on request, for the failure tests (--garbage-on, --nan-on and
--wrong-id-on on the anls metric's line only, so that each item misbehaves
once):
  --crash-after N   exit (status 3, with a message on stderr) after N scores
  --hang-on ITEM    stop answering (and reading) when ITEM's answer comes,
                    until --hang-while's file is gone (if given) or evalfleet
                    is gone
  --garbage-on ITEM write a line that is not JSON instead of ITEM's score
  --nan-on ITEM     write NaN as ITEM's score (Python's json does so)
  --wrong-id-on ITEM answer ITEM with an id that was never sent
  --huge-on ITEM    write a line of 4 MiB on stderr, then one on stdout,
                    instead of ITEM's score
  --marker FILE     append a line to FILE when it starts, and when it hangs
"""
import argparse
import json
import os
import sys
import time


def levenshtein(a, b):
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def as_text(value):
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return json.dumps(value)


def anls(answer, references, params):
    threshold = params.get("threshold", 0.5)
    norm = lambda s: " ".join(s.lower().split())
    a = norm(as_text(answer))
    best = 0.0
    for r in references:
        r = norm(as_text(r))
        longest = max(len(a), len(r))
        nl = 0.0 if longest == 0 else levenshtein(a, r) / longest
        best = max(best, 1.0 - nl if nl < threshold else 0.0)
    return best


def exact_match(answer, references, params):
    a = as_text(answer).strip()
    return max((1.0 if as_text(r).strip() == a else 0.0 for r in references), default=0.0)


METRICS = {"anls": anls, "exact_match": exact_match}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--crash-after", type=int)
    parser.add_argument("--hang-on")
    parser.add_argument("--garbage-on")
    parser.add_argument("--nan-on")
    parser.add_argument("--wrong-id-on")
    parser.add_argument("--huge-on")
    parser.add_argument("--hang-while")
    parser.add_argument("--marker")
    args = parser.parse_args()
    if args.marker:
        with open(args.marker, "a") as f:
            f.write("started\n")
    scored = 0
    for line in sys.stdin:
        request = json.loads(line)
        rid, item = request["id"], request["item"]
        if args.crash_after is not None and scored >= args.crash_after:
            print(f"score.py: crashing on purpose after {scored} scores", file=sys.stderr, flush=True)
            sys.exit(3)
        if item == args.hang_on and (args.hang_while is None or os.path.exists(args.hang_while)):
            print(f"score.py: hanging on {item}", file=sys.stderr, flush=True)
            if args.marker:
                with open(args.marker, "a") as f:
                    f.write(f"hanging on {item}\n")
            parent = os.getppid()
            while os.getppid() == parent and (args.hang_while is None or os.path.exists(args.hang_while)):
                time.sleep(0.05)
        odd = request["metric"] == "anls"
        if odd and item == args.garbage_on:
            print(f"this is not json for {item}", flush=True)
            continue
        if odd and item == args.huge_on:
            huge = "x" * (4 << 20)
            print(huge, file=sys.stderr, flush=True)
            print(huge, flush=True)
            continue
        if not request["references"]:
            print(json.dumps({"id": rid, "error": "no reference"}), flush=True)
            continue
        value = METRICS[request["metric"]](request["answer"], request["references"], request["params"])
        if odd and item == args.nan_on:
            value = float("nan")
        if odd and item == args.wrong_id_on:
            rid = "no-such-id"
        print(json.dumps({"id": rid, "score": value, "details": {"by": "score.py"}}), flush=True)
        scored += 1


main()
