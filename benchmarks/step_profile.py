"""Where does a decode step's time go, on the host and on the device?

Runs one workload three times on one engine (SmolLM2 by default: ``--requests`` chat prompts,
``--max-tokens`` each, EOS ignored, no prefix cache, so the runs are alike) and reports, per
decode step:

1. **plain**: wall ms per decode step and tokens per second, nothing timed inside;
2. **phases**: the engine's phases timed (``host_cost.py``'s split: schedule, inputs, forward,
   query state, sampling, detokenize, bookkeeping, boundary). On CUDA each timed call
   synchronizes the device at its start and end, so a phase's time includes the device work it
   queued: the split says what each phase costs, the plain run what they cost together when
   the host runs ahead of the device;
3. **window**: ``torch.profiler`` over ``--window`` decode steps from the middle of a run: the
   host's CPU time per step (this thread), the device's busy time per step (the union of its
   kernels' intervals) and its share of the wall time (well under 100%: the step waits for the
   host), the top device kernels and host operators, and a Chrome trace
   (``<out>.trace.json.gz``, open it in https://ui.perfetto.dev).

    python benchmarks/step_profile.py --device cuda                 # SmolLM2, 64 x 512, graphs
    python benchmarks/step_profile.py --device cpu --requests 8 --max-tokens 64
    python benchmarks/gpu_check.py --sections step                  # the same, in the GPU check

CUDA graphs are on where they can run (CUDA, the Triton backend), as ``gpu_check``'s
``fullkv+graphs`` row runs them; ``--no-graphs`` turns them off. The pool is the GPU check's
(40% of the pages every request needs at once) unless ``--kv-pages`` says otherwise. Writes
``<out>.json`` and ``<out>.md`` (default ``results/step_profile``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from host_cost import PHASES, PhaseClock, _decode_all, watch_schedule
from script_args import ROOT, out_stem, parser, run_main

TOP = 12  # kernels and operators listed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--model", default=None, help="GGUF/HF model or catalog name (default SmolLM2)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", help="the engine's dtype (gpu_check's rows)")
    p.add_argument("--policy", default="fullkv")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--kv-pages", type=int, default=None, help="default: the GPU check's pool")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--no-graphs", action="store_true", help="no CUDA graphs on CUDA")
    p.add_argument("--window", type=int, default=8, help="decode steps the profiler records")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "step_profile")
    args = p.parse_args(argv)
    for name in ("requests", "max_tokens", "page_size", "window"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.window > args.max_tokens - 2:
        p.error(f"--window ({args.window}) must leave room in --max-tokens ({args.max_tokens})")
    return args


def profile_steps(args: argparse.Namespace) -> dict[str, Any]:
    """The three runs of the module docstring; the Chrome trace goes beside ``args.out``."""
    from boundary_share import gpu_check_pool

    from growpage.engine.llm import LLM
    from growpage.engine.sampling_params import SamplingParams
    from growpage.eval.workload import reasoning_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.device(args.device).type == "cuda"
    base = LLM(args.model, policy="fullkv", kv_pages=8, device=args.device, dtype=args.dtype)
    prompts = [base.tokenizer.encode_chat(p) for p in reasoning_prompts(args.requests)]
    kv_pages = args.kv_pages or gpu_check_pool(
        [len(p) for p in prompts], args.max_tokens, args.page_size
    )
    llm = LLM(
        base.model,
        policy=args.policy,
        tokenizer=base.tokenizer,
        page_size=args.page_size,
        kv_pages=kv_pages,
        max_num_seqs=args.requests,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        enable_prefix_caching=False,
        cuda_graphs=False if args.no_graphs or not cuda else None,
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    last = watch_schedule(engine)
    run = [0]

    def add_all() -> None:
        run[0] += 1
        for i, ids in enumerate(prompts):
            engine.add_request(f"{run[0]}-{i}", ids, params)

    add_all()  # a run to warm up: allocator, kernels, graphs
    while engine.has_unfinished():
        engine.step()

    report: dict[str, Any] = {
        "model": llm.engine.runner.model.config.name,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": str(llm.config.dtype).removeprefix("torch."),
        "backend": engine.runner.model.backend.name,
        "cuda_graphs": engine.runner.graphs is not None,
        "policy": args.policy,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "page_size": args.page_size,
        "kv_pages": kv_pages,
    }
    report["plain"] = _plain(engine, add_all, last, cuda)
    report["phases"] = _phases(engine, add_all, last, cuda)
    report["window"] = _window(engine, add_all, last, args, cuda)
    return report


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _plain(engine: Any, add_all: Any, last: dict, cuda: bool) -> dict[str, Any]:
    add_all()
    steps, wall_s, tokens = 0, 0.0, 0
    while engine.has_unfinished():
        _sync(cuda)
        start = time.perf_counter()
        engine.step()
        _sync(cuda)
        if not last["prefill"]:
            steps += 1
            wall_s += time.perf_counter() - start
            tokens += last["batch"]
    return {
        "decode_steps": steps,
        "ms_per_step": 1000 * wall_s / max(steps, 1),
        "mean_batch": tokens / max(steps, 1),
        "decode_tokens_per_s": tokens / wall_s if wall_s else None,
    }


def _phases(engine: Any, add_all: Any, last: dict, cuda: bool) -> dict[str, Any]:
    runner = engine.runner

    def clock() -> float:
        _sync(cuda)
        return time.perf_counter()

    timer = PhaseClock()
    timer.wrap_host_phases(engine, clock)
    timer.wrap(runner.model, "forward", "forward", clock)
    timer.wrap(runner.model, "compute_logits", "forward", clock)
    if runner.graphs is not None:  # a replay (its static inputs filled): the forward
        timer.wrap(runner.graphs, "run", "forward", clock)
    totals = dict.fromkeys(PHASES, 0.0)
    add_all()
    try:
        steps, wall_s, _ = _decode_all(engine, timer, last, totals, real=True)
    finally:
        timer.restore()
    per = 1000 / max(steps, 1)
    return {
        "decode_steps": steps,
        "ms_per_step": wall_s * per,
        "ms": {k: v * per for k, v in totals.items()},
    }


def _window(
    engine: Any, add_all: Any, last: dict, args: argparse.Namespace, cuda: bool
) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    skip = max((args.max_tokens - args.window) // 2, 1)  # decode steps before the window
    add_all()
    seen = decode = prefill = 0
    prof = None
    wall_s = cpu_s = 0.0
    while engine.has_unfinished():
        if prof is None and seen == skip:
            prof = profile(activities=activities)
            prof.__enter__()
        _sync(cuda)
        cpu = time.thread_time()
        start = time.perf_counter()
        engine.step()
        _sync(cuda)
        elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu
        seen += not last["prefill"]
        if prof is None:
            continue
        wall_s += elapsed
        cpu_s += cpu
        decode += not last["prefill"]
        prefill += last["prefill"]
        if decode == args.window:
            break
    if prof is None:
        raise RuntimeError(f"the run ended after {seen} decode steps, before the window")
    prof.__exit__(None, None, None)
    while engine.has_unfinished():  # the rest of the run, untimed
        engine.step()
    steps = decode + prefill
    trace = _write_trace(prof, args.out)
    device_us = _busy_us(prof) if cuda else None
    return {
        "decode_steps": decode,
        "prefill_steps": prefill,
        "wall_ms_per_step": 1000 * wall_s / steps,
        "host_cpu_ms_per_step": 1000 * cpu_s / steps,
        "device_busy_ms_per_step": None if device_us is None else device_us / 1000 / steps,
        "device_busy_pct": None if device_us is None else 100 * device_us / 1e6 / wall_s,
        "top_device": _top(prof, "device", steps) if cuda else [],
        "top_host": _top(prof, "cpu", steps),
        "trace": trace.name,
    }


def _busy_us(prof: Any) -> float:
    """Length of the union of the device's kernel and copy intervals, in microseconds."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    busy, end = 0.0, float("-inf")
    for lo, hi in spans:
        if hi <= end:
            continue
        busy += hi - max(lo, end)
        end = hi
    return busy


