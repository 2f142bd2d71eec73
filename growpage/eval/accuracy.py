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

Rows may instead be given one by one (``AccuracySettings.rows``, ``growpage eval accuracy
--row LABEL=POLICY[:key=value,...]``, ``growpage.eval.rows``): any policy, built-in or a
policy author's own class, with its hyperparameters and its own capacity settings (a floor, the
summaries' horizon), and baselines matched to another row's budget or grow ratio.

The regime is explicit: the task (the generated ``maths`` problems or a real benchmark,
``growpage.eval.datasets``), whether the prompt is kept out of compression
(``protect_prompt``) and the floor above the prompt below which every request grows
(``floor_tokens``), for every row alike unless a row sets its own; each row records them.

Each finished run is stored at once (``results.json``, written atomically, and the outputs of
every problem in ``outputs/<label>.jsonl``), so a run cut short resumes where it stopped
(``resume=True``) with the same settings; a resumed table may ask for more policies or rows.
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

from growpage.core.config import GrowPageConfig, fitted_recent_window
from growpage.errors import ConfigError
from growpage.eval.datasets import TASKS, task_problems
from growpage.eval.maths import DIFFICULTIES, score
from growpage.eval.rows import RowSpec, check_buildable, check_rows, parse_row, resolved
from growpage.validators import (
    flag,
    in_range,
    integer,
    items,
    non_negative_int,
    one_of,
    optional,
    positive_int,
)

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
    task: str = attrs.field(default="maths", validator=one_of(TASKS))
    num_problems: int = attrs.field(default=200, validator=positive_int)
    seed: int = attrs.field(default=0, validator=integer)
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
    protect_prompt: bool = attrs.field(default=False, validator=flag)
    floor_tokens: int | None = attrs.field(default=None, validator=optional(non_negative_int))
    #: Rows given one by one (``growpage.eval.rows``); when any, they replace ``policies``.
    rows: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    def __attrs_post_init__(self) -> None:
        rows = self.row_specs()
        check_rows(rows)
        # Every row is built here, before a model loads or anything is written: a bad row
        # fails the table at once, not after the rows before it have run.
        table = GrowPageConfig(
            page_size=self.page_size,
            recent_window=fitted_recent_window(GrowPageConfig().recent_window, self.page_size),
            protect_prompt=self.protect_prompt,
            floor_tokens=self.floor_tokens,
        )
        for row in rows:
            check_buildable(row, table)

    def row_specs(self) -> list[RowSpec]:
        return [parse_row(text) for text in self.rows]

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(
            self, value_serializer=lambda _i, _a, v: list(v) if isinstance(v, tuple) else v
        )

    @classmethod
    def from_dict(cls, stored: dict[str, Any]) -> AccuracySettings:
        """The settings of a stored table; a table stored before a setting existed ran with
        its default."""
        known = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in stored.items() if k in known})


@attrs.frozen
class Run:
    """One row of the table: ``policy`` with ``kwargs`` and the row's own ``GrowPageConfig``
    settings ``config``, shown as ``label``."""

    label: str
    policy: str
    kwargs: dict[str, Any] = attrs.field(factory=dict)
    config: dict[str, Any] = attrs.field(factory=dict)


def round_to_page(tokens: float, page_size: int, min_pages: int = 2) -> int:
    """``tokens`` rounded to whole pages, at least ``min_pages``."""
    return max(min_pages, round(tokens / page_size)) * page_size


def plan_rows(settings: AccuracySettings, done: list[dict[str, Any]]) -> list[Run]:
    """The runs of a table of given rows whose references the rows in ``done`` answer, in the
    order given (a row waiting for another row's results comes once that row is done)."""
    results = {r["label"]: r for r in done}
    runs = []
    for spec in settings.row_specs():
        if any(ref.label not in results for ref in spec.references):
            continue
        row = resolved(spec, results, settings.page_size)
        runs.append(Run(row.label, row.policy, row.params, row.config))
    return runs


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


def regime(settings: AccuracySettings, run: Run) -> dict[str, Any]:
    """The ``GrowPageConfig`` settings ``run`` runs with: the table's prompt and floor, then
    the row's own settings over them."""
    return {
        "protect_prompt": settings.protect_prompt,
        "floor_tokens": settings.floor_tokens,
        **run.config,
    }


