"""The project's Triton kernels import only as ``growpage.kernels``: a top-level ``kernels``
never resolves into this checkout, where it would shadow the PyPI package of that name, which
transformers depends on (DESIGN.md, layout)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _in_checkout(path: str | None) -> bool:
    """Whether ``path`` lies in the checkout's kernels/ (a .venv inside the checkout does not
    count)."""
    return path is not None and Path(path).resolve().is_relative_to(ROOT / "kernels")


def _python(code: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *flags, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_test_environment_never_has_the_checkout_root_on_its_path() -> None:
    assert not [p for p in sys.path if Path(p or os.curdir).resolve() == ROOT], sys.path
    spec = importlib.util.find_spec("kernels")
    assert spec is None or not _in_checkout(spec.origin), spec


def test_import_kernels_finds_the_pypi_package_or_nothing() -> None:
    try:
        import kernels
    except ModuleNotFoundError:
        return
    assert not _in_checkout(kernels.__file__), kernels.__file__


def test_growpage_kernels_is_the_checkout_s_kernels_folder() -> None:
    import growpage.kernels

    assert growpage.kernels.__file__ is not None
    assert Path(growpage.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"


def test_python_started_in_the_root_still_gets_the_pypi_kernels() -> None:
    """``python -c`` (or a notebook) in the root has the root first on ``sys.path``: the
    checkout's kernels/ then hands ``import kernels`` on to the rest of the path."""
    code = (
        "import sys, kernels, growpage.kernels as g;"
        "print(kernels.__file__); print(g.__file__); print(sys.path[0] == '')"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr
    found, ours, cwd_first = done.stdout.split()
    assert cwd_first == "True"  # the case this test is about
    assert not _in_checkout(found), found
    assert _in_checkout(ours), ours


def test_with_only_the_root_on_the_path_import_kernels_fails_and_says_why() -> None:
    code = (
        f"import sys; sys.path[:] = [{str(ROOT)!r}] + [p for p in sys.path if 'python3' in p"
        " and 'site-packages' not in p]\n"
        "try:\n    import kernels\nexcept ModuleNotFoundError as exc:\n"
        "    print(exc.name, 'kernels' in sys.modules, exc)\n"
        "else:\n    print('imported', kernels.__file__)\n"
    )
    done = _python(code, "-I")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("kernels False "), done.stdout
    assert "growpage.kernels" in done.stdout
