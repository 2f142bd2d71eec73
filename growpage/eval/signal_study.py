"""The Delta_t study in the paper's method (section 5.3, Fig. 6 and Fig. 7) on recorded traces.

For each page size and each query-summary horizon, every trace of a full-KV trace set (recorded
at every layer, ``growpage record``) is replayed under full KV, and at each boundary the study
takes:

* Delta_t (Eq. 8) and the future demand change (the next page's working-set ratio minus the
  current one, full KV): Spearman's rho and sign agreement, Fig. 6;
* the growth advantage as Fig. 7 measures it: the reference (full-KV) trajectory's next page
  teacher-forced under *Compress & Hold* (GrowPage's selection of ``t - b`` of the ``t``
  tokens, at every layer) and under *Grow* (all ``t``), ``A_t = NLL_compress - NLL_grow``
  (``growpage.engine.counterfactual``), by Delta_t bucket and as rho(Delta_t, A_t);
* as a second column, section 10.1's measure: GrowPage's own replay (its compressions
  included) with the retained attention mass as the loss.

Intervals are 95% cluster bootstraps over traces (a request's boundaries are not independent).
"""

from __future__ import annotations

import math
import os
import pickle
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from tqdm import tqdm

from growpage.core.boundary_context import BoundaryContext
from growpage.core.config import SUMMARY_STARTS, GrowPageConfig
from growpage.core.decision import Decision
from growpage.core.trace_set import TraceSet
from growpage.core.traces import Trace
from growpage.engine.modeling.model import CausalLM
from growpage.errors import ConfigError
from growpage.policies.builtin import FullKVPolicy
from growpage.sim.realtrace import signal_summary
from growpage.sim.replay import ReplayOptions, replay_trace
from growpage.sim.signal import DELTA_EDGES, spearman
from growpage.validators import (
    in_range,
    integer,
    items,
    non_negative_int,
    one_of,
    optional,
    positive_int,
)

#: The paper's long summary remembers ~1/(1 - 0.999) = 1000 tokens of its 8k-token answers:
#: a scaled horizon keeps that share of the answers at hand.
PAPER_ANSWER_TOKENS = 8000
#: The query-summary horizons a study can measure (``horizons``).
HORIZONS = ("paper", "average", "scaled")


@attrs.frozen
class Horizon:
    """How the query summaries remember: the long EMA's decay and how both start."""

    label: str
    beta_long: float = attrs.field(default=0.999, validator=in_range(0, 1, hi_open=True))
    summary_start: str = attrs.field(default="first", validator=one_of(SUMMARY_STARTS))


def scaled_beta_long(mean_answer_tokens: float, beta: float = 0.999) -> float:
    """beta_L whose memory ``1 / (1 - beta_L)`` is the same share of ``mean_answer_tokens`` as
    the paper's 0.999 is of its 8k-token answers (rounded to 4 decimals); at least twice the
    short summary's memory (beta_L >= 0.95 beside beta_S = 0.9)."""
    memory = mean_answer_tokens * (1 / (1 - beta)) / PAPER_ANSWER_TOKENS
    return round(1 - 1 / max(memory, 2 / (1 - GrowPageConfig().beta_short)), 4)


def horizons(names: Sequence[str], mean_answer_tokens: float) -> list[Horizon]:
    """``paper`` (0.999, first query), ``average`` (0.999, bias-corrected start), ``scaled``
    (the scaled beta_L, bias-corrected start)."""
    known = {
        "paper": Horizon("paper"),
        "average": Horizon("average", summary_start="average"),
        "scaled": Horizon("scaled", scaled_beta_long(mean_answer_tokens), "average"),
    }
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"unknown horizon(s) {unknown}; known: {', '.join(known)}")
    return [known[n] for n in names]


@attrs.define(slots=False)
class _Probe(FullKVPolicy):
    """Full KV that notes, at every decided boundary, Delta_t and the slots GrowPage's
    Compress & Hold would keep (as positions: nothing is ever compressed here)."""

    seen: dict = attrs.field(factory=dict)

    def decide(self, ctx: BoundaryContext) -> Decision:
        keep = ctx.num_tokens - ctx.page_size
        slots = self.select(ctx, keep)  # the default: GrowPage's selection
        self.seen[ctx.position] = (ctx.delta(), torch.gather(ctx.positions(), 2, slots))
        return Decision.GROW


