#!/usr/bin/env bash
# Decode cost of runtime (unfused) LoRA adapters on the CPU: SmolLM2-135M 4-bit (from
# `cargo xtask fetch-models`) with and without a deterministic random rank-16 adapter on every
# attention and MLP projection (xtask/bench/make_lora.py; over a quantized base `--adapter` stays
# unfused), fresh process per run, runs alternating, medians of decode tok/s and of the ratios
# of adjacent runs.
#
#   xtask/bench/lora_overhead.sh [RUNS=5] [NEW=128] [PROMPT=128]
#
# Needs a release build (`cargo build --release -p mlxcel-cli`) and a Python with numpy
# (PYTHON, default target/bench/venv/bin/python, else python3).
set -euo pipefail
runs=${1:-5}
new=${2:-128}
prompt=${3:-128}
root=$(cd "$(dirname "$0")/../.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
bin=$target/release/mlxcel
model=${MODEL:-$HOME/.cache/mlxcel/models/SmolLM2-135M-Instruct-4bit}
py=${PYTHON:-$target/bench/venv/bin/python}
[ -x "$py" ] || py=python3
adapter=$target/bench/lora16-$(basename "$model")
[ -f "$adapter/adapters.safetensors" ] || "$py" "$root/xtask/bench/make_lora.py" "$model" "$adapter" --rank 16
ids=$(python3 -c "import random; r=random.Random(0); print(','.join(str(r.randrange(1000, 32000)) for _ in range($prompt)))")
run() {
    "$bin" generate --model "$model" "$@" --quiet --print-ids --ignore-eos --stats-json --force \
        --prompt-ids "$ids" --max-new "$new" 2>&1 >/dev/null | tail -1 |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["decode_tps"])'
}
base=() lora=()
for _ in $(seq "$runs"); do
    base+=("$(run)")
    lora+=("$(run --adapter "$adapter")")
done
python3 - "$runs" "${base[@]}" "${lora[@]}" <<'PY'
import statistics, sys
n = int(sys.argv[1])
base = [float(v) for v in sys.argv[2:2 + n]]
lora = [float(v) for v in sys.argv[2 + n:]]
mb, ml = statistics.median(base), statistics.median(lora)
print("base decode tok/s:", " ".join(f"{v:.2f}" for v in base), f"median {mb:.2f}")
print("rank-16 runtime adapter:", " ".join(f"{v:.2f}" for v in lora), f"median {ml:.2f}")
print(f"adapter / base, medians: {ml / mb:.3f} ({(1 - ml / mb) * 100:+.1f}% slower)")
# Adjacent runs share the machine's momentary load: the median of their ratios is the steadier
# figure on a shared machine.
pairs = statistics.median(l / b for b, l in zip(base, lora))
print(f"adapter / base, median of adjacent pairs: {pairs:.3f} ({(1 - pairs) * 100:+.1f}% slower)")
PY
