"""Triton kernels for the GPU path (importable as ``growpage.kernels``).

Every kernel has a naive torch twin in ``growpage.kernels.reference``. Prefill attention is not
a kernel here: the engine uses torch SDPA for prefill on both CPU and GPU.

NOTE: on a machine without CUDA, importing this package turns on Triton's CPU interpreter
(``TRITON_INTERPRET=1``) unless the variable is already set, because compiled Triton cannot run
there; the kernels then take CPU tensors (slow, for tests and tiny shapes only). Triton reads the
variable when a kernel is decorated, so this must happen before the kernel modules import.
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from ._utils import KernelInputError, set_index_checks, without_index_checks  # noqa: E402
from .accumulate import accumulate_attention  # noqa: E402
from .boundary_queries import boundary_queries, boundary_queries_batch  # noqa: E402
from .compaction import compact_kv, is_direct_safe  # noqa: E402
from .decode_attention import paged_decode_attention  # noqa: E402
from .demand import (  # noqa: E402
    DemandSignals,
    demand_attention,
    demand_attention_batch,
    demand_splits,
    estimate_demand,
    working_set_sizes,
)
from .kv_store import store_kv  # noqa: E402
from .query_state import BETA_LONG, BETA_SHORT, update_query_state  # noqa: E402

__all__ = [
    "BETA_LONG",
    "BETA_SHORT",
    "DemandSignals",
    "KernelInputError",
    "accumulate_attention",
    "boundary_queries",
    "boundary_queries_batch",
    "compact_kv",
    "demand_attention",
    "demand_attention_batch",
    "demand_splits",
    "estimate_demand",
    "is_direct_safe",
    "paged_decode_attention",
    "set_index_checks",
    "store_kv",
    "update_query_state",
    "without_index_checks",
    "working_set_sizes",
]
