#!/usr/bin/env python3
"""Helpers of gpu_stream.sh (expert streaming on the GPU machine; Python standard library only).

  stream_gpu.py prompt REFERENCE.safetensors   a fixture's reference prompt ids, comma-separated
  stream_gpu.py arena MODELDIR SHARE           arena bytes for SHARE (a fraction of each layer's
      routed experts, or `topk`: the router's top-k, the fewest slots a layer can work with),
      from the prepared expert-stream manifest; prints "BYTES SLOTS EXPERTS"
  stream_gpu.py same A.npy B.npy               exit 0 when the two float32 arrays are equal bit
      for bit; otherwise prints the largest difference and exits 1
  stream_gpu.py floor MODELDIR THREADS         sequential O_DIRECT reads of the stream files
      (8 MiB pieces, THREADS at a time, page cache bypassed): GB/s, the disk floor
"""
import json
import math
import mmap
import os
import struct
import sys
import threading
import time


def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), 8 + n


def prompt(ref):
    meta, base = header(ref)
    info = meta["prompt_ids"]
    assert info["dtype"] == "I32", info
    start, stop = info["data_offsets"]
    with open(ref, "rb") as f:
        f.seek(base + start)
        data = f.read(stop - start)
    print(",".join(str(v) for v in struct.unpack(f"<{len(data) // 4}i", data)))


def arena(model, share):
    with open(os.path.join(model, "expert-stream", "manifest.json")) as f:
        layers = json.load(f)["layers"]
    with open(os.path.join(model, "config.json")) as f:
        top_k = json.load(f)["num_experts_per_tok"]
    experts = max(l["experts"] for l in layers)
    if share == "topk":
        slots = top_k
    else:
        slots = min(experts, max(top_k, math.ceil(experts * float(share))))
    per_slot = sum(l["expert_stride"] for l in layers)
    print(per_slot * slots, slots, experts)


def load_npy(path):
    with open(path, "rb") as f:
        data = f.read()
    assert data[:6] == b"\x93NUMPY", path
    n = struct.unpack("<H", data[8:10])[0]
    head = data[10:10 + n].decode()
    assert "'<f4'" in head, head
    return data[10 + n:]


def same(a, b):
    x, y = load_npy(a), load_npy(b)
    if x == y:
        return 0
    if len(x) != len(y):
        print(f"different sizes: {len(x)} vs {len(y)} bytes")
        return 1
    fx = struct.unpack(f"<{len(x) // 4}f", x)
    fy = struct.unpack(f"<{len(y) // 4}f", y)
    diff = max(abs(p - q) for p, q in zip(fx, fy))
    scale = max(abs(p) for p in fx)
    print(f"max |diff| {diff:.3g} (max |logit| {scale:.3g}), "
          f"{sum(p != q for p, q in zip(fx, fy))} of {len(fx)} differ")
    return 1


def floor(model, threads):
    d = os.path.join(model, "expert-stream")
    files = sorted(os.path.join(d, f) for f in os.listdir(d) if not f.endswith(".json"))
    piece = 8 << 20
    jobs = [(p, off) for p in files for off in range(0, os.path.getsize(p) // piece * piece, piece)]
    lock, total = threading.Lock(), [0]

    def work():
        buf = mmap.mmap(-1, piece)
        fds = {}
        while True:
            with lock:
                if not jobs:
                    break
                path, off = jobs.pop()
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY | os.O_DIRECT)
            n = os.preadv(fd, [buf], off)
            with lock:
                total[0] += n
        for fd in fds.values():
            os.close(fd)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    print(f"{total[0] / (time.perf_counter() - t0) / 1e9:.2f}")


def main():
    cmd, *args = sys.argv[1:]
    if cmd == "prompt":
        prompt(*args)
    elif cmd == "arena":
        arena(*args)
    elif cmd == "same":
        return same(*args)
    elif cmd == "floor":
        floor(args[0], int(args[1]))
    else:
        sys.exit(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
