"""``ModelRunner``: turns a ``SchedulerOutput`` into a forward pass and next-token logits.

It reads block tables and positions, never allocates pages. Decode steps capture the pre-RoPE
queries of every layer and update the query-state pool in place (paper appendix E.1: the
regular decode path only updates the two EMAs; the demand estimation runs at boundaries).
When the KV manager holds H2O sums, every step asks the backend to add its attention into
them (``ctx.accumulation``). When it holds a recent-query ring (SnapKV), every step writes its
captured queries there: a decode step all rows, a prefill the last W of each sequence.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import attrs
import torch

from growpage.engine.accumulation import AttentionAccumulation
from growpage.engine.backends import QueryStateFusion
from growpage.engine.context import (
    StepCapture,
    StepContext,
    decode_context,
    prefill_context,
    use_context,
)
from growpage.engine.kv_manager import KVCacheManager
from growpage.engine.model import CausalLM
from growpage.engine.recent_queries import prefill_rows
from growpage.engine.scheduler import SchedulerOutput
from growpage.engine.sequence import Sequence
from growpage.engine.transfer import to_device
from growpage.errors import EngineError

if TYPE_CHECKING:
    from growpage.engine.cuda_graphs import DecodeGraphs
    from growpage.engine.recorder import TraceRecorder


@attrs.define
class FusedStepContext(StepContext):
    """A decode context carrying the query-state update for a fusing backend (Triton)."""

    query_state: QueryStateFusion | None = None


@attrs.frozen
class DecodeRows:
    """Host metadata of a decode batch, one entry per sequence: its last token and position,
    the cache slot that token's KV goes to, its context length after the step, its
    query-state slot and whether this is its first decode step."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    lens: list[int]
    query_slots: list[int]
    first: list[bool]

    @classmethod
    def of(cls, kv: KVCacheManager, seqs: list[Sequence]) -> DecodeRows:
        b = kv.page_size
        slots = []
        for seq in seqs:
            i = seq.state.num_tokens - 1
            slots.append(seq.state.block_table[i // b] * b + i % b)
        return cls(
            [s.last_token_id for s in seqs],
            [s.state.position - 1 for s in seqs],
            slots,
            [s.state.num_tokens for s in seqs],
            query_slots(seqs),
            [s.num_decode_steps == 0 for s in seqs],
        )


def query_slots(seqs: list[Sequence]) -> list[int]:
    """The query-state slot of each running sequence."""
    slots = []
    for seq in seqs:
        assert seq.query_slot is not None, "a running sequence without a query slot"
        slots.append(seq.query_slot)
    return slots


class ModelRunner:
    """Runs the model over the paged cache of ``kv``."""

    def __init__(
        self, model: CausalLM, kv: KVCacheManager, recorder: TraceRecorder | None = None
    ) -> None:
        self.model, self.kv, self.recorder = model, kv, recorder
        self.device = kv.cache.device
        self.backend = model.backend
        self.fuses_query_state = bool(getattr(model.backend, "fuses_query_state", False))
        self.graphs: DecodeGraphs | None = None  # set by the engine with ``cuda_graphs``
        self.accumulation = (
            None if kv.accumulated is None else AttentionAccumulation(kv.accumulated, kv.cache)
        )
        model.bind_kv_cache(kv.cache)

    def claim_model(self) -> None:
        """Install this engine's KV cache and backend in the model, which another engine
        (another ``LLM`` over the same ``CausalLM``, the warm-up) may have bound since."""
        model = self.model
        if model.kv_cache is self.kv.cache and model.backend is self.backend:
            return
        weight = model.model.embed_tokens.weight
        if weight.device != self.device or weight.dtype != self.kv.cache.dtype:
            raise EngineError(
                f"the model is on {weight.device} in {weight.dtype}, this engine runs on "
                f"{self.device} in {self.kv.cache.dtype}: another LLM moved the shared "
                "CausalLM; give each device/dtype its own model"
            )
        model.set_backend(self.backend)
        model.bind_kv_cache(self.kv.cache)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> tuple[list[Sequence], torch.Tensor]:
        """Forward the step; returns the sequences that get a next token and their logits
        ``[B', V]`` (fp32): every decoded sequence, and prefills that reached their end."""
        self.claim_model()
        capture = StepCapture(record_kv=self.recorder is not None)
        if not out.is_prefill and self.graphs is not None and self.graphs.fits(list(out.seqs)):
            hidden, ctx = self.graphs.run(list(out.seqs))  # static buffers, bucket rows
            assert ctx.capture is not None  # a graph's context records every layer
            capture = ctx.capture
            positions = self.graphs.positions
        else:
            if out.is_prefill:
                ctx, ids, positions = self._prepare_prefill(out, capture)
            else:
                ctx, ids, positions = self._prepare_decode(out, capture)
            with use_context(ctx):
                hidden = self.model(ids, positions)
        if self.recorder is not None:
            self.recorder.record(out, capture)
        if out.is_prefill:
            if self.kv.recent is not None:
                self._write_recent_prefill(out, capture)
            done = [i for i, seq in enumerate(out.seqs) if not seq.is_prefilling]
            rows = ctx.last_token_indices()[done].to(self.device)
            seqs = [out.seqs[i] for i in done]
        else:
            self._update_query_state(out, capture, ctx, positions)
            rows, seqs = None, list(out.seqs)
        if not seqs:
            return [], hidden.new_zeros(0, 0)
        return seqs, self.model.compute_logits(hidden if rows is None else hidden[rows])

    def _tensor(
        self, values: Seq[int] | torch.Tensor, dtype: torch.dtype = torch.long
    ) -> torch.Tensor:
        return to_device(values, dtype, self.device)  # queued: no host sync on CUDA

    def _slot_ids(self, seqs: list[Sequence]) -> torch.Tensor:
        """``[B]`` query-state slot of each running sequence."""
        return self._tensor(query_slots(seqs))

    def _first_steps(self, seqs: list[Sequence]) -> torch.Tensor:
        """``[B]`` bool: the sequence's first decode step (its EMAs start from the query)."""
        return self._tensor([seq.num_decode_steps == 0 for seq in seqs], torch.bool)

    def _prepare_prefill(
        self, out: SchedulerOutput, capture: StepCapture
    ) -> tuple[StepContext, torch.Tensor, torch.Tensor]:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = []
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            end = seq.state.position
            start = end - n
            starts.append(start)
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += self.kv.slots(seq, start, n)  # no compaction before decoding: slot = position
        # Without a cached prefix the new keys are all there is: attend to them directly.
        tables = None if not any(starts) else self._tensor(self.kv.block_tables(list(out.seqs)))
        ctx = prefill_context(
            list(out.num_new_tokens),
            self._tensor(slots),
            tables,
            [seq.state.num_tokens for seq in out.seqs],
            capture=capture if self.recorder is not None or self.kv.recent is not None else None,
            accumulation=self.accumulation,
        )
        return ctx, self._tensor(ids), self._tensor(positions)

    def _prepare_decode(
        self, out: SchedulerOutput, capture: StepCapture
    ) -> tuple[StepContext, torch.Tensor, torch.Tensor]:
        seqs = list(out.seqs)
        rows = DecodeRows.of(self.kv, seqs)
        ctx = decode_context(
            self._tensor(rows.slots),
            self._tensor(self.kv.block_tables(seqs)),
            self._tensor(rows.lens),
            capture,
            max_seqlen_k=max(rows.lens, default=0),
            accumulation=self.accumulation,
        )
        if self.fuses_query_state:  # the backend updates the EMAs inside decode attention
            pool = self.kv.query_pool
            fusion = QueryStateFusion(
                pool.summaries,
                self._tensor(rows.query_slots),
                self._tensor(rows.first, torch.int32),  # int32: not converted in every layer
                self.kv.cache,
                pool.beta_short,
                pool.beta_long,
            )  # reused after the forward
            ctx = FusedStepContext(**attrs.asdict(ctx, recurse=False), query_state=fusion)
        return ctx, self._tensor(rows.ids), self._tensor(rows.positions)

    def _write_recent_prefill(self, out: SchedulerOutput, capture: StepCapture) -> None:
        """The last W new tokens' queries of each sequence of a prefill step into the ring."""
        assert self.kv.recent is not None
        rows, owners, positions = prefill_rows(
            list(out.num_new_tokens), [s.state.position for s in out.seqs], self.kv.recent.window
        )
        index = self._tensor(rows)
        queries = torch.stack(
            [capture.queries[i][index] for i in range(self.model.config.num_layers)]
        )
        slots = query_slots(list(out.seqs))
        self.kv.recent.write(
            self._tensor([slots[b] for b in owners]), self._tensor(positions), queries
        )

    def _update_query_state(
        self,
        out: SchedulerOutput,
        capture: StepCapture,
        ctx: StepContext,
        positions: torch.Tensor,
    ) -> None:
        num_layers, batch = self.model.config.num_layers, len(out.seqs)
        # [L, B, Hq, d]; a CUDA-graph step has more rows (its bucket's padding): the first B.
        queries = torch.stack([capture.queries[i][:batch] for i in range(num_layers)])
        fusion = getattr(ctx, "query_state", None)
        if fusion is not None:  # the same rows the kernel used: no second copy
            slots, first = fusion.slot_ids[:batch], fusion.is_first[:batch]
        else:
            slots, first = self._slot_ids(list(out.seqs)), self._first_steps(list(out.seqs))
        self.kv.query_pool.update(slots, queries, first, summaries=not self.fuses_query_state)
        if self.kv.recent is not None:
            self.kv.recent.write(slots, positions[:batch], queries)
        for seq in out.seqs:
            seq.num_decode_steps += 1
