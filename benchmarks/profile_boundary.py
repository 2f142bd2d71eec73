"""Where the engine's capacity-boundary time goes: cProfile over every ``make_room`` call.

    python benchmarks/profile_boundary.py                       # CPU, SmolLM2, 8 requests
    python benchmarks/profile_boundary.py --device cuda --requests 64 --max-tokens 512

Prints the run's boundary share (``EngineStats.boundary_time_s``), the time per decided boundary,
and the functions with the most cumulative time inside capacity control. On CUDA, time spent
waiting for the GPU shows up in the functions that synchronize (``.item()``, ``.tolist()``,
``nonzero``), which is what to remove first.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys

import torch

from growpage.engine.llm import LLM  # noqa: E402
from growpage.engine.sampling_params import SamplingParams  # noqa: E402
from growpage.eval.workload import reasoning_prompts  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--policy", default="growpage")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--kv-pages", type=int, default=None, help="default: room for all at full")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(
        args.model,
        policy=args.policy,
        page_size=args.page_size,
        device=args.device,
        kv_pages=args.kv_pages or args.requests * (-(-(args.max_tokens + 160) // args.page_size)),
        max_num_seqs=args.requests,
        min_capacity=4,
        # The synchronous boundary path, whole inside make_room, on every device.
        cuda_graphs=False,
        async_compaction=False,
    )
    profiler = cProfile.Profile()
    make_room = llm.engine.kv.make_room

    def profiled(seq):
        profiler.enable()
        try:
            return make_room(seq)
        finally:
            profiler.disable()

    llm.engine.kv.make_room = profiled  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(reasoning_prompts(args.requests), params, chat=True, use_tqdm=False)
    st = llm.last_stats
    e = st.events
    decided = e.get("decided_grow", 0) + e.get("decided_compress", 0) + e.get("decided_shrink", 0)
    print(
        f"{args.policy} on {args.device}: {st.num_output_tokens} tokens in "
        f"{st.total_time_s:.2f} s ({st.tps:.1f} tok/s); boundary time {st.boundary_time_s:.3f}"
        f" s = {100 * st.boundary_time_s / st.total_time_s:.2f}% of the run"
    )
    print(
        f"boundaries {e.get('boundaries', 0)}, decided {decided}, compress "
        f"{e.get('compress', 0)}: "
        + (f"{1000 * st.boundary_time_s / decided:.2f}" if decided else "n/a")
        + " ms per decided boundary"
    )
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(args.top)
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    from script_main import run_main

    sys.exit(run_main(main))
