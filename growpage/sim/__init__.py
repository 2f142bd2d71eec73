"""Trace replay and serving simulation (see docs/simulator.md).

Main entry points::

    replay_trace(trace, policy, config, ReplayOptions(...)) -> ReplayResult     # one request
    simulate(requests, policy, config, SimConfig(...), cost_model) -> ServingResult
    resolve_workload("mixed" | "file.csv") -> [WorkloadRequest]
    load_cost_model("a100-qwen3-8b" | "model.json") -> CostModel
    signal_quality(records) -> SignalQuality                                   # Fig. 6 / 7
"""

from growpage.sim.costmodel import (
    CostModel,
    LinearCostModel,
    PiecewiseCostModel,
    RooflineCostModel,
    load_cost_model,
)
from growpage.sim.records import BoundaryRecord, ReplayResult
from growpage.sim.replay import ReplayOptions, replay_trace
from growpage.sim.serving import ServingResult, SimConfig, simulate
from growpage.sim.signal import SignalQuality, signal_quality
from growpage.sim.workloads import WORKLOADS, WorkloadRequest, WorkloadSpec, resolve_workload

__all__ = [
    "WORKLOADS",
    "BoundaryRecord",
    "CostModel",
    "LinearCostModel",
    "PiecewiseCostModel",
    "ReplayOptions",
    "ReplayResult",
    "RooflineCostModel",
    "ServingResult",
    "SignalQuality",
    "SimConfig",
    "WorkloadRequest",
    "WorkloadSpec",
    "load_cost_model",
    "replay_trace",
    "resolve_workload",
    "signal_quality",
    "simulate",
]
