"""Sums an `ncu --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum` report by kernel.

Usage: python3 ncu_sum.py REPORT.csv

One line per (kernel name, grid): launches, mean and total time, share of the profiled time,
bytes read from DRAM per launch and the rate that makes. ncu serialises kernels and adds a fixed
cost to each, so the total is above what the same launches take in a CUDA graph.
"""
import collections
import csv
import sys


def main(path):
    lines = open(path).read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    rows = list(csv.reader(lines[start:]))
    head, rows = rows[0], rows[1:]
    kernel, metric = head.index("Kernel Name"), head.index("Metric Name")
    value, unit, grid = head.index("Metric Value"), head.index("Metric Unit"), head.index("Grid Size")
    times = collections.defaultdict(list)
    dram = collections.defaultdict(list)
    to_us = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    to_bytes = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}
    for r in rows:
        v = float(r[value].replace(",", ""))
        key = r[kernel] + " " + r[grid]
        if r[metric] == "gpu__time_duration.sum":
            times[key].append(v * to_us.get(r[unit], 1.0))
        else:
            dram[key].append(v * to_bytes.get(r[unit], 1.0))
    total = sum(sum(t) for t in times.values())
    for key, t in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        mean = sum(t) / len(t)
        read = sum(dram[key]) / len(dram[key]) if dram[key] else 0.0
        print("%-58s n=%3d mean %7.2f us total %7.1f us (%4.1f%%) %.2f MB/launch %.2f TB/s"
              % (key, len(t), mean, sum(t), 100 * sum(t) / total, read / 1e6, read / mean / 1e6))
    print("total %.1f us" % total)


if __name__ == "__main__":
    main(sys.argv[1])