def _top(prof: Any, kind: str, steps: int) -> list[dict[str, Any]]:
    """The ``TOP`` operators (host, ``cpu``) or kernels (``device``) by self time, per step."""
    field = "self_cpu_time_total" if kind == "cpu" else "self_device_time_total"
    rows = [e for e in prof.key_averages() if getattr(e, field, 0) > 0]
    if kind == "device":
        rows = [e for e in rows if e.device_type == torch.autograd.DeviceType.CUDA]
    rows.sort(key=lambda e: getattr(e, field), reverse=True)
    return [
        {
            "name": e.key[:80],
            "calls_per_step": e.count / steps,
            "ms_per_step": getattr(e, field) / 1000 / steps,
        }
        for e in rows[:TOP]
    ]


def _write_trace(prof: Any, out: Path) -> Path:
    """``prof``'s Chrome trace, gzipped, at ``<out>.trace.json.gz``."""
    stem = out_stem(out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    raw = stem.with_name(stem.name + ".trace.json")
    prof.export_chrome_trace(str(raw))
    packed = raw.with_name(raw.name + ".gz")
    with raw.open("rb") as src, gzip.open(packed, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    return packed


def to_markdown(r: dict[str, Any]) -> str:
    plain, phases, window = r["plain"], r["phases"], r["window"]
    lines = [
        f"Decode steps of {r['model']} on {r['device']} ({r['dtype']}, {r['backend']}, "
        f"CUDA graphs {'on' if r['cuda_graphs'] else 'off'}), {r['policy']}: "
        f"{r['requests']} requests x {r['max_tokens']} tokens, {r['kv_pages']} pages of "
        f"{r['page_size']}.",
        "",
        f"Plain run: {plain['ms_per_step']:.3f} ms per decode step, "
        f"{plain['mean_batch']:.1f} requests per step on average, "
        f"{plain['decode_tokens_per_s']:.1f} decoded tokens/s ({plain['decode_steps']} "
        "decode steps).",
        "",
        "Phases, ms per decode step (each timed call synchronizes the device, so a phase "
        f"includes the device work it queued; total {phases['ms_per_step']:.3f}):",
        "",
        "| " + " | ".join(PHASES) + " |",
        "|" + "---:|" * len(PHASES),
        "| " + " | ".join(f"{phases['ms'][k]:.3f}" for k in PHASES) + " |",
        "",
        f"Profiled window: {window['decode_steps']} decode and {window['prefill_steps']} "
        f"prefill steps, {window['wall_ms_per_step']:.3f} ms wall and "
        f"{window['host_cpu_ms_per_step']:.3f} ms of host CPU per step",
    ]
    if window["device_busy_ms_per_step"] is not None:
        lines[-1] += (
            f"; the device busy {window['device_busy_ms_per_step']:.3f} ms per step "
            f"({window['device_busy_pct']:.1f}% of the wall time)"
        )
    lines[-1] += f". Trace: `{window['trace']}`."
    for kind, title in (("top_device", "Device kernels"), ("top_host", "Host operators")):
        if window[kind]:
            lines += ["", f"{title} by self time:", "", "| name | calls/step | ms/step |"]
            lines.append("|---|---:|---:|")
            lines += [
                f"| `{row['name']}` | {row['calls_per_step']:.1f} | {row['ms_per_step']:.3f} |"
                for row in window[kind]
            ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = profile_steps(args)
    text = to_markdown(report)
    print(text)
    stem = out_stem(args.out)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    stem.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
