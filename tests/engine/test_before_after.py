"""``benchmarks/before_after.py``: a git ref's tree exported, a script run from it and from the
working tree with each tree's own package, and the numbers both report set side by side."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_scripts import load_benchmark

before_after = load_benchmark("before_after")
ROOT = Path(__file__).resolve().parents[2]


def test_numbers_are_the_finite_scalars_under_their_key_paths():
    report = {
        "device": "cpu",
        "step": {"ms_per_step": 5.0, "window": {"busy_ms": 2, "kernels": [1, 2]}},
        "ok": True,
        "nan": float("nan"),
        "none": None,
    }
    assert before_after.numbers(report) == {"step.ms_per_step": 5.0, "step.window.busy_ms": 2.0}


def test_compare_takes_medians_of_the_keys_every_run_holds():
    before = [{"a": {"tokens_per_s": 10.0, "ms_per_step": 4.0}, "x_vs_y": 1.0}] * 2 + [
        {"a": {"tokens_per_s": 40.0, "ms_per_step": 6.0}, "x_vs_y": 1.0}
    ]
    after = [
        {"a": {"tokens_per_s": 15.0, "ms_per_step": 2.0}, "x_vs_y": 0.0},
        {"a": {"tokens_per_s": 25.0}, "x_vs_y": 0.0},  # no ms_per_step: that key is left out
        {"a": {"tokens_per_s": 20.0, "ms_per_step": 2.0}, "x_vs_y": 0.0},
    ]
    rows = before_after.compare(before, after, re.compile(before_after.DEFAULT_KEYS))
    assert rows == [
        {"key": "a.tokens_per_s", "before": 10.0, "after": 20.0, "ratio": 2.0},
        {"key": "x_vs_y", "before": 1.0, "after": 0.0, "ratio": 0.0},
    ]
    zero = before_after.compare([{"ms_per_step": 0}], [{"ms_per_step": 1}], re.compile("ms"))
    assert zero[0]["ratio"] is None
    text = before_after.markdown(
        rows,
        {"script": ["s.py"], "before": "HEAD abc", "after": "def", "repeats": 3, "machine": "m"},
    )
    assert "| a.tokens_per_s | 10 | 20 | 2.000 |" in text and "medians of 3 run(s)" in text


def test_a_run_imports_the_package_of_its_own_tree(tmp_path):
    """The before side gets the exported package even though the checkout's is installed."""
    tree = tmp_path / "tree"
    (tree / "growpage").mkdir(parents=True)
    (tree / "growpage" / "__init__.py").write_text("SIDE = 'before'\n")
    (tree / "benchmarks").mkdir()
    (tree / "benchmarks" / "probe.py").write_text(
        "import json, sys, growpage\n"
        "out = sys.argv[sys.argv.index('--out') + 1]\n"
        "json.dump({'side': growpage.SIDE, 'file': growpage.__file__, 'argv': sys.argv[1:]},"
        " open(out + '.json', 'w'))\n"
    )
    report = before_after.run_side(tree, ["benchmarks/probe.py", "--x", "1"], tmp_path / "b-0")
    assert report["side"] == "before" and report["file"].startswith(str(tree))
    assert report["argv"][:2] == ["--x", "1"]  # its arguments, then --out
    assert (tmp_path / "b-0.log").is_file()
    # growpage.errors exists in the installed checkout but not in this tree: an import error,
    # not the checkout's module slipped in by the editable install's finder.
    (tree / "benchmarks" / "probe.py").write_text("import growpage.errors\n")
    with pytest.raises(SystemExit, match=r"No module named 'growpage\.errors'"):
        before_after.run_side(tree, ["benchmarks/probe.py"], tmp_path / "b-e")
    (tree / "benchmarks" / "probe.py").write_text("raise SystemExit('broken on purpose')\n")
    with pytest.raises(SystemExit, match=r"the b-1 run failed \(exit 1\):\nbroken on purpose"):
        before_after.run_side(tree, ["benchmarks/probe.py"], tmp_path / "b-1")
    (tree / "benchmarks" / "probe.py").write_text("pass\n")
    with pytest.raises(SystemExit, match="wrote no b-2.json: does the script take --out"):
        before_after.run_side(tree, ["benchmarks/probe.py"], tmp_path / "b-2")


def test_bad_trees_refs_scripts_and_keys_are_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit, match="export no-such-ref: "):
        before_after.export_tree("no-such-ref", tmp_path)
    with pytest.raises(SystemExit, match=r"no growpage package there; make one with"):
        before_after.check_tree(tmp_path, "benchmarks/step_profile.py")
    (tmp_path / "growpage").mkdir()
    (tmp_path / "growpage" / "__init__.py").write_text("")
    with pytest.raises(SystemExit, match="--tree has no benchmarks/step_profile.py"):
        before_after.check_tree(tmp_path, "benchmarks/step_profile.py")
    for argv, says in [
        (["run", "--tree", "t"], "name the script after --"),
        (["run", "--tree", "t", "--repeats", "0", "--", "s.py"], "--repeats must be at least 1"),
        (["run", "--tree", "t", "--keys", "(", "--", "s.py"], "is not a regular expression"),
    ]:
        with pytest.raises(SystemExit):
            before_after.parse_args(argv)
        assert says in capsys.readouterr().err


def test_a_head_export_and_the_working_tree_profile_a_step_side_by_side(tmp_path):
    """End to end on the CPU: HEAD exported, ``step_profile.py`` run from it and from the
    checkout, alternately, and its step times compared."""
    tree = before_after.export_tree("HEAD", tmp_path / "trees")
    assert sorted(p.name for p in tree.iterdir()) == sorted(["EXPORTED", *before_after.EXPORTED])
    sha = tree.name
    assert (tree / "EXPORTED").read_text() == f"HEAD {sha}\n"
    out = tmp_path / "cmp"
    script = [
        "benchmarks/step_profile.py",
        "--device", "cpu", "--requests", "2", "--max-tokens", "6", "--page-size", "16",
        "--window", "2", "--kv-pages", "32", "--attention-backend", "torch",
        "--threads", "1",  # two threads contend for a loaded CPU (both trees take the flag)
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "benchmarks/before_after.py", "run", "--tree", str(tree),
         "--out", str(out), "--", *script],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in out.glob("*.json")) == [
        "after-0.json",
        "before-0.json",
        "compare.json",
    ]
    compared = json.loads((out / "compare.json").read_text())
    assert compared["before"] == f"HEAD {sha}" and compared["repeats"] == 1
    keys = {r["key"]: r for r in compared["rows"]}
    assert {"plain.ms_per_step", "plain.decode_tokens_per_s"} <= set(keys)
    assert all(r["before"] > 0 and r["after"] > 0 for r in keys.values())
    assert "| plain.ms_per_step |" in (out / "compare.md").read_text()
