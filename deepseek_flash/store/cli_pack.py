"""``deepseek-flash pack SRC OUT``: make a block store from a Hugging Face model directory."""
from __future__ import annotations

import time

HELP = "pack a Hugging Face safetensors model directory into a block store"
DESCRIPTION = """Pack a Hugging Face model directory (config.json + *.safetensors shards) into a
deepseek-flash block store: one 4 KiB-aligned block per semantic unit, forward order, crc32c per
block, flash_metadata.bin index. The store is built beside OUT and renamed into place, so OUT is
never half-written. --quantize stores the attention and MLP linear weights as int8 or packed int4
codes with float16 scales per group of --group-size input columns (per_block) or per tensor;
embeddings, norms, biases and lm_head keep the source dtype (docs/format.md)."""


def add_arguments(parser) -> None:
    parser.add_argument("src", metavar="SRC", help="Hugging Face model directory")
    parser.add_argument("out", metavar="OUT", help="store directory to create")
    parser.add_argument("--force", action="store_true", help="replace OUT if it is a store")
    parser.add_argument("--quiet", action="store_true", help="no progress bar, no summary")
    parser.add_argument("--quantize", choices=("int8_symmetric", "int4_symmetric"),
                        help="quantize the attention and MLP linear weights (lossy; default: keep "
                             "the source dtype)")
    parser.add_argument("--granularity", choices=("per_block", "per_tensor"), default="per_block",
                        help="one scale per group of --group-size input columns of a row "
                             "(per_block, default) or one per tensor")
    parser.add_argument("--group-size", type=int, choices=(32, 64, 128), default=128,
                        help="input columns per scale with per_block (default 128)")


def run(args) -> int:
    from pathlib import Path

    from .cli_common import byte_progress
    from .inspect import human
    from .pack import pack
    from .reader import Store

    quant = None
    if args.quantize:
        from ..quant import QuantSpec
        quant = QuantSpec(args.quantize, args.granularity, args.group_size)
    src = Path(args.src)
    # Progress counts stored bytes: the source size is their total only when nothing is quantized.
    total = (sum(p.stat().st_size for p in src.glob("*.safetensors"))
             if src.is_dir() and quant is None else None)
    start = time.monotonic()
    with byte_progress(total, "pack", args.quiet) as progress:
        out = pack(args.src, args.out, force=args.force, progress=progress, quant=quant)
    if not args.quiet:
        store = Store.open(out)
        elapsed = time.monotonic() - start
        what = f" ({quant.label()})" if quant else ""
        print(f"packed {len(store.blocks)} blocks{what}, {human(store.total_bytes)} into {out} in "
              f"{elapsed:.2f} s ({store.total_bytes / max(elapsed, 1e-9) / 1e9:.2f} GB/s)")
    return 0
