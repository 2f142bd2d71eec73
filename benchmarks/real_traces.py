"""How good is the Delta_t signal, and how do the policies do, on real traces (recorded here)?

SmolLM2's, or a Qwen2.5-Coder's on the maths task.

    .venv/bin/python benchmarks/real_traces.py --record DIR [--num 16] [--max-tokens 1100]
    .venv/bin/python benchmarks/real_traces.py --record DIR --model qwen2.5-coder-1.5b --task maths
    .venv/bin/python benchmarks/real_traces.py --shrink DIR [--traces DEST]  # default DEST: smollm2
    .venv/bin/python benchmarks/real_traces.py [--traces DIR] [--page-size 64] [--out DIR]

``--record`` runs the engine (SmolLM2-135M-Instruct, ``fullkv``) on
``growpage.eval.workload.reasoning_prompts()`` in chat form and writes a trace set (fp16, the
layers of ``--layers``, values included). SmolLM2 ends its answers after a few hundred tokens,
so recording samples (temperature 0.7, top-p 0.95, request ``i`` seeded ``seed + i``) with
``ignore_eos``: past its end of turn the model writes further chat turns, and the trace's
``meta.first_eos`` says where that starts.

``--shrink`` writes the committed set: the first 8 traces, layer 19 only, cut to 1024
generated tokens (values kept), about 17 MB. The analysis (default) replays every trace of ``--traces`` (default: the committed set)
under each policy of the appendix-H table and measures the signal (paper section 5.3); it
writes ``report.md``, ``real_traces.json`` and plots under ``--out``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import attrs
import torch
from script_args import add_threads, parser, run_main

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "data" / "traces" / "smollm2"
RECORD_LAYERS = (1, 10, 19, 28)
# The committed set (<= 20 MB): see --shrink.
COMMIT_NUM = 8
COMMIT_LAYERS = (19,)
COMMIT_MAX_GENERATED = 1024


def record(
    out: Path,
    num: int,
    max_tokens: int,
    layers: tuple[int, ...],
    seed: int,
    temperature: float,
    top_p: float,
    page_size: int,
    model: str | None = None,
    task: str = "reasoning",
    difficulty: int = 1,
) -> float:
    """Record ``num`` prompts (chat) into the trace set ``out``; returns wall seconds.

    ``task="reasoning"``: ``reasoning_prompts()``, sampled past the end of turn (see the module
    docstring). ``task="maths"``: the maths task's problems (``growpage.eval.maths``), answered
    greedily and ended at the model's end of turn, so a trace holds the model's own answer and
    nothing after it."""
    from growpage.engine.llm import LLM
    from growpage.engine.sampling_params import SamplingParams
    from growpage.eval.maths import generate_problems
    from growpage.eval.maths import prompt as maths_prompt
    from growpage.eval.workload import reasoning_prompts

    pages_each = math.ceil((512 + max_tokens) / page_size)
    llm = LLM(
        model,
        policy="fullkv",
        record_traces=out,
        record_layers=list(layers),
        page_size=page_size,
        kv_pages=num * pages_each + 8,
        max_num_seqs=num,
        seed=seed,
    )
    if task == "maths":
        problems = generate_problems(num, seed=seed, difficulty=difficulty)
        prompts = [maths_prompt(p) for p in problems]
        params: list = [SamplingParams(max_tokens=max_tokens) for _ in problems]
    else:
        prompts = reasoning_prompts(num)
        params = sampling_params(num, max_tokens, seed, temperature, top_p)
    wall = record_with(llm, prompts, params, out, chat=True)
    print(llm.last_stats.table())
    return wall


def sampling_params(num: int, max_tokens: int, seed: int, temperature: float, top_p: float) -> list:
    """Request ``i`` samples with seed ``seed + i`` and ignores end-of-sequence tokens."""
    from growpage.engine.sampling_params import SamplingParams

    return [
        SamplingParams(
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            seed=seed + i,
            ignore_eos=True,
        )
        for i in range(num)
    ]


def record_with(llm, prompts: list, params: list, out: Path, chat: bool) -> float:
    """Generate with a recording ``LLM`` and annotate its traces (``first_eos``, sampling)."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, chat=chat, use_tqdm=True)
    wall = time.perf_counter() - start
    eos = set(llm.engine.eos_token_ids)
    firsts = [next((i for i, t in enumerate(o.token_ids) if t in eos), None) for o in outs]
    _annotate(
        out,
        {
            o.request_id: {
                "first_eos": f,
                "sampling": {
                    "temperature": p.temperature,
                    "top_p": p.top_p,
                    "seed": p.seed,
                    "ignore_eos": p.ignore_eos,
                    "max_tokens": p.max_tokens,
                    "chat": chat,
                    "record_wall_s": round(wall, 1),
                },
            }
            for o, f, p in zip(outs, firsts, params, strict=True)
        },
    )
    print(
        f"recorded {len(outs)} traces, {sum(len(o.token_ids) for o in outs)} generated "
        f"tokens in {wall:.0f} s into {out}"
    )
    print("first end of turn (generated token index):", firsts)
    return wall


