"""pytest-benchmark micro-benchmarks of the kernels (tiny shapes on CPU, Llama-8B-like on GPU).

pytest benchmarks/kernels_micro.py --benchmark-only
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gpu_check import ensure_kernels_importable  # noqa: E402

ensure_kernels_importable()

from growpage.kernels import (  # noqa: E402
    compact_kv,
    demand_attention,
    paged_decode_attention,
    store_kv,
    update_query_state,
)

DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
DTYPE = torch.bfloat16
# (batch, context, Hq, Hkv, d, page_size, layers)
SHAPE = (64, 4096, 32, 8, 128, 256, 32) if ON_CUDA else (2, 24, 4, 2, 16, 8, 2)


def synced(fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        fn()
        if ON_CUDA:
            torch.cuda.synchronize()

    return run


@pytest.fixture(scope="module")
def decode_inputs():
    batch, context, num_heads, num_kv, dim, page, _ = SHAPE
    pages = batch * -(-context // page)
    k_cache = torch.randn(pages, page, num_kv, dim, dtype=DTYPE, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(pages, device=DEVICE).to(torch.int32).view(batch, -1)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, num_heads, dim, dtype=DTYPE, device=DEVICE)
    return q, k_cache, v_cache, tables, lens


def ema_args(batch: int, num_heads: int, dim: int) -> dict:
    return dict(
        q_pre=torch.randn(batch, num_heads, dim, dtype=DTYPE, device=DEVICE),
        query_state=torch.zeros(batch, 2, num_heads, dim, device=DEVICE),
        slot_ids=torch.arange(batch, dtype=torch.int32, device=DEVICE),
        is_first=torch.zeros(batch, dtype=torch.int32, device=DEVICE),
    )


def test_decode(benchmark, decode_inputs) -> None:
    benchmark(synced(lambda: paged_decode_attention(*decode_inputs)))


def test_decode_fused_ema(benchmark, decode_inputs) -> None:
    ema = ema_args(*decode_inputs[0].shape)
    benchmark(synced(lambda: paged_decode_attention(*decode_inputs, **ema)))


def test_ema_unfused(benchmark, decode_inputs) -> None:
    ema = ema_args(*decode_inputs[0].shape)
    args = (ema["q_pre"], ema["query_state"], ema["slot_ids"], ema["is_first"])
    benchmark(synced(lambda: update_query_state(*args)))


def test_store_kv(benchmark, decode_inputs) -> None:
    _, k_cache, v_cache, _, _ = decode_inputs
    batch = decode_inputs[0].shape[0]
    key = torch.randn(batch, *k_cache.shape[2:], dtype=DTYPE, device=DEVICE)
    slots = torch.randperm(k_cache.shape[0] * k_cache.shape[1], device=DEVICE)[:batch]
    benchmark(synced(lambda: store_kv(key, key, k_cache, v_cache, slots)))


@pytest.fixture(scope="module")
def boundary_inputs():
    _, context, num_heads, num_kv, dim, page, layers = SHAPE
    pages = -(-context // page)
    kv_cache = torch.randn(2, layers, pages, page, num_kv, dim, dtype=DTYPE, device=DEVICE)
    table = torch.randperm(pages, device=DEVICE).to(torch.int32)
    scores = torch.rand(layers, num_kv, context, device=DEVICE)
    keep = scores.topk((pages - 1) * page, dim=-1).indices.sort(-1).values.to(torch.int32)
    queries = torch.randn(2, layers, num_heads, dim, device=DEVICE)
    return kv_cache, table, keep, queries, context - page


def test_compaction_in_place(benchmark, boundary_inputs) -> None:
    kv_cache, table, keep, _, _ = boundary_inputs
    benchmark(synced(lambda: compact_kv(kv_cache, table[None], keep[None], staged=False)))


def test_demand_attention(benchmark, boundary_inputs) -> None:
    kv_cache, table, _, queries, num_candidates = boundary_inputs
    benchmark(synced(lambda: demand_attention(queries, kv_cache[0], table, num_candidates)))


if __name__ == "__main__":
    raise SystemExit(
        "kernels_micro.py: pytest-benchmark tests, not a script; run "
        "pytest benchmarks/kernels_micro.py --benchmark-only"
    )
