"""defrag: re-layout by access_freq, bit-exact reads and verify after it, SIGKILL at random moments
and at each phase boundary, refusal while in use, leftovers cleaned, repair over a renamed file."""
from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from deepseek_flash import cli
from deepseek_flash.errors import StoreInUse
from deepseek_flash.store import Store, pack
from deepseek_flash.store.format import encode_metadata
from deepseek_flash.store.maintenance import LOCK_FILE
from deepseek_flash.store.repair import repair, write_metadata_atomic
from deepseek_flash.store.verify import verify_store
from deepseek_flash.testing import make_tiny_model
from deepseek_flash.tools.defrag import defrag

FREQ = {6: 100, 0: 50, 11: 7, 3: 7, 9: 1}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A ~12 MB store (large enough that a defrag takes a while) with access counts set."""
    base = tmp_path_factory.mktemp("defrag")
    src = make_tiny_model(base / "hf", "qwen2", hidden_size=256, num_layers=4, intermediate_size=1024,
                          num_heads=4, num_kv_heads=2, vocab_size=4096, tie_word_embeddings=False)
    store = pack(src, base / "store")
    s = Store.open(store)
    for b in s.blocks:
        b.access_freq = FREQ.get(b.id, 0)
    write_metadata_atomic(store, encode_metadata(s.blocks, s.model))
    return store


def _contents(path):
    s = Store.open(path)
    return {b.id: s.read_block(b.id) for b in s.blocks}


@pytest.fixture(scope="module")
def reference(pristine):
    return _contents(pristine)


@pytest.fixture
def store(pristine, tmp_path):
    dst = tmp_path / "store"
    shutil.copytree(pristine, dst)
    return dst


@pytest.fixture
def runtime(tmp_path):
    return tmp_path / "run"


def _assert_whole(path, reference):
    s = Store.open(path)
    report = verify_store(s)
    assert report.ok, report.bad
    assert _contents(path) == reference


def test_reorders_by_access_freq(store, reference, runtime):
    report = defrag(store, runtime=runtime)
    assert report.action == "rewritten" and report.new_file == "blocks.1.dat"
    assert report.old_files == ["blocks.dat"]
    n = len(reference)
    expected = [6, 0, 3, 11, 9] + [i for i in range(n) if i not in FREQ]
    assert report.order_ids == expected
    s = Store.open(store)
    assert [b.id for b in sorted(s.blocks, key=lambda b: b.header_offset)] == expected
    assert {b.file for b in s.blocks} == {"blocks.1.dat"}
    assert [b.access_freq for b in s.blocks] == [FREQ.get(i, 0) for i in range(n)]
    assert sorted(p.name for p in store.glob("blocks*.dat")) == ["blocks.1.dat"]
    _assert_whole(store, reference)
    # Already in order: nothing rewritten. Forward order: back to the packer's layout.
    assert defrag(store, runtime=runtime).action == "none"
    back = defrag(store, order="forward", runtime=runtime)
    assert back.new_file == "blocks.2.dat" and back.order_ids == list(range(n))
    _assert_whole(store, reference)


def test_all_zero_counts_keep_forward_order(store, reference, runtime):
    s = Store.open(store)
    for b in s.blocks:
        b.access_freq = 0
    write_metadata_atomic(store, encode_metadata(s.blocks, s.model))
    report = defrag(store, runtime=runtime)
    assert report.action == "none" and "access_freq is 0" in report.note


def test_repair_rebuilds_from_renamed_file(store, reference, runtime):
    defrag(store, runtime=runtime)
    (store / "flash_metadata.bin").unlink()
    rep = repair(store)
    assert rep.action == "rebuilt" and rep.ok
    _assert_whole(store, reference)


def test_refuses_store_in_running_daemon(store, runtime):
    (runtime / "models" / "qwen").mkdir(parents=True)
    (runtime / "status").write_text(f"controller_state: ACTIVE\npid: {os.getpid()}\n")
    (runtime / "models" / "qwen" / "info").write_text(f"name: qwen\npath: {store}\nstate: open\n")
    with pytest.raises(StoreInUse) as exc:
        defrag(store, runtime=runtime)
    assert exc.value.code == 109 and "model qwen" in str(exc.value)
    assert sorted(p.name for p in store.glob("blocks*.dat")) == ["blocks.dat"]
    rc = cli.main(["defrag", "--model_path", str(store), "--runtime-dir", str(runtime), "--quiet"])
    assert rc == 2
    # A tree left by a daemon that died does not count.
    (runtime / "status").write_text("controller_state: ACTIVE\npid: 999999999\n")
    assert defrag(store, runtime=runtime).action == "rewritten"


def test_refuses_concurrent_defrag(store, runtime):
    fd = os.open(store / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(StoreInUse, match="maintenance lock"):
            defrag(store, runtime=runtime)
    finally:
        os.close(fd)


def test_bad_inputs(tmp_path, capsys):
    assert cli.main(["defrag", "--model_path", str(tmp_path)]) == 2
    assert "not a deepseek-flash store" in capsys.readouterr().err
    assert cli.defrag_main([str(tmp_path / "a"), "--model_path", str(tmp_path / "b")]) == 2
    assert not (tmp_path / LOCK_FILE).exists()


def test_cli_json(store, runtime, capsys):
    rc = cli.defrag_main(["--model_path", str(store), "--runtime_dir", str(runtime), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["action"] == "rewritten" and doc["new_file"] == "blocks.1.dat"


# --- kills ---------------------------------------------------------------------------------------
def _env(runtime):
    return {**os.environ, "DEEPSEEK_FLASH_RUNTIME_DIR": str(runtime)}


def _after_kill(store, reference, runtime):
    _assert_whole(store, reference)
    report = defrag(store, runtime=runtime)   # finishes the job and removes the leftovers
    _assert_whole(store, reference)
    names = sorted(p.name for p in store.iterdir() if "blocks" in p.name)
    assert names == [Store.open(store).blocks[0].file], names
    return report


def test_sigkill_at_random_moments(pristine, reference, tmp_path):
    runtime = tmp_path / "run"
    cmd = [sys.executable, "-m", "deepseek_flash", "defrag", "--quiet"]
    # How long a whole run takes here, so the kills spread over it.
    probe = tmp_path / "probe"
    shutil.copytree(pristine, probe)
    t = time.monotonic()
    subprocess.run([*cmd, str(probe)], check=True, env=_env(runtime))
    full = time.monotonic() - t
    rng = random.Random(1234)
    states = set()
    for trial in range(8):
        store = tmp_path / f"s{trial}"
        shutil.copytree(pristine, store)
        proc = subprocess.Popen([*cmd, str(store)], env=_env(runtime))
        time.sleep(rng.uniform(0.5, 1.0) * full)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        states.add(Store.open(store).blocks[0].file)
        _after_kill(store, reference, runtime)
        shutil.rmtree(store)
    assert states <= {"blocks.dat", "blocks.1.dat"}


# Each phase boundary of defrag, killed deterministically by a driver that SIGKILLs itself.
_DRIVER = r"""
import os, signal, sys
import deepseek_flash.tools.defrag as d
phase, store = sys.argv[1], sys.argv[2]
def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
if phase == "mid-copy":
    real = d._copy_block
    count = [0]
    def copy(*a, **k):
        count[0] += 1
        if count[0] == 4:
            die()
        return real(*a, **k)
    d._copy_block = copy
