"""Is a benchmark faster after a change than before it, measured in one go on one machine?

One benchmark script runs from the tree of a git ref (before) and from the working tree
(after), alternately, and the numbers both report are set side by side. On a GPU machine that
is one device call, so before and after share the machine, its clocks and its load:

    python benchmarks/before_after.py export HEAD      # here, where git is: .before/<sha>/
    python benchmarks/before_after.py run --tree .before/<sha> -- \\
        benchmarks/gpu_check.py --sections step,paper --skip-tests
    # a device call: the same `run` command, with .before in the call's carry (git-ignored)

``export REF`` writes the ``growpage/``, ``kernels/`` and ``benchmarks/`` folders of REF to
``.before/<short sha>/`` (replacing an earlier export of it). ``run`` runs the script after
``--`` (a path inside the checkout, with its arguments) ``--repeats`` times from each tree,
before first in even repeats and after first in odd ones; each run from its own tree's copy of
the script, with that tree's package first on ``PYTHONPATH``, and its own ``--out`` under
``--out`` (default ``results/before_after``): ``before-0.json``, ``after-0.json``... It then
writes ``compare.md`` and ``compare.json`` there: every number that all the runs' reports hold
under the same key path and whose path matches ``--keys`` (a regular expression; by default
throughput, ms per step, busy time and boundary shares), the median before and after, and
after / before.

The script must take ``--out STEM`` and write ``STEM.json`` (``gpu_check.py``,
``step_profile.py`` do). A run that fails ends the comparison, naming the side and the last
lines of its output.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

from script_args import ROOT, git_export, parser, run_main, tree_only_command

EXPORTED = ("growpage", "kernels", "benchmarks")
DEFAULT_KEYS = r"tokens_per_s|ms_per_step|busy|boundary_pct|boundary_critical_pct|_vs_"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    verbs = p.add_subparsers(dest="verb", required=True)
    export = verbs.add_parser("export", help="a git ref's tree into .before/<sha>")
    export.add_argument("ref")
    export.add_argument("--into", type=Path, default=ROOT / ".before", help="default .before/")
    run = verbs.add_parser("run", help="a script from both trees, alternately, then compared")
    run.add_argument("--tree", type=Path, required=True, help="an export (.before/<sha>)")
    run.add_argument("--repeats", type=int, default=1, help="runs from each tree")
    run.add_argument("--out", type=Path, default=ROOT / "results" / "before_after")
    run.add_argument("--keys", default=DEFAULT_KEYS, help="regular expression on key paths")
    run.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    args = p.parse_args(argv)
    if args.verb == "run":
        args.script = args.script[1:] if args.script[:1] == ["--"] else args.script
        if not args.script:
            p.error("run: name the script after --, e.g. -- benchmarks/step_profile.py")
        if args.repeats < 1:
            p.error(f"--repeats must be at least 1, got {args.repeats}")
        try:
            args.pattern = re.compile(args.keys)
        except re.error as exc:
            p.error(f"--keys {args.keys!r} is not a regular expression: {exc}")
    return args


def export_tree(ref: str, into: Path) -> Path:
    """``EXPORTED`` folders of ``ref`` in ``into/<short sha>`` (an earlier export of it
    replaced); the ref and its commit in its ``EXPORTED`` file."""
    sha = _git("rev-parse", "--short", f"{ref}^{{commit}}", what=f"export {ref}")
    tree = into / sha
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    try:
        git_export(sha, list(EXPORTED), tree, f"export {ref}")
    except SystemExit:
        shutil.rmtree(tree)
        raise
    (tree / "EXPORTED").write_text(f"{ref} {sha}\n")
    return tree


def _git(*args: str, what: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{what}: {done.stderr.strip() or 'git failed'}")
    return done.stdout.strip()


def check_tree(tree: Path, script: str) -> None:
    """Refuse a tree that is no export, or lacks the script, naming what is missing."""
    if not (tree / "growpage" / "__init__.py").is_file():
        raise SystemExit(
            f"--tree {tree}: no growpage package there; make one with "
            "`python benchmarks/before_after.py export REF`"
        )
    for root, side in ((tree, "--tree"), (ROOT, "the working tree")):
        if not (root / script).is_file():
            raise SystemExit(f"{side} has no {script} (give the script's path in the checkout)")


def run_side(root: Path, script: list[str], out: Path) -> dict[str, Any]:
    """The script from ``root`` on ``root``'s package alone (``tree_only_command``: a module
    the tree lacks fails, it does not come from the checkout), run in the checkout, so relative
    paths among its arguments mean the same on both sides; its report."""
    env = dict(os.environ, PYTHONPATH=str(root))
    cmd = tree_only_command(root / script[0], [*script[1:], "--out", str(out)])
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    (out.parent / f"{out.name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise SystemExit(f"the {out.name} run failed (exit {done.returncode}):\n{tail}")
    report = out.with_suffix(".json")
    if not report.is_file():
        raise SystemExit(f"the {out.name} run wrote no {report.name}: does the script take --out?")
    return json.loads(report.read_text())


def numbers(report: Any, prefix: str = "") -> dict[str, float]:
    """Every finite number of a JSON report under its key path (``a.b.c``); lists and
    booleans are left out."""
    if isinstance(report, dict):
        found: dict[str, float] = {}
        for key, value in report.items():
            found.update(numbers(value, f"{prefix}{key}."))
        return found
    if isinstance(report, (int, float)) and not isinstance(report, bool):
        return {prefix[:-1]: float(report)} if math.isfinite(report) else {}
    return {}


def compare(
    before: list[dict[str, Any]], after: list[dict[str, Any]], pattern: re.Pattern[str]
) -> list[dict[str, Any]]:
    """Rows of the numbers every run reports under a key matching ``pattern``: medians
    before and after, and after / before (None where before is 0)."""
    runs = [numbers(r) for r in before + after]
    keys = [k for k in runs[0] if pattern.search(k) and all(k in r for r in runs[1:])]
    rows = []
    for key in keys:
        b = statistics.median(r[key] for r in runs[: len(before)])
        a = statistics.median(r[key] for r in runs[len(before) :])
        rows.append({"key": key, "before": b, "after": a, "ratio": a / b if b else None})
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"`{' '.join(meta['script'])}`: before = {meta['before']}, after = the working tree "
        f"({meta['after']}); medians of {meta['repeats']} run(s) each, alternating, on "
        f"{meta['machine']}.",
        "",
        "| key | before | after | after / before |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"| {r['key']} | {r['before']:.4g} | {r['after']:.4g} | {ratio} |")
    if not rows:
        lines.append("| (no number matched --keys in every report) | | | |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    tree, args.out = args.tree.resolve(), args.out.resolve()
    check_tree(tree, args.script[0])
    args.out.mkdir(parents=True, exist_ok=True)
    reports: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    sides = [("before", tree), ("after", ROOT)]
    for rep in range(args.repeats):
        for name, root in sides if rep % 2 == 0 else sides[::-1]:
            print(f"[before_after] {name} run {rep + 1} of {args.repeats}", flush=True)
            reports[name].append(run_side(root, args.script, args.out / f"{name}-{rep}"))
    exported = tree / "EXPORTED"
    meta = {
        "script": args.script,
        "before": exported.read_text().strip() if exported.is_file() else str(tree),
        "after": _after_commit(),
        "repeats": args.repeats,
        "machine": _machine(),
    }
    rows = compare(reports["before"], reports["after"], args.pattern)
    (args.out / "compare.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    text = markdown(rows, meta)
    (args.out / "compare.md").write_text(text)
    print(text)
    return {**meta, "rows": rows}


def _after_commit() -> str:
    done = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty=+changes"],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip() if done.returncode == 0 else "no git here"


def _machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    return f"the CPU ({os.cpu_count()} cores)"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.verb == "export":
        tree = export_tree(args.ref, args.into)
        print(f"[before_after] {args.ref} exported to {tree}")
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
