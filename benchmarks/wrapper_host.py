"""Host cost of the kernels' Python launch wrappers, with every Triton launch stubbed out.

On a GPU a small model's decode step is bound by the host, and the wrappers run once per layer
(decode attention, KV store) or per boundary (demand, boundary queries, compaction). With the
launches replaced by no-ops, what is left is the wrappers' own work (argument checks, scratch
allocations, strides, split counts), which this measures on any machine. The first column is a
GPU's default (index tensors' values not checked); the second adds those checks, which the
interpreter always runs and ``GROWPAGE_CHECK_INDICES=1`` turns on for a GPU:

    python benchmarks/wrapper_host.py            # SmolLM2 shapes, batch 64, microseconds/call
    python benchmarks/wrapper_host.py --calls 200
"""

from __future__ import annotations

import argparse
import sys
import timeit

import torch

import growpage.kernels as K  # noqa: E402  (turns the interpreter on without CUDA)
from growpage.engine.config import check_device  # noqa: E402
from growpage.kernels import set_index_checks, without_index_checks  # noqa: E402
from growpage.kernels.variants import stubbed_launches  # noqa: E402

# SmolLM2-135M: 30 layers, 9 query / 3 KV heads of 64; pages of 64, contexts of ~600
LAYERS, HQ, HKV, D, PAGE, BATCH, PAGES = 30, 9, 3, 64, 64, 64, 10


def calls(device: torch.device) -> dict:
    """The wrapper calls to time, as closures over fixed inputs."""
    q = torch.randn(BATCH, HQ, D, device=device)
    cache = torch.zeros(2, LAYERS, BATCH * PAGES, PAGE, HKV, D, device=device)
    tables = torch.arange(BATCH * PAGES, device=device).view(BATCH, PAGES)
    lens = torch.full((BATCH,), PAGES * PAGE - 5, dtype=torch.long, device=device)
    pool = torch.zeros(LAYERS, BATCH, 2, HQ, D, device=device)
    current = torch.zeros(LAYERS, BATCH, HQ, D, device=device)
    slots = torch.arange(BATCH, device=device)
    first = torch.zeros(BATCH, dtype=torch.int32, device=device)
    k = torch.randn(BATCH, HKV, D, device=device)
    # each row's newest token (position len - 1): the last column of its table
    new_slots = tables[:, -1] * PAGE + (PAGES * PAGE - 6) % PAGE
    keep = torch.arange(PAGE * (PAGES - 1), device=device).expand(1, LAYERS, HKV, -1).contiguous()
    table = tables[:1].to(torch.int32)
    # the engine's boundary table: pages, then (Nc, splits) of the estimation candidates,
    # then the request's query-state slot and position
    packed = torch.cat(
        [
            table,
            torch.tensor([[PAGE * (PAGES - 1), 1, 3, 600]], dtype=torch.int32, device=table.device),
        ],
        dim=1,
    )
    inv_freq = torch.ones(D // 2, device=device)
    queries = torch.randn(2, LAYERS, HQ, D, device=device)
    return {
        "paged_decode_attention (fused EMA), per layer": lambda: K.paged_decode_attention(
            q,
            cache[0, 0],
            cache[1, 0],
            tables,
            lens,
            0.125,
            q_pre=q,
            query_state=pool[0],
            slot_ids=slots,
            is_first=first,
        ),
        "store_kv, per layer": lambda: K.store_kv(k, k, cache[0, 0], cache[1, 0], new_slots),
        "boundary_queries_batch (one request), per boundary": lambda: K.boundary_queries_batch(
            pool, current, packed, PAGES + 2, inv_freq
        ),
        "demand_attention_batch (one request), per boundary": lambda: K.demand_attention_batch(
            queries[None], cache[0], packed, PAGES, PAGE * (PAGES - 1), 1
        ),
        "compact_kv (direct), per boundary": lambda: K.compact_kv(
            cache, table, keep, table, staged=False
        ),
    }


def measure(num_calls: int, device: torch.device) -> dict[str, tuple[float, float]]:
    """Microseconds per call of each wrapper, launches stubbed (restored afterwards): as a GPU
    runs it by default, without checking the index tensors' values, and with those checks
    (always on under the interpreter; ``GROWPAGE_CHECK_INDICES=1`` on a GPU)."""
    out = {}
    with stubbed_launches():
        for name, fn in calls(device).items():
            with without_index_checks():
                plain = timeit.timeit(fn, number=num_calls) / num_calls * 1e6
            checked = timeit.timeit(fn, number=num_calls) / num_calls * 1e6
            out[name] = (plain, checked)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    device = check_device(args.device)  # ConfigError (one line) where torch has no such device
    previous = set_index_checks(True)  # the second column checks on a GPU too
    try:
        rows = measure(args.calls, device)
    finally:
        set_index_checks(previous)
    print("| wrapper (launch stubbed) | us per call | with index checks |\n|---|---:|---:|")
    for name, (plain, checked) in rows.items():
        print(f"| {name} | {plain:.1f} | {checked:.1f} |")
    return 0


if __name__ == "__main__":
    from script_main import run_main

    sys.exit(run_main(main))
