"""Compile the engine's Triton kernels before it serves (``LLM(warmup=...)``).

Triton compiles a kernel the first time it is launched with a new specialization key
(``growpage.kernels.variants``). The kernels keep per-step and per-boundary quantities out of
their keys, so an engine needs only a few variants: decode attention with and without split-K,
the KV store, the boundary queries, the two demand kernels and the three compaction routes
(direct, stage-out, stage-in); for a policy that reads H2O sums, also the accumulation kernel,
with the compaction routes that move the sums. Compiled lazily, each would stall the step
that first needs it by a fraction of a second to seconds: the first compression of a run, the
first step whose batch shrinks enough to split the context. ``warm_up`` launches every one of
them once, through the engine's own call sites, in a scratch engine that shares the model
(its own small KV cache, query-state pool and page pool), so the real engine's state is
untouched.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import attrs
import torch

from growpage.core.boundary_context import BoundaryContext
from growpage.core.decision import Decision
from growpage.engine.loop.paged_kv_view import boundary_kernels_on
from growpage.engine.sampling_params import SamplingParams
from growpage.policies.base import CapacityPolicy

if TYPE_CHECKING:
    from growpage.engine.loop.llm_engine import LLMEngine
    from growpage.engine.loop.sequence import Sequence


@attrs.frozen
class WarmupReport:
    """What ``warm_up`` did: launch keys per kernel (``variants``) and its wall time."""

    seconds: float = 0.0
    variants: dict[str, int] = attrs.field(factory=dict)
    launches: int = 0

    @property
    def ran(self) -> bool:
        return bool(self.variants)


class _CompressAtEveryBoundary(CapacityPolicy):
    """Reads the demand signals (boundary queries + demand kernels), then compresses
    (GrowPage selection + compaction)."""

    name = "warmup"

    def decide(self, ctx: BoundaryContext) -> Decision:
        ctx.delta()
        return Decision.COMPRESS


class _CompressWithSums(_CompressAtEveryBoundary):
    """The same, recording H2O sums: the accumulation kernel runs in decode and compaction
    moves the sums (the variants of an engine whose policy reads them)."""

    needs_accumulated_attention = True


def uses_kernels(engine: LLMEngine) -> tuple[bool, bool]:
    """(decode path, boundary path) of ``engine`` that run Triton kernels."""
    decode = bool(getattr(engine.model.backend, "fuses_query_state", False))
    return decode, boundary_kernels_on(engine.config.boundary_kernels, engine.kv.cache)


def warm_up(engine: LLMEngine) -> WarmupReport:
    """Launch every Triton kernel variant ``engine`` can need, once (compiling it on a GPU).

    Nothing of ``engine`` changes; the model is bound back to its KV cache and backend.
    """
    from growpage.engine.loop.llm_engine import LLMEngine
    from growpage.engine.modeling.triton_backend import TritonAttentionBackend
    from growpage.kernels.variants import record_variants

    decode, boundary = uses_kernels(engine)
    if not (decode or boundary):
        return WarmupReport()
    start = time.perf_counter()
    b = engine.config.page_size
    gp = engine.config.growpage.replace(min_capacity=2, watermark=0)
    config = attrs.evolve(
        engine.config,
        growpage=gp,
        kv_pages=4,
        kv_cache_memory=None,
        max_num_seqs=1,
        enable_prefix_caching=False,
        record_traces=None,
        warmup=False,
        cuda_graphs=False,
    )
    backend = engine.model.backend
    # Decode kernels: the Triton backend (the one that fuses the query-state update).
    split_k = backend if decode and isinstance(backend, TritonAttentionBackend) else None
    saved_splits = None if split_k is None else split_k.num_splits
    try:
        policy = (
            _CompressWithSums() if engine.kv.accumulated is not None else _CompressAtEveryBoundary()
        )
        scratch = LLMEngine(engine.model, config, policy)
        with record_variants() as log:
            # Prompt 2b - 1: the first decode fills two pages, the second meets a boundary
            # with history (one page of candidates) and compresses.
            length = max(1, min(2 * b - 1, engine.model.config.max_position - 6))
            prompt = [i % engine.model.config.vocab_size for i in range(3, 3 + length)]
            params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
            for splits in (1, 2) if decode else (None,):
                if split_k is not None:
                    split_k.num_splits = splits
                seq = scratch.add_request(f"warmup-{splits}", prompt, params)
                while scratch.has_unfinished():
                    if boundary and seq.state.num_pages == 2 and seq.has_query_state:
                        _staged_compaction(scratch, seq)
                        boundary = False
                    scratch.step()
    finally:
        if split_k is not None:
            split_k.num_splits = saved_splits
        engine.runner.claim_model()
    if engine.kv.cache.is_cuda:
        torch.cuda.synchronize(engine.kv.cache.device)
    return WarmupReport(time.perf_counter() - start, log.counts(), log.launches)


def _staged_compaction(scratch: LLMEngine, seq: Sequence) -> None:
    """The staged compaction route (destination pages in another order), which a run takes
    only when a shrink releases a shared page from the middle of a block table."""
    view = scratch.kv.view(seq, use_kernels=True)
    n = view.num_tokens
    keep = torch.arange(n, device=view.device).expand(view.num_layers, view.num_kv_heads, n)
    pages = list(seq.state.block_table)
    view.compact(keep, pages, pages[::-1])
