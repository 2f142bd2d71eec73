"""The simulator's replay as a grid: one point per trace (``growpage sim replay``).

A point reads its trace where it runs: from the trace set's directory (a worker on another
machine needs the set at the same path: shared storage), or, for synthetic traces, drawn from
the spec and the seed. A point may also be the ``Trace`` itself, read by the caller: Ray then
moves it to the worker through its object store (no shared storage, but every trace passes
through the caller's memory). Its row is the replay's ``ReplayResult.as_dict()`` and its final
capacity, from which ``result_of`` gives the ``ReplayResult`` back, as the replay made it
(less the per-head masses, which no report reads).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from growpage.core.config import GrowPageConfig
from growpage.core.trace_set import TraceEntry, TraceSet
from growpage.core.traces import Trace
from growpage.policies.registry import resolve_policy
from growpage.sim.records import BoundaryRecord, ReplayResult
from growpage.sim.replay import ReplayOptions, replay_trace
from growpage.sim.synthetic import SyntheticSpec, synthetic_trace


@attrs.frozen(kw_only=True)
class ReplayJob:
    """What every replay point shares: the source of the traces, the policy and the options.

    ``traces``: a trace set's directory (the points are its entries), else synthetic traces of
    ``spec`` (point i: seed ``seed + i``, id ``synthetic-i``)."""

    policy: str
    params: tuple[tuple[str, Any], ...] = ()
    config: GrowPageConfig
    options: ReplayOptions
    traces: str | None = None
    spec: SyntheticSpec | None = None
    seed: int = 0
    threads: int = 1  # torch CPU threads of each point


def replay_point(item: Trace | TraceEntry | int, job: ReplayJob) -> dict:
    """Replay one trace (``item`` itself, an entry of ``job.traces``, or synthetic trace
    ``item``): its row."""
    torch.set_num_threads(job.threads)
    if isinstance(item, Trace):
        trace = item
    elif isinstance(item, TraceEntry):
        assert job.traces is not None, "a trace set's entry without the set"
        trace = TraceSet(job.traces).read(item)
    else:
        assert job.spec is not None, "a synthetic trace without its spec"
        trace = synthetic_trace(job.spec, job.seed + item, f"synthetic-{item}")
    policy = resolve_policy(job.policy, **dict(job.params))
    result = replay_trace(trace, policy, job.config, job.options)
    return {**result.as_dict(), "final_pages": result.final_pages}


def result_of(row: dict) -> ReplayResult:
    """The ``ReplayResult`` of a ``replay_point`` row."""
    return ReplayResult(
        row["request_id"],
        row["policy"],
        row["page_size"],
        row["prompt_len"],
        row["num_tokens"],
        [BoundaryRecord(**r) for r in row["records"]],
        dict(row["events"]),
        row["avg_budget"],
        row["max_pages"],
        row["final_pages"],
        None,
        row["preempted"],
    )
