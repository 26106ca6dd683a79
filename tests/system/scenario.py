"""The operator's life cycle of deepseek-flash under a real systemd (run inside the harness container).

``python scenario.py STORE OUT``: install the units with ``deepseek-flash install-units``, verify
them, start the service, read the status tree, load a model through the socket, change a tunable,
reload the config (good and bad), stop, start again by socket activation, stop. Every step writes
what it saw to ``OUT/scenario.log``; the journal goes to ``OUT/journal.log``. Exit 0 when every
check held; the first failed check exits 1 naming the step.

Run by ``test_systemd.py`` with the host's Python and this repository bound read-only at the same
paths, so ``sys.executable`` is the Python whose environment holds deepseek_flash.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable
RUN = Path("/run/deepseek_flash")
CONFIG = Path("/etc/deepseek-flash/flash.json")
UNIT_DIR = Path("/etc/systemd/system")
GROUP = "deepseek-flash"


class CheckFailed(Exception):
    pass


def log(out: Path, text: str) -> None:
    with open(out / "scenario.log", "a") as f:
        f.write(text.rstrip("\n") + "\n")


def sh(out: Path, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    log(out, f"$ {' '.join(cmd)}  -> {proc.returncode}\n{proc.stdout}{proc.stderr}")
    if check and proc.returncode != 0:
        raise CheckFailed(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def cli(out: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return sh(out, PY, "-m", "deepseek_flash", *args, check=check)


def prop(out: Path, unit: str, name: str) -> str:
    return sh(out, "systemctl", "show", "-p", name, "--value", unit).stdout.strip()


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def eventually(what: str, probe, timeout: float = 20.0):
    """Poll ``probe()`` until it returns a true value; CheckFailed naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise CheckFailed(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def tree(name: str) -> dict:
    fields = {}
    path = RUN / name
    if path.exists():
        for line in path.read_text().splitlines():
            key, _, value = line.partition(": ")
            fields[key] = value
    return fields


def write_config(base: dict, store: str, **extra) -> None:
    """The installed default config with a small host tier, the test model and ``extra``."""
    config = {**base, "host_cache_bytes": "64MiB", "models": {"tiny": store}, **extra}
    CONFIG.write_text(json.dumps(config, indent=2))


def code_in_tmp() -> bool:
    """A checkout or Python under /tmp (some CI runners) is invisible behind PrivateTmp=:
    install-units refuses it unless --allow-tmp, which adds a PrivateTmp=no drop-in."""
    import deepseek_flash

    code = [Path(sys.prefix), Path(deepseek_flash.__file__).resolve().parent]
    return any(Path(tmp) in path.parents for path in code for tmp in ("/tmp", "/var/tmp"))


def scenario(store: str, out: Path) -> None:
    log(out, "## install-units")
    if code_in_tmp():
        refused = cli(out, "install-units", "--socket-group", GROUP, check=False)
        expect(refused.returncode == 2 and "PrivateTmp=yes" in refused.stderr,
               f"install-units accepted code under /tmp: {refused.stderr}")
        cli(out, "install-units", "--socket-group", GROUP, "--allow-tmp")
        expect("PrivateTmp=no" in (UNIT_DIR / "deepseek-flash.service.d" / "private-tmp.conf").read_text(),
               "install-units --allow-tmp wrote no PrivateTmp=no drop-in")
    else:
        cli(out, "install-units", "--socket-group", GROUP)
    service = (UNIT_DIR / "deepseek-flash.service").read_text()
    exec_start = next(line for line in service.splitlines() if line.startswith("ExecStart="))
    expect(exec_start.split("=", 1)[1].split()[0].startswith(sys.prefix),
           f"ExecStart does not run this environment's Python ({sys.prefix}): {exec_start}")
    expect(f"SocketGroup={GROUP}" in (UNIT_DIR / "deepseek-flash.socket").read_text(),
           "socket unit lacks SocketGroup=")
    base = json.loads(CONFIG.read_text())
    expect(base["socket_group"] == GROUP, "flash.json socket_group not set")
    write_config(base, store)
    (out / "installed.service").write_text(service)

    log(out, "## systemd-analyze verify")
    verify = sh(out, "systemd-analyze", "verify", str(UNIT_DIR / "deepseek-flash.service"),
                str(UNIT_DIR / "deepseek-flash.socket"), check=False)
    (out / "verify.log").write_text(verify.stdout + verify.stderr)
    expect(verify.returncode == 0 and not (verify.stdout + verify.stderr).strip(),
           f"systemd-analyze verify is not clean:\n{verify.stdout}{verify.stderr}")

    log(out, "## start")
    sh(out, "systemctl", "start", "deepseek-flash")
    expect(prop(out, "deepseek-flash", "ActiveState") == "active", "service not active after start")
    expect(prop(out, "deepseek-flash.socket", "ActiveState") == "active", "socket not active")
    expect(prop(out, "deepseek-flash", "StatusText").startswith("serving"),
           "StatusText does not say the daemon is serving (READY=1 with STATUS=)")
    expect(prop(out, "deepseek-flash", "WatchdogUSec") == "30s", "WatchdogSec=30 not in effect")
    status = eventually("controller_state: ACTIVE in /run/deepseek_flash/status",
                        lambda: tree("status").get("controller_state") == "ACTIVE" and tree("status"))
    (out / "status.txt").write_text((RUN / "status").read_text())
    sock = RUN / "control.sock"
    st = sock.stat()
    expect(oct(st.st_mode & 0o777) == "0o660", f"control.sock mode {oct(st.st_mode & 0o777)}, want 0o660")
    import grp
    expect(grp.getgrgid(st.st_gid).gr_name == GROUP, "control.sock not owned by the socket group")
    expect(status["config_state"] == "ok", f"config_state {status['config_state']!r}")

    log(out, "## CLI through the socket: load, models, set")
    load = cli(out, "load", "tiny")
    expect("resident_blocks:" in load.stdout, "load printed no resident_blocks")
    eventually("models/tiny/info", lambda: (RUN / "models" / "tiny" / "info").exists())
    info = tree("models/tiny/info")
    expect(info["blocks"] == info["resident_blocks"] and int(info["blocks"]) > 0,
           f"tiny not fully resident after load: {info}")
    (out / "models.txt").write_text(cli(out, "models").stdout)
    (out / "models_tiny.txt").write_text(cli(out, "models", "tiny").stdout)
    (out / "stats.txt").write_text(cli(out, "stats").stdout)
    (out / "status_cli.txt").write_text(cli(out, "status").stdout)
    set_out = cli(out, "set", "prefetch_window", "32")
    (out / "set.txt").write_text(set_out.stdout)
    eventually("prefetch_window: 32 in the tree", lambda: tree("tunables").get("prefetch_window") == "32")
    (out / "metrics.prom").write_text((RUN / "metrics.prom").read_text())

    log(out, "## reload: a good config")
    pid = prop(out, "deepseek-flash", "MainPID")
    write_config(base, store, block_eviction_policy="access_frequency_weighted")
    sh(out, "systemctl", "reload", "deepseek-flash")
    eventually("StatusText 'config reloaded'",
               lambda: prop(out, "deepseek-flash", "StatusText") == "config reloaded")
    eventually("block_eviction_policy reloaded",
               lambda: tree("tunables").get("block_eviction_policy") == "access_frequency_weighted")
    expect(prop(out, "deepseek-flash", "MainPID") == pid, "reload restarted the daemon")

    log(out, "## reload: a bad config keeps the old one")
    write_config(base, store, prefetch_window=-1)
    sh(out, "systemctl", "reload", "deepseek-flash")
    eventually("StatusText about the failed reload",
               lambda: prop(out, "deepseek-flash", "StatusText").startswith("config reload failed"))
    status = eventually("config_state: reload_failed",
                        lambda: tree("status").get("config_state") == "reload_failed" and tree("status"))
    expect("prefetch_window" in status["last_reload_error"], f"last_reload_error: {status}")
    expect(prop(out, "deepseek-flash", "ActiveState") == "active", "bad reload stopped the service")
    (out / "status_reload_failed.txt").write_text((RUN / "status").read_text())
    write_config(base, store)
    sh(out, "systemctl", "reload", "deepseek-flash")
    eventually("config_state: ok again", lambda: tree("status").get("config_state") == "ok")

    log(out, "## journal")
    journal = sh(out, "journalctl", "--no-pager", "-u", "deepseek-flash").stdout
    for needle in ("serving on", "opened model tiny", "SIGHUP: reloading", "config reload failed"):
        expect(needle in journal, f"journal of deepseek-flash lacks {needle!r}")

    log(out, "## stop")
    sh(out, "systemctl", "stop", "deepseek-flash")
    expect(prop(out, "deepseek-flash", "ActiveState") == "inactive", "service not inactive after stop")
    expect(prop(out, "deepseek-flash", "ExecMainStatus") == "0", "daemon did not exit 0 on SIGTERM")
    expect(prop(out, "deepseek-flash", "Result") == "success", "stop result not success")
    expect(not (RUN / "status").exists(), "status file left behind by a clean stop")
    expect(sock.exists(), "control.sock vanished with the service (the socket unit still listens)")
    noservice = cli(out, "status", check=False)
    # The CLI connected to the listening socket: systemd started the daemon to answer it.
    log(out, "## socket activation")
    expect(noservice.returncode == 0 and "controller_state: ACTIVE" in noservice.stdout,
           f"status through the activated socket failed: {noservice.stdout}{noservice.stderr}")
    expect(prop(out, "deepseek-flash", "ActiveState") == "active", "socket activation did not start the service")
    expect(prop(out, "deepseek-flash", "NRestarts") == "0", "the service restarted (crash or watchdog)")
    triggered = sh(out, "systemctl", "status", "--no-pager", "deepseek-flash", check=False).stdout
    expect("TriggeredBy:" in triggered and "deepseek-flash.socket" in triggered,
           "systemctl status does not show TriggeredBy deepseek-flash.socket")

    log(out, "## watchdog: the daemon pets it (WatchdogSec=2 through a drop-in)")
    dropin = UNIT_DIR / "deepseek-flash.service.d"
    dropin.mkdir(exist_ok=True)
    (dropin / "watchdog.conf").write_text("[Service]\nWatchdogSec=2\n")
    sh(out, "systemctl", "daemon-reload")
    sh(out, "systemctl", "restart", "deepseek-flash")
    pid = prop(out, "deepseek-flash", "MainPID")
    time.sleep(5)
    expect(prop(out, "deepseek-flash", "ActiveState") == "active" and prop(out, "deepseek-flash", "MainPID") == pid,
           "the watchdog killed the daemon: it does not send WATCHDOG=1 in time")
    expect(prop(out, "deepseek-flash", "NRestarts") == "0", "the service restarted under WatchdogSec=2")
    (dropin / "watchdog.conf").unlink()
    sh(out, "systemctl", "daemon-reload")
    security = sh(out, "systemd-analyze", "security", "--no-pager", "deepseek-flash", check=False)
    (out / "security.txt").write_text(security.stdout + security.stderr)

    log(out, "## a bad flash.json at start: failed, not restarted (RestartPreventExitStatus=2)")
    write_config(base, store, prefetch_window=-1)
    restart = sh(out, "systemctl", "restart", "deepseek-flash", check=False)
    expect(restart.returncode != 0, "systemctl restart with a bad flash.json succeeded")
    # Two RestartSec=2 periods: Restart=on-failure alone would have started it twice by now.
    time.sleep(4.5)
    expect(prop(out, "deepseek-flash", "ActiveState") == "failed",
           f"service {prop(out, 'deepseek-flash', 'ActiveState')} after a bad config, want failed")
    expect(prop(out, "deepseek-flash", "ExecMainStatus") == "2", "a config error did not exit 2")
    expect(prop(out, "deepseek-flash", "NRestarts") == "0", "systemd restarted a daemon with a bad config")
    journal = sh(out, "journalctl", "--no-pager", "-u", "deepseek-flash").stdout
    expect("invalid configuration" in journal and "prefetch_window" in journal,
           "the journal does not name the bad key")
    write_config(base, store)
    sh(out, "systemctl", "reset-failed", "deepseek-flash")

    log(out, "## final stop")
    sh(out, "systemctl", "stop", "deepseek-flash.socket", "deepseek-flash")
    expect(prop(out, "deepseek-flash", "ActiveState") == "inactive", "service not inactive")
    expect(prop(out, "deepseek-flash", "ExecMainStatus") == "0", "daemon did not exit 0")
    expect(not sock.exists(), "control.sock left behind after the socket unit stopped")
    missing = cli(out, "status", check=False)
    expect(missing.returncode == 1 and "no daemon running at /run/deepseek_flash/control.sock" in missing.stderr,
           f"status without a daemon: {missing.returncode} {missing.stderr!r}")
    log(out, "## all checks passed")


def main() -> int:
    store, out = sys.argv[1], Path(sys.argv[2])
    os.environ.pop("DEEPSEEK_FLASH_RUNTIME_DIR", None)
    try:
        scenario(store, out)
        return 0
    except (CheckFailed, subprocess.TimeoutExpired, subprocess.CalledProcessError) as exc:
        log(out, f"FAILED: {exc}")
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        journal = subprocess.run(["journalctl", "--no-pager", "-o", "short-precise", "-b"],
                                 capture_output=True, text=True, check=False)
        (out / "journal.log").write_text(journal.stdout + journal.stderr)
        status = subprocess.run(["systemctl", "status", "--no-pager", "deepseek-flash",
                                 "deepseek-flash.socket"], capture_output=True, text=True, check=False)
        (out / "systemctl-status.log").write_text(status.stdout + status.stderr)


if __name__ == "__main__":
    sys.exit(main())
