"""What every script here shares: its argument parser, the flags most of them take, its end.

    from script_args import ROOT, add_out, add_threads, parser, run_main

    def main(argv=None):
        p = parser(__doc__)        # --help: the docstring (its first line: the question answered)
        add_threads(p, default=1)
        args = p.parse_args(argv)
        ...

    if __name__ == "__main__":
        raise SystemExit(run_main(main))

A mistake the user can fix (the library's own errors, ``GrowPageError``, such as ``--device
cuda`` where torch sees no CUDA device) ends the run as one line, ``<script>: error: ...``, and
exit status 2, as argparse and the ``growpage`` command do; anything else keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from growpage.errors import GrowPageError

ROOT = Path(__file__).resolve().parents[1]  # the checkout


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose ``--help`` shows the script's docstring as written."""
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_threads(p: argparse.ArgumentParser, default: int | None = 1) -> None:
    p.add_argument(
        "--threads",
        type=int,
        default=default,
        help="torch CPU threads (default " + ("torch's" if default is None else str(default)) + ")",
    )


def add_out(p: argparse.ArgumentParser, name: str) -> None:
    """``--out DIR``, by default ``results/<name>`` of the checkout."""
    p.add_argument(
        "--out", type=Path, default=ROOT / "results" / name, help=f"default results/{name}"
    )


def out_stem(out: Path) -> Path:
    """``out`` without a ``.json`` or ``.md`` suffix: the stem a script writes ``<stem>.json``,
    ``<stem>.md`` and its other files beside."""
    return out.with_suffix("") if out.suffix in (".json", ".md") else out


def git_export(ref: str, paths: list[str], into: Path, label: str) -> None:
    """``paths`` of git ref ``ref`` in the checkout, extracted under ``into`` (which must
    exist); a ref git cannot export ends the script naming it (``label``) and git's reason."""
    done = subprocess.run(["git", "-C", str(ROOT), "archive", ref, *paths], capture_output=True)
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip()
        raise SystemExit(f"{label}: git archive cannot export it ({why})")
    subprocess.run(["tar", "-x", "-C", str(into)], input=done.stdout, check=True)


def run_main(main: Callable[[], object]) -> int:
    """``main()``'s exit status (0 when it returns something else); 2 after a one-line error."""
    try:
        status = main()
    except GrowPageError as exc:
        print(f"{os.path.basename(sys.argv[0])}: error: {exc}", file=sys.stderr)
        return 2
    return status if isinstance(status, int) else 0


# Runs a script as ``python SCRIPT ARGS`` would, with the import finders of editable installs
# dropped first: such a finder maps ``growpage.*`` by name to the checkout it was installed from,
# so a module that a tree on PYTHONPATH lacks would silently come from that checkout instead.
_TREE_ONLY = """\
import os, runpy, sys
sys.meta_path[:] = [
    f for f in sys.meta_path if "editable" not in getattr(f, "__name__", type(f).__name__).lower()
]
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def tree_only_command(script: Path | str, args: list[str]) -> list[str]:
    """The command that runs ``script`` with ``args`` on the package of the tree on
    ``PYTHONPATH`` alone: a module the tree lacks fails to import (``ModuleNotFoundError``)
    instead of coming from the checkout of an editable install."""
    return [sys.executable, "-c", _TREE_ONLY, str(script), *args]
