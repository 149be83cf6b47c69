#!/usr/bin/env bash
# Expert streaming on MLX's CUDA backend (issue 28), on the GPU machine (procedure: gpu.sh's
# header; `gpu.sh stage` copies this script, stream_gpu.py and the MoE fixtures).
#
#   gpu_stream.sh fixtures   each MoE fixture's logits with its routed experts streamed (top-k
#                            slots per layer: the most reads; io direct, dontneed, cached)
#                            against resident, bit for bit
#   gpu_stream.sh large      Qwen3-30B-A3B shape, 4-bit (17 GB), routing ROUTING (make_random_model.py
#                            --routing): the disk floor, resident decode (before and after), and
#                            decode with the experts streamed at arenas of 10% and 25% of each
#                            layer's routed experts, direct reads with and without reading ahead
#                            (MLXCEL_EXPERT_PREFETCH); seeded sampling, so every run generates the
#                            same tokens where streamed logits equal resident ones; last, the
#                            logits of a 1-id and a 16-id prompt, streamed against resident
# Env: ROUTING (skewed), PROMPT (32 ids), NEW (128), CONFIGS (share:io:prefetch[:in_place] ...,
# default "0.10:direct:1 0.10:direct:0 0.25:direct:1 0.25:direct:0"; in_place 0 writes the
# slots through MLX's slice_update, MLXCEL_EXPERT_IN_PLACE=0).
# Results: $OUT (default ./gpu-stream-out): logs, rows.jsonl, printed table.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
what=${1:-fixtures}
bin=$here/mlxcel
OUT=${OUT:-$PWD/gpu-stream-out}; mkdir -p "$OUT/logs"
WORK=${WORK:-$HOME/stream-work}; mkdir -p "$WORK"
MODELS=${BENCH_MODELS:-$HOME/bench-models}; mkdir -p "$MODELS"
py() { python3 "$here/stream_gpu.py" "$@"; }
fail() { echo "gpu_stream.sh: $*" >&2; exit 1; }
[ -x "$bin" ] || fail "no $bin (xtask/bench/gpu.sh stage)"

if [ "$what" = fixtures ]; then
  bad=0
  for f in qwen3_moe qwen3_moe-affine4-g64 mixtral mixtral-affine4-g32 qwen2_moe olmoe; do
    d=$WORK/$f; rm -rf "$d"; cp -r "$here/fixtures/$f" "$d"
    "$bin" prepare-expert-stream --model "$d" > "$OUT/logs/$f-prepare.log" 2>&1
    ids=$(py prompt "$d/reference.safetensors")
    read -r arena slots experts <<< "$(py arena "$d" topk)"
    MLXCEL_EXPERT_STREAM=0 "$bin" logits --model "$d" --prompt-ids "$ids" --out "$OUT/$f-resident.npy" \
      > "$OUT/logs/$f-resident.log" 2>&1 || fail "$f resident: $(tail -3 "$OUT/logs/$f-resident.log")"
    for io in direct dontneed cached; do
      log=$OUT/logs/$f-$io.log
      MLXCEL_EXPERT_STREAM=1 MLXCEL_EXPERT_ARENA_BYTES=$arena MLXCEL_EXPERT_IO=$io \
        "$bin" logits --model "$d" --prompt-ids "$ids" --out "$OUT/$f-$io.npy" > "$log" 2>&1 \
        || fail "$f $io: $(tail -3 "$log")"
      grep -q "Expert arena" "$log" || fail "$f $io: no expert arena line in $log"
      if verdict=$(py same "$OUT/$f-resident.npy" "$OUT/$f-$io.npy"); then
        echo "$f: streamed ($slots/$experts slots, io $io) = resident, bit for bit"
      else
        echo "$f: streamed ($slots/$experts slots, io $io) DIFFERS: $verdict"; bad=1
      fi
    done
  done
  exit $bad
fi
[ "$what" = large ] || fail "usage: gpu_stream.sh fixtures | large"

ROUTING=${ROUTING:-skewed}; PROMPT=${PROMPT:-32}; NEW=${NEW:-128}
model=$MODELS/qwen3-30b-a3b-4bit-$ROUTING
python3 "$here/make_random_model.py" make qwen3-30b-a3b "$model" --routing "$ROUTING"
if [ ! -f "$model/expert-stream/manifest.json" ]; then
  t0=$(date +%s); "$bin" prepare-expert-stream --model "$model" > "$OUT/logs/prepare.log" 2>&1 \
    || fail "prepare: $(tail -3 "$OUT/logs/prepare.log")"
  echo "prepared the expert stream in $(( $(date +%s) - t0 )) s"
