#!/usr/bin/env bash
# Runs on the GPU machine, sourced, in the one device call that carries pack_one.sh's folder:
#   source .device/one/unpack_one.sh .device/one
# Afterwards LD_LIBRARY_PATH and PYTHONPATH point at $HOME/mlxcel-sp (MLX's CUDA libmlx.so, its
# headers, Python mlx and mlx-lm), as ../shared/device/README.md's two-call unpack.sh leaves them.
one=${1:?usage: source unpack_one.sh OUTDIR/one}
sp=$HOME/mlxcel-sp
if [ ! -f "$sp/mlx/lib/libmlx.so" ]; then
  mkdir -p "$sp/mlx/lib"
  xz -d -c "$one/libmlx.so.xz" > "$sp/mlx/lib/libmlx.so"
  tar xJf "$one/rest.tar.xz" -C "$sp"
  nv=$(python3 -c 'import nvidia, os; print(list(nvidia.__path__)[0])')
  ln -sfn "$nv" "$sp/nvidia"
fi
# MLX's CUTLASS kernels include crt/mma.h, missing from the machine's CUDA headers.
nvinc=$(readlink -f "$sp/nvidia")/cu13/include
if [ -d "$sp/crt" ] && [ ! -f "$nvinc/crt/mma.h" ]; then cp -r "$sp/crt" "$nvinc/"; fi
export LD_LIBRARY_PATH="$sp/mlx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$sp${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, "default device:", mx.default_device())'
