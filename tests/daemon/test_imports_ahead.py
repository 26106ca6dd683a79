"""The daemon's learned manifest of the files a client's imports open: what a client reports, what
the daemon keeps, which files its start reads (and how), and the read shape that follows -- a client
whose module's files were read ahead keeps nothing shallow; a missing or corrupt manifest never
breaks a start or a load."""
import json
import logging
import os
import sys
import time
from pathlib import Path

import pytest
from flashd_harness import assert_eventually

from deepseek_flash._core import HostArena, IOEngine
from deepseek_flash.client import skeleton
from deepseek_flash.daemon import imports_ahead, readahead_worker, reads
from deepseek_flash.daemon.block_manager import BlockManager
from deepseek_flash.daemon.config import FlashConfig
from deepseek_flash.errors import ConfigError, ImportManifestCorrupt, MalformedFrame

MODULE = "transformers.models.llama.modeling_llama"
FULL = {"read_depth": 8, "read_request_bytes": 4 << 20}


def _tree(root):
    """A package as an interpreter leaves it: sources, their compiled files, an extension, a
    library, one file too large to read ahead."""
    pkg = root / "pkg"
    (pkg / "__pycache__").mkdir(parents=True)
    files = {"pkg/__init__.py": b"x = 1\n", "pkg/__pycache__/__init__.cpython-312.pyc": b"c" * 100,
             "pkg/mod.py": b"y = 2\n", "pkg/__pycache__/mod.cpython-312.pyc": b"m" * 3000,
             "pkg/lonely.py": b"z = 3\n", "pkg/_ext.so": b"e" * 5000, "pkg/big.so": b"b" * 9000}
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    return {rel: str(root / rel) for rel in files}


def test_the_plan_lists_the_directories_and_reads_every_file_not_mapped_already(tmp_path):
    f = _tree(tmp_path)
    first = [f["pkg/mod.py"], f["pkg/big.so"], f["pkg/__init__.py"], f["pkg/__pycache__/__init__.cpython-312.pyc"]]
    manifest = {MODULE: first, "other": [f["pkg/__init__.py"], f["pkg/_ext.so"], f["pkg/lonely.py"]]}
    mapped = {f["pkg/big.so"]}
    dirs, stat_only, read = imports_ahead.plan(manifest, mapped)
    assert dirs == [str(tmp_path / "pkg"), str(tmp_path / "pkg/__pycache__")] and stat_only == []
    # Sources too (transformers reads its model sources' text at import), once each, in the
    # manifest's order (its client's imports opened them so): the first-needed read first.
    assert read == [f["pkg/mod.py"], f["pkg/__init__.py"], f["pkg/__pycache__/__init__.cpython-312.pyc"],
                    f["pkg/_ext.so"], f["pkg/lonely.py"]]


def test_read_ahead_reads_exactly_the_planned_files_within_its_limits(tmp_path, monkeypatch):
    f = _tree(tmp_path)
    opened, listed, stated = [], [], []
    real_open, real_listdir, real_stat = open, os.listdir, os.stat
    monkeypatch.setattr(readahead_worker, "open",
                        lambda p, *a, **k: opened.append(p) or real_open(p, *a, **k), raising=False)
    monkeypatch.setattr(imports_ahead.os, "listdir", lambda p: listed.append(p) or real_listdir(p))
    monkeypatch.setattr(imports_ahead.os, "stat", lambda p: stated.append(p) or real_stat(p))
    read = [f["pkg/__pycache__/mod.cpython-312.pyc"], f["pkg/_ext.so"], f["pkg/big.so"],
            str(tmp_path / "gone.pyc")]
    out = imports_ahead.read_ahead([str(tmp_path / "pkg"), str(tmp_path / "nodir")], [f["pkg/mod.py"]], read,
                                   threads=3, max_file_bytes=8192)
    assert sorted(opened) == sorted(read)
    assert sorted(listed) == [str(tmp_path / "nodir"), str(tmp_path / "pkg")] and stated == [f["pkg/mod.py"]]
    assert out == {"dirs": 1, "stat": 1, "files": 2, "bytes": 8000, "skipped_large": 1, "skipped_budget": 0,
                   "missing": 2}
    # The whole start's budget: a file that would pass it is left out.
    out = imports_ahead.read_ahead([], [], read[:2], threads=1, max_bytes=4000)
    assert (out["files"], out["bytes"], out["skipped_budget"]) == (1, 3000, 1)


