"""``deepseek-flash pack SRC OUT``: make a block store from a Hugging Face model directory."""
from __future__ import annotations

import time

HELP = "pack a Hugging Face safetensors model directory into a block store"
DESCRIPTION = """Pack a Hugging Face model directory (config.json + *.safetensors shards) into a
deepseek-flash block store: one 4 KiB-aligned block per semantic unit, forward order, crc32c per
block, flash_metadata.bin index. The store is built beside OUT and renamed into place, so OUT is
never half-written."""


def add_arguments(parser) -> None:
    parser.add_argument("src", metavar="SRC", help="Hugging Face model directory")
    parser.add_argument("out", metavar="OUT", help="store directory to create")
    parser.add_argument("--force", action="store_true", help="replace OUT if it is a store")
    parser.add_argument("--quiet", action="store_true", help="no progress bar, no summary")


def run(args) -> int:
    from pathlib import Path

    from .cli_common import byte_progress
    from .inspect import human
    from .pack import pack
    from .reader import Store

    src = Path(args.src)
    total = sum(p.stat().st_size for p in src.glob("*.safetensors")) if src.is_dir() else None
    start = time.monotonic()
    with byte_progress(total, "pack", args.quiet) as progress:
        out = pack(args.src, args.out, force=args.force, progress=progress)
    if not args.quiet:
        store = Store.open(out)
        elapsed = time.monotonic() - start
        print(f"packed {len(store.blocks)} blocks, {human(store.total_bytes)} into {out} in "
              f"{elapsed:.2f} s ({store.total_bytes / max(elapsed, 1e-9) / 1e9:.2f} GB/s)")
    return 0
