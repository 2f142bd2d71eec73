"""``growpage bench`` test fixtures: the server tests' tiny model on disk, one torch thread."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import write_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (vocabulary 128) that ``LLM`` and ``growpage serve`` load."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: a tiny model's steps are faster without two contending threads."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)
