#!/usr/bin/env python3
"""V2, the benchmark matrix's overhead: the time between one model's last
answer and the next model's first call, less the next engine's own start.

    python3 bench/v2.py [--rounds 3] [--models 3] [--items 200] [--latency 20ms]
                        [--bin BIN | --no-build] [--keep DIR]

Each round runs `evalfleet bench` in a fresh store over `--models` models,
each served by the built-in mock started as a `local` engine (`evalfleet
mock --bind 127.0.0.1:{port} --life-log FILE`), on one dataset of
`--items` items. Then, for each handover from one model to the next:

  gap          from the last answer of model A to the first call to model B
               (the store's own times: A's last result, B's first attempt);
  engine start B's process start to its first health answer, as the bench
               saw it (its own `engine_start_ms`);
  ours         gap - engine start: A's run finishing, A's engine unloaded
               and waited for, B's run registered and started.

And, from the engines' own life logs (their own clocks): A's exit after its
last answer (the unload), and B's first call after it listened (the
readiness noticed and the run started).

Prints each round as JSON, then the median of each figure and a Markdown
row for docs/benchmarks.md. Only the standard library is used.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lives(path):
    """An engine's starts from its life log: [(pid, listening_ms, exited_ms)]."""
    out = []
    with open(path) as f:
        for line in f:
            what, at, pid = line.split()
            if what == "listening":
                out.append([int(pid), int(at), None])
            elif what == "exited":
                for life in reversed(out):
                    if life[0] == int(pid):
                        life[2] = int(at)
                        break
    return out


def config(models, latency, binary):
    text = "name: v2\nmodels:\n"
    for i in range(models):
        text += (
            f"  - name: m{i}\n    endpoint:\n      kind: local\n      model: m{i}\n"
            f"      command: \"{binary} mock --bind 127.0.0.1:{{port}} --model {{model}} "
            f"--latency {latency} --life-log life-m{i}.log\"\n"
            f"      concurrency: 16\n      stop_grace: 10s\n"
        )
    text += (
        "datasets:\n  - name: d\n    dataset: {path: items.jsonl, id_field: id}\n"
        "    task:\n      messages: [{role: user, content: '{{ question }}'}]\n"
        "      metrics: [{name: exact_match, reference: '{{ question }}'}]\n"
    )
    return text


def one_round(binary, args, work):
    with open(os.path.join(work, "items.jsonl"), "w") as f:
        for i in range(args.items):
            f.write(json.dumps({"id": f"item-{i:05}", "question": f"question {i}"}) + "\n")
    with open(os.path.join(work, "bench.yaml"), "w") as f:
        f.write(config(args.models, args.latency, binary))
    ran = subprocess.run([binary, "bench", "bench.yaml"], cwd=work, capture_output=True, text=True)
    if ran.returncode != 0:
        sys.exit(f"evalfleet bench failed ({ran.returncode}):\n{ran.stderr}")
    report = subprocess.run(
        [binary, "bench", "report", "v2", "--format", "json"],
        cwd=work, capture_output=True, text=True, check=True,
    )
    report = json.loads(report.stdout)
    handovers = []
    for h in report["handovers"]:
        a = lives(os.path.join(work, f"life-{h['from']}.log"))[-1]
        b = lives(os.path.join(work, f"life-{h['to']}.log"))[-1]
        # The first call to B and the last answer of A, in the store's times:
        # gap = first_call - last_answer.
        handovers.append({
            "from": h["from"],
            "to": h["to"],
            "gap_ms": h["gap_ms"],
            "engine_start_ms": h["engine_start_ms"],
            "ours_ms": h["overhead_ms"],
            # The engines' own clocks: A exited, B listened.
            "b_listened_after_a_exited_ms": b[1] - a[2],
        })
    return handovers


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", type=int, default=3)
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--latency", default="20ms")
    parser.add_argument("--bin")
    parser.add_argument("--no-build", action="store_true")
    parser.add_argument("--keep")
    args = parser.parse_args()
    binary = args.bin
    if binary is None:
        target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
        if not args.no_build:
            subprocess.run(["cargo", "build", "--release", "-p", "evalfleet"], cwd=ROOT, check=True)
        binary = os.path.join(target, "release", "evalfleet")
    binary = os.path.abspath(binary)
    every = []
    for r in range(args.rounds):
        work = tempfile.mkdtemp(prefix="v2-", dir=args.keep)
        handovers = one_round(binary, args, work)
        print(json.dumps({"round": r + 1, "handovers": handovers}))
        every.extend(handovers)
    if not every:
        sys.exit("no handover was measured")
    median = {k: statistics.median(h[k] for h in every)
              for k in ("gap_ms", "engine_start_ms", "ours_ms", "b_listened_after_a_exited_ms")}
    worst = max(h["ours_ms"] for h in every)
    print(json.dumps({"handovers": len(every), "median": median, "worst_ours_ms": worst}))
    print(
        f"| V2 | {args.models} models on local mock engines, {args.items} items each, "
        f"{len(every)} handovers | ours {median['ours_ms'] / 1000:.3f} s median "
        f"(worst {worst / 1000:.3f} s) of a {median['gap_ms'] / 1000:.3f} s gap, "
        f"{median['engine_start_ms'] / 1000:.3f} s of it the engine's start | under 1 s | "
        f"{'yes' if worst < 1000 else 'no'} | | `bench/v2.py --rounds {args.rounds}` |"
    )


if __name__ == "__main__":
    main()
