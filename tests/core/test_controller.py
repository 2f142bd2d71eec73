"""CapacityController on hand-made KV views: exact counts, fallback, preemption, events."""

import attrs
import pytest
import torch

from growpage import (
    Action,
    CapacityController,
    CapacityPolicy,
    Decision,
    GrowPageConfig,
    PagePool,
    PolicyError,
    RequestState,
)
from growpage.errors import ConfigError
from growpage.policies import GrowPagePolicy, ShrinkPolicy
from growpage.testing import BoundaryCase

B, R = 8, 3


@attrs.define
class Scripted(CapacityPolicy):
    """Returns the scripted decisions in order and records each context it saw."""

    name = "scripted"
    script: list = attrs.field(factory=list)
    seen: list = attrs.field(factory=list)

    def decide(self, ctx):
        self.seen.append(ctx)
        return self.script.pop(0)


def setup(decisions, pages=3, pool_pages=10, watermark=0, min_capacity=2, layers=2, kv=2):
    case = BoundaryCase(
        num_layers=layers,
        num_kv_heads=kv,
        group_size=2,
        head_dim=8,
        page_size=B,
        recent_window=R,
        num_pages=pages,
        num_free_pages=0,
        gap=5,
        seed=3,
        sharpness=1.0,
        track_accumulated=False,
    )
    config = GrowPageConfig(page_size=B, recent_window=R, min_capacity=min_capacity)
    pool = PagePool(pool_pages, B, watermark=watermark)
    policy = Scripted(list(decisions))
    ctrl = CapacityController(policy, pool, config)
    state = RequestState("r0", pool.allocate(pages), num_tokens=pages * B, position=pages * B + 5)
    return ctrl, state, case.view(), pool, policy


def test_grow_appends_one_page():
    ctrl, state, view, pool, _ = setup([Decision.GROW])
    out = ctrl.on_boundary(state, view)
    assert out.action is Action.GROW and not out.fallback
    assert (state.num_pages, state.num_tokens, pool.num_free_pages) == (4, 3 * B, 6)
    assert view.num_tokens == 3 * B


def test_compress_and_hold_keeps_p_minus_one_pages_of_tokens():
    ctrl, state, view, pool, _ = setup([Decision.COMPRESS])
    pages_before, positions_before = list(state.block_table), view.positions().clone()
    out = ctrl.on_boundary(state, view)
    assert out.action is Action.COMPRESS
    assert state.num_tokens == view.num_tokens == 2 * B
    assert state.block_table == pages_before and pool.num_free_pages == 7
    # The protected window survives in every head, and order is preserved.
    assert torch.equal(view.positions()[..., -R:], positions_before[..., -R:])
    assert (view.positions()[..., 1:] > view.positions()[..., :-1]).all()


def test_shrink_keeps_p_minus_two_pages_and_releases_one():
    ctrl, state, view, pool, _ = setup([Decision.SHRINK], pages=4)
    out = ctrl.on_boundary(state, view)
    assert out.action is Action.SHRINK
    assert (state.num_pages, state.num_tokens, view.num_tokens) == (3, 2 * B, 2 * B)
    assert pool.num_free_pages == 7


def test_shrink_below_min_capacity_compresses_instead():
    ctrl, state, view, pool, _ = setup([Decision.SHRINK], pages=3, min_capacity=3)
    out = ctrl.on_boundary(state, view)
    assert out.action is Action.COMPRESS and state.num_pages == 3
    assert state.events.shrink_refused == 1 and state.events.shrink == 0


def test_grow_falls_back_to_compress_when_pool_is_empty():
    ctrl, state, view, pool, _ = setup([Decision.GROW], pages=3, pool_pages=3)
    out = ctrl.on_boundary(state, view)
    assert out.action is Action.COMPRESS and out.fallback and out.decision is Decision.GROW
    assert state.num_tokens == 2 * B and state.num_pages == 3
    assert ctrl.events.fallback == 1 and ctrl.events.decided_grow == 1


