"""deepseek_flash.cuda.sdpa_backends: the one place serve, kv and decode take their attention
kernels from on a CUDA device -- every SDPA kernel but cuDNN's -- and a no-op elsewhere."""
import pytest
import torch

from deepseek_flash.cuda import SDPA_BACKENDS, sdpa_backends


def _enabled():
    b = torch.backends.cuda
    return (b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(),
            b.math_sdp_enabled())


def test_a_cuda_device_leaves_cudnn_out_and_the_flags_come_back():
    before = _enabled()
    assert "CUDNN_ATTENTION" not in SDPA_BACKENDS
    for device in ("cuda", "cuda:0", torch.device("cuda", 0)):
        with sdpa_backends(device):
            assert _enabled() == (False, True, True, True)
        assert _enabled() == before


def test_a_cpu_device_changes_nothing():
    before = _enabled()
    for device in ("cpu", torch.device("cpu")):
        with sdpa_backends(device):
            assert _enabled() == before


def test_the_tiered_attention_and_the_serve_runner_use_it():
    import deepseek_flash.kv.compute as compute
    import deepseek_flash.serve.runner as runner

    assert compute.sdpa_backends is sdpa_backends and runner.sdpa_backends is sdpa_backends


def test_a_model_on_a_cuda_device_runs_each_forward_without_cudnn(tmp_path):
    """``attention_without_cudnn`` (what ``load_model`` does to its models on CUDA): every
    forward -- a call, each step of ``generate``, one that raises -- runs with cuDNN's attention
    left out, and the process's flags are back after it; not wrapped twice; a CPU model is
    left alone. The kernels' choice is checked where attention runs (a hook on layer 0)."""
    from deepseek_flash.cuda import attention_without_cudnn, unwrapped_forward
    from deepseek_flash.testing import load_reference, make_tiny_model

    model = load_reference(make_tiny_model(tmp_path / "m", "llama", num_layers=2))
    seen = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda m, a: seen.append(_enabled()))
    before = _enabled()
    ids = torch.tensor([[1, 2, 3]])
    assert not attention_without_cudnn(model, "cpu") and not hasattr(model.forward, "__flash_sdpa__")
    with torch.no_grad():
        want = model(ids).logits
    assert seen == [before]

    seen.clear()
    assert attention_without_cudnn(model, torch.device("cuda", 0))
    assert not attention_without_cudnn(model, "cuda:0")          # once
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)             # the same computation on a CPU
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                         min_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 6)
    assert seen == [(False, True, True, True)] * 4 and _enabled() == before
    seen.clear()
    boom = model.model.layers[1].register_forward_pre_hook(
        lambda m, a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
        model(ids)
    assert seen == [(False, True, True, True)] and _enabled() == before
    boom.remove()

    unwrapped_forward(model)
    assert not hasattr(model.forward, "__flash_sdpa__")
    with torch.no_grad():
        model(ids)
    assert seen[-1] == before


def test_the_flags_are_those_of_torchs_sdpa_kernel_and_an_outer_choice_comes_back():
    # the few-calls context (deepseek_flash.cuda._SdpaFlags) sets what torch's sdpa_kernel sets
    # for the same backends, every flag, and puts back a state the caller had changed
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def flags():
        return (*_enabled(), torch._C._get_overrideable_sdp_enabled())

    with sdpa_kernel([getattr(SDPBackend, name) for name in SDPA_BACKENDS]):
        want = flags()
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        before = flags()
        with sdpa_backends("cuda"):
            assert flags() == want
            with sdpa_backends("cuda"):  # nested: nothing to change, nothing changed after
                assert flags() == want
            assert flags() == want
        assert flags() == before and before[1] is False
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
