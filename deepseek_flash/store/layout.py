"""Which HF tensors form which block, in which order: the semantic layout of a packed model.

Pure function of the model config and the tensor catalog (names, dtypes, shapes), so it is tested
without files. Blocks follow the forward pass -- embed, then per layer norms, attn, mlp_gate_up,
mlp_down, then final_norm and lm_head -- so a cold load is one sequential sweep of the data file.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UnsupportedModel
from ..fsutil import align_up
from .format import DTYPE_SIZES, EXACT_ROLES, TENSOR_ALIGN, BlockInfo, TensorInfo

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "mistral": "MistralForCausalLM"}

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Per-layer tensor suffixes in the order they sit in their block; biases follow their weight.
_LAYER_ROLES = {
    "norms": ["input_layernorm.weight", "post_attention_layernorm.weight"],
    "attn": [f"self_attn.{p}_proj.{k}" for p in "qkvo" for k in ("weight", "bias")],
    "mlp_gate_up": [f"mlp.{p}_proj.{k}" for p in ("gate", "up") for k in ("weight", "bias")],
    "mlp_down": ["mlp.down_proj.weight", "mlp.down_proj.bias"],
}
_SUFFIX_ROLE = {s: role for role, suffixes in _LAYER_ROLES.items() for s in suffixes}
_REQUIRED = [s for s in _SUFFIX_ROLE if s.endswith(".weight")]
# Buffers some old checkpoints carry; transformers recomputes them, so the store drops them.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class TensorSpec:
    """What the layout needs to know of one source tensor."""

    name: str
    dtype: str
    shape: tuple

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def architecture(config: dict, config_path) -> str:
    """The supported architecture named by ``config`` (UnsupportedModel otherwise)."""
    archs = config.get("architectures") or []
    if not archs and config.get("model_type") in _MODEL_TYPES:
        archs = [_MODEL_TYPES[config["model_type"]]]
    if not archs:
        raise UnsupportedModel(f"{config_path}: names no architecture (no 'architectures' and no "
                               f"known 'model_type'); supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
                               path=str(config_path))
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(f"{config_path}: architecture {arch!r} is not supported; supported: "
                               f"{', '.join(SUPPORTED_ARCHITECTURES)}", path=str(config_path),
                               architecture=arch)
    return arch


def quantized_info(name: str, spec: TensorSpec, offset: int, quant) -> TensorInfo:
    """The tensor map of ``spec`` quantized with ``quant`` (a QuantSpec), codes at ``offset``."""
    try:
        quant.check_shape(spec.shape, name)
    except ValueError as exc:
        raise UnsupportedModel(f"cannot quantize: {exc}", tensor=name) from None
    nbytes = quant.data_nbytes(spec.shape)
    scales_shape = quant.scales_shape(spec.shape)
    scales_offset = align_up(offset + nbytes, TENSOR_ALIGN)
    scales_nbytes = 2
    for d in scales_shape:
        scales_nbytes *= d
    return TensorInfo(name=name, dtype=quant.storage_dtype, shape=tuple(spec.shape), offset=offset,
                      nbytes=nbytes, quant={**quant.to_dict(), "dtype": spec.dtype,
                                            "scales_dtype": "float16",
                                            "scales_shape": list(scales_shape),
                                            "scales_offset": scales_offset,
                                            "scales_nbytes": scales_nbytes})


def quantizable_tensor(role: str, name: str) -> bool:
    """Whether ``pack --quantize`` quantizes this tensor: the 2-D linear weights of attention and
    MLP blocks; never biases, norms, embeddings or lm_head (``precision_req`` exact)."""
    return role not in EXACT_ROLES and name.endswith("_proj.weight")


def plan_blocks(config: dict, specs: dict, identical, source: str, quant=None) -> list[BlockInfo]:
    """Blocks (ids, roles, layers, tensors at their payload offsets, deps) in forward order.

    ``specs`` maps HF name -> TensorSpec; ``identical(a, b)`` says whether two tensors hold the same
    bytes (used to serve an untied but equal lm_head as an alias); ``source`` names the model in
    errors; ``quant`` (a ``deepseek_flash.quant.QuantSpec`` or None) quantizes the linear weights of
    the quantizable blocks. File offsets and checksums are the packer's to fill in.
    """
    num_layers = int(config.get("num_hidden_layers", 0))
    layers: dict[int, dict[str, list[str]]] = {}
    for name in specs:
        if name in (EMBED, FINAL_NORM, LM_HEAD) or _IGNORED.match(name):
            continue
        m = _LAYER.fullmatch(name)
        role = _SUFFIX_ROLE.get(m.group(2)) if m else None
        if role is None or int(m.group(1)) >= num_layers:
            raise UnsupportedModel(f"{source}: tensor {name!r} does not belong to any block of a "
                                   f"{num_layers}-layer Llama/Qwen2/Mistral model", tensor=name)
        layers.setdefault(int(m.group(1)), {}).setdefault(role, [])
    for name in (EMBED, FINAL_NORM):
        if name not in specs:
            raise UnsupportedModel(f"{source}: required tensor {name!r} is missing", tensor=name)
    for layer in range(num_layers):
        for suffix in _REQUIRED:
            name = f"model.layers.{layer}.{suffix}"
            if name not in specs:
                raise UnsupportedModel(f"{source}: required tensor {name!r} is missing", tensor=name)

    tied = bool(config.get("tie_word_embeddings", False))
    lm_head_alias = tied or LM_HEAD not in specs or identical(EMBED, LM_HEAD)

    groups: list[tuple[str, int, list[str]]] = [("embed", -1, [EMBED])]
    for layer in range(num_layers):
        for role, suffixes in _LAYER_ROLES.items():
            names = [f"model.layers.{layer}.{s}" for s in suffixes]
            groups.append((role, layer, [n for n in names if n in specs]))
    groups.append(("final_norm", -1, [FINAL_NORM]))
    if not lm_head_alias:
        groups.append(("lm_head", -1, [LM_HEAD]))

    blocks: list[BlockInfo] = []
    for block_id, (role, layer, names) in enumerate(groups):
        tensors, offset = [], 0
        for name in names:
            spec = specs[name]
            offset = align_up(offset, TENSOR_ALIGN)
            if quant is not None and quantizable_tensor(role, name):
                info = quantized_info(name, spec, offset, quant)
            else:
                aliases = [LM_HEAD] if name == EMBED and lm_head_alias else []
                info = TensorInfo(name=name, dtype=spec.dtype, shape=tuple(spec.shape),
                                  offset=offset, nbytes=spec.nbytes, aliases=aliases)
            tensors.append(info)
            offset = info.end
        blocks.append(BlockInfo(id=block_id, role=role, layer=layer, file="", offset=0,
                                length=offset, crc32c=0, tensors=tensors,
                                precision_req="exact" if role in EXACT_ROLES else "quantizable",
                                quant=quant.to_dict() if quant is not None and any(
                                    t.quant for t in tensors) else None))
    by_layer: dict[int, list[int]] = {}
    for b in blocks:
        if b.layer >= 0:
            by_layer.setdefault(b.layer, []).append(b.id)
    final_norm_id = next(b.id for b in blocks if b.role == "final_norm")
    for b in blocks:
        if b.layer >= 0:
            b.deps = [i for i in by_layer[b.layer] if i != b.id]
        elif b.role == "lm_head":
            b.deps = [final_norm_id]
    return blocks
