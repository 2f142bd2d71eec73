"""How sensitive is GrowPage to its demand threshold τ and local quota k_loc (paper appendix D)?

    python benchmarks/sensitivity.py                  # committed traces + the mixed workload
    python benchmarks/sensitivity.py --no-serve       # the real traces only (seconds)
    python benchmarks/sensitivity.py --traces DIR --out DIR   # another trace set

D.1, τ (GrowPage grows when Δt > τ; the paper sweeps -0.003 to 0.003 in steps of 0.001):

* per-request replay of the real SmolLM2 traces of ``--traces`` (private pool, b =
  ``--page-size``, as ``benchmarks/real_traces.py``): average budget, grow share, attention
  mass kept by the next page's queries (mean, worst boundary), output error, and how many
  decided boundaries have Δt in each interval between the τ values (a boundary grows under
  τ_i and compresses under τ_i+1 only when its Δt lies in (τ_i, τ_i+1]);
* the serving simulator on ``--workload`` (script mode, ``--cost`` roofline, pages of 256 as
  results section 3): TPS, C, average budget, grow share, the Δt of the served decisions, and
  the fidelity of ``--fidelity-traces`` synthetic traces replayed at the same point.

D.2, k_loc (Eq. 10): the paper's 16/32/64/128 of a 256-token page (``--kloc``), scaled to each
page size (b/16 to b/2), at τ = 0: ``growpage`` and a fixed budget (``--kloc-budget``, whose
decisions do not read the selection, so only *which* tokens are kept changes) on the real
traces, and ``growpage`` served. A fixed budget is not served: in script mode its decisions and
hence TPS do not depend on k_loc at all.

Writes ``report.md``, ``sensitivity.json``, ``tau.png`` and ``kloc.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import attrs
import numpy as np
import torch
from script_args import ROOT, add_out, add_threads, parser, run_main
from tqdm import tqdm

from growpage.core.boundary_context import BoundaryContext  # noqa: E402
from growpage.core.config import GrowPageConfig  # noqa: E402
from growpage.core.decision import Decision  # noqa: E402
from growpage.core.selection import growpage_select  # noqa: E402
from growpage.core.trace_set import read_trace_set  # noqa: E402
from growpage.core.traces import Trace  # noqa: E402
from growpage.errors import ConfigError  # noqa: E402
from growpage.policies.base import CapacityPolicy  # noqa: E402
from growpage.policies.builtin import GrowPagePolicy  # noqa: E402
from growpage.policies.registry import resolve_policy  # noqa: E402
from growpage.sim.costmodel import RooflineCostModel, load_cost_model  # noqa: E402
from growpage.sim.realtrace import PolicyPoint, RealTraceSettings, table_row  # noqa: E402
from growpage.sim.records import ReplayResult  # noqa: E402
from growpage.sim.replay import ReplayOptions, replay_trace  # noqa: E402
from growpage.sim.reports import (  # noqa: E402
    aggregate_replays,
    make_output_dir,
    markdown_table,
    write_json,
)
from growpage.sim.scripted import ScriptedContext  # noqa: E402
from growpage.sim.serving import SimConfig, simulate  # noqa: E402
from growpage.sim.sources import SCRIPT_SPEC  # noqa: E402
from growpage.sim.synthetic import synthetic_trace  # noqa: E402
from growpage.sim.workload_csv import WorkloadRequest  # noqa: E402
from growpage.sim.workloads import resolve_workload  # noqa: E402

COMMITTED = ROOT / "data" / "traces" / "smollm2"
TAUS = (-0.003, -0.002, -0.001, 0.0, 0.001, 0.002, 0.003)  # paper appendix D.1
KLOC_AT_256 = (16, 32, 64, 128)  # paper Table 4, pages of 256
PAPER_PAGE = 256
SERVE_PAGE = 256  # tokens per page of the serving side (results section 3)
FIDELITY_QUERIES_SERVED = 4  # per boundary of the served points' synthetic traces (as a sweep)


def scaled_kloc(at_256: int, page_size: int) -> int:
    """The paper's k_loc for 256-token pages at ``page_size`` (same share of a page)."""
    if (at_256 * page_size) % PAPER_PAGE:
        raise ConfigError(
            f"k_loc {at_256} of {PAPER_PAGE} is no whole number of tokens at pages of {page_size}"
        )
    return at_256 * page_size // PAPER_PAGE


