"""How do the policies compare in the real engine, on one workload and one KV page pool?

    python benchmarks/policies_engine.py                          # CPU preset, ~12 min here
    python benchmarks/policies_engine.py --preset full --device cuda   # ~4.5 min on one H200
    python benchmarks/policies_engine.py --preset smoke           # ~90 s: checks the pipeline
    python benchmarks/policies_engine.py --preset full --device cuda --executor ray   # a GPU each

What it does, in one run and with one seed:

1. ``fullkv`` generates a greedy continuation of every reasoning prompt (chat style, EOS ignored so
   every request is long) and a long stretch after every retrieval prompt (facts first).
2. Every policy then *teacher-forces* those continuations (``LLM.score``, paper section 5.3):
   capacity decisions happen exactly as in decoding, one token per step, but the next token is
   the reference one. Each run gives the engine stats (TPS, TPOT, C, budget, events) and the
   quality: mean NLL per token (increase over ``fullkv``) and retrieval accuracy (the answer
   after the stretch is reproduced greedily, token for token).
3. ``fixed`` runs at growpage's measured average budget (rounded to a page) and at twice it;
   ``random`` grows with growpage's measured grow ratio.

The runs are points of a grid (``growpage.executors``): ``--jobs N`` runs N at once in local
worker processes (one GPU each with ``--device cuda``), ``--executor ray`` on the Ray actors of a
cluster (``--address``), one engine built per worker and a GPU per engine where the cluster has
GPUs. Rows are the same, in the same order, whatever ran them; every finished run is kept under
``<out>/finished-points/``, and ``--resume`` skips those. Runs side by side on one CPU share it:
their TPS is lower than one at a time (``--jobs 1``, the default, times them alone).

Writes ``<out>/table.md``, ``<out>/results.json`` and plots (quality vs TPS, trajectories);
``<out>`` is the repository's ``results/policies_engine/<preset>-<device>`` unless ``--out`` says
otherwise, so runs of different presets or devices keep their own results.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from script_args import ROOT, add_threads, parser, run_main

from growpage.engine.config import check_device  # noqa: E402
from growpage.engine.llm import LLM  # noqa: E402
from growpage.engine.sampling_params import SamplingParams  # noqa: E402
from growpage.eval.machine import describe_machine  # noqa: E402
from growpage.eval.workload import (  # noqa: E402
    reasoning_prompts,
    retrieval_continuation,
    retrieval_items,
)
from growpage.executors import Executor, GridError, worker_state  # noqa: E402
from growpage.executors.options import add_executor_arguments, make_executor  # noqa: E402

PRESETS = {
    # The evaluation issue's size: 48 requests of 512 generated tokens.
    "full": dict(num_requests=48, max_tokens=512, page_size=64, retrieval=16, stretch=384),
    # Same 48 requests, shorter generations and smaller pages: ~12 minutes on 2 CPU cores.
    "cpu": dict(num_requests=48, max_tokens=128, page_size=16, retrieval=16, stretch=128),
    "smoke": dict(num_requests=4, max_tokens=12, page_size=8, retrieval=2, stretch=8),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default SmolLM2)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--num-requests", type=int, help="override the preset")
    p.add_argument("--max-tokens", type=int, help="override the preset")
    p.add_argument("--page-size", type=int, help="override the preset")
    p.add_argument("--retrieval", type=int, help="retrieval items (override the preset)")
    p.add_argument("--stretch", type=int, help="generated tokens before the questions")
    p.add_argument(
        "--pool-fraction",
        type=float,
        default=0.4,
        help="KV pool as a fraction of what fullkv needs to hold every request",
    )
    p.add_argument("--min-capacity", type=int, default=4, help="pages every request may hold")
    p.add_argument(
        "--policies",
        nargs="*",
        default=None,
        help="subset of: fullkv growpage fixed random inverse shrink (default all)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--timing-passes",
        type=int,
        default=1,
        help="time every row this many times, in rotated order, and report the "
        "median TPS (runs one after another drift: one pass is noisy to +-20%%)",
    )
    add_threads(p, None)
    add_executor_arguments(p, jobs=1, what="policy runs")
    p.add_argument(
        "--out",
        default=None,
        help="output folder (default: results/policies_engine/<preset>-<device>)",
    )
    args = p.parse_args(argv)
    if args.out is None:
        args.out = str(
            ROOT / "results" / "policies_engine" / f"{args.preset}-{args.device.replace(':', '')}"
        )
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.num_requests < 1 or args.max_tokens < 1 or args.retrieval < 0 or args.stretch < 0:
        p.error("request counts and token counts must be positive")
    if not 0 < args.pool_fraction <= 1:
        p.error("--pool-fraction must be in (0, 1]")
    if args.timing_passes < 1:
        p.error("--timing-passes must be at least 1")
    return args


class Bench:
    """Holds the model once and builds one ``LLM`` per policy over the same pool."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.base = LLM(
            args.model,
            policy="fullkv",
            page_size=args.page_size,
            kv_pages=8,
            device=args.device,
            dtype=args.dtype,
            attention_backend=args.attention_backend,
            seed=args.seed,
        )
        self.tok = self.base.tokenizer
        self.encode = lambda text: self.tok.encode(text, add_special_tokens=False)
        self.prompts = reasoning_prompts(args.num_requests)
        self.items = retrieval_items(args.retrieval, seed=args.seed) if args.retrieval else []
        b = args.page_size
        lengths = [len(self.tok.encode_chat(p)) + args.max_tokens for p in self.prompts]
        self.full_pages = sum(math.ceil((n + 1) / b) for n in lengths)
        longest = max(
            lengths
            + [
                len(self.tok.encode_chat(it.prompt))
                + len(retrieval_continuation(self.encode, [0] * args.stretch, it)[0])
                for it in self.items
            ]
        )
        self.kv_pages = max(
            math.ceil(args.pool_fraction * self.full_pages), math.ceil((longest + 1) / b) + 1
        )

    def llm(self, policy: str, **policy_kwargs) -> LLM:
        a = self.args
        return LLM(
            self.base.model,
            policy=policy,
            policy_kwargs=policy_kwargs,
            tokenizer=self.tok,
            page_size=a.page_size,
            kv_pages=self.kv_pages,
            max_num_seqs=max(a.num_requests, a.retrieval, 1),
            min_capacity=a.min_capacity,
            device=a.device,
            dtype=a.dtype,
            attention_backend=a.attention_backend,
            seed=a.seed,
        )

    def references(self) -> tuple[dict, list[list[int]], list[list[int]], list[list[tuple]]]:
        """fullkv's greedy continuations, its generate stats, and the retrieval continuations."""
        llm = self.llm("fullkv")
        params = SamplingParams(max_tokens=self.args.max_tokens, ignore_eos=True)
        outs = llm.generate(self.prompts, params, chat=True)
        stats = row_from_stats(llm.last_stats)
        conts = [o.token_ids for o in outs]
        rconts, spans = [], []
        if self.items:
            stretch = SamplingParams(max_tokens=max(self.args.stretch, 1), ignore_eos=True)
            routs = llm.generate([it.prompt for it in self.items], stretch, chat=True)
            for it, o in zip(self.items, routs, strict=True):
                ids, sp = retrieval_continuation(self.encode, o.token_ids[: self.args.stretch], it)
                rconts.append(ids)
                spans.append(sp)
        self.sample_text = outs[0].text[:400]
        return stats, conts, rconts, spans

    def run_policy(self, label: str, policy: str, kwargs: dict, conts, rconts, spans) -> dict:
        llm = self.llm(policy, **kwargs)
        start = time.perf_counter()
        scores = llm.score(self.prompts, conts, chat=True, use_tqdm=True)
        row = row_from_stats(llm.last_stats)
        tokens = sum(len(s.token_nlls) for s in scores)
        row.update(
            label=label,
            policy=policy,
            kwargs=kwargs,
            nll=sum(s.nll for s in scores) / tokens,
            trajectories=[s.trajectory for s in scores[:4]],
            prompt_lens=[len(s.prompt_token_ids) for s in scores[:4]],
        )
        if self.items:
            rscores = llm.score([it.prompt for it in self.items], rconts, chat=True)
            hits = [
                s.greedy_match(a, b) for s, sp in zip(rscores, spans, strict=True) for a, b in sp
            ]
            answer_nlls = [
                sum(s.token_nlls[a:b]) for s, sp in zip(rscores, spans, strict=True) for a, b in sp
            ]
            row.update(
                retrieval_acc=sum(hits) / len(hits),
                retrieval_budget=llm.last_stats.avg_kv_budget,
                retrieval_nll=sum(answer_nlls) / len(answer_nlls),
                retrieval_questions=len(hits),
            )
        row["wall_s"] = time.perf_counter() - start
        del llm
        gc.collect()
        return row

    def time_again(self, row: dict, conts) -> dict:
        """One more timed pass of ``row``'s main workload (no retrieval): its stats row."""
        llm = self.llm(row["policy"], **row["kwargs"])
        llm.score(self.prompts, conts, chat=True, use_tqdm=False)
        again = row_from_stats(llm.last_stats)
        del llm
        gc.collect()
        return again


