"""``deepseek-flash health`` / ``ssd-health-checker --device DEV --pattern flash_workload``."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys

from ..cli import bounded

POSITIVE_INT = bounded(int, 1)
SECONDS = bounded(float, 0, exclusive=True, what=" seconds")

HELP = "replay the daemon's read pattern on a device or file (read only) and check its settings"
DESCRIPTION = """Read DEV (a block device, or a regular file on the disk to check) the way the daemon
does: block-sized O_DIRECT reads, QUEUE_DEPTH in flight, through the native IO engine. DEV is opened
read only and never written. Reports throughput, per-request latency percentiles (submit to
completion, see docs/tools.md), io_completion_variance as the seeds' percentage (coefficient of
variation of the per-request latency: < 5% stable, 5-10% variable, > 10% unstable; the variance in
us^2 too, and in --json both), and the block device stack behind DEV from sysfs/udev (model, serial, firmware, IO scheduler,
nr_requests, rotational; md/dm slaves). Warns about mixed firmware behind one md/dm device, NVMe
APST enabled, an IO scheduler other than none, and nr_requests below the queue depth.

Exit status: 0 no warnings, 1 warnings printed, 2 error (missing or unreadable DEV, bad value)."""


def _block_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        value = int(t[:-1]) * units[t[-1]] if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1M, 4096)") from None
    if value < 4096 or value % 4096:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 4096 bytes, got {text}")
    return value


def add_arguments(parser) -> None:
    from .health import DEFAULT_BLOCK_SIZE, DEFAULT_QUEUE_DEPTH, PATTERNS

    parser.add_argument("--device", required=True, metavar="DEV",
                        help="block device (/dev/nvme0n1) or a regular file on the disk to check; "
                             "opened read only")
    parser.add_argument("--pattern", choices=PATTERNS, default="flash_workload",
                        help="flash_workload (default; = random: block-aligned random offsets, the "
                             "daemon's demand/prefetch reads) or sequential (forward, a cold load)")
    parser.add_argument("--queue-depth", "--queue_depth", dest="queue_depth", type=POSITIVE_INT,
                        default=DEFAULT_QUEUE_DEPTH, metavar="N",
                        help=f"requests in flight (default {DEFAULT_QUEUE_DEPTH}, the daemon's)")
    parser.add_argument("--block-size", "--block_size", dest="block_size", type=_block_size,
                        default=DEFAULT_BLOCK_SIZE, metavar="S",
                        help="bytes per read, a multiple of 4096; suffixes K, M, G (default 1M)")
    parser.add_argument("--duration", type=SECONDS, default=5.0, metavar="SECONDS",
                        help="how long to read, seconds (default 5)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--sysfs-root", "--sysfs_root", dest="sysfs_root", default="/sys",
                        metavar="DIR", help="where sysfs is mounted (default /sys; tests use a fake tree)")


@contextlib.contextmanager
def _seconds_bar(total: float, quiet: bool):
    if quiet or not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm
    with tqdm(total=total, desc="health", unit="s", file=sys.stderr, leave=False,
              bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} s") as bar:
        yield bar.update


def _text(report: dict) -> str:
    stack, w = report["stack"], report["workload"]
    lines = [f"target: {report['target']} ({stack['target_kind']}, {report['size_bytes']} bytes)"]
    if stack["device"]:
        part = f" (partition {stack['partition']})" if stack["partition"] else ""
        lines.append(f"block device: {stack['device']}{part}")
        for d in stack["leaves"]:
            apst = "" if d["apst_enabled"] is None else f" apst={'on' if d['apst_enabled'] else 'off'}"
            lines.append(f"  disk {d['name']} [{d['kind']}] model={d['model'] or '?'} "
                         f"serial={d['serial'] or '?'} firmware={d['firmware'] or '?'} "
                         f"scheduler={d['scheduler'] or '?'} nr_requests={d['nr_requests'] or '?'} "
                         f"rotational={'?' if d['rotational'] is None else int(d['rotational'])}{apst}")
    for note in stack["notes"]:
        lines.append(f"note: {note}")
    lat = w["latency_us"]
    lines += [
        (f"workload: {w['pattern']}, queue depth {w['queue_depth']}, block size {w['block_size']}, "
         f"{w['backend']}{', O_DIRECT' if w['direct'] else ', buffered (O_DIRECT refused)'}"),
        (f"  {w['requests']} reads, {w['bytes']} bytes in {w['duration_s']} s: "
         f"{w['throughput_mb_s']} MB/s, {w['iops']} IOPS"),
        (f"  latency us: p50 {lat['p50']}  p95 {lat['p95']}  p99 {lat['p99']}  max {lat['max']}  "
         f"mean {lat['mean']}"),
        (f"  io_completion_variance: {w['io_completion_variance_pct']}% "
         f"({w['io_completion_verdict']}: < 5% stable, 5-10% variable, > 10% unstable; "
         f"{w['io_completion_variance']} us^2, cv {w['latency_cv']})"),
    ]
    for warning in report["pitfalls"]:
        lines.append(f"WARNING: {warning}")
    if not report["pitfalls"]:
        lines.append("no known pitfalls found")
    return "\n".join(lines)


def run(args) -> int:
    from .health import health

    with _seconds_bar(args.duration, args.quiet) as progress:
        report = health(args.device, pattern=args.pattern, queue_depth=args.queue_depth,
                        block_size=args.block_size, duration=args.duration,
                        sysfs_root=args.sysfs_root, progress=progress)
    print(json.dumps(report, indent=2) if args.json else _text(report))
    return 1 if report["pitfalls"] else 0
