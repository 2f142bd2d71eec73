"""H2O accumulated attention in the engine: one fp32 sum per cache slot, beside the KV cache.

::

    sums  [L, num_pages * page_size, Hkv] fp32     allocated only for a policy that sets
                                                   ``needs_accumulated_attention``
    sums[l, slot, h] = sum, over every query the request holding ``slot`` has run since its
                       admission (prompt and decode), of that query's softmax weight on the
                       slot in layer l, averaged over the query heads of KV head h

This is the simulator's quantity (``TraceView.accumulate_until``). Every step adds its queries'
weights: prefill in torch (all backends), decode in torch or with the Triton kernel
``growpage.kernels.accumulate_attention`` (``ctx.accumulation`` asks for it). Attention is
causal, so a token's own query is the first to see its slot, in the step that stores it: that
step *sets* the slot's sum instead of adding to it, and a slot reused after a free, a preemption
or a compaction starts from zero without any clearing. Compaction moves the sums with their keys
and values (``EngineKVView.compact``).

NOTE: a slot belongs to one request. Prefix caching is off while sums are recorded: a shared
prompt page would mix two requests' sums, and a prefix hit would skip the prompt's queries.
"""

from __future__ import annotations

import attrs
import torch

from growpage.errors import EngineError

PREFILL_CHUNK = 256  # queries per softmax block in prefill: bounds the [n, Hq, c] temporary