def row_from_stats(st) -> dict:
    e = st.events
    return dict(
        tps=st.tps,
        tpot_ms=1000 * st.tpot_s,
        total_s=st.total_s,
        avg_resident=st.avg_resident,
        avg_budget=st.avg_kv_budget,
        grow=e.get("grow", 0),
        compress=e.get("compress", 0),
        shrink=e.get("shrink", 0),
        fallback=e.get("fallback", 0),
        preemptions=st.num_preemptions,
        decided_grow=e.get("decided_grow", 0),
        decided_compress=e.get("decided_compress", 0),
        boundary_s=st.boundary_s,
        output_tokens=st.num_output_tokens,
        max_pages_used=st.max_pages_used,
    )


ALL_POLICIES = ["fullkv", "growpage", "fixed", "random", "inverse", "shrink"]


def policy_order(wanted: list[str] | None) -> list[str]:
    """fullkv (the baseline) always; growpage whenever fixed/random are matched to it."""
    wanted = list(wanted or ALL_POLICIES)
    unknown = sorted(set(wanted) - set(ALL_POLICIES))
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; choose from {ALL_POLICIES}")
    need = {"fullkv", *wanted} | ({"growpage"} if {"fixed", "random"} & set(wanted) else set())
    return [p for p in ALL_POLICIES if p in need]


