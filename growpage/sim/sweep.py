"""Policies x hyperparameters, served (and replayed for fidelity) in parallel processes.

A point spec is ``NAME`` or ``NAME@key=v1,v2;key2=v3``: one point per combination of the listed
values (each value read as ``--param`` reads it: ``policies.registry.parse_policy_value``), e.g.
``fixed@budget_tokens=1024,2048,4096,8192`` or ``growpage@tau=-0.01,0,0.01``.

Each point is served on the workload (throughput side of the Pareto front) and replayed on a few
traces with a private pool (fidelity side: mean retained attention mass and output error of the
next page's queries, as in ``sim.replay``): the first traces of the set a trace-mode sweep
serves, else synthetic ones (``fidelity_traces``).

A point that raises does not stop the sweep: its row carries ``error`` (the exception and where
it was raised) instead of metrics, and the other points run on.

``run_sweep`` runs the points one after another in this process, or on the executor it is given
(``growpage.executors``: worker processes, a Ray cluster), which returns the same rows in the
same order. The simulator does not import the executors (DESIGN.md): it only calls ``run``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import attrs
import torch
from tqdm import tqdm

from growpage.core.config import GrowPageConfig
from growpage.core.trace_set import TraceSet
from growpage.core.traces import Trace
from growpage.errors import ConfigError, GrowPageError, describe_error
from growpage.policies.registry import parse_policy_value, resolve_policy
from growpage.sim.costmodel import CostModel, load_cost_model, with_boundary_costs
from growpage.sim.replay import ReplayOptions, replay_trace
from growpage.sim.reports import aggregate_replays
from growpage.sim.serving import SimConfig, simulate
from growpage.sim.sources import SCRIPT_SPEC, traces_for
from growpage.sim.synthetic import synthetic_trace
from growpage.sim.workload_csv import WorkloadRequest


class SweepError(GrowPageError):
    """Points of a sweep failed; the others ran and their results were kept."""


@attrs.frozen
class SweepPoint:
    """One policy with fixed hyperparameters."""

    policy: str
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        return self.policy + "".join(f" {k}={v}" for k, v in self.params)


def parse_points(specs: Sequence[str]) -> list[SweepPoint]:
    """Expand point specs (see the module docstring) into points."""
    points = []
    for spec in specs:
        name, _, rest = spec.partition("@")
        grid: dict[str, list[tuple[str, Any]]] = {}
        for item in filter(None, rest.split(";")):
            key, eq, values = item.partition("=")
            key = key.strip()
            if not eq or not key or not values:
                raise ConfigError(f"bad sweep spec {spec!r}: expected NAME@key=v1,v2;key2=v3")
            if key in grid:
                raise ConfigError(
                    f"bad sweep spec {spec!r}: key {key!r} given twice (list its "
                    f"values once: {key}=v1,v2)"
                )
            grid[key] = [(key, parse_policy_value(v)) for v in values.split(",")]
        points += [SweepPoint(name, tuple(combo)) for combo in itertools.product(*grid.values())]
    return points


def check_points(points: Sequence[SweepPoint], name: str = "sweep") -> None:
    """A ``ConfigError`` before any point runs: a bad policy name or hyperparameter, or a point
    given twice (``name``: what the message names, such as the flag that gave the points)."""
    for i, p in enumerate(points):
        resolve_policy(p.policy, **dict(p.params))
        earlier = next((q for q in points[:i] if q == p), None)
        if earlier is not None:
            again = "" if earlier.label == p.label else f" (as {earlier.label!r})"
            raise ConfigError(
                f"{name}: the point {p.label!r} is given twice{again}; give each point once"
            )


def _requests(values: Iterable[WorkloadRequest]) -> tuple[WorkloadRequest, ...]:
    return tuple(values)  # converter=tuple, typed (growpage._convert says why)


@attrs.frozen(kw_only=True)
class SweepSettings:
    """Everything a worker process needs besides the point (all picklable)."""

    requests: tuple[WorkloadRequest, ...] = attrs.field(converter=_requests)
    config: GrowPageConfig
    sim: SimConfig
    cost: str | CostModel  # preset name, a cost model's JSON path, or the model itself
    fidelity_traces: int = 4  # synthetic traces replayed per point (0: no fidelity)
    fidelity_gen_len: int = 4096  # tokens generated per fidelity trace
    seed: int = 0
    boundary_s: float | None = None  # capacity-control prices over the cost model's (None: its)
    compaction_s: float | None = None
    boundary_step_s: float | None = None
    compaction_step_s: float | None = None
    traces: str | None = None  # trace set for decisions="trace" (None: synthetic traces)
    threads: int = 1  # torch CPU threads of each point's process


def _identity(point: SweepPoint) -> dict:
    return {
        "label": point.label,
        "group": point.policy,
        **dict(point.params),
        "policy": point.policy,
    }


def run_point(point: SweepPoint, settings: SweepSettings) -> dict:
    """Serve and replay one point; a flat dict of metrics."""
    torch.set_num_threads(settings.threads)
    kwargs = dict(point.params)
    requests, trace_of = list(settings.requests), None
    if settings.traces and settings.sim.decisions == "trace":
        requests, trace_of = traces_for(requests, settings.traces)
    serving = simulate(
        requests,
        resolve_policy(point.policy, **kwargs),
        settings.config,
        settings.sim,
        with_boundary_costs(
            _cost_model(settings.cost),
            settings.boundary_s,
            settings.compaction_s,
            settings.boundary_step_s,
            settings.compaction_step_s,
        ),
        trace_of,
    )
    replays = [
        replay_trace(
            trace,
            resolve_policy(point.policy, **kwargs),
            settings.config,
            ReplayOptions(fidelity_queries=4),
        )
        for trace in fidelity_traces(settings)
    ]
    fidelity = aggregate_replays(replays)
    return {
        **_identity(point),
        **serving.metrics.as_dict(),
        "policy": point.policy,
        "fidelity_source": fidelity_source(settings),
        "mass_mean": fidelity.get("mass_mean"),
        "mass_min": fidelity.get("mass_min"),
        "output_error": fidelity.get("output_error"),
        "replay_avg_budget": fidelity.get("avg_budget"),
    }


def _cost_model(cost: str | CostModel) -> CostModel:
    return load_cost_model(cost) if isinstance(cost, str) else cost


def fidelity_traces(settings: SweepSettings) -> list[Trace]:
    """The traces a point's fidelity is replayed on: the first ``fidelity_traces`` of the
    trace set when the sweep serves one (trace mode), else synthetic ones."""
    if settings.fidelity_traces == 0:
        return []
    if settings.traces and settings.sim.decisions == "trace":
        return TraceSet(settings.traces).read_all(settings.fidelity_traces)
    spec = attrs.evolve(SCRIPT_SPEC, gen_len=settings.fidelity_gen_len)
    return [
        synthetic_trace(spec, settings.seed + 1000 + i) for i in range(settings.fidelity_traces)
    ]


def fidelity_source(settings: SweepSettings) -> str:
    """What ``fidelity_traces`` replays, in words (a sweep row's ``fidelity_source``)."""
    if settings.fidelity_traces == 0:
        return "none"
    if settings.traces and settings.sim.decisions == "trace":
        count = min(settings.fidelity_traces, len(TraceSet(settings.traces)))
        return f"traces {settings.traces} (first {count})"
    return f"{settings.fidelity_traces} synthetic traces of {settings.fidelity_gen_len} tokens"


def try_point(point: SweepPoint, settings: SweepSettings) -> dict:
    """``run_point``, or, when it raises, the point's label, params and ``error``.

    NOTE: the error is described in the process that ran the point: a worker's traceback does
    not survive the trip back, and the exception itself may not pickle."""
    try:
        return run_point(point, settings)
    except Exception as exc:  # noqa: BLE001 - whatever the policy raised; the sweep goes on
        return {**_identity(point), "error": describe_error(exc)}


class GridRunner(Protocol):
    """What ``run_sweep`` needs of an executor (``growpage.executors.Executor`` is one)."""

    def run(
        self,
        fn: Callable[[Any, Any], dict],
        items: Sequence[Any],
        shared: Any = None,
        identities: Sequence[dict] | None = None,
        desc: str = "grid",
        unit: str = "point",
    ) -> list[dict]: ...


def run_sweep(
    points: Sequence[SweepPoint],
    settings: SweepSettings,
    executor: GridRunner | None = None,
    progress: bool = True,
) -> list[dict]:
    """Run every point: one after another in this process, or on ``executor``; rows in the
    order of ``points``.

    A point that fails gives a row with ``error`` (``try_point``); the others run on."""
    check_points(points)
    if executor is not None:
        identities = [_identity(p) for p in points]
        return executor.run(try_point, points, settings, identities, desc="sweep")
    rows: list[dict] = []
    with tqdm(total=len(points), desc="sweep", unit="point", disable=not progress) as bar:
        for p in points:
            rows.append(try_point(p, settings))
            failed = sum("error" in r for r in rows)
            if failed:
                bar.set_postfix_str(f"{failed} failed", refresh=False)
            bar.update()
    return rows
