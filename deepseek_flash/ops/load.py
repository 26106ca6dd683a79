"""``deepseek-flash load NAME|PATH``: open a model in the daemon and read it into the host tier."""
from __future__ import annotations

from .common import add_location_arguments, print_fields, with_daemon

HELP = "open a model in the daemon and read its blocks into host memory"
DESCRIPTION = """NAME is a registered model or a directory under a store root; PATH is a block store
directory (made by `deepseek-flash pack`). Waits until the blocks that fit are resident, unless
--no-wait. The model stays open after this command exits, until `deepseek-flash unload NAME`."""


def add_arguments(parser):
    add_location_arguments(parser)
    parser.add_argument("model", metavar="NAME|PATH")
    parser.add_argument("--no-wait", action="store_true", help="return once the reads are queued")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args) -> int:
    return with_daemon(args, lambda client: print_fields(
        client.load(args.model, wait=not args.no_wait), args.json))
