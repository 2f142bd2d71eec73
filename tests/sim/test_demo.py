"""``growpage demo``: bad options are reported before any work (the full demo takes ~15 s)."""

from __future__ import annotations

import pytest

from growpage.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--traces", "0"], "--traces must be an integer >= 1, got 0"),
        (["--page-size", "16"], "--page-size must be > 16"),
    ],
)
def test_bad_demo_options_are_reported(capsys, tmp_path, argv, message):
    assert main(["demo", *argv, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_unusable_demo_out_fails_before_the_work(capsys, tmp_path, monkeypatch):
    import growpage.demo as demo

    def no_work(*args, **kwargs):
        raise AssertionError("the demo started before --out was checked")

    monkeypatch.setattr(demo, "replay_table", no_work)
    (tmp_path / "file").write_text("x")
    assert main(["demo", "--out", str(tmp_path / "file" / "out")]) == 2
    assert "--out" in capsys.readouterr().err


def test_demo_help_gives_every_default(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    options = " ".join(capsys.readouterr().out.split()).split("options:")[1]
    helps = {part.split()[0]: part for part in options.split(" --")[1:]}  # the help wraps
    for option, default in (
        ("traces", 3),
        ("gen-len", 3072),
        ("page-size", 64),
        ("seed", 0),
        ("out", "results/demo"),
    ):
        assert helps[option].endswith(f"(default {default})"), helps[option]


def test_a_short_demo_writes_its_plots_and_numbers(capsys, tmp_path):
    import json

    out = tmp_path / "out"
    assert main(["demo", "--traces", "1", "--gen-len", "512", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in ("pareto.png", "capacity.png", "pool.png", "demo.json"):
        assert (out / name).stat().st_size > 0 and str(out / name) in printed
    numbers = json.loads((out / "demo.json").read_text())
    assert [r["policy"] for r in numbers["serving"]] == [
        "growpage",
        "fixed-1024",
        "fixed-2048",
        "fullkv",
    ]
