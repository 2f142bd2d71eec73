"""Executors: run grids of simulations or engine runs, on this machine or on a Ray cluster.

A thin face over the two worlds (DESIGN.md): nothing in ``sim`` or ``engine`` imports it. A
grid is a function and its points; every executor returns the same rows in the same order::

    from growpage.executors import LocalExecutor, RowStore

    with LocalExecutor(jobs=2, store=RowStore("out/finished-points", resume=True)) as ex:
        rows = ex.run(fn, items, shared)          # fn(item, shared) -> dict, one row per item

``RayExecutor`` (``pip install 'growpage[ray]'``) runs the same grid as Ray tasks, or on Ray
actors that keep one engine per worker. The command-line flags are in ``executors.options``.
"""

from growpage.errors import describe_error
from growpage.executors.base import (
    Executor,
    GridError,
    call_point,
    worker_state,
)
from growpage.executors.local import LocalExecutor
from growpage.executors.store import RowStore, fingerprint

__all__ = [
    "Executor",
    "GridError",
    "LocalExecutor",
    "RowStore",
    "call_point",
    "describe_error",
    "fingerprint",
    "worker_state",
]
