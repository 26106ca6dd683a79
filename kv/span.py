"""One gather per layer and step for the top-K pages: a view of a layer's whole host tier as rows
of one tensor, and a table of where each page's heads start in it.

A layer's host pages live in several chunks (kv/pages.py). ``HostSpan`` views the address range
from the lowest chunk to the end of the highest as one tensor of ``unit``-byte rows -- on a CUDA
device through the unified address space (page-locked memory from ``cudaHostAlloc`` is readable
by kernels at its host address), on the CPU directly -- so the selected pages of every sequence
are fetched by a single ``index_select`` whose indices are computed on the device from the
chosen page ids: no host sync, no Python loop over pages, no per-page copy call.

Only rows inside chunks are ever indexed: the table holds, for page ``i`` of sequence ``b``, the
row where that page starts; a page's ``2 * kv_heads`` head blocks (``page_tokens x head_dim``
elements each, BICL) follow it. The rows are ordered (K/V, sequence, head, page, row) so that the
gathered tensor *is* keys and values ``[b, heads, k * page_tokens, head_dim]``: no unpacking copy.
"""
from __future__ import annotations

import ctypes
import logging
import math

import torch

log = logging.getLogger("deepseek_flash.kv.cache")

MAX_UNIT = 4096


class _CudaMemory:
    """``__cuda_array_interface__`` of ``nbytes`` at ``address`` (host memory mapped into the
    unified address space): what ``torch.as_tensor`` turns into a CUDA tensor without a copy."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (address, False), "version": 2}


def raw_view(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` at ``address`` on ``device`` (no copy, not owning)."""
    if device.type == "cuda":
        view = torch.as_tensor(_CudaMemory(address, nbytes), device=device)
    else:
        view = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)
    if view.data_ptr() != address or view.device.type != device.type:
        raise RuntimeError(f"a view of host memory at {address:#x} came back at "
                           f"{view.data_ptr():#x} on {view.device}")
    return view


class HostSpan:
    """The rows of one layer's host chunks, the page table and the row offsets of a page's head
    blocks. Built for a fixed set of chunks; rebuilt when a chunk is added or leaves the host.

    ``extra``: a tensor of pages in the same BICL layout (kv/pagecache.py's slots on the device)
    inside the same view, from row ``extra_row``: with unified addressing one ``index_select``
    reads some pages from the host and others from device memory (only the rows indexed are ever
    touched; the view spans the addresses between)."""

    def __init__(self, chunks, batch: int, layout, device: torch.device, extra=None):
        elem = layout.elem_bytes
        head_bytes = layout.page_tokens * layout.head_dim * elem
        bases = [c.tensor.data_ptr() for c in chunks]
        ends = [b + c.tensor.numel() * elem for b, c in zip(bases, chunks)]
        if extra is not None:
            ends.append(extra.data_ptr() + extra.numel() * elem)
        starts = bases + ([extra.data_ptr()] if extra is not None else [])
        unit = math.gcd(head_bytes, MAX_UNIT, *starts)
        if unit % elem:
            raise RuntimeError(f"host chunks not aligned to their {elem}-byte elements")
        lo = min(starts)
        hi = max(ends)
        view = raw_view(lo, hi - lo, device)
        # [(hi - lo) / unit, unit / 8] as int64 where it divides: 8-byte loads per thread (a GPU
        # reading host memory moves it in larger transactions); viewed back after the gather
        self.dtype = layout.dtype
        self.rows = view.view(-1, unit).view(torch.int64 if unit % 8 == 0 else layout.dtype)
        per_page = layout.page_bytes // unit
        self.units_per_head = head_bytes // unit
        self.units_per_page = per_page
        self.extra_row = (extra.data_ptr() - lo) // unit if extra is not None else None
        # table[b, page]: the row where page `page` of sequence `b` starts
        starts = []
        for base, c in zip(bases, chunks):
            slot = torch.arange(c.capacity * batch, dtype=torch.int64).view(c.capacity, batch)
            starts.append((base - lo) // unit + slot * per_page)
        self.table = torch.cat(starts).t().contiguous().to(device)
        heads = 2 * layout.kv_heads
        self.offsets = (torch.arange(heads, dtype=torch.int64).view(2, 1, layout.kv_heads, 1, 1)
                        * self.units_per_head
                        + torch.arange(self.units_per_head).view(1, 1, 1, 1, -1)).to(device)
        self.kv_heads, self.page_tokens, self.head_dim = (layout.kv_heads, layout.page_tokens,
                                                          layout.head_dim)
        self.pages = sum(c.capacity for c in chunks)
        self._check(chunks[0], batch, layout, device)
        if extra is not None:
            rows = torch.arange(self.extra_row, self.extra_row + per_page, device=device)
            got = self.rows.index_select(0, rows).view(torch.uint8).flatten()
            if not torch.equal(got, extra[0].view(torch.uint8).flatten()):
                raise RuntimeError("the slots read through the view differ from the slots")
            # the same rows as a tensor of the slots alone (writes go there, not through the view)
            self.extra_rows = extra.view(torch.uint8).view(-1, unit).view(self.rows.dtype)

    def _check(self, chunk, batch, layout, device) -> None:
        """Once per view: the first page of every sequence through the view equals the
        same page copied the ordinary way (else the caller falls back to run-by-run copies)."""
        first = torch.full((batch, 1), chunk.first, dtype=torch.int64, device=device)
        k, v = self.gather(first)
        pages = chunk.tensor[:batch].to(device).view(1, batch, *layout.shape)
        want_k, want_v = pages[0, :, 0], pages[0, :, 1]
        if not (torch.equal(k, want_k) and torch.equal(v, want_v)):
            raise RuntimeError("the gathered page differs from the page copied to the device")

    def gather(self, chosen: torch.Tensor):
        """Pages ``chosen`` ``[b, k]`` (device) -> keys, values ``[b, kv_heads, k * page_tokens,
        head_dim]``: one index computation and one ``index_select``."""
        b, k = chosen.shape
        return self.unpack(self.rows.index_select(0, self.indices(chosen)), b, k)

    def indices(self, chosen: torch.Tensor) -> torch.Tensor:
        """The rows of pages ``chosen`` ``[b, k]``, ordered K/V, sequence, head, page, row."""
        return self.rows_at(self.table.gather(1, chosen))

    def rows_at(self, start: torch.Tensor) -> torch.Tensor:
        """The rows of the pages starting at rows ``start`` ``[b, k]``, ordered K/V, sequence,
        head, page, row."""
        b, k = start.shape
        return (start.view(1, b, 1, k, 1) + self.offsets).view(-1)  # [2, b, heads, k, units]

    def gather_into(self, chosen: torch.Tensor, out: torch.Tensor) -> None:
        """``gather`` into the rows ``out`` (kv/graphs.py: a buffer of fixed address)."""
        torch.index_select(self.rows, 0, self.indices(chosen), out=out)

    def unpack(self, rows: torch.Tensor, b: int, k: int):
        """Gathered rows -> keys, values ``[b, kv_heads, k * page_tokens, head_dim]`` (views)."""
        kv = self.unpack_kv(rows, b, k)
        return kv[0], kv[1]

    def unpack_kv(self, rows: torch.Tensor, b: int, k: int) -> torch.Tensor:
        """Gathered rows -> keys and values ``[2, b, kv_heads, k * page_tokens, head_dim]``."""
        return rows.view(self.dtype).view(2, b, self.kv_heads, k * self.page_tokens,
                                          self.head_dim)