def page_share(k_loc: int, page_size: int) -> str:
    """``k_loc / b`` as a fraction ("1/4"), the label both sides share."""
    return str(Fraction(k_loc, page_size))


# ---- Δt intervals ----------------------------------------------------------------------------
def interval_labels(edges: Sequence[float]) -> list[str]:
    """``(-inf, e0]``, ``(e0, e1]``, ..., ``(e_n, inf)``: where a boundary's Δt decides alike
    under every τ of one interval's side (grow iff Δt > τ)."""
    inner = [f"({a:g}, {b:g}]" for a, b in zip(edges[:-1], edges[1:], strict=True)]
    return [f"≤ {edges[0]:g}"] + inner + [f"> {edges[-1]:g}"]


def count_deltas(deltas: Sequence[float], edges: Sequence[float]) -> dict:
    """Counts of ``deltas`` per interval of ``interval_labels(edges)`` and of exact zeros."""
    idx = np.searchsorted(
        np.asarray(edges, dtype=float), np.asarray(deltas, dtype=float), side="left"
    )
    counts = np.bincount(idx, minlength=len(edges) + 1)
    return {
        "delta_counts": [int(c) for c in counts],
        "delta_zero": int(sum(d == 0 for d in deltas)),
        "decided": len(deltas),
    }


def decided_deltas(results: Sequence[ReplayResult]) -> list[float]:
    """Δt of every policy-decided boundary of ``results``."""
    return [
        r.delta
        for res in results
        for r in res.records
        if r.decision is not None and r.delta is not None
    ]


# ---- per-request replay of the real traces ---------------------------------------------------
@attrs.frozen(kw_only=True)
class ReplaySetup:
    """The real-trace side: traces, page size and what a boundary measures."""

    traces: tuple[Trace, ...] = attrs.field(converter=tuple)
    page_size: int = 64
    fidelity_queries: int = 8

    def config(self, k_loc: int | None = None) -> GrowPageConfig:
        base = RealTraceSettings(page_size=self.page_size).config()
        return base.replace(k_loc=base.local_quota if k_loc is None else k_loc)


class QuotaProbe(CapacityPolicy):
    """Wraps a policy; at each compression it also selects with k_loc = 0 (global top-k only,
    on the same scores) and keeps how much the block-local quota changed the kept set."""

    def __init__(self, inner: CapacityPolicy) -> None:
        self.inner, self.name = inner, inner.name
        self.changed_slots: list[float] = []  # per compression: share of kept slots changed
        self.changed_heads: list[float] = []  # per compression: share of (layer, head) changed

    def decide(self, ctx: BoundaryContext) -> Decision:
        return self.inner.decide(ctx)

    def select(self, ctx: BoundaryContext, keep: int) -> torch.Tensor:
        chosen = self.inner.select(ctx, keep)
        plain = growpage_select(
            ctx.scores(), ctx.num_tokens, ctx.recent_window, keep, ctx.page_size, 0
        )
        in_plain = torch.zeros(*plain.shape[:-1], ctx.num_tokens, dtype=torch.bool)
        in_plain.scatter_(-1, plain, True)
        changed = keep - in_plain.gather(-1, chosen).sum(-1)  # [L, Hkv]
        historical = max(keep - ctx.recent_window, 1)
        self.changed_slots.append(float(changed.float().mean()) / historical)
        self.changed_heads.append(float((changed > 0).float().mean()))
        return chosen


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def replay_row(
    setup: ReplaySetup, point: PolicyPoint, k_loc: int | None, edges: Sequence[float]
) -> tuple[dict, list[ReplayResult]]:
    """One point replayed over every trace: the policy-table row, Δt interval counts, and how
    much the local quota changed the compressions' selections (``QuotaProbe``)."""
    config = setup.config(k_loc)
    options = ReplayOptions(fidelity_queries=setup.fidelity_queries)
    probes, results = [], []
    for trace in setup.traces:
        probes.append(QuotaProbe(resolve_policy(point.policy, **point.params)))
        results.append(replay_trace(trace, probes[-1], config, options))
    row = table_row(point, results)
    row.update(
        tau=point.params.get("tau", config.tau),
        k_loc=config.local_quota,
        k_loc_share=page_share(config.local_quota, config.page_size),
        page_size=config.page_size,
        **count_deltas(decided_deltas(results), edges),
        quota_changed_slots=_mean([x for p in probes for x in p.changed_slots]),
        quota_changed_heads=_mean([x for p in probes for x in p.changed_heads]),
    )
    return row, results


