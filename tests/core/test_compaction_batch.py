"""A step's boundaries in one pass: batched signals, selections, checks and compactions give
every request exactly what it gets alone (``core.boundary_signals``, ``selection``'s batch,
``capacity.invalid_rows``, ``core.compaction_batch``)."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_boundary_batch import case

from growpage import CapacityController, Decision, GrowPageConfig, PagePool, RequestState
from growpage.core import boundary_signals, compaction_batch, selection
from growpage.core.boundary_context import BoundaryBatch
from growpage.core.capacity import _invalid, invalid_rows
from growpage.core.compaction_batch import CompactionBatch
from growpage.core.selection import growpage_select, growpage_select_batch, select_slots
from growpage.core.threads import one_thread
from growpage.errors import PolicyError
from growpage.policies import FixedBudgetPolicy, GrowPagePolicy
from growpage.testing import BoundaryCase


# ---- selection ----------------------------------------------------------------------------
@st.composite
def selections(draw):
    """R requests' selection inputs of one step: shared shapes, each its own slot count,
    prefix, kept count (compress or shrink) and scores (ties, zeros and NaN drawn in)."""
    layers, heads = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    block = draw(st.sampled_from([4, 8, 16]))
    recent = draw(st.integers(0, block - 1))
    k_loc = draw(st.integers(0, block))
    seed = draw(st.integers(0, 2**31))
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(draw(st.integers(1, 5))):
        pages = draw(st.integers(2, 8))
        n = pages * block
        keep = draw(st.sampled_from([(pages - 1) * block, (pages - 2) * block]))
        prefix = draw(st.integers(0, max(keep - recent, 0))) if draw(st.booleans()) else 0
        if keep < prefix + recent or keep < recent:
            keep, prefix = (pages - 1) * block, 0
        scores = torch.rand(layers, heads, n - recent, generator=gen)
        kind = draw(st.sampled_from(["plain", "ties", "zeros", "nan"]))
        if kind == "ties":
            scores = (scores * 3).floor() / 3
        elif kind == "zeros":
            scores[scores < 0.6] = 0.0
        elif kind == "nan" and scores.numel():
            scores.view(-1)[draw(st.integers(0, scores.numel() - 1))] = float("nan")
        rows.append((scores, n, keep, prefix))
    return rows, recent, block, k_loc


def _alone(rows, recent, block, k_loc):
    return [growpage_select(s, n, recent, k, block, k_loc, p) for s, n, k, p in rows]


def _unzip(rows):
    return [list(column) for column in zip(*rows, strict=True)]


@settings(max_examples=150, deadline=None)
@given(selections())
def test_batched_selection_is_each_requests_own(case):
    rows, recent, block, k_loc = case
    scores, counts, keeps, prefixes = _unzip(rows)
    got = growpage_select_batch(scores, counts, recent, keeps, block, k_loc, prefixes)
    assert got.shape == (len(rows), *scores[0].shape[:2], max(keeps))
    for i, (want, keep) in enumerate(zip(_alone(rows, recent, block, k_loc), keeps, strict=True)):
        assert torch.equal(got[i, :, :, :keep], want)
        assert (got[i, :, :, keep:] == -1).all()


@settings(max_examples=30, deadline=None)
@given(selections())
def test_large_batches_on_the_cpu_select_one_by_one_with_the_same_slots(case):
    rows, recent, block, k_loc = case
    scores, counts, keeps, prefixes = _unzip(rows)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(selection, "CPU_BATCH_ELEMENTS", 0)
        patch.setattr(selection, "growpage_select_batch", lambda *a: pytest.fail("batched"))
        one_by_one = select_slots(scores, counts, recent, keeps, block, k_loc, prefixes)
    assert torch.equal(
        one_by_one, growpage_select_batch(scores, counts, recent, keeps, block, k_loc, prefixes)
    )


def test_batched_selection_refuses_what_cannot_be_kept():
    with pytest.raises(ValueError, match="cannot keep"):
        growpage_select_batch([torch.rand(1, 1, 12)], [16], 4, [20], 4, 1, [0])


@st.composite
def checked(draw):
    """Selections of R requests, some broken: out of range, repeated, unordered, a window or
    prefix slot missing."""
    layers, heads, recent = (
        draw(st.integers(1, 3)),
        draw(st.integers(1, 3)),
        draw(st.integers(0, 4)),
    )
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(8, 40))
        keep = draw(st.integers(max(recent, 1), n))
        prefix = draw(st.integers(0, keep - recent)) if draw(st.booleans()) else 0
        middle = torch.randperm(n - recent - prefix, generator=gen)[: keep - recent - prefix]
        row = torch.cat(
            [torch.arange(prefix), middle.sort().values + prefix, torch.arange(n - recent, n)]
        )
        slots = row.expand(layers, heads, keep).clone()
        flaw = draw(st.sampled_from([None, "low", "high", "repeat", "reverse", "drop"]))
        at = (draw(st.integers(0, layers - 1)), draw(st.integers(0, heads - 1)))
        j = draw(st.integers(0, keep - 1))
        if flaw == "low":
            slots[at][j] = -1
        elif flaw == "high":
            slots[at][j] = n
        elif flaw == "repeat" and keep > 1:
            slots[at][j] = slots[at][(j + 1) % keep]
        elif flaw == "reverse":
            slots[at] = slots[at].flip(-1)
        elif flaw == "drop":  # a window or prefix slot swapped for a dropped candidate
            free = sorted(set(range(n)) - set(row.tolist()))
            if free:
                slots[at][j] = free[0]
                slots[at] = slots[at].sort().values
        rows.append((slots, n, prefix))
    return rows, recent


@settings(max_examples=200, deadline=None)
@given(checked())
def test_one_check_for_all_flags_what_each_check_flags(case):
    rows, recent = case
    keep = selection.padded_slots([s for s, _, _ in rows])
    got = invalid_rows(
        keep,
        [s.shape[-1] for s, _, _ in rows],
        [n for _, n, _ in rows],
        recent,
        [p for _, _, p in rows],
    )
    assert got == [bool(_invalid(s, n, recent, p).any()) for s, n, p in rows]


# ---- signals ------------------------------------------------------------------------------
@st.composite
def steps(draw, max_requests: int = 5):
    """Boundaries of one step: requests of one model (shapes, page, window) with their own
    slot counts, positions and histories."""
    shape = dict(
        num_layers=draw(st.integers(1, 3)),
        num_kv_heads=draw(st.integers(1, 3)),
        group_size=draw(st.integers(1, 3)),
        head_dim=draw(st.sampled_from([4, 8, 16])),
        page_size=draw(st.sampled_from([4, 8])),
        track_accumulated=False,
    )
    shape["recent_window"] = draw(st.integers(1, shape["page_size"] - 1))
    return [
        BoundaryCase(
            **shape,
            num_pages=draw(st.integers(2, 6)),
            num_free_pages=4,
            gap=draw(st.integers(0, 9)),
            seed=seed,
            sharpness=draw(st.sampled_from([0.3, 1.0, 4.0])),
        )
        for seed in draw(
            st.lists(st.integers(0, 10**6), min_size=2, max_size=max_requests, unique=True)
        )
    ]


LONE = dict(
    num_layers=1, num_kv_heads=1, group_size=3, head_dim=8, page_size=8, recent_window=1,
    num_pages=3, num_free_pages=4, gap=0, sharpness=0.3, track_accumulated=False,
)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(steps(), st.sampled_from([1, 2]))
# One layer and one KV head on two threads: alone, the logits are a lone matrix product, which
# a BLAS splits across threads; two such requests of one slot count share one product of two.
@example([BoundaryCase(**LONE, seed=0), BoundaryCase(**LONE, seed=1)], 2)
def test_one_pass_gives_each_request_its_own_signals(cases, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = [c.context() for c in cases]
        expected = [
            (c.attention("short"), c.attention("long"), c.scores(), c.delta()) for c in alone
        ]
        batch = BoundaryBatch()
        together = [c.context() for c in cases]
        for ctx in together:
            batch.add(ctx)
        together[-1].delta()  # the step's pass: every member's signals
        assert all("_importance" in vars(c) for c in together)
        for ctx, (short, long, scores, delta) in zip(together, expected, strict=True):
            assert torch.equal(ctx.attention("short"), short)
            assert torch.equal(ctx.attention("long"), long)
            assert torch.equal(ctx.scores(), scores) and ctx.delta() == delta
    finally:
        torch.set_num_threads(before)


def test_one_thread_gives_the_bits_of_two_at_a_real_models_shapes():
    """Large enough that two threads split the work: Qwen2.5-0.5B's layers and heads."""
    shape = dict(
        num_layers=24,
        num_kv_heads=2,
        group_size=7,
        head_dim=64,
        page_size=16,
        recent_window=4,
        num_free_pages=4,
        gap=7,
        sharpness=2.0,
        track_accumulated=False,
    )
    cases = [BoundaryCase(**shape, num_pages=p, seed=s) for p, s in ((12, 1), (15, 2), (12, 3))]

    def signals():
        batch, contexts = BoundaryBatch(), [c.context() for c in cases]
        for ctx in contexts:
            batch.add(ctx)
        deltas = [ctx.delta() for ctx in contexts]
        scores = [ctx.scores() for ctx in contexts]
        keeps = [(c.num_pages - 1) * c.page_size for c in cases]
        slots = selection.select_slots(
            scores, [c.num_tokens for c in cases], 4, keeps, 16, 4, [0, 0, 0]
        )
        return deltas, [ctx.attention("long") for ctx in contexts], scores, slots

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        many = signals()
        with one_thread("cpu", num_matrices=24 * 2):
            assert torch.get_num_threads() == 1
            one = signals()
    finally:
        torch.set_num_threads(before)
    assert many[0] == one[0]
    for a, b in zip(many[1:], one[1:], strict=True):
        a, b = (a, b) if isinstance(a, list) else ([a], [b])
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_one_thread_restores_the_thread_count():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_thread("cpu"):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), one_thread("cpu"):
            raise RuntimeError("boundary failed")
        assert torch.get_num_threads() == 2
        with one_thread("cpu", num_matrices=1):  # a lone matrix product keeps its threads
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# ---- booked compressions ------------------------------------------------------------------
@attrs.define
class Scripted(GrowPagePolicy):
    """GrowPage's selection; the decisions scripted per request."""

    name = "scripted"
    script: dict = attrs.field(factory=dict)

    def decide(self, ctx):
        return self.script[ctx.request_id]


