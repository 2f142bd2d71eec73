"""The ``growpage sim ...`` commands (options in ``commands.cli``): faces over the simulator, whose
grids run through ``growpage.executors``."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from tqdm import tqdm

from growpage.core.config import GrowPageConfig, fitted_recent_window
from growpage.core.host_memory import available_memory
from growpage.core.trace_set import TraceSet
from growpage.core.traces import Trace, TraceHeader
from growpage.errors import ConfigError
from growpage.policies.registry import parse_policy_params, resolve_policy
from growpage.sim import reports
from growpage.sim.costmodel import (
    CostModel,
    PiecewiseCostModel,
    RooflineCostModel,
    load_cost_model,
    with_boundary_costs,
)
from growpage.sim.replay import ReplayOptions
from growpage.sim.serving import SimConfig, check_pool_memory
from growpage.sim.signal import signal_quality
from growpage.sim.sources import traces_for
from growpage.sim.synthetic import SyntheticSpec
from growpage.sim.workload_csv import WorkloadRequest
from growpage.sim.workloads import resolve_workload
from growpage.validators import at_least, non_negative_number, positive_number

REPLAY_GEN_LEN, REPLAY_SCHEDULE = 4096, "random"  # replay --synthetic's defaults (tokens)
LONG_REQUEST_TOKENS = 1 << 16  # beyond this, replaying a synthetic trace takes a while
BOUNDARY_FLAGS = ("--boundary-ms", "--compaction-ms", "--boundary-step-ms", "--compaction-step-ms")
SWEEP_COLUMNS: list[reports.Column] = [
    ("label", "point", ""),
    ("tps", "TPS", ".0f"),
    ("avg_resident", "C", ".1f"),
    ("avg_kv_budget", "avg budget", ".0f"),
    ("mass_mean", "mass mean", ".4f"),
    ("output_error", "out err", ".4f"),
    ("grow_ratio", "grow %", ".1%"),
    ("fallbacks", "fallback", "d"),
    ("num_preemptions", "preempt", "d"),
    ("tpot_ms", "TPOT ms", ".1f"),
    ("ttft_p99_s", "TTFT p99 s", reports.SIGNIFICANT),
    ("e2e_p99_s", "E2E p99 s", reports.SIGNIFICANT),
]


def parse_params(items: list[str]) -> dict[str, Any]:
    """``--param KEY=VALUE`` items -> policy kwargs."""
    return parse_policy_params(items, "--param")


def _setup(args: argparse.Namespace) -> GrowPageConfig:
    torch.set_num_threads(args.threads)
    window = args.recent_window
    if window is None:  # as LLM(page_size=...) does: the default, kept below small pages
        window = fitted_recent_window(GrowPageConfig().recent_window, args.page_size)
    return GrowPageConfig(page_size=args.page_size, recent_window=window)


def _out_dir(args: argparse.Namespace) -> Path | None:
    """``--out DIR``, created before the work starts, so that a bad directory fails at once
    rather than after a long run."""
    return reports.make_output_dir(args.out) if args.out else None


def _emit(args: argparse.Namespace, table: str, payload: dict) -> None:
    print(json.dumps(reports._jsonable(payload), indent=1) if args.json else table)


def _note(args: argparse.Namespace, text: str) -> None:
    """A message besides the results (on stderr when stdout carries JSON)."""
    print(text, file=sys.stderr if args.json else sys.stdout)


def warning(text: str, kind: str = "warning") -> None:
    """Something the user should know about their input, on stderr."""
    print(f"growpage: {kind}: {text}", file=sys.stderr)


# ---- replay ----------------------------------------------------------------------------------
def _note_layer_subset(directory: str, headers: list[TraceHeader]) -> None:
    """Say so when a set's traces (``headers``) hold some of the model's layers only: every
    attention signal is then computed over those (the engine reads all of them)."""
    counts = {
        (h.num_recorded_layers, h.num_layers)
        for h in headers
        if h.num_recorded_layers < h.num_layers
    }
    if counts:
        held = ", ".join(f"{n} of {total}" for n, total in sorted(counts))
        warning(
            f"{directory}: traces hold {held} model layers; Delta_t, scores and "
            "fidelity are computed over those layers only (the engine reads every layer)",
            kind="note",
        )


def _deep_check(args: argparse.Namespace) -> bool:
    """Whether ``--check-traces deep`` asks for every trace's tensors to be checked first."""
    if args.check_traces is not None and not args.traces:
        raise ConfigError("--check-traces: for --traces only (synthetic traces need no check)")
    return args.check_traces == "deep"


