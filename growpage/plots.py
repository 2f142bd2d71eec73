"""Matplotlib plots (Agg backend, files only): capacity trajectories, the KV pool over time and
Pareto fronts."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
from matplotlib.transforms import Bbox  # noqa: E402
from matplotlib.typing import ColorType  # noqa: E402

# NOTE: what a label crossing a line, or nearer to another point than to its own, costs in
# place_labels, in pixels of overlap: less than covering another label's text, more than nothing.
LINE_CROSSING = 20.0


def plot_capacity(
    trajectories: Mapping[str, Sequence[tuple[float, int]]],
    path: str | os.PathLike,
    page_size: int,
    xlabel: str = "position (tokens)",
    title: str = "KV capacity",
    shaded: Sequence[tuple[float, float]] = (),
    shaded_label: str = "",
) -> Path:
    """Step plot of capacity (pages * page_size tokens) against position or time, one line each.

    ``shaded`` spans of x (e.g. diffuse-attention regimes) are drawn in the background.
    """
    fig, ax = plt.subplots(figsize=(7, 4))
    if len(trajectories) > 10:  # the default cycle repeats after 10 colours
        ax.set_prop_cycle(color=matplotlib.color_sequences["tab20"])
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


def plot_pool(
    timelines: Mapping[str, Sequence[tuple[float, int, int]]],
    path: str | os.PathLike,
    num_pages: int,
    max_num_seqs: int,
    title: str = "KV pool",
) -> Path:
    """Pages in use (against the pool's size) and resident requests over time, one line per
    run: two step plots sharing the time axis, from ``ServingResult.pool_timeline()``."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    most = 0
    for label, timeline in timelines.items():
        times = [t for t, _, _ in timeline]
        (line,) = top.step(
            times, [u for _, u, _ in timeline], where="post", linewidth=1.2, label=label
        )
        residents = [n for _, _, n in timeline]
        bottom.step(
            times, residents, where="post", linewidth=1.2, color=line.get_color(), label=label
        )
        most = max(most, *residents)
    top.axhline(num_pages, color="0.4", linestyle="--", linewidth=1, label=f"pool ({num_pages})")
    if max_num_seqs <= 2 * most:  # the cap, when it is in view
        bottom.axhline(
            max_num_seqs,
            color="0.4",
            linestyle="--",
            linewidth=1,
            label=f"max_num_seqs ({max_num_seqs})",
        )
    top.set_ylabel("KV pages in use")
    top.set_title(title)
    bottom.set_ylabel("resident requests")
    bottom.set_xlabel("time (s)")
    for ax in (top, bottom):
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # pages and requests are counts
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    return _save(fig, path)


def plot_pareto(
    points: Sequence[Mapping],
    path: str | os.PathLike,
    x: str,
    y: str,
    xlabel: str,
    ylabel: str,
    title: str,
) -> Path:
    """Scatter of ``points[i][x]`` against ``points[i][y]``, labelled by ``points[i]["label"]``.

    Points sharing a ``"group"`` (e.g. fixed budgets) are joined in order of ``x``.
    """
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    groups: dict[str, list[Mapping]] = {}
    labels: list[tuple[str, float, float, ColorType]] = []
    for p in points:
        if p.get(x) is None or p.get(y) is None:
            continue
        groups.setdefault(str(p.get("group", p["label"])), []).append(p)
    for name, members in groups.items():
        members = sorted(members, key=lambda p: p[x])
        style = "o-" if len(members) > 1 else "o"
        line = ax.plot([p[x] for p in members], [p[y] for p in members], style, label=name)[0]
        labels += [(p["label"], p[x], p[y], line.get_color()) for p in members]
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()  # the axes' final size, which the label placement measures
    place_labels(ax, labels)
    return _save(fig, path)


def place_labels(ax: Axes, labels: Sequence[tuple[str, float, float, ColorType]]) -> None:
    """Annotate each ``(text, x, y, colour)`` beside its point, inside the axes and clear of the
    other labels, the points, the legend and the lines: at the first free corner of the point
    (one no other point is nearer to), else at the nearest free height above or below it, with
    a leader line, else where it costs least (``_spot_cost``). Greedy, in order of x; measured
    in pixels, so call it once the layout is final."""
    if not labels:
        return
    # get_renderer is the Agg canvas's (this module's backend), not FigureCanvasBase's.
    renderer = ax.figure.canvas.get_renderer()  # type: ignore[attr-defined]  # Agg's method
    centres = [tuple(c) for c in ax.transData.transform([(x, y) for _, x, y, _ in labels])]
    taken = [Bbox.from_extents(cx - 4, cy - 4, cx + 4, cy + 4) for cx, cy in centres]
    legend = ax.get_legend()
    if legend is not None:
        taken.append(legend.get_window_extent(renderer))
    paths = [line.get_transform().transform_path(line.get_path()) for line in ax.get_lines()]
    scene = (ax.get_window_extent(renderer), taken, centres, [p for p in paths if len(p) > 1])
    for (text, x, y, colour), centre in sorted(
        zip(labels, centres, strict=True), key=lambda t: t[1]
    ):
        probe = ax.annotate(text, (x, y), textcoords="offset points", xytext=(0, 0), fontsize=7)
        best: tuple[float, tuple[float, float, str, str], Bbox] | None = None
        for dx, dy, ha, va in _label_spots():
            probe.set(position=(dx, dy), ha=ha, va=va)
            box = probe.get_window_extent(renderer)
            cost = _spot_cost(box, centre, abs(dy) > 4, *scene)
            if best is None or cost < best[0]:
                best = (cost, (dx, dy, ha, va), box)
            if cost == 0:
                break
        probe.remove()
        assert best is not None
        _, (dx, dy, ha, va), box = best
        leader = dict(arrowstyle="-", color=colour, lw=0.5, shrinkA=0, shrinkB=3)
        ax.annotate(
            text,
            (x, y),
            textcoords="offset points",
            xytext=(dx, dy),
            ha=ha,
            va=va,
            fontsize=7,
            color=colour,
            arrowprops=leader if abs(dy) > 4 else None,
        )
        taken.append(box)


def _spot_cost(
    box: Bbox,
    centre: tuple[float, float],
    has_leader: bool,
    frame: Bbox,
    taken: Sequence[Bbox],
    centres: Sequence[tuple[float, float]],
    paths: Sequence,
) -> float:
    """Pixels of ``box`` outside the axes (x10) or over what is ``taken``, plus ``LINE_CROSSING``
    per line it crosses and once more when, without a leader, another point is nearer to it."""
    cost = (
        _outside(box, frame)
        + sum(_overlap(box, t) for t in taken)
        + LINE_CROSSING * sum(p.intersects_bbox(box, filled=False) for p in paths)
    )
    if not has_leader and min(_distance(box, c) for c in centres) < _distance(box, centre):
        cost += LINE_CROSSING
    return cost


def _label_spots() -> Iterator[tuple[float, float, str, str]]:
    """Label offsets (points) and alignments to try: the four corners, then further up or
    down in 6-point steps, right of the point before left of it."""
    for dy, va in ((4, "bottom"), (-4, "top")):
        yield 4, dy, "left", va
        yield -4, dy, "right", va
    for step in range(1, 13):
        for dy, va in ((4 + 6 * step, "bottom"), (-4 - 6 * step, "top")):
            yield 4, dy, "left", va
            yield -4, dy, "right", va


def _overlap(a: Bbox, b: Bbox) -> float:
    """Area (pixels) that ``a`` and ``b`` share, with a pixel of room between them."""
    w = min(a.x1, b.x1) - max(a.x0, b.x0) + 1
    h = min(a.y1, b.y1) - max(a.y0, b.y0) + 1
    return w * h if w > 0 and h > 0 else 0.0


def _distance(box: Bbox, point: tuple[float, float]) -> float:
    """Pixels from ``point`` to the nearest edge of ``box`` (0 inside it)."""
    dx = max(box.x0 - point[0], 0.0, point[0] - box.x1)
    dy = max(box.y0 - point[1], 0.0, point[1] - box.y1)
    return (dx * dx + dy * dy) ** 0.5


def _outside(box: Bbox, frame: Bbox) -> float:
    """Area (pixels) of ``box`` outside ``frame``, weighted to lose against any overlap."""
    inside = max(0.0, min(box.x1, frame.x1) - max(box.x0, frame.x0)) * max(
        0.0, min(box.y1, frame.y1) - max(box.y0, frame.y0)
    )
    return 10 * (box.width * box.height - inside)


def plot_signal_scatter(
    pairs: Sequence[tuple[float, float]], path: str | os.PathLike, title: str
) -> Path:
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


def _save(fig: Figure, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
