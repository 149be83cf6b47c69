#!/usr/bin/env bash
# Where a batched serving step's time goes, on the GPU machine: one server at a time per
# configuration (`bash gpu_serve_probe.sh "ENV=V ..." ...`), 8 clients at 128 and 512 new tokens
# (a longer generation dilutes the joins and prefills), then the server's batching counters.
# The model is gpu_serve_model.sh's (made when missing).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp}
model=$(bash "$here/gpu_serve_model.sh")
for cfg in "$@"; do
  env $cfg "$here/mlxcel" serve --model "$model" --port 8105 --parallel 8 >"$out/probe-serve.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 300); do
    curl -sf http://127.0.0.1:8105/health >/dev/null 2>&1 && break
    sleep 1
  done
  echo "## $cfg"
  for n in ${TOKENS:-128 512}; do
    python3 "$here/serve_client.py" "$cfg" 8105 "$cfg" 8105 --runs 1 --clients "${CLIENTS:-1,8}" --max-tokens "$n" | grep -E "^\| [0-9]" | sed "s/^/max_tokens $n: /"
  done
  curl -s http://127.0.0.1:8105/metrics | grep -E "^mlxcel_(decode|last|completion|prompt)"
  kill $pid
  wait $pid 2>/dev/null || true
done
