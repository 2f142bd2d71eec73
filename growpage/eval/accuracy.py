"""Accuracy at a KV budget, policy by policy (the paper's Tables 1 and 8 on this machine).

Every policy answers the same maths problems (``growpage.eval.maths``) with greedy decoding in
the real engine, all under one KV page pool that binds, and each run gives a row: accuracy with
its 95% interval, average KV budget, mean generated tokens per problem, TPS, C (mean resident
requests), and the grow, compress, fallback and preempt counts. Compression can lengthen the
reasoning, which costs throughput: the table shows both.

The runs (``plan``): ``fullkv``, ``growpage``, then the policies matched to growpage's run:
``fixed`` at growpage's average budget (rounded to a page) and at half and twice it, ``random``
at growpage's grow ratio, the fixed-budget baselines ``h2o``, ``snapkv`` and ``streamingllm`` at
growpage's budget, ``inverse``, and ``shrink`` (never under half of that budget).

Each finished run is stored at once (``results.json``, written atomically, and the outputs of
every problem in ``outputs/<label>.jsonl``), so a run cut short resumes where it stopped
(``resume=True``) with the same settings; a resumed table may ask for more policies.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from growpage.errors import ConfigError
from growpage.eval.maths import DIFFICULTIES, generate_problems, prompt, score
from growpage.validators import in_range, items, one_of, optional, positive_int

ALL_POLICIES = (
    "fullkv",
    "growpage",
    "fixed",
    "random",
    "inverse",
    "shrink",
    "streamingllm",
    "h2o",
    "snapkv",
)
#: fixed runs at growpage's average budget times each of these.
FIXED_SCALES = (1.0, 0.5, 2.0)
#: policies run at growpage's average budget (``budget_tokens``).
AT_GROWPAGE_BUDGET = ("streamingllm", "h2o", "snapkv")


@attrs.frozen
class AccuracySettings:
    """What one accuracy table is run on; stored with its results so that a resumed run can
    refuse results of other settings.

    The pool is ``kv_pages`` pages, or, when that is None, ``pool_fraction`` of the pages that
    ``max_num_seqs`` requests of the longest prompt and ``max_tokens`` tokens need at once: at
    a fraction below 1, fullkv cannot hold a full batch and the policies compete for pages.
    """

    model: str = "qwen2.5-coder-0.5b"
    num_problems: int = attrs.field(default=200, validator=positive_int)
    seed: int = 0
    difficulty: int = attrs.field(default=1, validator=one_of(DIFFICULTIES))
    max_tokens: int = attrs.field(default=512, validator=positive_int)
    page_size: int = attrs.field(default=16, validator=positive_int)
    kv_pages: int | None = attrs.field(default=None, validator=optional(positive_int))
    pool_fraction: float = attrs.field(default=0.5, validator=in_range(0, 1, lo_open=True))
    max_num_seqs: int = attrs.field(default=32, validator=positive_int)
    dtype: str = attrs.field(default="float32", validator=one_of(("float32", "bfloat16")))
    policies: tuple[str, ...] = attrs.field(
        default=ALL_POLICIES, converter=tuple, validator=items(one_of(ALL_POLICIES))
    )

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(
            self, value_serializer=lambda _i, _a, v: list(v) if isinstance(v, tuple) else v
        )


@attrs.frozen
class Run:
    """One row of the table: ``policy`` with ``kwargs``, shown as ``label``."""

    label: str
    policy: str
    kwargs: dict[str, Any] = attrs.field(factory=dict)


def round_to_page(tokens: float, page_size: int, min_pages: int = 2) -> int:
    """``tokens`` rounded to whole pages, at least ``min_pages``."""
    return max(min_pages, round(tokens / page_size)) * page_size


def plan(settings: AccuracySettings, growpage_row: dict[str, Any] | None) -> list[Run]:
    """The runs of the table, the most telling first (a table cut short still answers the
    main question): fullkv and growpage, then, once growpage's row exists, fixed at its
    budget, the two strongest baselines at that budget (h2o, snapkv), random at its grow ratio,
    fixed at half and twice the budget, streamingllm, inverse and shrink."""
    wanted = settings.policies
    runs = [Run(name, name) for name in ("fullkv", "growpage") if name in wanted]
    if growpage_row is None:
        return runs
    b = settings.page_size
    budget = round_to_page(growpage_row["avg_budget"], b)
    fixed = [
        Run(f"fixed-{t}", "fixed", {"budget_tokens": t})
        for t in dict.fromkeys(round_to_page(budget * s, b) for s in FIXED_SCALES)
    ]
    at_budget = {
        name: Run(f"{name}-{budget}", name, {"budget_tokens": budget})
        for name in AT_GROWPAGE_BUDGET
    }
    decided = growpage_row["decided_grow"] + growpage_row["decided_compress"]
    q = round(growpage_row["decided_grow"] / decided, 3) if decided else 0.5
    later = [
        (fixed[:1], "fixed"),
        ([at_budget["h2o"]], "h2o"),
        ([at_budget["snapkv"]], "snapkv"),
        ([Run(f"random-q{q:g}", "random", {"grow_prob": q, "seed": settings.seed})], "random"),
        (fixed[1:], "fixed"),
        ([at_budget["streamingllm"]], "streamingllm"),
        ([Run("inverse", "inverse")], "inverse"),
        (
            [Run("shrink", "shrink", {"min_capacity_tokens": round_to_page(budget / 2, b)})],
            "shrink",
        ),
    ]
    return runs + [run for group, name in later if name in wanted for run in group]


def stats_row(stats: Any) -> dict[str, Any]:
    """The engine stats one row reports (``EngineStats`` of the run)."""
    e = stats.events
    return {
        "tps": stats.tps,
        "tpot_ms": 1000 * stats.tpot_s,
        "total_s": stats.total_s,
        "avg_resident": stats.avg_resident,
        "avg_budget": stats.avg_kv_budget,
        "grow": e.get("grow", 0),
        "compress": e.get("compress", 0),
        "shrink": e.get("shrink", 0),
        "fallback": e.get("fallback", 0),
        "preemptions": stats.num_preemptions,
        "decided_grow": e.get("decided_grow", 0),
        "decided_compress": e.get("decided_compress", 0),
        "output_tokens": stats.num_output_tokens,
        "max_pages_used": stats.max_pages_used,
        "steps": stats.num_steps,
    }


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _file_label(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label)


class AccuracyRunner:
    """Loads the model once and runs one ``LLM`` per policy over the same pool and problems."""

    def __init__(self, settings: AccuracySettings, threads: int | None = None) -> None:
        from growpage.engine.llm import LLM

        self.settings = settings
        if threads:
            import torch

            torch.set_num_threads(threads)
        self.base = LLM(
            settings.model,
            policy="fullkv",
            page_size=settings.page_size,
            kv_pages=8,
            dtype=settings.dtype,
            seed=settings.seed,
        )
        self.tokenizer = self.base.tokenizer
        self.problems = generate_problems(
            settings.num_problems, seed=settings.seed, difficulty=settings.difficulty
        )
        self.prompts = [prompt(p) for p in self.problems]
        self.kv_pages = settings.kv_pages or self.pool_pages()

    def pool_pages(self) -> int:
        s = self.settings
        longest = max(len(self.tokenizer.encode_chat(p)) for p in self.prompts)
        per_request = math.ceil((longest + s.max_tokens + 1) / s.page_size)
        batch = min(s.max_num_seqs, s.num_problems)
        return max(per_request + 1, math.ceil(s.pool_fraction * batch * per_request))

    def run(self, run: Run, progress: bool = True) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Generates every problem's answer under ``run``: its row and its outputs."""
        from growpage.engine.llm import LLM
        from growpage.engine.sampling_params import SamplingParams

        s = self.settings
        llm = LLM(
            self.base.model,
            policy=run.policy,
            policy_kwargs=run.kwargs,
            tokenizer=self.tokenizer,
            page_size=s.page_size,
            kv_pages=self.kv_pages,
            max_num_seqs=s.max_num_seqs,
            dtype=s.dtype,
            seed=s.seed,
        )
        load_start = os.getloadavg()[0]
        start = time.perf_counter()
        outs = llm.generate(
            self.prompts, SamplingParams(max_tokens=s.max_tokens), chat=True, use_tqdm=progress
        )
        wall_s = time.perf_counter() - start
        graded = score(self.problems, [o.text for o in outs])
        row: dict[str, Any] = {"label": run.label, "policy": run.policy, "kwargs": run.kwargs}
        row.update(
            accuracy=graded.accuracy,
            interval=list(graded.interval),
            num_correct=graded.num_correct,
            num_problems=graded.num_problems,
            mean_tokens=sum(len(o.token_ids) for o in outs) / len(outs),
            num_truncated=sum(o.finish_reason == "length" for o in outs),
            num_no_answer=sum(r.extracted is None for r in graded.records),
            num_boxed=sum(r.form == "boxed" for r in graded.records),
            wall_s=wall_s,
            load_avg=[round(load_start, 2), round(os.getloadavg()[0], 2)],
        )
        row.update(stats_row(llm.last_stats))
        records: list[dict[str, Any]] = graded.to_dict()["records"]  # type: ignore[assignment]
        outputs = [
            {
                "id": p.id,
                "template": p.template,
                "question": p.question,
                **{k: v for k, v in record.items() if k not in ("id", "template")},
                "num_tokens": len(o.token_ids),
                "finish_reason": str(o.finish_reason),
                "output": o.text,
            }
            for p, o, record in zip(self.problems, outs, records, strict=True)
        ]
        return row, outputs


