"""decode.flash: the maskless decode attention -- on the CPU exactly the step's mask + sdpa; its
Triton kernels compile for sm_90, agree with that in Triton's interpreter (``kernels._self_check``,
tests/decode/test_decode_kernels.py) and on CUDA, and follow the slot inside one captured graph."""
import pytest
import torch

from deepseek_flash.decode import flash, kernels
from deepseek_flash.decode.fused import _additive
from deepseek_flash.decode.step import decode_allowed


@pytest.mark.parametrize("window", [0, 4])
def test_cpu_path_is_the_steps_mask_then_sdpa_bit_for_bit(window):
    torch.manual_seed(4)
    b, kvh, group, d, cap, visible = 3, 2, 4, 16, 24, 16
    q = torch.randn(b, kvh, group, d)
    k_cache, v_cache = torch.randn(b, kvh, cap, d), torch.randn(b, kvh, cap, d)
    valid_from, slot = torch.tensor([0, 2, 9]), torch.tensor([11])
    mask = _additive(decode_allowed(slot, visible, valid_from, torch.arange(cap), window or None), q.dtype)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k_cache[:, :, :visible], v_cache[:, :, :visible], attn_mask=mask, scale=0.3)
    got = flash.decode_attention(q, k_cache, v_cache, valid_from, slot, visible, window, 0.3)
    assert torch.equal(got, want)
    # a key the row may not see changes nothing; one it may see changes its output
    k_cache[2, :, 8] += 5.0
    k_cache[1, :, 12] += 5.0
    assert torch.equal(flash.decode_attention(q, k_cache, v_cache, valid_from, slot, visible, window, 0.3), want)
    k_cache[0, :, 11] += 5.0
    again = flash.decode_attention(q, k_cache, v_cache, valid_from, slot, visible, window, 0.3)
    assert not torch.equal(again[0], want[0]) and torch.equal(again[1:], want[1:])


def test_fits_names_what_the_kernel_does_not_take():
    q = torch.randn(1, 2, 4, 48)
    assert flash.fits(q, q, q) == "head size 48"
    q = torch.randn(1, 2, 4, 64)
    assert flash.fits(q, q, q) is None
    assert flash.fits(q, q.transpose(-1, -2), q) == "a head dimension that is not contiguous"


def test_flash_kernels_compile_for_the_h200():
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_(fn, sig, constexprs):
        sig = dict(sig, **{n: "constexpr" for n in constexprs})
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": flash.WARPS})
        assert ".entry" in kernel.asm["ptx"]

    ints = {n: "i32" for n in ("L", "KVH", "SPLITS", "WINDOW", "q_sb", "q_sh", "q_sg", "k_sb", "k_sh",
                               "k_sl", "v_sb", "v_sh", "v_sl")}
    for dtype, group, d in (("bf16", 4, 128), ("bf16", 7, 128), ("fp32", 2, 16)):
        g_pad = triton.next_power_of_2(group)
        split = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "valid_ptr": "*i64",
                 "slot_ptr": "*i64", "part_ptr": "*fp32", "ml_ptr": "*fp32", **ints, "scale": "fp32"}
        compile_(flash._flash_split_kernel, split,
                 {"G": group, "G_PAD": g_pad, "CHUNK": flash.CHUNK, "BLOCK": flash.BLOCK, "D": d})
        compile_(flash._flash_split_dot_kernel, split,
                 {"G": group, "G_PAD": max(16, g_pad), "CHUNK": 64, "BLOCK": 64, "D": d, "IEEE": dtype == "fp32"})
        for one in (True, False):
            compile_(flash._flash_combine_kernel,
                     {"part_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": f"*{dtype}",
                      **{n: "i32" for n in ("KVH", "SPLITS", "out_sb", "out_sh", "out_sg")}},
                     {"G": group, "G_PAD": g_pad, "S_BLOCK": flash.COMBINE_BLOCK, "D": d, "ONE": one})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 8])
def test_flash_kernel_on_cuda_at_the_8b_heads_and_inside_one_graph(batch):
    """bf16, 32 heads over 8: within a bf16 step of the reference for slots across a 512-key
    window (padding, a sliding window); one captured graph replayed as the slot advances gives
    what the eager call gives at each slot."""
    assert kernels.triton is not None
    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(5)
    q = torch.randn(batch, 8, 4, 128, generator=gen).to(dev, torch.bfloat16)
    k_cache = torch.randn(batch, 8, 600, 128, generator=gen).to(dev, torch.bfloat16)
    v_cache = torch.randn(batch, 8, 600, 128, generator=gen).to(dev, torch.bfloat16)
    valid_from = torch.arange(batch, device=dev) * 7
    scale = 128 ** -0.5
    for slot, window in ((130, 0), (300, 0), (511, 0), (400, 100)):
        s = torch.tensor([slot], device=dev)
        want = flash._ref_decode_attention(q, k_cache, v_cache, valid_from, s, 512, window, scale)
        for kernel, chunk, block in (("sum", 32, 16), ("dot", 64, 64), ("dot", None, None)):
            got = flash._tri_decode_attention(q, k_cache, v_cache, valid_from, s, 512, window, scale, chunk,
                                              block, None, kernel)
            assert (got.float() - want.float()).abs().max().item() <= 2 ** -6, (slot, window, kernel)
    slot = torch.tensor([200], device=dev)
    out = torch.empty_like(q)
    call = lambda: out.copy_(flash._tri_decode_attention(q, k_cache, v_cache, valid_from, slot, 512, 0, scale))  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for at in (200, 201, 350, 511):
        slot.fill_(at)
        graph.replay()
        torch.cuda.synchronize()
        eager = flash._tri_decode_attention(q, k_cache, v_cache, valid_from, slot, 512, 0, scale)
        assert torch.equal(out, eager), at
