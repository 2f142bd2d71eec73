"""Signal and policy analysis of recorded (real-model) trace sets.

``analyze(traces, settings)`` replays every trace under the policies of the paper's appendix-H
table and measures the Delta_t signal (paper section 5.3) on them:

* signals (Fig. 6 / 7) at every policy-decided boundary of the ``growpage`` replay, and of the
  ``fullkv`` replay (there the KV is never compressed, so the counterfactual compares full KV
  with one compression: the cleanest version of the paper's reference-trace setup);
* per signal set, a cluster bootstrap over traces for the Spearman rho and for each Delta_t
  bucket's mean growth advantage (``bucket_ci95``), the rho of a naive
  *persistence* predictor (the demand change of the page just finished) as a yardstick, and,
  for traces whose header has ``meta["first_eos"]`` (recorded past the end of turn), the
  signal before and after that point;
* for the same boundaries, the rho of Delta_t with the demand *level* before and after
  (``level_correlations``): what Delta_t tracks when it does not predict the change;
* the policy table: ``growpage``, ``fixed`` at ``budgets``, ``random`` at the grow probability
  that ``growpage`` showed on the same traces, ``inverse``, ``shrink``, ``fullkv``, ``entropy``,
  ``streamingllm`` and ``h2o`` (at ``baseline_budget``).

Everything is per request with a private page pool (no fallbacks), as ``growpage sim replay``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch
from tqdm import tqdm

from growpage._convert import int_tuple
from growpage.core.config import GrowPageConfig
from growpage.core.traces import Trace
from growpage.errors import ConfigError
from growpage.policies.registry import resolve_policy
from growpage.sim.fidelity import FutureAttention
from growpage.sim.records import BoundaryRecord, ReplayResult
from growpage.sim.replay import ReplayOptions, replay_trace
from growpage.sim.reports import aggregate_replays
from growpage.sim.signal import signal_quality, spearman
from growpage.sim.traceview import TraceView
from growpage.validators import items, non_negative_int, optional, positive_int


@attrs.frozen(kw_only=True)
class RealTraceSettings:
    """Settings of ``analyze``.

    Attributes:
        page_size: tokens per page (b); real SmolLM2 traces are ~1.1k tokens, so 32 or 64.
        fidelity_queries: future queries sampled per boundary.
        budgets: fixed-budget points (tokens).
        baseline_budget: budget of ``streamingllm`` and ``h2o``; None = the middle budget.
        shrink_min_tokens: ``shrink``'s minimum capacity (the paper's 1024 is a whole trace here).
        bootstrap: resamples of the cluster bootstrap over traces (0 = none).
        seed: seed of the bootstrap and of ``random``.
    """

    page_size: int = attrs.field(default=64, validator=positive_int)
    fidelity_queries: int = attrs.field(default=8, validator=positive_int)
    budgets: tuple[int, ...] = attrs.field(
        default=(256, 512, 768), converter=int_tuple, validator=items(positive_int)
    )
    baseline_budget: int | None = attrs.field(default=None, validator=optional(positive_int))
    shrink_min_tokens: int = attrs.field(default=256, validator=positive_int)
    bootstrap: int = attrs.field(default=1000, validator=non_negative_int)
    seed: int = attrs.field(default=0, validator=non_negative_int)

    def config(self) -> GrowPageConfig:
        """The paper's defaults, with the recent window scaled to small pages (b // 4 <= 16)."""
        return GrowPageConfig(page_size=self.page_size, recent_window=min(16, self.page_size // 4))

    @property
    def middle_budget(self) -> int:
        if self.baseline_budget is not None:
            return self.baseline_budget
        return sorted(self.budgets)[len(self.budgets) // 2]


@attrs.frozen
class PolicyPoint:
    """One row of the policy table."""

    label: str
    policy: str
    params: dict = attrs.field(factory=dict)
    group: str = ""
    signals: bool = False


def policy_points(settings: RealTraceSettings, grow_prob: float) -> list[PolicyPoint]:
    """The appendix-H points besides ``growpage`` (``random`` at ``grow_prob``)."""
    mid = settings.middle_budget
    points = [PolicyPoint("fullkv", "fullkv", signals=True)]
    points += [
        PolicyPoint(f"fixed-{b}", "fixed", {"budget_tokens": b}, "fixed")
        for b in sorted(settings.budgets)
    ]
    points += [
        PolicyPoint(
            f"random (q={grow_prob:.2f})",
            "random",
            {"grow_prob": round(grow_prob, 4), "seed": settings.seed},
        ),
        PolicyPoint("inverse", "inverse"),
        PolicyPoint("shrink", "shrink", {"min_capacity_tokens": settings.shrink_min_tokens}),
        PolicyPoint("entropy", "entropy"),
        PolicyPoint(f"streamingllm-{mid}", "streamingllm", {"budget_tokens": mid}),
        PolicyPoint(f"h2o-{mid}", "h2o", {"budget_tokens": mid}),
    ]
    return points


def replay_point(
    traces: Sequence[Trace],
    point: PolicyPoint,
    config: GrowPageConfig,
    fidelity_queries: int,
    bar: tqdm | None = None,
) -> list[ReplayResult]:
    """Replay every trace under ``point``'s policy (``bar`` advances once per trace)."""
    options = ReplayOptions(fidelity_queries=fidelity_queries, signals=point.signals)
    results = []
    for trace in traces:
        policy = resolve_policy(point.policy, **point.params)
        results.append(replay_trace(trace, policy, config, options))
        if bar is not None:
            bar.update(1)
    return results


def grow_ratio(results: Iterable[ReplayResult]) -> float:
    """Share of GROW among the policy's primary decisions (paper Table 9's grow ratio)."""
    decided = [r.decision for res in results for r in res.records if r.decision is not None]
    return sum(d == "grow" for d in decided) / len(decided) if decided else 0.0


def _signal_records(results: Sequence[ReplayResult]) -> list[list[BoundaryRecord]]:
    return [[r for r in res.records if r.delta is not None] for res in results]


def _persistence_pairs(
    per_trace: Sequence[Sequence[BoundaryRecord]], page_size: int
) -> list[tuple[float, float]]:
    """(demand change of the page just finished, of the next page) at consecutive boundaries."""
    pairs = []
    for records in per_trace:
        for a, b in zip(records[:-1], records[1:], strict=True):
            if (
                b.position - a.position == page_size
                and a.future_change is not None
                and b.future_change is not None
            ):
                pairs.append((a.future_change, b.future_change))
    return pairs


def _bootstrap_rho(
    per_trace: Sequence[Sequence[BoundaryRecord]], num: int, seed: int
) -> tuple[float, float] | None:
    """95% interval of Spearman's rho, resampling whole traces (boundaries of one request are
    not independent)."""
    pairs = [
        [
            (r.delta, r.future_change)
            for r in recs
            if r.delta is not None and r.future_change is not None
        ]
        for recs in per_trace
    ]
    pairs = [p for p in pairs if p]
    if num <= 0 or len(pairs) < 2:
        return None
    rng = np.random.default_rng(seed)
    rhos = []
    for _ in range(num):
        pooled = [xy for i in rng.integers(0, len(pairs), len(pairs)) for xy in pairs[i]]
        rho = spearman([x for x, _ in pooled], [y for _, y in pooled])
        if not np.isnan(rho):
            rhos.append(rho)
    if not rhos:
        return None
    lo, hi = np.percentile(rhos, [2.5, 97.5])
    return float(lo), float(hi)


def _bootstrap_buckets(
    per_trace: Sequence[Sequence[BoundaryRecord]], num: int, seed: int
) -> list[dict[str, tuple[float, float] | None]]:
    """Per Delta_t bucket, the 95% interval of the mean growth advantage (retained mass and
    output error), resampling whole traces as ``_bootstrap_rho`` does.

    A bucket gets ``None`` where fewer than two traces have a boundary in it: resampling one
    trace says nothing about the spread between requests.
    """
    per_trace = [[r for r in recs if r.advantage is not None] for recs in per_trace]
    num_buckets = len(signal_quality([]).buckets)
    keys = ("mean_advantage", "mean_advantage_error")
    empty: list[dict[str, tuple[float, float] | None]] = [
        {k: None for k in keys} for _ in range(num_buckets)
    ]
    if num <= 0 or len(per_trace) < 2:
        return empty
    contributing = np.zeros(num_buckets, dtype=int)
    for recs in per_trace:
        counts = [b.count for b in signal_quality(recs).buckets]
        contributing += np.array(counts) > 0
    rng = np.random.default_rng(seed)
    draws: list[dict[str, list[float]]] = [{k: [] for k in keys} for _ in range(num_buckets)]
    for _ in range(num):
        pooled = [r for i in rng.integers(0, len(per_trace), len(per_trace)) for r in per_trace[i]]
        for j, bucket in enumerate(signal_quality(pooled).buckets):
            for k in keys:
                value = getattr(bucket, k)
                if value is not None:
                    draws[j][k].append(value)
    out = empty
    for j in range(num_buckets):
        for k in keys:
            if contributing[j] >= 2 and draws[j][k]:
                lo, hi = np.percentile(draws[j][k], [2.5, 97.5])
                out[j][k] = (float(lo), float(hi))
    return out


def _subset_quality(per_trace: Sequence[Sequence[BoundaryRecord]]) -> dict[str, Any]:
    records = [r for recs in per_trace for r in recs]
    q = signal_quality(records)
    return {
        "num_boundaries": q.num_boundaries,
        "spearman": q.spearman,
        "sign_agreement": q.sign_agreement,
        "mean_advantage": [b.mean_advantage for b in q.buckets],
        "counts": [b.count for b in q.buckets],
    }


def split_at(
    results: Sequence[ReplayResult], cutoffs: Mapping[str, int], page_size: int
) -> dict[str, dict[str, Any]]:
    """Signal quality of the boundaries whose next page ends before the request's cutoff
    (``before``: e.g. the model's own answer, up to its first end of turn) and of the rest."""
    per_trace = _signal_records(results)
    before, after = [], []
    for res, recs in zip(results, per_trace, strict=True):
        cut = cutoffs.get(res.request_id)
        if cut is None:
            continue
        before.append([r for r in recs if r.position + page_size <= cut])
        after.append([r for r in recs if r.position + page_size > cut])
    return {"before": _subset_quality(before), "after": _subset_quality(after)}


def signal_summary(
    results: Sequence[ReplayResult],
    page_size: int,
    bootstrap: int = 0,
    seed: int = 0,
    cutoffs: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Fig. 6 / 7 numbers of one replay set, plus context (interval, persistence, per trace,
    and with ``cutoffs`` the split of ``split_at``)."""
    per_trace = _signal_records(results)
    records = [r for recs in per_trace for r in recs]
    quality = signal_quality(records)
    pairs = [
        (r.delta, r.future_change)
        for r in records
        if r.delta is not None and r.future_change is not None
    ]
    adv = [
        (r.delta, r.advantage) for r in records if r.delta is not None and r.advantage is not None
    ]
    persistence = _persistence_pairs(per_trace, page_size)
    per_trace_rho = []
    for recs in per_trace:
        xy = [
            (r.delta, r.future_change)
            for r in recs
            if r.delta is not None and r.future_change is not None
        ]
        per_trace_rho.append(spearman([x for x, _ in xy], [y for _, y in xy]))
    deltas, changes = np.array([x for x, _ in pairs]), np.array([y for _, y in pairs])
    return {
        **quality.as_dict(),
        "spearman_ci95": _bootstrap_rho(per_trace, bootstrap, seed),
        "bucket_ci95": _bootstrap_buckets(per_trace, bootstrap, seed),
        "spearman_delta_advantage": spearman([x for x, _ in adv], [y for _, y in adv]),
        "persistence_spearman": spearman([a for a, _ in persistence], [b for _, b in persistence]),
        "persistence_pairs": len(persistence),
        "per_trace_spearman": per_trace_rho,
        "delta_mean": float(deltas.mean()) if pairs else None,
        "delta_std": float(deltas.std()) if pairs else None,
        "future_change_std": float(changes.std()) if pairs else None,
        "pairs": pairs,
        "split": None if cutoffs is None else split_at(results, cutoffs, page_size),
    }


def level_correlations(
    traces: Sequence[Trace],
    results: Sequence[ReplayResult],
    config: GrowPageConfig,
    num_queries: int,
) -> dict[str, Any]:
    """Spearman rho of Delta_t with the demand *level* (mean top-p working-set ratio, full KV)
    of the page before each boundary and of the page after it.

    Delta_t compares a recent and a long query summary, so it should track the current level
    against the long-run one; whether that predicts the *change* depends on how demand moves.
    """
    deltas: list[float] = []
    current: list[float] = []
    future: list[float] = []
    for trace, res in zip(traces, results, strict=True):
        view = TraceView(trace, config)
        for r in res.records:
            start = max(r.position - config.page_size, trace.prompt_len)
            end = min(r.position + config.page_size, trace.num_tokens)
            if r.delta is None or start >= r.position or end <= r.position:
                continue
            deltas.append(r.delta)
            for out, (a, b) in ((current, (start, r.position)), (future, (r.position, end))):
                attn = FutureAttention.compute(view, a, b, num_queries)
                out.append(attn.working_set_ratio(config.top_p))
    return {
        "num_boundaries": len(deltas),
        "spearman_current_level": spearman(deltas, current),
        "spearman_next_level": spearman(deltas, future),
        "spearman_current_level_vs_change": spearman(
            current, [f - c for f, c in zip(future, current, strict=True)]
        ),
    }


def table_row(point: PolicyPoint, results: Sequence[ReplayResult]) -> dict[str, Any]:
    """One policy-table row: ``aggregate_replays`` plus the grow ratio and the point's params."""
    row = aggregate_replays(results, point.label)
    row.update(
        policy_name=point.policy,
        params=dict(point.params),
        group=point.group,
        grow_ratio=grow_ratio(results),
    )
    return row


@attrs.define
class RealTraceAnalysis:
    """What ``analyze`` measured; ``results[label]`` are the replays of each table row."""

    settings: RealTraceSettings
    trace_ids: list[str]
    results: dict[str, list[ReplayResult]]
    rows: list[dict[str, Any]]
    signals: dict[str, dict[str, Any]]

    def as_dict(self, with_records: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "settings": attrs.asdict(self.settings),
            "config": attrs.asdict(self.settings.config()),
            "traces": self.trace_ids,
            "table": self.rows,
            "signals": self.signals,
        }
        if with_records:
            out["replays"] = {
                label: [r.as_dict() for r in res] for label, res in self.results.items()
            }
        return out


def analyze(
    traces: Sequence[Trace],
    settings: RealTraceSettings | None = None,
    progress: bool = True,
    table: bool = True,
) -> RealTraceAnalysis:
    """Replay ``traces`` under the appendix-H policies and measure the signal (module docstring).

    With ``table=False`` only ``growpage`` and ``fullkv`` are replayed (the signal sets).
    """
    settings = settings or RealTraceSettings()
    config = settings.config()
    if not traces:
        raise ConfigError("analyze needs at least one trace")
    gp_point = PolicyPoint("growpage", "growpage", signals=True)
    num_points = 1 + len(policy_points(settings, 0.0)) if table else 2
    bar = tqdm(
        total=num_points * len(traces),
        desc=f"replay b={settings.page_size}",
        unit="trace",
        disable=not progress,
        dynamic_ncols=True,
    )
    bar.set_postfix_str("growpage")
    results = {"growpage": replay_point(traces, gp_point, config, settings.fidelity_queries, bar)}
    points = [gp_point] + policy_points(settings, grow_ratio(results["growpage"]))
    if not table:
        points = [p for p in points if p.signals]
    for point in points[1:]:
        bar.set_postfix_str(point.label)
        results[point.label] = replay_point(traces, point, config, settings.fidelity_queries, bar)
    bar.close()
    rows = [table_row(p, results[p.label]) for p in points]
    cutoffs = {
        t.request_id: t.prompt_len + t.header.meta["first_eos"]
        for t in traces
        if isinstance(t.header.meta.get("first_eos"), int)
    }
    signals = {
        p.label: signal_summary(
            results[p.label], settings.page_size, settings.bootstrap, settings.seed, cutoffs or None
        )
        for p in points
        if p.signals
    }
    for label, sig in signals.items():
        sig["levels"] = level_correlations(
            traces, results[label], config, settings.fidelity_queries
        )
    return RealTraceAnalysis(settings, [t.request_id for t in traces], results, rows, signals)


def subset_trace(
    trace: Trace,
    layer_ids: Sequence[int] | None = None,
    values: bool = True,
    max_generated: int | None = None,
) -> Trace:
    """``trace`` restricted to some recorded layers, without values, and/or cut after
    ``max_generated`` generated tokens (to keep a committed trace set small)."""
    h = trace.header
    layer_ids = list(h.layer_ids if layer_ids is None else layer_ids)
    missing = sorted(set(layer_ids) - set(h.layer_ids))
    if missing:
        raise ConfigError(
            f"{trace.request_id}: layers {missing} are not recorded (recorded: {list(h.layer_ids)})"
        )
    rows = [h.layer_ids.index(i) for i in sorted(layer_ids)]
    end = h.num_tokens if max_generated is None else min(h.num_tokens, h.prompt_len + max_generated)
    kept_values = trace.values if values else None
    meta = dict(h.meta)
    if end < h.num_tokens:
        meta["last_token_id"] = h.token_ids[end]
    header = attrs.evolve(
        h,
        layer_ids=sorted(layer_ids),
        token_ids=list(h.token_ids[:end]),
        has_values=kept_values is not None,
        meta=meta,
    )

    def pick(x: torch.Tensor) -> torch.Tensor:
        return x[rows, :end].clone()

    return Trace(
        header=header,
        queries=pick(trace.queries),
        keys=pick(trace.keys),
        values=None if kept_values is None else pick(kept_values),
    )


__all__ = [
    "PolicyPoint",
    "RealTraceAnalysis",
    "RealTraceSettings",
    "analyze",
    "grow_ratio",
    "policy_points",
    "replay_point",
    "signal_summary",
    "subset_trace",
    "table_row",
]
