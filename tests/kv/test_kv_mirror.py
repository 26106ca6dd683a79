"""``dense_on_device`` (kv/mirror.py): the dense layers keep their pages on the device as well and
read them there -- the same tokens and logits as DynamicCache, nothing of theirs copied, their
bytes counted in ``gpu_bytes``. (On by default on CUDA only; forced here on the CPU.)"""
import torch

from deepseek_flash.kv import TieredCache, cache_kwargs

from kvmodels import greedy, reference, tiny_model


def test_mirrored_dense_layers_match_dynamic_cache_and_count_on_the_device():
    model = tiny_model("llama", layers=3)
    ids = torch.randint(1, 256, (2, 700), generator=torch.Generator().manual_seed(9))
    mask = torch.ones_like(ids)
    mask[1, :21] = 0
    want_tokens, want_logits = reference(model, ids, mask, 40)
    runs = {}
    for on in (True, False):
        cache = TieredCache.for_model(model, gpu_tokens=64, page_tokens=32, dense_layers=2,
                                      dense_on_device=on)
        tokens, logits = greedy(model, ids, mask, cache, 40)
        assert torch.equal(tokens, want_tokens)
        assert (logits - want_logits).abs().max().item() <= 1e-4
        runs[on] = cache
    on, off = runs[True].stats(), runs[False].stats()
    assert [layer.mirror is not None for layer in runs[True].layers] == [True, True, False]
    assert off["mirrored_pages"] == 0 and on["mirrored_pages"] == 2 * on["pages"] // 3
    assert on["pages"] == off["pages"] and on["host_bytes"] == off["host_bytes"]
    # the mirrors' bytes: 2 layers x (K + V) x batch 2 x 2 kv heads x capacity x 16 x fp32
    cap = runs[True].layers[0].mirror.k.shape[2]
    assert cap >= runs[True].layers[0].paged_tokens
    assert on["gpu_bytes"] - off["gpu_bytes"] == 2 * 2 * 2 * 2 * cap * 16 * 4
    # every decode step copies only the third layer's pages (the prefill copies none)
    assert on["pages_fetched"] > 0 and off["pages_fetched"] == 3 * on["pages_fetched"]


def test_a_mirrored_layer_attends_its_buffer_in_place_without_concatenating_its_pages():
    # a decode step of a mirrored dense layer: its keys and values are one prefix of the
    # mirror's buffer (sinks, pages, recent and new tokens in that order), so no concatenation
    # reads its pages; the tokens and logits those of DynamicCache
    from torch.utils._python_dispatch import TorchDispatchMode

    model = tiny_model("llama", layers=3)
    ids = torch.randint(1, 256, (1, 500), generator=torch.Generator().manual_seed(4))
    want_tokens, want_logits = reference(model, ids, None, 30)
    cache = TieredCache.for_model(model, gpu_tokens=64, page_tokens=32, dense_layers=2,
                                  dense_on_device=True)
    tokens, logits = greedy(model, ids, None, cache, 30)  # 30 steps: a page boundary
    assert torch.equal(tokens, want_tokens)
    assert (logits - want_logits).abs().max().item() <= 1e-4
    mirrors = [layer.mirror for layer in cache.layers if layer.mirror is not None]
    assert len(mirrors) == 2 and all(m.sinks_in for m in mirrors)
    held = {m.k.untyped_storage().data_ptr() for m in mirrors}
    held |= {m.v.untyped_storage().data_ptr() for m in mirrors}
    cats = []

    class Cats(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.cat.default:
                cats.append([t.untyped_storage().data_ptr() for t in args[0]])
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Cats():
        out = model(tokens[:, -1:], **cache_kwargs(model, cache))
    assert not [c for c in cats if held & set(c)], "a concatenation read a mirror's pages"
    assert out.logits.isfinite().all()
