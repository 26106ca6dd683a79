"""The pure rules of KV pruning: the compensation factor, the pattern offsets, the level queue."""
import pytest
import torch

from deepseek_flash.kv.prune import (COMPENSATION_POWER, COMPENSATION_TOKENS, OffsetMatcher,
                                     adjust_scores, compensation, next_levels, page_scores)
from deepseek_flash.kv.prune.policy import page_offsets


@pytest.mark.parametrize("n_active, want", [
    (32, 1.0), (33, 1.0), (1000, 1.0),
    (31, (32 / 31) ** 0.3), (16, 2 ** 0.3), (8, 4 ** 0.3), (1, 32 ** 0.3),
    (0, 32 ** 0.3),  # no active token counts as one
])
def test_compensation_factor_is_the_seeds(n_active, want):
    assert COMPENSATION_TOKENS == 32 and COMPENSATION_POWER == 0.3
    assert compensation(n_active) == pytest.approx(want, rel=1e-12)
    assert compensation(n_active, enabled=False) == 1.0


def test_adjust_scores_multiplies_then_adds_then_clips():
    s = torch.tensor([0.0, 0.1, 0.12, 0.5, 0.9])
    # 16 active tokens: factor 2 ** 0.3 = 1.2311
    f = 2 ** 0.3
    got = adjust_scores(s, 16)
    assert torch.allclose(got, (s * f).clamp(0, 1))
    assert got[2].item() == pytest.approx(0.12 * f)  # 0.1477: still below 0.15
    assert adjust_scores(s, 16, compensate=False).equal(s)
    off = torch.tensor([0.08, 0.08, 0.0, 0.0, 0.2])
    got = adjust_scores(s, 64, off)
    assert torch.allclose(got, torch.tensor([0.08, 0.18, 0.12, 0.5, 1.0]))
    # the offset lifts a token over the default threshold 0.15: 0.1 + 0.08 = 0.18
    assert got[1] >= 0.15 > s[1]
    got = adjust_scores(s, 8, off)
    assert torch.allclose(got, (s * 4 ** 0.3 + off).clamp(0, 1))


def test_page_scores_average_tokens_and_take_the_best_sequence():
    t = torch.tensor([[0.1, 0.2, 0.0, 0.05, 0.3, 0.3],
                      [0.0, 0.0, 0.4, 0.01, 0.0, 0.1]])
    assert page_scores(t, 2).tolist() == pytest.approx([0.15, 0.205, 0.3])
    o = torch.tensor([[0.0, 0.08, 0.0, 0.0, 0.0, 0.0],
                      [0.0, 0.0, 0.0, 0.0, 0.13, 0.08]])
    assert page_offsets(o, 2).tolist() == pytest.approx([0.08, 0.0, 0.13])


def test_levels_queue_down_one_step_and_promote_straight_to_one():
    levels = torch.tensor([1, 1, 2, 2, 3, 3, 1, 2, 3], dtype=torch.int8)
    scores = torch.tensor([0.2, 0.1, 0.15, 0.149, 0.16, 0.0, 0.15, 0.9, 0.14999])
    new, promoted, demoted = next_levels(levels, scores, 0.15)
    assert new.tolist() == [1, 2, 1, 3, 1, 3, 1, 1, 3]
    assert promoted.tolist() == [False, False, True, False, True, False, False, True, False]
    assert demoted.tolist() == [False, True, False, True, False, False, False, False, False]
    # two evaluations below the threshold take a level-1 page to level 3, and no further
    lv = torch.tensor([1], dtype=torch.int8)
    for want in (2, 3, 3):
        lv, _, _ = next_levels(lv, torch.tensor([0.0]), 0.15)
        assert lv.tolist() == [want]


class _Tok:
    """A tokenizer whose token i is the i-th piece."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)


def test_offsets_from_a_text_pattern_mark_every_overlapping_token():
    tok = _Tok(["x", " = ", "de", "f", " foo", "(", ")", ":", "\n", "import", " os"])
    m = OffsetMatcher([(r"def \w+", 0.08), (r"(?m)^import", 0.05)], tok)
    m.append([0, 1, 2])          # "x = de": no match yet
    assert m.values == [0.0, 0.0, 0.0]
    m.append([3, 4])             # "def foo" spans tokens 2, 3, 4
    assert m.values == pytest.approx([0, 0, 0.08, 0.08, 0.08])
    m.append([5, 6, 7, 8])
    m.append([9, 10])            # "import" at a line start
    assert m.values == pytest.approx([0, 0, 0.08, 0.08, 0.08, 0, 0, 0, 0, 0.05, 0])
    m.append([2, 3, 4])          # a second "def foo": +0.08 once per token
    assert m.values[-3:] == pytest.approx([0.08] * 3)
    assert sum(m.values) == pytest.approx(6 * 0.08 + 0.05)


def test_offsets_from_token_ids_and_callables_need_no_tokenizer():
    m = OffsetMatcher([({7, 9}, 0.08), (lambda ids: [i == 3 for i in ids], 0.1)])
    m.append([1, 7, 3])
    m.append([9, 2])
    assert m.values == pytest.approx([0, 0.08, 0.1, 0.08, 0])
    with pytest.raises(ValueError, match="needs prune_tokenizer"):
        OffsetMatcher([("def", 0.08)])
    with pytest.raises(ValueError, match="want \\(pattern, offset\\)"):
        OffsetMatcher([("def",)], _Tok([]))


def test_level_one_cap_keeps_the_best_scored_pages():
    levels = torch.tensor([1, 1, 2, 3, 1, 1, 2], dtype=torch.int8)
    scores = torch.tensor([0.5, 0.9, 0.8, 0.7, 0.1, 0.5, 0.6])
    new, promoted, demoted = next_levels(levels, scores, 0.15, l1_cap=3)
    # above the threshold: pages 0, 1, 2, 3, 5, 6; the best three (1, 2, 3) take level 1, the
    # others (0, 5, 6) wait at level 2; page 4 falls below the threshold: one level down
    assert new.tolist() == [2, 1, 1, 1, 2, 2, 2]
    assert promoted.tolist() == [False, False, True, True, False, False, False]
    assert demoted.tolist() == [True, False, False, False, True, True, False]
    # ties: the lower page stays; a level-3 page over the cap stays compressed
    new, _, _ = next_levels(torch.tensor([1, 3, 1], dtype=torch.int8),
                            torch.tensor([0.5, 0.5, 0.5]), 0.15, l1_cap=1)
    assert new.tolist() == [1, 3, 2]
    new, _, _ = next_levels(levels, scores, 0.15, l1_cap=0)
    assert new.tolist() == [2, 2, 2, 3, 2, 2, 2]
    assert next_levels(levels, scores, 0.15, l1_cap=None)[0].tolist() == [1, 1, 1, 1, 2, 1, 1]
