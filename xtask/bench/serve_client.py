#!/usr/bin/env python3
"""Serving throughput: two OpenAI-compatible servers already running, driven with 1 and 8
concurrent greedy chat requests (128 tokens each), runs alternating between them; prints a
markdown table of aggregate tok/s (completion tokens of a run / its wall time, prefill
included). Standard library only: it runs on the GPU machine (xtask/bench/gpu_serve.sh); the
CPU machine uses `cargo xtask bench --serve`, which does the same in Rust.

  serve_client.py NAME_A PORT_A NAME_B PORT_B [--runs N] [--max-tokens N]
"""
import argparse
import json
import statistics
import threading
import time
import urllib.request

SUBJECTS = [
    "a dragon who collects maps", "a lighthouse keeper on Mars", "two rival bakers in Lyon",
    "a robot learning to paint", "a river that flows uphill", "the last library on Earth",
    "a cat who runs a train station", "an orchestra of clocks",
]


def request(port, subject, max_tokens):
    body = json.dumps({
        "messages": [{"role": "user", "content": f"Write a long story about {subject}."}],
        "max_tokens": max_tokens, "temperature": 0.0,
    }).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.load(r)["usage"]["completion_tokens"]


def measure(port, clients, round_, max_tokens):
    results = [0] * clients
    barrier = threading.Barrier(clients + 1)

    def run(i):
        barrier.wait()
        results[i] = request(port, SUBJECTS[(i + round_) % len(SUBJECTS)], max_tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return sum(results), time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("name_a")
    ap.add_argument("port_a", type=int)
    ap.add_argument("name_b")
    ap.add_argument("port_b", type=int)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--clients", default="1,8", help="comma-separated client counts")
    a = ap.parse_args()
    servers = [(a.name_a, a.port_a), (a.name_b, a.port_b)]
    # Warm-up: kernels compiled on first use (MLX's CUDA backend JIT-compiles some, for tens of
    # seconds), at both batch shapes.
    for _, port in servers:
        measure(port, 1, 0, 32)
        measure(port, 8, 0, 32)
    rows = []
    for clients in [int(c) for c in a.clients.split(",")]:
        tps = {name: [] for name, _ in servers}
        for r in range(a.runs):
            for name, port in servers:
                tokens, wall = measure(port, clients, r, a.max_tokens)
                print(f"{name} x{clients} run {r}: {tokens} tokens in {wall:.2f} s", flush=True)
                tps[name].append(tokens / wall)
        rows.append((clients, statistics.median(tps[a.name_a]), statistics.median(tps[a.name_b])))
    print(f"\n| clients | {a.name_a} tok/s | {a.name_b} tok/s | ratio |\n|---|---|---|---|")
    for clients, x, y in rows:
        print(f"| {clients} | {x:.1f} | {y:.1f} | {x / y:.2f}x |")
    (c1, a1, b1), (c8, a8, b8) = rows[0], rows[-1]
    print(f"\n{c8} clients vs one: {a.name_a} {a8 / a1:.2f}x, {a.name_b} {b8 / b1:.2f}x")


if __name__ == "__main__":
    main()
