"""Selection (Eq. 9-10): exact counts, protected window, block-local quota, global top-k."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from growpage.core import selection
from growpage.core.selection import block_local_topk, growpage_select, importance


@settings(max_examples=80, deadline=None)
@given(
    st.integers(0, 10**6),
    st.integers(1, 3),
    st.integers(1, 3),
    st.sampled_from([4, 8, 16]),
    st.integers(2, 6),
    st.data(),
)
def test_growpage_select_invariants(seed, num_layers, num_kv, block, pages, data):
    n = pages * block
    recent = data.draw(st.integers(0, block - 1))
    # The controller keeps (P-1)*b or (P-2)*b slots, never below one page.
    keep = data.draw(
        st.sampled_from([(pages - 1) * block, (pages - 2) * block]).filter(lambda k: k >= block)
    )
    k_loc = data.draw(st.integers(0, block))
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_layers, num_kv, n - recent, generator=g)
    idx = growpage_select(scores, n, recent, keep, block, k_loc)
    assert idx.shape == (num_layers, num_kv, keep)
    assert (idx[..., 1:] > idx[..., :-1]).all()  # ascending, hence unique
    assert idx.min() >= 0 and idx.max() < n
    if recent:
        assert (idx[..., -recent:] == torch.arange(n - recent, n)).all()
    # Block-local quota (Eq. 10): every historical block keeps at least min(quota, its size).
    m = n - recent
    num_blocks = -(-m // block)
    quota = min(k_loc, (keep - recent) // num_blocks)
    hist = idx[..., : keep - recent]
    for j in range(num_blocks):
        size = min(block, m - j * block)
        in_block = ((hist >= j * block) & (hist < j * block + size)).sum(-1)
        assert (in_block >= min(quota, size)).all()


def test_block_local_quota_then_global_topk_exact_choice():
    # Two blocks of 4; scores concentrated in block 1; quota 1 forces one pick from block 0.
    scores = torch.tensor([[[0.01, 0.05, 0.02, 0.03, 0.9, 0.8, 0.7, 0.6]]])
    chosen = block_local_topk(scores, k=4, block=4, k_loc=1).sort(-1).values
    assert chosen.tolist() == [[[1, 4, 5, 6]]]
    chosen = block_local_topk(scores, k=4, block=4, k_loc=0).sort(-1).values
    assert chosen.tolist() == [[[4, 5, 6, 7]]]
    chosen = block_local_topk(scores, k=4, block=4, k_loc=2).sort(-1).values
    assert chosen.tolist() == [[[1, 3, 4, 5]]]


def test_quota_is_lowered_when_it_alone_exceeds_the_budget():
    scores = torch.rand(1, 1, 16)
    chosen = block_local_topk(scores, k=2, block=4, k_loc=4)
    assert chosen.shape == (1, 1, 2) and chosen.unique().numel() == 2


def test_heads_select_independently():
    scores = torch.zeros(1, 2, 8)
    scores[0, 0, :4] = 1.0
    scores[0, 1, 4:] = 1.0
    chosen = block_local_topk(scores, k=4, block=8, k_loc=0).sort(-1).values
    assert chosen[0, 0].tolist() == [0, 1, 2, 3]
    assert chosen[0, 1].tolist() == [4, 5, 6, 7]


def test_importance_is_elementwise_max():
    a, b = torch.rand(2, 3, 5), torch.rand(2, 3, 5)
    assert torch.equal(importance(a, b), torch.where(a > b, a, b))


def stable_top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The reference order: a stable descending argsort's first k, ascending (NaN first)."""
    return scores.argsort(dim=-1, descending=True, stable=True)[..., :k].sort(dim=-1).values


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 40), st.data())
def test_top_slots_is_the_stable_argsort_order_with_ties_infinities_nan_and_signed_zero(
    seed, m, data
):
    from growpage.core.selection import top_slots

    k = data.draw(st.integers(0, m))
    g = torch.Generator().manual_seed(seed)
    # Few distinct values, so ties are everywhere; then inf, -inf, NaN and -0.0 sprinkled in.
    scores = torch.randint(-3, 4, (2, 3, m), generator=g).float() * 0.5
    r = torch.rand(2, 3, m, generator=g)
    scores[r < 0.1] = float("inf")
    scores[(r >= 0.1) & (r < 0.15)] = float("nan")
    scores[(r >= 0.15) & (r < 0.2)] = -0.0
    scores[(r >= 0.2) & (r < 0.25)] = float("-inf")
    assert torch.equal(top_slots(scores, k), stable_top(scores, k))


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed top-k (CPU)", "argsort (GPU)"])
def test_block_local_topk_keeps_the_stable_order_of_its_global_step(keyed, monkeypatch):
    """Scores tied across blocks: the global part takes the earliest of the tied slots."""
    monkeypatch.setattr(selection, "keyed_top_k", keyed)
    scores = torch.tensor([[[0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.9, 0.1]]])
    assert block_local_topk(scores, k=4, block=5, k_loc=0).tolist() == [[[0, 1, 2, 8]]]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 60), st.sampled_from([4, 8, 16]), st.data())
def test_both_ways_of_the_global_step_choose_the_same_slots(seed, m, block, data):
    k = data.draw(st.integers(0, m))
    k_loc = data.draw(st.integers(0, block))
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 5, (2, 2, m), generator=g).float() / 4  # many ties
    chosen = []
    for keyed in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(selection, "keyed_top_k", keyed)
            chosen.append(block_local_topk(scores, k, block, k_loc))
    assert torch.equal(chosen[0], chosen[1])
