#!/usr/bin/env python3
"""evalfleet benchmarks: the workloads of ../shared/BENCHMARKS.md.

    python3 bench/run.py w1 [--items 100000] [--rounds 3]
    python3 bench/run.py w2 [--rounds 3] [--n 10,50,200,1000]
    python3 bench/run.py w5 [--items 1000000]
    python3 bench/run.py startup [--items 100] [--rounds 5]

Each workload builds the release binary (unless --no-build), runs the mock
endpoint pinned to core 0 and the client pinned to core 1, measures a
reference in the same run, and prints the figures as JSON and as a Markdown
table for docs/benchmarks.md. Only the standard library is used.
"""

import argparse
import json
import os
import re
import resource
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release", "evalfleet")
SERVER_CORE = "0"
CLIENT_CORE = "1"

FINISHED = re.compile(r"finished: (\d+) done, (\d+) failed; (\d+) items in ([\d.]+)s \(([\d.]+) items/s\)")


def build():
    subprocess.run(["cargo", "build", "--release", "-p", "evalfleet"], cwd=ROOT, check=True)


def raise_fd_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Mock:
    """`evalfleet mock` on the server core."""

    def __init__(self, *args, port=0):
        self.proc = subprocess.Popen(
            ["taskset", "-c", SERVER_CORE, BIN, "mock", "--bind", f"127.0.0.1:{port}", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http://"):
            raise SystemExit("the mock did not start")

    def stats(self):
        with urllib.request.urlopen(self.url[: -len("/v1")] + "/mock/stats") as r:
            return json.load(r)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def write_dataset(path, n):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"i{i}", "question": f"What is {i} plus {i + 1}? Answer briefly."}) + "\n")


def write_config(path, dataset, url, concurrency, stream=False):
    with open(path, "w") as f:
        f.write(
            f"name: bench\n"
            f"dataset: {{ path: {dataset}, id_field: id }}\n"
            f"endpoints:\n"
            f"  - {{ name: mock, kind: external, base_url: \"{url}\", model: m, concurrency: {concurrency} }}\n"
            f"task:\n"
            f"  messages: [ {{ role: user, content: \"{{{{ question }}}}\" }} ]\n"
            f"  params: {{ max_tokens: 64 }}\n"
            f"  stream: {'true' if stream else 'false'}\n"
        )


def evalfleet(args, cwd):
    """Runs the client on its core; returns its figures."""
    cmd = ["taskset", "-c", CLIENT_CORE, "/usr/bin/time", "-f", "TIME %e %U %S %M", BIN, *args]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    out = {"code": proc.returncode}
    for line in proc.stderr.splitlines():
        if m := FINISHED.search(line):
            out.update(done=int(m[1]), failed=int(m[2]), items=int(m[3]), seconds=float(m[4]), rate=float(m[5]))
        if line.startswith("TIME "):
            wall, user, sys_, rss = line.split()[1:]
            out.update(wall=float(wall), cpu=float(user) + float(sys_), rss_mb=int(rss) / 1024)
    if "rate" not in out:
        raise SystemExit(f"evalfleet did not finish: {proc.stderr[-2000:]}")
    return out


def wrk(url, concurrency, seconds, cwd):
    script = os.path.join(cwd, "post.lua")
    body = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "What is 12345 plus 12346? Answer briefly."}],
            "max_tokens": 64,
            "stream": False,
        }
    )
    with open(script, "w") as f:
        f.write(f'wrk.method = "POST"\nwrk.body = {json.dumps(body)}\nwrk.headers["Content-Type"] = "application/json"\n')
    proc = subprocess.run(
        ["taskset", "-c", CLIENT_CORE, "wrk", "-t1", f"-c{concurrency}", f"-d{seconds}s", "-s", script, url + "/chat/completions"],
        capture_output=True,
        text=True,
        check=True,
    )
    m = re.search(r"Requests/sec:\s+([\d.]+)", proc.stdout)
    return float(m[1])


def version(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True).stdout.strip().splitlines()[0]
    except (OSError, IndexError):
        return "absent"


