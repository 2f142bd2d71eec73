"""Fitting ``LinearCostModel`` or ``PiecewiseCostModel`` to measured engine step times
(``growpage calibrate``).

Measurements are rows of ``num_seqs, kv_tokens, prefill_tokens, step_s`` (a decode step of
``num_seqs`` sequences reading ``kv_tokens`` KV tokens in total, plus ``prefill_tokens`` prompt
tokens; ``step_s`` seconds), from a CSV file with that header or a JSON list of objects.

``growpage calibrate`` times the local engine's steps for such rows
(``growpage.engine.profiling.profile.measure_step_times(**options) -> list[dict]``, read by
``measured_rows``); ``growpage calibrate --measurements FILE`` fits rows measured elsewhere
(another engine, another machine).
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from growpage.errors import ConfigError
from growpage.sim.costmodel import (
    STEP_COEFFICIENTS,
    FittedT,
    LinearCostModel,
    PiecewiseCostModel,
    check_step_times,
)

COLUMNS = ("num_seqs", "kv_tokens", "prefill_tokens", "step_s")


def _fields_problem(d: Any) -> str:
    """What is wrong with a measurement's fields (not a mapping, or which fields)."""
    if not isinstance(d, dict):
        return f"got {d!r:.80}"
    extra = [k for k in d if k not in COLUMNS]
    lacks = [c for c in COLUMNS if c not in d]
    problems = [f"lacks {', '.join(lacks)}"] if lacks else []
    if None in extra:  # csv.DictReader's key for a row's values past the header's
        extra.remove(None)
        problems.append("more values than the header")
    if extra:
        problems.append(f"has {', '.join(map(repr, extra))}")
    return "; ".join(problems)


def _row(d: Any, where: str) -> list[float]:
    if not isinstance(d, dict) or set(d) != set(COLUMNS):
        raise ConfigError(
            f"{where}: a measurement needs exactly the fields {', '.join(COLUMNS)} "
            f"({_fields_problem(d)})"
        )
    try:
        if any(isinstance(d[c], bool) for c in COLUMNS):
            raise TypeError("a bool is not a measurement")
        row = [float(d[c]) for c in COLUMNS]
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{where}: measurement fields must be numbers, got {d!r:.200}") from None
    if not all(math.isfinite(x) and x >= 0 for x in row):
        raise ConfigError(f"{where}: measurement fields must be finite and >= 0, got {d!r:.200}")
    if row[3] == 0:  # NOTE: a step takes time; 0 is a timer gone wrong or seconds rounded away
        raise ConfigError(f"{where}: step_s must be > 0 (seconds a step took), got {row[3]!r}")
    return row


