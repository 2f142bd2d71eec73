"""``growpage bench`` test fixtures: the server tests' tiny model on disk, one torch thread."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import write_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (vocabulary 128) that ``LLM`` and ``growpage serve`` load."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module", autouse=True)
def _one_thread_everywhere(one_thread):
    """Every bench test with one intra-op thread (``one_thread``, tests/conftest.py)."""
