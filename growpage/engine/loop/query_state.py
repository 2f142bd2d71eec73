"""``QueryStatePool``: pre-allocated dual-timescale query summaries (paper appendix E.1).

::

    summaries [L, M, 2, Hq, d] fp32   (M = max_num_seqs; index 2: 0 = short EMA, 1 = long EMA)
    current   [L, M, Hq, d]    fp32   the last decode query of the slot (for RMS calibration)

A slot is bound when a request starts running and released when it finishes or is preempted;
nothing is cleared: the first decode step of a new owner overwrites both EMAs (Eq. 6 with
``first``). Queries are pre-RoPE (post q-norm).

With ``zero_start`` (``GrowPageConfig.summary_start == "average"``) a slot's summaries are set
to zero when it is bound and its first decode step is an ordinary update (no ``first`` flag),
so each summary is ``(1 - beta) sum_i beta^(n - i) q_i``: the bias-corrected average times
``1 - beta^n``, a factor the RMS calibration (Eq. 12) removes.
"""

from __future__ import annotations

import math

import torch

from growpage.core.kv_view import QueryState
from growpage.errors import EngineError


class QueryStatePool:
    """Fixed query-state storage for ``max_slots`` running requests."""

    def __init__(
        self,
        num_layers: int,
        max_slots: int,
        num_q_heads: int,
        head_dim: int,
        beta_short: float,
        beta_long: float,
        device: torch.device | str = "cpu",
        zero_start: bool = False,
    ) -> None:
        self.summaries = torch.zeros(
            num_layers, max_slots, 2, num_q_heads, head_dim, dtype=torch.float32, device=device
        )
        self.current = torch.zeros(
            num_layers, max_slots, num_q_heads, head_dim, dtype=torch.float32, device=device
        )
        self.beta_short, self.beta_long = beta_short, beta_long
        self.zero_start = zero_start
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # update's scratch
        self._beta_tensors: tuple[torch.Tensor, torch.Tensor] | None = None
        self._free = list(range(max_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def max_slots(self) -> int:
        return self.summaries.shape[1]

    def can_bind(self) -> bool:
        return bool(self._free)

    def bind(self) -> int:
        if not self._free:
            raise EngineError("no free query-state slot (more running requests than max_num_seqs)")
        slot = self._free.pop()
        if self.zero_start:
            self.summaries[:, slot] = 0.0
        return slot

    def is_first(self, num_decode_steps: int) -> bool:
        """Whether a decode step sets the summaries to its query (Eq. 6's start) rather than
        blending it in: the owner's first, unless the slot starts at zero (``zero_start``)."""
        return num_decode_steps == 0 and not self.zero_start

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.max_slots:
            raise EngineError(f"query-state slot {slot} released twice or out of range")
        self._free.append(slot)

    def update(
        self,
        slots: torch.Tensor | slice,
        queries: torch.Tensor,
        first: torch.Tensor,
        summaries: bool = True,
        any_first: bool | None = None,
    ) -> None:
        """Eq. 6 in place for a decode batch.

        Args:
            slots: ``[B]`` int64 slot of each sequence, or ``slice(a, a + B)`` when they are
                consecutive (the update then runs in place, with no gather and scatter).
            queries: ``[L, B, Hq, d]`` pre-RoPE queries of the step.
            first: ``[B]`` bool, first decode step of the slot's owner (EMAs := query).
            summaries: False when the attention backend already updated the EMAs (fused
                kernel); only the current query is stored then.
            any_first: whether ``first`` has a True row, when the caller knows (None: not
                known; False skips the rows' selection).

        The blend runs in preallocated scratch (no per-step allocation: on some hosts every
        fresh large tensor costs page faults) with the same fp32 operations, in the same
        order, as ``old * beta + q * (1 - beta)``: the summaries are bitwise those.
        ``queries`` may be the view ``current[:, slots]`` itself (slots a slice): the caller
        stacked them there.
        """
        q = queries.to(self.summaries.dtype)
        if not summaries:
            self._store_current(slots, q)
            return
        betas, rest = self._betas(q.device)
        old, blend = self._scratch(q.shape[1])
        if isinstance(slots, slice):  # consecutive slots: blended where they are
            old = self.summaries[:, slots]
        else:
            slots = slots.long()
            torch.index_select(self.summaries, 1, slots, out=old)
        old.mul_(betas)
        torch.mul(q.unsqueeze(2), rest, out=blend)
        old.add_(blend)
        if any_first is None or any_first:
            torch.where(first.view(1, -1, 1, 1, 1), q.unsqueeze(2), old, out=old)
        if isinstance(slots, slice):
            self._store_current(slots, q)
        else:
            self.summaries.index_copy_(1, slots, old)
            self.current.index_copy_(1, slots, q)

    def _store_current(self, slots: torch.Tensor | slice, q: torch.Tensor) -> None:
        """``current[:, slots] = q``, unless ``q`` is that very view (stacked in place)."""
        if isinstance(slots, slice):
            dst = self.current[:, slots]
            if q.data_ptr() == dst.data_ptr() and q.stride() == dst.stride():
                return
            dst.copy_(q)
        else:
            self.current[:, slots] = q

    def _scratch(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two ``[L, batch, 2, Hq, d]`` fp32 scratch tensors (views of buffers allocated on
        first use, as large as the pool)."""
        if self._buffers is None:
            self._buffers = (torch.empty_like(self.summaries), torch.empty_like(self.summaries))
        shape = (self.summaries.shape[0], batch, *self.summaries.shape[2:])
        n = math.prod(shape)
        a, b = self._buffers
        return a.view(-1)[:n].view(shape), b.view(-1)[:n].view(shape)

    def _betas(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``beta`` and ``1 - beta`` as ``[1, 1, 2, 1, 1]`` fp32 tensors on ``device``."""
        if self._beta_tensors is None or self._beta_tensors[0].device != device:
            betas = torch.tensor([self.beta_short, self.beta_long], device=device)
            betas = betas.view(1, 1, 2, 1, 1)
            self._beta_tensors = betas, 1 - betas
        return self._beta_tensors

    def read(self, slot: int) -> QueryState:
        """Short, long and current query of ``slot``, each ``[L, Hq, d]`` (views)."""
        s = self.summaries[:, slot]
        return QueryState(short=s[:, 0], long=s[:, 1], current=self.current[:, slot])
