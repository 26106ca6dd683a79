"""Where the status tree and the daemon are, for every operator verb, and the "no daemon" answer."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import paths
from ..errors import DaemonNotRunning
from ..sysfs_shim.publisher import format_fields


def add_location_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runtime-dir", type=Path, default=None,
                        help="status tree directory (default: $DEEPSEEK_FLASH_RUNTIME_DIR or "
                             "/run/deepseek_flash)")
    parser.add_argument("--socket", type=Path, default=None,
                        help="control socket (default: $DEEPSEEK_FLASH_SOCKET or "
                             "<runtime dir>/control.sock)")


def runtime_dir(args) -> Path:
    return args.runtime_dir if args.runtime_dir is not None else paths.runtime_dir()


def socket_path(args) -> Path:
    if args.socket is not None:
        return args.socket
    if args.runtime_dir is not None:
        return args.runtime_dir / "control.sock"
    return paths.socket_path()


def connect(args):
    """A Client of the running daemon (never an embedded controller); DaemonNotRunning otherwise."""
    from ..client import Client

    path = socket_path(args)
    try:
        return Client(socket_path=str(path), embedded=False)
    except DaemonNotRunning as exc:
        raise DaemonNotRunning(f"no daemon running at {path}", socket=str(path)) from exc
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        raise DaemonNotRunning(f"no daemon running at {path}", socket=str(path)) from exc


def with_daemon(args, action) -> int:
    """Run ``action(client)``; "no daemon running at <socket>" and exit status 1 when there is none."""
    try:
        client = connect(args)
    except DaemonNotRunning as exc:
        print(f"deepseek-flash {args.verb}: {exc.message}", file=sys.stderr)
        return 1
    with client:
        return int(action(client) or 0)


def print_fields(fields, as_json: bool, *, status: bool = False) -> None:
    if as_json:
        print(json.dumps(fields, indent=2, sort_keys=False, default=str))
    else:
        sys.stdout.write(format_fields(fields, status=status))


def show_tree_file(args, name: str, ask) -> int:
    """Print the tree file ``name`` (``--json``: as an object); without a tree, ``ask(client)``."""
    from ..sysfs_shim.publisher import parse

    path = runtime_dir(args) / name
    try:
        text = path.read_text()
    except FileNotFoundError:
        return with_daemon(args, lambda client: print_fields(ask(client), args.json,
                                                             status=name == "status"))
    if args.json:
        print(json.dumps(parse(text), indent=2))
    else:
        sys.stdout.write(text)
    return 0
