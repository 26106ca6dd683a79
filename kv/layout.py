"""BICL page geometry: where every byte of a KV page sits (docs/kv.md draws it).

A page holds ``page_tokens`` consecutive tokens of one layer for one sequence of the batch: all
key heads, then all value heads, each head ``page_tokens`` rows of ``head_dim`` channels. Fetching
a page is therefore one contiguous copy, and a page is the unit of selection, of the host tier and
of a spill file.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PAGE_TOKENS_CHOICES = (16, 32, 64, 128)
AUTO_LONG_CONTEXT = 4096
"""Prompts longer than this get 64-token pages with ``page_tokens="auto"``, shorter ones 32."""


def auto_page_tokens(seq_len: int) -> int:
    """``page_tokens="auto"``: 32-token pages up to a 4,096-token prompt, 64 beyond.

    Short contexts have few pages, so finer pages let top-K pick more precisely; long ones have
    many, and 64-token pages halve the summaries and the per-page fetch overhead."""
    return 32 if seq_len <= AUTO_LONG_CONTEXT else 64


@dataclass(frozen=True)
class PageLayout:
    """One page: ``[2 (K, V), kv_heads, page_tokens, head_dim]`` elements of ``dtype``, C order."""

    kv_heads: int
    head_dim: int
    page_tokens: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (2, self.kv_heads, self.page_tokens, self.head_dim)

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def page_elems(self) -> int:
        return 2 * self.kv_heads * self.page_tokens * self.head_dim

    @property
    def page_bytes(self) -> int:
        return self.page_elems * self.elem_bytes

    @property
    def token_bytes(self) -> int:
        """K and V of one token of one layer (all heads): what a DynamicCache holds per token."""
        return 2 * self.kv_heads * self.head_dim * self.elem_bytes

    def offset(self, kv: int, head: int, token: int, channel: int) -> int:
        """Byte offset inside the page of K (kv=0) or V (kv=1) of `head`, `token`, `channel`."""
        if not (0 <= kv < 2 and 0 <= head < self.kv_heads and 0 <= token < self.page_tokens
                and 0 <= channel < self.head_dim):
            raise IndexError(f"({kv}, {head}, {token}, {channel}) outside page {self.shape}")
        return (((kv * self.kv_heads + head) * self.page_tokens + token) * self.head_dim
                + channel) * self.elem_bytes


def pack_pages(keys: torch.Tensor, values: torch.Tensor, page_tokens: int) -> torch.Tensor:
    """``keys``/``values`` ``[batch, heads, n * page_tokens, head_dim]`` -> pages
    ``[n, batch, 2, heads, page_tokens, head_dim]`` (contiguous; page i of row b at ``[i, b]``)."""
    b, h, t, d = keys.shape
    n = t // page_tokens
    kv = torch.stack((keys, values))  # [2, b, h, t, d]
    return kv.view(2, b, h, n, page_tokens, d).permute(3, 1, 0, 2, 4, 5).contiguous()


def unpack_pages(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``pack_pages`` for ``[n, batch, 2, heads, page_tokens, head_dim]`` -> keys,
    values ``[batch, heads, n * page_tokens, head_dim]``."""
    n, b, _, h, p, d = pages.shape
    kv = pages.permute(2, 1, 3, 0, 4, 5).reshape(2, b, h, n * p, d)
    return kv[0], kv[1]