def tau_point(tau: float) -> PolicyPoint:
    return PolicyPoint(f"growpage τ={tau:+.3f}", "growpage", {"tau": tau})


def kloc_points(budget: int) -> list[PolicyPoint]:
    """The D.2 policies: growpage (τ = 0) and a fixed budget."""
    return [
        PolicyPoint("growpage", "growpage", {"tau": 0.0}),
        PolicyPoint(f"fixed-{budget}", "fixed", {"budget_tokens": budget}, "fixed"),
    ]


# ---- serving ---------------------------------------------------------------------------------
@attrs.define
class ServedDeltaPolicy(GrowPagePolicy):
    """``growpage`` keeping the Δt of each decision the serving simulator asks it for (script
    mode hands it a ``ScriptedContext``; the script replays behind it are not counted)."""

    served: list[float] = attrs.field(factory=list)

    def decide(self, ctx: BoundaryContext) -> Decision:
        if isinstance(ctx, ScriptedContext):
            self.served.append(ctx.delta(self.p))
        return super().decide(ctx)


@attrs.frozen(kw_only=True)
class ServeSetup:
    """The serving side: requests, pool, cost model, fidelity traces (as ``sim sweep``)."""

    requests: tuple[WorkloadRequest, ...] = attrs.field(converter=tuple)
    workload: str
    cost: str = "a100-qwen3-8b"
    num_kv_pages: int = 1500
    fidelity_traces: int = 4
    fidelity_gen_len: int = 4096
    seed: int = 0

    def config(self, k_loc: int | None = None) -> GrowPageConfig:
        base = GrowPageConfig(page_size=SERVE_PAGE)
        return base.replace(k_loc=base.local_quota if k_loc is None else k_loc)


def serve_row(setup: ServeSetup, tau: float, k_loc: int | None, edges: Sequence[float]) -> dict:
    """``growpage`` at (τ, k_loc) served on the workload, and replayed on the synthetic
    fidelity traces of ``growpage sim sweep`` (same seeds)."""
    config = setup.config(k_loc)
    policy = ServedDeltaPolicy(tau=tau)
    start = time.perf_counter()
    sim = SimConfig(num_kv_pages=setup.num_kv_pages, seed=setup.seed)
    result = simulate(list(setup.requests), policy, config, sim, load_cost_model(setup.cost))
    spec = attrs.evolve(SCRIPT_SPEC, gen_len=setup.fidelity_gen_len)
    replays = [
        replay_trace(
            synthetic_trace(spec, setup.seed + 1000 + i),
            GrowPagePolicy(tau=tau),
            config,
            ReplayOptions(fidelity_queries=FIDELITY_QUERIES_SERVED),
        )
        for i in range(setup.fidelity_traces)
    ]
    fidelity = aggregate_replays(replays)
    m = result.metrics
    return {
        "label": f"τ={tau:+.3f} k_loc={config.local_quota}",
        "tau": tau,
        "k_loc": config.local_quota,
        "k_loc_share": page_share(config.local_quota, config.page_size),
        "tps": m.tps,
        "avg_resident": m.avg_resident,
        "avg_kv_budget": m.avg_kv_budget,
        "grow_ratio": m.grow_ratio,
        "fallbacks": m.fallbacks,
        "preemptions": m.num_preemptions,
        "tpot_ms": m.tpot_ms,
        "total_s": m.total_s,
        **{
            f"fidelity_{k}": fidelity.get(k)
            for k in ("mass_mean", "mass_min", "output_error", "avg_budget")
        },
        **count_deltas(policy.served, edges),
        "wall_s": time.perf_counter() - start,
    }


# ---- the two sweeps --------------------------------------------------------------------------
@attrs.frozen(kw_only=True)
class SweepPlan:
    """What to run: τ values, k_loc values (paper scale), the fixed budget, serving or not."""

    taus: tuple[float, ...] = attrs.field(default=TAUS, converter=tuple)
    kloc_at_256: tuple[int, ...] = attrs.field(default=KLOC_AT_256, converter=tuple)
    kloc_budget: int = 256
    serve: bool = True
    serve_kloc: bool = True


