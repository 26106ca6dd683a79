"""Small file-system helpers every writer shares: alignment and the crash-safe replace of a file.

A file others read (status tree, store metadata, profiles) is never rewritten in place: the new
bytes go to a temp file in the same directory, which is fsynced and renamed over the old name,
and the directory is fsynced so the rename itself survives a power cut. A reader sees the old
file or the new one, never a half-written one.
"""
from __future__ import annotations


def align_up(n: int, alignment: int) -> int:
    """``n`` rounded up to a multiple of ``alignment``."""
    return (n + alignment - 1) // alignment * alignment
