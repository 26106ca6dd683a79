"""Tiny random Hugging Face models for tests, the demo and benchmarks -- never a download.

``make_tiny_model`` builds a Llama-, Qwen2- or Mistral-shaped model from a ``transformers`` config
with random weights and writes it with ``save_pretrained`` (safetensors, optionally sharded with an
index), exactly as a user's checkpoint directory looks.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ARCHITECTURES = ("llama", "qwen2", "mistral")

#: The source checkout's bench scripts (tests load them as modules: a bench's own arithmetic).
BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_module(name: str):
    """bench/NAME.py of the source checkout imported as a module (``bench_NAME``), its folder on
    the path while it loads (a bench imports its siblings)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def tiny_config(arch: str = "llama", *, hidden_size: int = 64, num_layers: int = 2,
                intermediate_size: int = 128, num_heads: int = 4, num_kv_heads: int = 2,
                vocab_size: int = 256, tie_word_embeddings: bool | None = None, **extra):
    """A ``transformers`` config of the given architecture with small dimensions."""
    import transformers

    common = dict(hidden_size=hidden_size, num_hidden_layers=num_layers,
                  intermediate_size=intermediate_size, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, vocab_size=vocab_size,
                  max_position_embeddings=extra.pop("max_position_embeddings", 512), **extra)
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
    """The same model loaded by plain ``transformers`` -- what parity tests compare against --
    with the attention kernels ``load_model`` gives its models on ``device`` (on CUDA every SDPA
    kernel but cuDNN's: ``deepseek_flash.cuda.attention_without_cudnn``), so that parity is
    about the bytes, not about which kernel torch picked."""
    import torch
    import transformers

    from .cuda import attention_without_cudnn

    kwargs = {}
    if dtype is not None:
        kwargs["dtype"] = getattr(torch, dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device)
    model.eval()
    attention_without_cudnn(model, torch.device(device))
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


TINY_EOS = "<|endoftext|>"


def make_tiny_tokenizer(path, chat_template: str | None = None, eos: bool = True) -> Path:
    """A byte-level tokenizer built locally (no download) into ``path``: ids 0..255 are the bytes,
    256 is ``<|endoftext|>`` (eos; left out with ``eos=False``, e.g. so that benchmark requests
    always run to their max_tokens). Pair it with ``make_tiny_model(..., vocab_size=260,
    eos_token_id=256)``; ids the tokenizer does not know decode to nothing. Without
    ``chat_template`` the tokenizer has none."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # The byte-level alphabet in byte order, so id == byte value.
    table = {c: i for i, c in enumerate(sorted(byte_chars, key=_byte_of))}
    tok = tokenizers.Tokenizer(models.BPE(vocab=table, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    if eos:
        tok.add_special_tokens([TINY_EOS])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=TINY_EOS if eos else None)
    if chat_template is not None:
        fast.chat_template = chat_template
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    return path


def _byte_of(char: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's bytes_to_unicode inverse)."""
    code = ord(char)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
