"""``EngineConfig``: the settings of one engine instance (attrs, validated)."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np
import torch

from growpage._argtypes import positive_int as positive_arg
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
#: What ``dtype=None`` or ``"auto"`` means: bfloat16 weights and KV on CUDA (the greedy tokens
#: agree with float32 wherever float32's best token leads by more than bf16 can blur:
#: tests/engine/test_engine_cuda_bf16.py), float32 on the CPU, where bf16 matmuls are slower.
AUTO_DTYPES = {"cuda": torch.bfloat16, "cpu": torch.float32}
DEFAULT_KV_CACHE_MEMORY = 512 * 2**20  # bytes, when neither kv_pages nor a budget is given


def _to_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    # None / "auto": decided by the device in EngineConfig.__attrs_post_init__.
    if value is None or value == "auto":
        return None
    if isinstance(value, torch.dtype):
        if value not in (*DTYPES.values(), torch.float64):
            raise ConfigError(
                f"EngineConfig.dtype: {value} is not supported (one of "
                "torch.float32, torch.bfloat16, torch.float16, torch.float64)"
            )
        return value
    if not isinstance(value, str) or value not in DTYPES:
        raise ConfigError(
            f"EngineConfig.dtype: unknown dtype {value!r} (one of auto, {', '.join(DTYPES)})"
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


def _help(text: str, **flag: Any) -> dict[str, Any]:
    """attrs metadata of an engine setting: its one-line ``help`` (the ``growpage`` flag's, and
    ``LLM``'s docstring's) and the ``flag`` options its type does not give (``type``,
    ``choices``; ``name``: a flag name other than the field's; ``default``: the commands'
    default where it differs from the field's), read by ``growpage.engine.cli_flags.add_engine_flags``."""
    return {"help": text, "flag": flag}


def _device_name(value: object) -> str:
    return resolve_device(str(value))


def _path_text(value: object) -> str | None:
    return None if value is None else str(value)


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Settings of one engine: ``growpage`` (capacity control; ``page_size`` is the KV page
    size b) and the engine settings, each field with its one-line help in its metadata
    (``settings_help()`` lists them). ``LLM`` takes each setting as a keyword and the
    ``growpage`` commands as a flag; both take their defaults from here.

    NOTE: ``cuda_graphs`` needs CUDA and the Triton backend, and no trace recording; True
    where it cannot run is a ``ConfigError``. ``async_compaction``: a request whose boundary
    is decided as a compression sits that decode step out and compresses beside it on a side
    CUDA stream, then rejoins with the tokens the synchronous path gives (paper E.3); by
    default with CUDA graphs, whose replay leaves the host free while the forward runs (without
    graphs the H200 check measured no gain). ``resolved`` turns both Nones into True or False.
    ``async_decisions`` (beyond the paper, which decides synchronously): the whole boundary of
    a request, decision included, runs beside the forward while the request sits the step out;
    its decision is the synchronous one (same inputs), one step later. Only where no outcome can
    need a preemption: a policy that falls back to compressing, and no shared page to copy.
    ``attention_backend="triton"`` and ``boundary_kernels=True`` run on the CPU only under
    ``TRITON_INTERPRET=1`` (slow: tests, ``benchmarks/boundary_ops.py``).
    """

    growpage: GrowPageConfig = attrs.field(factory=GrowPageConfig)
    kv_pages: int | None = attrs.field(
        default=None,
        validator=optional(positive_int),
        metadata=_help(
            "pages in the KV cache (default: as many as kv_cache_memory holds)", type=positive_arg
        ),
    )
    kv_cache_memory: int | None = attrs.field(
        default=None,
        validator=optional(positive_int),
        metadata=_help(
            "bytes for the KV cache, instead of kv_pages (default: 512 MiB)", type=positive_arg
        ),
    )
    max_num_seqs: int = attrs.field(
        default=64,
        validator=positive_int,
        metadata=_help(
            "most requests running at once (also the query-state slots)", type=positive_arg
        ),
    )
    max_num_batched_tokens: int = attrs.field(
        default=4096,
        validator=positive_int,
        metadata=_help(
            "prompt tokens per prefill step; longer prompts prefill in chunks", type=positive_arg
        ),
    )
    enable_prefix_caching: bool = attrs.field(
        default=True,
        converter=_plain_bool,
        validator=flag,
        metadata=_help(
            "share full prompt pages between requests (off when recording, or for a policy "
            "that reads H2O accumulated attention)",
            name="prefix-caching",
        ),
    )
    dtype: torch.dtype = attrs.field(
        default=None,
        converter=_to_dtype,
        metadata=_help(
            "dtype of the model weights and the KV cache (default auto: bfloat16 on CUDA, "
            "float32 on the CPU)",
            choices=("auto", *DTYPES),
        ),
    )
    device: str = attrs.field(
        default="cpu",
        converter=_device_name,
        # The commands run on the GPU torch sees; LLM and EngineConfig stay on the CPU.
        metadata=_help(
            "'cpu', 'cuda', 'cuda:N', or 'auto': cuda when torch sees a GPU",
            type=resolve_device,
            default="auto",
        ),
    )
    attention_backend: str = attrs.field(
        default="auto",
        validator=one_of(BACKENDS),
        metadata=_help("auto: Triton on CUDA, torch elsewhere", choices=BACKENDS),
    )
    boundary_kernels: bool | None = attrs.field(
        default=None,
        converter=_plain_bool,
        validator=_FLAG_OR_AUTO,
        metadata=_help(
            "demand estimation and compaction at capacity boundaries with the Triton kernels "
            "(default: on CUDA)"
        ),
    )
    warmup: bool | None = attrs.field(
        default=None,
        converter=_plain_bool,
        validator=_FLAG_OR_AUTO,
        metadata=_help(
            "launch every Triton kernel variant once when the engine is built, so no compile "
            "stalls a step (growpage.engine.loop.warmup; default: when Triton runs on CUDA)"
        ),
    )
    cuda_graphs: bool | None = attrs.field(
        default=None,
        converter=_plain_bool,
        validator=_FLAG_OR_AUTO,
        metadata=_help(
            "replay decode steps as CUDA graphs (default: on CUDA with the Triton backend, "
            "when not recording)"
        ),
    )
    async_compaction: bool | None = attrs.field(
        default=None,
        converter=_plain_bool,
        validator=_FLAG_OR_AUTO,
        metadata=_help("compress beside the decode step (paper E.3; default: with CUDA graphs)"),
    )
    async_decisions: bool = attrs.field(
        default=False,
        converter=_plain_bool,
        validator=flag,
        metadata=_help("decide whole boundaries beside the decode step (beyond the paper)"),
    )
    record_traces: str | None = attrs.field(
        default=None,
        converter=_path_text,
        metadata=_help("trace-set directory to record every finished request into (fullkv)"),
    )
    record_layers: tuple[int, ...] | None = attrs.field(
        default=None, converter=_layers, metadata=_help("model layers to record (default: all)")
    )
    record_values: bool = attrs.field(
        default=True,
        converter=_plain_bool,
        validator=flag,
        metadata=_help("record the values too (has_values)"),
    )
    seed: int = attrs.field(
        default=0,
        validator=_SEED,
        metadata=_help(
            "seed of the engine's sampling generator (requests without their own)", type=int
        ),
    )

    @device.validator
    def _device(self, attribute: attrs.Attribute, value: str) -> None:
        check_device(value)

    def __attrs_post_init__(self) -> None:
        if self.dtype is None:  # None or "auto": the device's default
            auto = AUTO_DTYPES.get(torch.device(self.device).type, torch.float32)
            object.__setattr__(self, "dtype", auto)
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
        if self.record_layers is not None and self.record_traces is None:
            raise ConfigError(
                f"EngineConfig.record_layers ({list(self.record_layers)}) picks the layers that "
                "record_traces records: give record_traces too"
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


#: The engine settings: every ``EngineConfig`` field but ``growpage`` (whose fields ``LLM``
#: takes as keywords of their own).
SETTINGS: tuple[attrs.Attribute, ...] = tuple(
    f for f in attrs.fields(EngineConfig) if f.name != "growpage"
)


def settings_help(indent: str = "    ") -> str:
    """One line per engine setting: ``name (default): help``."""
    return "\n".join(f"{indent}{f.name} ({f.default!r}): {f.metadata['help']}" for f in SETTINGS)
