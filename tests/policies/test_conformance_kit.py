"""The conformance kit catches broken policies that the basic cases in test_policies.py miss,
and always reports a broken rule as ``PolicyConformanceError``."""

import random
import re
import threading
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from growpage import CapacityController, CapacityPolicy, Decision, PagePool, RequestState
from growpage.errors import PolicyError
from growpage.policies import GrowPagePolicy
from growpage.testing import (
    BoundaryCase,
    PolicyConformanceError,
    PolicyConformanceWarning,
    check_case,
    check_policy,
)


@attrs.define
class GlobalRandomDecide(CapacityPolicy):
    """Draws from the process-wide RNG: not reproducible from the context."""

    name = "global-random"
    source: str = "random"

    def decide(self, ctx):
        draw = {
            "random": random.random,
            "numpy": np.random.random,
            "torch": lambda: float(torch.rand(())),
        }[self.source]()
        return Decision.GROW if draw < 0.5 else Decision.COMPRESS


@pytest.mark.parametrize("source", ["random", "numpy", "torch"])
def test_decisions_from_the_global_rng_are_not_deterministic(source):
    with pytest.raises(PolicyConformanceError) as info:
        check_policy(GlobalRandomDecide(source), max_examples=20)
    assert info.value.rule == "deterministic"


def test_check_policy_leaves_the_global_rngs_as_it_found_them():
    random.seed(7)
    torch.manual_seed(7)
    expected = (random.random(), float(torch.rand(())))
    random.seed(7)
    torch.manual_seed(7)
    check_policy(GrowPagePolicy(), max_examples=3)
    assert (random.random(), float(torch.rand(()))) == expected


@attrs.define
class FailsOnSeventhCall(GrowPagePolicy):
    """Breaks on one call only: hypothesis cannot replay the failure."""

    name = "seventh-call"
    calls: list = attrs.field(factory=list)

    def decide(self, ctx):
        self.calls.append(1)
        if len(self.calls) == 7:
            raise RuntimeError("seventh call")
        return super().decide(ctx)


def test_a_failure_that_does_not_replay_is_a_conformance_error():
    with pytest.raises(PolicyConformanceError) as info:
        check_policy(FailsOnSeventhCall(), max_examples=20)
    assert info.value.rule == "deterministic"
    assert "seventh call" in info.value.detail and info.value.case is not None


@attrs.define
class ZeroesAttention(GrowPagePolicy):
    name = "zeroes-attention"

    def decide(self, ctx):
        ctx.attention("short").clamp_(min=0.5)  # in place: the context's own cached signal
        return Decision.COMPRESS


@attrs.define
class OverwritesRatio(GrowPagePolicy):
    name = "overwrites-ratio"

    def decide(self, ctx):
        ctx.working_set_ratio("short").fill_(1.0)
        return Decision.GROW if ctx.delta() > 0 else Decision.COMPRESS


@pytest.mark.parametrize("policy", [ZeroesAttention(), OverwritesRatio()], ids=str)
def test_modifying_a_cached_signal_is_a_mutation(policy):
    with pytest.raises(PolicyConformanceError) as info:
        check_policy(policy, max_examples=10)
    assert info.value.rule == "no-mutation"
    assert "attention" in info.value.detail or "working_set_ratio" in info.value.detail


@attrs.define
class ComplexSelection(GrowPagePolicy):
    name = "complex-selection"

    def select(self, ctx, keep):
        return super().select(ctx, keep).to(torch.complex64)


def test_complex_selection_is_an_exact_selection_error():
    with pytest.raises(PolicyConformanceError) as info:
        check_policy(ComplexSelection(), max_examples=5)
    assert info.value.rule == "exact-selection" and "complex64" in info.value.detail


@pytest.mark.parametrize(
    "policy, says",
    [
        (GrowPagePolicy, "the class GrowPagePolicy.*GrowPagePolicy\\(\\)"),
        ("growpage", "no decide"),
    ],
    ids=["class", "name"],
)
def test_check_policy_wants_a_policy_object(policy, says):
    """Not a broken rule but a wrong argument: said at once, not as a no-crash failure of
    every example."""
    with pytest.raises(TypeError, match=says):
        check_policy(policy, max_examples=2)


