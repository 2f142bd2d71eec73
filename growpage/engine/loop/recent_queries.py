"""``RecentQueryRing``: the last W queries of each running request (SnapKV's observation window).

::

    queries [L, M, W, Hq, d]  cache dtype   (M = max_num_seqs query-state slots)
    queries[l, slot, p % W] = pre-RoPE query (post q-norm) of position p of the request that
                              holds query-state slot ``slot``

Allocated only for a policy whose ``needs_recent_queries`` is W > 0. Every decode step writes
its rows (one indexed copy for all layers, after the forward, from the queries the step
captured for the query summaries), and every prefill chunk the last W of each sequence's new
tokens, so after any step the ring of a request holds the queries of its last W computed
positions. A slot is never cleared: a reader asks only for positions its request computed in
this residency, ``[max(t - W, num_cached_tokens), t)`` at a boundary whose current query is
token t - 1's; a prefix hit's cached tokens ran no query, a recompute after a preemption
refills the ring from its prefill.

The queries are kept as the model computed them before RoPE (the step capture's, exact in the
cache dtype) and rotated when read (``core.observation.rotate_queries``), as the simulator
rotates its trace's rows: both worlds score the same numbers.
"""

from __future__ import annotations

import torch

from growpage.errors import EngineError
from growpage.validators import positive_int


class RecentQueryRing:
    """Fixed storage for the last ``window`` queries of ``max_slots`` running requests."""

    def __init__(
        self,
        num_layers: int,
        max_slots: int,
        window: int,
        num_q_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        positive_int.raising(EngineError).require("a recent-query window", window)
        self.window = window
        self.queries = torch.zeros(
            num_layers, max_slots, window, num_q_heads, head_dim, dtype=dtype, device=device
        )
        # [L, M * W, Hq * d]: a row per (slot, ring index), written with one index_copy_
        self._rows = self.queries.view(num_layers, max_slots * window, num_q_heads * head_dim)

    def write(self, slots: torch.Tensor, positions: torch.Tensor, queries: torch.Tensor) -> None:
        """Store ``queries [L, n, Hq, d]`` (pre-RoPE) of the tokens at ``positions [n]`` of the
        requests in query-state ``slots [n]``; at most one row per (slot, position % W)."""
        rows = slots * self.window + positions % self.window
        self._rows.index_copy_(1, rows, queries.flatten(2).to(self.queries.dtype))

    def read(self, slot: int, positions: torch.Tensor) -> torch.Tensor:
        """The stored pre-RoPE queries ``[L, n, Hq, d]`` of ``slot`` at ``positions [n]`` (the
        last W positions at most; the caller knows they were written)."""
        return self.queries[:, slot, positions % self.window]


def prefill_rows(
    seq_lens: list[int], ends: list[int], window: int
) -> tuple[list[int], list[int], list[int]]:
    """Which rows of a packed prefill step go into the ring: the last ``window`` new tokens of
    each sequence (``seq_lens[b]`` new tokens ending before position ``ends[b]``). Returns the
    rows' indices in the step, their sequence's index in the batch and their positions."""
    rows: list[int] = []
    owners: list[int] = []
    positions: list[int] = []
    offset = 0
    for b, (n, end) in enumerate(zip(seq_lens, ends, strict=True)):
        m = min(n, window)
        rows += range(offset + n - m, offset + n)
        owners += [b] * m
        positions += range(end - m, end)
        offset += n
    return rows, owners, positions
