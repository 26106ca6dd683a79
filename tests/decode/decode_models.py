"""Tiny random models and left-padded prompts for the decode tests (never downloaded)."""
import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda:0", marks=[pytest.mark.gpu,
                                                pytest.mark.skipif(not CUDA, reason="needs CUDA")])]


def tiny_model(arch="llama", seed=0, device="cpu", dtype=torch.float32, **config):
    import transformers

    from deepseek_flash.testing import tiny_config

    torch.manual_seed(seed)
    window = config.pop("sliding_window", None) if arch == "mistral" else None
    cfg = tiny_config(arch, **config)
    if window is not None:
        cfg.sliding_window = window
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype)
    return model.eval()


def left_padded(batch, prompt, device="cpu", seed=0, pads=(0, 3, 1, 5)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (batch, prompt), generator=g)
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, :pads[row % len(pads)]] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids.to(device), mask.to(device)
