"""``python -m deepseek_flash.flash_benchmark`` / ``deepseek-flash bench``: generation latency
through the fabric.

The model is loaded with ``load_model`` (weights are views into the controller's memory; with
``--weight_budget`` below the model size its MLPs stream through slots), then timed.

A latency *sample* is one ``model.generate()`` call, greedy, producing exactly ``--new_tokens``
tokens (``min_new_tokens`` = ``max_new_tokens``, so an end-of-sequence token cannot cut it short)
for a batch of ``--batch_size`` sequences of ``--seq_len`` random prompt tokens: wall time from
the call to its return, prompt prefill included; on CUDA the device is synchronized before and
after, so queued kernels count. ``--warmup`` calls run first and are not counted. tokens/s =
generated tokens (batch_size x new_tokens per sample) over the summed sample time.
"""
from __future__ import annotations

import json
import math
import sys
import time

from .cli import bounded

POSITIVE_INT = bounded(int, 1)
NON_NEGATIVE_INT = bounded(int, 0)

HELP = "time generate() through the fabric: latency percentiles, tokens/s, prefetch hit rate"
DESCRIPTION = """Load MODEL through the controller (load_model) and time REPEAT greedy generate()
calls after WARMUP untimed ones. One latency sample = one generate() call producing exactly
NEW_TOKENS tokens for BATCH_SIZE random prompts of SEQ_LEN tokens (prefill included; on CUDA the
device is synchronized around the call). Reports avg/p50/p95/p99 latency (nearest rank), generated
tokens/s, prefetch hit rate and bytes streamed over the timed calls (streaming runs: the client's
slot ring; resident runs: 0 bytes and the controller's host-tier hit rate), model bytes, device.

Exit status: 0 done, 2 error (unknown model, SEQ_LEN + NEW_TOKENS beyond the model's
max_position_embeddings, no daemon at --socket, budget too small)."""


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, metavar="M",
                        help="registered model name, name under store_roots, or store directory")
    parser.add_argument("--batch_size", type=POSITIVE_INT, default=8, metavar="N",
                        help="sequences per generate() call (default 8)")
    parser.add_argument("--seq_len", type=POSITIVE_INT, default=2048, metavar="L",
                        help="prompt tokens per sequence (default 2048); SEQ_LEN + NEW_TOKENS must "
                             "not exceed the model's max_position_embeddings")
    parser.add_argument("--new_tokens", type=POSITIVE_INT, default=32, metavar="N",
                        help="tokens generated per call (default 32)")
    parser.add_argument("--warmup", type=NON_NEGATIVE_INT, default=5, metavar="N",
                        help="untimed calls first (default 5)")
    parser.add_argument("--repeat", type=POSITIVE_INT, default=20, metavar="N",
                        help="timed calls = latency samples (default 20)")
    parser.add_argument("--output_format", choices=("json", "table"), default="table",
                        help="json: one JSON object on stdout; table: key/value lines (default)")
    parser.add_argument("--device", default="cpu", metavar="DEV",
                        help="cpu (default) or cuda[:N]: where the weights and the compute are")
    parser.add_argument("--weight_budget", default=None, metavar="SIZE",
                        help="device memory the model may use (bytes or e.g. 8GiB); below the model "
                             "size, layers stream through slots (default: the whole model resident)")
    parser.add_argument("--socket", default=None, metavar="PATH",
                        help="use the daemon at this control socket (never an embedded controller)")
    parser.add_argument("--embedded", action="store_true",
                        help="run the controller in this process (default: the daemon when one "
                             "answers at the default socket, else embedded)")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="flash.json for the embedded controller (default: the system config)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def percentile(values, q: float) -> float:
    """Nearest-rank percentile: a value that was measured (q in 0..100)."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def _progress(total: int, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="bench", unit="call", disable=quiet or not sys.stderr.isatty(),
                file=sys.stderr)


def _counters(model, client) -> dict:
    """Cumulative prefetch counters of this model: the stream's when it streams, else the
    controller's host tier."""
    stream = model.flash.stream
    if stream is not None:
        s = stream.stats()
        return {"hits": s["prefetch_hits"], "misses": s["prefetch_miss_count"],
                "bytes": s["bytes_streamed"], "source": "stream"}
    s = client.stats()
    return {"hits": s["hits"], "misses": s["misses"], "bytes": 0, "source": "controller"}


