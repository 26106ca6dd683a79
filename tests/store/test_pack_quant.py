"""pack --quantize: the bytes of codes and scales, what stays exact, version 2, and every verb
that reads a store (verify, inspect, repair, defrag, prune) on quantized blocks."""
from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest
import torch
from conftest import reference_tensors

from deepseek_flash import errors
from deepseek_flash.quant import QuantSpec, quantize
from deepseek_flash.store import Store, pack
from deepseek_flash.store.format import DATA_FILE, METADATA_FILE, TENSOR_ALIGN
from deepseek_flash.store.repair import repair
from deepseek_flash.store.verify import verify_store
from deepseek_flash.store.views import block_tensors

INT4 = QuantSpec("int4_symmetric", "per_block", 32)
INT8_TENSOR = QuantSpec("int8_symmetric", "per_tensor")


@pytest.mark.parametrize("arch,dtype,spec", [("llama", "bfloat16", INT4),
                                             ("qwen2", "float16", INT8_TENSOR),
                                             ("mistral", "float32", QuantSpec("int4_symmetric", "per_tensor"))],
                         ids=["llama-bf16-int4-g32", "qwen2-f16-int8-tensor", "mistral-f32-int4-tensor"])
def test_quantized_bytes_are_the_codecs_and_exact_tensors_untouched(arch, dtype, spec, model_factory,
                                                                      tmp_path):
    src = model_factory(arch, dtype, False)
    store = Store.open(pack(src, tmp_path / "q", quant=spec, quant_device="cpu"))
    ref = reference_tensors(src)
    raw = (store.path / DATA_FILE).read_bytes()
    quantized = 0
    for block in store.blocks:
        payload = raw[block.offset:block.offset + block.length]
        views = block_tensors(block, bytearray(payload))
        assert (block.quant is not None) == (block.precision_req == "quantizable")
        for t in block.tensors:
            if t.name.endswith("_proj.weight"):
                quantized += 1
                expect = quantize(ref[t.name], spec, t.name)
                assert t.dtype == spec.storage_dtype and list(t.shape) == list(ref[t.name].shape)
                assert t.quant["dtype"] == dtype and t.quant["scales_offset"] % TENSOR_ALIGN == 0
                assert payload[t.offset:t.offset + t.nbytes] == expect.data.numpy().tobytes()
                scales = payload[t.quant["scales_offset"]:t.quant["scales_offset"] + t.quant["scales_nbytes"]]
                assert scales == expect.scales.numpy().astype("<f2").tobytes()
                assert torch.equal(store.tensor(t.name), expect.dequantize(getattr(torch, dtype)))
                assert torch.equal(views[t.name].dequantize(), expect.dequantize(getattr(torch, dtype)))
            else:
                assert t.quant is None and t.dtype == dtype
                assert torch.equal(store.tensor(t.name), ref[t.name]), t.name
    assert quantized == 7 * 2
    assert store.total_bytes < sum(v.numel() * v.element_size() for v in ref.values())
    assert verify_store(store).ok
    meta = (store.path / METADATA_FILE).read_bytes()
    assert struct.unpack_from("<H", meta, 8)[0] == 2
    assert struct.unpack_from("<H", raw, store.blocks[1].header_offset + 8)[0] == 1   # norms: v1
    attn = next(b for b in store.blocks if b.role == "attn")
    assert struct.unpack_from("<H", raw, attn.header_offset + 8)[0] == 2
    assert attn.quant == spec.to_dict()


def test_plain_store_stays_version_1(store_dir):
    assert struct.unpack_from("<H", (store_dir / METADATA_FILE).read_bytes(), 8)[0] == 1


def test_group_size_that_does_not_divide_is_a_typed_error(model_factory, tmp_path):
    with pytest.raises(errors.UnsupportedModel, match="not a multiple of the group size 128") as info:
        pack(model_factory("llama", "bfloat16", False), tmp_path / "q",
             quant=QuantSpec("int4_symmetric", "per_block", 128))
    assert info.value.tensor.endswith("_proj.weight")
    assert not any(tmp_path.iterdir())


def test_repair_defrag_prune_keep_quantized_blocks(model_factory, tmp_path):
    from deepseek_flash.store.format import encode_metadata
    from deepseek_flash.store.repair import write_metadata_atomic
    from deepseek_flash.tools.defrag import defrag
    from deepseek_flash.tools.prune import analyse, apply

    src = model_factory("qwen2", "bfloat16", False)
    path = pack(src, tmp_path / "q", quant=INT4, quant_device="cpu")
    before = {n: Store.open(path).tensor(n) for n in reference_tensors(src)}
    meta = (path / METADATA_FILE).read_bytes()
    (path / METADATA_FILE).unlink()
    report = repair(path)
    assert report.ok and (path / METADATA_FILE).read_bytes() == meta
    store = Store.open(path)
    for b in store.blocks:          # the last blocks hottest: defrag reverses the file
        b.access_freq = b.id
    write_metadata_atomic(path, encode_metadata(store.blocks, store.model))
    assert defrag(path, runtime=tmp_path / "rt").action == "rewritten"
    store = Store.open(path)
    assert store.blocks[-1].header_offset == 0
    assert verify_store(store).ok
    pruned = Store.open(apply(store, analyse(store), tmp_path / "pruned"))
    assert verify_store(pruned).ok
    for name, tensor in before.items():
        assert torch.equal(store.tensor(name), tensor), name
        assert torch.equal(pruned.tensor(name), tensor), name


def test_cli_pack_quantize_and_inspect(model_factory, tmp_path):
    src = model_factory("llama", "bfloat16", False)
    out = tmp_path / "q"
    run = subprocess.run([sys.executable, "-m", "deepseek_flash", "pack", str(src), str(out),
                          "--quantize", "int4_symmetric", "--group-size", "32"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "(int4_symmetric per_block g32)" in run.stdout
    doc = json.loads(subprocess.run([sys.executable, "-m", "deepseek_flash", "inspect", str(out),
                                     "--json"], capture_output=True, text=True, check=True).stdout)
    assert doc["quantization"] == {"scheme": "int4_symmetric", "granularity": "per_block",
                                   "group_size": 32}
    attn = next(b for b in doc["blocks"] if b["role"] == "attn")
    assert attn["dtypes"] == ["int4"] and attn["quant"]["group_size"] == 32
    table = subprocess.run([sys.executable, "-m", "deepseek_flash", "inspect", str(out)],
                           capture_output=True, text=True, check=True).stdout
    assert "quantization: int4_symmetric per_block g32" in table
