#!/usr/bin/env python3
"""evalfleet benchmarks: the workloads of ../shared/BENCHMARKS.md.

    python3 bench/run.py w1 [--items 100000] [--rounds 3]
    python3 bench/run.py w2 [--rounds 3] [--n 10,50,200,1000]
    python3 bench/run.py w5 [--items 1000000]
    python3 bench/run.py startup [--items 100] [--rounds 5]
    python3 bench/run.py w3 [--items 6000] [--rpm 6000] [--rounds 3]
    python3 bench/run.py w4 [--items 12000] [--capacity 32] [--rounds 3]
    python3 bench/run.py w6 [--items 200000] [--rounds 3]
    python3 bench/run.py j1 [--rounds 3]     # needs ../shared/data/humaneval.jsonl.gz

W1, W5, W6 and J1 take --baseline BIN: another evalfleet binary (an earlier
commit's) measured in the same rounds against the same mocks, alternating
which goes first, so that a change is judged side by side.

W3 and W4 also run the peers with --peers DIR, where DIR holds
venv/bin/inspect (pip install inspect-ai openai) and
node/node_modules/.bin/promptfoo (npm install promptfoo); each runs once
with its default settings against a fresh mock like ours.

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
            f"  - {{ name: mock, kind: external, base_url: \"{url}\", model: m, concurrency: {json.dumps(concurrency)} }}\n"
            f"task:\n"
            f"  messages: [ {{ role: user, content: \"{{{{ question }}}}\" }} ]\n"
            f"  params: {{ max_tokens: 64 }}\n"
            f"  stream: {'true' if stream else 'false'}\n"
        )


def evalfleet(args, cwd, pin=True, binary=None):
    """Runs the client (`binary`, else this build) on its core (`pin`; else
    on every core); returns its figures."""
    cmd = (["taskset", "-c", CLIENT_CORE] if pin else []) + ["/usr/bin/time", "-f", "TIME %e %U %S %M", binary or BIN, *args]
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


def binaries(args, round_):
    """The binaries to measure in this round, as (label, path): this build,
    and the baseline when given, taking turns at going first."""
    pairs = [("new", BIN)]
    if args.baseline:
        pairs.append(("baseline", os.path.abspath(args.baseline)))
        if round_ % 2 == 1:
            pairs.reverse()
    return pairs


def side_by_side(rounds, key, higher_is_better=True):
    """The medians of `key` for each binary, and new / baseline."""
    out = {}
    for label in ("new", "baseline"):
        values = [r[label][key] for r in rounds if label in r]
        if values:
            out[f"{label}_{key}_median"] = statistics.median(values)
    if "baseline_" + key + "_median" in out:
        ratios = [r["new"][key] / r["baseline"][key] for r in rounds if "baseline" in r]
        out[f"new_over_baseline_{key}_median"] = statistics.median(ratios)
    return out


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
            round_ = {"wrk_rps": reference}
            for label, binary in binaries(args, i):
                run = evalfleet(["run", config, "--store", os.path.join(work, f"w1-{label}-{i}.db"), "-q"], work, binary=binary)
                assert run["done"] == args.items, run
                round_[label] = {**run, "ratio": run["rate"] / reference}
            rounds.append({**round_, **round_["new"]})
            print(json.dumps(round_), file=sys.stderr)
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
        **side_by_side(rounds, "rate"),
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
    results = {}
    for label, binary in binaries(args, 0):
        results[label] = w5_once(args, work, dataset, label, binary)
    if "baseline" in results:
        print(json.dumps({"workload": "W5", "side_by_side": results}, indent=2))


def w5_once(args, work, dataset, label, binary):
    """W5 with one binary; then `report` on its store of a million results."""
    port = free_port()
    mock = Mock(port=port)
    config = os.path.join(work, "w5.yaml")
    write_config(config, dataset, mock.url, args.concurrency)
    db = os.path.join(work, f"w5-{label}.db")
    result = {"workload": "W5", "binary": label, "items": args.items, "concurrency": args.concurrency}

    # First session, killed with SIGKILL at about half.
    started = time.time()
    proc = subprocess.Popen(
        ["taskset", "-c", CLIENT_CORE, binary, "run", config, "--store", db, "--run-id", "w5", "-q"],
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
    run = evalfleet(["resume", "w5", "--store", db, "-q"], work, binary=binary)
    first = mock.stats()["first_request_at_ms"] / 1000.0
    mock.stop()
    result["resume_to_first_request_ms"] = (first - t0) * 1000.0
    result["resume_peak_rss_mb"] = run["rss_mb"]
    result["resume_items_per_s"] = run["rate"]

    # Every item exactly once, each answer its own.
    seen = set()
    duplicated = 0
    wrong = 0
    export = subprocess.Popen([binary, "export", "w5", "--store", db, "--format", "jsonl"], stdout=subprocess.PIPE, text=True)
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
    # The report of a million results: its time and memory.
    report = subprocess.run(
        ["/usr/bin/time", "-f", "TIME %e %U %S %M", binary, "report", "w5", "--store", db, "--json", "--out", os.path.join(work, f"report-{label}")],
        cwd=work, capture_output=True, text=True,
    )
    for line in report.stderr.splitlines():
        if line.startswith("TIME "):
            wall, _, _, rss = line.split()[1:]
            result["report_wall_s"] = float(wall)
            result["report_peak_rss_mb"] = int(rss) / 1024
    result["report_code"] = report.returncode
    print(json.dumps(result, indent=2))
    print(
        f"\n| W5 | {args.items} items | peak RSS {max(result['first_session_peak_rss_mb'], result['resume_peak_rss_mb']):.0f} MB "
        f"| resume to first request {result['resume_to_first_request_ms']:.0f} ms | missing {result['missing']}, "
        f"duplicated {result['duplicated']}, wrong {result['wrong_or_not_done']} "
        f"| report {result.get('report_wall_s', float('nan')):.1f} s, {result.get('report_peak_rss_mb', float('nan')):.0f} MB | ({label})"
    )
    os.remove(db)
    return result


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


INSPECT_TASK = """
import os
from inspect_ai import Task, task
from inspect_ai.dataset import FieldSpec, json_dataset
from inspect_ai.solver import generate