def test_watermark_refuses_policy_growth():
    ctrl, state, view, pool, _ = setup([Decision.GROW], pages=3, pool_pages=5, watermark=2)
    assert ctrl.on_boundary(state, view).fallback


def test_forced_growth_below_min_capacity_skips_the_policy():
    ctrl, state, view, pool, policy = setup([], pages=2, min_capacity=3)
    out = ctrl.on_boundary(state, view)
    assert out.action is Action.GROW and out.decision is None and not policy.seen
    assert state.events.forced_grow == 1 and state.events.grow == 1


def test_forced_growth_with_empty_pool_needs_preemption():
    ctrl, state, view, pool, _ = setup([], pages=2, pool_pages=2, min_capacity=3)
    out = ctrl.on_boundary(state, view)
    assert out.needs_preemption and state.num_pages == 2 and state.num_tokens == 2 * B


def test_copy_on_write_replaces_shared_pages_before_compaction():
    ctrl, state, view, pool, _ = setup([Decision.COMPRESS], pages=3, pool_pages=6)
    shared = state.block_table[0]
    pool.fork([shared])  # another request shares our first (prefix) page
    ctrl.on_boundary(state, view)
    assert state.block_table[0] != shared
    assert pool.refcounts[shared] == 1  # only the other holder is left
    assert state.events.cow_pages == 1 and pool.num_free_pages == 2


def test_preemption_needed_when_compression_cannot_copy_shared_pages():
    ctrl, state, view, pool, _ = setup([Decision.GROW], pages=3, pool_pages=3)
    pool.fork(state.block_table)  # all pages shared, no free page anywhere
    before = (list(state.block_table), state.num_tokens, view.positions().clone())
    out = ctrl.on_boundary(state, view)
    assert out.needs_preemption
    assert (state.block_table, state.num_tokens) == (before[0], before[1])
    assert torch.equal(view.positions(), before[2]) and pool.num_free_pages == 0
    assert ctrl.events.fallback == 1 and ctrl.events.preempt_needed == 1


@pytest.mark.parametrize("bad", ["grow", None, 1])
def test_invalid_decision_is_a_policy_error_and_changes_nothing(bad):
    ctrl, state, view, pool, _ = setup([bad])
    with pytest.raises(PolicyError, match="expected a growpage.Decision"):
        ctrl.on_boundary(state, view)
    assert state.num_pages == 3 and pool.num_free_pages == 7 and view.num_tokens == 3 * B


class WrongCount(Scripted):
    def select(self, ctx, keep):
        return super().select(ctx, keep)[..., 1:]


def test_invalid_selection_is_a_policy_error_and_changes_nothing():
    ctrl, state, view, pool, _ = setup([Decision.COMPRESS])
    ctrl.policy = WrongCount([Decision.COMPRESS])
    positions = view.positions().clone()
    with pytest.raises(PolicyError, match="wrong shape"):
        ctrl.on_boundary(state, view)
    assert state.num_tokens == 3 * B and torch.equal(view.positions(), positions)


class Raises(Scripted):
    """Raises ``error`` from ``where`` (decide or select)."""

    def __init__(self, where, error):
        super().__init__([Decision.COMPRESS])
        self.where, self.error = where, error

    def decide(self, ctx):
        if self.where == "decide":
            raise self.error
        return super().decide(ctx)

    def select(self, ctx, keep):
        if self.where == "select":
            raise self.error
        return super().select(ctx, keep)


