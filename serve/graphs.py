"""The running batch's decode step with fixed shapes, captured as CUDA graphs (``StaticDecode``).

An eager decode forward of an 8B Llama through transformers' modules issues ~1100 kernels; the
host issuing them, not the device, bounds the step (~26 ms on the H200 against ~5 ms of weight
reads), and an L0 request arriving during a step waits for all of it before its own prefill. Here
the step runs over **every row** of the ``RowCache`` at once, so its shapes depend only on the
attention width (a ``KV_BUCKET`` multiple): one CUDA graph per width, captured at start-up and
replayed at every step -- the ~1100 launches become one.

Per step the host writes each row's token and position into one static input buffer (one copy to
the device): a row that decodes gets its last token at its position; every other row -- free, in
the middle of its prompt, or on a tiered cache of its own -- gets the cache's *scratch* position
(``RowCache.scratch``, one slot past ``max_len``, which no attention width reads), so its keys go
where nothing reads them and its output is ignored. The mask is built inside the graph from the
positions (a query at ``p`` sees its row's keys ``0..p``), the new keys are scattered into the
cache at the positions, the logits land in one static buffer shared by every width's graph.

Where capture is impossible -- a CPU device, forward hooks on the model (a streamed model's layer
ring), a failed capture, a replay that differs from the same step run eagerly -- the runner keeps
its eager decode over the gathered rows, and the reason is logged once and kept in ``reason``.
``capture=False`` runs this same fixed-shape step eagerly (what the CPU tests check the step's
logic with).
"""
from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("deepseek_flash.serve")

# The check of a captured graph: the relative error (L2 norm) of its logits against the eager step's.
CHECK_TOLERANCE = 1e-2


def graphs_blocker(runner) -> str | None:
    """Why the decode step of ``runner`` (a ``RowRunner``) cannot be captured (None: it can)."""
    from ..decode.engine import capture_blocker

    if runner.device.type != "cuda":
        return f"CUDA graphs need a CUDA device (the model is on {runner.device.type})"
    # A load still in flight holds every layer behind a gate (a forward pre-hook each, removed
    # once all are open): wait for it, so that only hooks that stay are counted.
    wait_loaded = getattr(getattr(runner.model, "flash", None), "wait_loaded", None)
    if wait_loaded is not None:
        wait_loaded()
    return capture_blocker(runner.model)


