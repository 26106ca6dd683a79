"""kv/fused.py's Triton decode step of a top-K layer on the CPU, through Triton's interpreter
(tests/kv/fused_checks.py, in a process of its own: Triton reads ``TRITON_INTERPRET`` when it is
imported): the same chosen pages, page-cache tables, slots and counts as the torch path, step for
step, its attention within float32 rounding of torch's; its CUDA graph (emulated) replays the same
steps as its eager launches; a step Triton refuses leaves the layer on the torch path. The
kernels on CUDA: tests/kv/test_kv_gpu.py."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deepseek_flash.kv.fused as fused
from deepseek_flash.kv import TieredCache

from kvmodels import greedy, tiny_model

needs_triton = pytest.mark.skipif(fused.triton is None, reason="needs Triton")


@pytest.fixture(scope="module")
def checks():
    here = Path(__file__).parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(here / "fused_checks.py")], capture_output=True,
                         text=True, env=env, cwd=here, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@needs_triton
@pytest.mark.parametrize("name", ["batch1", "batch2", "split1", "split2"])
def test_the_fused_step_equals_the_torch_path(checks, name):
    assert checks[name] == "ok", checks[name]


@needs_triton
def test_the_fused_graph_replays_the_eager_launches(checks):
    assert checks["graph"] == "ok", checks["graph"]


@needs_triton
@pytest.mark.parametrize("name", ["direct", "direct_refused"])
def test_the_fused_graph_over_the_steps_own_tensors(checks, name):
    # the step's tensors at the addresses of the last step: a graph reading them in place (no
    # copy), the same values; its capture refused: the buffers' graph serves
    assert checks[name] == "ok", checks[name]


@needs_triton
def test_the_kernels_rankings_by_sorting_equal_their_definition(checks):
    # a page's rank and the slots' order of eviction, each one sort of packed keys in the
    # kernels: the same as counting the pages (slots) ahead, ties and all
    assert checks["sorts"] == "ok", checks["sorts"]


@needs_triton
def test_a_failing_fused_step_leaves_the_layer_on_the_torch_path(checks):
    assert checks["failure"] == "ok", checks["failure"]


def test_what_the_fused_step_does_not_serve_takes_the_torch_path(monkeypatch):
    # another score, or no Triton for the device (here the CPU): the torch path, the same tokens
    model = tiny_model(layers=2)
    ids = torch.randint(1, 256, (1, 560), generator=torch.Generator().manual_seed(3))

    def cache_of(use_fused, **kw):
        cache = TieredCache.for_model(model, gpu_tokens=64, sink_tokens=4, page_tokens=16,
                                      top_k_pages=0.25, dense_layers=1, window_pages=16, **kw)
        cache.fused = use_fused
        return cache

    want = greedy(model, ids, None, cache_of(False, score="quest"), 3)
    cache = cache_of(True, score="quest")
    got = greedy(model, ids, None, cache, 3)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert cache.layers[1]._fused is None and not cache.layers[1]._fused_failed
    cache = cache_of(True)
    assert not fused.available(torch.device("cpu"))  # no interpreter in this process
    greedy(model, ids, None, cache, 2)
    assert cache.layers[1]._fused is None and not cache.layers[1]._fused_failed
