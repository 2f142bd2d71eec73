"""``Scheduler``: continuous batching over the waiting and running queues.

Each step is either a prefill step (chunks of prompts: running sequences still prefilling,
then newly admitted ones, within ``max_num_batched_tokens``) or a decode step (one token for
every running sequence). Before a decode step each sequence at a capacity boundary goes through
the ``CapacityController`` (grow / compress & hold / shrink); when nothing can make room the
most recently admitted running sequence is preempted.

Preemption is by recompute: the victim frees its pages and query slot and returns to the front
of the waiting queue; when admitted again it prefills prompt + generated tokens (its full KV,
compressions forgotten) and its query summaries restart at its next decode step (paper E.1).
Cached prefix pages often survive, so the recompute is partly free.

With ``EngineConfig.async_compaction`` (paper appendix E.3) a sequence whose boundary is
decided as a compression sits the decode step out: its compression is settled while
scheduling and runs beside the step's forward (``DeferredBoundaries.run``); it rejoins
the next step. Growth still decodes at once. When no other sequence would decode, the
compressions run at once and the step decodes them. With ``EngineConfig.async_decisions`` a
sequence whose boundary its policy decides sits the step out before any decision, and the
decision and its action run beside the forward (``DeferredBoundaries.decides_late`` says when).
"""

from __future__ import annotations

from collections import deque

import attrs

from growpage.core.capacity import forced_growth_pages
from growpage.core.residency import defers_beside_step, pick_victim
from growpage.engine.config import EngineConfig, plural
from growpage.engine.loop.kv_manager import KVCacheManager
from growpage.engine.loop.sequence import FinishReason, Sequence, SequenceStatus
from growpage.engine.sampling_params import SamplingParams
from growpage.errors import EngineError


