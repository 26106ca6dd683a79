"""One factory builds the controller for the daemon and for embedded mode: the same parts, wired
the same way, taken down in order."""
import threading

from deepseek_flash.client import Client
from deepseek_flash.daemon.config import RESTART_ONLY, FlashConfig
from deepseek_flash.daemon.factory import Controller, build_controller
from deepseek_flash.daemon.attachments import Attachments
from deepseek_flash.daemon.operations import Operations
from deepseek_flash.daemon.recovery import DeviceWatch


def config_for(store):
    return {"host_cache_bytes": "8MiB", "store_roots": [str(store.parent)], "prefetch_window": 0}


def threads_named(prefix):
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def test_build_controller_wires_every_part_and_closes_them(tiny_store):
    before = len(threads_named("flash-recovery")), len(threads_named("flash-io-completion"))
    c = build_controller(config_for(tiny_store), use_udev=False)
    assert isinstance(c, Controller) and isinstance(c.recovery, DeviceWatch)
    assert isinstance(c.attachments, Attachments) and isinstance(c.ops, Operations)
    assert c.config == FlashConfig.from_dict(config_for(tiny_store))
    # The hooks of the tiers above are wired into the host tier.
    state = c.manager.state
    assert c.attachments.detach in state.disconnect_hooks
    assert c.attachments.copy_source in state.copy_sources
    assert c.recovery._opened in state.open_hooks and c.recovery._read_error in state.device_error_hooks
    # The op table answers with the controller's snapshot (device tier merged in).
    cid = c.manager.connect({"name": "t"})
    c.ops.call(cid, "open_model", {"model": "tiny"})
    snap = c.ops.call(cid, "status", {})
    assert {"bytes_h2d", "device_evictions"} <= set(snap["stats"])
    assert "device_devnum" in snap["models"]["tiny"]        # the device watch mapped the store
    assert len(threads_named("flash-recovery")) == before[0] + 1
    c.close()
    assert (len(threads_named("flash-recovery")), len(threads_named("flash-io-completion"))) == before


def test_read_shape_sets_the_io_engine(tiny_store):
    c = build_controller({**config_for(tiny_store), "read_shape": "4x8MiB"}, use_udev=False)
    try:
        assert (c.engine.queue_depth, c.engine.request_size, tuple(c.engine.shape)) == \
            (4, 8 << 20, (4, 8 << 20))
        assert c.manager.reads.full_shape == (4, 8 << 20)
        cid = c.manager.connect({"name": "t"})
        stats = c.ops.call(cid, "status", {})["stats"]
        assert (stats["read_depth"], stats["read_request_bytes"]) == (4, 8 << 20)
    finally:
        c.close()


def test_embedded_mode_has_the_daemons_parts(tiny_store):
    with Client(embedded=True, config=config_for(tiny_store)) as client:
        controller = client._backend.controller
        assert isinstance(controller, Controller) and isinstance(controller.recovery, DeviceWatch)
        client.open_model("tiny")
        model = client.status()["models"]["tiny"]
        assert model["device_devnum"]                       # mapped by the device watch, as in the daemon
        assert "device_evictions" in client.status()["stats"]       # the device tier in its status


def test_restart_only_keys_are_marked_in_the_key_table():
    assert set(RESTART_ONLY) == {"host_cache_bytes", "devices", "socket_mode", "max_frame_bytes",
                                 "unified_memory_ratio", "read_shape"}


def test_the_daemon_serves_before_torch_is_imported(tmp_path):
    """Starting the controller and publishing its first status import no torch (the fabric's
    preparation imports it on its own thread where a driver is present): the socket and the
    status tree came ~3.4 s late on the GPU machines while the quant package and the snapshot's
    CUDA probe imported it first."""
    import json
    import subprocess
    import sys

    script = """
import json, sys
from unittest import mock
import deepseek_flash.daemon.app
from deepseek_flash.daemon import fabric
from deepseek_flash.daemon.factory import build_controller
after_import = "torch" in sys.modules
# As on a GPU machine whose CUDA is still starting: a driver is present, nothing prepared yet.
with mock.patch.object(fabric, "nvidia_driver_present", return_value=True), \\
        mock.patch.object(fabric.Fabric, "prepare", return_value=None):
    controller = build_controller({"host_cache_bytes": "16MiB"}, use_udev=False)
    state = controller.snapshot()["status"]["unified_memory_fabric"]
print(json.dumps({"after_import": after_import, "after_snapshot": "torch" in sys.modules,
                  "fabric": state}))
controller.close()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "after_import": False, "after_snapshot": False, "fabric": "ENABLED"}
