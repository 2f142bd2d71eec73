"""What the three ``growpage bench`` commands share: latency summaries, tables and ``--out``."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from growpage.core.traces import atomic_write
from growpage.sim.reports import (
    SIGNIFICANT,
    Column,
    check_output_file,
    format_table,
    make_output_dir,
)

#: A latency of a summary: (key, unit, label, scale from seconds).
Latency = tuple[str, str, str, float]


def latency_fields(
    name: str, values: Sequence[float], unit: str, percentiles: Sequence[float], scale: float = 1.0
) -> dict[str, float]:
    """``{name}_mean_{unit}`` and ``{name}_p{q}_{unit}`` of ``values`` (seconds, times
    ``scale``); 0 without values."""
    xs = np.asarray(values, dtype=np.float64) * scale
    qs = np.percentile(xs, percentiles) if len(xs) else [0.0] * len(percentiles)
    out = {f"{name}_mean_{unit}": float(xs.mean()) if len(xs) else 0.0}
    out.update({f"{name}_p{q:g}_{unit}": float(v) for q, v in zip(percentiles, qs, strict=True)})
    return out


def latency_table(
    summary: dict[str, Any], latencies: Sequence[Latency], percentiles: Sequence[float]
) -> str:
    """One row per latency of ``summary`` (``latency_fields`` keys): its mean and
    percentiles."""
    columns: list[Column] = [("latency", "latency", ""), ("mean", "mean", SIGNIFICANT)]
    columns += [(f"p{q:g}", f"p{q:g}", SIGNIFICANT) for q in percentiles]
    rows = [
        {
            "latency": label,
            "mean": summary[f"{key}_mean_{unit}"],
            **{f"p{q:g}": summary[f"{key}_p{q:g}_{unit}"] for q in percentiles},
        }
        for key, unit, label, _ in latencies
    ]
    return format_table(rows, columns)


def lines(rows: Sequence[tuple[str, str]]) -> str:
    """``name  value`` lines, the values aligned."""
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def out_path(text: str | None) -> Path | None:
    """``--out FILE``, checked before the benchmark runs (its folder is made when it is
    written)."""
    return None if text is None else check_output_file(text)


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The command's options, as JSON values."""
    return {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if k not in ("func", "command", "bench_command") and not callable(v)
    }


def write_result(path: Path, args: argparse.Namespace, payload: dict[str, Any]) -> None:
    """``payload`` with the date and the command's settings, as JSON at ``path``
    (atomically)."""
    record = {"date": time.strftime("%Y-%m-%d %H:%M"), "settings": settings(args), **payload}
    text = json.dumps(record, indent=1, default=str) + "\n"
    make_output_dir(path.parent)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    print(f"results in {path}")