def test_the_manifest_round_trips_and_a_corrupt_one_is_a_typed_error(tmp_path):
    path = tmp_path / "state" / imports_ahead.MANIFEST_NAME
    assert imports_ahead.load_manifest(path) == {}
    imports_ahead.save_manifest(path, {MODULE: ["/a/b.pyc", "/a/c.so", "/d/e.py"]})
    assert json.loads(path.read_text()) == {"version": 1, "modules": {MODULE: {"/a": ["b.pyc", "c.so"],
                                                                               "/d": ["e.py"]}}}
    assert imports_ahead.load_manifest(path) == {MODULE: ["/a/b.pyc", "/a/c.so", "/d/e.py"]}
    assert [p.name for p in path.parent.iterdir()] == [path.name]       # no temporary left
    for text, reason in (("{not json", "not JSON"), ('{"version": 7, "modules": {}}', "not a manifest"),
                         ('{"version": 1, "modules": {"m": ["/a"]}}', "malformed entry"),
                         ("[]", "not a manifest")):
        path.write_text(text)
        with pytest.raises(ImportManifestCorrupt) as exc:
            imports_ahead.load_manifest(path)
        assert exc.value.reason == reason and exc.value.path == str(path)
    # Relative directories and names with slashes are not files to read.
    assert imports_ahead.flatten({"/a": ["b", "c/d", "..", 3], "rel": ["x"], "/e": "f"}) == ["/a/b"]


