"""``deepseek-flash stats``: the controller's counters, from /run/deepseek_flash/stats."""
from __future__ import annotations

from .common import add_location_arguments, show_tree_file

HELP = "show the daemon's counters (prefetch misses, evictions, bytes read, ...)"
DESCRIPTION = """Print /run/deepseek_flash/stats (the same numbers are in metrics.prom for Prometheus).
Without a status tree the daemon is asked over the control socket; with neither the verb
prints "no daemon running at <socket>" and exits 1."""


def add_arguments(parser):
    add_location_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON object")


def run(args) -> int:
    return show_tree_file(args, "stats", lambda client: client.stats())
