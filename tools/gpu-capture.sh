#!/usr/bin/env bash
# Records what nvidia-smi prints on a real GPU machine, idle and with a
# process holding a known amount of GPU memory, for the telemetry parser's
# tests. Usage: tools/gpu-capture.sh OUTDIR
set -u
out=${1:?OUTDIR}
mkdir -p "$out"
q_gpu=index,uuid,name,memory.used,memory.total,utilization.gpu,utilization.memory,temperature.gpu,power.draw
q_app=gpu_uuid,pid,process_name,used_memory
capture() { # label
  nvidia-smi --query-gpu=$q_gpu --format=csv,noheader,nounits > "$out/$1-gpus.csv" 2>&1
  nvidia-smi --query-gpu=$q_gpu --format=csv > "$out/$1-gpus-units.csv" 2>&1
  nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total --format=csv,noheader,nounits > "$out/$1-gpus-5.csv" 2>&1
  nvidia-smi --query-compute-apps=$q_app --format=csv,noheader,nounits > "$out/$1-apps.csv" 2>&1
  nvidia-smi --query-compute-apps=$q_app --format=csv > "$out/$1-apps-units.csv" 2>&1
  nvidia-smi > "$out/$1-plain.txt" 2>&1
  nvidia-smi -q -x > "$out/$1-q.xml" 2>&1
}
nvidia-smi --version > "$out/version.txt" 2>&1
capture idle
# A process that holds 2048 MiB of GPU memory, through the driver API alone.
python3 "$(dirname "$0")/gpu-hold.py" 2048 12 > "$out/hold.log" 2>&1 &
holder=$!
for i in $(seq 1 40); do grep -q holding "$out/hold.log" && break; sleep 0.25; done
sleep 1
echo "holder pid $holder" > "$out/holder.txt"
capture busy
kill $holder 2>/dev/null; wait $holder 2>/dev/null
sleep 1
capture after
ls -la "$out"
