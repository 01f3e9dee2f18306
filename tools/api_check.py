#!/usr/bin/env python3
"""Checks the HTTP API as a client that knows only its OpenAPI document:
serves a store with two finished runs (the quickstart, twice) with the
built binary, validates the document (openapi-spec-validator), then lets
schemathesis generate requests for every operation and check that none
gets a server error and every response keeps to the document (status,
content type, body schema, the event stream's events).

    python3 tools/api_check.py [--bin target/debug/evalfleet] [--venv DIR] [--examples N]

Needs schemathesis and openapi-spec-validator from PyPI; with --venv DIR
(default /tmp/evalfleet-api-check) they are installed there first. The
server runs read-only, so that generated requests start no runs. Exit 0
when both pass.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tools(venv):
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", "schemathesis", "openapi-spec-validator"], check=True)
    return os.path.join(venv, "bin")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")
    parser.add_argument("--bin", default=os.path.join(target, "debug", "evalfleet"))
    parser.add_argument("--venv", default="/tmp/evalfleet-api-check")
    parser.add_argument("--examples", type=int, default=30, help="schemathesis examples per operation")
    args = parser.parse_args()
    bins = tools(args.venv)
    work = tempfile.mkdtemp(prefix="evalfleet-api-")
    server = None
    try:
        shutil.copytree(os.path.join(ROOT, "examples"), os.path.join(work, "examples"))
        store = os.path.join(work, "store.db")
        for run_id in ("quickstart-a", "quickstart-b"):
            subprocess.run([args.bin, "run", "examples/quickstart.yaml", "--store", store, "-q", "--run-id", run_id],
                           cwd=work, check=True, stdout=subprocess.DEVNULL)
        server = subprocess.Popen([args.bin, "serve", "--bind", "127.0.0.1:0", "--store", store, "--read-only"],
                                  cwd=work, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        base = server.stdout.readline().strip()
        document = os.path.join(work, "openapi.json")
        with urllib.request.urlopen(f"{base}/api/openapi.json") as response, open(document, "wb") as out:
            out.write(response.read())
        subprocess.run([os.path.join(bins, "openapi-spec-validator"), document], check=True)
        result = subprocess.run([
            os.path.join(bins, "schemathesis"), "run", f"{base}/api/openapi.json", "--url", f"{base}/api/v1",
            "-n", str(args.examples),
            # Valid by the schema but refused by rules it cannot say (a run
            # id that does not exist, a comma list of states): not a fault.
            "--exclude-checks", "positive_data_acceptance",
        ], cwd=work)
        return result.returncode
    finally:
        if server:
            server.terminate()
            server.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
