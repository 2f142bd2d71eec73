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
from typing import TYPE_CHECKING, Any

import attrs
import torch

from growpage.engine.loop.kv_manager import KVCacheManager
from growpage.engine.loop.recent_queries import prefill_rows
from growpage.engine.loop.scheduler import SchedulerOutput
from growpage.engine.loop.sequence import Sequence
from growpage.engine.loop.transfer import to_device
from growpage.engine.modeling.accumulation import AttentionAccumulation
from growpage.engine.modeling.backends import QueryStateFusion
from growpage.engine.modeling.model import CausalLM
from growpage.engine.modeling.step_context import (
    StepCapture,
    StepContext,
    prefill_context,
    use_context,
)
from growpage.errors import EngineError

if TYPE_CHECKING:
    from growpage.engine.loop.cuda_graphs import DecodeGraphs
    from growpage.engine.loop.recorder import TraceRecorder


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
    def of(cls, kv: KVCacheManager, seqs: Seq[Sequence]) -> DecodeRows:
        b = kv.page_size
        states = [s.state for s in seqs]
        lens = [st.num_tokens for st in states]
        return cls(
            [s.last_token_id for s in seqs],
            [st.position - 1 for st in states],
            [
                st.block_table[(n - 1) // b] * b + (n - 1) % b
                for st, n in zip(states, lens, strict=True)
            ],
            lens,
            query_slots(seqs),
            [kv.query_pool.is_first(s.num_decode_steps) for s in seqs],
        )

    def packed(self, tables: list[list[int]]) -> tuple[list[int], int]:
        """Every row and the block tables (``-1`` padded) as one flat list, for one tensor and
        one host-to-device copy; and the tables' width. Layout: ids, positions, slots, lens,
        query slots, first flags, each padded to an even length (so that every row starts
        16-byte aligned, as a tensor of its own would: kernels are specialized on it), then
        the ``[B, width]`` tables."""
        width = max(map(len, tables), default=0)
        pad = [0] * (len(self.ids) % 2)
        flat = [*self.ids, *pad, *self.positions, *pad, *self.slots, *pad, *self.lens, *pad]
        flat += [*self.query_slots, *pad, *self.first, *pad]
        for table in tables:
            flat += table
            if len(table) < width:
                flat += [-1] * (width - len(table))
        return flat, width


@attrs.frozen
class DecodeInputs:
    """Device tensors of a decode step, views of one packed copy (``DecodeRows.packed``)."""

    ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slots: torch.Tensor  # [B] int64, the new token's cache slot
    lens: torch.Tensor  # [B] int64
    query_slots: torch.Tensor  # [B] int64
    first: torch.Tensor  # [B] int64, 1 on a sequence's first decode step
    block_tables: torch.Tensor  # [B, width] int64, -1 padded

    @classmethod
    def of(cls, packed: torch.Tensor, batch: int, width: int) -> DecodeInputs:
        stride = batch + batch % 2
        rows = packed[: 6 * stride].view(6, stride)[:, :batch]
        ids, positions, slots, lens, query_slots, first = rows
        tables = packed[6 * stride :].view(batch, width)
        return cls(ids, positions, slots, lens, query_slots, first, tables)


def query_slots(seqs: Seq[Sequence]) -> list[int]:
    """The query-state slot of each running sequence."""
    slots = [seq.query_slot for seq in seqs]
    if None in slots:
        raise AssertionError("a running sequence without a query slot")
    return slots  # type: ignore[return-value]


def slot_range(slots: list[int]) -> slice | None:
    """``slice(a, a + B)`` when ``slots`` are ``a, a + 1, ..., a + B - 1``, else None."""
    if (
        slots
        and slots[-1] - slots[0] == len(slots) - 1
        and slots == list(range(slots[0], slots[-1] + 1))
    ):
        return slice(slots[0], slots[-1] + 1)
    return None


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
        self._step_rows: tuple[DecodeInputs, DecodeRows] | None = None  # the decode step's
        self._queries: torch.Tensor | None = None  # stacked queries (``_queries_buffer``)
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
        seqs = out.seqs
        rows = DecodeRows.of(self.kv, seqs)
        flat, width = rows.packed([s.state.block_table for s in seqs])
        inputs = DecodeInputs.of(self._tensor(flat), len(seqs), width)  # one copy
        self._step_rows = (inputs, rows)
        fields: dict[str, Any] = dict(
            is_prefill=False,
            slot_mapping=inputs.slots,
            block_tables=inputs.block_tables,
            context_lens=inputs.lens,
            max_seqlen_q=1,
            max_seqlen_k=max(rows.lens, default=0),
            capture=capture,
            accumulation=self.accumulation,
        )
        if not self.fuses_query_state:
            return StepContext(**fields), inputs.ids, inputs.positions
        pool = self.kv.query_pool
        fusion = QueryStateFusion(  # the backend updates the EMAs inside decode attention
            pool.summaries,
            inputs.query_slots,
            inputs.first.to(torch.int32),  # int32: not converted in every layer
            self.kv.cache,
            pool.beta_short,
            pool.beta_long,
        )  # reused after the forward
        return FusedStepContext(**fields, query_state=fusion), inputs.ids, inputs.positions

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
        pool = self.kv.query_pool
        consecutive = slot_range(query_slots(out.seqs))  # slots a..a+B-1: no gather/scatter
        # [L, B, Hq, d]; a CUDA-graph step has more rows (its bucket's padding): the first B.
        layers = [capture.queries[i][:batch] for i in range(num_layers)]
        if consecutive is not None and layers[0].dtype == pool.current.dtype:
            target = pool.current[:, consecutive]  # stacked where the pool keeps them
        else:
            target = self._queries_buffer(layers[0], batch)
        queries = torch.stack(layers, out=target)
        fusion = getattr(ctx, "query_state", None)
        if fusion is not None:  # the same rows the kernel used: no second copy
            slots = fusion.slot_ids[:batch]
            pool.update(consecutive or slots, queries, fusion.is_first[:batch], summaries=False)
        else:
            assert self._step_rows is not None  # set by _prepare_decode in this step
            inputs, rows = self._step_rows
            slots = inputs.query_slots
            first = inputs.first.bool()
            pool.update(consecutive or slots, queries, first, any_first=any(rows.first))
        if self.kv.recent is not None:
            self.kv.recent.write(slots, positions[:batch], queries)
        for seq in out.seqs:
            seq.num_decode_steps += 1

    def _queries_buffer(self, like: torch.Tensor, batch: int) -> torch.Tensor:
        """``[L, *like.shape]`` storage for a step's stacked queries (``like``: one layer's
        ``[B, Hq, d]``), allocated once (no per-step allocation)."""
        num_layers = self.model.config.num_layers
        n = num_layers * like.numel()
        buf = self._queries
        if buf is None or buf.dtype != like.dtype or buf.device != like.device or buf.numel() < n:
            rows = max(batch, self.kv.query_pool.max_slots)
            buf = self._queries = like.new_empty(n // batch * rows)
        return buf[:n].view(num_layers, *like.shape)
