"""status, stats, models, load, unload, set: from the status tree, through the real daemon, or
"no daemon running" with exit status 1."""
from __future__ import annotations

import json
import os
import signal

import pytest
from deepseek_flash.sysfs_shim.publisher import StatusTree
from flashd_harness import Daemon, assert_eventually, packed_model

from deepseek_flash.cli import main


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def tree(tmp_path):
    # Written as a running daemon would: this (live) process's pid and an existing socket path.
    (tmp_path / "rt").mkdir()
    (tmp_path / "rt" / "control.sock").touch()
    StatusTree(tmp_path / "rt").publish({
        "status": {"controller_state": "DEGRADED", "prefetch_hit_rate": 0.5, "semantic_block_count": 3,
                   "unified_memory_fabric": "DISABLED", "pid": os.getpid(),
                   "socket": str(tmp_path / "rt" / "control.sock")},
        "stats": {"prefetch_miss_count": 4, "bytes_read_nvme": 8192},
        "models": {"alpha": {"state": "open", "blocks": 2, "resident_blocks": 1, "resident_bytes": 4096,
                             "total_bytes": 8192, "disk_bytes": 24576, "gpu_bytes": 4096,
                             "quantization_scheme": "int4_symmetric",
                             "quantization_granularity": "per_block", "quantization_group_size": 128,
                             "quantized_at": "host_tier",
                             "residency": [{"id": 0, "role": "embed", "state": "resident", "bytes": 4096},
                                           {"id": 1, "role": "lm_head", "state": "absent", "bytes": 4096}]},
                   "beta-long-name": {"state": "failed", "blocks": 0}},
    })
    return tmp_path / "rt"


def test_status_and_stats_print_the_tree_files(tree, capsys):
    rc, out, _ = run(capsys, "status", "--runtime-dir", str(tree))
    assert rc == 0 and out == (tree / "status").read_text()
    assert out.splitlines()[:2] == ["controller_state: DEGRADED", "prefetch_hit_rate: 50.0%"]
    rc, out, _ = run(capsys, "stats", "--runtime-dir", str(tree), "--json")
    assert rc == 0 and json.loads(out) == {"prefetch_miss_count": "4", "bytes_read_nvme": "8192"}


def test_models_table_and_one_model(tree, capsys):
    rc, out, _ = run(capsys, "models", "--runtime-dir", str(tree))
    assert rc == 0
    assert out.splitlines() == [
        "NAME            STATE   BLOCKS  RESIDENT_BLOCKS  RESIDENT_BYTES  TOTAL_BYTES  DISK_BYTES  "
        "GPU_BYTES  QUANTIZATION_SCHEME  QUANTIZATION_GRANULARITY  QUANTIZATION_GROUP_SIZE  QUANTIZED_AT",
        "alpha           open    2       1                4096            8192         24576       "
        "4096       int4_symmetric       per_block                 128                      host_tier",
        "beta-long-name  failed  0       -                -               -            -           "
        "-          -                    -                         -                        -",
    ]
    rc, out, _ = run(capsys, "models", "alpha", "--blocks", "--runtime-dir", str(tree))
    assert rc == 0
    assert out == ("name: alpha\nstate: open\nblocks: 2\nresident_blocks: 1\nresident_bytes: 4096\n"
                   "total_bytes: 8192\ndisk_bytes: 24576\ngpu_bytes: 4096\nquantization_scheme: int4_symmetric\n"
                   "quantization_granularity: per_block\nquantization_group_size: 128\nquantized_at: host_tier\nresidency:\n  absent_blocks: 1\n  absent_bytes: 4096\n"
                   "  resident_blocks: 1\n  resident_bytes: 4096\nblocks:\n"
                   "  0: role=embed state=resident bytes=4096\n  1: role=lm_head state=absent bytes=4096\n")
    rc, _, err = run(capsys, "models", "gamma", "--runtime-dir", str(tree))
    assert rc == 1 and "no model 'gamma' is open (open: alpha, beta-long-name)" in err


@pytest.mark.parametrize("verb", [["status"], ["stats"], ["models"], ["load", "x"], ["unload", "x"],
                                  ["set", "prefetch_window", "4"]])