@pytest.mark.parametrize("where", ["decide", "select"])
def test_an_exception_from_the_policy_is_a_policy_error_naming_it(where):
    """Wrapped, naming policy, method and boundary, with the original as its cause; the
    request and the pool are as before."""
    ctrl, state, view, pool, _ = setup([])
    ctrl.policy = Raises(where, ZeroDivisionError("division by zero"))
    with pytest.raises(
        PolicyError,
        match=rf"policy scripted {where}\(\) raised "
        r"ZeroDivisionError: division by zero \(request 'r0' at position 29\)",
    ) as info:
        ctrl.on_boundary(state, view)
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert (state.num_pages, state.num_tokens, pool.num_free_pages) == (3, 3 * B, 7)
    # A context method refusing the policy's argument is the policy's bug: named as above.
    ctrl.policy = Raises(where, ConfigError("coverage p must lie in (0, 1]"))
    with pytest.raises(
        PolicyError,
        match=rf"policy scripted {where}\(\) raised ConfigError: "
        r"coverage p must lie in \(0, 1\] \(request 'r0' at position 29\)",
    ):
        ctrl.on_boundary(state, view)
    ctrl.policy = Raises(where, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        ctrl.on_boundary(state, view)


def test_a_policy_without_a_name_is_named_by_its_class():
    class Unnamed(CapacityPolicy):
        def decide(self, ctx):
            return Decision.GROW

    class Named(Unnamed):
        name = "named"

    class ChildOfNamed(Named):
        pass

    assert Unnamed().name == "Unnamed" and str(Unnamed()) == "Unnamed"
    assert Named().name == ChildOfNamed().name == "named"
    assert GrowPagePolicy().name == "growpage"


@attrs.define
class Chosen(Scripted):
    """Compresses, keeping ``make(num_tokens, keep) -> [keep]`` on every layer and KV head."""

    make: object = None

    def select(self, ctx, keep):
        slots = torch.as_tensor(self.make(ctx.num_tokens, keep))
        return slots.expand(*ctx.shape, keep).clone()


def _last(n, keep):
    return list(range(n - keep, n))


@pytest.mark.parametrize(
    "make, problem",
    [
        (lambda n, k: [-1] + _last(n, k - 1), "slot index out of range"),
        (lambda n, k: _last(n, k - 1) + [n], "slot index out of range"),
        (lambda n, k: [0, 0] + _last(n, k - 2), "duplicate slot indices"),
        (lambda n, k: list(range(k)), "protected recent window"),
        (lambda n, k: list(range(k - 1)) + [n - 1], "protected recent window"),
        (lambda n, k: torch.tensor(_last(n, k), dtype=torch.complex64), "expected an integer"),
        (lambda n, k: torch.tensor(_last(n, k), dtype=torch.float32), "expected an integer"),
        (lambda n, k: torch.ones(k, dtype=torch.bool), "expected an integer"),
    ],
)
def test_each_invalid_selection_is_named_and_changes_nothing(make, problem):
    ctrl, state, view, pool, _ = setup([])
    ctrl.policy = Chosen([Decision.COMPRESS], make=make)
    positions, table = view.positions().clone(), list(state.block_table)
    with pytest.raises(PolicyError, match=problem):
        ctrl.on_boundary(state, view)
    assert state.num_tokens == 3 * B and state.block_table == table
    assert torch.equal(view.positions(), positions) and pool.num_free_pages == 7


def test_an_unordered_selection_is_sorted_before_compaction():
    def shuffled(n, k):
        return list(reversed(range(2, 2 + k - R))) + _last(n, R)  # history out of order

    results = []
    for make in (shuffled, lambda n, k: sorted(shuffled(n, k))):
        ctrl, state, view, _, _ = setup([])
        ctrl.policy = Chosen([Decision.COMPRESS], make=make)
        before = view.positions().clone()
        assert ctrl.on_boundary(state, view).action is Action.COMPRESS
        results.append((view.positions().clone(), view.keys().clone()))
    kept = sorted(shuffled(3 * B, 2 * B))
    assert torch.equal(results[0][0], before[..., kept])  # slot order kept, not the policy's
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_not_at_boundary_is_rejected():
    ctrl, state, view, _, _ = setup([Decision.GROW])
    state.num_tokens -= 1
    with pytest.raises(ValueError, match="not at a capacity boundary"):
        ctrl.on_boundary(state, view)


def test_event_counters_are_exact_over_a_script():
    script = [Decision.GROW, Decision.COMPRESS, Decision.GROW, Decision.SHRINK]
    ctrl, state, view, pool, _ = setup(script, pages=3, pool_pages=5)
    g = torch.Generator().manual_seed(0)
    actions = []
    for _ in range(4):
        while not ctrl.needs_decision(state):
            view.append(torch.randn(2, 2, 8, generator=g), state.position)
            state.num_tokens += 1
            state.position += 1
        actions.append(ctrl.on_boundary(state, view).action)
    # pool of 5: grow (4 pages), compress, grow (5 pages, pool empty), shrink (4 pages)
    assert actions == [Action.GROW, Action.COMPRESS, Action.GROW, Action.SHRINK]
    ev = ctrl.events
    assert (ev.boundaries, ev.decided_grow, ev.decided_compress, ev.decided_shrink) == (4, 2, 1, 1)
    assert (ev.grow, ev.compress, ev.shrink, ev.fallback, ev.preempt_needed) == (2, 1, 1, 0, 0)
    assert state.events == ev
    assert [t[1] for t in state.trajectory] == [4, 4, 5, 4]


@pytest.mark.parametrize("policy", [GrowPagePolicy(), ShrinkPolicy(min_capacity_tokens=16)])
def test_long_decode_loop_keeps_invariants(policy):
    config = GrowPageConfig(page_size=B, recent_window=R)
    pool = PagePool(12, B)
    ctrl = CapacityController(policy, pool, config)
    case = BoundaryCase(
        num_layers=2,
        num_kv_heads=1,
        group_size=3,
        head_dim=8,
        page_size=B,
        recent_window=R,
        num_pages=2,
        num_free_pages=0,
        gap=0,
        seed=9,
        sharpness=1.0,
        track_accumulated=False,
    )
    view = case.view()
    state = RequestState("loop", pool.allocate(2), num_tokens=2 * B, position=2 * B)
    g = torch.Generator().manual_seed(1)
    for _ in range(300):
        if ctrl.needs_decision(state):
            out = ctrl.on_boundary(state, view)
            assert not out.needs_preemption or pool.num_free_pages == 0
            if out.needs_preemption:
                break
        view.append(torch.randn(2, 1, 8, generator=g), state.position)
        view.set_queries(torch.randn(2, 2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g))
        state.num_tokens += 1
        state.position += 1
        assert state.num_tokens <= state.num_pages * B
        assert pool.num_used_pages == state.num_pages and view.num_tokens == state.num_tokens
        assert state.num_pages >= 2
    # Every kept position is a real past position, unique per head.
    pos = view.positions()
    assert (pos < state.position).all()
    assert all(p.unique().numel() == p.numel() for p in pos.flatten(0, 1))
    assert ctrl.events.boundaries > 10


def test_boundary_before_any_decode_query_grows_without_the_policy():
    from growpage.core.kv_view import DenseKVView
    from growpage.core.rope import RopeConfig

    ctrl, state, _, pool, policy = setup([Decision.COMPRESS], pages=3)
    view = DenseKVView(2, 4, 2, 8, RopeConfig(head_dim=8), capacity=3 * B)
    view.extend(torch.randn(2, 2, 3 * B, 8), torch.arange(3 * B))  # prompt only, no decode yet
    out = ctrl.on_boundary(state, view)
    assert out.action is Action.GROW and out.decision is None and not policy.seen
    assert state.events.forced_grow == 1


def test_fullkv_is_preempted_instead_of_compressed_when_no_page_is_free():
    from growpage.policies import FullKVPolicy

    ctrl, state, view, pool, _ = setup([], pages=3, pool_pages=3)
    ctrl.policy = FullKVPolicy()
    out = ctrl.on_boundary(state, view)
    assert out.needs_preemption and out.decision is Decision.GROW
    assert state.num_tokens == view.num_tokens == 3 * B  # nothing was evicted
    assert ctrl.events.fallback == 0 and ctrl.events.preempt_needed == 1


# ---- deferred compressions (the engine's asynchronous compaction) -------------------------
@pytest.mark.parametrize("decision", [Decision.COMPRESS, Decision.SHRINK])
def test_a_deferred_compression_settles_pages_then_runs_as_the_synchronous_one(decision):
    sync_ctrl, sync_state, sync_view, sync_pool, _ = setup([decision], pages=4, pool_pages=7)
    ctrl, state, view, pool, _ = setup([decision], pages=4, pool_pages=7)
    for p in (sync_pool, pool):
        p.fork([sync_state.block_table[1]])  # a shared page: copied on write
    want = sync_ctrl.on_boundary(sync_state, sync_view)
    before = (list(state.block_table), state.num_tokens, view.positions().clone())
    out = ctrl.on_boundary(state, view, defer=True)
    pending = out.pending
    assert pending is not None and out.action is want.action
    assert (out.pages_after, out.tokens_after) == (want.pages_after, want.tokens_after)
    # Settled: a compression takes its copy-on-write page now; a shrink drops the shared page
    # instead, which stays held until the compaction has read it. The request and its KV are
    # untouched.
    cow = decision is Decision.COMPRESS
    assert len(pending.fresh) == cow and pool.num_free_pages == 7 - 4 - cow
    assert pending.released == [before[0][1]]
    assert (state.block_table, state.num_tokens) == before[:2]
    assert torch.equal(view.positions(), before[2]) and not state.trajectory
    assert state.events.compress + state.events.shrink == 0
    done = pending.run()
    assert (done.action, done.pages_after, done.tokens_after) == (
        want.action,
        want.pages_after,
        want.tokens_after,
    )
    assert (state.num_tokens, state.num_pages) == (sync_state.num_tokens, sync_state.num_pages)
    assert torch.equal(view.positions(), sync_view.positions())
    assert torch.equal(view.keys(), sync_view.keys())
    assert pool.num_free_pages == sync_pool.num_free_pages
    assert state.events.as_dict() == sync_state.events.as_dict()
    assert state.trajectory == sync_state.trajectory
    with pytest.raises(ValueError, match="already ran"):
        pending.run()


def test_cancelling_a_deferred_compression_returns_its_pages_and_changes_nothing():
    ctrl, state, view, pool, _ = setup([Decision.COMPRESS], pages=3, pool_pages=6)
    pool.fork([state.block_table[0]])
    free, before = pool.num_free_pages, (list(state.block_table), view.positions().clone())
    pending = ctrl.on_boundary(state, view, defer=True).pending
    assert pool.num_free_pages == free - 1
    pending.cancel()
    assert pool.num_free_pages == free and state.block_table == before[0]
    assert torch.equal(view.positions(), before[1]) and state.num_tokens == 3 * B
    with pytest.raises(ValueError, match="already ran or was cancelled"):
        pending.cancel()


def test_a_deferred_compression_refuses_a_request_that_moved_on():
    ctrl, state, view, pool, _ = setup([Decision.COMPRESS], pages=3, pool_pages=6)
    pool.fork([state.block_table[0]])
    free = pool.num_free_pages
    pending = ctrl.on_boundary(state, view, defer=True).pending
    state.block_table.extend(pool.allocate(1))  # something grew it meanwhile
    with pytest.raises(ValueError, match="changed while its compaction was pending"):
        pending.run()
    assert pool.num_free_pages == free - 1  # the copy-on-write page went back, not the new one


def test_a_bad_selection_in_a_deferred_compression_changes_nothing():
    ctrl, state, view, pool, policy = setup([Decision.COMPRESS], pages=3, pool_pages=6)
    policy.select = lambda ctx, keep: torch.zeros(2, 2, keep, dtype=torch.long)  # duplicates
    pool.fork([state.block_table[0]])
    free, before = pool.num_free_pages, (list(state.block_table), view.positions().clone())
    pending = ctrl.on_boundary(state, view, defer=True).pending
    with pytest.raises(PolicyError, match="duplicate"):
        pending.run()
    assert pool.num_free_pages == free and state.block_table == before[0]
    assert torch.equal(view.positions(), before[1]) and state.num_tokens == 3 * B


def test_grow_is_never_deferred():
    ctrl, state, view, pool, _ = setup([Decision.GROW])
    out = ctrl.on_boundary(state, view, defer=True)
    assert out.pending is None and out.action is Action.GROW and state.num_pages == 4


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16])
def test_a_selection_too_narrow_for_real_contexts_is_refused_and_changes_nothing(dtype):
    """Slots as small integers fit a small request but not a real one (thousands of slots):
    refused whatever their values, as the conformance kit refuses them."""
    ctrl, state, view, pool, _ = setup([])
    ctrl.policy = Chosen(
        [Decision.COMPRESS], make=lambda n, k: torch.tensor(_last(n, k), dtype=dtype)
    )
    positions, table = view.positions().clone(), list(state.block_table)
    with pytest.raises(PolicyError, match=rf"dtype {dtype}, too narrow .*torch.long"):
        ctrl.on_boundary(state, view)
    assert state.num_tokens == 3 * B and state.block_table == table
    assert torch.equal(view.positions(), positions) and pool.num_free_pages == 7


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_32_and_64_bit_selections_are_accepted(dtype):
    ctrl, state, view, _, _ = setup([])
    ctrl.policy = Chosen(
        [Decision.COMPRESS], make=lambda n, k: torch.tensor(_last(n, k), dtype=dtype)
    )
    before = view.positions().clone()
    assert ctrl.on_boundary(state, view).action is Action.COMPRESS
    assert torch.equal(view.positions(), before[..., B:])


