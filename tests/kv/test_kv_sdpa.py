"""Which attention kernels the tiered attention allows: cuDNN's is left out of every call whose
key length changes from step to step (decode, a chunked prefill), through the one shared
``deepseek_flash.cuda.sdpa_backends``; a whole first prompt (one shape for every layer of the
forward) keeps the caller's choice, as a ``DynamicCache`` prefill does."""
import torch

import deepseek_flash.kv.compute as compute
from deepseek_flash.cuda import sdpa_backends
from deepseek_flash.kv import TieredCache, cache_kwargs


def test_decode_steps_leave_cudnn_out_and_the_first_prompt_keeps_the_callers_choice(
        llama, monkeypatch):
    calls = []

    def recording(device):
        calls.append(str(device))
        return sdpa_backends(device)

    monkeypatch.setattr(compute, "sdpa_backends", recording)
    layers = llama.config.num_hidden_layers
    ids = torch.randint(1, 256, (1, 300), generator=torch.Generator().manual_seed(3))
    cache = TieredCache.for_model(llama, gpu_tokens=64, page_tokens=32, top_k_pages=0.5)
    with torch.no_grad():
        out = llama(ids, **cache_kwargs(llama, cache))
        assert calls == []                        # the whole prompt: one call per layer, as is
        tok = out.logits[:, -1:].argmax(-1)
        for step in range(1, 3):
            tok = llama(tok, **cache_kwargs(llama, cache)).logits[:, -1:].argmax(-1)
            assert calls == ["cpu"] * layers * step
        llama(ids[:, :40], **cache_kwargs(llama, cache))  # more prompt after the first
    assert calls == ["cpu"] * layers * 3
