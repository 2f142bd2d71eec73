"""GrowPage: on-demand KV-cache budgeting for LLM reasoning serving.

One policy API (``CapacityPolicy``) drives both the trace-replay simulator (``growpage.sim``)
and the paged-attention engine (``growpage.engine``).
"""

from typing import TYPE_CHECKING

from growpage.core.boundary_context import BoundaryContext
from growpage.core.capacity import BoundaryOutcome, CapacityController
from growpage.core.config import GrowPageConfig
from growpage.core.decision import Action, Decision
from growpage.core.events import EventCounters
from growpage.core.kv_view import DenseKVView, KVView, QueryState
from growpage.core.pages import PagePool
from growpage.core.request import RequestState
from growpage.errors import (
    ConfigError,
    EngineError,
    GrowPageError,
    PolicyError,
    PoolExhaustedError,
    SimulationError,
    TraceError,
    WorkloadError,
)
from growpage.policies.base import CapacityPolicy
from growpage.policies.registry import register_policy, resolve_policy

__version__ = "0.1.0"

if TYPE_CHECKING:  # imported on first use (``__getattr__``); type checkers see the classes
    from growpage.engine.llm import LLM
    from growpage.engine.sampling_params import SamplingParams

# The engine is imported on first use, so policy authors and the simulator do not pay for it.
_LAZY = {"LLM": "growpage.engine.llm", "SamplingParams": "growpage.engine.sampling_params"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'growpage' has no attribute {name!r}")


__all__ = [
    "Action",
    "BoundaryContext",
    "BoundaryOutcome",
    "CapacityController",
    "CapacityPolicy",
    "ConfigError",
    "Decision",
    "DenseKVView",
    "EngineError",
    "EventCounters",
    "GrowPageConfig",
    "GrowPageError",
    "KVView",
    "LLM",
    "SamplingParams",
    "PagePool",
    "PolicyError",
    "PoolExhaustedError",
    "QueryState",
    "RequestState",
    "SimulationError",
    "TraceError",
    "WorkloadError",
    "register_policy",
    "resolve_policy",
]