def stats_row(stats: Any) -> dict[str, Any]:
    """The engine stats one row reports (``EngineStats`` of the run)."""
    e = stats.events
    return {
        "tps": stats.tps,
        "tpot_ms": 1000 * stats.tpot_s,
        "total_s": stats.total_s,
        "avg_resident": stats.avg_resident,
        "avg_budget": stats.avg_kv_budget,
        "avg_above_prompt": stats.avg_kv_above_prompt,
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


#: What every stored output holds, at least (``read_outputs``).
OUTPUT_KEYS = ("id", "correct", "output")


def outputs_path(out: Path, label: str) -> Path:
    """The file of the table in ``out`` that holds row ``label``'s outputs (JSON lines, one
    per problem in the table's order)."""
    return Path(out) / "outputs" / f"{_file_label(label)}.jsonl"


def read_outputs(out: Path, label: str) -> list[dict[str, Any]]:
    """Row ``label``'s stored outputs in the table in ``out``."""
    path = outputs_path(out, label)
    if not path.is_file():
        raise ConfigError(f"{path}: no outputs of row {label!r}")
    try:
        outputs = [json.loads(line) for line in path.read_text().splitlines()]
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not JSON lines ({exc})") from None
    for i, o in enumerate(outputs, 1):
        if not (isinstance(o, dict) and all(k in o for k in OUTPUT_KEYS)):
            raise ConfigError(
                f"{path}, line {i}: not a stored output (a JSON object with "
                f"{', '.join(OUTPUT_KEYS)})"
            )
    return outputs


def read_results(out: Path) -> dict[str, Any]:
    """The report stored in ``out``'s ``results.json`` (``ConfigError`` naming the file when
    it is missing, not JSON or not an accuracy table's)."""
    path = Path(out) / "results.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no accuracy table")
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not JSON ({exc})") from None
    rows = report.get("rows") if isinstance(report, dict) else None
    if not (
        isinstance(report, dict)
        and isinstance(report.get("settings"), dict)
        and isinstance(rows, list)
        and all(isinstance(r, dict) and isinstance(r.get("label"), str) for r in rows)
    ):
        raise ConfigError(
            f"{path}: not an accuracy table's results (a JSON object with settings and rows, "
            "each row with its label)"
        )
    return report


