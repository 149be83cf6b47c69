#!/usr/bin/env python3
"""Compile mlxcel's CUDA module with NVRTC alone (no GPU, no driver) and print the log.

    pip install nvidia-cuda-nvrtc-cu12          # e.g. into a venv
    cargo run -p mlxcel-core --example cuda_kernels -- --source > /tmp/mlxcel.cu
    python3 xtask/bench/cuda/nvrtc_check.py /tmp/mlxcel.cu [--arch 90] [--ptx out.ptx]

Compiles the source twice, as mlxcel does on a GPU machine (cpp/cuda_compile.cc:
`--gpu-architecture=sm_<arch> --std=c++17`, a cubin) and once more to compute_<arch> PTX;
prints each log (warnings included) and, with --ptx, writes the PTX (to read the generated
instructions, e.g. that mma/ldmatrix/cp.async came out as intended). Exit status 1 when either
compile fails or logs a warning. `-` reads the source from stdin. The library is found in the
installed `nvidia.cuda_nvrtc` package, or at NVRTC_LIB.
"""

import argparse
import ctypes
import os
import sys


def load_nvrtc():
    path = os.environ.get("NVRTC_LIB")
    if not path:
        import nvidia.cuda_nvrtc  # from the nvidia-cuda-nvrtc-cu12 wheel

        base = list(nvidia.cuda_nvrtc.__path__)[0]
        path = os.path.join(base, "lib", "libnvrtc.so.12")
    return ctypes.CDLL(path)


def compile_once(lib, source, name, options, want_ptx):
    prog = ctypes.c_void_p()
    check = lambda rc, what: rc == 0 or sys.exit(f"{what}: NVRTC error {rc}")
    check(
        lib.nvrtcCreateProgram(
            ctypes.byref(prog), source.encode(), name.encode(), 0, None, None
        ),
        "nvrtcCreateProgram",
    )
    opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    rc = lib.nvrtcCompileProgram(prog, len(options), opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    out = None
    if rc == 0:
        if want_ptx:
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetPTX(prog, buf)
            out = buf.value.decode()
        else:
            lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetCUBIN(prog, buf)
            out = buf.raw
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace").strip(), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("source", help="the module source (`-`: stdin)")
    ap.add_argument("--arch", default="90")
    ap.add_argument("--ptx", help="write the compute_<arch> PTX here")
    ap.add_argument("--cubin", help="write the sm_<arch> cubin here")
    args = ap.parse_args()
    source = sys.stdin.read() if args.source == "-" else open(args.source).read()
    lib = load_nvrtc()
    failed = False
    for target, want_ptx in ((f"sm_{args.arch}", False), (f"compute_{args.arch}", True)):
        options = [f"--gpu-architecture={target}", "--std=c++17"]
        rc, log, out = compile_once(lib, source, "mlxcel_all.cu", options, want_ptx)
        status = "ok" if rc == 0 else f"FAILED (NVRTC error {rc})"
        print(f"== {target}: {status}" + (f", {len(out)} bytes" if out else ""))
        if log:
            print(log)
        failed |= rc != 0 or "warning" in log
        if out is not None and want_ptx and args.ptx:
            open(args.ptx, "w").write(out)
        if out is not None and not want_ptx and args.cubin:
            open(args.cubin, "wb").write(out)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
