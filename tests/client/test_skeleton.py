"""The skeleton: parameters on meta only for the thread building it, and only while it builds."""
from __future__ import annotations

import threading

import pytest
import torch

from deepseek_flash.client.skeleton import bind_parameters, build_skeleton, meta_parameters


def test_meta_parameters_is_scoped_to_the_block_and_the_thread():
    original = torch.nn.Module.register_parameter
    inside = threading.Event()
    built = threading.Event()
    other = {}

    def elsewhere():
        inside.wait(10)
        other["linear"] = torch.nn.Linear(4, 4)
        built.set()

    thread = threading.Thread(target=elsewhere)
    thread.start()
    with meta_parameters():
        with meta_parameters():                     # nested: still meta inside
            assert torch.nn.Linear(2, 2).weight.is_meta
        ours = torch.nn.Linear(4, 4)
        inside.set()
        assert built.wait(10)
    thread.join()
    assert ours.weight.is_meta and ours.bias.is_meta
    assert not other["linear"].weight.is_meta        # another thread, same moment
    assert torch.nn.Module.register_parameter is original
    assert not torch.nn.Linear(2, 2).weight.is_meta


def test_meta_parameters_restores_after_an_error():
    original = torch.nn.Module.register_parameter
    with pytest.raises(RuntimeError, match="boom"), meta_parameters():
        raise RuntimeError("boom")
    assert torch.nn.Module.register_parameter is original


def test_skeleton_has_meta_parameters_and_real_buffers():
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2).to_dict()
    model = build_skeleton(config)
    assert all(p.is_meta for p in model.parameters())
    assert all(not b.is_meta for b in model.buffers())
    embed = torch.zeros(64, 32, dtype=torch.float32)
    with pytest.raises(KeyError, match="parameters not served"):
        bind_parameters(model, {"model.embed_tokens.weight": embed})
    assert model.model.embed_tokens.weight.data_ptr() == embed.data_ptr()   # a view, not a copy
