"""Does the serving simulator, calibrated on this machine's CPU, predict the engine it models?

Scenario: 16 chat prompts from ``growpage.eval.workload.reasoning_prompts()``, every request
generating exactly ``--max-tokens`` tokens (``ignore_eos``), all submitted at once to the engine
(SmolLM2-135M-Instruct, fp32, torch backend) with a KV pool too small for ``fullkv`` to keep
every request resident; ``--arrival-rate R`` has them arrive as a Poisson process instead, in
wall-clock time on the engine (``LLM.generate(arrival_s=...)``) and in simulated time in
the simulator. Steps:

1. **calibrate**: time the engine's forward passes over the workload's shapes (every batch size
   from 1 to the number of requests; ``growpage.engine.profiling.profile.measure_step_times``) and fit the
   simulator's ``PiecewiseCostModel`` (``growpage.sim.calibrate.fit_piecewise``), as ``growpage
   calibrate --kind piecewise`` does; a ``LinearCostModel`` fitted on the same rows is reported
   beside it. Both price a decode step's KV as the engine's torch backend reads it, padded to
   the batch's longest context (``padded_kv``). The machine is shared, so one pass runs before the engine runs and one after each
   of them, and the models are fitted on all passes together: they see the load the engine runs
   saw;
2. **record**: run the workload once under ``fullkv`` with a pool large enough for everything,
   recording every layer's queries and keys (``LLM(record_traces=DIR)``);
3. **engine**: run the workload under each policy with the small pool and keep ``EngineStats``;
4. **simulate**: serve the same requests in ``growpage.sim.serving`` in *trace* mode (each request
   decides on a ``TraceView`` over its own recorded trace: closed loop, the real policy on the
   real queries and keys), with the calibrated cost model and the engine's pool, page size,
   ``max_num_seqs`` and token budget;
5. compare TPS, C (average resident requests), total time and event counts; the same requests
   priced with the linear model give a second set of errors (not gated).

Modelling choices that make both sides count the same thing:

* the simulated request generates as many tokens as the engine's (``max_tokens``); the engine
  samples the first token at the end of its prefill, the simulator in its first decode step, so
  the simulator runs one more decode step per request (< 1% of the steps here);
* prefix caching is off in the engine (the simulator does not model prefix sharing; with 32-token
  pages the chat template's shared system prompt would fill at most one page anyway);
* the simulator's ``admission_reserve`` is 0 (the engine admits greedily; its watermark is 0);
* the engine's boundary work (capacity control: scoring and compaction) is measured by the
  engine (``EngineStats.boundary_s``); the simulator prices it as the engine runs it, a step's
  boundaries together (per step that decides plus per decision, per step that compacts plus
  per compaction), as a separate run of the policy measured it (``measure_boundary_costs``;
  off with ``--no-boundaries``), and both sides report it (``boundary s``).

Run: ``.venv/bin/python benchmarks/sim_vs_engine.py`` (about 5 minutes of CPU time, one
thread; 15 minutes of wall time when the 2-core machine is loaded by other jobs); writes ``results/sim_vs_engine/report.md`` and ``sim_vs_engine.json``.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from script_args import add_out, add_threads, parser, run_main
from tqdm import tqdm

from growpage.core.config import GrowPageConfig
from growpage.core.trace_set import TraceSet
from growpage.core.traces import Trace
from growpage.eval.machine import describe_machine
from growpage.policies.registry import resolve_policy
from growpage.sim.calibrate import fit_linear, fit_piecewise
from growpage.sim.costmodel import CostModel, with_boundary_costs
from growpage.sim.serving import ServingResult, SimConfig, simulate
from growpage.sim.sweep import SweepPoint, parse_points
from growpage.sim.workload_csv import WorkloadRequest

TARGET = 0.15  # relative error the simulator should stay within on TPS, C and total time


@attrs.frozen(kw_only=True)
class Scenario:
    """The shared settings of both worlds."""

    num_requests: int = 16
    max_tokens: int = 192  # tokens generated per request (EOS ignored)
    page_size: int = 32  # tokens per KV page
    kv_pages: int = 64  # KV pool of the measured runs (pages)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    record_kv_pages: int = 512  # pool of the recording run: nothing is ever preempted
    chat: bool = True
    arrival_rate: float | None = None  # Poisson arrivals (requests/s); None: all at t = 0

    def arrivals(self) -> list[float] | None:
        """Arrival seconds of the requests, the first at 0 (seed 0), or None (all at once)."""
        if self.arrival_rate is None:
            return None
        from growpage.engine.inputs import poisson_arrivals

        times = poisson_arrivals(self.num_requests, self.arrival_rate, seed=0)
        return [t - times[0] for t in times]


# ---- the engine side -------------------------------------------------------------------------
def make_llm(
    model: Any, tokenizer: Any, scenario: Scenario, point: SweepPoint, kv_pages: int, **kwargs: Any
) -> Any:
    """An ``LLM`` over an already loaded model (loading once keeps the runs comparable)."""
    from growpage.engine.llm import LLM

    return LLM(
        model,
        policy=point.policy,
        policy_kwargs=dict(point.params),
        tokenizer=tokenizer,
        page_size=scenario.page_size,
        kv_pages=kv_pages,
        max_num_seqs=scenario.max_num_seqs,
        max_num_batched_tokens=scenario.max_num_batched_tokens,
        enable_prefix_caching=False,
        **kwargs,
    )


def sampling_params(scenario: Scenario) -> Any:
    from growpage.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=scenario.max_tokens, ignore_eos=True)


def calibration_shapes(
    scenario: Scenario, prompt_tokens: int
) -> tuple[list[int], list[int], list[int | tuple[int, int]]]:
    """Batch sizes, per-request contexts and prefills spanning the workload's steps: every
    batch size the run can decode (the engine's step time is not linear in it: on a CPU some
    sizes take matrix kernels' faster paths), the shortest and longest contexts, one prompt (a
    recompute after preemption), and every prompt at once as the first step admits them (a
    batch of ``n`` sequences, not one sequence of ``prompt_tokens``, whose attention would cost
    the square of its length)."""
    n = scenario.num_requests
    per_prompt = max(1, prompt_tokens // n)
    longest = per_prompt + scenario.max_tokens
    batch_sizes = list(range(1, n + 1))
    contexts = sorted({per_prompt, longest})
    prefills: list[int | tuple[int, int]] = [per_prompt, (n, max(n, prompt_tokens))]
    return batch_sizes, contexts, prefills


def measure(
    model: Any,
    shapes: tuple[list[int], list[int], list[int]],
    repeats: int = 1,
    progress: bool = True,
) -> np.ndarray:
    """One calibration pass: ``[n, 4]`` rows (num_seqs, kv_tokens, prefill_tokens, step_s) of
    the engine's forward passes (``growpage.engine.profiling.profile``, best of ``repeats + 1``)."""
    from growpage.engine.profiling.profile import measure_step_times

    rows = measure_step_times(model, *shapes, repeats=repeats, progress=progress)
    return np.array(
        [[r["num_seqs"], r["kv_tokens"], r["prefill_tokens"], r["step_s"]] for r in rows],
        dtype=np.float64,
    )


