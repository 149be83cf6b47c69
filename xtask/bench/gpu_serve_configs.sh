#!/usr/bin/env bash
# Two mlxcel serve configurations side by side on the GPU machine (the model is
# gpu_serve_model.sh's, made when missing): `bash gpu_serve_configs.sh "ENV=V ..." "ENV=V ..."`,
# 1 and 8 clients, runs alternating between the two servers.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp}
model=$(bash "$here/gpu_serve_model.sh")
env ${1:-MLXCEL_NOTHING=1} "$here/mlxcel" serve --model "$model" --port 8103 --parallel 8 >"$out/serve-a.log" 2>&1 &
a=$!
env ${2:-MLXCEL_NOTHING=1} "$here/mlxcel" serve --model "$model" --port 8104 --parallel 8 >"$out/serve-b.log" 2>&1 &
b=$!
trap 'kill $a $b 2>/dev/null || true' EXIT
for port in 8103 8104; do
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    sleep 1
  done
done
[ -n "${SAME:-}" ] && python3 "$here/same_replies.py" 8103 8104
python3 "$here/serve_client.py" "${1:-default}" 8103 "${2:-default}" 8104 --runs "${RUNS:-2}" \
  --clients "${CLIENTS:-1,8}" | tail -6
