"""Latency percentiles, computed alike by the simulator's and the engine's metrics."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)  # latency percentiles reported (numpy's linear interpolation)


def percentile_fields(
    latencies: Mapping[str, Sequence[float]], units: Mapping[str, str]
) -> dict[str, float]:
    """``{name}_p{q}_{unit}`` for every latency ``name`` (over the requests that have it) and
    every q of ``PERCENTILES``; 0 where there are no values."""
    out = {}
    for name, xs in latencies.items():
        qs = (
            np.percentile(np.asarray(xs, dtype=np.float64), PERCENTILES)
            if len(xs)
            else [0.0] * len(PERCENTILES)
        )
        out.update(
            {f"{name}_p{q}_{units[name]}": float(v) for q, v in zip(PERCENTILES, qs, strict=True)}
        )
    return out
