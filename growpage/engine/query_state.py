"""``QueryStatePool``: pre-allocated dual-timescale query summaries (paper appendix E.1).

::

    summaries [L, M, 2, Hq, d] fp32   (M = max_num_seqs; index 2: 0 = short EMA, 1 = long EMA)
    current   [L, M, Hq, d]    fp32   the last decode query of the slot (for RMS calibration)

A slot is bound when a request starts running and released when it finishes or is preempted;
nothing is cleared: the first decode step of a new owner overwrites both EMAs (Eq. 6 with
``first``). Queries are pre-RoPE (post q-norm).
"""

from __future__ import annotations

import torch

from growpage.core.kvview import QueryState
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
    ) -> None:
        self.summaries = torch.zeros(
            num_layers, max_slots, 2, num_q_heads, head_dim, dtype=torch.float32, device=device
        )
        self.current = torch.zeros(
            num_layers, max_slots, num_q_heads, head_dim, dtype=torch.float32, device=device
        )
        self.beta_short, self.beta_long = beta_short, beta_long
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
        return self._free.pop()

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.max_slots:
            raise EngineError(f"query-state slot {slot} released twice or out of range")
        self._free.append(slot)

    def update(
        self,
        slots: torch.Tensor,
        queries: torch.Tensor,
        first: torch.Tensor,
        summaries: bool = True,
    ) -> None:
        """Eq. 6 in place for a decode batch.

        Args:
            slots: ``[B]`` int64 slot of each sequence.
            queries: ``[L, B, Hq, d]`` pre-RoPE queries of the step.
            first: ``[B]`` bool, first decode step of the slot's owner (EMAs := query).
            summaries: False when the attention backend already updated the EMAs (fused
                kernel); only the current query is stored then.
        """
        q = queries.to(self.summaries.dtype)
        if not summaries:
            self.current[:, slots] = q
            return
        old = self.summaries[:, slots]  # [L, B, 2, Hq, d]
        betas = torch.tensor([self.beta_short, self.beta_long], device=q.device)
        betas = betas.view(1, 1, 2, 1, 1)
        new = old * betas + q.unsqueeze(2) * (1 - betas)
        new = torch.where(first.view(1, -1, 1, 1, 1), q.unsqueeze(2).expand_as(new), new)
        self.summaries[:, slots] = new
        self.current[:, slots] = q

    def read(self, slot: int) -> QueryState:
        """Short, long and current query of ``slot``, each ``[L, Hq, d]`` (views)."""
        s = self.summaries[:, slot]
        return QueryState(short=s[:, 0], long=s[:, 1], current=self.current[:, slot])