def _replay_grid(args: argparse.Namespace) -> tuple[list[Any], list[dict], dict[str, Any]]:
    """The points of a replay (a trace set's entries, or synthetic trace numbers), what each
    one's failed row says, and where ``ReplayJob`` finds the traces."""
    synthetic_only = {"--gen-len": args.gen_len, "--schedule": args.schedule, "--seed": args.seed}
    if args.traces:
        given = [flag for flag, value in synthetic_only.items() if value is not None]
        if given:
            raise ConfigError(f"{', '.join(given)}: for --synthetic traces only, not with --traces")
        traces = TraceSet(args.traces)
        if not len(traces):
            raise ConfigError(f"{args.traces}: the trace set is empty")
        # A broken file is found now, not after the traces before it.
        _note_layer_subset(
            args.traces, traces.check(deep=_deep_check(args), progress=not args.json)
        )
        entries = list(traces.index)
        return entries, [{"request_id": e.request_id} for e in entries], {"traces": args.traces}
    _deep_check(args)  # refuses --check-traces without --traces
    at_least(1).require("--synthetic", args.synthetic)
    drawn = _synthetic_settings(args)
    spec = SyntheticSpec(gen_len=drawn["gen_len"], schedule=drawn["schedule"])
    numbers = list(range(args.synthetic))
    return (
        numbers,
        [{"request_id": f"synthetic-{i}"} for i in numbers],
        {"spec": spec, "seed": drawn["seed"]},
    )


