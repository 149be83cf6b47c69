"""Builds a synthetic benchmark checkpoint from its plan (`cargo xtask synth-plan NAME [--bits B]`)
with Python MLX, on a machine without the Rust toolchain (the GPU machine). Same config, tensor
names, shapes, fills and quantization as `xtask/src/bench/synth.rs` writes; other random values.

    python3 make_plan_model.py PLAN.json OUTDIR
"""
import json
import os
import sys

import mlx.core as mx


def main():
    plan_path, out = sys.argv[1], sys.argv[2]
    with open(plan_path) as f:
        plan = json.load(f)
    if os.path.exists(os.path.join(out, "config.json")):
        print(f"{out}: already built")
        return
    os.makedirs(out, exist_ok=True)
    dtype = getattr(mx, plan["dtype"])
    half_width = plan["std"] * 3 ** 0.5
    tensors = {}
    mx.random.seed(7)
    for t in plan["tensors"]:
        shape = t["shape"]
        if t["fill"] == "ones":
            base = mx.ones(shape, dtype=mx.float32)
        else:
            base = mx.random.uniform(-half_width, half_width, shape)
        base = base.astype(dtype)
        q = t["quantization"]
        if q is None:
            tensors[t["name"]] = base
        else:
            w, scales, biases = mx.quantize(base, group_size=q["group_size"], bits=q["bits"])
            tensors[t["name"] + ".weight"] = w
            tensors[t["name"] + ".scales"] = scales
            tensors[t["name"] + ".biases"] = biases
        mx.eval(list(tensors.values())[-3:])
    mx.save_safetensors(os.path.join(out, "model.safetensors"), tensors, metadata={"format": "mlx"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(plan["config"], f, indent=2)
    print(f"{out}: {len(tensors)} tensors")


if __name__ == "__main__":
    main()
