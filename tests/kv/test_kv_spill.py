"""The NVMe tier: pages past host_bytes spill to files through the native IO engine and come back
exactly; a corrupt page is named (strict) or left out (graceful); a full disk is a clear error
and the generation goes on unharmed."""
import resource
import signal
from pathlib import Path

import pytest
import torch

from deepseek_flash.errors import KVPageCorrupt, KVSpillFailed
from deepseek_flash.kv import TieredCache, cache_kwargs

from kvmodels import greedy, reference, tiny_model

PAGE_BYTES = 2 * 2 * 16 * 16 * 4  # K+V, 2 heads, 16 tokens, head_dim 16, fp32 = 4 KiB


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=21)


def _cache(model, tmp_path, **kw):
    opts = dict(gpu_tokens=32, page_tokens=16, host_bytes=8 * PAGE_BYTES, spill_dir=tmp_path,
                chunk_pages=2)
    opts.update(kw)
    return TieredCache.for_model(model, **opts)


def test_spilled_pages_come_back_exactly(model, tmp_path):
    ids = torch.randint(1, 256, (1, 400))
    want_tokens, want_logits = reference(model, ids, None, 6)
    cache = _cache(model, tmp_path)
    tokens, logits = greedy(model, ids, None, cache, 6)
    assert torch.equal(tokens, want_tokens)
    assert (logits - want_logits).abs().max().item() <= 1e-4
    s = cache.stats()
    # prefill: (400 - 4 - 32) // 16 = 22 pages per layer = 11 full chunks of 2; the budget keeps
    # 4 chunks, so 18 spill. Decode step 4 (recent window 44 + 4 = 48) fills page 23: a new
    # (partial) chunk per layer, so two more full ones spill. Steps 1..4 read 18 spilled chunks
    # of 2 pages, step 5 reads 20.
    assert s["pages"] == 2 * 23
    assert s["host_bytes"] <= 8 * PAGE_BYTES
    files = sorted(Path(tmp_path).glob("*.pages"))
    assert s["chunks_spilled"] == len(files) == 20
    assert all(f.stat().st_size == 2 * PAGE_BYTES for f in files)
    assert s["spilled_bytes"] == 20 * 2 * PAGE_BYTES
    assert s["pages_read_spilled"] == 4 * 18 * 2 + 20 * 2
    cache.close()
    assert not list(Path(tmp_path).glob("*.pages"))


def _corrupt_one(tmp_path):
    path = sorted(Path(tmp_path).glob("*L001-P00000002.pages"))[0]
    raw = bytearray(path.read_bytes())
    raw[PAGE_BYTES + 100] ^= 0xFF  # second page of the chunk = page 3 of layer 1
    path.write_bytes(bytes(raw))
    return path


def test_corrupt_page_strict_names_file_and_page(model, tmp_path):
    ids = torch.randint(1, 256, (1, 400))
    cache = _cache(model, tmp_path)
    with torch.no_grad():
        model(ids, **cache_kwargs(model, cache))
        path = _corrupt_one(tmp_path)
        with pytest.raises(KVPageCorrupt) as info:
            model(ids[:, :1], **cache_kwargs(model, cache))
    err = info.value
    assert err.path == str(path) and err.layer == 1 and err.page == 3 and err.row == 0
    assert str(path) in str(err) and "page 3" in str(err) and err.code == 702


def test_corrupt_page_graceful_leaves_it_out(model, tmp_path):
    ids = torch.randint(1, 256, (1, 400))
    cache = _cache(model, tmp_path, error_recovery_mode="graceful")
    with torch.no_grad():
        model(ids, **cache_kwargs(model, cache))
        _corrupt_one(tmp_path)
        out = model(ids[:, :1], **cache_kwargs(model, cache))
        model(ids[:, :1], **cache_kwargs(model, cache))
    assert torch.isfinite(out.logits).all()
    assert cache.stats()["pages_lost"] == 1  # found once, then never read again
    assert cache.layers[1].lost_pages == {3}


@pytest.fixture
def full_disk():
    """Files of this process cannot grow past 4 KiB (EFBIG) while the fixture is active."""
    old_sig = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)

    def fill(on):
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old[1]) if on else old)
    yield fill
    resource.setrlimit(resource.RLIMIT_FSIZE, old)
    signal.signal(signal.SIGXFSZ, old_sig)


@pytest.mark.parametrize("mode", ["strict", "graceful"])
def test_spill_dir_full_is_a_clear_error_and_nothing_is_lost(model, tmp_path, full_disk, mode):
    ids = torch.randint(1, 256, (1, 400))
    with torch.no_grad():
        full = TieredCache.for_model(model, gpu_tokens=32, page_tokens=16)
        want = [model(ids, **cache_kwargs(model, full)).logits[:, -1]]
        for t in range(1, 4):
            want.append(model(ids[:, t:t + 1], **cache_kwargs(model, full)).logits[:, -1])
        cache = _cache(model, tmp_path, error_recovery_mode=mode)
        full_disk(True)
        got = [model(ids, **cache_kwargs(model, cache)).logits[:, -1]]
        assert cache.stats()["spill_errors"] >= 1
        assert cache.host_bytes() > 8 * PAGE_BYTES  # kept on the host, not dropped
        assert not list(Path(tmp_path).glob("*.pages"))  # no partial file left behind
        if mode == "strict":
            with pytest.raises(KVSpillFailed) as info:
                model(ids[:, 1:2], **cache_kwargs(model, cache))
            assert str(tmp_path) in str(info.value) and info.value.errno != 0
        full_disk(False)
        for t in range(1, 4):
            got.append(model(ids[:, t:t + 1], **cache_kwargs(model, cache)).logits[:, -1])
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() <= 1e-4
    assert cache.stats()["host_bytes"] <= 8 * PAGE_BYTES  # spilled once the disk had room


def _corrupt_layer(tmp_path, layer):
    """Flip one byte in every page of every spill file of ``layer``."""
    paths = sorted(Path(tmp_path).glob(f"*L{layer:03d}-P*.pages"))
    for path in paths:
        raw = bytearray(path.read_bytes())
        for page in range(len(raw) // PAGE_BYTES):
            raw[page * PAGE_BYTES + 7] ^= 0xFF
        path.write_bytes(bytes(raw))
    return paths


@pytest.mark.parametrize("mode", ["strict", "graceful"])
def test_corrupt_page_chosen_by_topk(model, tmp_path, mode):
    """The top-K path reads single spilled pages: a corrupt one fails the step naming its file
    and page (strict), or is left out of attention and never chosen again (graceful)."""
    ids = torch.randint(1, 256, (1, 400), generator=torch.Generator().manual_seed(9))
    cache = _cache(model, tmp_path, top_k_pages=3, dense_layers=0, error_recovery_mode=mode)
    with torch.no_grad():
        model(ids, **cache_kwargs(model, cache))
        paths = {str(p) for p in _corrupt_layer(tmp_path, 1)}
        if mode == "strict":
            with pytest.raises(KVPageCorrupt) as info:
                model(ids[:, :1], **cache_kwargs(model, cache))
            err = info.value
            assert err.path in paths and err.layer == 1 and err.code == 702
            assert err.path in str(err) and f"page {err.page}" in str(err)
            return
        outs = [model(ids[:, t:t + 1], **cache_kwargs(model, cache)).logits for t in range(3)]
    lost = cache.layers[1].lost_pages
    assert all(torch.isfinite(o).all() for o in outs)
    assert len(lost) >= 1 and cache.stats()["pages_lost"] == len(lost)  # each found once
    assert cache.layers[0].lost_pages == set()