def _controllers(cases, policy):
    """A controller and, per case, a request state and a fresh view."""
    case = cases[0]
    config = GrowPageConfig(page_size=case.page_size, recent_window=case.recent_window)
    pool = PagePool(64, case.page_size)
    controller = CapacityController(policy, pool, config)
    states = [
        RequestState(
            f"req-{c.seed}",
            pool.allocate(c.num_pages),
            num_tokens=c.num_tokens,
            position=c.position,
        )
        for c in cases
    ]
    return controller, states, [c.view() for c in cases]


def _run(cases, script, together: bool, policy_class=Scripted):
    policy = policy_class(script=script)
    controller, states, views = _controllers(cases, policy)
    compactions = CompactionBatch(controller) if together else None
    outcomes = [
        controller.on_boundary(state, view, compactions=compactions)
        for state, view in zip(states, views, strict=True)
    ]
    if compactions is not None:
        assert len(compactions) == sum(o.action.value != "grow" for o in outcomes)
        compactions.run()
    return outcomes, states, views, controller


@settings(max_examples=40, deadline=None)
@given(steps(), st.data())
def test_booked_compressions_keep_what_each_keeps_alone(cases, data):
    script = {
        f"req-{c.seed}": data.draw(
            st.sampled_from([Decision.GROW, Decision.COMPRESS, Decision.SHRINK])
        )
        for c in cases
    }
    alone = _run(cases, script, together=False)
    together = _run(cases, script, together=True)
    assert together[0] == alone[0]  # outcomes: actions, pages, tokens
    for a, b in zip(alone[1], together[1], strict=True):
        assert (a.block_table, a.num_tokens, a.events, a.trajectory) == (
            b.block_table,
            b.num_tokens,
            b.events,
            b.trajectory,
        )
    for a, b in zip(alone[2], together[2], strict=True):
        assert torch.equal(a.positions(), b.positions()) and torch.equal(a.keys(), b.keys())
    assert alone[3].events == together[3].events


