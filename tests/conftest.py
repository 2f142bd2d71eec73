"""Session-wide setup shared by every test directory.

Triton reads TRITON_INTERPRET when it is first imported, and transformers or torch may import
it before ``growpage.kernels`` gets the chance to set it; without CUDA, set it here first.
"""

from __future__ import annotations

import os

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op torch thread for a module's tests: on a loaded 2-core machine a tiny
    model's steps (and the Triton interpreter) run several times faster than with two threads
    that contend. Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)