def allocate_sums(
    num_layers: int, num_slots: int, num_kv_heads: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Zero-filled ``[L, num_slots, Hkv]`` fp32 sums."""
    return torch.zeros(num_layers, num_slots, num_kv_heads, dtype=torch.float32, device=device)


def sum_bytes(num_layers: int, page_size: int, num_kv_heads: int) -> int:
    """Bytes the sums take per page across all layers."""
    return 4 * num_layers * page_size * num_kv_heads


def layer_index(kv_cache: torch.Tensor, layer_cache: torch.Tensor) -> int:
    """Index ``i`` such that ``layer_cache`` is the view ``kv_cache[:, i]``."""
    offset = layer_cache.data_ptr() - kv_cache.data_ptr()
    layer, rest = divmod(offset, kv_cache.stride(1) * kv_cache.element_size())
    if (
        rest
        or not 0 <= layer < kv_cache.shape[1]
        or layer_cache.stride() != (kv_cache.stride(0), *kv_cache.stride()[2:])
    ):
        raise EngineError(
            "the layer cache is not a view kv_cache[:, i] of the step's kv_cache "
            "(bind the same cache to the model)"
        )
    return layer


@attrs.frozen
class AttentionAccumulation:
    """Add this step's attention into ``sums`` (set as ``ctx.accumulation``).

    Attributes:
        sums: ``[L, num_pages * page_size, Hkv]`` fp32, updated in place.
        kv_cache: ``[2, L, num_pages, page_size, Hkv, d]`` the cache bound to the model; a
            backend finds layer ``i`` from its view ``kv_cache[:, i]``.
    """

    sums: torch.Tensor
    kv_cache: torch.Tensor

    def __attrs_post_init__(self) -> None:
        _, layers, pages, page_size, heads, _ = self.kv_cache.shape
        if self.sums.dtype != torch.float32 or self.sums.shape != (
            layers,
            pages * page_size,
            heads,
        ):
            raise EngineError(
                f"AttentionAccumulation.sums must be fp32 "
                f"[{layers}, {pages * page_size}, {heads}], got "
                f"{self.sums.dtype} {tuple(self.sums.shape)}"
            )

    def layer(self, layer_cache: torch.Tensor) -> torch.Tensor:
        """The ``[num_slots, Hkv]`` sums of the layer whose cache view is ``layer_cache``."""
        return self.sums[layer_index(self.kv_cache, layer_cache)]


def table_slots(table: torch.Tensor, num_slots: int, page_size: int) -> torch.Tensor:
    """Flat cache slots ``[num_slots]`` (int64) of a block table row's slots ``0..n-1``."""
    idx = torch.arange(num_slots, device=table.device)
    return table.long()[idx // page_size] * page_size + idx % page_size


def group_attention(
    q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Softmax weights of ``q [..., Hq, n, d]`` over ``k [..., Hkv, S, d]``, averaged over
    each KV head's query heads: ``[..., Hkv, n, S]`` fp32. ``mask`` (additive, -inf = hidden)
    broadcasts against ``[..., Hkv, G, n, S]``."""
    *lead, num_q, n, d = q.shape
    num_kv, num_keys = k.shape[-3], k.shape[-2]
    group = num_q // num_kv
    qg = (q.float() * scale).reshape(*lead, num_kv, group * n, d)  # one batched GEMM per head
    logits = torch.matmul(qg, k.float().transpose(-1, -2)).view(*lead, num_kv, group, n, num_keys)
    if mask is not None:
        logits = logits + mask
    return logits.softmax(dim=-1).mean(dim=-3)


@attrs.frozen
class DecodeIndex:
    """Where a decode step's weights go, shared by all layers of the step.

    Attributes:
        flat: ``[B * Hkv * S]`` int64 index into ``sums[layer].view(-1)`` of each weight of
            ``[B, Hkv, S]`` (slot * Hkv + head).
        own: ``[B]`` int64 slot of each row's own token (its last context slot), set not added.
    """

    flat: torch.Tensor
    own: torch.Tensor

    @classmethod
    def of(cls, slots: torch.Tensor, context_lens: torch.Tensor, num_kv_heads: int) -> DecodeIndex:
        """From ``slots [B, S]`` (flat cache slot of each row's slot s, anything past the
        context) and ``context_lens [B]``."""
        heads = torch.arange(num_kv_heads, device=slots.device)
        flat = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).flatten()
        own = slots.gather(1, (context_lens.long() - 1)[:, None]).squeeze(1)
        return cls(flat, own)


def add_decode(sums: torch.Tensor, weights: torch.Tensor, index: DecodeIndex) -> None:
    """Add ``weights [B, Hkv, S]`` into ``sums [num_slots, Hkv]``; each row's own slot is set.

    NOTE: entries past a row's context carry weight exactly 0, so their (padding) slots may
    point anywhere.
    """
    sums.index_fill_(0, index.own, 0.0)
    sums.view(-1).index_add_(0, index.flat, weights.flatten())


def prefill_sums(
    q: torch.Tensor, k: torch.Tensor, scale: float, chunk: int = PREFILL_CHUNK
) -> torch.Tensor:
    """Summed group-mean softmax weights ``[c, Hkv]`` of ``q [n, Hq, d]``, the queries of the
    last n of ``k [c, Hkv, d]``'s slots (causal: query i sees slots ``0..c-n+i``)."""
    n, c = q.shape[0], k.shape[0]
    kt = k.transpose(0, 1)  # [Hkv, c, d]
    total = torch.zeros(k.shape[1], c, dtype=torch.float32, device=k.device)
    cols = torch.arange(c, device=k.device)
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        rows = torch.arange(c - n + lo, c - n + hi, device=k.device)
        hidden = torch.zeros(hi - lo, c, device=k.device).masked_fill_(
            cols[None, :] > rows[:, None], float("-inf")
        )
        total += group_attention(q[lo:hi].transpose(0, 1), kt, scale, hidden).sum(dim=1)
    return total.T


def add_prefill(
    sums: torch.Tensor, q: torch.Tensor, k: torch.Tensor, slots: torch.Tensor, scale: float
) -> None:
    """Add one sequence's prefill chunk: ``q [n, Hq, d]`` over ``k [c, Hkv, d]`` held in
    ``slots [c]``; the chunk's own n slots are set, the c - n before them added to."""
    total = prefill_sums(q, k, scale)
    old = k.shape[0] - q.shape[0]
    slots = slots.long()
    sums.index_add_(0, slots[:old], total[:old])
    sums.index_copy_(0, slots[old:], total[old:])


def gather_sums(sums: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``[L, Hkv, N]`` sums of a request's slots ``[N]`` (flat cache slots, in slot order)."""
    return sums[:, slots].transpose(1, 2)
