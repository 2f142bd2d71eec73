"""The layer contracts of docs/architecture.md (``[tool.importlinter]`` in pyproject.toml) hold,
and a new import that breaks one fails the check, naming the contract and the import."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
LAYERS = "layers: faces > executors > sim | engine > policies | kernels > core > ground"
FACES = "faces inside the worlds: imported by none of their modules"


def lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the package under ``cwd`` (found first on its path), with the
    checkout's contracts."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(ROOT / "pyproject.toml")],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_package_keeps_its_layer_contracts():
    proc = lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{LAYERS} KEPT" in proc.stdout and f"{FACES} KEPT" in proc.stdout


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory) -> Path:
    """A copy of growpage/ (kernels/ through its link) to add forbidden imports to."""
    root = tmp_path_factory.mktemp("copy")
    shutil.copytree(ROOT / "growpage", root / "growpage", ignore=shutil.ignore_patterns("*.pyc"))
    return root


@pytest.mark.parametrize(
    "path, source, contract, chain",
    [
        (  # the import the controller had: under TYPE_CHECKING it counts all the same
            "core/leak.py",
            "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
            "    from growpage.policies.base import CapacityPolicy\n",
            LAYERS,
            "growpage.core.leak -> growpage.policies.base",
        ),
        (  # inside a function, as calibrate measured the engine from the simulator
            "sim/leak.py",
            "def measure():\n    from growpage.engine.profiling.profile import measure_step_times\n",
            LAYERS,
            "growpage.sim.leak -> growpage.engine.profiling.profile",
        ),
        (
            "engine/leak.py",
            "def draw():\n    from growpage.plots import plot_pool\n    from growpage.sim import "
            "reports\n",
            LAYERS,
            "growpage.engine.leak -> growpage.sim.reports",
        ),
        (
            "policies/leak.py",
            "import growpage.sim.replay\n",
            LAYERS,
            "growpage.policies.leak -> growpage.sim.replay",
        ),
        (  # the simulator standing on the executors, as its command line did
            "sim/leak.py",
            "from growpage.executors.grids import replay_point\n",
            LAYERS,
            "growpage.sim.leak -> growpage.executors.grids",
        ),
        (
            "engine/loop/leak.py",
            "from growpage.engine.cli_flags import add_engine_flags\n",
            FACES,
            "growpage.engine.loop.leak -> growpage.engine.cli_flags",
        ),
        ("unplaced.py", "import growpage.errors\n", LAYERS, "growpage.unplaced"),
    ],
)
def test_a_forbidden_import_fails_the_check(package_copy, path, source, contract, chain):
    leak = package_copy / "growpage" / path
    leak.write_text(source)
    try:
        proc = lint_imports(package_copy)
    finally:
        leak.unlink()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert f"{contract} BROKEN" in out and chain in out
    assert "Contracts: 1 kept, 1 broken." in out  # the other contract still holds
