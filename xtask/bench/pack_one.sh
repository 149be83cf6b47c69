#!/usr/bin/env bash
# Packs MLX's CUDA build for ONE device call: libmlx.so with only the H100/H200's sm_90 code
# (cuda/prune_fatbin.py: 16 MB compressed instead of 70 MB), the rest of pack.sh's payload
# (Python mlx and mlx-lm, bundled libraries, crt headers) and unpack_one.sh.
#
#   usage: xtask/bench/pack_one.sh .device          (makes .device/one, ~23 MB)
#   device call, carry [".device/one", ".device/run"]:
#     source .device/one/unpack_one.sh .device/one >/dev/null 2>&1; bash .device/run/gpu_ab.sh
# With .device/run (~18 MB with the decode test and its fixtures) and the checkout without its
# tests/fixtures (xtask/bench/fixtures_aside.sh out), one call carries ~52 of its 64 MiB.
# If a kernel of the pruned library ever reports "no kernel image is available", fall back to
# ../shared/device/pack.sh's two calls.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:?usage: pack_one.sh OUTDIR}
cache=$HOME/.cache/mlxcel-device/${MLX_VERSION:-0.32.4}
# pack.sh downloads and compresses the wheels once (its cache); its two halves are not needed here.
[ -f "$cache/libmlx.so.xz" ] && [ -f "$cache/rest.tar.xz" ] || bash "$root/../shared/device/pack.sh" "$out"
mkdir -p "$out/one"
if [ ! -f "$cache/libmlx.sm90.so.xz" ]; then
  tmp=$(mktemp -d)
  xz -d -c "$cache/libmlx.so.xz" > "$tmp/libmlx.so"
  python3 "$here/cuda/prune_fatbin.py" "$tmp/libmlx.so" "$tmp/libmlx.sm90.so" 90
  xz -6 -T2 -c "$tmp/libmlx.sm90.so" > "$cache/libmlx.sm90.so.xz.tmp"
  mv "$cache/libmlx.sm90.so.xz.tmp" "$cache/libmlx.sm90.so.xz"
  rm -rf "$tmp"
fi
cp "$cache/libmlx.sm90.so.xz" "$out/one/libmlx.so.xz"
cp "$cache/rest.tar.xz" "$here/unpack_one.sh" "$out/one/"
grep -qx '/.device/' "$root/.git/info/exclude" 2>/dev/null || echo '/.device/' >> "$root/.git/info/exclude"
du -sh "$out/one"
