"""Fitting ``LinearCostModel`` to measured engine step times (``growpage calibrate``).

Measurements are rows of ``num_seqs, kv_tokens, prefill_tokens, step_s`` (a decode step of
``num_seqs`` sequences reading ``kv_tokens`` KV tokens in total, plus ``prefill_tokens`` prompt
tokens; ``step_s`` seconds), from a CSV file with that header or a JSON list of objects.

``measure_engine`` asks the engine for such rows. It needs
``growpage.engine.profile.measure_step_times(**options) -> list[dict]``; until the engine offers
it, it raises ``EngineError`` and ``growpage calibrate --measurements FILE`` is the way.
"""

from __future__ import annotations

import csv
import importlib
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from growpage.errors import ConfigError, EngineError
from growpage.sim.costmodel import STEP_COEFFICIENTS, LinearCostModel

COLUMNS = ("num_seqs", "kv_tokens", "prefill_tokens", "step_s")
ENGINE_PROFILER = "growpage.engine.profile"


def _row(d: Any, where: str) -> list[float]:
    if not isinstance(d, dict) or set(d) != set(COLUMNS):
        raise ConfigError(f"{where}: a measurement needs exactly the fields {', '.join(COLUMNS)}")
    try:
        row = [float(d[c]) for c in COLUMNS]
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: measurement fields must be numbers, got {d!r}") from None
    if not all(math.isfinite(x) and x >= 0 for x in row):
        raise ConfigError(f"{where}: measurement fields must be finite and >= 0, got {d!r}")
    return row


def load_measurements(path: str | os.PathLike) -> np.ndarray:
    """``[n, 4]`` float64 rows (``COLUMNS``) from a CSV or JSON file."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read measurements ({e})") from None
    if path.suffix == ".json":
        try:
            items = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(items, list):
            raise ConfigError(f"{path}: expected a JSON list of measurements")
    else:
        items = list(csv.DictReader(text.splitlines()))
    rows = [_row(d, f"{path}, measurement {i}") for i, d in enumerate(items)]
    if len(rows) < 4:
        raise ConfigError(f"{path}: need at least 4 measurements to fit 4 coefficients, "
                          f"got {len(rows)}")
    return np.array(rows)


def fit_linear(rows: np.ndarray) -> LinearCostModel:
    """Least-squares fit of ``LinearCostModel`` with non-negative coefficients.

    A coefficient the unconstrained fit makes negative is fixed at 0 and the rest refitted.
    """
    x = np.column_stack([np.ones(len(rows)), rows[:, 0], rows[:, 1], rows[:, 2]])
    y = rows[:, 3]
    active = [True] * 4
    coef = np.zeros(4)
    while any(active):
        cols = [i for i in range(4) if active[i]]
        sol, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        coef[:] = 0
        coef[cols] = sol
        if (sol >= 0).all():
            break
        active[cols[int(np.argmin(sol))]] = False
    base, per_seq, per_kv, per_prefill = (float(c) for c in coef)
    return LinearCostModel(base_s=base, per_seq_s=per_seq, per_kv_token_s=per_kv,
                           per_prefill_token_s=per_prefill)


def fit_warnings(rows: np.ndarray) -> list[str]:
    """What ``rows`` cannot determine: a column with one value throughout (its coefficient is
    then fitted as 0, or cannot be told apart from ``base_s``), or columns that depend linearly
    on each other."""
    warnings = []
    for i, (column, coef) in enumerate(zip(COLUMNS[:3], STEP_COEFFICIENTS[1:], strict=True)):
        value = float(rows[0, i])
        if (rows[:, i] == value).all():
            what = ("is fitted as 0 (free in the simulator)" if value == 0 else
                    "cannot be told apart from base_s (only their sum is fitted)")
            warnings.append(f"{column} is {value:g} in every measurement, so {coef} {what}; "
                            f"measure steps with other {column}")
    if not warnings:
        x = np.column_stack([np.ones(len(rows)), rows[:, :3]])
        if np.linalg.matrix_rank(x / np.abs(x).max(axis=0)) < x.shape[1]:
            warnings.append(f"{', '.join(COLUMNS[:3])} depend linearly on each other in these "
                            "measurements, so their coefficients are not fitted separately; "
                            "vary them independently")
    return warnings


def measure_engine(**options: Any) -> np.ndarray:
    """Step-time measurements of the local engine (see the module docstring)."""
    try:
        profiler = importlib.import_module(ENGINE_PROFILER)
    except ModuleNotFoundError as e:
        if e.name not in (ENGINE_PROFILER, "growpage.engine"):
            raise
        raise EngineError(f"the engine cannot be measured yet: {ENGINE_PROFILER}."
                          "measure_step_times is missing; pass --measurements FILE with columns "
                          f"{', '.join(COLUMNS)}") from None
    items = profiler.measure_step_times(**options)
    return np.array([_row(d, f"{ENGINE_PROFILER} row {i}") for i, d in enumerate(items)])
