"""Server test fixtures; the helpers live in ``server_helpers.py``."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op torch thread: the tiny model's steps run ten times faster on a loaded
    2-core machine than with two threads that contend (the engine thread steps with it)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)
