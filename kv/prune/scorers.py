"""Importance scorers of KV pruning: each cached token of a layer gets a score in 0..1 from what
the cache has observed about it (``TokenStats``), before each evaluation of the levels.

Signature of a scorer (a built-in or any callable given as ``prune_scorer``)::

    scorer(inp: ScoreInput) -> torch.Tensor   # [batch, n] scores in 0..1, on inp's device

``ScoreInput`` (below) holds, for the ``n`` scored tokens of one layer (the paged tokens: sinks
and the recent window are never scored): the attention they received (``mass``: an exponential
moving average over the last ``window`` observed steps of the attention share a token received,
relative to a uniform share -- 1.0 is "as much as the average attended token", summed over the
query heads), the share at the last observed step, how often they were observed, the key and value
norms per KV head, their positions and the layer. Higher means keep.

* ``"attention"`` (default, no training): ``x = mass * exp(-KEY_NORM_WEIGHT * z)`` where ``z`` is
  the token's key norm z-scored within the layer (mean over heads); score
  ``x / (x + ATTENTION_HALF)`` (``ATTENTION_HALF`` = 17/3). A token drawing the uniform share
  scores 0.15, the default threshold: at the default a page is demoted when its tokens draw less
  than an average token's share; 0.5 takes 17/3 of it. The key-norm term follows the observation that tokens with
  small key norms draw more attention (Devoto et al., 2024); never-observed tokens score 0.5.
* ``"mlp"``: the seed's two-layer MLP (``MLPScorer``): features of ``ScoreInput`` -> 32 -> 1,
  sigmoid; trained by ``bench/kv_prune_train.py`` to predict the attention share a token receives
  over the next steps. The cache holds no hidden states, so the MLP sees the token's projections of
  it -- per-head key and value norms -- plus the attention statistics.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

KEY_NORM_WEIGHT = 0.2
UNIFORM_SCORE = 0.15
"""The attention scorer's score of a token that draws exactly the uniform share (``mass`` 1.0):
the seed's default threshold, so that at the default a page is demoted when its tokens draw less
attention than an average token (docs/kv.md, "the attention scorer's calibration")."""
ATTENTION_HALF = (1.0 - UNIFORM_SCORE) / UNIFORM_SCORE
"""``x / (x + ATTENTION_HALF)``: the share (17/3 of the uniform one) that scores 0.5."""
MLP_FILE = "kv_prune_mlp.pt"
"""``prune_scorer="mlp"`` loads this file from the model's directory (a transformers model's
``name_or_path``, or the store of a ``load_model`` model) unless a path or an ``MLPScorer`` is
given."""


@dataclass
class ScoreInput:
    layer: int
    num_layers: int
    mass: torch.Tensor         # [b, n] fp32: moving average of the relative attention share
    mass_last: torch.Tensor    # [b, n] fp32: the share at the last observation
    observed: torch.Tensor     # [b, n] fp32: observations so far
    key_norms: torch.Tensor    # [b, kv_heads, n] fp32
    value_norms: torch.Tensor  # [b, kv_heads, n] fp32
    positions: torch.Tensor    # [n] int64: slot of each token in the sequence
    length: int                # tokens in the sequence


def _zscore(x: torch.Tensor) -> torch.Tensor:
    """z-score over the token axis (last), per row."""
    if x.shape[-1] < 2:
        return torch.zeros_like(x)
    return (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-6)


def attention_scorer(inp: ScoreInput) -> torch.Tensor:
    z = _zscore(inp.key_norms).mean(1)
    x = inp.mass.clamp(min=0) * torch.exp(-KEY_NORM_WEIGHT * z)
    score = x / (ATTENTION_HALF + x)
    return torch.where(inp.observed > 0, score, torch.full_like(score, 0.5))


def features(inp: ScoreInput) -> torch.Tensor:
    """The MLP's input ``[b, n, 5 + 2 * kv_heads]``."""
    b, n = inp.mass.shape
    age = (inp.length - inp.positions).float().clamp(min=0) / max(1, inp.length)
    cols = [torch.log1p(inp.mass.clamp(min=0)), torch.log1p(inp.mass_last.clamp(min=0)),
            torch.log1p(inp.observed) / 4.0, age.expand(b, n),
            torch.full((b, n), inp.layer / max(1, inp.num_layers - 1), device=inp.mass.device)]
    k = _zscore(inp.key_norms).transpose(1, 2)    # [b, n, h]
    v = _zscore(inp.value_norms).transpose(1, 2)
    return torch.cat([torch.stack(cols, -1), k, v], -1)