def test_a_corrupt_manifest_is_logged_and_the_start_reads_nothing(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv(imports_ahead.PACKAGES_ENV, "")
    (tmp_path / imports_ahead.MANIFEST_NAME).write_text("{broken")
    warmed = []
    ahead = imports_ahead.ImportsAhead(tmp_path, on_warm=warmed.append)
    with caplog.at_level(logging.INFO, logger="deepseek_flash.imports_ahead"):
        ahead.start().done.wait(10)
    assert ahead.result is None and warmed == []
    assert "is not JSON" in caplog.text and "starting without reading ahead" in caplog.text
    # The next report rewrites it (what exists of it: an audited open may have failed); the same
    # report again writes nothing.
    y = tmp_path / "y.pyc"
    y.write_bytes(b"c")
    assert ahead.learn(MODULE, [str(y), str(tmp_path / "never.pyc")]) is True
    assert ahead.learn(MODULE, [str(y)]) is False
    assert imports_ahead.load_manifest(ahead.path) == {MODULE: [str(y)]}


def test_learning_keeps_the_latest_list_of_at_most_max_modules(tmp_path, monkeypatch):
    monkeypatch.setattr(imports_ahead, "MAX_MODULES", 2)
    p = {n: str(tmp_path / f"f{n}") for n in range(1, 5)}
    for path in p.values():
        Path(path).write_text("x")
    ahead = imports_ahead.ImportsAhead(tmp_path / "state")
    ahead.learn("a", [p[1]])
    ahead.learn("b", [p[2]])
    ahead.learn("a", [p[3], p[1]])      # replaced, and now the newest
    ahead.learn("c", [p[4]])            # b, the oldest, goes
    # Each list in the order its client gave it (the order its imports first opened the files).
    assert imports_ahead.load_manifest(ahead.path) == {"a": [p[3], p[1]], "c": [p[4]]}


def test_the_read_shape_follows_the_modules_read_ahead(tiny_store):
    """Unit level (the throttle decision): a client importing a module whose files were read ahead
    keeps nothing shallow; one importing another module does; reading ahead while a client holds
    lifts its hold."""
    config = FlashConfig.from_dict({"store_roots": [str(tiny_store.parent)]})
    engine = IOEngine(queue_depth=8, request_size=256 << 10)
    manager = BlockManager(config, HostArena(8 << 20), engine)
    try:
        a, b = manager.connect({}), manager.connect({})
        manager.hold_shallow(a, module=MODULE)
        assert engine.shape == reads.SHALLOW_SHAPE and manager.state.shallow_holders() == [a]
        time.sleep(0.2)
        manager.imports_read_ahead([MODULE, "x"])
        assert engine.shape == (8, 256 << 10) and manager.state.shallow_holders() == []
        assert manager.stats()["shallow_read_clients"] == 0
        manager.hold_shallow(b, module="transformers.models.qwen2.modeling_qwen2")
        assert engine.shape == reads.SHALLOW_SHAPE and manager.state.shallow_holders() == [b]
        manager.hold_shallow(b)             # no module named: nothing known of its files
        assert engine.shape == reads.SHALLOW_SHAPE
        assert manager.end_shallow(b) is not None and engine.shape == (8, 256 << 10)
        # a's reads were shallow until its module's files were read ahead, not until it ended.
        time.sleep(0.3)
        assert 0.2 <= manager.end_shallow(a) < 0.45
        manager.hold_shallow(a, module=MODULE)        # warm before it attached: never shallow
        assert manager.end_shallow(a) == 0.0
    finally:
        manager.close()


def test_imported_files_reports_sources_compiled_files_and_mapped_libraries(tmp_path, monkeypatch):
    class Spec:
        def __init__(self, cached):
            self.cached = cached

    class Mod:
        def __init__(self, file, cached=None):
            self.__file__ = file
            self.__spec__ = Spec(cached)

    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 12 /lib/libz.so.1\n"
                    "7f01-7f02 rw-p 00000000 00:00 0 \n"
                    "7f02-7f03 rw-s 00000000 00:01 9 /dev/shm/x\n"
                    "7f03-7f04 r--p 00000000 00:01 9 /tmp/gone.so (deleted)\n"
                    "7f04-7f05 r--p 00000000 00:00 0 [heap]\n")
    modules = {"p": Mod("/s/p/__init__.py", "/s/p/__pycache__/__init__.cpython-312.pyc"),
               "p.e": Mod("/s/p/e.so"), "builtin": object(), "rel": Mod("rel.py")}
    out = skeleton.imported_files(modules, str(maps), opened={"/t/models/x.py": None})
    assert out == {"/lib": ["libz.so.1"], "/s/p": ["__init__.py", "e.so"],
                   "/s/p/__pycache__": ["__init__.cpython-312.pyc"], "/t/models": ["x.py"]}
    # In the order first seen: what was opened, the modules' files, then the mapped libraries.
    assert list(out) == ["/t/models", "/s/p/__pycache__", "/s/p", "/lib"]
    # Too large with the sources: they go first; too large without them: nothing is reported.
    monkeypatch.setattr(skeleton, "MAX_REPORT_BYTES", 90)
    assert skeleton.imported_files(modules, str(maps)) == {"/lib": ["libz.so.1"], "/s/p": ["e.so"],
                                                          "/s/p/__pycache__": ["__init__.cpython-312.pyc"]}
    monkeypatch.setattr(skeleton, "MAX_REPORT_BYTES", 10)
    assert skeleton.imported_files(modules, str(maps)) is None
    # Less what the process had before its imports: modules and mapped files.
    monkeypatch.setattr(skeleton, "MAX_REPORT_BYTES", 1 << 20)
    had = ({"p"}, {"/lib/libz.so.1"})
    assert skeleton.imported_files(modules, str(maps), before=had) == {"/s/p": ["e.so"]}
    assert skeleton.mapped_files(str(maps)) == {"/lib/libz.so.1"}
    assert skeleton.mapped_files(str(tmp_path / "nothing")) == set()


