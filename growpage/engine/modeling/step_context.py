"""Per-step attention metadata, set by the model runner before a forward pass.

The model's ``forward(input_ids, positions)`` stays short: every attention layer reads what it
needs (slot mapping, block tables, sequence lengths) from the context of the current step.

Token layout of one step (``T`` new tokens of ``B`` sequences, packed back to back)::

    input_ids   [ s0 s0 s0 | s1 | s2 s2 ]      cu_seqlens_q = [0, 3, 4, 6]
    slot_mapping[ 17 18 19 | 40 | -1  8 ]      flat cache slot per token (page * page_size + offset)

``context_lens[b]`` counts the slots sequence ``b`` holds after this step's tokens are written
(cached prefix + new tokens); its new tokens occupy the last slots of its block table, in order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import attrs
import torch

if TYPE_CHECKING:
    from growpage.engine.modeling.accumulation import AttentionAccumulation


@attrs.define
class StepCapture:
    """Per-layer tensors recorded during a forward pass (query summaries, trace recording).

    ``layers=None`` records every layer. Each dict maps a layer index to a tensor over the
    step's new tokens: ``queries`` the pre-RoPE query (after q-norm where the model has one)
    ``[T, Hq, d]``; ``keys`` the post-RoPE key and ``values`` the value ``[T, Hkv, d]``.
    """

    layers: frozenset[int] | None = None
    record_kv: bool = False
    queries: dict[int, torch.Tensor] = attrs.field(factory=dict)
    keys: dict[int, torch.Tensor] = attrs.field(factory=dict)
    values: dict[int, torch.Tensor] = attrs.field(factory=dict)

    def wants(self, layer_idx: int) -> bool:
        return self.layers is None or layer_idx in self.layers

    def record(
        self, layer_idx: int, q_pre_rope: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        if not self.wants(layer_idx):
            return
        self.queries[layer_idx] = q_pre_rope.detach()
        if self.record_kv:
            self.keys[layer_idx] = k.detach()
            self.values[layer_idx] = v.detach()


@attrs.define
class StepContext:
    """Attention metadata of one forward pass.

    Attributes:
        is_prefill: prefill (any number of new tokens per sequence, causal) or decode
            (exactly one new token per sequence).
        slot_mapping: ``[T]`` int64, flat KV-cache slot of each new token; ``-1`` = not stored.
        context_lens: ``[B]`` int32/64, slots held by each sequence after this step.
        block_tables: ``[B, max_pages]`` int32/64 page ids, ``-1`` padded. Required for decode
            and for a prefill that attends to cached pages (prefix caching); ``None`` for a
            prefill whose keys are all new (attention then runs on the new tokens directly).
        cu_seqlens_q: ``[B + 1]`` cumulative new-token counts (prefill).
        max_seqlen_q / max_seqlen_k: largest new-token count / context length in the batch.
        capture: optional recorder of pre-RoPE queries (and keys/values) per layer.
        accumulation: optional request to add the step's attention into the H2O sums
            (``growpage.engine.modeling.accumulation``); None = nothing extra.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    capture: StepCapture | None = None
    accumulation: AttentionAccumulation | None = None

    @property
    def num_seqs(self) -> int:
        if self.cu_seqlens_q is not None:
            return self.cu_seqlens_q.numel() - 1
        assert self.context_lens is not None
        return self.context_lens.numel()

    def last_token_indices(self) -> torch.Tensor:
        """``[B]`` index of each sequence's last new token in the packed step (for logits)."""
        if not self.is_prefill:
            return torch.arange(self.num_seqs)
        assert self.cu_seqlens_q is not None
        return self.cu_seqlens_q[1:].long() - 1


def prefill_context(
    seq_lens: list[int],
    slot_mapping: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
    context_lens: list[int] | None = None,
    capture: StepCapture | None = None,
    accumulation: AttentionAccumulation | None = None,
) -> StepContext:
    """Build a prefill context for sequences of ``seq_lens`` new tokens.

    ``context_lens`` defaults to ``seq_lens`` (no cached prefix). Without ``slot_mapping`` the
    keys and values are not stored (no KV cache needed).
    """
    ctx_lens = list(seq_lens) if context_lens is None else list(context_lens)
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int64), 0)
    return StepContext(
        is_prefill=True,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        context_lens=torch.tensor(ctx_lens, dtype=torch.int64),
        cu_seqlens_q=cu,
        max_seqlen_q=max(seq_lens, default=0),
        max_seqlen_k=max(ctx_lens, default=0),
        capture=capture,
        accumulation=accumulation,
    )


def decode_context(
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    capture: StepCapture | None = None,
    max_seqlen_k: int | None = None,
    accumulation: AttentionAccumulation | None = None,
) -> StepContext:
    """Build a decode context: one new token per sequence, ``context_lens`` includes it.

    Pass ``max_seqlen_k`` when the lengths are known on the host: reading it from a device
    ``context_lens`` is a host sync.
    """
    if max_seqlen_k is None:
        max_seqlen_k = int(context_lens.max()) if context_lens.numel() else 0
    return StepContext(
        is_prefill=False,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        context_lens=context_lens,
        max_seqlen_q=1,
        max_seqlen_k=max_seqlen_k,
        capture=capture,
        accumulation=accumulation,
    )


_CONTEXT: StepContext | None = None


def set_context(ctx: StepContext) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def get_context() -> StepContext:
    """The context of the running step; a forward pass outside ``use_context`` is a bug."""
    if _CONTEXT is None:
        raise RuntimeError("no step context set: wrap the forward pass in use_context(ctx)")
    return _CONTEXT


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = None


@contextlib.contextmanager
def use_context(ctx: StepContext) -> Iterator[StepContext]:
    """``with use_context(ctx): model(input_ids, positions)``; the context is cleared after."""
    set_context(ctx)
    try:
        yield ctx
    finally:
        reset_context()
