"""Writes a deterministic random mlx-lm LoRA adapter for a Llama-type model folder: rank R on
every attention and MLP projection (q/k/v/o, gate/up/down) of every layer, for the runtime
adapter benchmark in docs/performance.md.

    python3 xtask/bench/make_lora.py MODEL_DIR OUT_DIR [--rank 16] [--scale 2.0] [--seed 0]

Needs numpy (the bench venv, target/bench/venv, has it). The shapes come from MODEL_DIR/config.json; lora_a ~ N(0, 1/in), lora_b ~
N(0, 0.01) (small enough that the greedy ids stay reasonable, large enough to change them).
"""

import argparse
import json
import struct
from pathlib import Path

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("out")
p.add_argument("--rank", type=int, default=16)
p.add_argument("--scale", type=float, default=2.0)
p.add_argument("--seed", type=int, default=0)
args = p.parse_args()

cfg = json.loads((Path(args.model) / "config.json").read_text())
hidden = cfg["hidden_size"]
inter = cfg["intermediate_size"]
heads = cfg["num_attention_heads"]
kv = cfg.get("num_key_value_heads", heads)
head_dim = cfg.get("head_dim", hidden // heads)
shapes = {  # module: (in, out)
    "self_attn.q_proj": (hidden, heads * head_dim),
    "self_attn.k_proj": (hidden, kv * head_dim),
    "self_attn.v_proj": (hidden, kv * head_dim),
    "self_attn.o_proj": (heads * head_dim, hidden),
    "mlp.gate_proj": (hidden, inter),
    "mlp.up_proj": (hidden, inter),
    "mlp.down_proj": (inter, hidden),
}
rng = np.random.default_rng(args.seed)
tensors = {}
for layer in range(cfg["num_hidden_layers"]):
    for module, (n_in, n_out) in shapes.items():
        name = f"model.layers.{layer}.{module}"
        tensors[f"{name}.lora_a"] = rng.normal(0, n_in**-0.5, (n_in, args.rank)).astype("<f4")
        tensors[f"{name}.lora_b"] = rng.normal(0, 0.01, (args.rank, n_out)).astype("<f4")

out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
header, offset = {}, 0
for name in sorted(tensors):
    t = tensors[name]
    header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
    offset += t.nbytes
blob = json.dumps(header, separators=(",", ":")).encode()
blob += b" " * (-len(blob) % 8)
with open(out / "adapters.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name in sorted(tensors):
        f.write(tensors[name].tobytes())
config = {
    "fine_tune_type": "lora",
    "num_layers": cfg["num_hidden_layers"],
    "lora_parameters": {"rank": args.rank, "scale": args.scale, "dropout": 0.0, "keys": list(shapes)},
}
(out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
print(f"{len(tensors) // 2} adapted projections, rank {args.rank}, {offset / 2**20:.1f} MiB -> {out}")
