#!/usr/bin/env bash
# A/B rounds for GPU kernel work on the device machine: alternating processes of two variants
# (environment settings, or two mlxcel binaries) in one call on one machine, plus kernel
# profiles. Compare variants only within one call: H100 machines of the same kind measured 5%
# apart (docs/performance.md, session 32).
#
# Stage here: xtask/bench/gpu.sh stage. For a binary A/B also build the baseline and copy it as
# .device/run/mlxcel_base (e.g. `git stash; MLXCEL_LINK=name cargo build --release -p mlxcel-cli;
# cp target/release/mlxcel .device/run/mlxcel_base; git stash pop`, then stage again), and
# `xz -T2 -3` the binaries so .device/b + .device/run stay under the 64 MiB a call carries.
# Then, as gpu.sh's header says, two calls back to back (the machine goes back after 30 s idle):
#   carry [".device/a"]:  mkdir -p $HOME/mlxcel-dev && cp .device/a/libmlx.part0 $HOME/mlxcel-dev/
#   carry [".device/b", ".device/run"]:
#     source .device/b/unpack.sh .device/b >/dev/null 2>&1; PHASES="models env" bash .device/run/gpu_ab.sh
#
# Phases ($PHASES, in order; each is skipped once the call has run $BUDGET seconds, default 520):
#   models     the random checkpoints (make_random_model.py): llama-8b-4bit, qwen3-30b-a3b-4bit,
#              llama-wide (the decode test's wide model); ~25 s on a fresh machine
#   env        $ROUNDS rounds over $AB_MODELS x $AB_ENVS (each `A=1+B=2`; X=1 = no change)
#   bins       $ROUNDS rounds over $AB_MODELS x $BINS (default ./mlxcel_base ./mlxcel; a binary
#              may carry settings of its own: ./mlxcel_base@A=1+B=2)
#   test       the GPU decode test on every fixture and llama-wide, with the defaults and with
#              each of $TEST_ENVS (default: the fused router, 128-thread attention blocks), then
#              the kernel checks
#   prefill    the prompt-side variants' checks: their GPU test against the default path
#              (cuda_decode_test prefill_variants: the rope kernel, the folded residual), rows.cu's
#              checks and the rope's timing (cuda_kernels --rows), then a fresh process's first
#              512-id prompt kernel by kernel (ncu, $NCU_MODEL, warm-up off) under each of
#              $PREFILL_ENVS (default: X=1 and both variants on)
#   ncu        one decode step kernel by kernel ($NCU_MODEL, ncu_sum.py): $NCU_PER_STEP launches
#              matching mlxcel_dec per step (8B: 161; 30B-A3B: 337, or 289 with the fused router)
#   detail     stall reasons and occupancy of one launch of each of $DETAIL_KERNELS
# Each process: prompt 512 ids, 128 new, greedy, two requests; a line gives decode and prefill
# tok/s of both requests and the md5 of the greedy ids.
cd "$(dirname "$0")" && xz -d -f ./*.xz 2>/dev/null
chmod +x mlxcel* cuda_kernels cuda_decode_test 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# The host's NUMA layout and the GPU's node (the load reads the checkpoint through host memory).
lscpu 2>/dev/null | grep -i "numa" | tr -s ' '
nvidia-smi topo -m 2>/dev/null | head -3
models=$HOME/bench-models
mkdir -p "$models"
ids=$(python3 -c "import random; r=random.Random(7); print(','.join(str(r.randrange(1000, 32000)) for _ in range(512)))")
late() { [ $SECONDS -gt "${BUDGET:-520}" ] && echo "skipping $1 at ${SECONDS}s"; }
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)

# One process (two requests) of binary $BIN on model $1 with settings $2 (A=1+B=2: `+` between
# settings, since a setting's value may hold commas). The setting PIN=<cpu list> runs the
# process under `taskset -c <cpu list>` (e.g. one NUMA node's CPUs, for the load's reads).
one() {
  local model=$1 envs=$2 pin=
  # The checkpoint read into the page cache first, as gpu_probe.sh does for every process.
  cat "$models/$model"/*.safetensors > /dev/null 2>&1 || true
  [[ $envs =~ (^|\+)PIN=([^+]*) ]] && pin="taskset -c ${BASH_REMATCH[2]}"
  out=$(env ${envs//+/ } $pin timeout 120 "${BIN:-./mlxcel}" generate --model "$models/$model" --prompt-ids "$ids" \
    --max-new 128 --ignore-eos --stats-json --print-ids --quiet --repeat 2 2>"$OUT/err.txt")
  stats=$(python3 -c '
import json, sys
s = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
if not s:
    print("failed")
else:
    print(" ".join("%.1f" % x["decode_tps"] for x in s), "tok/s, prefill",
          " ".join("%.0f" % x["prefill_tps"] for x in s),
          "(overlapped %s, compile %.1f s, load %.2f s: build %.2f s, reads %.2f s of %.1f GB, warm-up %.2f s; kept %.1f GB, peak %.1f GB)" % (
          s[0].get("cuda_decode_overlapped"), s[0].get("kernel_compile_s", 0), s[0].get("load_s", 0),
          s[0].get("load_phases_s", {}).get("build", 0), s[0].get("device_reads", {}).get("s", 0),
          s[0].get("device_reads", {}).get("bytes", 0) / 1e9, s[0].get("load_phases_s", {}).get("warm_up", 0),
          s[-1].get("prefill_dense_bytes", 0) / 1e9, s[-1].get("peak_mlx_bytes", 0) / 1e9))' "$OUT/err.txt")
  echo "$model ${BIN:-./mlxcel} [$envs] $stats ids $(echo "$out" | head -1 | md5sum | cut -c1-8) at ${SECONDS}s" | tee -a "$OUT/ab.txt"
  grep -i "error\|panic" "$OUT/err.txt" | head -3
}

for phase in ${PHASES:-models env}; do
  case $phase in
  models)
    for m in llama-8b:llama-8b-4bit qwen3-30b-a3b:qwen3-30b-a3b-4bit llama-wide:llama-wide; do
      [ -f "$models/${m#*:}/config.json" ] || python3 make_random_model.py make "${m%:*}" "$models/${m#*:}" | tail -1
    done
    echo "models at ${SECONDS}s" ;;
  env)
    for r in ${ROUNDS:-1 2}; do
      for m in ${AB_MODELS:-llama-8b-4bit qwen3-30b-a3b-4bit}; do
        for e in ${AB_ENVS:-X=1}; do
          late env && break 3
          one "$m" "$e"
        done
      done
    done ;;
  bins)
    for r in ${ROUNDS:-1 2}; do
      for m in ${AB_MODELS:-llama-8b-4bit qwen3-30b-a3b-4bit}; do
        for b in ${BINS:-./mlxcel_base ./mlxcel}; do
          late bins && break 3
          envs=X=1
          [[ $b == *@* ]] && envs=${b#*@}
          BIN=${b%%@*} one "$m" "$envs"
        done
      done
    done ;;
  test)
    late test && continue
    # The defaults, then each of $TEST_ENVS (the step's variants that are off by default).
    for e in X=1 ${TEST_ENVS:-MLXCEL_CUDA_DECODE_FUSED_ROUTE=1 MLXCEL_CUDA_DECODE_ATTN_THREADS=128}; do
      late test && break
      echo "== decode test [$e]"
      env ${e//+/ } MLXCEL_DECODE_TEST_MODELS=$models/llama-wide MLXCEL_FIXTURES_DIR=$PWD/fixtures-decode \
        timeout 240 ./cuda_decode_test --ignored --nocapture --test-threads 1 cuda_step_matches 2>&1 | grep -v "^$" | tail -12
    done
    echo "== kernel checks"; timeout 200 ./cuda_kernels 2>&1 | tail -5
    echo "at ${SECONDS}s" ;;
  prefill)
    late prefill && continue
    echo "== prefill variants test"
    MLXCEL_FIXTURES_DIR=$PWD/fixtures-decode timeout 240 ./cuda_decode_test --ignored --nocapture \
      --test-threads 1 prefill_variants 2>&1 | grep -v "^$" | tail -14
    echo "== rows.cu checks"; timeout 120 ./cuda_kernels --rows 2>&1 | tail -8
    for e in ${PREFILL_ENVS:-X=1 MLXCEL_CUDA_PREFILL_ROPE=1+MLXCEL_PREFILL_FOLD_RESIDUAL=1}; do
      late prefill && break
      echo "== first prompt kernel by kernel [$e]"
      env ${e//+/ } MLXCEL_WARM_UP=0 timeout 300 "$NCU" --cache-control none --clock-control none --csv \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum ./mlxcel generate \
        --model "$models/${NCU_MODEL:-llama-8b-4bit}" --prompt-ids "$ids" --max-new 1 --ignore-eos \
        --print-ids --quiet > "$OUT/ncu-prefill.csv" 2>"$OUT/ncu-err.txt"
      tail -2 "$OUT/ncu-err.txt"
      python3 ncu_sum.py "$OUT/ncu-prefill.csv" | head -${NCU_LINES:-24}
    done
    echo "at ${SECONDS}s" ;;
  ncu)
    late ncu && continue
    per=${NCU_PER_STEP:-161}
    short=$(echo "$ids" | cut -d, -f1-"${NCU_PROMPT:-512}")
    timeout 300 "$NCU" --cache-control none --clock-control none --kernel-name regex:mlxcel_dec \
      --launch-skip $((per * 11)) --launch-count $((per * 2)) --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum \
      ./mlxcel generate --model "$models/${NCU_MODEL:-llama-8b-4bit}" --prompt-ids "$short" --max-new 16 \
      --ignore-eos --print-ids --quiet > "$OUT/ncu.csv" 2>"$OUT/ncu-err.txt"
    tail -2 "$OUT/ncu-err.txt"
    python3 ncu_sum.py "$OUT/ncu.csv" | head -30 ;;
  detail)
    late detail && continue
    for k in ${DETAIL_KERNELS:-attention moe_glu moe_down}; do
      timeout 200 "$NCU" --cache-control none --clock-control none --kernel-name "regex:mlxcel_dec_$k" \
        --launch-skip "${DETAIL_SKIP:-600}" --launch-count 1 --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section SchedulerStats \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio" \
        ./mlxcel generate --model "$models/${DETAIL_MODEL:-qwen3-30b-a3b-4bit}" --prompt-ids "$ids" --max-new 24 \
        --ignore-eos --print-ids --quiet > "$OUT/detail-$k.txt" 2>&1
      echo "== $k"
      grep -E "Duration|Achieved Occupancy|Theoretical Occupancy|Registers Per|Grid Size|Eligible Warps|Warp Cycles Per Issued|Memory Throughput" "$OUT/detail-$k.txt"
      grep "stalled" "$OUT/detail-$k.txt" | awk '{v=$NF; if (v+0 > 0.3) print}' | sed 's/smsp__average_warps_issue_stalled_//'
    done ;;
  *) echo "unknown phase $phase" ;;
  esac
done
