"""Small helpers shared by the kernel wrappers (not part of the public API)."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator

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


# Triton knows an integer argument is a multiple of 16 only when it specializes on it; the
# strides kernels keep out of their compile keys (``do_not_specialize``) lose that, and with it
# every vector load and store whose address they enter (a 20x slower compaction on an H200).
# A kernel takes ``ALIGN`` (a constexpr, ``stride_align``) and rebuilds such a stride as
# ``stride // ALIGN * ALIGN``: the same value, known to be a multiple of ALIGN.
STRIDE_ALIGN = 16


def stride_align(*strides: int) -> int:
    """``STRIDE_ALIGN`` when every stride is a multiple of it, else 1 (for a kernel's ALIGN)."""
    return STRIDE_ALIGN if all(int(s) % STRIDE_ALIGN == 0 for s in strides) else 1


# Register budgets of a context tile, ``BLOCK_N x BLOCK_D`` elements of the cache's dtype: the
# largest that ``benchmarks/aot_compile.py`` finds free of register spills on sm_80 / sm_90 with
# 4 warps. bf16 / fp16 at head dim 128 keep the 64-key tile; an fp32 cache (whose dot runs in
# fp32) at head dim 128 gets 16 keys: with 64, decode attention spills 608 bytes a thread and
# the H2O accumulation 200; with 32, decode attention with the fused EMA still spills 360.
# Demand attention at head dim 256 gets 32 keys (64 spills 512 bytes); its fp32 path keeps 64
# keys at head dim 128 (80 registers), so it passes an fp32 budget of 2 x TILE_BYTES.
# Compaction only moves data: 2 x TILE_BYTES for every dtype (64 keys but for an fp32 cache at
# head dim 256, which spills 376-528 bytes a thread with 64).
TILE_BYTES = 64 * 128 * 2
TILE_BYTES_FP32 = 16 * 128 * 4


def default_block_n(
    head_dim: int,
    dtype: torch.dtype,
    tile_bytes: int = TILE_BYTES,
    fp32_tile_bytes: int = TILE_BYTES_FP32,
) -> int:
    """The context tile of a compiled launch whose caller gave none: the largest power of two in
    ``[MIN_DOT_DIM, 64]`` whose ``BLOCK_N x BLOCK_D`` tile fits the budget of the cache's dtype
    (``tile_bytes``; ``fp32_tile_bytes`` for fp32), which a kernel that needs fewer registers
    per element may raise. Under the interpreter: 16, the cheapest to interpret."""
    if _INTERPRETER:
        return 16
    budget = fp32_tile_bytes if dtype == torch.float32 else tile_bytes
    rows = budget // (next_pow2(head_dim) * dtype.itemsize)
    return max(MIN_DOT_DIM, min(64, 1 << max(rows, 1).bit_length() - 1))


def tile_warps(block_n: int, head_dim: int, dtype: torch.dtype) -> int:
    """Warps of a program over a ``block_n``-key context tile: 4, or 8 when even that tile is
    over its dtype's register budget (an fp32 cache at head dim 256, whose 16-key tile spills
    24 bytes a thread with 4 warps in the H2O accumulation and none with 8)."""
    budget = TILE_BYTES_FP32 if dtype == torch.float32 else TILE_BYTES
    return 8 if block_n * next_pow2(head_dim) * dtype.itemsize > budget else 4


def vector_warps(elements: int, itemsize: int, most: int = 4) -> int:
    """Warps for a program that moves one ``elements``-element tile: as many as still give each
    thread a 16-byte vector (too many threads for a small tile split it into 2- or 4-byte
    accesses), at least 1, at most ``most``."""
    warps = elements * itemsize // (32 * 16)
    return max(1, min(most, 1 << max(warps, 1).bit_length() - 1))


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether kernels should upcast ``tl.dot`` operands to fp32.

    fp32 caches always do (with IEEE precision, no TF32). bf16 does only under the interpreter,
    whose numpy ``tl.dot`` mishandles bf16 operands (Triton 3.x); on GPU bf16/fp16 use tensor cores.
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and is_interpreter())