class _Points:
    """Runs points once each (τ = 0 at the default k_loc is shared by both sweeps) and advances
    one progress bar per point."""

    def __init__(self, total: int, progress: bool) -> None:
        self.bar = tqdm(
            total=total, desc="sensitivity", unit="point", disable=not progress, dynamic_ncols=True
        )
        self.done: dict[tuple, object] = {}

    def run(self, key: tuple, label: str, fn, *args):
        if key not in self.done:
            self.bar.set_postfix_str(label)
            self.done[key] = fn(*args)
            self.bar.update(1)
        return self.done[key]


def count_points(plan: SweepPlan, replay: ReplaySetup, serve: ServeSetup | None) -> int:
    """Distinct points ``run_sweeps`` runs (its progress bar's total)."""
    default = replay.config().local_quota
    klocs = {scaled_kloc(v, replay.page_size) for v in plan.kloc_at_256}
    n = len(plan.taus) + len(klocs) + len(klocs - {default} if 0.0 in plan.taus else klocs)
    if serve is not None:
        n += len(plan.taus)
        if plan.serve_kloc:
            served = {scaled_kloc(v, SERVE_PAGE) for v in plan.kloc_at_256}
            n += len(served - {serve.config().local_quota} if 0.0 in plan.taus else served)
    return n


def run_sweeps(
    plan: SweepPlan, replay: ReplaySetup, serve: ServeSetup | None, progress: bool = True
) -> dict:
    """Both sweeps; ``{"tau": {"replay", "serve"}, "kloc": {"replay", "serve"}}`` of rows."""
    edges = sorted(plan.taus)
    points = _Points(count_points(plan, replay, serve), progress)
    default = replay.config().local_quota

    def replayed(point: PolicyPoint, k_loc: int) -> dict:
        key = ("replay", point.policy, json.dumps(point.params, sort_keys=True), k_loc)
        row = points.run(
            key, f"{point.label} k_loc={k_loc}", replay_row, replay, point, k_loc, edges
        )[0]
        return dict(row, policy=point.label)  # the shared τ = 0 point, named per table

    def served(tau: float, k_loc: int) -> dict:
        return points.run(
            ("serve", tau, k_loc),
            f"served τ={tau:+.3f} k_loc={k_loc}",
            serve_row,
            serve,
            tau,
            k_loc,
            edges,
        )

    out: dict = {"edges": edges, "intervals": interval_labels(edges)}
    out["tau"] = {"replay": [replayed(tau_point(t), default) for t in plan.taus]}
    out["kloc"] = {
        "replay": [
            replayed(p, scaled_kloc(v, replay.page_size))
            for p in kloc_points(plan.kloc_budget)
            for v in plan.kloc_at_256
        ]
    }
    if serve is not None:
        serve_default = serve.config().local_quota
        out["tau"]["serve"] = [served(t, serve_default) for t in plan.taus]
        if plan.serve_kloc:
            out["kloc"]["serve"] = [
                served(0.0, scaled_kloc(v, SERVE_PAGE)) for v in plan.kloc_at_256
            ]
    points.bar.close()
    return out


# ---- report ----------------------------------------------------------------------------------
Column = tuple[str, str, str]
TAU_REPLAY: list[Column] = [
    ("tau", "τ", "+.3f"),
    ("avg_budget", "avg budget", ".0f"),
    ("grow_ratio", "grow %", ".1%"),
    ("mass_mean", "mass mean", ".4f"),
    ("mass_min", "mass min", ".4f"),
    ("output_error", "out err", ".4f"),
    ("decided", "decided", "d"),
]
TAU_SERVE: list[Column] = [
    ("tau", "τ", "+.3f"),
    ("tps", "TPS", ".0f"),
    ("avg_resident", "C", ".1f"),
    ("avg_kv_budget", "avg budget", ".0f"),
    ("grow_ratio", "grow %", ".1%"),
    ("fallbacks", "fallback", "d"),
    ("preemptions", "preempt", "d"),
    ("fidelity_mass_mean", "mass mean (synth.)", ".4f"),
    ("fidelity_output_error", "out err (synth.)", ".4f"),
]
KLOC_REPLAY: list[Column] = [
    ("policy", "policy", ""),
    ("k_loc", "k_loc", "d"),
    ("k_loc_share", "k_loc / b", ""),
    ("avg_budget", "avg budget", ".0f"),
    ("grow_ratio", "grow %", ".1%"),
    ("mass_mean", "mass mean", ".4f"),
    ("mass_min", "mass min", ".4f"),
    ("output_error", "out err", ".4f"),
    ("quota_changed_slots", "slots changed", ".2%"),
    ("quota_changed_heads", "heads changed", ".1%"),
]
KLOC_SERVE: list[Column] = [
    ("k_loc", "k_loc", "d"),
    ("k_loc_share", "k_loc / b", ""),
    ("tps", "TPS", ".0f"),
    ("avg_resident", "C", ".1f"),
    ("avg_kv_budget", "avg budget", ".0f"),
    ("grow_ratio", "grow %", ".1%"),
    ("fidelity_mass_mean", "mass mean (synth.)", ".4f"),
    ("fidelity_output_error", "out err (synth.)", ".4f"),
]


