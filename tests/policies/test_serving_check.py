"""``check_serving``: the conformance kit's serving half passes the built-in policies and
catches what only a served run shows."""

from __future__ import annotations

import copy
import random
import threading

import attrs
import pytest
from hypothesis import given, settings

from growpage import CapacityPolicy, Decision, GrowPageConfig
from growpage.policies import GrowPagePolicy, resolve_policy
from growpage.policies.registry import registered_policies
from growpage.sim.workload_csv import WorkloadRequest
from growpage.testing import (
    PolicyConformanceError,
    PolicyConformanceWarning,
    ServingCase,
    check_serving,
    check_serving_case,
    serving_cases,
)
from growpage.testing.serving import script_mode_problem


@pytest.mark.parametrize("name", sorted(registered_policies()))
def test_every_registered_policy_serves(name):
    check_serving(resolve_policy(name), max_examples=6)


def test_a_small_fixed_budget_serves():
    check_serving(resolve_policy("fixed", budget_tokens=16), max_examples=6)


@attrs.define
class GlobalRandomGrowth(CapacityPolicy):
    """Grows when the process-wide RNG says so: a served run cannot be repeated."""

    name = "global-random-growth"

    def decide(self, ctx):
        return Decision.GROW if random.random() < 0.5 else Decision.COMPRESS


def test_a_policy_on_the_global_rng_is_caught_by_a_second_run():
    state = random.getstate()
    with pytest.raises(PolicyConformanceError) as info:
        check_serving(GlobalRandomGrowth(), max_examples=10, max_requests=2, max_output=40)
    assert info.value.rule == "serves"
    assert "fresh copy" in str(info.value) and "first difference: event" in str(info.value)
    assert isinstance(info.value.case, ServingCase)
    assert random.getstate() == state  # the kit leaves the global RNG as it found it


@attrs.define
class ShortHistory(GrowPagePolicy):
    """Keeps each boundary's position in a fixed-size array: overflows past 48 tokens, which the
    per-boundary kit's small contexts never reach."""

    name = "short-history"
    slots: list = attrs.field(factory=lambda: [0] * 48)

    def decide(self, ctx):
        self.slots[ctx.position] = 1
        return super().decide(ctx)


def test_a_crash_on_long_requests_names_the_error_and_the_smallest_workload():
    with pytest.raises(PolicyConformanceError) as info:
        check_serving(
            ShortHistory(),
            max_examples=25,
            max_requests=2,
            max_prompt=16,
            max_output=64,
            page_sizes=(8,),
        )
    text = str(info.value)
    # The controller reports the policy's exception as a PolicyError naming decide() and the
    # boundary; the kit passes it on with the workload.
    assert info.value.rule == "serves" and "the run stopped: PolicyError" in text
    assert "decide() raised IndexError" in text
    case = info.value.case
    assert isinstance(case, ServingCase) and "requests=[r0:" in text
    # hypothesis shrank it to one request just long enough to reach position 48.
    assert len(case.requests) == 1
    r = case.requests[0]
    assert r.prompt_tokens + r.output_tokens - 1 > 48


def test_the_pool_fits_the_most_demanding_request_alone():
    requests = (WorkloadRequest("a", 0.0, 9, 30), WorkloadRequest("b", 0.0, 3, 2))
    case = ServingCase(requests, page_size=4, slack=1, max_num_seqs=2)
    config = GrowPageConfig(page_size=4, recent_window=1, min_capacity=2, watermark=2)
    # A compressing request needs its prompt's pages (3) and min_capacity (2); one that never
    # compresses its whole KV: 9 + 30 - 1 = 38 tokens, 10 pages. Plus slack and watermark.
    assert case.num_kv_pages(config, compresses=True) == 3 + 1 + 2
    assert case.num_kv_pages(config, compresses=False) == 10 + 1 + 2
    # An 8-token prompt fills its 2 pages: its first decode step is a forced growth (no query
    # summary yet), so it needs 3 pages even under a policy that compresses.
    full = ServingCase((WorkloadRequest("c", 0.0, 8, 2),), page_size=4, slack=0, max_num_seqs=1)
    assert full.num_kv_pages(GrowPageConfig(page_size=4, recent_window=1), True) == 3
    for policy in (resolve_policy("fullkv"), resolve_policy("fixed", budget_tokens=8)):
        check_serving_case(policy, case)
        check_serving_case(policy, full)
        check_serving_case(policy, attrs.evolve(full, requests=(WorkloadRequest("c", 0, 8, 1),)))