@attrs.frozen
class SchedulerOutput:
    """What one step runs: the sequences and how many new tokens each feeds.

    For a prefill step the new tokens of a sequence are the ``num_new_tokens[i]`` tokens
    ending at its (already advanced) ``state.position``; for a decode step it is its last token.
    """

    is_prefill: bool
    seqs: tuple[Sequence, ...]
    num_new_tokens: tuple[int, ...]
    preempted: tuple[Sequence, ...] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    """Owns the queues; page operations go through the ``KVCacheManager``."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.config, self.kv = config, kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        self._preempted: list[Sequence] = []

    # ---- queues ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue ``seq``, which its caller has checked with ``check_fits`` (as
        ``LLMEngine.add_request`` does, through ``check_request``)."""
        self.waiting.append(seq)

    def check_fits(self, request_id: str, num_tokens: int, params: SamplingParams) -> None:
        """``EngineError`` when a request of ``num_tokens`` tokens can never fit the KV cache.

        A policy that compresses when the pool is full needs room for the prompt and one more
        token; one that never compresses (``fallback_to_compress = False``: fullkv) needs room
        for every token it may generate, which the model's context bounds.
        """
        need = num_tokens
        watermark = ""
        if not getattr(self.kv.controller.policy, "fallback_to_compress", True):
            # Its KV at the end: every token but the last, which is never fed back. Growth the
            # policy decides leaves the pool's watermark free, even for a request alone (only
            # growth below min_capacity may take it).
            need = min(need + params.max_tokens, self.kv.model_config.max_position) - 1
            reserve = self.kv.pool.watermark
            limit = max(self.kv.num_pages - reserve, self.kv.controller.config.min_capacity)
            fits = self.kv.pages_for(need) <= limit
            if reserve:
                watermark = f", {reserve} of them kept free as the pool's watermark"
        else:
            # The prompt and the first decode step's token, and the growth below the floor
            # (up to its whole KV, when that is smaller).
            total = min(need + params.max_tokens, self.kv.model_config.max_position) - 1
            forced = forced_growth_pages(self.kv.controller.config, num_tokens)
            fits = (
                self.kv.can_ever_fit(need)
                and min(forced, self.kv.pages_for(total)) <= self.kv.num_pages
            )
        if not fits:
            raise EngineError(
                f"request {request_id!r}: {need} tokens (prompt {num_tokens}) "
                f"cannot fit in the KV cache ({plural(self.kv.num_pages, 'page')} of "
                f"{self.kv.page_size} tokens{watermark}); raise kv_pages, shorten the prompt "
                "or lower max_tokens"
            )

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.kv.release(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def preempt(self, seq: Sequence) -> None:
        self.kv.release(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        self._preempted.append(seq)

    # ---- schedule -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step's work; raises ``EngineError`` when nothing can make progress."""
        self._preempted = []
        out = self._schedule_prefill() or self._schedule_decode()
        if out is None:
            raise EngineError(
                "the engine cannot make progress: every running request needs a "
                "KV page and none can be freed; raise kv_pages"
            )
        return out

    def _schedule_prefill(self) -> SchedulerOutput | None:
        budget = self.config.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        for seq in self.running:
            if seq.is_prefilling and budget > 0:
                n = min(seq.num_uncomputed_prefill, budget)
                seqs.append(seq)
                counts.append(n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.kv.can_admit(seq, len(self.running)):
                break
            self.waiting.popleft()
            self.kv.admit(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_prefill, budget)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        if not seqs:
            return None
        for seq, n in zip(seqs, counts, strict=True):
            seq.state.num_tokens += n
            seq.state.position += n
        return SchedulerOutput(True, tuple(seqs), tuple(counts), tuple(self._preempted))

    def _schedule_decode(self) -> SchedulerOutput | None:
        scheduled: list[Sequence] = []
        b = self.kv.page_size
        running = SequenceStatus.RUNNING
        ready = [
            seq
            for seq in self.running
            if seq.status is running and seq.state.position >= seq.prefill_target
        ]
        # Those at a capacity boundary (every slot used); the others only take their next slot.
        at = [seq for seq in ready if seq.state.num_tokens >= len(seq.state.block_table) * b]
        self.kv.prepare_boundaries(at)  # their boundary signals in one pass
        try:
            try:
                for seq in ready:
                    state = seq.state
                    if state.num_tokens < len(state.block_table) * b:
                        if seq.status is running:  # (not preempted for an earlier one)
                            state.num_tokens += 1  # kv.append_slot, without the slot
                            state.position += 1
                            scheduled.append(seq)
                        continue
                    if seq.status is not running:
                        continue  # preempted for an earlier one
                    if self._make_room(seq, scheduled):
                        self.kv.append_slot(seq)
                        scheduled.append(seq)
            finally:
                self.kv.end_boundaries()
            pending = self.kv.deferred.num_pending
            if pending and not defers_beside_step(pending, len(scheduled)):
                # Nothing else decodes this step: run the work now and decode its requests.
                for seq in self.kv.deferred.run():
                    self.kv.append_slot(seq)
                    scheduled.append(seq)
        except BaseException:
            for seq in scheduled:  # a failed schedule: the slots it gave out come back
                self._give_back(seq, 1)
            raise
        if not scheduled:
            return None
        return SchedulerOutput(
            False, tuple(scheduled), (1,) * len(scheduled), tuple(self._preempted)
        )

    def unschedule(self, out: SchedulerOutput) -> None:
        """Undo what scheduling ``out`` advanced, for a step that failed before its tokens were
        sampled: each request gives back the slot (decode) or the prompt chunk (prefill) it
        was given, so the next step computes it again, at the same positions. What scheduling
        settled stays: admissions, pages, boundary outcomes, preemptions (each a state the
        next step starts from as from any other)."""
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            self._give_back(seq, n)

    @staticmethod
    def _give_back(seq: Sequence, n: int) -> None:
        seq.state.num_tokens -= n
        seq.state.position -= n

    def _make_room(self, seq: Sequence, scheduled: list[Sequence]) -> bool:
        """Capacity control for ``seq``'s next token; preempts until it has a free slot.

        False when ``seq`` does not decode this step: it was preempted, must wait (no victim can
        be recomputed) or compresses beside the step (``async_compaction``:
        ``kv.deferred.is_deferred``; with ``async_decisions`` its whole boundary is decided there).
        """
        while True:
            outcome = self.kv.make_room(seq)
            if self.kv.deferred.is_deferred(
                seq
            ):  # a compression, or its whole boundary, beside the step
                return False
            if outcome is None or not outcome.needs_preemption:
                return True
            victim = pick_victim(self.running, lambda v: self.kv.can_ever_fit(v.num_total_tokens))
            if victim is None:
                return False
            self.preempt(victim)
            if victim in scheduled:
                scheduled.remove(victim)
            if victim is seq:
                return False
