"""``deepseek-flash defrag`` / ``deepseek-flash-defrag --model_path P``: re-lay out a store's blocks."""
from __future__ import annotations

import json
import sys

HELP = "rewrite a store's block layout by access frequency (crash-safe)"
DESCRIPTION = """Rewrite the store's data file so the blocks with the highest access_freq (recorded
in flash_metadata.bin) come first, in descending order (ties, and a store with no counts yet, in
forward order). Every block is copied with its inline header into a new data file
blocks.<gen>.dat, checked and fsynced; the new metadata then replaces the old atomically (the
commit point) and the old data file is deleted. A kill at any moment leaves a store that opens and
verifies, in the old or the new layout. Refused (StoreInUse) while a running daemon has the store
open or another defrag runs on it.

Exit status: 0 done (or nothing to do), 2 error (not a store, in use, a damaged block)."""


def add_arguments(parser) -> None:
    from .defrag import ORDERS

    parser.add_argument("path", metavar="PATH", nargs="?", help="store directory")
    parser.add_argument("--model_path", "--model-path", dest="model_path", metavar="PATH",
                        help="store directory (the operators' spelling)")
    parser.add_argument("--order", choices=ORDERS, default="access",
                        help="access (default): most used blocks first; forward: the packer's "
                             "forward order (embed, layer 0 ... N-1, final norm, lm_head)")
    parser.add_argument("--runtime-dir", "--runtime_dir", dest="runtime_dir", metavar="DIR",
                        help="the daemon's runtime dir whose status tree tells whether the store is "
                             "in use (default: DEEPSEEK_FLASH_RUNTIME_DIR or /run/deepseek_flash)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress bar, print only errors")


def run(args) -> int:
    from dataclasses import asdict
    from pathlib import Path

    from ..store.cli_common import byte_progress
    from ..store.reader import Store
    from .defrag import defrag

    if (args.path is None) == (args.model_path is None):
        print("deepseek-flash defrag: give the store as PATH or --model_path PATH (one of them)",
              file=sys.stderr)
        return 2
    path = Path(args.path or args.model_path)
    total = Store.open(path).total_bytes
    with byte_progress(total, "defrag", args.quiet) as progress:
        report = defrag(path, order=args.order, progress=progress, runtime=args.runtime_dir)
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    elif not args.quiet:
        for name in report.removed_leftovers:
            print(f"{path}: removed {name} left by an interrupted defrag")
        print(f"{path}: order: {report.note}")
        if report.action == "none":
            print(f"{path}: nothing to do ({report.blocks} blocks in {', '.join(report.old_files)})")
        else:
            print(f"{path}: rewrote {report.blocks} blocks ({report.bytes} payload bytes) from "
                  f"{', '.join(report.old_files)} into {report.new_file}; file order by block id: "
                  f"{' '.join(map(str, report.order_ids))}")
    return 0
