"""repair: rebuild from inline headers after loss or truncation; report what cannot be recovered."""
from __future__ import annotations

import os

import pytest
import torch
from conftest import reference_tensors

from deepseek_flash import errors
from deepseek_flash.store import Store
from deepseek_flash.store.format import DATA_FILE, METADATA_FILE, encode_metadata
from deepseek_flash.store.reader import read_metadata
from deepseek_flash.store.repair import repair, write_metadata_atomic
from deepseek_flash.store.verify import verify_store


def _assert_whole(store_dir, model_dir):
    store = Store.open(store_dir)
    assert verify_store(store).ok
    for name, tensor in reference_tensors(model_dir).items():
        assert torch.equal(store.tensor(name), tensor), name


@pytest.mark.parametrize("damage", ["deleted", "truncated", "garbage"])
def test_rebuild_after_metadata_loss(damage, llama_dir, llama_store):
    meta = llama_store / METADATA_FILE
    original = meta.read_bytes()
    if damage == "deleted":
        meta.unlink()
    elif damage == "truncated":
        meta.write_bytes(original[: len(original) // 2])
    else:
        meta.write_bytes(os.urandom(len(original)))
    data_before = (llama_store / DATA_FILE).read_bytes()
    report = repair(llama_store)
    assert report.action == "rebuilt" and report.ok and report.blocks == 11
    assert meta.read_bytes() == original          # the very same index, byte for byte
    assert (llama_store / DATA_FILE).read_bytes() == data_before
    _assert_whole(llama_store, llama_dir)


def test_rebuild_without_old_metadata_or_model_info(llama_dir, llama_store):
    (llama_store / METADATA_FILE).unlink()
    repair(llama_store)
    assert Store.open(llama_store).model["architecture"] == "LlamaForCausalLM"


def test_healthy_metadata_left_alone_unless_forced(llama_store):
    meta = llama_store / METADATA_FILE
    blocks, model = read_metadata(llama_store)
    blocks[3].access_freq = 42
    write_metadata_atomic(llama_store, encode_metadata(blocks, model))
    mtime = meta.stat().st_mtime_ns
    assert repair(llama_store).action == "none"
    assert meta.stat().st_mtime_ns == mtime
    report = repair(llama_store, force_rebuild=True)
    assert report.action == "rebuilt" and report.ok
    assert Store.open(llama_store).blocks[3].access_freq == 42   # preserved


def test_corrupted_payload_is_reported(llama_store):
    store = Store.open(llama_store)
    with open(llama_store / DATA_FILE, "r+b") as f:
        f.seek(store.blocks[5].offset + 3)
        f.write(b"\xde\xad")
    report = repair(llama_store, force_rebuild=True)
    assert not report.ok and [b for b, _ in report.bad] == [5]
    assert "payload crc32c" in report.bad[0][1]
    # The index still describes every block, so verify names the bad one too.
    assert [b for b, _ in verify_store(Store.open(llama_store)).bad] == [5]


def test_damaged_header_refuses_to_replace_readable_metadata(llama_store):
    store = Store.open(llama_store)
    meta_before = (llama_store / METADATA_FILE).read_bytes()
    with open(llama_store / DATA_FILE, "r+b") as f:
        f.seek(store.blocks[7].header_offset + 60)
        f.write(b"\x00\xff\x00")
    report = repair(llama_store, force_rebuild=True)
    assert report.action == "refused" and report.missing == [7]
    assert report.skipped and report.skipped[0][0] == store.blocks[7].header_offset
    assert (llama_store / METADATA_FILE).read_bytes() == meta_before


def test_truncated_data_file_reports_lost_blocks(llama_store):
    store = Store.open(llama_store)
    (llama_store / METADATA_FILE).unlink()
    os.truncate(llama_store / DATA_FILE, store.blocks[-1].offset + 100)
    report = repair(llama_store)
    assert report.action == "refused"
    assert [b for b, _ in report.bad] == [store.blocks[-1].id]
    assert not (llama_store / METADATA_FILE).exists()


def test_not_a_store(tmp_path):
    with pytest.raises(errors.NotAStore) as info:
        repair(tmp_path)
    assert info.value.code == 108 and str(tmp_path) in str(info.value)
