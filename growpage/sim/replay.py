"""Per-request replay: one trace, one policy, the shared ``CapacityController``.

The prompt is prefilled (all its keys written, ``ceil(prompt_len / b)`` pages, no decisions).
Then every decode token ``t`` updates the query summaries from its pre-RoPE query, calls the
controller when the request is at a capacity boundary, and writes its key. The summaries are
precomputed (``sim.ema``) and keys are written a page at a time, so the loop runs once per
boundary. After each boundary the retained set is scored against the real attention of a sample
of the next page's queries (``sim.fidelity``); with ``signals`` the boundary also gets the
paper's section 5.3 measurements (``BoundaryRecord.future_change`` and ``advantage``).
"""

from __future__ import annotations

import math

import attrs
import torch

from growpage.core.capacity import BoundaryOutcome, CapacityController
from growpage.core.config import GrowPageConfig
from growpage.core.decision import Action
from growpage.core.pages import PagePool
from growpage.core.request import RequestState
from growpage.core.traces import Trace
from growpage.errors import ConfigError
from growpage.policies.base import CapacityPolicy
from growpage.policies.registry import resolve_policy
from growpage.sim.fidelity import Fidelity, FutureAttention
from growpage.sim.records import BoundaryRecord, ReplayResult
from growpage.sim.traceview import TraceView
from growpage.validators import flag, non_negative_int


@attrs.frozen(kw_only=True)
class ReplayOptions:
    """What a replay measures besides decisions.

    Attributes:
        fidelity_queries: future queries sampled per boundary (evenly over the next page) to
            score the retained set; 0 turns fidelity off (decisions only, fastest).
        output_error: also compute the attention-output error when the trace has values.
        signals: record Delta_t, the future demand change and the counterfactual growth
            advantage at every policy-decided boundary (needs ``fidelity_queries > 0``).
        release: return the request's pages to the pool when the replay ends.
    """

    fidelity_queries: int = attrs.field(default=8, validator=non_negative_int)
    output_error: bool = attrs.field(default=True, validator=flag)
    signals: bool = attrs.field(default=False, validator=flag)
    release: bool = attrs.field(default=True, validator=flag)

    def __attrs_post_init__(self) -> None:
        if self.signals and not self.fidelity_queries:
            raise ConfigError("ReplayOptions.signals needs fidelity_queries > 0")


def replay_trace(
    trace: Trace,
    policy: str | CapacityPolicy,
    config: GrowPageConfig | None = None,
    options: ReplayOptions | None = None,
    pool: PagePool | None = None,
) -> ReplayResult:
    """Replay ``trace`` under ``policy``; see the module docstring.

    ``pool`` defaults to a private pool large enough to hold the whole trace uncompressed; with
    a smaller shared pool, GROW may fall back, and a boundary that cannot make room at all stops
    the replay (``ReplayResult.preempted``).
    """
    config = config or GrowPageConfig()
    options = options or ReplayOptions()
    policy = resolve_policy(policy)
    b, total, prompt = config.page_size, trace.num_tokens, trace.prompt_len
    if pool is None:
        pool = PagePool(math.ceil(total / b) + config.watermark + 2, b, watermark=config.watermark)
    controller = CapacityController(policy, pool, config)
    view = TraceView(
        trace, config, track_accumulated=getattr(policy, "needs_accumulated_attention", False)
    )
    state = RequestState(
        trace.request_id,
        pool.allocate(math.ceil(prompt / b)),
        num_tokens=prompt,
        position=prompt,
        num_prompt_tokens=prompt,
    )
    try:
        result = _run(trace, policy, view, state, controller, options)
    except BaseException:
        pool.free(state.block_table)  # a failing policy or view leaves the pool as it was
        raise
    if options.release:
        pool.free(state.block_table)
    return result


def _run(
    trace: Trace,
    policy: CapacityPolicy,
    view: TraceView,
    state: RequestState,
    controller: CapacityController,
    options: ReplayOptions,
) -> ReplayResult:
    b, total, prompt = controller.config.page_size, trace.num_tokens, trace.prompt_len
    view.write_until(prompt)
    probe = _Probe(view, controller, options)
    records: list[BoundaryRecord] = []
    budget_tokens, max_pages, preempted = 0, state.num_pages, False
    while state.position < total:
        if controller.needs_decision(state):
            records.append(probe.boundary(state))
            if records[-1].action == Action.PREEMPT.value:
                preempted = True
                break
            max_pages = max(max_pages, state.num_pages)
        n = min(state.num_pages * b - state.num_tokens, total - state.position)
        view.write_until(state.position + n)
        state.num_tokens += n
        state.position += n
        budget_tokens += n * state.num_pages * b
    decoded = state.position - prompt
    avg_budget = budget_tokens / decoded if decoded else float(state.num_pages * b)
    return ReplayResult(
        trace.request_id,
        getattr(policy, "name", type(policy).__name__),
        b,
        prompt,
        total,
        records,
        state.events.as_dict(),
        avg_budget,
        max_pages,
        state.num_pages,
        probe.head_mass(),
        preempted,
    )


