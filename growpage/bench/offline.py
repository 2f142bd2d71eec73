"""``growpage bench throughput`` and ``growpage bench latency``: the engine run offline
(``LLM.generate``), every request generating exactly its output tokens (``ignore_eos``).

``throughput`` serves a whole workload at once: requests and tokens per second, the engine's
steps and the share of the run its capacity boundaries took. ``latency`` runs batches of
``--batch-size`` random prompts, ``--num-iters`` times after ``--num-iters-warmup``: the
batch's latency, every engine step's and every request's TTFT, TPOT and E2E, as the mean and
percentiles.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import attrs
from tqdm.auto import tqdm

from growpage.bench.report import (
    Latency,
    latency_fields,
    latency_table,
    lines,
    out_path,
    write_result,
)
from growpage.bench.workload import BenchRequest, bench_requests, synthetic_requests
from growpage.engine.cli_flags import llm_kwargs
from growpage.engine.llm import LLM
from growpage.engine.outputs import EngineStats, RequestOutput
from growpage.engine.sampling_params import SamplingParams
from growpage.errors import ConfigError

LATENCIES: list[Latency] = [
    ("latency", "s", "batch (s)", 1.0),
    ("step", "ms", "step (ms)", 1e3),
    ("ttft", "s", "TTFT (s)", 1.0),
    ("tpot", "ms", "TPOT (ms)", 1e3),
    ("e2e", "s", "E2E (s)", 1.0),
]


def generate(
    llm: LLM, requests: list[BenchRequest], progress: bool = False
) -> tuple[list[RequestOutput], EngineStats]:
    """Every request at once, each generating exactly its output tokens; the outputs and the
    call's statistics."""
    params = [SamplingParams(max_tokens=r.output_tokens, ignore_eos=True) for r in requests]
    outs = llm.generate([r.prompt for r in requests], params, use_tqdm=progress)
    assert llm.last_stats is not None, "a finished generate call leaves its stats"
    return outs, llm.last_stats


def throughput_summary(stats: EngineStats) -> dict[str, Any]:
    """Tokens and requests per second, steps and the boundary share of one run."""
    total = stats.total_s
    return {
        "num_requests": stats.num_requests,
        "input_tokens": stats.num_prompt_tokens,
        "output_tokens": stats.num_output_tokens,
        "total_s": total,
        "request_throughput_req_s": stats.num_requests / total if total > 0 else 0.0,
        "output_throughput_tok_s": stats.tps,
        "total_throughput_tok_s": (
            (stats.num_prompt_tokens + stats.num_output_tokens) / total if total > 0 else 0.0
        ),
        "num_steps": stats.num_steps,
        "step_mean_ms": 1e3 * total / stats.num_steps if stats.num_steps else 0.0,
        "boundary_s": stats.boundary_s,
        "boundary_share": stats.boundary_s / total if total > 0 else 0.0,
        "num_boundaries": stats.events.get("boundaries", 0),
        "events": dict(stats.events),
        "avg_kv_budget": stats.avg_kv_budget,
        "num_preemptions": stats.num_preemptions,
    }


def throughput_table(s: dict[str, Any]) -> str:
    events = ", ".join(
        f"{k} {s['events'][k]}"
        for k in ("grow", "compress", "shrink", "fallback")
        if s["events"][k]
    )
    return lines(
        [
            ("requests", str(s["num_requests"])),
            ("tokens", f"{s['input_tokens']} in, {s['output_tokens']} out"),
            ("total time", f"{s['total_s']:.2f} s"),
            (
                "throughput",
                f"{s['request_throughput_req_s']:.2f} req/s, "
                f"{s['output_throughput_tok_s']:.1f} output tok/s, "
                f"{s['total_throughput_tok_s']:.1f} total tok/s",
            ),
            ("engine steps", f"{s['num_steps']} ({s['step_mean_ms']:.2f} ms per step)"),
            (
                "boundary share",
                f"{100 * s['boundary_share']:.1f}% ({s['boundary_s']:.3f} s in "
                f"{s['num_boundaries']} capacity boundaries{': ' + events if events else ''})",
            ),
            ("avg KV budget", f"{s['avg_kv_budget']:.0f} tokens"),
            ("preemptions", str(s["num_preemptions"])),
        ]
    )