def config_for(page_size: int, horizon: Horizon) -> GrowPageConfig:
    """The paper's settings at ``page_size`` (recent window b/4, at most 16) and ``horizon``."""
    return GrowPageConfig(
        page_size=page_size,
        recent_window=min(16, page_size // 4),
        beta_long=horizon.beta_long,
        summary_start=horizon.summary_start,
    )


def trace_boundaries(
    trace: Trace, config: GrowPageConfig, fidelity_queries: int = 8
) -> tuple[list[dict[str, Any]], Any]:
    """The full-KV replay of ``trace``: per decided boundary its position, Delta_t, future
    demand change and kept positions ``[L, Hkv, t - b]``; and GrowPage's own replay (for the
    second column)."""
    options = ReplayOptions(fidelity_queries=fidelity_queries, signals=True)
    probe = _Probe()
    full = replay_trace(trace, probe, config, options)
    rows = []
    for record in full.records:
        if record.position not in probe.seen:
            continue
        delta, kept = probe.seen[record.position]
        rows.append(
            {
                "position": record.position,
                "delta": delta,
                "future_change": record.future_change,
                "kept": kept,
            }
        )
    own = replay_trace(trace, "growpage", config, options)
    return rows, own


def _bootstrap(
    per_trace: Sequence[Sequence[tuple[float, float]]],
    stat: Callable[[list[tuple[float, float]]], float | None],
    num: int,
    seed: int,
) -> tuple[float, float] | None:
    """95% interval of ``stat`` over pooled pairs, resampling whole traces."""
    groups = [g for g in per_trace if g]
    if num <= 0 or len(groups) < 2:
        return None
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(num):
        pooled = [xy for i in rng.integers(0, len(groups), len(groups)) for xy in groups[i]]
        value = stat(pooled)
        if value is not None and not math.isnan(value):
            values.append(value)
    if not values:
        return None
    lo, hi = np.percentile(values, [2.5, 97.5])
    return float(lo), float(hi)


def _rho(pairs: list[tuple[float, float]]) -> float:
    return spearman([x for x, _ in pairs], [y for _, y in pairs])


def _sign(pairs: list[tuple[float, float]]) -> float | None:
    return float(np.mean([np.sign(x) == np.sign(y) for x, y in pairs])) if pairs else None


def _bucket_mean(low: float, high: float) -> Callable[[list[tuple[float, float]]], float | None]:
    def mean(pairs: list[tuple[float, float]]) -> float | None:
        inside = [y for x, y in pairs if low <= x < high]
        return float(np.mean(inside)) if inside else None

    return mean


def summarize(
    per_trace: Sequence[Sequence[tuple[float, float]]], bootstrap: int, seed: int
) -> dict[str, Any]:
    """rho, sign agreement and Delta_t buckets of ``(delta, y)`` pairs, with intervals."""
    pooled = [xy for g in per_trace for xy in g]
    buckets = []
    for low, high in zip(DELTA_EDGES[:-1], DELTA_EDGES[1:], strict=True):
        mean = _bucket_mean(low, high)
        traces = sum(any(low <= x < high for x, _ in g) for g in per_trace)
        buckets.append(
            {
                "low": low,
                "high": high,
                "count": sum(low <= x < high for x, _ in pooled),
                "mean": mean(pooled),
                "ci95": _bootstrap(per_trace, mean, bootstrap, seed) if traces >= 2 else None,
            }
        )
    return {
        "num_boundaries": len(pooled),
        "spearman": _rho(pooled),
        "spearman_ci95": _bootstrap(per_trace, _rho, bootstrap, seed),
        "sign_agreement": _sign(pooled),
        "sign_agreement_ci95": _bootstrap(per_trace, _sign, bootstrap, seed),
        "buckets": buckets,
    }


def _each_once(values: Any) -> Any:
    """A list or tuple without repeats (the first kept); anything else as given, for the
    validator to refuse."""
    try:
        return tuple(dict.fromkeys(values)) if isinstance(values, (list, tuple)) else values
    except TypeError:  # an unhashable item
        return values


@attrs.frozen(kw_only=True)
class StudySettings:
    """What ``run_study`` measures. ``bootstrap``: resamples of the cluster bootstrap over
    traces (0: no intervals); ``max_traces``: the first N traces (None: all). A page size or
    horizon named twice is measured once (twice would pool each trace's boundaries twice)."""

    page_sizes: tuple[int, ...] = attrs.field(
        default=(16, 32, 64), converter=_each_once, validator=items(positive_int)
    )
    horizons: tuple[str, ...] = attrs.field(
        default=("paper", "scaled"), converter=_each_once, validator=items(one_of(HORIZONS))
    )
    fidelity_queries: int = attrs.field(default=8, validator=non_negative_int)
    bootstrap: int = attrs.field(default=1000, validator=non_negative_int)
    seed: int = attrs.field(default=0, validator=integer)
    max_traces: int | None = attrs.field(default=None, validator=optional(positive_int))


def run_study(
    traces_dir: Path,
    model: str | CausalLM,
    settings: StudySettings,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    log: Callable[[str], None] = print,
    items: Path | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """The study's report (JSON-ready): per page size and horizon, Fig. 6's rho and sign
    agreement, Fig. 7's NLL growth advantage, and the replay column of section 10.1.

    With ``items``, each (trace, page size, horizon) is stored there as it finishes, so that a
    run cut short loses at most one; ``resume`` reads back those measured with the same
    settings and measures the rest. Without ``resume`` a folder holding items is refused."""
    from growpage.engine.counterfactual import reference
    from growpage.engine.loading.loader import load_model

    trace_set = TraceSet(traces_dir)
    entries = list(trace_set.index)[: settings.max_traces]
    if not entries:
        raise ConfigError(f"{traces_dir}: no traces")
    answers = [e.num_tokens - e.prompt_len for e in entries]
    mean_answer = float(np.mean(answers))
    chosen = horizons(settings.horizons, mean_answer)
    log(
        f"[signal] {len(entries)} traces, answers {min(answers)}-{max(answers)} tokens (mean "
        f"{mean_answer:.0f}); horizons "
        + ", ".join(f"{h.label} (beta_L {h.beta_long}, {h.summary_start})" for h in chosen)
    )
    store = _ItemStore(items, resume, settings.fidelity_queries, model) if items else None
    if store is not None and store.reused:
        log(f"[signal] resuming: {store.reused} items already in {items}")
    lm = model if isinstance(model, CausalLM) else load_model(_model_path(model), dtype=dtype)
    start = time.time()
    cells: dict[str, dict[str, Any]] = {}
    grid = [(b, h) for b in settings.page_sizes for h in chosen]
    bar = tqdm(total=len(grid) * len(entries), desc="signal study", disable=not progress)
    collected: dict[tuple[int, str], dict[str, list]] = {
        (b, h.label): {"fig6": [], "fig7": [], "own": [], "persistence": []} for b, h in grid
    }
    for entry in entries:
        trace = trace_set.read(entry.request_id)
        _check_layers(trace, lm.config.num_layers)
        ref = None
        for b, h in grid:
            stored = store.get(trace, b, h) if store is not None else None
            if stored is not None:
                fig6, fig7, persist, own = stored
                _collect(collected[(b, h.label)], fig6, fig7, persist, own)
                bar.update()
                continue
            if ref is None:
                ref = reference(lm, list(trace.header.token_ids))
            rows, own = trace_boundaries(trace, config_for(b, h), settings.fidelity_queries)
            fig6, fig7, persist = [], [], []
            for a, nxt in zip(rows[:-1], rows[1:], strict=True):
                gap = nxt["position"] - a["position"]
                if gap == b and a["future_change"] is not None and nxt["future_change"] is not None:
                    persist.append((a["future_change"], nxt["future_change"]))
            for row in rows:
                t = row["position"]
                if row["future_change"] is not None:
                    fig6.append((row["delta"], row["future_change"]))
                if t + b < ref.num_tokens:
                    compress = float(ref.nll_kept(t, row["kept"], b).mean())
                    grow = float(ref.nlls[t : t + b].mean())
                    fig7.append((row["delta"], compress - grow))
            if store is not None:
                store.put(trace, b, h, (fig6, fig7, persist, own))
            _collect(collected[(b, h.label)], fig6, fig7, persist, own)
            bar.update()
    bar.close()
    for b, h in grid:
        cell = collected[(b, h.label)]
        own = signal_summary(cell["own"], b, settings.bootstrap, settings.seed)
        own_pairs = [
            [
                (r.delta, r.advantage)
                for r in res.records
                if r.delta is not None and r.advantage is not None
            ]
            for res in cell["own"]
        ]
        cells[f"b{b}-{h.label}"] = {
            "page_size": b,
            "horizon": attrs.asdict(h),
            "fig6": summarize(cell["fig6"], settings.bootstrap, settings.seed),
            # The yardstick: the last page's demand change as the predictor of the next one's.
            "persistence_spearman": _rho([xy for g in cell["persistence"] for xy in g]),
            "fig7_nll": summarize(cell["fig7"], settings.bootstrap, settings.seed),
            "own_replay": {
                "spearman": own["spearman"],
                "sign_agreement": own["sign_agreement"],
                "num_boundaries": own["num_boundaries"],
                "advantage_mass": summarize(own_pairs, settings.bootstrap, settings.seed),
            },
        }
    return {
        "traces": str(traces_dir),
        "num_traces": len(entries),
        "answer_tokens": {"min": min(answers), "mean": mean_answer, "max": max(answers)},
        "prompt_tokens": [e.prompt_len for e in entries],
        "model": model if isinstance(model, str) else lm.config.arch,
        "settings": attrs.asdict(settings),
        "cells": cells,
        "elapsed_s": time.time() - start,
    }


def _collect(cell: dict[str, list], fig6: list, fig7: list, persist: list, own: Any) -> None:
    cell["fig6"].append(fig6)
    cell["fig7"].append(fig7)
    cell["persistence"].append(persist)
    cell["own"].append(own)


class _ItemStore:
    """One pickle per measured (trace, page size, horizon), written atomically, keyed by
    everything that changes its numbers; the folder is made by the first one (a study refused
    before it measures anything leaves none)."""

    def __init__(self, folder: Path, resume: bool, fidelity_queries: int, model: Any) -> None:
        self.folder = folder
        self.fidelity_queries = fidelity_queries
        self.model = model if isinstance(model, str) else None
        present = sorted(folder.glob("*.pkl")) if folder.is_dir() else []
        if present and not resume:
            raise ConfigError(
                f"{folder} holds {len(present)} measured items of an earlier run: pass "
                "--resume to reuse them, or choose another --out"
            )
        self.reused = len(present)

    def _path(self, trace: Trace, b: int, h: Horizon) -> Path:
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", trace.header.request_id)
        return self.folder / f"{name}-b{b}-{h.label}.pkl"

    def _key(self, trace: Trace, b: int, h: Horizon) -> dict[str, Any]:
        return {
            "version": 1,
            "model": self.model,
            "token_ids": list(trace.header.token_ids),
            "page_size": b,
            "horizon": attrs.asdict(h),
            "fidelity_queries": self.fidelity_queries,
        }

    def get(self, trace: Trace, b: int, h: Horizon) -> tuple | None:
        path = self._path(trace, b, h)
        if not path.exists():
            return None
        try:
            with path.open("rb") as f:
                key, value = pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError, ValueError) as exc:
            raise ConfigError(f"{path}: unreadable stored item ({exc}); delete it") from exc
        return value if key == self._key(trace, b, h) else None

    def put(self, trace: Trace, b: int, h: Horizon, value: tuple) -> None:
        path = self._path(trace, b, h)
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with tmp.open("wb") as f:
            pickle.dump((self._key(trace, b, h), value), f)
        os.replace(tmp, path)


def _model_path(model: str) -> str:
    from growpage.engine.loading.catalog import get_model, model_path

    try:
        return str(model_path(get_model(model)))
    except Exception:  # noqa: BLE001 - not a catalog name: a path
        return model


def _check_layers(trace: Trace, num_layers: int) -> None:
    layers = tuple(trace.header.layer_ids)
    if layers != tuple(range(num_layers)):
        raise ConfigError(
            f"trace {trace.request_id}: recorded layers {list(layers)}; the growth advantage "
            f"compresses every layer, so record all {num_layers} (growpage record without "
            "--layers)"
        )


def _ci(ci: Sequence[float] | None) -> str:
    return "" if ci is None else f" [{ci[0]:.3f}, {ci[1]:.3f}]"


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def plot_study(report: dict[str, Any], path: Path) -> Path:
    """Fig. 7 as the study measures it: the growth advantage A_t (nats per token) by Delta_t
    bucket, one panel per page size, one line per horizon, with 95% intervals over traces."""
    from growpage.plots import plot_by_delta

    panels: dict[str, dict[str, list]] = {}
    for cell in report["cells"].values():
        h = cell["horizon"]
        label = f"{h['label']} (beta_L {h['beta_long']}, {h['summary_start']})"
        panels.setdefault(f"b = {cell['page_size']}", {})[label] = cell["fig7_nll"]["buckets"]
    return plot_by_delta(panels, path, "A_t = NLL(compress) - NLL(grow)")


def report_markdown(report: dict[str, Any]) -> str:
    """The study's tables: one row per page size and horizon; then the Fig. 7 buckets."""
    a = report["answer_tokens"]
    lines = [
        f"{report['num_traces']} traces of {report['model']} ({report['traces']}), answers "
        f"{a['min']}-{a['max']} tokens (mean {a['mean']:.0f}); every layer compressed in the "
        "counterfactual. Brackets: 95% cluster bootstrap over traces. Yardstick: rho of the "
        "last page's demand change with the next one's (a predictor that needs no signal).",
        "",
        "| b | horizon | boundaries | rho(Delta_t, demand change) | sign agreement "
        "| yardstick rho | rho(Delta_t, A_t NLL) | rho(Delta_t, mass adv.), own replay |",
        "|---|---|---:|---|---|---:|---|---|",
    ]
    for cell in report["cells"].values():
        f6, f7, own = cell["fig6"], cell["fig7_nll"], cell["own_replay"]["advantage_mass"]
        h = cell["horizon"]
        lines.append(
            f"| {cell['page_size']} | {h['label']} (beta_L {h['beta_long']}, "
            f"{h['summary_start']}) | {f6['num_boundaries']} "
            f"| {_num(f6['spearman'])}{_ci(f6['spearman_ci95'])} "
            f"| {_num(f6['sign_agreement'])}{_ci(f6['sign_agreement_ci95'])} "
            f"| {_num(cell.get('persistence_spearman'))} "
            f"| {_num(f7['spearman'])}{_ci(f7['spearman_ci95'])} "
            f"| {_num(own['spearman'])}{_ci(own['spearman_ci95'])} |"
        )
    lines += [
        "",
        "Growth advantage A_t = NLL(compress) - NLL(grow), nats per token, by Delta_t:",
        "",
    ]
    cells = list(report["cells"].values())
    edges = [(bk["low"], bk["high"]) for bk in cells[0]["fig7_nll"]["buckets"]]
    head = " | ".join(f"[{lo:g}, {hi:g})" for lo, hi in edges)
    lines += [f"| b, horizon | {head} |", "|---|" + "---|" * len(edges)]
    for cell in cells:
        parts = [
            f"{_num(bk['mean'], '.4f')} (n={bk['count']})" for bk in cell["fig7_nll"]["buckets"]
        ]
        lines.append(f"| {cell['page_size']}, {cell['horizon']['label']} | {' | '.join(parts)} |")
    return "\n".join(lines) + "\n"
