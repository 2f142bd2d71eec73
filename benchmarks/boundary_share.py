"""What share of the GPU check's engine run do capacity boundaries take, host side only?

On the H200 the engine section (SmolLM2, 64 requests x 512 tokens, pages of 64, 40% of the pool
fullkv needs) is host-bound: every kernel is tiny, so a decode step costs what its Python,
torch dispatch and launch wrappers cost, and so does a boundary. This runs the same workload on
any machine with every Triton launch stubbed out and a model with SmolLM2's layers and heads
(30 layers, 9 query heads on 3 KV heads of 64) but a narrow hidden size, so the matrix products
cost next to nothing either:

    python benchmarks/boundary_share.py                  # fullkv and growpage, ~1.5 min
    python benchmarks/boundary_share.py --requests 16 --max-tokens 256 --policies growpage
    python benchmarks/boundary_share.py --policies growpage --alone --prompt-len 45-75
    python benchmarks/boundary_share.py --policies growpage --async-compaction --prompt-len 45-75
    python benchmarks/boundary_share.py --policies growpage --async-decisions --prompt-len 45-75

It prints, per policy, the run's seconds, the boundary seconds and share, ms per decided
boundary, and the boundary phases (``growpage.engine.profiling.boundary_profile``). With
``--async-compaction`` each policy also runs with compressions deferred to beside the forward
(``LLM(async_compaction=True)``): its ``decision %`` is the boundary share left when the deferred
work is hidden entirely, the best a GPU's overlap can do (here, on the CPU, the step waits for
all of it). ``--async-decisions`` adds rows that defer whole boundaries as well
(``LLM(async_decisions=True)``, beyond the paper): their ``decision %`` is what stays on the
critical path, the registration of late boundaries while scheduling and the boundaries that must
stay synchronous (``DeferredBoundaries.decides_late``).

NOTE: an estimate, not a measurement. With launches stubbed the kernels' outputs are left
unwritten, so the decisions differ from a real run's; and torch ops still compute on the CPU, so
phases that sort the candidates (``demand``, ``select``) cost more here than the launches they
are on a GPU. Read it for where the host time goes and for before/after comparisons on one
machine.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from script_args import add_threads, parser, run_main

# NOTE: first, before anything imports triton: growpage.kernels turns Triton's interpreter on
# when there is no CUDA device.
import growpage.kernels  # noqa: E402, F401
from growpage.core.rope import RopeConfig  # noqa: E402
from growpage.engine.llm import LLM  # noqa: E402
from growpage.engine.loading.loader import build_model, meta_shapes  # noqa: E402
from growpage.engine.modeling.model import CausalLM, ModelConfig  # noqa: E402
from growpage.engine.profiling.boundary_profile import profile_boundaries  # noqa: E402
from growpage.engine.sampling_params import SamplingParams  # noqa: E402
from growpage.kernels import without_index_checks  # noqa: E402
from growpage.kernels.variants import stubbed_launches  # noqa: E402


def narrow_smollm2(layers: int = 30, seed: int = 0) -> CausalLM:
    """SmolLM2-135M's attention shapes (9 q heads, 3 KV heads, head dim 64) on a hidden size of
    64: the host work of every layer, almost none of the arithmetic."""
    cfg = ModelConfig(
        arch="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,
        num_layers=layers,
        num_q_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope=RopeConfig(head_dim=64),
        bos_token_id=1,
        eos_token_ids=(2,),
        name="narrow-smollm2",
    )
    gen = torch.Generator().manual_seed(seed)
    shapes = meta_shapes(cfg)
    return build_model(
        cfg, {name: torch.randn(shape, generator=gen) * 0.1 for name, shape in shapes.items()}
    )


def gpu_check_pool(prompt_lengths: list[int], max_tokens: int, page: int) -> int:
    """The GPU check's pool: 40% of the pages fullkv needs for every request at once."""
    lengths = [n + max_tokens + 1 for n in prompt_lengths]
    return max(sum(-(-n // page) for n in lengths) * 2 // 5, max(lengths) // page + 2)


def run(args: argparse.Namespace) -> dict:
    model = narrow_smollm2(args.layers)
    rng = random.Random(0)
    lo, _, hi = args.prompt_len.partition("-")
    prompts = [
        [rng.randrange(3, 256) for _ in range(rng.randint(int(lo), int(hi or lo)))]
        for _ in range(args.requests)
    ]
    kv_pages = gpu_check_pool([len(p) for p in prompts], args.max_tokens, args.page_size)
    report: dict = {
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "page_size": args.page_size,
        "kv_pages": kv_pages,
        "layers": args.layers,
        "rows": {},
    }
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    # (policy, shared BoundaryBatch per step, deferred: "" | "async" | "async-decisions")
    runs = [(policy, True, "") for policy in args.policies]
    if args.alone:
        runs += [(policy, False, "") for policy in args.policies if policy != "fullkv"]
    for flag, deferred in (
        (args.async_compaction, "async"),
        (args.async_decisions, "async-decisions"),
    ):
        if flag:
            runs += [(policy, True, deferred) for policy in args.policies if policy != "fullkv"]
    for policy, shared, deferred in runs:
        # No index-value checks: the interpreter always runs them, a GPU by default does not.
        with stubbed_launches(), without_index_checks():
            llm = LLM(
                model,
                policy=policy,
                page_size=args.page_size,
                kv_pages=kv_pages,
                max_num_seqs=args.requests,
                device="cpu",
                attention_backend="triton",
                boundary_kernels=True,
                min_capacity=4,
                enable_prefix_caching=False,
                async_compaction=bool(deferred),
                async_decisions=deferred == "async-decisions",
            )
            if not shared:  # every boundary on its own: no BoundaryBatch per step
                kv = llm.engine.kv
                kv.prepare_boundaries = lambda seqs, kv=kv: kv.end_boundaries()
            with profile_boundaries(llm) as phases:
                llm.generate(prompts, params, use_tqdm=False)
        st = llm.last_stats
        kv = llm.engine.kv
        name = policy + ("" if shared else " (alone)") + (f"+{deferred}" if deferred else "")
        report["rows"][name] = {
            "total_s": st.total_s,
            "boundary_s": st.boundary_s,
            "boundary_pct": 100 * st.boundary_s / st.total_s,
            "deferred_s": kv.deferred.work_s,
            "deferred_compactions": kv.deferred.num_compactions,
            "deferred_decisions": kv.deferred.num_decisions,
            "decision_pct": 100 * (st.boundary_s - kv.deferred.work_s) / st.total_s,
            "steps": st.num_steps,
            "decided": phases.decided,
            "ms_per_decided": (1000 * st.boundary_s / phases.decided if phases.decided else None),
            "events": dict(st.events),
            "phases": phases.as_dict(),
            "shared_steps": llm.engine.kv.shared_steps,
            "shared_boundaries": llm.engine.kv.shared_boundaries,
            "phases_markdown": phases.markdown(),
        }
    return report


def _ms(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms:.3f}"  # None: no boundary was decided


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--policies", nargs="+", default=["fullkv", "growpage"])
    add_threads(p, 1)
    p.add_argument(
        "--prompt-len",
        default="80-159",
        metavar="LO-HI",
        help="prompt lengths drawn from LO..HI tokens (default 80-159; the GPU "
        "check's SmolLM2 chat prompts are 45-75)",
    )
    p.add_argument(
        "--alone",
        action="store_true",
        help="also run each policy with every boundary on its own (no shared "
        "BoundaryBatch per step), in the same process, for a ratio",
    )
    p.add_argument(
        "--async-compaction",
        action="store_true",
        help="also run each policy with compressions deferred to beside the forward "
        "(LLM(async_compaction=True)); 'decision %%' is the share left when the "
        "deferred work is hidden",
    )
    p.add_argument(
        "--async-decisions",
        action="store_true",
        help="also run each policy with whole boundaries decided beside the forward "
        "(LLM(async_decisions=True), beyond the paper)",
    )
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    report = run(args)
    print(
        f"{args.requests} requests x {args.max_tokens} tokens, {report['kv_pages']} pages x "
        f"{args.page_size}, {args.layers} layers, launches stubbed (host time only):\n"
    )
    print(
        "| policy | run s | steps | boundary s | boundary % | decision % | decided | "
        "ms per decided |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for policy, r in report["rows"].items():
        print(
            f"| {policy} | {r['total_s']:.2f} | {r['steps']} | {r['boundary_s']:.3f} | "
            f"{r['boundary_pct']:.2f} | {r['decision_pct']:.2f} | {r['decided']} | "
            f"{_ms(r['ms_per_decided'])} |"
        )
    for policy, r in report["rows"].items():
        if r["decided"]:
            print(f"\n{policy}: {r['phases_markdown']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