class _Probe:
    """Runs one boundary through the controller and measures it."""

    def __init__(
        self, view: TraceView, controller: CapacityController, options: ReplayOptions
    ) -> None:
        self.view, self.controller, self.options = view, controller, options
        self.config = controller.config
        self._head_mass: list[torch.Tensor] = []
        self._demand: dict[int, float] = {}  # window start -> mean working-set ratio

    def head_mass(self) -> torch.Tensor | None:
        return torch.stack(self._head_mass) if self._head_mass else None

    def boundary(self, state: RequestState) -> BoundaryRecord:
        view, t = self.view, state.position
        view.prepare_boundary(t)
        before = view.positions().clone() if self.options.signals else None
        delta, alternative = (
            self._counterfactual_inputs(state) if before is not None else (None, None)
        )
        outcome = self.controller.on_boundary(state, view)
        fields = _outcome_fields(t, outcome)
        if outcome.delta is not None:
            delta = outcome.delta
        fields["delta"] = delta
        if self.options.fidelity_queries and outcome.action is not Action.PREEMPT:
            fields.update(self._fidelity(t, state, before, alternative, delta))
        return BoundaryRecord(**fields)

    def _counterfactual_inputs(
        self, state: RequestState
    ) -> tuple[float | None, torch.Tensor | None]:
        """Delta_t and the policy's compress selection (as positions), before anything changes."""
        # NOTE: the controller's own test for a forced growth: below the floor, or before
        # any decode query (a prompt ending on a page boundary), where Delta_t of the empty
        # query state would read 0.0 and land in signal_quality's buckets as a decision.
        if not self.controller.will_decide(state, self.view):
            return None, None  # forced growth: no decision to evaluate
        ctx = self.controller.context(state, self.view)
        keep = (state.num_pages - 1) * self.config.page_size
        slots = self.controller.checked_selection(ctx, keep)
        return ctx.delta(), torch.gather(self.view.positions(), 2, slots)

    def _fidelity(
        self,
        t: int,
        state: RequestState,
        before: torch.Tensor | None,
        alternative: torch.Tensor | None,
        delta: float | None,
    ) -> dict:
        end = min(t + self.config.page_size, self.view.num_positions)
        future = FutureAttention.compute(self.view, t, end, self.options.fidelity_queries)
        with_error = self.options.output_error
        fid = Fidelity.of(future, self.view.positions(), with_error)
        self._head_mass.append(fid.head_mass)
        out = {
            "mass_mean": fid.mass_mean,
            "mass_min": fid.mass_min,
            "output_error": fid.output_error,
        }
        if before is None:
            return out
        self._demand[t] = future.working_set_ratio(self.config.top_p)
        current = self._window_demand(t)
        if current is not None:
            out["future_change"] = self._demand[t] - current
        if alternative is not None and delta is not None:
            grow, compress = (
                Fidelity.of(future, before, with_error),
                Fidelity.of(future, alternative, with_error),
            )
            out["advantage"] = grow.mass_mean - compress.mass_mean
            if grow.output_error is not None and compress.output_error is not None:
                out["advantage_error"] = compress.output_error - grow.output_error
        return out

    def _window_demand(self, t: int) -> float | None:
        """Working-set ratio of the queries of the page before ``t`` (full KV)."""
        start = max(t - self.config.page_size, self.view.trace.prompt_len)
        if start >= t:
            return None
        if start not in self._demand:
            future = FutureAttention.compute(self.view, start, t, self.options.fidelity_queries)
            self._demand[start] = future.working_set_ratio(self.config.top_p)
        return self._demand[start]


def _outcome_fields(position: int, outcome: BoundaryOutcome) -> dict:
    return {
        "position": position,
        "action": outcome.action.value,
        "decision": None if outcome.decision is None else outcome.decision.value,
        "fallback": outcome.fallback,
        "pages_before": outcome.pages_before,
        "pages_after": outcome.pages_after,
        "tokens_after": outcome.tokens_after,
    }
