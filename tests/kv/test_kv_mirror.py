"""``dense_on_device`` (kv/mirror.py): the dense layers keep their pages on the device as well and
read them there -- the same tokens and logits as DynamicCache, nothing of theirs copied, their
bytes counted in ``gpu_bytes``. (On by default on CUDA only; forced here on the CPU.)"""
import torch

from deepseek_flash.kv import TieredCache

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