def plan(
    args: argparse.Namespace, name: str, growpage_row: dict | None
) -> list[tuple[str, str, dict]]:
    """The (label, policy, kwargs) runs of one policy; fixed and random match growpage's run."""
    b = args.page_size
    if name in ("fullkv", "growpage", "inverse"):
        return [(name, name, {})]
    if name == "shrink":
        return [("shrink", "shrink", {"min_capacity_tokens": args.min_capacity * b})]
    assert growpage_row is not None, "growpage runs before the policies matched to it"
    if name == "fixed":
        matched = max(args.min_capacity, round(growpage_row["avg_budget"] / b)) * b
        return [
            (f"fixed-{matched}", "fixed", {"budget_tokens": matched}),
            (f"fixed-{2 * matched}", "fixed", {"budget_tokens": 2 * matched}),
        ]
    decided = growpage_row["decided_grow"] + growpage_row["decided_compress"]
    q = growpage_row["decided_grow"] / decided if decided else 0.5
    return [(f"random (q={q:.2f})", "random", {"grow_prob": round(q, 3), "seed": args.seed})]


# Flags that say where the runs go, not what they compute (left out of a point's key).
EXECUTOR_FLAGS = ("executor", "address", "jobs", "default_jobs", "resume", "out", "timing_passes")


def bench_args(args: argparse.Namespace) -> dict:
    """What a worker needs to build the ``Bench`` (the same for every point of a run)."""
    return {k: v for k, v in vars(args).items() if k not in EXECUTOR_FLAGS}


def worker_bench(settings: dict) -> Bench:
    """This worker's ``Bench``: built on its first point, then kept (one engine per worker)."""

    def build() -> Bench:
        if settings["threads"]:
            torch.set_num_threads(settings["threads"])
        return Bench(argparse.Namespace(**settings))

    return worker_state(json.dumps(settings, sort_keys=True), build)


def reference_point(_: int, settings: dict) -> dict:
    """fullkv's continuations (``Bench.references``) and the pool's size, as a row."""
    bench = worker_bench(settings)
    gen_row, conts, rconts, spans = bench.references()
    return dict(
        gen_row=gen_row,
        conts=conts,
        rconts=rconts,
        spans=spans,
        sample_text=bench.sample_text,
        kv_pages=bench.kv_pages,
        full_pages=bench.full_pages,
        num_items=len(bench.items),
    )


def policy_point(run: tuple[str, str, dict], job: tuple[dict, dict]) -> dict:
    """One policy's row (``Bench.run_policy``); ``job``: the settings and the references."""
    settings, refs = job
    label, policy, kwargs = run
    return worker_bench(settings).run_policy(
        label, policy, kwargs, refs["conts"], refs["rconts"], refs["spans"]
    )


