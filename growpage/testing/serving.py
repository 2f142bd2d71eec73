"""``check_serving``: a policy served by the simulator under a tight page pool, on small random
workloads, as the conformance kit's second half.

``check_policy`` checks one boundary at a time. Serving adds what only a shared pool shows: a
GROW the pool refuses (fallback to compression, or preemption for a policy that never
compresses), forced growth below ``min_capacity``, pages given back by SHRINK, requests
arriving while others decode. Each example draws a workload and a pool just large enough for
its most demanding request alone (plus a few pages of slack), serves it in trace mode (each
request on its own synthetic trace, so the policy reads real attention signals) and checks:
every request finishes with all its tokens, every page comes back to the pool, the pool never
holds more than it has, and a second run of a fresh copy of the policy gives the same events.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Sequence
from typing import Any

import attrs
from hypothesis import given
from hypothesis import strategies as st

from growpage.core.config import GrowPageConfig
from growpage.errors import GrowPageError
from growpage.policies.base import CapacityPolicy
from growpage.sim.costmodel import LinearCostModel
from growpage.sim.serving import ServingResult, SimConfig, simulate
from growpage.sim.workload_csv import WorkloadRequest
from growpage.testing.conformance import (
    PolicyConformanceError,
    global_rngs_seeded,
    kit_settings,
    raise_smallest_failure,
    refuse_a_class,
)
from growpage.testing.rules import PolicyConformanceWarning, copy_policy
from growpage.testing.strategies import check_knob, check_sizes

# Step times of round numbers: what is checked does not depend on them, only the order of events.
COST = LinearCostModel(base_s=0.01, per_seq_s=0.001, per_prefill_token_s=0.0001)


@attrs.frozen
class ServingCase:
    """One drawn example: the workload, the page size and the pool's slack.

    ``num_kv_pages(config, compresses)`` is the pool it is served with: the pages the most
    demanding request needs alone (its prompt's, one more where the prompt fills its last page,
    at least ``min_capacity``; for a policy that never compresses, its whole length) plus
    ``slack``, plus the watermark.
    """

    requests: tuple[WorkloadRequest, ...]
    page_size: int
    slack: int
    max_num_seqs: int

    def config(self) -> GrowPageConfig:
        return GrowPageConfig(page_size=self.page_size, recent_window=max(1, self.page_size // 4))

    def num_kv_pages(self, config: GrowPageConfig, compresses: bool) -> int:
        b = config.page_size

        def alone(r: WorkloadRequest) -> int:
            if not compresses:  # its KV ends one token short of prompt + output
                return math.ceil((r.prompt_tokens + r.output_tokens - 1) / b)
            # A prompt that fills its last page has a boundary at its first decode step, before
            # any query summary exists: a forced growth (as below min_capacity). The engine
            # wants room for it whatever the output length, and so does the simulator.
            return max(math.ceil((r.prompt_tokens + 1) / b), config.min_capacity)

        return max(alone(r) for r in self.requests) + self.slack + config.watermark

    def __str__(self) -> str:
        lengths = ", ".join(
            f"{r.request_id}: {r.prompt_tokens}+{r.output_tokens} at {r.arrival_s:g} s"
            for r in self.requests
        )
        return (
            f"ServingCase(page_size={self.page_size}, slack={self.slack}, "
            f"max_num_seqs={self.max_num_seqs}, requests=[{lengths}])"
        )


def serving_cases(
    max_requests: int = 5,
    max_prompt: int = 40,
    max_output: int = 120,
    page_sizes: Sequence[int] = (4, 8, 16),
    max_slack: int = 4,
    max_num_seqs: int = 4,
) -> st.SearchStrategy[ServingCase]:
    """Small workloads for ``check_serving``: 1 to ``max_requests`` requests of 1 to
    ``max_prompt`` prompt and 1 to ``max_output`` output tokens, arriving within 0.5 s of
    simulated time (decode steps take about 10 ms), in pages of one of ``page_sizes``, on a pool
    with 0 to ``max_slack`` pages beyond the most demanding request's, with 1 to
    ``max_num_seqs`` seats."""
    for name, value, low in (
        ("max_requests", max_requests, 1),
        ("max_prompt", max_prompt, 1),
        ("max_output", max_output, 1),
        ("max_slack", max_slack, 0),
        ("max_num_seqs", max_num_seqs, 1),
    ):
        check_knob("serving_cases", name, value, low)
    check_sizes("serving_cases", "page_sizes", page_sizes)
    sizes = list(page_sizes)
    for b in sizes:
        check_knob("serving_cases", "page_sizes", b, 2)
    request = st.tuples(
        st.integers(1, max_prompt),
        st.integers(1, max_output),
        st.sampled_from([0.0, 0.0, 0.05, 0.2, 0.5]),
    )
    return st.builds(
        lambda specs, b, slack, seats: ServingCase(
            tuple(
                WorkloadRequest(f"r{i}", arrival, prompt, output)
                for i, (prompt, output, arrival) in enumerate(specs)
            ),
            b,
            slack,
            seats,
        ),
        st.lists(request, min_size=1, max_size=max_requests),
        st.sampled_from(sizes),
        st.integers(0, max_slack),
        st.integers(1, max_num_seqs),
    )


#: What is left out for a policy that cannot be deep-copied.
SERVED_COPIES = "'serves' ran the policy object itself twice, not two fresh copies"


def _fresh(policy: CapacityPolicy, copies: bool) -> CapacityPolicy:
    return copy.deepcopy(policy) if copies else policy


def _serve(
    policy: CapacityPolicy, case: ServingCase, config: GrowPageConfig, pages: int, copies: bool
) -> ServingResult:
    sim = SimConfig(
        num_kv_pages=pages,
        max_num_seqs=case.max_num_seqs,
        admission_reserve=0.0,
        decisions="trace",
        record_events=True,
    )
    return simulate(list(case.requests), _fresh(policy, copies), config, sim, COST)


def _first_difference(a: list[tuple], b: list[tuple]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"event {i}: {x} then {y}"
    return f"{len(a)} events then {len(b)}"


def check_serving_case(
    policy: CapacityPolicy, case: ServingCase, copies: bool | None = None
) -> None:
    """Serve ``case`` twice under copies of ``policy``; raise ``PolicyConformanceError``
    (rule ``serves``) on the first thing that goes wrong.

    ``copies``: whether ``policy`` can be deep-copied (None: try; one that cannot is served
    itself, with a ``PolicyConformanceWarning``)."""
    if copies is None:
        copies = copy_policy(policy, SERVED_COPIES) is not None
    config = case.config()
    pages = case.num_kv_pages(config, policy.fallback_to_compress)

    def fail(detail: str) -> PolicyConformanceError:
        return PolicyConformanceError("serves", f"{detail} (pool of {pages} pages)", case)

    try:  # the two runs see different global RNG states, as check_policy's
        with global_rngs_seeded(0):
            result = _serve(policy, case, config, pages, copies)
    except GrowPageError as exc:
        raise fail(f"the run stopped: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:
        raise fail(f"the run crashed: {type(exc).__name__}: {exc}") from exc
    unfinished = [
        r.request_id
        for r in result.requests
        if r.finish_s is None or r.generated != r.output_tokens - 1
    ]
    if unfinished or len(result.requests) != len(case.requests):
        raise fail(f"requests {unfinished} did not finish with all their tokens")
    if result.metrics.peak_pages > pages:
        raise fail(f"{result.metrics.peak_pages} pages were in use at once")
    try:
        result.pool.check_invariants()
    except AssertionError as exc:
        raise fail(f"the pool's bookkeeping broke: {exc}") from exc
    if result.pool.num_free_pages != pages:
        raise fail(f"{pages - result.pool.num_free_pages} pages never came back to the pool")
    with global_rngs_seeded(1):
        again = _serve(policy, case, config, pages, copies)
    if again.events != result.events:
        run = "a fresh copy of the policy" if copies else "the same policy object"
        raise fail(
            f"a second run of {run} gave other events (first "
            f"difference: {_first_difference(result.events or [], again.events or [])}): "
            "the policy depends on state outside its contexts (a global RNG, a counter)"
        )


def check_serving(policy: CapacityPolicy, max_examples: int = 15, **strategy_kwargs: Any) -> None:
    """Serve ``max_examples`` small random workloads (``serving_cases(**strategy_kwargs)``)
    under ``policy`` in the simulator, each on a pool just large enough for its most demanding
    request alone; see the module docstring for what is checked.

    Raises ``PolicyConformanceError`` (rule ``serves``) with the smallest failing workload
    hypothesis found; ``TypeError`` when ``policy`` is not a policy object.
    """
    refuse_a_class(policy, "check_serving")
    check_knob("check_serving", "max_examples", max_examples, 1)
    if not isinstance(policy, CapacityPolicy):
        raise TypeError(
            f"check_serving takes a CapacityPolicy instance (the simulator and the "
            f"engine run only those), got {policy!r}"
        )
    failure: list[PolicyConformanceError] = []
    copies = copy_policy(policy, SERVED_COPIES) is not None

    @kit_settings(max_examples)
    @given(serving_cases(**strategy_kwargs))
    def run(case: ServingCase) -> None:
        try:
            check_serving_case(policy, case, copies)
        except PolicyConformanceError as exc:
            failure[:] = [exc]
            raise

    raise_smallest_failure(run, failure, "a workload")


def script_mode_problem(policy: CapacityPolicy) -> str | None:
    """Why ``policy`` cannot be served in script mode (the default of ``growpage sim serve``),
    or None: a few small workloads on tight and ample pools, served with played-back signals.

    Not a conformance rule (the policy may be right, and trace mode serves it): script mode
    plays back the signals a replay of a synthetic trace read, so a policy whose choice of
    signals depends on the pool, or that reads KV content, cannot run there."""
    case = ServingCase(
        tuple(WorkloadRequest(f"r{i}", 0.05 * (i % 2), 20 + 3 * i, 60 + 30 * i) for i in range(5)),
        page_size=8,
        slack=1,
        max_num_seqs=4,
    )
    config = case.config()
    tight = case.num_kv_pages(config, policy.fallback_to_compress)
    with warnings.catch_warnings():  # check_serving has said so, if it cannot be copied
        warnings.simplefilter("ignore", PolicyConformanceWarning)
        copies = copy_policy(policy, SERVED_COPIES) is not None
    for pages in (tight, 4 * tight):
        sim = SimConfig(
            num_kv_pages=pages,
            max_num_seqs=case.max_num_seqs,
            admission_reserve=0.0,
            decisions="script",
            num_scripts=2,
        )
        try:
            with global_rngs_seeded(0):
                simulate(list(case.requests), _fresh(policy, copies), config, sim, COST)
        except GrowPageError as exc:
            return f"{type(exc).__name__}: {exc}"
    return None
