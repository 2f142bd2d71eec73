"""``DeferredBoundaries``: a decode step's boundary work that runs beside its forward.

With ``EngineConfig.async_compaction`` (paper appendix E.3) a compression decided while
scheduling is only settled there (``KVCacheManager.make_room(seq, defer=True)``); ``run`` runs
the step's compressions after the decode step's forward has been launched, on a side CUDA
stream, so the selection and compaction of the requests that compress overlap the others'
decoding. With ``EngineConfig.async_decisions`` (beyond the paper) a boundary the policy decides
is not even decided there: ``make_room`` only files it (``LateBoundary``), and ``run`` decides
and acts on it beside the forward, so the whole boundary leaves the critical path.

The KV manager owns one (``KVCacheManager.deferred``) and files the work; the scheduler and
the engine run or cancel it.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import torch

from growpage.core import residency
from growpage.core.boundary_context import BoundaryBatch
from growpage.core.capacity import BoundaryOutcome, PendingCompaction
from growpage.core.compaction_batch import CompactionBatch
from growpage.engine.loop.sequence import Sequence

if TYPE_CHECKING:
    from growpage.engine.loop.kv_manager import KVCacheManager


class LateBoundary:
    """A boundary registered while scheduling and decided in ``DeferredBoundaries.run``
    (``EngineConfig.async_decisions``): the request sits the step out unchanged, so its
    decision reads what it would have read at once (summaries, keys, sums)."""

    def __init__(self, kv: KVCacheManager, seq: Sequence) -> None:
        self.kv, self.seq = kv, seq

    def run(
        self, batch: BoundaryBatch | None, compactions: CompactionBatch | None = None
    ) -> BoundaryOutcome:
        """Decide and act (grow, or compress: at once, or booked in ``compactions``); never a
        preemption (see ``DeferredBoundaries.decides_late``)."""
        seq = self.seq
        outcome = self.kv.controller.on_boundary(
            seq.state, self.kv.view(seq), batch, compactions=compactions
        )
        if outcome.needs_preemption:  # decides_late rules it out; a broken rule is a bug
            raise RuntimeError(
                f"request {seq.request_id!r}: a late boundary asked for a preemption"
            )
        return outcome

    def cancel(self) -> None:
        """Nothing was settled: the request stays at its boundary, decided next step."""


class DeferredBoundaries:
    """The step's deferred compressions and late boundaries of one ``KVCacheManager``, in
    decision order, and running totals of what they did and cost."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._items: dict[int, tuple[Sequence, PendingCompaction | LateBoundary]] = {}
        self.num_compactions = 0  # compressions run by run (running total)
        self.num_decisions = 0  # late boundaries decided by run (running total)
        self.work_s = 0.0  # their part of kv.boundary_s (running total)
        self.waited_s = 0.0  # of that, what the step waited for (running total)
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        self._ready: torch.cuda.Event | None = None  # the step's boundary work, before forward

    def decides_late(self, seq: Sequence) -> bool:
        """Whether ``seq``'s boundary can be decided beside the forward (``async_decisions``;
        ``residency.decides_late``)."""
        return residency.decides_late(self.kv.controller, seq.state, self.kv.view(seq))

    def is_deferred(self, seq: Sequence) -> bool:
        """Whether ``seq`` has a compression or a late boundary pending (it sits this decode
        step out)."""
        return seq.seq_id in self._items

    @property
    def num_pending(self) -> int:
        return len(self._items)

    def add(self, seq: Sequence, work: PendingCompaction | LateBoundary) -> None:
        """File ``seq``'s settled compression or late boundary for ``run``."""
        self._items[seq.seq_id] = (seq, work)

    def mark_ready(self) -> None:
        """At the end of scheduling: on CUDA, what the pending work reads was computed before
        this point; the forward queued next on this stream is what it must not wait for."""
        if self._items and self.kv.cache.is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def cancel(self, seq: Sequence | None = None) -> None:
        """Drop the pending compression of ``seq`` (None: all): its copy-on-write pages return
        to the pool, the request stays at its boundary and is decided again next step."""
        if seq is None:
            items, self._items = list(self._items.values()), {}
        else:
            item = self._items.pop(seq.seq_id, None)
            items = [] if item is None else [item]
        for _, pending in items:
            pending.cancel()

    def run(self) -> list[Sequence]:
        """Run this step's pending compressions, in decision order; returns their sequences.

        On CUDA they run on a side stream that waits only for the boundary work of scheduling
        (not for the forward launched since), so the device overlaps them with the decode step
        and the host does their Python while the forward runs. The time is boundary time
        (``work_s`` says how much); ``waited_s`` is the part of it after the forward had
        finished, which the step waited for (all of it on the CPU). A compression that fails
        cancels the ones after it and raises.
        """
        if not self._items:
            return []
        items, self._items = list(self._items.values()), {}
        late = [seq for seq, pending in items if isinstance(pending, LateBoundary)]
        start = time.perf_counter()
        streams = self._side_streams()
        forward_done = None
        if streams is not None:
            forward_done = torch.cuda.Event(enable_timing=True)
            forward_done.record()  # after everything queued on the main stream: the forward
        done = [0]
        try:
            side = contextlib.nullcontext() if streams is None else torch.cuda.stream(streams[0])
            with side, self.kv.one_thread():
                if streams is not None and self._ready is not None:
                    streams[0].wait_event(self._ready)
                self._run_items(items, late, done)
        except BaseException:
            for _, pending in items[done[0] :]:
                pending.cancel()
            raise
        finally:
            self._ready = None
            if streams is not None:
                streams[0].synchronize()
                torch.cuda.current_stream().wait_stream(streams[0])
            elapsed = time.perf_counter() - start  # before waiting for the forward below
            stall = (
                elapsed
                if streams is None or forward_done is None
                else min(_stall_time(forward_done, streams[1]), elapsed)
            )
            self.kv.boundary_s += elapsed
            self.work_s += elapsed
            self.waited_s += stall
        self.num_compactions += len(items) - len(late)
        self.num_decisions += len(late)
        return [seq for seq, _ in items]

    def _run_items(
        self,
        items: list[tuple[Sequence, PendingCompaction | LateBoundary]],
        late: list[Sequence],
        done: list[int],
    ) -> None:
        """Decide the late boundaries (sharing a batch) and run the compressions, in order;
        two or more items book theirs and run them together. ``done[0]`` counts the items
        started (those after it are cancelled when one fails)."""
        batch = self.kv.shared_batch(late)
        compactions = self._compaction_batch(len(items))
        try:
            for _, pending in items:
                done[0] += 1
                if isinstance(pending, LateBoundary):
                    pending.run(batch, compactions)
                else:
                    pending.run(compactions)
        finally:
            if compactions is not None:
                compactions.run()  # those booked, failure or not

    def _compaction_batch(self, num_items: int) -> CompactionBatch | None:
        """The run's compressions booked and run together (two or more items and
        ``KVCacheManager.compacts_together``), or None: each at its turn."""
        kv = self.kv
        together = num_items > 1 and kv.compacts_together
        return CompactionBatch(kv.controller) if together else None

    def _side_streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream] | None:
        """(compaction stream, an idle stream to read the device clock on); None on the CPU."""
        cache = self.kv.cache
        if not cache.is_cuda:
            return None
        if self._streams is None:
            self._streams = (torch.cuda.Stream(cache.device), torch.cuda.Stream(cache.device))
        return self._streams


def _stall_time(forward_done: torch.cuda.Event, idle: torch.cuda.Stream) -> float:
    """Seconds from the forward's end on the device to now (0 when it is still running): how
    long the deferred work kept the step from going on. ``now`` is an event on an idle stream,
    which the device stamps at once."""
    now = torch.cuda.Event(enable_timing=True)
    now.record(idle)
    forward_done.synchronize()  # the sampler waits for it next anyway
    now.synchronize()
    return max(forward_done.elapsed_time(now), 0.0) / 1000.0
