"""GraphDecoder: generate() gives transformers' tokens, 64 steps, fp32 tiny models -- the static
cache path on the CPU in CI, the captured graphs on CUDA (marked ``gpu``)."""
import logging

import pytest
import torch
from decode_models import DEVICES, left_padded, tiny_model

from deepseek_flash.decode import enable
from deepseek_flash.errors import DecodeCapacityExceeded

STEPS = 64


def reference(model, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch, config", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 24})],
                         ids=["llama", "qwen2", "mistral-window24"])
def test_greedy_tokens_identical_for_64_steps(arch, config, device):
    model = tiny_model(arch, device=device, **config)
    ids, mask = left_padded(3, 9, device)
    want = reference(model, ids, mask, max_new_tokens=STEPS)
    # Visible length grows 16 tokens at a time: five graphs per batch bucket over 73 tokens.
    decoder = enable(model, capacity=96, length_step=16)
    got = reference(model, ids, mask, max_new_tokens=STEPS)
    assert torch.equal(got, want), (got != want).nonzero()[:4].tolist()
    stats = decoder.stats()
    assert stats["generate_calls"] == 1 and stats["fallback_calls"] == 0 and stats["batch_rows"] == 4
    if device == "cpu":
        assert stats["mode"] == "eager" and stats["eager_steps"] == STEPS - 1
    else:
        assert stats["mode"] == "graphs" and stats["replays"] == STEPS - 1 and stats["graphs"] == 5
        assert stats["step"] == "fused" and stats["triton"] == "on"
    # Another prompt length and batch within the capacity: same graphs, same tokens as transformers.
    ids1, mask1 = left_padded(1, 20, device, seed=1)
    got1 = reference(model, ids1, mask1, max_new_tokens=40)
    want1 = decoder.transformers_generate(ids1, attention_mask=mask1, do_sample=False, pad_token_id=0,
                                          max_new_tokens=40)
    assert torch.equal(got1, want1)
    if device != "cpu":
        assert decoder.stats()["captures"] == 5 + 3      # batch bucket 1: visible 32, 48, 64


def test_logits_of_prefill_match_transformers():
    model = tiny_model("qwen2")
    ids, mask = left_padded(2, 7)
    decoder = enable(model, capacity=32)
    from deepseek_flash.decode.request import parse

    req = parse(model, (ids,), {"attention_mask": mask, "max_new_tokens": 1})
    with torch.inference_mode():
        st = decoder._state(2)
        decoder._prefill(st, req, None)
        ours = _last_logits(decoder, req)
        theirs = model(ids, attention_mask=mask).logits[:, -1].float()
    assert (ours - theirs).abs().max().item() < 1e-5


def _last_logits(decoder, req):
    from deepseek_flash.decode.step import forward_last, prefill_allowed

    cursor = decoder.cursor
    cursor.index = torch.arange(req.prompt)
    cursor.visible = 32
    positions = (torch.arange(req.prompt)[None] - req.valid_from[:, None]).clamp(min=0)
    mask = decoder.masks.build(lambda w: prefill_allowed(req.prompt, 32, req.valid_from, w))
    return forward_last(decoder.model, decoder.cache_kw, req.input_ids, positions, mask,
                        decoder.store.cache(req.batch, cursor), decoder.swaps)


@pytest.mark.parametrize("device", DEVICES)
def test_eos_stops_and_pads_like_generate(device):
    model = tiny_model("llama", seed=3, device=device)
    ids, mask = left_padded(2, 5, device, seed=2)
    free = reference(model, ids, mask, max_new_tokens=40)
    eos = int(free[0, 5 + 6])             # the 7th token of row 0 becomes an eos
    want = reference(model, ids, mask, max_new_tokens=40, eos_token_id=eos)
    enable(model, capacity=64)
    got = reference(model, ids, mask, max_new_tokens=40, eos_token_id=eos)
    assert torch.equal(got, want)
    assert got.shape[1] <= free.shape[1]


@pytest.mark.parametrize("device", DEVICES)
def test_min_new_tokens_and_min_length_hold_back_eos_like_generate(device):
    model = tiny_model("llama", seed=3, device=device)
    ids, mask = left_padded(2, 5, device, seed=2)
    free = reference(model, ids, mask, max_new_tokens=40)
    eos = int(free[0, 5 + 6])             # the 7th token of row 0 becomes an eos
    stopped = reference(model, ids, mask, max_new_tokens=40, eos_token_id=eos)
    cases = [{"min_new_tokens": 12}, {"min_length": 5 + 20}, {"min_new_tokens": 12, "top_k": 1}]
    wants = [reference(model, ids, mask, max_new_tokens=40, eos_token_id=eos, **kw) for kw in cases[:2]]
    wants.append(wants[0])                # top-k 1 sampling is greedy
    assert not torch.equal(wants[0][:, :stopped.shape[1]], stopped)   # the rule changes the tokens
    decoder = enable(model, capacity=64)
    for kw, want in zip(cases, wants):
        sample = {"do_sample": True, "temperature": 0.5} if "top_k" in kw else {"do_sample": False}
        got = model.generate(ids, attention_mask=mask, max_new_tokens=40, eos_token_id=eos,
                             pad_token_id=0, **sample, **kw)
        assert torch.equal(got, want), kw
    assert torch.equal(reference(model, ids, mask, max_new_tokens=40, eos_token_id=eos), stopped)
    assert decoder.stats()["fallback_calls"] == 0