def record_traces(
    model: Any,
    tokenizer: Any,
    scenario: Scenario,
    prompts: Sequence[str],
    directory: Path,
    layers: Sequence[int] | None = None,
    progress: bool = True,
) -> tuple[TraceSet, list[Any]]:
    """Record the workload under ``fullkv`` (queries and keys of ``layers``, no values)."""
    if directory.exists():
        shutil.rmtree(directory)
    llm = make_llm(
        model,
        tokenizer,
        scenario,
        SweepPoint("fullkv"),
        scenario.record_kv_pages,
        record_traces=str(directory),
        record_layers=layers,
        record_values=False,
    )
    outs = llm.generate(
        list(prompts), sampling_params(scenario), chat=scenario.chat, use_tqdm=progress
    )
    return TraceSet(directory), outs


def run_engine(
    model: Any,
    tokenizer: Any,
    scenario: Scenario,
    point: SweepPoint,
    prompts: Sequence[str],
    progress: bool = True,
) -> Any:
    """``EngineStats`` of the workload under ``point`` with the small pool."""
    llm = make_llm(model, tokenizer, scenario, point, scenario.kv_pages)
    llm.generate(
        list(prompts),
        sampling_params(scenario),
        chat=scenario.chat,
        use_tqdm=progress,
        arrival_s=scenario.arrivals(),
    )
    return llm.last_stats, llm.config.growpage


