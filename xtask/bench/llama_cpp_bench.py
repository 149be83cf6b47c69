#!/usr/bin/env python3
"""llama.cpp side of `cargo xtask bench` (the `llama.cpp` engine): llama-cpp-python reading a GGUF.

Loads the GGUF, prefills the given prompt token ids, greedily decodes a fixed number of tokens
(argmax of the last row's logits, EOS not a stop) and prints one JSON line of measurements on
stderr with the keys and definitions of `mlxcel generate --stats-json`:

  load_s       Llama(...) returns (weights mapped and the context made)
  prefill_s    prompt in, first token's id out (eval of the prompt + argmax)
  decode_s     from the first token to the last: (generated - 1) tokens
  vmhwm_bytes  this process's peak resident set (VmHWM)

Both engines get the same thread count (`--threads`, default 2) for prefill and decode.

usage: llama_cpp_bench.py FILE.gguf --prompt-ids 1,2,3 --max-new N [--threads 2] [--print-ids]
"""
import argparse
import json
import sys
import time


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
    ap.add_argument("gguf")
    ap.add_argument("--prompt-ids", required=True)
    ap.add_argument("--max-new", type=int, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--print-ids", action="store_true")
    args = ap.parse_args()

    import llama_cpp
    import numpy as np

    prompt = [int(t) for t in args.prompt_ids.split(",") if t]
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=args.gguf,
        n_ctx=len(prompt) + args.max_new + 8,
        n_batch=512,
        n_ubatch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        logits_all=False,
        verbose=False,
    )
    load_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()

    def next_id():
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
        return int(logits.argmax())

    ids = []
    t_start = time.perf_counter()
    llm.eval(prompt)
    ids.append(next_id())
    t_first = time.perf_counter()
    while len(ids) < args.max_new:
        llm.eval([ids[-1]])
        ids.append(next_id())
    t_end = time.perf_counter()

    prefill_s = t_first - t_start
    decode_s = t_end - t_first
    stats = {
        "load_s": load_s,
        "prompt_tokens": len(prompt),
        "prefill_s": prefill_s,
        "prefill_tps": len(prompt) / prefill_s if prefill_s > 0 else 0.0,
        "generated_tokens": len(ids),
        "decode_s": decode_s,
        "decode_tps": (len(ids) - 1) / decode_s if decode_s > 0 else 0.0,
        "vmhwm_bytes": vmhwm_bytes(),
        "device": "cpu",
        "dtype": "gguf",
        "threads": args.threads,
        "llama_cpp_version": llama_cpp.__version__,
    }
    if args.print_ids:
        print(",".join(str(i) for i in ids))
    print(json.dumps(stats), file=sys.stderr)


if __name__ == "__main__":
    main()
