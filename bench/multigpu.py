"""Benchmark: several GPUs of one host -- a streamed model split over devices, and tensor-parallel
attach.

``--devices cuda:0 cuda:1`` (two GPUs) or ``--devices cuda:0 cuda:0`` (one GPU as two logical
slices: two parts, two loads, two slot rings and copy streams on one link -- the code paths, not
the speed-up). Random 7-8B-shaped model (``--arch llama|qwen2|mistral``, bf16), the controller's
default configuration except the host cache (sized to hold the model):

1. **stream**: a model twice the total weight budget (``weight_budget = model / 2``). One device
   (``device=devices[0]``, the whole budget) vs the split (``device_map={"devices": devices}``, the
   same total, split by bytes): decode tok/s at batch 1, each against its bound -- streamed bytes
   per token over the pinned host->GPU rate measured in this run on each device (the split's bound
   takes the busier link) -- greedy tokens identical to the one-device run, the ratio split / one
   (goal on two GPUs: >= 1.8).
2. **tp**: the model made resident by a first tensor-parallel run (one process per device; the
   daemon derives each rank's shard once), then a second run of fresh processes attaching to it:
   each rank's ``load_model`` time (goal < 100 ms) and logits vs the single-device model through
   the same daemon: largest difference, the logits' scale, argmax agreement. NCCL where the ranks'
   devices differ, gloo otherwise (NCCL refuses two ranks on one GPU).
3. **tp_stream** (with both phases): the same model, same total budget, tensor-parallel -- each
   rank streams its shard under ``budget / world``, so every layer's copies run on every link at
   once -- batch-1 decode tok/s vs the one-device run (goal on two GPUs: >= 1.8). A layer split
   cannot reach that at batch 1 under an equal total budget: its parts run one after the other,
   and a part's ring prefetches during the other part's compute only as many layers as it has
   slots, which the same budget pays for (docs/multigpu.md).

Both phases run against a real ``deepseek-flashd`` started here (state and runtime under
``--dir``). ``--smoke`` runs everything on the CPU with a tiny model (CI: the code paths, JSON out).

    python bench/multigpu.py --devices cuda:0 cuda:1 --arch llama --dir /var/tmp/flash-bench --output multigpu.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

from _common import ARCH_SHAPES, add_arch_argument, emit, pinned_h2d, save, write_finite_model

PROMPT = 16
SMOKE_LAYERS = 16
HERE = Path(__file__).resolve().parent


def start_daemon(root: Path, host_cache: str) -> tuple[subprocess.Popen, Path]:
    """A ``deepseek-flashd`` of its own under ``root``; returns (process, socket) once it answers."""
    from deepseek_flash.client import Client
    from deepseek_flash.errors import DaemonNotRunning

    root.mkdir(parents=True, exist_ok=True)
    config = root / "flash.json"
    config.write_text(json.dumps({"host_cache_bytes": host_cache}))
    short = Path(os.environ.get("TMPDIR", "/tmp")) / f"mgpu-{os.getpid()}"
    short.mkdir(exist_ok=True)
    sock = short / "control.sock"
    env = {**os.environ, "DEEPSEEK_FLASH_RUNTIME_DIR": str(short), "DEEPSEEK_FLASH_SOCKET": str(sock),
           "DEEPSEEK_FLASH_CONFIG": str(config), "DEEPSEEK_FLASH_STATE_DIR": str(root / "state")}
    env.pop("NOTIFY_SOCKET", None)
    log = open(root / "daemon.log", "ab")  # noqa: SIM115 -- the daemon's log for its life
    proc = subprocess.Popen([sys.executable, "-m", "deepseek_flash.daemon.app"], env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        try:
            Client(sock, embedded=False, connect_timeout=1.0, reconnect_timeout=0).close()
            return proc, sock
        except DaemonNotRunning:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"deepseek-flashd did not start; see {root / 'daemon.log'}") from None
            time.sleep(0.2)


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def decode_rate(model, device: str, tokens: int, vocab: int) -> tuple[float, object]:
    """Batch-1 decode tokens/s: (generate N+1) - (generate 1), so prefill is excluded."""
    import torch

    ids = torch.randint(0, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(1)).to(device)
    mask = torch.ones_like(ids)

    def gen(n):
        sync(device)
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        for d in {p.device.type + (f":{p.device.index}" if p.device.index is not None else "")
                  for p in model.parameters()}:
            sync(d)
        return time.perf_counter() - t, out

    gen(2)
    t1, _ = gen(1)
    tn, out = gen(tokens + 1)
    return tokens / max(tn - t1, 1e-9), out


def streamed_per_token(model) -> list[int]:
    """Bytes each streaming part copies per token (one entry per part; 0 for a resident part)."""
    info = {b.id: b for b in model.flash.info.blocks}
    parts = model.flash.parts or [None]
    out = []
    for part in parts:
        plan = part.plan if part is not None else model.flash.stream.plan if model.flash.stream else None
        out.append(0 if plan is None else sum(info[b].length for layer in plan.streamed_layers
                                              for b in plan.stream_blocks[layer]))
    return out


def check_budgets(store_dir, devices) -> dict:
    """The budgets this run asks for, checked before anything starts: half the model on one
    device, the same total over the split's parts (as ``load_model(device_map=...)`` splits it:
    each part's resident minimum first) and half of it per tensor-parallel rank. Exits naming
    the shortfall where the model is too short for them (anchors and slots are paid per part)."""
    from deepseek_flash.client.placement import block_sizes, resolve
    from deepseek_flash.daemon.planner import resident_minimum
    from deepseek_flash.errors import BudgetTooSmall
    from deepseek_flash.store import Store
    from deepseek_flash.wire import SLOT_ALIGNMENT

    store = Store.open(store_dir)
    budget = store.total_bytes // 2
    one = resident_minimum(store.blocks)
    out = {"total": budget, "one_device_minimum": one}
    try:
        if budget < one:
            raise BudgetTooSmall(f"half the model, {budget} bytes, is below the one-device resident "
                                 f"minimum {one} bytes")
        sizes = block_sizes(store.blocks, store.num_layers, SLOT_ALIGNMENT)
        parts = resolve({"devices": devices}, weight_budget=budget,
                        available=["cpu"] + sorted(set(devices) - {"cpu"}), **sizes)
    except BudgetTooSmall as exc:
        raise SystemExit(f"bench/multigpu.py: {exc.message}; this model ({store.num_layers} layers, "
                         f"{store.total_bytes} bytes) is too short for a budget of half of it -- "
                         f"use more layers (--layers)") from None
    out["split"] = []
    for p in parts:
        mine = set(p.blocks(store.blocks))
        out["split"].append({"device": p.device, "budget": p.budget,
                             "minimum": resident_minimum([b for b in store.blocks if b.id in mine])})
    return out


def stream_phase(args, store_dir, sock, res, h2d) -> None:
    import torch

    from deepseek_flash.client.model import load_model
    from deepseek_flash.store import Store

    store = Store.open(store_dir)
    budget = store.total_bytes // 2
    vocab = int(store.config["vocab_size"])
    out = res["stream"] = {"model_bytes": store.total_bytes, "total_budget_bytes": budget}
    one = load_model(store_dir, device=args.devices[0], socket_path=sock, embedded=False,
                     weight_budget=budget)
    rate1, tokens1 = decode_rate(one, args.devices[0], args.tokens, vocab)
    per1 = streamed_per_token(one)[0]
    out["one_device"] = {"device": args.devices[0], "tok_s": round(rate1, 3),
                         "streamed_bytes_per_token": per1,
                         "bound_tok_s": round(h2d[args.devices[0]] * 1e9 / per1, 3) if per1 else None}
    one.flash.close()
    del one
    sync(args.devices[0])
    if args.devices[0].startswith("cuda"):
        torch.cuda.empty_cache()
    split = load_model(store_dir, device_map={"devices": args.devices}, socket_path=sock,
                       embedded=False, weight_budget=budget)
    rate2, tokens2 = decode_rate(split, args.devices[0], args.tokens, vocab)
    per2 = streamed_per_token(split)
    stats = split.flash.stream.stats() if split.flash.stream is not None else {}
    # Two bounds: every link busy all the time (the token waits for the busier one), and the
    # links in turn (the parts run one after the other; docs/multigpu.md says why that is the
    # one a layer split meets at batch 1).
    bound2 = min((h2d[p.part.device] * 1e9 / n for p, n in zip(split.flash.parts, per2) if n),
                 default=None)
    turn_s = sum(n / (h2d[p.part.device] * 1e9) for p, n in zip(split.flash.parts, per2))
    out["split"] = {"parts": [{"device": p.part.device, "layers": [p.part.layers[0], p.part.layers[-1]],
                               "budget_bytes": p.plan.budget, "streamed_layers": len(p.plan.streamed_layers),
                               "slots": p.plan.n_slots, "streamed_bytes_per_token": n}
                              for p, n in zip(split.flash.parts, per2)],
                    "tok_s": round(rate2, 3), "bound_tok_s": round(bound2, 3) if bound2 else None,
                    "bound_links_in_turn_tok_s": round(1 / turn_s, 3) if turn_s else None,
                    "prefetch_hit_rate": round(stats.get("prefetch_hit_rate", 0.0), 4),
                    "tokens_identical_to_one_device": bool(torch.equal(tokens1.cpu(), tokens2.cpu()))}
    out["split_vs_one"] = round(rate2 / rate1, 3)
    split.flash.close()
    save(res, args.output)


RANK = r"""
import json, sys, time, torch, torch.distributed as dist
torch.set_num_threads(4)
rank, world, backend, init, store, sock, device, ids_path, out, budget, tokens = sys.argv[1:12]
rank, world, budget, tokens = int(rank), int(world), int(budget), int(tokens)
if device.startswith("cuda"):
    torch.cuda.set_device(torch.device(device))
