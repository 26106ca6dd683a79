"""``deepseek-flash serve MODEL``: load the model through the controller and serve it over HTTP.

The model is loaded with ``load_model`` -- through the daemon when one answers on the control
socket, else with an embedded controller -- so its weights are the controller's (resident or
streamed under ``--weight-budget``). The listening socket is bound before the application starts,
so ``READY=1`` (under systemd, ``Type=notify``) means the port accepts connections.
"""
from __future__ import annotations

import logging
import signal
import socket

from ..cli import bounded

HELP = "serve a model over an OpenAI-compatible HTTP API (continuous batching, L0/L1/L2 scheduler)"
DESCRIPTION = HELP + """

Endpoints: /v1/chat/completions, /v1/completions (stream: true for server-sent events), /v1/models,
/healthz, /metrics. Request extensions: flash_context {"priority_class": "L0"|"L1"|"L2",
"prefetch_window": N, the tiered KV cache's kv_* keys} and priority. Guide: docs/serve.md.
"""

log = logging.getLogger("deepseek_flash.serve")


def add_arguments(parser):
    parser.add_argument("model", metavar="MODEL", help="registered model name or store directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=bounded(int, 0), default=8000, help="TCP port (default 8000; 0 picks one)")
    parser.add_argument("--device", default=None,
                        help="cpu or cuda[:N] (default cuda:0 when a GPU is visible, else cpu)")
    parser.add_argument("--weight-budget", default=None,
                        help="device memory for weights, e.g. 8GiB; layers beyond it are streamed")
    parser.add_argument("--max-batch", type=bounded(int, 1), default=8, help="rows of the running batch (default 8)")
    parser.add_argument("--max-model-len", type=bounded(int, 1), default=None,
                        help="tokens per request, prompt + completion (default: the model's, at most 4096)")
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: the store's name)")
    parser.add_argument("--l0-capacity", type=bounded(int, 1), default=50,
                        help="L0 requests admitted at once (queued + running; default 50)")
    parser.add_argument("--scheduler", choices=("flash", "fifo"), default="flash",
                        help="flash: L0/L1/L2 classes (default); fifo: arrival order, for comparison")
    parser.add_argument("--read-priority", type=int, default=0,
                        help="priority of this model's disk reads in the controller (its load, streamed "
                             "layers): higher goes before other models' waiting reads (default 0)")
    parser.add_argument("--kv-spill-root", default=None,
                        help="directory under which a request's flash_context.kv_spill_dir may put KV "
                             "spill files (default: none; requests naming one get 400)")
    parser.add_argument("--embedded", action="store_true",
                        help="run the controller in this process even when a daemon answers")
    parser.add_argument("--torch-threads", type=bounded(int, 1), default=None,
                        help="torch intra-op threads (default: torch's). On a CPU device shared with other "
                             "busy processes, fewer threads keep torch's spinning workers from starving "
                             "the HTTP thread")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def build(model_ref, *, device=None, weight_budget=None, max_batch=8, max_model_len=None,
          served_model_name=None, l0_capacity=50, scheduler="flash", embedded=None, gpu_busy=None,
          read_priority=0, kv_spill_root=None):
    """Load the model and build the application: returns (FastAPI app, ServeState). The model is
    detached when the application shuts down."""
    from .app import create_app

    model, tokenizer = load(model_ref, device=device, weight_budget=weight_budget, embedded=embedded,
                            priority=read_priority)
    try:
        state = make_state(model, tokenizer, max_batch=max_batch, max_model_len=max_model_len,
                           served_model_name=served_model_name, l0_capacity=l0_capacity,
                           scheduler=scheduler, gpu_busy=gpu_busy, kv_spill_root=kv_spill_root)
    except BaseException:
        model.flash.close()
        raise
    state.closer = model.flash.close
    return create_app(state), state


def load(model_ref, *, device=None, weight_budget=None, embedded=None, priority=0):
    """``load_model`` on ``device`` (default cuda:0 when visible, else cpu) and the store's tokenizer."""
    import torch
    import transformers

    from ..client.model import load_model

    if device is None:
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    model = load_model(model_ref, device=device, weight_budget=weight_budget, embedded=embedded,
                       priority=priority)
    path = model.flash.info.path
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        model.flash.close()
        from ..errors import UnsupportedModel

        raise UnsupportedModel(f"no usable tokenizer in the store {path}: {exc}", path=path) from None
    return model, tokenizer


def make_state(model, tokenizer, *, max_batch=8, max_model_len=None, served_model_name=None,
               l0_capacity=50, scheduler="flash", gpu_busy=None, kv_spill_root=None):
    """A started engine over ``model`` (a ``load_model`` model) with its scheduler, wrapped in the
    routes' ``ServeState``."""
    from .app import ServeState
    from .engine import Engine
    from .scheduler import FifoScheduler, FlashScheduler

    device = next(model.parameters()).device
    if gpu_busy is None and device.type == "cuda":
        gpu_busy = nvml_busy(device.index or 0)
    if scheduler == "fifo":
        sched = FifoScheduler(slots=max_batch)
    else:
        sched = FlashScheduler(l0_capacity=l0_capacity, slots=max_batch, gpu_busy=gpu_busy)
    limit = max_model_len or min(4096, model.config.max_position_embeddings)
    engine = Engine(model, tokenizer, sched, max_batch=max_batch, max_model_len=limit).start()
    return ServeState(engine, tokenizer, served_model_name or model.flash.info.name, kv_spill_root=kv_spill_root)


def nvml_busy(index: int):
    """A GPU-busy reading (0..1, NVML utilisation, sampled at most twice a second) for the
    scheduler's degrade rule; None where NVML is missing (the rule then uses idle slots only)."""
    import time

    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:  # noqa: BLE001 -- any NVML failure means no reading
        log.info("no GPU utilisation for the scheduler (%s)", exc)
        return None
    last = [0.0, None]

    def read():
        now = time.monotonic()
        if now - last[0] >= 0.5:
            try:
                last[1] = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
            except Exception:  # noqa: BLE001
                last[1] = None
            last[0] = now
        return last[1]
    return read


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, so that asyncio sets TCP_NODELAY on every accepted connection (it does only
    # for sockets whose protocol says TCP): without it a streamed token written after the headers
    # waits for the client's delayed ACK (~40 ms on Linux) -- Nagle's algorithm.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def server(app, sock: socket.socket, log_level: str = "info"):
    """A uvicorn server for ``app`` on the already bound ``sock`` (``server.run(sockets=[sock])``)."""
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=30, access_log=False)
    return uvicorn.Server(config)


def run(args) -> int:
    from ..daemon.notify import Notifier

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(args.torch_threads)
    sock = listen(args.host, args.port)
    app, state = build(args.model, device=args.device, weight_budget=args.weight_budget,
                       max_batch=args.max_batch, max_model_len=args.max_model_len,
                       served_model_name=args.served_model_name, l0_capacity=args.l0_capacity,
                       scheduler=args.scheduler, embedded=True if args.embedded else None,
                       read_priority=args.read_priority, kv_spill_root=args.kv_spill_root)
    host, port = sock.getsockname()[:2]
    log.info("serving %s on http://%s:%d (max batch %d, scheduler %s)", state.model_name, host, port,
             args.max_batch, args.scheduler)
    notifier = Notifier()
    srv = server(app, sock, args.log_level)
    original_startup, original_shutdown = srv.startup, srv.shutdown

    async def startup(sockets=None):
        await original_startup(sockets=sockets)
        notifier.send(READY=1, STATUS=f"serving {state.model_name} on {host}:{port}")

    async def shutdown(sockets=None):
        notifier.send(STOPPING=1)
        await original_shutdown(sockets=sockets)
    srv.startup, srv.shutdown = startup, shutdown
    # uvicorn takes SIGTERM while it serves and, once shut down, raises it again under the handler
    # it found: with the default one the process would die of the signal. This one asks a server
    # not yet listening to stop at once, and is a no-op once it has stopped: exit status 0.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: setattr(srv, "should_exit", True))
    try:
        srv.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
