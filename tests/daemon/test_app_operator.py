"""``deepseek-flashd`` as an operator meets it: logging without the journal binding, the status
tree claimed at start, configuration errors at start."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

from deepseek_flash.daemon import app as app_module
from deepseek_flash.daemon.app import Application, setup_logging
from deepseek_flash.sysfs_shim.publisher import StatusTree, parse


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_without_the_journal_binding_the_daemon_logs_to_stderr_and_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "systemd", None)          # `from systemd.journal import` fails
    monkeypatch.setitem(sys.modules, "systemd.journal", None)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging("info", environ={"JOURNAL_STREAM": "8:1234"})
        assert [type(h) for h in root.handlers] == [logging.StreamHandler]
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    err = capsys.readouterr().err
    assert "systemd-python is not installed: logging to stderr" in err
    assert "pip install 'deepseek-flash[journal]'" in err and "libsystemd-dev" in err


def test_start_claims_the_tree_before_building(tmp_path, monkeypatch):
    runtime = tmp_path / "rt"
    # A killed predecessor's tree: its pid is gone, its files stayed.
    StatusTree(runtime).publish({"status": {"controller_state": "ACTIVE", "pid": dead_pid()},
                                 "stats": {"hits": 5, "stale_field": 1},
                                 "models": {"old": {"state": "open", "blocks": 1}}})
    config = tmp_path / "flash.json"
    config.write_text('{"host_cache_bytes": "16MiB"}')
    seen = {}

    build = app_module.build_controller

    def probe(*args, **kwargs):
        # Runs inside the start, once the arenas exist and before READY.
        controller = build(*args, **kwargs)
        seen["status"] = parse((runtime / "status").read_text())
        seen["files"] = sorted(p.name for p in runtime.iterdir() if not p.name.startswith("."))
        seen["models"] = sorted(p.name for p in (runtime / "models").iterdir())
        return controller

    monkeypatch.setattr(app_module, "build_controller", probe)
    app = Application(config, tmp_path / "s.sock", runtime, environ={})
    app.start()
    try:
        assert seen["status"] == {"controller_state": "STARTING", "pid": str(os.getpid()),
                                  "socket": str(tmp_path / "s.sock"), "version": app.snapshot()["status"]["version"]}
        assert seen["files"] == ["metrics.prom", "models", "status"]
        assert seen["models"] == []
        status = parse((runtime / "status").read_text())
        assert status["controller_state"] == "ACTIVE" and status["pid"] == str(os.getpid())
        assert status["socket"] == str(tmp_path / "s.sock")
        assert "stale_field" not in parse((runtime / "stats").read_text())
    finally:
        app.shutdown()
    assert not (runtime / "status").exists()
