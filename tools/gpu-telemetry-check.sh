#!/usr/bin/env bash
# Checks resource telemetry on a machine with a real NVIDIA GPU: an ordinary
# `evalfleet run` of a mock config with telemetry on (`gpus: all`), while a
# process holds 2048 MiB of GPU 0's memory through the CUDA driver API, must
# store GPU samples, and `evalfleet report RUN --json` must show the GPU's
# peak memory at or above 2048 MiB, and a `resource_limit` event for the
# 1024 MiB limit. Exit 0 when it does.
#
#   tools/gpu-telemetry-check.sh [EVALFLEET_BINARY]   (default target/release/evalfleet)
set -eu
bin=$(realpath "${1:-target/release/evalfleet}")
work=$(mktemp -d)
holder=
trap 'status=$?; kill $holder 2>/dev/null; wait $holder 2>/dev/null || true; exit $status' EXIT
python3 "$(dirname "$0")/gpu-hold.py" 2048 60 > "$work/hold.log" 2>&1 &
holder=$!
for _ in $(seq 1 80); do grep -q holding "$work/hold.log" && break; sleep 0.25; done
grep -q holding "$work/hold.log" || { echo "the holder did not start:"; cat "$work/hold.log"; exit 1; }
echo "nvidia-smi says: $(nvidia-smi --query-gpu=index,memory.used,memory.total,utilization.gpu --format=csv,noheader)"
for i in $(seq 1 200); do echo "{\"id\": \"i$i\", \"question\": \"question $i\"}"; done > "$work/items.jsonl"
cat > "$work/run.yaml" <<YAML
name: gpu-telemetry-check
dataset: { path: items.jsonl, id_field: id }
endpoints:
  - { name: m, kind: mock, concurrency: 4, mock: { latency: 50ms } }
task:
  messages:
    - { role: user, content: "{{ question }}" }
telemetry:
  interval: 200ms
  gpus: all
  limits: { gpu_memory_mb: 1024 }
YAML
"$bin" run "$work/run.yaml" --store "$work/evalfleet.db" --run-id gpu-check -q
"$bin" report gpu-check --store "$work/evalfleet.db" --out "$work/report" --json > "$work/report.json"
"$bin" status gpu-check --store "$work/evalfleet.db" --json > "$work/status.json"
python3 - "$work/report.json" "$work/status.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))["resources"]
status = json.load(open(sys.argv[2]))
for s in report["series"]:
    print(f'{s["series"]["source"]:9} {s["series"]["name"]:3} {s["series"]["metric"]:20} peak {s["peak"]:10.1f} mean {s["mean"]:10.1f} samples {s["samples"]}')
peak = report["gpu_memory_peak_mb"]
print("gpu_memory_peak_mb:", peak)
limits = [e["message"] for e in status["events"] if e["kind"] == "resource_limit"]
print("resource_limit events:", limits)
ok = peak is not None and peak >= 2048 and len(limits) >= 1
print("OK" if ok else "FAILED")
sys.exit(0 if ok else 1)
PY
