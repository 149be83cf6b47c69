#!/usr/bin/env bash
# GPU side-by-side benchmark: mlxcel vs mlx-lm on MLX's CUDA backend (one H200), on random-weight
# checkpoints shaped like Llama-3.1-8B (4-bit) and Qwen3-30B-A3B (4-bit MoE), each tok/s next
# to its bandwidth floor. Procedure: ../shared/device/README.md; details: docs/performance.md.
#
# Here (the CPU machine, with the Rust toolchain):
#   xtask/bench/gpu.sh stage            builds the release mlxcel, fills .device/run/
#   ../shared/device/pack.sh .device    once: .device/a and .device/b (MLX CUDA + mlx-lm)
# Then two device calls back to back:
#   carry [".device/a"]:  mkdir -p $HOME/mlxcel-dev && cp .device/a/libmlx.part0 $HOME/mlxcel-dev/
#   carry [".device/b", ".device/run"]:
#     source .device/b/unpack.sh .device/b && bash .device/run/gpu.sh run all
# `run` takes: all | llama-8b | qwen3-30b-a3b (split when 10 minutes per call is short: the
# models stay in $HOME/bench-models while the machine is warm). Env: RUNS (default 2),
# PROMPT (512), NEW (128). Results: $OUT/gpu_results.{md,json} and per-run logs; the table is
# printed last.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mode=${1:-run}
what=${2:-all}

if [ "$mode" = stage ]; then
  root=$(cd "$here/../.." && pwd)
  # Binaries that record libmlx by name, so LD_LIBRARY_PATH selects the CUDA build on the GPU machine.
  (cd "$root" && MLXCEL_LINK=name cargo build --release -p mlxcel-cli && MLXCEL_LINK=name cargo build --release -p mlxcel-core --example cuda_kernels)
  mkdir -p "$root/.device/run"
  cp "$root/target/release/mlxcel" "$root/target/release/examples/cuda_kernels" "$here/gpu.sh" "$here/gpu_warm_compare.sh" "$here/gpu_probe.sh" "$here/gpu_dist.sh" \
     "$here/mlx_lm_bench.py" "$here/make_random_model.py" \
     "$here/cuda/prefill_probe.py" "$here/make_plan_model.py" "$here/gpu_embed.sh" "$here/st_embed_bench.py" "$here/gpu_serve.sh" "$here/gpu_serve_configs.sh" "$here/gpu_serve_probe.sh" "$here/gpu_serve_model.sh" "$here/same_replies.py" "$here/serve_client.py" "$here/gpu_speculative_ids.sh" "$here/gpu_stream.sh" "$here/stream_gpu.py" "$here/gpu_ab.sh" "$here/gpu_pending.sh" "$here/cuda/ncu_sum.py" "$root/.device/run/"
  # The MoE fixtures (5.5 MB), for gpu_stream.sh fixtures.
  mkdir -p "$root/.device/run/fixtures"
  for f in qwen3_moe qwen3_moe-affine4-g64 mixtral mixtral-affine4-g32 qwen2_moe olmoe; do
    rm -rf "$root/.device/run/fixtures/$f"; cp -r "$root/tests/fixtures/models/$f" "$root/.device/run/fixtures/"
  done
  # The CUDA decode step's test binary and the fixtures it reads (gpu_probe.sh decode).
  test_bin=$(cd "$root" && MLXCEL_LINK=name cargo test --release -p mlxcel-tests --test cuda_decode \
    --no-run --message-format=json 2>/dev/null | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="cuda_decode": print(m["executable"])')
  cp "$test_bin" "$root/.device/run/cuda_decode_test"
  mkdir -p "$root/.device/run/fixtures-decode/models"
  for f in llama-affine4-g32 llama-affine4-g64 llama-affine8-g64 qwen3-affine4-g64 llama qwen2 qwen3 \
           qwen3_moe-affine4-g64 mixtral-affine4-g32 qwen3_moe mixtral; do
    rm -rf "$root/.device/run/fixtures-decode/models/$f"
    cp -r "$root/tests/fixtures/models/$f" "$root/.device/run/fixtures-decode/models/"
  done
  # Plans of the CPU bench's state-space models, built there by make_plan_model.py (gpu_probe.sh ssm).
  mkdir -p "$root/.device/run/plans"
  for m in mamba2 jamba; do
    (cd "$root" && cargo xtask synth-plan $m --bits 4) > "$root/.device/run/plans/$m-4bit.json"
  done
  grep -qx '/.device/' "$root/.git/info/exclude" 2>/dev/null || \
    grep -qx '/.device/' "$root/.gitignore" || echo '/.device/' >> "$root/.git/info/exclude"
  du -sh "$root/.device/run"
  exit 0
fi
[ "$mode" = run ] || { echo "usage: gpu.sh stage | gpu.sh run [all|llama-8b|qwen3-30b-a3b]" >&2; exit 2; }

RUNS=${RUNS:-2}; PROMPT=${PROMPT:-512}; NEW=${NEW:-128}
OUT=${OUT:-$PWD/gpu-bench-out}; mkdir -p "$OUT/logs"
MODELS=${BENCH_MODELS:-$HOME/bench-models}; mkdir -p "$MODELS"
bin=$here/mlxcel
fail() { echo "gpu.sh: $*" >&2; exit 1; }

# Self-checks: the CUDA libmlx.so is the one loaded, MLX sees a GPU, mlx-lm imports.
[ -x "$bin" ] || fail "no $bin: run 'xtask/bench/gpu.sh stage' here and carry .device/run"
case "${LD_LIBRARY_PATH:-}" in *mlxcel-sp*) ;; *) fail "LD_LIBRARY_PATH has no mlxcel-sp: source .device/b/unpack.sh .device/b first";; esac
python3 - <<'PY' || fail "Python mlx/mlx_lm missing or MLX's default device is not the GPU"
import mlx.core as mx, mlx_lm  # noqa: F401
assert mx.default_device() == mx.gpu, mx.default_device()
print("mlx", mx.__version__, "on", mx.default_device())
PY
ldd "$bin" | grep -q "mlxcel-sp/mlx/lib/libmlx.so" || fail "mlxcel does not resolve the CUDA libmlx.so: $(ldd "$bin" | grep libmlx)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>/dev/null || true

