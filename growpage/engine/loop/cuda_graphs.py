"""CUDA-graph replay of decode steps for fixed batch-size buckets (beyond the paper).

A decode step of a small model is bound by the host: per layer some 25 torch operators and
three Triton launches, each a few microseconds of Python and driver work, while the GPU needs
less. With ``LLM(cuda_graphs=True)`` (Triton backend on CUDA) the runner captures the decode
forward pass once per batch bucket and then replays it: the host fills static input buffers
and launches one graph.

Static buffers, rows padded to the bucket (``B <= bucket``)::

    input ids, positions     [Bmax]      padding 0
    slot mapping             [Bmax]      -1: the KV store skips the row
    context lengths          [Bmax]      0: attention over nothing (zeros)
    block tables             [Bmax, W]   -1; one buffer per width bucket W (a power of two of
                                         pages, at least the batch's longest block table)
    query slots, first flags [Bmax]      -1 / 0: the fused EMA update skips the row

Padding rows therefore write nothing: not the KV cache, not the query-state pool, not the H2O
sums (the accumulation kernel skips a row of length 0). Launch shapes
depend only on the batch bucket and W, which is what a graph needs (the decode kernel's split
count comes from them): one graph per (batch bucket, width bucket) met. A batch above the
largest bucket, or a block table longer than the pool or the model allows, runs eagerly.

``capture=False`` runs the same static-shape forward eagerly, without a graph: the CPU tests use
it to check the padding and the buffers against the ordinary decode path.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import attrs
import torch

from growpage.engine.loop.sequence import Sequence
from growpage.engine.loop.transfer import copy_into
from growpage.engine.modeling.backends import QueryStateFusion
from growpage.engine.modeling.step_context import (
    StepCapture,
    StepContext,
    decode_context,
    use_context,
)

if TYPE_CHECKING:
    from growpage.engine.loop.model_runner import ModelRunner


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8, up to and including ``max_batch``."""
    small = [b for b in (1, 2, 4) if b < max_batch]
    return tuple(small + list(range(8, max_batch, 8)) + [max_batch])


@attrs.define
class _Entry:
    bucket: int
    width: int
    ctx: StepContext
    graph: torch.cuda.CUDAGraph | None = None  # when captured
    hidden: torch.Tensor | None = None  # the graph's output [bucket, hidden]


class DecodeGraphs:
    """Captured (or, with ``capture=False``, eagerly run) static-shape decode forwards."""

    def __init__(self, runner: ModelRunner, max_batch: int, capture: bool = True) -> None:
        kv, model = runner.kv, runner.model
        if capture and not kv.cache.is_cuda:
            raise RuntimeError("CUDA graphs need the KV cache on a CUDA device")
        if not runner.fuses_query_state:
            raise RuntimeError(
                "CUDA graphs need an attention backend that fuses the query-state "
                "update (the Triton backend)"
            )
        self.runner, self.capture = runner, capture
        self.buckets = batch_buckets(max_batch)
        self.page_size = kv.page_size
        self.max_width = min(
            kv.num_pages, math.ceil((model.config.max_position + 1) / kv.page_size)
        )
        device, rows = kv.cache.device, self.buckets[-1]
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.lens = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_ids = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.first = torch.zeros(rows, dtype=torch.int32, device=device)
        self._tables: dict[int, torch.Tensor] = {}  # width bucket -> [rows, width] page ids
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    @property
    def num_captured(self) -> int:
        return sum(1 for e in self._entries.values() if e.graph is not None)

    def bucket(self, batch: int) -> int | None:
        """The smallest bucket holding ``batch`` rows; None above the largest."""
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def width(self, num_pages: int) -> int:
        """The width bucket of block tables with at most ``num_pages`` pages."""
        return min(1 << max(num_pages - 1, 0).bit_length(), self.max_width)

    def fits(self, seqs: list[Sequence]) -> bool:
        return (
            self.bucket(len(seqs)) is not None
            and max((s.state.num_pages for s in seqs), default=0) <= self.max_width
        )

    def run(self, seqs: list[Sequence]) -> tuple[torch.Tensor, StepContext]:
        """The decode forward of ``seqs`` (call ``fits`` first): hidden states ``[B, hidden]``
        and the bucket's step context (its capture holds the pre-RoPE queries, bucket rows)."""
        bucket = self.bucket(len(seqs))
        assert bucket is not None
        width = self.width(max(s.state.num_pages for s in seqs))
        entry = self._entries.get((bucket, width))
        if entry is None:
            entry = self._entries[bucket, width] = self._build(bucket, width)
        self._fill(seqs, bucket, width)
        if entry.graph is not None:
            assert entry.hidden is not None  # captured with the graph
            entry.graph.replay()
            hidden = entry.hidden
        else:
            hidden = self._forward(entry.ctx, bucket)
        return hidden[: len(seqs)], entry.ctx

    # ---- internals ------------------------------------------------------------------------
    def _fill(self, seqs: list[Sequence], bucket: int, width: int) -> None:
        """Rows ``0..B-1`` from ``seqs``, rows ``B..bucket-1`` padding; one queued copy each."""
        from growpage.engine.loop.model_runner import DecodeRows

        rows, pad = DecodeRows.of(self.runner.kv, seqs), bucket - len(seqs)
        tables = [s.state.block_table + [-1] * (width - s.state.num_pages) for s in seqs]
        for dst, values, padding in (
            (self.ids, rows.ids, 0),
            (self.positions, rows.positions, 0),
            (self.slots, rows.slots, -1),
            (self.lens, rows.lens, 0),
            (self.slot_ids, rows.query_slots, -1),
            (self.first, rows.first, 0),
            (self._table(width), tables, [-1] * width),
        ):
            copy_into(dst, values + [padding] * pad)

    def _table(self, width: int) -> torch.Tensor:
        table = self._tables.get(width)
        if table is None:
            table = self._tables[width] = torch.full(
                (self.buckets[-1], width), -1, dtype=torch.long, device=self.ids.device
            )
        return table

    def _context(self, bucket: int, width: int) -> StepContext:
        from growpage.engine.loop.model_runner import FusedStepContext

        kv = self.runner.kv
        ctx = decode_context(
            self.slots[:bucket],
            self._table(width)[:bucket],
            self.lens[:bucket],
            StepCapture(),
            max_seqlen_k=width * self.page_size,
            accumulation=self.runner.accumulation,
        )
        fusion = QueryStateFusion(
            kv.query_pool.summaries,
            self.slot_ids[:bucket],
            self.first[:bucket],
            kv.cache,
            kv.query_pool.beta_short,
            kv.query_pool.beta_long,
        )
        return FusedStepContext(**attrs.asdict(ctx, recurse=False), query_state=fusion)

    def _forward(self, ctx: StepContext, bucket: int) -> torch.Tensor:
        with use_context(ctx):
            return self.runner.model(self.ids[:bucket], self.positions[:bucket])

    def _build(self, bucket: int, width: int) -> _Entry:
        ctx = self._context(bucket, width)
        if not self.capture:
            return _Entry(bucket, width, ctx)
        # All rows padding: the warm-up and capture runs write neither the cache nor the
        # query-state pool.
        self._fill([], bucket, width)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # lazy initialisations happen outside the capture
                self._forward(ctx, bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = self._forward(ctx, bucket)
        return _Entry(bucket, width, ctx, graph, hidden)