def test_a_daemon_learns_a_clients_files_and_reads_them_ahead_after_a_restart(daemon_factory, tiny_store,
                                                                             tmp_path):
    f = _tree(tmp_path / "site")
    d = daemon_factory({"host_cache_bytes": "16MiB", "store_roots": [str(tiny_store.parent)]}).start()
    manifest = d.runtime / "state" / imports_ahead.MANIFEST_NAME
    try:
        assert "no import manifest yet" in d.log()
        with d.client() as c:
            c.attach("tiny", "cpu", importing=True, imports_module=MODULE)
            assert c.stats()["shallow_read_clients"] == 1          # nothing read ahead: shallow
            with pytest.raises(MalformedFrame) as exc:
                c.call("imports_done", {"module": MODULE})
            assert exc.value.fields["argument"] == "files"
            assert c.imports_done(MODULE, imports_ahead.group(f.values())) > 0
            assert_eventually(lambda: manifest.exists(), 10, "the manifest written")
        # Kept in the order the client listed them (directory by directory, as first seen).
        assert imports_ahead.load_manifest(manifest) == {MODULE: [
            f[k] for k in ("pkg/__init__.py", "pkg/mod.py", "pkg/lonely.py", "pkg/_ext.so", "pkg/big.so",
                           "pkg/__pycache__/__init__.cpython-312.pyc", "pkg/__pycache__/mod.cpython-312.pyc")]}
    finally:
        assert d.stop() == 0
    d.start()
    try:
        line = assert_eventually(lambda: next((ln for ln in d.log().splitlines()
                                               if "read ahead the imports of" in ln), None), 20, "read ahead")
        assert ("read ahead the imports of 1 modules: 7 files (17118 bytes), 0 stat-ed, 2 directories"
                in line), line
        with d.client() as c:
            c.attach("tiny", "cpu", importing=True, imports_module=MODULE)
            stats = c.stats()
            assert {k: stats[k] for k in ("read_depth", "read_request_bytes", "shallow_read_clients")} == \
                {**FULL, "shallow_read_clients": 0}
            c.imports_done()
    finally:
        assert d.stop() == 0


def test_a_corrupt_manifest_never_breaks_a_daemon_start_or_a_load(daemon_factory, tiny_store):
    d = daemon_factory({"host_cache_bytes": "16MiB", "store_roots": [str(tiny_store.parent)]})
    (d.runtime / "state").mkdir(parents=True)
    (d.runtime / "state" / imports_ahead.MANIFEST_NAME).write_bytes(b"\xff\xfe garbage")
    d.start()
    try:
        with d.client() as c:
            c.attach("tiny", "cpu", importing=True, imports_module=MODULE)
            assert c.stats()["shallow_read_clients"] == 1
            c.imports_done()
        log = d.log()
        assert "ImportManifestCorrupt" in log or "unreadable" in log, log[-2000:]
        assert "starting without reading ahead" in log
    finally:
        assert d.stop() == 0


def test_a_refused_report_still_ends_the_clients_hold(monkeypatch):
    """load_model's imports_done: a daemon told which files were opened; one that refuses the
    report (an older daemon's frame limit, a malformed-argument answer) gets the plain call, and
    an embedded controller is never sent the list."""
    from deepseek_flash.client import model as client_model
    from deepseek_flash.errors import FrameTooLarge

    class Imports:
        module = MODULE
        opened = {"/t/x.py"}
        before = ({"torch"}, {"/lib/libcuda.so"})

    class FakeClient:
        def __init__(self, mode, refuse):
            self.mode, self.refuse, self.calls = mode, refuse, []

        def imports_done(self, module=None, files=None):
            self.calls.append((module, None if files is None else sorted(files)))
            if files is not None and self.refuse:
                raise self.refuse
            return 1.5

    monkeypatch.setattr(client_model, "imported_files",
                        lambda opened, before: {"/a": ["b.pyc"], **({"/t": ["x.py"]} if (
                            opened == {"/t/x.py"} and before == Imports.before) else {})})
    daemon = FakeClient("daemon", None)
    assert client_model._imports_done(daemon, Imports()) == 1.5
    assert daemon.calls == [(MODULE, ["/a", "/t"])]
    for refuse in (MalformedFrame("no", argument="files"), FrameTooLarge("big", size=2, limit=1)):
        old = FakeClient("daemon", refuse)
        assert client_model._imports_done(old, Imports()) == 1.5
        assert old.calls == [(MODULE, ["/a", "/t"]), (None, None)]
    embedded = FakeClient("embedded", None)
    assert client_model._imports_done(embedded, Imports()) == 1.5 and embedded.calls == [(None, None)]


