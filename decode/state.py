"""The fixed device tensors a captured decode step reads and writes, and the step's eos rules.

One ``StepState`` per batch bucket (``engine.GraphDecoder`` keeps them): a graph captured over
these tensors is replayed with new values copied into them, never with new tensors.
"""
from __future__ import annotations

from . import request as requests


def is_eos(tokens, eos):
    """``torch.isin`` without its sorting path, which syncs with the host (a capture breaker)."""
    return (tokens[:, None] == eos[None, :]).any(dim=-1)


def suppress_eos(logits, st, step):
    """transformers' MinLength / MinNewTokensLength processors: eos logits -inf while fewer than
    ``min_new`` new tokens exist (``step``: the index of the token being chosen)."""
    return logits.masked_fill(st.eos_mask & (st.min_new > step), float("-inf"))


class StepState:
    """The fixed tensors one batch bucket's graphs read and write."""

    def __init__(self, batch: int, capacity: int, vocab: int, device, torch):
        i64 = dict(dtype=torch.int64, device=device)
        self.batch = batch
        self.tokens = torch.zeros(batch, **i64)
        self.valid_from = torch.zeros(batch, **i64)
        self.slot = torch.zeros(1, **i64)
        self.step = torch.zeros(1, **i64)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.out = torch.zeros(batch, capacity, **i64)
        self.done = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.eos = torch.full((requests.MAX_EOS,), -1, **i64)
        self.pad = torch.zeros(1, **i64)
        # min_new_tokens / min_length: eos logits are -inf while step < min_new.
        self.min_new = torch.zeros(1, **i64)
        self.eos_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.temperature = torch.ones(1, dtype=torch.float32, device=device)
        self.top_p = torch.ones(1, dtype=torch.float32, device=device)
        self.key_slots = torch.arange(capacity, **i64)
        self.logits = None          # (batch, steps, vocab) float32 while generate_with_logits runs

    def scalars(self):
        return (self.tokens, self.slot, self.step, self.finished)

    def snapshot(self):
        return [t.clone() for t in self.scalars()]

    def restore(self, saved) -> None:
        for t, s in zip(self.scalars(), saved):
            t.copy_(s)
