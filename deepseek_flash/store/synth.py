"""Random Llama-shaped safetensors checkpoints of any size, fast (numpy bytes, no transformers init).

For benchmarks and for tests that need a checkpoint big enough to take real time to pack; the
bytes are random, so the model computes nothing useful, but every byte is distinct from its
neighbours, which is what a storage test wants.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_ST_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4}


# The architectures the synthetic writer can make: Llama's tensor layout, plus (qwen2) biases on
# the q/k/v projections; the config names the class transformers builds.
ARCHS = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                "rms_norm_eps": 1e-5, "sliding_window": None, "rope_theta": 1e6},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rms_norm_eps": 1e-6,
              "rope_theta": 1e6, "use_sliding_window": False},
}


def llama_shapes(hidden: int, layers: int, intermediate: int, vocab: int, kv_heads: int,
                 heads: int, tied: bool, arch: str = "llama") -> dict:
    kv = hidden // heads * kv_heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        if arch == "qwen2":
            shapes.update({p + "self_attn.q_proj.bias": (hidden,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (intermediate, hidden), p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate)})
    shapes["model.norm.weight"] = (hidden,)
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def write_random_llama(path, *, hidden: int = 2048, layers: int = 16, intermediate: int = 5632,
                       vocab: int = 32000, heads: int = 16, kv_heads: int = 4, dtype: str = "bfloat16",
                       tied: bool = False, shard_bytes: int = 1 << 30, seed: int = 0,
                       arch: str = "llama", transform=None) -> Path:
    """Write config.json and ``*.safetensors`` shards (+ index when sharded) to ``path``;
    ``arch``: one of ``ARCHS`` (llama, mistral, qwen2). ``transform``: called on each tensor's
    random bytes (a writable uint8 array) before they are written, to change them in place."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shapes = llama_shapes(hidden, layers, intermediate, vocab, kv_heads, heads, tied, arch)
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * _SIZES[dtype]
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map = {}
    for i, names in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name in names:
            nbytes = int(np.prod(shapes[name])) * _SIZES[dtype]
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shapes[name]),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(path / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name in names:
                n = int(np.prod(shapes[name])) * _SIZES[dtype]
                # Raw generator output: ~8x faster than integers(), which matters for an 8B model.
                words = rng.bit_generator.random_raw((n + 7) // 8)
                data = words.view(np.uint8)[:n]
                if transform is not None:
                    transform(data)
                f.write(memoryview(data))
    if len(shards) > 1:
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(int(np.prod(s)) * _SIZES[dtype] for s in shapes.values())},
             "weight_map": weight_map}))
    config = {**ARCHS[arch], "hidden_size": hidden,
              "num_hidden_layers": layers, "intermediate_size": intermediate, "vocab_size": vocab,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "tie_word_embeddings": tied, "torch_dtype": dtype,
              "max_position_embeddings": 4096}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
