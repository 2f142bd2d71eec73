"""Small helpers shared by the kernel wrappers (not part of the public API)."""

from __future__ import annotations

import functools
import os

import torch

# NOTE: tl.dot needs every block dimension >= 16 on GPU.
MIN_DOT_DIM = 16


# NOTE: Triton picks interpreter or compiler when a kernel is decorated, i.e. when the kernel
# modules import (after this one), so the value read here is the one in force. Read once: the
# wrappers ask on every launch, and an environment lookup costs microseconds.
_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def is_interpreter() -> bool:
    """True when the kernels run under the CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return _INTERPRETER


# Host-side helpers in plain Python: ``triton.cdiv`` / ``triton.next_power_of_2`` go through
# Triton's jit wrapper (~5 us a call), and the wrappers call them on every launch.
def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def next_pow2(n: int) -> int:
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length()


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether kernels should upcast ``tl.dot`` operands to fp32.

    fp32 caches always do (with IEEE precision, no TF32). bf16 does only under the interpreter,
    whose numpy ``tl.dot`` mishandles bf16 operands (Triton 3.x); on GPU bf16/fp16 use tensor cores.
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and is_interpreter())


def check_device(*tensors: torch.Tensor) -> None:
    """All tensors on one device; CPU tensors only under the interpreter."""
    device = tensors[0].device
    for t in tensors:
        assert t.device == device, f"tensors on different devices: {t.device} vs {device}"
    if device.type == "cpu":
        assert _INTERPRETER, "Triton kernels on CPU tensors need TRITON_INTERPRET=1"


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float(t: torch.Tensor, name: str) -> None:
    assert t.dtype in FLOAT_DTYPES, f"{name}: fp32/fp16/bf16 expected, got {t.dtype}"


def check_block(block_n: int, name: str = "block_n", dot: bool = True) -> None:
    """A tile width given by the caller: ``tl.arange`` needs a power of two, and a ``tl.dot``
    operand (``dot``) at least ``MIN_DOT_DIM`` rows when compiled."""
    least = MIN_DOT_DIM if dot and not _INTERPRETER else 1
    assert block_n >= least and block_n & (block_n - 1) == 0, \
        f"{name} must be a power of two >= {least}, got {block_n}"


def check_heads(num_heads: int, num_kv_heads: int) -> None:
    assert num_kv_heads > 0 and num_heads % num_kv_heads == 0, \
        f"{num_heads} query heads do not split evenly over {num_kv_heads} KV heads (GQA)"


def check_index(t: torch.Tensor, ndim: int, name: str) -> None:
    assert t.dim() == ndim, f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}"
    assert t.dtype in (torch.int32, torch.int64), f"{name}: int32/int64 expected, got {t.dtype}"
    assert t.stride(-1) == 1, f"{name}: last dimension must be contiguous"


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 on CPU, where it only shapes test launches)."""
    if device.type != "cuda":
        return 4
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
