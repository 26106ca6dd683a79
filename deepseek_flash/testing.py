"""Tiny random Hugging Face models for tests, the demo and benchmarks -- never a download.

``make_tiny_model`` builds a Llama-, Qwen2- or Mistral-shaped model from a ``transformers`` config
with random weights and writes it with ``save_pretrained`` (safetensors, optionally sharded with an
index), exactly as a user's checkpoint directory looks.
"""
from __future__ import annotations

from pathlib import Path

ARCHITECTURES = ("llama", "qwen2", "mistral")


def tiny_config(arch: str = "llama", *, hidden_size: int = 64, num_layers: int = 2,
                intermediate_size: int = 128, num_heads: int = 4, num_kv_heads: int = 2,
                vocab_size: int = 256, tie_word_embeddings: bool | None = None, **extra):
    """A ``transformers`` config of the given architecture with small dimensions."""
    import transformers

    common = dict(hidden_size=hidden_size, num_hidden_layers=num_layers,
                  intermediate_size=intermediate_size, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, vocab_size=vocab_size,
                  max_position_embeddings=512, **extra)
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            tie_word_embeddings=bool(tie_word_embeddings), **common)
    elif arch == "qwen2":
        # Qwen2 carries q/k/v biases; small Qwen2 checkpoints tie the embeddings.
        cfg = transformers.Qwen2Config(
            tie_word_embeddings=True if tie_word_embeddings is None else tie_word_embeddings,
            **common)
    elif arch == "mistral":
        cfg = transformers.MistralConfig(
            tie_word_embeddings=bool(tie_word_embeddings), sliding_window=None, **common)
    else:
        raise ValueError(f"unknown architecture {arch!r}; choose from {ARCHITECTURES}")
    return cfg


def make_tiny_model(path, arch: str = "llama", *, dtype: str = "float32", seed: int = 0,
                    max_shard_size: str | int | None = None, **config_kwargs) -> Path:
    """Write a random model to ``path`` (a new directory) and return the path.

    ``max_shard_size`` splits the weights into several ``*.safetensors`` shards with a
    ``model.safetensors.index.json``, as large checkpoints are published.
    """
    import torch
    import transformers

    path = Path(path)
    cfg = tiny_config(arch, **config_kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    # Random norms and biases too, so a block mixed up with another can never compare equal.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.uniform_(0.5, 1.5)
    model = model.to(getattr(torch, dtype))
    kwargs = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def load_reference(path, dtype: str | None = None, device: str = "cpu"):
    """The same model loaded by plain ``transformers`` -- what parity tests compare against."""
    import torch
    import transformers

    kwargs = {}
    if dtype is not None:
        kwargs["dtype"] = getattr(torch, dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device)
    model.eval()
    return model


def assert_same_outputs(model, reference, ids, new_tokens: int = 4) -> None:
    """Logits equal (``torch.equal``) and greedy tokens identical -- the parity bar."""
    import torch

    mask = torch.ones_like(ids)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits), "logits differ"
    got = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    want = reference.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    assert torch.equal(got, want), f"greedy tokens differ: {got.tolist()} != {want.tolist()}"