def run_throughput(args: argparse.Namespace) -> int:
    out = out_path(args.out)
    engine: list[LLM] = []
    requests = bench_requests(args, lambda: _vocab_size(_llm(args, engine)))
    llm = _llm(args, engine)  # a text dataset needs no vocabulary: built here
    _, stats = generate(llm, requests, args.progress)
    summary = throughput_summary(stats)
    print(f"{llm.model.config.name} under {stats.policy}, pages of {stats.page_size} tokens")
    print(throughput_table(summary))
    if out is not None:
        stats_row = attrs.asdict(stats, filter=lambda a, _: a.name != "pool_timeline")
        write_result(out, args, {"model": llm.model.config.name, **summary, "stats": stats_row})
    return 0


def latency_summary(
    batch_s: list[float], runs: list[tuple[list[RequestOutput], EngineStats]], percentiles: Any
) -> dict[str, Any]:
    """Means and percentiles of the batches' latencies, their steps' and their requests'."""
    steps = []  # seconds of every step: the gaps between the ends of a run's steps
    for _, stats in runs:
        ends = [0.0] + [end for end, _, _ in stats.pool_timeline]
        steps += [b - a for a, b in zip(ends, ends[1:], strict=False)]
    outs = [o for batch, _ in runs for o in batch]
    values = {
        "latency": batch_s,
        "step": steps,
        "ttft": [o.ttft_s for o in outs],
        "tpot": [o.tpot_s for o in outs if len(o.token_ids) > 1],
        "e2e": [o.e2e_s for o in outs],
    }
    summary: dict[str, Any] = {
        "num_iters": len(runs),
        "num_steps": len(steps),
        "num_requests": len(outs),
        "output_tokens": sum(len(o.token_ids) for o in outs),
    }
    for key, unit, _, scale in LATENCIES:
        summary.update(latency_fields(key, values[key], unit, percentiles, scale))
    return summary


def run_latency(args: argparse.Namespace) -> int:
    out = out_path(args.out)
    for flag, value in (("--batch-size", args.batch_size), ("--num-iters", args.num_iters)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if args.num_iters_warmup < 0:
        raise ConfigError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}")
    llm = _llm(args, [])
    vocab = _vocab_size(llm)
    batch_s, runs = [], []
    total = args.num_iters_warmup + args.num_iters
    for i in tqdm(range(total), desc="batches", unit="batch", disable=not args.progress):
        # New prompts every batch: a repeated one would be served from the prefix cache.
        requests = synthetic_requests(
            args.batch_size, args.input_len, args.output_len, vocab, args.seed + i
        )
        start = time.perf_counter()
        run = generate(llm, requests)
        if i >= args.num_iters_warmup:
            batch_s.append(time.perf_counter() - start)
            runs.append(run)
    summary = latency_summary(batch_s, runs, args.metric_percentiles)
    print(
        f"{llm.model.config.name} under {llm.policy.name}: {args.num_iters} batches of "
        f"{args.batch_size} requests, {args.input_len} prompt and {args.output_len} output "
        f"tokens each, after {args.num_iters_warmup} warmup "
        f"batch{'' if args.num_iters_warmup == 1 else 'es'}"
    )
    print(latency_table(summary, LATENCIES, args.metric_percentiles))
    if out is not None:
        write_result(out, args, {"model": llm.model.config.name, **summary})
    return 0


def _llm(args: argparse.Namespace, built: list[LLM]) -> LLM:
    """The engine of the flags, built once (``built`` holds it)."""
    if not built:
        built.append(LLM(**llm_kwargs(args)))
    return built[0]


def _vocab_size(llm: LLM) -> int:
    return int(llm.model.config.vocab_size)
