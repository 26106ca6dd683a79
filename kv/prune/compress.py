"""Level 3 of KV pruning: a page's keys and values as 4-bit integers with per-group scales, the
form a long-unimportant page takes on the host (docs/kv.md, "Importance pruning").

Why this and not the seed's "keep K, drop V, recompute V when needed": a value vector is
``W_v · norm(h)`` of the token's hidden state ``h``, which the cache does not hold; ``V`` cannot be
derived from ``K`` (another projection of the same ``h``, with RoPE applied) nor from the query.
Recomputing it means keeping ``h`` (as large as K and V together for most models) or re-running
the layers below, so "drop V" either loses the token or saves nothing. Quantizing both K and V to
int4 keeps every token attendable at about a quarter of bf16's bytes, and it comes back (lossy,
with a bounded error) whenever top-K selection or a higher score asks for it.

Groups (the KIVI split: keys have outlier *channels*, values do not):

* K: per (head, channel), over the page's tokens -- ``[.., heads, 1, head_dim]`` minimum and step;
* V: per (head, token), over the channels -- ``[.., heads, page_tokens, 1]``.

Asymmetric: ``q = round((x - lo) / step)`` in 0..15, ``x' = lo + q * step``, ``step = (hi - lo) /
15``. ``lo`` and ``step`` are stored in fp16, rounded so that ``lo <= min`` and ``lo + 15 * step >=
max`` still hold; then every element comes back within ``step / 2`` (plus fp32 rounding) of its
original -- ``round_trip_bound`` gives that bound per element and tests/kv/test_prune_compress.py
checks it. Two codes share a byte (low nibble first).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LEVELS = 15  # 4 bits: codes 0..15


def _round_down_half(x: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float16)
    over = h.float() > x
    return torch.where(over, torch.nextafter(h, torch.full_like(h, float("-inf"))), h)


def _round_up_half(x: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float16)
    under = h.float() < x
    return torch.where(under, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def _quantize(x: torch.Tensor, dim: int):
    """x (fp32) -> codes uint8 (same shape), lo and step fp16 (``dim`` reduced, kept)."""
    lo = _round_down_half(x.amin(dim, keepdim=True))
    hi = x.amax(dim, keepdim=True)
    step = _round_up_half((hi - lo.float()) / LEVELS)
    step = torch.where(step > 0, step, torch.ones_like(step))
    # lo + 15 * step must reach hi in fp32 after fp16 rounding of step: nudge up where it does not
    short = lo.float() + LEVELS * step.float() < hi
    step = torch.where(short, torch.nextafter(step, torch.full_like(step, float("inf"))), step)
    codes = ((x - lo.float()) / step.float()).round_().clamp_(0, LEVELS).to(torch.uint8)
    return codes, lo, step


def _pack(codes: torch.Tensor) -> torch.Tensor:
    flat = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return flat[..., 0] | (flat[..., 1] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), -1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


@dataclass
class CompressedPages:
    """int4 pages: ``shape`` is the original ``[..., 2, heads, page_tokens, head_dim]``."""

    k_codes: torch.Tensor  # uint8 [..., heads, page_tokens, head_dim / 2]
    v_codes: torch.Tensor
    k_lo: torch.Tensor     # fp16 [..., heads, 1, head_dim]
    k_step: torch.Tensor
    v_lo: torch.Tensor     # fp16 [..., heads, page_tokens, 1]
    v_step: torch.Tensor
    shape: tuple
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (
            self.k_codes, self.v_codes, self.k_lo, self.k_step, self.v_lo, self.v_step))

    def to(self, device, non_blocking: bool = False) -> "CompressedPages":
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return CompressedPages(move(self.k_codes), move(self.v_codes), move(self.k_lo),
                               move(self.k_step), move(self.v_lo), move(self.v_step),
                               self.shape, self.dtype)


    def select(self, i: int) -> "CompressedPages":
        """Page ``i`` of a batch compressed together, as its own tensors (copies: the batch is
        not kept alive by one page)."""
        pick = lambda t: t[i].clone()  # noqa: E731
        return CompressedPages(pick(self.k_codes), pick(self.v_codes), pick(self.k_lo),
                               pick(self.k_step), pick(self.v_lo), pick(self.v_step),
                               tuple(self.shape[1:]), self.dtype)


FIELDS = ("k_codes", "v_codes", "k_lo", "k_step", "v_lo", "v_step")


def to_rows(pages: list[CompressedPages]) -> torch.Tensor:
    """Pages compressed apart (equal shapes, CPU) as bytes, one row per page ``[n, nbytes]``
    uint8: the six tensors of each page back to back in ``FIELDS`` order (the spill form)."""
    return torch.stack([torch.cat([getattr(c, f).contiguous().view(-1).view(torch.uint8)
                                   for f in FIELDS]) for c in pages])


def from_rows(rows: torch.Tensor, like: CompressedPages, copy: bool = True) -> CompressedPages:
    """``to_rows``' bytes ``[n, nbytes]`` back to a batch ``[n, ...]`` shaped like page ``like``;
    ``copy=False``: views of ``rows`` where the fields' offsets allow it (valid while ``rows``
    is)."""
    n = rows.shape[0]
    out, at = {}, 0
    for f in FIELDS:
        t = getattr(like, f)
        size = t.numel() * t.element_size()
        part = rows[:, at:at + size]
        if copy or at % t.element_size() or rows.stride(0) % t.element_size():
            part = part.contiguous()
        out[f] = part.view(t.dtype).reshape(n, *t.shape)
        at += size
    return CompressedPages(**out, shape=(n, *like.shape), dtype=like.dtype)


def stack_compressed(pages: list[CompressedPages]) -> CompressedPages:
    """Pages compressed apart (equal shapes) as one batch ``[n, ...]``."""
    st = lambda name: torch.stack([getattr(c, name) for c in pages])  # noqa: E731
    return CompressedPages(st("k_codes"), st("v_codes"), st("k_lo"), st("k_step"), st("v_lo"),
                           st("v_step"), (len(pages), *pages[0].shape), pages[0].dtype)


def compress_pages(pages: torch.Tensor) -> CompressedPages:
    """``pages`` ``[..., 2, heads, page_tokens, head_dim]`` (head_dim even) -> int4 form."""
    if pages.shape[-4] != 2 or pages.shape[-1] % 2:
        raise ValueError(f"pages of shape {tuple(pages.shape)}: want [..., 2, heads, tokens, "
                         f"even head_dim]")
    x = pages.float()
    k, v = x.select(-4, 0), x.select(-4, 1)
    kc, klo, kstep = _quantize(k, -2)  # per channel, over tokens
    vc, vlo, vstep = _quantize(v, -1)  # per token, over channels
    return CompressedPages(_pack(kc), _pack(vc), klo, kstep, vlo, vstep, tuple(pages.shape),
                           pages.dtype)


def decompress_pages(c: CompressedPages, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Back to ``[..., 2, heads, page_tokens, head_dim]`` of ``dtype`` (the original's by
    default), on the device the compressed tensors are on."""
    out = torch.empty(c.shape, dtype=torch.float32, device=c.k_codes.device)
    return decompress_into(c, out).to(dtype or c.dtype)


