"""The skeleton: parameters on meta only for the thread building it, and only while it builds."""
from __future__ import annotations

import threading

import pytest
import torch

from deepseek_flash.client.skeleton import bind_parameters, build_skeleton, meta_parameters


def test_meta_parameters_is_scoped_to_the_block_and_the_thread():
    original = torch.nn.Module.register_parameter
    inside = threading.Event()
    built = threading.Event()
    other = {}

    def elsewhere():
        inside.wait(10)
        other["linear"] = torch.nn.Linear(4, 4)
        built.set()

    thread = threading.Thread(target=elsewhere)
    thread.start()
    with meta_parameters():
        with meta_parameters():                     # nested: still meta inside
            assert torch.nn.Linear(2, 2).weight.is_meta
        ours = torch.nn.Linear(4, 4)
        inside.set()
        assert built.wait(10)
    thread.join()
    assert ours.weight.is_meta and ours.bias.is_meta
    assert not other["linear"].weight.is_meta        # another thread, same moment
    assert torch.nn.Module.register_parameter is original
    assert not torch.nn.Linear(2, 2).weight.is_meta


def test_meta_parameters_restores_after_an_error():
    original = torch.nn.Module.register_parameter
    with pytest.raises(RuntimeError, match="boom"), meta_parameters():
        raise RuntimeError("boom")
    assert torch.nn.Module.register_parameter is original


def test_skeleton_has_meta_parameters_and_real_buffers():
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2).to_dict()
    model = build_skeleton(config)
    assert all(p.is_meta for p in model.parameters())
    assert all(not b.is_meta for b in model.buffers())
    embed = torch.zeros(64, 32, dtype=torch.float32)
    with pytest.raises(KeyError, match="parameters not served"):
        bind_parameters(model, {"model.embed_tokens.weight": embed})
    assert model.model.embed_tokens.weight.data_ptr() == embed.data_ptr()   # a view, not a copy


def test_prefetch_imports_reads_ahead_sources_and_this_interpreters_compiled_modules(tmp_path,
                                                                                   monkeypatch):
    import sys

    from deepseek_flash.client.skeleton import prefetch_imports

    pkg = tmp_path / "flash_prefetch_pkg"
    for rel in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py", "tests/t.py", ".hidden/h.py",
                "notes.txt", f"__pycache__/a.{sys.implementation.cache_tag}.pyc",
                "__pycache__/a.other-99.pyc", f"sub/__pycache__/b.{sys.implementation.cache_tag}.pyc"):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DEEPSEEK_FLASH_CACHE_DIR", str(tmp_path / "cache"))    # no manifest
    # Four sources and this interpreter's two compiled modules; not the tests, hidden
    # directories, other files or another interpreter's bytecode. A missing package is skipped.
    assert prefetch_imports(("flash_prefetch_pkg", "no_such_package_here"), threads=3) == 6
    assert prefetch_imports(("no_such_package_here",)) == 0


def test_prefetch_reads_every_byte_where_the_kernel_ignores_read_ahead_advice(tmp_path,
                                                                              monkeypatch):
    """gVisor (the GPU machines' sandbox) accepts POSIX_FADV_WILLNEED and does nothing: the
    prefetch must read the files themselves, all of them, to the last byte."""
    import os

    from deepseek_flash.client import skeleton

    pkg = tmp_path / "flash_prefetch_bytes"
    sizes = {"__init__.py": 10, "a.py": 3 * skeleton.PREFETCH_CHUNK + 17, "sub/b.py": 0,
             "sub/__init__.py": skeleton.PREFETCH_CHUNK}
    for rel, size in sizes.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_bytes(b"#" * size)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DEEPSEEK_FLASH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(os, "posix_fadvise", lambda *a: None)      # advice ignored
    read = {}
    real_readv = os.readv

    def counting_readv(fd, buffers):
        n = real_readv(fd, buffers)
        path = os.readlink(f"/proc/self/fd/{fd}")
        read[path] = read.get(path, 0) + n
        return n

    monkeypatch.setattr(os, "readv", counting_readv)
    seen = []
    assert skeleton.prefetch_imports(("flash_prefetch_bytes",), threads=2, seen=seen) == 4
    assert sorted(seen) == sorted(str(pkg / rel) for rel in sizes)
    assert read == {str(pkg / rel): size for rel, size in sizes.items()}


def test_the_read_ahead_process_reads_every_file_and_only_under_a_python_executable(tmp_path,
                                                                                   monkeypatch):
    import subprocess
    import sys

    from deepseek_flash.client import skeleton

    pkg = tmp_path / "flash_prefetch_proc"
    for rel in ("__init__.py", "a.py", "sub/__init__.py", "tests/t.py"):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DEEPSEEK_FLASH_CACHE_DIR", str(tmp_path / "cache"))    # no manifest
    ra = skeleton.start_read_ahead(("flash_prefetch_proc",), threads=2)
    assert ra.wait(60) == 3 and ra.proc.returncode == 0 and ra.seconds > 0
    assert skeleton.start_read_ahead(("no_such_package_here",)) is None
    # Embedded in a host whose executable is not Python: nothing is started.
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    monkeypatch.setattr(sys, "executable", "/usr/bin/uwsgi")
    assert skeleton.start_read_ahead(("flash_prefetch_proc",)) is None and started == []


def test_the_next_fresh_process_reads_ahead_every_file_the_skeleton_imports(tmp_path, monkeypatch):
    """A skeleton build in a fresh process records what it imported; the next fresh process's
    prefetch reads all of it (whatever packages the environment's transformers pulls in) plus the
    model sources transformers reads as text, before any of it is imported."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, DEEPSEEK_FLASH_CACHE_DIR=str(tmp_path / "cache"))
    build = """
