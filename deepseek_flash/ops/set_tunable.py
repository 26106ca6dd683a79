"""``deepseek-flash set KEY VALUE``: change a run-time tunable of the daemon."""
from __future__ import annotations

import json

from .common import add_location_arguments, with_daemon

HELP = "change a tunable of the running daemon (e.g. set prefetch_window 32)"
DESCRIPTION = """VALUE is read as JSON when it parses (32, 0.85, null), else as a string (lru).
Tunables: prefetch_window, block_eviction_policy, eviction_threshold, error_recovery_mode,
max_outstanding_requests_per_client, max_leases_per_client. The change lasts until the daemon
restarts or reloads flash.json; it shows in /run/deepseek_flash/tunables."""


def add_arguments(parser):
    add_location_arguments(parser)
    parser.add_argument("key", metavar="KEY")
    parser.add_argument("value", metavar="VALUE")


def parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def run(args) -> int:
    def change(client):
        result = client.set_tunable(args.key, parse_value(args.value))
        print(f"{args.key}: {result['old']} -> {result['new']}")
    return with_daemon(args, change)