class KernelInputError(ValueError, AssertionError):
    """A launch wrapper refused its arguments (shape, dtype, stride, device or index values).

    A ``ValueError``, and an ``AssertionError`` for callers that catch one. Raised, never
    asserted: ``python -O`` must keep the checks, or a bad shape reaches a kernel that reads past
    its tensors."""


def check_device(*tensors: torch.Tensor) -> None:
    """All tensors on one device; CPU tensors only under the interpreter."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise KernelInputError(f"tensors on different devices: {t.device} vs {device}")
    if device.type == "cpu":
        if not _INTERPRETER:
            raise KernelInputError("Triton kernels on CPU tensors need TRITON_INTERPRET=1")


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float(t: torch.Tensor, name: str) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise KernelInputError(f"{name}: fp32/fp16/bf16 expected, got {t.dtype}")


def check_block(block_n: int, name: str = "block_n", dot: bool = True) -> None:
    """A tile width given by the caller: ``tl.arange`` needs a power of two, and a ``tl.dot``
    operand (``dot``) at least ``MIN_DOT_DIM`` rows when compiled."""
    least = MIN_DOT_DIM if dot and not _INTERPRETER else 1
    if not (block_n >= least and block_n & (block_n - 1) == 0):
        raise KernelInputError(f"{name} must be a power of two >= {least}, got {block_n}")


def check_heads(num_heads: int, num_kv_heads: int) -> None:
    if not (num_kv_heads > 0 and num_heads % num_kv_heads == 0):
        raise KernelInputError(
            f"{num_heads} query heads do not split evenly over {num_kv_heads} KV heads (GQA)"
        )


def check_kv_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """``v_cache`` laid out as ``k_cache``: the kernels address both with ``k_cache``'s strides."""
    if not (k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()):
        raise KernelInputError(
            f"v_cache: expected k_cache's shape {tuple(k_cache.shape)} and strides "
            f"{k_cache.stride()}, got {tuple(v_cache.shape)} and {v_cache.stride()}"
        )


def check_written(t: torch.Tensor, name: str) -> None:
    """A tensor a kernel writes holds each element once: a stride of 0 over a dimension of two
    or more (an ``expand`` view) makes two programs' writes land on one address."""
    if 0 in t.stride():  # NOTE: the common case costs this one test
        for size, stride in zip(t.shape, t.stride(), strict=True):
            if not (stride != 0 or size < 2):
                raise KernelInputError(
                    f"{name}: written, so no element may alias another, got strides {t.stride()} "
                    f"for shape {tuple(t.shape)} (an expanded view?)"
                )


def check_sums(t: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    """Per-slot H2O sums a kernel adds to or moves: fp32 of ``shape``, heads (the last
    dimension) contiguous, each element once."""
    if not (t.dtype == torch.float32 and tuple(t.shape) == shape):
        raise KernelInputError(
            f"{name}: fp32 {list(shape)} expected, got {t.dtype} {tuple(t.shape)}"
        )
    if t.stride(-1) != 1:
        raise KernelInputError(f"{name}: heads contiguous")
    check_written(t, name)


def check_index(t: torch.Tensor, ndim: int, name: str) -> None:
    if t.dim() != ndim:
        raise KernelInputError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(f"{name}: int32/int64 expected, got {t.dtype}")
    if t.stride(-1) != 1:
        raise KernelInputError(f"{name}: last dimension must be contiguous")


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 on CPU, where it only shapes test launches)."""
    if device.type != "cuda":
        return 4
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# --- values of index tensors ------------------------------------------------------------------
# NOTE: checking a value reads the tensor, which on a GPU is a device sync per check. Under the
# interpreter (CPU tensors, where reading costs no sync) the values are always checked; compiled,
# only when GROWPAGE_CHECK_INDICES is set when this module is imported, or after
# ``set_index_checks(True)``. Read once, like the interpreter flag: the wrappers ask on every
# launch. (Keyed on the interpreter rather than the device: benchmarks/aot_compile.py compiles
# for a GPU with placeholder CPU tensors and checks nothing, as on a GPU.)
CHECK_INDICES_ENV = "GROWPAGE_CHECK_INDICES"


def env_flag(name: str) -> bool:
    """An environment variable set to 1/true/on/yes (any case)."""
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "on", "yes")


_CHECK_ON_DEVICE = env_flag(CHECK_INDICES_ENV)


def set_index_checks(enabled: bool) -> bool:
    """Check the values of index tensors on a GPU too (each check then syncs); returns the
    previous setting. Under the interpreter they are checked whatever the setting."""
    global _CHECK_ON_DEVICE
    previous, _CHECK_ON_DEVICE = _CHECK_ON_DEVICE, bool(enabled)
    return previous


_SUSPENDED = 0  # depth of ``without_index_checks`` blocks


@contextlib.contextmanager
def without_index_checks() -> Iterator[None]:
    """No index values are checked inside the block, not even under the interpreter: for tools
    that count a GPU run's host work on the CPU (``benchmarks/boundary_ops.py``), and for tests
    of a kernel's own guards against values the checks would refuse."""
    global _SUSPENDED
    _SUSPENDED += 1
    try:
        yield
    finally:
        _SUSPENDED -= 1


