"""quant.codec: the on-disk bytes of int8/int4 weights and scales, dequantization, scale search."""
from __future__ import annotations

import pytest
import torch

from deepseek_flash.quant import QuantSpec, dequantize, pack_int4, quantize, unpack_int4
from deepseek_flash.quant.codec import search_scales

INT4 = QuantSpec("int4_symmetric", "per_block", 32)


def test_int4_nibbles_low_is_even_column_stored_plus_8():
    codes = torch.tensor([[-8, 7, 0, -1], [3, -3, 5, -6]], dtype=torch.int8)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [[0x00 | 0xF0, 0x08 | 0x70], [0x0B | 0x50, 0x0D | 0x20]]
    assert torch.equal(unpack_int4(packed), codes)


def test_dequantize_is_code_times_group_scale_rounded_once():
    spec = QuantSpec("int4_symmetric", "per_block", 32)
    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(2, 4)          # [2, 64]
    scales = torch.tensor([[0.5, -0.25], [2.0, 1.0]], dtype=torch.float16)
    w = dequantize(pack_int4(codes), scales, spec, (2, 64), torch.float32)
    expect = codes.float().view(2, 2, 32) * scales.float().unsqueeze(-1)
    assert torch.equal(w, expect.view(2, 64))
    assert dequantize(pack_int4(codes), scales, spec, (2, 64), torch.bfloat16).dtype == torch.bfloat16


def test_int8_per_tensor_layout():
    spec = QuantSpec("int8_symmetric", "per_tensor")
    assert spec.group_size == 0 and spec.scales_shape((4, 8)) == (1,)
    w = torch.linspace(-1, 1, 32).view(4, 8)
    qt = quantize(w, spec)
    assert qt.data.dtype == torch.int8 and qt.data.shape == (4, 8)
    assert qt.scales.dtype == torch.float16 and qt.scales.shape == (1,)
    assert (qt.dequantize() - w).abs().max() <= qt.scales.float().abs().item() / 2 + 1e-6


@pytest.mark.parametrize("spec", [QuantSpec("int4_symmetric", "per_block", g) for g in (32, 64, 128)] +
                         [QuantSpec("int8_symmetric", "per_block", 128),
                          QuantSpec("int4_symmetric", "per_tensor")], ids=lambda s: s.label())
def test_search_never_worse_than_round_to_nearest(spec):
    torch.manual_seed(0)
    w = torch.randn(64, 256) * torch.rand(64, 1) + torch.randn(64, 256).pow(7) * 0.01   # outliers
    searched, rtn = quantize(w, spec), quantize(w, spec, search=False)
    assert searched.data.shape == (64, 256 * spec.bits // 8)
    assert searched.scales.shape == spec.scales_shape((64, 256))
    e_search = (searched.dequantize() - w).square()
    e_rtn = (rtn.dequantize() - w).square()
    if spec.granularity == "per_block":
        per_group = lambda e: e.view(64, -1, spec.group_size).sum(-1)   # noqa: E731
        assert bool((per_group(e_search) <= per_group(e_rtn) + 1e-12).all())
    assert e_search.sum() < e_rtn.sum() * (0.9 if spec.bits == 4 else 1.0)
    assert torch.equal(quantize(w, spec).data, searched.data)          # deterministic
    assert torch.equal(quantize(w, spec).scales, searched.scales)


def test_extreme_positive_group_takes_code_minus_8_with_a_negative_scale():
    x = torch.tensor([[8.0, -7.0, 6.0, 5.0] + [0.0] * 28])
    s = search_scales(x, INT4)
    assert s.item() == -1.0          # 8 -> -8 x -1 exactly; every value representable
    qt = quantize(x, INT4)
    assert torch.equal(qt.dequantize(), x)


def test_zero_group_and_all_zero_tensor():
    w = torch.zeros(2, 64)
    for spec in (INT4, QuantSpec("int8_symmetric", "per_tensor")):
        qt = quantize(w, spec)
        assert torch.equal(qt.dequantize(), w)
        assert bool((qt.scales.float() != 0).all())


def test_shape_errors_name_the_tensor():
    with pytest.raises(ValueError, match="w.q: 100 input columns are not a multiple of the group size 32"):
        quantize(torch.zeros(4, 100), INT4, "w.q")
    with pytest.raises(ValueError, match="odd"):
        quantize(torch.zeros(4, 7), QuantSpec("int4_symmetric", "per_tensor"), "w.k")
    with pytest.raises(ValueError, match="only 2-D"):
        quantize(torch.zeros(8), INT4, "w.n")
    with pytest.raises(ValueError, match="group size 48"):
        QuantSpec("int4_symmetric", "per_block", 48)
    with pytest.raises(ValueError, match="scheme 'fp8'"):
        QuantSpec("fp8")