import json, os, sys
from transformers import LlamaConfig
from deepseek_flash.client import skeleton
seen = []
files = skeleton.prefetch_imports(seen=seen)
before = set(sys.modules)
skeleton.build_skeleton(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2).to_dict())
imported = set(skeleton._module_files([m for m in sys.modules if m not in before]))
print(json.dumps({"files": files, "missed": sorted(imported - set(seen)),
                  "imported": len(imported), "manifest": skeleton.imports_manifest_path().is_file(),
                  "bert_source": any(p.endswith("models/bert/modeling_bert.py") for p in seen)}))
"""
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", build], capture_output=True, text=True,
                             timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["manifest"] and first["imported"] > 100
    assert second["missed"] == [] and second["bert_source"]
    # In import order (a read-ahead beside the imports stays ahead of them): modeling_utils
    # before the model that subclasses its PreTrainedModel (alphabetically it would be after).
    from deepseek_flash.client import skeleton

    monkeypatch.setenv("DEEPSEEK_FLASH_CACHE_DIR", env["DEEPSEEK_FLASH_CACHE_DIR"])
    listed = skeleton.imports_manifest_path().read_text().split("\n")

    def at(suffix):
        return next(i for i, p in enumerate(listed) if p.endswith(suffix))

    assert at(f"transformers/__pycache__/modeling_utils.{sys.implementation.cache_tag}.pyc") < at(
        f"llama/__pycache__/modeling_llama.{sys.implementation.cache_tag}.pyc")


def test_a_fresh_process_attaches_first_and_reads_the_imports_ahead_beside_the_load(tmp_path):
    """In a process that has not imported the model's transformers module, load_model attaches
    first (the load's disk reads start at once), then starts a process of its own that reads the
    module files ahead while this one imports them; nothing of transformers is imported before
    the attach (the decode engine's import comes after it)."""
    import json
    import os
    import subprocess
    import sys

    from deepseek_flash.store import pack
    from deepseek_flash.testing import make_tiny_model

    store = pack(make_tiny_model(tmp_path / "src", "llama", num_layers=2), tmp_path / "store")
    script = f"""
import json, os, sys, importlib.util
from deepseek_flash.client import Client
from deepseek_flash.client.skeleton import imports_cached
# The page cache loses the files the imports start with (as after a drop of the caches).
root = list(importlib.util.find_spec("transformers").submodule_search_locations)[0]
for rel in ("models/llama/modeling_llama.py", "modeling_utils.py"):
    fd = os.open(os.path.join(root, rel), os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
assert not imports_cached({{"model_type": "llama"}})
from deepseek_flash.client.model import load_model
import subprocess
seen, events = [], []
real_popen = subprocess.Popen
def popen_spy(args, *a, **k):
    if any(str(x).endswith("imports_readahead.py") for x in args):
        events.append("read-ahead started")
    return real_popen(args, *a, **k)
subprocess.Popen = popen_spy
with Client(embedded=True, config={{"host_cache_bytes": "16MiB"}}) as client:
    attach = client.attach
    def spy(*a, **k):
        seen.append(sorted(m for m in sys.modules if m.startswith("transformers")))
        events.append("attach")
        return attach(*a, **k)
    client.attach = spy
    model = load_model({str(store)!r}, device="cpu", client=client)
    read = model.flash.read_ahead.wait(120)
    print(json.dumps({{"timings": list(model.flash.timings), "before_attach": seen[0],
                      "events": events, "read": read,
                      "cached_after": imports_cached({{"model_type": "llama"}})}}))
    model.flash.close()
    # Another load in the same process: the module is imported, nothing is read ahead.
    again = load_model({str(store)!r}, device="cpu", client=client)
    print(json.dumps({{"timings": list(again.flash.timings)}}))
    again.flash.close()
"""
    env = dict(os.environ, DEEPSEEK_FLASH_CACHE_DIR=str(tmp_path / "cache"))    # no manifest
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    first, again = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert first["timings"] == ["open_model_ms", "attach_ms", "prefetch_imports_ms", "skeleton_ms",
                                "device_memory_ms", "bind_ms", "total_ms"]
    assert first["events"] == ["attach", "read-ahead started"]
    assert first["before_attach"] == [] and first["cached_after"] is True
    # No manifest yet: the package walk, thousands of module files (transformers' sources alone).
    assert first["read"] > 1000
    assert again["timings"] == ["open_model_ms", "attach_ms", "skeleton_ms", "device_memory_ms",
                                "bind_ms", "total_ms"]


def test_a_fresh_process_with_the_files_cached_reads_nothing_ahead(tmp_path):
    import json
    import subprocess
    import sys

    from deepseek_flash.store import pack
    from deepseek_flash.testing import make_tiny_model

    store = pack(make_tiny_model(tmp_path / "src", "llama", num_layers=2), tmp_path / "store")
    script = f"""
import json
from deepseek_flash.client import Client
from deepseek_flash.client.model import load_model
with Client(embedded=True, config={{"host_cache_bytes": "16MiB"}}) as client:
    model = load_model({str(store)!r}, device="cpu", client=client)
    print(json.dumps(list(model.flash.timings)))
    model.flash.close()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # make_tiny_model just imported (and so cached) the same files in this process.
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [
        "open_model_ms", "attach_ms", "skeleton_ms", "device_memory_ms", "bind_ms", "total_ms"]
