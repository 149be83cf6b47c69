#!/usr/bin/env python3
"""mlx-lm side of `cargo xtask bench` (and of xtask/bench/gpu.sh).

Loads a model folder with mlx_lm, prefills the given prompt token ids, greedily decodes a fixed
number of tokens (EOS is not a stop: generate_step never stops on it) and prints one JSON line of
measurements on stderr, with the same keys and definitions as `mlxcel generate --stats-json`:

  load_s       mlx_lm.utils.load_model (weights evaluated) [+ the f32 cast], tokenizer not loaded
  prefill_s    prompt in, first token's logits out (mlx-lm processes all but the last prompt
               token, then the last one, and samples the first token: the time to the first yield)
  decode_s     from the first token to the last: (generated - 1) tokens
  vmhwm_bytes  this process's peak resident set (VmHWM)
  peak_mlx_bytes  mx.get_peak_memory()

usage: mlx_lm_bench.py MODEL --prompt-ids 1,2,3 --max-new N [--dtype f32] [--print-ids]
                       [--draft-model DIR --num-draft-tokens K]

With --draft-model, mlx-lm's speculative_generate_step decodes (greedy), and the stats line adds
draft_accepted: the generated tokens that came from the draft.
"""
import argparse
import json
import sys
import time
from pathlib import Path


def vmhwm_bytes():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt-ids", required=True)
    ap.add_argument("--max-new", type=int, required=True)
    ap.add_argument("--dtype", choices=["checkpoint", "f32"], default="checkpoint")
    ap.add_argument("--print-ids", action="store_true")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the generation this many times in the process, a stats line each")
    ap.add_argument("--draft-model")
    ap.add_argument("--num-draft-tokens", type=int, default=2)
    args = ap.parse_args()

    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    prompt = [int(t) for t in args.prompt_ids.split(",") if t]
    t0 = time.perf_counter()
    model, _config = load_model(Path(args.model), lazy=False)
    draft = load_model(Path(args.draft_model), lazy=False)[0] if args.draft_model else None
    if args.dtype == "f32":
        # MLX's Linux CPU backend emulates bf16/f16 and accumulates quantized matmuls in the
        # activation dtype; mlxcel computes in float32 there. Cast every float parameter
        # (norms, embeddings, dense weights, quantization scales and biases) to float32;
        # packed quantized weights (uint32) are untouched.
        model.update(
            tree_map(
                lambda p: p.astype(mx.float32)
                if mx.issubdtype(p.dtype, mx.floating)
                else p,
                model.parameters(),
            )
        )
        mx.eval(model.parameters())
    load_s = time.perf_counter() - t0

    for _ in range(max(args.repeat, 1)):
        ids = []
        t_start = time.perf_counter()
        t_first = None
        from_draft = 0
        if draft is None:
            steps = ((t, False) for t, _ in generate_step(mx.array(prompt), model, max_tokens=args.max_new))
        else:
            from mlx_lm.generate import speculative_generate_step

            steps = ((t, d) for t, _, d in speculative_generate_step(
                mx.array(prompt), model, draft, num_draft_tokens=args.num_draft_tokens,
                max_tokens=args.max_new))
        for token, drafted in steps:
            from_draft += int(bool(drafted))
            tok = token if isinstance(token, int) else int(token.item())
            if t_first is None:
                t_first = time.perf_counter()
            ids.append(tok)
            if len(ids) >= args.max_new:
                break
        t_end = time.perf_counter()
        prefill_s = t_first - t_start
        decode_s = t_end - t_first
        if args.print_ids:
            print(",".join(map(str, ids)))
        stats = {
            "engine": "mlx-lm",
            "dtype": args.dtype,
            "device": str(mx.default_device()),
            "mlx_version": mx.__version__,
            "load_s": load_s,
            "prompt_tokens": len(prompt),
            "prefill_s": prefill_s,
            "prefill_tps": len(prompt) / max(prefill_s, 1e-9),
            "generated_tokens": len(ids),
            "decode_s": decode_s,
            "decode_tps": max(len(ids) - 1, 0) / max(decode_s, 1e-9),
            "peak_mlx_bytes": mx.get_peak_memory(),
            "vmhwm_bytes": vmhwm_bytes(),
        }
        if draft is not None:
            stats["draft_accepted"] = from_draft
        sys.stderr.write(json.dumps(stats) + "\n")


if __name__ == "__main__":
    main()