def _fixed(cases):
    budget = min(c.num_tokens for c in cases)  # every boundary compresses
    return lambda script: FixedBudgetPolicy(budget_tokens=budget)


def test_a_policy_that_decides_without_signals_gets_them_in_one_pass(monkeypatch):
    cases = [case(seed, pages) for seed, pages in ((1, 3), (2, 5), (3, 3))]
    passes = []
    fill = boundary_signals._fill
    monkeypatch.setattr(
        boundary_signals,
        "_fill",
        lambda c, t, estimation: passes.append(len(c)) or fill(c, t, estimation),
    )
    alone = _run(cases, {}, together=False, policy_class=_fixed(cases))
    passes.clear()
    together = _run(cases, {}, together=True, policy_class=_fixed(cases))
    assert passes == [3]  # fixed reads no signal to decide: its selections' pass is the only one
    for a, b in zip(alone[2], together[2], strict=True):
        assert torch.equal(a.positions(), b.positions())


@attrs.define
class OwnSelection(GrowPagePolicy):
    """Compresses; its own ``select`` fails for the request named ``fails``."""

    name = "own-selection"
    fails: str = ""

    def decide(self, ctx):
        return Decision.COMPRESS

    def select(self, ctx, keep):
        if ctx.request_id == self.fails:
            raise RuntimeError("no selection today")
        return super().select(ctx, keep)


