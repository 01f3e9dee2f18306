#!/bin/sh
# The bench's engine turns on a real GPU: two models on GPU 0, each engine a
# mock that first holds 8 GiB of GPU memory in its process group (through
# the CUDA driver API, tools/gpu-hold.py), run in turn by `evalfleet bench`. The bench
# must start the second engine only once the first one's memory is back.
#
#   sh bench/gpu_turns.sh BIN OUTDIR
#
# Writes OUTDIR/bench.txt (the bench's own account), OUTDIR/smi.csv (GPU 0's
# memory every 200 ms) and OUTDIR/life-*.log (each mock's own start and exit).
set -u
BIN=$(realpath "$1"); OUT=$(realpath "$2"); mkdir -p "$OUT"
HOLD=$(realpath "$(dirname "$0")/../tools/gpu-hold.py")
WORK=$(mktemp -d); cd "$WORK" || exit 1
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv > "$OUT/gpus.txt" 2>&1
# Each engine first holds 8 GiB of GPU 0 through the CUDA driver API (as a
# model's weights would), and only then starts answering.
HOG="python3 $HOLD 8192 1e6 > hold-MODEL.log 2>&1 & for i in \$(seq 400); do grep -q holding hold-MODEL.log && break; sleep 0.05; done;"
echo "each engine holds 8 GiB of GPU 0 (tools/gpu-hold.py) before it answers" > "$OUT/hog.txt"
python3 - <<'PY'
import json
with open("items.jsonl", "w") as f:
    for i in range(3000):
        f.write(json.dumps({"id": f"i{i}", "question": f"q {i}"}) + "\n")
PY
for m in a b; do
  cat >> models.yaml <<YAML
  - name: $m
    endpoint:
      kind: local
      model: $m
      gpu: "0"
      gpu_memory_threshold_mb: 4096
      command: '$(echo "$HOG" | sed "s/MODEL/$m/g") exec $BIN mock --bind 127.0.0.1:{port} --latency 20ms --life-log $OUT/life-$m.log'
      concurrency: 16
      stop_grace: 10s
      startup_timeout: 120s
YAML
done
{ echo "name: gpu"; echo "models:"; cat models.yaml; cat <<'YAML'
datasets:
  - name: d
    dataset: {path: items.jsonl, id_field: id}
    task: {messages: [{role: user, content: '{{ question }}'}]}
YAML
} > bench.yaml
cp bench.yaml "$OUT/"
( while :; do echo "$(date +%s%3N),$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0)"; sleep 0.2; done ) > "$OUT/smi.csv" 2>&1 &
SMI=$!
"$BIN" bench bench.yaml > "$OUT/bench.txt" 2>&1; echo "rc=$?" >> "$OUT/bench.txt"
"$BIN" bench report gpu --format json >> "$OUT/report.json" 2>&1
kill $SMI
cat "$OUT/hog.txt" "$OUT/bench.txt"; cat "$OUT"/life-*.log
