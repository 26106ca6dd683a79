"""deepseek-flash-repair --ssd_device DEV: the stores on one disk, under the disk's lock, never
while the running daemon has a model open there."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from deepseek_flash.cli import main, repair_main
from deepseek_flash.store import pack
from deepseek_flash.store.format import METADATA_FILE
from deepseek_flash.store.repair_device import disk_of_path, lock_device
from deepseek_flash.sysfs_shim.publisher import StatusTree


@pytest.fixture
def disk(tmp_path):
    """(block device node, whole-disk MAJ:MIN) of the disk under tmp_path."""
    devnum = disk_of_path(tmp_path)
    uevent = Path(f"/sys/dev/block/{devnum}/uevent")
    if not uevent.exists():
        pytest.skip(f"{tmp_path} is on no block device ({devnum}): nothing for --ssd_device to name")
    name = dict(line.split("=", 1) for line in uevent.read_text().splitlines())["DEVNAME"]
    node = Path("/dev") / name
    if not (node.exists() and stat.S_ISBLK(node.stat().st_mode)):
        major, minor = (int(x) for x in devnum.split(":"))
        node = tmp_path / name
        try:
            os.mknod(node, stat.S_IFBLK | 0o600, os.makedev(major, minor))
        except PermissionError:
            pytest.skip(f"no /dev/{name} and no right to make a device node for {devnum}")
    return node, devnum


@pytest.fixture
def setup(llama_dir, tmp_path, disk):
    """Two stores flash.json knows (a registered one, one under a store root), one unknown."""
    registered = pack(llama_dir, tmp_path / "registered")
    (tmp_path / "roots").mkdir()
    rooted = pack(llama_dir, tmp_path / "roots" / "rooted")
    pack(llama_dir, tmp_path / "elsewhere")
    config = tmp_path / "flash.json"
    config.write_text(json.dumps({"models": {"reg": str(registered)},
                                  "store_roots": [str(tmp_path / "roots")]}))
    runtime = tmp_path / "rt"
    return {"node": disk[0], "devnum": disk[1], "registered": registered, "rooted": rooted,
            "config": config, "runtime": runtime,
            "argv": ["--ssd_device", str(disk[0]), "--config", str(config), "--runtime-dir", str(runtime)]}


def test_repairs_every_configured_store_on_the_disk(setup, capsys):
    (setup["rooted"] / METADATA_FILE).unlink()
    assert repair_main(setup["argv"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2
    assert out[0] == (f"{setup['registered']}: metadata OK and the data of all 11 blocks checks (crc32c); "
                      f"nothing to do (--force_rebuild rebuilds anyway)")
    assert out[1].startswith(f"{setup['rooted']}: rebuilt flash_metadata.bin from 11 block headers "
                             f"({setup['rooted'] / METADATA_FILE}: missing")
    assert (setup["rooted"] / METADATA_FILE).exists()
    # The lock is a file of the runtime tree, released again.
    lock = setup["runtime"] / "locks" / f"dev-{setup['devnum']}.lock"
    os.close(lock_device(setup["devnum"], setup["runtime"]))
    assert lock.exists()


def test_a_given_store_only(setup, capsys):
    assert main(["repair", "--model_path", str(setup["registered"]), *setup["argv"]]) == 0
    assert capsys.readouterr().out.startswith(f"{setup['registered']}: metadata OK")


def test_refused_while_the_running_daemon_has_a_model_on_the_disk(setup, capsys):
    runtime = setup["runtime"]
    runtime.mkdir()
    (runtime / "control.sock").touch()
    StatusTree(runtime).publish({
        "status": {"controller_state": "ACTIVE", "pid": os.getpid(), "socket": str(runtime / "control.sock")},
        "models": {"reg": {"path": str(setup["registered"]), "device_disk_devnum": setup["devnum"]}}})
    (setup["rooted"] / METADATA_FILE).unlink()
    assert repair_main(setup["argv"]) == 2
    err = capsys.readouterr().err
    assert (f"--ssd_device {setup['node']} ({setup['devnum']}) is in use by the running deepseek-flashd "
            f"(pid {os.getpid()}): model(s) reg open on it; unload them first (deepseek-flash unload reg)") in err
    assert "[StoreInUse, code 109]" in err
    assert not (setup["rooted"] / METADATA_FILE).exists()        # nothing was touched
    # The same tree from a daemon that is gone does not hold the disk.
    (runtime / "control.sock").unlink()
    assert repair_main(setup["argv"]) == 0


def test_refused_while_another_repair_holds_the_disk_lock(setup, capsys):
    fd = lock_device(setup["devnum"], setup["runtime"])
    try:
        assert repair_main(setup["argv"]) == 2
    finally:
        os.close(fd)
    err = capsys.readouterr().err
    assert f"device {setup['devnum']}: its lock" in err and "is held (another repair of this disk" in err


def test_not_a_block_device(tmp_path, capsys):
    assert repair_main(["--ssd_device", str(tmp_path), "--runtime-dir", str(tmp_path / "rt")]) == 2
    assert f"--ssd_device {tmp_path}: {tmp_path} is not a block device [DeviceError, code 220]" in (
        capsys.readouterr().err)