def timing_point(run: tuple[str, dict, int], job: tuple[dict, list]) -> dict:
    """Pass ``run[2]`` of one row's timing (``Bench.time_again``)."""
    settings, conts = job
    policy, kwargs, _ = run
    return worker_bench(settings).time_again({"policy": policy, "kwargs": kwargs}, conts)


def grid_executor(args: argparse.Namespace) -> Executor:
    """The executor of ``--executor``/``--jobs``: one engine per worker, a GPU per engine on
    ``--device cuda`` (Ray: actors of one GPU each; local: one visible GPU per process)."""
    gpu = args.device.startswith("cuda")
    out = Path(args.out)
    if args.executor == "local":
        check_device(args.device)  # here, before any work (a Ray cluster's workers may differ)
    if args.executor == "ray":
        return make_executor(
            args, out, num_cpus=args.threads or 1, num_gpus=1 if gpu else 0, actors=True
        )
    envs = None
    if args.device == "cuda" and (args.jobs or 1) > 1:
        envs = [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(torch.cuda.device_count())]
    return make_executor(args, out, worker_env=envs)


def checked(rows: list[dict]) -> list[dict]:
    """``rows``, or a ``GridError`` naming the runs that failed (one bad run spoils the
    table's comparisons)."""
    failed = [r for r in rows if "error" in r]
    if failed:
        raise GridError(
            "policy runs failed: " + "; ".join(f"{r['label']}: {r['error']}" for r in failed)
        )
    return rows


def run(args: argparse.Namespace, on_row=None) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = bench_args(args)
    with grid_executor(args) as executor:
        t0 = time.perf_counter()
        [refs] = checked(
            executor.run(reference_point, [0], settings, [{"label": "references"}], "references")
        )
        bench = SimpleNamespace(**{k: refs[k] for k in ("kv_pages", "full_pages", "sample_text")})
        gen_row = refs["gen_row"]
        print(
            f"[policies_engine] {args.num_requests} requests x {args.max_tokens} tokens, "
            f"{refs['num_items']} retrieval items x {args.stretch}; pool {refs['kv_pages']} "
            f"pages of {args.page_size} ({refs['full_pages']} needed for all at full length); "
            f"references in {time.perf_counter() - t0:.0f} s; fullkv generate: "
            f"{gen_row['tps']:.1f} tok/s",
            flush=True,
        )
        names = policy_order(args.policies)
        by_name: dict[str, list[dict]] = {}
        # fixed and random are matched to growpage's run: they go after it, the rest first.
        for stage in ([n for n in names if n not in MATCHED], [n for n in names if n in MATCHED]):
            growpage_row = by_name.get("growpage", [None])[0]
            runs = [(n, r) for n in stage for r in plan(args, n, growpage_row)]
            rows = checked(
                executor.run(
                    policy_point,
                    [r for _, r in runs],
                    (settings, refs),
                    [{"label": label} for _, (label, _, _) in runs],
                    "policies",
                )
            )
            for (name, _), row in zip(runs, rows, strict=True):
                by_name.setdefault(name, []).append(row)
                print(
                    f"[policies_engine] {row['label']}: {row['tps']:.1f} tok/s, "
                    f"C {row['avg_resident']:.1f}, nll {row['nll']:.4f}, {row['wall_s']:.0f} s",
                    flush=True,
                )
            if on_row is not None:  # partial results survive a run cut short
                done = [r for n in names for r in by_name.get(n, [])]
                on_row(finish(args, bench, gen_row, done, t0))
        rows = [r for n in names for r in by_name[n]]
        timing_passes(
            TimedOn(executor, settings, refs["conts"]), rows, refs["conts"], args.timing_passes
        )
    return finish(args, bench, gen_row, rows, t0)


MATCHED = ("fixed", "random")  # the policies ``plan`` matches to growpage's run


class TimedOn:
    """``timing_passes``' bench: each pass of a row is a point of ``executor``."""

    def __init__(self, executor: Executor, settings: dict, conts: list) -> None:
        self.executor, self.settings, self.conts = executor, settings, conts
        self.passes: dict[str, int] = {}

    def time_again(self, row: dict, conts) -> dict:
        k = self.passes[row["label"]] = self.passes.get(row["label"], 1) + 1
        [again] = checked(
            self.executor.run(
                timing_point,
                [(row["policy"], row["kwargs"], k)],
                (self.settings, self.conts),
                [{"label": row["label"]}],
                progress=False,
            )
        )
        return again


