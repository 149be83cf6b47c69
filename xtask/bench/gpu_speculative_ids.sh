#!/usr/bin/env bash
# Speculative decoding on the GPU machine: greedy ids with a draft model against plain decoding,
# on the real SmolLM2-135M-Instruct (4-bit) and two tiny fixtures; then the 8B-shape speed probe
# (gpu_probe.sh speculative).
#
# The SmolLM2 checkpoint (98 MB) is larger than one device call may carry, so it travels in
# three parts: `split -b` of model.safetensors into smol.part1 (cp'd to $HOME/mlxcel-dev in a
# first call), smol.part2 (a second call) and smol.part3 (a third call; this script in .device/run, next
# to smol.sha256, config.json as smol_config.json, generation_config.json as smol_generation_config.json,
# tokenizer.json.xz and tokenizer_config.json); the fixtures llama and llama-affine4-g32 in
# .device/run/fixtures.
set -u
here=$(cd "$(dirname "$0")" && pwd)
parts=$HOME/mlxcel-dev
S=$HOME/smollm2
mkdir -p "$S"
cat "$parts/smol.part1" "$parts/smol.part2" "$parts/smol.part3" > "$S/model.safetensors"
(cd "$S" && sha256sum -c "$here/smol.sha256") || exit 1
cp "$here/smol_config.json" "$S/config.json"
cp "$here/smol_generation_config.json" "$S/generation_config.json"
cp "$here/tokenizer_config.json" "$S/"
xz -dc "$here/tokenizer.json.xz" > "$S/tokenizer.json"
[ -f "$HOME/smollm2-early20/config.json" ] || "$here/mlxcel" convert --hf "$S" --out "$HOME/smollm2-early20" --early-exit 20 --quiet

ids() {  # model, label, flags...
  local m=$1 label=$2; shift 2
  local out
  out=$("$here/mlxcel" generate --model "$m" "$@" --max-new 96 --print-ids 2>/tmp/spec.err | tail -1)
  printf '  %-28s %s  %s\n' "$label" "$(echo "$out" | md5sum | cut -c1-12)" "$(grep -h speculative /tmp/spec.err)"
}
for user in "What is the capital of France?" "Write a short poem about the sea." "List three uses of a paperclip."; do
  echo "SmolLM2, --user \"$user\" (md5 of the greedy ids):"
  ids "$S" plain --user "$user"
  ids "$S" "draft=itself k=4" --user "$user" --draft-model "$S" --draft-tokens 4
  ids "$S" "draft=early-exit-20 k=3" --user "$user" --draft-model "$HOME/smollm2-early20" --draft-tokens 3
done
F=$here/fixtures
echo "fixture llama (f32), prompt ids 5,6,7,8:"
ids "$F/llama" plain --prompt-ids 5,6,7,8 --ignore-eos
for k in 1 3 5; do
  ids "$F/llama" "draft=llama-affine4-g32 k=$k" --prompt-ids 5,6,7,8 --ignore-eos --draft-model "$F/llama-affine4-g32" --draft-tokens $k
done
