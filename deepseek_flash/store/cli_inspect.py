"""``deepseek-flash inspect PATH``: list a store's blocks and sizes (table or JSON)."""
from __future__ import annotations

import json

HELP = "list a store's blocks, per-layer and total sizes"


def add_arguments(parser) -> None:
    parser.add_argument("path", metavar="PATH", help="store directory")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    from .inspect import describe, format_table
    from .reader import Store

    store = Store.open(args.path)
    print(json.dumps(describe(store), indent=2) if args.json else format_table(store))
    return 0
