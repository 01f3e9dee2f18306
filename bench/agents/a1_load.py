"""A1's "agent": a load generator run as an exec task's item (with
`task.network: open`). It sends the same request stream twice, with the
same client (wrk, one thread), once to the mock's own address (`direct`)
and once through the item's gateway address ($OPENAI_BASE_URL), in the
order the item gives, and prints each arm's latency figures as JSON.

The item: {"concurrency": N, "seconds": S, "warmup": W, "body": {...},
"direct": "http://127.0.0.1:PORT/v1", "order": ["direct", "gateway"],
"lua": "/path/a1_post.lua"}. Standard library only.
"""

import json
import os
import subprocess
import sys


def busy():
    """The machine's busy and total jiffies so far (every core)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def wrk(url, item, seconds):
    env = dict(os.environ, A1_BODY=json.dumps(item["body"]))
    cmd = ["wrk", "-t1", f"-c{item['concurrency']}", f"-d{int(seconds)}s", "--timeout", "30s", "-s", item["lua"], url + "/chat/completions"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"wrk failed ({proc.returncode}): {proc.stderr[-1000:]} {proc.stdout[-1000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    item = json.load(sys.stdin)
    urls = {"direct": item["direct"], "gateway": os.environ["OPENAI_BASE_URL"]}
    out = {}
    for arm in item["order"]:
        if item.get("warmup"):
            wrk(urls[arm], item, item["warmup"])
        b0, t0 = busy()
        figures = wrk(urls[arm], item, item["seconds"])
        b1, t1 = busy()
        figures["machine_busy"] = (b1 - b0) / max(1, t1 - t0)
        out[arm] = figures
    print(json.dumps(out))


if __name__ == "__main__":
    main()