@attrs.define
class NarrowSelection(GrowPagePolicy):
    """Slots as small integers: right on the kit's contexts, wrong past 127 tokens."""

    name = "narrow-selection"
    dtype: torch.dtype = torch.int8

    def select(self, ctx, keep):
        return super().select(ctx, keep).to(self.dtype)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16])
def test_a_selection_too_narrow_for_real_contexts_is_an_exact_selection_error(dtype):
    with pytest.raises(PolicyConformanceError) as info:
        check_policy(NarrowSelection(dtype=dtype), max_examples=5)
    assert info.value.rule == "exact-selection" and str(dtype).split(".")[1] in info.value.detail
    check_policy(NarrowSelection(dtype=torch.int32), max_examples=5)


@attrs.define
class SumsH2O(CapacityPolicy):
    """Keeps the heaviest accumulated slots: needs the sums, as H2O does."""

    name = "sums"
    needs_accumulated_attention = True

    def decide(self, ctx):
        return Decision.COMPRESS

    def select(self, ctx, keep):
        acc = ctx.accumulated_attention()[..., : ctx.num_selection_candidates]
        recent = ctx.num_tokens - ctx.num_selection_candidates
        top = acc.topk(keep - recent, dim=-1).indices.sort(dim=-1).values
        tail = torch.arange(ctx.num_selection_candidates, ctx.num_tokens)
        return torch.cat([top, tail.expand(*top.shape[:-1], recent)], dim=-1)


def test_a_policy_that_needs_accumulated_attention_always_gets_it():
    check_policy(SumsH2O(), max_examples=30)
    with pytest.raises(PolicyConformanceError) as info:  # unless told otherwise
        check_policy(SumsH2O(), max_examples=30, accumulated=False)
    assert info.value.rule == "no-crash"


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64])
def test_the_kit_and_the_controller_judge_a_selection_dtype_alike(dtype):
    """One rule: a dtype the kit refuses the controller refuses too, with the same words."""
    policy = NarrowSelection(dtype=dtype)
    try:
        check_policy(policy, max_examples=3)
        kit = None
    except PolicyConformanceError as exc:
        kit = exc.detail.split(": ", 1)[1]
    case = BoundaryCase(
        num_layers=1,
        num_kv_heads=2,
        group_size=1,
        head_dim=4,
        page_size=4,
        recent_window=1,
        num_pages=3,
        num_free_pages=0,
        gap=4,
        seed=0,
        sharpness=1.0,
        track_accumulated=False,
    )
    pool = PagePool(3, 4)
    ctrl = CapacityController(policy, pool, case.config)
    state = RequestState("r", pool.allocate(3), num_tokens=12, position=case.num_tokens + 4)
    try:
        ctrl.on_boundary(state, case.view())
        controller = None
    except PolicyError as exc:
        controller = str(exc).split("select(): ", 1)[1].rsplit(" (request ", 1)[0]
    assert kit == controller
    assert (kit is None) == (torch.iinfo(dtype).bits >= 32)


@pytest.mark.parametrize(
    "knobs, error, says",
    [
        ({"head_dims": (3,)}, ValueError, "head_dims must hold even integers"),
        ({"max_pages": 1}, ValueError, "max_pages must be at least 2"),
        ({"max_layers": 0}, ValueError, "max_layers must be at least 1"),
        ({"page_sizes": ()}, ValueError, "page_sizes must not be empty"),
        ({"page_sizes": 4}, TypeError, "page_sizes must be a tuple of integers"),
        ({"max_compressions": -1}, ValueError, "max_compressions must be at least 0"),
        ({"max_kv_heads": 2.5}, TypeError, "max_kv_heads must be an integer"),
        ({"page_size": 4}, TypeError, "unexpected keyword argument 'page_size'"),
    ],
    ids=lambda x: str(x)[:20],
)
def test_a_wrong_strategy_knob_is_named_not_blamed_on_the_policy(knobs, error, says):
    with pytest.raises(error, match=f"boundary_cases.*{says}") as info:
        check_policy(GrowPagePolicy(), max_examples=3, **knobs)
    assert not isinstance(info.value, PolicyConformanceError)


