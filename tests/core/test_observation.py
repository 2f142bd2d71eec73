"""SnapKV's observation-window scores (``growpage.core.observation``) against a naive reference
written here: explicit loops over layers, KV heads, query heads and queries, a full softmax per
query over the slots it may see, and a max pool by hand."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from growpage.core.boundary_context import BoundaryContext
from growpage.core.config import GrowPageConfig
from growpage.core.kv_view import DenseKVView
from growpage.core.observation import max_pool, rotate_queries, snapkv_scores, window_attention
from growpage.core.rope import RopeConfig
from growpage.errors import ConfigError


def naive_window_attention(q, q_pos, k, k_pos, scale):
    """``q [L, n, Hq, d]``, ``k [L, Hkv, N, d]``, ``k_pos [L, Hkv, N]`` -> ``[L, Hkv, N]``."""
    num_l, n, num_q, _ = q.shape
    num_kv, num_slots = k.shape[1], k.shape[2]
    group = num_q // num_kv
    out = torch.zeros(num_l, num_kv, num_slots, dtype=torch.float64)
    for layer in range(num_l):
        for head in range(num_q):
            kv = head // group  # query head `head` reads KV head `head // group`
            for j in range(n):
                seen = [s for s in range(num_slots) if k_pos[layer, kv, s] <= q_pos[j]]
                if not seen:
                    continue
                logits = [
                    float(q[layer, j, head].double() @ k[layer, kv, s].double()) * scale
                    for s in seen
                ]
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights)
                for s, w in zip(seen, weights, strict=True):
                    out[layer, kv, s] += w / total
    return out


def naive_max_pool(scores, kernel):
    half = kernel // 2
    m = scores.shape[-1]
    out = torch.empty_like(scores)
    for i in range(m):
        out[..., i] = scores[..., max(0, i - half) : min(m, i + half + 1)].max(dim=-1).values
    return out


@settings(max_examples=25, deadline=None)
@given(
    layers=st.integers(1, 2),
    num_kv=st.integers(1, 3),
    group=st.integers(1, 3),
    n=st.integers(1, 5),
    slots=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_window_attention_equals_the_naive_loops(layers, num_kv, group, n, slots, seed):
    g = torch.Generator().manual_seed(seed)
    d = 8
    q = torch.randn(layers, n, num_kv * group, d, generator=g) * 2
    k = torch.randn(layers, num_kv, slots, d, generator=g)
    # Each head holds its own ascending positions (as after compressions); the window's
    # queries sit among them, so some queries see only part of the slots, some none.
    k_pos = torch.stack(
        [
            torch.randperm(slots + 6, generator=g)[:slots].sort().values
            for _ in range(layers * num_kv)
        ]
    ).view(layers, num_kv, slots)
    q_pos = torch.arange(slots + 6 - n, slots + 6) - int(torch.randint(0, slots, (1,), generator=g))
    got = window_attention(q, q_pos, k, k_pos, 0.3)
    want = naive_window_attention(q, q_pos, k, k_pos, 0.3)
    assert got.shape == (layers, num_kv, slots) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    # Each query that sees any slot adds exactly one unit per query head of the group.
    seeing = (k_pos[..., None, :] <= q_pos[None, None, :, None]).any(-1).sum(-1)  # [L, Hkv]
    torch.testing.assert_close(got.sum(-1), (seeing * group).float(), rtol=1e-5, atol=1e-5)


def test_causality_a_query_never_weighs_a_later_position():
    """The oldest query of the window sees only the slots up to its position: moving the keys
    after it changes nothing of its contribution, and a window of that query alone puts no
    weight on them."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 3, 2, 8, generator=g)
    k = torch.randn(1, 1, 10, 8, generator=g)
    k_pos = torch.arange(10).view(1, 1, 10)
    q_pos = torch.tensor([7, 8, 9])
    alone = window_attention(q[:, :1], q_pos[:1], k, k_pos, 0.5)
    assert torch.all(alone[..., 8:] == 0) and torch.all(alone[..., :8] > 0)
    changed = k.clone()
    changed[:, :, 8:] = torch.randn(1, 1, 2, 8, generator=g) * 10
    assert torch.equal(alone, window_attention(q[:, :1], q_pos[:1], changed, k_pos, 0.5))


