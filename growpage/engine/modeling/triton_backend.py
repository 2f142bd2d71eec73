"""Attention backend on the Triton kernels of ``growpage.kernels`` (the GPU path).

* store_kv: ``growpage.kernels.store_kv`` (slot ``-1`` skipped).
* decode: ``growpage.kernels.paged_decode_attention`` over the layer's views
  ``layer_cache[0], layer_cache[1]`` ``[num_pages, page_size, Hkv, d]`` with
  ``ctx.block_tables`` / ``ctx.context_lens``: GQA in one program per KV head, split-K,
  fp32 accumulation, static launch shapes.
* prefill: delegated to ``TorchAttentionBackend.prefill`` (torch SDPA). Prefill is
  compute-bound, and SDPA dispatches to a fused attention kernel on GPU, so a hand-written
  Triton prefill would buy little; decode is memory-bound and is where paging costs.

Optional fused EMA: when the step context carries ``query_state`` (a
``growpage.engine.modeling.backends.QueryStateFusion``; read with ``getattr``, default None),
decode also updates that layer's query summaries in the same launch. See docs/kernels.md.

Optional H2O sums: when the step context carries ``accumulation``, decode launches
``growpage.kernels.accumulate_attention`` after attention (it recomputes each row's
log-sum-exp); prefill adds them in torch, as the torch backend does.

NOTE: importing this module imports ``growpage.kernels``, which turns on Triton's CPU
interpreter (``TRITON_INTERPRET=1``) on a machine without CUDA; the backend then runs on CPU
tensors (slowly: tests and tiny models only).
"""

from __future__ import annotations

import torch

from growpage.engine.modeling.attention import AttentionBackend, TorchAttentionBackend
from growpage.engine.modeling.backends import QueryStateFusion
from growpage.engine.modeling.step_context import StepContext
from growpage.kernels import accumulate_attention, paged_decode_attention, store_kv


class TritonAttentionBackend(AttentionBackend):
    """Triton store and decode kernels; torch SDPA for prefill.

    Args:
        num_splits: split-K factor of decode attention; None = from static shapes (batch,
            KV heads, block-table width, SM count), which keeps CUDA-graph launches static.
        block_n: context tile of decode attention; None = kernel default (64 GPU, 16 CPU).
    """

    name = "triton"
    fuses_query_state = True

    def __init__(self, num_splits: int | None = None, block_n: int | None = None) -> None:
        self.num_splits = num_splits
        self.block_n = block_n
        self._prefill = TorchAttentionBackend()

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        store_kv(k, v, layer_cache[0], layer_cache[1], slot_mapping)

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor | None,
        ctx: StepContext,
        scale: float,
    ) -> torch.Tensor:
        return self._prefill.prefill(q, k, v, layer_cache, ctx, scale)

    def decode(
        self, q: torch.Tensor, layer_cache: torch.Tensor, ctx: StepContext, scale: float
    ) -> torch.Tensor:
        assert ctx.block_tables is not None and ctx.context_lens is not None
        fusion: QueryStateFusion | None = getattr(ctx, "query_state", None)
        ema: dict = {}
        if fusion is not None:
            layer = fusion.layer_of(layer_cache)
            ema = dict(
                q_pre=fusion.pre_rope_query(ctx.capture, layer),
                query_state=fusion.pool[layer],
                slot_ids=fusion.slot_ids,
                is_first=fusion.is_first,
                beta_short=fusion.beta_short,
                beta_long=fusion.beta_long,
            )
        out = paged_decode_attention(
            q,
            layer_cache[0],
            layer_cache[1],
            ctx.block_tables,
            ctx.context_lens,
            scale,
            num_splits=self.num_splits,
            block_n=self.block_n,
            **ema,
        )
        if ctx.accumulation is not None:  # H2O sums: a second launch over the keys
            accumulate_attention(
                q,
                layer_cache[0],
                ctx.block_tables,
                ctx.context_lens,
                ctx.accumulation.layer(layer_cache),
                scale,
            )
        return out
