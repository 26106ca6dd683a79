"""``deepseek-flash repair`` / ``deepseek-flash-repair --model_path P``: rebuild flash_metadata.bin."""
from __future__ import annotations

import os
import sys
from pathlib import Path

HELP = "rebuild a store's flash_metadata.bin from the inline block headers"
DESCRIPTION = """Check a store's flash_metadata.bin and, when it is missing or corrupt (or with
--force_rebuild, always), rebuild it by scanning the data file for inline block headers. When the
metadata reads fine, every block's data is checked instead (crc32c, truncation, like `verify`).
Block data is never modified; the new metadata replaces the old atomically and only when every
block was found. Damaged data cannot be repaired, only named: re-pack the model.

--ssd_device DEV repairs the stores on one disk (those given, else every store flash.json names
that lies on DEV), under DEV's lock, and refuses while the running daemon has a model open there.

Exits 0 when the store is whole (metadata and every block's data), 1 when blocks are bad or
missing (named), 2 on errors."""


def add_arguments(parser) -> None:
    parser.add_argument("path", metavar="PATH", nargs="?", help="store directory")
    parser.add_argument("--model_path", "--model-path", dest="model_path", metavar="PATH",
                        help="store directory (the operators' spelling)")
    parser.add_argument("--force_rebuild", "--force-rebuild", dest="force_rebuild",
                        action="store_true", help="rebuild even when the metadata reads fine")
    parser.add_argument("--quiet", action="store_true", help="print only problems")
    parser.add_argument("--ssd_device", "--ssd-device", dest="ssd_device", metavar="DEV",
                        help="repair the stores on this disk (e.g. /dev/nvme0n1): the ones given, else "
                             "every store flash.json names there; takes DEV's lock and refuses while "
                             "the running daemon has a model open on DEV")
    parser.add_argument("--config", type=Path, default=None, metavar="FILE",
                        help="flash.json listing the stores (with --ssd_device; default: the system config)")
    parser.add_argument("--runtime-dir", "--runtime_dir", dest="runtime_dir", type=Path, default=None,
                        metavar="DIR", help="the daemon's status tree, where DEV's lock lives too "
                                            "(with --ssd_device; default: /run/deepseek_flash)")


def run(args) -> int:
    if args.path is not None and args.model_path is not None:
        print("deepseek-flash repair: give the store as PATH or --model_path PATH, not both", file=sys.stderr)
        return 2
    if args.ssd_device is not None:
        return _repair_device(args)
    if args.path is None and args.model_path is None:
        print("deepseek-flash repair: give the store as PATH or --model_path PATH (or a disk as "
              "--ssd_device DEV)", file=sys.stderr)
        return 2
    return _repair_one(Path(args.path or args.model_path), args)


def _repair_device(args) -> int:
    from .. import paths
    from ..daemon.config import FlashConfig
    from ..errors import StoreInUse
    from .repair_device import daemon_models_on, lock_device, stores_to_repair

    given = [Path(p) for p in (args.path, args.model_path) if p is not None]
    config = None if given else FlashConfig.load(args.config or paths.config_path(),
                                                 required=args.config is not None)
    devnum, stores = stores_to_repair(args.ssd_device, given, config)
    runtime = args.runtime_dir or paths.client_runtime_dir()
    lock_fd = lock_device(devnum, runtime)
    try:
        pid, names = daemon_models_on(devnum, runtime)
        if names:
            raise StoreInUse(f"--ssd_device {args.ssd_device} ({devnum}) is in use by the running "
                             f"deepseek-flashd (pid {pid}): model(s) {', '.join(names)} open on it; unload "
                             f"them first (deepseek-flash unload {names[0]}) or stop the daemon",
                             device=args.ssd_device, models=names)
        if not stores:
            print(f"{args.ssd_device} ({devnum}): no store of the configuration lies on this disk; "
                  f"nothing to repair")
            return 0
        return max(_repair_one(store, args) for store in stores)
    finally:
        os.close(lock_fd)


def _repair_one(path: Path, args) -> int:
    from .cli_common import byte_progress
    from .repair import repair

    total = sum(p.stat().st_size for p in path.glob("blocks*.dat")) if path.is_dir() else None
    with byte_progress(total, "repair", args.quiet) as progress:
        report = repair(path, force_rebuild=args.force_rebuild, progress=progress)
    for offset, reason in report.skipped:
        print(f"{path}: skipped damaged header slot at offset {offset}: {reason}", file=sys.stderr)
    for block_id, reason in report.bad:
        print(f"{path}: block {block_id} cannot be recovered: {reason}", file=sys.stderr)
    if report.action == "none" and report.bad:
        ids = sorted({b for b, _ in report.bad})
        print(f"{path}: metadata OK ({report.blocks} blocks), but the data of {len(ids)} block(s) is "
              f"damaged ({', '.join(map(str, ids))}); repair rebuilds metadata only and cannot fix "
              f"block data: re-pack the model (deepseek-flash pack SRC {path} --force)", file=sys.stderr)
        return 1
    if report.missing:
        print(f"{path}: no valid header found for block(s) {', '.join(map(str, report.missing))}",
              file=sys.stderr)
    if report.action == "refused":
        print(f"{path}: metadata NOT rewritten: {report.blocks} blocks found, "
              f"{len(report.missing)} missing", file=sys.stderr)
        return 1
    if not args.quiet:
        if report.action == "none":
            print(f"{path}: metadata OK and the data of all {report.blocks} blocks checks (crc32c); "
                  f"nothing to do (--force_rebuild rebuilds anyway)")
        else:
            print(f"{path}: rebuilt flash_metadata.bin from {report.blocks} block headers "
                  f"({report.reason})")
    return 0 if report.ok else 1