def benchmark(args) -> dict:
    import torch

    from .client.model import load_model
    from .errors import ConfigError, DaemonNotRunning

    embedded = True if args.embedded else (False if args.socket else None)
    if args.embedded and args.socket:
        raise ConfigError("--embedded and --socket exclude each other", key="--socket",
                          value=args.socket, allowed="one of --embedded, --socket")
    t0 = time.perf_counter()
    try:
        model = load_model(args.model, device=args.device, weight_budget=args.weight_budget,
                           embedded=embedded, socket_path=args.socket, config=args.config)
    except DaemonNotRunning as exc:
        raise DaemonNotRunning(f"no daemon running at {args.socket}: {exc.message}",
                               socket=str(args.socket)) from None
    try:
        load_ms = (time.perf_counter() - t0) * 1e3
        handle = model.flash
        info = handle.info
        cfg = model.config
        limit = getattr(cfg, "max_position_embeddings", None)
        if limit is not None and args.seq_len + args.new_tokens > limit:
            raise ConfigError(f"--seq_len {args.seq_len} + --new_tokens {args.new_tokens} = "
                              f"{args.seq_len + args.new_tokens} tokens exceeds model {info.name}'s "
                              f"max_position_embeddings {limit}", key="seq_len", value=args.seq_len,
                              allowed=f"<= {limit - args.new_tokens}")
        device = torch.device(args.device)
        gen = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len), generator=gen).to(device)
        mask = torch.ones_like(ids)
        pad = model.generation_config.pad_token_id
        if pad is None:
            pad = model.generation_config.eos_token_id
            pad = (pad[0] if isinstance(pad, list) else pad) or 0
        cuda = device.type == "cuda"

        def one_call() -> float:
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                     min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=pad)
            if cuda:
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
            if out.shape != (args.batch_size, args.seq_len + args.new_tokens):
                raise RuntimeError(f"generate() returned shape {tuple(out.shape)}, expected "
                                   f"{(args.batch_size, args.seq_len + args.new_tokens)}")
            return elapsed

        with _progress(args.warmup + args.repeat, args.quiet) as bar:
            for _ in range(args.warmup):
                one_call()
                bar.update()
            before = _counters(model, handle.client)
            samples = []
            for _ in range(args.repeat):
                samples.append(one_call())
                bar.update()
            after = _counters(model, handle.client)
        hits = after["hits"] - before["hits"]
        misses = after["misses"] - before["misses"]
        lat_ms = [s * 1e3 for s in samples]
        generated = args.batch_size * args.new_tokens * args.repeat
        device_name = str(device)
        if cuda:
            device_name += f" ({torch.cuda.get_device_name(device)})"
        return {
            "model": info.name, "model_path": info.path, "model_bytes": info.total_bytes,
            "device": device_name, "controller": handle.client.mode,
            "batch_size": args.batch_size, "seq_len": args.seq_len, "new_tokens": args.new_tokens,
            "warmup": args.warmup, "repeat": args.repeat,
            "weight_budget_bytes": _budget_bytes(args.weight_budget),
            "streaming": handle.stream is not None,
            "sample": "one greedy generate() call of new_tokens tokens on batch_size x seq_len prompt "
                      "tokens, wall time incl. prefill",
            "avg_latency_ms": sum(lat_ms) / len(lat_ms),
            "p50_latency_ms": percentile(lat_ms, 50), "p95_latency_ms": percentile(lat_ms, 95),
            "p99_latency_ms": percentile(lat_ms, 99),
            "min_latency_ms": min(lat_ms), "max_latency_ms": max(lat_ms),
            "tokens_per_s": generated / sum(samples),
            "prefetch_hit_rate": hits / (hits + misses) if hits + misses else 1.0,
            "prefetch_hits": hits, "prefetch_misses": misses, "prefetch_source": after["source"],
            "bytes_streamed": after["bytes"] - before["bytes"],
            "load_ms": load_ms, "latency_ms": lat_ms,
            "torch": torch.__version__,
        }
    finally:
        model.flash.close()


def _budget_bytes(value):
    from .sizes import parse_size

    return None if value is None else parse_size("weight_budget", value)


def format_table(result: dict) -> str:
    rows = []
    for key, value in result.items():
        if key == "latency_ms":
            value = " ".join(f"{v:.2f}" for v in value)
        elif isinstance(value, float):
            value = f"{value:.4f}" if key == "prefetch_hit_rate" else f"{value:.2f}"
        rows.append((key, value))
    width = max(len(k) for k, _ in rows)
    return "".join(f"{k:<{width}}  {v}\n" for k, v in rows)


def run(args) -> int:
    result = benchmark(args)
    if args.output_format == "json":
        print(json.dumps(result, indent=2))
    else:
        sys.stdout.write(format_table(result))
    return 0


if __name__ == "__main__":
    from .cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
