"""GrowPage's selection (Eq. 10) at boundary shapes: the global top-k both ways, side by side.

``block_local_topk`` finds its global top-k either with one stable argsort of all M candidates
(what a GPU runs: one launch or two) or with ``top_slots``: an int64 key per slot and a partial
top-k of the ~one page a compression drops (what the CPU runs). Both give the same slots; this
times them in one process, interleaved, and prints the ratio:

    python benchmarks/selection_speed.py                 # SmolLM2 and Llama-8B shapes, ~20 s
    python benchmarks/selection_speed.py --tokens 1024 4096 --repeats 20 --json out.json

The selection runs at every compression of the engine on the CPU and of the simulator's trace
mode, which is where it matters.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from growpage.core import selection  # noqa: E402

#: (name, layers, KV heads): SmolLM2-135M, Llama-3-8B / Qwen3-8B-like.
MODELS = (("smollm2-135m", 30, 3), ("llama-8b", 32, 8))


def time_selection(
    layers: int,
    heads: int,
    tokens: int,
    page: int,
    recent: int,
    local_quota: int,
    repeats: int,
    seed: int = 0,
) -> dict:
    """Seconds per ``growpage_select`` (keep ``tokens - page``), keyed and argsort, interleaved;
    checks that both chose the same slots."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(layers, heads, tokens - recent, generator=gen).softmax(-1)
    keep = tokens - page
    seconds = {True: [], False: []}
    chosen = {}
    saved = selection.keyed_top_k
    try:
        for _ in range(repeats + 1):  # the first round warms up
            for keyed in (True, False):
                selection.keyed_top_k = keyed
                start = time.perf_counter()
                chosen[keyed] = selection.growpage_select(
                    scores, tokens, recent, keep, page, local_quota
                )
                seconds[keyed].append(time.perf_counter() - start)
    finally:
        selection.keyed_top_k = saved
    if not torch.equal(chosen[True], chosen[False]):
        raise AssertionError(f"the two ways chose different slots at {layers}x{heads}x{tokens}")
    keyed_ms = 1000 * min(seconds[True][1:])
    sort_ms = 1000 * min(seconds[False][1:])
    return {
        "layers": layers,
        "kv_heads": heads,
        "tokens": tokens,
        "keyed_ms": keyed_ms,
        "argsort_ms": sort_ms,
        "speedup": sort_ms / keyed_ms,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[512, 2048, 8192],
        help="resident tokens N at the boundary (default 512 2048 8192)",
    )
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--recent-window", type=int, default=16)
    p.add_argument("--local-quota", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10, help="timed rounds; the best is kept")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    for n in args.tokens:
        if n < 2 * args.page_size or args.recent_window >= args.page_size:
            p.error(
                f"--tokens {n}: need at least two pages of {args.page_size} and a recent "
                f"window ({args.recent_window}) below one page"
            )
    if args.repeats < 1 or args.threads < 1:
        p.error("--repeats and --threads must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [
        dict(
            model=name,
            **time_selection(
                layers, heads, n, args.page_size, args.recent_window, args.local_quota, args.repeats
            ),
        )
        for name, layers, heads in MODELS
        for n in args.tokens
    ]
    print(
        f"growpage_select, keep N - {args.page_size}, recent {args.recent_window}, "
        f"quota {args.local_quota}, best of {args.repeats}, {args.threads} thread(s):\n"
    )
    print("| model | L x Hkv | N | keyed top-k ms | stable argsort ms | speedup |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['layers']} x {r['kv_heads']} | {r['tokens']} | "
            f"{r['keyed_ms']:.3f} | {r['argsort_ms']:.3f} | {r['speedup']:.2f}x |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    from script_main import run_main

    sys.exit(run_main(main))
