"""Plots: every line of a capacity plot can be told apart."""

from __future__ import annotations

import matplotlib.pyplot as plt

from growpage.sim import plots


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
