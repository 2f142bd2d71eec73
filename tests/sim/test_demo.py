"""``growpage demo``: bad options are reported before any work (the full demo takes ~15 s)."""

from __future__ import annotations

import pytest

from growpage.cli import main


@pytest.mark.parametrize("argv, message", [
    (["--traces", "0"], "--traces must be >= 1"),
    (["--page-size", "16"], "--page-size must be > 16"),
])
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
