"""Choosing an attention backend, and the per-step request to update the query summaries.

``make_attention_backend("auto", device)`` gives the Triton backend on CUDA and the torch
backend elsewhere. ``QueryStateFusion`` is the hook that turns on the EMA update of the
query-state pool (paper section 4.1) for one decode step::

    pool  [L, max_num_seqs, 2, Hq, d] fp32     2 = (short EMA, long EMA), pre-RoPE
    row b of the decode batch -> pool[layer, slot_ids[b]]   (slot -1: row skipped)

A backend with ``fuses_query_state = True`` (Triton) applies it inside decode attention when it
finds it on the step context (``ctx.query_state``), reading the pre-RoPE query the model records
into ``ctx.capture`` (a fresh ``StepCapture`` per step that records every layer). Other backends
ignore it: the runner updates the pool after the forward pass (``QueryStatePool.update``).
"""

from __future__ import annotations

import warnings

import attrs
import torch

from growpage.engine.modeling.accumulation import layer_index
from growpage.engine.modeling.attention import AttentionBackend
from growpage.engine.modeling.attention_torch import PagedTorchBackend
from growpage.engine.modeling.step_context import StepCapture
from growpage.errors import EngineError
from growpage.validators import in_range

BACKEND_NAMES = ("auto", "torch", "triton")
INTERPRETER_WARNING = (
    "attention_backend='triton' on the CPU runs Triton's interpreter "
    "(TRITON_INTERPRET=1): correct but tens of times slower than 'torch'; "
    "meant for tests"
)
BETA_SHORT = 0.9  # same defaults as growpage.kernels (not imported: that pulls in Triton)
BETA_LONG = 0.999


def _check_pool(instance: QueryStateFusion, attribute: attrs.Attribute, pool: torch.Tensor) -> None:
    if pool.dim() != 5 or pool.shape[2] != 2 or pool.dtype != torch.float32:
        raise EngineError(
            f"QueryStateFusion.pool must be fp32 [L, M, 2, Hq, d], got "
            f"{pool.dtype} {tuple(pool.shape)}"
        )


def _check_rows(instance: QueryStateFusion, attribute: attrs.Attribute, rows: torch.Tensor) -> None:
    if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64, torch.bool):
        raise EngineError(
            f"QueryStateFusion.{attribute.name} must be a 1-D int/bool tensor, "
            f"got {rows.dtype} {tuple(rows.shape)}"
        )


_BETA = in_range(0, 1, lo_open=True, hi_open=True).raising(EngineError)


@attrs.frozen
class QueryStateFusion:
    """Update the query summaries of one decode step (set as ``ctx.query_state``).

    Attributes:
        pool: ``[L, M, 2, Hq, d]`` fp32 query-state pool, updated in place.
        slot_ids: ``[B]`` int pool slot of each decode row; ``-1`` skips the row (padding).
        is_first: ``[B]`` bool/int; nonzero on a request's first decode step: both summaries
            are set to the query instead of blended (overwrites the slot's previous owner).
        kv_cache: ``[2, L, num_pages, page_size, Hkv, d]`` the cache bound to the model; a
            backend recognises layer ``i`` by its view ``kv_cache[:, i]``.
        beta_short, beta_long: EMA decay of the two summaries (Eq. 6).
    """

    pool: torch.Tensor = attrs.field(validator=_check_pool)
    slot_ids: torch.Tensor = attrs.field(validator=_check_rows)
    is_first: torch.Tensor = attrs.field(validator=_check_rows)
    kv_cache: torch.Tensor
    beta_short: float = attrs.field(default=BETA_SHORT, validator=_BETA)
    beta_long: float = attrs.field(default=BETA_LONG, validator=_BETA)

    def __attrs_post_init__(self) -> None:
        if self.slot_ids.shape != self.is_first.shape:
            raise EngineError(
                f"QueryStateFusion: slot_ids {tuple(self.slot_ids.shape)} and "
                f"is_first {tuple(self.is_first.shape)} differ"
            )
        if self.kv_cache.dim() != 6 or self.kv_cache.shape[1] != self.pool.shape[0]:
            raise EngineError(
                f"QueryStateFusion: kv_cache {tuple(self.kv_cache.shape)} does not "
                f"match the pool's {self.pool.shape[0]} layers"
            )

    def layer_of(self, layer_cache: torch.Tensor) -> int:
        """Index ``i`` such that ``layer_cache`` is ``kv_cache[:, i]``."""
        return layer_index(self.kv_cache, layer_cache)

    def pre_rope_query(self, capture: StepCapture | None, layer: int) -> torch.Tensor:
        """This step's pre-RoPE query ``[B, Hq, d]`` of ``layer``, as the model recorded it."""
        q_pre = None if capture is None else capture.queries.get(layer)
        if q_pre is None:
            raise EngineError(
                f"query-state update needs the pre-RoPE query of layer {layer}: "
                "set ctx.capture = StepCapture() (all layers) on decode steps"
            )
        if q_pre.shape[0] != self.slot_ids.shape[0]:
            raise EngineError(
                f"query-state update: {q_pre.shape[0]} queries in layer {layer} "
                f"for {self.slot_ids.shape[0]} slot ids (stale capture?)"
            )
        return q_pre


def make_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """The attention backend called ``name`` for a model on ``device``.

    Args:
        name: ``"torch"`` (plain torch, any device), ``"triton"`` (Triton kernels: CUDA, or CPU
            under ``TRITON_INTERPRET=1`` for tests) or ``"auto"`` (triton on CUDA, else torch).
        device: the device of the model and its KV cache.
    Raises:
        EngineError: unknown name or device, or Triton unusable on ``device``.
    """
    choice = name.strip().lower() if isinstance(name, str) else None
    if choice not in BACKEND_NAMES:
        raise EngineError(
            f"unknown attention backend {name!r}: expected one of "
            f"{', '.join(repr(n) for n in BACKEND_NAMES)}"
        )
    try:
        device = torch.device(device)
    except RuntimeError as exc:
        raise EngineError(f"attention backend: bad device {device!r} ({exc})") from exc
    if choice == "auto":
        choice = "triton" if device.type == "cuda" else "torch"
    if choice == "torch":
        return PagedTorchBackend()
    return _triton_backend(device)


def _triton_backend(device: torch.device) -> AttentionBackend:
    if device.type not in ("cuda", "cpu"):
        raise EngineError(
            f"the triton attention backend runs on cuda (or on cpu under "
            f"TRITON_INTERPRET=1), not on {device.type}"
        )
    try:
        from growpage.engine.modeling.triton_backend import TritonAttentionBackend
        from growpage.kernels._utils import is_interpreter
    except ImportError as exc:
        raise EngineError(f"the triton attention backend needs triton: {exc}") from exc
    if device.type == "cpu" and not is_interpreter():
        raise EngineError(
            "the triton attention backend on cpu needs TRITON_INTERPRET=1 (set "
            "before growpage.kernels is first imported); use 'torch' on cpu"
        )
    if device.type == "cpu":  # shown once per process by the default warning filter
        warnings.warn(INTERPRETER_WARNING, UserWarning, stacklevel=1)
    return TritonAttentionBackend()
