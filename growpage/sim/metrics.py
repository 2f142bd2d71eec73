"""Serving metrics as the paper reports them (section 5.1, Tables 7-9, Fig. 5)."""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from growpage.core.events import EventCounters
from growpage.latency import PERCENTILES, percentile_fields
from growpage.sim.requests import SimRequest

__all__ = ["PERCENTILES", "ServingMetrics", "compute_metrics"]


@attrs.frozen(kw_only=True)
class ServingMetrics:
    """Aggregate metrics of one simulated run.

    Attributes:
        total_s: simulated seconds from the first arrival until every request finished.
        tps: output tokens per second over ``total_s``.
        tpot_ms: mean over requests of (finish - end of first prefill) / (output tokens - 1),
            as the engine's (requests of one output token have none).
        ttft_s: mean seconds from arrival to the end of the request's first prefill.
        avg_resident: time-average number of requests resident in KV memory (the paper's C).
        avg_kv_budget: mean over requests of their average capacity (tokens) while decoding
            (requests that never decoded, of one output token, are left out, as from TPOT).
        grow_ratio: share of policy decisions that were GROW, before fallback (Table 9).
        grows: executed growths (forced ones included); compresses, shrinks, fallbacks as the
            controller counted them; num_preemptions: requests preempted by the scheduler.
        peak_pages: most pages in use at once.
        boundary_s: simulated seconds of capacity control (``CostModel.boundary_time``),
            part of ``total_s``; 0 unless the cost model prices it.
        prefix_hit_tokens: prompt tokens (recomputes' tokens included) taken from the prefix
            cache instead of computed, as the engine's ``EngineStats.prefix_hit_tokens``.
        e2e_s: mean seconds from arrival to the request's last output token.
        ttft_p50_s ... e2e_p99_s: percentiles (``PERCENTILES``) over the requests of their
            TTFT (s), TPOT (ms) and end-to-end latency (s), defined as the means are; numpy's
            linear interpolation between the order statistics. 0 when there is no request.
    """

    policy: str
    num_requests: int
    output_tokens: int
    total_s: float
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
    num_preemptions: int
    decode_steps: int
    prefill_steps: int
    peak_pages: int
    num_pages: int
    boundary_s: float = 0.0
    e2e_s: float = 0.0
    ttft_p50_s: float = 0.0
    ttft_p90_s: float = 0.0
    ttft_p99_s: float = 0.0
    tpot_p50_ms: float = 0.0
    tpot_p90_ms: float = 0.0
    tpot_p99_ms: float = 0.0
    e2e_p50_s: float = 0.0
    e2e_p90_s: float = 0.0
    e2e_p99_s: float = 0.0
    prefix_hit_tokens: int = 0

    def as_dict(self) -> dict:
        return attrs.asdict(self)


def compute_metrics(
    policy: str,
    requests: list[SimRequest],
    events: EventCounters,
    total_s: float,
    resident_s: float,
    num_preemptions: int,
    decode_steps: int,
    prefill_steps: int,
    peak_pages: int,
    num_pages: int,
    boundary_s: float = 0.0,
    prefix_hit_tokens: int = 0,
) -> ServingMetrics:
    """Metrics of a finished run; ``resident_s`` is the integral of the batch size."""
    out_tokens = sum(r.output_tokens for r in requests)
    latencies = {
        "ttft": _known(r.ttft_s for r in requests),
        "tpot": _known(r.tpot_ms for r in requests),
        "e2e": _known(r.e2e_s for r in requests),
    }
    budgets = _known(r.avg_budget for r in requests)  # requests that decoded at all
    means = {
        name: sum(xs) / max(len(xs), 1) for name, xs in {**latencies, "budget": budgets}.items()
    }
    return ServingMetrics(
        policy=policy,
        num_requests=len(requests),
        output_tokens=out_tokens,
        total_s=total_s,
        tps=out_tokens / total_s if total_s else 0.0,
        tpot_ms=means["tpot"],
        ttft_s=means["ttft"],
        e2e_s=means["e2e"],
        avg_resident=resident_s / total_s if total_s else 0.0,
        avg_kv_budget=means["budget"],
        grow_ratio=events.grow_ratio,
        grows=events.grow,
        forced_grows=events.forced_grow,
        compresses=events.compress,
        shrinks=events.shrink,
        fallbacks=events.fallback,
        num_preemptions=num_preemptions,
        decode_steps=decode_steps,
        prefill_steps=prefill_steps,
        peak_pages=peak_pages,
        num_pages=num_pages,
        boundary_s=boundary_s,
        prefix_hit_tokens=prefix_hit_tokens,
        **percentile_fields(latencies, {"ttft": "s", "tpot": "ms", "e2e": "s"}),
    )


def _known(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None]