def interval_table(rows: Sequence[dict], intervals: Sequence[str]) -> str:
    """Per τ run: decided boundaries by Δt interval, and how many had Δt exactly 0."""
    columns: list[Column] = [("tau", "run τ", "+.3f"), ("decided", "decided", "d")]
    columns += [(f"i{j}", f"Δt {name}", "d") for j, name in enumerate(intervals)]
    columns += [("delta_zero", "Δt = 0", "d")]
    flat = [{**r, **{f"i{j}": c for j, c in enumerate(r["delta_counts"])}} for r in rows]
    return markdown_table(flat, columns)


def tables(result: dict) -> list[tuple[str, str]]:
    """``(title, markdown table)`` of every measured part of ``result``."""
    intervals = result["intervals"]
    parts = [
        (
            "D.1 τ, real traces (per-request replay)",
            markdown_table(result["tau"]["replay"], TAU_REPLAY),
        ),
        (
            "D.1 τ, real traces: decided boundaries by Δt interval",
            interval_table(result["tau"]["replay"], intervals),
        ),
    ]
    if "serve" in result["tau"]:
        parts += [
            ("D.1 τ, served", markdown_table(result["tau"]["serve"], TAU_SERVE)),
            (
                "D.1 τ, served: decisions by Δt interval",
                interval_table(result["tau"]["serve"], intervals),
            ),
        ]
    parts.append(
        ("D.2 k_loc, real traces (τ = 0)", markdown_table(result["kloc"]["replay"], KLOC_REPLAY))
    )
    if "serve" in result["kloc"]:
        parts.append(
            (
                "D.2 k_loc, served (growpage, τ = 0)",
                markdown_table(result["kloc"]["serve"], KLOC_SERVE),
            )
        )
    return parts


NOTES = {
    "decided boundaries by Δt interval": [
        "A decided boundary grows iff Δt > τ, so between neighbouring τ values only the "
        "boundaries whose Δt lies in the interval between them can decide differently (until "
        "the first one does, the two replays are the same). `Δt = 0`: exact ties, also "
        "counted in their interval.",
        "",
    ],
    "D.2 k_loc, real traces (τ = 0)": [
        "`slots changed`: share of the kept historical slots that the block-local quota put in "
        "place of the global top-k's own choice (k_loc = 0, same scores), mean over "
        "compressions; `heads changed`: share of (layer, KV head) selections with any such "
        "slot.",
        "",
    ],
}
NOTES["decisions by Δt interval"] = NOTES["decided boundaries by Δt interval"]


