"""Device watch: store -> block device mapping, udev remove/read-only/add through an injected
monitor, and a real store file truncated under the daemon (host-only, then back)."""
import errno
import os
import socket
import threading
import time

import pytest
from deepseek_flash.daemon import recovery
from deepseek_flash.daemon.block_manager import BlockManager
from deepseek_flash.daemon.config import FlashConfig
from deepseek_flash.daemon.recovery import DeviceWatch, block_device_of
from faults import FakeDevice, FakeMonitor, copy_store, corrupt_block
from flashd_harness import assert_eventually

from deepseek_flash._core import HostArena, IOEngine
from deepseek_flash.errors import DeviceError, FlashIOError
from deepseek_flash.store import Store


def text_of(path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def fake_sysfs(root, path):
    """A sysfs tree in which ``path``'s device is partition nvme0n1p1 of an NVMe disk."""
    st = os.stat(path)
    devnum = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    disk = root / "devices" / "pci0000:00" / "nvme" / "nvme0" / "nvme0n1"
    part = disk / "nvme0n1p1"
    part.mkdir(parents=True)
    (part / "partition").write_text("1\n")
    (part / "dev").write_text(devnum + "\n")
    (disk / "dev").write_text("259:0\n")
    (disk / "ro").write_text("0\n")
    (disk / "device").mkdir()
    (disk / "device" / "model").write_text("Flash Test NVMe 2TB   \n")
    (disk / "device" / "serial").write_text("  S6XYZ123  \n")
    (disk / "device" / "firmware_rev").write_text("3B2QGXA7\n")
    (root / "dev" / "block").mkdir(parents=True)
    os.symlink(part, root / "dev" / "block" / devnum)
    return devnum


def test_maps_a_partition_to_its_disk(tmp_path, tiny_store):
    devnum = fake_sysfs(tmp_path / "sys", tiny_store)
    info = block_device_of(tiny_store, tmp_path / "sys")
    assert info == {"devnum": devnum, "disk_devnum": "259:0", "disk": "nvme0n1", "partition": "nvme0n1p1",
                    "node": "/dev/nvme0n1", "model": "Flash Test NVMe 2TB", "serial": "S6XYZ123",
                    "firmware": "3B2QGXA7", "ro": False}


def test_a_file_system_without_a_block_device(tmp_path, tiny_store):
    (tmp_path / "sys" / "dev" / "block").mkdir(parents=True)      # no link for the store's devnum
    st = os.stat(tiny_store)
    assert block_device_of(tiny_store, tmp_path / "sys") == {
        "devnum": f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}", "disk": "", "node": "",
        "note": "no block device (virtual or network file system)"}


@pytest.fixture
def watched(tmp_path, tiny_store):
    """A graceful and a strict copy of tiny on a fake NVMe disk, a manager, a watch, a monitor."""
    made = []

    def make(mode):
        path = copy_store(tiny_store, tmp_path / mode, "tiny")
        sysfs = tmp_path / f"sys-{mode}"
        fake_sysfs(sysfs, path)
        cfg = FlashConfig.from_dict({"prefetch_window": 0, "eviction_threshold": 1.0,
                                     "store_roots": [str(path.parent)], "error_recovery_mode": mode})
        m = BlockManager(cfg, HostArena(8 << 20), IOEngine())
        monitor = FakeMonitor()
        watch = DeviceWatch(m, monitor=monitor, sysfs=sysfs, probe_interval=0.05)
        made.append((m, watch))
        return m, watch, monitor, Store.open(path)
    yield make
    for m, watch in made:
        watch.close()
        m.close()


DISK = os.makedev(259, 0)


def test_udev_remove_makes_a_graceful_model_host_only_and_add_brings_it_back(watched):
    m, watch, monitor, store = watched("graceful")
    m.open_model(0, "tiny")
    info = m.snapshot()["models"]["tiny"]
    assert (info["device_model"], info["device_serial"], info["device_firmware"]) == \
        ("Flash Test NVMe 2TB", "S6XYZ123", "3B2QGXA7")
    assert info["unified_memory_fabric"] == "ENABLED"
    warm = m.acquire(0, "tiny", layer=0)
    monitor.push(FakeDevice("remove", DISK, "nvme0n1"))
    assert_eventually(lambda: m.stats()["host_only_models"] == 1, what="host-only")
    snap = m.snapshot()
    assert snap["models"]["tiny"]["unified_memory_fabric"] == "HOST_ONLY"
    assert "nvme0n1 removed" in snap["models"]["tiny"]["host_only_reason"]
    assert snap["status"]["unified_memory_fabric"] == "HOST_ONLY"
    assert snap["status"]["controller_state"] == "DEGRADED"
    # Host-resident blocks keep serving, byte-exact; a disk read fails fast and typed.
    again = m.acquire(0, "tiny", layer=0)
    for bid, off in again.blocks.items():
        assert bytes(m.arena.view(off, store.block(bid).length)) == store.read_block(bid)
    read = m.stats()["bytes_read_nvme"]
    start = time.monotonic()
    with pytest.raises(DeviceError) as err:
        m.acquire(0, "tiny", layer=2)
    assert time.monotonic() - start < 0.5 and err.value.code == 220
    assert err.value.device == "/dev/nvme0n1" and "block" in str(err.value)
    assert m.stats()["bytes_read_nvme"] == read and m.prefetch("tiny", layers=[3]) == 0
    # A probe does not bring a udev-removed device back (page cache would lie); `add` does.
    assert watch.probe() == [] and m.stats()["host_only_models"] == 1
    monitor.push(FakeDevice("add", DISK, "nvme0n1"))
    assert_eventually(lambda: m.stats()["host_only_models"] == 0, what="device back")
    lease = m.acquire(0, "tiny", layer=2)
    for bid, off in lease.blocks.items():
        assert bytes(m.arena.view(off, store.block(bid).length)) == store.read_block(bid)
    assert m.snapshot()["status"]["controller_state"] == "ACTIVE"
    for lease_ in (warm, again, lease):
        m.release(0, lease_.id)


