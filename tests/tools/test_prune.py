"""prune: the right tensors listed, a pruned copy with identical logits, SRC never touched, bad inputs."""
from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from deepseek_flash.client.skeleton import bind_parameters, build_skeleton

from deepseek_flash import cli
from deepseek_flash.errors import NotAModelDirectory, NotAStore, StoreExists
from deepseek_flash.store import Store, pack
from deepseek_flash.store.format import crc32c, encode_block_header, encode_metadata
from deepseek_flash.store.repair import write_metadata_atomic
from deepseek_flash.store.verify import verify_store
from deepseek_flash.store.views import block_tensors
from deepseek_flash.testing import make_tiny_model


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A Qwen2 store with zero biases, duplicated weights and an untied lm_head equal to the embedding."""
    import safetensors.torch as st

    base = tmp_path_factory.mktemp("prune")
    hf = make_tiny_model(base / "hf", "qwen2", tie_word_embeddings=False, hidden_size=64,
                         num_layers=2, intermediate_size=128, num_heads=4, num_kv_heads=2,
                         vocab_size=256)
    f = hf / "model.safetensors"
    sd = st.load_file(f)
    for n in ("q", "k", "v"):
        sd[f"model.layers.0.self_attn.{n}_proj.bias"].zero_()
    sd["model.layers.1.self_attn.k_proj.bias"].zero_()
    sd["model.layers.1.mlp.up_proj.weight"] = sd["model.layers.1.mlp.gate_proj.weight"].clone()
    sd["model.layers.1.mlp.down_proj.weight"] = sd["model.layers.0.mlp.down_proj.weight"].clone()
    # pack aliases an lm_head equal to the embedding itself; store a different one, then make its
    # stored bytes equal (a store packed by an older packer, or edited in place).
    lm = sd["model.embed_tokens.weight"].clone()
    lm[0, 0] += 1
    sd["lm_head.weight"] = lm
    st.save_file(sd, f, metadata={"format": "pt"})
    store = pack(hf, base / "store")
    s = Store.open(store)
    head, _ = s.find("lm_head.weight")
    embed, _ = s.find("model.embed_tokens.weight")
    data = s.read_block(embed.id)[:head.length]
    head.crc32c = crc32c(data)
    fd = os.open(s.data_path(head), os.O_WRONLY)
    try:
        os.pwrite(fd, data, head.offset)
        os.pwrite(fd, encode_block_header(head, len(s.blocks)), head.header_offset)
    finally:
        os.close(fd)
    write_metadata_atomic(store, encode_metadata(s.blocks, s.model))
    assert verify_store(Store.open(store)).ok
    return store


def _hashes(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def _logits(path):
    s = Store.open(path)
    model = build_skeleton(s.config)
    tensors = {}
    for b in s.blocks:
        tensors.update(block_tensors(b, bytearray(s.read_block(b.id))))
    bind_parameters(model, tensors)
    with torch.no_grad():
        return model(torch.arange(3, 40).reshape(1, -1)).logits


EXPECTED = {   # name: (kind, twin, action)
    "model.layers.0.self_attn.q_proj.bias": ("zero_bias", None, "keep"),
    "model.layers.0.self_attn.k_proj.bias": ("zero_bias", None, "keep"),
    "model.layers.0.self_attn.v_proj.bias": ("zero_bias", "model.layers.0.self_attn.k_proj.bias", "alias"),
    "model.layers.1.self_attn.k_proj.bias": ("zero_bias", "model.layers.0.self_attn.k_proj.bias", "keep"),
    "model.layers.1.mlp.up_proj.weight": ("duplicate", "model.layers.1.mlp.gate_proj.weight", "alias"),
    "model.layers.1.mlp.down_proj.weight": ("duplicate", "model.layers.0.mlp.down_proj.weight", "keep"),
    "lm_head.weight": ("duplicate", "model.embed_tokens.weight", "drop_block"),
}


def test_lists_the_right_tensors(src, capsys):
    before = _hashes(src)
    assert cli.main(["prune", str(src), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {f["name"]: (f["kind"], f["twin"], f["action"]) for f in doc["findings"]} == EXPECTED
    saved = {f["name"]: f["saved"] for f in doc["findings"]}
    # v bias: 32 fp32 = 128 B, but it frees one 256 B alignment slot; up_proj 128x64 fp32.
    assert saved["model.layers.0.self_attn.v_proj.bias"] == 256
    assert saved["model.layers.1.mlp.up_proj.weight"] == 128 * 64 * 4
    assert saved["lm_head.weight"] == 256 * 64 * 4
    assert sum(saved.values()) == doc["saved_bytes"] == 256 + 32768 + 65536
    assert doc["listed_bytes"] == 256 + 3 * 128 + 2 * 32768 + 65536
    assert doc["output"] is None
    assert _hashes(src) == before


def test_apply_keeps_logits_and_never_touches_src(src, tmp_path, capsys):
    before = _hashes(src)
    out = tmp_path / "pruned"
    assert cli.main(["prune", str(src), "--apply", str(out), "--quiet"]) == 0
    assert f"wrote the pruned copy to {out}" in capsys.readouterr().out
    assert _hashes(src) == before
    a, b = Store.open(src), Store.open(out)
    assert verify_store(b).ok
    assert len(b.blocks) == len(a.blocks) - 1 and [x.id for x in b.blocks] == list(range(len(b.blocks)))
    assert "lm_head" not in {x.role for x in b.blocks}
    assert b.total_bytes == a.total_bytes - (256 + 32768 + 65536)
    names = {n for blk in a.blocks for n in blk.names}
    assert names == {n for blk in b.blocks for n in blk.names}
    for name in names:
        assert torch.equal(a.tensor(name), b.tensor(name)), name
    assert b.find("lm_head.weight")[0].role == "embed"
    assert b.find("model.layers.0.self_attn.v_proj.bias")[1].name == "model.layers.0.self_attn.k_proj.bias"
    # deps follow the renumbered ids: every block still depends on its own layer's blocks.
    for blk in b.blocks:
        assert all(b.block(d).layer == blk.layer for d in blk.deps)
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert torch.equal(_logits(src), _logits(out))
    # The pruned store has nothing more to drop.
    assert cli.main(["prune", str(out), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["saved_bytes"] == 0


def test_bad_inputs(src, tmp_path, capsys):
    before = _hashes(src)
    assert cli.main(["prune", str(tmp_path)]) == 2
    assert "NotAStore, code 108" in capsys.readouterr().err
    assert cli.main(["prune", str(src), "--apply", str(tmp_path / "missing" / "out")]) == 2
    assert "output's parent directory does not exist" in capsys.readouterr().err
    (tmp_path / "taken").mkdir()
    assert cli.main(["prune", str(src), "--apply", str(tmp_path / "taken")]) == 2
    assert "StoreExists, code 105" in capsys.readouterr().err
    assert cli.main(["prune", str(src), "--apply", str(src)]) == 2
    assert _hashes(src) == before
    assert not list(tmp_path.glob("*.tmp-*"))

    from deepseek_flash.tools.prune import analyse, apply
    with pytest.raises(NotAStore):
        Store.open(tmp_path / "nothing")
    s = Store.open(src)
    with pytest.raises(NotAModelDirectory):
        apply(s, analyse(s), tmp_path / "a" / "b")
    with pytest.raises(StoreExists):
        apply(s, analyse(s), src)
