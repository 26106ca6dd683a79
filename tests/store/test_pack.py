"""pack: bit-exact round trips, layout, every bad input, crash safety, disk full."""
from __future__ import annotations

import errno
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import MODEL_CASES, case_id, reference_tensors

from deepseek_flash import errors
from deepseek_flash.store import Store, pack
from deepseek_flash.store.format import BLOCK_ALIGN, DATA_FILE, METADATA_FILE, TENSOR_ALIGN
from deepseek_flash.store.synth import write_random_llama


@pytest.mark.parametrize("case", MODEL_CASES, ids=case_id)
def test_round_trip_every_tensor_bit_exact(case, model_factory, tmp_path):
    arch, dtype, sharded = case
    src = model_factory(arch, dtype, sharded)
    assert (src / "model.safetensors.index.json").exists() == sharded
    store = Store.open(pack(src, tmp_path / "out"))
    ref = reference_tensors(src)
    served = {n for b in store.blocks for n in b.names}
    assert set(ref) <= served
    for name, tensor in ref.items():
        got = store.tensor(name)
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got, tensor), name
    if "lm_head.weight" not in ref:  # tied: served as the embedding's alias
        assert torch.equal(store.tensor("lm_head.weight"), ref["model.embed_tokens.weight"])


def test_layout_forward_order_alignment_and_deps(model_factory, tmp_path):
    store = Store.open(pack(model_factory("llama", "float32", True), tmp_path / "out"))
    roles = [(b.role, b.layer) for b in store.blocks]
    expected = [("embed", -1)]
    for layer in range(2):
        expected += [(r, layer) for r in ("norms", "attn", "mlp_gate_up", "mlp_down")]
    expected += [("final_norm", -1), ("lm_head", -1)]
    assert roles == expected
    assert [b.id for b in store.blocks] == list(range(len(expected)))
    offsets = [b.offset for b in store.blocks]
    assert offsets == sorted(offsets)
    for b in store.blocks:
        assert b.offset % BLOCK_ALIGN == 0 and b.header_offset % BLOCK_ALIGN == 0
        assert b.header_offset + b.header_size == b.offset
        assert all(t.offset % TENSOR_ALIGN == 0 for t in b.tensors)
        assert b.hot == (b.role in ("embed", "norms", "final_norm"))
        assert b.quant is None and b.access_freq == 0
    attn = store.blocks[2]
    assert [t.name.split(".", 3)[3] for t in attn.tensors] == [
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight"]
    gate_up = store.blocks[3]
    assert [t.name.rsplit(".", 2)[1] for t in gate_up.tensors] == ["gate_proj", "up_proj"]
    assert store.blocks[1].deps == [2, 3, 4]
    assert store.blocks[-1].deps == [store.blocks[-2].id]
    assert store.blocks[0].precision_req == "exact" and attn.precision_req == "quantizable"
    assert store.num_layers == 2
    for b in store.blocks:
        assert b.length == b.tensors[-1].offset + b.tensors[-1].nbytes
    assert store.total_bytes == sum(b.length for b in store.blocks)


def test_qwen2_biases_and_tied_alias(model_factory, tmp_path):
    store = Store.open(pack(model_factory("qwen2", "bfloat16", False), tmp_path / "out"))
    assert [b.role for b in store.blocks][-1] == "final_norm"   # no separate lm_head block
    embed, tensor = store.find("lm_head.weight")
    assert embed.role == "embed" and tensor.name == "model.embed_tokens.weight"
    assert tensor.aliases == ["lm_head.weight"]
    names = [t.name for t in store.blocks[2].tensors]
    assert "model.layers.0.self_attn.q_proj.bias" in names
    assert names.index("model.layers.0.self_attn.q_proj.bias") == names.index(
        "model.layers.0.self_attn.q_proj.weight") + 1


def test_untied_identical_lm_head_becomes_alias(llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    index = json.loads((llama_dir / "model.safetensors.index.json").read_text())["weight_map"]
    head_shard = llama_dir / index["lm_head.weight"]
    embed = load_file(llama_dir / index["model.embed_tokens.weight"])["model.embed_tokens.weight"]
    tensors = load_file(head_shard)
    tensors["lm_head.weight"] = embed.clone()
    save_file(tensors, head_shard, metadata={"format": "pt"})
    store = Store.open(pack(llama_dir, tmp_path / "out"))
    assert "lm_head" not in [b.role for b in store.blocks]
    assert torch.equal(store.tensor("lm_head.weight"), embed)


def test_copies_config_and_tokenizer_files(llama_dir, tmp_path):
    (llama_dir / "tokenizer.json").write_text('{"t": 1}')
    (llama_dir / "special_tokens_map.json").write_text("{}")
    (llama_dir / "notes.txt").write_text("not copied")
    out = pack(llama_dir, tmp_path / "out")
    names = {p.name for p in out.iterdir()}
    assert names == {DATA_FILE, METADATA_FILE, "config.json", "generation_config.json",
                     "tokenizer.json", "special_tokens_map.json"}
    assert (out / "tokenizer.json").read_text() == '{"t": 1}'
    assert Store.open(out).config == json.loads((llama_dir / "config.json").read_text())


def test_pack_is_deterministic(llama_dir, tmp_path):
    a, b = pack(llama_dir, tmp_path / "a"), pack(llama_dir, tmp_path / "b")
    for name in (DATA_FILE, METADATA_FILE):
        assert (a / name).read_bytes() == (b / name).read_bytes()


# --- bad input: exact class and code, nothing left behind ----------------------------------------
def _assert_nothing_left(out: Path):
    assert not out.exists()
    assert not list(out.parent.glob(out.name + ".tmp-*"))


def _raises(cls, code, fn, *match):
    with pytest.raises(cls) as info:
        fn()
    assert type(info.value) is cls and info.value.code == code
    for m in match:
        assert m in str(info.value), (m, str(info.value))
    return info.value


def test_not_a_model_directory(tmp_path):
    out = tmp_path / "out"
    _raises(errors.NotAModelDirectory, 101, lambda: pack(tmp_path / "nope", out), "nope", "not a directory")
    (tmp_path / "empty").mkdir()
    _raises(errors.NotAModelDirectory, 101, lambda: pack(tmp_path / "empty", out), "no config.json")
    (tmp_path / "empty" / "config.json").write_text("{not json")
    _raises(errors.NotAModelDirectory, 101, lambda: pack(tmp_path / "empty", out), "config.json", "not valid JSON")
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "empty" / "pytorch_model.bin").write_bytes(b"x")
    _raises(errors.NotAModelDirectory, 101, lambda: pack(tmp_path / "empty", out),
            "no *.safetensors", "pytorch_model.bin")
    _assert_nothing_left(out)


def test_shard_missing_from_index(llama_dir, tmp_path):
    shard = sorted(llama_dir.glob("model-*.safetensors"))[1]
    shard.unlink()
    out = tmp_path / "out"
    err = _raises(errors.MissingShard, 102, lambda: pack(llama_dir, out), shard.name,
                  "model.safetensors.index.json")
    assert err.path == str(shard)
    _assert_nothing_left(out)


@pytest.mark.parametrize("damage", ["truncated_data", "truncated_header", "bad_json", "empty",
                                    "bad_offsets"])
def test_corrupt_safetensors(damage, model_factory, tmp_path):
    src = tmp_path / "m"
    shutil.copytree(model_factory("llama", "bfloat16", False), src)
    st = src / "model.safetensors"
    data = st.read_bytes()
    hlen = int.from_bytes(data[:8], "little")
    if damage == "truncated_data":
        st.write_bytes(data[:-100])
        expect = "truncated"
    elif damage == "truncated_header":
        st.write_bytes(data[:8 + hlen // 2])
        expect = "does not fit"
    elif damage == "bad_json":
        st.write_bytes(data[:8] + b"{" * hlen + data[8 + hlen:])
        expect = "not valid JSON"
    elif damage == "empty":
        st.write_bytes(b"")
        expect = "truncated"
    else:
        header = json.loads(data[8:8 + hlen])
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"][1] += 2
        raw = json.dumps(header, separators=(",", ":")).encode().ljust(hlen)
        assert len(raw) == hlen
        st.write_bytes(data[:8] + raw + data[8 + hlen:])
        expect = "spans"
    out = tmp_path / "out"
    err = _raises(errors.CorruptSafetensors, 103, lambda: pack(src, out), str(st), expect)
    assert err.path == str(st)
    _assert_nothing_left(out)


def test_unsupported_dtype_names_tensor_and_dtype(tmp_path):
    from safetensors.torch import save_file
    src = write_random_llama(tmp_path / "m", hidden=64, layers=1, intermediate=128, vocab=64,
                             heads=4, kv_heads=2)
    save_file({"model.norm.weight": torch.zeros(64, dtype=torch.float64)}, src / "extra.safetensors")
    (src / "model.safetensors").rename(src / "a.safetensors")
    out = tmp_path / "out"
    err = _raises(errors.UnsupportedModel, 104, lambda: pack(src, out), "model.norm.weight", "F64")
    assert err.dtype == "F64"
    _assert_nothing_left(out)


def test_unsupported_architecture_and_unknown_tensor(llama_dir, tmp_path):
    out = tmp_path / "out"
    cfg = json.loads((llama_dir / "config.json").read_text())
    (llama_dir / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    _raises(errors.UnsupportedModel, 104, lambda: pack(llama_dir, out), "GPT2LMHeadModel")
    (llama_dir / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    _raises(errors.UnsupportedModel, 104, lambda: pack(llama_dir, out), "model.layers.1.")
    (llama_dir / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    _raises(errors.UnsupportedModel, 104, lambda: pack(llama_dir, out), "model.layers.2.", "missing")
    _assert_nothing_left(out)


def test_out_exists_and_force(llama_dir, model_factory, tmp_path):
    out = pack(llama_dir, tmp_path / "out")
    before = (out / DATA_FILE).read_bytes()
    _raises(errors.StoreExists, 105, lambda: pack(llama_dir, out), str(out), "--force")
    assert (out / DATA_FILE).read_bytes() == before
    pack(model_factory("qwen2", "bfloat16", False), out, force=True)
    assert Store.open(out).model["architecture"] == "Qwen2ForCausalLM"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama", "out"]
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "thesis.tex").write_text("x")
    _raises(errors.StoreExists, 105, lambda: pack(llama_dir, precious, force=True), "not a deepseek-flash store")
    # Without --force the first message is already the final answer: no "use --force" hint.
    err = _raises(errors.StoreExists, 105, lambda: pack(llama_dir, precious), "not a deepseek-flash store",
                  "not even with --force")
    assert "use --force" not in str(err)
    assert (precious / "thesis.tex").read_text() == "x"


def test_missing_output_parent_is_an_io_error_naming_it(llama_dir, tmp_path):
    import errno

    out = tmp_path / "no" / "such" / "out"
    err = _raises(errors.FlashIOError, 200, lambda: pack(llama_dir, out), f"{out.parent}: the output's parent "
                  "directory does not exist (create it first: mkdir -p")
    assert err.errno == errno.ENOENT and err.path == str(out.parent)
    (tmp_path / "file").write_text("x")
    err = _raises(errors.FlashIOError, 200, lambda: pack(llama_dir, tmp_path / "file" / "out"),
                  "is not a directory")
    assert err.errno == errno.ENOTDIR
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "llama"]


def test_enospc_from_writer_is_typed_and_cleans_up(llama_dir, tmp_path, monkeypatch):
    from deepseek_flash import _core

    class FullWriter:
        def __init__(self, path, *a, **k):
            self._w = real(path)

        def __getattr__(self, name):
            return getattr(self._w, name)

        def write(self, data):
            if self._w.tell() > 8192:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self._w.write(data)

    real = _core.AlignedWriter
    monkeypatch.setattr(_core, "AlignedWriter", FullWriter)
    out = tmp_path / "out"
    err = _raises(errors.NoSpace, 110, lambda: pack(llama_dir, out), str(out), "no space")
    assert err.path == str(out)
    _assert_nothing_left(out)


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_disk_full_on_a_real_small_filesystem(llama_dir, small_tmpfs):
    out = small_tmpfs / "out"
    _raises(errors.NoSpace, 110, lambda: pack(llama_dir, out), str(out))
    assert list(small_tmpfs.iterdir()) == []


# --- crash safety --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def big_src(tmp_path_factory):
    # ~48 MiB: long enough that a SIGKILL lands in every phase of a pack.
    return write_random_llama(tmp_path_factory.mktemp("big") / "m", hidden=512, layers=8,
                              intermediate=1536, vocab=8192, heads=8, kv_heads=2,
                              dtype="bfloat16", shard_bytes=16 << 20)


def _pack_cmd(src, out, force=False):
    return [sys.executable, "-m", "deepseek_flash", "pack", str(src), str(out), "--quiet",
            *(["--force"] if force else [])]


def _kill_while_building(src, out, delay, force=False) -> bool:
    """Start a pack, wait until its temp dir exists, SIGKILL it ``delay`` s later.

    Returns whether the kill landed while the temp dir still existed (mid-build).
    """
    proc = subprocess.Popen(_pack_cmd(src, out, force))
    tmp = out.parent / f"{out.name}.tmp-{proc.pid}"
    deadline = time.monotonic() + 30
    while not tmp.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(delay)
    mid_build = tmp.exists()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return mid_build


def test_killed_pack_leaves_no_store(big_src, tmp_path):
    start = time.monotonic()
    pack(big_src, tmp_path / "timing")
    duration = time.monotonic() - start
    rng = random.Random(1234)
    mid_builds = 0
    for i in range(6):
        out = tmp_path / f"out{i}"
        mid_build = _kill_while_building(big_src, out, rng.uniform(0, duration))
        mid_builds += mid_build
        if mid_build:
            assert not out.exists()
        if out.exists():   # the kill came after the final rename: the store must be whole
            from deepseek_flash.store.verify import verify_store
            assert verify_store(Store.open(out)).ok
        # A later pack cleans the dead pack's temp dir and succeeds.
        pack(big_src, out, force=out.exists())
        assert not list(tmp_path.glob(f"out{i}.tmp-*"))
    assert mid_builds >= 2, "the kills should land while the store is being built"


def test_killed_forced_repack_leaves_old_store_untouched(big_src, model_factory, tmp_path):
    from deepseek_flash.store.verify import verify_store
    old_src = model_factory("llama", "bfloat16", False)
    out = tmp_path / "out"
    pack(old_src, out)
    old_bytes = {p.name: p.read_bytes() for p in out.iterdir()}
    start = time.monotonic()
    pack(big_src, tmp_path / "timing")
    duration = time.monotonic() - start
    rng = random.Random(99)
    for _ in range(4):
        _kill_while_building(big_src, out, rng.uniform(0, duration), force=True)
        now = {p.name: p.read_bytes() for p in out.iterdir()}
        if now != old_bytes:   # killed after the atomic exchange: the new store is whole
            assert verify_store(Store.open(out)).ok
            assert Store.open(out).num_layers == 8
            return
    assert Store.open(out).num_layers == 2


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_synthetic_checkpoint_of_each_arch_loads_every_weight(tmp_path, arch):
    """The benches' random checkpoints (``--arch``): transformers finds every weight it expects
    (qwen2: the q/k/v biases) and nothing else."""
    import transformers

    src = write_random_llama(tmp_path / "m", hidden=64, layers=2, intermediate=128, vocab=96,
                             heads=4, kv_heads=2, dtype="float32", arch=arch)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(src, output_loading_info=True)
    assert type(model).__name__ == {"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}[arch]
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert (arch == "qwen2") == ("model.layers.0.self_attn.q_proj.bias" in model.state_dict())