def test_read_only_change_and_partition_events(watched):
    m, watch, monitor, _store = watched("graceful")
    m.open_model(0, "tiny")
    monitor.push(FakeDevice("change", DISK, "nvme0n1", ro="1"))
    assert_eventually(lambda: m.stats()["host_only_models"] == 1, what="read-only -> host-only")
    assert "went read-only" in m.snapshot()["models"]["tiny"]["host_only_reason"]
    monitor.push(FakeDevice("change", DISK, "nvme0n1", ro="0"))
    assert_eventually(lambda: m.stats()["host_only_models"] == 0, what="writable -> back")
    monitor.push(FakeDevice("remove", 0, "nvme0n1p1"))          # by partition name
    assert_eventually(lambda: m.stats()["host_only_models"] == 1, what="partition removed")
    monitor.push(FakeDevice("remove", os.makedev(8, 0), "sda"))  # another disk: nothing changes
    monitor.push(FakeDevice("add", DISK, "nvme0n1"))
    assert_eventually(lambda: m.stats()["host_only_models"] == 0, what="back")
    assert watch.events_seen == 5


def test_strict_model_fails_every_request_until_the_device_returns(watched):
    m, _watch, monitor, _store = watched("strict")
    m.open_model(0, "tiny")
    warm = m.acquire(0, "tiny", layer=0)
    m.release(0, warm.id)
    monitor.push(FakeDevice("remove", DISK, "nvme0n1"))
    assert_eventually(lambda: m.stats()["host_only_models"] == 1, what="device gone")
    with pytest.raises(DeviceError):
        m.acquire(0, "tiny", layer=0)                  # strict: even resident blocks
    assert m.list_models()[0]["state"] == "failed"
    monitor.push(FakeDevice("add", DISK, "nvme0n1"))
    assert_eventually(lambda: m.list_models()[0]["state"] == "open", what="device back")
    m.release(0, m.acquire(0, "tiny", layer=3).id)


def test_a_model_opened_while_its_device_is_gone_starts_host_only(watched):
    m, _watch, monitor, _store = watched("graceful")
    m.open_model(0, "tiny")
    monitor.push(FakeDevice("remove", DISK, "nvme0n1"))
    assert_eventually(lambda: m.stats()["host_only_models"] == 1, what="host-only")
    m.unload("tiny")
    m.open_model(0, "tiny")
    assert m.stats()["host_only_models"] == 1


def test_the_probe_reads_past_the_page_cache(watched, monkeypatch):
    """A device gone bad while the page cache still holds its bytes: the probe must read the
    disk (O_DIRECT through the native engine), not the cache."""
    m, watch, _monitor, store = watched("graceful")
    m.open_model(0, "tiny")
    probe_block = store.block(m.device_models()["tiny"]["probe"][0])
    data = str(store.data_path(probe_block))
    good = bytes(open(data, "rb").read())
    real_pread = os.pread

    def cached_pread(fd, n, offset):
        # What a buffered read of the data file returns: the page cache's (good) bytes.
        if os.readlink(f"/proc/self/fd/{fd}") == data:
            return good[offset:offset + n]
        return real_pread(fd, n, offset)
    monkeypatch.setattr(os, "pread", cached_pread)
    corrupt_block(store.path, probe_block.id)                  # the disk itself now reads bad
    assert m.set_host_only("tiny", "read error: test")         # as after a failed read
    assert watch.probe() == [] and m.stats()["host_only_models"] == 1
    with open(data, "r+b") as f:                               # the device is good again
        f.write(good)
        os.fsync(f.fileno())
    assert_eventually(lambda: m.stats()["host_only_models"] == 0, what="probe brings it back")


# --- the real daemon: a store's data file vanishes under it ------------------------------------------

