"""``growpage demo``: the policies side by side, in the simulator, in about a minute on a CPU.

1. Replay: a few synthetic traces (attention switching between concentrated and diffuse
   regimes, paper Fig. 3) under ``growpage``, ``fixed`` at several budgets, ``fullkv``,
   ``random`` and ``inverse``, through the shared ``CapacityController``. The table shows what
   each policy spent (average KV budget) and what it kept: the attention mass the next page of
   real future queries puts on the retained tokens (mean, and worst layer/head), and the
   attention-output error.
2. Serving: a small workload through the simpy serving simulator with a shared page pool.
3. A Pareto plot (retained mass vs average budget) and the capacity trajectories of one trace,
   written to ``results/demo/``.
"""

from __future__ import annotations

import argparse
import time

import attrs
import torch
from tqdm import tqdm

from growpage.core.config import GrowPageConfig
from growpage.policies import resolve_policy

POLICIES: list[tuple[str, str, dict]] = [  # (label, policy, hyperparameters)
    ("growpage", "growpage", {}),
    ("fullkv", "fullkv", {}),
    ("random", "random", {"grow_prob": 0.3}),
    ("inverse", "inverse", {}),
    ("fixed-512", "fixed", {"budget_tokens": 512}),
    ("fixed-1024", "fixed", {"budget_tokens": 1024}),
    ("fixed-2048", "fixed", {"budget_tokens": 2048}),
]
SERVE_POLICIES = ["growpage", "fixed-1024", "fixed-2048", "fullkv"]
SERVE_PAGES = 600  # KV pool of the serving run, pages (of --page-size tokens)
SERVE_SEATS = 64  # max_num_seqs
RECENT_WINDOW = 16  # protected recent tokens


CAPACITY_PLOT = ["growpage", "fixed-1024", "random", "inverse", "fullkv"]


def replay_table(
    args: argparse.Namespace, config: GrowPageConfig
) -> tuple[list[dict], dict, list[tuple[int, int]]]:
    """Aggregate replay rows per policy; the trajectories and diffuse regimes of one trace."""
    from growpage.sim.replay import ReplayOptions, replay_trace
    from growpage.sim.reports import aggregate_replays
    from growpage.sim.synthetic import SyntheticSpec, synthetic_trace

    spec = SyntheticSpec(
        num_layers=2,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        prompt_len=128,
        gen_len=args.gen_len,
        schedule="random",
        mean_regime_len=1024.0,
    )
    traces = [synthetic_trace(spec, args.seed + i) for i in range(args.traces)]
    rows, trajectories = [], {}
    # Plot the trace with the most regime switches.
    shown = max(range(len(traces)), key=lambda i: len(traces[i].header.meta["regimes"]))
    diffuse = [(a, b) for a, b, kind in traces[shown].header.meta["regimes"] if kind == "diffuse"]
    jobs = [(label, name, kw, t) for label, name, kw in POLICIES for t in traces]
    results: dict[str, list] = {}
    for label, name, kw, trace in tqdm(jobs, desc="replay", unit="run"):
        result = replay_trace(
            trace, resolve_policy(name, **kw), config, ReplayOptions(fidelity_queries=8)
        )
        results.setdefault(label, []).append(result)
    for label, name, _ in POLICIES:
        row = aggregate_replays(results[label], label)
        rows.append({**row, "group": "fixed" if name == "fixed" else label})
        if label in CAPACITY_PLOT:
            trajectories[label] = results[label][shown].trajectory
    return rows, trajectories, diffuse


