#!/usr/bin/env bash
# Kernel-level and warm end-to-end probes on the GPU machine (after unpack.sh; staged into
# .device/run by `gpu.sh stage`):
#   gpu_probe.sh kernels     the cuda_kernels example (mlxcel's CUDA dequantize and GEMV against
#                            MLX's) and prefill_probe.py (quantized vs dequantize+dense matmuls)
#   gpu_probe.sh all         kernels check, llama-8b configurations, bf16 and MoE shapes
#   gpu_probe.sh graphs      MLX CUDA-graph batching settings (and decode host vs device time)
#   gpu_probe.sh llama-8b    warm mlxcel configurations vs mlx-lm on the 8B 4-bit shape
#   gpu_probe.sh llama-8b-bf16   the same on the unquantized bf16 8B shape
#   gpu_probe.sh qwen3-30b-a3b   the same on the 30B-A3B MoE shape (4-bit)
#   gpu_probe.sh fold        the kernel checks, then the 8B 4-bit shape with the GEMV's folded
#                            ops on and off (greedy ids of both), then speed against mlx-lm
#   gpu_probe.sh mma         the tensor-core batch GEMV (MLXCEL_CUDA_QMV_MMA): its check against
#                            MLX's quantized matmul, then timings against the one-row kernel
#                            per row and MLX (cuda_kernels --mma)
#   gpu_probe.sh speculative the 8B 4-bit shape decoding plainly and with an early-exit draft
#                            of itself (its first EARLY=4 layers, `mlxcel convert --early-exit`)
#                            proposing 2 and 4 tokens a round, against mlx-lm plain and with the
#                            same draft; on the random model and on ones whose later layers are
#                            damped so the draft agrees more often (DAMPS, make_random_model.py)
#   gpu_probe.sh decode      the CUDA decode step (MLXCEL_CUDA_DECODE): its test against the MLX
#                            graph on the quantized llama/qwen3 fixtures (the cuda_decode test
#                            binary, staged with its fixtures), then the 8B 4-bit shape's greedy
#                            ids with the step on and off, then speed against mlx-lm
#   gpu_probe.sh moe         the CUDA decode step's routed-expert layers: the decode test (its
#                            MoE fixtures included), then the 30B-A3B 4-bit shape's greedy ids
#                            with the step on and off, then speed against mlx-lm (moe-shape:
#                            without the test; GRAPH=0: without the MLX graph's speed)
#   gpu_probe.sh gather      MoE prefill's routed-expert product (MLXCEL_CUDA_GATHER): its check
#                            and timings (cuda_kernels --gather), then the 30B-A3B 4-bit shape's
#                            greedy ids with it on and off, then speed against mlx-lm
#   gpu_probe.sh load        checkpoint tensors read into device memory (MLXCEL_CUDA_LOAD): the
#                            cuda_decode test of bit-equal models, then load time, first request
#                            and steady state with it on and off against mlx-lm (SHAPES)
#   gpu_probe.sh tc          the CUDA decode step's tensor-core GEMVs (MLXCEL_CUDA_DECODE_TC): the
#                            decode test on its fixtures, then the 8B 4-bit shape's greedy ids
#                            with them on and off, then speed by launch shape (TC_SHAPES) against
#                            mlx-lm
#   gpu_probe.sh gemv        the CUDA decode step's float GEMV launch shapes
#                            (MLXCEL_CUDA_DECODE_GEMV, GEMV_SHAPES: "rms,res,glu" each NWxRPW[:B])
#                            on SHAPE (default the 8B 4-bit shape): decode tok/s of each (one
#                            process, two requests) and an md5 of its greedy ids (rows per block
#                            and register caps change no arithmetic, so those lines' ids should
#                            match; warps per block change the order of a block's sums)
#   gpu_probe.sh fresh       a machine's first process per shape (SHAPES, default the 8B 4-bit and
#                            bf16 ones; CLEAR=1 deletes every kernel cache first): which of
#                            mlxcel's CUDA kernels it compiles and how long each takes
#                            (MLXCEL_KERNEL_LOG), its load and first-request speed, the files in
#                            MLX's JIT cache; then the kernel caches on disk
#   gpu_probe.sh ssm         the CPU bench's Mamba-2- and Jamba-shaped 4-bit models, built from
#                            plans/{mamba2,jamba}-4bit.json (`cargo xtask synth-plan mamba2
#                            --bits 4 > .device/run/plans/mamba2-4bit.json`, likewise jamba)
# Each engine runs once to fill MLX's kernel cache, then RUNS (default 2) measured passes;
# prompt 512 ids, 128 new tokens, EOS ignored. Every process, of either engine, starts with the
# model's files just read into the page cache (docs/performance.md's Method: load-to-ready is
# measured from the page cache), so that neither loads from disk what the other's process left
# in memory, whichever runs first after another shape's processes. Every process generates twice (`--repeat 2`):
# run 1 pays first-use costs in the process (GPU kernel modules, first touch of the weights),
# run 2 shows the steady state a server sees.
set -u
here=$(cd "$(dirname "$0")" && pwd)
what=${1:-kernels}
RUNS=${RUNS:-2}
models=$HOME/bench-models; mkdir -p "$models"
fmt='import json,sys
lines=[l for l in sys.stdin.read().strip().splitlines() if l.startswith("{")]
if not lines: print("no stats line")
for i, l in enumerate(lines):
    s=json.loads(l)
    extra=" (graph %.0f%%, async_eval %.0f%%, token wait %.0f%% of decode)" % (100*s["decode_graph_s"]/s["decode_s"], 100*s["decode_dispatch_s"]/s["decode_s"], 100*(1-(s["decode_graph_s"]+s["decode_dispatch_s"])/s["decode_s"])) if "decode_graph_s" in s else ""
    if "decode_step_arrays" in s: extra += " %d arrays/step" % s["decode_step_arrays"]
    if s.get("kernel_compile_s"): extra += " (mlxcel kernels compiled: %.1f s)" % s["kernel_compile_s"]
    if s.get("draft_proposed"): extra += " draft: %d rounds, %d of %d accepted" % (s["draft_rounds"], s["draft_accepted"], s["draft_proposed"])
    elif "draft_accepted" in s: extra += " draft: %d tokens from the draft" % s["draft_accepted"]
    print("%s[run %d] load %.2f s  prefill %.0f tok/s  decode %.1f tok/s%s" % ("\n      " if i else "", i+1, s["load_s"], s["prefill_tps"], s["decode_tps"], extra), end="")
    if "load_phases_s" in s and __import__("os").environ.get("PHASES") and i == 0: print(" phases " + " ".join("%s %.2f" % kv for kv in s["load_phases_s"].items()), end="")
    if i == 0 and "decode_step_census" in s and __import__("os").environ.get("CENSUS"): print("\n      census: " + ", ".join(s["decode_step_census"]), end="")
