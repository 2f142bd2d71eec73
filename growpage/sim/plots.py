"""Matplotlib plots (Agg backend, files only): capacity trajectories and Pareto fronts."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first


def plot_capacity(trajectories: Mapping[str, Sequence[tuple[float, int]]], path: str | os.PathLike,
                  page_size: int, xlabel: str = "position (tokens)",
                  title: str = "KV capacity",
                  shaded: Sequence[tuple[float, float]] = (), shaded_label: str = "") -> Path:
    """Step plot of capacity (pages * page_size tokens) against position or time, one line each.

    ``shaded`` spans of x (e.g. diffuse-attention regimes) are drawn in the background.
    """
    fig, ax = plt.subplots(figsize=(7, 4))
    if len(trajectories) > 10:   # the default cycle repeats after 10 colours
        ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)
    for i, (lo, hi) in enumerate(shaded):
        ax.axvspan(lo, hi, color="0.9", label=shaded_label if i == 0 and shaded_label else None)
    for label, points in trajectories.items():
        if not points:
            continue
        xs = [x for x, _ in points]
        ys = [pages * page_size for _, pages in points]
        ax.step(xs, ys, where="post", label=label, linewidth=1.2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("capacity (tokens)")
    ax.set_title(title)
    if len(trajectories) <= 12:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_pareto(points: Sequence[Mapping], path: str | os.PathLike, x: str, y: str,
                xlabel: str, ylabel: str, title: str) -> Path:
    """Scatter of ``points[i][x]`` against ``points[i][y]``, labelled by ``points[i]["label"]``.

    Points sharing a ``"group"`` (e.g. fixed budgets) are joined in order of ``x``.
    """
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    groups: dict[str, list[Mapping]] = {}
    for p in points:
        if p.get(x) is None or p.get(y) is None:
            continue
        groups.setdefault(str(p.get("group", p["label"])), []).append(p)
    for name, members in groups.items():
        members = sorted(members, key=lambda p: p[x])
        style = "o-" if len(members) > 1 else "o"
        line = ax.plot([p[x] for p in members], [p[y] for p in members], style, label=name)[0]
        for p in members:
            ax.annotate(p["label"], (p[x], p[y]), textcoords="offset points", xytext=(4, 4),
                        fontsize=7, color=line.get_color())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_signal_scatter(pairs: Sequence[tuple[float, float]], path: str | os.PathLike,
                        title: str) -> Path:
    """Scatter of Delta_t against the future demand change at each boundary (paper Fig. 6)."""
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    if pairs:
        ax.scatter([p[0] for p in pairs], [p[1] for p in pairs], s=8, alpha=0.5)
    ax.axhline(0, color="grey", lw=0.8)
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_xlabel("Delta_t (short minus long working-set ratio)")
    ax.set_ylabel("future demand change (next page)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _save(fig: plt.Figure, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