class StaticDecode:
    """One fixed-shape decode step over all rows of ``runner.cache``; CUDA graphs per width when
    ``capture`` (see the module's doc)."""

    what = "decode steps"

    def __init__(self, runner, capture: bool = True):
        torch = runner.torch
        self.torch = torch
        self.runner = runner
        self.cache = runner.cache
        self.rows = self.cache.keys[0].shape[0]
        self.device = runner.device
        self.capture = bool(capture)
        head = runner.model.get_output_embeddings()
        vocab = getattr(head, "out_features", None) or runner.model.config.vocab_size
        # [0]: each row's token, [1]: its position; one host-to-device copy per step.
        self.inputs = torch.zeros((2, self.rows, 1), dtype=torch.long, device=self.device)
        self.inputs[1].fill_(self.cache.scratch)
        self.logits = torch.zeros((self.rows, vocab), dtype=runner.dtype, device=self.device)
        self.key_slots = torch.arange(self.cache.max_len, device=self.device)
        self.graphs: dict[int, object] = {}
        self.pool = None
        # Each instance (the decode's, the prompt forwards') captures on a stream of its own: the
        # cuBLAS workspace a graph bakes in is its capture stream's, so a prompt graph replayed
        # beside another graph (``beside.L0Beside``) never shares one with it.
        self.capture_stream = None
        self.reason: str | None = None
        self.counters = {"captures": 0, "capture_s": 0.0, "replays": 0, "static_steps": 0}

    # -- the step ---------------------------------------------------------------------------------
    def _step(self, kv_len: int) -> None:
        """The function each graph captures: every row's logits after its token at its position."""
        torch = self.torch
        ids, positions = self.inputs[0], self.inputs[1]
        self.cache.bind_static(positions, kv_len)
        allowed = self.key_slots[None, None, None, :kv_len] <= positions[:, None, :, None]
        mask = torch.zeros(allowed.shape, dtype=self.runner.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.runner.dtype).min)
        out = self.runner.call_model(ids, positions, mask)
        self.logits.copy_(out.logits[:, -1, :])

    def run(self, rows: list, last: list, lengths: list, kv_len: int):
        """Logits of ``rows`` (in that order) after each one's ``last`` token at its position
        ``lengths``; the attention reads ``kv_len`` positions (a ``KV_BUCKET`` multiple). None when
        the step cannot run here any more (capture failed: the caller decodes eagerly)."""
        torch = self.torch
        host = [[0] * self.rows, [self.cache.scratch] * self.rows]
        for row, token, pos in zip(rows, last, lengths):
            host[0][row], host[1][row] = token, pos
        self.inputs.copy_(torch.tensor(host, dtype=torch.long).view(2, self.rows, 1))
        # Made before the replay: a host-to-device copy waits for the stream's work, and ``run``
        # returns while the device still computes (``RowRunner.decode``'s ``meanwhile``).
        index = torch.tensor(rows, device=self.device)
        if self.capture:
            graph = self.graphs.get(kv_len)
            if graph is None:
                graph = self._capture(kv_len)
                if graph is None:
                    return None
            with torch.cuda.device(self.device):
                graph.replay()
            self.counters["replays"] += 1
        else:
            self._step(kv_len)
            self.counters["static_steps"] += 1
        return self.logits[index]

    # -- capture ----------------------------------------------------------------------------------
    def capture_all(self, widths) -> float:
        """Capture the graph of every width in ``widths`` now (start-up: no request holds a row,
        so the check may write keys anywhere); returns the seconds."""
        began = time.perf_counter()
        for kv_len in widths:
            if self.reason is not None:
                break
            if kv_len not in self.graphs:
                self._capture(kv_len, idle=True)
        return time.perf_counter() - began

    def _capture(self, kv_len: int, idle: bool = False):
        """Capture the step at ``kv_len`` (two eager runs on a side stream first, as CUDA graphs
        require), then check it: a replay on other inputs must give the logits the eager step
        gives (``idle``: no request holds a row, so those inputs may be real positions; otherwise
        every row stays at the scratch slot). Any failure switches the runner to its eager decode
        for good, with the reason."""
        torch = self.torch
        reason = graphs_blocker(self.runner)
        if reason is not None:
            return self._give_up(reason)
        t0 = time.perf_counter()
        with torch.cuda.device(self.device):
            saved = self._inputs(kv_len).clone()
            self._quiet(kv_len)
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            try:
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._step(kv_len)
                torch.cuda.current_stream(self.device).wait_stream(side)
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                # No collection inside the capture (a cycle freed there may release CUDA resources,
                # illegal while capturing; ``torch.cuda.graph`` collects once as it starts -- fast
                # after ``Engine.start``'s ``gc.freeze``); thread_local: the process's other
                # threads' CUDA calls neither join nor invalidate it.
                gc_was_enabled = gc.isenabled()
                gc.disable()
                try:
                    if self.capture_stream is None:
                        self.capture_stream = torch.cuda.Stream(device=self.device)
                    with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream,
                                          capture_error_mode="thread_local"):
                        self._step(kv_len)
                finally:
                    if gc_was_enabled:
                        gc.enable()
                differs = self._check(graph, kv_len, idle)
            except Exception as exc:   # noqa: BLE001 -- any capture failure: eager, with the reason
                try:
                    torch.cuda.synchronize(self.device)
                    self._inputs(kv_len).copy_(saved)
                except Exception:      # noqa: BLE001 -- the error is the capture's, reported below
                    pass
                return self._give_up(f"capture failed: {type(exc).__name__}: {exc}".splitlines()[0][:300])
            self._inputs(kv_len).copy_(saved)
        if differs is not None:
            return self._give_up(differs)
        self.graphs[kv_len] = graph
        self.counters["captures"] += 1
        self.counters["capture_s"] += time.perf_counter() - t0
        return graph

    def _check(self, graph, kv_len: int, idle: bool) -> str | None:
        """Replay ``graph`` on inputs other than the capture's (each row a token of its own and,
        when ``idle``, a position of its own within the width) and run the same step eagerly: the
        logits must agree."""
        torch = self.torch
        self._varied(kv_len, idle)
        graph.replay()
        replayed = self.logits.clone()
        self._step(kv_len)
        torch.cuda.synchronize(self.device)
        eager = self.logits.float()
        # The same kernels on the same inputs: equal but for a library's choice of algorithm under
        # capture; a graph that baked an input in (a position, a token) is off by far more.
        error = ((replayed.float() - eager).norm() / eager.norm().clamp_min(1e-6)).item()
        if not error <= CHECK_TOLERANCE:
            return (f"a replay of the width-{kv_len} graph differs from the eager step "
                    f"(relative error {error:.3g})")
        return None

    def _inputs(self, key):
        """The static input buffer the graph of ``key`` reads."""
        return self.inputs

    def _quiet(self, key) -> None:
        """Inputs of the capture runs: every row at the scratch slot (nothing real is written)."""
        self.inputs[0].zero_()
        self.inputs[1].fill_(self.cache.scratch)

    def _varied(self, kv_len, idle: bool) -> None:
        """Inputs of the check: a token of its own per row and, when ``idle``, a position too."""
        torch = self.torch
        rows = torch.arange(self.rows, device=self.device)
        self.inputs[0].copy_((rows * 7 + 3)[:, None] % self.logits.shape[1])
        if idle:
            self.inputs[1].copy_((kv_len - 1 - rows % kv_len)[:, None])

    def _give_up(self, reason: str):
        self.reason = reason
        self.graphs.clear()
        log.warning("serve %s run eagerly: %s", self.what, reason)
        return None

    def stats(self) -> dict:
        return {"mode": "graphs" if self.capture and self.reason is None else "static",
                "reason": self.reason, "graphs": len(self.graphs), **self.counters}