def test_daemon_vanished_data_file_goes_host_only_and_comes_back(daemon_factory, tiny_store, tmp_path):
    path = copy_store(tiny_store, tmp_path, "cut")
    store = Store.open(path)
    data = store.data_path(store.blocks[0])
    away = data.with_name(data.name + ".away")
    expected = {b.id: store.read_block(b.id) for b in store.blocks}
    d = daemon_factory({"host_cache_bytes": "8MiB", "store_roots": [str(path.parent)],
                        "error_recovery_mode": "graceful", "prefetch_window": 0}).start()
    with d.client() as c:
        info = c.open_model("cut")
        st = os.stat(path)
        assert_eventually(lambda: f"device_devnum: {os.major(st.st_dev)}:{os.minor(st.st_dev)}" in
                          text_of(d.runtime / "models" / "cut" / "info"), what="device in info")
        warm = c.acquire(info, layer=0)
        os.rename(data, away)                         # the file (its device) is gone: ENOENT
        with pytest.raises(FlashIOError) as err:
            c.acquire(info, layer=3)
        assert err.value.block_id in {b.id for b in store.blocks if b.layer == 3}
        assert err.value.errno == errno.ENOENT
        assert_eventually(lambda: c.stats()["host_only_models"] == 1, what="host-only")
        assert_eventually(lambda: d.status_file()["controller_state"] == "DEGRADED", what="DEGRADED")
        assert d.status_file()["unified_memory_fabric"] == "HOST_ONLY"
        # The tree's files are replaced one after another: the model's info may trail the status.
        assert_eventually(lambda: "unified_memory_fabric: HOST_ONLY" in
                          text_of(d.runtime / "models" / "cut" / "info"), what="model HOST_ONLY")
        d.wait_message("STATUS=DEGRADED")
        # Resident layer 0 still serves byte-exact; layer 2 (absent, still on disk) fails fast.
        lease = c.acquire(info, layer=0)
        for bid, off in lease.blocks.items():
            assert bytes(c.arena.view(off, store.block(bid).length)) == expected[bid]
        with pytest.raises(DeviceError):
            c.acquire(info, layer=2)
        c.release(lease)
        os.rename(away, data)                         # the device is back: the probe sees it
        assert_eventually(lambda: c.stats()["host_only_models"] == 0, timeout=15, what="back")
        lease = c.acquire(info, layer=3)
        for bid, off in lease.blocks.items():
            assert bytes(c.arena.view(off, store.block(bid).length)) == expected[bid]
        assert_eventually(lambda: d.status_file()["controller_state"] == "ACTIVE", what="ACTIVE")
        d.wait_message("STATUS=ACTIVE")
        c.release(lease)
        c.release(warm)
    assert d.stop() == 0


# --- the daemon's composition root with an injected udev monitor -----------------------------------

def test_application_with_injected_monitor(tmp_path, tiny_store, monkeypatch):
    from deepseek_flash.client import Client
    from deepseek_flash.daemon.app import Application

    fake = {"devnum": "259:1", "disk_devnum": "259:0", "disk": "nvme0n1", "partition": "nvme0n1p1",
            "node": "/dev/nvme0n1", "model": "Flash Test NVMe", "serial": "S1", "firmware": "F1",
            "ro": False}
    monkeypatch.setattr(recovery, "block_device_of", lambda path, sysfs="/sys": dict(fake))
    notify_path = tmp_path / "n.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(0.05)
    (tmp_path / "flash.json").write_text(
        '{"host_cache_bytes": "8MiB", "error_recovery_mode": "graceful", "prefetch_window": 0, '
        f'"store_roots": ["{tiny_store.parent}"]}}')
    monitor = FakeMonitor()
    sock = tmp_path / "c.sock"
    app = Application(tmp_path / "flash.json", sock, tmp_path / "rt", udev_monitor=monitor,
                      environ={"NOTIFY_SOCKET": str(notify_path)})
    app.start()
    loop = threading.Thread(target=app.run)
    loop.start()
    messages = []

    def got(needle):
        try:
            messages.append(notify.recv(4096).decode())
        except TimeoutError:
            pass
        return any(needle in msg for msg in messages)
    try:
        with Client(sock, embedded=False) as c:
            info = c.open_model("tiny")
            c.release(c.acquire(info, layer=0))
            assert_eventually(lambda: "device_serial: S1" in
                              text_of(tmp_path / "rt" / "models" / "tiny" / "info"), what="info")
            monitor.push(FakeDevice("remove", os.makedev(259, 0), "nvme0n1"))
            assert_eventually(lambda: got("STATUS=DEGRADED"), what="STATUS=DEGRADED")
            status = c.status()["status"]
            assert status["unified_memory_fabric"] == "HOST_ONLY" and status["host_only_models"] == 1
            c.release(c.acquire(info, layer=0))
            with pytest.raises(DeviceError):
                c.acquire(info, layer=1)
            monitor.push(FakeDevice("add", os.makedev(259, 0), "nvme0n1"))
            assert_eventually(lambda: got("STATUS=ACTIVE"), what="STATUS=ACTIVE")
            c.release(c.acquire(info, layer=1))
    finally:
        app.request_stop()
        loop.join(20)
        notify.close()
    assert not loop.is_alive()