def write_report(out: Path, payload: dict) -> Path:
    """``report.md``, ``sensitivity.json`` and the plots under ``out``."""
    r = payload["settings"]
    lines = [
        "# Hyperparameter sensitivity (paper appendix D)",
        "",
        f"Command: `{payload['command']}` ({payload['wall_s']:.0f} s wall). Machine: "
        f"{payload['machine']}.",
        "",
        f"Real traces: {r['num_traces']} traces of `{r['traces']}`, pages of "
        f"{r['page_size']} tokens, recent window {r['recent_window']}, "
        f"{r['fidelity_queries']} sampled future queries per boundary, private pool. "
        f"Default k_loc {r['default_kloc']} (b/4).",
        "",
    ]
    if r.get("workload"):
        lines += [
            f"Served: workload `{r['workload']}` ({r['num_requests']} requests), cost "
            f"model `{r['cost']}`, {r['num_kv_pages']} pages of {SERVE_PAGE} tokens, "
            f"script-mode decisions; fidelity of {r['fidelity_traces']} synthetic traces "
            f"of {r['fidelity_gen_len']} tokens.",
            "",
        ]
    for title, table in tables(payload["result"]):
        lines += [f"## {title}", "", table, ""] + NOTES.get(title.split(":")[-1].strip(), [])
    lines += ["![τ sweep](tau.png)", "", "![k_loc sweep](kloc.png)", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    write_json(out / "sensitivity.json", payload)
    plot_tau(payload["result"], out / "tau.png")
    plot_kloc(payload["result"], out / "kloc.png")
    return path


# ---- plots -----------------------------------------------------------------------------------
def _twin(ax, xs, left, right, left_label: str, right_label: str) -> None:
    """``left`` on ``ax``, ``right`` on a twin axis (a None is not drawn)."""
    left, right = ([np.nan if v is None else v for v in ys] for ys in (left, right))
    ax.plot(xs, left, "o-", color="tab:blue")
    ax.set_ylabel(left_label, color="tab:blue")
    other = ax.twinx()
    other.plot(xs, right, "s--", color="tab:red")
    other.set_ylabel(right_label, color="tab:red")
    ax.grid(alpha=0.3)


def _tau_axis(ax, taus: Sequence[float]) -> range:
    """One slot per τ (evenly spaced, labelled with the value): the grid need not be even."""
    xs = range(len(taus))
    ax.set_xticks(xs, [f"{t:g}" for t in taus], fontsize=8)
    ax.set_xlabel("τ")
    return xs


def plot_tau(result: dict, path: Path) -> Path:
    """Real traces: quality and budget against τ; served: TPS and C against τ, and the
    fidelity-throughput trade-off labelled by τ (the paper's Fig. 9)."""
    import matplotlib.pyplot as plt

    from growpage.plots import place_labels

    rows, serve = result["tau"]["replay"], result["tau"].get("serve")
    fig, axes = plt.subplots(2 if serve else 1, 2, figsize=(11, 8 if serve else 4), squeeze=False)
    taus = [r["tau"] for r in rows]
    _twin(
        axes[0][0],
        _tau_axis(axes[0][0], taus),
        [r["mass_mean"] for r in rows],
        [r["output_error"] for r in rows],
        "attention mass kept (mean)",
        "output error",
    )
    _twin(
        axes[0][1],
        _tau_axis(axes[0][1], taus),
        [r["avg_budget"] for r in rows],
        [100 * r["grow_ratio"] for r in rows],
        "average budget (tokens)",
        "grow %",
    )
    for ax in axes[0]:
        ax.set_title(f"{rows[0]['traces']} real SmolLM2 traces (replay)", fontsize=9)
    if serve:
        ax = axes[1][0]
        _twin(
            ax,
            _tau_axis(ax, [r["tau"] for r in serve]),
            [r["tps"] for r in serve],
            [r["avg_resident"] for r in serve],
            "TPS (simulated tokens/s)",
            "C (resident requests)",
        )
        ax.set_title("served (script mode)", fontsize=9)
        _plot_tradeoff(axes[1][1], serve)
        fig.tight_layout()
        key = "fidelity_mass_mean" if _has_fidelity(serve) else "avg_kv_budget"
        place_labels(
            axes[1][1], [(f"{r['tau']:+.3f}", r["tps"], r[key], "tab:blue") for r in serve]
        )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _has_fidelity(rows: Sequence[dict]) -> bool:
    return all(r["fidelity_mass_mean"] is not None for r in rows)  # not --fidelity-traces 0


def _plot_tradeoff(ax, serve: Sequence[dict]) -> None:
    """Synthetic-trace fidelity (else the budget) against TPS, one point per τ."""
    key, name = "fidelity_mass_mean", "attention mass kept (synthetic traces)"
    if not _has_fidelity(serve):
        key, name = "avg_kv_budget", "average KV budget (tokens)"
    ax.plot([r["tps"] for r in serve], [r[key] for r in serve], "o-", color="tab:blue")
    ax.set_xlabel("TPS (simulated tokens/s)")
    ax.set_ylabel(name)
    ax.set_title("trade-off, labelled by τ (paper Fig. 9)", fontsize=9)
    ax.grid(alpha=0.3)


def _of_page(share: Fraction) -> str:
    """``1/4`` -> ``b/4``, ``3/4`` -> ``3b/4``, ``1`` -> ``b``, ``0`` -> ``0``."""
    if share == 0:
        return "0"
    top = "b" if share.numerator == 1 else f"{share.numerator}b"
    return top if share.denominator == 1 else f"{top}/{share.denominator}"


def plot_kloc(result: dict, path: Path) -> Path:
    """Mass kept and output error against k_loc / b, per policy; served TPS beside them."""
    import matplotlib.pyplot as plt

    rows, serve = result["kloc"]["replay"], result["kloc"].get("serve")
    fig, axes = plt.subplots(1, 3 if serve else 2, figsize=(15 if serve else 10, 4))
    by_policy: dict[str, list[dict]] = {}
    for r in rows:
        by_policy.setdefault(r["policy"], []).append(r)
    for ax, key, name in (
        (axes[0], "mass_mean", "attention mass kept (mean)"),
        (axes[1], "output_error", "output error"),
    ):
        for label, members in by_policy.items():
            ax.plot(range(len(members)), [m[key] for m in members], "o-", label=label)
        shares = [m["k_loc_share"] for m in next(iter(by_policy.values()))]
        ax.set_xticks(range(len(shares)), [_of_page(Fraction(s)) for s in shares])
        ax.set_xlabel(f"k_loc (b = {rows[0]['page_size']})")
        ax.set_ylabel(name)
        ax.set_title(f"{rows[0]['traces']} real SmolLM2 traces (replay, τ = 0)", fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    if serve:
        xs = range(len(serve))
        _twin(
            axes[2],
            xs,
            [r["tps"] for r in serve],
            [r["fidelity_mass_mean"] for r in serve],
            "TPS (simulated tokens/s)",
            "attention mass kept (synthetic)",
        )
        axes[2].set_xticks(xs, [str(r["k_loc"]) for r in serve])
        axes[2].set_xlabel(f"k_loc (b = {SERVE_PAGE})")
        axes[2].set_title("served growpage (script mode)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- command line ----------------------------------------------------------------------------
def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument(
        "--traces",
        type=Path,
        default=COMMITTED,
        help=f"real trace set (default {COMMITTED.relative_to(ROOT)})",
    )
    p.add_argument("--limit", type=int, default=None, help="replay only the first N traces")
    p.add_argument(
        "--page-size", type=int, default=64, help="tokens per page of the replays (default 64)"
    )
    p.add_argument(
        "--fidelity-queries",
        type=int,
        default=8,
        help="future queries sampled per replayed boundary (default 8)",
    )
    p.add_argument(
        "--taus",
        default=",".join(f"{t:g}" for t in TAUS),
        help="τ values, comma-separated; write --taus=-0.01,0 when the first is negative "
        "(default -0.003 to 0.003 step 0.001)",
    )
    p.add_argument(
        "--kloc",
        default=",".join(map(str, KLOC_AT_256)),
        help="k_loc values for pages of 256 tokens (paper Table 4), scaled to each "
        "page size (default 16,32,64,128)",
    )
    p.add_argument(
        "--kloc-budget",
        type=int,
        default=256,
        help="budget (tokens) of the fixed-budget policy of the k_loc sweep (default 256)",
    )
    p.add_argument(
        "--workload",
        default="mixed",
        help="served workload: a name or a CSV/JSON Lines file (default mixed)",
    )
    p.add_argument(
        "--cost",
        default="a100-qwen3-8b",
        help="cost model of the serving side (default a100-qwen3-8b)",
    )
    p.add_argument(
        "--kv-pages",
        type=int,
        default=None,
        help="KV pages of 256 tokens (default: what the cost model's memory holds)",
    )
    p.add_argument(
        "--fidelity-traces",
        type=int,
        default=4,
        help="synthetic traces replayed per served point (default 4)",
    )
    p.add_argument(
        "--fidelity-gen-len",
        type=int,
        default=4096,
        help="generated tokens of each of those traces (default 4096)",
    )
    p.add_argument(
        "--serve",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the serving side (default on)",
    )
    p.add_argument(
        "--serve-kloc",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve the k_loc points too (default on)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload and synthetic seed (default 0)")
    add_threads(p, 1)
    add_out(p, "sensitivity")
    p.add_argument(
        "--json", action="store_true", help="print the results as JSON instead of markdown tables"
    )
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    try:
        args.taus = [t + 0.0 for t in _floats(args.taus)]  # -0 is 0
        args.kloc = _ints(args.kloc)
    except ValueError as e:
        p.error(f"--taus / --kloc: {e}")
    if not args.taus or any(not -1 <= t <= 1 for t in args.taus):
        p.error(f"--taus: give values in [-1, 1] (Δt is a difference of ratios), got {args.taus}")
    if len(set(args.taus)) != len(args.taus):
        p.error(f"--taus: a value is given twice ({args.taus})")
    if not args.kloc or len(set(args.kloc)) != len(args.kloc):
        p.error(f"--kloc: give distinct values, got {args.kloc}")
    if args.page_size < 4:
        p.error(f"--page-size must be >= 4, got {args.page_size}")
    for v in args.kloc:
        for b in (args.page_size, SERVE_PAGE):
            if not 0 <= v <= PAPER_PAGE or (v * b) % PAPER_PAGE:
                p.error(
                    f"--kloc {v}: need 0 <= k_loc <= {PAPER_PAGE} and a whole number of "
                    f"tokens at pages of {b} ({v} x {b} / {PAPER_PAGE})"
                )
    for flag, value, low in (
        ("--limit", args.limit, 1),
        ("--kloc-budget", args.kloc_budget, 1),
        ("--fidelity-queries", args.fidelity_queries, 1),
        ("--fidelity-traces", args.fidelity_traces, 0),
        ("--fidelity-gen-len", args.fidelity_gen_len, 1),
        ("--kv-pages", args.kv_pages, 1),
        ("--threads", args.threads, 1),
    ):
        if value is not None and value < low:
            p.error(f"{flag} must be >= {low}, got {value}")


def serve_setup(args: argparse.Namespace) -> ServeSetup:
    cost = load_cost_model(args.cost)
    pages = args.kv_pages
    if pages is None:
        pages = cost.kv_pages(SERVE_PAGE) if isinstance(cost, RooflineCostModel) else 1500
    requests = resolve_workload(args.workload, args.seed)
    return ServeSetup(
        requests=requests,
        workload=args.workload,
        cost=args.cost,
        num_kv_pages=pages,
        fidelity_traces=args.fidelity_traces,
        fidelity_gen_len=args.fidelity_gen_len,
        seed=args.seed,
    )


def settings_of(args: argparse.Namespace, replay: ReplaySetup, serve: ServeSetup | None) -> dict:
    config = replay.config()
    out = {
        "traces": _shown(args.traces),
        "num_traces": len(replay.traces),
        "trace_ids": [t.request_id for t in replay.traces],
        "page_size": replay.page_size,
        "recent_window": config.recent_window,
        "default_kloc": config.local_quota,
        "fidelity_queries": replay.fidelity_queries,
        "taus": args.taus,
        "kloc_at_256": args.kloc,
        "kloc_budget": args.kloc_budget,
        "threads": args.threads,
    }
    if serve is not None:
        out.update(
            workload=serve.workload,
            num_requests=len(serve.requests),
            cost=serve.cost,
            num_kv_pages=serve.num_kv_pages,
            fidelity_traces=serve.fidelity_traces,
            fidelity_gen_len=serve.fidelity_gen_len,
            seed=serve.seed,
        )
    return out


def _shown(path: Path) -> str:
    """``path`` as the report shows it: relative to the repository when inside it, so a
    committed report names no machine's directories."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    replay = ReplaySetup(
        traces=read_trace_set(args.traces).read_all(args.limit),
        page_size=args.page_size,
        fidelity_queries=args.fidelity_queries,
    )
    serve = serve_setup(args) if args.serve else None
    out = make_output_dir(args.out)  # every input checked, before the long part
    plan = SweepPlan(
        taus=args.taus,
        kloc_at_256=args.kloc,
        kloc_budget=args.kloc_budget,
        serve=args.serve,
        serve_kloc=args.serve_kloc,
    )
    result = run_sweeps(plan, replay, serve)
    wall = time.perf_counter() - start
    shown = sys.argv[1:] if argv is None else argv
    payload = {
        "command": " ".join(["python benchmarks/sensitivity.py", *shown]),
        "wall_s": wall,
        "machine": f"{os.cpu_count()} CPU cores (shared), torch "
        f"{torch.__version__}, {args.threads} thread(s)",
        "settings": settings_of(args, replay, serve),
        "result": result,
    }
    path = write_report(out, payload)
    if args.json:
        print(json.dumps(json.loads((out / "sensitivity.json").read_text()), indent=1))
    else:
        for title, table in tables(result):
            print(f"\n## {title}\n\n{table}")
        print(f"\nreport: {path} ({wall:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
