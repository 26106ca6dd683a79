"""store.shard: Megatron's split rules, exact bytes, and the derived store of one rank."""
from __future__ import annotations

import json

import pytest
import torch

from deepseek_flash.errors import ShardError
from deepseek_flash.store import Store, pack
from deepseek_flash.store.shard import check_world, derive, shard_shape, shard_tensor, split_of
from deepseek_flash.testing import make_tiny_model


@pytest.mark.parametrize("name,kind", [
    ("model.layers.3.self_attn.q_proj.weight", "column"), ("model.layers.0.self_attn.v_proj.bias", "column"),
    ("model.layers.1.mlp.gate_proj.weight", "column"), ("model.layers.1.mlp.up_proj.weight", "column"),
    ("model.layers.2.self_attn.o_proj.weight", "row"), ("model.layers.2.mlp.down_proj.weight", "row"),
    ("model.embed_tokens.weight", None), ("lm_head.weight", None), ("model.norm.weight", None),
    ("model.layers.0.input_layernorm.weight", None),
])
def test_split_rules(name, kind):
    assert split_of(name) == kind


def test_shards_put_back_together_are_the_tensor_bit_for_bit():
    w = torch.randn(8, 12)
    cols = [shard_tensor("x.q_proj.weight", w, r, 4) for r in range(4)]
    assert all(c.shape == (2, 12) and c.is_contiguous() for c in cols)
    assert torch.equal(torch.cat(cols, 0), w)
    # A column shard is one byte range of the stored rows.
    flat = w.view(-1)
    assert torch.equal(cols[1].view(-1), flat[2 * 12:4 * 12])
    rows = [shard_tensor("x.down_proj.weight", w, r, 3) for r in range(3)]
    assert all(r.shape == (8, 4) and r.is_contiguous() for r in rows)
    assert torch.equal(torch.cat(rows, 1), w)
    assert shard_shape("x.down_proj.weight", (8, 12), 3) == [8, 4]
    # A row-split layer's bias is added once: rank 0 keeps it, the others hold zeros.
    b = torch.randn(8)
    assert torch.equal(shard_tensor("x.o_proj.bias", b, 0, 2), b)
    assert torch.equal(shard_tensor("x.o_proj.bias", b, 1, 2), torch.zeros(8))
    assert shard_tensor("model.norm.weight", b, 1, 2) is b


@pytest.mark.parametrize("config,world,rank,dimension", [
    ({"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}, 4, 0,
     "num_key_value_heads"),
    ({"num_attention_heads": 6, "num_key_value_heads": 6, "intermediate_size": 128}, 4, 0,
     "num_attention_heads"),
    ({"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 100}, 8, 0,
     "num_attention_heads"),
    ({"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 129}, 2, 0,
     "intermediate_size"),
    ({"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}, 2, 2, "rank"),
])
def test_worlds_a_model_cannot_take_are_named(config, world, rank, dimension):
    with pytest.raises(ShardError) as exc:
        check_world(config, world, rank, model="m")
    assert exc.value.code == 902 and exc.value.dimension == dimension
    assert dimension in str(exc.value) or "rank" in str(exc.value)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_derived_store_holds_exactly_the_rank_slices(tmp_path, arch):
    src = make_tiny_model(tmp_path / "src", arch, dtype="bfloat16", num_layers=2, seed=3)
    store = Store.open(pack(src, tmp_path / "full"))
    shards = [Store.open(derive(store, r, 2, tmp_path / f"tp{r}")) for r in range(2)]
    for shard in shards:
        assert json.loads((shard.path / "config.json").read_text())["flash_tensor_parallel"]["world"] == 2
        assert [b.role for b in shard.blocks] == [b.role for b in store.blocks]
    names = [t.name for b in store.blocks for t in b.tensors]
    for name in names:
        whole = store.tensor(name)
        parts = [s.tensor(name) for s in shards]
        kind = split_of(name)
        if kind == "column":
            assert torch.equal(torch.cat(parts, 0), whole), name
        elif kind == "row" and whole.dim() == 2:
            assert torch.equal(torch.cat(parts, 1), whole), name
        else:
            assert all(torch.equal(p, whole) for p in parts), name
    # Tied embeddings stay tied: lm_head is served by the embedding block's bytes.
    if arch == "qwen2":
        assert "lm_head.weight" in shards[0].blocks[0].names
    # The temporary source directory is gone.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "src", "tp0", "tp1"]