def _annotate(directory: Path, per_request: dict[str, dict]) -> None:
    """Rewrite each trace of the set with ``per_request[request_id]`` merged into its meta."""
    from growpage.core.trace_set import read_trace_set
    from growpage.core.traces import read_trace, write_trace

    traces = read_trace_set(directory)
    for entry in traces.index:
        extra = per_request.get(entry.request_id)
        if extra is None:
            continue
        path = traces.directory / entry.file
        trace = read_trace(path, dtype=torch.float16)
        meta = {**trace.header.meta, **extra}
        trace = attrs.evolve(trace, header=attrs.evolve(trace.header, meta=meta))
        write_trace(path, trace, dtype=torch.float16)


def shrink(
    source: Path,
    dest: Path,
    num: int,
    layers: tuple[int, ...],
    values: bool,
    max_generated: int | None,
) -> int:
    """Write the first ``num`` traces of ``source`` into ``dest`` cut down (``subset_trace``)."""
    from growpage.core.trace_set import TraceSet, read_trace_set
    from growpage.sim.realtrace import subset_trace

    src = read_trace_set(source)
    if dest.exists():
        for f in list(dest.glob("*.safetensors")) + [dest / "index.json"]:
            f.unlink(missing_ok=True)
    out = TraceSet(dest, create=True)
    for i in range(min(num, len(src))):
        trace = subset_trace(src.read(i, dtype=torch.float16), layers, values, max_generated)
        out.write(trace, tags=[_model_tag(trace.header.model), "real"])
    size = sum(f.stat().st_size for f in dest.iterdir())
    print(f"wrote {len(out)} traces ({size / 2**20:.1f} MiB) into {dest}")
    return size


def _model_tag(model: str) -> str:
    """A short tag for a model name (``"Qwen2.5 Coder 1.5B Instruct GGUF"`` -> ``qwen2.5-coder-1.5b``)."""
    words = [w.lower() for w in model.replace("-", " ").replace("_", " ").split()]
    keep = [w for w in words if w not in ("instruct", "gguf", "hf")]
    return "-".join(keep) or "model"


# ---- report ----------------------------------------------------------------------------------
TABLE_COLUMNS = [
    ("policy", "policy", ""),
    ("avg_budget", "avg budget", ".0f"),
    ("mass_mean", "mass mean", ".4f"),
    ("mass_min", "mass min", ".4f"),
    ("output_error", "out err", ".4f"),
    ("grow_ratio", "grow %", ".1%"),
    ("grow", "grow", "d"),
    ("compress", "compress", "d"),
    ("shrink", "shrink", "d"),
    ("fallback", "fallback", "d"),
]


def _interval(ci: list[float] | tuple[float, float] | None, fmt: str) -> str | None:
    return None if ci is None else f"{ci[0]:{fmt}} to {ci[1]:{fmt}}"


