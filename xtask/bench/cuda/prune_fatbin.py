#!/usr/bin/env python3
"""Keeps one GPU architecture's code in a CUDA shared library's embedded fat binaries.

MLX's CUDA wheel (mlx-cuda-13) ships libmlx.so with every kernel compiled for sm_75, 80, 90,
100, 120 and 121 plus compute_120 PTX: 67 MB of its 146 MB, which is why the library needs two
device calls to carry (70 MB compressed against 64 MiB a call). The H100 and H200 run sm_90
code only. Each fat binary in the `.nv_fatbin` section is rewritten in place to hold just its
sm_90 ELF entry: it keeps its address (the registration records in `.nvFatBinSegment` point
at it), its header's size field says the smaller size, and the bytes it no longer uses become
zeros, which compress to nothing. No other byte of the file changes (checked below).

    usage: prune_fatbin.py SRC DST [ARCH=90]
"""
import struct
import subprocess
import sys

FATBIN_MAGIC = 0xBA55ED50
ELF_ENTRY = 2  # entry kinds: 1 = PTX, 2 = ELF (cubin)


def section(path, name):
    """(file offset, size) of section `name`, from readelf."""
    for line in subprocess.check_output(["readelf", "-S", "-W", path], text=True).splitlines():
        if "]" in line and line.split("]", 1)[1].split()[:1] == [name]:
            fields = line.split("]", 1)[1].split()
            return int(fields[3], 16), int(fields[4], 16)
    sys.exit(f"prune_fatbin: {path} has no {name} section")


def fatbins(data, start, end):
    """Yields (offset, header size, entries size, [(kind, arch, entry bytes)]) of each fat binary."""
    pos = start
    while pos < end:
        magic, _version, header, size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # fat binaries sit 8-byte aligned, with padding between them
            continue
        entries, p = [], pos + header
        while p < pos + header + size:
            kind, _flags, entry_header, payload = struct.unpack_from("<HHIQ", data, p)
            arch = struct.unpack_from("<I", data, p + 28)[0]
            entries.append((kind, arch, bytes(data[p : p + entry_header + payload])))
            p += entry_header + payload
        if p != pos + header + size:
            sys.exit(f"prune_fatbin: entries of the fat binary at {pos:#x} overrun its size")
        yield pos, header, size, entries
        pos += header + size


def main():
    src, dst = sys.argv[1], sys.argv[2]
    arch = int(sys.argv[3]) if len(sys.argv) > 3 else 90
    original = open(src, "rb").read()
    data = bytearray(original)
    start, size = section(src, ".nv_fatbin")
    kept = zeroed = count = 0
    for pos, header, entries_size, entries in list(fatbins(original, start, start + size)):
        chosen = [e for kind, a, e in entries if kind == ELF_ENTRY and a == arch]
        if len(chosen) != 1:
            found = sorted((kind, a) for kind, a, _ in entries)
            sys.exit(f"prune_fatbin: the fat binary at {pos:#x} has no single sm_{arch} ELF: {found}")
        body = chosen[0]
        data[pos + header : pos + header + entries_size] = body + bytes(entries_size - len(body))
        struct.pack_into("<Q", data, pos + 8, len(body))
        kept, zeroed, count = kept + len(body), zeroed + entries_size - len(body), count + 1
    # What was written: every fat binary holds its one entry; nothing outside them changed.
    rewritten = list(fatbins(data, start, start + size))
    assert len(rewritten) == count and all(
        [(k, a) for k, a, _ in e] == [(ELF_ENTRY, arch)] for _, _, _, e in rewritten
    )
    changed = [i for i in range(0, len(data), 1 << 16) if data[i : i + (1 << 16)] != original[i : i + (1 << 16)]]
    assert all(start <= i + (1 << 16) and i < start + size for i in changed), "bytes outside .nv_fatbin changed"
    open(dst, "wb").write(data)
    print(f"{count} fat binaries: kept {kept} bytes of sm_{arch} code, zeroed {zeroed}")


if __name__ == "__main__":
    main()
