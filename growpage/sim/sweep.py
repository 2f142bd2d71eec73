"""Policies x hyperparameters, served (and replayed for fidelity) in parallel processes.

A point spec is ``NAME`` or ``NAME@key=v1,v2;key2=v3``: one point per combination of the listed
values (values are parsed as JSON, else kept as strings), e.g.
``fixed@budget_tokens=1024,2048,4096,8192`` or ``growpage@tau=-0.01,0,0.01``.

Each point is served on the workload (throughput side of the Pareto front) and replayed on a few
synthetic traces with a private pool (fidelity side: mean retained attention mass and output
error of the next page's queries, as in ``sim.replay``).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import attrs
import torch
from tqdm import tqdm

from growpage.core.config import GrowPageConfig
from growpage.errors import ConfigError
from growpage.policies.registry import resolve_policy
from growpage.sim.costmodel import load_cost_model, with_boundary_costs
from growpage.sim.replay import ReplayOptions, replay_trace
from growpage.sim.reports import aggregate_replays
from growpage.sim.serving import SimConfig, simulate
from growpage.sim.sources import SCRIPT_SPEC, traces_for
from growpage.sim.synthetic import synthetic_trace
from growpage.sim.workload_csv import WorkloadRequest


@attrs.frozen
class SweepPoint:
    """One policy with fixed hyperparameters."""

    policy: str
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        return self.policy + "".join(f" {k}={v}" for k, v in self.params)


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_points(specs: Sequence[str]) -> list[SweepPoint]:
    """Expand point specs (see the module docstring) into points."""
    points = []
    for spec in specs:
        name, _, rest = spec.partition("@")
        grid: list[list[tuple[str, Any]]] = []
        for item in filter(None, rest.split(";")):
            key, eq, values = item.partition("=")
            if not eq or not key.strip() or not values:
                raise ConfigError(f"bad sweep spec {spec!r}: expected NAME@key=v1,v2;key2=v3")
            grid.append([(key.strip(), _value(v.strip())) for v in values.split(",")])
        points += [SweepPoint(name, tuple(combo)) for combo in itertools.product(*grid)]
    return points


@attrs.frozen(kw_only=True)
class SweepSettings:
    """Everything a worker process needs besides the point (all picklable)."""

    requests: tuple[WorkloadRequest, ...] = attrs.field(converter=tuple)
    config: GrowPageConfig
    sim: SimConfig
    cost: str                         # preset name or linear model JSON path
    fidelity_traces: int = 4          # synthetic traces replayed per point (0: no fidelity)
    fidelity_gen_len: int = 4096      # tokens generated per fidelity trace
    seed: int = 0
    boundary_s: float | None = None   # capacity-control prices over the cost model's (None: its)
    compaction_s: float | None = None
    traces: str | None = None         # trace set for decisions="trace" (None: synthetic traces)


def run_point(point: SweepPoint, settings: SweepSettings) -> dict:
    """Serve and replay one point; a flat dict of metrics."""
    torch.set_num_threads(1)
    kwargs = dict(point.params)
    requests, trace_of = list(settings.requests), None
    if settings.traces and settings.sim.decisions == "trace":
        requests, trace_of = traces_for(requests, settings.traces)
    serving = simulate(requests, resolve_policy(point.policy, **kwargs),
                       settings.config, settings.sim,
                       with_boundary_costs(load_cost_model(settings.cost), settings.boundary_s,
                                           settings.compaction_s), trace_of)
    spec = attrs.evolve(SCRIPT_SPEC, gen_len=settings.fidelity_gen_len)
    replays = [replay_trace(synthetic_trace(spec, settings.seed + 1000 + i),
                            resolve_policy(point.policy, **kwargs), settings.config,
                            ReplayOptions(fidelity_queries=4))
               for i in range(settings.fidelity_traces)]
    fidelity = aggregate_replays(replays)
    return {"label": point.label, "group": point.policy, **dict(point.params),
            **serving.metrics.as_dict(), "policy": point.policy,
            "mass_mean": fidelity.get("mass_mean"), "mass_min": fidelity.get("mass_min"),
            "output_error": fidelity.get("output_error"),
            "replay_avg_budget": fidelity.get("avg_budget")}


def run_sweep(points: Sequence[SweepPoint], settings: SweepSettings, jobs: int = 2,
              progress: bool = True) -> list[dict]:
    """Run every point (in ``jobs`` processes); rows in the order of ``points``."""
    for p in points:   # fail fast on a bad policy name or hyperparameter
        resolve_policy(p.policy, **dict(p.params))
    bar = tqdm(total=len(points), desc="sweep", unit="point", disable=not progress)
    if jobs <= 1:
        rows = []
        for p in points:
            rows.append(run_point(p, settings))
            bar.update()
        bar.close()
        return rows
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(run_point, p, settings) for p in points]
        for future in futures:
            future.add_done_callback(lambda _: bar.update())
        rows = [f.result() for f in futures]
    bar.close()
    return rows
