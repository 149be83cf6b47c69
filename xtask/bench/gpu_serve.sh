#!/usr/bin/env bash
# GPU serving throughput: `mlxcel serve` against `mlx_lm.server` on one H200 (both batch
# concurrent requests), 1 and 8 concurrent greedy chat clients, on a random Llama-3.1-8B-shaped
# 4-bit checkpoint paired with SmolLM2's tokenizer (vocabulary 49152).
# Here: `xtask/bench/gpu.sh stage`, then copy SmolLM2's tokenizer.json (or an xz of it) and
# tokenizer_config.json into .device/run/ (gpu_serve_model.sh makes the model from them).
# On the GPU machine (after unpack.sh):
#   bash .device/run/gpu_serve.sh      (results: $OUT/serve.md and the server logs)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp}
model=$(bash "$here/gpu_serve_model.sh")
"$here/mlxcel" serve --model "$model" --port 8101 --parallel 8 >"$out/serve-mlxcel.log" 2>&1 &
ours=$!
python3 -m mlx_lm server --model "$model" --port 8102 --decode-concurrency 8 \
  --log-level WARNING >"$out/serve-mlx_lm.log" 2>&1 &
theirs=$!
trap 'kill $ours $theirs 2>/dev/null || true' EXIT
for port in 8101 8102; do
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    sleep 1
  done
done
python3 "$here/serve_client.py" mlxcel 8101 mlx_lm.server 8102 --runs "${RUNS:-2}" \
  --clients "${CLIENTS:-1,8}" | tee "$out/serve.md"
