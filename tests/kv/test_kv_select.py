"""Page selection policy: bounds, scores and top-K on hand-made tables."""
import math

import pytest
import torch

from deepseek_flash.kv.select import (group_queries, mass_logits, page_scores, quest_bound,
                                      resolve_top_k,
                                      select_pages)


def test_quest_bound_is_an_upper_bound_of_every_key_in_the_page():
    torch.manual_seed(1)
    keys = torch.randn(1, 2, 6, 8, 16)  # [b, h, pages, tokens, d]
    q = torch.randn(1, 2, 3, 16)
    bound = quest_bound(q, keys.amin(3), keys.amax(3), scale=1.0)
    exact = torch.einsum("bhgd,bhntd->bhgnt", q, keys).amax(-1)
    assert bound.shape == (1, 2, 3, 6)
    assert bool((bound >= exact - 1e-5).all())


def test_quest_bound_exact_table():
    q = torch.tensor([[[[1.0, -2.0]]]])
    kmin = torch.tensor([[[[0.0, -1.0], [2.0, 3.0]]]])
    kmax = torch.tensor([[[[1.0, 1.0], [4.0, 5.0]]]])
    # page 0: max(0,1)*1 + max(-2*-1, -2*1) = 1 + 2 = 3; page 1: 4 + (-6) = -2
    assert quest_bound(q, kmin, kmax, scale=0.5).flatten().tolist() == [1.5, -1.0]


def test_quest_score_keeps_a_page_one_head_needs():
    # head 0 likes page 2 strongly, head 1 is flat: quest keeps page 2 on top
    bound = torch.tensor([[[[0.0, 0.0, 9.0, 0.0]], [[1.0, 1.1, 1.0, 1.0]]]])
    scores = page_scores(bound, "quest")
    assert scores.shape == (1, 4)
    assert select_pages(scores, 1).tolist() == [[2]]
    assert scores[0, 2].item() == pytest.approx(9.0 - math.log(3 + math.exp(9.0)), abs=1e-5)


def test_windowed_score_normalises_inside_windows():
    bound = torch.tensor([[[[5.0, 5.0, 0.0, 1.0]]]])
    scores = page_scores(bound, "windowed", window_pages=2)
    # window [5, 5] -> 0.5, 0.5; window [0, 1] -> 0.269, 0.731
    assert scores.flatten().tolist() == pytest.approx([0.5, 0.5, 0.26894, 0.73106], abs=1e-4)
    assert select_pages(scores, 1).tolist() == [[3]]
    whole = page_scores(bound, "windowed", window_pages=64)
    assert whole.sum().item() == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError):
        page_scores(bound, "nope")


def test_select_pages_ascending_per_sequence():
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.7], [0.8, 0.1, 0.2, 0.9]])
    assert select_pages(scores, 2).tolist() == [[1, 3], [0, 3]]


@pytest.mark.parametrize("k,n,want", [(None, 10, None), (3, 10, 3), (10, 10, None), (12, 10, None),
                                      (0.25, 10, 3), (0.25, 64, 16), (1.0, 8, None), (0.01, 8, 1)])
def test_resolve_top_k(k, n, want):
    assert resolve_top_k(k, n) == want


def test_group_queries_follows_gqa_head_order():
    q = torch.arange(4 * 2 * 3, dtype=torch.float32).view(1, 4, 2, 3)  # 4 q heads, 2 positions
    g = group_queries(q, 2)
    assert g.shape == (1, 2, 4, 3)
    assert torch.equal(g[0, 1, 0], q[0, 2, 0]) and torch.equal(g[0, 1, 3], q[0, 3, 1])


def test_hybrid_score_takes_the_best_page_of_each_rule():
    # one head, one query, two windows of 2 pages: quest's best is page 0 (largest bound),
    # windowed's best is page 3 (dominates its own window [0.0, 4.0]); pages 1 and 2 are neither
    bound = torch.tensor([[[[6.0, 5.9, 0.0, 4.0]]]])
    assert select_pages(page_scores(bound, "quest"), 2).tolist() == [[0, 1]]
    assert select_pages(page_scores(bound, "windowed", window_pages=2), 1).tolist() == [[3]]
    hybrid = page_scores(bound, "hybrid", window_pages=2)
    assert select_pages(hybrid, 2).tolist() == [[0, 3]]
    # ranks: quest 0,1,3,2 -- windowed 1,2,3,0 -> min 0,1,3,0, ties by quest rank: 0 then 3
    assert hybrid.argsort(descending=True).tolist() == [[0, 3, 1, 2]]