class MLPScorer(torch.nn.Module):
    """The seed's two-layer MLP: ``features`` -> ``hidden`` (ReLU) -> 1 (sigmoid)."""

    def __init__(self, kv_heads: int, hidden: int = 32):
        super().__init__()
        self.kv_heads = kv_heads
        self.net = torch.nn.Sequential(torch.nn.Linear(5 + 2 * kv_heads, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.net(x).squeeze(-1))

    @torch.no_grad()
    def __call__(self, inp):  # noqa: D102 - ScoreInput or a feature tensor
        if isinstance(inp, ScoreInput):
            if inp.key_norms.shape[1] != self.kv_heads:
                raise ValueError(f"MLP scorer trained for {self.kv_heads} KV heads, given "
                                 f"{inp.key_norms.shape[1]}")
            x = features(inp)
            net = self.net.to(x.device)
            return torch.sigmoid(net(x).squeeze(-1))
        return super().__call__(inp)

    def save(self, path) -> None:
        torch.save({"kind": "kv_prune_mlp", "kv_heads": self.kv_heads,
                    "hidden": self.net[0].out_features, "state_dict": self.state_dict()}, path)

    @classmethod
    def load(cls, path) -> "MLPScorer":
        data = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(data, dict) or data.get("kind") != "kv_prune_mlp":
            raise ValueError(f"{path}: not a KV pruning MLP (written by bench/kv_prune_train.py)")
        m = cls(int(data["kv_heads"]), int(data["hidden"]))
        m.load_state_dict(data["state_dict"])
        return m.eval()


def _model_dir(model) -> Path | None:
    flash = getattr(model, "flash", None)
    for cand in (getattr(getattr(flash, "info", None), "path", None),
                 getattr(flash, "path", None),
                 getattr(getattr(model, "config", None), "name_or_path", None),
                 getattr(model, "name_or_path", None)):
        if cand and Path(str(cand)).is_dir():
            return Path(str(cand))
    return None


def resolve_scorer(spec, model=None):
    """``"attention"``, ``"mlp"`` (``kv_prune_mlp.pt`` beside the model), a path to such a file,
    an ``MLPScorer`` or any callable -> a callable ``ScoreInput -> [b, n]``."""
    if spec == "attention":
        return attention_scorer
    if spec == "mlp":
        where = _model_dir(model) if model is not None else None
        if where is None or not (where / MLP_FILE).exists():
            raise ValueError(f"prune_scorer='mlp': no {MLP_FILE} beside the model "
                             f"({where or 'model directory unknown'}); train one with "
                             f"bench/kv_prune_train.py or pass its path")
        return MLPScorer.load(where / MLP_FILE)
    if isinstance(spec, (str, Path)):
        if not Path(spec).is_file():
            raise ValueError(f"prune_scorer {str(spec)!r}: 'attention', 'mlp', a scorer file or "
                             f"a callable")
        return MLPScorer.load(spec)
    if callable(spec):
        return spec
    raise ValueError(f"prune_scorer {spec!r}: 'attention', 'mlp', a scorer file or a callable")


STATS_CHUNK = 64
"""``TokenStats`` grows by whole chunks of this many tokens (no copy of the statistics per step)."""


class TokenStats:
    """What one layer has observed about its committed tokens (slots ``0 .. length - 1``):
    attention received (on the layer's device), key and value norms (on the host).

    Per token and sequence: 3 fp32 on the device (``mass``, ``last``, ``observed``: updated by
    every step's attention) -- 12 bytes, 0.3 % of an 8B shape's bf16 K and V (4,096 bytes) -- and
    2 fp32 per KV head on the host (``knorm``, ``vnorm``: fixed once the token is written, read
    only by an evaluation, which copies the scored slots over; page-locked with CUDA, written by
    an asynchronous copy). Buffers grow by ``STATS_CHUNK`` tokens at a time: ``nbytes()``
    (counted in ``gpu_bytes``) and ``host_nbytes()`` (in ``host_bytes``) are at most their
    per-token bytes times ``length + STATS_CHUNK - 1``, and a decode step appends in place."""

    def __init__(self, window: int = 32):
        self.alpha = 1.0 / window
        self.n = 0
        self._f = None      # [3, b, capacity] on the device: mass, last, observed
        self._norms = None  # [capacity, 2, b, h] on the host: key and value norms

    @property
    def capacity(self) -> int:
        return 0 if self._f is None else self._f.shape[-1]

    @property
    def mass(self):
        return None if self._f is None else self._f[0, :, :self.n]

    @property
    def last(self):
        return None if self._f is None else self._f[1, :, :self.n]

    @property
    def observed(self):
        return None if self._f is None else self._f[2, :, :self.n]

    @property
    def knorm(self):
        """``[b, h, n]`` (host)."""
        return None if self._norms is None else self._norms[:self.n, 0].permute(1, 2, 0)

    @property
    def vnorm(self):
        return None if self._norms is None else self._norms[:self.n, 1].permute(1, 2, 0)

    def _grow(self, b: int, h: int, need: int, device) -> None:
        cap = -(-need // STATS_CHUNK) * STATS_CHUNK
        pinned = torch.device(device).type == "cuda"
        f = torch.zeros((3, b, cap), dtype=torch.float32, device=device)
        norms = torch.empty((cap, 2, b, h), dtype=torch.float32, pin_memory=pinned)
        if self._f is not None:
            f[..., :self.n] = self._f[..., :self.n]
            if pinned:  # the norms' copies to the host are done before they are read here
                torch.cuda.current_stream(device).synchronize()
            norms[:self.n] = self._norms[:self.n]
        self._f, self._norms = f, norms

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """New tokens ``[b, h, t, d]`` join (not observed yet)."""
        b, h, t, _ = keys.shape
        if self.n + t > self.capacity:
            self._grow(b, h, self.n + t, keys.device)
        end = self.n + t
        kv = torch.linalg.vector_norm(torch.stack((keys, values)), dim=-1,
                                      dtype=torch.float32)  # [2, b, h, t]
        self._norms[self.n:end].copy_(kv.permute(3, 0, 1, 2),
                                      non_blocking=keys.device.type == "cuda")
        self.n = end  # mass, last, observed of the new slots: zeros since the buffer was made

    def observe(self, probs: torch.Tensor, cols: torch.Tensor | None) -> None:
        """``probs`` ``[b, n_cols]`` (each row sums to 1: the attention share of each attended
        committed slot, averaged over query heads and queries) for slots ``cols`` (``[b, n_cols]``
        int64, or None: slots 0..n_cols-1)."""
        b, n = probs.shape
        rel = probs.float() * n
        if cols is None:
            cols = torch.arange(n, device=probs.device).expand(b, n)
        # mass, last and observed of the slots in one gather and one scatter (a slot is attended
        # once per step: no index repeats)
        idx = cols.expand(3, b, n)
        old, _, seen = torch.gather(self._f, 2, idx)
        new = torch.where(seen > 0, old + self.alpha * (rel - old), rel)
        self._f.scatter_(2, idx, torch.stack((new, rel, seen + 1)))

    def input(self, layer: int, num_layers: int, start: int, stop: int, length: int) -> ScoreInput:
        """The ``ScoreInput`` of slots ``start .. stop - 1`` (their norms copied to the device:
        after the copies that wrote them, on the same stream)."""
        s = slice(start, stop)
        dev = self._f.device
        norms = self._norms[s].to(dev, non_blocking=dev.type == "cuda").permute(1, 2, 3, 0)
        return ScoreInput(layer, num_layers, self.mass[:, s], self.last[:, s],
                          self.observed[:, s], norms[0], norms[1],
                          torch.arange(start, stop, device=dev), length)

    def nbytes(self) -> int:
        """Bytes held on the device (the buffers' whole capacity)."""
        return 0 if self._f is None else self._f.numel() * self._f.element_size()

    def host_nbytes(self) -> int:
        """Bytes held on the host (the norms' buffer)."""
        return 0 if self._norms is None else self._norms.numel() * self._norms.element_size()


def attention_probs(query: torch.Tensor, keys: torch.Tensor, scale: float,
                    valid: torch.Tensor | None = None, causal_offset: int | None = None):
    """The attention share of each key ``[b, n]`` for ``query`` ``[b, hq, q, d]`` over ``keys``
    ``[b, h, n, d]`` (GQA), averaged over query heads and queries. ``valid`` ``[b, n]`` masks
    padding; with ``causal_offset`` query ``i`` sees keys ``< causal_offset + i + 1``."""
    b, hq, q, d = query.shape
    h = keys.shape[1]
    g = query.float().reshape(b, h, (hq // h) * q, d)
    logits = (g @ keys.float().transpose(-1, -2)) * scale  # [b, h, g*q, n]
    n = keys.shape[2]
    if causal_offset is not None:
        qpos = causal_offset + torch.arange(q, device=query.device)
        allowed = torch.arange(n, device=query.device)[None, :] <= qpos[:, None]  # [q, n]
        allowed = allowed.repeat(hq // h, 1)
        logits = logits.masked_fill(~allowed[None, None], -math.inf)
    if valid is not None:
        logits = logits.masked_fill(~valid[:, None, None, :], -math.inf)
    probs = logits.softmax(-1)
    if causal_offset is not None or valid is not None:
        probs = probs.nan_to_num_(0.0)  # a query that sees no key
    return probs.mean(dim=2).sum(1) / h