def test_no_tree_and_no_daemon(verb, tmp_path, capsys):
    rc, out, err = run(capsys, *verb, "--runtime-dir", str(tmp_path))
    assert rc == 1 and out == ""
    assert err == f"deepseek-flash {verb[0]}: no daemon running at {tmp_path}/control.sock\n"


def test_verbs_through_the_daemon(tmp_path, capsys):
    store = packed_model(tmp_path, "tiny")
    daemon = Daemon(tmp_path / "d", {"host_cache_bytes": "16MiB"}).start()
    empty = tmp_path / "no-tree"
    empty.mkdir()
    sock = ["--socket", str(daemon.socket)]
    try:
        # No tree at --runtime-dir: the verbs ask the daemon.
        rc, out, _ = run(capsys, "status", "--runtime-dir", str(empty), *sock)
        assert rc == 0 and out.splitlines()[0] == "controller_state: ACTIVE"
        assert "prefetch_hit_rate: 100.0%" in out.splitlines()

        rc, out, _ = run(capsys, "load", str(store), *sock)
        assert rc == 0
        loaded = dict(line.split(": ", 1) for line in out.splitlines())
        assert loaded["model"] == "tiny" and loaded["resident_blocks"] == loaded["blocks"]

        rc, out, _ = run(capsys, "models", "--runtime-dir", str(empty), *sock)
        assert rc == 0 and out.splitlines()[1].split()[:3] == ["tiny", "open", loaded["blocks"]]

        rc, out, _ = run(capsys, "set", "prefetch_window", "32", *sock)
        assert rc == 0 and out == "prefetch_window: auto -> 32\n"
        assert_eventually(lambda: daemon.status_file("tunables").get("prefetch_window") == "32",
                          what="prefetch_window: 32 in the tree")
        rc, out, err = run(capsys, "set", "prefetch_window", "999", *sock)
        assert rc == 2 and "prefetch_window: 999 is not allowed" in err and "code 500" in err
        rc, out, err = run(capsys, "set", "block_eviction_policy", "access_frequency_weighted", *sock)
        assert rc == 0 and out == "block_eviction_policy: lru -> access_frequency_weighted\n"

        assert_eventually(lambda: (daemon.runtime / "models" / "tiny" / "info").exists(), what="tree")
        rc, out, _ = run(capsys, "unload", "tiny", *sock)
        assert rc == 0 and out.splitlines()[0] == "model: tiny"
        assert_eventually(lambda: not (daemon.runtime / "models" / "tiny").exists(),
                          what="models/tiny removed from the tree")
        rc, out, err = run(capsys, "unload", "tiny", *sock)
        assert rc == 2 and "UnknownModel" in err
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()


def test_a_tree_whose_socket_is_gone_is_not_a_running_daemon(tree, capsys):
    (tree / "control.sock").unlink()
    for verb in ("status", "stats", "models"):
        rc, out, err = run(capsys, verb, "--runtime-dir", str(tree))
        assert rc == 1 and out == ""
        assert err == (f"deepseek-flash {verb}: the daemon is not running: the control socket "
                       f"{tree}/control.sock named in {tree}/status is gone\n")


def test_a_killed_daemons_tree_is_reported_not_running(tmp_path, capsys):
    store = packed_model(tmp_path, "tiny")
    daemon = Daemon(tmp_path / "d", {"host_cache_bytes": "16MiB"}).start()
    where = ["--runtime-dir", str(daemon.runtime), "--socket", str(daemon.socket)]
    try:
        rc, _, _ = run(capsys, "load", str(store), *where)
        assert rc == 0
        assert_eventually(lambda: (daemon.runtime / "models" / "tiny" / "info").exists(), what="tree")
        rc, out, _ = run(capsys, "status", *where)
        assert rc == 0 and out.startswith("controller_state: ACTIVE\n")
        pid = daemon.proc.pid
        daemon.signal(signal.SIGKILL)
        daemon.proc.wait()
        # The tree and the socket file stay behind, as after kill -9 under systemd.
        assert (daemon.runtime / "status").exists() and daemon.socket.exists()
        for verb in ("status", "stats", "models"):
            rc, out, err = run(capsys, verb, *where)
            assert rc == 1 and out == "", verb
            assert err == (f"deepseek-flash {verb}: the daemon is not running: deepseek-flashd pid {pid} "
                           f"named in {daemon.runtime}/status is not running; the tree is what it left "
                           f"behind\n")
    finally:
        daemon.cleanup()