def _bucket_rows(signal: dict) -> list[dict]:
    cis = signal.get("bucket_ci95") or [{} for _ in signal["buckets"]]
    return [
        {
            "bucket": f"[{b['low']:g}, {b['high']:g})",
            "count": b["count"],
            "adv": b["mean_advantage"],
            "adv_ci": _interval(ci.get("mean_advantage"), ".4f"),
            "adv_err": b["mean_advantage_error"],
            "adv_err_ci": _interval(ci.get("mean_advantage_error"), ".4f"),
        }
        for b, ci in zip(signal["buckets"], cis, strict=True)
    ]


H2O_NOTE = (
    "`h2o` keeps the heavy hitters of the attention accumulated by every replayed "
    "query (`TraceView(track_accumulated=True)`), with the fixed budget's decisions."
)

BUCKET_COLUMNS = [
    ("bucket", "Δt bucket", ""),
    ("count", "n", "d"),
    ("adv", "advantage (1 − mass)", ".4f"),
    ("adv_ci", "95% interval", ""),
    ("adv_err", "advantage (output error)", ".4f"),
    ("adv_err_ci", "95% interval", ""),
]


def signal_text(label: str, sig: dict, page_size: int) -> str:
    n = sig["num_boundaries"]
    ci = sig.get("spearman_ci95")
    ci_text = (
        f" (95% trace-bootstrap interval {ci[0]:.3f} to {ci[1]:.3f})"
        if ci and n >= MIN_RHO_PAIRS
        else ""
    )
    return "\n".join(
        [
            f"**{label}, b = {page_size}**: {n} boundaries. "
            f"Spearman ρ(Δt, future demand change) = {_rho(sig['spearman'], n)}{ci_text}; "
            f"sign agreement = {sig['sign_agreement']:.1%}. "
            f"Yardstick: the demand change of the page just finished predicts the next one with "
            f"ρ = {_rho(sig['persistence_spearman'], sig['persistence_pairs'])} "
            f"({sig['persistence_pairs']} pairs). "
            f"ρ(Δt, growth advantage) = {_rho(sig['spearman_delta_advantage'], n)}. "
            f"Δt mean {sig['delta_mean']:.4f}, std {sig['delta_std']:.4f}; future change std "
            f"{sig['future_change_std']:.4f}."
        ]
        + _split_text(sig.get("split"))
        + _level_text(sig.get("levels"))
        + [""]
    )


# A rank correlation over fewer pairs than this is not reported (over 2 it is always +-1).
MIN_RHO_PAIRS = 10


def _rho(rho: float, num_pairs: int) -> str:
    return f"{rho:.3f}" if num_pairs >= MIN_RHO_PAIRS else f"n/a (< {MIN_RHO_PAIRS} pairs)"


def _level_text(levels: dict | None) -> list[str]:
    if not levels:
        return []
    n = levels["num_boundaries"]
    return [
        f"Levels: ρ(Δt, demand of the page before) = "
        f"{_rho(levels['spearman_current_level'], n)}, "
        f"ρ(Δt, demand of the page after) = {_rho(levels['spearman_next_level'], n)}, "
        f"ρ(demand before, its change) = "
        f"{_rho(levels['spearman_current_level_vs_change'], n)} ({n} boundaries)."
    ]


def _split_text(split: dict | None) -> list[str]:
    if not split:
        return []
    parts = []
    for key, name in (
        ("before", "inside the model's own answer (next page ends before its first end of turn)"),
        ("after", "past the first end of turn"),
    ):
        q = split[key]
        if q["num_boundaries"]:
            parts.append(
                f"{name}: {q['num_boundaries']} boundaries, "
                f"ρ = {_rho(q['spearman'], q['num_boundaries'])}, "
                f"sign {q['sign_agreement']:.1%}"
            )
    return ["Split: " + "; ".join(parts) + "."] if parts else []


