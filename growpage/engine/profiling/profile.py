"""Step-time measurements of the local engine, for ``growpage calibrate``.

Each row is one timed forward pass (model + logits of the last tokens) through the engine's paged
attention backend: a decode step of ``num_seqs`` sequences reading ``kv_tokens`` cached tokens in
total, or a prefill of ``prefill_tokens`` prompt tokens. The cache content is zeros: step time
does not depend on it. ``growpage.sim.calibrate.fit_linear`` turns the rows into a cost model.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from growpage.engine.modeling.attention import allocate_kv_cache
from growpage.engine.modeling.backends import make_attention_backend
from growpage.engine.modeling.model import CausalLM
from growpage.engine.modeling.step_context import (
    StepContext,
    decode_context,
    prefill_context,
    use_context,
)

if TYPE_CHECKING:
    from growpage.policies.base import CapacityPolicy

PAGE_SIZE = 64  # tokens per page of the measurement cache


def _timed(
    model: CausalLM,
    ids: torch.Tensor,
    positions: torch.Tensor,
    ctx: StepContext,
    last: torch.Tensor,
    repeats: int,
) -> float:
    best = float("inf")
    with torch.inference_mode(), use_context(ctx):
        for _ in range(repeats + 1):  # the first run warms up
            start = time.perf_counter()
            model.compute_logits(model(ids, positions)[last])
            best = min(best, time.perf_counter() - start)
    return best


def _decode_row(model: CausalLM, num_seqs: int, context: int, repeats: int) -> dict:
    pages_per_seq = -(-context // PAGE_SIZE)
    tables = torch.arange(num_seqs * pages_per_seq).reshape(num_seqs, pages_per_seq)
    lens = torch.full((num_seqs,), context)
    slots = tables[:, (context - 1) // PAGE_SIZE] * PAGE_SIZE + (context - 1) % PAGE_SIZE
    ctx = decode_context(slots, tables, lens)
    ids = torch.zeros(num_seqs, dtype=torch.long)
    step_s = _timed(model, ids, lens - 1, ctx, torch.arange(num_seqs), repeats)
    return {
        "num_seqs": num_seqs,
        "kv_tokens": num_seqs * context,
        "prefill_tokens": 0,
        "step_s": step_s,
    }


def _prefill_row(model: CausalLM, shape: int | tuple[int, int], repeats: int) -> dict:
    """A prefill of ``shape`` tokens (one sequence) or ``(num_seqs, tokens)``: ``tokens`` in
    all, split as evenly as possible over ``num_seqs`` sequences, each with its own logits. The
    row's ``num_seqs`` is 0 either way, as the simulator prices a prefill-only step
    (``CostModel.prefill_time``: by its tokens alone), so the fit's ``per_seq_s`` is a decode
    sequence's cost and the prefill rows do not carry one the simulator never charges."""
    num_seqs, tokens = (1, shape) if isinstance(shape, int) else shape
    if not 1 <= num_seqs <= tokens:
        raise ValueError(f"prefill shape {shape!r}: need 1 <= num_seqs <= tokens")
    lens = [tokens // num_seqs + (i < tokens % num_seqs) for i in range(num_seqs)]
    ctx = prefill_context(lens, slot_mapping=torch.arange(tokens))
    ids = torch.zeros(tokens, dtype=torch.long)
    positions = torch.cat([torch.arange(n) for n in lens])
    last = torch.cumsum(torch.tensor(lens), 0) - 1
    step_s = _timed(model, ids, positions, ctx, last, repeats)
    return {"num_seqs": 0, "kv_tokens": 0, "prefill_tokens": tokens, "step_s": step_s}


def measure_step_times(
    model: str | Path | CausalLM | None = None,
    batch_sizes: Sequence[int] = (1, 4, 16),
    contexts: Sequence[int] = (128, 512, 1024),
    prefills: Sequence[int | tuple[int, int]] = (64, 256, (16, 1024)),
    repeats: int = 2,
    progress: bool = True,
) -> list[dict]:
    """Time decode steps over ``batch_sizes x contexts`` and prefills of ``prefills`` tokens
    (an int: one sequence; ``(num_seqs, tokens)``: a batch of that many prompts, ``tokens`` in
    all, as a workload's admission step prefills them).

    Returns rows ``{num_seqs, kv_tokens, prefill_tokens, step_s}`` (best of ``repeats``).
    """
    if not isinstance(model, CausalLM):
        from growpage.engine.loading.loader import load_model

        model = load_model(model, backend=make_attention_backend("auto", "cpu"))
    cfg = model.config
    most = max((p if isinstance(p, int) else p[1] for p in prefills), default=0)
    num_pages = max(max(batch_sizes) * -(-max(contexts) // PAGE_SIZE), -(-most // PAGE_SIZE))
    device = next(model.parameters()).device
    model.bind_kv_cache(
        allocate_kv_cache(
            cfg.num_layers,
            num_pages,
            PAGE_SIZE,
            cfg.num_kv_heads,
            cfg.head_dim,
            next(model.parameters()).dtype,
            device,
        )
    )
    decodes = [(b, c) for b in batch_sizes for c in contexts]
    rows = []
    with tqdm(
        total=len(decodes) + len(prefills), desc="calibrate", unit="shape", disable=not progress
    ) as bar:
        for num_seqs, context in decodes:
            rows.append(_decode_row(model, num_seqs, context, repeats))
            bar.update()
        for shape in prefills:
            rows.append(_prefill_row(model, shape, repeats))
            bar.update()
    model.bind_kv_cache(None)
    return rows


def decode_pads_kv(model: CausalLM | None = None) -> bool:
    """Whether the decode steps ``measure_step_times`` times pad each sequence's KV to the
    longest in the batch (``AttentionBackend.pads_decode``): ``model``'s backend, or the one it
    loads (``auto`` on the CPU: torch, which pads)."""
    backend = (
        model.backend if isinstance(model, CausalLM) else make_attention_backend("auto", "cpu")
    )
    return bool(backend.pads_decode)


def measure_boundary_costs(
    model: str | Path | CausalLM | None = None,
    num_requests: int = 6,
    max_tokens: int = 96,
    page_size: int = 16,
    policy: str | CapacityPolicy = "growpage",
    progress: bool = True,
) -> dict[str, float]:
    """Seconds of capacity control on the local engine, for the simulator's cost model
    (``CostModel.boundary_time``): per decode step that decides, ``boundary_step_s`` plus
    ``boundary_s`` per decision; per step that compacts, ``compaction_step_s`` plus
    ``compaction_s`` per compaction (the engine handles a step's boundaries together).

    What a decision costs depends on the policy (``fullkv`` reads nothing, ``growpage``
    estimates demand), so price the policy you simulate. Runs ``policy`` (a name or an
    instance) on ``num_requests`` random prompts in a pool with room for 40% of what they
    would need at full length (so that requests both grow and compress), splits each step's
    boundary time by phase (``growpage.engine.profiling.boundary_profile``: the selections,
    their check and the compactions are the compaction part) and fits both parts by least
    squares over the steps (``fit_step_prices``).
    Returns the four prices and ``decided``, ``compactions`` and ``steps`` counts.
    """
    from growpage.engine.profiling.boundary_profile import profile_boundaries
    from growpage.engine.sampling_params import SamplingParams

    llm, prompts = _squeezed(model, num_requests, max_tokens, page_size, policy)
    with profile_boundaries(llm) as phases:
        steps = _boundary_steps(llm, phases)
        llm.generate(
            prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=progress
        )
    decided = [row[0] for row in steps]
    compacted = [row[1] for row in steps]
    deciding = fit_step_prices(decided, [row[2] for row in steps])
    compacting = fit_step_prices(compacted, [row[3] for row in steps])
    return {
        "boundary_s": deciding[1],
        "boundary_step_s": deciding[0],
        "compaction_s": compacting[1],
        "compaction_step_s": compacting[0],
        "decided": sum(decided),
        "compactions": sum(compacted),
        "steps": sum(1 for d in decided if d),
    }


def _squeezed(
    model: str | Path | CausalLM | None,
    num_requests: int,
    max_tokens: int,
    page_size: int,
    policy: str | CapacityPolicy,
) -> tuple[Any, list[list[int]]]:
    """An ``LLM`` whose pool holds 40% of what ``num_requests`` requests of ``max_tokens``
    need (so that they both grow and compress), and their random prompts."""
    import random

    from growpage.engine.llm import LLM

    rng = random.Random(0)
    llm = LLM(
        model,
        policy=policy,
        page_size=page_size,
        max_num_seqs=num_requests,
        kv_pages=max(num_requests * -(-(max_tokens + 48) // page_size) * 2 // 5, 8),
        min_capacity=2,
        enable_prefix_caching=False,
        warmup=False,
    )
    vocab = llm.engine.model.config.vocab_size
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randrange(16, 48))] for _ in range(num_requests)
    ]
    return llm, prompts


COMPACTION_PHASES = ("select", "check", "compact")


def _boundary_steps(llm: Any, phases: Any) -> list[tuple[int, int, float, float]]:
    """Wraps ``llm``'s engine step: each step's ``(decided, compactions, decision seconds,
    compaction seconds)`` is appended to the returned list (steps with no boundary work
    left out)."""
    engine = llm.engine
    step = engine.step
    rows: list[tuple[int, int, float, float]] = []
    events = engine.kv.controller.events

    def counted() -> Any:
        before = (_decided(events), events.compress + events.shrink, dict(phases.seconds))
        try:
            return step()
        finally:
            seconds = {k: v - before[2][k] for k, v in phases.seconds.items()}
            compacting = sum(seconds[p] for p in COMPACTION_PHASES)
            decided = _decided(events) - before[0]
            compactions = events.compress + events.shrink - before[1]
            if decided or compactions:
                rows.append((decided, compactions, sum(seconds.values()) - compacting, compacting))

    engine.step = counted
    return rows


def _decided(events: Any) -> int:
    return int(events.decided_grow + events.decided_compress + events.decided_shrink)


def fit_step_prices(counts: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """``(per_step, per_item)`` seconds, both >= 0, that best give ``seconds[i]`` as
    ``per_step + per_item * counts[i]`` over the steps with ``counts[i] > 0`` (least squares;
    one price alone where the counts cannot tell them apart or the other would be negative).
    """
    import numpy as np

    rows = [(n, t) for n, t in zip(counts, seconds, strict=True) if n > 0]
    if not rows:
        return 0.0, 0.0
    n = np.array([r[0] for r in rows], dtype=np.float64)
    t = np.array([r[1] for r in rows], dtype=np.float64)
    if len(set(n.tolist())) > 1:
        (per_step, per_item), *_ = np.linalg.lstsq(np.stack([np.ones_like(n), n], 1), t)
        if per_step >= 0 and per_item >= 0:
            return float(per_step), float(per_item)
        if per_item < 0:
            return float(max(t.mean(), 0.0)), 0.0
    return 0.0, float(max(t.sum() / n.sum(), 0.0))
