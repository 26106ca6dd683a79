"""Access control: the socket's mode and group from config, peers outside the group refused with a
clear error, and model names that stay names (no traversal, no symlink or metadata escapes)."""
import grp
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest
from faults import copy_store

from deepseek_flash.errors import NotAStore, PermissionDenied, UnknownModel
from deepseek_flash.store.format import decode_metadata, encode_metadata

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")

GROUP = "daemon"
GID = grp.getgrnam(GROUP).gr_gid
NOBODY = 65534

AS_USER = textwrap.dedent("""
    import json, os, sys
    import deepseek_flash._core, deepseek_flash.store   # before dropping privileges (the
    # interpreter's own files need not be readable by nobody)
    from deepseek_flash.client import Client
    from deepseek_flash.errors import FlashError
    sock, gid, groups, names = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(65534)
    out = {}
    try:
        c = Client(sock, embedded=False)
    except FlashError as exc:
        out["connect"] = [type(exc).__name__, exc.code, str(exc)]
    else:
        out["connect"] = "ok"
        for name in names:
            try:
                out[name] = c.open_model(name).name
            except FlashError as exc:
                out[name] = [type(exc).__name__, exc.code, str(exc)]
        c.close()
    print(json.dumps(out))
""")


def as_nobody(daemon, gid, groups=(), names=()):
    out = subprocess.run([sys.executable, "-c", AS_USER, str(daemon.socket), str(gid), json.dumps(list(groups)),
                          json.dumps(list(names))], capture_output=True, text=True, timeout=60, cwd="/",
                         check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def make(daemon_factory, tiny_store):
    def start(**cfg):
        return daemon_factory({"host_cache_bytes": "8MiB", "store_roots": [str(tiny_store.parent)],
                               "socket_group": GROUP, **cfg}).start()
    return start


def test_socket_mode_and_group_come_from_config(make):
    d = make(socket_mode="0640")
    st = os.stat(d.socket)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640 and st.st_gid == GID
    assert d.stop() == 0
    d2 = make()
    assert stat.S_IMODE(os.stat(d2.socket).st_mode) == 0o660
    assert d2.stop() == 0


def test_group_members_allowed_others_refused(make, tiny_store):
    d = make(socket_mode="0660")
    # Primary group, then supplementary group: allowed, and names resolve under store_roots only.
    for gid, groups in ((GID, []), (NOBODY, [GID])):
        out = as_nobody(d, gid, groups, ["tiny", "../tiny", str(tiny_store), "/etc"])
        assert out["connect"] == "ok" and out["tiny"] == "tiny"
        assert out["../tiny"][:2] == ["UnknownModel", UnknownModel.code]
        assert out[str(tiny_store)] == "tiny"              # an absolute path inside a store root
        assert out["/etc"][:2] == ["UnknownModel", UnknownModel.code]
        assert "only accepted from root" in out["/etc"][2]
    # Outside the group: the socket file's mode already says no -- a clear PermissionDenied.
    out = as_nobody(d, NOBODY)
    assert out["connect"][:2] == ["PermissionDenied", PermissionDenied.code]
    assert "permission denied" in out["connect"][2] and "group" in out["connect"][2]
    assert d.stop() == 0
    # A world-writable socket: the peer-credential check refuses it instead.
    d = make(socket_mode="0666")
    out = as_nobody(d, NOBODY)
    assert out["connect"][:2] == ["PermissionDenied", PermissionDenied.code]
    assert "uid 65534" in out["connect"][2] and "socket_group" in out["connect"][2]
    with d.client() as c:                                   # root still served
        assert c.open_model("tiny").name == "tiny"
    assert d.stop() == 0


def test_names_are_names(make, tiny_store, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(tiny_store, root / "escape")                 # a symlink out of the root
    shutil.copytree(tiny_store, root / "inside")
    d = make(store_roots=[str(root)])
    with d.client() as c:
        for bad in ("../tiny", "inside/../../tiny", "./inside", "inside/..", "escape", "a b", "", "~root"):
            with pytest.raises(UnknownModel):
                c.open_model(bad)
        assert c.open_model("inside").name == "inside"
        with pytest.raises(NotAStore):
            c.open_model("/etc")                             # root may name a path; it is no store
    assert d.stop() == 0


def test_metadata_cannot_point_outside_the_store(make, tiny_store, tmp_path):
    path = copy_store(tiny_store, tmp_path, "evil")
    meta = path / "flash_metadata.bin"
    blocks, model = decode_metadata(meta.read_bytes(), meta)
    secret = tmp_path / "secret"
    secret.mkdir()
    shutil.copy(path / blocks[0].file, secret / "blocks.dat")
    for b in blocks:
        b.file = "../../secret/blocks.dat"
    meta.write_bytes(encode_metadata(blocks, model))
    d = make(store_roots=[str(path.parent)])
    with d.client() as c:
        with pytest.raises(UnknownModel) as err:
            c.open_model("evil")
        assert "outside the store directory" in str(err.value)
        assert c.stats()["bytes_read_nvme"] == 0
    assert d.stop() == 0
