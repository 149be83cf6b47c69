#!/usr/bin/env bash
# What issue 24 still waits to measure, in order of priority, sized for one 10-minute device
# call (sessions 35-36 were lent no machine that started). On the GPU machine, after
# `gpu.sh stage` and `pack_one.sh .device` here and `fixtures_aside.sh out` for the call:
#   carry [".device/one", ".device/run"]:
#     source .device/one/unpack_one.sh .device/one > /tmp/unpack.log 2>&1; bash .device/run/gpu_pending.sh 2>&1 | tee $OUT/pending.txt
# 1. the random checkpoints (gpu_ab.sh models);
# 2. a fresh machine's first processes with every kernel cache deleted (gpu_probe.sh fresh,
#    CLEAR=1): a MoE prompt should leave MLX's JIT cache empty (session 35's gathers and gating);
# 3. the prompt-side variants against the default path on the fixtures, and rows.cu's kernels
#    against MLX's ops (gpu_ab.sh prefill);
# 4. mlxcel's defaults against mlx-lm (gpu_probe.sh final, the 8B and 30B-A3B 4-bit shapes);
# 5. A/B rounds of the variants that are off by default, then the decode test (gpu_ab.sh env test).
# Each step starts only while the call has time left for it (END, default 560 s).
cd "$(dirname "$0")"
END=${END:-560}
xz -d -f ./*.xz 2>/dev/null; chmod +x mlxcel cuda_kernels cuda_decode_test
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PHASES="models" bash gpu_ab.sh
CLEAR=1 SHAPES="qwen3-30b-a3b-4bit llama-8b-4bit" bash gpu_probe.sh fresh
echo "== prefill checks at ${SECONDS}s"
BUDGET=$((END - 160 - SECONDS)) PHASES="prefill" PREFILL_ENVS=" " bash gpu_ab.sh
echo "== final at ${SECONDS}s"
[ $SECONDS -lt $((END - 200)) ] && RUNS=0 SHAPES="llama-8b-4bit qwen3-30b-a3b-4bit" bash gpu_probe.sh final
echo "== A/B at ${SECONDS}s"
BUDGET=$((END - 20 - SECONDS)) PHASES="env test" ROUNDS="${ROUNDS:-1 2}" TEST_ENVS=" " \
  AB_MODELS="llama-8b-4bit qwen3-30b-a3b-4bit" \
  AB_ENVS="X=1 MLXCEL_CUDA_PREFILL_ROPE=1 MLXCEL_PREFILL_FOLD_RESIDUAL=1 MLXCEL_CUDA_ROUTER=1 MLXCEL_CUDA_PREFILL_ROPE=1+MLXCEL_PREFILL_FOLD_RESIDUAL=1+MLXCEL_CUDA_ROUTER=1" \
  bash gpu_ab.sh
echo "== done at ${SECONDS}s"
