"""``deepseek-flash install-units``: install the systemd units and the default config.

The unit files and ``flash.json`` ship once, as package data (``deepseek_flash/data``; the
repository's ``systemd/`` and ``etc/`` link to them). Installing rewrites two lines: ``ExecStart=``
runs the ``deepseek-flashd`` (the daemon) or ``deepseek-flash serve`` (the HTTP server template
unit) of the Python environment doing the install (a venv or pyenv is not on systemd's PATH), and
``SocketGroup=`` names the group allowed on the control socket. An existing ``flash.json`` is never
overwritten: it is the operator's.
"""
from __future__ import annotations

import grp
import os
import shlex
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

from .. import paths
from ..errors import ConfigError
from ..fsutil import atomic_write

HELP = "install deepseek-flash.service/.socket, deepseek-flash-serve@.service and /etc/deepseek-flash/flash.json"
DESCRIPTION = """Write deepseek-flash.service, deepseek-flash.socket and deepseek-flash-serve@.service to
--prefix, with ExecStart= set to the deepseek-flashd / deepseek-flash of this Python environment (or
of --python), create the socket group when it is missing, install the default flash.json unless one
exists, and run `systemctl daemon-reload`.
Then: systemctl enable --now deepseek-flash.socket deepseek-flash.service
and, to serve a model over HTTP: systemctl enable --now deepseek-flash-serve@MODEL"""

UNITS = ("deepseek-flash.service", "deepseek-flash.socket", "deepseek-flash-serve@.service")
# ExecStart= of the template unit after the executable: the instance is the model name.
SERVE_ARGS = "serve %I $SERVE_ARGS"
PRIVATE_TMP_DROPIN = "private-tmp.conf"
TMP_ROOTS = (Path("/tmp"), Path("/var/tmp"))
CONFIG_NAME = "flash.json"
DEFAULT_GROUP = "deepseek-flash"


def add_arguments(parser):
    parser.add_argument("--prefix", type=Path, default=Path("/etc/systemd/system"),
                        help="unit directory (default: /etc/systemd/system)")
    parser.add_argument("--python", default=sys.executable,
                        help="Python of the environment that runs the daemon (default: this one)")
    parser.add_argument("--socket-group", default=DEFAULT_GROUP,
                        help=f"group allowed to connect to the control socket (default: {DEFAULT_GROUP}; "
                             "created as a system group when missing)")
    parser.add_argument("--config-dir", type=Path, default=paths.SYSTEM_CONFIG.parent,
                        help=f"where flash.json goes (default: {paths.SYSTEM_CONFIG.parent}; the "
                             "service reads it through ConfigurationDirectory=)")
    parser.add_argument("--no-reload", action="store_true",
                        help="do not run `systemctl daemon-reload`")
    parser.add_argument("--allow-tmp", action="store_true",
                        help="the environment lies under /tmp or /var/tmp: install a drop-in with "
                             "PrivateTmp=no so the service can see it (default: refuse, naming the path)")


def run(args) -> int:
    exec_start = daemon_command(args.python)
    hidden = paths_in_private_tmp(args.python, exec_start)
    if hidden and not args.allow_tmp:
        raise ConfigError(
            f"{hidden[0]} lies under {_tmp_root(hidden[0])}, which deepseek-flash.service cannot see "
            f"(PrivateTmp=yes gives it its own empty /tmp and /var/tmp: the unit would fail with "
            f"status 203/EXEC). Install deepseek-flash into an environment elsewhere, e.g. "
            f"`python3 -m venv /opt/deepseek-flash && /opt/deepseek-flash/bin/pip install "
            f"deepseek-flash`, and run install-units from it; or pass --allow-tmp to install a "
            f"drop-in with PrivateTmp=no", key="python", value=str(hidden[0]),
            allowed="an environment outside /tmp and /var/tmp, or --allow-tmp")
    ensure_group(args.socket_group)
    args.prefix.mkdir(parents=True, exist_ok=True)
    commands = {"deepseek-flash.service": exec_start,
                "deepseek-flash-serve@.service": f"{cli_command(args.python)} {SERVE_ARGS}"}
    for name in UNITS:
        text = unit_text(name, exec_start=commands.get(name), socket_group=args.socket_group)
        target = args.prefix / name
        atomic_write(target, text.encode())
        print(f"installed {target}")
    for unit in (name for name in UNITS if hidden and name.endswith(".service")):
        dropin = args.prefix / f"{unit}.d" / PRIVATE_TMP_DROPIN
        dropin.parent.mkdir(exist_ok=True)
        atomic_write(dropin, f"# {hidden[0]} lies under {_tmp_root(hidden[0])} (install-units "
                             f"--allow-tmp)\n[Service]\nPrivateTmp=no\n".encode())
        print(f"installed {dropin} (PrivateTmp=no: {hidden[0]} is under {_tmp_root(hidden[0])})")
    config = args.config_dir / CONFIG_NAME
    if config.exists():
        print(f"kept existing {config}")
    else:
        args.config_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(config, default_config(args.socket_group).encode())
        print(f"installed {config}")
    if not args.no_reload and Path("/run/systemd/system").is_dir():
        subprocess.run(["systemctl", "daemon-reload"], check=True)
        print("ran systemctl daemon-reload")
    print("start with: systemctl enable --now deepseek-flash.socket deepseek-flash.service")
    print("serve a model over HTTP: systemctl enable --now deepseek-flash-serve@MODEL "
          "(options in /etc/deepseek-flash/serve-MODEL.env: SERVE_ARGS=--port 8000 ...)")
    return 0


