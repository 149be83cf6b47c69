#!/usr/bin/env bash
# Tensor parallelism on the 2×H200 machine (nvidia-h200-x2) over MLX's NCCL backend: TP=1
# (`mlxcel generate`) against TP=2 (`mlxcel launch --nproc 2 --backend nccl -- generate ...`)
# on the same random-weight checkpoints as gpu.sh (Llama-3.1-8B and Qwen3-30B-A3B shapes,
# affine 4-bit g64), then a Llama-3.1-70B-shaped bf16 model (~141 GB: more than one H200) that
# only runs across both GPUs, its weights made on each GPU by the rank that holds them
# (`--random-weights`, a header-only sparse checkpoint: the disk cannot hold it).
#
# Staging and the device calls are gpu.sh's (`xtask/bench/gpu.sh stage` copies this script
# into .device/run); on the GPU machine, after `source .device/b/unpack.sh .device/b`:
#   bash .device/run/gpu_dist.sh [all|llama-8b|qwen3-30b-a3b|llama-70b]
# Env: RUNS (default 2), PROMPT (512), NEW (128), BACKEND (nccl), MODES ("tensor"; add
# "pipeline" to measure pipeline parallelism too). Each process generates twice (`--repeat 2`:
# first request, then steady state; the table reports the second). Per-GPU memory is the
# largest `nvidia-smi` memory.used seen during the run (polled every 200 ms), next to the
# process's own MLX peak (rank 0). Results: $OUT/dist_results.{md,jsonl} and logs.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
what=${1:-all}
RUNS=${RUNS:-2}; PROMPT=${PROMPT:-512}; NEW=${NEW:-128}; BACKEND=${BACKEND:-nccl}
MODES=${MODES:-tensor}
OUT=${OUT:-$PWD/gpu-dist-out}; mkdir -p "$OUT/logs"
MODELS=${BENCH_MODELS:-$HOME/bench-models}; mkdir -p "$MODELS"
bin=$here/mlxcel
fail() { echo "gpu_dist.sh: $*" >&2; exit 1; }

