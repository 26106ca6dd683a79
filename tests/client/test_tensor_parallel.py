"""Tensor-parallel clients: two processes of a torch.distributed group against one daemon each
acquire their shard (1/2 of every linear weight) and compute the single-process model's logits,
up to the order of the sums (fp32; gloo on the CPU in CI, the same test on GPUs where present)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "daemon"))

from deepseek_flash.client import Client
from deepseek_flash.client.model import load_model
from deepseek_flash.errors import ShardError
from deepseek_flash.store import Store, pack
from deepseek_flash.store.shard import split_of
from deepseek_flash.testing import load_reference, make_tiny_model
from flashd_harness import Daemon

# fp32: a row-split projection sums two half-length dot products where the single process sums
# one; both are the same K products added in another order. The logits here are O(1) and the
# sums are over K <= 128 terms, so they differ by a few ulps of float32 (eps 1.2e-7) per layer:
# ~1e-6 measured. 1e-5 absolute and relative bounds that with room, and is far below any
# difference a wrong shard makes (an order of magnitude of the logits themselves).
TOLERANCE = dict(rtol=1e-5, atol=1e-5)

CUDA = torch.cuda.is_available()
# (devices, backend): CPU in CI; on a GPU machine two ranks on one GPU (gloo: NCCL refuses two
# ranks on one device) and, with two GPUs, one rank each over NCCL.
WORLDS = [(("cpu", "cpu"), "gloo"),
          pytest.param(("cuda:0", "cuda:0"), "gloo", marks=[pytest.mark.gpu, pytest.mark.skipif(
              not CUDA, reason="needs CUDA")], id="cuda:0-slices"),
          pytest.param(("cuda:0", "cuda:1"), "nccl", marks=[pytest.mark.gpu, pytest.mark.skipif(
              not CUDA or torch.cuda.device_count() < 2, reason="needs two GPUs")], id="two-gpus")]

RANK = r"""
import json, sys, torch, torch.distributed as dist
torch.set_num_threads(1)
rank, init, store, sock, ids_path, out, device, backend = int(sys.argv[1]), *sys.argv[2:]
if device.startswith("cuda"):
    torch.cuda.set_device(torch.device(device))
dist.init_process_group(backend, rank=rank, world_size=2, init_method="file://" + init)
from deepseek_flash.client.model import load_model
from deepseek_flash.store.shard import split_of
m = load_model(store, device=device, socket_path=sock, embedded=False, tensor_parallel=True)
ids = torch.load(ids_path).to(device)
with torch.no_grad():
    logits = m(ids).logits.cpu()
tokens = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                    do_sample=False).cpu()
blocks = {b.id: b for b in m.flash.info.blocks}
plan = m.flash.desc["plan"]
linear = sum(p.numel() * p.element_size() for n, p in m.named_parameters()
             if split_of(n) and n.endswith(".weight"))
torch.save({"logits": logits, "tokens": tokens}, out + ".pt")
json.dump({"model": m.flash.info.name, "linear_weight_bytes": linear,
           "placed_bytes": sum(blocks[b].length for b in plan["resident"]),
           "opened": [x["name"] for x in m.flash.client.list_models()]}, open(out + ".json", "w"))
m.flash.close()
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    # Biases on every projection: column-split ones are sliced, row-split ones added once.
    src = make_tiny_model(root / "src", "llama", dtype="float32", num_layers=3, seed=11,
                          attention_bias=True, mlp_bias=True)
    return src, pack(src, root / "tp-llama")


@pytest.mark.parametrize("devices,backend", WORLDS, ids=lambda v: "-".join(v) if isinstance(v, tuple) else v)
def test_two_ranks_compute_the_single_process_logits_from_half_the_linear_bytes(model, tmp_path, devices,
                                                                                backend):
    src, store = model
    state = tmp_path / "state"
    daemon = Daemon(tmp_path / "flashd", {"host_cache_bytes": "64MiB"},
                    env={"DEEPSEEK_FLASH_STATE_DIR": str(state)}).start()
    try:
        ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(5))
        torch.save(ids, tmp_path / "ids.pt")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(tmp_path / "init"), str(store),
                                   str(daemon.socket), str(tmp_path / "ids.pt"), str(tmp_path / f"r{r}"),
                                   devices[r], backend],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(2)]
        outs = [p.communicate(timeout=240)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
        ref = load_reference(src, device=devices[0])
        with torch.no_grad():
            want = ref(ids.to(devices[0])).logits.cpu()
        want_tokens = ref.generate(ids.to(devices[0]), attention_mask=torch.ones_like(ids).to(devices[0]),
                                   max_new_tokens=4, do_sample=False).cpu()
        full = Store.open(store)
        full_linear = sum(t.nbytes for b in full.blocks for t in b.tensors
                          if split_of(t.name) and t.name.endswith(".weight"))
        replicated = sum(t.nbytes for b in full.blocks for t in b.tensors if not split_of(t.name))
        got = []
        for r in range(2):
            res = torch.load(tmp_path / f"r{r}.pt")
            info = json.loads((tmp_path / f"r{r}.json").read_text())
            got.append(res["logits"])
            torch.testing.assert_close(res["logits"], want, **TOLERANCE)
            assert torch.equal(res["tokens"], want_tokens)
            # Each process holds exactly half of every linear weight ...
            assert info["linear_weight_bytes"] * 2 == full_linear
            # ... and what its attach placed is its shard: half the linear bytes (and biases),
            # the replicated embeddings, norms and head -- never the whole checkpoint.
            assert info["placed_bytes"] < full_linear // 2 + replicated + 64 * 1024
            assert info["placed_bytes"] < 0.75 * full.total_bytes
            assert info["model"] == f"tp-llama.tp{r}of2"
            assert "tp-llama" in info["opened"]   # the source is opened, never acquired
        # Every rank adds the same partial sums: identical logits on both.
        assert torch.equal(got[0], got[1])
        print("tensor-parallel max |logit difference|:", (got[0] - want).abs().max().item())
        # The shards were derived once, under the state directory, keyed by the source's metadata.
        derived = sorted(p.name for p in state.joinpath("shards").glob("*/*"))
        assert derived == ["tp-llama.tp0of2", "tp-llama.tp1of2"]
    finally:
        assert daemon.stop() == 0
        daemon.cleanup()


def test_a_world_the_model_cannot_take_is_refused_typed(model, tmp_path, monkeypatch):
    _, store = model
    monkeypatch.setenv("DEEPSEEK_FLASH_STATE_DIR", str(tmp_path / "state"))
    with Client(embedded=True, config={"host_cache_bytes": "16MiB"}) as client:
        with pytest.raises(ShardError) as exc:
            client.shard(store, 0, 4)          # 2 key/value heads
        assert exc.value.code == 902 and exc.value.dimension == "num_key_value_heads"
        with pytest.raises(ShardError, match="rank 2 is outside"):
            client.shard(store, 2, 2)
        with pytest.raises(ShardError, match="not initialised"):
            load_model(store, client=client, tensor_parallel=True)
    assert not (tmp_path / "state" / "shards").exists() or not any((tmp_path / "state" / "shards").rglob("*.tp*"))
