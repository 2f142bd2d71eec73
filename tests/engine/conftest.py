"""Engine test fixtures; the helpers live in ``engine_helpers.py`` (importable by tests)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
from engine_helpers import TINY_VARIANTS, tiny_pair  # noqa: E402


@pytest.fixture(params=list(TINY_VARIANTS), scope="module")
def pair(request):
    """``(ours, reference)`` per tiny variant: llama, llama with tied embeddings, qwen3."""
    return tiny_pair(request.param)
