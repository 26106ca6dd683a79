"""Health checker: the read-only workload on a file, the sysfs stack and pitfalls from a fake tree,
the CLI's output shapes and exit codes."""
from __future__ import annotations

import hashlib
import json
import re
import os

import pytest

from deepseek_flash import cli
from deepseek_flash.errors import DeviceError
from deepseek_flash.tools import health

QD = 4
BS = 64 << 10


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "disk.img"
    path.write_bytes(os.urandom(4 << 20))
    return path


def _digest(path):
    st = os.stat(path)
    return hashlib.sha256(path.read_bytes()).hexdigest(), st.st_mtime_ns, st.st_size


# --- a fake sysfs --------------------------------------------------------------------------------
def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _link(link, target):
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(target, link.parent), link)


def _disk(root, rel, *, scheduler="[none] mq-deadline", nr=1023, rot=0, device=None):
    d = root / rel
    _write(d / "queue" / "scheduler", scheduler)
    _write(d / "queue" / "nr_requests", str(nr))
    _write(d / "queue" / "rotational", str(rot))
    _link(root / "class" / "block" / d.name, d)
    if device:
        ctrl = root / "devices" / "ctrl" / d.name
        for key, value in device.items():
            _write(ctrl / key, value)
        _link(d / "device", ctrl)
    return d


def _target_devno(path):
    st = os.stat(path)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


@pytest.fixture
def fake_md(tmp_path, data_file):
    """md0 (the file's device) over two NVMe namespaces with different firmware, APST on."""
    root = tmp_path / "sys"
    n0 = _disk(root, "devices/pci0/nvme/nvme0/nvme0n1",
               device={"model": "Flash 3.84TB", "serial": "S0", "firmware_rev": "1.0.1"})
    n1 = _disk(root, "devices/pci0/nvme/nvme1/nvme1n1",
               device={"model": "Flash 3.84TB", "serial": "S1", "firmware_rev": "1.0.2"})
    md = _disk(root, "devices/virtual/block/md0", scheduler="none")
    _write(md / "md" / "level", "raid0")
    _link(md / "slaves" / "nvme0n1", n0)
    _link(md / "slaves" / "nvme1n1", n1)
    _link(root / "dev" / "block" / _target_devno(data_file), md)
    _write(root / "module" / "nvme_core" / "parameters" / "default_ps_max_latency_us", "100000")
    return root


@pytest.fixture
def fake_sata(tmp_path, data_file):
    """The file on partition sda1 of a disk with mq-deadline and a shallow queue."""
    root = tmp_path / "sys"
    sda = _disk(root, "devices/pci0/ata1/block/sda", scheduler="none [mq-deadline] kyber", nr=4,
                device={"model": "SSD 860", "rev": "RVT04B6Q", "vpd_pg80": "SER123"})
    part = sda / "sda1"
    _write(part / "partition", "1")
    _link(root / "class" / "block" / "sda1", part)
    _link(root / "dev" / "block" / _target_devno(data_file), part)
    return root


def test_stack_md_over_nvme(fake_md, data_file):
    info = health.describe(data_file, fake_md)
    assert info.target_kind == "file"
    assert info.device == "md0" and info.partition is None
    assert info.top.kind == "md" and info.top.model == "raid0"
    assert [(d.name, d.kind, d.serial, d.firmware, d.apst_enabled) for d in info.leaves] == [
        ("nvme0n1", "nvme", "S0", "1.0.1", True), ("nvme1n1", "nvme", "S1", "1.0.2", True)]
    warnings = health.pitfalls(info, queue_depth=32)
    assert len(warnings) == 3, warnings
    assert "different firmware (nvme0n1=1.0.1, nvme1n1=1.0.2)" in warnings[0]
    assert all("APST" in w for w in warnings[1:])
    assert {w.split(":")[0] for w in warnings[1:]} == {"nvme0n1", "nvme1n1"}


def test_apst_off_per_controller(fake_md, data_file):
    # A controller's own latency tolerance of 0 turns APST off whatever the module default says.
    _write(fake_md / "devices" / "ctrl" / "nvme0n1" / "power" / "pm_qos_latency_tolerance_us", "0")
    _write(fake_md / "devices" / "ctrl" / "nvme1n1" / "power" / "pm_qos_latency_tolerance_us", "0")
    info = health.describe(data_file, fake_md)
    assert [d.apst_enabled for d in info.leaves] == [False, False]
    assert not any("APST" in w for w in health.pitfalls(info, 32))


def test_apst_module_default_zero(fake_md, data_file):
    _write(fake_md / "module" / "nvme_core" / "parameters" / "default_ps_max_latency_us", "0")
    info = health.describe(data_file, fake_md)
    assert not any("APST" in w for w in health.pitfalls(info, 32))


def test_stack_partition_scheduler_and_nr_requests(fake_sata, data_file):
    info = health.describe(data_file, fake_sata)
    assert (info.device, info.partition) == ("sda", "sda1")
    d = info.top
    assert (d.kind, d.model, d.serial, d.firmware, d.scheduler, d.nr_requests, d.rotational) == (
        "scsi", "SSD 860", "SER123", "RVT04B6Q", "mq-deadline", 4, False)
    assert [x.name for x in info.leaves] == ["sda"]
    warnings = health.pitfalls(info, queue_depth=32)
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("sda: IO scheduler is mq-deadline, not none")
    assert warnings[1].startswith("sda: nr_requests is 4, below the engine's queue depth 32")
    assert health.pitfalls(info, queue_depth=4) == warnings[:1]