dist.init_process_group(backend, rank=rank, world_size=world, init_method="file://" + init)
from deepseek_flash.client.model import load_model
from deepseek_flash.client.skeleton import build_skeleton
from deepseek_flash.store import Store
# As bench/load.py's warm attach: torch, transformers and the model's class imported, CUDA and the
# process group up -- what a serving process has before it asks for a model -- then the clock.
build_skeleton(Store.open(store).config)
if device.startswith("cuda"):
    torch.empty(1, device=device)
dist.barrier()
t = time.perf_counter()
m = load_model(store, device=device, socket_path=sock, embedded=False, tensor_parallel=True,
               weight_budget=budget or None)
wall_ms = (time.perf_counter() - t) * 1e3
ids = torch.load(ids_path).to(device)
t = time.perf_counter()
with torch.no_grad():
    logits = m(ids).logits.float().cpu()
first_forward_ms = (time.perf_counter() - t) * 1e3
torch.save(logits, out + ".pt")
rate = None
if tokens:
    # Batch-1 decode, both ranks in step (every layer all-reduces): (N+1 tokens) - (1 token).
    one = ids[:1]
    def gen(n):
        dist.barrier()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        o = m.generate(one, attention_mask=torch.ones_like(one), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t, o
    gen(2)
    t1, _ = gen(1)
    tn, o = gen(tokens + 1)
    rate = tokens / max(tn - t1, 1e-9)
    torch.save(o.cpu(), out + ".tokens.pt")
json.dump({"rank": rank, "model": m.flash.info.name, "load_model_ms": round(wall_ms, 2),
           "decode_tok_s": rate, "streaming": m.flash.stream is not None,
           "first_forward_ms": round(first_forward_ms, 2),
           "timings": m.flash.timings}, open(out + ".json", "w"))
m.flash.close()
dist.destroy_process_group()
"""


def run_ranks(args, store_dir, sock, work: Path, tag: str, budget: int = 0, tokens: int = 0) -> list[dict]:
    devices = args.devices
    backend = "nccl" if all(d.startswith("cuda") for d in devices) and len(set(devices)) == len(devices) \
        else "gloo"
    init = work / f"init-{tag}"
    init.unlink(missing_ok=True)
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(len(devices)), backend, str(init),
                               str(store_dir), str(sock), devices[r], str(work / "ids.pt"),
                               str(work / f"{tag}-r{r}"), str(budget), str(tokens)],
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for r in range(len(devices))]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("a tensor-parallel rank failed:\n" + "\n".join(outs))
    return [json.loads((work / f"{tag}-r{r}.json").read_text()) | {"backend": backend}
            for r in range(len(devices))]


def tp_phase(args, store_dir, sock, work: Path, res) -> None:
    import torch

    from deepseek_flash.client.model import load_model
    from deepseek_flash.store import Store

    vocab = int(Store.open(store_dir).config["vocab_size"])
    ids = torch.randint(0, vocab, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    torch.save(ids, work / "ids.pt")
    out = res["tp"] = {"world": len(args.devices), "devices": args.devices}
    t = time.perf_counter()
    run_ranks(args, store_dir, sock, work, "first")       # derives the shards, loads them
    out["first_run_s"] = round(time.perf_counter() - t, 2)
    ranks = run_ranks(args, store_dir, sock, work, "attach")
    out["ranks"] = [{k: r[k] for k in ("rank", "model", "load_model_ms", "first_forward_ms", "backend")} |
                    {"load_model_phases_ms": r["timings"]} for r in ranks]
    ref = load_model(store_dir, device=args.devices[0], socket_path=sock, embedded=False)
    with torch.no_grad():
        want = ref(ids.to(args.devices[0])).logits.float().cpu()
    ref.flash.close()
    got = [torch.load(work / f"attach-r{r}.pt") for r in range(len(args.devices))]
    diff = max((g - want).abs().max().item() for g in got)
    out["logits"] = {"max_abs_diff": diff, "max_abs_logit": want.abs().max().item(),
                     "ranks_identical": all(torch.equal(g, got[0]) for g in got),
                     "argmax_agreement": round(min((g.argmax(-1) == want.argmax(-1)).float().mean().item()
                                                   for g in got), 4)}
    save(res, args.output)
    if "stream" in res:
        # The model twice the total budget again, now tensor-parallel: each rank streams its
        # shard under its share of the budget, every layer on every link at once.
        budget = res["stream"]["total_budget_bytes"] // len(args.devices)
        ranks = run_ranks(args, store_dir, sock, work, "tpstream", budget=budget, tokens=args.tokens)
        one = res["stream"]["one_device"]
        tokens = [torch.load(work / f"tpstream-r{r}.tokens.pt") for r in range(len(args.devices))]
        rate = min(r["decode_tok_s"] for r in ranks)
        res["tp_stream"] = {"budget_bytes_per_rank": budget,
                            "streaming": all(r["streaming"] for r in ranks),
                            "tok_s": round(rate, 3), "vs_one_device": round(rate / one["tok_s"], 3),
                            "ranks_same_tokens": all(torch.equal(t, tokens[0]) for t in tokens)}
        save(res, args.output)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", nargs="+", default=["cuda:0", "cuda:1"],
                        help="devices in order; one repeated (cuda:0 cuda:0) = logical slices of one GPU")
    add_arch_argument(parser)
    parser.add_argument("--dir", default="/var/tmp/flash-bench")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers for a quick run")
    parser.add_argument("--tokens", type=int, default=16, help="decode steps per measurement")
    parser.add_argument("--host-cache", default="40GiB")
    parser.add_argument("--phases", default="stream,tp")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU (CI)")
    parser.add_argument("--output")
    args = parser.parse_args(argv)

    import torch

    from deepseek_flash.store import pack

    torch.set_num_threads(1 if args.smoke else 4)
    # One directory per model shape: a store packed for another layer count is never reused.
    layers = SMOKE_LAYERS if args.smoke else args.layers or ARCH_SHAPES[args.arch]["layers"]
    work = Path(args.dir) / (f"multigpu-smoke-{args.arch}" if args.smoke
                             else f"multigpu-{args.arch}-{layers}L")
    work.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        from deepseek_flash.testing import make_tiny_model

        args.devices = ["cpu", "cpu"]
        args.host_cache, args.tokens = "64MiB", 3
        src = work / "src"
        if not (src / "config.json").exists():
            # The proportions of the real run's default (a 16-layer Mistral-7B shape): attention
            # a quarter of the MLP, embeddings + head ~7 % of the layers -- so half the model
            # must hold each part's anchors and two slots here exactly as it must there.
            make_tiny_model(src, args.arch, dtype="float32", num_layers=layers, intermediate_size=256,
                            vocab_size=512, seed=2)
    else:
        src = write_finite_model(work / "src", args.arch, args.layers)
    store_dir = work / "store"
    if not (store_dir / "flash_metadata.bin").exists():
        pack(src, store_dir)
    res = {"benchmark": "multigpu", "arch": args.arch, "layers": layers, "date": datetime.date.today().isoformat(),
           "host": platform.node(), "devices": args.devices,
           "gpus": [torch.cuda.get_device_name(torch.device(d)) for d in args.devices
                    if d.startswith("cuda")]}
    # The limit each link allows, measured here (the CPU smoke has none: "cpu" reads as 1 GB/s).
    h2d = {d: pinned_h2d(device=torch.device(d).index or 0) if d.startswith("cuda") else 1.0
           for d in dict.fromkeys(args.devices)}
    res["pinned_h2d_gbps"] = h2d
    res["budgets"] = check_budgets(store_dir, args.devices)
    # A timeout's SIGTERM ends the run through the finally below, so the daemon (and its GPU
    # memory) does not outlive the bench.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    proc, sock = start_daemon(work / "daemon", args.host_cache)
    try:
        phases = args.phases.split(",")
        if "stream" in phases:
            stream_phase(args, store_dir, sock, res, h2d)
        if "tp" in phases:
            tp_phase(args, store_dir, sock, work, res)
    finally:
        proc.terminate()
        proc.wait(60)
    goals = {}
    if "stream" in res:
        goals["split>=1.8*one_device"] = res["stream"]["split_vs_one"] >= 1.8
        goals["split_tokens_identical"] = res["stream"]["split"]["tokens_identical_to_one_device"]
    if "tp_stream" in res:
        goals["tp_stream>=1.8*one_device"] = res["tp_stream"]["vs_one_device"] >= 1.8
    if "tp" in res:
        goals["tp_attach<100ms_each"] = all(r["load_model_ms"] < 100 for r in res["tp"]["ranks"])
        goals["tp_argmax_agreement>=0.99"] = res["tp"]["logits"]["argmax_agreement"] >= 0.99
    res["goals"] = goals
    emit(res, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