def test_mass_logits_is_the_midpoint_logit_plus_the_spread_term():
    q = torch.tensor([[[[1.0, -2.0]]]])
    kmin = torch.tensor([[[[0.0, -1.0]]]])
    kmax = torch.tensor([[[[2.0, 3.0]]]])
    # mid (1, 1): q.mid = -1; sd (0.5, 1): q^2 . sd^2 = 0.25 + 4 = 4.25; scale 0.5
    want = -1 * 0.5 + 4.25 * 0.5 * 0.25
    assert mass_logits(q, kmin, kmax, scale=0.5).item() == pytest.approx(want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,q_heads,kv_heads,q_len,n,k,w", [
    (1, 4, 2, 1, 37, 9, 8), (3, 8, 2, 1, 130, 33, 64), (2, 4, 4, 3, 64, 16, 16)])
def test_hybrid_choice_in_few_ops_is_the_same_pages(dtype, b, q_heads, kv_heads, q_len, n, k, w):
    # PageSummaries.choose's fast path for "hybrid" picks exactly the pages of the table-tested
    # rules (quest_bound -> page_scores "hybrid" -> select_pages)
    from deepseek_flash.kv.summaries import PageSummaries

    g = torch.Generator().manual_seed(n)
    d = 16
    keys = torch.randn(b, kv_heads, n * 4, d, generator=g).to(dtype)
    s = PageSummaries()
    s.init(keys)
    s.append_keys(keys, 4)
    for trial in range(3):
        q = (torch.randn(b, q_heads, q_len, d, generator=g) * (1 + trial)).to(dtype)
        want = select_pages(page_scores(quest_bound(group_queries(q, kv_heads), s.kmin[:, :, :n],
                                                    s.kmax[:, :, :n], 0.25), "hybrid", w), k)
        got = s.choose(q, k, scale=0.25, score="hybrid", window_pages=w)
        assert got.tolist() == want.tolist()


def test_summaries_keep_exact_min_and_max_side_by_side():
    # PageSummaries holds [max, min] per page in one tensor (one matmul scores every page); the
    # kmin/kmax views are each page's exact channel-wise key minimum and maximum, across growth
    from deepseek_flash.kv.summaries import PageSummaries

    g = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 3, 40 * 4, 8, generator=g).to(torch.bfloat16)
    s = PageSummaries()
    s.init(keys)
    for a in range(0, 40, 8):  # 5 appends: the capacity grows 16 -> 32 -> 64
        s.append_keys(keys[:, :, a * 4:(a + 8) * 4], 4)
    pages = keys.view(2, 3, 40, 4, 8)
    assert s.n == 40 and s.minmax.shape == (2, 3, 64, 16)
    assert torch.equal(s.kmin[:, :, :40], pages.amin(3))
    assert torch.equal(s.kmax[:, :, :40], pages.amax(3))
    assert s.gpu_bytes() == 40 * 2 * 3 * 16 * 2  # pages x batch x heads x [max, min] x bf16


def test_the_lean_logsumexp_is_torchs_bit_for_bit():
    # kv/summaries.py's logsumexp_last (fewer operations in the top-K graph) computes what
    # torch.logsumexp computes, to the bit, with infinite and NaN entries among the rows
    from deepseek_flash.kv.summaries import logsumexp_last

    gen = torch.Generator().manual_seed(4)
    for trial in range(40):
        x = torch.randn(2, 3, 4, 97, generator=gen) * 10.0 ** (trial % 5 - 2)
        x[0, 1, 2] = float("-inf")  # a whole row: maximum -inf, taken as 0
        x[1, 0, 3, 5] = float("inf")
        x[1, 2, 1, 7] = float("nan")
        want, got = torch.logsumexp(x, -1, keepdim=True), logsumexp_last(x)
        assert torch.equal(want.isnan(), got.isnan())
        assert torch.equal(want.nan_to_num(0.5), got.nan_to_num(0.5))
