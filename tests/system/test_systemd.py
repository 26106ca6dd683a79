"""deepseek-flash under a real systemd: units, notify, status tree, socket activation, reload, stop.

Boots a throw-away Debian container with systemd as PID 1 through the shared harness
(``<repo>/../shared/systemd-harness/harness.sh``; CI clones ``shared`` beside the repository) and
runs ``scenario.py`` in it with this Python environment and this repository bound read-only at
their own paths. A tiny model packed here is bound at /srv/deepseek-flash-test/tiny (not under
/tmp: the service has PrivateTmp=). On failure the scenario log, the journal and the container
console are printed.

Root only. Outside CI a missing root or harness skips with a message saying how to run it
(``DEEPSEEK_FLASH_SYSD_HARNESS`` points at a harness elsewhere); in CI (``CI=true``) either is a
failure, not a skip.
"""
from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(os.environ.get("DEEPSEEK_FLASH_SYSD_HARNESS",
                              REPO.parent / "shared" / "systemd-harness" / "harness.sh"))
CACHE = Path(os.environ.get("DEEPSEEK_FLASH_SYSD_CACHE", "/var/cache/deepseek-flash-sysd"))
# The pyenv/python.org builds link these; minbase Debian lacks them.
PACKAGES = "python3,libffi8,libssl3"
# Named like its registered name: the daemon names an open model after its store directory.
STORE_IN_CONTAINER = "/srv/deepseek-flash-test/tiny"
OUT_IN_CONTAINER = "/srv/deepseek-flash-test/out"
IN_CI = os.environ.get("CI", "").lower() == "true"

pytestmark = [pytest.mark.systemd, pytest.mark.slow]


def python_binds() -> list[str]:
    """Directories that hold this interpreter and its packages, outermost only."""
    candidates = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix), REPO}
    candidates.update(Path(p) for p in site.getsitepackages())
    user_site = site.getusersitepackages()
    if user_site and Path(user_site).is_dir():
        candidates.add(Path(user_site))
    resolved = sorted({p.resolve() for p in candidates if p.exists()}, key=lambda p: len(p.parts))
    outer: list[Path] = []
    for path in resolved:
        if not any(path == o or o in path.parents for o in outer):
            outer.append(path)
    return [str(p) for p in outer]


def find_harness(harness: Path = HARNESS, in_ci: bool = IN_CI) -> Path:
    """The harness script; outside CI a missing root or harness skips (saying how to run the
    test), in CI (CI=true) it fails."""
    how = (f"to run it: as root, with a systemd-nspawn harness at {harness} (the shared repository "
           f"cloned beside this one, or DEEPSEEK_FLASH_SYSD_HARNESS=/path/to/harness.sh)")
    if os.geteuid() != 0:
        if in_ci:
            pytest.fail("the systemd test needs root in CI (it boots a container with systemd-nspawn)")
        pytest.skip(f"boots a systemd container: root only; {how}")
    if not harness.is_file():
        if in_ci:
            pytest.fail(f"systemd harness not found at {harness}: clone the shared repository beside "
                        f"this one (../shared) so that systemd-harness/harness.sh exists")
        pytest.skip(f"no systemd harness at {harness}; {how}")
    return harness


@pytest.fixture(scope="module")
def harness():
    return find_harness()


def test_missing_harness_skips_outside_ci_and_fails_in_ci(tmp_path):
    missing = tmp_path / "shared" / "systemd-harness" / "harness.sh"
    if os.geteuid() != 0:
        with pytest.raises(pytest.fail.Exception, match="needs root in CI"):
            find_harness(missing, in_ci=True)
        return
    with pytest.raises(pytest.skip.Exception, match=f"no systemd harness at {missing}; to run it: as root"):
        find_harness(missing, in_ci=False)
    with pytest.raises(pytest.fail.Exception, match=f"systemd harness not found at {missing}"):
        find_harness(missing, in_ci=True)
    missing.parent.mkdir(parents=True)
    missing.write_text("#!/bin/sh\n")
    assert find_harness(missing, in_ci=True) == missing


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from deepseek_flash.store import pack
    from deepseek_flash.testing import make_tiny_model

    base = tmp_path_factory.mktemp("sysd")
    src = make_tiny_model(base / "src", "llama")
    return pack(src, base / "store")


def test_service_life_cycle_under_systemd(harness, store, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    console = tmp_path / "console.log"
    env = dict(os.environ,
               SYSD_HARNESS_PACKAGES=PACKAGES,
               SYSD_HARNESS_BIND_RO=" ".join([*python_binds(), f"{store}:{STORE_IN_CONTAINER}"]),
               SYSD_HARNESS_BIND=f"{out}:{OUT_IN_CONTAINER}",
               SYSD_HARNESS_LOG=str(console))
    CACHE.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [str(harness), str(CACHE), "--", sys.executable, str(REPO / "tests" / "system" / "scenario.py"),
         STORE_IN_CONTAINER, OUT_IN_CONTAINER],
        env=env, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        report = [f"harness exit {proc.returncode}", "--- harness stdout/stderr", proc.stdout, proc.stderr]
        for name in ("scenario.log", "systemctl-status.log", "journal.log", "verify.log"):
            path = out / name
            if path.exists():
                report += [f"--- {name}", path.read_text()[-20000:]]
        if console.exists():
            report += ["--- container console (tail)", console.read_text()[-5000:]]
        pytest.fail("\n".join(report))

    log = (out / "scenario.log").read_text()
    assert log.rstrip().endswith("## all checks passed")
    assert (out / "verify.log").read_text() == ""
    status = (out / "status.txt").read_text().splitlines()
    assert status[0] == "controller_state: ACTIVE"
    assert [line.split(":")[0] for line in status[:4]] == [
        "controller_state", "prefetch_hit_rate", "semantic_block_count", "unified_memory_fabric"]
    assert (out / "set.txt").read_text() == "prefetch_window: auto -> 32\n"
    failed = dict(line.split(": ", 1) for line in (out / "status_reload_failed.txt").read_text().splitlines()
                  if ": " in line)
    assert failed["config_state"] == "reload_failed"
    metrics = (out / "metrics.prom").read_text()
    assert 'deepseek_flash_controller_state{state="ACTIVE"} 1' in metrics
    assert 'deepseek_flash_model_resident_blocks{model="tiny"}' in metrics