def test_sampling_with_top_k_1_is_greedy():
    model = tiny_model("mistral", seed=4)
    ids, mask = left_padded(2, 6)
    want = reference(model, ids, mask, max_new_tokens=12)
    enable(model, capacity=32)
    got = model.generate(ids, attention_mask=mask, do_sample=True, top_k=1, temperature=0.5,
                         max_new_tokens=12, pad_token_id=0)
    assert torch.equal(got, want)


def test_capacity_is_checked_before_any_work():
    model = tiny_model("llama")
    decoder = enable(model, capacity=16)
    ids, mask = left_padded(1, 10)
    with pytest.raises(DecodeCapacityExceeded) as err:
        model.generate(ids, attention_mask=mask, max_new_tokens=7)
    assert (err.value.prompt, err.value.new_tokens, err.value.capacity) == (10, 7, 16)
    assert err.value.code == 801 and decoder.store is None
    assert model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False).shape == (1, 16)


@pytest.mark.parametrize("where", ["cache", "step"])
def test_out_of_memory_falls_back_to_transformers_for_the_call(where, monkeypatch, caplog):
    from deepseek_flash.decode import engine

    model = tiny_model("llama", seed=2)
    ids, mask = left_padded(2, 6, seed=3)
    want = reference(model, ids, mask, max_new_tokens=12)
    decoder = enable(model, capacity=32)
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
    if where == "cache":
        def no_memory(*args, **kwargs):
            raise oom
        monkeypatch.setattr(engine, "KVStore", no_memory)
    else:
        step, calls = decoder._step, []

        def step_then_oom(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise oom
            return step(*args, **kwargs)
        monkeypatch.setattr(decoder, "_step", step_then_oom)
    with caplog.at_level(logging.WARNING, logger="deepseek_flash.decode"):
        got = reference(model, ids, mask, max_new_tokens=12)
    assert torch.equal(got, want)
    stats = decoder.stats()
    assert stats["oom_fallbacks"] == 1 and stats["fallback_calls"] == 1 and stats["kv_bytes"] == 0
    assert "out of device memory" in stats["last_fallback"] and "4.00 GiB" in stats["last_fallback"]
    assert any("out of device memory" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()                  # memory again: the next call decodes over the static cache
    assert torch.equal(reference(model, ids, mask, max_new_tokens=12), want)
    assert decoder.stats()["generate_calls"] == 2 and decoder.stats()["kv_bytes"] > 0


def test_a_larger_batch_frees_the_old_cache_before_making_the_new(monkeypatch):
    import weakref

    from deepseek_flash.decode import engine

    model = tiny_model("llama", seed=2)
    decoder = enable(model, capacity=32)
    ids, mask = left_padded(1, 6, seed=3)
    reference(model, ids, mask, max_new_tokens=4)
    old = weakref.ref(decoder.store)
    assert decoder._caches and decoder._kv_rows        # views of the old buffers
    alive_at_new, make = [], engine.KVStore

    def store(*args, **kwargs):
        alive_at_new.append(old() is not None or bool(decoder._caches) or bool(decoder._kv_rows))
        return make(*args, **kwargs)
    monkeypatch.setattr(engine, "KVStore", store)
    ids, mask = left_padded(3, 6, seed=4)
    want = decoder.transformers_generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                         pad_token_id=0)
    assert torch.equal(reference(model, ids, mask, max_new_tokens=4), want)
    assert alive_at_new == [False] and decoder.store.batch == 4


def test_unsupported_calls_go_to_transformers_with_a_logged_reason(caplog):
    model = tiny_model("llama")
    ids, mask = left_padded(1, 6)
    want = reference(model, ids, mask, max_new_tokens=5, num_beams=2)
    decoder = enable(model, capacity=32)
    with caplog.at_level(logging.WARNING, logger="deepseek_flash.decode"):
        got = reference(model, ids, mask, max_new_tokens=5, num_beams=2)
    assert torch.equal(got, want)
    assert decoder.stats()["fallback_calls"] == 1 and "num_beams=2" in decoder.last_fallback
    assert any("num_beams=2" in r.getMessage() for r in caplog.records)


def test_a_tiered_cache_given_to_generate_goes_to_transformers_with_the_reason(caplog):
    """A caller's own cache (the kv tier) is a model input the step does not implement: the call
    is transformers' generate over that cache, unchanged, and the log says so."""
    from deepseek_flash.kv import TieredCache, cache_keyword, cache_kwargs

    model = tiny_model("llama")
    ids, mask = left_padded(1, 6)
    plain = reference(model, ids, mask, max_new_tokens=5)
    decoder = enable(model, capacity=32)     # as load_model(decode=...) installs it, before any cache
    with caplog.at_level(logging.WARNING, logger="deepseek_flash.decode"):
        # for_model switches the model's attention to the tiered function (kv/attention.py).
        cache = TieredCache.for_model(model, gpu_tokens=8)
        got = reference(model, ids, mask, max_new_tokens=5, **cache_kwargs(model, cache))
    want = type(model).generate(model, ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                                max_new_tokens=5,
                                **cache_kwargs(model, TieredCache.for_model(model, gpu_tokens=8)))
    assert torch.equal(got, want) and torch.equal(got, plain)
    stats = decoder.stats()
    assert stats["fallback_calls"] == 1 and stats["generate_calls"] == 0
    assert cache_keyword(model) in decoder.last_fallback and "model inputs" in decoder.last_fallback
    assert any(decoder.last_fallback in r.getMessage() for r in caplog.records)
    # Afterwards (the model's attention still switched) a call without a cache is the decoder's
    # static-cache step again, with transformers' tokens.
    assert torch.equal(reference(model, ids, mask, max_new_tokens=5), plain)
    assert decoder.stats()["generate_calls"] == 1


def test_unsupported_architecture_keeps_transformers_generate(caplog):
    import transformers

    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 64, (1, 4))
    want = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with caplog.at_level(logging.WARNING, logger="deepseek_flash.decode"):
        decoder = enable(model)
    assert decoder.mode == "transformers" and "gpt2" in decoder.unsupported
    assert any("gpt2" in r.getMessage() for r in caplog.records)
    assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_forward_hooks_make_steps_eager_with_the_reason(caplog):
    model = tiny_model("llama", device="cuda:0")
    seen = []
    model.model.layers[1].mlp.register_forward_hook(lambda m, a, o: seen.append(1))
    ids, mask = left_padded(2, 6, "cuda:0")
    want = reference(model, ids, mask, max_new_tokens=10)
    decoder = enable(model, capacity=32)
    with caplog.at_level(logging.WARNING, logger="deepseek_flash.decode"):
        got = reference(model, ids, mask, max_new_tokens=10)
    assert torch.equal(got, want)
    assert decoder.mode == "eager" and "model.layers.1.mlp has forward hooks" in decoder.eager_reason
    assert decoder.stats()["replays"] == 0 and len(seen) == 2 * 10      # the hook ran every step


