"""A streamed ``load_model`` model with the tiered cache and a chunked prefill (the 128K-in-16-GiB
Show, bench/kv_16g.py): its CPU smoke run, the ``generate(prefill_chunk_size=...)`` path a user
takes, and on a GPU (``pytest -m gpu tests/kv``) the pieces that keep it within its memory: the
prefill chunks' causality without a mask, and top-K's one gather over the controller's arena."""
import json

import pytest
import torch

from deepseek_flash.client import Client
from deepseek_flash.client.model import load_model
from deepseek_flash.cuda import device_address
from deepseek_flash.daemon.planner import resident_minimum
from deepseek_flash.kv import TieredCache, cache_kwargs
from deepseek_flash.kv.compute import attend_columns, lower_right
from deepseek_flash.store import Store, pack
from deepseek_flash.testing import load_reference, make_tiny_model

from kvmodels import bench_module, reference

gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def streamed_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv16")
    src = make_tiny_model(root / "src", "llama", num_layers=3, hidden_size=64,
                          intermediate_size=512, max_position_embeddings=1024, seed=7)
    return src, pack(src, root / "store")


def test_smoke_bench_streams_weights_and_pages_kv(tmp_path):
    bench = bench_module("kv_16g")
    out = tmp_path / "kv16.json"
    assert bench.main(["--smoke", "--dir", str(tmp_path), "--output", str(out)]) == 0
    r = json.loads(out.read_text())
    assert "error" not in r and r["smoke"] and r["context"] == 400
    # weights streamed through the slot ring, under a budget below the model
    assert r["budget_bytes"] < r["model_bytes"] and r["plan"]["streamed_layers"] > 0
    assert r["runtime"]["bytes_streamed"] > 0 and r["runtime"]["prefetch_miss_count"] >= 0
    # every decode step streams each streamed unit once (a slot's bytes: a layer's MLP, or one
    # projection of it -- gate, up and down are the same size)
    per_pass = r["runtime"]["streamed_units"] * r["plan"]["slot_bytes"]
    assert r["topk25_weight_bytes_per_token"] == r["lossless_weight_bytes_per_token"] == per_pass
    # the KV paged to the host after the prefill: 4 layers, 32-token pages past 4 sinks and a
    # 64-token recent window, (400 - 68) // 32 = 10 pages per layer (still 10 after 14 steps)
    assert r["kv"]["page_tokens"] == 32 and r["kv"]["pages"] == 4 * 10
    assert r["kv_host_bytes"] > 0 and r["kv_gpu_bytes"] < r["kv"]["full_bytes"]
    # lossless reads every page each step; top-K the two dense layers' 10 pages and 25 % of the
    # two others' (3 of 10)
    assert r["lossless_kv_pages_per_token"] == 40
    assert r["topk25_kv_pages_per_token"] == 2 * 10 + 2 * 3
    assert r["lossless_tokens_identical_to_resident"] is True
    assert r["topk25_tok_s"] > 0 and r["lossless_tok_s"] > 0 and r["ttft_s"] > 0


def test_smoke_bench_int8_resident_row(tmp_path):
    """The lossy second row: the model packed as int8 and resident, no weights over the link."""
    bench = bench_module("kv_16g")
    out = tmp_path / "kv16-int8.json"
    assert bench.main(["--smoke", "--dir", str(tmp_path), "--budget", "none", "--quantize",
                       "int8_symmetric", "--decode", "2", "--output", str(out)]) == 0
    r = json.loads(out.read_text())
    assert "error" not in r and r["quantize"] == "int8_symmetric" and r["budget_bytes"] is None
    assert r["plan"] == {"streamed_layers": 0, "resident_bytes": r["model_bytes"]}
    assert "runtime" not in r
    assert r["topk25_weight_bytes_per_token"] == r["lossless_weight_bytes_per_token"] == 0
    assert r["lossless_kv_pages_per_token"] == 40 and r["topk25_kv_pages_per_token"] == 26


