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
