#!/usr/bin/env python3
"""Random-weight checkpoints and bandwidth floors for the GPU benchmark (xtask/bench/gpu.sh).

Needs only Python `mlx` (the GPU machine has no Rust toolchain):

  make_random_model.py make llama-8b  OUTDIR   Llama-3.1-8B shape, affine 4-bit g64, bf16 scales
  make_random_model.py make llama-8b OUTDIR --dense   the same shape unquantized, bf16 (16 GB)
  make_random_model.py make qwen3-30b-a3b OUTDIR   Qwen3-30B-A3B shape (128 experts, top-8)
  make_random_model.py make llama-8b OUTDIR --vocab 49152   another vocabulary size
  make_random_model.py make llama-70b OUTDIR --dense --sparse   headers only: every data region
      is a hole of a sparse file (no disk blocks, no Python mlx needed), for shapes no disk
      holds; run them with `mlxcel generate --random-weights SEED` (each rank makes its own
      shard's random weights on the device, see xtask/bench/gpu_dist.sh)
  make_random_model.py make llama-8b OUTDIR --damp-after 4 --damp 0.2   layers 4 and later
      write damp x their updates into the residual stream (o_proj and down_proj scaled): the
      first 4 layers then predict what all 32 do as often as the damping allows, a stand-in for
      a trained model whose early-exit draft (`mlxcel convert --early-exit 4`) agrees often
      (the speculative-decoding benchmark; 0 makes the later layers no-ops)
  make_random_model.py floor MODELDIR [--bandwidth GBPS]
      prints JSON: weight bytes, bytes read per decoded token, measured device copy bandwidth
      (a large MLX array copy: read + write bytes / time) and the decode floor in tok/s.

Weights are uniform with std 0.02 (seeded per tensor), norms are ones, routers stay bf16,
experts are written in mlx-lm's stacked layout (mlp.switch_mlp.{gate,up,down}_proj).
Shards hold a few layers each and model.safetensors.index.json maps names to shards.
"""
import argparse
import json
import math
import os
import struct
import sys
import time

SHAPES = {
    "llama-8b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        hidden_act="silu", attention_bias=False, mlp_bias=False, bos_token_id=128000,
        eos_token_id=128001, torch_dtype="bfloat16"),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, rope_scaling=None,
        hidden_act="silu", attention_bias=False, bos_token_id=151643, eos_token_id=151645,
        torch_dtype="bfloat16"),
    # Small, with an MLP wide enough that the CUDA decode step's GEMVs walk several chunks of a
    # row (down: K = 10240) and matrices taller than a grid's first wave (gate|up, the head):
    # what the tiny fixtures never reach (gpu_probe.sh decode tests the step on it).
    "llama-wide": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        intermediate_size=10240, vocab_size=16384, tie_word_embeddings=False,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096, rope_scaling=None,
        hidden_act="silu", attention_bias=False, mlp_bias=False, bos_token_id=1,
        eos_token_id=2, torch_dtype="bfloat16"),
    # Llama-3.1-70B: bf16 it is ~141 GB, more than one H200 holds.
    "llama-70b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=8192,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        hidden_act="silu", attention_bias=False, mlp_bias=False, bos_token_id=128000,
        eos_token_id=128001, torch_dtype="bfloat16"),
}
GROUP, BITS = 64, 4


def layout(c):
    """(name, shape, kind) with kind 'q' (quantized linear prefix), 'ones', 'dense'; by layer."""
    h, hd = c["hidden_size"], c["head_dim"]
    nh, kv = c["num_attention_heads"], c["num_key_value_heads"]
    head = [("model.embed_tokens", (c["vocab_size"], h), "q")]
    layers = []
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t = [
            (f"{p}.input_layernorm.weight", (h,), "ones"),
            (f"{p}.post_attention_layernorm.weight", (h,), "ones"),
            (f"{p}.self_attn.q_proj", (nh * hd, h), "q"),
            (f"{p}.self_attn.k_proj", (kv * hd, h), "q"),
            (f"{p}.self_attn.v_proj", (kv * hd, h), "q"),
            (f"{p}.self_attn.o_proj", (h, nh * hd), "q"),
        ]
        if c["model_type"] == "qwen3_moe":
            e, mi = c["num_experts"], c["moe_intermediate_size"]
            t += [
                (f"{p}.self_attn.q_norm.weight", (hd,), "ones"),
                (f"{p}.self_attn.k_norm.weight", (hd,), "ones"),
                (f"{p}.mlp.gate.weight", (e, h), "dense"),
                (f"{p}.mlp.switch_mlp.gate_proj", (e, mi, h), "q"),
                (f"{p}.mlp.switch_mlp.up_proj", (e, mi, h), "q"),
                (f"{p}.mlp.switch_mlp.down_proj", (e, h, mi), "q"),
            ]
        else:
            it = c["intermediate_size"]
            t += [
                (f"{p}.mlp.gate_proj", (it, h), "q"),
                (f"{p}.mlp.up_proj", (it, h), "q"),
                (f"{p}.mlp.down_proj", (h, it), "q"),
            ]
        layers.append(t)
    tail = [("model.norm.weight", (h,), "ones")]
    if not c["tie_word_embeddings"]:
        tail.append(("lm_head", (c["vocab_size"], h), "q"))
    return head, layers, tail


