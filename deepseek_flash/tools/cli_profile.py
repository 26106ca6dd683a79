"""``deepseek-flash profile`` / ``flash-profiler --pid N --duration S --output F [--plot P]``."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..cli import bounded
from ..fsutil import atomic_write

SECONDS = bounded(float, 0, exclusive=True, what=" seconds")
PID = bounded(int, 1, what="", noun="a process id")

HELP = "collect one client process's per-block load latencies from the daemon over a window"
DESCRIPTION = """Ask the running daemon, every 0.2 s for DURATION seconds, for the block loads
(disk -> host arena) that process PID's requests caused: acquires, layer prefetch windows,
prefetch and load requests of every connection whose SO_PEERCRED pid is PID. Latency of a load =
engine submit -> completion seen by the daemon (microseconds; queueing behind the other reads of
the same batch included). Blocks already resident cause no load and no sample.

Writes OUTPUT (JSON): per block its block_load_latency_us list and p50/p95/p99, overall
percentiles (nearest rank), counts, bytes, the median per (layer, role), and the raw samples.
--plot draws that median as a layers x roles heatmap (PNG).

Exit status: 0 done, 2 error (no daemon, no client of PID connected, DURATION <= 0, OUTPUT or
PLOT in a directory that does not exist)."""


def add_arguments(parser) -> None:
    parser.add_argument("--pid", type=PID, required=True, metavar="PID",
                        help="process id of the client to profile (it must be connected to the daemon)")
    parser.add_argument("--duration", type=SECONDS, required=True, metavar="S",
                        help="length of the collection window in seconds (> 0)")
    parser.add_argument("--output", type=Path, required=True, metavar="FILE",
                        help="profile JSON to write (its directory must exist; replaced atomically)")
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG",
                        help="also draw a heatmap (layers x roles, colour = median latency) to PNG")
    parser.add_argument("--socket", type=Path, default=None, metavar="PATH",
                        help="daemon control socket (default: $DEEPSEEK_FLASH_SOCKET or "
                             "/run/deepseek_flash/control.sock)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _check_writable(flag: str, path: Path) -> str | None:
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        return f"{flag} {path}: directory {parent} does not exist"
    if not os.access(parent, os.W_OK):
        return f"{flag} {path}: directory {parent} is not writable"
    if path.is_dir():
        return f"{flag} {path}: is a directory"
    return None


def run(args) -> int:
    from tqdm import tqdm

    from .. import paths
    from ..ops.common import connect
    from .profiler import collect, plot, summarize

    for flag, path in (("--output", args.output), ("--plot", args.plot)):
        problem = path is not None and _check_writable(flag, path)
        if problem:
            print(f"deepseek-flash {args.verb}: error: {problem}", file=sys.stderr)
            return 2
    args.runtime_dir = None
    if args.socket is None:
        args.socket = paths.socket_path()
    with connect(args) as client:
        bar = tqdm(total=args.duration, desc=f"profile pid {args.pid}", unit="s", file=sys.stderr,
                   disable=args.quiet or not sys.stderr.isatty(),
                   bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} s")

        def on_start(first):
            print(f"profiling pid {args.pid} (clients {first['clients']}) for {args.duration:g} s",
                  file=sys.stderr, flush=True)

        def on_poll(elapsed):
            bar.n = elapsed
            bar.refresh()
        with bar:
            window = collect(client, args.pid, args.duration, on_poll=on_poll, on_start=on_start)
    profile = summarize(window)
    atomic_write(args.output, json.dumps(profile, indent=1).encode())
    if args.plot is not None:
        plot(profile, args.plot)
    overall = profile["overall_latency_us"]
    print(f"pid {args.pid}: {profile['sample_count']} block loads of {profile['block_count']} blocks "
          f"({profile['bytes_loaded']} bytes) in {args.duration:g} s; latency us p50 {overall['p50']} "
          f"p95 {overall['p95']} p99 {overall['p99']}")
    print(f"wrote {args.output}" + (f" and {args.plot}" if args.plot else ""))
    return 0
