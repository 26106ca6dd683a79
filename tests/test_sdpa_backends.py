"""deepseek_flash.cuda.sdpa_backends: the one place serve, kv and decode take their attention
kernels from on a CUDA device -- every SDPA kernel but cuDNN's -- and a no-op elsewhere."""
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
