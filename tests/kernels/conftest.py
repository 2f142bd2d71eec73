"""Kernel tests run on CUDA when present, else on CPU under Triton's interpreter.

TRITON_INTERPRET must be set before any kernel module is imported (Triton reads it when a
kernel is decorated), hence at the top of this conftest.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import growpage.kernels  # noqa: E402,F401 - after TRITON_INTERPRET is set
