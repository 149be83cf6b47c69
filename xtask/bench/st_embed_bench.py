#!/usr/bin/env python3
"""sentence-transformers side of `cargo xtask bench --embeddings`.

Loads MODEL with sentence-transformers on torch (CPU), encodes the texts of FILE (one per line)
in batches of --batch-size and prints one JSON line on stderr with the same keys as
`mlxcel embed --stats-json`:

  load_s   SentenceTransformer(MODEL) construction
  embed_s  encode(texts, batch_size) (sentence-transformers sorts by length and pads per batch,
           as mlxcel does); no warm-up on either side
  texts, tokens, torch_version, torch_threads

With --compare FILE.npy (mlxcel's output, float32 [texts, dims]) it also reports the smallest
cosine similarity between the two engines' vectors (min_cosine).

usage: st_embed_bench.py MODEL FILE [--batch-size 32] [--compare mlxcel.npy]
"""
import argparse
import json
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("file")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--compare")
    ap.add_argument("--device", default="cpu", help="torch device (cuda on the GPU machine)")
    a = ap.parse_args()
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    with open(a.file, encoding="utf8") as f:
        texts = [line.rstrip("\n") for line in f if line.strip()]
    t0 = time.perf_counter()
    st = SentenceTransformer(a.model, device=a.device, local_files_only=True)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    emb = st.encode(texts, batch_size=a.batch_size, convert_to_numpy=True)
    embed_s = time.perf_counter() - t0
    tokens = sum(len(st.tokenizer(t, truncation=True, max_length=st.max_seq_length)["input_ids"]) for t in texts)
    out = {
        "texts": len(texts),
        "tokens": tokens,
        "embed_s": embed_s,
        "load_s": load_s,
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    if a.compare:
        other = np.load(a.compare)
        num = (emb * other).sum(1)
        den = np.linalg.norm(emb, axis=1) * np.linalg.norm(other, axis=1)
        out["min_cosine"] = float((num / den).min())
    print(json.dumps(out), file=sys.stderr)


if __name__ == "__main__":
    main()
