"""Attention backends over a paged KV cache, and the cache tensor itself.

The cache is one tensor allocated once; layer ``i`` works on the view ``cache[:, i]``::

    cache  [2, L, num_pages, page_size, Hkv, d]      2 = (key, value); keys are post-RoPE
    layer  [2,    num_pages, page_size, Hkv, d]
    slot   = page * page_size + offset               (flat index into num_pages * page_size)

    block_tables[b] = [ 7 | 2 | 9 | -1 ... ]   the pages of sequence b, in slot order
    slot order:         0..b-1 | b..2b-1 | ...  only the first context_lens[b] slots are valid

NOTE: attention runs over slot order, never over positions: positions are baked into the
post-RoPE keys. After a GrowPage compaction each (layer, KV head) holds a different subset of
tokens in its slots, but the same count, so ``context_lens`` stays the one length per sequence.
"""

from __future__ import annotations

import abc
from pathlib import Path

import torch
import torch.nn.functional as F

from growpage.core.host_memory import available_memory
from growpage.engine.modeling.accumulation import DecodeIndex, add_decode, add_prefill, table_slots
from growpage.engine.modeling.step_context import StepContext
from growpage.errors import EngineError


def allocate_kv_cache(
    num_layers: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Zero-filled cache ``[2, num_layers, num_pages, page_size, num_kv_heads, head_dim]``;
    ``EngineError`` saying how many bytes were asked when the device cannot hold it."""
    shape = (2, num_layers, num_pages, page_size, num_kv_heads, head_dim)
    try:
        return torch.zeros(shape, dtype=dtype, device=device)
    except RuntimeError as exc:  # torch.OutOfMemoryError included
        num_bytes = num_pages * kv_cache_bytes(num_layers, page_size, num_kv_heads, head_dim, dtype)
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise EngineError(
            f"cannot allocate the KV cache: {_size(num_bytes)} for {num_pages} "
            f"pages on {device} ({reason}); lower kv_pages or kv_cache_memory"
        ) from None


def check_kv_cache_fits(
    num_bytes: int, num_pages: int, device: torch.device | str, root: str | Path = "/"
) -> None:
    """``EngineError`` naming the limit hit when a cache of ``num_bytes`` is more than the
    host's available memory or the room left under its cgroup (container) memory limit
    (``growpage.core.host_memory``; ``root`` lets a test give a fake /proc and /sys).

    NOTE: on the CPU a cache larger than the free memory may still be granted (overcommit), and
    zero-filling it then gets the process killed, so it is refused before it is allocated.
    """
    if torch.device(device).type != "cpu":
        return
    available = available_memory(root)
    if available is not None and num_bytes > available.num_bytes:
        raise EngineError(
            f"the KV cache would take {_size(num_bytes)} for {num_pages} pages, "
            f"but the host has {_size(available.num_bytes)} available "
            f"({available.source}); lower kv_pages or kv_cache_memory"
        )


def _size(num_bytes: int) -> str:
    return f"{num_bytes} bytes ({num_bytes / 2**30:.2f} GiB)"


def kv_cache_bytes(
    num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one page takes across all layers (keys and values)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * page_size * num_kv_heads * head_dim * itemsize


def gather_pages(
    layer_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of each sequence in slot order.

    Args:
        layer_cache: ``[2, num_pages, page_size, Hkv, d]``.
        block_tables: ``[B, max_pages]`` page ids, ``-1`` padded (padding reads page 0; mask it).
    Returns:
        ``k, v`` each ``[B, max_pages * page_size, Hkv, d]``.
    """
    pages = block_tables.clamp(min=0).long()
    batch, max_pages = pages.shape
    _, _, page_size, num_heads, head_dim = layer_cache.shape
    k = layer_cache[0][pages].reshape(batch, max_pages * page_size, num_heads, head_dim)
    v = layer_cache[1][pages].reshape(batch, max_pages * page_size, num_heads, head_dim)
    return k, v


class AttentionBackend(abc.ABC):
    """Stores a step's new keys/values in the paged cache and computes attention.

    A backend is stateless between steps; the cache views and the metadata come in with each
    call. ``scale`` is the softmax scale (``head_dim ** -0.5``). When ``ctx.accumulation`` is
    set, ``prefill`` and ``decode`` also add their attention weights into the H2O sums
    (``growpage.engine.modeling.accumulation``).
    """

    name: str = "abstract"
    #: Decode reads every sequence's KV padded to the longest in the batch, so a step costs
    #: about ``batch * longest context`` KV reads, not their sum (the simulator's cost models
    #: price it so with ``padded_kv``; ``growpage calibrate`` reads it).
    pads_decode: bool = False

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor | None,
        ctx: StepContext,
        scale: float,
    ) -> torch.Tensor:
        """Store ``k, v [T, Hkv, d]`` at ``ctx.slot_mapping`` and attend with ``q [T, Hq, d]``.

        Returns ``[T, Hq, d]`` in ``q``'s dtype.
        """
        if layer_cache is not None and ctx.slot_mapping is not None:
            self.store_kv(k, v, layer_cache, ctx.slot_mapping)
        if ctx.is_prefill:
            return self.prefill(q, k, v, layer_cache, ctx, scale)
        if layer_cache is None or ctx.block_tables is None:
            raise RuntimeError("decode needs a bound KV cache and block tables")
        return self.decode(q, layer_cache, ctx, scale)

    @abc.abstractmethod
    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write ``k, v [T, Hkv, d]`` into ``layer_cache`` at flat slots ``[T]`` (-1 skipped)."""

    @abc.abstractmethod
    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor | None,
        ctx: StepContext,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of each sequence's new tokens over its slots.

        Without ``ctx.block_tables`` the keys are the new ``k, v`` only; with them, each
        sequence attends to the first ``context_lens[b]`` slots of its pages (cached prefix
        followed by its new tokens, already stored). ``q [T, Hq, d] -> [T, Hq, d]``.
        """

    @abc.abstractmethod
    def decode(
        self, q: torch.Tensor, layer_cache: torch.Tensor, ctx: StepContext, scale: float
    ) -> torch.Tensor:
        """One query per sequence over its first ``context_lens[b]`` slots.

        ``q [B, Hq, d] -> [B, Hq, d]``.
        """


