"""Where the status tree and the daemon are, for every operator verb, and the "no daemon" answer."""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import paths
from ..cli import bounded
from ..errors import DaemonNotRunning
from ..sysfs_shim.publisher import format_fields


DEFAULT_TIMEOUT = 15.0


def add_location_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runtime-dir", type=Path, default=None,
                        help="status tree directory (default: $DEEPSEEK_FLASH_RUNTIME_DIR or "
                             "/run/deepseek_flash)")
    parser.add_argument("--socket", type=Path, default=None,
                        help="control socket (default: $DEEPSEEK_FLASH_SOCKET or "
                             "<runtime dir>/control.sock)")
    parser.add_argument("--timeout", type=bounded(float, 0, exclusive=True, what=" seconds"),
                        default=DEFAULT_TIMEOUT, metavar="S",
                        help=f"seconds to wait for the daemon's answer to the connection (default "
                             f"{DEFAULT_TIMEOUT:g}; a socket-activated daemon starts within it)")


def runtime_dir(args) -> Path:
    return args.runtime_dir if args.runtime_dir is not None else paths.client_runtime_dir()


def socket_path(args) -> Path:
    if args.socket is not None:
        return args.socket
    if args.runtime_dir is not None:
        return args.runtime_dir / "control.sock"
    return paths.client_socket_path()


def connect(args):
    """A Client of the running daemon (never an embedded controller); DaemonNotRunning otherwise."""
    from ..client import Client

    path = socket_path(args)
    try:
        return Client(socket_path=str(path), embedded=False,
                      handshake_timeout=getattr(args, "timeout", DEFAULT_TIMEOUT))
    except DaemonNotRunning as exc:
        if getattr(exc, "waited_for", None):
            raise                 # a socket that does not answer: the message says what was waited for
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


@dataclass
class TreeOwner:
    """The daemon a status tree names (``pid`` and ``socket`` in its ``status`` file)."""

    pid: str
    socket: str
    alive: bool
    reason: str = ""        # why it is not running


def tree_owner(runtime: Path) -> TreeOwner:
    """Whether the daemon that wrote the tree under ``runtime`` still runs: its pid is a live
    process and its control socket exists. A daemon killed with SIGKILL leaves its tree behind, and
    that tree must not pass for a running daemon's."""
    from ..sysfs_shim.publisher import parse

    status = runtime / "status"
    try:
        fields = parse(status.read_text(errors="replace"))
    except FileNotFoundError:
        return TreeOwner("", "", False, f"no status tree at {runtime}")
    pid, sock = fields.get("pid", ""), fields.get("socket", "")
    if not pid.isdigit():
        return TreeOwner(pid, sock, False, f"{status} names no daemon pid")
    if not _pid_runs(int(pid)):
        return TreeOwner(pid, sock, False, f"deepseek-flashd pid {pid} named in {status} is not running; "
                                           f"the tree is what it left behind")
    if sock and not os.path.exists(sock):
        return TreeOwner(pid, sock, False, f"the control socket {sock} named in {status} is gone")
    return TreeOwner(pid, sock, True)


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass                      # another user's process: it exists
    try:
        # A killed daemon not yet reaped by its parent is a zombie: dead all the same.
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def require_live_tree(args) -> int | None:
    """None when the tree's daemon runs; else print why it is not running and return 1."""
    owner = tree_owner(runtime_dir(args))
    if owner.alive:
        return None
    print(f"deepseek-flash {args.verb}: the daemon is not running: {owner.reason}", file=sys.stderr)
    return 1


def show_tree_file(args, name: str, ask) -> int:
    """Print the tree file ``name`` (``--json``: as an object) when the daemon that wrote it runs;
    without a tree, ``ask(client)``; a dead daemon's tree: "not running", exit status 1."""
    from ..sysfs_shim.publisher import parse

    path = runtime_dir(args) / name
    try:
        text = path.read_text()
    except FileNotFoundError:
        return with_daemon(args, lambda client: print_fields(ask(client), args.json,
                                                             status=name == "status"))
    refused = require_live_tree(args)
    if refused is not None:
        return refused
    if args.json:
        print(json.dumps(parse(text), indent=2))
    else:
        sys.stdout.write(text)
    return 0
