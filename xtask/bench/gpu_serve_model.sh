#!/usr/bin/env bash
# The serving benchmarks' model, made once per GPU machine: a random Llama-3.1-8B-shaped 4-bit
# checkpoint with SmolLM2's tokenizer (vocabulary 49152) at $HOME/bench-models/llama-8b-4bit-v49k.
# Reads tokenizer.json (or tokenizer.json.xz) and tokenizer_config.json beside this script.
# Prints the model's path.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
model=$HOME/bench-models/llama-8b-4bit-v49k
if [ ! -f "$model/tokenizer.json" ]; then
  [ -f "$here/tokenizer.json" ] || xz -dkf "$here/tokenizer.json.xz"
  python3 "$here/make_random_model.py" make llama-8b "$model" --vocab 49152 >&2
  cp "$here/tokenizer.json" "$here/tokenizer_config.json" "$model/"
  # The tokenizer's special ids (SmolLM2: <|im_start|> 1, <|im_end|> 2), not Llama 3's.
  python3 - "$model/config.json" <<'PY'
import json, sys
p = sys.argv[1]
c = json.load(open(p))
c.update(bos_token_id=1, eos_token_id=2)
json.dump(c, open(p, "w"), indent=1)
PY
fi
echo "$model"
