"""The store's CLI verbs (pack, verify, inspect, repair and deepseek-flash-repair): exit codes, messages."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deepseek_flash.cli import main
from deepseek_flash.store.format import DATA_FILE, METADATA_FILE


def test_pack_verify_inspect(model_factory, tmp_path, capsys):
    out = tmp_path / "m.flash"
    assert main(["pack", str(model_factory("mistral", "float16", True)), str(out)]) == 0
    assert "packed 11 blocks" in capsys.readouterr().out
    assert main(["pack", str(model_factory("mistral", "float16", True)), str(out)]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "[StoreExists, code 105]" in err
    assert main(["pack", str(model_factory("llama", "float32", False)), str(out), "--force", "--quiet"]) == 0
    assert capsys.readouterr().out == ""
    assert main(["verify", str(out)]) == 0
    assert ": OK, 11 blocks" in capsys.readouterr().out
    assert main(["inspect", str(out)]) == 0
    assert "total: 11 blocks, 2 layers" in capsys.readouterr().out
    assert main(["inspect", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["architecture"] == "LlamaForCausalLM"


def test_verify_names_bad_blocks_and_exits_1(llama_store, capsys):
    from deepseek_flash.store import Store
    store = Store.open(llama_store)
    with open(llama_store / DATA_FILE, "r+b") as f:
        for bid in (3, 8):
            f.seek(store.blocks[bid].offset)
            f.write(b"\xff\xfe\xfd")
    assert main(["verify", str(llama_store)]) == 1
    err = capsys.readouterr().err
    assert "block 3 (mlp_gate_up, layer 0) BAD" in err and "block 8 (mlp_down, layer 1) BAD" in err
    assert "2 of 11 blocks bad: 3, 8" in err


def test_errors_exit_2_with_class_and_code(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 2
    assert "[NotAStore, code 108]" in capsys.readouterr().err
    assert main(["pack", str(tmp_path / "none"), str(tmp_path / "out")]) == 2
    assert "[NotAModelDirectory, code 101]" in capsys.readouterr().err


def test_repair_verb_and_operator_alias(llama_store, capsys):
    (llama_store / METADATA_FILE).unlink()
    assert main(["verify", str(llama_store)]) == 2
    assert "[MetadataError, code 106]" in capsys.readouterr().err
    assert main(["repair", str(llama_store)]) == 0
    assert "rebuilt flash_metadata.bin from 11 block headers" in capsys.readouterr().out
    assert main(["repair", "--model_path", str(llama_store)]) == 0
    assert "metadata OK and the data of all 11 blocks checks (crc32c); nothing to do" in capsys.readouterr().out
    assert main(["repair"]) == 2
    # The installed operator tool, as an operator types it.
    r = subprocess.run([sys.executable, "-c", "import sys; from deepseek_flash.cli import repair_main; "
                        "sys.exit(repair_main())", "--model_path", str(llama_store), "--force_rebuild"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "rebuilt flash_metadata.bin" in r.stdout and "rebuild forced" in r.stdout


def test_repair_reports_unrecoverable_blocks(llama_store, capsys):
    from deepseek_flash.store import Store
    store = Store.open(llama_store)
    with open(llama_store / DATA_FILE, "r+b") as f:
        f.seek(store.blocks[4].offset + 1)
        f.write(b"\x00\x01")
    assert main(["repair", "--model_path", str(llama_store), "--force_rebuild"]) == 1
    assert "block 4 cannot be recovered: payload crc32c" in capsys.readouterr().err
    with open(llama_store / DATA_FILE, "r+b") as f:
        f.seek(store.blocks[6].header_offset + 48)
        f.write(b"\x00\x01")
    assert main(["repair", "--model_path", str(llama_store), "--force_rebuild"]) == 1
    err = capsys.readouterr().err
    assert "no valid header found for block(s) 6" in err and "metadata NOT rewritten" in err


@pytest.mark.parametrize("damage", ["crc", "truncated"])
def test_repair_checks_the_data_under_good_metadata(damage, llama_store, capsys):
    from deepseek_flash.store import Store
    store = Store.open(llama_store)
    if damage == "crc":
        with open(llama_store / DATA_FILE, "r+b") as f:
            f.seek(store.blocks[5].offset + 2)
            f.write(b"\xde\xad")
    else:
        os.truncate(llama_store / DATA_FILE, store.blocks[-1].offset + 100)
    bad = 5 if damage == "crc" else store.blocks[-1].id
    assert main(["repair", str(llama_store)]) == 1
    err = capsys.readouterr().err
    assert (f"{llama_store}: metadata OK (11 blocks), but the data of 1 block(s) is damaged ({bad}); "
            f"repair rebuilds metadata only and cannot fix block data: re-pack the model") in err
    assert ("payload crc32c" if damage == "crc" else "is truncated") in err
    assert main(["verify", str(llama_store)]) == 1           # repair and verify agree
