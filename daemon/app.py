"""Composition root of the controller and the ``deepseek-flashd`` entry point.

``Application`` takes the controller from ``daemon.factory.build_controller`` (the same parts
embedded mode runs) and adds what a daemon process has on top -- status publisher, sd_notify
notifier, socket server -- passing each in, so nothing is a module-level singleton and tests can
hand in their own. ``main()`` parses the command line, sets up logging
(the journal under systemd, stderr otherwise), installs signal handlers that only set flags (the
wake-up fd breaks the event loop's select), and runs the loop:

* SIGHUP: ``RELOADING=1``, re-read the config; a bad file keeps the old config (logged, sent as
  ``STATUS=``, shown as ``config_state``/``last_reload_error`` in the status file); ``READY=1``.
* SIGTERM/SIGINT: ``STOPPING=1``, finish in-flight replies, close clients, remove the socket,
  exit 0.
* ``READY=1`` only once the socket is bound and the first status tree is written; ``WATCHDOG=1``
  every half ``WATCHDOG_USEC`` from the loop itself, so a wedged loop stops petting the watchdog.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from .. import __version__, paths
from ..errors import ConfigError, DaemonAlreadyRunning, FlashError
from .config import RESTART_ONLY, FlashConfig
from .factory import build_controller
from .server import Server
from .sockets import SocketLock, activation_sockets, bind_socket, resolve_group

log = logging.getLogger("deepseek_flash.daemon")

STATUS_INTERVAL = 1.0       # the status tree is rewritten at least this often
STATUS_DEBOUNCE = 0.1       # and at most this often when state changes


class Application:
    """The controller of one daemon process (or of a test)."""

    def __init__(self, config_path: Path, socket_path: Path, runtime_dir: Path, *, notifier=None,
                 publisher=None, environ=None, udev_monitor=None):
        self.config_path = Path(config_path)
        self.socket_path = Path(socket_path)
        self.runtime_dir = Path(runtime_dir)
        self.environ = os.environ if environ is None else environ
        self._notifier = notifier
        self._publisher = publisher
        self.state = "STARTING"
        self.config_state = "ok"
        self.last_reload_error = ""
        self.stop_requested = threading.Event()
        self.reload_requested = threading.Event()
        self.config: FlashConfig | None = None
        self.controller = self.manager = self.server = None
        self._lock = None
        self._bound_path: Path | None = None
        self.socket_name = str(self.socket_path)
        self._status_thread = None
        self._published_generation = -1
        self._status_wake = threading.Event()
        # The udev event source of the device watch (None: pyudev's netlink monitor if reachable).
        self._udev_monitor = udev_monitor
        self._last_controller_state = None

    # --- start ---------------------------------------------------------------------------------
    def start(self) -> None:
        from ..sysfs_shim.publisher import StatusTree
        from .notify import Notifier

        self.config = FlashConfig.load(self.config_path)
        self.runtime_dir.mkdir(parents=True, exist_ok=True)
        self.notifier = self._notifier or Notifier(self.environ)
        self.publisher = self._publisher or StatusTree(self.runtime_dir)
        listeners = activation_sockets(self.environ)
        if not listeners:
            self.socket_path.parent.mkdir(parents=True, exist_ok=True)
            self._lock = SocketLock(self.socket_path)
            try:
                listeners = [bind_socket(self.socket_path, self.config.socket_mode,
                                         resolve_group(self.config.socket_group))]
            except BaseException:
                self._lock.release()
                self._lock = None
                raise
            self._bound_path = self.socket_path
        self.socket_name = _socket_name(listeners, self.socket_path)
        try:
            self._mark_tree()
            self._build(listeners)
        except BaseException:
            for sock in listeners:
                sock.close()
            self._release_socket()
            self.publisher.remove()
            raise
        self.state = "ACTIVE"
        self.publish()
        self._status_thread = threading.Thread(target=self._status_loop, name="flash-status", daemon=True)
        self._status_thread.start()
        where = self._bound_path or "systemd-activated socket"
        log.info("deepseek-flashd %s serving on %s (pid %d)", __version__, where, os.getpid())
        self.notifier.ready(status=f"serving on {where}")

    def _mark_tree(self) -> None:
        """Claim the status tree before the slow part of the start: a dead predecessor's files go,
        and ``status`` names this process (STARTING, pid, socket), so no reader takes a killed
        daemon's tree for a running one (docs/operations.md, "Is it running?")."""
        self.publisher.reset()
        self.publisher.publish({"status": {"controller_state": "STARTING", "pid": os.getpid(),
                                           "socket": self.socket_name, "version": __version__}})

    def _build(self, listeners) -> None:
        self.controller = build_controller(self.config, status=self.snapshot,
                                           udev_monitor=self._udev_monitor, imports_ahead=True)
        self.manager = self.controller.manager
        manager = self.manager
        try:
            self.server = Server(self.controller.ops, listeners, self.controller.arena,
                                 self.config.max_frame_bytes, resolve_group(self.config.socket_group),
                                 max_outstanding=lambda: manager.config.max_outstanding_requests_per_client)
        except BaseException:
            self.controller.close()
            raise

    # --- status --------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """The controller's snapshot plus this process's own state (the ``status`` op and tree)."""
        snap = self.controller.snapshot()
        status = snap["status"]
        if self.state != "ACTIVE":
            status["controller_state"] = self.state
        status.update(config_state=self.config_state, last_reload_error=self.last_reload_error,
                      config_path=str(self.config_path), pid=os.getpid(), socket=self.socket_name,
                      version=__version__)
        return snap

    def publish(self) -> None:
        generation = self.manager.generation
        snap = self.snapshot()
        try:
            self.publisher.publish(snap)
        except OSError as exc:
            log.warning("status tree %s not written: %s", self.runtime_dir, exc)
        self._published_generation = generation
        self._announce(snap["status"])

    def _announce(self, status: dict) -> None:
        """Tell systemd (``STATUS=``) and the log when the controller turns DEGRADED or back."""
        state = status["controller_state"]
        if state == self._last_controller_state or state not in ("ACTIVE", "DEGRADED"):
            return
        previous, self._last_controller_state = self._last_controller_state, state
        if state == "DEGRADED":
            log.error("controller DEGRADED: %s", status.get("degraded_reason", ""))
            self.notifier.status(f"DEGRADED: {status.get('degraded_reason', '')}")
        elif previous == "DEGRADED":
            log.warning("controller ACTIVE again")
            self.notifier.status("ACTIVE: serving")

    def _status_loop(self) -> None:
        # Off the event loop: the fsyncs of the status files never delay a reply.
        last = time.monotonic()
        while not self.stop_requested.is_set():
            self._status_wake.wait(STATUS_DEBOUNCE)
            self._status_wake.clear()
            now = time.monotonic()
            if self.manager.generation != self._published_generation or now - last >= STATUS_INTERVAL:
                self.publish()
                last = now

    # --- loop ----------------------------------------------------------------------------------
    def run(self) -> int:
        watchdog = self.notifier.watchdog_interval()
        next_pet = time.monotonic()
        while not self.stop_requested.is_set():
            timeout = 0.5
            if watchdog:
                timeout = max(0.0, min(timeout, next_pet - time.monotonic()))
            self.server.serve_once(timeout)
            if self.reload_requested.is_set():
                self.reload_requested.clear()
                self.reload()
            if watchdog and time.monotonic() >= next_pet:
                self.notifier.watchdog()
                next_pet = time.monotonic() + watchdog / 2
        self.shutdown()
        return 0

    def reload(self) -> bool:
        self.notifier.reloading(status=f"reloading {self.config_path}")
        log.info("SIGHUP: reloading %s", self.config_path)
        try:
            new = FlashConfig.load(self.config_path)
            resolve_group(new.socket_group)
        except FlashError as exc:
            self.config_state = "reload_failed"
            self.last_reload_error = str(exc)
            log.error("config reload failed, keeping the running config: %s", exc)
            self.publish()
            self.notifier.ready(status=f"config reload failed, old config kept: {exc}")
            return False
        fixed = [k for k in RESTART_ONLY if new[k] != self.config[k]]
        if fixed:
            log.warning("config keys %s change only at restart; running values kept", ", ".join(fixed))
            new = new.override({k: self.config[k] for k in fixed})
        self.config = new
        self.manager.update_config(new)
        self.server.allowed_gid = resolve_group(new.socket_group)
        self.config_state = "ok"
        self.last_reload_error = ""
        self.publish()
        self.notifier.ready(status="config reloaded")
        return True

    def _release_socket(self) -> None:
        if self._bound_path is not None:
            self._bound_path.unlink(missing_ok=True)
            self._bound_path = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def request_stop(self) -> None:
        self.stop_requested.set()
        self.server.wake()

    def shutdown(self) -> None:
        self.state = "STOPPING"
        self.notifier.stopping(status="stopping: draining clients")
        log.info("stopping: finishing in-flight replies and closing clients")
        self.stop_requested.set()
        self._status_wake.set()
        self.server.drain()
        self._release_socket()
        if self._status_thread is not None:
            self._status_thread.join()
        self.publish()
        self.controller.close()
        self.server.close()
        self.publisher.remove()
        log.info("stopped")