def test_record_opens_sees_the_files_opened_inside_it_on_any_thread(tmp_path):
    import threading

    a, b, c = (tmp_path / n for n in ("a.py", "b.txt", "c.txt"))
    for p in (a, b, c):
        p.write_text("x")
    with skeleton.record_opens() as opened:
        a.read_text()
        t = threading.Thread(target=b.read_bytes)
        t.start()
        t.join()
        open("/proc/self/stat").close()          # not a file to read ahead
    c.read_text()                                 # after: not recorded
    assert list(opened) == [str(a), str(b)]      # in the order first opened
    with skeleton.record_opens() as again:
        pass
    assert again == {}


def test_the_imports_thread_records_what_its_import_opened(tmp_path, monkeypatch):
    pkg = tmp_path / "flash_probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import pathlib\n"
                                     "TEXT = (pathlib.Path(__file__).parent / 'data.txt').read_text()\n")
    (pkg / "data.txt").write_text("scanned")
    monkeypatch.syspath_prepend(str(tmp_path))
    imports = skeleton.Imports("flash_probe_pkg")
    imports.wait()
    assert str(pkg / "data.txt") in imports.opened and str(pkg / "__init__.py") in imports.opened
    had_modules, had_maps = imports.before
    assert "flash_probe_pkg" not in had_modules and "sys" in had_modules and had_maps
    report = skeleton.imported_files(opened=imports.opened, before=imports.before)
    assert report[str(pkg)] == ["__init__.py", "data.txt"]
    assert not any("site-packages/torch" in d for d in report)     # imported before: not theirs


def test_read_threads_from_the_environment(tmp_path, monkeypatch):
    env = imports_ahead.THREADS_ENV
    assert imports_ahead.read_threads({}) == imports_ahead.THREADS == 48
    assert imports_ahead.read_threads({env: "16"}) == 16 and imports_ahead.read_threads({env: "256"}) == 256
    for bad in ("0", "257", "many", ""):
        with pytest.raises(ConfigError) as info:
            imports_ahead.read_threads({env: bad})
        assert info.value.key == env and info.value.value == bad and info.value.allowed == "1..256"
        assert env in str(info.value)
    monkeypatch.setenv(env, "7")
    assert imports_ahead.ImportsAhead(tmp_path).threads == 7
    assert imports_ahead.ImportsAhead(tmp_path, threads=3).threads == 3


