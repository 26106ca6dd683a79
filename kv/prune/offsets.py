"""Per-pattern score offsets (seed §2.1: "+0.08 for a pattern"): ``prune_offsets=[(pattern,
offset), ...]``. A pattern is

* a regular expression (str) matched over the *text* of the sequence (each token's text from the
  tokenizer, concatenated): every token that overlaps a match gets the offset. Matching is
  incremental: new tokens re-run the pattern over the last ``LOOKBACK`` characters, so a match may
  span tokens (``def \\w+``) but not more than ``LOOKBACK`` characters;
* a set (or list, tuple) of token ids: a token with one of those ids gets the offset (no tokenizer
  needed);
* a callable ``f(token_ids: list[int]) -> list[bool]`` over the sequence so far.

A token gets each matching rule's offset once; several rules add up.
"""
from __future__ import annotations

import bisect
import re
from collections.abc import Iterable

LOOKBACK = 256


def check_offsets(offsets, tokenizer=None) -> list[tuple[object, float]]:
    """Validated rules ``[(compiled pattern | frozenset | callable, offset)]``; ValueError names
    the bad entry."""
    rules = []
    for entry in offsets or ():
        try:
            pattern, offset = entry
            offset = float(offset)
        except (TypeError, ValueError):
            raise ValueError(f"prune_offsets entry {entry!r}: want (pattern, offset)") from None
        if isinstance(pattern, str):
            if tokenizer is None:
                raise ValueError(f"prune_offsets pattern {pattern!r}: a text pattern needs "
                                 f"prune_tokenizer (or give a set of token ids)")
            try:
                rules.append((re.compile(pattern), offset))
            except re.error as exc:
                raise ValueError(f"prune_offsets pattern {pattern!r}: {exc}") from None
        elif callable(pattern):
            rules.append((pattern, offset))
        elif isinstance(pattern, Iterable):
            rules.append((frozenset(int(i) for i in pattern), offset))
        else:
            raise ValueError(f"prune_offsets pattern {pattern!r}: a regular expression, a set "
                             f"of token ids or a callable")
    return rules


class OffsetMatcher:
    """The offsets of one sequence's tokens (``values[i]`` for token ``i``), updated as tokens are
    appended."""

    def __init__(self, offsets, tokenizer=None):
        self.rules = check_offsets(offsets, tokenizer)
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.values: list[float] = []
        self.text = ""
        self.ends: list[int] = []  # character end of each token in ``text``
        self._hits: list[set[int]] = [set() for _ in self.rules]
        self._has_text = any(isinstance(p, re.Pattern) for p, _ in self.rules)

    def append(self, ids: Iterable[int]) -> None:
        ids = [int(i) for i in ids]
        start = len(self.ids)
        self.ids.extend(ids)
        self.values.extend([0.0] * len(ids))
        if self._has_text:
            for tid in ids:
                self.text += self.tokenizer.decode([tid])
                self.ends.append(len(self.text))
        for r, (pattern, offset) in enumerate(self.rules):
            if isinstance(pattern, frozenset):
                hits = [i for i in range(start, len(self.ids)) if self.ids[i] in pattern]
            elif isinstance(pattern, re.Pattern):
                hits = self._text_hits(pattern, start)
            else:
                flags = list(pattern(list(self.ids)))
                hits = [i for i, f in enumerate(flags[:len(self.ids)]) if f]
            for i in hits:
                if i not in self._hits[r]:
                    self._hits[r].add(i)
                    self.values[i] += offset

    def _text_hits(self, pattern: re.Pattern, start: int) -> list[int]:
        """Tokens overlapping a match that reaches into the new text."""
        first_new = self.ends[start - 1] if start else 0
        out = []
        for m in pattern.finditer(self.text, max(0, first_new - LOOKBACK)):
            if m.end() <= first_new or m.start() == m.end():
                continue
            a = bisect.bisect_right(self.ends, m.start())
            b = bisect.bisect_left(self.ends, m.end())
            out.extend(range(a, min(b + 1, len(self.ids))))
        return out