class _HostSync(torch.nn.Module):
    """A module a graph cannot hold: it reads a value on the host in every forward."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if x.abs().sum().item() < 0:
            return x
        return self.inner(x)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_failed_capture_falls_back_to_eager_and_stays_exact():
    model = tiny_model("qwen2", device="cuda:0")
    ids, mask = left_padded(2, 6, "cuda:0")
    want = reference(model, ids, mask, max_new_tokens=12)
    model.model.layers[0].mlp.down_proj = _HostSync(model.model.layers[0].mlp.down_proj)
    decoder = enable(model, capacity=32)
    got = reference(model, ids, mask, max_new_tokens=12)
    assert torch.equal(got, want)
    assert decoder.mode == "eager" and decoder.eager_reason.startswith("capture failed")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_pool_bytes_is_the_pool_the_graphs_hold():
    model = tiny_model("llama", device="cuda:0")
    ids, mask = left_padded(2, 6, "cuda:0")
    scratch = torch.empty(64 << 20, dtype=torch.uint8, device="cuda:0")
    del scratch                        # cached memory that the capture's own empty_cache releases
    decoder = enable(model, capacity=64, length_step=16)
    reference(model, ids, mask, max_new_tokens=30)
    stats = decoder.stats()
    assert stats["captures"] == 3 and stats["mode"] == "graphs"
    pool = tuple(decoder.pool)
    held = sum(s["total_size"] for s in torch.cuda.memory_snapshot()
               if tuple(s.get("segment_pool_id", ())) == pool)
    assert stats["graph_pool_bytes"] == held > 0
    decoder.reset()
    assert decoder.stats()["graph_pool_bytes"] == 0


def test_concurrent_calls_take_turns_and_stay_exact():
    import threading

    model = tiny_model("qwen2", seed=5)
    prompts = [left_padded(2, 6, seed=s) for s in (10, 11, 12)]
    want = [reference(model, ids, mask, max_new_tokens=16) for ids, mask in prompts]
    enable(model, capacity=32)
    got = [None] * len(prompts)

    def run(i):
        ids, mask = prompts[i]
        got[i] = reference(model, ids, mask, max_new_tokens=16)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_prompt_on_another_device_goes_to_transformers():
    model = tiny_model("llama")
    decoder = enable(model, capacity=32)
    ids, mask = left_padded(1, 4)
    decoder.device = torch.device("meta")       # as if the model lived elsewhere than the prompt
    reference(model, ids, mask, max_new_tokens=3)
    assert decoder.stats()["fallback_calls"] == 1 and "prompt on cpu" in decoder.last_fallback