TIMED = ("tps", "tpot_ms", "total_s")


def timing_passes(bench: Bench, rows: list[dict], conts, passes: int) -> None:
    """Passes 2..``passes`` over every row, each starting one row later than the last (so no
    row always runs first, when the machine is coldest); each row's TPS, TPOT and total time
    become the median over its passes, every pass kept in ``<key>_passes``. The decisions are
    deterministic: a pass whose events differ from the first is an error."""
    for row in rows:
        for key in TIMED:
            row[f"{key}_passes"] = [row[key]]
    for k in range(1, passes):
        shift = k % len(rows)
        for row in rows[shift:] + rows[:shift]:
            again = bench.time_again(row, conts)
            for key in ("grow", "compress", "shrink", "fallback", "preemptions"):
                if again[key] != row[key]:
                    raise RuntimeError(
                        f"{row['label']}: pass {k + 1} gave {key} {again[key]}, "
                        f"the first {row[key]}: the runs are not deterministic"
                    )
            for key in TIMED:
                row[f"{key}_passes"].append(again[key])
            print(
                f"[policies_engine] pass {k + 1}, {row['label']}: {again['tps']:.1f} tok/s",
                flush=True,
            )
    for row in rows:
        for key in TIMED:
            row[key] = statistics.median(row[f"{key}_passes"])


def finish(
    args: argparse.Namespace, bench: Bench, gen_row: dict, rows: list[dict], t0: float
) -> dict:
    base = next((r for r in rows if r["policy"] == "fullkv"), None)
    for r in rows:
        if base is not None:
            r["tps_vs_fullkv"] = r["tps"] / base["tps"] if base["tps"] else float("nan")
            r["nll_increase_pct"] = 100 * (r["nll"] / base["nll"] - 1) if base["nll"] else 0.0
    return {
        "args": vars(args),
        "kv_pages": bench.kv_pages,
        "full_pages": bench.full_pages,
        "machine": machine(args),
        "fullkv_generate": gen_row,
        "rows": rows,
        "targets": targets(rows),
        "sample_text": bench.sample_text,
        "wall_s": time.perf_counter() - t0,
    }


def targets(rows: list[dict]) -> dict:
    """The evaluation issue's targets, as ratios measured in this run."""
    by = {r["policy"]: r for r in rows if r["policy"] != "fixed"}
    fixed = [r for r in rows if r["policy"] == "fixed"]
    g, f = by.get("growpage"), by.get("fullkv")
    out: dict = {}
    if g and f:
        out["growpage_tps_vs_fullkv"] = g["tps"] / f["tps"]
        out["growpage_nll_increase_pct"] = 100 * (g["nll"] / f["nll"] - 1)
        out["tps_and_quality_met"] = (
            out["growpage_tps_vs_fullkv"] >= 1.5 and out["growpage_nll_increase_pct"] <= 2.0
        )
    if g and fixed:
        m = fixed[0]  # the budget matched to growpage's average
        out["matched_fixed"] = m["label"]
        out["growpage_vs_matched_fixed_tps"] = g["tps"] / m["tps"]
        out["growpage_vs_matched_fixed_nll"] = g["nll"] / m["nll"]
        out["growpage_beats_matched_fixed"] = g["tps"] >= m["tps"] and g["nll"] <= m["nll"]
    for name in ("random", "inverse"):
        if g and name in by:
            out[f"{name}_worse_nll"] = by[name]["nll"] > g["nll"]
    return out


def machine(args: argparse.Namespace) -> str:
    if args.device.startswith("cuda") and torch.cuda.is_available():
        dev = torch.cuda.get_device_name()
    else:
        dev = f"{describe_machine()}, {torch.get_num_threads()} threads"
    return f"{dev}; torch {torch.__version__}; {args.dtype}"


