"""Event counters of capacity control (paper appendix H.2, Table 9)."""

from __future__ import annotations

import attrs


@attrs.define
class EventCounters:
    """Counts of boundary events. ``decided_*`` are the policy's primary decisions before
    fallback; ``grow`` / ``compress`` / ``shrink`` are what was executed."""

    boundaries: int = 0
    decided_grow: int = 0
    decided_compress: int = 0
    decided_shrink: int = 0
    forced_grow: int = 0  # growth below min_capacity (no policy call)
    grow: int = 0  # executed growths, forced ones included
    compress: int = 0
    shrink: int = 0
    fallback: int = 0  # GROW refused by the pool, COMPRESS executed instead
    shrink_refused: int = 0  # SHRINK below min_capacity, COMPRESS executed instead
    preempt_needed: int = 0  # nothing could make room; the caller must preempt
    cow_pages: int = 0  # shared pages replaced by private copies before compaction

    def merge(self, other: EventCounters) -> None:
        for field in attrs.fields(EventCounters):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    def as_dict(self) -> dict[str, int]:
        return attrs.asdict(self)

    @property
    def grow_ratio(self) -> float:
        """Share of primary decisions that were GROW (Table 9's grow ratio)."""
        total = self.decided_grow + self.decided_compress + self.decided_shrink
        return self.decided_grow / total if total else 0.0
