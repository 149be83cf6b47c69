#!/usr/bin/env bash
# GPU embeddings: `mlxcel embed` against sentence-transformers on CUDA (one H200), on
# all-MiniLM-L6-v2, the bench's 1024 texts (target/bench/embed_texts.txt), batches of 32,
# RUNS runs each (default 3), alternating. On the GPU machine after unpack.sh, with the model
# folder in $MINILM: bash gpu_embed.sh  (prints each run's stats line; sentences/s = texts /
# embed_s).
#
# The real checkpoint is 90 MB, more than one device call carries. MINILM_RANDOM=1 takes the
# folder without its model.safetensors (config, tokenizer, sentence-transformers modules: a few
# hundred KB) and gives it random BERT weights of the same shape made by transformers there:
# speed does not depend on the weights' values, and both engines read the same file.
# PAD_TO lists the `MLXCEL_EMBED_PAD_TO` settings to run (default: the default, i.e. unset).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp}
m=${MINILM:?the all-MiniLM-L6-v2 folder}
RUNS=${RUNS:-3}
if [ "${MINILM_RANDOM:-0}" = 1 ] && [ ! -f "$m/model.safetensors" ]; then
  python3 - "$m" <<'PY'
import sys, torch
from transformers import BertConfig, BertModel
torch.manual_seed(0)
model = BertModel(BertConfig.from_pretrained(sys.argv[1]), add_pooling_layer=False)
model.save_pretrained(sys.argv[1], safe_serialization=True)
print("random weights written to", sys.argv[1])
PY
fi
for run in $(seq 1 "$RUNS"); do
  for pad in ${PAD_TO:-default}; do
    env $([ "$pad" = default ] || echo "MLXCEL_EMBED_PAD_TO=$pad") \
      "$here/mlxcel" embed --model "$m" --file "$here/embed_texts.txt" --batch-size 32 --format npy \
      --out "$out/emb.npy" --stats-json >/dev/null 2>"$out/mlxcel-$run-$pad.err"
    echo "mlxcel (pad to $pad) $run: $(tail -1 "$out/mlxcel-$run-$pad.err")"
  done
  python3 "$here/st_embed_bench.py" "$m" "$here/embed_texts.txt" --batch-size 32 --device cuda \
    --compare "$out/emb.npy" 2>"$out/st-$run.err" >/dev/null
  echo "sentence-transformers $run: $(tail -1 "$out/st-$run.err")"
done