# The prompt forwards captured at start-up: up to 4 rows (padded with rows that write at the scratch
# slot), prompt chunks padded on the left to one of these widths (a longer chunk runs eagerly: its
# launch overhead matters less beside its compute, and each width costs captures at start-up).
PREFILL_ROWS = (1, 2, 4)
PREFILL_WIDTHS = (16, 32, 64, 128)
# The L0 requests' own prompt graphs (``RowRunner.static_prefill_l0``): one or two rows.
L0_PREFILL_ROWS = (1, 2)


class StaticPrefill(StaticDecode):
    """Prompt forwards of fixed shapes -- (rows, width, attention width), captured at start-up
    (``capture_all``) for rows 1, 2, 4 and widths 16, 32, 64, 128 (attention over the width's
    64-key bucket and the next one) and, ``deep`` (the batch's prompts, not the L0 ones), one row of
    128 tokens at every attention width (``keys``); a prompt forward of another shape runs eagerly. The host pads the
    rows on the left with the row's next position (as the eager forward does) and adds rows at
    the scratch slot up to the bucket. An eager prefill is launch-bound like the decode, and under
    load it also waits for the server's other thread to let it hold the interpreter: ~14 ms
    unloaded, 27-32 ms under load on the H200."""

    what = "prompt forwards"

    def __init__(self, runner, capture: bool = True, chunk: int = 512, rows=PREFILL_ROWS, deep: bool = False):
        super().__init__(runner, capture)
        self.deep = bool(deep)
        self.inputs = None
        self.buffers: dict[tuple, object] = {}
        self.row_buckets = [r for r in rows if r <= self.rows]
        self.set_chunk(chunk)
        self.logits = self.logits[: max(self.row_buckets)]

    def set_chunk(self, chunk: int) -> None:
        """Widths up to the engine's prefill chunk (and the cache's length)."""
        limit = min(chunk, self.cache.max_len)
        self.widths = [w for w in PREFILL_WIDTHS if w <= limit] or [limit]

    def covers(self, rows: int, width: int, kv_len: int) -> bool:
        """Whether a prompt forward of ``rows`` rows, ``width`` tokens each, reading ``kv_len`` key
        positions runs from a graph captured at start-up."""
        return self._key(rows, width, self.runner.bucket(kv_len)) is not None

    def _key(self, rows: int, width: int, kv_len: int):
        """The (rows, width, attention width) a forward of this shape runs as: rows and tokens
        padded up to the nearest bucket that has a graph at ``kv_len`` (a wider one where the
        nearest has none: a long prompt's last chunk runs as the widest width's deep graph, its
        padding written at the row's next position as any); None when none has."""
        if self.reason is not None:
            return None
        n = next((r for r in self.row_buckets if r >= rows), None)
        if n is None:
            return None
        for w in self.widths:
            if w >= width and (not self.capture or (n, w, kv_len) in self.graphs):
                return n, w, kv_len
        return None

    def widest(self) -> int:
        """The widest prompt chunk a graph runs."""
        return self.widths[-1]

    def keys(self) -> list:
        """The (rows, width, attention width) captured at start-up: each rows x width over the
        width's attention bucket and the next one (a prompt's first chunk) and, when ``deep``, one
        row of the widest width at every attention width up to the cache's length too (any chunk
        of a long prompt, ``Engine._step``)."""
        bucket = self.runner.bucket
        out = []
        for n in self.row_buckets:
            for w in self.widths:
                kvs = {bucket(w), bucket(w + 1)}
                if self.deep and n == 1 and w == self.widest():
                    k = bucket(w)
                    while k < self.cache.max_len:
                        k = bucket(k + 1)
                        kvs.add(k)
                for k in sorted(kvs):
                    out.append((n, w, k))
        return out

    def _inputs(self, key):
        n, w, _ = key
        buf = self.buffers.get((n, w))
        if buf is None:
            # Per row: its cache row, then ``w`` token ids, then ``w`` positions.
            buf = self.buffers[(n, w)] = self.torch.zeros((n, 1 + 2 * w), dtype=self.torch.long,
                                                          device=self.device)
            buf[:, 1 + w:] = self.cache.scratch
        return buf

    def _step(self, key) -> None:
        torch = self.torch
        n, w, kv_len = key
        buf = self._inputs(key)
        rows, ids, positions = buf[:, 0], buf[:, 1:1 + w], buf[:, 1 + w:]
        self.cache.bind(rows, positions, kv_len)
        allowed = self.key_slots[None, None, None, :kv_len] <= positions[:, None, :, None]
        mask = torch.zeros(allowed.shape, dtype=self.runner.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.runner.dtype).min)
        out = self.runner.call_model(ids, positions, mask)
        self.logits[:n].copy_(out.logits[:, -1, :])

    def _quiet(self, key) -> None:
        buf = self._inputs(key)
        w = key[1]
        buf[:, : 1 + w].zero_()
        buf[:, 1 + w:] = self.cache.scratch

    def _varied(self, key, idle: bool) -> None:
        torch = self.torch
        n, w, kv_len = key
        buf = self._inputs(key)
        rows = torch.arange(n, device=self.device)
        buf[:, 0] = rows
        buf[:, 1:1 + w] = (rows[:, None] * 7 + torch.arange(w, device=self.device)[None, :] + 3) % self.logits.shape[1]
        if idle:
            buf[:, 1 + w:] = torch.arange(w, device=self.device)[None, :] % kv_len

    def capture_all(self, widths=None) -> float:
        return super().capture_all(self.keys())

    def run(self, rows: list, ids: list, positions: list, kv_len: int):
        """Logits at the last position of each of ``rows`` after ``ids`` at ``positions`` (lists
        per row, of equal length; ``kv_len`` a ``KV_BUCKET`` multiple) from a captured graph; None
        when no graph has this shape (the caller runs the forward eagerly)."""
        torch = self.torch
        width = len(ids[0])
        key = self._key(len(rows), width, kv_len)
        if key is None:
            return None
        n, w, _ = key
        graph = self.graphs.get(key)
        host = []
        for i in range(n):
            if i < len(rows):
                pad = w - width
                nxt = min(positions[i][-1] + 1, self.cache.scratch)
                host.append([rows[i]] + [0] * pad + list(ids[i]) + [nxt] * pad + list(positions[i]))
            else:
                host.append([rows[0]] + [0] * w + [self.cache.scratch] * w)
        src = torch.tensor(host, dtype=torch.long)
        if self.device.type == "cuda":
            # From page-locked memory, in the current stream's order: a prompt beside another
            # forward (``side_stream``) does not wait for it to copy its inputs.
            src = src.pin_memory()
        self._inputs(key).copy_(src, non_blocking=True)
        if self.capture:
            with torch.cuda.device(self.device):
                graph.replay()
            self.counters["replays"] += 1
        else:
            self._step(key)
            self.counters["static_steps"] += 1
        return self.logits[: len(rows)]
