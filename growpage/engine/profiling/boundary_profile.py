"""Where the engine's capacity-boundary time goes, phase by phase.

``EngineStats.boundary_s`` says how long capacity control took in all; this says which part
of it: the summaries' calibration, the attention estimate, the demand maths, the policy's own
code, the selection, its validation, the compaction, and the controller's bookkeeping::

    with profile_boundaries(llm) as phases:
        llm.generate(prompts, params)
    print(phases.markdown())

Times are *exclusive*: a phase's time excludes the phases it calls (``decide`` is the policy's
``decide`` minus the queries, attention and demand it asked for), so the phases add up to the
boundary time. Without ``sync`` a phase's time is host time plus any wait for the device inside
it (a host sync waits for everything queued before it). With ``sync=True`` (CUDA only) the
device is synchronized as every phase starts and ends, so device work is charged to the phase
that launched it; that adds a few syncs per boundary, so use it to attribute, not to time.

The wrappers cost about a microsecond per call. While the context is open, the engine's KV views
are patched at class level (one profile at a time, per process).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

import growpage.core.boundary_signals as boundary_signals_module
import growpage.core.capacity as capacity_module
import growpage.core.compaction_batch as compaction_module
from growpage.core import demand as demand_module
from growpage.engine.loop.paged_kv_view import EngineKVView

#: Phase names in report order; ``control`` is whatever capacity control does outside the others.
PHASES = ("queries", "attention", "demand", "decide", "select", "check", "compact", "control")


class BoundaryPhases:
    """Exclusive seconds and call counts per phase, filled while ``profile_boundaries`` is open."""

    def __init__(self, sync: bool = False) -> None:
        self.sync = sync
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.calls: Counter[str] = Counter()
        self.boundaries = 0  # make_room calls that reached the controller
        self.decided = 0  # of those, boundaries where the policy decided
        self._stack: list[list[float]] = []  # [start, time spent in children]

    def timed(
        self, phase: str, fn: Callable[..., Any], count: Callable[..., int] | None = None
    ) -> Callable[..., Any]:
        """``fn`` wrapped so that its exclusive time is charged to ``phase``; each call counts
        one, or ``count(*args)`` (the requests a call of a step's batch serves)."""
        if phase not in self.seconds:
            raise ValueError(f"unknown boundary phase {phase!r}; expected one of {PHASES}")

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._synchronize()
            frame = [time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._synchronize()
                self._stack.pop()
                elapsed = time.perf_counter() - frame[0]
                self.seconds[phase] += elapsed - frame[1]
                self.calls[phase] += 1 if count is None else count(*args)
                if self._stack:
                    self._stack[-1][1] += elapsed

        return functools.update_wrapper(wrapper, fn, assigned=(), updated=())  # sets __wrapped__

    def _synchronize(self) -> None:
        if self.sync:
            torch.cuda.synchronize()

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def per_decided_ms(self) -> dict[str, float | None]:
        """Milliseconds per decided boundary, by phase (forced grows are in ``control``); None
        for every phase when no boundary was decided."""
        if not self.decided:
            return dict.fromkeys(self.seconds)
        return {phase: round(1000 * s / self.decided, 4) for phase, s in self.seconds.items()}

    def as_dict(self) -> dict:
        return {
            "boundaries": self.boundaries,
            "decided": self.decided,
            "sync": self.sync,
            "total_s": round(self.total_s, 6),
            "ms_per_decided": self.per_decided_ms(),
            "calls": {phase: self.calls[phase] for phase in PHASES},
        }

    def markdown(self) -> str:
        """A table of ms per decided boundary and share of boundary time, by phase."""
        total = self.total_s or 1.0
        per = self.per_decided_ms()
        lines = [
            f"Boundary phases ({self.decided} decided of {self.boundaries} boundaries"
            f"{', device synced per phase' if self.sync else ''}):",
            "",
            "| phase | calls | ms per decided boundary | share |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| {p} | {self.calls[p]} | {'n/a' if per[p] is None else f'{per[p]:.3f}'} | "
            f"{100 * self.seconds[p] / total:.1f}% |"
            for p in PHASES
        ]
        return "\n".join(lines)


class _TimedPolicy:
    """Delegates to a policy; ``decide`` and ``select`` are timed (attrs policies have slots,
    so the policy object itself cannot be patched)."""

    def __init__(self, policy: Any, phases: BoundaryPhases) -> None:
        self._policy = policy
        self._phases = phases
        self.decide = phases.timed("decide", policy.decide)
        self.select = phases.timed("select", policy.select)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)


@contextlib.contextmanager
def profile_boundaries(llm: Any, sync: bool = False) -> Iterator[BoundaryPhases]:
    """Time the capacity boundaries of ``llm`` (an ``LLM`` or ``LLMEngine``) by phase."""
    engine = getattr(llm, "engine", llm)
    kv = engine.kv
    phases = BoundaryPhases(sync and kv.cache.is_cuda)
    controller = kv.controller
    make_room = kv.make_room
    prepare = kv.prepare_boundaries

    timed_make_room = phases.timed("control", make_room)

    def counted_make_room(seq: Any) -> Any:
        if not controller.needs_decision(seq.state):
            return make_room(seq)  # no boundary: not capacity-control time
        phases.boundaries += 1
        return timed_make_room(seq)

    timed_prepare = phases.timed("control", prepare)

    def counted_prepare(seqs: Any) -> Any:
        # A step's shared batch (contexts built before its first boundary) is control time.
        if sum(controller.needs_decision(seq.state) for seq in seqs) < 2:
            return prepare(seqs)  # nothing to share: no batch is built
        return timed_prepare(seqs)

    # A step's booked compressions (CompactionBatch.run): the selections, their check and the
    # compactions are charged to those phases (counted per request), the rest to ``control``.
    timed_run_compactions = phases.timed("control", kv.run_compactions)
    deferred = kv.deferred
    run_deferred = deferred.run
    timed_run_deferred = phases.timed("control", run_deferred)

    def counted_run_deferred() -> Any:
        # Compressions deferred to beside the forward (async compaction): their selection,
        # check and compaction are charged to those phases, the rest to ``control``.
        return timed_run_deferred() if deferred.num_pending else run_deferred()

    def counted_decide(*args: Any, **kwargs: Any) -> Any:
        phases.decided += 1
        return decide(*args, **kwargs)

    # A step's shared batch gets its members' queries and attention in one call
    # (batch_boundary_signals; on the torch path the step's signal pass): charged to
    # ``attention``. A step's batched selections, checks and compactions count their requests.
    patches: list[tuple[object, str, str, Callable[..., int] | None]] = [
        (EngineKVView, "boundary_queries", "queries", None),
        (EngineKVView, "summary_attention", "attention", None),
        (EngineKVView, "batch_boundary_signals", "attention", None),
        (boundary_signals_module, "_fill", "attention", None),
        (EngineKVView, "compact", "compact", None),
        (EngineKVView, "compact_batch", "compact", lambda jobs, keep: len(jobs)),
        (demand_module, "working_set_counts", "demand", None),
        (demand_module, "demand_trends", "demand", None),
        (capacity_module, "_check_selection", "check", None),
        (compaction_module, "select_slots", "select", lambda scores, *rest: len(scores)),
        (compaction_module, "invalid_rows", "check", lambda keep, kept, *rest: len(kept)),
    ]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _, _ in patches]
    # Instance-level wrappers already there (a benchmark's counters) are put back afterwards.
    own = [
        (owner, name, owner.__dict__.get(name))
        for owner, name in (
            (kv, "make_room"),
            (kv, "prepare_boundaries"),
            (kv, "run_compactions"),
            (deferred, "run"),
        )
    ]
    policy = controller.policy
    timed_policy = _TimedPolicy(policy, phases)
    decide = timed_policy.decide
    timed_policy.decide = counted_decide
    try:
        for owner, name, phase, count in patches:
            timed = phases.timed(phase, getattr(owner, name), count)
            static = isinstance(owner.__dict__[name], staticmethod)
            setattr(owner, name, staticmethod(timed) if static else timed)
        controller.policy = timed_policy
        kv.make_room = counted_make_room
        kv.prepare_boundaries = counted_prepare
        kv.run_compactions = timed_run_compactions
        deferred.run = counted_run_deferred
        yield phases
    finally:
        for holder, name, wrapper in own:
            if wrapper is None:
                delattr(holder, name)
            else:
                setattr(holder, name, wrapper)
        controller.policy = policy
        for owner, name, original in saved:
            setattr(owner, name, original)