def decompress_rows_into(rows: torch.Tensor, like: CompressedPages, lead: tuple,
                         out: torch.Tensor) -> torch.Tensor:
    """``rows_of``' bytes ``[prod(lead), compressed_bytes]`` (any device) decompressed into
    ``out`` (fp32 ``[*lead, 2, heads, tokens, head_dim]``, any strides) -> ``out``: what
    ``decompress_into(from_rows(rows, like), out)`` gives, with the K and V codes split into
    nibbles together and the four fp16 group tensors widened together (they lie back to back in
    a row: ``FIELDS``)."""
    codes_n = like.k_codes.numel() + like.v_codes.numel()
    groups = rows[:, codes_n:]
    if rows.stride(0) % 2 or codes_n % 2 or rows.storage_offset() % 2:
        groups = groups.contiguous()
    groups = groups.view(torch.float16).float()
    codes = rows[:, :codes_n]
    low, high = codes & 0x0F, codes >> 4
    parts, at = {}, 0
    for f in ("k_codes", "v_codes"):  # bytes of the codes region
        size, shape = getattr(like, f).numel(), getattr(like, f).shape
        parts[f] = (low[:, at:at + size].reshape(*lead, *shape),
                    high[:, at:at + size].reshape(*lead, *shape))
        at += size
    at = 0
    for f in ("k_lo", "k_step", "v_lo", "v_step"):  # fp16 elements of the groups region
        size, shape = getattr(like, f).numel(), getattr(like, f).shape
        parts[f] = groups[:, at:at + size].reshape(*lead, *shape)
        at += size
    for i, (kind, per_channel) in enumerate((("k", True), ("v", False))):
        part = out.select(-4, i)
        lo_q, hi_q = parts[f"{kind}_codes"]
        step = parts[f"{kind}_step"]
        even, odd = (step[..., 0::2], step[..., 1::2]) if per_channel else (step, step)
        torch.mul(lo_q, even, out=part[..., 0::2])
        torch.mul(hi_q, odd, out=part[..., 1::2])
        part.add_(parts[f"{kind}_lo"])  # lo + q * step
    return out


