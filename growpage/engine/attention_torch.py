"""``PagedTorchBackend``: the engine's torch backend, with a faster decode path.

The reference ``TorchAttentionBackend.decode`` gathers every page of the block table for every
layer and runs two einsums. Here the per-step metadata (flat slot of each used position, the
padding mask) is computed once per step and shared by all layers, only the first
``max(context_lens)`` slots are gathered (one ``index_select`` each for keys and values), and the
attention itself is one fused SDPA call with the native GQA mapping::

    slots [B, S]  = block_tables[b, s // page] * page + s % page       S = max(context_lens)
    mask  [B, S]  = s < context_lens[b]
    k, v  [B, S, Hkv, d]    = layer_cache[0 / 1].view(slots, Hkv, d)[slots]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from growpage.engine.attention import TorchAttentionBackend
from growpage.engine.context import StepContext


class PagedTorchBackend(TorchAttentionBackend):
    """Torch attention over the paged cache (CPU or GPU); prefill as the reference backend."""

    name = "torch"

    def __init__(self) -> None:
        self._ctx: StepContext | None = None
        self._slots = torch.empty(0, dtype=torch.long)
        self._mask = torch.empty(0, dtype=torch.bool)

    def _metadata(self, ctx: StepContext, page_size: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat slots ``[B * S]`` and mask ``[B, 1, 1, S]`` of this step (cached per step)."""
        if ctx is not self._ctx:
            assert ctx.block_tables is not None and ctx.context_lens is not None
            lens = ctx.context_lens.to(device)
            tables = ctx.block_tables.to(device).clamp(min=0).long()
            num_slots = max(int(lens.max()), 1)
            pos = torch.arange(num_slots, device=device)
            page_idx = (pos // page_size).expand(tables.shape[0], -1)
            slots = tables.gather(1, page_idx) * page_size + pos % page_size
            self._slots = slots.reshape(-1)
            self._mask = (pos[None, :] < lens[:, None])[:, None, None, :]
            self._ctx = ctx
        return self._slots, self._mask

    def decode(self, q: torch.Tensor, layer_cache: torch.Tensor, ctx: StepContext,
               scale: float) -> torch.Tensor:
        """``q [B, Hq, d]`` over each sequence's first ``context_lens[b]`` slots -> ``[B, Hq, d]``."""
        _, _, page_size, num_kv_heads, head_dim = layer_cache.shape
        slots, mask = self._metadata(ctx, page_size, q.device)
        batch, num_q_heads, _ = q.shape
        num_slots = mask.shape[-1]
        k, v = (layer_cache[i].view(-1, num_kv_heads, head_dim).index_select(0, slots)
                .view(batch, num_slots, num_kv_heads, head_dim).transpose(1, 2) for i in (0, 1))
        dtype = torch.float32 if q.device.type == "cpu" else q.dtype
        out = F.scaled_dot_product_attention(
            q.to(dtype).view(batch, num_q_heads, 1, head_dim), k.to(dtype), v.to(dtype),
            attn_mask=mask, scale=scale, enable_gqa=True)
        return out.view(batch, num_q_heads, head_dim).to(q.dtype)
