"""One request's state in the engine, and what its tokens become: the text its client is sent, where
it stops, when it is done. The engine decides when a request runs and on which row; this module
only turns each new token into the events of that request.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .scheduler import SchedRequest


@dataclass(eq=False)
class Generation:
    """One request's state in the engine. ``on_event(kind, data)`` is called from the engine thread
    with ``("token", {"text": delta, "token": id})``, then ``("done", {...})`` or
    ``("error", FlashError)``."""

    sched: SchedRequest
    prompt_ids: list
    on_event: object
    stop_ids: frozenset = frozenset()
    stop_strings: tuple = ()
    seed: int | None = None
    prefetch_window: int | None = None
    row: int | None = None
    prefilled: int = 0
    output_ids: list = field(default_factory=list)
    text: str = ""
    sent: int = 0                       # characters of ``text`` already emitted
    prefix_offset: int = 0              # incremental detokenization window (see ``detokenize``)
    read_offset: int = 0
    finish_reason: str | None = None
    cancelled: bool = False
    first_token_at: float | None = None
    received_at: float | None = None    # the HTTP handler had the request (time.monotonic)
    first_write_at: float | None = None  # its first token's chunk went to the HTTP server to write
    bytes_streamed_at_start: int = 0
    generator: object = None
    kv_options: dict | None = None      # for_model arguments: runs on a TieredCache of its own
    kv_cache: object = None
    fill_ids: list = None               # what prefill puts in the cache: the prompt, or after a
    resumed: bool = False               # preemption the prompt and the tokens generated but the last
    dispatched: bool = False

    def __post_init__(self):
        if self.fill_ids is None:
            self.fill_ids = self.prompt_ids
        # A request on a tiered KV cache of its own keeps its row (its cache is not recomputed).
        self.sched.preemptible = self.kv_options is None

    def cancel(self) -> None:
        """The client went away: the engine frees the row at the next step boundary."""
        self.cancelled = True

    def rewind(self) -> None:
        """The request lost its row (preempted): when it joins again it prefills its prompt and the
        tokens it generated but the last (whose keys were in the row), then decodes on from the
        last -- its client sees no gap but the wait."""
        self.row = None
        self.prefilled = 0
        self.resumed = bool(self.output_ids)
        self.fill_ids = self.prompt_ids + self.output_ids[:-1] if self.output_ids else self.prompt_ids

    def take(self, token: int, eos_ids, max_len: int, tokenizer) -> str | None:
        """Append ``token`` (unless it is a stop or end-of-text token), emit the new text, and
        return the finish reason (``"stop"``, ``"length"``) when the request is done, else None.
        ``max_len``: tokens a request may hold, prompt and output."""
        reason = None
        appended = token not in self.stop_ids and token not in eos_ids
        if appended:
            self.output_ids.append(token)
        else:
            reason = "stop"
        n = len(self.output_ids)
        self.sched.generated = n
        if reason is None and (n >= self.sched.max_new_tokens or len(self.prompt_ids) + n >= max_len):
            reason = "length"
        before = len(self.text)
        self.detokenize(tokenizer, final=reason is not None)
        if self.stop_strings and len(self.text) > before:
            # Only the new text (and the longest stop string's reach back into the old) can match.
            start = max(0, before - max(len(s) for s in self.stop_strings) + 1)
            hits = [at for at in (self.text.find(stop, start) for stop in self.stop_strings) if at >= 0]
            if hits:
                self.text, reason = self.text[:min(hits)], "stop"
        # Hold back the tail that may still become a stop string.
        ready = len(self.text)
        if reason is None and self.stop_strings:
            hold = max(len(s) for s in self.stop_strings) - 1
            ready = max(self.sent, ready - hold)
        # One event per generated token (its text may be empty while held back), so a stream shows
        # progress -- and the time to the first token -- even before the text is printable.
        if ready > self.sent or appended:
            self.on_event("token", {"text": self.text[self.sent: ready], "token": token})
            self.sent = ready
        return reason

    def detokenize(self, tokenizer, final: bool) -> None:
        """Extend ``text`` by the characters the new tokens complete, decoding only a window of the
        last tokens (not the whole output at every token): the window from ``prefix_offset`` keeps
        the context a tokenizer needs for a leading space, and text that ends in an incomplete UTF-8
        sequence waits for the next token -- except at the end (``final``), where the whole
        output's decode is what is answered."""
        ids = self.output_ids
        decode = tokenizer.decode
        prefix = decode(ids[self.prefix_offset: self.read_offset], skip_special_tokens=True)
        new = decode(ids[self.prefix_offset:], skip_special_tokens=True)
        if final or (len(new) > len(prefix) and not new.endswith("\ufffd")):
            self.text += new[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
