"""BICL page layout: every byte where docs/kv.md says it is."""
import pytest
import torch

from deepseek_flash.kv.layout import PageLayout, auto_page_tokens, pack_pages, unpack_pages


def test_page_offsets_are_k_heads_then_v_heads_token_major():
    lay = PageLayout(kv_heads=2, head_dim=4, page_tokens=3, dtype=torch.bfloat16)
    assert lay.shape == (2, 2, 3, 4)
    assert lay.page_bytes == 2 * 2 * 3 * 4 * 2 == 96
    assert lay.token_bytes == 32
    assert lay.offset(0, 0, 0, 0) == 0
    assert lay.offset(0, 0, 0, 1) == 2
    assert lay.offset(0, 0, 1, 0) == 8
    assert lay.offset(0, 1, 0, 0) == 24
    assert lay.offset(1, 0, 0, 0) == 48
    assert lay.offset(1, 1, 2, 3) == 94
    with pytest.raises(IndexError):
        lay.offset(2, 0, 0, 0)


def test_pack_pages_puts_each_element_at_its_offset():
    b, h, p, d, n = 2, 3, 4, 5, 2
    keys = torch.arange(b * h * n * p * d, dtype=torch.float32).view(b, h, n * p, d)
    values = -keys - 1
    pages = pack_pages(keys, values, p)
    assert pages.shape == (n, b, 2, h, p, d) and pages.is_contiguous()
    lay = PageLayout(h, d, p, torch.float32)
    raw = pages.view(torch.uint8)
    for (page, row, kv, head, tok, ch) in [(0, 0, 0, 0, 0, 0), (1, 1, 1, 2, 3, 4), (1, 0, 0, 1, 2, 3)]:
        src = (keys if kv == 0 else values)[row, head, page * p + tok, ch]
        base = (page * b + row) * lay.page_bytes + lay.offset(kv, head, tok, ch)
        got = raw.reshape(-1)[base:base + 4].view(torch.float32)
        assert got.item() == src.item()
    k2, v2 = unpack_pages(pages)
    assert torch.equal(k2, keys) and torch.equal(v2, values)


@pytest.mark.parametrize("seq,tokens", [(1, 32), (4096, 32), (4097, 64), (131072, 64)])
def test_auto_page_tokens(seq, tokens):
    assert auto_page_tokens(seq) == tokens