def w1(args, work):
    dataset = os.path.join(work, "w1.jsonl")
    write_dataset(dataset, args.items)
    mock = Mock()
    config = os.path.join(work, "w1.yaml")
    write_config(config, dataset, mock.url, args.concurrency)
    rounds = []
    try:
        for i in range(args.rounds):
            reference = wrk(mock.url, args.concurrency, 8, work)
            run = evalfleet(["run", config, "--store", os.path.join(work, f"w1-{i}.db"), "-q"], work)
            assert run["done"] == args.items, run
            rounds.append({"wrk_rps": reference, **run, "ratio": run["rate"] / reference})
            print(json.dumps(rounds[-1]), file=sys.stderr)
    finally:
        mock.stop()
    med = lambda k: statistics.median(r[k] for r in rounds)
    result = {
        "workload": "W1",
        "items": args.items,
        "concurrency": args.concurrency,
        "wrk_rps_median": med("wrk_rps"),
        "evalfleet_items_per_s_median": med("rate"),
        "ratio_median": med("ratio"),
        "wall_items_per_s_median": statistics.median(args.items / r["wall"] for r in rounds),
        "peak_rss_mb_median": med("rss_mb"),
        "rounds": rounds,
        "wrk": version(["wrk", "-v"]),
    }
    print(json.dumps(result, indent=2))
    print(
        f"\n| W1 | {args.items} items, concurrency {args.concurrency} | wrk {result['wrk_rps_median']:.0f} req/s "
        f"| evalfleet {result['evalfleet_items_per_s_median']:.0f} items/s ({result['wall_items_per_s_median']:.0f} "
        f"including registration) | {100 * result['ratio_median']:.1f}% | {result['peak_rss_mb_median']:.0f} MB |"
    )


def w2(args, work):
    latency = 0.5
    mock = Mock("--latency", "500ms")
    rows = []
    try:
        for stream in (False, True):
            for n in [int(x) for x in args.n.split(",")]:
                items = n * args.waves
                dataset = os.path.join(work, f"w2-{n}.jsonl")
                write_dataset(dataset, items)
                config = os.path.join(work, f"w2-{n}-{stream}.yaml")
                write_config(config, dataset, mock.url, n, stream)
                runs = []
                for i in range(args.rounds):
                    db = os.path.join(work, f"w2-{n}-{stream}-{i}.db")
                    run = evalfleet(["run", config, "--store", db, "-q"], work)
                    assert run["done"] == items, run
                    runs.append(run["rate"] / (n / latency))
                row = {"stream": stream, "n": n, "items": items, "efficiency_median": statistics.median(runs), "runs": runs}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    finally:
        mock.stop()
    print(json.dumps(rows, indent=2))
    for r in rows:
        print(
            f"| W2 | N={r['n']}, {'streaming' if r['stream'] else 'not streaming'}, {r['items']} items "
            f"| {100 * r['efficiency_median']:.1f}% | runs: {', '.join(f'{100 * x:.1f}%' for x in r['runs'])} |"
        )


