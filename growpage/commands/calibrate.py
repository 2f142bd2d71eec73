"""``growpage calibrate``: a step-time model (``growpage.sim.calibrate``) fitted to measurements
of a file or of the local engine (``growpage.engine.profiling.profile``).

Glue that needs both worlds, so it lives here, above them (docs/architecture.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from growpage.commands.sim import warning
from growpage.errors import ConfigError
from growpage.sim.calibrate import FITS, fit_warnings, load_measurements, measured_rows
from growpage.sim.costmodel import with_boundary_costs
from growpage.sim.reports import check_output_file, make_output_dir

ENGINE_PROFILER = "growpage.engine.profiling.profile"


def measure_engine(**options: Any) -> np.ndarray:
    """Step-time measurements of the local engine (``measure_step_times(**options)``), as
    ``[n, 4]`` rows of ``growpage.sim.calibrate.COLUMNS``."""
    from growpage.engine.profiling.profile import measure_step_times

    return measured_rows(measure_step_times(**options), ENGINE_PROFILER)


def engine_pads_kv() -> bool:
    """Whether the local engine's decode steps, as ``measure_engine`` times them, pad every
    sequence's KV to the longest."""
    from growpage.engine.profiling.profile import decode_pads_kv

    return decode_pads_kv()


def _model_path(text: str) -> Path:
    """``calibrate --out FILE``, checked before measuring (its folder is made when it is
    written)."""
    return check_output_file(text, example="costmodel.json")


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one existing file (through links and ``..`` too)."""
    try:
        return a.samefile(b)
    except OSError:  # one is missing: writing ``a`` cannot clobber ``b``
        return False


def run_calibrate(args: argparse.Namespace) -> int:
    out = _model_path(args.out)
    if args.measurements and _same_file(out, Path(args.measurements)):
        raise ConfigError(
            f"--out {args.out}: is the measurements file {args.measurements}; "
            "give another name for the model"
        )
    engine_only = [
        flag
        for flag, value in (
            ("--boundary-policy", args.boundary_policy),
            ("--batch-sizes", args.batch_sizes),
            ("--contexts", args.contexts),
        )
        if value is not None
    ]
    if args.measurements and engine_only:
        hint = (
            " (serve and sweep take --boundary-ms / --compaction-ms and their --*-step-ms for prices"
            " measured elsewhere)"
            if args.boundary_policy is not None
            else ""
        )
        raise ConfigError(
            f"{', '.join(engine_only)} set how the local engine is measured, "
            f"which --measurements does not run; drop one of them{hint}"
        )
    if args.measurements:
        rows = load_measurements(args.measurements)
    else:
        shapes = {
            "batch_sizes": args.batch_sizes
            or (tuple(range(1, 17)) if args.kind == "piecewise" else (1, 4, 16))
        }
        if args.contexts:
            shapes["contexts"] = args.contexts
        rows = measure_engine(**shapes)
    padded = args.padded_kv
    if padded is None:  # as the measured engine's attention does (--measurements: summed)
        padded = False if args.measurements else engine_pads_kv()
    try:
        model = FITS[args.kind](rows, padded_kv=padded)
    except ConfigError as e:  # a measurement the kind cannot use: say which file holds it
        raise ConfigError(f"{args.measurements}, {e}" if args.measurements else str(e)) from None
    for text in fit_warnings(rows, args.kind):
        warning(text)
    if not args.measurements and args.boundaries:  # capacity control on the same engine
        from growpage.engine.profiling.profile import measure_boundary_costs

        costs = measure_boundary_costs(policy=args.boundary_policy or "growpage")
        model = with_boundary_costs(
            model,
            costs["boundary_s"],
            costs["compaction_s"],
            costs.get("boundary_step_s"),
            costs.get("compaction_step_s"),
        )
        print(
            f"capacity control: {costs['decided']} decisions, {costs['compactions']} "
            "compactions measured"
        )
    predicted = model.step_time(rows[:, 0], rows[:, 1], rows[:, 2])
    rms = float(((predicted - rows[:, 3]) ** 2).mean() ** 0.5)
    make_output_dir(out.parent)
    try:
        path = model.save(out)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write the cost model ({e.strerror or e})") from None
    print(f"fitted on {len(rows)} measurements (rms error {rms * 1e3:.3f} ms):")
    for key, value in attrs.asdict(model).items():
        if key == "padded_kv":
            print(f"  {key:20s} {str(value).lower()}")
        elif key != "name":
            shown = (
                ", ".join(f"{v:.6g}" for v in value)
                if isinstance(value, (list, tuple))
                else f"{value:.6g}"
            )
            print(f"  {key:20s} {shown}")
    print(f"wrote {path}")
    return 0
