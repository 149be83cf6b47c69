#!/usr/bin/env bash
# Warm comparison on the Llama-8B 4-bit shape (run on the GPU machine after unpack.sh, from
# .device/run/ next to mlxcel, mlx_lm_bench.py and make_random_model.py): one warm-up run each so
# MLX's CUDA JIT cache is filled, then two measured passes.
set -u
here=$(cd "$(dirname "$0")" && pwd)
M=$HOME/bench-models/llama-8b-4bit
[ -f $M/config.json ] || python3 $here/make_random_model.py make llama-8b $M > /dev/null
IDS=$(python3 -c "print(','.join(str(i*7%1000+10) for i in range(512)))")
fmt='import json,sys; s=json.loads(sys.stdin.read().strip().splitlines()[-1]); print("prefill %.0f decode %.1f" % (s["prefill_tps"], s["decode_tps"]))'
for pass in warmup measured measured; do
  echo -n "$pass mlxcel: "; $here/mlxcel generate --model $M --prompt-ids $IDS --max-new 128 --ignore-eos --stats-json --print-ids --quiet 2>&1 >/dev/null | python3 -c "$fmt"
  echo -n "$pass mlx-lm: "; python3 $here/mlx_lm_bench.py $M --prompt-ids $IDS --max-new 128 2>&1 >/dev/null | python3 -c "$fmt"
done
