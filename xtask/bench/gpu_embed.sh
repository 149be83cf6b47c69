#!/usr/bin/env bash
# GPU embeddings: `mlxcel embed` against sentence-transformers on CUDA (one H200), on the real
# all-MiniLM-L6-v2, the bench's 1024 texts (target/bench/embed_texts.txt), batches of 32,
# three runs each, alternating. On the GPU machine after unpack.sh, with the model folder in
# $MINILM: bash gpu_embed.sh  (prints each run's stats line; sentences/s = texts / embed_s).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp}
m=${MINILM:?the all-MiniLM-L6-v2 folder}
for run in 1 2 3; do
  "$here/mlxcel" embed --model "$m" --file "$here/embed_texts.txt" --batch-size 32 --format npy \
    --out "$out/emb.npy" --stats-json >/dev/null 2>"$out/mlxcel-$run.err"
  echo "mlxcel $run: $(tail -1 "$out/mlxcel-$run.err")"
  python3 "$here/st_embed_bench.py" "$m" "$here/embed_texts.txt" --batch-size 32 --device cuda \
    --compare "$out/emb.npy" 2>"$out/st-$run.err" >/dev/null
  echo "sentence-transformers $run: $(tail -1 "$out/st-$run.err")"
done
