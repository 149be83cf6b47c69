#!/usr/bin/env bash
# Where a batched serving step's time goes, on the GPU machine: one server at a time per
# configuration (`bash gpu_serve_probe.sh "ENV=V ..." ...`), 8 clients at 128 and 512 new tokens
# (a longer generation dilutes the joins and prefills), then the server's batching counters.
# Builds the model gpu_serve.sh uses when it is missing.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp}
model=$HOME/bench-models/llama-8b-4bit-v49k
if [ ! -f "$model/tokenizer.json" ]; then
  [ -f "$here/tokenizer.json" ] || xz -dkf "$here/tokenizer.json.xz"
  python3 "$here/make_random_model.py" make llama-8b "$model" --vocab 49152 >/dev/null
  cp "$here/tokenizer.json" "$here/tokenizer_config.json" "$model/"
  python3 - "$model/config.json" <<'PY'
import json, sys
p = sys.argv[1]
c = json.load(open(p))
c.update(bos_token_id=1, eos_token_id=2)
json.dump(c, open(p, "w"), indent=1)
PY
fi
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
