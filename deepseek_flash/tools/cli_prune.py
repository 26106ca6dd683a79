"""``deepseek-flash prune SRC [--apply OUT]``: list (and drop, in a copy) tensors that add nothing."""
from __future__ import annotations

import json
import sys

HELP = "list all-zero biases and duplicate tensors; --apply OUT writes a pruned copy"
DESCRIPTION = """Read every block of the store SRC (crc-checked) and list the tensors that contribute
nothing measurable: biases whose bytes are all zero, and tensors exactly equal to an earlier one
(e.g. an untied lm_head equal to the embedding), with the bytes each one would save. With
--apply OUT, write a pruned copy to OUT (SRC is never modified): a tensor whose twin is in the same
block or in an always-resident block becomes an alias of it (the same bytes serve both names),
and a block left empty is dropped. Loading OUT gives logits identical to SRC. Tensors that cannot
be aliased safely are listed with action "keep" and the reason (see docs/tools.md).

Exit status: 0 done, 2 error (SRC not a store, OUT exists or its directory is missing)."""


def add_arguments(parser) -> None:
    parser.add_argument("src", metavar="SRC", help="store directory to analyse (only read)")
    parser.add_argument("--apply", metavar="OUT",
                        help="write the pruned copy to OUT (a new directory; its parent must exist)")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    from ..store.cli_common import byte_progress
    from ..store.reader import Store
    from .prune import analyse, apply

    store = Store.open(args.src)
    with byte_progress(store.total_bytes, "prune: scan", args.quiet) as progress:
        report = analyse(store, progress)
    out = None
    if args.apply:
        with byte_progress(store.total_bytes, "prune: write", args.quiet) as progress:
            out = apply(store, report, args.apply, progress)
    if args.json:
        doc = report.to_dict()
        doc["output"] = str(out) if out else None
        print(json.dumps(doc, indent=2))
        return 0
    for f in report.findings:
        twin = f" = {f.twin} (block {f.twin_block})" if f.twin else ""
        print(f"{f.kind:9} {f.name} [block {f.block} {f.role}] {f.nbytes} B{twin}: {f.action}"
              f"{f' saves {f.saved} B' if f.saved else ''} -- {f.reason}")
    if not report.findings:
        print(f"{store.path}: nothing to prune")
    print(f"{store.path}: {len(report.findings)} tensors listed ({report.listed_bytes} B); "
          f"--apply saves {report.saved_bytes} of {report.payload_bytes} payload bytes", file=sys.stdout)
    if out:
        print(f"wrote the pruned copy to {out}")
    return 0
