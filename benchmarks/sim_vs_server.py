"""Does the serving simulator predict the latencies clients of ``growpage serve`` measure?

``benchmarks/sim_vs_engine.py`` checks the simulator against the engine called in-process;
this checks it against the server, as a client sees it: requests sent over HTTP at their
Poisson arrival times, streamed, and timed on the client (``growpage bench serve``'s client), so
HTTP, the event loop, per-step detokenization and the engine thread's hand-offs are all in the
measurement and none of them in the simulator. Steps:

1. **calibrate**: time the engine's forward passes (every batch size from 1 to the number of
   requests; ``sim_vs_engine.calibration_shapes``) right before and right after each server
   run, fit that run's ``PiecewiseCostModel`` (``growpage calibrate --kind piecewise``) on the
   two, and price its policy's capacity control right after it (``measure_boundary_costs``):
   the machine is shared, and its speed drifts by 2x within minutes as other jobs come and go;
2. **record**: run the workload once under ``fullkv`` in-process with a pool large enough for
   everything, recording every layer's queries and keys (the simulator's trace mode decides on
   them);
3. **serve**: per policy, start ``growpage serve`` (a subprocess, one torch thread, prefix caching
   off as in the simulator), send one warm-up request, run the load: the 16 chat prompts of
   ``reasoning_prompts()`` as token-id prompts through ``/v1/completions`` (the chat template
   applied here, so the server sees exactly the recorded tokens), each generating
   ``--max-tokens`` tokens (``ignore_eos``), arriving as a Poisson process (seed 0, the first at
   t = 0); stop the server with SIGTERM; then (unless ``--no-engine``) run the same requests
   in-process (``LLM.generate`` with the same arrival times), which shows how much of a miss
   is the server's and how much the machine's speed moving between runs;
4. **simulate**: ``growpage sim serve`` on the same workload (written as ``workload.csv``: the
   arrival times sent, the recorded lengths, the trace of each request) in trace mode with the
   calibrated cost model and the server's pool, page size and limits;
5. compare TTFT and TPOT at p50 and p90, and throughput (output tokens per second from the first
   arrival to the last finish); the target is +-20% on each.

``--http-overhead`` (on by default) adds the server's fixed cost per request that the simulator
does not see, measured once on the idle server before the load: the client's TTFT of a
one-token request minus the engine's own (``/metrics``' TTFT histogram), added to the
simulator's TTFTs (reported beside the plain prediction).

Run: ``.venv/bin/python benchmarks/sim_vs_server.py`` (about 15 minutes on the 2-core machine);
writes ``results/sim_vs_server/report.md``, ``sim_vs_server.json``, ``workload.csv``,
``costmodel-<point>.json``, ``load-<point>.json``, the servers' logs and the simulator's outputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import sim_vs_engine
import torch
from script_args import ROOT, add_out, add_threads, parser, run_main

from growpage.bench import serve as load
from growpage.bench.workload import BenchRequest
from growpage.core.traces import atomic_write
from growpage.eval.machine import describe_machine
from growpage.sim.calibrate import fit_piecewise
from growpage.sim.costmodel import PiecewiseCostModel
from growpage.sim.sweep import SweepPoint, parse_points
from growpage.sim.workload_csv import WorkloadRequest

TARGET = 0.20  # relative error the simulator should stay within on each gated metric
MODEL_NAME = "SmolLM2-135M-Instruct"
#: (key, label, format); every one is gated
METRICS = [
    ("ttft_p50_s", "TTFT p50 (s)", ".3f"),
    ("ttft_p90_s", "TTFT p90 (s)", ".3f"),
    ("tpot_p50_ms", "TPOT p50 (ms)", ".1f"),
    ("tpot_p90_ms", "TPOT p90 (ms)", ".1f"),
    ("tps", "throughput (tok/s)", ".1f"),
]
SHOWN = [  # reported, not gated
    ("e2e_p50_s", "E2E p50 (s)", ".1f"),
    ("total_s", "total time (s)", ".1f"),
    ("grows", "grow", ".0f"),
    ("compresses", "compress", ".0f"),
    ("preemptions", "preempt", ".0f"),
]


# ---- the server side -------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def start_server(
    point: SweepPoint, scenario: sim_vs_engine.Scenario, port: int, threads: int, log: Path
) -> subprocess.Popen:
    """``growpage serve`` with the scenario's engine, ready (``/health`` answers)."""
    growpage = Path(sys.executable).parent / "growpage"
    command = [str(growpage), "serve", "--port", str(port), "--policy", point.policy]
    for key, value in point.params:
        command += ["--param", f"{key}={json.dumps(value)}"]
    command += ["--page-size", str(scenario.page_size), "--kv-pages", str(scenario.kv_pages)]
    command += ["--max-num-seqs", str(scenario.max_num_seqs), "--no-prefix-caching"]
    command += ["--max-num-batched-tokens", str(scenario.max_num_batched_tokens)]
    command += ["--threads", str(threads), "--log-level", "warning"]
    proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"growpage serve exited with {proc.returncode}: see {log}")
        try:
            _get(f"http://127.0.0.1:{port}/health")
            return proc
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"growpage serve did not start in 300 s: see {log}") from None
            time.sleep(0.5)


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=120)