bw=$(python3 -c "
import sys; sys.path.insert(0, '$here'); import make_random_model as m
print(round(m.bandwidth_gbps(), 1))")
echo "device copy bandwidth: $bw GB/s"

ids=$(python3 -c "
import random; r = random.Random(7); print(','.join(str(r.randrange(1000, 32000)) for _ in range($PROMPT)))")

shapes=(llama-8b qwen3-30b-a3b)
[ "$what" = all ] || shapes=("$what")
: > "$OUT/rows.jsonl"
for shape in "${shapes[@]}"; do
  model=$MODELS/$shape-4bit
  python3 "$here/make_random_model.py" make "$shape" "$model"
  floor=$(python3 "$here/make_random_model.py" floor "$model" --bandwidth "$bw")
  for r in $(seq 1 "$RUNS"); do
    for engine in mlxcel mlx-lm; do
      tag=$shape-$engine-$r
      if [ $engine = mlxcel ]; then
        "$bin" generate --model "$model" --prompt-ids "$ids" --max-new "$NEW" --print-ids \
          --ignore-eos --stats-json --quiet --force > "$OUT/logs/$tag.out" 2> "$OUT/logs/$tag.err" \
          || fail "$tag failed: $(tail -5 "$OUT/logs/$tag.err")"
      else
        python3 "$here/mlx_lm_bench.py" "$model" --prompt-ids "$ids" --max-new "$NEW" --print-ids \
          > "$OUT/logs/$tag.out" 2> "$OUT/logs/$tag.err" \
          || fail "$tag failed: $(tail -5 "$OUT/logs/$tag.err")"
      fi
      stats=$(grep '^{' "$OUT/logs/$tag.err" | tail -1)
      [ -n "$stats" ] || fail "$tag printed no stats line"
      echo "{\"shape\":\"$shape\",\"engine\":\"$engine\",\"run\":$r,\"floor\":$floor,\"stats\":$stats}" >> "$OUT/rows.jsonl"
      echo "  $tag: $(echo "$stats" | python3 -c 'import json,sys; s=json.load(sys.stdin); print(f"prefill {s[\"prefill_tps\"]:.1f} tok/s, decode {s[\"decode_tps\"]:.1f} tok/s, load {s[\"load_s\"]:.1f}s, {s[\"generated_tokens\"]} tokens")')"
    done
  done
done

python3 - "$OUT" "$NEW" <<'PY'
import json, statistics, sys
out, new = sys.argv[1], int(sys.argv[2])
rows = [json.loads(l) for l in open(f"{out}/rows.jsonl")]
bad = [r for r in rows if r["stats"]["generated_tokens"] != new]
groups = {}
for r in rows:
    groups.setdefault((r["shape"], r["engine"]), []).append(r)
ids = {}
for r in rows:
    tag = f'{r["shape"]}-{r["engine"]}-{r["run"]}'
    ids.setdefault(r["shape"], {})[r["engine"]] = open(f"{out}/logs/{tag}.out").read().strip()
med = lambda g, k: statistics.median(x["stats"][k] for x in g)
lines = ["| model | engine | runs | load s | prefill tok/s | decode tok/s | decode floor tok/s | % of floor | GB/token |",
         "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
summary = []
for (shape, engine), g in groups.items():
    f = g[0]["floor"]
    d = med(g, "decode_tps")
    row = dict(shape=shape, engine=engine, runs=len(g), load_s=med(g, "load_s"),
               prefill_tps=med(g, "prefill_tps"), decode_tps=d, floor_tps=f["decode_floor_tps"],
               bytes_per_token=f["bytes_per_token"], bandwidth_gbps=f["bandwidth_gbps"])
    summary.append(row)
    lines.append(f'| {shape} 4-bit | {engine} | {len(g)} | {row["load_s"]:.1f} | {row["prefill_tps"]:.0f} | '
                 f'{d:.1f} | {f["decode_floor_tps"]:.0f} | {100 * d / f["decode_floor_tps"]:.0f}% | '
                 f'{f["bytes_per_token"] / 1e9:.2f} |')
notes = []
for shape, e in ids.items():
    a, b = e.get("mlxcel", ""), e.get("mlx-lm", "")
    same = 0
    for x, y in zip(a.split(","), b.split(",")):
        if x != y:
            break
        same += 1
    notes.append(f"{shape}: greedy ids agree for {same} of {new} tokens (bf16 on GPU: some drift is expected)")
if rows:
    notes.insert(0, f'device copy bandwidth {rows[0]["floor"]["bandwidth_gbps"]:.0f} GB/s (read+write of a 4 GiB array); '
                    f'floor = bandwidth / weight bytes read per decoded token')
md = "\n".join(lines + [""] + ["- " + n for n in notes])
open(f"{out}/gpu_results.md", "w").write(md + "\n")
json.dump({"rows": summary, "notes": notes}, open(f"{out}/gpu_results.json", "w"), indent=2)
print(md)
if bad:
    sys.exit(f"{len(bad)} run(s) generated the wrong token count")
PY