def load_results(
    out: Path, settings: AccuracySettings
) -> tuple[list[dict[str, Any]], AccuracySettings]:
    """The rows already stored in ``out`` for ``settings``, and the settings the table goes on
    with: ``settings`` with the stored table's policies added (a resumed table may ask for more
    policies, and keeps the rows of the others). Refuses results of other settings."""
    path = Path(out) / "results.json"
    if not path.is_file():
        return [], settings
    try:
        stored = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc}); move it away to start over") from None
    given = stored.get("settings")
    mine = settings.to_dict()
    if not isinstance(given, dict) or {**given, "policies": None} != {**mine, "policies": None}:
        raise ConfigError(
            f"{path} holds results of other settings ({given}); "
            "use another --out, or the same settings to resume (--policies may differ)"
        )
    wanted = set(settings.policies) | set(given.get("policies") or ())
    merged = AccuracySettings(**{**mine, "policies": [p for p in ALL_POLICIES if p in wanted]})
    return list(stored.get("rows", [])), merged


def run_table(
    settings: AccuracySettings,
    out: Path,
    resume: bool = False,
    threads: int | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Runs every row of ``plan`` not yet stored in ``out`` and returns the report."""
    out = Path(out)
    (out / "outputs").mkdir(parents=True, exist_ok=True)
    rows, stored_as = load_results(out, settings) if resume else ([], settings)
    if not resume and (out / "results.json").exists():
        raise ConfigError(
            f"{out / 'results.json'} exists: pass resume to continue it, or another output folder"
        )
    runner = AccuracyRunner(settings, threads)
    log(
        f"[accuracy] {settings.model}: {len(runner.problems)} problems, pool "
        f"{runner.kv_pages} pages of {settings.page_size}, up to {settings.max_num_seqs} "
        f"running, {settings.max_tokens} tokens at most"
    )
    started = time.time()

    def report() -> dict[str, Any]:
        return {
            "settings": stored_as.to_dict(),
            "kv_pages": runner.kv_pages,
            "date": time.strftime("%Y-%m-%d"),
            "commit": _commit(),
            "rows": rows,
        }

    while True:
        growpage_row = next((r for r in rows if r["policy"] == "growpage"), None)
        todo = [
            r for r in plan(settings, growpage_row) if r.label not in {x["label"] for x in rows}
        ]
        if not todo:
            break
        run = todo[0]
        log(f"[accuracy] {run.label} ...")
        row, outputs = runner.run(run, progress)
        lines = "".join(json.dumps(o) + "\n" for o in outputs)
        _write_atomic(out / "outputs" / f"{_file_label(run.label)}.jsonl", lines)
        rows.append(row)
        _write_atomic(out / "results.json", json.dumps(report(), indent=1))
        log(
            f"[accuracy] {run.label}: {row['accuracy']:.3f} [{row['interval'][0]:.3f}, "
            f"{row['interval'][1]:.3f}], {row['tps']:.1f} tok/s, budget "
            f"{row['avg_budget']:.0f}, {row['mean_tokens']:.0f} tokens, {row['wall_s']:.0f} s"
        )
    final = report()
    final["elapsed_s"] = time.time() - started
    _write_atomic(out / "results.json", json.dumps(final, indent=1))
    _write_atomic(out / "table.md", to_markdown(final))
    plot(final, out / "accuracy_vs_tps.png")
    return final


def _commit() -> str:
    import subprocess

    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=10,
        )
    except OSError:
        return "unknown"
    return done.stdout.strip() or "unknown"


def to_markdown(report: dict[str, Any]) -> str:
    """The table of a report, one row per run."""
    s = report["settings"]
    head = (
        f"{s['model']}, {s['num_problems']} maths problems (seed {s['seed']}, difficulty "
        f"{s['difficulty']}), greedy, at most {s['max_tokens']} tokens; pool "
        f"{report['kv_pages']} pages of {s['page_size']}, up to {s['max_num_seqs']} running, "
        f"{s['dtype']}. {report['date']}, commit {report['commit']}.\n\n"
    )
    cols = (
        "policy | accuracy [95% CI] | avg budget | mean tokens | TPS | C | grow | compress"
        " | fallback | preempt | boxed | no answer | truncated | steps | load"
    )
    lines = [f"| {cols} |", "|" + "---|" * (cols.count("|") + 1)]
    for r in report["rows"]:
        lo, hi = r["interval"]
        lines.append(
            f"| {r['label']} | {r['accuracy']:.3f} [{lo:.3f}, {hi:.3f}] | {r['avg_budget']:.0f}"
            f" | {r['mean_tokens']:.0f} | {r['tps']:.1f} | {r['avg_resident']:.1f} | {r['grow']}"
            f" | {r['compress']} | {r['fallback']} | {r['preemptions']} | {r.get('num_boxed', 0)}"
            f" | {r['num_no_answer']} | {r['num_truncated']} | {r.get('steps', '-')}"
            f" | {_load(r.get('load_avg'))} |"
        )
    note = (
        "\nTPS compares across rows only at like loads: `load` is the machine's 1-minute load "
        "average at the start and end of each run (steps do not depend on it; C, weighted by step "
        "time, does).\n"
    )
    return head + "\n".join(lines) + "\n" + note


def _load(load: list[float] | None) -> str:
    return "-" if not load else f"{load[0]:.1f}-{load[1]:.1f}"


def plot(report: dict[str, Any], path: Path) -> Path:
    """Accuracy (with its interval) against TPS and against C (requests resident, weighted by
    step time), one point per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    axes_keys = (
        ("tps", "throughput (generated tokens/s)"),
        ("avg_resident", "C (mean requests resident)"),
    )
    for ax, (key, label) in zip(axes, axes_keys, strict=True):
        for r in report["rows"]:
            lo, hi = r["interval"]
            yerr = [[r["accuracy"] - lo], [hi - r["accuracy"]]]
            ax.errorbar(r[key], r["accuracy"], yerr=yerr, fmt="o", capsize=3)
            ax.annotate(
                r["label"],
                (r[key], r["accuracy"]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
            )
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    s = report["settings"]
    axes[0].set_ylabel("accuracy (95% interval)")
    fig.suptitle(f"{s['model']}: {s['num_problems']} maths problems, one KV pool", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