print()'
ids=$(python3 -c "import random; r=random.Random(7); print(','.join(str(r.randrange(1000, 32000)) for _ in range(512)))")

# Splits a configuration's words into env assignments (ENVS) and --flags (FLAGS).
split_config() {
  ENVS=(); FLAGS=()
  for word in "$@"; do case $word in --*) FLAGS+=("$word") ;; *) ENVS+=("$word") ;; esac; done
}
# The model's checkpoint files read into the page cache (outside the processes' measured load).
warm_cache() { cat "$M"/*.safetensors > /dev/null 2>&1 || true; }
mlxcel() {  # label, env assignments and --flags...
  local label=$1; shift
  split_config "$@"
  warm_cache
  echo -n "  mlxcel $label: "
  env "${ENVS[@]}" "$here/mlxcel" generate --model "$M" --prompt-ids "$ids" --max-new 128 --ignore-eos \
    --stats-json --print-ids --quiet --repeat 2 ${FLAGS[@]+"${FLAGS[@]}"} 2>&1 >/dev/null | python3 -c "$fmt"
}
mlxlm() {  # [label, env assignments and --flags...]
  local label=${1:-}; shift || true
  split_config "$@"
  warm_cache
  echo -n "  mlx-lm${label:+ $label}: "
  env "${ENVS[@]}" python3 "$here/mlx_lm_bench.py" "$M" --prompt-ids "$ids" --max-new 128 --repeat 2 \
    ${FLAGS[@]+"${FLAGS[@]}"} 2>&1 >/dev/null | python3 -c "$fmt"
}

# Generates model folder $1 (llama-8b-4bit | llama-8b-bf16 | qwen3-30b-a3b-4bit) if absent; sets M.
model() {
  M=$models/$1
  local make
  case $1 in
    llama-8b-4bit) make="make llama-8b $M" ;;
    llama-8b-bf16) make="make llama-8b $M --dense" ;;
    qwen3-30b-a3b-4bit) make="make qwen3-30b-a3b $M" ;;
  esac
  if [ -f "$here/plans/$1.json" ]; then
    python3 "$here/make_plan_model.py" "$here/plans/$1.json" "$M" | tail -1
  fi
  [ -f "$M/config.json" ] || python3 "$here/make_random_model.py" $make | tail -1
  python3 "$here/make_random_model.py" floor "$M"
}
# The warm-up pass and RUNS measured passes of mlxcel configurations ("label ENV=VALUE ...",
# ...) and mlx-lm on $M; MLXLM_CONFIGS (same form) adds mlx-lm configurations.
passes() {
  for pass in warm-up $(seq -f measured-%g "$RUNS"); do
    echo "$pass"
    for config in "$@"; do mlxcel $config; done
    mlxlm
    for config in ${MLXLM_CONFIGS:+"${MLXLM_CONFIGS[@]}"}; do mlxlm $config; done
  done
}

# The CUDA decode step's GPU test (the fixtures and make_random_model.py's llama-wide, whose
# long rows and tall matrices the tiny fixtures never give the GEMVs' loops) under the
# environment's MLXCEL_* policy; $1: the test name filter.
decode_test() {
  local wide=$models/llama-wide
  [ -f "$wide/config.json" ] || python3 "$here/make_random_model.py" make llama-wide "$wide" | tail -1
  MLXCEL_DECODE_TEST_MODELS=$wide MLXCEL_FIXTURES_DIR=$here/fixtures-decode timeout ${TEST_TIMEOUT:-400} \
    "$here/cuda_decode_test" --ignored --nocapture --test-threads 1 ${1:-} 2>&1 | grep -v "^$" | tail -60
}
# The CUDA decode step against the MLX graph: the decode test (its fixtures, when $2 is "test"),
# then shape $1's greedy ids with the step on and off, then speed against mlx-lm (GRAPH=0: the
# step alone).
step_against_graph() {
  if [ "${2:-}" = test ]; then
    decode_test
  fi
  model "$1"
  for f in 1 0; do
    echo -n "  greedy ids, MLXCEL_CUDA_DECODE=$f: "
    MLXCEL_CUDA_DECODE=$f "$here/mlxcel" generate --model "$M" --prompt-ids "$ids" --max-new 64 \
      --ignore-eos --print-ids --quiet 2>&1 | tail -1 | cut -c1-60
  done
  if [ "${GRAPH:-1}" = 1 ]; then
    CENSUS=1 passes "step MLXCEL_CUDA_DECODE=1" "graph MLXCEL_CUDA_DECODE=0"
  else
    CENSUS=1 passes "step MLXCEL_CUDA_DECODE=1"
  fi
}

case $what in
tc)
  # The decode test with the tensor-core GEMVs on (the test reads the MLXCEL_* environment).
  MLXCEL_CUDA_DECODE_TC=1 decode_test cuda_step_matches
  model llama-8b-4bit
  for f in 1 0; do
    echo -n "  greedy ids, MLXCEL_CUDA_DECODE_TC=$f: "
    MLXCEL_CUDA_DECODE_TC=$f "$here/mlxcel" generate --model "$M" --prompt-ids "$ids" --max-new 64 \
      --ignore-eos --print-ids --quiet 2>&1 | tail -1 | cut -c1-200
  done
  configs=()
  for shape in ${TC_SHAPES:-8x16 4x16 8x32 16x16}; do configs+=("tc-$shape MLXCEL_CUDA_DECODE_TC=$shape"); done
  passes "${configs[@]}" "qmv MLXCEL_CUDA_DECODE_TC=0"
  ;;
kernels)
  timeout 170 "$here/cuda_kernels"
  timeout 120 python3 "$here/prefill_probe.py"
  ;;
llama-8b)
  model llama-8b-4bit
  CENSUS=1 passes "default MLXCEL_NOTHING=1" "unfused MLXCEL_FUSE_PROJECTIONS=0" \
    "mlx-dequantize MLXCEL_CUDA_DEQUANT=0" "qmv-4x4 MLXCEL_CUDA_QMV=4x4"
  ;;
all)
  # One device session: the kernel checks, the 8B 4-bit configurations, then mlxcel's
  # defaults against mlx-lm on the bf16 and MoE shapes.
  timeout 170 "$here/cuda_kernels" | grep -v "max|ours"
  "$0" llama-8b
  for shape in llama-8b-bf16 qwen3-30b-a3b-4bit; do
    echo "== $shape"
    model $shape
    passes "default MLXCEL_NOTHING=1"
  done
  ;;
llama-8b-bf16 | qwen3-30b-a3b)
  model "$what$([ "$what" = qwen3-30b-a3b ] && echo -4bit)"
  passes "default MLXCEL_NOTHING=1"
  ;;
graphs)
  # MLX's CUDA-graph batching (ops and MB per graph, or no graphs), with the async_eval
  # back-pressure that hides whether decode waits on the host or the device: with one graph
  # per token (g1000) async_eval no longer waits for the device, so the dispatch share is pure
  # host time.
  model llama-8b-4bit
  g1000="MLX_MAX_OPS_PER_BUFFER=1000 MLX_MAX_MB_PER_BUFFER=1000000"
  MLXLM_CONFIGS=("g1000 $g1000" "no-graphs MLX_USE_CUDA_GRAPHS=0")
  passes "default MLXCEL_NOTHING=1" "g1000 $g1000" \
    "g100 MLX_MAX_OPS_PER_BUFFER=100 MLX_MAX_MB_PER_BUFFER=4000" \
    "no-graphs MLX_USE_CUDA_GRAPHS=0" "qmv-4x4 MLXCEL_CUDA_QMV=4x4" "qmv-4x4-g1000 MLXCEL_CUDA_QMV=4x4 $g1000"
  ;;
fold)
  timeout 200 "$here/cuda_kernels" | grep -v "max|ours - MLX| [0-9.e+-]* (output" | grep -v "^dequant"
  model llama-8b-4bit
  for f in 1 0; do
    echo -n "  greedy ids, MLXCEL_CUDA_QMV_FOLD=$f: "
    MLXCEL_CUDA_QMV_FOLD=$f "$here/mlxcel" generate --model "$M" --prompt-ids "$ids" --max-new 24 \
      --ignore-eos --print-ids --quiet 2>&1 | tail -1
  done
  CENSUS=1 passes "default MLXCEL_NOTHING=1" "no-fold MLXCEL_CUDA_QMV_FOLD=0"
  ;;
mma)
  timeout 500 "$here/cuda_kernels" --mma | grep -v "max|ours - MLX| [0-9.e+-]* (output"
  ;;
speculative)
  # Per model: greedy ids plain and with the draft, then one process per configuration
  # (--repeat 2: run 2 is the steady state). DAMPS: the models, "none" the plain random one,
  # a number the --damp of layers EARLY (default 4) onwards (see make_random_model.py).
  early=${EARLY:-4}
  for damp in ${DAMPS:-none 0.2 0}; do
    if [ "$damp" = none ]; then model llama-8b-4bit; else
      M=$models/llama-8b-4bit-damp$damp
      [ -f "$M/config.json" ] || python3 "$here/make_random_model.py" make llama-8b "$M" \
        --damp-after "$early" --damp "$damp" | tail -1
    fi
    D=$M-early$early
    [ -f "$D/config.json" ] || "$here/mlxcel" convert --hf "$M" --out "$D" --early-exit "$early" --quiet
    echo "== $(basename "$M"), draft: its first $early layers"
    for flags in "" "--draft-model=$D --draft-tokens=4"; do
      echo -n "  greedy ids ${flags:-plain}: "
      "$here/mlxcel" generate --model "$M" --prompt-ids "$ids" --max-new 64 --ignore-eos --print-ids \
        --quiet $flags 2>&1 | tail -1 | md5sum
    done
    mlxcel default MLXCEL_NOTHING=1
    mlxcel draft-k2 --draft-model=$D --draft-tokens=2
    mlxcel draft-k4 --draft-model=$D --draft-tokens=4
    mlxlm
    mlxlm draft-k2 --draft-model=$D --num-draft-tokens=2
  done
  ;;
decode)
  step_against_graph llama-8b-4bit test
  # The GEMVs alone on the 8B shapes (what bounds the step once the host no longer does).
  timeout 150 "$here/cuda_kernels" --speed
  ;;
ssm)
  # The CUDA selective scan's check, then mlxcel with the scan kernel everywhere (default), at
  # decode only, and off (MLX graphs), against mlx-lm; greedy ids of the three first.
  timeout 120 "$here/cuda_kernels" --scan
  for shape in mamba2-4bit jamba-4bit; do
    echo "== $shape"
    model $shape
    for s in 1 decode 0; do
      echo -n "  greedy ids, MLXCEL_CUDA_SCAN=$s: "
      MLXCEL_CUDA_SCAN=$s "$here/mlxcel" generate --model "$M" --prompt-ids "$ids" --max-new 24 \
        --ignore-eos --print-ids --quiet 2>&1 | tail -1 | md5sum
    done
    passes "default MLXCEL_NOTHING=1" "scan-decode MLXCEL_CUDA_SCAN=decode" "scan-off MLXCEL_CUDA_SCAN=0"
  done
  ;;
moe | moe-shape)
  step_against_graph qwen3-30b-a3b-4bit $([ "$what" = moe ] && echo test)
  ;;
gather)
  # MoE prefill's routed-expert product (MLXCEL_CUDA_GATHER): its check against float32 and
  # timings against dequantize + MLX's gathered matmul, then the 30B-A3B 4-bit shape's greedy
  # ids with it on and off, then speed against mlx-lm (the first run of each process is a
  # first request: it shows what MLX still JIT-compiles for a MoE prompt).
  # (KERNELS=0: without the kernel check, when it has run already)
  if [ "${KERNELS:-1}" = 1 ]; then
    timeout ${KERNELS_TIMEOUT:-240} "$here/cuda_kernels" --gather 2>&1 | tail -40
  fi
  model qwen3-30b-a3b-4bit
  for f in 1 0; do
    echo -n "  greedy ids, MLXCEL_CUDA_GATHER=$f: "
    MLXCEL_CUDA_GATHER=$f "$here/mlxcel" generate --model "$M" --prompt-ids "$ids" --max-new 32 \
      --ignore-eos --print-ids --quiet 2>&1 | tail -1 | cut -c1-60
  done
  passes "gather MLXCEL_CUDA_GATHER=1" "dequantize MLXCEL_CUDA_GATHER=0"
  ;;
final)
  # mlxcel's defaults against mlx-lm on the three shapes (SHAPES: a subset).
  for shape in ${SHAPES:-llama-8b-4bit llama-8b-bf16 qwen3-30b-a3b-4bit}; do
    echo "== $shape"
    model $shape
    passes "default MLXCEL_NOTHING=1"
  done
  ;;
load)
  # Checkpoint tensors read into device memory (MLXCEL_CUDA_LOAD=1: pinned staging buffers,
  # cpp/cuda_load.cc, by reader threads kept for the process; "unpooled": threads started per
  # tensor) against MLX's copy into unified memory: the cuda_decode test that both
  # make bit-equal models (fixtures staged by gpu.sh stage), then load time, the first
  # request and the steady state on the 4-bit shapes (SHAPES) against mlx-lm, with the load's
  # phases.
  MLXCEL_FIXTURES_DIR=$here/fixtures-decode timeout ${TEST_TIMEOUT:-200} "$here/cuda_decode_test" \
    --ignored --nocapture --test-threads 1 tensors_read_into_device_memory 2>&1 | grep -v "^$" | tail -12
  for shape in ${SHAPES:-llama-8b-4bit qwen3-30b-a3b-4bit}; do
    echo "== $shape"
    model $shape
    PHASES=1 passes "device-load MLXCEL_CUDA_LOAD=1" "unpooled MLXCEL_CUDA_LOAD_POOL=0" "mapped MLXCEL_CUDA_LOAD=0"
  done
  ;;
gemv)
  model ${SHAPE:-llama-8b-4bit}
  for c in ${GEMV_SHAPES:-4x8,4x4:8,4x8 4x8,4x4,4x8 4x8:4,4x4:8,4x8 4x8,4x4:8,4x8:5 4x8,4x8:6,4x8 4x8,4x4:8,4x8}; do
    stats=$(mktemp)
    out=$(MLXCEL_CUDA_DECODE_GEMV=$c timeout 120 "$here/mlxcel" generate --model "$M" --prompt-ids "$ids" \
      --max-new 128 --ignore-eos --stats-json --print-ids --quiet --repeat 2 2>"$stats")
    echo -n "  $c: ids $(echo "$out" | head -1 | md5sum | cut -c1-8) "
    python3 -c "$fmt" < "$stats"
    rm -f "$stats"
  done
  ;;
fresh)
  for shape in ${SHAPES:-llama-8b-4bit llama-8b-bf16}; do
    echo "== $shape (first process on this machine)"
    model $shape
    # CLEAR=1: every kernel cache deleted first (mlxcel's, MLX's JIT, the driver's PTX cache),
    # as on a machine that never ran either engine.
    [ "${CLEAR:-0}" = 1 ] && rm -rf "$HOME/.cache/mlxcel/cuda" /tmp/mlx "$HOME/.nv/ComputeCache"
    warm_cache
    out=$(MLXCEL_KERNEL_LOG=1 "$here/mlxcel" generate --model "$M" --prompt-ids "$ids" --max-new 128 \
      --ignore-eos --stats-json --print-ids --quiet --repeat 2 2>&1 >/dev/null)
    echo "$out" | grep '^\[mlxcel CUDA kernel' || echo "  (no mlxcel kernel compiled)"
    echo -n "  mlxcel: "; echo "$out" | python3 -c "$fmt"
    echo "  MLX JIT cache: $(find /tmp/mlx -type f 2>/dev/null | wc -l) files"
    find /tmp/mlx -type f 2>/dev/null | sed 's|.*/||' | head -8 | sed 's/^/    /'
  done
  echo "== kernel caches on disk"
  ls -la "$HOME/.cache/mlxcel/cuda" 2>/dev/null | tail -n +2
  du -sh "$HOME"/.cache/* 2>/dev/null
  ;;
*) echo "usage: gpu_probe.sh kernels | all | graphs | llama-8b | llama-8b-bf16 | qwen3-30b-a3b | fold | speculative | decode | moe | gather | load | ssm | fresh | final | tc | gemv" >&2; exit 2 ;;
esac
