"""Selection (Eq. 9-10): exact counts, protected window, block-local quota, global top-k."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from growpage.core.selection import block_local_topk, growpage_select, importance


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 3), st.integers(1, 3), st.sampled_from([4, 8, 16]),
       st.integers(2, 6), st.data())
def test_growpage_select_invariants(seed, num_layers, num_kv, block, pages, data):
    n = pages * block
    recent = data.draw(st.integers(0, block - 1))
    # The controller keeps (P-1)*b or (P-2)*b slots, never below one page.
    keep = data.draw(st.sampled_from([(pages - 1) * block, (pages - 2) * block]).filter(
        lambda k: k >= block))
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
