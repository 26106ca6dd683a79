"""The pure rules of KV importance pruning (table-tested in tests/kv/test_prune_policy.py): the
compensation factor, the pattern offsets, and how a page moves between the three levels.

* **Compensation** (seed §2.2): when fewer than ``COMPENSATION_TOKENS`` (32) tokens are active
  (levels 1 and 2), every score is multiplied by ``(32 / N_active) ** 0.3``, so the last active
  tokens are not demoted as easily. ``N_active`` counts every token of the layer at level 1 or 2:
  sinks and the recent window (always on the device) included -- so with the defaults (4 sinks,
  a recent window of at least 64 tokens) the factor never acts: the window itself keeps more than
  32 tokens active. It acts when ``sink_tokens + gpu_tokens`` is below 32. ``N_active`` of 0
  counts as 1.
* **Offsets** (seed §2.1): a page holding a token that matches a pattern gets ``+offset`` (the
  seed's is +0.08) added to its score (the largest of its tokens' offsets; several patterns
  matching one token add up). Applied after the compensation; the result is clipped to 0..1.
* **Levels**: 1 = full precision on the device, 2 = full precision on the host, 3 = compressed
  (int4, kv/prune/compress.py) on the host. At each evaluation a page whose score is at or above
  the threshold goes (back) to level 1 -- a promotion when it was lower; a page below it moves one
  level down, 1 -> 2 -> 3 (the seed's queue): a page needs two evaluations below the threshold in
  a row to be compressed. A page's score is the mean score of its tokens -- for the attention
  scorer about its share of attention against an average page's -- and the highest over the
  sequences of the batch (one level per page serves the whole batch).
"""
from __future__ import annotations

import torch

COMPENSATION_TOKENS = 32
COMPENSATION_POWER = 0.3
DEFAULT_THRESHOLD = 0.15
DEFAULT_OFFSET = 0.08
LEVELS = (1, 2, 3)


def compensation(n_active: int, enabled: bool = True) -> float:
    """The factor scores are multiplied by: ``(32 / N_active) ** 0.3`` when fewer than 32 tokens
    are active, else 1 (and always 1 when ``enabled`` is False)."""
    if not enabled or n_active >= COMPENSATION_TOKENS:
        return 1.0
    return (COMPENSATION_TOKENS / max(1, int(n_active))) ** COMPENSATION_POWER


def adjust_scores(scores: torch.Tensor, n_active: int, offsets: torch.Tensor | None = None, *,
                  compensate: bool = True) -> torch.Tensor:
    """``scores`` (any shape, 0..1) times the compensation, plus ``offsets`` (same shape or
    broadcastable; None: no offset), clipped to 0..1."""
    out = scores * compensation(n_active, compensate)
    if offsets is not None:
        out = out + offsets
    return out.clamp(0.0, 1.0)


def page_scores(token_scores: torch.Tensor, page_tokens: int) -> torch.Tensor:
    """``token_scores`` ``[batch, n_pages * page_tokens]`` -> ``[n_pages]``: the mean over each
    page's tokens, the highest over the sequences."""
    b, t = token_scores.shape
    return token_scores.view(b, t // page_tokens, page_tokens).mean(2).amax(0)


def page_offsets(token_offsets: torch.Tensor, page_tokens: int) -> torch.Tensor:
    """``token_offsets`` ``[batch, n_pages * page_tokens]`` -> ``[n_pages]``: the largest offset of
    a page's tokens over every sequence."""
    b, t = token_offsets.shape
    return token_offsets.view(b, t // page_tokens, page_tokens).amax(dim=(0, 2))


def next_levels(levels: torch.Tensor, scores: torch.Tensor, threshold: float,
                l1_cap: int | None = None):
    """One evaluation: ``levels`` (int8 ``[n]``, values 1..3) and page ``scores`` ``[n]`` -> new
    levels, and bool masks ``promoted`` (moved up to 1) and ``demoted`` (moved down).

    ``l1_cap``: level 1 holds at most that many pages -- of the pages at or above the threshold
    the best-scored stay (ties: the lower page), the others wait at level 2 (a level-3 page stays
    at 3: its int4 form has nothing more to give back); None: unbounded."""
    keep = scores >= threshold
    new = torch.where(keep, torch.ones_like(levels), (levels + 1).clamp(max=3))
    if l1_cap is not None:
        up = torch.nonzero(keep).flatten()
        if up.numel() > l1_cap:
            order = torch.sort(-scores[up].float(), stable=True).indices
            over = up[order[l1_cap:]]
            new[over] = levels[over].clamp(min=2)
    promoted = (new == 1) & (levels > 1)
    demoted = new > levels
    return new, promoted, demoted