def write_sparse(path, entries):
    """A safetensors file of `entries` (name, dtype, shape) whose data region is a hole."""
    size = {"BF16": 2, "U32": 4, "F32": 4}
    meta, offset = {"__metadata__": {"format": "mlx"}}, 0
    for name, dtype, shape in entries:
        n = size[dtype] * math.prod(shape)
        meta[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(meta, separators=(",", ":")).encode()
    head += b" " * ((8 - len(head) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        f.truncate(8 + len(head) + offset)
    return offset


def sparse_entries(items, dense):
    """The stored tensors of layout items: quantized linears as packed words, scales, biases."""
    for name, shp, kind in items:
        if kind in ("ones", "dense") or dense:
            yield (name if kind != "q" else f"{name}.weight"), "BF16", shp
        else:
            *out, inp = shp
            yield f"{name}.weight", "U32", (*out, inp * BITS // 32)
            yield f"{name}.scales", "BF16", (*out, inp // GROUP)
            yield f"{name}.biases", "BF16", (*out, inp // GROUP)


def damped(name, damp_after, damp):
    """The factor for weight `name`: `damp` for the residual-writing projections of layers at
    or after `damp_after`, else 1."""
    if damp_after is None or not name.endswith(("o_proj", "down_proj")):
        return 1.0
    parts = name.split(".")
    layer = int(parts[parts.index("layers") + 1])
    return damp if layer >= damp_after else 1.0


# Routing constants of xtask/src/bench/synth.rs (TOKEN_STD, SHARED_RMS, ZIPF_ALPHA, BIAS_BETA).
TOKEN_STD, SHARED_RMS, ZIPF_ALPHA, BIAS_BETA = 2.0, 1.0, 1.0, 0.5


def shared_direction(mx, h):
    """The unit vector [1, h] every token embedding has a component along."""
    u = mx.random.uniform(shape=(1, h), key=mx.random.key(0x5EED0A11)) - 0.5
    return u / mx.sqrt((u * u).sum(axis=1, keepdims=True))


def routed_fill(mx, name, shp, key, routing):
    """The float32 values of `name` under `routing`, or None where it changes nothing."""
    if routing is None:
        return None
    h = shp[-1]
    if name == "model.embed_tokens":
        tok = (mx.random.uniform(shape=shp, key=key) - 0.5) * (2 * TOKEN_STD * math.sqrt(3))
        return tok + shared_direction(mx, h) * (SHARED_RMS * math.sqrt(h))
    if name.endswith(".mlp.gate.weight"):
        u = shared_direction(mx, h)
        g = (mx.random.uniform(shape=shp, key=key) - 0.5) * (2 * 0.02 * math.sqrt(3))
        g = g - (g * u).sum(axis=1, keepdims=True) * u
        if routing == "skewed":
            layer = int(name.split(".")[2])
            ranks = mx.random.permutation(shp[0], key=mx.random.key(777 + layer))
            zipf = (1.0 + ranks.astype(mx.float32)) ** -ZIPF_ALPHA
            g = g + (BIAS_BETA * zipf)[:, None] * u
        return g
    return None


def make(shape, out, dense=False, vocab=None, sparse=False, damp_after=None, damp=1.0,
         routing=None):
    c = dict(SHAPES[shape])
    if vocab:
        # To pair the shape with a smaller real tokenizer (the serving benchmark).
        c["vocab_size"] = vocab
    if not dense:
        q = {"group_size": GROUP, "bits": BITS, "mode": "affine"}
        c["quantization"] = q
        c["quantization_config"] = dict(q)
    if os.path.isfile(os.path.join(out, "model.safetensors.index.json")):
        print(f"{out}: present")
        return
    stage = out + ".staging"
    os.makedirs(stage, exist_ok=True)
    head, layers, tail = layout(c)
    per_shard = 4
    groups = [head + layers[0]] + layers[1:]
    groups[-1] = groups[-1] + tail
    shards = [sum(groups[i:i + per_shard], []) for i in range(0, len(groups), per_shard)]
    weight_map, counter, total = {}, 0, 0
    t0 = time.time()
    if sparse:
        for si, items in enumerate(shards):
            fname = f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors"
            entries = list(sparse_entries(items, dense))
            total += write_sparse(os.path.join(stage, fname), entries)
            weight_map.update({n: fname for n, _, _ in entries})
        with open(os.path.join(stage, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
        with open(os.path.join(stage, "config.json"), "w") as f:
            json.dump(c, f, indent=2)
        os.rename(stage, out)
        print(f"{out}: {total / 1e9:.2f} GB of sparse (header-only) safetensors")
        return
    import mlx.core as mx

    for si, items in enumerate(shards):
        fname = f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shp, kind in items:
            counter += 1
            key = mx.random.key(1000003 * 3 + counter)
            if kind == "ones":
                tensors[name] = mx.ones(shp, dtype=mx.bfloat16)
                continue
            scale = 2 * 0.02 * math.sqrt(3) * damped(name, damp_after, damp)
            w = routed_fill(mx, name, shp, key, routing)
            if w is None:
                w = (mx.random.uniform(shape=shp, key=key) - 0.5) * scale
            w = w.astype(mx.bfloat16)
            if kind == "dense":
                tensors[name] = w
            elif dense:
                tensors[f"{name}.weight"] = w
            else:
                wq, s, b = mx.quantize(w, group_size=GROUP, bits=BITS)
                tensors[f"{name}.weight"], tensors[f"{name}.scales"], tensors[f"{name}.biases"] = wq, s, b
            mx.eval(tensors)
        for n, a in tensors.items():
            weight_map[n] = fname
            total += a.nbytes
        mx.save_safetensors(os.path.join(stage, fname), tensors, metadata={"format": "mlx"})
        del tensors
        print(f"  {fname} ({time.time() - t0:.0f}s)", flush=True)
    with open(os.path.join(stage, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(stage, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    os.rename(stage, out)
    print(f"{out}: {total / 1e9:.2f} GB in {time.time() - t0:.0f}s")


def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def bytes_per_token(model):
    """Weight bytes one decoded token reads: everything except the embedding table (one row)
    and the routed experts (top-k of E)."""
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    files = sorted(x for x in os.listdir(model) if x.endswith(".safetensors"))
    total = read = 0
    frac = c.get("num_experts_per_tok", 1) / c.get("num_experts", 1)
    for fn in files:
        for name, info in header(os.path.join(model, fn)).items():
            if name == "__metadata__":
                continue
            n = info["data_offsets"][1] - info["data_offsets"][0]
            total += n
            if name.startswith("model.embed_tokens.") and not c.get("tie_word_embeddings"):
                continue
            read += n * frac if ".switch_mlp." in name else n
    return total, int(read)


def bandwidth_gbps():
    import mlx.core as mx

    a = mx.random.uniform(shape=(1 << 30,), dtype=mx.float32)  # 4 GiB
    mx.eval(a)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        b = a + 0  # reads 4 GiB, writes 4 GiB
        mx.eval(b)
        dt = time.perf_counter() - t
        best = max(best, 2 * a.nbytes / dt / 1e9)
        del b
    return best


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("shape", choices=sorted(SHAPES))
    m.add_argument("out")
    m.add_argument("--dense", action="store_true", help="bf16 weights, no quantization")
    m.add_argument("--vocab", type=int, help="vocabulary size instead of the shape's")
    m.add_argument("--sparse", action="store_true",
                   help="headers only, data regions as holes (run with --random-weights)")
    m.add_argument("--damp-after", type=int, help="first layer whose o_proj/down_proj are damped")
    m.add_argument("--damp", type=float, default=1.0, help="factor on those projections")
    m.add_argument("--routing", choices=["uniform", "skewed"],
                   help="MoE shapes: routing like the CPU streaming benchmark's (see above)")
    fl = sub.add_parser("floor")
    fl.add_argument("model")
    fl.add_argument("--bandwidth", type=float, help="GB/s (measured when absent)")
    args = ap.parse_args()
    if args.cmd == "make":
        if args.routing and "num_experts" not in SHAPES[args.shape]:
            ap.error("--routing needs an MoE shape")
        make(args.shape, args.out, args.dense, args.vocab, args.sparse, args.damp_after, args.damp,
             args.routing)
    else:
        total, read = bytes_per_token(args.model)
        bw = args.bandwidth or bandwidth_gbps()
        print(json.dumps({"weight_bytes": total, "bytes_per_token": read, "bandwidth_gbps": bw,
                          "decode_floor_tps": bw * 1e9 / read}))


if __name__ == "__main__":
    sys.exit(main())
