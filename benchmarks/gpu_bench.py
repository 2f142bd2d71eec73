"""Measurements behind ``gpu_check.py``: decode bandwidth, EMA fusion cost, boundary work.

Every function takes a ``Shapes`` (full size on GPU, tiny under ``--smoke``) and returns plain
dicts for the JSON report. Times are medians in milliseconds.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from growpage.kernels import (
    compact_kv,
    demand_attention,
    demand_attention_batch,
    demand_splits,
    estimate_demand,
    paged_decode_attention,
    update_query_state,
    working_set_sizes,
)

# Peak HBM bandwidth in GB/s by device-name fragment (first match wins).
PEAK_GBPS = {
    "H200": 4800.0,
    "H100": 3350.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB": 2039.0,
    "A100": 1555.0,
    "L40S": 864.0,
    "A10G": 600.0,
}


@dataclass(frozen=True)
class Shapes:
    num_heads: int = 32  # Llama-8B-like
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 256
    batches: tuple[int, ...] = (1, 16, 64, 256)
    contexts: tuple[int, ...] = (1024, 4096, 16384)
    ema_cases: tuple[tuple[int, int], ...] = ((64, 4096), (256, 4096))
    sweep_case: tuple[int, int] = (64, 4096)
    boundary_context: int = 8192
    num_layers: int = 32
    max_num_seqs: int = 512


SMOKE = Shapes(
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    page_size=8,
    batches=(1, 2),
    contexts=(16, 40),
    ema_cases=((2, 40),),
    sweep_case=(2, 40),
    boundary_context=32,
    num_layers=2,
    max_num_seqs=4,
)
SWEEP = [
    dict(block_n=bn, num_warps=w, num_stages=s)
    for bn in (32, 64, 128)
    for w in (4, 8)
    for s in (2, 3)
]


def peak_gbps(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_GBPS.items() if k in name), None)


def bench_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median time of ``fn`` in ms: triton's do_bench on GPU, a few wall-clock runs on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def fits(nbytes: int, device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes * 1.15 < free


def decode_inputs(sh: Shapes, batch: int, context: int, dtype: torch.dtype, device: torch.device):
    pages_per_seq = -(-context // sh.page_size)
    num_pages = batch * pages_per_seq
    shape = (num_pages, sh.page_size, sh.num_kv_heads, sh.head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    # shuffled pages, as after a while of serving
    tables = torch.randperm(num_pages, device=device).to(torch.int32).view(batch, pages_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, sh.num_heads, sh.head_dim, dtype=dtype, device=device)
    return q, k_cache, v_cache, tables, lens


def decode_bytes(sh: Shapes, batch: int, context: int, dtype: torch.dtype) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    kv = 2 * batch * context * sh.num_kv_heads * sh.head_dim * size
    qo = 2 * batch * sh.num_heads * sh.head_dim * size
    return kv + qo + batch * (-(-context // sh.page_size) + 1) * 4


def sweep_decode(sh: Shapes, dtype: torch.dtype, device: torch.device) -> dict:
    """Try a few (block_n, warps, stages) on one shape; the best is used for the grid."""
    batch, context = sh.sweep_case
    args = decode_inputs(sh, batch, context, dtype, device)
    configs = SWEEP if device.type == "cuda" else SWEEP[:2]
    rows: list[dict[str, Any]] = []
    for cfg in configs:
        try:
            ms = bench_ms(functools.partial(paged_decode_attention, *args, **cfg), device)
        except Exception as exc:  # a config the compiler rejects (e.g. out of shared memory)
            rows.append({**cfg, "error": repr(exc)[:200]})
            continue
        rows.append({**cfg, "ms": ms})
    best = min((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    return {
        "batch": batch,
        "context": context,
        "configs": rows,
        "best": {k: best[k] for k in ("block_n", "num_warps", "num_stages")},
    }


def decode_bandwidth(
    sh: Shapes, dtype: torch.dtype, device: torch.device, peak: float | None, config: dict
) -> list[dict]:
    rows = []
    for batch in sh.batches:
        for context in sh.contexts:
            nbytes = decode_bytes(sh, batch, context, dtype)
            row: dict = {"batch": batch, "context": context, "bytes": nbytes}
            if not fits(nbytes, device):
                rows.append({**row, "skipped": "exceeds free device memory"})
                continue
            args = decode_inputs(sh, batch, context, dtype, device)
            ms = bench_ms(functools.partial(paged_decode_attention, *args, **config), device)
            gbps = nbytes / ms / 1e6
            rows.append(
                {**row, "ms": ms, "gbps": gbps, "pct_peak": 100 * gbps / peak if peak else None}
            )
            del args
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def ema_overhead(sh: Shapes, dtype: torch.dtype, device: torch.device, config: dict) -> list[dict]:
    """Plain decode vs fused EMA vs plain + standalone EMA launch (unfused)."""
    rows = []
    for batch, context in sh.ema_cases:
        q, k_cache, v_cache, tables, lens = decode_inputs(sh, batch, context, dtype, device)
        state = torch.zeros(sh.max_num_seqs, 2, sh.num_heads, sh.head_dim, device=device)
        ema = dict(
            q_pre=q.clone(),
            query_state=state,
            slot_ids=torch.arange(batch, dtype=torch.int32, device=device) % sh.max_num_seqs,
            is_first=torch.zeros(batch, dtype=torch.int32, device=device),
        )
        base = (q, k_cache, v_cache, tables, lens)

        def unfused(ema: dict = ema, base: tuple = base) -> None:
            paged_decode_attention(*base, **config)
            update_query_state(ema["q_pre"], ema["query_state"], ema["slot_ids"], ema["is_first"])

        plain = bench_ms(functools.partial(paged_decode_attention, *base, **config), device)
        fused = bench_ms(functools.partial(paged_decode_attention, *base, **ema, **config), device)
        separate = bench_ms(unfused, device)
        rows.append(
            {
                "batch": batch,
                "context": context,
                "plain_ms": plain,
                "fused_ms": fused,
                "unfused_ms": separate,
                "fused_overhead_pct": 100 * (fused / plain - 1),
                "unfused_overhead_pct": 100 * (separate / plain - 1),
            }
        )
    return rows


def boundary_work(sh: Shapes, dtype: torch.dtype, device: torch.device) -> dict:
    """One request at ``boundary_context`` tokens, all layers: compaction and demand estimation."""
    context, page = sh.boundary_context, sh.page_size
    num_pages = -(-context // page)
    kv_cache = torch.randn(
        2, sh.num_layers, num_pages, page, sh.num_kv_heads, sh.head_dim, dtype=dtype, device=device
    )
    tables = torch.randperm(num_pages, device=device).to(torch.int32)[None]
    num_keep = (num_pages - 1) * page  # Compress & Hold frees one page
    scores = torch.rand(sh.num_layers, sh.num_kv_heads, context, device=device)
    keep = scores.topk(num_keep, dim=-1).indices.sort(dim=-1).values.to(torch.int32)[None]
    direct = bench_ms(lambda: compact_kv(kv_cache, tables, keep, staged=False), device)
    staged = bench_ms(lambda: compact_kv(kv_cache, tables, keep, staged=True), device)
    num_candidates = context - page  # estimation excludes the most recent page
    queries = torch.randn(2, sh.num_layers, sh.num_heads, sh.head_dim, device=device)
    k_all = kv_cache[0]
    # As the engine calls it: the pages and (Nc, splits) in one table, already on the device.
    splits = demand_splits(num_candidates, sh.num_layers, sh.num_kv_heads, device)
    meta = torch.tensor([[num_candidates, splits]], dtype=torch.int32, device=device)
    packed = torch.cat([tables, meta], dim=1)
    attn_ms = bench_ms(
        lambda: demand_attention_batch(
            queries[None], k_all, packed, num_pages, num_candidates, splits
        ),
        device,
    )
    attn = demand_attention(queries, k_all, tables[0], num_candidates)
    topp_ms = bench_ms(lambda: working_set_sizes(attn, 0.99), device)
    total_ms = bench_ms(lambda: estimate_demand(queries, k_all, tables[0], num_candidates), device)
    kv_bytes = kv_cache.numel() * kv_cache.element_size()
    return {
        "context": context,
        "num_layers": sh.num_layers,
        "num_keep": num_keep,
        "kv_bytes": kv_bytes,
        "compaction_direct_ms": direct,
        "compaction_staged_ms": staged,
        "compaction_direct_gbps": 2 * kv_bytes * num_keep / context / direct / 1e6,
        "demand_attention_ms": attn_ms,
        "demand_top_p_ms": topp_ms,
        "demand_total_ms": total_ms,
    }


if __name__ == "__main__":
    raise SystemExit(
        "gpu_bench.py: the measurements of gpu_check.py, not a script of its own; "
        "run python benchmarks/gpu_check.py [--smoke] [--sections ...]"
    )