def vm_hwm_mb(pid):
    """Peak RSS of a running process."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def w5(args, work):
    dataset = os.path.join(work, "w5.jsonl")
    write_dataset(dataset, args.items)
    port = free_port()
    mock = Mock(port=port)
    config = os.path.join(work, "w5.yaml")
    write_config(config, dataset, mock.url, args.concurrency)
    db = os.path.join(work, "w5.db")
    result = {"workload": "W5", "items": args.items, "concurrency": args.concurrency}

    # First session, killed with SIGKILL at about half.
    started = time.time()
    proc = subprocess.Popen(
        ["taskset", "-c", CLIENT_CORE, BIN, "run", config, "--store", db, "--run-id", "w5", "-q"],
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    peak = 0.0
    while True:
        peak = max(peak, vm_hwm_mb(proc.pid))
        if mock.stats()["completed"] >= args.items // 2:
            break
        if proc.poll() is not None:
            raise SystemExit(f"the run ended before it was killed: {proc.stderr.read()}")
        time.sleep(0.05)
    peak = max(peak, vm_hwm_mb(proc.pid))
    proc.kill()
    proc.wait()
    result["first_session_seconds"] = time.time() - started
    result["first_session_peak_rss_mb"] = peak
    with sqlite3.connect(db) as conn:
        result["committed_at_kill"] = conn.execute("SELECT COUNT(*) FROM results").fetchone()[0]
    mock.stop()

    # Resume against a fresh mock on the same port, timing the first request.
    mock = Mock(port=port)
    t0 = time.time()
    run = evalfleet(["resume", "w5", "--store", db, "-q"], work)
    first = mock.stats()["first_request_at_ms"] / 1000.0
    mock.stop()
    result["resume_to_first_request_ms"] = (first - t0) * 1000.0
    result["resume_peak_rss_mb"] = run["rss_mb"]
    result["resume_items_per_s"] = run["rate"]

    # Every item exactly once, each answer its own.
    seen = set()
    duplicated = 0
    wrong = 0
    export = subprocess.Popen([BIN, "export", "w5", "--store", db, "--format", "jsonl"], stdout=subprocess.PIPE, text=True)
    for line in export.stdout:
        row = json.loads(line)
        if row["item_id"] in seen:
            duplicated += 1
        seen.add(row["item_id"])
        if row["status"] != "done" or row["output"] != row["item"]["question"]:
            wrong += 1
    export.wait()
    expected = {f"i{i}" for i in range(args.items)}
    result["missing"] = len(expected - seen)
    result["unexpected"] = len(seen - expected)
    result["duplicated"] = duplicated
    result["wrong_or_not_done"] = wrong
    print(json.dumps(result, indent=2))
    print(
        f"\n| W5 | {args.items} items | peak RSS {max(result['first_session_peak_rss_mb'], result['resume_peak_rss_mb']):.0f} MB "
        f"| resume to first request {result['resume_to_first_request_ms']:.0f} ms | missing {result['missing']}, "
        f"duplicated {result['duplicated']}, wrong {result['wrong_or_not_done']} |"
    )


def startup(args, work):
    """From the command to the first request the endpoint sees."""
    dataset = os.path.join(work, "startup.jsonl")
    write_dataset(dataset, args.items)
    port = free_port()
    config = os.path.join(work, "startup.yaml")
    write_config(config, dataset, f"http://127.0.0.1:{port}/v1", 8)
    times = []
    for i in range(args.rounds):
        mock = Mock(port=port)
        t0 = time.time()
        run = evalfleet(["run", config, "--store", os.path.join(work, f"startup-{i}.db"), "-q"], work)
        first = mock.stats()["first_request_at_ms"] / 1000.0
        mock.stop()
        assert run["done"] == args.items, run
        times.append((first - t0) * 1000.0)
    result = {"workload": "start-up", "items": args.items, "ms": times, "median_ms": statistics.median(times)}
    print(json.dumps(result, indent=2))
    print(f"\n| start-up | {args.items} items, new store | {result['median_ms']:.0f} ms (runs: {', '.join(f'{t:.0f}' for t in times)}) |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=["w1", "w2", "w5", "startup"])
    parser.add_argument("--no-build", action="store_true")
    parser.add_argument("--items", type=int)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--n", default="10,50,200,1000", help="W2: concurrency levels")
    parser.add_argument("--waves", type=int, default=20, help="W2: items per concurrency slot")
    parser.add_argument("--keep", action="store_true", help="keep the working directory")
    args = parser.parse_args()
    if not args.no_build:
        build()
    raise_fd_limit()
    work = tempfile.mkdtemp(prefix=f"evalfleet-{args.workload}-")
    try:
        if args.workload == "w1":
            args.items = args.items or 100_000
            w1(args, work)
        elif args.workload == "w2":
            w2(args, work)
        elif args.workload == "w5":
            args.items = args.items or 1_000_000
            w5(args, work)
        else:
            args.items = args.items or 100
            args.rounds = max(args.rounds, 5)
            startup(args, work)
    finally:
        if not args.keep:
            subprocess.run(["rm", "-rf", work])
        else:
            print(f"kept {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