def engine_ttft_total(url: str) -> tuple[float, float]:
    """``(sum, count)`` of the server's TTFT histogram (``/metrics``)."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {
        s.name: s.value
        for family in text_string_to_metric_families(_get(url + "/metrics").decode())
        for s in family.samples
    }
    return (
        values["growpage_time_to_first_token_seconds_sum"],
        values["growpage_time_to_first_token_seconds_count"],
    )


def http_overhead(url: str, ids: list[int], repeats: int = 5) -> float:
    """Seconds a client's TTFT exceeds the engine's on an idle server: the median over
    ``repeats`` one-token streamed requests of (client TTFT - the engine's TTFT of it)."""
    excess = []
    for i in range(repeats + 1):  # the first warms the server up
        before = engine_ttft_total(url)
        request = BenchRequest(f"probe-{i}", ids, 1)
        [result] = asyncio.run(load.run_load(url, [request], [0.0], MODEL_NAME, progress=False))
        after = engine_ttft_total(url)
        assert result.ok and after[1] == before[1] + 1, result.error
        if i:
            excess.append(result.ttft_s - (after[0] - before[0]))
    return float(np.median(excess))


def serve_point(
    point: SweepPoint,
    scenario: sim_vs_engine.Scenario,
    requests: list[WorkloadRequest],
    send_s: list[float],
    ids: list[list[int]],
    out: Path,
    threads: int,
) -> tuple[dict, float, list]:
    """The load on a fresh server: ``(summary, http overhead s, per-request results)``."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(point, scenario, port, threads, out / f"server-{_slug(point)}.log")
    try:
        overhead = http_overhead(url, ids[0][:64])
        time.sleep(1.0)
        cpu, steps = thread_cpu_s(proc.pid), server_counts(url)["step_s"]
        sent = [
            BenchRequest(r.request_id, p, r.output_tokens)
            for r, p in zip(requests, ids, strict=True)
        ]
        results = asyncio.run(load.run_load(url, sent, send_s, MODEL_NAME))
        counts = server_counts(url)
        counts["cpu_share"] = engine_cpu_share(
            cpu, thread_cpu_s(proc.pid), counts["step_s"] - steps
        )
    finally:
        status = stop_server(proc)
    if status != 0:
        raise RuntimeError(f"growpage serve exited with status {status} after SIGTERM")
    summary = load.summarize(results)
    if summary["num_failed"]:
        raise RuntimeError(f"{summary['num_failed']} requests failed: {summary['errors']}")
    summary["engine"] = counts
    return summary, overhead, results


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of process ``pid`` (Linux ``/proc``)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def engine_cpu_share(before: dict[int, float], after: dict[int, float], step_s: float) -> float:
    """The engine thread's CPU seconds per wall second of its steps over a load: the share of a
    core it got (the thread that used the most CPU is the engine's)."""
    used = max(after[t] - before.get(t, 0.0) for t in after)
    return used / step_s if step_s > 0 else 1.0


def server_counts(url: str) -> dict[str, float]:
    """The server engine's steps, step seconds and capacity events (``/metrics``), less the
    HTTP-term probes' (one prefill and no boundary each: their steps are few and short)."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {
        s.name: s.value
        for family in text_string_to_metric_families(_get(url + "/metrics").decode())
        for s in family.samples
    }
    return {
        "num_steps": values["growpage_step_seconds_count"],
        "step_s": values["growpage_step_seconds_sum"],
        "grows": values["growpage_grows_total"],
        "compresses": values["growpage_compressions_total"],
        "preemptions": values["growpage_preemptions_total"],
    }


def write_load(path: Path, summary: dict, overhead: float, results: list) -> None:
    requests = [
        {
            k: getattr(r, k)
            for k in ("arrival_s", "sent_s", "ttft_s", "tpot_s", "e2e_s", "num_tokens")
        }
        for r in results
    ]
    write_json(path, {"summary": summary, "http_overhead_s": overhead, "requests": requests})


def write_json(path: Path, payload: dict) -> None:
    """``payload`` as JSON at ``path``, atomically."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(payload, indent=1) + "\n"))


def server_row(summary: dict) -> dict:
    return {
        "ttft_p50_s": summary["ttft_p50_s"],
        "ttft_p90_s": summary["ttft_p90_s"],
        "tpot_p50_ms": summary["tpot_p50_ms"],
        "tpot_p90_ms": summary["tpot_p90_ms"],
        "tps": summary["throughput_tok_s"],
        "e2e_p50_s": summary["e2e_p50_s"],
        "total_s": summary["duration_s"],
        "grows": summary["engine"]["grows"],
        "compresses": summary["engine"]["compresses"],
        "preemptions": summary["engine"]["preemptions"],
    }


def engine_row(stats: Any) -> dict:
    """The in-process engine (``LLM.generate`` with the same arrivals) in the same terms."""
    return {
        "ttft_p50_s": stats.ttft_p50_s,
        "ttft_p90_s": stats.ttft_p90_s,
        "tpot_p50_ms": 1e3 * stats.tpot_p50_s,
        "tpot_p90_ms": 1e3 * stats.tpot_p90_s,
        "tps": stats.tps,
        "e2e_p50_s": stats.e2e_p50_s,
        "total_s": stats.total_s,
        "grows": stats.events.get("grow", 0),
        "compresses": stats.events.get("compress", 0),
        "preemptions": stats.num_preemptions,
    }


# ---- the simulator side ----------------------------------------------------------------------
def write_workload(path: Path, requests: list[WorkloadRequest]) -> None:
    """The simulator's CSV workload (with each request's trace)."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["arrival_s", "prompt_tokens", "output_tokens", "trace"])
        for r in requests:
            writer.writerow([repr(r.arrival_s), r.prompt_tokens, r.output_tokens, r.trace])


def sim_command(
    point: SweepPoint,
    scenario: sim_vs_engine.Scenario,
    out: Path,
    prices: dict,
    cost: Path,
    suffix: str = "",
) -> list[str]:
    """``growpage sim serve`` of the workload in trace mode, as the server runs it."""
    command = ["growpage", "sim", "serve", "--workload", str(out / "workload.csv")]
    command += ["--decisions", "trace", "--traces", str(out / "traces")]
    command += ["--cost", str(cost), "--policy", point.policy]
    for key, value in point.params:
        command += ["--param", f"{key}={json.dumps(value)}"]
    command += ["--boundary-ms", f"{1e3 * prices['boundary_s']:.4f}"]
    command += ["--compaction-ms", f"{1e3 * prices['compaction_s']:.4f}"]
    for key in ("boundary_step_s", "compaction_step_s"):  # per step, as the engine batches
        if key in prices:
            command += [f"--{key[:-2].replace('_', '-')}-ms", f"{1e3 * prices[key]:.4f}"]
    command += ["--page-size", str(scenario.page_size), "--kv-pages", str(scenario.kv_pages)]
    command += ["--max-num-seqs", str(scenario.max_num_seqs)]
    command += ["--max-num-batched-tokens", str(scenario.max_num_batched_tokens)]
    command += ["--no-prefix-caching", "--admission-reserve", "0"]
    command += ["--out", str(out / "sim" / (_slug(point) + suffix))]
    return command


def scaled(cost: PiecewiseCostModel, factor: float) -> PiecewiseCostModel:
    """``cost`` with every price multiplied by ``factor``."""
    return attrs.evolve(
        cost,
        batch_s=tuple(factor * t for t in cost.batch_s),
        per_kv_token_s=factor * cost.per_kv_token_s,
        per_prefill_token_s=factor * cost.per_prefill_token_s,
        boundary_s=factor * cost.boundary_s,
        compaction_s=factor * cost.compaction_s,
    )


def run_sim(command: list[str], out: Path) -> dict:
    """Run ``command`` (``growpage`` from this venv) and read its ``metrics.json``."""
    growpage = str(Path(sys.executable).parent / "growpage")
    subprocess.run([growpage, *command[1:]], check=True, stdout=subprocess.DEVNULL)
    return json.loads((Path(command[-1]) / "metrics.json").read_text())["metrics"]


def sim_row(metrics: dict, http_s: float = 0.0) -> dict:
    """The simulator's numbers; ``http_s`` added to its TTFTs (the server's fixed cost per
    request, which it does not model)."""
    return {
        "ttft_p50_s": metrics["ttft_p50_s"] + http_s,
        "ttft_p90_s": metrics["ttft_p90_s"] + http_s,
        "tpot_p50_ms": metrics["tpot_p50_ms"],
        "tpot_p90_ms": metrics["tpot_p90_ms"],
        "tps": metrics["tps"],
        "e2e_p50_s": metrics["e2e_p50_s"] + http_s,
        "total_s": metrics["total_s"],
        "grows": metrics["grows"],
        "compresses": metrics["compresses"],
        "preemptions": metrics["num_preemptions"],
    }


# ---- comparison ------------------------------------------------------------------------------
def _slug(point: SweepPoint) -> str:
    return point.label.replace(" ", "_").replace("=", "-")


def compare(label: str, server: dict, sim: dict, adjusted: dict, engine: dict | None) -> dict:
    rel = sim_vs_engine.relative_error
    keys = [k for k, _, _ in METRICS + SHOWN]
    errors = {k: rel(sim[k], server[k]) for k in keys}
    adjusted_errors = {k: rel(adjusted[k], server[k]) for k in keys}

    def within(errs: dict) -> bool:
        return all(errs[k] is not None and abs(errs[k]) <= TARGET for k, _, _ in METRICS)

    return {
        "point": label,
        "server": server,
        "sim": sim,
        "sim_cpu_share": adjusted,
        "engine": engine,
        "rel_error": errors,
        "rel_error_cpu_share": adjusted_errors,
        "within_target": within(errors),
        "within_target_cpu_share": within(adjusted_errors),
    }


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "| point | metric | server (measured) | simulator | error | simulator, CPU share "
        "| error | in-process engine, just after |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(err: float | None, gated: bool) -> str:
        if err is None:
            return "n/a"
        return f"{err:+.1%}" + (" **!**" if gated and abs(err) > TARGET else "")

    for row in rows:
        for key, name, fmt in METRICS + SHOWN:
            gated = any(key == k for k, _, _ in METRICS)
            engine = row["engine"]
            beside = "-" if engine is None else format(engine[key], fmt)
            lines.append(
                f"| {row['point']} | {name} | {row['server'][key]:{fmt}} | "
                f"{row['sim'][key]:{fmt}} | {cell(row['rel_error'][key], gated)} | "
                f"{row['sim_cpu_share'][key]:{fmt}} | "
                f"{cell(row['rel_error_cpu_share'][key], gated)} | {beside} |"
            )
    calibration = [
        "| point | load average (before / after) | step ms at batch 1 / 8 / 16 | "
        "us per KV token | ms per prefill token | rms ms | capacity control ms "
        "(decision + compaction) | CPU share: calibration / server | HTTP term ms |",
        "|---|---|---|---:|---:|---:|---|---|---:|",
    ]
    for label, p in meta["points"].items():
        c, bp = p["cost_model"], p["boundary_prices"]
        batch = dict(zip(c["batch_sizes"], c["batch_s"], strict=True))
        fixed = " / ".join(f"{1e3 * batch[n]:.0f}" if n in batch else "-" for n in (1, 8, 16))
        calibration.append(
            f"| {label} | {p['load_average'][0]:.1f} / {p['load_average'][1]:.1f} | {fixed} | "
            f"{1e6 * c['per_kv_token_s']:.2f} | {1e3 * c['per_prefill_token_s']:.3f} | "
            f"{1e3 * p['calibration_rms_s']:.1f} | {1e3 * bp['boundary_s']:.2f} + "
            f"{1e3 * bp['compaction_s']:.2f} | "
            + " + ".join(f"{x:.2f}" for x in p["cpu_share_calibration"])
            + f" / {p['cpu_share_server']:.2f} | {1e3 * p['http_overhead_s']:.1f} |"
        )
    met = [r["point"] for r in rows if r["within_target"]]
    met_cpu = [r["point"] for r in rows if r["within_target_cpu_share"]]
    return "\n".join(
        [
            "# Simulator vs server (CPU, SmolLM2-135M-Instruct over HTTP)",
            "",
            f"Command: `{meta['command']}`",
            "",
            f"Machine: {meta['machine']}; torch {meta['torch']}, {meta['threads']} thread(s); "
            f"commit {meta['commit']}; measured {meta['date']}; whole benchmark "
            f"{meta['wall_s']:.0f} s.",
            "",
            f"Workload: {meta['num_requests']} chat prompts from `reasoning_prompts()` sent as "
            f"token ids to `/v1/completions` ({meta['prompt_tokens']} prompt tokens in all), "
            f"{meta['max_tokens']} generated tokens each (EOS ignored), streamed, Poisson "
            f"arrivals at {meta['arrival_rate']:g} requests/s (seed 0, the first at t = 0); "
            f"`growpage serve` with a pool of {meta['kv_pages']} pages x {meta['page_size']} "
            f"tokens, max_num_seqs {meta['max_num_seqs']}, prefix caching off, one torch "
            "thread. Latencies are timed on the client (`growpage bench serve`'s).",
            "",
            "Simulator: `growpage sim serve` in trace mode on `workload.csv` (the arrival times "
            "sent, the recorded traces), with a piecewise cost model fitted on the calibration "
            "passes right before and after the point's server run (forward passes of every batch "
            "size, KV padded to the longest as the torch backend reads it) and capacity control "
            "priced right after it (`measure_boundary_costs`). Both simulator columns add the "
            "HTTP term: the client's TTFT minus the engine's on the idle server (median of 5 "
            "one-token requests, measured on each server before its load), to TTFT and E2E. "
            "'Simulator, CPU share' prices every step and boundary times the CPU share the "
            "calibration got over the share the server's engine thread got during the load "
            "(its thread's CPU seconds per wall second of its steps, from /proc): the machine is "
            "shared, and the CPU other jobs leave moves by 2x within minutes. The last column "
            "is the same requests served in-process (`LLM.generate` with the same arrival times) "
            "right after the server run and the pricing: the same engine, no HTTP. One of the "
            "simulator's "
            f"commands: `{' '.join(meta['sim_commands'][0])}`.",
            "",
            *calibration,
            "",
            *lines,
            "",
            f"Target: TTFT and TPOT p50 and p90 and throughput within +-{TARGET:.0%} "
            "(**!** marks a miss). Within it on every gated metric: "
            f"{', '.join(met) or 'none'} (simulator); {', '.join(met_cpu) or 'none'} "
            "(simulator, CPU share).",
            "",
        ]
    )


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--kv-pages", type=int, default=64)
    ap.add_argument("--arrival-rate", type=float, default=0.5, metavar="REQ_PER_S")
    ap.add_argument(
        "--points", nargs="+", default=["fullkv", "growpage", "fixed@budget_tokens=128"]
    )
    add_threads(ap, 1)
    ap.add_argument("--repeats", type=int, default=2, help="timings per calibration shape")
    ap.add_argument(
        "--no-http-overhead",
        dest="http_overhead",
        action="store_false",
        help="compare the simulator's TTFT without the measured HTTP term",
    )
    ap.add_argument(
        "--no-engine",
        dest="engine",
        action="store_false",
        help="skip the in-process engine run after each server run (LLM.generate with the "
        "same arrivals; it shows how far the machine's speed moved between runs)",
    )
    add_out(ap, "sim_vs_server")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    start, started = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M")
    commit, machine = git_commit(), describe_machine()
    scenario = sim_vs_engine.Scenario(
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
    ids = [tokenizer.encode_chat(p) for p in prompts]
    shapes = sim_vs_engine.calibration_shapes(scenario, sum(map(len, ids)))
    steps = 1 + (5 if args.engine else 4) * len(points)
    step = iter(range(1, steps + 1))
    passes: list[np.ndarray] = []
    loads: list[float] = []  # the 1-minute load average at each pass
    shares: list[float] = []  # CPU seconds per wall second of each pass (one thread)

    def calibration_pass() -> None:
        print(f"[{next(step)}/{steps}] calibration pass {len(passes) + 1}", flush=True)
        loads.append(os.getloadavg()[0])
        wall, cpu = time.perf_counter(), time.process_time()
        passes.append(sim_vs_engine.measure(model, shapes, args.repeats))
        shares.append((time.process_time() - cpu) / (time.perf_counter() - wall))

    print(f"[{next(step)}/{steps}] recording fullkv traces", flush=True)
    traces, outs = sim_vs_engine.record_traces(model, tokenizer, scenario, prompts, out / "traces")
    send_s = scenario.arrivals()
    assert send_s is not None
    requests = [
        WorkloadRequest(e.request_id, t, e.prompt_len, len(o.token_ids), e.request_id)
        for e, o, t in zip(traces.index, outs, send_s, strict=True)
    ]
    assert [r.prompt_tokens for r in requests] == [len(x) for x in ids]
    write_workload(out / "workload.csv", requests)

    # NOTE: the machine is shared and its speed drifts by 2x within minutes as other jobs come
    # and go: each run is bracketed by calibration passes (one right before, one right after),
    # its cost model is fitted on those two, and capacity control is priced right after it.
    from growpage.engine.profiling.profile import decode_pads_kv

    rows, commands, meta_points = [], [], {}
    for point in points:
        calibration_pass()
        print(f"[{next(step)}/{steps}] growpage serve: {point.label}", flush=True)
        summary, overhead, results = serve_point(
            point, scenario, requests, send_s, ids, out, args.threads
        )
        write_load(out / f"load-{_slug(point)}.json", summary, overhead, results)
        print(load.table(summary), flush=True)
        print(f"HTTP term (client TTFT - engine TTFT, idle server): {1e3 * overhead:.1f} ms")
        calibration_pass()
        print(f"[{next(step)}/{steps}] pricing capacity control", flush=True)
        prices = sim_vs_engine.boundary_prices(model, point, scenario)
        engine = None
        if args.engine:
            print(f"[{next(step)}/{steps}] in-process engine: {point.label}", flush=True)
            stats, _ = sim_vs_engine.run_engine(model, tokenizer, scenario, point, prompts)
            engine = engine_row(stats)
        table = np.concatenate(passes[-2:])
        cost = fit_piecewise(table, padded_kv=decode_pads_kv(model))
        cost_file = out / f"costmodel-{_slug(point)}.json"
        cost.save(cost_file)
        command = sim_command(point, scenario, out, prices, cost_file)
        commands.append(command)
        metrics = run_sim(command, out)
        # The same prices scaled by how much less (or more) CPU the server's engine thread got
        # than the calibration did: the machine's load, not the server, sets that ratio.
        # (Step times go as 1 / share: the fit averages the passes' times, so their harmonic
        # mean share is the one it holds.)
        held = 1.0 / float(np.mean([1.0 / x for x in shares[-2:]]))
        scale = held / summary["engine"]["cpu_share"]
        adjusted_file = out / f"costmodel-{_slug(point)}-cpu-share.json"
        scaled(cost, scale).save(adjusted_file)
        adjusted_prices = {k: scale * prices[k] for k in ("boundary_s", "compaction_s")}
        adjusted = run_sim(
            sim_command(point, scenario, out, adjusted_prices, adjusted_file, "-cpu-share"), out
        )
        http_s = overhead if args.http_overhead else 0.0
        rows.append(
            compare(
                point.label,
                server_row(summary),
                sim_row(metrics, http_s),
                sim_row(adjusted, http_s),
                engine,
            )
        )
        fitted = cost.step_time(table[:, 0], table[:, 1], table[:, 2])
        meta_points[point.label] = {
            "cost_model": attrs.asdict(cost),
            "calibration_rows": len(table),
            "calibration_rms_s": float(np.sqrt(np.mean((fitted - table[:, 3]) ** 2))),
            "load_average": loads[-2:],
            "cpu_share_calibration": shares[-2:],
            "cpu_share_server": summary["engine"]["cpu_share"],
            "scale": scale,
            "boundary_prices": prices,
            "http_overhead_s": overhead,
        }
    meta = {
        "command": "python " + " ".join(["benchmarks/sim_vs_server.py", *sys.argv[1:]]),
        "commit": commit,
        "machine": machine,
        "torch": torch.__version__,
        "threads": args.threads,
        "date": started,
        "wall_s": time.perf_counter() - start,
        "num_requests": scenario.num_requests,
        "prompt_tokens": sum(map(len, ids)),
        "max_tokens": scenario.max_tokens,
        "arrival_rate": scenario.arrival_rate,
        "kv_pages": scenario.kv_pages,
        "page_size": scenario.page_size,
        "max_num_seqs": scenario.max_num_seqs,
        "points": meta_points,
        "sim_commands": [
            [c if not c.startswith(str(ROOT)) else os.path.relpath(c, ROOT) for c in cmd]
            for cmd in commands
        ],
    }
    report = markdown(rows, meta)
    (out / "report.md").write_text(report)
    write_json(
        out / "sim_vs_server.json",
        {"meta": meta, "rows": rows, "calibration": [p.tolist() for p in passes]},
    )
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
