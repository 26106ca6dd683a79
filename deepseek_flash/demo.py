"""``deepseek-flash demo``: the whole data path end to end on a tiny random model, step by step.

Make a Llama-shaped model (``testing.make_tiny_model``, no download), pack it into a block store,
verify every block, start a controller (in this process by default; ``--daemon`` runs the real
``deepseek-flashd`` on a private socket and runtime dir and stops it after), load the model through
``load_model`` and check that greedy tokens equal plain ``transformers``', lease each decoder layer
through the ``Client`` and check the served bytes equal the store's, then print the controller's
status. Needs no root, no systemd and no running daemon.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .ops.install_units import daemon_argv

HELP = "make, pack, verify and serve a tiny random model end to end (no root, no daemon needed)"
DESCRIPTION = """Run the product end to end on a tiny random Llama-shaped model and say what each step
did: make the model (transformers, random weights), pack it into a block store, verify every block's
crc32c, start a controller (embedded in this process; --daemon: the real deepseek-flashd on a
private socket and runtime dir, stopped afterwards), load the model through load_model and compare
its greedy tokens with plain transformers', acquire each decoder layer through the Client and
compare the served bytes with the store's, and print the controller's status (the daemon's status
file with --daemon, the embedded controller's status otherwise).

Exit status: 0 every check passed, 1 a check failed, 2 error (e.g. --keep DIR not empty)."""

NUM_LAYERS = 4
NEW_TOKENS = 8
CONFIG = {"host_cache_bytes": "64MiB", "unified_memory_ratio": 0.05}


class DemoFailed(Exception):
    """A check of the demo did not hold (exit status 1)."""


def add_arguments(parser) -> None:
    parser.add_argument("--daemon", action="store_true",
                        help="run the real deepseek-flashd (temp socket and runtime dir) instead of "
                             "an in-process controller")
    parser.add_argument("--device", default="cpu", metavar="DEV",
                        help="cpu (default) or cuda[:N]: where load_model puts the weights")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="work in DIR (created; must be empty) and keep the model, store and "
                             "daemon log there; default: a temp dir removed afterwards")


def _step(n: int, text: str) -> None:
    print(f"[{n}] {text}", flush=True)


class _DaemonProcess:
    """``deepseek-flashd`` with every root in a private temp tree."""

    def __init__(self, work: Path):
        import json

        # AF_UNIX paths are limited to 108 bytes: the socket lives in a short /tmp dir.
        self.short = Path(tempfile.mkdtemp(prefix="dfdemo-", dir="/tmp"))
        self.runtime = self.short / "rt"
        self.socket = self.runtime / "control.sock"
        self.config = work / "flash.json"
        self.config.write_text(json.dumps(CONFIG))
        self.log_path = work / "daemon.log"
        env = dict(os.environ)
        for key in ("LISTEN_FDS", "LISTEN_PID", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
            env.pop(key, None)
        env.update(DEEPSEEK_FLASH_RUNTIME_DIR=str(self.runtime), DEEPSEEK_FLASH_SOCKET=str(self.socket),
                   DEEPSEEK_FLASH_CONFIG=str(self.config), DEEPSEEK_FLASH_STATE_DIR=str(work / "state"))
        self._log = open(self.log_path, "wb")  # noqa: SIM115 -- the daemon's stdout for its life
        self.proc = subprocess.Popen(daemon_argv(), env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    def connect(self, timeout: float = 60.0):
        from .client import Client
        from .errors import DaemonNotRunning

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise DemoFailed(f"deepseek-flashd exited with status {self.proc.returncode} before "
                                 f"serving {self.socket}; log:\n{self.log()}")
            try:
                return Client(self.socket, embedded=False)
            except DaemonNotRunning:
                if time.monotonic() > deadline:
                    raise DemoFailed(f"deepseek-flashd did not serve {self.socket} within "
                                     f"{timeout:.0f} s; log:\n{self.log()}") from None
                time.sleep(0.05)

    def status_text(self, until: str, timeout: float = 10.0) -> str:
        """The daemon's status file once it shows ``until`` (its status thread publishes within
        0.1 s of a change, so a read right after the last request can still show the tree from
        before the model was opened); after ``timeout``, whatever it shows."""
        path = self.runtime / "status"
        deadline = time.monotonic() + timeout
        while True:
            try:
                text = path.read_text()
            except FileNotFoundError:
                text = None
            if text is not None and (until in text or time.monotonic() > deadline):
                return text
            if text is None and time.monotonic() > deadline:
                raise DemoFailed(f"the daemon wrote no {path} within {timeout:.0f} s")
            time.sleep(0.05)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 30.0) -> int:
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    return self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                    return -signal.SIGKILL
            return self.proc.returncode
        finally:
            self._log.close()
            shutil.rmtree(self.short, ignore_errors=True)


def _work_dir(keep: Path | None):
    if keep is None:
        return Path(tempfile.mkdtemp(prefix="deepseek-flash-demo-")), True
    from .errors import ConfigError

    if keep.exists() and (not keep.is_dir() or any(keep.iterdir())):
        raise ConfigError(f"--keep {keep}: exists and is not an empty directory", key="--keep",
                          value=str(keep), allowed="a new or empty directory")
    keep.mkdir(parents=True, exist_ok=True)
    return keep, False


def demo(args) -> None:
    import torch
    import transformers

    from .client import Client
    from .client.model import load_model
    from .store import Store, pack
    from .store.verify import verify_store
    from .sysfs_shim.publisher import format_fields
    from .testing import load_reference, make_tiny_model

    # The demo prints its own steps; transformers' save/load bars would only interleave with them.
    transformers.utils.logging.disable_progress_bar()
    work, remove = _work_dir(args.keep)
    daemon = None
    try:
        t = time.perf_counter()
        src = make_tiny_model(work / "tiny-llama", "llama", num_layers=NUM_LAYERS, seed=0)
        _step(1, f"made a random Llama-shaped model ({NUM_LAYERS} layers, float32) in {src} "
                 f"({time.perf_counter() - t:.2f} s)")
        t = time.perf_counter()
        store_path = pack(src, work / "store")
        store = Store.open(store_path)
        _step(2, f"packed it into {store_path}: {len(store.blocks)} blocks, {store.total_bytes} bytes "
                 f"({time.perf_counter() - t:.2f} s)")
        report = verify_store(store)
        if not report.ok:
            raise DemoFailed(f"verify found bad blocks: {report.bad}")
        _step(3, f"verified {report.blocks} blocks ({report.bytes} bytes): every crc32c and inline "
                 f"header matches")
        if args.daemon:
            daemon = _DaemonProcess(work)
            client = daemon.connect()
            _step(4, f"started deepseek-flashd (pid {daemon.proc.pid}) on {daemon.socket}")
        else:
            client = Client(embedded=True, config=CONFIG)
            _step(4, "started the controller in this process (embedded)")
        with client:
            t = time.perf_counter()
            model = load_model(store_path, device=args.device, client=client)
            try:
                ref = load_reference(src, device=args.device)
                ids = torch.tensor([[1, 17, 42, 99, 7, 3]], device=args.device)
                mask = torch.ones_like(ids)
                with torch.inference_mode():
                    got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                         do_sample=False, pad_token_id=0)
                    want = ref.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                        do_sample=False, pad_token_id=0)
                if not torch.equal(got, want):
                    raise DemoFailed(f"tokens differ from plain transformers: {got.tolist()} vs "
                                     f"{want.tolist()}")
                _step(5, f"load_model on {args.device} ({client.mode}, "
                         f"{(time.perf_counter() - t) * 1e3:.0f} ms incl. generate) generated "
                         f"{got[0, ids.shape[1]:].tolist()}: identical to plain transformers")
            finally:
                model.flash.close()
            info = client.open_model(store_path)
            arena = client.arena
            for layer in range(info.num_layers):
                lease = client.acquire(info, layer=layer)
                try:
                    for bid, offset in lease.blocks.items():
                        block = store.block(bid)
                        served = bytes(arena.view(offset, block.length))
                        if served != store.read_block(bid):
                            raise DemoFailed(f"layer {layer} block {bid} ({block.role}): served bytes "
                                             f"differ from the store's")
                    roles = ", ".join(store.block(b).role for b in sorted(lease.blocks))
                    _step(6, f"acquired layer {layer} through the Client: lease {lease.id}, blocks "
                             f"{sorted(lease.blocks)} ({roles}) -- bytes equal the store's")
                finally:
                    client.release(lease)
            if daemon is not None:
                text = daemon.status_text(until=f"semantic_block_count: {len(store.blocks)}\n")
                _step(7, f"status ({daemon.runtime / 'status'}):")
            else:
                text = format_fields(client.status()["status"], status=True)
                _step(7, "status (embedded controller):")
            sys.stdout.write("".join(f"    {line}\n" for line in text.splitlines()))
            if "controller_state: ACTIVE" not in text:
                raise DemoFailed("the controller is not ACTIVE")
        if daemon is not None:
            rc = daemon.stop()
            daemon = None
            if rc != 0:
                raise DemoFailed(f"deepseek-flashd exited with status {rc} after SIGTERM")
            _step(8, "stopped deepseek-flashd (SIGTERM, exit status 0)")
        print(f"demo OK{f'; files kept in {work}' if not remove else ''}")
    finally:
        if daemon is not None:
            daemon.stop()
        if remove:
            shutil.rmtree(work, ignore_errors=True)


def run(args) -> int:
    try:
        demo(args)
    except DemoFailed as exc:
        print(f"deepseek-flash demo: FAILED: {exc}", file=sys.stderr)
        return 1
    return 0