def test_without_a_manifest_the_start_reads_the_packages_files(tmp_path, monkeypatch, caplog):
    """A daemon's first start: every file of the fallback packages (found without importing them;
    one not installed skipped), then any importing client counts as warm."""
    site = tmp_path / "site"
    (site / "flash_pkg_a" / "sub").mkdir(parents=True)
    (site / "flash_pkg_a" / "__init__.py").write_text("a = 1\n")
    (site / "flash_pkg_a" / "sub" / "m.py").write_text("m = 2\n")
    (site / "flash_mod_b.py").write_text("b = 3\n")
    # What no import reads: headers, stubs, tests, shared libraries under lib/ -- not walked.
    for skipped in ("include/x.h", "lib/libbig.so", "sub/tests/test_m.py", "core.pyi", "sub/k.cuh"):
        (site / "flash_pkg_a" / skipped).parent.mkdir(parents=True, exist_ok=True)
        (site / "flash_pkg_a" / skipped).write_text("skipped at the first start\n")
    monkeypatch.syspath_prepend(str(site))
    assert imports_ahead.fallback_packages({}) == imports_ahead.FALLBACK_PACKAGES
    # torch's own Python files and the optional packages a model class pulls in are listed.
    assert {"torch", "torchvision", "pandas", "sklearn", "narwhals"} <= set(imports_ahead.FALLBACK_PACKAGES)
    assert imports_ahead.fallback_packages({imports_ahead.PACKAGES_ENV: " x, ,y "}) == ("x", "y")
    files = [str(site / "flash_mod_b.py"), str(site / "flash_pkg_a" / "__init__.py"),
             str(site / "flash_pkg_a" / "sub" / "m.py")]
    assert imports_ahead.package_files(["flash_pkg_a", "flash_no_such_pkg", "flash_mod_b"]) == files
    monkeypatch.setenv(imports_ahead.PACKAGES_ENV, "flash_pkg_a,flash_mod_b,flash_no_such_pkg")
    warmed = []
    ahead = imports_ahead.ImportsAhead(tmp_path / "state", on_warm=warmed.append)
    with caplog.at_level(logging.INFO, logger="deepseek_flash.imports_ahead"):
        counts = ahead.run()
    assert (counts["files"], counts["bytes"], counts["missing"]) == (3, 18, 0)
    assert warmed == [[imports_ahead.ANY_MODULE]] and counts["in_process"] is False
    assert counts["walked"] == 3
    assert "read ahead the packages' files (no manifest yet): 3 files (18 bytes)" in caplog.text
    assert not ahead.path.exists()           # nothing learned from it


def test_after_the_packages_were_read_no_client_keeps_the_reads_shallow(tiny_store):
    config = FlashConfig.from_dict({"store_roots": [str(tiny_store.parent)]})
    engine = IOEngine(queue_depth=8, request_size=256 << 10)
    manager = BlockManager(config, HostArena(8 << 20), engine)
    try:
        a = manager.connect({})
        manager.hold_shallow(a, module="anything")
        assert engine.shape == reads.SHALLOW_SHAPE
        manager.imports_read_ahead({imports_ahead.ANY_MODULE: []})
        assert engine.shape == (8, 256 << 10) and manager.state.shallow_holders() == []
    finally:
        manager.close()


def test_the_reads_run_in_a_process_of_their_own_or_here_when_it_fails(tmp_path, monkeypatch, caplog):
    f = _tree(tmp_path)
    request = {"roots": [str(tmp_path / "pkg" / "__pycache__")], "read": [f["pkg/mod.py"]],
               "dirs": [str(tmp_path / "pkg")], "threads": 2, "max_file_bytes": 8192, "max_bytes": 1 << 20}
    expected = {"dirs": 1, "stat": 0, "files": 3, "bytes": 3106, "skipped_large": 0, "skipped_budget": 0,
                "missing": 0, "walked": 2}
    assert imports_ahead.run_worker(request) == {**expected, "in_process": False}
    monkeypatch.setattr(imports_ahead, "WORKER", str(tmp_path / "no_such_worker.py"))
    with caplog.at_level(logging.WARNING, logger="deepseek_flash.imports_ahead"):
        assert imports_ahead.run_worker(request) == {**expected, "in_process": True}
    assert "the read-ahead process failed (exit 2" in caplog.text


def test_own_module_files_are_the_compiled_and_module_files_in_import_order(tmp_path):
    import types
    from importlib.machinery import ModuleSpec

    def module(name, origin=None, cached=None):
        m = types.ModuleType(name)
        m.__spec__ = ModuleSpec(name, None, origin=origin)
        m.__spec__.cached = cached
        if origin is not None:
            m.__file__ = origin
        return m

    mods = {"src": module("src", "/s/src.py", "/s/__pycache__/src.cpython-312.pyc"),
            "ext": module("ext", "/s/_ext.so"),                 # an extension: no compiled file
            "builtin": module("builtin"),                      # no file at all
            "rel": module("rel", "rel.py"),                    # not an absolute path: left out
            "again": module("again", "/s/src.py", "/s/__pycache__/src.cpython-312.pyc")}
    # Each module's compiled file and its own (an installation without compiled files reads the
    # source), once, in the order imported.
    assert imports_ahead.own_module_files(mods) == ["/s/__pycache__/src.cpython-312.pyc", "/s/src.py",
                                                    "/s/_ext.so"]
    # This process's own, in the order imported: the interpreter's start before this module.
    own = imports_ahead.own_module_files()
    assert own.index(sys.modules["encodings"].__spec__.cached) < own.index(imports_ahead.__spec__.cached)


