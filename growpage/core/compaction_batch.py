"""``CompactionBatch``: the compressions of one step, booked one by one and run in one pass.

Requests at a capacity boundary are decided one by one, each against the pool as the ones
before it left it (``CapacityController.on_boundary``). What a compression does to the pool and
to its request is known once it is settled, so it is *booked* at its turn: its pages are
invalidated and released and the request holds ``tokens_after`` slots in its new pages, as if
it had run. Its KV work waits: at the end of the step's scheduling ``run`` selects, checks and
compacts every booked request together::

    turn:  A decides COMPRESS -> booked     B decides GROW -> page     C COMPRESS -> booked
    run:   scores of A, C (one pass)  ->  selections (one pass)  ->  one check (one sync)
           ->  one gather and one scatter of both requests' slots  ->  positions

Decisions, pages and kept slots are those of running each compression at its turn: the
signals and the selection compute row by row what each request computes alone
(``core.boundary_signals``, ``selection.growpage_select_batch``), and every slot is read before
any is written, so a page one request released and another got as a copy-on-write target in
the same step is read first. A policy with its own ``select`` is asked at the request's turn
(its errors leave the request untouched); only its compaction joins the batch. A request booked
and then preempted before ``run`` is dropped (``drop``): its KV is discarded anyway.
"""

from __future__ import annotations

import attrs
import torch

from growpage.core import boundary_signals
from growpage.core.capacity import (
    BoundaryOutcome,
    CapacityController,
    PendingCompaction,
    invalid_rows,
    selection_problem,
)
from growpage.core.kv_view import CompactionJob
from growpage.core.request import RequestState
from growpage.core.selection import padded_slots, select_slots
from growpage.errors import PolicyError


@attrs.define
class _Booked:
    pending: PendingCompaction
    keep: torch.Tensor | None  # the policy's own selection, checked; None: the default's


class CompactionBatch:
    """Booked compressions of one step, run together by ``run``."""

    def __init__(self, controller: CapacityController) -> None:
        self.controller = controller
        self._booked: list[_Booked] = []
        #: The policy's ``select`` is GrowPage's (``CapacityPolicy.has_default_selection``):
        #: the selections of the batch run in one pass.
        self.selects_together = bool(getattr(controller.policy, "has_default_selection", False))

    def __len__(self) -> int:
        return len(self._booked)

    def book(self, pending: PendingCompaction) -> BoundaryOutcome:
        """Book ``pending`` (settled): a policy's own selection now, then the pages and the
        request as after the compaction; the KV work waits for ``run``."""
        keep = None
        if not self.selects_together:
            try:
                keep = self.controller.checked_selection(pending.ctx, pending.tokens_after)
            except BaseException:
                self.controller.pool.free(pending.fresh)
                raise
        outcome = self.controller.book(pending)
        self._booked.append(_Booked(pending, keep))
        return outcome

    def drop(self, state: RequestState) -> None:
        """Forget the booked compaction of ``state``'s request (preempted: its pages went back
        to the pool and its KV is recomputed)."""
        self._booked = [b for b in self._booked if b.pending.state is not state]

    def run(self) -> None:
        """Select, check and compact every booked request, in one pass each."""
        booked, self._booked = self._booked, []
        if not booked:
            return
        pendings = [b.pending for b in booked]
        own = [b.keep for b in booked if b.keep is not None]
        keep = padded_slots(own) if own else select_together(self.controller, pendings)
        jobs = [
            CompactionJob(
                p.view,
                keep[i, :, :, : p.tokens_after],
                p.source,
                p.target,
                p.ctx.num_tokens,
                p.ctx.position,
            )
            for i, p in enumerate(pendings)
        ]
        view_class = type(jobs[0].view)
        if any(type(job.view) is not view_class for job in jobs):
            for job in jobs:  # views of several classes (never in one engine or simulator)
                type(job.view).compact_batch([job], job.keep[None])
            return
        view_class.compact_batch(jobs, keep)


def select_together(
    controller: CapacityController, pendings: list[PendingCompaction]
) -> torch.Tensor:
    """GrowPage's selection (``CapacityPolicy.select``'s default) of each of ``pendings``, in
    one pass: ``[R, L, Hkv, K_max]``, row r's first ``tokens_after`` slots its selection, -1
    past them. Checked as ``CapacityController.checked_selection`` checks one (one host sync;
    ``PolicyError`` naming the first request whose selection breaks a rule)."""
    contexts = [p.ctx for p in pendings]
    config = controller.config
    scores = boundary_signals.selection_scores(contexts, [p.source for p in pendings])
    num_kept = [p.tokens_after for p in pendings]
    num_tokens = [c.num_tokens for c in contexts]
    prefixes = [c.num_protected_prefix for c in contexts]
    keep = select_slots(
        scores,
        num_tokens,
        config.recent_window,
        num_kept,
        config.page_size,
        config.local_quota,
        prefixes,
    )
    bad = invalid_rows(keep, num_kept, num_tokens, config.recent_window, prefixes)
    for i, (ctx, wrong) in enumerate(zip(contexts, bad, strict=True)):
        if wrong:  # never for GrowPage's selection: a bug, named as a policy's would be
            problem = selection_problem(keep[i, :, :, : num_kept[i]], ctx, num_kept[i])
            raise PolicyError(
                f"policy {getattr(controller.policy, 'name', 'custom')} select(): {problem} "
                f"(request {ctx.request_id!r} at position {ctx.position})",
                request_id=ctx.request_id,
            )
    return keep