def test_a_policy_reading_sums_it_did_not_ask_for_is_told_the_flag():
    ctrl, state, view, pool, _ = setup([])

    class ReadsSums(CapacityPolicy):
        def decide(self, ctx):
            return (
                Decision.GROW if ctx.accumulated_attention()[0, 0, 0] > 1 else (Decision.COMPRESS)
            )

    ctrl.policy = ReadsSums()
    with pytest.raises(
        PolicyError,
        match=r"decide\(\) raised TypeError: .* -- "
        r"accumulated_attention\(\) was None here: a policy "
        r"that reads it sets needs_accumulated_attention = "
        r"True$",
    ):
        ctrl.on_boundary(state, view)
    assert state.num_tokens == 3 * B and pool.num_free_pages == 7
    ctrl.policy = Scripted([Decision.GROW])  # the hint only where sums were read
    ctrl.policy.decide = lambda ctx: 1 / 0
    with pytest.raises(
        PolicyError,
        match=r"ZeroDivisionError: division by zero \(request "
        r"'r0' at position \d+\)$",
    ):
        ctrl.on_boundary(state, view)


@attrs.define
class SpoilsOneHead(Scripted):
    """Keeps the last slots, then spoils layer 1, KV head 1 with ``spoil(row, n)``."""

    spoil: object = None

    def select(self, ctx, keep):
        slots = torch.arange(ctx.num_tokens - keep, ctx.num_tokens).expand(*ctx.shape, keep)
        slots = slots.clone()
        self.spoil(slots[1, 1], ctx.num_tokens)
        return slots


def _set(i, value):
    return lambda row, n: row.__setitem__(i, value(n))


@pytest.mark.parametrize(
    "spoil, says",
    [
        (
            _set(0, lambda n: -3),
            r"slot index out of range \[0, 24\): -3 in layer 1, KV head 1 \(request .* at position \d+\)$",
        ),
        (
            _set(-1, lambda n: n + 2),
            r"out of range \[0, 24\): 26 in layer 1, KV head 1 \(request .* at position \d+\)$",
        ),
        (
            _set(0, lambda n: n - 1),
            r"duplicate slot indices within a layer/KV head: slot 23 twice "
            r"in layer 1, KV head 1 \(request .* at position \d+\)$",
        ),
        (
            _set(-2, lambda n: 2),
            r"protected recent window \(last 3 slots\) not fully kept: slot "
            r"22 missing in layer 1, KV head 1 \(request .* at position \d+\)$",
        ),
    ],
)
def test_an_invalid_selection_says_where(spoil, says):
    ctrl, state, view, _, _ = setup([])
    ctrl.policy = SpoilsOneHead([Decision.COMPRESS], spoil=spoil)
    with pytest.raises(PolicyError, match=says):
        ctrl.on_boundary(state, view)