def _socket_name(listeners, bound: Path) -> str:
    """The path clients connect to: the socket bound here, or the one systemd passed."""
    for sock in listeners:
        name = sock.getsockname()
        if isinstance(name, str) and name:
            return name
    return str(bound)


# --- command line -------------------------------------------------------------------------------------

def setup_logging(level: str, environ=os.environ) -> None:
    root = logging.getLogger()
    root.setLevel(level.upper())
    handler = None
    missing_binding = False
    if environ.get("JOURNAL_STREAM"):
        # Started by systemd: structured journal fields instead of a text stream.
        try:
            from systemd.journal import JournalHandler
        except ImportError:
            missing_binding = True
        else:
            handler = JournalHandler(SYSLOG_IDENTIFIER="deepseek-flashd")
            handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.handlers[:] = [handler]
    if missing_binding:
        log.info("systemd-python is not installed: logging to stderr, which the journal records as "
                 "plain lines (for structured fields: pip install 'deepseek-flash[journal]', which "
                 "needs libsystemd-dev and pkg-config)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepseek-flashd",
                                description="deepseek-flash controller daemon (runs in the foreground).")
    p.add_argument("--config", type=Path, default=None,
                   help=f"config file (default {paths.config_path()}; env DEEPSEEK_FLASH_CONFIG)")
    p.add_argument("--socket", type=Path, default=None,
                   help="control socket path (default <runtime-dir>/control.sock; env DEEPSEEK_FLASH_SOCKET)")
    p.add_argument("--runtime-dir", type=Path, default=None,
                   help=f"status tree root (default {paths.runtime_dir()}; env DEEPSEEK_FLASH_RUNTIME_DIR)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--version", action="version", version=f"deepseek-flashd {__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    runtime = args.runtime_dir or paths.runtime_dir()
    if args.socket:
        socket_path = args.socket
    elif os.environ.get("DEEPSEEK_FLASH_SOCKET") or not args.runtime_dir:
        socket_path = paths.socket_path()
    else:
        socket_path = runtime / "control.sock"
    if args.config is not None:
        # A file named on the command line must exist; only the default location may be absent.
        try:
            FlashConfig.load(args.config, required=True)
        except ConfigError as exc:
            log.error("invalid configuration: %s", exc)
            return 2
    app = Application(args.config or paths.config_path(), socket_path, runtime)

    def on_signal(signum, _frame):
        # Only flags here; the wake-up fd (set below) breaks the loop's select.
        if signum == signal.SIGHUP:
            app.reload_requested.set()
        else:
            app.stop_requested.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        app.start()
    except DaemonAlreadyRunning as exc:
        log.error("%s", exc)
        return 3
    except ConfigError as exc:
        log.error("invalid configuration: %s", exc)
        return 2
    except FlashError as exc:
        log.error("cannot start: %s [%s, code %d]", exc, type(exc).__name__, exc.code)
        return 1
    signal.set_wakeup_fd(app.server.wake_w, warn_on_full_buffer=False)
    return app.run()


if __name__ == "__main__":
    sys.exit(main())
