"""``StatsCollector``: per-step timing and occupancy, summarized as ``EngineStats``."""

from __future__ import annotations

import time
from collections.abc import Callable

from growpage.core.events import EventCounters
from growpage.engine.loop.sequence import Sequence
from growpage.engine.outputs import EngineStats
from growpage.latency import percentile_fields


class StatsCollector:
    """Accumulates what one ``generate`` / ``score`` call did.

    ``totals()`` returns the engine's running totals (preemptions, prefix-hit tokens, boundary
    seconds, deferred-compression seconds...); a call's numbers are their growth since
    ``reset``.
    """

    def __init__(
        self, events: EventCounters, totals: Callable[[], dict[str, float]] = dict
    ) -> None:
        self._events = events
        self._totals = totals
        self.reset()

    def reset(self) -> None:
        """Start a new measurement."""
        self.start = time.perf_counter()
        self.events_at_start = self._events.as_dict()
        self.totals_at_start = self._totals()
        self.num_steps = 0
        self.resident_s = 0.0  # sum of (running requests * step seconds)
        self.step_s = 0.0
        self.budget_tokens = 0  # sum over decode steps and requests of capacity (tokens)
        self.budget_samples = 0
        self.above_prompt_tokens = 0  # the same, of capacity beyond the request's prompt
        self.max_pages_used = 0
        self.timeline: list[tuple[float, int, int]] = []
        self.finished: list[Sequence] = []

    def on_step(
        self,
        seconds: float,
        num_running: int,
        decode_capacities: list[int],
        pages_used: int,
        resident_after: int,
        prompt_lens: list[int] | None = None,
    ) -> None:
        """One step took ``seconds`` with ``num_running`` requests; ``pages_used`` and
        ``resident_after`` are the pool's and the batch's state when it ended;
        ``decode_capacities`` and ``prompt_lens`` are the decoding requests' capacities and
        prompt lengths (tokens)."""
        self.timeline.append((time.perf_counter() - self.start, pages_used, resident_after))
        self.num_steps += 1
        self.step_s += seconds
        self.resident_s += seconds * num_running
        self.budget_tokens += sum(decode_capacities)
        self.budget_samples += len(decode_capacities)
        if prompt_lens:
            self.above_prompt_tokens += sum(
                max(0, c - p) for c, p in zip(decode_capacities, prompt_lens, strict=True)
            )
        self.max_pages_used = max(self.max_pages_used, pages_used)

    def on_idle(self, seconds: float) -> None:
        """The engine waited ``seconds`` with nothing to run (requests still to arrive): part
        of the time that ``avg_resident`` averages over, with none resident."""
        self.step_s += seconds

    def on_finish(self, seq: Sequence) -> None:
        self.finished.append(seq)

    def summary(self, policy: str, page_size: int, num_pages: int) -> EngineStats:
        total = time.perf_counter() - self.start
        seqs = self.finished
        num_out = sum(s.num_output_tokens for s in seqs)
        tpots = [
            (s.finish_s - s.first_token_s) / (s.num_output_tokens - 1)
            for s in seqs
            if s.num_output_tokens > 1 and s.first_token_s is not None and s.finish_s is not None
        ]
        ttfts = [s.first_token_s - s.arrival_s for s in seqs if s.first_token_s is not None]
        e2es = [s.finish_s - s.arrival_s for s in seqs if s.finish_s is not None]
        now = self._events.as_dict()
        events = {k: v - self.events_at_start.get(k, 0) for k, v in now.items()}
        grown = {k: v - self.totals_at_start.get(k, 0) for k, v in self._totals().items()}
        return EngineStats(
            policy=policy,
            page_size=page_size,
            num_pages=num_pages,
            num_requests=len(seqs),
            num_prompt_tokens=sum(len(s.prompt_token_ids) for s in seqs),
            num_output_tokens=num_out,
            num_steps=self.num_steps,
            total_s=total,
            tps=num_out / total if total > 0 else 0.0,
            tpot_s=sum(tpots) / len(tpots) if tpots else 0.0,
            ttft_s=sum(ttfts) / len(ttfts) if ttfts else 0.0,
            e2e_s=sum(e2es) / len(e2es) if e2es else 0.0,
            **percentile_fields(
                {"ttft": ttfts, "tpot": tpots, "e2e": e2es}, {"ttft": "s", "tpot": "s", "e2e": "s"}
            ),
            avg_resident=self.resident_s / self.step_s if self.step_s else 0.0,
            avg_kv_budget=(
                self.budget_tokens / self.budget_samples if self.budget_samples else 0.0
            ),
            avg_kv_above_prompt=(
                self.above_prompt_tokens / self.budget_samples if self.budget_samples else 0.0
            ),
            max_pages_used=self.max_pages_used,
            num_preemptions=int(grown.get("num_preemptions", 0)),
            prefix_hit_tokens=int(grown.get("prefix_hit_tokens", 0)),
            events=events,
            boundary_s=grown.get("boundary_s", 0.0),
            deferred_s=grown.get("deferred_s", 0.0),
            deferred_waited_s=grown.get("deferred_waited_s", 0.0),
            pool_timeline=list(self.timeline),
        )
