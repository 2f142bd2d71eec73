"""Helpers for the engine's H2O tests: a policy that logs what it saw at each boundary, an fp32
recorder of every computed query and key, and the oracle: the simulator's ``TraceView`` replay
of the same rows, driven by the engine's own decisions."""

from __future__ import annotations

import attrs
import torch

from growpage.core.traces import Trace, TraceHeader
from growpage.engine.llm import LLM
from growpage.policies.builtin import GrowPagePolicy, H2OPolicy
from growpage.sim.traceview import TraceView


@attrs.define
class Seen:
    """One decided boundary: the sums and positions the policy read, the pages the request
    held, and the slots a compression kept (sorted, as the controller hands them on)."""

    request_id: str
    position: int
    sums: torch.Tensor
    positions: torch.Tensor
    pages: tuple[int, ...]
    keep: torch.Tensor | None = None


@attrs.define
class SpyH2O(H2OPolicy):
    """H2O (fixed budget, heavy hitters) logging every boundary the controller asks it about."""

    log: list[Seen] = attrs.field(factory=list)

    def decide(self, ctx):
        sums = ctx.accumulated_attention()
        assert sums is not None and sums.dtype == torch.float32
        self.log.append(
            Seen(
                str(ctx.request_id),
                ctx.position,
                sums.clone(),
                ctx.positions().clone(),
                tuple(ctx.view.seq.state.block_table),
            )
        )
        return super().decide(ctx)

    def select(self, ctx, keep):
        slots = super().select(ctx, keep)
        # Its own boundary's entry: with async compaction the selections of a step run after
        # all of its decisions, so the last entry may be another request's.
        seen = next(
            s
            for s in reversed(self.log)
            if (s.request_id, s.position) == (str(ctx.request_id), ctx.position)
        )
        seen.keep = slots.sort(dim=-1).values
        return slots

    def seen(self, request_id: str) -> list[Seen]:
        return [s for s in self.log if s.request_id == request_id]


@attrs.define
class SumsReadingGrowPage(GrowPagePolicy):
    """GrowPage that asks for the sums but never reads them: the engine records them while
    its decisions and selections stay GrowPage's."""

    needs_accumulated_attention = True


class RowRecorder:
    """Every computed row (pre-RoPE query, post-RoPE key, all layers) of each request in fp32,
    as ``TraceRecorder`` keeps them minus the fp16 rounding; a recompute after a preemption
    overwrites the rows from where it restarts, and notes how long the policy log was then."""

    def __init__(self, llm: LLM, spy: SpyH2O) -> None:
        self.llm, self.spy = llm, spy
        self.queries: dict[str, torch.Tensor] = {}  # request id -> [L, T, Hq, d]
        self.keys: dict[str, torch.Tensor] = {}  # request id -> [L, T, Hkv, d]
        self.restarts: dict[str, int] = {}  # request id -> len(spy.log) at a restart
        llm.engine.recorder = llm.engine.runner.recorder = self

    def record(self, out, capture) -> None:
        offset = 0
        layers = sorted(capture.queries)
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            rid, start = seq.request_id, seq.state.position - n
            new_q = torch.stack([capture.queries[i][offset : offset + n] for i in layers]).float()
            new_k = torch.stack([capture.keys[i][offset : offset + n] for i in layers]).float()
            old_q, old_k = self.queries.get(rid, new_q[:, :0]), self.keys.get(rid, new_k[:, :0])
            assert start <= old_q.shape[1], "skipped rows: prefix caching must be off"
            if start < old_q.shape[1]:
                self.restarts[rid] = len(self.spy.log)
            self.queries[rid] = torch.cat([old_q[:, :start], new_q], dim=1)
            self.keys[rid] = torch.cat([old_k[:, :start], new_k], dim=1)
            offset += n

    def finish(self, seq, extra_meta=None) -> None:
        pass

    def discard(self, seq) -> None:
        pass

    def trace(self, request_id: str, prompt_len: int) -> Trace:
        c = self.llm.model.config
        q, k = self.queries[request_id], self.keys[request_id]
        header = TraceHeader(
            request_id=request_id,
            model=c.name,
            num_layers=c.num_layers,
            layer_ids=tuple(range(c.num_layers)),
            num_q_heads=c.num_q_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            rope=c.rope,
            softmax_scale=c.head_dim**-0.5,
            prompt_len=prompt_len,
            token_ids=tuple([3] * q.shape[1]),
            has_values=False,
        )
        return Trace(header=header, queries=q, keys=k)


def check_against_simulator(
    llm: LLM, spy: SpyH2O, rows: RowRecorder, request_id: str, prompt_len: int, atol: float = 1e-4
) -> int:
    """Replay ``request_id``'s rows in a ``TraceView`` (H2O sums on), taking the engine's
    decisions, and compare positions and sums at every boundary of its last residency.
    Returns the number of boundaries compared."""
    view = TraceView(
        rows.trace(request_id, prompt_len), llm.config.growpage, track_accumulated=True
    )
    since = rows.restarts.get(request_id, 0)
    seen = [s for s in spy.log[since:] if s.request_id == request_id]
    for s in seen:
        view.prepare_boundary(s.position)
        assert torch.equal(view.positions(), s.positions), (request_id, s.position)
        torch.testing.assert_close(
            s.sums,
            view.accumulated_attention(),
            atol=atol,
            rtol=1e-4,
            msg=lambda m, at=s.position: f"{request_id} at {at}: {m}",
        )
        if s.keep is not None:
            view.compact(s.keep, [], [])
    return len(seen)