class TorchAttentionBackend(AttentionBackend):
    """Reference backend in plain torch (CPU or GPU); softmax in fp32."""

    name = "torch"
    pads_decode = True  # gathers whole block tables; the paged backend, up to the longest

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        num_heads, head_dim = layer_cache.shape[-2:]
        slots = slot_mapping.long()
        keep = slots >= 0
        if not bool(keep.all()):
            slots, k, v = slots[keep], k[keep], v[keep]
        layer_cache[0].view(-1, num_heads, head_dim).index_copy_(0, slots, k.to(layer_cache.dtype))
        layer_cache[1].view(-1, num_heads, head_dim).index_copy_(0, slots, v.to(layer_cache.dtype))

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor | None,
        ctx: StepContext,
        scale: float,
    ) -> torch.Tensor:
        assert ctx.cu_seqlens_q is not None and ctx.context_lens is not None
        cached: tuple[torch.Tensor, torch.Tensor] | None = None  # (layer cache, block tables)
        if ctx.block_tables is not None:
            if layer_cache is None:
                raise RuntimeError("prefill over cached pages needs a bound KV cache")
            cached = layer_cache, ctx.block_tables
        bounds = ctx.cu_seqlens_q.tolist()
        ctx_lens = ctx.context_lens.tolist()
        accumulate: tuple[torch.Tensor, torch.Tensor] | None = None  # (H2O sums, slot mapping)
        if ctx.accumulation is not None:
            assert layer_cache is not None and ctx.slot_mapping is not None
            accumulate = ctx.accumulation.layer(layer_cache), ctx.slot_mapping
        out = torch.empty_like(q)
        for b in range(len(bounds) - 1):
            start, end = bounds[b], bounds[b + 1]
            if end == start:
                continue
            if cached is not None:
                kb, vb = gather_pages(cached[0], cached[1][b : b + 1])
                kb, vb = kb[0, : ctx_lens[b]], vb[0, : ctx_lens[b]]
            else:
                kb, vb = k[start:end], v[start:end]
            out[start:end] = _causal_attention(q[start:end], kb, vb, scale)
            if accumulate is not None:
                sums, slot_mapping = accumulate
                slots = (
                    table_slots(cached[1][b], ctx_lens[b], cached[0].shape[2])
                    if cached is not None
                    else slot_mapping[start:end]
                )
                add_prefill(sums, q[start:end], kb, slots, scale)
        return out

    def decode(
        self, q: torch.Tensor, layer_cache: torch.Tensor, ctx: StepContext, scale: float
    ) -> torch.Tensor:
        assert ctx.block_tables is not None and ctx.context_lens is not None
        k, v = gather_pages(layer_cache, ctx.block_tables)  # [B, S, Hkv, d]
        batch, num_q_heads, head_dim = q.shape
        num_kv_heads = k.shape[2]
        qg = q.float().view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
        scores = torch.einsum("bhgd,bshd->bhgs", qg, k.float()) * scale
        slot_idx = torch.arange(k.shape[1], device=q.device)
        invalid = slot_idx[None, :] >= ctx.context_lens.to(q.device)[:, None]  # [B, S]
        scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhgs,bshd->bhgd", probs, v.float())
        if ctx.accumulation is not None:
            page_size = layer_cache.shape[2]
            slots = torch.stack(
                [table_slots(t.clamp(min=0), k.shape[1], page_size) for t in ctx.block_tables]
            )
            index = DecodeIndex.of(slots, ctx.context_lens.to(q.device), num_kv_heads)
            add_decode(ctx.accumulation.layer(layer_cache), probs.mean(dim=2), index)
        return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q [n, Hq, d]`` over ``k, v [c, Hkv, d]`` (c >= n); the n queries are the last n slots."""
    n, c = q.shape[0], k.shape[0]
    qt = q.float().transpose(0, 1).unsqueeze(0)  # [1, Hq, n, d]
    kt = k.float().transpose(0, 1).unsqueeze(0)
    vt = v.float().transpose(0, 1).unsqueeze(0)
    if c == n:
        out = F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        rows = torch.arange(n, device=q.device)[:, None] + (c - n)
        mask = torch.arange(c, device=q.device)[None, :] <= rows  # [n, c], True = attend
        out = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True
        )
    return out[0].transpose(0, 1).to(q.dtype)