class AccuracyRunner:
    """Loads the model once and runs one ``LLM`` per policy over the same pool and problems."""

    def __init__(self, settings: AccuracySettings, threads: int | None = None) -> None:
        from growpage.engine.llm import LLM

        self.settings = settings
        # The problems first: a benchmark that is not cached, or has fewer problems than
        # asked for, is refused before the model loads.
        self.problems, self.prompts = task_problems(
            settings.task, settings.num_problems, settings.seed, settings.difficulty
        )
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
        self.prompt_lens = [len(self.tokenizer.encode_chat(p)) for p in self.prompts]
        self.kv_pages = settings.kv_pages or self.pool_pages()

    def pool_pages(self) -> int:
        s = self.settings
        longest = max(self.prompt_lens)
        per_request = math.ceil((longest + s.max_tokens + 1) / s.page_size)
        batch = min(s.max_num_seqs, s.num_problems)
        return max(per_request + 1, math.ceil(s.pool_fraction * batch * per_request))

    def run(self, run: Run, progress: bool = True) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Generates every problem's answer under ``run``: its row and its outputs."""
        from growpage.engine.llm import LLM
        from growpage.engine.sampling_params import SamplingParams

        s = self.settings
        config = regime(s, run)
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
            **config,
        )
        gp = llm.config.growpage
        load_start = os.getloadavg()[0]
        start = time.perf_counter()
        outs = llm.generate(
            self.prompts, SamplingParams(max_tokens=s.max_tokens), chat=True, use_tqdm=progress
        )
        wall_s = time.perf_counter() - start
        graded = score(self.problems, [o.text for o in outs])
        row: dict[str, Any] = {
            "label": run.label,
            "policy": run.policy,
            "kwargs": run.kwargs,
            "config": run.config,
            "protect_prompt": gp.protect_prompt,
            "floor_tokens": gp.floor_tokens,
            "beta_long": gp.beta_long,
            "summary_start": gp.summary_start,
        }
        row.update(
            accuracy=graded.accuracy,
            interval=list(graded.interval),
            num_correct=graded.num_correct,
            num_problems=graded.num_problems,
            mean_tokens=sum(len(o.token_ids) for o in outs) / len(outs),
            num_truncated=sum(o.finish_reason == "length" for o in outs),
            num_no_answer=sum(r.extracted is None for r in graded.records),
            num_boxed=sum(r.form == "boxed" for r in graded.records),
            # Upper bound on the answers whose KV a recompute rebuilt after a compression:
            # preempted requests that compressed at some point.
            num_rebuilt=sum(
                o.num_preemptions > 0
                and o.events.get("compress", 0) + o.events.get("shrink", 0) > 0
                for o in outs
            ),
            wall_s=wall_s,
            load_avg=[round(load_start, 2), round(os.getloadavg()[0], 2)],
        )
        row.update(stats_row(llm.last_stats))
        records: list[dict[str, Any]] = graded.to_dict()["records"]  # type: ignore[assignment]
        outputs = [
            {
                "id": p.id,
                "template": getattr(p, "template", s.task),
                "question": p.question,
                **{k: v for k, v in record.items() if k not in ("id", "template")},
                "num_tokens": len(o.token_ids),
                "num_prompt_tokens": len(o.prompt_token_ids),
                "num_preemptions": o.num_preemptions,
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
    policies, and keeps the rows of the others) and its rows, those ``settings`` names first
    and in its order (a resumed table may ask for more rows, or run the stored ones in another
    order). Refuses results of other settings."""
    path = Path(out) / "results.json"
    if not path.is_file():
        return [], settings
    try:
        stored = read_results(out)
    except ConfigError as exc:
        raise ConfigError(f"{exc}; move it away to start over") from None
    mine = settings.to_dict()
    # a setting added since the table was stored: its default
    given = {**AccuracySettings().to_dict(), **stored["settings"]}
    given["model"] = stored["settings"].get("model")
    free = {"policies": None, "rows": None}
    if {**given, **free} != {**mine, **free}:
        raise ConfigError(
            f"{path} holds results of other settings ({given}); use another --out, or the "
            "same settings to resume (--policies and --row may differ)"
        )
    stored_policies, stored_texts = given.get("policies") or [], given.get("rows") or []
    for what in (stored_policies, stored_texts):
        if not (isinstance(what, list) and all(isinstance(x, str) for x in what)):
            raise ConfigError(f"{path}: its settings' policies and rows are not lists of text")
    wanted = set(settings.policies) | set(stored_policies)
    stored_rows = {parse_row(text).label: text for text in stored_texts}
    named = {}
    for text in settings.rows:
        label = parse_row(text).label
        if label in stored_rows and stored_rows[label] != text:
            raise ConfigError(
                f"{path} has a row labelled {label!r} given as {stored_rows[label]!r}, not "
                f"{text!r}: give it another label"
            )
        named[label] = text
    # The rows still to run go in the order this command names them, then the stored table's
    # others in theirs.
    rows = list(named.values()) + [t for lab, t in stored_rows.items() if lab not in named]
    merged = AccuracySettings(
        **{**mine, "policies": [p for p in ALL_POLICIES if p in wanted], "rows": rows}
    )
    return list(stored["rows"]), merged


def _check_matched(
    settings: AccuracySettings, stored_as: AccuracySettings, rows: list[dict[str, Any]]
) -> None:
    """Refuse planned policies that would never run: all but fullkv and growpage are matched
    to growpage's row, which neither this table nor the stored one has."""
    if stored_as.rows or "growpage" in settings.policies:
        return
    if any(r.get("policy") == "growpage" for r in rows):
        return
    matched = [p for p in settings.policies if p not in ("fullkv", "growpage")]
    if matched:
        raise ConfigError(
            f"policies {', '.join(matched)} run at growpage's budget or grow ratio: add "
            "growpage to the policies, or resume a table that has its row"
        )


def run_table(
    settings: AccuracySettings,
    out: Path,
    resume: bool = False,
    threads: int | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Runs every row of ``plan`` not yet stored in ``out`` and returns the report. ``out``
    (and ``out/outputs``) is made when the first row is stored: a table refused, or one whose
    model cannot load, leaves nothing behind."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file, not a folder for the table")
    rows, stored_as = load_results(out, settings) if resume else ([], settings)
    if not resume and (out / "results.json").exists():
        raise ConfigError(
            f"{out / 'results.json'} exists: pass resume to continue it, or another output folder"
        )
    _check_matched(settings, stored_as, rows)
    runner = AccuracyRunner(settings, threads)
    log(
        f"[accuracy] {settings.model}: {len(runner.problems)} problems, pool "
        f"{runner.kv_pages} pages of {settings.page_size}, up to {settings.max_num_seqs} "
        f"running, {settings.max_tokens} tokens at most"
    )
    started = time.time()
    code = _commit()  # what this process runs: HEAD may move while it does

    lens = runner.prompt_lens

    def report() -> dict[str, Any]:
        return {
            "settings": stored_as.to_dict(),
            "kv_pages": runner.kv_pages,
            "prompt_tokens": {
                "min": min(lens),
                "mean": round(sum(lens) / len(lens), 1),
                "max": max(lens),
            },
            "date": time.strftime("%Y-%m-%d"),
            "commit": _commit(),
            "rows": rows,
        }

    while True:
        if stored_as.rows:
            planned = plan_rows(stored_as, rows)
        else:
            growpage_row = next((r for r in rows if r["policy"] == "growpage"), None)
            planned = plan(settings, growpage_row)
        todo = [r for r in planned if r.label not in {x["label"] for x in rows}]
        if not todo:
            break
        run = todo[0]
        log(f"[accuracy] {run.label} ...")
        row, outputs = runner.run(run, progress)
        lines = "".join(json.dumps(o) + "\n" for o in outputs)
        (out / "outputs").mkdir(parents=True, exist_ok=True)
        _write_atomic(outputs_path(out, run.label), lines)
        row["commit"] = code  # a resumed table's rows may come from several commits
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
    plot(final, out / "accuracy.png")
    return final


def rescore(out: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """Read every stored output of the table in ``out`` again with the current answer reader
    (``growpage.eval.answers``): the rows' accuracy, interval and answer counts, and each
    output's record, are rewritten, as are ``table.md`` and the plot. Returns the report and,
    per row, how many verdicts changed. Every row is read and scored before anything is
    rewritten: a table that cannot be rescored is left as it was."""
    out = Path(out)
    path = out / "results.json"
    report = read_results(out)
    try:
        s = AccuracySettings.from_dict(report["settings"])
    except (TypeError, ValueError) as exc:  # ConfigError is a ValueError
        raise ConfigError(f"{path}: its settings are not an accuracy table's ({exc})") from None
    problems, _ = task_problems(s.task, s.num_problems, s.seed, s.difficulty)
    changed: dict[str, int] = {}
    rewritten: dict[Path, list[dict[str, Any]]] = {}
    for row in report["rows"]:
        file = outputs_path(out, row["label"])
        outputs = read_outputs(out, row["label"])
        if [o["id"] for o in outputs] != [p.id for p in problems]:
            raise ConfigError(f"{file}: its problems are not the table's")
        graded = score(problems, [o["output"] for o in outputs])
        records: list[dict[str, Any]] = graded.to_dict()["records"]  # type: ignore[assignment]
        changed[row["label"]] = sum(
            o["correct"] != rec["correct"] for o, rec in zip(outputs, records, strict=True)
        )
        for o, rec in zip(outputs, records, strict=True):
            o.update({k: v for k, v in rec.items() if k not in ("id", "template")})
        row.update(
            accuracy=graded.accuracy,
            interval=list(graded.interval),
            num_correct=graded.num_correct,
            num_no_answer=sum(r.extracted is None for r in graded.records),
            num_boxed=sum(r.form == "boxed" for r in graded.records),
        )
        rewritten[file] = outputs
    report["rescored"] = {"date": time.strftime("%Y-%m-%d"), "commit": _commit()}
    try:
        table = to_markdown(report)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"{path}: not a whole accuracy table ({type(exc).__name__}: {exc})"
        ) from None
    for file, outputs in rewritten.items():
        _write_atomic(file, "".join(json.dumps(o) + "\n" for o in outputs))
    _write_atomic(path, json.dumps(report, indent=1))
    _write_atomic(out / "table.md", table)
    plot(report, out / "accuracy.png")
    return report, changed


def _commit(package: Path | None = None) -> str:
    """The short commit of the checkout holding ``package`` (default: growpage's own folder),
    with ``+changes`` when tracked files under ``package`` differ from it (what runs is then
    not that commit alone); ``unknown`` outside a git checkout."""
    import subprocess

    folder = package or Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=folder, timeout=10
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = head and git("status", "--porcelain", "--untracked-files=no", "--", ".")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (head + ("+changes" if changed else "")) or "unknown"


def to_markdown(report: dict[str, Any]) -> str:
    """The table of a report, one row per run."""
    s = report["settings"]
    task = s.get("task", "maths")
    what = (
        f"{s['num_problems']} maths problems (seed {s['seed']}, difficulty {s['difficulty']})"
        if task == "maths"
        else f"{s['num_problems']} {task} problems (seed {s['seed']})"
    )
    prompts = report.get("prompt_tokens")
    prompt_text = (
        f"; prompts {prompts['min']}-{prompts['max']} tokens (mean {prompts['mean']:.0f})"
        if prompts
        else ""
    )
    head = (
        f"{s['model']}, {what}, greedy, at most {s['max_tokens']} tokens{prompt_text}; pool "
        f"{report['kv_pages']} pages of {s['page_size']}, up to {s['max_num_seqs']} running, "
        f"{s['dtype']}. {report['date']}, commit {report['commit']}.{_row_commits(report)}\n\n"
    )
    frontier = fixed_frontier(report["rows"])
    cols = (
        "row | regime | accuracy [95% CI] | vs fixed | avg budget | above prompt | mean tokens"
        " | steps"
        " | TPS | C | grow | compress | fallback | preempt | rebuilt | boxed | no answer"
        " | truncated | load"
    )
    lines = [f"| {cols} |", "|" + "---|" * (cols.count("|") + 1)]
    for r in report["rows"]:
        lo, hi = r["interval"]
        above = r.get("avg_above_prompt")
        gap = frontier_gap(r, frontier)
        lines.append(
            f"| {r['label']} | {regime_text(r)} | {r['accuracy']:.3f} [{lo:.3f}, {hi:.3f}]"
            f" | {'-' if gap is None else f'{gap:+.3f}'} | {r['avg_budget']:.0f}"
            f" | {'-' if above is None else f'{above:.0f}'} | {r['mean_tokens']:.0f} | {r.get('steps', '-')} | {r['tps']:.1f}"
            f" | {r['avg_resident']:.1f} | {r['grow']} | {r['compress']} | {r['fallback']}"
            f" | {r['preemptions']} | {r.get('num_rebuilt', '-')} | {r.get('num_boxed', 0)}"
            f" | {r['num_no_answer']} | {r['num_truncated']} | {load_text(r.get('load_avg'))} |"
        )
    note = (
        "\n`vs fixed`: the row's accuracy minus that of the fixed budgets at its average "
        "budget (linear between the fixed rows; `-` outside them). `regime`: prompt kept out "
        "of compression (`P`) or evictable (`-`); the floor in "
        "tokens above the prompt (`f64`; none: the paper's two pages); the long summary's decay "
        "and start where they differ from the paper's (0.999, first query). `above prompt`: KV "
        "held beyond the request's prompt. `rebuilt`: answers preempted after compressing at "
        "most (a recompute rebuilds the whole KV). TPS compares across rows only at like "
        "loads: `load` is the machine's 1-minute load average at the start and end of each run "
        "(steps do not depend on it; C, weighted by step time, does).\n"
    )
    return head + "\n".join(lines) + "\n" + note


def _row_commits(report: dict[str, Any]) -> str:
    """Which commit ran which rows, for the rows that recorded it (a table resumed across
    commits)."""
    by: dict[str, list[str]] = {}
    for r in report["rows"]:
        if r.get("commit"):
            by.setdefault(r["commit"], []).append(r["label"])
    if not by:
        return ""
    return (
        " Rows ran at " + "; ".join(f"{c}: {', '.join(labels)}" for c, labels in by.items()) + "."
    )


def fixed_frontier(rows: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """``(average budget, accuracy)`` of the plain fixed-budget rows (no settings of their
    own), by budget: the frontier other rows are read against."""
    fixed = [r for r in rows if r["policy"] == "fixed" and not r.get("config")]
    return sorted((r["avg_budget"], r["accuracy"]) for r in fixed)


def frontier_gap(row: dict[str, Any], frontier: list[tuple[float, float]]) -> float | None:
    """``row``'s accuracy minus the fixed frontier's at its average budget (linear between
    the fixed rows); None outside the frontier's budgets or for a fixed row itself."""
    if row["policy"] == "fixed" and not row.get("config") or len(frontier) < 2:
        return None
    x = row["avg_budget"]
    for (x0, y0), (x1, y1) in zip(frontier[:-1], frontier[1:], strict=True):
        if x0 <= x <= x1:
            y = y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
            return row["accuracy"] - y
    return None


def regime_text(row: dict[str, Any]) -> str:
    """``P f64 bL0.99 avg``: the capacity settings a row ran with (see ``to_markdown``)."""
    parts = ["P" if row.get("protect_prompt") else "-"]
    if row.get("floor_tokens") is not None:
        parts.append(f"f{row['floor_tokens']}")
    paper = GrowPageConfig()
    if row.get("beta_long", paper.beta_long) != paper.beta_long:
        parts.append(f"bL{row['beta_long']:g}")
    if row.get("summary_start", paper.summary_start) != paper.summary_start:
        parts.append(str(row["summary_start"]))
    return " ".join(parts)


def load_text(load: list[float] | None) -> str:
    """A run's load averages at its start and end, as the table prints them."""
    return "-" if not load else f"{load[0]:.1f}-{load[1]:.1f}"


def plot(report: dict[str, Any], path: Path) -> Path:
    """Accuracy (with its interval) against the average KV budget, against engine steps and
    against TPS, one point per run; the fixed-budget rows are joined as the frontier a policy
    is read against."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8), sharey=True)
    axes_keys = (
        ("avg_budget", "average KV budget per request (tokens)"),
        ("steps", "engine steps (fewer: more requests per step)"),
        ("tps", "throughput (generated tokens/s; compare at like loads)"),
    )
    # one colour per row, the same in every panel (tab10 repeats after ten rows)
    palette = plt.get_cmap("tab10" if len(rows) <= 10 else "tab20")
    colours = {r["label"]: palette(i % palette.N) for i, r in enumerate(rows)}
    fixed = [r for r in rows if r["policy"] == "fixed" and not r.get("config")]
    for ax, (key, label) in zip(axes, axes_keys, strict=True):
        frontier = sorted((r for r in fixed if r.get(key) is not None), key=lambda r: r[key])
        if len(frontier) > 1:
            ax.plot(
                [r[key] for r in frontier],
                [r["accuracy"] for r in frontier],
                "-",
                color="0.6",
                zorder=0,
                label="fixed budgets",
            )
        for r in rows:
            if r.get(key) is None:
                continue
            lo, hi = r["interval"]
            yerr = [[r["accuracy"] - lo], [hi - r["accuracy"]]]
            marker = "s" if r in fixed else "o"
            ax.errorbar(
                r[key], r["accuracy"], yerr=yerr, fmt=marker, capsize=3, color=colours[r["label"]]
            )
            ax.annotate(
                r["label"],
                (r[key], r["accuracy"]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
            )
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    if len(fixed) > 1:
        axes[0].legend(fontsize=8, loc="lower right")
    s = report["settings"]
    axes[0].set_ylabel("accuracy (95% interval)")
    fig.suptitle(
        f"{s['model']}: {s['num_problems']} {s.get('task', 'maths')} problems, one KV pool of "
        f"{report['kv_pages']} pages of {s['page_size']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
