"""A GPU-only benchmark run on a machine without CUDA ends in one line and exit status 2; the
files of ``benchmarks/`` that are no scripts say so when run."""

from __future__ import annotations

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