def test_gqa_sums_over_each_kv_heads_own_query_heads():
    """Query heads 0-1 read KV head 0 and 2-3 KV head 1: the score of KV head h is the sum of
    the windows of its own two query heads, each computed alone with one query head."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 4, 8, generator=g)
    k = torch.randn(1, 2, 9, 8, generator=g)
    k_pos = torch.arange(9).expand(1, 2, 9)
    q_pos = torch.arange(5, 9)
    got = window_attention(q, q_pos, k, k_pos, 0.4)
    for h in range(2):
        parts = [
            window_attention(q[:, :, i : i + 1], q_pos, k[:, h : h + 1], k_pos[:, :1], 0.4)
            for i in (2 * h, 2 * h + 1)
        ]
        torch.testing.assert_close(got[:, h : h + 1], parts[0] + parts[1])


def test_a_query_that_sees_no_slot_adds_nothing():
    k_pos = torch.tensor([[[5, 6, 7]]])
    q = torch.randn(1, 2, 1, 4)
    got = window_attention(q, torch.tensor([3, 6]), torch.randn(1, 1, 3, 4), k_pos, 1.0)
    assert not got.isnan().any()
    torch.testing.assert_close(got.sum(), torch.tensor(1.0))
    assert got[0, 0, 2] == 0


@pytest.mark.parametrize("kernel", [1, 3, 5, 7, 9])
def test_max_pool_equals_the_naive_one(kernel):
    scores = torch.rand(2, 3, 11, generator=torch.Generator().manual_seed(kernel))
    torch.testing.assert_close(max_pool(scores, kernel), naive_max_pool(scores, kernel))


def test_max_pool_refuses_an_even_or_empty_kernel():
    for bad in (0, 2, 4, -1):
        with pytest.raises(ValueError, match="positive odd"):
            max_pool(torch.rand(1, 1, 5), bad)


def test_snapkv_scores_pool_only_the_selection_candidates():
    """The protected window's weights never leak into the candidates' pooled scores."""
    attn = torch.zeros(1, 1, 10)
    attn[..., 9] = 100.0  # a protected slot
    attn[..., 3] = 1.0
    scores = snapkv_scores(attn, 8, 3)
    assert torch.equal(scores[0, 0], torch.tensor([0, 0, 1, 1, 1, 0, 0, 0.0]))


def test_rotate_queries_rotates_each_to_its_own_position():
    rope = RopeConfig(head_dim=8)
    q = torch.randn(2, 3, 4, 8)
    positions = torch.tensor([4, 9, 10])
    got = rotate_queries(rope, q, positions)
    from growpage.core.rope import rope_at

    for j, p in enumerate(positions.tolist()):
        torch.testing.assert_close(got[:, j], rope_at(rope, q[:, j], p))


def test_the_context_scores_a_dense_views_recent_queries():
    """``ctx.window_attention(w)`` is the core function over the view's keys and its last ``w``
    queries rotated to their positions; fewer when the view holds fewer; None without any."""
    rope = RopeConfig(head_dim=8)
    view = DenseKVView(2, 4, 2, 8, rope, capacity=12)
    g = torch.Generator().manual_seed(3)
    view.extend(torch.randn(2, 2, 12, 8, generator=g), torch.arange(12))
    pre = torch.randn(2, 12, 4, 8, generator=g)
    config = GrowPageConfig(page_size=4, recent_window=2)
    ctx = BoundaryContext("r", 12, 12, 3, 0, config, view)
    assert ctx.recent_queries(4) is None and ctx.window_attention(4) is None
    view.set_recent_queries(pre[:, 5:], torch.arange(5, 12))
    ctx = BoundaryContext("r", 12, 12, 3, 0, config, view)
    q, pos = ctx.recent_queries(4)
    assert pos.tolist() == [8, 9, 10, 11]
    torch.testing.assert_close(q, rotate_queries(rope, pre[:, 8:], pos))
    want = naive_window_attention(q, pos, view.keys(), view.positions(), view.softmax_scale)
    torch.testing.assert_close(ctx.window_attention(4).double(), want, rtol=1e-5, atol=1e-6)
    assert ctx.recent_queries(30)[1].tolist() == list(range(5, 12))  # all it holds
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ConfigError, match="window must be a positive integer"):
            ctx.window_attention(bad)
