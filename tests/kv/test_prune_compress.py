"""Level 3's int4 form: exact layout, the round-trip error bound, bytes."""
import pytest
import torch

from deepseek_flash.kv.prune import compress_pages, decompress_pages, round_trip_bound
from deepseek_flash.kv.prune.compress import compressed_bytes


def test_round_trip_within_half_a_step_of_each_group():
    torch.manual_seed(0)
    pages = torch.randn(3, 2, 2, 2, 32, 64) * 4  # [n, b, 2, heads, tokens, head_dim]
    pages[0, 0, 0, 1, :, 5] += 100.0  # an outlier key channel stays in its own group
    c = compress_pages(pages)
    back = decompress_pages(c)
    assert back.shape == pages.shape and back.dtype == torch.float32
    err = (back - pages).abs()
    assert bool((err <= round_trip_bound(pages)).all())
    # K groups are per (head, channel) over tokens: the outlier channel's step is its own
    k_step = c.k_step.float()
    assert k_step.shape == (3, 2, 2, 1, 64)
    k = pages[:, :, 0]  # [n, b, heads, tokens, channels]
    want = (k.amax(3) - k.amin(3)) / 15
    assert torch.allclose(k_step[:, :, :, 0], want, rtol=2e-3)  # fp16 rounding of the step
    assert want[0, 0, 1, 5] < 3.0 < 100  # the +100 channel's range is its own
    # V groups are per (head, token) over channels
    assert c.v_step.shape == (3, 2, 2, 32, 1)
    # the error is not zero: this is a lossy form
    assert err.max() > 0


def test_exact_codes_of_a_known_group():
    # one head, two tokens, two channels: K channel 0 = [0, 1.5], channel 1 = [-1, -1]
    pages = torch.zeros(2, 1, 2, 2)
    pages[0, 0] = torch.tensor([[0.0, -1.0], [1.5, -1.0]])
    pages[1, 0] = torch.tensor([[0.0, 3.0], [-2.0, 2.0]])
    c = compress_pages(pages)
    assert c.k_lo.float().flatten().tolist() == [0.0, -1.0]
    assert c.k_step.float().flatten()[0].item() == pytest.approx(0.1, rel=1e-3)  # 1.5 / 15
    assert c.k_step.float().flatten()[1].item() == 1.0  # a constant group: step 1, code 0
    back = decompress_pages(c)
    assert back[0, 0, :, 1].tolist() == [-1.0, -1.0]  # a constant channel comes back exactly
    assert back[0, 0, 1, 0].item() == pytest.approx(1.5, abs=0.1 / 2 + 1e-6)
    assert back[1, 0, 1, 0].item() == pytest.approx(-2.0, abs=1e-6)  # the group's minimum
    # two codes per byte, low nibble first: V token 0 = [0, 3] -> codes [0, 15]
    assert c.v_codes[0, 0].tolist() == [0 | (15 << 4)]


def test_bytes_and_dtypes():
    pages = torch.randn(2, 8, 64, 128).to(torch.bfloat16)  # one 8B-shaped page
    c = compress_pages(pages)
    assert c.nbytes == compressed_bytes(8, 64, 128) == 65536 + 4096 + 2048
    assert pages.numel() * 2 / c.nbytes == pytest.approx(3.66, abs=0.01)
    back = decompress_pages(c)
    assert back.dtype == torch.bfloat16
    bound = round_trip_bound(pages.float())
    # bf16 output adds its own rounding (relative 2 ** -8) on top of the int4 bound
    assert bool(((back.float() - pages.float()).abs() <= bound + (pages.float().abs() + bound) * 2 ** -8).all())
    with pytest.raises(ValueError, match="even head_dim"):
        compress_pages(torch.zeros(2, 1, 4, 3))


def test_a_batch_compresses_page_by_page_and_stacks_back():
    from deepseek_flash.kv.prune.compress import stack_compressed

    torch.manual_seed(1)
    pages = torch.randn(4, 1, 2, 2, 16, 8)
    batch = compress_pages(pages)
    one = [compress_pages(pages[i]) for i in range(4)]
    for i in range(4):
        page = batch.select(i)
        assert page.shape == one[i].shape == (1, 2, 2, 16, 8)
        for name in ("k_codes", "v_codes", "k_lo", "k_step", "v_lo", "v_step"):
            assert torch.equal(getattr(page, name), getattr(one[i], name))
        assert page.nbytes == one[i].nbytes == compressed_bytes(2, 16, 8)
        assert page.k_codes.untyped_storage().nbytes() == page.k_codes.numel()  # its own copy
    assert torch.equal(decompress_pages(stack_compressed(one)), decompress_pages(batch))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_decompress_straight_into_the_attention_layout_bit_for_bit(dtype):
    """Level 3's recall: rows of int4 pages decompressed straight into the keys-and-values
    layout (any strides) give exactly what decompress_pages gives, in either row order, and from
    rows at an odd byte offset (the fp16 groups then copied once to align)."""
    from deepseek_flash.kv.prune.compress import decompress_rows_into, like_page, rows_of

    gen = torch.Generator().manual_seed(3)
    n, b, h, p, d = 3, 2, 2, 8, 16
    pages = (torch.randn(n, b, 2, h, p, d, generator=gen) * 4).to(dtype)
    c = compress_pages(pages)
    want = decompress_pages(c)                                  # [n, b, 2, h, p, d]
    rows = rows_of(c)                                           # page-major: [n * b, bytes]
    like = like_page(h, p, d, dtype)
    out = torch.empty((2, b, h, n, p, d))
    decompress_rows_into(rows, like, (n, b), out.permute(3, 1, 0, 2, 4, 5))
    assert torch.equal(out.to(dtype), want.permute(2, 1, 3, 0, 4, 5))
    seq = rows.view(n, b, -1).transpose(0, 1).reshape(n * b, -1)  # sequence-major
    out2 = torch.empty((2, b, h, n, p, d))
    decompress_rows_into(seq, like, (b, n), out2.permute(1, 3, 0, 2, 4, 5))
    assert torch.equal(out2, out)
    shifted = torch.empty(rows.numel() + 1, dtype=torch.uint8)[1:].view_as(rows)
    shifted.copy_(rows)
    assert shifted.storage_offset() % 2 == 1
    out3 = torch.empty((2, b, h, n, p, d))
    decompress_rows_into(shifted, like, (n, b), out3.permute(3, 1, 0, 2, 4, 5))
    assert torch.equal(out3, out)