def index_checks_on() -> bool:
    """Whether the wrappers check the values of their index tensors before a launch."""
    return (_INTERPRETER or _CHECK_ON_DEVICE) and not _SUSPENDED


def first_true(mask: torch.Tensor) -> tuple[int, ...] | None:
    """Index of the first True of ``mask`` in row-major order, None when there is none."""
    if not bool(mask.any()):
        return None
    return tuple(mask.nonzero()[0].tolist())


def values_in(t: torch.Tensor, low: int, high: int | None) -> bool:
    """Every value of ``t`` in ``[low, high)`` (``high`` None: no upper bound); one reduction."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return int(lo) >= low and (high is None or int(hi) < high)


def at(name: str, index: tuple[int, ...]) -> str:
    return f"{name}[{', '.join(map(str, index))}]"


def check_values(
    t: torch.Tensor,
    name: str,
    low: int,
    high: int | None,
    expected: str,
    *,
    where: Callable[[], torch.Tensor] | None = None,
    label: Callable[[tuple[int, ...]], str] | None = None,
    note: Callable[[tuple[int, ...]], str] | None = None,
    exc: type[Exception] = KernelInputError,
) -> None:
    """Raise ``exc`` naming the first value of ``t`` outside ``[low, high)`` (``high`` None: no
    upper bound), its index and ``expected`` (the valid values, in words).

    ``where()``, a bool mask of ``t``'s shape, limits the check to the entries a kernel reads; it
    is only built when some value of the whole tensor is out of range (one ``aminmax`` first).
    ``label(index)`` names an entry (default ``name[index]``); ``note(index)`` says, after the
    value, why the entry matters.
    """
    if values_in(t, low, high):
        return
    bad = t < low
    if high is not None:
        bad |= t >= high
    if where is not None:
        bad &= where()
    index = first_true(bad)
    if index is not None:
        entry = label(index) if label is not None else at(name, index)
        why = f" ({note(index)})" if note is not None else ""
        raise exc(f"{entry} = {int(t[index])}{why}: expected {expected}")


# --- repeated write targets -------------------------------------------------------------------
# NOTE: programs of one launch run concurrently and unordered, so two of them writing through
# one index (a slot, a page) leave either's data, or a mix: an unspecified result. Where a
# repeat can only be a caller's bug, the wrappers refuse it, under the same switch as the value
# checks (a host scan of a small index tensor, else one sort; a sync on a GPU). Negative values
# (-1: padding, no write) may repeat; the value checks, which run first, have refused any other
# negative value.


def unravel(flat: int, shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """The row-major index of entry ``flat`` of a tensor of ``shape``."""
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


# Entries up to which ``first_repeat`` scans a host copy in Python: a batch's slots (16 of them:
# ~1.5 us on a CPU, where the sort path's few torch ops take ~35 us; about even at 1024).
SCAN_ON_HOST = 256


def first_repeat(
    t: torch.Tensor, where: torch.Tensor | None = None
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The first entry of ``t`` (row-major) whose value >= 0 an earlier entry holds, as the
    indices ``(earlier, later)`` of the two; None when the values >= 0 are distinct. ``where``,
    a bool mask of ``t``'s shape, limits the search to its True entries."""
    if t.numel() < 2:
        return None
    flat = t.reshape(-1)
    if where is not None:
        flat = torch.where(where.reshape(-1), flat, -1)
    if flat.numel() <= SCAN_ON_HOST:
        seen: dict[int, int] = {}
        for i, value in enumerate(flat.tolist()):
            if value >= 0 and seen.setdefault(value, i) != i:
                return unravel(seen[value], t.shape), unravel(i, t.shape)
        return None
    # Sorted, a repeat is a zero step between neighbours >= 0; a step into a negative value
    # (sorted first) counts 1 more.
    values = torch.sort(flat).values
    if int((values.diff() + (values[1:] < 0)).min()) > 0:
        return None
    # Stable: equal values keep their row-major order, so each pair of equal neighbours is an
    # entry and its nearest earlier copy.
    values, order = torch.sort(flat, stable=True)
    repeat = (values[1:] == values[:-1]) & (values[1:] >= 0)
    later = order[1:][repeat]
    i = int(later.argmin())  # the first repeat; its nearest earlier copy is then the first
    return unravel(int(order[:-1][repeat][i]), t.shape), unravel(int(later[i]), t.shape)


