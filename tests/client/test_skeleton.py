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


# The real Mistral-7B shape (32 layers, 32k vocabulary): 291 parameters, 7,241,732,096 weights.
MISTRAL_7B = dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=128, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, torch_dtype="bfloat16")


def test_a_real_size_skeleton_holds_no_weight_memory_and_builds_in_milliseconds():
    """In a fresh process, the 7B skeleton: every parameter on meta (none allocated, none
    initialised: the process's peak resident memory grows by no weight's worth), the buffers
    only the rotary table; the first build is the imports, a second build (the model class
    imported) takes milliseconds -- the skeleton phase of a cold load is its imports, nothing
    proportional to the model's bytes."""
    import json
    import subprocess
    import sys

    script = f"""
import json, resource, sys, time
import torch
from deepseek_flash.client.skeleton import build_skeleton, start_imports
config = {MISTRAL_7B!r}
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t = time.perf_counter()
imports = start_imports(config)
fresh_module_before = imports is not None and imports.module in sys.modules
model = build_skeleton(config, imports)
first_s = time.perf_counter() - t
peak = rss()
t = time.perf_counter()
again = build_skeleton(config, start_imports(config))
second_s = time.perf_counter() - t
params = list(model.named_parameters())
print(json.dumps({{"first_s": first_s, "second_s": second_s, "rss_growth": rss() - peak,
    "n_params": len(params), "numel": sum(p.numel() for _, p in params),
    "meta": all(p.is_meta for _, p in params) and all(p.is_meta for p in again.parameters()),
    "dtype": sorted({{str(p.dtype) for _, p in params}}),
    "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers() if not b.is_meta),
    "buffers": sorted(n for n, _ in model.named_buffers()),
    "ahead": imports is not None, "imports_s": imports and imports.seconds,
    "fresh_module_before": fresh_module_before}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["n_params"] == 32 * 9 + 3 and res["numel"] == 7_241_732_096
    assert res["meta"] and res["dtype"] == ["torch.bfloat16"]
    assert res["buffers"] == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    assert 0 < res["buffer_bytes"] <= 1024
    # One layer's MLP alone is 352 MB; the whole model 14.5 GB.
    assert res["rss_growth"] < 64 << 20
    assert res["ahead"] and res["imports_s"] > 0 and not res["fresh_module_before"]
    assert res["second_s"] < min(1.0, res["first_s"] / 4), res


def test_start_imports_is_none_once_the_module_is_imported_and_errors_surface_in_the_build():
    from deepseek_flash.client.skeleton import build_skeleton, skeleton_imported, start_imports

    config = {"model_type": "llama"}
    import transformers.models.llama.modeling_llama  # noqa: F401

    assert skeleton_imported(config) and start_imports(config) is None
    missing = start_imports({"model_type": "no_such_arch"})
    missing.wait()
    assert missing.seconds is not None          # the thread's error is not raised there ...
    with pytest.raises((ValueError, KeyError), match="no_such_arch"):
        build_skeleton({"model_type": "no_such_arch"}, missing)    # ... but by the build


def test_a_fresh_process_imports_on_a_thread_while_it_attaches(tmp_path):
    """In a process that has not imported the model's transformers module, load_model starts the
    skeleton's imports on a thread from the store's config.json once its attach request is on
    its way (in-process: right before the controller handles it; not beside the open's or the
    attach's sending): they are under way while the attach runs (``imports_ms`` is what is left
    of them after it), and the attach asks for shallow reads until they are done; a second load
    in the same process imports nothing."""
    import json
    import subprocess
    import sys

    from deepseek_flash.store import pack
    from deepseek_flash.testing import make_tiny_model

    store = pack(make_tiny_model(tmp_path / "src", "llama", num_layers=2), tmp_path / "store")
    script = f"""
