"""``deepseek-flash status``: the controller's state, from /run/deepseek_flash/status."""
from __future__ import annotations

from .common import add_location_arguments, show_tree_file

HELP = "show the daemon's state (status tree, else the daemon itself)"
DESCRIPTION = """Print /run/deepseek_flash/status: controller_state, prefetch_hit_rate,
semantic_block_count, unified_memory_fabric, config_state, last_reload_error.
Without a status tree the daemon is asked over the control socket; with neither the verb
prints "no daemon running at <socket>" and exits 1."""


def add_arguments(parser):
    add_location_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON object")


def run(args) -> int:
    return show_tree_file(args, "status", lambda client: client.status()["status"])