def load_measurements(path: str | os.PathLike) -> np.ndarray:
    """``[n, 4]`` float64 rows (``COLUMNS``) from a CSV or JSON file."""
    path = Path(path)
    try:
        # NOTE: utf-8-sig drops the byte order mark spreadsheets write before "CSV UTF-8" (it
        # would be read as part of the first field's name); a file without one reads as UTF-8.
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read measurements ({e})") from None
    if path.suffix == ".json":
        try:
            items = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(items, list):
            raise ConfigError(f"{path}: expected a JSON list of measurements")
        where = [f"{path}, measurement {i}" for i in range(len(items))]  # list positions
    else:
        reader = csv.DictReader(text.splitlines())
        items, where = [], []
        for d in reader:
            items.append(d)
            # NOTE: counted from 0 as everywhere (fit_piecewise's errors too), with the line
            # an editor shows: measurement 0 is line 2, under the header.
            where.append(f"{path}, measurement {len(where)} (line {reader.line_num})")
    rows = [_row(d, at) for d, at in zip(items, where, strict=True)]
    if len(rows) < 4:
        raise ConfigError(
            f"{path}: need at least 4 measurements to fit a cost model, got {len(rows)}"
        )
    return np.array(rows)


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``argmin ||a x - b||`` over ``x >= 0`` (Lawson and Hanson's active-set method).

    Columns are scaled to unit norm first (the constraint does not change), as the step-time
    columns differ by orders of magnitude; a zero column gets coefficient 0. The tolerances are
    relative to ``b``'s norm, so scaling ``b`` scales the answer.
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.shape != a.shape[:1]:
        raise ValueError(f"nnls needs a [m, n] matrix and an [m] vector, got {a.shape}, {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("nnls needs finite numbers (the input holds NaN or infinity)")
    peak = np.abs(a).max(axis=0, initial=0.0)
    usable = peak > 0
    unit = a[:, usable] / peak[usable]  # in [-1, 1]: its norm cannot overflow
    norms = peak[usable] * np.linalg.norm(unit, axis=0)
    scaled = unit / np.linalg.norm(unit, axis=0)
    b_peak = float(np.abs(b).max(initial=0.0))
    if b_peak == 0.0 or not usable.any():
        return np.zeros(a.shape[1])
    b_unit = b / b_peak  # solve for b / b_peak, scale back at the end
    n = scaled.shape[1]
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    tol = (
        10 * np.finfo(np.float64).eps * max(scaled.shape) * max(float(np.linalg.norm(b_unit)), 1.0)
    )
    for _ in range(3 * n + 1):
        gradient = scaled.T @ (b_unit - scaled @ x)
        free = ~passive & (gradient > tol)
        if not free.any():
            break
        passive[np.argmax(np.where(free, gradient, -np.inf))] = True
        while True:  # solve on the passive set; step back while it leaves the feasible region
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(scaled[:, passive], b_unit, rcond=None)[0]
            bad = passive & (z <= tol)
            if not bad.any():
                x = z
                break
            alpha = np.min(x[bad] / (x[bad] - z[bad]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    out = np.zeros(a.shape[1])
    # NOTE: divided first, as ``x * b_peak`` overflows for step times near the largest float;
    # a coefficient past it is inf, which the cost model's validators refuse by name.
    with np.errstate(over="ignore"):
        out[usable] = x / norms * b_peak
    return out


def _checked(rows: Any) -> np.ndarray:
    """``rows`` as a ``[n, 4]`` float64 array (n >= 1) of measurements, each checked as a file's
    (``_row``): the fits take arrays from callers other than ``load_measurements``."""
    array = np.asarray(rows, dtype=np.float64)
    if array.ndim != 2 or array.shape[1] != len(COLUMNS) or not len(array):
        raise ConfigError(
            f"measurements must be rows of {', '.join(COLUMNS)}, got an array of "
            f"shape {array.shape}"
        )
    for i, row in enumerate(array.tolist()):
        _row(dict(zip(COLUMNS, row, strict=True)), f"measurement {i}")
    return array


def _design_linear(rows: np.ndarray) -> np.ndarray:
    return np.column_stack([np.ones(len(rows)), rows[:, 0], rows[:, 1], rows[:, 2]])


def fit_linear(rows: np.ndarray, padded_kv: bool = False) -> LinearCostModel:
    """Least-squares fit of ``LinearCostModel`` with non-negative coefficients (``nnls``).

    ``padded_kv``: the measured engine pads decode KV to the longest sequence
    (``CostModel.padded_kv``); the fit is the same (measure uniform contexts), the simulator
    then prices ragged batches by their longest sequence.
    """
    rows = _checked(rows)
    base, per_seq, per_kv, per_prefill = (float(c) for c in nnls(_design_linear(rows), rows[:, 3]))
    return _usable(
        LinearCostModel,
        base_s=base,
        per_seq_s=per_seq,
        per_kv_token_s=per_kv,
        per_prefill_token_s=per_prefill,
        padded_kv=padded_kv,
    )


def _usable(cls: type[FittedT], **fields: Any) -> FittedT:
    """``cls(**fields)`` when it prices steps as ``check_step_times`` asks, else a
    ``ConfigError`` saying that the measurements fit no usable model."""
    try:
        model = cls(**fields)
        check_step_times(model)
    except ConfigError as e:
        raise ConfigError(f"the measurements fit no usable model: {e}") from None
    return model


def _design_piecewise(rows: np.ndarray) -> tuple[list[int], np.ndarray]:
    """The batch sizes measured and the design matrix: one indicator column per batch size,
    then kv_tokens and prefill_tokens."""
    for i, n in enumerate(rows[:, 0]):
        if float(n) != int(n):
            raise ConfigError(
                f"measurement {i}: a piecewise cost model needs a whole number of "
                f"sequences (num_seqs), got {float(n):g}"
            )
    sizes = sorted({int(n) for n in rows[:, 0]})
    indicators = rows[:, 0][:, None] == np.array(sizes, dtype=np.float64)[None, :]
    return sizes, np.column_stack([indicators.astype(np.float64), rows[:, 1], rows[:, 2]])


def fit_piecewise(rows: np.ndarray, padded_kv: bool = False) -> PiecewiseCostModel:
    """Least-squares fit of ``PiecewiseCostModel``: one fixed cost per batch size measured
    (``num_seqs`` 0 for prefill-only steps) and a shared cost per KV token and per prompt
    token, all non-negative (``nnls``); ``padded_kv`` as ``fit_linear``'s."""
    rows = _checked(rows)
    sizes, x = _design_piecewise(rows)
    coef = nnls(x, rows[:, 3])
    return _usable(
        PiecewiseCostModel,
        batch_sizes=tuple(sizes),
        batch_s=tuple(float(c) for c in coef[: len(sizes)]),
        per_kv_token_s=float(coef[-2]),
        per_prefill_token_s=float(coef[-1]),
        padded_kv=padded_kv,
    )


#: ``growpage calibrate --kind``: the fitting function of each fitted cost model.
FITS: dict[str, Callable[..., LinearCostModel | PiecewiseCostModel]] = {
    "linear": fit_linear,
    "piecewise": fit_piecewise,
}


def fit_warnings(rows: np.ndarray, kind: str = "linear") -> list[str]:
    """What ``rows`` cannot determine for a ``kind`` model (``FITS``).

    Linear: a column with one value throughout (its coefficient is then fitted as 0, or cannot
    be told apart from ``base_s``), or columns that depend linearly on each other. Piecewise:
    the per-token costs, which only differences within one batch size determine.
    """
    if kind not in FITS:
        raise ConfigError(
            f"unknown cost model kind {kind!r} (expected {' or '.join(map(repr, FITS))})"
        )
    rows = _checked(rows)
    if kind == "piecewise":
        return _piecewise_warnings(rows)
    warnings, varied = [], []
    for i, (column, coef) in enumerate(zip(COLUMNS[:3], STEP_COEFFICIENTS[1:], strict=True)):
        value = float(rows[0, i])
        if (rows[:, i] == value).all():
            what = (
                "is fitted as 0 (free in the simulator)"
                if value == 0
                else "cannot be told apart from base_s (only their sum is fitted)"
            )
            warnings.append(
                f"{column} is {value:g} in every measurement, so {coef} {what}; "
                f"measure steps with other {column}"
            )
        else:
            varied.append(i)
    # NOTE: the dependency check leaves out the constant columns (warned of above), not the
    # whole check: decode steps at one context each (kv_tokens proportional to num_seqs) with
    # prefill_tokens 0 throughout cannot split per_seq_s from per_kv_token_s either.
    x = _design_linear(rows)[:, [0, *(i + 1 for i in varied)]]
    if np.linalg.matrix_rank(x / np.abs(x).max(axis=0)) < x.shape[1]:
        warnings.append(
            f"{', '.join(COLUMNS[i] for i in varied)} depend linearly on each other "
            "in these measurements, so their coefficients are not fitted "
            "separately; vary them independently"
        )
    return warnings


def _piecewise_warnings(rows: np.ndarray) -> list[str]:
    sizes, x = _design_piecewise(rows)
    warnings = []
    for col, column, coef in (
        (1, "kv_tokens", "per_kv_token_s"),
        (2, "prefill_tokens", "per_prefill_token_s"),
    ):
        if (rows[:, col] == 0).all():
            warnings.append(
                f"{column} is 0 in every measurement, so {coef} is fitted as 0 "
                f"(free in the simulator); measure steps with other {column}"
            )
        elif all(len(set(rows[rows[:, 0] == n, col])) == 1 for n in sizes):
            warnings.append(
                f"{column} never changes within one num_seqs, so {coef} is not "
                "fitted (a piecewise model gives each num_seqs its own fixed cost); "
                f"measure each num_seqs at two or more {column}"
            )
    if (
        not warnings
        and np.linalg.matrix_rank(x / np.maximum(np.abs(x).max(axis=0), 1e-300)) < x.shape[1]
    ):
        warnings.append(
            f"these {len(rows)} measurements do not determine every coefficient "
            f"({len(sizes)} fixed costs, one per num_seqs, and the costs per KV "
            "token and per prefill token): vary kv_tokens and prefill_tokens "
            "independently within the batch sizes"
        )
    return warnings


def measured_rows(items: list[Any], source: str) -> np.ndarray:
    """``[n, 4]`` float64 rows (``COLUMNS``) of measurements that ``source`` gave as dicts."""
    return np.array([_row(d, f"{source} row {i}") for i, d in enumerate(items)])