# ---- the simulator side ----------------------------------------------------------------------
def workload_from_traces(
    traces: TraceSet, output_tokens: Sequence[int], arrivals: Sequence[float] | None = None
) -> tuple[list[WorkloadRequest], dict[str, Trace]]:
    """One simulated request per recorded trace, in the set's order (= submission order),
    arriving at ``arrivals`` (seconds; None: all at t = 0), generating what the engine
    generated."""
    requests, by_id = [], {}
    times = arrivals if arrivals is not None else [0.0] * len(traces.index)
    for entry, out_tokens, arrival in zip(traces.index, output_tokens, times, strict=True):
        requests.append(
            WorkloadRequest(
                entry.request_id,
                float(arrival),
                entry.prompt_len,
                int(out_tokens),
                entry.request_id,
                "recorded",
            )
        )
        by_id[entry.request_id] = traces.read(entry)
    return requests, by_id


def run_sim(
    requests: Sequence[WorkloadRequest],
    traces: dict[str, Trace],
    point: SweepPoint,
    config: GrowPageConfig,
    scenario: Scenario,
    cost: CostModel,
) -> ServingResult:
    """The workload in the serving simulator, trace mode, the engine's pool and limits."""
    sim = SimConfig(
        num_kv_pages=scenario.kv_pages,
        max_num_seqs=scenario.max_num_seqs,
        max_num_batched_tokens=scenario.max_num_batched_tokens,
        decisions="trace",
        admission_reserve=0.0,
        prefix_caching=False,
    )  # as make_llm's engine
    policy = resolve_policy(point.policy, **dict(point.params))
    return simulate(requests, policy, config, sim, cost, trace_of=lambda r: traces[r.request_id])


def boundary_prices(model: Any, point: SweepPoint, scenario: Scenario) -> dict:
    """Seconds per capacity decision and per compaction of ``point``'s policy on this engine
    (``growpage.engine.profiling.profile.measure_boundary_costs``)."""
    from growpage.engine.profiling.profile import measure_boundary_costs

    print(f"pricing capacity control: {point.label}", flush=True)
    policy = resolve_policy(point.policy, **dict(point.params))
    return measure_boundary_costs(
        model, policy=policy, page_size=scenario.page_size, progress=False
    )


def _prices(label: str, p: dict) -> str:
    """``label`` and its capacity-control prices in ms: decisions, then compactions, each as
    per step + per request."""
    step_d, step_c = p.get("boundary_step_s", 0.0), p.get("compaction_step_s", 0.0)
    return (
        f"{label} {1e3 * step_d:.2f} + {1e3 * p['boundary_s']:.2f}, "
        f"{1e3 * step_c:.2f} + {1e3 * p['compaction_s']:.2f}"
    )


# ---- comparison ------------------------------------------------------------------------------
def engine_row(stats: Any) -> dict:
    e = stats.events
    return {
        "tps": stats.tps,
        "avg_resident": stats.avg_resident,
        "total_s": stats.total_s,
        "output_tokens": stats.num_output_tokens,
        "num_requests": stats.num_requests,
        "grows": e.get("grow", 0),
        "compresses": e.get("compress", 0),
        "fallbacks": e.get("fallback", 0),
        "preemptions": stats.num_preemptions,
        "avg_kv_budget": stats.avg_kv_budget,
        "boundary_s": stats.boundary_s,
        "num_steps": stats.num_steps,
        **{
            f"{name}_p{q}_{unit}": scale * getattr(stats, f"{name}_p{q}_s")
            for name, unit, scale in LATENCIES
            for q in (50, 99)
        },
    }


def sim_row(result: ServingResult) -> dict:
    m = result.metrics
    decoded = sum(r.generated for r in result.requests)
    return {
        "tps": m.tps,
        "avg_resident": m.avg_resident,
        "total_s": m.total_s,
        "output_tokens": m.output_tokens,
        "num_requests": m.num_requests,
        "grows": m.grows,
        "compresses": m.compresses,
        "fallbacks": m.fallbacks,
        "preemptions": m.num_preemptions,
        "avg_kv_budget": sum(r.budget_tokens for r in result.requests) / max(decoded, 1),
        "num_steps": m.decode_steps + m.prefill_steps,
        "boundary_s": m.boundary_s,
        **{
            f"{name}_p{q}_{unit}": getattr(m, f"{name}_p{q}_{unit}")
            for name, unit, _ in LATENCIES
            for q in (50, 99)
        },
    }