def _synthetic_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings ``replay --synthetic`` draws its traces with, defaults filled in (None in
    ``args`` only marks a flag left out)."""
    return {
        "gen_len": REPLAY_GEN_LEN if args.gen_len is None else args.gen_len,
        "schedule": REPLAY_SCHEDULE if args.schedule is None else args.schedule,
        "seed": 0 if args.seed is None else args.seed,
    }


def run_replay(args: argparse.Namespace) -> int:
    from growpage.executors import GridError
    from growpage.executors.grids import ReplayJob, replay_point, result_of
    from growpage.executors.options import jobs_of, make_executor

    config = _setup(args)
    kwargs = parse_params(args.param)
    options = ReplayOptions(fidelity_queries=args.fidelity_queries, signals=args.signals)
    at_least(1).require("--jobs", jobs_of(args))
    items, identities, source = _replay_grid(args)
    resolve_policy(args.policy, **kwargs)  # a bad name or hyperparameter fails before the work
    out = _out_dir(args)
    job = ReplayJob(
        policy=args.policy,
        params=tuple(kwargs.items()),
        config=config,
        options=options,
        threads=args.threads,
        **source,
    )
    with make_executor(args, out, progress=not args.json, num_cpus=args.threads) as executor:
        grid = executor.run(replay_point, items, job, identities, desc="replay", unit="trace")
    results = [result_of(row) for row in grid if "error" not in row]
    failed = [row for row in grid if "error" in row]
    if not results:
        raise GridError(_failed_traces(failed, len(grid), None))
    rows = [r.summary() for r in results] + [reports.aggregate_replays(results, "ALL")]
    columns = [("request_id", "trace", "")] + reports.REPLAY_COLUMNS
    table = reports.format_table(rows, columns)
    payload: dict[str, Any] = {
        "config": attrs.asdict(config),
        "policy": args.policy,
        "params": kwargs,
        "source": _source(args),
        "summary": rows[-1],
        "traces": [r.as_dict() for r in results],
    }
    if failed:
        payload["failed"] = failed
    if args.signals:
        quality = signal_quality(rec for r in results for rec in r.records)
        payload["signals"] = quality.as_dict()
        table += "\n\n" + _signal_table(quality)
    _emit(args, table, payload)
    if out is not None:
        reports.write_json(out / "replay.json", payload)
        reports.write_csv(out / "replay.csv", rows)
        from growpage.plots import plot_capacity, plot_signal_scatter

        # Each line runs from the prompt to the trace's last token (a replay stopped by a
        # full pool, to its last boundary): a trace with no boundary is a flat line.
        plot_capacity(
            {
                r.request_id: r.trajectory
                + ([] if r.preempted else [(r.num_tokens, r.final_pages)])
                for r in results[:12]
            },
            out / "capacity.png",
            config.page_size,
            title=f"capacity under {args.policy}",
        )
        files = "replay.json, replay.csv, capacity.png"
        if args.signals:
            pairs = [
                (rec.delta, rec.future_change)
                for r in results
                for rec in r.records
                if rec.delta is not None and rec.future_change is not None
            ]
            plot_signal_scatter(
                pairs,
                out / "signals.png",
                title=f"Delta_t vs future demand ({len(pairs)} boundaries)",
            )
            files += ", signals.png"
        _note(args, f"results in {out}/ ({files})")
    if failed:
        raise GridError(_failed_traces(failed, len(grid), out))
    return 0


def _failed_traces(failed: list[dict], total: int, out: Path | None) -> str:
    head = f"{len(failed)} of {total} traces failed"
    kept = total - len(failed)
    if kept:
        head += f" ({kept} replayed: their results are printed" + (
            f" and written to {out}/)" if out is not None else ")"
        )
    return "\n".join([head + ":"] + [f"  {r['request_id']}: {r['error']}" for r in failed])


def _source(args: argparse.Namespace) -> dict[str, Any]:
    """What a replay read: the trace set, or the synthetic traces' settings."""
    if args.traces:
        return {"traces": args.traces}
    return {"synthetic": args.synthetic, **_synthetic_settings(args)}


def _signal_table(q: Any) -> str:
    # NaN (null in the JSON): fewer than two paired boundaries, or one side constant.
    n = q.num_boundaries
    rho = (
        f"Spearman rho = {q.spearman:.3f}"
        if not math.isnan(q.spearman)
        else f"Spearman rho = n/a ({'too few boundaries' if n < 2 else 'a constant signal'})"
    )
    agree = "" if math.isnan(q.sign_agreement) else f", sign agreement = {q.sign_agreement:.1%}"
    head = (
        f"Delta_t vs future demand change: {rho}{agree} over {n} boundar{'y' if n == 1 else 'ies'}"
    )
    rows = [
        {
            "bucket": f"[{b.low:g}, {b.high:g})",
            "count": b.count,
            "adv": b.mean_advantage,
            "adv_err": b.mean_advantage_error,
        }
        for b in q.buckets
    ]
    return (
        head
        + "\n"
        + reports.format_table(
            rows,
            [
                ("bucket", "Delta_t bucket", ""),
                ("count", "n", "d"),
                ("adv", "growth adv (mass)", ".4f"),
                ("adv_err", "growth adv (out err)", ".4f"),
            ],
        )
    )


