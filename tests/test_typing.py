"""Typing: growpage and its kernels are mypy-clean, growpage ships a working ``py.typed`` marker,
and a policy author's annotated code passes mypy's strict checks while the usual mistakes do not.

One mypy run checks the package, the kernels (``kernels/``, checked as ``growpage.kernels``
through the ``growpage/kernels`` symlink, the only name they import under) and the
samples in ``typing_samples/`` together (the samples get every per-module flag of ``--strict``
from pyproject.toml), so torch and the other dependencies are analysed once: some 30 s of CPU on a clean checkout (no ``.mypy_cache``), a few seconds
with the cache of an earlier run. A second, short run reuses that cache to import growpage as
an installed package, as its users do.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["growpage"]  # pyproject.toml's [tool.mypy] files
SAMPLES = Path(__file__).resolve().parent / "typing_samples"
AUTHOR = SAMPLES / "policy_author.py"
MISTAKES = SAMPLES / "policy_mistakes.py"
PYPROJECT = ROOT / "pyproject.toml"
CACHE = ROOT / ".mypy_cache"  # mypy's default, so that `python -m mypy` shares it
TIMEOUT_S = 900
ERROR = re.compile(r"^(?P<path>.+?):(?P<line>\d+): error: .*\[(?P<code>[a-z-]+)\]$", re.M)
EXPECTED = re.compile(r"# error: (?P<code>[a-z-]+)\s*$")


def _mypy(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    try:
        done = subprocess.run(
            [sys.executable, "-m", "mypy", *args],
            cwd=cwd,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mypy ran over {TIMEOUT_S} s: {exc.output}")
    return done.stdout


def _checked(output: str, num_files: int | None = None) -> bool:
    """Whether mypy got as far as its summary line (not a crash or a bad option)."""
    files = r"\d+" if num_files is None else str(num_files)
    return (
        re.search(
            rf"^(Success: no issues found in {files} source files?|Found \d+ errors? in "
            rf"\d+ files? \(checked {files} source files?\))$",
            output,
            re.M,
        )
        is not None
    )


def _errors(output: str, cwd: Path = ROOT) -> dict[Path, set[tuple[int, str]]]:
    found: dict[Path, set[tuple[int, str]]] = {}
    for m in ERROR.finditer(output):
        found.setdefault((cwd / m["path"]).resolve(), set()).add((int(m["line"]), m["code"]))
    return found


@pytest.fixture(scope="module")
def checked() -> str:
    """mypy's output on the package, the kernels and the samples, with the project's
    configuration."""
    return _mypy([*PACKAGES, str(AUTHOR.relative_to(ROOT)), str(MISTAKES.relative_to(ROOT))], ROOT)


def test_the_package_is_mypy_clean(checked: str) -> None:
    assert _checked(checked), f"mypy did not run:\n{checked}"
    errors = {path: found for path, found in _errors(checked).items() if path != MISTAKES}
    assert errors == {}, f"mypy:\n{checked}"


def test_the_kernels_are_checked_as_growpage_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m mypy`` checks what this module checks, and that includes every module of
    kernels/, as ``growpage.kernels``: never as a top-level ``kernels``, the name of the PyPI
    package transformers depends on."""
    from mypy.find_sources import create_source_list
    from mypy.main import process_options

    monkeypatch.chdir(ROOT)  # the configuration's paths and excludes are relative to it
    monkeypatch.setenv("MYPY_CONFIG_FILE_DIR", "")  # mypy sets it; restored after the test
    _, options = process_options(["--config-file", str(PYPROJECT)], require_targets=False)
    assert options.files == PACKAGES
    modules = {source.module for source in create_source_list(PACKAGES, options)}
    kernels = {
        "growpage.kernels" if path.stem == "__init__" else f"growpage.kernels.{path.stem}"
        for path in (ROOT / "kernels").glob("*.py")
    }
    assert len(kernels) >= 10 and kernels <= modules, sorted(kernels - modules)
    assert not [m for m in modules if m.split(".")[0] == "kernels"]


def test_a_typed_policy_passes_the_strict_checks(checked: str) -> None:
    assert _checked(checked), f"mypy did not run:\n{checked}"
    assert AUTHOR not in _errors(checked), f"mypy:\n{checked}"


def test_policy_mistakes_are_refused(checked: str) -> None:
    expected = {
        (i, m["code"])
        for i, line in enumerate(MISTAKES.read_text().splitlines(), 1)
        if (m := EXPECTED.search(line))
    }
    assert len(expected) >= 3
    assert _errors(checked).get(MISTAKES) == expected, f"mypy:\n{checked}"