#: Latencies compared (not gated): (name, unit of the simulator's metric, engine seconds to it).
LATENCIES = (("ttft", "s", 1.0), ("tpot", "ms", 1e3), ("e2e", "s", 1.0))
METRICS = [
    ("tps", "TPS (tok/s)", ".1f"),
    ("avg_resident", "C", ".2f"),
    ("total_s", "total time (s)", ".1f"),
    ("avg_kv_budget", "KV budget (tok)", ".0f"),
    ("num_steps", "steps", "d"),
    ("grows", "grow", "d"),
    ("compresses", "compress", "d"),
    ("fallbacks", "fallback", "d"),
    ("preemptions", "preempt", "d"),
    ("boundary_s", "boundary s", ".2f"),
    ("ttft_p50_s", "TTFT p50 (s)", ".2f"),
    ("ttft_p99_s", "TTFT p99 (s)", ".2f"),
    ("tpot_p50_ms", "TPOT p50 (ms)", ".1f"),
    ("tpot_p99_ms", "TPOT p99 (ms)", ".1f"),
    ("e2e_p50_s", "E2E p50 (s)", ".1f"),
    ("e2e_p99_s", "E2E p99 (s)", ".1f"),
]
GATED = ("tps", "avg_resident", "total_s")


def relative_error(sim: float, measured: float) -> float | None:
    """``(sim - measured) / measured``; None where the engine measured 0 and the simulator not."""
    return (sim - measured) / measured if measured else None if sim else 0.0


def compare(label: str, engine: dict, sim: dict) -> dict:
    errors = {k: relative_error(sim[k], engine[k]) for k, _, _ in METRICS}
    return {
        "point": label,
        "engine": engine,
        "sim": sim,
        "rel_error": errors,
        "within_target": all(errors[k] is not None and abs(errors[k]) <= TARGET for k in GATED),
    }


def _error_cell(err: float | None, difference: float, fmt: str) -> str:
    """The relative error, or (engine count 0) n/a and the simulator's absolute excess."""
    return f"{err:+.1%}" if err is not None else f"n/a ({difference:+{fmt}})"


