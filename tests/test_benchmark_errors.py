"""A GPU-only benchmark run on a machine without CUDA ends in one line and exit status 2; the
files of ``benchmarks/`` that are no scripts say so when run; every script says in its first
line the question it answers, and takes its parser from ``script_args``."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
import torch
from benchmark_scripts import BENCHMARKS


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine whose torch sees no GPU")
@pytest.mark.parametrize(
    "script, args",
    [
        ("policies_engine", ["--preset", "full", "--device", "cuda"]),  # the library's ConfigError
        ("gpu_check", []),
    ],
)
def test_gpu_run_without_cuda_says_so_in_one_line(script, args, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{script}.py"), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"{script}.py: error: ") and "sees no CUDA device" in line
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("name, says", [("gpu_bench", "run python benchmarks/gpu_check.py")])
def test_a_module_that_is_no_script_says_what_to_run(name, says, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0 and proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"{name}.py: ") and says in line


#: Modules of benchmarks/ that are no scripts: the shared arguments, gpu_check's measurements.
NOT_SCRIPTS = {"script_args", "gpu_bench"}


@pytest.mark.parametrize(
    "path",
    sorted(p for p in BENCHMARKS.glob("*.py") if p.stem not in NOT_SCRIPTS),
    ids=lambda p: p.name,
)
def test_a_script_asks_its_question_first_and_parses_with_script_args(path):
    tree = ast.parse(path.read_text())
    first = (ast.get_docstring(tree) or "").split("\n")[0]
    assert first.endswith("?"), f"{path.name}: {first!r}"
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "script_args"
        for alias in node.names
    }
    assert {"parser", "run_main"} <= imported, path.name
    calls = {
        n.func.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    }
    assert "ArgumentParser" not in calls, path.name  # one parser, script_args's
