#!/usr/bin/env python3
"""Registers and instruction counts by issue pipe of compiled kernels, no GPU needed.

    python3 xtask/bench/cuda/sass_counts.py CUBIN... [--kernel SUBSTRING] [--all]

CUBIN: e.g. crates/mlxcel-core/kernels/prebuilt/mlxcel_dec_attention_bfloat16-sm90-*.cubin (the
shipped modules; `prebuild_cubins_for_sm90` writes them for changed sources). Uses cuobjdump from
the `nvidia-cuda-cuobjdump` and `nvidia-cuda-nvdisasm` wheels (installed once under
~/.cache/mlxcel/cuobjdump). Counts are
static (every unrolled copy of a loop counts), so compare kernels before and after a change,
not against a runtime. Session 30 found the 4-bit decode GEMV bound by its integer pipe this
way: LOP3/SHF/IADD3 issue at half the rate of FFMA on sm_80/sm_90.
"""
import collections
import glob
import os
import re
import subprocess
import sys

# cuobjdump -sass runs nvdisasm from its own folder (both wheels put it in nvidia/cu13/bin).
WHEELS = ["nvidia-cuda-cuobjdump==13.5.37", "nvidia-cuda-nvdisasm==13.5.37"]
# Where each opcode issues (sm_80/sm_90): the integer ALU pipe at 16 lanes a cycle per SM
# quarter, the FMA pipes at 32 (IMAD on the heavy half only), conversions at a fraction.
PIPES = {
    "int": {"LOP3", "SHF", "IADD3", "PRMT", "ISETP", "LEA", "SEL", "IABS", "IMNMX", "FLO", "POPC",
            "BMSK", "SGXT", "VIADD"},
    "fma": {"FFMA", "FMUL", "FADD", "IMAD", "HFMA2", "HADD2", "HMUL2", "FSEL", "FSETP", "FMNMX"},
    "conv": {"F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP", "MUFU"},
    "mem": {"LDG", "STG", "LDS", "STS", "LDC", "LD", "ST", "ATOMG", "RED", "LDGSTS", "LDSM"},
    "tensor": {"HMMA", "IMMA"},
}


def cuobjdump():
    cache = os.path.join(os.environ.get("MLXCEL_CACHE_DIR", os.path.expanduser("~/.cache/mlxcel")), "cuobjdump")
    bin_dir = os.path.join(cache, "nvidia", "cu13", "bin")
    if not all(os.path.exists(os.path.join(bin_dir, t)) for t in ("cuobjdump", "nvdisasm")):
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade",
                        "--target", cache] + WHEELS, check=True)
    for t in ("cuobjdump", "nvdisasm"):
        os.chmod(os.path.join(bin_dir, t), 0o755)
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    return os.path.join(bin_dir, "cuobjdump")


def main():
    args = sys.argv[1:]
    kernel = args[args.index("--kernel") + 1] if "--kernel" in args else ""
    show_all = "--all" in args
    files = [f for a in args if a.endswith(".cubin") for f in glob.glob(a)]
    if not files:
        sys.exit(__doc__)
    tool = cuobjdump()
    for path in files:
        usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
        regs = dict(re.findall(r"Function (\w+):\s*\n\s*REG:(\d+)", usage))
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
        counts, name = {}, None
        for line in sass.splitlines():
            m = re.search(r"Function : (\w+)", line)
            if m:
                name = m.group(1)
                counts[name] = collections.Counter()
                continue
            m = re.match(r"\s+/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", line)
            if m and name:
                counts[name][m.group(1)] += 1
        print(os.path.basename(path))
        for fn, c in sorted(counts.items()):
            if kernel not in fn:
                continue
            by_pipe = {p: sum(c[o] for o in ops) for p, ops in PIPES.items()}
            total = sum(c.values())
            print("  %-44s regs %4s  instructions %5d  " % (fn[:44], regs.get(fn, "?"), total)
                  + "  ".join("%s %d" % kv for kv in by_pipe.items()))
            if show_all:
                print("    " + ", ".join("%s %d" % kv for kv in c.most_common(16)))


if __name__ == "__main__":
    main()