fi
echo "disk floor (O_DIRECT, 8 MiB pieces): $(py floor "$model" 1) GB/s with 1 thread, $(py floor "$model" 4) GB/s with 4"
ids=$(python3 -c "
import random; r = random.Random(7); print(','.join(str(r.randrange(1000, 32000)) for _ in range($PROMPT)))")
: > "$OUT/rows.jsonl"
run() {  # label, then env assignments
  local label=$1; shift
  env "$@" "$bin" generate --model "$model" --prompt-ids "$ids" --max-new "$NEW" --print-ids \
    --ignore-eos --stats-json --temperature 1 --seed 1 --force \
    > "$OUT/logs/$label.out" 2> "$OUT/logs/$label.err" || fail "$label: $(tail -3 "$OUT/logs/$label.err")"
  local json; json=$(grep '^{"' "$OUT/logs/$label.err" | tail -1)
  echo "{\"label\":\"$label\",\"stats\":$json}" >> "$OUT/rows.jsonl"
  echo "$label: $(python3 -c "
import json, sys; s = json.loads(sys.argv[1]); e = s.get('expert_stream') or {}
print(f\"load {s['load_s']:.2f} s, prefill {s['prefill_tps']:.1f} tok/s, decode {s['decode_tps']:.2f} tok/s\"
      + (f\", {e['slots_per_layer']} slots, hit rate {100 * e['hit_rate']:.1f}%, {e['bytes_read'] / 2**30:.2f} GiB read in {e['read_s']:.2f} s ({e['read_gbps']:.2f} GB/s, io {e['io']}), reuse {100 * e['reuse']:.1f}%, top-10% share {100 * e['top_decile_share']:.1f}%\" if e else ''))
" "$json")"
}
MLXCEL_EXPERT_STREAM=0 "$bin" generate --model "$model" --prompt-ids "$ids" --max-new 4 --force --quiet \
  > /dev/null 2>&1 || true  # warm-up: kernel caches and the page cache of the checkpoint
run resident-before MLXCEL_EXPERT_STREAM=0
for c in ${CONFIGS:-0.10:direct:1 0.10:direct:0 0.25:direct:1 0.25:direct:0}; do
  IFS=: read -r share io ahead in_place <<< "$c"
  in_place=${in_place:-1}
  read -r arena slots experts <<< "$(py arena "$model" "$share")"
  run "stream-$share-$io-ahead$ahead$([ "$in_place" = 1 ] || echo -slice-update)" \
    MLXCEL_EXPERT_STREAM=1 MLXCEL_EXPERT_ARENA_BYTES="$arena" \
    MLXCEL_EXPERT_IO="$io" MLXCEL_EXPERT_PREFETCH="$ahead" MLXCEL_EXPERT_IN_PLACE="$in_place"
done
run resident-after MLXCEL_EXPERT_STREAM=0
for f in "$OUT"/logs/resident-before.out "$OUT"/logs/stream-*.out; do
  cmp -s "$f" "$OUT/logs/resident-after.out" || echo "NOTE: $(basename "$f" .out) generated other ids than resident-after"
done
# Streamed against resident logits on this model (bf16): a 1-id prompt (a decode-shaped pass:
# one row, top-k experts) and 16 ids (sorted gathers, several rows per expert).
read -r arena slots experts <<< "$(py arena "$model" 0.25)"
for n in 1 16; do
  few=$(echo "$ids" | cut -d, -f1-$n)
  MLXCEL_EXPERT_STREAM=0 "$bin" logits --model "$model" --prompt-ids "$few" --out "$OUT/large-$n-resident.npy" > /dev/null 2>&1
  MLXCEL_EXPERT_STREAM=1 MLXCEL_EXPERT_ARENA_BYTES=$arena "$bin" logits --model "$model" \
    --prompt-ids "$few" --out "$OUT/large-$n-streamed.npy" > /dev/null 2>&1
  if verdict=$(py same "$OUT/large-$n-resident.npy" "$OUT/large-$n-streamed.npy"); then
    echo "logits of a $n-id prompt: streamed = resident, bit for bit"
  else
    echo "logits of a $n-id prompt: streamed differs from resident: $verdict"
  fi
done