def test_generate_with_prefill_chunks_on_a_streamed_model(streamed_store):
    """What a user runs: ``generate`` with transformers' ``prefill_chunk_size`` on a model whose
    layers stream, into a tiered cache -- the resident model's greedy tokens (fp32)."""
    src, store = streamed_store
    ids = torch.randint(1, 256, (1, 300), generator=torch.Generator().manual_seed(11))
    want, want_logits = reference(load_reference(src), ids, None, 6)
    budget = resident_minimum(Store.open(store).blocks)
    with Client(embedded=True, config={"host_cache_bytes": "64MiB"}) as client:
        model = load_model(store, client=client, weight_budget=budget)
        try:
            stream = model.flash.stream      # three layers, each one unit or three (projections)
            assert stream is not None and len(stream.layers) == 3
            assert stream.m == 3 * (3 if stream.plan.unit == "projection" else 1)
            cache = TieredCache.for_model(model, gpu_tokens=64)
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=6, do_sample=False,
                                     prefill_chunk_size=128, output_logits=True,
                                     return_dict_in_generate=True, pad_token_id=0,
                                     **cache_kwargs(model, cache))
            assert torch.equal(out.sequences, want)
            assert (torch.stack(out.logits) - want_logits).abs().max().item() <= 1e-4
            s = cache.stats()
            # the first chunk (128 tokens) chose 32-token pages; every page went to the host
            assert s["page_tokens"] == 32 and s["pages"] == 3 * ((305 - 68) // 32)
            assert model.flash.stream.stats()["passes"] == 3 + 5  # 3 prefill chunks, 5 steps
        finally:
            model.flash.close()


def test_device_address_without_cuda_is_none():
    if torch.cuda.is_available():
        pytest.skip("the CPU answer")
    assert device_address(torch.empty(16).data_ptr()) is None


def test_lower_right_is_for_cuda_only():
    q = torch.randn(1, 4, 8, 16)
    k = torch.randn(1, 2, 40, 16)
    assert lower_right(q, k, k) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_chunk_causality_without_a_mask_equals_the_mask(dtype):
    """A later prefill chunk's attention (queries at the end of longer keys, GQA) through the
    lower-right causal bias equals the materialised mask over repeated heads, within the
    kernels' rounding; no [q, kv] mask is built."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 32, 300, 128, device="cuda", dtype=dtype, generator=g)
    past_k = torch.randn(1, 8, 1000, 128, device="cuda", dtype=dtype, generator=g)
    past_v = torch.randn_like(past_k)
    new_k = torch.randn(1, 8, 300, 128, device="cuda", dtype=dtype, generator=g)
    new_v = torch.randn_like(new_k)
    assert lower_right(q, torch.cat((past_k, new_k), 2), torch.cat((past_v, new_v), 2)) is not None
    got = attend_columns(q, [past_k], [past_v], None, new_k, new_v, None, 128 ** -0.5,
                         length=1000, prefill_chunk=128)
    # the same chunks with the mask built (a padding mask of all ones takes that path)
    ones = torch.ones(1, 1300, dtype=torch.bool, device="cuda")
    want = attend_columns(q, [past_k], [past_v], None, new_k, new_v, ones, 128 ** -0.5,
                          length=1000, prefill_chunk=128)
    assert (got.float() - want.float()).abs().max().item() <= 2e-2
    assert (got.float() - want.float()).abs().mean().item() <= 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_topk_one_gather_over_the_controller_arena(streamed_store):
    """A load_model model's host pages in the controller's page-locked arena: top-K gathers them
    in one index_select (the arena is mapped for the device at its host addresses) and decodes
    exactly as copying the same pages run by run; lossless equals the resident model."""
    src, store = streamed_store
    ids = torch.randint(1, 256, (1, 300), generator=torch.Generator().manual_seed(11))
    budget = resident_minimum(Store.open(store).blocks)
    with Client(embedded=True, config={"host_cache_bytes": "64MiB"}) as client:
        model = load_model(store, device="cuda:0", client=client, weight_budget=budget)
        try:
            arena = client.host_tensor(pinned=True)
            assert device_address(arena.data_ptr()) == arena.data_ptr()
            assert device_address(torch.empty(1 << 20).data_ptr()) is None  # pageable
            runs = []
            for one_gather in (True, False):
                cache = TieredCache.for_model(model, gpu_tokens=64, top_k_pages=0.25,
                                              dense_layers=1, page_cache=0)
                cache.select_graphs = False
                if not one_gather:
                    for layer in cache.layers:
                        layer.pages._span_failed = True
                with torch.no_grad():
                    out = model.generate(ids.cuda(), max_new_tokens=8, do_sample=False,
                                         prefill_chunk_size=128, output_logits=True,
                                         return_dict_in_generate=True, pad_token_id=0,
                                         **cache_kwargs(model, cache))
                assert cache.host_memory.arena and cache.stats()["arena_fallbacks"] == 0
                spans = [layer.pages._span is not None for layer in cache.layers]
                assert spans == ([False, True, True] if one_gather else [False] * 3)
                runs.append((out.sequences, torch.stack(out.logits)))
                cache.close()
            assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
        finally:
            model.flash.close()
