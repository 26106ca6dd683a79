"""``deepseek-flash repair`` / ``deepseek-flash-repair --model_path P``: rebuild flash_metadata.bin."""
from __future__ import annotations

import sys

HELP = "rebuild a store's flash_metadata.bin from the inline block headers"
DESCRIPTION = """Check a store's flash_metadata.bin and, when it is missing or corrupt (or with
--force_rebuild, always), rebuild it by scanning the data file for inline block headers. Block
data is never modified; the new metadata replaces the old atomically and only when every block
was found. Exits 0 when the store is whole, 1 when blocks are bad or missing (named), 2 on errors."""


def add_arguments(parser) -> None:
    parser.add_argument("path", metavar="PATH", nargs="?", help="store directory")
    parser.add_argument("--model_path", "--model-path", dest="model_path", metavar="PATH",
                        help="store directory (the operators' spelling)")
    parser.add_argument("--force_rebuild", "--force-rebuild", dest="force_rebuild",
                        action="store_true", help="rebuild even when the metadata reads fine")
    parser.add_argument("--quiet", action="store_true", help="print only problems")


def run(args) -> int:
    from pathlib import Path

    from .cli_common import byte_progress
    from .repair import repair

    if (args.path is None) == (args.model_path is None):
        print("deepseek-flash repair: give the store as PATH or --model_path PATH (one of them)",
              file=sys.stderr)
        return 2
    path = Path(args.path or args.model_path)
    total = sum(p.stat().st_size for p in path.glob("blocks*.dat")) if path.is_dir() else None
    with byte_progress(total, "repair", args.quiet) as progress:
        report = repair(path, force_rebuild=args.force_rebuild, progress=progress)
    for offset, reason in report.skipped:
        print(f"{path}: skipped damaged header slot at offset {offset}: {reason}", file=sys.stderr)
    for block_id, reason in report.bad:
        print(f"{path}: block {block_id} cannot be recovered: {reason}", file=sys.stderr)
    if report.missing:
        print(f"{path}: no valid header found for block(s) {', '.join(map(str, report.missing))}",
              file=sys.stderr)
    if report.action == "refused":
        print(f"{path}: metadata NOT rewritten: {report.blocks} blocks found, "
              f"{len(report.missing)} missing", file=sys.stderr)
        return 1
    if not args.quiet:
        if report.action == "none":
            print(f"{path}: metadata OK ({report.blocks} blocks); nothing to do "
                  f"(--force_rebuild rebuilds anyway)")
        else:
            print(f"{path}: rebuilt flash_metadata.bin from {report.blocks} block headers "
                  f"({report.reason})")
    return 0 if report.ok else 1
