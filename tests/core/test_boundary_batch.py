"""``BoundaryBatch``: requests at a boundary in the same step share one top-p pass and one host
sync for Delta_t, and each gets exactly the numbers it gets alone."""

from __future__ import annotations

import pytest
import torch

from growpage.core import demand
from growpage.core.boundary_context import BoundaryBatch
from growpage.core.capacity import CapacityController
from growpage.core.config import GrowPageConfig
from growpage.core.pages import PagePool
from growpage.core.request import RequestState
from growpage.policies import GrowPagePolicy
from growpage.testing import BoundaryCase


def case(seed: int, num_pages: int, sharpness: float = 1.0) -> BoundaryCase:
    return BoundaryCase(
        num_layers=2,
        num_kv_heads=2,
        group_size=2,
        head_dim=8,
        page_size=8,
        recent_window=3,
        num_pages=num_pages,
        num_free_pages=4,
        gap=5,
        seed=seed,
        sharpness=sharpness,
        track_accumulated=False,
    )


CASES = [case(1, 3), case(2, 6, 3.0), case(3, 4, 0.3), case(4, 9, 2.0)]


def batched(cases: list[BoundaryCase]):
    batch = BoundaryBatch()
    contexts = [c.context() for c in cases]
    for ctx in contexts:
        batch.add(ctx)
    return batch, contexts


def test_counts_match_coverage_demand_row_by_row():
    gen = torch.Generator().manual_seed(0)
    attns = [
        torch.softmax(torch.randn(2, 3, 4, n, generator=gen) * s, dim=-1)
        for n, s in ((5, 1.0), (40, 4.0), (17, 0.1), (1, 1.0))
    ]
    for p in (0.5, 0.9, 0.99, 1.0):
        counts = demand.working_set_counts(attns, p)
        assert counts.shape == (4, 2, 3, 4) and counts.dtype == torch.int64
        for a, k in zip(attns, counts, strict=True):
            assert torch.equal(k, demand.coverage_demand(a, p))


def test_counts_of_a_padded_tensor_are_those_of_its_rows():
    gen = torch.Generator().manual_seed(3)
    attns = [torch.softmax(torch.randn(2, 3, n, generator=gen) * 2, dim=-1) for n in (4, 11, 7)]
    padded = torch.zeros(3, 2, 3, 11)
    for i, a in enumerate(attns):
        padded[i, ..., : a.shape[-1]] = a
    assert torch.equal(
        demand.working_set_counts(padded, 0.9), demand.working_set_counts(attns, 0.9)
    )


def test_counts_reject_bad_input():
    with pytest.raises(ValueError, match="coverage p"):
        demand.working_set_counts([torch.ones(3) / 3], 0.0)
    with pytest.raises(ValueError, match="at least one"):
        demand.working_set_counts([], 0.9)
    with pytest.raises(ValueError, match="leading shape"):
        demand.working_set_counts([torch.ones(2, 3) / 3, torch.ones(3, 3) / 3], 0.9)


def test_trends_are_the_papers_delta():
    gen = torch.Generator().manual_seed(1)
    attn = torch.softmax(torch.randn(2, 3, 2, 30, generator=gen) * 3, dim=-1)
    ratios = demand.working_set_ratio(attn, 0.9)
    (delta,) = demand.demand_trends(demand.working_set_counts([attn], 0.9), [30])
    assert delta == pytest.approx(demand.demand_trend(ratios[0], ratios[1]), abs=1e-6)


@pytest.mark.parametrize("pad,sorts", [(True, 1), (False, len(CASES))])
def test_members_get_exactly_what_they_get_alone(monkeypatch, pad, sorts):
    """Padded, all four sort together; unpadded (the CPU default), each candidate count alone.
    Either way one host sync per p gives every member its Delta_t."""
    monkeypatch.setattr(BoundaryBatch, "pad", pad)
    alone = [c.context() for c in CASES]
    expected = [
        (ctx.delta(), ctx.working_set_ratio("short"), ctx.working_set_ratio("long"), ctx.delta(0.7))
        for ctx in alone
    ]
    batch, contexts = batched(CASES)
    calls = {"counts": 0, "trends": 0}
    counts, trends = demand.working_set_counts, demand.demand_trends
    monkeypatch.setattr(
        demand,
        "working_set_counts",
        lambda *a: calls.__setitem__("counts", calls["counts"] + 1) or counts(*a),
    )
    monkeypatch.setattr(
        demand,
        "demand_trends",
        lambda *a: calls.__setitem__("trends", calls["trends"] + 1) or trends(*a),
    )
    got = []
    for ctx in reversed(contexts):  # any member may ask first
        got.append(
            (
                ctx.delta(),
                ctx.working_set_ratio("short"),
                ctx.working_set_ratio("long"),
                ctx.delta(0.7),
            )
        )
    got.reverse()
    assert calls == {"counts": 2 * sorts, "trends": 2}
    for (d, rs, rl, d7), (ed, ers, erl, ed7) in zip(got, expected, strict=True):
        assert d == ed and d7 == ed7
        assert torch.equal(rs, ers) and torch.equal(rl, erl)
    assert all(ctx.computed_delta() == ctx.delta() for ctx in contexts)