def serving_table(
    args: argparse.Namespace, config: GrowPageConfig
) -> tuple[list[dict], dict[str, list[tuple[float, int, int]]]]:
    """The serving table's rows, and each policy's ``pool_timeline()``."""
    from growpage.sim.costmodel import load_cost_model
    from growpage.sim.serving import SimConfig, simulate
    from growpage.sim.workloads import resolve_workload

    requests = resolve_workload("small", args.seed)
    sim = SimConfig(num_kv_pages=SERVE_PAGES, max_num_seqs=SERVE_SEATS, seed=args.seed)
    cost = load_cost_model("a100-qwen3-8b")
    kwargs = {label: (name, kw) for label, name, kw in POLICIES}
    rows, timelines = [], {}
    for label in tqdm(SERVE_POLICIES, desc="serve", unit="policy"):
        name, kw = kwargs[label]
        result = simulate(requests, resolve_policy(name, **kw), config, sim, cost)
        rows.append({**result.metrics.as_dict(), "policy": label})
        timelines[label] = result.pool_timeline()
    return rows, timelines


def run(args: argparse.Namespace) -> int:
    from growpage.errors import ConfigError
    from growpage.plots import plot_capacity, plot_pareto, plot_pool
    from growpage.sim.reports import (
        REPLAY_COLUMNS,
        SERVING_COLUMNS,
        format_table,
        make_output_dir,
        write_json,
    )
    from growpage.validators import at_least

    at_least(1).require("--traces", args.traces)
    if args.page_size <= RECENT_WINDOW:
        raise ConfigError(
            f"--page-size must be > {RECENT_WINDOW} (the demo protects the "
            f"{RECENT_WINDOW} most recent tokens), got {args.page_size}"
        )
    out = make_output_dir(args.out)
    torch.set_num_threads(1)
    start = time.perf_counter()
    config = GrowPageConfig(page_size=args.page_size, recent_window=RECENT_WINDOW)
    rows, trajectories, diffuse = replay_table(args, config)
    print(
        f"\nReplay: {args.traces} synthetic traces of {args.gen_len} generated tokens, "
        f"page size {config.page_size}; fidelity = real attention of 8 sampled queries of "
        "the next page (mass on retained tokens; 1 = nothing lost)"
    )
    print(format_table(rows, REPLAY_COLUMNS))
    serve_rows, timelines = serving_table(args, config)
    print(
        f"\nServing: 'small' workload (96 requests, all at t=0), {SERVE_PAGES} KV pages of "
        f"{config.page_size} tokens, {SERVE_SEATS} seats, A100/Qwen3-8B roofline step times, "
        "decisions scripted from synthetic traces"
    )
    print(format_table(serve_rows, SERVING_COLUMNS))
    pareto = plot_pareto(
        [{**r, "label": r["policy"]} for r in rows],
        out / "pareto.png",
        "avg_budget",
        "mass_mean",
        "average KV budget (tokens)",
        "retained attention mass (next page)",
        "fidelity vs KV budget",
    )
    capacity = plot_capacity(
        trajectories,
        out / "capacity.png",
        config.page_size,
        title="capacity over one synthetic trace",
        shaded=diffuse,
        shaded_label="diffuse attention",
    )
    pool = plot_pool(
        timelines,
        out / "pool.png",
        SERVE_PAGES,
        SERVE_SEATS,
        title="KV pool while serving the 'small' workload",
    )
    write_json(
        out / "demo.json", {"replay": rows, "serving": serve_rows, "config": attrs.asdict(config)}
    )
    print(
        f"\nPareto plot: {pareto}\nCapacity trajectories: {capacity}\nKV pool: {pool}\n"
        f"Numbers: {out / 'demo.json'}   ({time.perf_counter() - start:.0f} s)"
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="compare policies in the simulator (about a minute)")
    p.add_argument("--traces", type=int, default=3, help="synthetic traces to replay (default 3)")
    p.add_argument(
        "--gen-len", type=int, default=3072, help="generated tokens per trace (default 3072)"
    )
    p.add_argument("--page-size", type=int, default=64, help="tokens per KV page (default 64)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the synthetic traces and the serving workload (default 0)",
    )
    p.add_argument(
        "--out", default="results/demo", help="where plots and numbers go (default results/demo)"
    )
    p.set_defaults(func=run)