def to_markdown(r: dict) -> str:
    a = r["args"]
    has_ret = any("retrieval_acc" in x for x in r["rows"])
    head = (
        "| policy | TPS | x fullkv | TPOT ms | total s | C | avg budget | grow | compress | "
        "shrink | fallback | preempt | boundary s | NLL | NLL +% |"
        + (" retrieval acc @ budget |" if has_ret else "")
    )
    lines = [
        f"Engine policy table: {a['num_requests']} requests x {a['max_tokens']} tokens "
        f"(teacher-forced fullkv greedy continuations), pool {r['kv_pages']} pages x "
        f"{a['page_size']} tokens ({r['full_pages']} for all at full length), min capacity "
        f"{a['min_capacity']} pages, seed {a['seed']}; {r['machine']}.",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for x in r["rows"]:
        cells = [
            x["label"],
            f"{x['tps']:.1f}",
            f"{x.get('tps_vs_fullkv', float('nan')):.2f}",
            f"{x['tpot_ms']:.1f}",
            f"{x['total_s']:.1f}",
            f"{x['avg_resident']:.1f}",
            f"{x['avg_budget']:.0f}",
            str(x["grow"]),
            str(x["compress"]),
            str(x["shrink"]),
            str(x["fallback"]),
            str(x["preemptions"]),
            f"{x['boundary_s']:.2f}",
            f"{x['nll']:.4f}",
            f"{x.get('nll_increase_pct', 0.0):+.2f}",
        ]
        if has_ret:
            cells.append(
                f"{x.get('retrieval_acc', float('nan')):.3f} "
                f"@ {x.get('retrieval_budget', float('nan')):.0f}"
            )
        lines.append("| " + " | ".join(cells) + " |")
    g = r["fullkv_generate"]
    passes = a.get("timing_passes", 1)
    lines += [
        "",
        (
            f"TPS, TPOT and total s: the median of {passes} passes per row, each pass in "
            "another order."
            if passes > 1
            else "TPS, TPOT and total s: one pass, the rows one after another; differences "
            "under ~20% may be the order (`--timing-passes 3` takes the median of three)."
        ),
    ]
    lines += [
        "",
        f"fullkv *generating* the same workload (not forced): {g['tps']:.1f} tok/s, "
        f"C {g['avg_resident']:.1f}, {g['preemptions']} preemptions.",
        "",
        f"Targets: `{json.dumps(r['targets'])}`",
        "",
        f"Wall time {r['wall_s']:.0f} s.",
    ]
    return "\n".join(lines)


def plots(r: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    return [
        plot_quality(r["rows"], out / "pareto.png"),
        plot_trajectories(r["rows"], r["args"]["page_size"], out / "trajectories.png"),
    ]


def plot_quality(rows: list[dict], path: Path) -> Path:
    """NLL increase against throughput, one labelled point per run."""
    import matplotlib.pyplot as plt

    from growpage.plots import place_labels

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = []
    for x in rows:
        nll = x.get("nll_increase_pct", 0.0)
        dots = ax.scatter(x["tps"], nll, s=40)
        labels.append((x["label"], x["tps"], nll, dots.get_facecolor()[0]))
    ax.set_xlabel("throughput (output tok/s)")
    ax.set_ylabel("NLL increase over fullkv (%)")
    ax.set_title("Quality vs throughput, same workload and pool")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    place_labels(ax, labels)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# (line style, marker, width) per trajectory: policies that keep the same pages draw the same
# steps, so each line needs its own dashes and hollow marker to show through the others.
TRAJECTORY_STYLES = [("-", "o", 3.0), ("--", "s", 2.2), ("-.", "^", 1.6), (":", "D", 1.2)]


def plot_trajectories(rows: list[dict], page_size: int, path: Path) -> Path:
    """Capacity of request 0 against generated tokens under fullkv, growpage and fixed."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = [
        x for x in rows if x["policy"] in ("growpage", "fixed", "fullkv") and x["trajectories"]
    ]
    for x, (style, marker, width) in zip(drawn, itertools.cycle(TRAJECTORY_STYLES)):
        traj, plen = x["trajectories"][0], x["prompt_lens"][0]
        ax.step(
            [p - plen for p, _, _ in traj],
            [n * page_size for _, n, _ in traj],
            where="post",
            label=x["label"],
            linestyle=style,
            linewidth=width,
            marker=marker,
            markersize=2 + 2 * width,
            markerfacecolor="none",
        )
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("KV capacity (tokens)")
    ax.set_title("Capacity trajectory of request 0")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(report: dict, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2, default=str))
    markdown = to_markdown(report)
    (out / "table.md").write_text(markdown + "\n")
    return markdown


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    report = run(args, on_row=lambda partial: write(partial, out))
    markdown = write(report, out)
    try:
        plots(report, out)
    except Exception as exc:  # plots are a convenience: keep the numbers
        print(f"[policies_engine] plots failed: {exc!r}")
    print(markdown)
    print(f"[policies_engine] wrote {out}/table.md, results.json, pareto.png, trajectories.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