def test_no_block_device_in_fake_tree(tmp_path, data_file):
    info = health.describe(data_file, tmp_path / "empty-sys")
    assert info.device is None and info.leaves == []
    assert "no block device behind" in info.notes[0]
    assert health.pitfalls(info, 32) == []


def test_replay_reads_only_and_measures(data_file):
    before = _digest(data_file)
    for pattern in ("flash_workload", "sequential"):
        r = health.replay(data_file, pattern=pattern, queue_depth=QD, block_size=BS, duration=0.3)
        assert r.requests > QD and r.bytes == r.requests * BS
        assert r.throughput_mb_s > 0 and r.iops > 0
        lat = r.latency_us
        assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"] <= lat["max"]
        assert r.io_completion_variance >= 0 and r.latency_cv >= 0
        # The seeds' percentage is the coefficient of variation: sqrt(variance) / mean, x 100.
        assert r.io_completion_variance_pct == pytest.approx(
            r.io_completion_variance ** 0.5 / lat["mean"] * 100, rel=0.01, abs=0.02)
        assert r.io_completion_verdict == health.variance_verdict(r.io_completion_variance_pct)
    assert _digest(data_file) == before


def test_replay_bad_values(data_file, tmp_path):
    with pytest.raises(ValueError, match="duration must be > 0"):
        health.replay(data_file, duration=0)
    with pytest.raises(ValueError, match="multiple of 4096"):
        health.replay(data_file, block_size=1000, duration=0.1)
    small = tmp_path / "small"
    small.write_bytes(b"x" * 4096)
    with pytest.raises(DeviceError, match="smaller than one"):
        health.replay(small, block_size=BS, duration=0.1)
    with pytest.raises(DeviceError) as exc:
        health.replay(tmp_path / "missing", duration=0.1)
    assert exc.value.code == 220 and "no such device or file" in str(exc.value)


def test_cli_json_shape(data_file, fake_md, capsys):
    before = _digest(data_file)
    rc = cli.main(["health", "--device", str(data_file), "--pattern", "flash_workload",
                   "--queue-depth", str(QD), "--block-size", "64K", "--duration", "0.3",
                   "--json", "--sysfs-root", str(fake_md)])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 1   # warnings found
    assert set(doc) == {"target", "size_bytes", "stack", "pitfalls", "workload"}
    assert doc["size_bytes"] == 4 << 20
    assert set(doc["workload"]) >= {"throughput_mb_s", "latency_us", "io_completion_variance",
                                    "io_completion_variance_pct", "io_completion_verdict",
                                    "queue_depth", "block_size", "requests", "backend", "direct"}
    assert set(doc["workload"]["latency_us"]) == {"p50", "p95", "p99", "max", "mean"}
    assert doc["workload"]["queue_depth"] == QD and doc["workload"]["block_size"] == BS
    assert doc["stack"]["device"] == "md0" and len(doc["stack"]["leaves"]) == 2
    assert len(doc["pitfalls"]) == 3
    assert _digest(data_file) == before


def test_cli_text_and_clean_exit(data_file, tmp_path, capsys):
    root = tmp_path / "sys"
    d = _disk(root, "devices/virtio/block/vdb", scheduler="[none] mq-deadline", nr=256,
              device={"model": "QEMU"})
    _link(root / "dev" / "block" / _target_devno(data_file), d)
    rc = cli.health_main(["--device", str(data_file), "--pattern", "sequential", "--queue-depth",
                          "2", "--block_size", "65536", "--duration", "0.2", "--quiet",
                          "--sysfs-root", str(root)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "block device: vdb" in out and "scheduler=none" in out
    assert "latency us: p50" in out
    line = next(x for x in out.splitlines() if "io_completion_variance:" in x)
    assert re.fullmatch(r"  io_completion_variance: [0-9.]+% \((stable|variable|unstable): < 5% stable, "
                        r"5-10% variable, > 10% unstable; [0-9.]+ us\^2, cv [0-9.]+\)", line), line
    assert "no known pitfalls found" in out


@pytest.mark.parametrize("argv, message", [
    (["--duration", "0"], "must be > 0 seconds"),
    (["--duration", "-1"], "must be > 0 seconds"),
    (["--queue-depth", "0"], "must be >= 1"),
    (["--block-size", "1000"], "multiple of 4096"),
    (["--pattern", "nope"], "invalid choice"),
])
def test_cli_bad_arguments(data_file, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        cli.main(["health", "--device", str(data_file), *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_missing_and_unreadable_device(tmp_path, capsys):
    assert cli.main(["health", "--device", str(tmp_path / "nvme9n9"), "--duration", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "nvme9n9: no such device or file" in err and "DeviceError, code 220" in err
    assert cli.main(["health", "--device", str(tmp_path), "--duration", "0.1"]) == 2
    assert "not a block device or regular file" in capsys.readouterr().err


def test_cli_help_names_every_flag(capsys):
    with pytest.raises(SystemExit):
        cli.health_main(["--help"])
    out = capsys.readouterr().out
    for flag in ("--device", "--pattern", "--queue-depth", "--block-size", "--duration", "--json",
                 "--quiet", "--sysfs-root"):
        assert flag in out


@pytest.mark.parametrize("pct, verdict", [(0.0, "stable"), (4.99, "stable"), (5.0, "variable"),
                                          (9.99, "variable"), (10.0, "unstable"), (31.46, "unstable")])
def test_variance_verdicts_follow_the_seeds_thresholds(pct, verdict):
    assert health.variance_verdict(pct) == verdict
