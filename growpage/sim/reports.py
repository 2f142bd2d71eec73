"""Tables on screen and JSON/CSV files for replay, serving and sweep results."""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from growpage.sim.records import ReplayResult

Column = tuple[str, str, str]  # (key, header, format spec, or SIGNIFICANT)
SIGNIFICANT = "sig"  # 3 significant digits, no exponent: 10800, 43.2, 0.0412

REPLAY_COLUMNS: list[Column] = [
    ("policy", "policy", ""),
    ("avg_budget", "avg budget", ".0f"),
    ("mass_mean", "mass mean", ".4f"),
    ("mass_min", "mass min", ".4f"),
    ("output_error", "out err", ".4f"),
    ("grow", "grow", "d"),
    ("compress", "compress", "d"),
    ("shrink", "shrink", "d"),
    ("fallback", "fallback", "d"),
]

SERVING_COLUMNS: list[Column] = [
    ("policy", "policy", ""),
    ("tps", "TPS", ".0f"),
    ("tpot_ms", "TPOT ms", ".1f"),
    ("total_s", "time s", SIGNIFICANT),
    ("avg_resident", "C", ".1f"),
    ("avg_kv_budget", "avg budget", ".0f"),
    ("grow_ratio", "grow %", ".1%"),
    ("grows", "grow", "d"),
    ("compresses", "compress", "d"),
    ("shrinks", "shrink", "d"),
    ("fallbacks", "fallback", "d"),
    ("num_preemptions", "preempt", "d"),
    ("boundary_s", "boundary s", SIGNIFICANT),
]


LATENCIES = (("TTFT (s)", "ttft", "s"), ("TPOT (ms)", "tpot", "ms"), ("E2E (s)", "e2e", "s"))


def latency_table(metrics: dict, percentiles: Sequence[int] = (50, 90, 99)) -> str:
    """TTFT, TPOT and end-to-end latency of one run (``ServingMetrics.as_dict()``): the mean
    and the percentiles, one row per latency, 3 significant digits."""
    columns: list[Column] = [("latency", "latency", ""), ("mean", "mean", SIGNIFICANT)]
    columns += [(f"p{q}", f"p{q}", SIGNIFICANT) for q in percentiles]
    rows = [
        {
            "latency": label,
            "mean": metrics[f"{key}_{unit}"],
            **{f"p{q}": metrics[f"{key}_p{q}_{unit}"] for q in percentiles},
        }
        for label, key, unit in LATENCIES
    ]
    return format_table(rows, columns)


def _significant(value: float, digits: int = 3) -> str:
    if value == 0 or not math.isfinite(value):
        return format(value, "g")
    return f"{value:.{max(0, digits - 1 - math.floor(math.log10(abs(value))))}f}"


def _cell(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if fmt == SIGNIFICANT and isinstance(value, (int, float)):
        return _significant(value)
    if fmt:
        try:
            return format(value, fmt)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


def markdown_table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]]
) -> str:
    """A Markdown table of ``rows``: ``columns`` are ``(key, header, format)``; a column with a
    format is right-aligned, a missing or NaN value is ``-``."""
    lines = [
        "| " + " | ".join(h for _, h, _ in columns) + " |",
        "|" + "|".join("---" if not f else "---:" for _, _, f in columns) + "|",
    ]
    lines += ["| " + " | ".join(_cell(r.get(k), f) for k, _, f in columns) + " |" for r in rows]
    return "\n".join(lines)


def format_table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    """A plain-text table, right-aligned numbers, one row per dict."""
    cells = [[_cell(row.get(key), fmt) for key, _, fmt in columns] for row in rows]
    headers = [header for _, header, _ in columns]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = [
        "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def aggregate_replays(results: Sequence[ReplayResult], label: str | None = None) -> dict:
    """One row for a set of replays of the same policy: means, the worst minimum, event sums."""
    if not results:
        return {"policy": label}
    summaries = [r.summary() for r in results]

    def mean(key: str) -> float | None:
        xs = [s[key] for s in summaries if s[key] is not None]
        return sum(xs) / len(xs) if xs else None

    mins = [s["mass_min"] for s in summaries if s["mass_min"] is not None]
    row: dict[str, Any] = {
        "policy": label or summaries[0]["policy"],
        "traces": len(results),
        "avg_budget": mean("avg_budget"),
        "mass_mean": mean("mass_mean"),
        "mass_min": min(mins) if mins else None,
        "output_error": mean("output_error"),
    }
    for key in ("boundaries", "grow", "compress", "shrink", "fallback"):
        row[key] = sum(s[key] for s in summaries)
    return row


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(obj), indent=1) + "\n")
    return path


def write_csv(path: str | os.PathLike, rows: Sequence[dict]) -> Path:
    """CSV with the union of the rows' keys as columns (first-seen order)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _jsonable(v) for k, v in row.items()})
    return path


def make_output_dir(path: str | Path, flag: str = "--out") -> Path:
    """``path`` created (with its parents) before any work, so that an unusable directory is a
    ``ConfigError`` at once rather than a traceback after a long run."""
    from growpage.errors import ConfigError

    out = Path(path)
    blocker = _not_a_folder([out, *out.parents])
    if blocker is not None:
        raise ConfigError(f"{flag} {out}: {blocker} is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"{flag} {out}: cannot create the output directory ({e.strerror or e})"
        ) from None
    return out


def check_output_file(path: str | Path, flag: str = "--out", example: str = "results.json") -> Path:
    """``path``, a file written after the work, checked before it and creating nothing: a
    ``ConfigError`` when it is a directory (the message suggests ``example`` in it), or when
    the nearest of its folders that exists is not a folder (``/dev/null/x.json``) or cannot
    be written in. The writer makes its missing folders (``make_output_dir(path.parent)``),
    so that a run that fails leaves none."""
    from growpage.errors import ConfigError

    out = Path(path)
    if out.is_dir():
        raise ConfigError(f"{flag} {out}: is a directory; give a file name such as {out / example}")
    blocker = _not_a_folder(list(out.parents))
    if blocker is not None:
        raise ConfigError(f"{flag} {out}: {blocker} is not a folder")
    nearest = next((p for p in out.parents if p.exists()), Path("."))
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {out}: cannot write in {nearest} (permission denied)")
    return out


def _not_a_folder(paths: Sequence[Path]) -> Path | None:
    """The nearest of ``paths`` (a path and its parents, nearest first) that exists, when it is
    not a folder (a file, a device, a link to nothing)."""
    for p in paths:
        if p.is_dir():
            return None
        if p.exists() or p.is_symlink():
            return p
    return None
