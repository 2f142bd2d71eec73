"""``PagedTorchBackend``: the engine's torch backend, with a faster decode path.

The reference ``TorchAttentionBackend.decode`` gathers every page of the block table for every
layer and runs two einsums. Here the per-step metadata (flat slot of each used position, the
additive padding mask, the store slots) is computed once per step and shared by all layers, only
the first ``max(context_lens)`` slots are gathered (one ``index_select`` each for keys and
values), and the attention itself is one fused SDPA call with the native GQA mapping::

    slots [B, S]  = block_tables[b, s // page] * page + s % page       S = max(context_lens)
    mask  [B, S]  = 0 where s < context_lens[b], else -inf
    k, v  [B, S, Hkv, d]    = layer_cache[0 / 1].view(slots, Hkv, d)[slots]

With ``ctx.accumulation`` (H2O sums) decode also computes the softmax weights explicitly from
the same gathered keys (SDPA does not return them) and adds them into the sums.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from growpage.engine.modeling.accumulation import DecodeIndex, add_decode, group_attention
from growpage.engine.modeling.attention import TorchAttentionBackend
from growpage.engine.modeling.step_context import StepContext


class PagedTorchBackend(TorchAttentionBackend):
    """Torch attention over the paged cache (CPU or GPU); prefill as the reference backend."""

    name = "torch"

    def __init__(self) -> None:
        self._ctx: StepContext | None = None
        self._slots = torch.empty(0, dtype=torch.long)
        self._mask = torch.empty(0)
        self._sums_index: DecodeIndex | None = None
        self._store_src: torch.Tensor | None = None
        self._store_slots = torch.empty(0, dtype=torch.long)
        self._store_keep: torch.Tensor | None = None
        # Decode's gathered keys and values (and their fp32 copies): kept from step to step.
        # NOTE: a fresh tensor of megabytes per layer and step costs page faults where the
        # allocator hands large blocks back to the system (the CPU engine at batch 256: 29
        # against 15 ms per step of a tiny model, 2026-12-06); values are the same either way.
        self._scratch: dict[str, torch.Tensor] = {}

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """As the reference, with the slot check done once per step (per ``slot_mapping``)."""
        if slot_mapping is not self._store_src:
            slots = slot_mapping.long()
            keep = slots >= 0
            self._store_keep = None if bool(keep.all()) else keep
            self._store_slots = slots if self._store_keep is None else slots[keep]
            self._store_src = slot_mapping
        if self._store_keep is not None:
            k, v = k[self._store_keep], v[self._store_keep]
        num_heads, head_dim = layer_cache.shape[-2:]
        for cache, new in ((layer_cache[0], k), (layer_cache[1], v)):
            cache.view(-1, num_heads, head_dim).index_copy_(
                0, self._store_slots, new.to(layer_cache.dtype)
            )

    def _metadata(
        self, ctx: StepContext, page_size: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat slots ``[B * S]`` and additive mask ``[B, 1, 1, S]`` of this step (cached)."""
        if ctx is not self._ctx or self._mask.dtype != dtype:
            assert ctx.block_tables is not None and ctx.context_lens is not None
            lens = ctx.context_lens.to(device)
            tables = ctx.block_tables.to(device).clamp(min=0).long()
            num_slots = max(int(lens.max()), 1)
            pos = torch.arange(num_slots, device=device)
            page_idx = (pos // page_size).expand(tables.shape[0], -1)
            slots = tables.gather(1, page_idx) * page_size + pos % page_size
            self._slots = slots.reshape(-1)
            padding = pos[None, :] >= lens[:, None]
            self._mask = torch.zeros(padding.shape, dtype=dtype, device=device).masked_fill_(
                padding, float("-inf")
            )[:, None, None, :]
            self._sums_index = None  # H2O sums: built on first use in the step
            self._ctx = ctx
        return self._slots, self._mask

    def _gather(
        self, name: str, rows: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """``rows.index_select(0, slots).to(dtype)``, written into scratch kept by ``name``."""
        out = self._buffer(name, (slots.numel(), *rows.shape[1:]), rows)
        torch.index_select(rows, 0, slots, out=out)
        if dtype == rows.dtype:
            return out
        converted = self._buffer(name + ".cast", tuple(out.shape), out, dtype)
        return converted.copy_(out)

    def _buffer(
        self,
        name: str,
        shape: tuple[int, ...],
        like: torch.Tensor,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """A ``shape`` view of the scratch ``name`` (grown by half again when too small)."""
        dtype = dtype or like.dtype
        need = math.prod(shape)
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < need or buf.dtype != dtype or buf.device != like.device:
            buf = torch.empty(need + need // 2, dtype=dtype, device=like.device)
            self._scratch[name] = buf
        return buf[:need].view(shape)

    def decode(
        self, q: torch.Tensor, layer_cache: torch.Tensor, ctx: StepContext, scale: float
    ) -> torch.Tensor:
        """``q [B, Hq, d]`` over each sequence's first ``context_lens[b]`` slots -> ``[B, Hq, d]``."""
        assert ctx.context_lens is not None
        _, _, page_size, num_kv_heads, head_dim = layer_cache.shape
        dtype = torch.float32 if q.device.type == "cpu" else q.dtype
        slots, mask = self._metadata(ctx, page_size, dtype, q.device)
        batch, num_q_heads, _ = q.shape
        num_slots = mask.shape[-1]
        k, v = (
            self._gather(name, layer_cache[i].view(-1, num_kv_heads, head_dim), slots, dtype)
            .view(batch, num_slots, num_kv_heads, head_dim)
            .transpose(1, 2)
            for i, name in enumerate(("k", "v"))
        )
        out = F.scaled_dot_product_attention(
            q.to(dtype).view(batch, num_q_heads, 1, head_dim),
            k,
            v,
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        if ctx.accumulation is not None:  # H2O sums: the weights again, explicitly
            if self._sums_index is None:
                self._sums_index = DecodeIndex.of(
                    slots.view(batch, num_slots), ctx.context_lens.to(q.device), num_kv_heads
                )
            weights = group_attention(
                q.view(batch, num_q_heads, 1, head_dim), k, scale, mask.float()[:, :, None]
            )  # [B, Hkv, 1, S]
            add_decode(ctx.accumulation.layer(layer_cache), weights, self._sums_index)
        return out.view(batch, num_q_heads, head_dim).to(q.dtype)