def test_the_daemons_own_imports_are_learned_kept_and_read_first(tmp_path, monkeypatch):
    """``learn_own`` keeps the daemon's own modules' files (``OWN``); they never count as a client's
    module, are never evicted for one, and the next start reads them before every client's."""
    f = _tree(tmp_path)
    monkeypatch.setattr(imports_ahead, "MAX_MODULES", 2)
    monkeypatch.setattr(imports_ahead, "own_module_files", lambda: [f["pkg/_ext.so"], f["pkg/lonely.py"]])
    ahead = imports_ahead.ImportsAhead(tmp_path / "state")
    assert ahead.learn_own()
    ahead.learn(MODULE, [f["pkg/mod.py"], f["pkg/lonely.py"]])
    ahead.learn("other", [f["pkg/__init__.py"]])                 # the oldest client's goes, not OWN
    assert list(imports_ahead.load_manifest(ahead.path)) == [imports_ahead.OWN, "other"]
    ahead.learn(MODULE, [f["pkg/mod.py"], f["pkg/lonely.py"]])
    assert list(imports_ahead.load_manifest(ahead.path)) == [imports_ahead.OWN, MODULE]
    requests, warmed = [], []
    monkeypatch.setattr(imports_ahead, "run_worker", lambda r: requests.append(r) or {
        "files": 0, "bytes": 0, "stat": 0, "dirs": 0, "missing": 0, "skipped_large": 0, "skipped_budget": 0})
    restarted = imports_ahead.ImportsAhead(tmp_path / "state", on_warm=warmed.append)
    restarted.run()
    assert requests[0]["read"] == [f["pkg/_ext.so"], f["pkg/lonely.py"], f["pkg/mod.py"]]
    assert warmed == [[MODULE]]


def test_with_only_the_daemons_own_list_the_start_reads_it_then_walks_the_packages(tmp_path, monkeypatch):
    """A daemon restarted before any client reported (only ``OWN`` kept): its own files first, then
    the fallback packages' walk as at a first start; any importing client then counts as warm."""
    f = _tree(tmp_path)
    monkeypatch.setattr(imports_ahead, "own_module_files", lambda: [f["pkg/_ext.so"]])
    imports_ahead.ImportsAhead(tmp_path / "state").learn_own()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(imports_ahead.PACKAGES_ENV, "pkg")
    warmed = []
    counts = imports_ahead.ImportsAhead(tmp_path / "state", on_warm=warmed.append).run()
    assert warmed == [[imports_ahead.ANY_MODULE]]
    # _ext.so read from the list, then the walk's 7 files (the walk re-reads it: 8 reads in all).
    assert counts["walked"] == 7 and counts["files"] == 8
    assert counts["bytes"] == 5000 + sum(os.path.getsize(p) for p in f.values())


def test_with_a_compiled_module_cache_each_sources_compiled_file_is_read_before_it(tmp_path):
    from deepseek_flash import bytecode

    f = _tree(tmp_path)
    cache = str(tmp_path / "cache")
    _, _, read = imports_ahead.plan({MODULE: [f["pkg/mod.py"], f["pkg/_ext.so"]],
                                     imports_ahead.OWN: [f["pkg/lonely.py"]]}, cache=cache)
    assert read == [bytecode.cache_path(cache, f["pkg/lonely.py"]), f["pkg/lonely.py"],
                    bytecode.cache_path(cache, f["pkg/mod.py"]), f["pkg/mod.py"], f["pkg/_ext.so"]]
