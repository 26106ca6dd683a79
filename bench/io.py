"""Disk read benchmark: the IO engine against the raw limits measured in the same run.

Creates (or reuses) a file of --size in --dir, drops the page cache when root, then measures
`dd iflag=direct` at a few block sizes, a multi-threaded Python O_DIRECT reader (os.preadv into
mmap-aligned buffers), and the engine sweeping queue depth and request size on io_uring and on the
thread pool. Prints JSON; `engine_vs_best_raw` is the best engine rate over the best raw rate.

    python bench/io.py [--size 4GiB] [--dir DIR]

With ``--file`` (an existing file, e.g. a store's blocks.dat): the daemon's read shapes
(``--shapes``, the ``read_shape`` key's form; ``threads:8x4MiB`` on the engine's thread pool
instead of io_uring) against ``dd iflag=direct bs=4M``, in ``--rounds``
rounds of dd then each shape, each reading ``--bytes`` of the file at a region of its own (no
region read twice while the file has room; page cache dropped before each), into a populated
destination as the daemon's; ``shapes`` holds each one's median over dd's median.

    python bench/io.py --file STORE/blocks.dat --bytes 1GiB --shapes 32x1MiB,8x4MiB --rounds 2
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
import time

from _common import dd_read as bench_dd
from _common import drop_caches, gbps
from _common import python_direct_read as bench_python

from deepseek_flash import _core

UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
         "t": 1 << 40, "tib": 1 << 40}
EXTENT = 32 << 20          # engine extents: the size of a large weight block
DEST = 256 << 20           # engine destination window (extents land in it round-robin)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4GiB, 512MiB)")
    return int(m.group(1)) * UNITS[m.group(2).lower()]


def make_file(path: str, size: int) -> bool:
    if os.path.exists(path) and os.path.getsize(path) == size:
        return False
    chunk = os.urandom(64 << 20)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, len(chunk))
            f.write(chunk[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    return True


def bench_engine(path: str, size: int, backend: str, depth: int, request: int, dest,
                 offset: int = 0) -> float:
    n = size // EXTENT
    reqs = [_core.ReadRequest(path, offset + i * EXTENT, EXTENT, dest, (i * EXTENT) % DEST, block_id=i)
            for i in range(n)]
    with _core.IOEngine(backend, depth, request) as engine:
        t = time.perf_counter()
        comps = engine.wait(engine.submit(reqs))
        dt = time.perf_counter() - t
    bad = [c for c in comps if not c.ok]
    if bad:
        bad[0].raise_if_failed()
    return gbps(n * EXTENT, dt)


def median(values):
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def shapes_against_dd(path: str, nbytes: int, shapes: list[str], rounds: int) -> dict:
    """``--file``: each read shape against dd (4 MiB, one read at a time) on the same file, the
    regions taken in turn so that no region is read twice while the file has room."""
    from deepseek_flash.daemon.config import read_shape

    # "threads:8x4MiB": the engine's preadv thread pool instead of io_uring.
    parsed = {s: (s.partition(":")[0] if ":" in s else "io_uring",
                  *read_shape("--shapes", s.rpartition(":")[2])) for s in shapes}
    size = os.path.getsize(path)
    nbytes = min(nbytes, size) // EXTENT * EXTENT
    if nbytes == 0:
        raise SystemExit(f"{path}: smaller than one {EXTENT}-byte extent")
    regions = max(1, size // nbytes)
    dest = _core.HostArena(DEST, "bench-io")
    dest.populate()
    runs: dict[str, list[float]] = {"dd 1x4MiB": [], **{s: [] for s in shapes}}
    order = []
    turn = 0
    for _ in range(rounds):
        for name in runs:
            offset = (turn % regions) * nbytes
            turn += 1
            drop_caches()
            if name == "dd 1x4MiB":
                rate = bench_dd(path, nbytes, 4 << 20, skip=offset // (4 << 20))
            else:
                rate = bench_engine(path, nbytes, *parsed[name], dest, offset=offset)
            runs[name].append(rate)
            order.append([name, offset, rate])
            print(f"{name} @{offset >> 20} MiB: {rate} GB/s", file=sys.stderr, flush=True)
    dd = median(runs["dd 1x4MiB"])
    return {"file": path, "bytes_each": nbytes, "rounds": rounds, "regions": regions,
            "page_cache_dropped": drop_caches(), "runs": runs, "order": order, "dd_median_gbps": dd,
            "shapes": {s: {"median_gbps": round(median(runs[s]), 3),
                           "vs_dd": round(median(runs[s]) / dd, 3)} for s in shapes}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=parse_size, default=4 << 30, help="test file size (default 4GiB)")
    ap.add_argument("--dir", default="/var/tmp", help="directory on the disk to measure (default /var/tmp)")
    ap.add_argument("--file", help="an existing file: read shapes against dd on it (module docstring)")
    ap.add_argument("--bytes", type=parse_size, default=1 << 30, help="with --file: bytes a reading")
    ap.add_argument("--shapes", default="32x1MiB,16x4MiB,8x4MiB,4x4MiB,2x8MiB,1x4MiB",
                    help="with --file: the read shapes (DEPTHxSIZE, comma-separated)")
    ap.add_argument("--rounds", type=int, default=2, help="with --file: rounds of dd + every shape")
    ap.add_argument("--output", help="with --file: also write the JSON here")
    args = ap.parse_args(argv)
    if args.file:
        out = {"bench": "io_shapes", "date": datetime.date.today().isoformat(),
               "machine": {"host": platform.node(), "cpus": os.cpu_count(), "kernel": platform.release()},
               "unit": "GB/s", **shapes_against_dd(args.file, args.bytes,
                                                  [s for s in args.shapes.split(",") if s], args.rounds)}
        text = json.dumps(out, indent=2)
        print(text)
        if args.output:
            with open(args.output, "w") as f:
                f.write(text + "\n")
        return 0
    size = args.size // EXTENT * EXTENT
    if size == 0:
        ap.error(f"--size must be at least {EXTENT} bytes")
    path = os.path.join(args.dir, f"deepseek-flash-bench-{size}.dat")
    created = make_file(path, size)
    dropped = drop_caches()

    results: dict = {"dd": {}, "python_odirect": {}, "engine": {}}
    for bs in (1 << 20, 4 << 20, 16 << 20):
        results["dd"][f"bs={bs >> 20}M"] = bench_dd(path, size, bs)
    for threads in (4, 8):
        results["python_odirect"][f"threads={threads}"] = bench_python(path, size, threads)
    dest = _core.HostArena(DEST, "bench-io")
    dest.populate()
    for backend in ("io_uring", "threads"):
        for depth in (4, 16, 64):
            for request in (256 << 10, 1 << 20, 4 << 20):
                key = f"{backend} qd={depth} rs={request >> 10}K"
                results["engine"][key] = bench_engine(path, size, backend, depth, request, dest)

    best_raw_key, best_raw = max(
        [(f"dd {k}", v) for k, v in results["dd"].items()]
        + [(f"python_odirect {k}", v) for k, v in results["python_odirect"].items()], key=lambda kv: kv[1])
    best_engine_key, best_engine = max(results["engine"].items(), key=lambda kv: kv[1])
    out = {
        "bench": "io",
        "date": datetime.date.today().isoformat(),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "kernel": platform.release()},
        "file": path, "size_bytes": size, "file_created": created, "page_cache_dropped": dropped,
        "extent_bytes": EXTENT, "unit": "GB/s",
        "results": results,
        "best_raw": {"name": best_raw_key, "gbps": best_raw},
        "best_engine": {"name": best_engine_key, "gbps": best_engine},
        "engine_vs_best_raw": round(best_engine / best_raw, 3),
    }
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
