"""Triton kernels for the GPU path (importable as ``growpage.kernels``).

Every kernel has a naive torch twin in ``growpage.kernels.reference``. Prefill attention is not
a kernel here: the engine uses torch SDPA for prefill on both CPU and GPU.

NOTE: on a machine without CUDA, importing this package turns on Triton's CPU interpreter
(``TRITON_INTERPRET=1``) unless the variable is already set, because compiled Triton cannot run
there; the kernels then take CPU tensors (slow, for tests and tiny shapes only). Triton reads the
variable when a kernel is decorated, so this must happen before the kernel modules import.

NOTE: this folder is the package ``growpage.kernels`` (pyproject's package-dir, and the
``growpage/kernels`` symlink), never a top-level ``kernels``: that name belongs to the PyPI
package transformers depends on. Where the checkout's root is on ``sys.path`` anyway (``python
-c`` or a notebook started in it), ``import kernels`` runs this file under that name; it then
loads the PyPI package from the rest of the path in its place, or fails as if there were none.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _load_from_elsewhere(name: str) -> None:
    """Puts the module ``name`` found on ``sys.path`` outside this checkout in ``sys.modules``
    in place of this one (the import system returns what ``sys.modules`` holds)."""
    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    path = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(
            f"No module named {name!r} (this checkout's kernels/ is the "
            "package growpage.kernels, never a top-level one)",
            name=name,
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


if __name__ != "growpage.kernels":
    _load_from_elsewhere(__name__)
else:
    import torch

    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

    from ._utils import KernelInputError, set_index_checks, without_index_checks
    from .accumulate import accumulate_attention
    from .boundary_queries import boundary_queries, boundary_queries_batch
    from .compaction import compact_kv, is_direct_safe
    from .decode_attention import paged_decode_attention
    from .demand import (
        DemandSignals,
        demand_attention,
        demand_attention_batch,
        demand_splits,
        estimate_demand,
        working_set_sizes,
    )
    from .kv_store import store_kv
    from .query_state import BETA_LONG, BETA_SHORT, update_query_state

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
