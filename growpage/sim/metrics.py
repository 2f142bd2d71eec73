"""Serving metrics as the paper reports them (section 5.1, Tables 7-9, Fig. 5)."""

from __future__ import annotations

import attrs

from growpage.core.events import EventCounters
from growpage.sim.requests import SimRequest


@attrs.frozen(kw_only=True)
class ServingMetrics:
    """Aggregate metrics of one simulated run.

    Attributes:
        total_time_s: simulated seconds from the first arrival until every request finished.
        tps: output tokens per second over ``total_time_s``.
        tpot_ms: mean over requests of (finish - end of first prefill) / output tokens.
        ttft_s: mean seconds from arrival to the end of the request's first prefill.
        avg_resident: time-average number of requests resident in KV memory (the paper's C).
        avg_kv_budget: mean over requests of their average capacity (tokens) while decoding.
        grow_ratio: share of policy decisions that were GROW, before fallback (Table 9).
        grows: executed growths (forced ones included); compresses, shrinks, fallbacks as the
            controller counted them; preemptions: requests preempted by the scheduler.
        peak_pages: most pages in use at once.
        boundary_time_s: simulated seconds of capacity control (``CostModel.boundary_time``),
            part of ``total_time_s``; 0 unless the cost model prices it.
    """

    policy: str
    num_requests: int
    output_tokens: int
    total_time_s: float
    tps: float
    tpot_ms: float
    ttft_s: float
    avg_resident: float
    avg_kv_budget: float
    grow_ratio: float
    grows: int
    forced_grows: int
    compresses: int
    shrinks: int
    fallbacks: int
    preemptions: int
    decode_steps: int
    prefill_steps: int
    peak_pages: int
    num_pages: int
    boundary_time_s: float = 0.0

    def as_dict(self) -> dict:
        return attrs.asdict(self)


def compute_metrics(policy: str, requests: list[SimRequest], events: EventCounters,
                    total_time_s: float, resident_seconds: float, num_preemptions: int,
                    decode_steps: int, prefill_steps: int, peak_pages: int, num_pages: int,
                    boundary_time_s: float = 0.0) -> ServingMetrics:
    """Metrics of a finished run; ``resident_seconds`` is the integral of the batch size."""
    out_tokens = sum(r.output_tokens for r in requests)
    n = max(len(requests), 1)
    tpot = [(r.finish_s - r.first_token_s) / r.output_tokens for r in requests
            if r.finish_s is not None and r.first_token_s is not None]
    ttft = [r.first_token_s - r.spec.arrival_s for r in requests if r.first_token_s is not None]
    return ServingMetrics(
        policy=policy, num_requests=len(requests), output_tokens=out_tokens,
        total_time_s=total_time_s, tps=out_tokens / total_time_s if total_time_s else 0.0,
        tpot_ms=1e3 * sum(tpot) / max(len(tpot), 1), ttft_s=sum(ttft) / max(len(ttft), 1),
        avg_resident=resident_seconds / total_time_s if total_time_s else 0.0,
        avg_kv_budget=sum(r.avg_budget for r in requests) / n, grow_ratio=events.grow_ratio,
        grows=events.grow, forced_grows=events.forced_grow, compresses=events.compress,
        shrinks=events.shrink, fallbacks=events.fallback, preemptions=num_preemptions,
        decode_steps=decode_steps, prefill_steps=prefill_steps, peak_pages=peak_pages,
        num_pages=num_pages, boundary_time_s=boundary_time_s)