[ -x "$bin" ] || fail "no $bin: run 'xtask/bench/gpu.sh stage' here and carry .device/run"
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
[ "$gpus" -ge 2 ] || fail "needs 2 GPUs, nvidia-smi lists $gpus"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>/dev/null || true
ids=$(python3 -c "
import random; r = random.Random(7); print(','.join(str(r.randrange(1000, 32000)) for _ in range($PROMPT)))")

# Largest memory.used per GPU (MiB) while "$@" runs, written to $1.mem as "gpu0,gpu1".
with_memory() {
  local tag=$1; shift
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/logs/$tag.smi" 2>/dev/null &
  local smi=$!
  "$@"; local rc=$?
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
  python3 - "$OUT/logs/$tag.smi" > "$OUT/logs/$tag.mem" <<'PY'
import sys
peak = {}
for line in open(sys.argv[1]):
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 2 and parts[1].isdigit():
        peak[parts[0]] = max(peak.get(parts[0], 0), int(parts[1]))
print(",".join(str(peak.get(str(i), 0)) for i in range(2)))
PY
  return $rc
}

# One configuration: tp (1 or 2), mode, model, tag, extra generate flags.
run() {
  local tp=$1 mode=$2 model=$3 tag=$4; shift 4
  local gen=(generate --model "$model" --prompt-ids "$ids" --max-new "$NEW" --print-ids --ignore-eos
             --stats-json --quiet --force --repeat 2 "$@")
  if [ "$tp" = 1 ]; then
    with_memory "$tag" env CUDA_VISIBLE_DEVICES=0 "$bin" "${gen[@]}" > "$OUT/logs/$tag.out" 2> "$OUT/logs/$tag.err"
  else
    with_memory "$tag" "$bin" launch --nproc "$tp" --backend "$BACKEND" --mode "$mode" -- "${gen[@]}" \
      > "$OUT/logs/$tag.out" 2> "$OUT/logs/$tag.err"
  fi || { echo "  $tag failed: $(tail -3 "$OUT/logs/$tag.err")"; return 1; }
  local stats; stats=$(grep '^{' "$OUT/logs/$tag.err" | tail -1)
  [ -n "$stats" ] || { echo "  $tag printed no stats line"; return 1; }
  local mem; mem=$(cat "$OUT/logs/$tag.mem")
  echo "{\"tag\":\"$tag\",\"tp\":$tp,\"mode\":\"$mode\",\"gpu_mib\":[$mem],\"stats\":$stats}" >> "$OUT/dist_results.jsonl"
  echo "  $tag: $(echo "$stats" | python3 -c 'import json,sys; s=json.load(sys.stdin); print(f"prefill {s[\"prefill_tps\"]:.1f} tok/s, decode {s[\"decode_tps\"]:.1f} tok/s, load {s[\"load_s\"]:.1f}s")'), GPU memory used (MiB) $mem"
}

shapes=(llama-8b qwen3-30b-a3b llama-70b)
[ "$what" = all ] || shapes=("$what")
: > "$OUT/dist_results.jsonl"
for shape in "${shapes[@]}"; do
  if [ "$shape" = llama-70b ]; then
    model=$MODELS/llama-70b-bf16-sparse
    python3 "$here/make_random_model.py" make llama-70b "$model" --dense --sparse
    echo "$shape (bf16, random weights made per rank)"
    # TP=1 cannot hold it: the memory check refuses it (recorded, not measured).
    env CUDA_VISIBLE_DEVICES=0 "$bin" generate --model "$model" --prompt-ids 1,2,3 --max-new 1 \
      --random-weights 1 > /dev/null 2> "$OUT/logs/$shape-tp1.err" \
      && echo "  $shape-tp1: unexpectedly ran" || echo "  $shape-tp1: $(tail -1 "$OUT/logs/$shape-tp1.err")"
    for mode in $MODES; do
      for r in $(seq 1 "$RUNS"); do
        run 2 "$mode" "$model" "$shape-$mode-tp2-$r" --random-weights 1
      done
    done
    continue
  fi
  model=$MODELS/$shape-4bit
  python3 "$here/make_random_model.py" make "$shape" "$model" || fail "making $model"
  echo "$shape (4-bit)"
  for r in $(seq 1 "$RUNS"); do
    run 1 tensor "$model" "$shape-tp1-$r"
    for mode in $MODES; do run 2 "$mode" "$model" "$shape-$mode-tp2-$r"; done
  done
done

python3 - "$OUT" <<'PY'
import json, statistics, sys
out = sys.argv[1]
rows = [json.loads(l) for l in open(f"{out}/dist_results.jsonl")]
groups = {}
for r in rows:
    key = r["tag"].rsplit("-", 1)[0]
    groups.setdefault(key, []).append(r)
lines = ["| run | ranks | prefill tok/s | decode tok/s | load s | GPU0 MiB | GPU1 MiB | MLX peak (rank 0) GiB |",
         "|---|---:|---:|---:|---:|---:|---:|---:|"]
base = {}
for key, g in groups.items():
    med = lambda k: statistics.median(x["stats"][k] for x in g)
    mem = [max(x["gpu_mib"][i] for x in g) for i in range(2)]
    peak = max(x["stats"].get("peak_mlx_bytes", 0) for x in g) / 2**30
    shape = key.split("-tp")[0].replace("-tensor", "").replace("-pipeline", "")
    d, p = med("decode_tps"), med("prefill_tps")
    if g[0]["tp"] == 1:
        base[shape] = (d, p)
    speed = ""
    if g[0]["tp"] > 1 and shape in base:
        speed = f' (×{d / base[shape][0]:.2f} decode, ×{p / base[shape][1]:.2f} prefill)'
    lines.append(f'| {key}{speed} | {g[0]["tp"]} | {p:.0f} | {d:.1f} | {med("load_s"):.1f} | {mem[0]} | {mem[1]} | {peak:.1f} |')
md = "\n".join(lines)
open(f"{out}/dist_results.md", "w").write(md + "\n")
print(md)
PY
