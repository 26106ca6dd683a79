"""``deepseek-flash verify PATH``: read every block of a store and check every crc32c."""
from __future__ import annotations

import sys
import time

HELP = "check every block of a store against its crc32c"
DESCRIPTION = """Read the whole data file sequentially (O_DIRECT where possible) and check each
block's payload crc32c and inline header against flash_metadata.bin. Exits 1 naming every bad
block, 2 when the store or its metadata cannot be opened."""


def add_arguments(parser) -> None:
    parser.add_argument("path", metavar="PATH", help="store directory")
    parser.add_argument("--quiet", action="store_true", help="print only problems")


def run(args) -> int:
    from .cli_common import byte_progress
    from .inspect import human
    from .reader import Store
    from .verify import verify_store

    store = Store.open(args.path)
    total = sum((store.path / f).stat().st_size for f in {b.file for b in store.blocks}
                if (store.path / f).exists())
    start = time.monotonic()
    with byte_progress(total, "verify", args.quiet) as progress:
        report = verify_store(store, progress)
    elapsed = time.monotonic() - start
    for block_id, reason in report.bad:
        print(f"{store.path}: block {block_id} ({store.block(block_id).role}, layer "
              f"{store.block(block_id).layer}) BAD: {reason}", file=sys.stderr)
    if not report.ok:
        ids = sorted({b for b, _ in report.bad})
        print(f"{store.path}: {len(ids)} of {report.blocks} blocks bad: {', '.join(map(str, ids))}",
              file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"{store.path}: OK, {report.blocks} blocks, {human(report.bytes)} read in "
              f"{elapsed:.2f} s ({report.bytes / max(elapsed, 1e-9) / 1e9:.2f} GB/s)")
    return 0
