"""Boundary work on one CPU thread.

A capacity boundary runs dozens of small operations. With torch's intra-op pool on several
threads each of them may wake the others and wait for them, which on a machine whose cores are
busy costs milliseconds per operation (a Qwen2.5-0.5B boundary's signals took 57 ms on two
threads against 2.5 ms on one, 2-core machine under load, 2026-12-06). A boundary's operations
give the same bits on one thread as on several, because each output is computed by one thread
either way (rows of a softmax, a sort, a cumsum; the matrices of a batched product). A lone
matrix product, which a BLAS may split across threads, runs on one thread wherever it is
(``boundary_signals.summary_logits``), so a model whose layers times KV heads is one, which runs
its boundaries on the threads it has, gets the same bits too (``tests/core/test_compaction_batch.py``
checks the bits on one and two threads).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_thread(device: torch.device | str, num_matrices: int = 2) -> Iterator[None]:
    """Torch's CPU operations on one thread inside; nothing changes for other devices, or when
    a boundary's products are single matrices (``num_matrices``: layers times KV heads)."""
    threads = torch.get_num_threads()
    if torch.device(device).type != "cpu" or threads == 1 or num_matrices < 2:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
