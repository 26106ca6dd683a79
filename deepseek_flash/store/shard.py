"""Tensor-parallel shards of a store: the rules (Megatron's) and the derived store of one rank.

A tensor-parallel world of ``W`` processes runs every decoder layer on all of them at once, each
with ``1/W`` of every linear weight:

* *column* split (``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``): rank ``r``
  keeps output rows ``[r*n/W, (r+1)*n/W)`` of the ``[out, in]`` weight (whole attention heads,
  whole key/value heads: heads and key/value heads must divide by ``W``) and of the bias. In the
  stored row-major bytes that is **one contiguous byte range** of the tensor;
* *row* split (``o_proj``, ``down_proj``): rank ``r`` keeps input columns ``[r*n/W, (r+1)*n/W)``,
  i.e. ``out`` strided pieces of ``n/W`` elements -- gathered into a contiguous tensor (a strided
  read). Each rank's output is a partial sum that the ranks add up (``all_reduce``); a bias is
  kept by rank 0 and zero on the others, so it is added once;
* everything else (embeddings, norms, ``lm_head``) is replicated: each rank computes the full
  logits, identical on every rank, with no gather at the end. Vocabulary-parallel embeddings and
  head would save their memory too; they are not done.

``derive`` writes one rank's shard as a store of its own (through ``pack``: crash-safe, crc32c
per block, the usual block layout), so the daemon serves it like any other model -- host tier,
GPU arenas, CUDA IPC views, streaming under a budget -- and a process of the world acquires only
its shard: ``1/W`` of the linear weights. The source store is read block by block; nothing holds
more than one block and its slices in memory.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

from ..errors import ShardError

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
_ST_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_DTYPE_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
_AUX = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
        "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
        "chat_template.jinja")


def split_of(name: str) -> str | None:
    """``"column"``, ``"row"`` or None (replicated) for an HF parameter name."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-1] in ("weight", "bias"):
        if parts[-2] in COLUMN:
            return "column"
        if parts[-2] in ROW:
            return "row"
    return None


def check_world(config: dict, world: int, rank: int | None = None, quantized: bool = False,
                model: str = "model") -> None:
    """ShardError unless a model of ``config`` splits into ``world`` ranks."""
    if world < 1 or (rank is not None and not 0 <= rank < world):
        raise ShardError(f"{model}: rank {rank} is outside a tensor-parallel world of {world}",
                         world=world, rank=rank, dimension="rank")
    if quantized:
        raise ShardError(f"{model}: tensor-parallel shards of a quantized store are not "
                         f"implemented; pack the model without --quantize", world=world,
                         dimension="quantization")
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = int(config.get(key, config.get("num_attention_heads", 0)))
        if value % world:
            raise ShardError(f"{model}: {key} = {value} does not divide by the tensor-parallel "
                             f"world size {world}", world=world, dimension=key, value=value)


def shard_tensor(name: str, tensor, rank: int, world: int):
    """Rank ``rank``'s part of parameter ``name`` (a torch tensor), contiguous."""
    kind = split_of(name)
    if kind is None:
        return tensor
    if kind == "column":
        rows = tensor.shape[0] // world
        return tensor[rank * rows:(rank + 1) * rows].contiguous()
    if tensor.dim() == 1:              # a row-split layer's bias: added once, by rank 0
        return tensor.clone() if rank == 0 else tensor.new_zeros(tensor.shape)
    cols = tensor.shape[1] // world
    return tensor[:, rank * cols:(rank + 1) * cols].contiguous()


def shard_shape(name: str, shape, world: int) -> list[int]:
    """The shape of one rank's part of parameter ``name`` (``shape``: the whole tensor's)."""
    shape = list(shape)
    kind = split_of(name)
    if kind == "column":
        shape[0] //= world
    elif kind == "row" and len(shape) == 2:
        shape[1] //= world
    return shape


def derive(store, rank: int, world: int, out: Path, work: Path | None = None) -> Path:
    """Write rank ``rank``'s shard of ``store`` (a ``Store``) as a packed store at ``out``.

    The shard is first written as one safetensors file in a temporary source directory beside
    ``out`` (with the model's config, marked ``flash_tensor_parallel``, and its tokenizer files):
    the header from the metadata alone, then the tensors block by block, so no more than one
    block is in memory. ``pack`` turns it into the store, renamed into place in one step: a crash
    leaves no half shard. Returns ``out``."""
    import torch

    from .pack import pack
    from .views import block_tensors

    check_world(store.config, world, rank, quantized=store.quant is not None, model=store.name)
    out = Path(out)
    work = Path(work) if work is not None else out.parent / f".{out.name}.src-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        config = dict(store.config)
        config["flash_tensor_parallel"] = {"rank": rank, "world": world, "source": store.name}
        (work / "config.json").write_text(json.dumps(config, indent=2))
        for aux in _AUX:
            if (store.path / aux).exists():
                shutil.copyfile(store.path / aux, work / aux)
        # Tied aliases (lm_head of tied embeddings) are not tensors of their own: pack makes
        # the alias again from the config.
        header, offset = {}, 0
        for block in store.blocks:
            for t in block.tensors:
                shape = shard_shape(t.name, t.shape, world)
                n = _DTYPE_SIZE[t.dtype]
                for d in shape:
                    n *= d
                header[t.name] = {"dtype": _ST_DTYPE[t.dtype], "shape": shape,
                                  "data_offsets": [offset, offset + n]}
                offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(work / "model.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for block in store.blocks:
                payload = torch.frombuffer(bytearray(store.read_block(block.id)), dtype=torch.uint8)
                views = block_tensors(block, payload)
                for t in block.tensors:
                    part = shard_tensor(t.name, views[t.name], rank, world)
                    f.write(part.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
        return pack(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
