"""Helpers of the serve tests (a module of its own: ``conftest`` is a name every test folder has)."""
import threading
import time

import torch


def greedy(model, prompt_ids, n):
    """The model's own greedy continuation of ``prompt_ids``: ``n`` tokens, alone, no batching."""
    ids = torch.tensor([prompt_ids], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False)
    return out[0, len(prompt_ids):].tolist()


class Collector:
    """An engine ``on_event`` that records events and signals the end."""

    def __init__(self):
        self.events = []
        self.done = threading.Event()

    def __call__(self, kind, data):
        self.events.append((kind, data))
        if kind in ("done", "error"):
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(d["text"] for k, d in self.events if k == "token")

    def result(self, timeout=60.0):
        assert self.done.wait(timeout), "generation did not finish"
        return self.events[-1]


def serve_in_thread(app):
    """``app`` served by uvicorn on 127.0.0.1 (a free port) in a daemon thread, once it listens:
    ``(base_url, server, thread)``; stop it with ``stop_server``."""
    from deepseek_flash.serve.cli import listen, server

    sock = listen("127.0.0.1", 0)
    srv = server(app, sock, "warning")
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", srv, thread


def stop_server(srv, thread):
    srv.should_exit = True
    thread.join(30)
    assert not thread.is_alive()


DEGRADED_ONCE = ['deepseek_flash_serve_degrade_steps_total{step="temperature"} 1',
                 'deepseek_flash_serve_degrade_steps_total{step="top_p"} 1',
                 'deepseek_flash_serve_degrade_steps_total{step="max_new_tokens"} 1',
                 "deepseek_flash_serve_degraded_requests_total 1"]


def degrade_metrics(text: str) -> list:
    """The degrade counters' lines of a ``/metrics`` text (``DEGRADED_ONCE``: one request through
    the three steps)."""
    return [line for line in text.splitlines()
            if line.startswith(("deepseek_flash_serve_degrade_steps_total{",
                                "deepseek_flash_serve_degraded_requests_total "))]