@task
def bench():
    return Task(
        dataset=json_dataset(os.environ["BENCH_DATASET"], FieldSpec(input="question", id="id")),
        solver=generate(),
    )
"""


def inspect_peer(peers, dataset, url, work):
    """inspect-ai with its defaults (adaptive connections, its retries)."""
    task = os.path.join(work, "inspect_task.py")
    with open(task, "w") as f:
        f.write(INSPECT_TASK)
    exe = os.path.join(peers, "venv", "bin", "inspect")
    env = dict(os.environ, BENCH_DATASET=dataset, MOCK_BASE_URL=url, MOCK_API_KEY="none", INSPECT_DISPLAY="none")
    cmd = [exe, "eval", os.path.basename(task), "--model", "openai-api/mock/m", "--max-tokens", "64", "--log-dir", os.path.join(work, "inspect-logs")]
    return peer_process(cmd, env, work), version([exe, "--version"])


def promptfoo_peer(peers, dataset, url, work):
    """promptfoo with its defaults (-j 4, its adaptive concurrency and retries), cache off."""
    tests = os.path.join(work, "promptfoo_tests.csv")
    with open(dataset) as src, open(tests, "w") as out:
        out.write("question\n")
        for line in src:
            out.write(json.loads(line)["question"] + "\n")
    config = os.path.join(work, "promptfooconfig.yaml")
    with open(config, "w") as f:
        f.write(
            'prompts: ["{{question}}"]\n'
            f"providers:\n  - id: openai:chat:m\n    config: {{ apiBaseUrl: \"{url}\", apiKey: none, max_tokens: 64 }}\n"
            f"tests: file://{tests}\n"
        )
    exe = os.path.join(peers, "node", "node_modules", ".bin", "promptfoo")
    env = dict(
        os.environ,
        PROMPTFOO_CONFIG_DIR=os.path.join(work, "promptfoo-home"),
        PROMPTFOO_DISABLE_TELEMETRY="1",
        PROMPTFOO_DISABLE_UPDATE="1",
        PROMPTFOO_CACHE_ENABLED="false",
    )
    cmd = [exe, "eval", "-c", config, "--no-cache", "--no-progress-bar", "--no-table", "--no-write"]
    return peer_process(cmd, env, work), version([exe, "--version"])


def peer_process(cmd, env, cwd):
    """Runs a peer on the client core; its wall time and peak RSS."""
    cmd = ["taskset", "-c", CLIENT_CORE, "/usr/bin/time", "-f", "TIME %e %U %S %M", *cmd]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    out = {"code": proc.returncode}
    for line in proc.stderr.splitlines():
        if line.startswith("TIME "):
            wall, user, sys_, rss = line.split()[1:]
            out.update(wall=float(wall), cpu=float(user) + float(sys_), rss_mb=int(rss) / 1024)
    if proc.returncode != 0:
        print(f"{cmd[6]} exited with {proc.returncode}: {proc.stderr[-1500:]}{proc.stdout[-1500:]}", file=sys.stderr)
    return out


def served_span(stats):
    """Seconds from the first request the mock saw to its last full answer."""
    return (stats["last_completed_at_ms"] - stats["first_request_at_ms"]) / 1000.0


def run_peers(args, mock_args, dataset, work, figures):
    """Each peer once against a fresh mock; `figures(stats, proc)` makes its row."""
    peers = {}
    for name, driver in (("inspect-ai", inspect_peer), ("promptfoo", promptfoo_peer)):
        mock = Mock(*mock_args)
        proc, ver = driver(args.peers, dataset, mock.url, work)
        stats = mock.stats()
        mock.stop()
        peers[name] = {"version": ver, "wall": proc.get("wall"), "exit": proc["code"], **figures(stats)}
        print(json.dumps({name: peers[name]}), file=sys.stderr)
    return peers


def status(run_id, db, cwd):
    out = subprocess.run([BIN, "status", run_id, "--store", db, "--json"], cwd=cwd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def w3(args, work):
    """A quota of R requests a minute (bursts of one second's worth), 429 with
    Retry-After beyond it; evalfleet with its default adaptive settings."""
    dataset = os.path.join(work, "w3.jsonl")
    write_dataset(dataset, args.items)
    burst = max(1, args.rpm // 60)
    ideal = (args.items - burst) / (args.rpm / 60.0)
    rounds = []
    for i in range(args.rounds):
        mock = Mock("--rpm", str(args.rpm), "--burst", str(burst), "--latency", "100ms")
        config = os.path.join(work, f"w3-{i}.yaml")
        write_config(config, dataset, mock.url, "adaptive")
        run = evalfleet(["run", config, "--store", os.path.join(work, f"w3-{i}.db"), "-q"], work)
        stats = mock.stats()
        mock.stop()
        assert run["done"] == args.items, run
        round_ = {
            "seconds": run["seconds"],
            "served_span": served_span(stats),
            "time_over_ideal": run["seconds"] / ideal,
            "rate_limited": stats["rate_limited"],
            "completed": stats["completed"],
            "per_success": stats["rate_limited"] / stats["completed"],
            "rss_mb": run["rss_mb"],
        }
        rounds.append(round_)
        print(json.dumps(round_), file=sys.stderr)
    med = lambda k: statistics.median(r[k] for r in rounds)
    result = {
        "workload": "W3",
        "items": args.items,
        "rpm": args.rpm,
        "burst": burst,
        "ideal_seconds": ideal,
        "time_over_ideal_median": med("time_over_ideal"),
        "per_success_median": med("per_success"),
        "rounds": rounds,
    }
    if args.peers:
        result["peers"] = run_peers(
            args,
            ["--rpm", str(args.rpm), "--burst", str(burst), "--latency", "100ms"],
            dataset,
            work,
            lambda stats: {
                "completed": stats["completed"],
                "served_span": served_span(stats),
                "span_over_ideal": served_span(stats) / ideal,
                "rate_limited": stats["rate_limited"],
                "per_success": stats["rate_limited"] / max(1, stats["completed"]),
            },
        )
    print(json.dumps(result, indent=2))
    print(
        f"\n| W3 | {args.items} items, {args.rpm} rpm (bursts of {burst}), 100 ms per call | ideal {ideal:.1f} s "
        f"| {result['time_over_ideal_median']:.3f} x ideal, {result['per_success_median']:.4f} 429s per success |"
    )


def w4(args, work):
    """A backend that serves K at once and queues the rest (no 429 ever);
    evalfleet with its default adaptive settings."""
    latency = 0.2
    dataset = os.path.join(work, "w4.jsonl")
    write_dataset(dataset, args.items)
    ideal = args.capacity / latency
    # The unloaded latency: one call at a time.
    mock = Mock("--capacity", str(args.capacity), "--latency", "200ms")
    probe = os.path.join(work, "w4-probe.jsonl")
    write_dataset(probe, 50)
    config = os.path.join(work, "w4-probe.yaml")
    write_config(config, probe, mock.url, 1)
    evalfleet(["run", config, "--store", os.path.join(work, "w4-probe.db"), "-q", "--run-id", "probe"], work)
    unloaded = status("probe", os.path.join(work, "w4-probe.db"), work)["endpoints"][0]["latency_ms"]["p50"]
    unloaded_served = mock.stats()["served_p50_ms"]
    mock.stop()
    rounds = []
    for i in range(args.rounds):
        mock = Mock("--capacity", str(args.capacity), "--latency", "200ms")
        config = os.path.join(work, f"w4-{i}.yaml")
        write_config(config, dataset, mock.url, "adaptive")
        db = os.path.join(work, f"w4-{i}.db")
        run = evalfleet(["run", config, "--store", db, "-q", "--run-id", f"w4-{i}"], work)
        stats = mock.stats()
        mock.stop()
        assert run["done"] == args.items, run
        summary = status(f"w4-{i}", db, work)
        limits = [
            int(m.split(" to ")[1].rstrip("."))
            for m in (e["message"] for e in summary["events"] if e["kind"] == "limit")
        ]
        half = limits[len(limits) // 2 :] or limits
        round_ = {
            "items_per_s": run["rate"],
            "throughput_over_ideal": run["rate"] / ideal,
            "p50_ms": summary["endpoints"][0]["latency_ms"]["p50"],
            "p50_over_unloaded": summary["endpoints"][0]["latency_ms"]["p50"] / unloaded,
            "served_p50_ms": stats["served_p50_ms"],
            "served_span_items_per_s": stats["completed"] / served_span(stats),
            "limit_second_half": [min(half), max(half)] if half else None,
            "mock_max_in_flight": stats["max_in_flight"],
            "rate_limited": stats["rate_limited"],
        }
        rounds.append(round_)
        print(json.dumps(round_), file=sys.stderr)
    med = lambda k: statistics.median(r[k] for r in rounds)
    result = {
        "workload": "W4",
        "items": args.items,
        "capacity": args.capacity,
        "latency_ms": latency * 1000,
        "unloaded_p50_ms": unloaded,
        "unloaded_served_p50_ms": unloaded_served,
        "ideal_items_per_s": ideal,
        "throughput_over_ideal_median": med("throughput_over_ideal"),
        "p50_over_unloaded_median": med("p50_over_unloaded"),
        "rounds": rounds,
    }
    if args.peers:
        result["peers"] = run_peers(
            args,
            ["--capacity", str(args.capacity), "--latency", "200ms"],
            dataset,
            work,
            lambda stats: {
                "completed": stats["completed"],
                "items_per_s": stats["completed"] / served_span(stats),
                "throughput_over_ideal": stats["completed"] / served_span(stats) / ideal,
                "served_p50_ms": stats["served_p50_ms"],
                "p50_over_unloaded": stats["served_p50_ms"] / unloaded_served,
                "mock_max_in_flight": stats["max_in_flight"],
                "rate_limited": stats["rate_limited"],
            },
        )
    print(json.dumps(result, indent=2))
    print(
        f"\n| W4 | {args.items} items, K = {args.capacity}, L = 200 ms | ideal {ideal:.0f} items/s, unloaded p50 {unloaded:.0f} ms "
        f"| {100 * result['throughput_over_ideal_median']:.1f}% of K/L, p50 {result['p50_over_unloaded_median']:.2f} x unloaded |"
    )


def w6(args, work):
    """The same run again with every answer in the cache. Reference: the
    first run (W1's work: every item a call to the mock, answers stored and
    cached)."""
    dataset = os.path.join(work, "w6.jsonl")
    write_dataset(dataset, args.items)
    rounds = []
    for i in range(args.rounds):
        by_binary = {}
        for label, binary in binaries(args, i):
            mock = Mock()
            config = os.path.join(work, f"w6-{label}-{i}.yaml")
            write_config(config, dataset, mock.url, args.concurrency)
            with open(config, "a") as f:
                f.write("cache: { mode: read_write }\n")
            db = os.path.join(work, f"w6-{label}-{i}.db")
            first = evalfleet(["run", config, "--store", db, "-q"], work, binary=binary)
            calls = mock.stats()["requests"]
            cached = evalfleet(["run", config, "--store", db, "-q"], work, binary=binary)
            again = mock.stats()["requests"] - calls
            mock.stop()
            assert first["done"] == args.items and cached["done"] == args.items, (first, cached)
            by_binary[label] = {
                "first_items_per_s": first["rate"],
                "cached_items_per_s": cached["rate"],
                "cached_wall_s": cached["wall"],
                "cached_rss_mb": cached["rss_mb"],
                "calls_in_cached_run": again,
            }
        round_ = {**by_binary, **by_binary["new"]}
        rounds.append(round_)
        print(json.dumps(by_binary), file=sys.stderr)
    med = lambda k: statistics.median(r[k] for r in rounds)
    result = {
        "workload": "W6",
        "items": args.items,
        "first_items_per_s_median": med("first_items_per_s"),
        "cached_items_per_s_median": med("cached_items_per_s"),
        **side_by_side(rounds, "cached_items_per_s"),
        **side_by_side(rounds, "first_items_per_s"),
        "rounds": rounds,
    }
    print(json.dumps(result, indent=2))
    print(
        f"\n| W6 | {args.items} items, every answer cached | first run {result['first_items_per_s_median']:.0f} items/s "
        f"| {result['cached_items_per_s_median']:.0f} items/s, {max(r['calls_in_cached_run'] for r in rounds)} calls |"
    )


def j1(args, work):
    """The code judge: HumanEval's 164 canonical solutions, answered by the
    mock and judged in the sandbox, against the same programs run one after
    another with python3; and one stdin/stdout problem with 200 tests against
    running them one by one."""
    import gzip

    source = os.path.join(ROOT, "..", "shared", "data", "humaneval.jsonl.gz")
    problems = [json.loads(line) for line in gzip.open(source, "rt")]
    dataset = os.path.join(work, "humaneval.jsonl")
    answers = os.path.join(work, "answers.jsonl")
    with open(dataset, "w") as d, open(answers, "w") as a:
        for p in problems:
            d.write(json.dumps(p) + "\n")
            a.write(json.dumps({"prompt": p["prompt"], "replies": ["```python\n" + p["canonical_solution"] + "\n```"]}) + "\n")
    # The stdio problem: 200 tests of a program that doubles its input.
    stdio = os.path.join(work, "stdio.jsonl")
    program = "n = int(input())\nprint(2 * n)\n"
    tests = [{"input": f"{i}\n", "output": f"{2 * i}\n"} for i in range(200)]
    with open(stdio, "w") as f:
        f.write(json.dumps({"id": "double", "question": "Double it.", "tests": tests}) + "\n")
    stdio_answers = os.path.join(work, "stdio-answers.jsonl")
    with open(stdio_answers, "w") as f:
        f.write(json.dumps({"prompt": "Double it.", "replies": ["```python\n" + program + "```"]}) + "\n")
    cores = os.cpu_count()

    def serial_humaneval():
        started = time.monotonic()
        for i, p in enumerate(problems):
            path = os.path.join(work, f"serial-{i}.py")
            with open(path, "w") as f:
                f.write(p["prompt"] + p["canonical_solution"] + "\n" + p["test"] + f"\ncheck({p['entry_point']})\n")
            subprocess.run(["/usr/bin/python3", path], check=True, capture_output=True)
        return time.monotonic() - started

    def serial_stdio():
        path = os.path.join(work, "double.py")
        with open(path, "w") as f:
            f.write(program)
        started = time.monotonic()
        for t in tests:
            out = subprocess.run(["/usr/bin/python3", path], input=t["input"], capture_output=True, text=True, check=True)
            assert out.stdout == t["output"]
        return time.monotonic() - started

    def judged(name, data, script, fmt, messages, binary):
        mock = Mock("--answers", script)
        config = os.path.join(work, f"{name}.yaml")
        with open(config, "w") as f:
            f.write(
                f"name: {name}\ndataset: {{ path: {data}, id_field: {'task_id' if fmt == 'humaneval' else 'id'} }}\n"
                f"endpoints:\n  - {{ name: mock, kind: external, base_url: \"{mock.url}\", model: m, concurrency: 16 }}\n"
                f"task:\n  messages: [ {{ role: user, content: \"{messages}\" }} ]\n  params: {{ max_tokens: 1024 }}\n"
                f"  code: {{ format: {fmt} }}\n"
            )
        db = os.path.join(work, f"{name}.db")
        # Not pinned: the judge's programs use every core, as the reference's
        # share does.
        run = evalfleet(["run", config, "--store", db, "-q", "--run-id", name], work, pin=False, binary=binary)
        mock.stop()
        report = subprocess.run([binary, "report", name, "--store", db, "--json", "--out", os.path.join(work, name)], capture_output=True, text=True, check=True)
        summary = json.loads(report.stdout)
        return run, summary

    rounds = []
    for i in range(args.rounds):
        serial = serial_humaneval()
        serial_io = serial_stdio()
        by_binary = {}
        for label, binary in binaries(args, i):
            run, summary = judged(f"he-{label}-{i}", dataset, answers, "humaneval", "{{ prompt }}", binary)
            accepted = summary["code_verdicts"]["all"].get("success", 0)
            io_run, io_summary = judged(f"io-{label}-{i}", stdio, stdio_answers, "stdio", "{{ question }}", binary)
            io_passed = json.loads(subprocess.run([binary, "export", f"io-{label}-{i}", "--store", os.path.join(work, f"io-{label}-{i}.db"), "--format", "jsonl"], capture_output=True, text=True, check=True).stdout)["judge"]["passed"]
            # The whole command's wall time: start-up, the calls, the judge's
            # set-up and every program, as a user waits for it.
            by_binary[label] = {
                "serial_s": serial,
                "evalfleet_s": run["wall"],
                "evalfleet_cpu_s": run["cpu"],
                "ratio_to_serial_over_cores": run["wall"] / (serial / cores),
                "accepted": accepted,
                "stdio_serial_s": serial_io,
                "stdio_evalfleet_s": io_run["wall"],
                "stdio_speedup": serial_io / io_run["wall"],
                "stdio_passed": io_passed,
            }
        round_ = {**by_binary, **by_binary["new"]}
        rounds.append(round_)
        print(json.dumps(by_binary), file=sys.stderr)
    med = lambda k: statistics.median(r[k] for r in rounds)
    result = {
        "workload": "J1",
        "cores": cores,
        "ratio_median": med("ratio_to_serial_over_cores"),
        "stdio_speedup_median": med("stdio_speedup"),
        **side_by_side(rounds, "ratio_to_serial_over_cores"),
        **side_by_side(rounds, "stdio_speedup"),
        "rounds": rounds,
    }
    print(json.dumps(result, indent=2))
    print(
        f"\n| J1 | 164 HumanEval canonical solutions | serial python3 {med('serial_s'):.2f} s / {cores} cores "
        f"| {med('evalfleet_s'):.2f} s, {result['ratio_median']:.2f} x (serial / cores), {min(r['accepted'] for r in rounds)}/164 accepted |"
    )


# Each workload and its default number of items.
WORKLOADS = {
    "w1": (w1, 100_000),
    "w2": (w2, None),
    "w3": (w3, 6000),
    "w4": (w4, 12000),
    "w5": (w5, 1_000_000),
    "w6": (w6, 200_000),
    "j1": (j1, None),
    "startup": (startup, 100),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=list(WORKLOADS))
    parser.add_argument("--rpm", type=int, default=6000, help="W3: the quota")
    parser.add_argument("--capacity", type=int, default=32, help="W4: calls served at once")
    parser.add_argument("--no-build", action="store_true")
    parser.add_argument("--items", type=int)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--n", default="10,50,200,1000", help="W2: concurrency levels")
    parser.add_argument("--waves", type=int, default=20, help="W2: items per concurrency slot")
    parser.add_argument("--keep", action="store_true", help="keep the working directory")
    parser.add_argument("--peers", help="W3, W4: also run inspect-ai and promptfoo installed under this directory")
    parser.add_argument("--baseline", help="W1, W5, W6, J1: another evalfleet binary measured side by side")
    args = parser.parse_args()
    if not args.no_build:
        build()
    raise_fd_limit()
    work = tempfile.mkdtemp(prefix=f"evalfleet-{args.workload}-")
    try:
        run, default_items = WORKLOADS[args.workload]
        args.items = args.items or default_items
        if args.workload == "startup":
            args.rounds = max(args.rounds, 5)
        run(args, work)
    finally:
        if not args.keep:
            subprocess.run(["rm", "-rf", work])
        else:
            print(f"kept {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
