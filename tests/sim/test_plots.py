"""Plots: every line of a capacity plot can be told apart; Pareto labels can be read."""

from __future__ import annotations

import itertools

import matplotlib.pyplot as plt
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text

from growpage import plots


def test_capacity_plot_gives_twelve_requests_twelve_colours(tmp_path, monkeypatch):
    colours = []
    save = plots._save

    def keep_colours(fig, path):
        colours.extend(line.get_color() for line in fig.axes[0].get_lines())
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", keep_colours)
    trajectories = {f"req-{i}": [(0.0, 1), (float(i + 1), 2)] for i in range(12)}
    path = plots.plot_capacity(trajectories, tmp_path / "c.png", 16, xlabel="time (s)")
    assert path.stat().st_size > 0
    assert len(colours) == 12 and len(set(colours)) == 12
    plt.close("all")


# The mixed sweep of docs/results.md: two fixed budgets at nearly one point, growpage beside
# inverse, the longest label at the right edge; and five points in a cluster.
MIXED_SWEEP = [
    ("growpage", "growpage", 2517, 0.685),
    ("fullkv", "fullkv", 1084, 1.0),
    ("random grow_prob=0.3", "random", 3472, 0.454),
    ("inverse", "inverse", 2702, 0.700),
    ("shrink", "shrink", 2936, 0.624),
    *(
        (f"fixed budget_tokens={b}", "fixed", tps, mass)
        for b, tps, mass in (
            (1024, 7276, 0.596),
            (2048, 4404, 0.850),
            (4096, 2639, 0.998),
            (8192, 1999, 1.0),
        )
    ),
]
CLUSTER = [(f"policy-{i}", f"policy-{i}", 1000 + 10 * i, 0.5 + 0.002 * i) for i in range(5)]


@pytest.mark.parametrize(
    "rows", [MIXED_SWEEP, CLUSTER + [("far right", "x", 3000, 0.9)]], ids=["mixed-sweep", "cluster"]
)
def test_pareto_labels_neither_overlap_nor_leave_the_figure(rows, tmp_path, monkeypatch):
    figures = []
    save = plots._save

    def keep_figure(fig, path):
        figures.append(fig)
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", keep_figure)
    points = [
        {"label": label, "group": group, "tps": tps, "mass": mass}
        for label, group, tps, mass in rows
    ]
    plots.plot_pareto(points, tmp_path / "p.png", "tps", "mass", "throughput", "mass", "pareto")
    [fig] = figures
    canvas = FigureCanvasAgg(fig)  # the figure as saved (and closed), drawn again
    canvas.draw()
    renderer = canvas.get_renderer()
    ax = fig.axes[0]
    assert sorted(t.get_text() for t in ax.texts) == sorted(p["label"] for p in points)
    boxes = {t.get_text(): Text.get_window_extent(t, renderer) for t in ax.texts}  # no leader
    legend = ax.get_legend().get_window_extent(renderer)
    for (a, box_a), (b, box_b) in itertools.combinations(boxes.items(), 2):
        assert not box_a.overlaps(box_b), f"{a!r} overlaps {b!r}"
    for label, box in boxes.items():
        assert not box.overlaps(legend), f"{label!r} overlaps the legend"
        assert (
            fig.bbox.x0 <= box.x0
            and box.x1 <= fig.bbox.x1
            and fig.bbox.y0 <= box.y0
            and box.y1 <= fig.bbox.y1
        ), f"{label!r} leaves the figure"
    plt.close("all")