elif phase == "before-commit":
    d.write_metadata_atomic = die
elif phase == "during-commit":
    real_replace = os.replace          # fsutil.atomic_write's rename
    def replace(src, dst):
        if str(dst).endswith("flash_metadata.bin"):
            die()
        return real_replace(src, dst)
    os.replace = replace
elif phase == "before-delete":
    real_commit = d.write_metadata_atomic
    def commit(*a, **k):
        real_commit(*a, **k)
        die()
    d.write_metadata_atomic = commit
d.defrag(store)
"""


@pytest.mark.parametrize("phase, expect_file", [("mid-copy", "blocks.dat"),
                                                ("before-commit", "blocks.dat"),
                                                ("during-commit", "blocks.dat"),
                                                ("before-delete", "blocks.1.dat")])
def test_sigkill_at_each_phase(store, reference, tmp_path, phase, expect_file):
    runtime = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", _DRIVER, phase, str(store)], env=_env(runtime),
                          check=False)
    assert proc.returncode == -signal.SIGKILL
    assert Store.open(store).blocks[0].file == expect_file
    leftovers = {p.name for p in store.iterdir() if "blocks" in p.name}
    assert leftovers - {"blocks.dat"}, "the kill came before defrag wrote anything"
    rep = _after_kill(store, reference, runtime)
    if expect_file == "blocks.dat":
        assert rep.action == "rewritten" and rep.new_file == "blocks.1.dat"
    else:
        assert rep.action == "none"