@attrs.define
class SinksByPosition(CapacityPolicy):
    """Keeps the slots holding positions 0 and 1 (attention sinks) and the newest slots, but
    assumes every KV head holds the same positions, as none does after a compression."""

    name = "sinks-by-position"

    def decide(self, ctx):
        return Decision.COMPRESS

    def select(self, ctx, keep):
        sinks = (ctx.positions() < 2).nonzero()[:, -1].reshape(*ctx.shape, -1)
        newest = torch.arange(ctx.num_tokens - keep + sinks.shape[-1], ctx.num_tokens)
        return torch.cat([sinks, newest.expand(*ctx.shape, -1)], dim=-1)


def test_a_policy_that_assumes_heads_share_positions_is_caught_on_a_small_example():
    with pytest.raises(PolicyConformanceError) as info:
        check_policy(SinksByPosition(), max_examples=40)
    case = info.value.case
    assert info.value.rule == "no-crash" and "shape" in info.value.detail
    # Shrunk: one layer, the smallest pages, one compression in the history.
    assert (case.num_layers, case.page_size, case.num_pages, case.gap) == (1, 4, 2, 4)
    assert case.num_kv_heads >= 2


@attrs.define
class ReadsSumsWithoutAsking(CapacityPolicy):
    """Reads H2O sums but forgot ``needs_accumulated_attention``."""

    name = "reads-sums"

    def decide(self, ctx):
        return (
            Decision.GROW
            if float(ctx.accumulated_attention()[..., 0].mean()) > 1
            else (Decision.COMPRESS)
        )


@attrs.define
class SelectRaises(GrowPagePolicy):
    name = "select-raises"

    def select(self, ctx, keep):
        raise KeyError("no such slot")


@pytest.mark.parametrize(
    "policy, says",
    [
        (
            ReadsSumsWithoutAsking(),
            r"decide\(ctx\) raised TypeError: .* accumulated_attention\(\) "
            r"was None here: a policy that reads it sets needs_accumulated_attention = True$",
        ),
        (SelectRaises(), r"select\(ctx, keep=\d+\) raised KeyError: 'no such slot'$"),
    ],
    ids=str,
)
def test_a_crash_names_the_call_and_the_likely_cause(policy, says):
    with pytest.raises(PolicyConformanceError) as info:
        check_policy(policy, max_examples=20)
    assert info.value.rule == "no-crash"
    assert re.search(says, info.value.detail), info.value.detail


@attrs.define
class ShufflesTheHistory(GrowPagePolicy):
    """Keeps a random sample of the history (from the global RNG) and the recent window."""

    name = "shuffles"

    def select(self, ctx, keep):
        chosen = torch.randperm(ctx.num_selection_candidates)[: keep - ctx.recent_window]
        window = torch.arange(ctx.num_selection_candidates, ctx.num_tokens)
        return torch.cat([chosen.sort().values, window]).expand(*ctx.shape, keep).clone()


def test_a_nondeterministic_selection_is_told_apart_from_a_decision():
    with pytest.raises(PolicyConformanceError) as info:
        check_policy(ShufflesTheHistory(), max_examples=20)
    assert info.value.rule == "deterministic"
    assert re.fullmatch(
        r"select\(ctx, keep=\d+\) chose different slots on the same context", info.value.detail
    ), info.value.detail
    with pytest.raises(PolicyConformanceError) as info:
        check_policy(GlobalRandomDecide("torch"), max_examples=20)
    assert re.fullmatch(
        r"decided Decision\.\w+ then Decision\.\w+ on the same context", info.value.detail
    ), info.value.detail


@attrs.define
class RemembersItsLastDecide(GrowPagePolicy):
    """Keeps what its last decide() saw and selects by it: right only when each select()
    follows its own decide() at once, which asynchronous compaction does not promise."""

    name = "remembers-last-decide"
    _scores: torch.Tensor | None = None

    def decide(self, ctx):
        self._scores = ctx.scores()
        return super().decide(ctx)

    def select(self, ctx, keep):
        from growpage.core.selection import growpage_select

        return growpage_select(
            self._scores,
            ctx.num_tokens,
            ctx.recent_window,
            keep,
            ctx.page_size,
            ctx.config.local_quota,
        )


@attrs.define
class CachesByBoundary(GrowPagePolicy):
    """The same scores, cached by (request, position) as the policy guide advises: passes."""

    name = "caches-by-boundary"
    _cache: dict = attrs.field(factory=dict)

    def decide(self, ctx):
        self._cache[(ctx.request_id, ctx.position)] = ctx.scores()
        return super().decide(ctx)

    def select(self, ctx, keep):
        from growpage.core.selection import growpage_select

        scores = self._cache.get((ctx.request_id, ctx.position))
        scores = ctx.scores() if scores is None else scores
        return growpage_select(
            scores, ctx.num_tokens, ctx.recent_window, keep, ctx.page_size, ctx.config.local_quota
        )