def describe_traces(traces: list) -> tuple[str, dict]:
    gen = [t.num_generated for t in traces]
    eos = [t.header.meta.get("first_eos") for t in traces]
    eos_known = [e for e in eos if e is not None]
    h = traces[0].header
    info = {
        "num_traces": len(traces),
        "model": h.model,
        "layer_ids": list(h.layer_ids),
        "has_values": h.has_values,
        "prompt_len": [t.prompt_len for t in traces],
        "generated": gen,
        "first_eos": eos,
    }
    text = (
        f"{len(traces)} traces of `{h.model}`, recorded layers {list(h.layer_ids)} of "
        f"{h.num_layers}, values {'yes' if h.has_values else 'no'}; prompts "
        f"{min(info['prompt_len'])}–{max(info['prompt_len'])} tokens, "
        f"{min(gen)}–{max(gen)} generated tokens per trace. "
    )
    ignored = [t.header.meta.get("sampling", {}).get("ignore_eos", True) for t in traces]
    if eos_known and any(ignored):
        text += (
            f"First end of turn (ignored) after {min(eos_known)}–{max(eos_known)} "
            f"generated tokens (median {sorted(eos_known)[len(eos_known) // 2]}) in "
            f"{len(eos_known)} of {len(traces)} traces; the rest of each trace is the "
            f"model continuing past it."
        )
    elif eos_known:
        text += (
            f"Each trace is the model's own answer, ended at its end of turn ({len(eos_known)} "
            f"of {len(traces)} ended there, the others at the token limit); greedy decoding."
        )
    return text, info