def markdown(rows: list[dict], meta: dict, linear_rows: Sequence[dict] = ()) -> str:
    """The report: the piecewise model's comparison (gated), then the same runs priced with
    the linear model (``linear_rows``, errors only)."""
    lines = [
        "| point | metric | engine (measured) | simulator | rel. error |",
        "|---|---|---:|---:|---:|",
    ]
    for row in rows:
        for key, name, fmt in METRICS:
            e, s, err = row["engine"][key], row["sim"][key], row["rel_error"][key]
            mark = " **!**" if key in GATED and (err is None or abs(err) > TARGET) else ""
            lines.append(
                f"| {row['point']} | {name} | {e:{fmt}} | {s:{fmt}} | "
                f"{_error_cell(err, s - e, fmt)}{mark} |"
            )
    c, lc = meta["cost_model"], meta.get("linear_cost_model")
    table = ", ".join(
        f"{n}: {1e3 * t:.1f}" for n, t in zip(c["batch_sizes"], c["batch_s"], strict=True)
    )
    linear = []
    if linear_rows and lc:
        linear = [
            "Same runs priced with a linear model fitted on the same rows (rms "
            f"{1e3 * meta['linear_calibration_rms_s']:.2f} ms: base {1e3 * lc['base_s']:.2f} ms + "
            f"{1e3 * lc['per_seq_s']:.3f} ms/seq + {1e6 * lc['per_kv_token_s']:.3f} us/KV token "
            f"+ {1e3 * lc['per_prefill_token_s']:.3f} ms/prefill token; not gated):",
            "",
            "| point | TPS error | C error | total time error |",
            "|---|---:|---:|---:|",
            *(
                f"| {row['point']} | "
                + " | ".join(
                    _error_cell(row["rel_error"][k], row["sim"][k] - row["engine"][k], ".2f")
                    for k in GATED
                )
                + " |"
                for row in linear_rows
            ),
            "",
        ]
    return "\n".join(
        [
            "# Simulator vs engine (CPU, SmolLM2-135M-Instruct)",
            "",
            f"Command: `{meta['command']}`",
            "",
            f"Machine: {meta['machine']}; torch {meta['torch']}, {meta['threads']} thread(s); "
            f"measured {meta['date']}; whole benchmark {meta['wall_s']:.0f} s.",
            "",
            f"Workload: {meta['num_requests']} chat prompts from `reasoning_prompts()`, "
            f"{meta['prompt_tokens']} prompt tokens in all, {meta['max_tokens']} generated tokens "
            f"each (EOS ignored), "
            + (
                "all at t = 0"
                if meta.get("arrival_rate") is None
                else f"Poisson arrivals at {meta['arrival_rate']:g} requests/s "
                "(seed 0, the first at t = 0)"
            )
            + f"; pool {meta['kv_pages']} pages x {meta['page_size']} "
            f"tokens, max_num_seqs {meta['max_num_seqs']}, prefix caching off. Traces: "
            f"{meta['recorded_layers']} layers recorded under fullkv. Simulator: trace mode "
            "(closed loop on the recorded queries and keys), admission reserve 0.",
            "",
            f"Piecewise cost model fitted on {meta['calibration_rows']} engine forward passes "
            f"(rms {1e3 * meta['calibration_rms_s']:.2f} ms): fixed ms per step by batch size "
            f"({table}; 0 = prefill) + {1e6 * c['per_kv_token_s']:.3f} us/KV token + "
            f"{1e3 * c['per_prefill_token_s']:.3f} ms/prefill token; a decode step's KV tokens "
            + (
                "are its batch times its longest context (the torch backend pads to it)"
                if c.get("padded_kv")
                else "are the sum of its contexts"
            )
            + ". Capacity control, ms per step "
            "that decides + per decision, and per step that compacts + per compaction, measured "
            "per policy in runs of their own (`measure_boundary_costs`; 0 with "
            "`--no-boundaries`): "
            + "; ".join(_prices(label, p) for label, p in meta.get("boundary_prices", {}).items())
            + ".",
            "",
            *lines,
            "",
            f"Target: TPS, C and total time within +-{TARGET:.0%} (**!** marks a miss).",
            "",
            *linear,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--kv-pages", type=int, default=64)
    ap.add_argument(
        "--points", nargs="+", default=["fullkv", "growpage", "fixed@budget_tokens=128"]
    )
    ap.add_argument("--layers", default="all", help="recorded layers: 'all' or 0,15,29")
    add_threads(ap, 1)
    ap.add_argument("--repeats", type=int, default=2, help="timings per calibration shape")
    ap.add_argument(
        "--no-boundaries",
        dest="boundaries",
        action="store_false",
        help="leave capacity control unpriced in the simulator (asynchronous)",
    )
    ap.add_argument(
        "--arrival-rate",
        type=float,
        default=None,
        metavar="REQ_PER_S",
        help="requests arrive as a Poisson process of this rate (seed 0, the first "
        "at once) on both sides: LLM.generate(arrival_s=...) over wall-clock "
        "time, the simulator over simulated time (default: all at t = 0)",
    )
    add_out(ap, "sim_vs_engine")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    start, started = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M")
    machine = describe_machine()
    scenario = Scenario(
        num_requests=args.num_requests,
        max_tokens=args.max_tokens,
        page_size=args.page_size,
        kv_pages=args.kv_pages,
        arrival_rate=args.arrival_rate,
    )
    points = parse_points(args.points)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from growpage.engine.loading.loader import load_model
    from growpage.engine.loading.tokenizer import load_tokenizer
    from growpage.eval.workload import reasoning_prompts

    model, tokenizer = load_model(), load_tokenizer()
    prompts = reasoning_prompts(scenario.num_requests)
    prompt_tokens = sum(len(tokenizer.encode_chat(p)) for p in prompts)
    layers = None if args.layers == "all" else [int(x) for x in args.layers.split(",")]

    shapes = calibration_shapes(scenario, prompt_tokens)
    steps = 2 + 2 * len(points)
    passes: list[np.ndarray] = []

    def calibration_pass(step: int) -> None:
        print(
            f"[{step}/{steps}] calibration pass {len(passes) + 1} (engine forward passes)",
            flush=True,
        )
        passes.append(measure(model, shapes, args.repeats))

    calibration_pass(1)
    print(f"[2/{steps}] recording fullkv traces", flush=True)
    traces, rec_outs = record_traces(model, tokenizer, scenario, prompts, out / "traces", layers)
    requests, by_id = workload_from_traces(
        traces, [len(o.token_ids) for o in rec_outs], scenario.arrivals()
    )
    engine_stats = []
    for i, point in enumerate(points):
        print(f"[{3 + 2 * i}/{steps}] engine: {point.label}", flush=True)
        engine_stats.append(run_engine(model, tokenizer, scenario, point, prompts))
        calibration_pass(4 + 2 * i)
    # NOTE: the passes are spread over the benchmark, so the fit sees the machine's load as the
    # engine runs did (the machine is shared; one pass alone can be off by tens of percent).
    table = np.concatenate(passes)
    from growpage.engine.profiling.profile import decode_pads_kv

    # The torch backend pads every sequence's KV to the batch's longest: the simulator prices
    # a decode step's KV so (the calibration's contexts are uniform, so the fit is the same).
    pads = decode_pads_kv(model)
    costs = {
        "piecewise": fit_piecewise(table, padded_kv=pads),
        "linear": fit_linear(table, padded_kv=pads),
    }
    costs["piecewise"].save(out / "costmodel.json")
    costs["linear"].save(out / "costmodel-linear.json")
    # Capacity control priced per point on this engine, in runs of their own: what a decision
    # costs depends on the policy (fullkv reads nothing, growpage estimates demand).
    prices = {
        point.label: boundary_prices(model, point, scenario)
        if args.boundaries
        else {"boundary_s": 0.0, "compaction_s": 0.0}
        for point in points
    }
    rms = {
        kind: float(
            np.sqrt(
                np.mean((c.step_time(table[:, 0], table[:, 1], table[:, 2]) - table[:, 3]) ** 2)
            )
        )
        for kind, c in costs.items()
    }
    rows: dict[str, list[dict]] = {kind: [] for kind in costs}
    for point, (stats, config) in tqdm(
        list(zip(points, engine_stats, strict=True)), desc="simulate", unit="point"
    ):
        for kind, cost in costs.items():
            price = prices[point.label]
            priced = with_boundary_costs(
                cost,
                price["boundary_s"],
                price["compaction_s"],
                price.get("boundary_step_s"),
                price.get("compaction_step_s"),
            )
            result = run_sim(requests, by_id, point, config, scenario, priced)
            rows[kind].append(compare(point.label, engine_row(stats), sim_row(result)))
    meta = {
        "command": "python " + " ".join(["benchmarks/sim_vs_engine.py", *sys.argv[1:]]),
        "machine": machine,
        "torch": torch.__version__,
        "threads": args.threads,
        "date": started,
        "wall_s": time.perf_counter() - start,
        "num_requests": scenario.num_requests,
        "prompt_tokens": prompt_tokens,
        "max_tokens": scenario.max_tokens,
        "kv_pages": scenario.kv_pages,
        "arrival_rate": scenario.arrival_rate,
        "page_size": scenario.page_size,
        "max_num_seqs": scenario.max_num_seqs,
        "recorded_layers": "all" if layers is None else len(layers),
        "calibration_rows": len(table),
        "calibration_rms_s": rms["piecewise"],
        "linear_calibration_rms_s": rms["linear"],
        "cost_model": attrs.asdict(costs["piecewise"]),
        "linear_cost_model": attrs.asdict(costs["linear"]),
        "boundary_prices": prices,
    }
    report = markdown(rows["piecewise"], meta, rows["linear"])
    (out / "report.md").write_text(report)
    (out / "sim_vs_engine.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "scenario": attrs.asdict(scenario),
                "rows": rows["piecewise"],
                "linear_rows": rows["linear"],
                "calibration": table.tolist(),
            },
            indent=1,
        )
        + "\n"
    )
    print(report)
    print(
        f"results in {out}/ (report.md, sim_vs_engine.json, costmodel.json, "
        "costmodel-linear.json, traces/)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
