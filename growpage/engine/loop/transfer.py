"""Host-to-device copies of step and boundary metadata that do not stall the host.

``torch.tensor(values, device="cuda")`` copies from pageable memory, and torch then waits for
the stream: every such copy is a host sync. Through pinned memory with ``non_blocking=True`` the
copy is queued behind the work already launched, like a kernel; torch's caching host allocator
keeps the pinned buffer alive until the copy has run. On the CPU it is a plain tensor.
"""

from __future__ import annotations

from typing import Any

import torch


def copy_into(dst: torch.Tensor, values: Any) -> None:
    """``dst[:len(values)] = values`` (nested lists or a CPU tensor), queued on CUDA."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dst.dtype)
    if dst.is_cuda:
        host = host.pin_memory()
    dst[: host.shape[0]].copy_(host, non_blocking=dst.is_cuda)


def to_device(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (nested lists of numbers, or a CPU tensor) as a ``dtype`` tensor on
    ``device``, without a host sync on CUDA."""
    host = (
        values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    )
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
