"""What a replay produces: one ``BoundaryRecord`` per boundary and a ``ReplayResult`` per trace."""

from __future__ import annotations

import math

import attrs
import torch


@attrs.frozen
class BoundaryRecord:
    """One capacity boundary of a replay.

    Attributes:
        position: absolute position of the token that needed a slot.
        action: what the controller executed ("grow", "compress", "shrink", "preempt").
        decision: the policy's primary decision, None when growth was forced.
        fallback: GROW was refused and COMPRESS ran.
        pages_before, pages_after, tokens_after: request state around the boundary.
        delta: Delta_t (Eq. 8) when the policy computed it (or signals were requested); None
            at a forced growth, which asks the policy nothing.
        mass_mean, mass_min: retained attention mass of the next page's sampled queries,
            mean / min over layers and KV heads (None when fidelity is off).
        output_error: mean |o - o_hat|_2 of those queries (None without values).
        future_change: signals only: working-set ratio of the next page's queries minus that of
            the current page's (full KV, the paper's "future demand change", Fig. 6).
        advantage, advantage_error: signals only: loss(compress) - loss(grow) over the next
            page, loss = 1 - retained mass / output error (the paper's growth advantage, Fig. 7).
    """

    position: int
    action: str
    decision: str | None
    fallback: bool
    pages_before: int
    pages_after: int
    tokens_after: int
    delta: float | None = None
    mass_mean: float | None = None
    mass_min: float | None = None
    output_error: float | None = None
    future_change: float | None = None
    advantage: float | None = None
    advantage_error: float | None = None

    def as_dict(self) -> dict:
        return attrs.asdict(self)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


@attrs.define
class ReplayResult:
    """Replay of one trace under one policy.

    Attributes:
        head_mass: ``[num_fidelity_boundaries, L, Hkv]`` retained mass per layer and KV head
            (None when fidelity is off).
        avg_budget: mean KV capacity in tokens (pages * b) over the decode tokens.
        preempted: the shared pool could not make room; the replay stopped at that boundary.
    """

    request_id: str
    policy: str
    page_size: int
    prompt_len: int
    num_tokens: int
    records: list[BoundaryRecord]
    events: dict[str, int]
    avg_budget: float
    max_pages: int
    final_pages: int
    head_mass: torch.Tensor | None = None
    preempted: bool = False

    @property
    def mass_mean(self) -> float | None:
        return _mean([r.mass_mean for r in self.records if r.mass_mean is not None])

    @property
    def mass_min(self) -> float | None:
        values = [r.mass_min for r in self.records if r.mass_min is not None]
        return min(values) if values else None

    @property
    def output_error(self) -> float | None:
        return _mean([r.output_error for r in self.records if r.output_error is not None])

    @property
    def trajectory(self) -> list[tuple[int, int]]:
        """``(position, pages)`` after every boundary, starting from the prefill."""
        prefill = math.ceil(self.prompt_len / self.page_size)
        return [(self.prompt_len, prefill)] + [(r.position, r.pages_after) for r in self.records]

    def summary(self) -> dict:
        """Scalar metrics, JSON-ready."""
        return {
            "request_id": self.request_id,
            "policy": self.policy,
            "num_tokens": self.num_tokens,
            "avg_budget": self.avg_budget,
            "max_pages": self.max_pages,
            "mass_mean": self.mass_mean,
            "mass_min": self.mass_min,
            "output_error": self.output_error,
            "boundaries": len(self.records),
            "grow": self.events.get("grow", 0),
            "compress": self.events.get("compress", 0),
            "shrink": self.events.get("shrink", 0),
            "fallback": self.events.get("fallback", 0),
            "preempted": self.preempted,
        }

    def as_dict(self) -> dict:
        return {
            **self.summary(),
            "page_size": self.page_size,
            "prompt_len": self.prompt_len,
            "events": self.events,
            "records": [r.as_dict() for r in self.records],
        }
