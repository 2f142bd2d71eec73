"""``EngineConfig``: the settings of one engine instance (attrs, validated)."""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import attrs
import numpy as np
import torch

from growpage.core.config import GrowPageConfig
from growpage.engine.sampling_params import SEED_RANGE
from growpage.errors import ConfigError
from growpage.validators import Check, flag, is_int, one_of, optional, positive_int

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
BACKENDS = ("auto", "torch", "triton")
DEFAULT_KV_CACHE_MEMORY = 512 * 2**20  # bytes, when neither kv_pages nor a budget is given


def _to_dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value not in (*DTYPES.values(), torch.float64):
            raise ConfigError(
                f"EngineConfig.dtype: {value} is not supported (one of "
                "torch.float32, torch.bfloat16, torch.float16, torch.float64)"
            )
        return value
    if not isinstance(value, str) or value not in DTYPES:
        raise ConfigError(
            f"EngineConfig.dtype: unknown dtype {value!r} (one of {', '.join(DTYPES)})"
        )
    return DTYPES[value]


def resolve_device(name: str) -> str:
    """``"auto"`` is ``"cuda"`` when torch sees a GPU, else ``"cpu"``; other names unchanged."""
    if name != "auto":
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(value: str) -> torch.device:
    """``value`` as a ``torch.device`` the engine can run on (cpu, or a CUDA device that torch
    sees); ``ConfigError`` naming the problem otherwise."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(
            f"EngineConfig.device: {value!r} is not a torch device (use 'cpu', 'cuda' or 'cuda:N')"
        ) from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"EngineConfig.device: {value!r} is not supported (the engine runs "
            "on 'cpu' or 'cuda[:N]')"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "no visible GPU"
            raise ConfigError(
                f"EngineConfig.device: {value!r} asked for, but torch sees no "
                f"CUDA device ({build}; torch {torch.__version__})"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(
                f"EngineConfig.device: {value!r} asked for, but torch sees {count} CUDA device(s)"
            )
    return device


def plural(num: int, noun: str) -> str:
    """``"1 page"``, ``"3 pages"``."""
    return f"{num} {noun}" if num == 1 else f"{num} {noun}s"


def _layers(value: Iterable[int] | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    items = (
        None if isinstance(value, (str, bytes)) or not isinstance(value, Iterable) else list(value)
    )  # once: a generator is read here only
    if items is None or not all(
        isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in items
    ):
        raise ConfigError(
            f"EngineConfig.record_layers must be a list of layer indices or None, got {value!r:.80}"
        )
    return tuple(sorted({int(i) for i in items}))


def _plain_bool(value: object) -> object:
    """A numpy bool as a Python bool (anything else is left for the validator)."""
    return bool(value) if isinstance(value, np.bool_) else value


_FLAG_OR_AUTO = Check("True, False or None (automatic)", optional(flag).accepts)
_SEED = Check(
    "an integer in [-2**63, 2**64)", lambda v: is_int(v) and SEED_RANGE[0] <= v < SEED_RANGE[1]
)


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Settings of one engine.

    Attributes:
        growpage: capacity-control settings (``page_size`` is the KV page size b).
        kv_pages: pages in the KV cache; None sizes it from ``kv_cache_memory``.
        kv_cache_memory: bytes for the KV cache, instead of ``kv_pages`` (default, when neither is
            given: 512 MiB); giving both is a ``ConfigError``.
        max_num_seqs: most requests resident (running) at once; also the query-state slots.
        max_num_batched_tokens: prefill tokens per step; longer prompts prefill in chunks.
        enable_prefix_caching: share full prompt pages across requests (PagePool hash table).
        dtype: model weights and KV cache dtype.
        device: torch device of the model and the cache.
        attention_backend: ``"auto"`` (Triton on CUDA, torch otherwise), ``"torch"`` or
            ``"triton"`` (on CPU only under ``TRITON_INTERPRET=1``: slow, for tests).
        boundary_kernels: run demand estimation and compaction at capacity boundaries with the
            Triton kernels; None (default) = on CUDA. True on CPU needs the interpreter (tests,
            ``benchmarks/boundary_ops.py``).
        warmup: launch every Triton kernel variant the engine can need once when it is built
            (``growpage.engine.warmup``), so no compile stalls a step while serving; None
            (default) = when a Triton path runs on CUDA.
        cuda_graphs: replay decode steps as CUDA graphs, one per batch-size bucket
            (``growpage.engine.cuda_graphs``); needs CUDA and the Triton backend, and no
            trace recording. None (default) = wherever it can run: on CUDA with the Triton
            backend (``"auto"`` picks it there) and without trace recording. True where it
            cannot run is a ``ConfigError``.
        async_compaction: a request whose boundary is decided as a compression sits that
            decode step out and compresses beside it, on a side CUDA stream, then rejoins
            (paper appendix E.3; ``growpage.engine.scheduler``). The tokens are the ones the
            synchronous path gives. None (default) = with CUDA graphs: the overlap needs the
            host free while the forward runs, which graph replay gives (without graphs the
            H200 check measured no gain); on the CPU there is nothing to overlap.
            ``resolved`` turns both Nones into True or False.
        async_decisions: beyond the paper, which decides synchronously: a request at a
            boundary its policy decides sits that decode step out, and the whole boundary,
            decision included, runs beside the forward (as ``async_compaction`` runs a
            compression), so with CUDA graphs nothing of it is left on the step's critical
            path; the request's decision is the one it would get synchronously (same inputs),
            one step later. Only where no outcome can need a preemption: a policy that falls
            back to compressing, and no shared (prefix-cached) page to copy. Off by default.
        record_traces: directory of a trace set to record every finished request into.
        record_layers: model layers to record (None: all).
        record_values: record the values too (``has_values``).
        seed: seed of the engine's sampling RNG (requests without their own seed).
    """

    growpage: GrowPageConfig = attrs.field(factory=GrowPageConfig)
    kv_pages: int | None = attrs.field(default=None, validator=optional(positive_int))
    kv_cache_memory: int | None = attrs.field(default=None, validator=optional(positive_int))
    max_num_seqs: int = attrs.field(default=64, validator=positive_int)
    max_num_batched_tokens: int = attrs.field(default=4096, validator=positive_int)
    enable_prefix_caching: bool = attrs.field(default=True, converter=_plain_bool, validator=flag)
    dtype: torch.dtype = attrs.field(default=torch.float32, converter=_to_dtype)
    device: str = attrs.field(default="cpu", converter=str)
    attention_backend: str = attrs.field(default="auto", validator=one_of(BACKENDS))
    boundary_kernels: bool | None = attrs.field(
        default=None, converter=_plain_bool, validator=_FLAG_OR_AUTO
    )
    warmup: bool | None = attrs.field(default=None, converter=_plain_bool, validator=_FLAG_OR_AUTO)
    cuda_graphs: bool | None = attrs.field(
        default=None, converter=_plain_bool, validator=_FLAG_OR_AUTO
    )
    async_compaction: bool | None = attrs.field(
        default=None, converter=_plain_bool, validator=_FLAG_OR_AUTO
    )
    async_decisions: bool = attrs.field(default=False, converter=_plain_bool, validator=flag)
    record_traces: str | None = None
    record_layers: tuple[int, ...] | None = attrs.field(default=None, converter=_layers)
    record_values: bool = attrs.field(default=True, converter=_plain_bool, validator=flag)
    seed: int = attrs.field(default=0, validator=_SEED)

    @device.validator
    def _device(self, attribute: attrs.Attribute, value: str) -> None:
        check_device(value)

    def __attrs_post_init__(self) -> None:
        # NOTE: every request grows to min_capacity pages before its policy may compress.
        least = self.growpage.min_capacity
        if self.kv_pages is not None and self.kv_cache_memory is not None:
            raise ConfigError(
                f"EngineConfig: give kv_pages ({self.kv_pages}) or "
                f"kv_cache_memory ({self.kv_cache_memory} bytes), not both: they "
                "are two ways to size the same KV cache"
            )
        if self.kv_pages is not None and self.kv_pages < least:
            raise ConfigError(
                f"EngineConfig.kv_pages: {plural(self.kv_pages, 'page')} cannot "
                f"hold one request, which grows to min_capacity = {least} pages "
                f"before its policy may compress; give at least {least}"
            )
        if self.cuda_graphs:
            self._check_cuda_graphs()

    def _check_cuda_graphs(self) -> None:
        """What ``LLMEngine`` would refuse after loading the model, refused before it."""
        if torch.device(self.device).type != "cuda" or self.attention_backend == "torch":
            raise ConfigError(
                f"EngineConfig.cuda_graphs needs a CUDA device and "
                f"attention_backend='triton' (device {self.device!r}, backend "
                f"{self.attention_backend!r})"
            )
        if self.record_traces is not None:
            raise ConfigError(
                "EngineConfig.cuda_graphs cannot record traces (the recorder "
                "reads each step's keys and values); turn one of them off"
            )

    def resolved(self, graphs_can_run: bool) -> EngineConfig:
        """This config with ``cuda_graphs`` and ``async_compaction`` decided (True or False):
        each None becomes its default, CUDA graphs where ``graphs_can_run`` (the engine knows:
        CUDA, the Triton backend, no trace recording) and asynchronous compaction with them."""
        graphs = graphs_can_run if self.cuda_graphs is None else self.cuda_graphs
        deferred = graphs if self.async_compaction is None else self.async_compaction
        if (graphs, deferred) == (self.cuda_graphs, self.async_compaction):
            return self
        return attrs.evolve(self, cuda_graphs=graphs, async_compaction=deferred)

    @property
    def page_size(self) -> int:
        return self.growpage.page_size

    def num_pages_for(self, bytes_per_page: int) -> int:
        """Pages of the KV cache: ``kv_pages`` or as many as fit in the memory budget."""
        if self.kv_pages is not None:
            return self.kv_pages
        budget = self.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
        pages = budget // bytes_per_page
        least = self.growpage.min_capacity
        if pages < least:
            raise ConfigError(
                f"EngineConfig.kv_cache_memory: {budget} bytes hold "
                f"{plural(pages, 'page')} of {bytes_per_page} bytes; need at least "
                f"min_capacity = {least}"
            )
        return int(pages)
