"""Is the simulator as fast as its targets (a benchmark that prints, not a test)?

    .venv/bin/python benchmarks/sim_speed.py [--quick] [--threads N]

1. Synthetic trace generation: 8192 tokens, 6 layers, 9 query / 3 KV heads, d = 64
   (target <= 2 s).
2. Replay of that trace under ``growpage`` (b = 256): decisions only, and with fidelity
   (8 sampled future queries per boundary, output error), and with the section 5.3 signals
   (target for the replay: <= 2 s).
3. Serving: the paper's mixed workload (Table 6, 3559 requests, up to 32k tokens) under
   ``growpage`` in script mode with the A100 / Qwen3-8B roofline preset: wall time, simulated
   time and their ratio (target <= 60 s wall).

Times are the best of ``--repeat`` runs for the short measurements (the machine may be busy).
"""

from __future__ import annotations

import os
import time

import attrs
import torch
from script_args import add_threads, parser, run_main

from growpage.core.config import GrowPageConfig  # noqa: E402
from growpage.sim.costmodel import load_cost_model  # noqa: E402
from growpage.sim.replay import ReplayOptions, replay_trace  # noqa: E402
from growpage.sim.serving import SimConfig, simulate  # noqa: E402
from growpage.sim.synthetic import SyntheticSpec, synthetic_trace  # noqa: E402
from growpage.sim.workloads import resolve_workload  # noqa: E402

SPEC_8K = SyntheticSpec(
    num_layers=6, num_q_heads=9, num_kv_heads=3, head_dim=64, prompt_len=256, gen_len=8192 - 256
)


def best_of(repeat: int, fn):
    best, value = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - start)
    return best, value


def row(name: str, seconds: float, target: float | None, extra: str = "") -> None:
    verdict = "" if target is None else ("ok" if seconds <= target else "SLOW")
    goal = "" if target is None else f"<= {target:g} s"
    print(f"{name:44s} {seconds:8.2f} s  {goal:>9s}  {verdict:4s}  {extra}")


def bench_replay(repeat: int) -> None:
    synthetic_trace(attrs.evolve(SPEC_8K, gen_len=64), seed=0)  # warm-up
    seconds, trace = best_of(repeat, lambda: synthetic_trace(SPEC_8K, seed=0))
    row("synthetic trace 8192 tok x 6 layers", seconds, 2.0)
    config = GrowPageConfig()
    for label, options, target in [
        ("replay growpage, decisions only", ReplayOptions(fidelity_queries=0), 2.0),
        ("replay growpage + fidelity (8 queries)", ReplayOptions(), 2.0),
        ("replay growpage + fidelity + signals", ReplayOptions(signals=True), None),
    ]:
        seconds, result = best_of(
            repeat, lambda o=options: replay_trace(trace, "growpage", config, o)
        )
        s = result.summary()
        mass = "" if s["mass_mean"] is None else f"mass {s['mass_mean']:.3f}"
        row(
            label,
            seconds,
            target,
            f"{s['boundaries']} boundaries, avg budget {s['avg_budget']:.0f} {mass}",
        )


def bench_serving(workload: str) -> None:
    requests = resolve_workload(workload, seed=0)
    cost = load_cost_model("a100-qwen3-8b")
    config = GrowPageConfig()
    sim = SimConfig(num_kv_pages=cost.kv_pages(config.page_size))
    start = time.perf_counter()
    result = simulate(requests, "growpage", config, sim, cost)
    wall = time.perf_counter() - start
    m = result.metrics
    row(
        f"serve '{workload}' ({len(requests)} req) growpage",
        wall,
        60.0,
        f"simulated {m.total_s:.0f} s = {m.total_s / 3600:.2f} h, ratio {m.total_s / wall:.0f}x",
    )
    print(
        f"{'':44s} TPS {m.tps:.0f}, C {m.avg_resident:.1f}, avg budget {m.avg_kv_budget:.0f}, "
        f"grow ratio {m.grow_ratio:.1%}, fallbacks {m.fallbacks}, preemptions {m.num_preemptions}, "
        f"{m.output_tokens} output tokens"
    )


def main() -> int:
    p = parser(__doc__)
    add_threads(p, 1)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="serve 'amc23' instead of 'mixed'")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch threads {torch.get_num_threads()}, load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n"
    )
    print(f"{'measurement':44s} {'time':>10s}  {'target':>9s}")
    bench_replay(args.repeat)
    bench_serving("amc23" if args.quick else "mixed")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