def test_state_carried_from_decide_to_select_breaks_order_independence():
    with pytest.raises(PolicyConformanceError) as info:
        check_policy(RemembersItsLastDecide(), max_examples=15)
    assert info.value.rule == "order-independent"
    assert "another request's decide() and select()" in str(info.value)
    check_policy(CachesByBoundary(), max_examples=15)


@attrs.define
class PlansInDecide(CapacityPolicy):
    """decide() notes the request's length, select() keeps the last slots by that note: right
    only when the other request of the order check differs in length (with the same shape and
    length this would pass the kit, then fail in the engine with asynchronous compaction)."""

    name = "plans-in-decide"
    _plan: int = 0

    def decide(self, ctx):
        self._plan = ctx.num_tokens
        return Decision.COMPRESS

    def select(self, ctx, keep):
        n = self._plan
        return torch.arange(n - keep, n).expand(*ctx.shape, keep).contiguous()


def test_a_length_carried_from_decide_to_select_breaks_order_independence():
    with pytest.raises(PolicyConformanceError) as info:
        check_policy(PlansInDecide(), max_examples=20)
    assert info.value.rule == "order-independent"


def test_a_crash_keeps_the_policys_own_traceback():
    """The smallest failing example's error is chained to the policy's exception, whose
    traceback ends in the policy's line."""
    import traceback

    with pytest.raises(PolicyConformanceError) as info:
        check_policy(SelectRaises(), max_examples=10)
    root = info.value
    while root.__cause__ is not None:
        root = root.__cause__
    assert isinstance(root, KeyError)
    last = traceback.extract_tb(root.__traceback__)[-1]
    assert (last.filename, last.name) == (__file__, "select")


@pytest.mark.parametrize(
    "value, error", [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError)]
)
def test_max_examples_is_checked_by_the_kit_not_by_hypothesis(value, error):
    from growpage.testing import check_serving

    for check in (check_policy, check_serving):
        with pytest.raises(error, match=rf"{check.__name__}: max_examples must be"):
            check(GrowPagePolicy(), max_examples=value)


@attrs.define
class TwoBugs(GrowPagePolicy):
    """Two bugs at two lines: hypothesis finds both, and would report them as a group."""

    name = "two-bugs"

    def decide(self, ctx):
        if ctx.num_pages >= 4:
            return "grow"
        return super().decide(ctx)

    def select(self, ctx, keep):
        if ctx.recent_window == 0:
            raise ZeroDivisionError("no window")
        return super().select(ctx, keep)


def test_two_broken_rules_are_reported_as_one_conformance_error():
    """Until 2026-12 hypothesis's report of several distinct failures (an ExceptionGroup) left
    check_policy, and `growpage check` dumped it as a traceback."""
    with pytest.raises(PolicyConformanceError) as info:
        check_policy(TwoBugs(), max_examples=40)
    assert info.value.rule in ("valid-decision", "no-crash") and info.value.case is not None


@attrs.define
class ChangesTheView(GrowPagePolicy):
    """Changes one thing the context leads to, in place."""

    name = "changes-the-view"
    what: str = "keys"

    def select(self, ctx, keep):
        if self.what == "keys":
            keys = ctx.view.keys()
            keys /= keys.norm(dim=-1, keepdim=True) + 1.0
        elif self.what == "queries":
            ctx.view.query_state().short.mul_(2.0)
        else:
            ctx.num_free_pages += 1
        return super().select(ctx, keep)


@pytest.mark.parametrize(
    "what, named",
    [
        ("keys", "ctx.view.keys()"),
        ("queries", "query_state().short"),
        ("facts", "ctx.num_free_pages"),
    ],
)
def test_a_mutation_names_what_changed(what, named):
    """Until 2026-12 the error said only "the context or its view changed"."""
    with pytest.raises(PolicyConformanceError) as info:
        check_policy(ChangesTheView(what=what), max_examples=3, max_layers=1, max_pages=3)
    assert info.value.rule == "no-mutation" and named in info.value.detail


