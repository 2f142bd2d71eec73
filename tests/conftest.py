"""Session-wide setup shared by every test directory.

Triton reads TRITON_INTERPRET when it is first imported, and transformers or torch may import
it before ``growpage.kernels`` gets the chance to set it; without CUDA, set it here first.
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
