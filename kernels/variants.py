"""Compiled variants of the kernels: what makes Triton compile again, and how to see it.

Triton compiles a kernel once per *specialization key*: the values of its ``tl.constexpr``
parameters, the launch options (``num_warps``...), and for every other argument its type plus,
unless the kernel opts out (``do_not_specialize``, ``do_not_specialize_on_alignment``), whether
an integer is divisible by 16 (an integer equal to 1 even becomes a constant) and whether a
tensor's address is 16-byte aligned. A compile takes a fraction of a second to seconds. In a
serving engine every launch whose key is new *during serving* is a stall of that length, so the
kernels keep every per-call quantity (context lengths, candidate counts, split counts, slot
numbers, table widths, addresses of sliced tensors) out of their keys, and the engine compiles
the few keys left once, at start-up (``growpage.engine.loop.warmup``).

Two views of it:

* ``record_variants()``: the key of every launch inside the block, computed with Triton's own
  specialization function. It works on any machine (under the CPU interpreter too, where
  nothing is compiled), so tests pin the keys on CPU: a workload that varies batch size,
  context lengths and boundary sizes must not produce a key the warm-up did not.
* ``compiled_variants()``: on CUDA, how many binaries each kernel holds in Triton's in-memory
  cache: the ground truth that ``benchmarks/gpu_check.py`` reports around its timed runs.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import attrs
from triton.backends.compiler import BaseBackend

from . import accumulate, compaction, decode_attention, demand, kv_store, query_state, split_k
from .boundary_queries import _boundary_queries_kernel

KERNELS = {
    "accumulate": accumulate._accumulate_kernel,
    "boundary_queries": _boundary_queries_kernel,
    "compact": compaction._compact_kernel,
    "decode_attention": decode_attention._decode_attention_kernel,
    "demand_logits": demand._demand_logits_kernel,
    "demand_normalize": demand._demand_normalize_kernel,
    "merge_splits": split_k._merge_splits_kernel,
    "store_kv": kv_store._store_kv_kernel,
    "update_query_state": query_state._update_query_state_kernel,
}


def _native_specialize():
    from triton._C.libtriton import native_specialize_impl

    return native_specialize_impl


@attrs.frozen
class _Param:
    name: str
    constexpr: bool
    specialize: bool
    align: bool
    default: object


def _params(kernel) -> tuple[_Param, ...]:
    """The kernel's parameters with the specialization flags Triton applies to them."""
    cached = getattr(kernel, "_growpage_params", None)
    if cached is not None:
        return cached
    # JITFunction keeps the lists as attributes; InterpretedFunction in its constructor kwargs.
    options = getattr(kernel, "kwargs", {}) or {}
    no_spec = getattr(kernel, "do_not_specialize", None) or options.get("do_not_specialize") or ()
    no_align = (
        getattr(kernel, "do_not_specialize_on_alignment", None)
        or options.get("do_not_specialize_on_alignment")
        or ()
    )
    params = []
    for i, p in enumerate(inspect.signature(kernel.fn).parameters.values()):
        params.append(
            _Param(
                p.name,
                "constexpr" in str(p.annotation),
                not (i in no_spec or p.name in no_spec),
                not (i in no_align or p.name in no_align),
                p.default,
            )
        )
    kernel._growpage_params = tuple(params)
    return kernel._growpage_params


def specialization_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """The key Triton compiles ``kernel`` for when launched with ``args`` / ``kwargs``
    (constexpr values, argument types and divisibility / alignment flags, launch options)."""
    params = _params(kernel)
    specialize = _native_specialize()
    key = []
    for i, p in enumerate(params):
        if i < len(args):
            value = args[i]
        elif p.name in kwargs:
            value = kwargs[p.name]
        else:
            value = p.default
        if p.constexpr:
            key.append((p.name, "constexpr", value))
        else:
            key.append((p.name, *specialize(BaseBackend, value, False, p.specialize, p.align)))
    names = {p.name for p in params}
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in names))
    return tuple(key) + options


@attrs.define
class VariantLog:
    """Specialization keys seen per kernel name (``KERNELS``), in first-seen order."""

    keys: dict[str, list[tuple]] = attrs.field(factory=dict)
    launches: int = 0

    def add(self, name: str, key: tuple) -> None:
        self.launches += 1
        seen = self.keys.setdefault(name, [])
        if key not in seen:
            seen.append(key)

    def counts(self) -> dict[str, int]:
        return {name: len(keys) for name, keys in sorted(self.keys.items())}

    def new_since(self, before: VariantLog) -> dict[str, list[tuple]]:
        """Keys here that ``before`` did not have (what would compile after ``before``)."""
        out = {}
        for name, keys in self.keys.items():
            fresh = [k for k in keys if k not in before.keys.get(name, [])]
            if fresh:
                out[name] = fresh
        return out


def describe(key: tuple) -> str:
    """A key's varying parts in one line (constexpr values and specialized arguments)."""
    parts = []
    for item in key:
        if len(item) == 3 and item[1] == "constexpr":
            parts.append(f"{item[0]}={item[2]}")
        elif len(item) == 3 and item[2]:
            parts.append(f"{item[0]}:{item[1]}[{item[2]}]")
        elif len(item) == 2:
            parts.append(f"{item[0]}={item[1]}")
    return ", ".join(parts)


@contextlib.contextmanager
def record_variants(log: VariantLog | None = None) -> Iterator[VariantLog]:
    """Record the specialization key of every kernel launch inside the block.

    Wraps the kernels' ``run`` on the instances (restored on exit); ``warmup=True`` calls of
    Triton's ``kernel.warmup`` are recorded too, since they compile.
    """
    log = log if log is not None else VariantLog()
    patched = []
    for name, kernel in KERNELS.items():
        outer = kernel.__dict__.get("run")  # an enclosing recorder's wrapper, if any
        original = kernel.run

        def run(*args, _name=name, _kernel=kernel, _original=original, grid, warmup, **kwargs):
            log.add(_name, specialization_key(_kernel, args, kwargs))
            return _original(*args, grid=grid, warmup=warmup, **kwargs)

        kernel.run = run  # instance attribute: ``kernel[grid](...)`` looks it up here
        patched.append((kernel, outer))
    try:
        yield log
    finally:
        for kernel, outer in patched:
            if outer is None:
                del kernel.run
            else:
                kernel.run = outer


@contextlib.contextmanager
def stubbed_launches() -> Iterator[None]:
    """Every launch of ``KERNELS`` is a no-op inside the block (the wrappers still run): for
    timing the host's part of a launch path on any machine. Restored on exit."""
    for kernel in KERNELS.values():
        kernel.run = lambda *args, grid, warmup, **kwargs: None
    try:
        yield
    finally:
        for kernel in KERNELS.values():
            del kernel.run


def compiled_variants() -> dict[str, int]:
    """On CUDA: binaries each kernel holds in Triton's in-memory cache, summed over devices
    (an empty dict under the interpreter, which compiles nothing)."""
    out = {}
    for name, kernel in KERNELS.items():
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            return {}
        out[name] = sum(len(entry[0]) for entry in caches.values())
    return out