import json, sys, threading, time
from deepseek_flash.client import Client
from deepseek_flash.client.model import load_model
seen = []
with Client(embedded=True, config={{"host_cache_bytes": "16MiB"}}) as client:
    def spy(call):
        def wrapped(*a, **k):
            seen.append(sorted(t.name for t in threading.enumerate()
                               if t.name == "flash-skeleton-imports"))
            return call(*a, **k)
        return wrapped
    client.open_model, client.attach = spy(client.open_model), spy(client.attach)
    ops = client._backend.ops
    handled = ops.call
    def op_spy(cid, op, args):
        if op == "attach":
            seen.append(sorted(t.name for t in threading.enumerate()
                               if t.name == "flash-skeleton-imports"))
        return handled(cid, op, args)
    ops.call = op_spy
    began = time.perf_counter()
    model = load_model({str(store)!r}, device="cpu", client=client)
    took = time.perf_counter() - began
    print(json.dumps({{"timings": list(model.flash.timings), "at_open": seen[0], "at_attach": seen[1],
                      "at_handled": seen[2],
                      "load_model_s": took,
                      "imports_s": model.flash.imports.seconds, "shallow_s": model.flash.shallow_read_s,
                      "after": [client.stats()[k] for k in ("read_depth", "shallow_read_clients")]}}))
    model.flash.close()
    again = load_model({str(store)!r}, device="cpu", client=client)
    print(json.dumps({{"timings": list(again.flash.timings), "imports": again.flash.imports,
                      "shallow_s": again.flash.shallow_read_s}}))
    again.flash.close()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    first, again = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert first["timings"] == ["open_model_ms", "attach_ms", "imports_ms", "skeleton_ms",
                                "device_memory_ms", "bind_ms", "total_ms"]
    # The imports start once the attach request is out (not beside the open's or the attach's
    # sending), before the controller handles it.
    assert first["at_open"] == [] and first["at_attach"] == []
    assert first["at_handled"] == ["flash-skeleton-imports"]
    assert first["imports_s"] > 0
    # Attached while importing: the controller read shallow until the imports were done (they
    # ended after the attach here: the attach's round trip and imports_done's within the call),
    # then went back to full depth.
    assert 0 < first["shallow_s"] < first["load_model_s"] and first["after"] == [8, 0]
    assert again["shallow_s"] is None
    assert again["timings"] == ["open_model_ms", "attach_ms", "skeleton_ms", "device_memory_ms",
                                "bind_ms", "total_ms"]
    assert again["imports"] is None


def test_a_failed_load_model_returns_only_after_its_imports(tmp_path):
    """load_model that fails after starting the skeleton's imports (here: a budget below the
    model's minimum) returns its error only once that thread is done, so the caller's own
    imports of transformers never run beside it."""
    import json
    import subprocess
    import sys

    from deepseek_flash.store import pack
    from deepseek_flash.testing import make_tiny_model

    store = pack(make_tiny_model(tmp_path / "src", "llama", num_layers=2), tmp_path / "store")
    script = f"""
import json, threading
from deepseek_flash.client import Client
from deepseek_flash.client.model import load_model
from deepseek_flash.errors import BudgetTooSmall
with Client(embedded=True, config={{"host_cache_bytes": "16MiB"}}) as client:
    try:
        load_model({str(store)!r}, device="cpu", client=client, weight_budget=1)
    except BudgetTooSmall as exc:
        print(json.dumps({{"error": type(exc).__name__, "threads": sorted(
            t.name for t in threading.enumerate() if t.name == "flash-skeleton-imports")}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"error": "BudgetTooSmall",
                                                                "threads": []}


def test_imports_begun_are_kept_for_the_same_architecture():
    """``start_imports`` with imports begun earlier keeps them when the config names the same
    architecture, and joins them before starting another's."""
    from deepseek_flash.client.skeleton import start_imports

    assert start_imports(None) is None
    begun = start_imports({"model_type": "no_such_arch_a"})
    assert start_imports({"model_type": "no_such_arch_a"}, begun) is begun
    other = start_imports({"model_type": "no_such_arch_b"}, begun)
    assert begun.seconds is not None               # joined before the other one started
    assert other is not begun and other.module.endswith("modeling_no_such_arch_b")
    other.wait()