# ---- check-traces ----------------------------------------------------------------------------
def run_check_traces(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    traces = TraceSet(args.traces)
    if not len(traces):
        raise ConfigError(f"{args.traces}: the trace set is empty")
    headers = traces.check(deep=args.deep, progress=args.progress and not args.json)
    tokens = sum(h.num_tokens for h in headers)
    checked = "headers and tensors" if args.deep else "headers (--deep: tensors too)"
    _emit(
        args,
        f"{args.traces}: {len(headers)} traces, {tokens} tokens: {checked} ok",
        {
            "traces": args.traces,
            "deep": args.deep,
            "num_traces": len(headers),
            "num_tokens": tokens,
        },
    )
    return 0


# ---- serve -----------------------------------------------------------------------------------
def _serving_setup(
    args: argparse.Namespace, config: GrowPageConfig, rate: float | None, warn: bool = True
) -> tuple[SimConfig, CostModel, list[WorkloadRequest]]:
    """The simulator's settings, cost model and requests of ``args`` at arrival ``rate``;
    ``warn``: say what in them deserves a warning (a sweep's rates share all of it but the
    arrival times, so it warns once)."""
    cost = _cost_model(args)
    pages = args.kv_pages
    if pages is None:
        pages = cost.kv_pages(config.page_size) if isinstance(cost, RooflineCostModel) else 1500
    sim = SimConfig(
        num_kv_pages=pages,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        chunked_prefill=args.chunked_prefill,
        prefix_caching=args.prefix_caching,
        admission_reserve=args.admission_reserve,
        decisions=args.decisions,
        num_scripts=args.num_scripts,
        seed=args.seed,
        async_compaction=args.async_compaction,
        async_decisions=args.async_decisions,
    )
    # simulate() checks it too; here, before any output folder, the error names the flag.
    check_pool_memory(pages, available_memory(), "--kv-pages")
    if args.traces and args.decisions != "trace":
        raise ConfigError(
            "--traces is used only with --decisions trace (script mode draws synthetic traces)"
        )
    _deep_check(args)  # refuses --check-traces without --traces
    if rate is not None:
        positive_number.require("--arrival-rate (requests per second)", rate)
    requests = resolve_workload(args.workload, args.seed, rate)
    if not args.traces and any(r.trace for r in requests):
        warning(
            f"{args.workload}: the trace column is ignored; it names traces of the set given "
            "with --decisions trace --traces DIR"
        )
    batch = min(sim.max_num_seqs, len(requests))  # the most sequences a decode step can hold
    if warn and isinstance(cost, PiecewiseCostModel) and batch > cost.batch_sizes[-1]:
        warning(
            f"{args.cost} measured decode steps of up to {cost.batch_sizes[-1]} sequences; "
            f"steps of more (up to {batch}: --max-num-seqs {sim.max_num_seqs}, "
            f"{len(requests)} requests) are priced by extrapolation "
            f"({1e3 * cost.trend_s:.3g} ms per sequence more): calibrate with --batch-sizes "
            f"up to {batch} to measure them"
        )
    longest = max(r.prompt_tokens + r.output_tokens for r in requests)
    if warn and longest > LONG_REQUEST_TOKENS and not args.traces:
        warning(
            f"{args.workload}: the longest request has {longest} tokens; a policy that reads "
            "attention signals first replays a synthetic trace that long (script mode: once "
            "per script; trace mode: once per request), and that time grows about as the "
            "square of the length: ~30 s at 131072 tokens, half an hour or more at a million"
        )
    return sim, cost, requests


def _trace_requests(
    args: argparse.Namespace, requests: list[WorkloadRequest]
) -> tuple[list[WorkloadRequest], Callable[[WorkloadRequest], Trace]]:
    """``traces_for`` over ``--traces``, saying once how many requests changed lengths."""
    traced, trace_of = traces_for(
        requests,
        args.traces,
        on_headers=lambda h: _note_layer_subset(args.traces, h),
        deep=_deep_check(args),
        progress=not args.json,
    )
    changed = sum(
        (a.prompt_tokens, a.output_tokens) != (b.prompt_tokens, b.output_tokens)
        for a, b in zip(requests, traced, strict=True)
    )
    if changed:
        warning(
            f"{changed} of {len(requests)} requests take their prompt and output lengths from "
            f"their traces in {args.traces}, not from the workload",
            kind="note",
        )
    return traced, trace_of


def _cost_model(args: argparse.Namespace) -> CostModel:
    """``--cost`` with the capacity-control prices of the flags over its own."""
    cost = load_cost_model(args.cost)
    prices = _boundary_prices(args)
    try:
        return with_boundary_costs(cost, *prices)
    except ConfigError as e:  # a price that takes the model out of scale: name the flags
        given = [f for f, v in zip(BOUNDARY_FLAGS, prices, strict=True) if v is not None]
        raise ConfigError(f"{', '.join(given)}: {e}") from None


def _boundary_prices(
    args: argparse.Namespace,
) -> tuple[float | None, float | None, float | None, float | None]:
    """``--boundary-ms`` / ``--compaction-ms`` / ``--boundary-step-ms`` /
    ``--compaction-step-ms`` in seconds (None where not given)."""
    prices = []
    for flag in BOUNDARY_FLAGS:
        ms = getattr(args, flag[2:].replace("-", "_"), None)
        if ms is not None:
            non_negative_number.require(flag, ms)
        prices.append(None if ms is None else ms / 1000.0)
    return prices[0], prices[1], prices[2], prices[3]


def run_serve(args: argparse.Namespace) -> int:
    from growpage.sim.serving import check_simulation, simulate

    config = _setup(args)
    sim, cost, requests = _serving_setup(args, config, args.arrival_rate)
    trace_of = None
    if args.decisions == "trace" and args.traces:
        requests, trace_of = _trace_requests(args, requests)
    kwargs = parse_params(args.param)
    policy = check_simulation(requests, resolve_policy(args.policy, **kwargs), config, sim, cost)
    out = _out_dir(args)
    with tqdm(total=len(requests), desc="serve", unit="req", disable=args.json) as bar:
        result = simulate(
            requests,
            policy,
            config,
            sim,
            cost,
            trace_of,
            on_progress=lambda n: bar.update(n - bar.n),
        )
    m = result.metrics.as_dict()
    table = reports.format_table([m], reports.SERVING_COLUMNS) + (
        f"\n{m['num_requests']} requests, {m['output_tokens']} output tokens, "
        f"{sim.num_kv_pages} KV pages (peak {m['peak_pages']}), cost model {args.cost}"
        + (
            f", {m['prefix_hit_tokens']} prompt tokens from the prefix cache"
            if m["prefix_hit_tokens"]
            else ""
        )
        + "\n\n"
        + reports.latency_table(m)
    )
    payload = {
        "metrics": m,
        "policy": args.policy,
        "params": kwargs,
        "sim": attrs.asdict(sim),
        "config": attrs.asdict(config),
        "cost": args.cost,
        "cost_model": cost.describe(),
        "workload": args.workload,
        "arrival_rate_per_s": args.arrival_rate,
        "traces": args.traces,
    }
    _emit(args, table, payload)
    if out is not None:
        reports.write_json(out / "metrics.json", payload)
        reports.write_csv(out / "requests.csv", [_request_row(r) for r in result.requests])
        from growpage.plots import plot_capacity, plot_pool

        trajectories = dict(list(result.capacity_trajectories().items())[:12])
        plot_capacity(
            trajectories,
            out / "capacity.png",
            config.page_size,
            xlabel="time (s)",
            title=f"per-request capacity under {policy.name}",
        )
        plot_pool(
            {policy.name: result.pool_timeline()},
            out / "pool.png",
            sim.num_kv_pages,
            sim.max_num_seqs,
            title=f"KV pool under {policy.name}",
        )
        _note(args, f"results in {out}/ (metrics.json, requests.csv, capacity.png, pool.png)")
    return 0


def _request_row(r: Any) -> dict:
    return {
        "request_id": r.request_id,
        "arrival_s": r.spec.arrival_s,
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "avg_budget": r.avg_budget,
        "num_preemptions": r.num_preemptions,
        "first_token_s": r.first_token_s,
        "finish_s": r.finish_s,
        "ttft_s": r.ttft_s,
        "tpot_ms": r.tpot_ms,
        "e2e_s": r.e2e_s,
    }


# ---- sweep ---------------------------------------------------------------------
def run_sweep(args: argparse.Namespace) -> int:
    from growpage.executors.options import jobs_of, make_executor
    from growpage.sim.sweep import (
        SweepError,
        SweepSettings,
        check_points,
        parse_points,
        run_sweep,
    )

    config = _setup(args)
    at_least(1).require("--jobs", jobs_of(args))
    at_least(0).require("--fidelity-traces", args.fidelity_traces)
    rates = args.arrival_rate or [None]
    if len(set(rates)) != len(rates):
        raise ConfigError(f"--arrival-rate: a rate is given twice ({rates})")
    setups = [
        _serving_setup(args, config, rate, warn=i == 0)  # all checked first
        for i, rate in enumerate(rates)
    ]
    points = parse_points(args.points)
    check_points(points, "--points")
    out = _out_dir(args)
    boundary_s, compaction_s, boundary_step_s, compaction_step_s = _boundary_prices(args)
    if args.traces:
        _trace_requests(args, setups[0][2])  # a bad set or trace name fails before the work
    rows = []
    # NOTE: the cost model travels with the settings, so a worker on another machine needs
    # no copy of a calibrated model's file.
    with make_executor(args, out, progress=not args.json, num_cpus=args.threads) as executor:
        for rate, (sim, cost, requests) in zip(rates, setups, strict=True):
            settings = SweepSettings(
                requests=requests,
                config=config,
                sim=sim,
                cost=cost,
                fidelity_traces=args.fidelity_traces,
                seed=args.seed,
                boundary_s=boundary_s,
                compaction_s=compaction_s,
                boundary_step_s=boundary_step_s,
                compaction_step_s=compaction_step_s,
                traces=args.traces,
                threads=args.threads,
            )
            part = run_sweep(points, settings, executor, progress=not args.json)
            rows += part if rate is None else [_at_rate(row, rate) for row in part]
    done, failed = [r for r in rows if "error" not in r], [r for r in rows if "error" in r]
    columns = (
        SWEEP_COLUMNS
        if rates == [None]
        else (SWEEP_COLUMNS[:1] + [("arrival_rate_per_s", "req/s", "g")] + SWEEP_COLUMNS[1:])
    )
    if done or args.json:
        _emit(args, reports.format_table(done, columns), {"points": done, "failed": failed})
    if out is not None:
        reports.write_json(
            out / "sweep.json",
            {
                "workload": args.workload,
                "traces": args.traces,
                "arrival_rate_per_s": args.arrival_rate,
                "points": done,
                "failed": failed,
            },
        )
        reports.write_csv(out / "sweep.csv", done)
        if done:
            _plot_sweep(done, out / "pareto.png", args.workload)
        _note(args, f"results in {out}/ (sweep.json, sweep.csv{', pareto.png' if done else ''})")
    if failed:
        raise SweepError(_failures(failed, len(rows), out))
    return 0


def _at_rate(row: dict, rate: float) -> dict:
    """A sweep row of one arrival rate: the rate in its label, group and
    ``arrival_rate_per_s``."""
    return {
        "label": f"{row['label']} @{rate:g}/s",
        "arrival_rate_per_s": rate,
        **{k: v for k, v in row.items() if k != "label"},
        "group": f"{row['group']} @{rate:g}/s",
    }


def _plot_sweep(rows: list[dict], path: Path, workload: str) -> None:
    from growpage.plots import plot_pareto

    if any(r.get("mass_mean") is not None for r in rows):
        plot_pareto(
            rows,
            path,
            "tps",
            "mass_mean",
            "throughput (tokens/s)",
            "retained attention mass",
            f"fidelity vs throughput ({workload})",
        )
    else:  # --fidelity-traces 0: no fidelity to plot, the KV budget instead
        plot_pareto(
            rows,
            path,
            "tps",
            "avg_kv_budget",
            "throughput (tokens/s)",
            "average KV budget (tokens)",
            f"KV budget vs throughput ({workload})",
        )


def _failures(failed: list[dict], total: int, out: Path | None) -> str:
    kept = total - len(failed)
    head = f"{len(failed)} of {total} sweep points failed"
    if kept:
        head += f" ({kept} finished: their results are printed" + (
            f" and written to {out}/)" if out is not None else ")"
        )
    return "\n".join([head + ":"] + [f"  {r['label']}: {r['error']}" for r in failed])