def test_check_serving_refuses_what_is_not_a_policy_instance():
    with pytest.raises(TypeError, match=r"check_serving\(GrowPagePolicy\(\)\)"):
        check_serving(GrowPagePolicy)
    with pytest.raises(TypeError, match="CapacityPolicy instance"):
        check_serving(object())


@pytest.mark.parametrize(
    "knobs, error, match",
    [
        ({"max_requests": 0}, ValueError, "max_requests must be at least 1"),
        ({"page_sizes": ()}, ValueError, "page_sizes must not be empty"),
        ({"page_sizes": (1,)}, ValueError, "page_sizes must be at least 2"),
        ({"page_sizes": 8}, TypeError, "page_sizes must be a tuple of integers"),
        ({"max_slack": -1}, ValueError, "max_slack must be at least 0"),
        ({"max_output": 2.5}, TypeError, "max_output must be an integer"),
    ],
)
def test_serving_cases_refuse_bad_knobs(knobs, error, match):
    """As ``boundary_cases``: a knob of the wrong type is a TypeError, one out of range (an
    empty tuple of sizes included) a ValueError."""
    with pytest.raises(error, match=f"serving_cases: {match}"):
        serving_cases(**knobs)


@settings(max_examples=20, deadline=None)
@given(serving_cases(max_requests=3, max_prompt=10, max_output=5, page_sizes=(8,)))
def test_serving_cases_stay_within_their_knobs(case):
    assert 1 <= len(case.requests) <= 3 and case.page_size == 8
    assert all(1 <= r.prompt_tokens <= 10 and 1 <= r.output_tokens <= 5 for r in case.requests)
    assert len({r.request_id for r in case.requests}) == len(case.requests)


class HoldsALock(CapacityPolicy):
    """Memoizes its decisions under a lock: correct, served as is by the simulator and the
    engine, but ``copy.deepcopy`` cannot copy it. ``leaky``: alternates per request instead,
    a count that carries over from one run to the next."""

    name = "holds-a-lock"

    def __init__(self, leaky: bool = False) -> None:
        self._lock = threading.Lock()
        self.leaky, self.memo = leaky, {}

    def decide(self, ctx):
        with self._lock:
            if self.leaky:
                self.memo[ctx.request_id] = self.memo.get(ctx.request_id, 0) + 1
                return Decision.GROW if self.memo[ctx.request_id] % 2 else Decision.COMPRESS
            key = (ctx.request_id, ctx.position)
            if key not in self.memo:
                self.memo[key] = Decision.GROW if ctx.num_pages < 4 else Decision.COMPRESS
            return self.memo[key]


def test_a_policy_that_cannot_be_copied_is_served_itself_with_a_warning():
    with pytest.raises(TypeError, match="pickle"):
        copy.deepcopy(HoldsALock())
    with pytest.warns(
        PolicyConformanceWarning,
        match=r"policy 'holds-a-lock' cannot be "
        r"deep-copied \(TypeError: .*pickle.*\): 'serves' ran the policy object "
        r"itself twice, not two fresh copies",
    ):
        check_serving(HoldsALock(), max_examples=4)
    # What a run leaves behind still shows, named for what was served twice.
    with pytest.warns(PolicyConformanceWarning), pytest.raises(PolicyConformanceError) as info:
        check_serving(HoldsALock(leaky=True), max_examples=10)
    assert "a second run of the same policy object gave other events" in str(info.value)
    assert script_mode_problem(HoldsALock()) is None  # no crash on the copy either