def decompress_into(c: CompressedPages, out: torch.Tensor) -> torch.Tensor:
    """Decompress into ``out`` (fp32, ``c.shape``, any strides: e.g. a permuted view of the
    keys-and-values layout attention reads) -> ``out``. Each element is ``lo + q * step``
    computed in fp32 as ``decompress_pages`` defines it, with no unpacked copy of the codes: the
    low nibbles fill the even channels, the high nibbles the odd ones."""
    for i, (codes, lo, step, per_channel) in enumerate(((c.k_codes, c.k_lo, c.k_step, True),
                                                        (c.v_codes, c.v_lo, c.v_step, False))):
        part = out.select(-4, i)
        s = step.float()
        even, odd = (s[..., 0::2], s[..., 1::2]) if per_channel else (s, s)
        torch.mul(codes & 0x0F, even, out=part[..., 0::2])
        torch.mul(codes >> 4, odd, out=part[..., 1::2])
        part.add_(lo.float())  # lo + q * step
    return out


def round_trip_bound(pages: torch.Tensor) -> torch.Tensor:
    """Per element, the largest error ``decompress(compress(pages))`` may show: half the
    quantization step of the element's group (plus fp32 rounding of ``lo + q * step``)."""
    c = compress_pages(pages)
    kb = (c.k_step.float() / 2).expand(*c.shape[:-4], c.shape[-3], c.shape[-2], c.shape[-1])
    vb = (c.v_step.float() / 2).expand(*c.shape[:-4], c.shape[-3], c.shape[-2], c.shape[-1])
    bound = torch.stack((kb, vb), -4)
    return bound + pages.float().abs() * 2 ** -22 + c.k_step.float().amax() * 2 ** -20


def compressed_bytes(heads: int, page_tokens: int, head_dim: int) -> int:
    """Bytes of one compressed page of one sequence (codes + fp16 groups)."""
    codes = 2 * heads * page_tokens * head_dim // 2
    groups = 2 * 2 * heads * head_dim + 2 * 2 * heads * page_tokens
    return codes + groups


def rows_of(c: CompressedPages) -> torch.Tensor:
    """Compressed pages of any leading shape ``L`` (``c.shape`` is ``[*L, 2, heads, tokens,
    head_dim]``) as bytes, one row per page of one sequence ``[prod(L), compressed_bytes]`` uint8:
    the six tensors back to back in ``FIELDS`` order (the form level 3 keeps on the host and in a
    spill file; ``from_rows`` with ``like_page`` reads it back). On the tensors' device."""
    m = 1
    for n in c.shape[:-4]:
        m *= n
    return torch.cat([getattr(c, f).reshape(m, -1).contiguous().view(torch.uint8)
                      for f in FIELDS], 1)


def like_page(heads: int, page_tokens: int, head_dim: int, dtype: torch.dtype) -> CompressedPages:
    """A compressed page of one sequence (zeros): the shapes ``from_rows`` reads rows by."""
    return compress_pages(torch.zeros((2, heads, page_tokens, head_dim), dtype=dtype))