def data_text(name: str) -> str:
    return resources.files("deepseek_flash").joinpath("data", name).read_text()


def daemon_command(python: str) -> str:
    """The daemon's ExecStart= command line: the environment's ``deepseek-flashd`` script, else
    ``python -m``."""
    return _environment_command(python, "deepseek-flashd", "deepseek_flash.daemon.app")


def daemon_argv() -> list[str]:
    """How this interpreter's install starts the daemon (demo, tests, benches): the
    ``deepseek-flashd`` script beside ``sys.executable``, else ``python -m`` -- never another
    install's script that happens to come first on PATH."""
    script = Path(sys.executable).parent / "deepseek-flashd"
    if os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "deepseek_flash.daemon.app"]


def cli_command(python: str) -> str:
    """The environment's ``deepseek-flash`` script, else ``python -m deepseek_flash``."""
    return _environment_command(python, "deepseek-flash", "deepseek_flash")


def _environment_command(python: str, script_name: str, module: str) -> str:
    python_path = Path(python)
    if not python_path.is_absolute():
        found = shutil.which(python)
        if found is None:
            raise ConfigError(f"--python {python}: not found on PATH", key="python", value=python,
                              allowed="path of a Python interpreter")
        python_path = Path(found)
    if not os.access(python_path, os.X_OK):
        raise ConfigError(f"--python {python}: not an executable", key="python", value=python,
                          allowed="path of a Python interpreter")
    # Not resolved: a venv's bin/python is a symlink whose location selects the venv.
    script = python_path.parent / script_name
    if os.access(script, os.X_OK):
        return _quote(str(script))
    return " ".join(_quote(part) for part in (str(python_path), "-m", module))


def paths_in_private_tmp(python: str, exec_start: str) -> list[Path]:
    """The paths the service needs that PrivateTmp= hides: the ExecStart= program (as written and
    resolved), and this package's code when ``python`` is the interpreter running install-units."""
    program = Path(shlex.split(exec_start.replace("%%", "%"))[0])
    candidates = [program, program.resolve()]
    if _same_file(python, sys.executable):
        from .. import __file__ as package_init

        candidates.append(Path(package_init).resolve().parent)
    return [p for p in candidates if _tmp_root(p) is not None]


def _tmp_root(path: Path) -> Path | None:
    return next((root for root in TMP_ROOTS if root == path or root in path.parents), None)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(shutil.which(a) or a, b)
    except OSError:
        return False


def unit_text(name: str, *, exec_start: str | None, socket_group: str) -> str:
    replacements = {"ExecStart": exec_start} if name.endswith(".service") else {"SocketGroup": socket_group}
    out = []
    seen = set()
    for line in data_text(name).splitlines():
        key = line.split("=", 1)[0]
        if key in replacements:
            line = f"{key}={replacements[key]}"
            seen.add(key)
        out.append(line)
    missing = set(replacements) - seen
    if missing:
        raise ConfigError(f"packaged unit {name} has no {', '.join(sorted(missing))}= line to set",
                          key=min(missing), value=name, allowed="the packaged unit file")
    return "\n".join(out) + "\n"


def default_config(socket_group: str) -> str:
    text = data_text(CONFIG_NAME)
    return text.replace(f'"socket_group": "{DEFAULT_GROUP}"', f'"socket_group": "{socket_group}"')


def ensure_group(name: str) -> None:
    if _group_exists(name):
        return
    groupadd = shutil.which("groupadd")
    if groupadd is None:
        raise ConfigError(f"socket group {name!r} does not exist and groupadd is not available; "
                          f"create it or pass --socket-group with an existing group",
                          key="socket_group", value=name, allowed="an existing group")
    subprocess.run([groupadd, "--system", name], check=True)
    print(f"created system group {name} (add users with: usermod -aG {name} USER)")


def _group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def _quote(word: str) -> str:
    # systemd command lines: '%' starts a specifier, whitespace splits words.
    word = word.replace("%", "%%")
    if any(c.isspace() or c in "\"'\\" for c in word):
        return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return word