def test_the_samples_get_every_flag_of_strict(monkeypatch: pytest.MonkeyPatch) -> None:
    from mypy.main import process_options

    monkeypatch.setenv("MYPY_CONFIG_FILE_DIR", "")  # mypy sets it; restored after the test
    _, default = process_options(["--config-file", ""], require_targets=False)
    _, strict = process_options(["--config-file", "", "--strict"], require_targets=False)
    _, project = process_options(["--config-file", str(PYPROJECT)], require_targets=False)
    names = [n for n in dir(strict) if not n.startswith("_") and not callable(getattr(strict, n))]
    flags = {n: getattr(strict, n) for n in names if getattr(strict, n) != getattr(default, n)}
    assert "disallow_untyped_defs" in flags
    for module in (AUTHOR.stem, MISTAKES.stem):
        options = project.clone_for_module(module)
        assert {n: getattr(options, n) for n in flags} == flags, module


def test_every_function_of_the_package_must_be_annotated(monkeypatch: pytest.MonkeyPatch) -> None:
    """``disallow_untyped_defs`` and ``disallow_incomplete_defs`` hold for every module of
    growpage that mypy checks but the kernels, whose @triton.jit bodies go unannotated."""
    from mypy.main import process_options

    monkeypatch.setenv("MYPY_CONFIG_FILE_DIR", "")  # mypy sets it; restored after the test
    _, project = process_options(["--config-file", str(PYPROJECT)], require_targets=False)
    package = ROOT / "growpage"
    modules = [
        ".".join(("growpage", *path.relative_to(package).with_suffix("").parts)).removesuffix(
            ".__init__"
        )
        for path in sorted(package.rglob("*.py"))
        if path.relative_to(package).parts[0] != "kernels"
    ]
    assert "growpage" in modules and "growpage.engine.llm" in modules
    for module in modules:
        options = project.clone_for_module(module)
        assert options.disallow_untyped_defs and options.disallow_incomplete_defs, module


def test_growpage_imports_as_a_typed_package(checked: str, tmp_path: Path) -> None:
    """From outside the checkout, with growpage on the Python path (a folder holding only a link
    to it, as the Makefile makes; never the checkout's root): mypy reads growpage as an
    installed package, which it analyses only with a py.typed marker."""
    assert (ROOT / "growpage" / "py.typed").is_file()
    (tmp_path / "path").mkdir()
    (tmp_path / "path" / "growpage").symlink_to(ROOT / "growpage")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(tmp_path / "path"), env.get("PYTHONPATH")])
    )
    output = _mypy(
        ["--config-file", str(PYPROJECT), "--cache-dir", str(CACHE), str(AUTHOR)], tmp_path, env
    )
    assert _checked(output, 1) and "Success" in output, f"mypy:\n{output}"


def test_a_policy_author_runs_mypy_strict_in_their_own_directory(
    checked: str, tmp_path: Path
) -> None:
    """What the policy guide promises, as its reader does it: ``mypy --strict`` on their own
    files, in their own directory, with the environment ``make install`` built (no PYTHONPATH,
    no project configuration). The editable install's import hook is invisible to mypy; the
    checkout's .pth (Makefile) is what lets it find growpage."""
    assert _checked(checked), f"mypy did not run:\n{checked}"
    for sample in (AUTHOR, MISTAKES):
        (tmp_path / sample.name).write_text(sample.read_text())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
    output = _mypy(
        ["--strict", "--cache-dir", str(CACHE), AUTHOR.name, MISTAKES.name], tmp_path, env
    )
    assert "Cannot find implementation or library stub" not in output, (
        f"mypy cannot find growpage from outside the checkout (run `make install`):\n{output}"
    )
    assert _checked(output, 2), f"mypy:\n{output}"
    errors = _errors(output, tmp_path)
    assert tmp_path / AUTHOR.name not in errors, f"mypy:\n{output}"
    expected = {
        (i, m["code"])
        for i, line in enumerate(MISTAKES.read_text().splitlines(), 1)
        if (m := EXPECTED.search(line))
    }
    assert errors.get(tmp_path / MISTAKES.name) == expected, f"mypy:\n{output}"


def test_the_py_typed_marker_is_installed() -> None:
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]
    assert "py.typed" in setuptools["package-data"]["growpage"]
