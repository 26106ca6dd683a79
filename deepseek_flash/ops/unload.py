"""``deepseek-flash unload NAME``: close a model in the daemon and free its host memory."""
from __future__ import annotations

from .common import add_location_arguments, print_fields, with_daemon

HELP = "close a model in the daemon and free its host memory"
DESCRIPTION = """Refused (StoreInUse) while a client holds leases on the model's blocks."""


def add_arguments(parser):
    add_location_arguments(parser)
    parser.add_argument("model", metavar="NAME")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args) -> int:
    return with_daemon(args, lambda client: print_fields(client.unload(args.model), args.json))
