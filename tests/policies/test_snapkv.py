"""The ``snapkv`` policy: fixed-budget decisions, SnapKV selection from the recent queries (a
reference written here from the case's own history), its fallback, its parameters, and the
conformance kit handing it the recent queries."""

from __future__ import annotations

import pytest
import torch

from growpage.core.rope import apply_rope, cos_sin
from growpage.errors import ConfigError, PolicyError
from growpage.policies import FixedBudgetPolicy, SnapKVPolicy, resolve_policy
from growpage.testing import BoundaryCase, check_policy
from growpage.testing.strategies import _history

CASE = dict(
    num_layers=2,
    num_kv_heads=2,
    group_size=3,
    head_dim=8,
    page_size=4,
    recent_window=2,
    num_pages=5,
    num_free_pages=3,
    gap=8,
    seed=11,
    sharpness=1.0,
    track_accumulated=False,
)


def reference_select(case: BoundaryCase, window: int, kernel: int, keep: int) -> torch.Tensor:
    """SnapKV from the case's history, in loops: the last ``window`` queries rotated to their
    positions, softmax over the slots each may see, summed over queries and group heads, a max
    pool by hand, the best ``keep - R`` candidates (ties to the earlier slot) + the window."""
    h = _history(case)
    t, n, r = case.position, case.num_tokens, case.recent_window
    view = case.view()
    keys, held = view.keys(), view.positions()
    cos, sin = cos_sin(h.rope, torch.arange(t))
    rotated = apply_rope(h.queries, cos[:, None], sin[:, None])  # [L, t, Hq, d]
    out = torch.empty(case.num_layers, case.num_kv_heads, keep, dtype=torch.long)
    half = kernel // 2
    for layer in range(case.num_layers):
        for kv in range(case.num_kv_heads):
            score = torch.zeros(n, dtype=torch.float64)
            for j in range(max(0, t - window), t):
                for head in range(kv * case.group_size, (kv + 1) * case.group_size):
                    logits = (keys[layer, kv].double() @ rotated[layer, j, head].double()) * (
                        case.head_dim**-0.5
                    )
                    logits[held[layer, kv] > j] = float("-inf")
                    score += logits.softmax(-1)
            cand = score[: n - r]
            pooled = torch.stack(
                [cand[max(0, i - half) : i + half + 1].max() for i in range(n - r)]
            )
            order = sorted(range(n - r), key=lambda i: (-float(pooled[i]), i))
            chosen = sorted(order[: keep - r]) + list(range(n - r, n))
            out[layer, kv] = torch.tensor(chosen)
    return out


@pytest.mark.parametrize("window, kernel", [(16, 7), (4, 3), (1, 1), (100, 5)])
@pytest.mark.parametrize("seed", [11, 12])
def test_selection_equals_the_reference(window, kernel, seed):
    case = BoundaryCase(**{**CASE, "seed": seed})
    ctx = case.context()
    policy = SnapKVPolicy(budget_tokens=16, window=window, kernel_size=kernel)
    for keep in (case.num_tokens - case.page_size, case.recent_window + 3):
        got = policy.select(ctx, keep)
        assert got.dtype == torch.long and got.shape == (2, 2, keep)
        assert torch.equal(got, reference_select(case, window, kernel, keep)), keep


def test_decisions_are_the_fixed_budgets():
    for pages in (2, 3, 4, 5):
        ctx = BoundaryCase(**{**CASE, "num_pages": pages}).context()
        assert SnapKVPolicy(budget_tokens=16).decide(ctx) is FixedBudgetPolicy(16).decide(ctx)


def test_the_pool_keeps_a_strong_tokens_neighbours():
    """A slot the window attends to most pulls its neighbours within ``kernel_size // 2`` in
    with it; without pooling (kernel 1) they compete on their own weight."""
    case = BoundaryCase(**CASE)
    ctx = case.context()
    attn = ctx.window_attention(16)
    keep = case.recent_window + 3
    chosen = SnapKVPolicy(window=16, kernel_size=3).select(ctx, keep)[..., :3]
    candidates = attn[..., : ctx.num_selection_candidates]
    best = candidates.argmax(-1)  # each head's strongest candidate
    for layer in range(2):
        for kv in range(2):
            b = int(best[layer, kv])
            picked = set(chosen[layer, kv].tolist())
            assert b in picked
            assert {max(b - 1, 0), min(b + 1, ctx.num_selection_candidates - 1)} <= picked


def test_without_recent_queries_it_pools_the_summaries_importance():
    case = BoundaryCase(**{**CASE, "keeps_recent_queries": False})
    ctx = case.context()
    assert ctx.window_attention(16) is None
    keep = case.num_tokens - case.page_size
    got = SnapKVPolicy(kernel_size=3).select(ctx, keep)
    scores = torch.nn.functional.max_pool1d(ctx.scores().view(4, 1, -1), 3, 1, 1).view(2, 2, -1)
    order = torch.stack([s.argsort(descending=True, stable=True) for s in scores.view(4, -1)])
    want = order[:, : keep - 2].sort(-1).values.view(2, 2, -1)
    assert torch.equal(got[..., :-2], want)


@pytest.mark.parametrize(
    "params, match",
    [
        ({"window": 0}, "window must be a positive integer"),
        ({"window": -3}, "window must be a positive integer"),
        ({"window": 2.5}, "window must be a positive integer"),
        ({"kernel_size": 4}, "kernel_size must be a positive odd integer"),
        ({"kernel_size": 0}, "kernel_size must be a positive odd integer"),
        ({"kernel_size": True}, "kernel_size must be a positive odd integer"),
        ({"budget_tokens": 0}, "budget_tokens must be a positive integer"),
    ],
)
def test_bad_parameters_are_refused(params, match):
    with pytest.raises(PolicyError, match=match):
        resolve_policy("snapkv", **params)
    with pytest.raises(ConfigError, match=match):
        SnapKVPolicy(**params)
    policy = SnapKVPolicy()
    name, value = next(iter(params.items()))
    with pytest.raises(ConfigError, match=match):
        setattr(policy, name, value)  # validated on assignment too


def test_it_declares_its_window():
    assert SnapKVPolicy(window=5).needs_recent_queries == 5
    assert SnapKVPolicy().needs_recent_queries == 16
    assert FixedBudgetPolicy().needs_recent_queries == 0


def test_the_kit_hands_it_the_recent_queries():
    """``check_policy`` gives a policy that declares recent queries a view that keeps them in
    every example; one that reads them without declaring them is told what it forgot."""
    check_policy(SnapKVPolicy(budget_tokens=16, window=4), max_examples=15)

    class Undeclared(FixedBudgetPolicy):
        name = "undeclared-window"

        def select(self, ctx, keep):
            attn = ctx.window_attention(4)
            chosen = attn[..., : ctx.num_selection_candidates].topk(keep - ctx.recent_window)
            from growpage.core.selection import with_protected

            return with_protected(chosen.indices, ctx.num_tokens, ctx.recent_window)

    check_policy(Undeclared(budget_tokens=16), max_examples=5, recent_queries=True)
    with pytest.raises(Exception, match="needs_recent_queries"):
        check_policy(Undeclared(budget_tokens=16), max_examples=5, recent_queries=False)
    with pytest.raises(TypeError, match="recent_queries must be True, False or None"):
        check_policy(Undeclared(), max_examples=5, recent_queries="yes")
