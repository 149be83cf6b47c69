#!/usr/bin/env bash
# The checkout that travels with a device call may hold 64 MiB; tests/fixtures alone is ~78 MB
# (the GPU runs read the copies gpu.sh stage puts in .device/run). `out` moves it beside the
# checkout for the call, `in` puts it back. Never commit while it is out.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
aside="$root/../.fixtures-aside"
case "${1:-}" in
  out) if [ -d "$root/tests/fixtures" ]; then mkdir -p "$aside" && mv "$root/tests/fixtures" "$aside/fixtures"; fi ;;
  in) if [ -d "$aside/fixtures" ] && [ ! -e "$root/tests/fixtures" ]; then mv "$aside/fixtures" "$root/tests/fixtures"; fi ;;
  *) echo "usage: fixtures_aside.sh out|in" >&2; exit 2 ;;
esac
