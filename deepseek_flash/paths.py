"""Every filesystem path and address the project uses, with its environment override.

One table, so tests point every root at a temp tree (the fwupd way) and operators find all
overrides in one place.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

SYSTEM_RUNTIME_DIR = Path("/run/deepseek_flash")
SYSTEM_CONFIG = Path("/etc/deepseek-flash/flash.json")
SYSTEM_STATE_DIR = Path("/var/lib/deepseek-flash")


def runtime_dir() -> Path:
    """``DEEPSEEK_FLASH_RUNTIME_DIR``, else systemd's ``RUNTIME_DIRECTORY``, else /run (root) or
    ``$XDG_RUNTIME_DIR/deepseek_flash``."""
    env = os.environ.get("DEEPSEEK_FLASH_RUNTIME_DIR")
    if env:
        return Path(env)
    systemd_dir = os.environ.get("RUNTIME_DIRECTORY")
    if systemd_dir:
        return Path(systemd_dir.split(":")[0])
    if os.geteuid() == 0:
        return SYSTEM_RUNTIME_DIR
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "deepseek_flash"
    return Path(f"/tmp/deepseek_flash-{os.geteuid()}")


def socket_path() -> Path:
    """The socket a daemon started here binds: ``DEEPSEEK_FLASH_SOCKET``, else in runtime_dir()."""
    env = os.environ.get("DEEPSEEK_FLASH_SOCKET")
    return Path(env) if env else runtime_dir() / "control.sock"


def system_socket_reachable() -> bool:
    """The system daemon's socket exists and this user may connect to it (write permission:
    root, or a member of the socket's group)."""
    sock = SYSTEM_RUNTIME_DIR / "control.sock"
    try:
        mode = os.stat(sock).st_mode
    except OSError:
        return False
    return stat.S_ISSOCK(mode) and os.access(sock, os.W_OK)


def client_runtime_dir() -> Path:
    """Where clients and the read verbs find a daemon: the overrides, else for a user who is not
    root the system daemon's tree when its socket is reachable (a member of its group), else the
    per-user runtime_dir()."""
    overridden = os.environ.get("DEEPSEEK_FLASH_RUNTIME_DIR") or os.environ.get("RUNTIME_DIRECTORY")
    if not overridden and os.geteuid() != 0 and system_socket_reachable():
        return SYSTEM_RUNTIME_DIR
    return runtime_dir()


def client_socket_path() -> Path:
    """The socket clients connect to: ``DEEPSEEK_FLASH_SOCKET``, else in client_runtime_dir()."""
    env = os.environ.get("DEEPSEEK_FLASH_SOCKET")
    return Path(env) if env else client_runtime_dir() / "control.sock"


def config_path() -> Path:
    env = os.environ.get("DEEPSEEK_FLASH_CONFIG")
    if env:
        return Path(env)
    conf_dir = os.environ.get("CONFIGURATION_DIRECTORY")
    if conf_dir:
        return Path(conf_dir.split(":")[0]) / "flash.json"
    return SYSTEM_CONFIG


def state_dir() -> Path:
    env = os.environ.get("DEEPSEEK_FLASH_STATE_DIR") or os.environ.get("STATE_DIRECTORY")
    if env:
        return Path(env.split(":")[0])
    return SYSTEM_STATE_DIR if os.geteuid() == 0 else runtime_dir() / "state"
