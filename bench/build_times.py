#!/usr/bin/env python3
"""B1: what building and testing evalfleet costs on this machine.

For each commit given (the newest first; an older one is the reference,
measured in the same session), in a fresh clone with a target directory of
its own and the crates already downloaded (~/.cargo):

  first       the README's first command: `cargo run --release -- run
              examples/quickstart.yaml`, from nothing built
  reports     an incremental release build after a one-line change in the
              reports (a `pub const` added to the reports crate's lib.rs;
              before the split, core's report/mod.rs)
  fleet       the same after a one-line change in the fleet (the fleet's
              lib.rs; before, core's fleet/mod.rs)
  tests       the README's second command, `tools/test` (--tests), after
              the first: a debug build and the whole suite
  size        the release binary's size, and target/'s

    python3 bench/build_times.py [--commits HEAD,db03f63] [--tests] [--keep]

Run it on an idle machine: each figure is one measurement, and the machine's
other work shows in it. Prints a JSON line per commit and a Markdown table.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Where a one-line change goes, for each layout: the split crates, then the
# single core crate before them.
TOUCH = {
    "reports": ["crates/evalfleet-reports/src/lib.rs", "crates/evalfleet-core/src/report/mod.rs"],
    "fleet": ["crates/evalfleet-fleet/src/lib.rs", "crates/evalfleet-core/src/fleet/mod.rs"],
}


def timed(cmd, cwd, env, log):
    start = time.monotonic()
    with open(log, "ab") as out:
        rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    return rc, time.monotonic() - start


def du(path):
    out = subprocess.run(["du", "-sb", path], capture_output=True, text=True).stdout
    return int(out.split()[0]) if out else 0


def measure(commit, tests, keep):
    work = tempfile.mkdtemp(prefix="evalfleet-b1-")
    # Some tests run the binary as another user, who must reach it.
    os.chmod(work, 0o755)
    # ../shared beside the clone, as the repository expects it.
    shared = os.path.join(os.path.dirname(ROOT), "shared")
    clone = os.path.join(work, "main")
    if os.path.isdir(shared):
        os.symlink(shared, os.path.join(work, "shared"))
    subprocess.run(["git", "clone", "-q", ROOT, clone], check=True)
    subprocess.run(["git", "checkout", "-q", commit], cwd=clone, check=True)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone,
                         capture_output=True, text=True).stdout.strip()
    env = dict(os.environ)
    env.pop("CARGO_TARGET_DIR", None)
    env.pop("CI", None)
    log = os.path.join(work, "log.txt")
    row = {"commit": sha}
    rc, secs = timed(["cargo", "run", "--release", "--", "run", "examples/quickstart.yaml"], clone, env, log)
    row["first_s"], row["first_rc"] = round(secs, 1), rc
    binary = os.path.join(clone, "target", "release", "evalfleet")
    row["binary_mb"] = round(os.path.getsize(binary) / 1e6, 1) if os.path.exists(binary) else None
    for what, paths in TOUCH.items():
        path = next((p for p in paths if os.path.exists(os.path.join(clone, p))), None)
        with open(os.path.join(clone, path), "a") as f:
            f.write(f"pub const B1_CHANGE_{what.upper()}: u32 = 1;\n")
        # As a user builds again after a change: the README's command (with
        # the whole workspace's features; `-p evalfleet` would build the
        # mock crate with other features, and everything above it again).
        rc, secs = timed(["cargo", "run", "--release", "--", "--version"], clone, env, log)
        row[f"{what}_s"], row[f"{what}_rc"] = round(secs, 1), rc
    row["target_release_gb"] = round(du(os.path.join(clone, "target")) / 1e9, 2)
    if tests:
        rc, secs = timed(["tools/test"], clone, env, log)
        row["tests_s"], row["tests_rc"] = round(secs, 1), rc
        row["target_gb"] = round(du(os.path.join(clone, "target")) / 1e9, 2)
    row["log"] = log
    if not keep:
        # The log stays for a look; the clone and its target go.
        shutil.rmtree(clone, ignore_errors=True)
    return row


def minutes(secs):
    if secs is None:
        return "-"
    return f"{int(secs // 60)} min {secs % 60:04.1f} s" if secs >= 60 else f"{secs:.1f} s"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commits", default="HEAD", help="commits to measure, comma-separated")
    parser.add_argument("--tests", action="store_true", help="also time tools/test")
    parser.add_argument("--keep", action="store_true", help="keep the clones")
    args = parser.parse_args()
    rows = []
    for commit in args.commits.split(","):
        row = measure(commit, args.tests, args.keep)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("| commit | first command | after a line in reports | after a line in the fleet | tools/test | binary | target/ |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['commit']} | {minutes(r['first_s'])} | {minutes(r['reports_s'])} | {minutes(r['fleet_s'])} "
              f"| {minutes(r.get('tests_s'))} | {r['binary_mb']} MB | {r.get('target_gb', r['target_release_gb'])} GB |")
    return 0 if all(r["first_rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