def test_sizes_alone_do_not_sync_and_deltas_reuse_them(monkeypatch):
    expected = [c.context().delta() for c in CASES[:3]]
    batch, contexts = batched(CASES[:3])
    contexts[0].working_set_ratio("short")
    assert all(ctx._counts and not ctx._deltas for ctx in contexts)
    assert all(ctx.computed_delta() is not None for ctx in contexts)  # the sizes were paid for
    monkeypatch.setattr(demand, "working_set_counts", lambda *a: pytest.fail("sorted twice"))
    assert [ctx.delta() for ctx in contexts] == expected


def test_a_member_that_moved_on_is_left_out():
    batch, contexts = batched(CASES[:3])
    moved = contexts[1]
    moved.view.extend(moved.view.keys()[:, :, :1], torch.tensor([10_000]))  # one more token
    contexts[0].delta()
    assert contexts[2]._deltas and not moved._deltas and not moved._counts


def test_groups_stay_within_the_element_budget(monkeypatch):
    monkeypatch.setattr(BoundaryBatch, "pad", True)
    batch, contexts = batched(CASES)
    # 8 rows (2 views x 2 layers x 2 KV heads) of 16, 40, 24 and 64 candidates: 2 x 40 x 8 fit
    monkeypatch.setattr(BoundaryBatch, "max_elements", 2 * 40 * 8)
    sizes = []
    counts = demand.working_set_counts
    monkeypatch.setattr(
        demand, "working_set_counts", lambda attns, p: sizes.append(len(attns)) or counts(attns, p)
    )
    deltas = [ctx.delta() for ctx in contexts]
    assert sizes == [2, 1, 1]  # by candidate count: (16, 24), (40), (64)
    assert deltas == [c.context().delta() for c in CASES]


def test_unpadded_groups_hold_equal_candidate_counts(monkeypatch):
    monkeypatch.setattr(BoundaryBatch, "pad", False)
    same = [case(10 + i, 5) for i in range(3)] + [case(20, 7)]
    expected = [c.context().delta() for c in same]
    batch, contexts = batched(same)
    sizes = []
    counts = demand.working_set_counts
    monkeypatch.setattr(
        demand, "working_set_counts", lambda attns, p: sizes.append(len(attns)) or counts(attns, p)
    )
    assert [ctx.delta() for ctx in contexts] == expected
    assert sizes == [3, 1]


def test_a_request_joins_one_batch_once():
    batch = BoundaryBatch()
    batch.add(CASES[0].context())
    with pytest.raises(ValueError, match="already in this boundary batch"):
        batch.add(CASES[0].context())


def controller_and_states(cases: list[BoundaryCase], min_capacity: int = 4):
    config = GrowPageConfig(page_size=8, recent_window=3, min_capacity=min_capacity)
    pool = PagePool(64, 8)
    items = []
    for c in cases:
        state = RequestState(request_id=f"req-{c.seed}")
        state.block_table = pool.allocate(c.num_pages)
        state.num_tokens = c.num_tokens
        state.position = c.num_tokens + c.gap
        items.append((state, c.view()))
    return CapacityController(GrowPagePolicy(), pool, config), items


def test_controller_prepares_the_decided_ones_and_uses_their_contexts():
    controller, items = controller_and_states(CASES)
    batch = controller.prepare(items)
    assert len(batch) == 3  # the 3-page request is forced to grow (min_capacity 4)
    alone_ctl, alone_items = controller_and_states(CASES)
    deltas = []
    for (state, view), (s2, v2) in zip(items, alone_items, strict=True):
        got = controller.on_boundary(state, view, batch)
        want = alone_ctl.on_boundary(s2, v2)
        assert (got.action, got.delta, got.pages_after) == (
            want.action,
            want.delta,
            want.pages_after,
        )
        assert state.block_table == s2.block_table and state.num_tokens == s2.num_tokens
        deltas.append(got.delta)
    assert controller.events == alone_ctl.events
    assert deltas[0] is None and None not in deltas[1:]  # forced grow, then three decisions
    assert batch.take("req-2") is None  # each context is used once


def test_controller_refuses_a_request_changed_since_prepare():
    controller, items = controller_and_states(CASES[1:3])
    batch = controller.prepare(items)
    state, view = items[0]
    state.position += 1
    with pytest.raises(ValueError, match="changed since its boundary batch was prepared"):
        controller.on_boundary(state, view, batch)
    assert state.num_pages == CASES[1].num_pages and controller.events.boundaries == 0
