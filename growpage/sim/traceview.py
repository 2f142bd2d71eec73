"""``TraceView``: the KV view of one request replayed from a trace.

The view is a ``DenseKVView`` fed from the trace's tensors: keys are written in position order up
to wherever the replay (or the serving simulator) has got, and at a capacity boundary the query
summaries are set from EMAs precomputed for the whole trace (``sim.ema``). Between boundaries
nothing per token happens, so a replay costs one step per boundary, not per token.

Boundaries of a request come every ``page_size`` tokens after the first one: every action of the
controller (grow, compress & hold, shrink) leaves exactly one page of free slots. The EMAs are
precomputed on that grid; any other position is computed on demand.
"""

from __future__ import annotations

import math

import torch

from growpage.core.config import GrowPageConfig
from growpage.core.kv_view import DenseKVView
from growpage.core.observation import rotate_queries
from growpage.core.rope import apply_rope, cos_sin
from growpage.core.traces import Trace
from growpage.sim.ema import ema_snapshots


def first_boundary(prompt_len: int, page_size: int) -> int:
    """Position of a request's first capacity boundary after prefilling ``prompt_len`` tokens."""
    return math.ceil(prompt_len / page_size) * page_size


class TraceView(DenseKVView):
    """KV view over ``trace``; positions ``[0, written)`` have been appended (then maybe compacted).

    Attributes:
        trace: the replayed trace (fp32 tensors).
        keys_by_head: ``[L, Hkv, T, d]`` post-RoPE keys of every position.
        values_by_head: ``[L, Hkv, T, d]`` values, or None.
        written: number of positions appended so far.
        num_cached_tokens: leading tokens the request took from the prefix cache when it was
            admitted (the serving simulator sets it): their queries never ran, so
            ``recent_queries`` starts after them, as the engine's ring does.
    """

    def __init__(
        self, trace: Trace, config: GrowPageConfig, track_accumulated: bool = False
    ) -> None:
        """``track_accumulated``: replay every query's attention over the resident slots into
        ``accumulated_attention()`` (H2O), catching up at each boundary."""
        h = trace.header
        b = config.page_size
        super().__init__(
            h.num_recorded_layers,
            h.num_q_heads,
            h.num_kv_heads,
            h.head_dim,
            h.rope,
            capacity=min(trace.num_tokens, 4 * b),
            softmax_scale=h.softmax_scale,
            track_accumulated=track_accumulated,
        )
        self.accumulated_until = 0  # queries of positions below this are accumulated
        self.trace = trace
        self.config = config
        self.keys_by_head = trace.keys.float().permute(0, 2, 1, 3).contiguous()
        self.values_by_head = (
            None if trace.values is None else trace.values.float().permute(0, 2, 1, 3).contiguous()
        )
        self.written = 0
        self.num_cached_tokens = 0
        start = max(first_boundary(trace.prompt_len, b), trace.prompt_len)
        # A boundary at t reads the summaries after the update at t - 1 (docs/architecture.md).
        self._grid = [t - 1 for t in range(start, trace.num_tokens, b) if t > trace.prompt_len]
        self._grid_index = {p: i for i, p in enumerate(self._grid)}
        self._emas: torch.Tensor | None = None  # [n, L, 2, Hq, d], computed on first use

    @property
    def num_positions(self) -> int:
        return self.trace.num_tokens

    def write_until(self, position: int) -> None:
        """Append the keys of positions ``[written, position)``."""
        if position < self.written or position > self.trace.num_tokens:
            raise ValueError(
                f"cannot write up to position {position} (written {self.written}, "
                f"trace has {self.trace.num_tokens})"
            )
        if position > self.written:
            keys = self.keys_by_head[:, :, self.written : position]
            self.extend(keys, torch.arange(self.written, position))
            self.written = position

    def summaries_at(self, position: int) -> torch.Tensor:
        """Short/long EMA summaries after the update at decode ``position``, ``[L, 2, Hq, d]``."""
        betas = (self.config.beta_short, self.config.beta_long)
        zero = self.config.summary_start == "average"
        index = self._grid_index.get(position)
        first = self.trace.prompt_len
        if index is None:
            return ema_snapshots(self.trace.queries, first, [position], betas, zero)[0]
        if self._emas is None:
            self._emas = ema_snapshots(self.trace.queries, first, self._grid, betas, zero)
        return self._emas[index]

    def prepare_boundary(self, position: int, decoded: bool = True) -> None:
        """Bring the view to decode ``position``: keys before it written, queries set.

        As in the engine, token ``position`` has no query yet: the summaries and the current
        query are those of token ``position - 1``; before any decode query (a prompt ending on
        a page boundary) none are set and the controller grows without asking the policy. So it
        is, as in the engine, before the first decode step of a request back from preemption
        (``decoded`` False): its recompute starts its query summaries again.
        """
        if position < self.trace.prompt_len:
            raise ValueError(
                f"position {position} is inside the prompt "
                f"(prompt_len {self.trace.prompt_len}); no decisions in prefill"
            )
        self.write_until(position)
        if self._acc is not None:
            self.accumulate_until(position)
        last = position - 1
        if decoded and last >= self.trace.prompt_len:
            self.set_queries(self.summaries_at(last), self.trace.queries[:, last].float())
        else:
            self.clear_queries()

    def accumulate_until(self, position: int, chunk: int = 256) -> None:
        """Add the attention of the queries of positions ``[accumulated_until, position)`` over
        the resident slots (causal: a query sees slots holding positions up to its own), as
        H2O accumulates it token by token; group-mean per KV head."""
        start = self.accumulated_until
        if position <= start:
            return
        keys, slot_pos = self.keys().float(), self.positions()  # [L, Hkv, N, d], [L, Hkv, N]
        group = self.num_q_heads // self.num_kv_heads
        for lo in range(start, position, chunk):
            hi = min(lo + chunk, position)
            pos = torch.arange(lo, hi)
            cos, sin = cos_sin(self.rope, pos, device=keys.device)  # [n, d]
            q = self.trace.queries[:, lo:hi].float().to(keys.device)  # [L, n, Hq, d] pre-RoPE
            q = apply_rope(q, cos[None, :, None], sin[None, :, None])
            q = q.reshape(q.shape[0], hi - lo, self.num_kv_heads, group, self.head_dim)
            logits = torch.einsum("lnhgd,lhsd->lhngs", q, keys) * self.softmax_scale
            visible = slot_pos[:, :, None, :] <= pos.to(slot_pos.device)[None, None, :, None]
            logits = logits.masked_fill(~visible[:, :, :, None, :], float("-inf"))
            attn = logits.softmax(dim=-1).nan_to_num(0.0).mean(dim=3).sum(dim=2)  # [L, Hkv, N]
            self.add_attention(attn)
        self.accumulated_until = position

    def recent_queries(self, window: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The trace's queries of the last ``window`` positions before ``written`` (the
        boundary's; from ``num_cached_tokens`` on), rotated to their positions."""
        end = self.written
        start = min(max(end - window, self.num_cached_tokens), end)
        positions = torch.arange(start, end)
        queries = self.trace.queries[:, start:end].to(self.device)
        return rotate_queries(self.rope, queries, positions), positions