@attrs.define
class RemembersTheFirstSize(GrowPagePolicy):
    """Grows while a request holds the pages it had at its first boundary: state keyed by the
    request id alone."""

    name = "first-size"
    first: dict = attrs.field(factory=dict)

    def decide(self, ctx):
        first = self.first.setdefault(ctx.request_id, ctx.num_pages)
        return Decision.GROW if ctx.num_pages == first else Decision.COMPRESS


@attrs.define
class GrowsTheLongest(GrowPagePolicy):
    """Grows a request only if no longer one was seen so far: state shared by all requests."""

    name = "grows-the-longest"
    longest: list = attrs.field(factory=lambda: [0])

    def decide(self, ctx):
        self.longest[0] = max(self.longest[0], ctx.num_tokens)
        return Decision.GROW if ctx.num_tokens == self.longest[0] else Decision.COMPRESS


@pytest.mark.parametrize(
    "policy, saw",
    [
        (RemembersTheFirstSize(), "an earlier boundary of the same request"),
        (GrowsTheLongest(), "another request's boundary"),
    ],
    ids=str,
)
def test_answers_that_depend_on_earlier_boundaries_are_not_deterministic(policy, saw):
    """Until 2026-12 both passed: each boundary was answered twice by the same object, which
    answers the same the second time, and other boundaries came after a boundary's decide."""
    with pytest.raises(PolicyConformanceError) as info:
        check_policy(policy, max_examples=20)
    assert info.value.rule == "deterministic"
    assert f"first saw {saw}" in info.value.detail and "fresh copy" in info.value.detail


@attrs.define
class CachesDeltaByBoundary(GrowPagePolicy):
    """A cache keyed by (request id, position), as the policy guide allows: conforms."""

    name = "caches-delta"
    cache: dict = attrs.field(factory=dict)

    def decide(self, ctx):
        key = (ctx.request_id, ctx.position)
        if key not in self.cache:
            self.cache[key] = ctx.delta()
        return Decision.GROW if self.cache[key] > 0.0 else Decision.COMPRESS


def test_a_cache_keyed_by_request_and_position_conforms():
    check_policy(CachesDeltaByBoundary(), max_examples=20)


def test_check_policy_leaves_the_accelerators_seed_as_it_found_it():
    """The kit seeds torch's CPU generator only. Until 2026-12 it called torch.manual_seed,
    which also seeds CUDA (queued until CUDA starts, where it has not) and is not restored:
    a script's own torch.manual_seed then no longer decided its GPU draws."""
    torch.manual_seed(7)
    if torch.cuda.is_initialized():
        before = torch.cuda.get_rng_state_all()
        check_policy(GrowPagePolicy(), max_examples=3)
        assert all(
            torch.equal(a, b) for a, b in zip(before, torch.cuda.get_rng_state_all(), strict=True)
        )
        return
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    if tracker is None:
        pytest.skip("this torch queues CUDA seeds elsewhere")
    queued = tracker.get_calls()
    check_policy(GrowPagePolicy(), max_examples=3)
    assert tracker.get_calls() == queued


@attrs.define
class RemembersTheFirstSizeUnderALock(RemembersTheFirstSize):
    """``RemembersTheFirstSize`` guarding its memo with a lock: ``copy.deepcopy`` fails."""

    name = "first-size-locked"
    lock: Any = attrs.field(factory=threading.Lock)


def test_a_policy_that_cannot_be_copied_is_checked_without_copies_and_says_so():
    """Until 2026-12 the history half of ``deterministic`` was left out without a word."""
    with pytest.warns(
        PolicyConformanceWarning,
        match=r"policy 'first-size-locked' cannot be "
        r"deep-copied \(TypeError: .*\): 'deterministic' was not checked on "
        r"fresh copies of it",
    ) as caught:
        check_policy(RemembersTheFirstSizeUnderALock(), max_examples=20)
    assert len(caught) == 1  # once per check, not once per example
    with pytest.warns(PolicyConformanceWarning):  # check_case alone copies it, and says so
        check_case(
            RemembersTheFirstSizeUnderALock(),
            BoundaryCase(
                num_layers=1,
                num_kv_heads=1,
                group_size=1,
                head_dim=4,
                page_size=4,
                recent_window=0,
                num_pages=3,
                num_free_pages=0,
                gap=0,
                seed=0,
                sharpness=1.0,
                track_accumulated=False,
            ),
        )