def test_a_policys_own_selection_runs_at_its_turn_and_its_error_leaves_the_request():
    cases = [case(seed, 4) for seed in (1, 2)]
    policy = OwnSelection(fails="req-2")
    assert not policy.has_default_selection
    controller, states, views = _controllers(cases, policy)
    compactions = CompactionBatch(controller)
    assert not compactions.selects_together
    controller.on_boundary(states[0], views[0], compactions=compactions)
    assert len(compactions) == 1 and states[0].num_tokens == 3 * 8  # booked at its turn
    free = controller.pool.num_free_pages
    with pytest.raises(PolicyError, match="no selection today"):
        controller.on_boundary(states[1], views[1], compactions=compactions)
    assert len(compactions) == 1 and controller.pool.num_free_pages == free
    assert states[1].num_tokens == cases[1].num_tokens  # untouched
    compactions.run()
    assert views[0].num_tokens == 3 * 8 and views[1].num_tokens == 4 * 8


def test_a_dropped_request_is_not_compacted():
    cases = [case(seed, 4) for seed in (1, 2)]
    script = {f"req-{c.seed}": Decision.COMPRESS for c in cases}
    controller, states, views = _controllers(cases, Scripted(script=script))
    compactions = CompactionBatch(controller)
    for state, view in zip(states, views, strict=True):
        controller.on_boundary(state, view, compactions=compactions)
    keys = views[0].keys().clone()
    compactions.drop(states[0])  # preempted: its KV is recomputed
    compactions.run()
    assert torch.equal(views[0].keys(), keys) and views[1].num_tokens == states[1].num_tokens


def test_a_broken_batched_selection_is_a_policy_error_naming_its_request(monkeypatch):
    cases = [case(seed, 4) for seed in (1, 2)]
    script = {f"req-{c.seed}": Decision.COMPRESS for c in cases}
    controller, states, views = _controllers(cases, Scripted(script=script))
    compactions = CompactionBatch(controller)
    for state, view in zip(states, views, strict=True):
        controller.on_boundary(state, view, compactions=compactions)
    select = compaction_batch.select_slots

    def broken(*args):
        keep = select(*args)
        keep[1, 0, 0, -1] = keep[1, 0, 0, -2]  # request 2 loses a window slot
        return keep

    monkeypatch.setattr(compaction_batch, "select_slots", broken)
    with pytest.raises(PolicyError, match="duplicate slot") as err:
        compactions.run()
    assert err.value.request_id == "req-2"