def write_report(
    out: Path, analysis, extra: dict, traces: list, command: str, wall_s: float
) -> Path:
    from growpage import plots
    from growpage.sim import reports

    out.mkdir(parents=True, exist_ok=True)
    b = analysis.settings.page_size
    trace_text, trace_info = describe_traces(traces)
    _plot_signals(out, analysis, b)
    lines = [
        f"# Real traces of {traces[0].header.model}: the Δt signal and the policies",
        "",
        f"Command: `{command}` ({wall_s:.0f} s wall). Machine: shared 2-core CPU box, "
        f"torch {torch.__version__}, 1 thread.",
        "",
        trace_text,
        "",
        f"Page size b = {b} (the traces are {min(t.num_tokens for t in traces)}–"
        f"{max(t.num_tokens for t in traces)} tokens; the paper uses 256 on 8k–15k "
        f"token traces), recent window {analysis.settings.config().recent_window}, "
        f"βS = 0.9, βL = 0.999, p = 0.99, τ = 0, {analysis.settings.fidelity_queries} "
        f"sampled future queries per boundary. Δt is computed over the recorded layers "
        f"only.",
        "",
        "## Signal quality (paper Fig. 6: ρ = 0.78, sign 80.3%)",
        "",
    ]
    for label, sig in analysis.signals.items():
        lines.append(signal_text(label, sig, b))
    for size, sigs in extra.items():
        for label, sig in sigs.items():
            lines.append(signal_text(label, sig, size))
    lines += [
        "![Δt vs future demand](scatter.png)",
        "",
        "## Counterfactual growth advantage by Δt bucket (paper Fig. 7)",
        "",
    ]
    for label, sig in analysis.signals.items():
        lines += [
            f"Boundaries of the `{label}` replay:",
            "",
            reports.markdown_table(_bucket_rows(sig), BUCKET_COLUMNS),
            "",
        ]
    lines += [
        "![growth advantage](advantage.png)",
        "",
        "## Policy table (paper appendix H)",
        "",
        reports.markdown_table(analysis.rows, TABLE_COLUMNS),
        "",
        H2O_NOTE,
        "",
        "![capacity](capacity.png)",
        "![capacity per policy](capacity-policies.png)",
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    payload = {
        "command": command,
        "wall_s": wall_s,
        "trace_set": trace_info,
        **analysis.as_dict(),
        "extra_page_sizes": {str(k): v for k, v in extra.items()},
    }
    reports.write_json(out / "real_traces.json", payload)
    first = analysis.results["growpage"]
    plots.plot_capacity(
        {r.request_id: r.trajectory for r in first[:8]},
        out / "capacity.png",
        b,
        title=f"growpage capacity, real traces (b = {b})",
    )
    labels = ["fullkv"] + [
        row["policy"] for row in analysis.rows if row["policy"].startswith(("fixed", "random"))
    ]
    labels += ["inverse", "entropy", "shrink", "growpage"]  # growpage drawn last, on top
    plots.plot_capacity(
        {lab: analysis.results[lab][0].trajectory for lab in labels if lab in analysis.results},
        out / "capacity-policies.png",
        b,
        title=f"capacity per policy, trace {first[0].request_id}",
    )
    return path


def _plot_signals(out: Path, analysis, page_size: int) -> None:
    from growpage.plots import plot_signal_scatter  # (chooses the Agg backend)

    sig = analysis.signals["growpage"]
    plot_signal_scatter(
        sig["pairs"],
        out / "scatter.png",
        title=f"real traces, growpage, b={page_size}: "
        f"rho={_rho(sig['spearman'], sig['num_boundaries'])}",
    )
    plot_advantage(analysis.signals, out / "advantage.png")


# Buckets with fewer boundaries than this are drawn pale: their mean says little.
FEW_BOUNDARIES = 10


def _error_bars(ys: list[float], cis: list[dict], key: str) -> list[list[float]] | None:
    """Matplotlib's asymmetric ``yerr`` from per-bucket intervals (0 where a bucket has none);
    None when no bucket has one."""
    spans = [ci.get(key) for ci in cis]
    if all(span is None for span in spans):
        return None
    low = [
        0.0 if span is None else max(y - span[0], 0.0) for y, span in zip(ys, spans, strict=True)
    ]
    high = [
        0.0 if span is None else max(span[1] - y, 0.0) for y, span in zip(ys, spans, strict=True)
    ]
    return [low, high]


def plot_advantage(signals: dict[str, dict], path: Path) -> Path:
    """Mean growth advantage per Delta_t bucket, a bar per replay, each with its count n and,
    where the signal set has them (``bucket_ci95``), 95% trace-bootstrap intervals."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, name in (
        (axes[0], "mean_advantage", "1 - retained mass"),
        (axes[1], "mean_advantage_error", "output error"),
    ):
        for i, (label, s) in enumerate(signals.items()):
            buckets = s["buckets"]
            xs = [j + 0.4 * i for j in range(len(buckets))]
            ys = [bk[key] if bk[key] is not None else 0.0 for bk in buckets]
            yerr = _error_bars(ys, s.get("bucket_ci95") or [{} for _ in buckets], key)
            bars = ax.bar(
                xs,
                ys,
                width=0.4,
                label=label,
                yerr=yerr,
                error_kw={"elinewidth": 0.8, "capsize": 2, "ecolor": "black"},
            )
            for bar, bk in zip(bars, buckets, strict=True):
                bar.set_alpha(1.0 if bk["count"] >= FEW_BOUNDARIES else 0.35)
            ax.bar_label(bars, labels=[str(bk["count"]) for bk in buckets], fontsize=6, padding=1)
        ax.set_xticks([j + 0.2 for j in range(len(buckets))])
        ax.set_xticklabels(
            [f"[{bk['low']:g},{bk['high']:g})" for bk in buckets], rotation=45, fontsize=7
        )
        ax.set_xlabel("Delta_t bucket")
        ax.set_ylabel(f"growth advantage ({name})")
        whiskers = any(s.get("bucket_ci95") for s in signals.values())
        ax.set_title(
            f"on each bar: boundaries n (pale: n < {FEW_BOUNDARIES})"
            + ("; whiskers: 95% trace-bootstrap interval" if whiskers else ""),
            fontsize=8,
        )
        ax.margins(y=0.08)
        ax.axhline(0, color="grey", lw=0.8)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_analysis(args: argparse.Namespace) -> int:
    from growpage.core.trace_set import read_trace_set
    from growpage.sim.realtrace import RealTraceSettings, analyze
    from growpage.sim.reports import format_table

    start = time.perf_counter()
    traces = read_trace_set(args.traces).read_all(args.limit)
    budgets = tuple(int(x) for x in args.budgets.split(","))
    settings = RealTraceSettings(
        page_size=args.page_size,
        budgets=budgets,
        fidelity_queries=args.fidelity_queries,
        bootstrap=args.bootstrap,
    )
    analysis = analyze(traces, settings, progress=True, table=not args.signals_only)
    extra = {}
    for size in (int(x) for x in args.signal_page_sizes.split(",") if x):
        more = analyze(traces, attrs.evolve(settings, page_size=size), progress=True, table=False)
        extra[size] = more.signals
    wall = time.perf_counter() - start
    print(format_table(analysis.rows, TABLE_COLUMNS))
    for label, sig in analysis.signals.items():
        print(signal_text(label, sig, settings.page_size))
    command = "python benchmarks/real_traces.py " + " ".join(
        sys.argv[1:] if args.argv is None else args.argv
    )
    path = write_report(args.out, analysis, extra, traces, command.strip(), wall)
    print(f"report: {path}")
    return 0


def default_out(traces: Path) -> Path:
    """Where a report goes without ``--out``: the committed set's analysis and a full set's
    live side by side under results/real_traces, so neither run overwrites the other."""
    base = ROOT / "results" / "real_traces"
    return base / "committed" if traces.resolve() == COMMITTED.resolve() else base


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument(
        "--record",
        type=Path,
        default=None,
        metavar="DIR",
        help="record a new trace set into DIR and stop",
    )
    p.add_argument("--num", type=int, default=16, help="prompts to record (default 16)")
    p.add_argument("--model", default=None, help="model name or path (default SmolLM2)")
    p.add_argument(
        "--task",
        choices=("reasoning", "maths"),
        default="reasoning",
        help="what to record: reasoning prompts sampled past the end of turn (default), or the "
        "maths task answered greedily up to the model's end of turn",
    )
    p.add_argument("--difficulty", type=int, default=1, help="maths task difficulty (1-3)")
    p.add_argument("--record-page-size", type=int, default=64, help="pages while recording")
    p.add_argument("--max-tokens", type=int, default=1100)
    p.add_argument("--layers", default=",".join(map(str, RECORD_LAYERS)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument(
        "--shrink",
        type=Path,
        default=None,
        metavar="DIR",
        help="cut the trace set DIR down into --traces (the committed set) and stop",
    )
    p.add_argument("--shrink-num", type=int, default=COMMIT_NUM)
    p.add_argument("--shrink-layers", default=",".join(map(str, COMMIT_LAYERS)))
    p.add_argument(
        "--shrink-values",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep values (default on)",
    )
    p.add_argument("--shrink-max-generated", type=int, default=COMMIT_MAX_GENERATED)
    p.add_argument(
        "--traces",
        type=Path,
        default=COMMITTED,
        help=f"trace set to analyze (default {COMMITTED.relative_to(ROOT)})",
    )
    p.add_argument("--limit", type=int, default=None, help="analyze only the first N traces")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument(
        "--signal-page-sizes",
        default="32",
        help="further page sizes for the signal measurements only ('' for none)",
    )
    p.add_argument("--budgets", default="256,512,768", help="fixed-budget points (tokens)")
    p.add_argument(
        "--signals-only",
        action="store_true",
        help="replay only growpage and fullkv (no policy table)",
    )
    p.add_argument("--fidelity-queries", type=int, default=8)
    p.add_argument("--bootstrap", type=int, default=1000)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="report directory (default results/real_traces/committed for the "
        "committed set, results/real_traces for any other)",
    )
    add_threads(p, 1)
    args = p.parse_args(argv)
    args.argv = argv
    if args.out is None:
        args.out = default_out(args.traces)
    torch.set_num_threads(args.threads)
    if args.record is not None:
        layers = tuple(int(x) for x in args.layers.split(",") if x)
        record(
            args.record,
            args.num,
            args.max_tokens,
            layers,
            args.seed,
            args.temperature,
            args.top_p,
            page_size=args.record_page_size,
            model=args.model,
            task=args.task,
            difficulty=args.difficulty,
        )
        return 0
    if args.shrink is not None:
        layers = tuple(int(x) for x in args.shrink_layers.split(",") if x)
        shrink(
            args.shrink,
            args.traces,
            args.shrink_num,
            layers,
            args.shrink_values,
            args.shrink_max_generated,
        )
        return 0
    return run_analysis(args)


if __name__ == "__main__":
    raise SystemExit(run_main(main))
