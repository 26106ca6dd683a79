"""``deepseek-flash demo`` end to end, embedded and with the real daemon: every step printed,
status with controller_state ACTIVE, exit 0; --keep keeps the files; a non-empty --keep exits 2."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_demo(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "deepseek_flash", "demo", *argv], check=False, capture_output=True,
                          text=True, timeout=300, env=env)


def clean_env(tmp_path):
    """No daemon reachable and no system config: what a fresh machine looks like."""
    env = dict(os.environ)
    env.update(DEEPSEEK_FLASH_RUNTIME_DIR=str(tmp_path / "rt"),
               DEEPSEEK_FLASH_SOCKET=str(tmp_path / "rt" / "control.sock"),
               DEEPSEEK_FLASH_CONFIG=str(tmp_path / "no-flash.json"))
    return env


def check_steps(out: str, mode: str):
    for n in range(1, 8):
        assert f"[{n}] " in out, out
    assert "verified 19 blocks" in out
    assert f"({mode}, " in out and "identical to plain transformers" in out
    assert out.count("-- bytes equal the store's") == 4
    assert "    controller_state: ACTIVE\n" in out
    assert "    semantic_block_count: 19\n" in out
    assert out.rstrip().splitlines()[-1].startswith("demo OK")


def test_demo_embedded(tmp_path):
    r = run_demo(env=clean_env(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    check_steps(r.stdout, "embedded")
    assert "status (embedded controller):" in r.stdout
    assert r.stderr == ""


def test_demo_daemon_keep(tmp_path):
    keep = tmp_path / "kept"
    r = run_demo("--daemon", "--keep", str(keep), env=clean_env(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    check_steps(r.stdout, "daemon")
    assert "started deepseek-flashd (pid " in r.stdout
    assert "    config_state: ok\n" in r.stdout          # the daemon's own status file
    assert "[8] stopped deepseek-flashd (SIGTERM, exit status 0)" in r.stdout
    assert r.stdout.rstrip().endswith(f"files kept in {keep}")
    assert (keep / "store" / "flash_metadata.bin").is_file()
    assert (keep / "tiny-llama" / "config.json").is_file()
    assert f"opened model store from {keep / 'store'} (19 blocks" in (keep / "daemon.log").read_text()


def test_keep_must_be_empty(tmp_path):
    keep = tmp_path / "full"
    keep.mkdir()
    (keep / "x").write_text("x")
    r = run_demo("--keep", str(keep), env=clean_env(tmp_path))
    assert r.returncode == 2
    assert f"--keep {keep}: exists and is not an empty directory" in r.stderr
    assert (keep / "x").read_text() == "x"


@pytest.mark.parametrize("flag", ["--daemon", "--device", "--keep"])
def test_help_explains_every_flag(flag):
    r = run_demo("--help")
    assert r.returncode == 0 and flag in r.stdout