def check_distinct(
    t: torch.Tensor,
    name: str,
    expected: str,
    *,
    where: Callable[[], torch.Tensor] | None = None,
    label: Callable[[tuple[int, ...]], str] | None = None,
    note: Callable[[tuple[int, ...], tuple[int, ...]], str] | None = None,
    exc: type[Exception] = KernelInputError,
) -> None:
    """Raise ``exc`` naming the first value >= 0 that two entries of ``t`` hold (an index two
    programs would write through), the two entries and ``expected`` (in words).

    ``where()``, a bool mask of ``t``'s shape, limits the check to the entries a kernel writes
    through; it is only built when some value repeats in the whole tensor. ``label(index)``
    names an entry (default ``name[index]``); ``note(first, second)`` says, after the value,
    why the two entries matter.
    """
    found = first_repeat(t)
    if found is not None and where is not None:
        found = first_repeat(t, where())
    if found is None:
        return
    first, second = found

    def entry(index: tuple[int, ...]) -> str:
        return label(index) if label is not None else at(name, index)

    why = f" ({note(first, second)})" if note is not None else ""
    raise exc(f"{entry(first)} = {entry(second)} = {int(t[first])}{why}: expected {expected}")


def page_range(num_pages: int) -> str:
    return f"-1 (no page) or a page id in [0, {num_pages})"


def check_context_lens(
    context_lens: torch.Tensor, block_tables: torch.Tensor, page_size: int
) -> None:
    """Each context fits its row of the block table (the reference refuses a longer one; the
    kernels, unchecked, clamp it to the table rather than read past it)."""
    width = block_tables.shape[1]
    check_values(
        context_lens,
        "context_lens",
        0,
        width * page_size + 1,
        f"a context length in [0, {width * page_size}] (block_tables rows hold {width} "
        f"pages of {page_size} tokens)",
    )


def check_block_tables(
    block_tables: torch.Tensor, context_lens: torch.Tensor, page_size: int, num_pages: int
) -> None:
    """The table entries a paged kernel reads: row ``b``'s first ``cdiv(min(context_lens[b],
    width * page_size), page_size)`` columns, each -1 (skipped) or a page id. Entries past a
    row's context are never read and may hold anything. ``context_lens`` checked first."""

    def note(index: tuple[int, ...]) -> str:
        return f"within context_lens[{index[0]}] = {int(context_lens[index[0]])}"

    check_values(
        block_tables,
        "block_tables",
        -1,
        num_pages,
        page_range(num_pages),
        where=lambda: pages_read(block_tables, context_lens, page_size),
        note=note,
    )


def pages_read(
    block_tables: torch.Tensor, context_lens: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Bool ``[B, width]``: the table entries a paged kernel reads (row ``b``'s first
    ``cdiv(min(context_lens[b], width * page_size), page_size)`` columns)."""
    width = block_tables.shape[1]
    pages = (context_lens.clamp(max=width * page_size) + page_size - 1) // page_size
    columns = torch.arange(width, device=block_tables.device)
    return columns[None, :] < pages[:, None]
